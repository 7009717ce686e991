#!/usr/bin/env python3
"""Build backends/vulkan/_kp_barrier*.so: OpGlobalBarrier for kp 0.9 sequences.

    .venv/bin/python tools/build_kp_barrier.py          # `make setup` runs this

Compiles backends/vulkan/native/kp_barrier.cpp with the system C++ compiler,
pybind11 headers (pybind11-dev, the same ones kp was built with, so the two
modules share pybind11's type registry) and the Vulkan loader, then imports the
result in a child process to check that kp accepts it. Idempotent: does nothing
when the module is newer than its source and imports. Exit 1 with one line if
it cannot be built; the Vulkan backend then submits each dispatch on its own.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "backends", "vulkan", "native", "kp_barrier.cpp")
OUT = os.path.join(ROOT, "backends", "vulkan", "_kp_barrier" + sysconfig.get_config_var("EXT_SUFFIX"))
CHECK = ("import kp; from backends.vulkan._kp_barrier import OpGlobalBarrier; "
         "mgr = kp.Manager(); seq = mgr.sequence(); seq.record(OpGlobalBarrier()); seq.eval(); print('ok')")


def works() -> bool:
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip().endswith("ok")


def main() -> int:
    if os.path.exists(OUT) and os.path.getmtime(OUT) >= os.path.getmtime(SRC) and works():
        print(f"kp barrier: up to date ({os.path.relpath(OUT, ROOT)})")
        return 0
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        print("kp barrier: no C++ compiler (install g++)", file=sys.stderr)
        return 1
    tmp = OUT + ".tmp"
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden",
           f"-I{sysconfig.get_paths()['include']}", SRC, "-lvulkan", "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[-300:])
        print(f"kp barrier: compile failed: {first}", file=sys.stderr)
        return 1
    os.replace(tmp, OUT)
    if not works():
        os.remove(OUT)
        print("kp barrier: built, but kp does not accept it (kp built against another pybind11?)", file=sys.stderr)
        return 1
    print(f"kp barrier: built {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
