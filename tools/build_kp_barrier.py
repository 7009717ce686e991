#!/usr/bin/env python3
"""Build backends/vulkan/_kp_barrier*.so: OpGlobalBarrier for kp 0.9 sequences.

    .venv/bin/python tools/build_kp_barrier.py          # `make setup` runs this
    python tools/build_kp_barrier.py --out FILE --pybind11 INCLUDE_DIR

Compiles backends/vulkan/native/kp_barrier.cpp with the system C++ compiler,
pybind11 headers (pybind11-dev, the same ones kp was built with, so the two
modules share pybind11's type registry; --pybind11: other headers, for a kp built
against them) and the Vulkan loader, for the running interpreter, into
backends/vulkan/ (--out: another file, named _kp_barrier + this Python's extension
suffix), then imports the result in a child process to check that kp accepts it.
Idempotent: does nothing when the module is newer than its source and imports.
Exit 1 with one line if it cannot be built; the Vulkan backend then submits each
dispatch on its own. (tools/gpu_check.py prepare builds one for CPython 3.12.)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "backends", "vulkan", "native", "kp_barrier.cpp")
OUT = os.path.join(ROOT, "backends", "vulkan", "_kp_barrier" + sysconfig.get_config_var("EXT_SUFFIX"))
CHECK = ("import sys; sys.path.insert(0, sys.argv[1]); import kp; from _kp_barrier import OpGlobalBarrier; "
         "mgr = kp.Manager(); seq = mgr.sequence(); seq.record(OpGlobalBarrier()); seq.eval(); print('ok')")


def works(out: str) -> bool:
    r = subprocess.run([sys.executable, "-c", CHECK, os.path.dirname(out)], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip().endswith("ok")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT, help="the module file (default: in backends/vulkan/)")
    ap.add_argument("--pybind11", metavar="INCLUDE_DIR", help="pybind11's headers (default: the system's)")
    a = ap.parse_args(argv)
    out = a.out
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(SRC) and works(out):
        print(f"kp barrier: up to date ({os.path.relpath(out, ROOT)})")
        return 0
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        print("kp barrier: no C++ compiler (install g++)", file=sys.stderr)
        return 1
    tmp = out + ".tmp"
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden",
           *([f"-I{a.pybind11}"] if a.pybind11 else []),
           f"-I{sysconfig.get_paths()['include']}", SRC, "-lvulkan", "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[-300:])
        print(f"kp barrier: compile failed: {first}", file=sys.stderr)
        return 1
    os.replace(tmp, out)
    if not works(out):
        os.remove(out)
        print("kp barrier: built, but kp does not accept it (kp built against another pybind11?)", file=sys.stderr)
        return 1
    print(f"kp barrier: built {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
