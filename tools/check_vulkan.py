#!/usr/bin/env python3
"""Smoke test for Kompute (`kp`) + Vulkan.

Compiles a tiny GLSL compute shader with `glslangValidator -V` (doubles every
element), uploads a float32 numpy array with kp, dispatches the shader and
checks the result. Prefers the lavapipe (llvmpipe) CPU device when present.

Exit 0 and print the device name on success; one line on stderr and exit 1
on failure.

    python tools/check_vulkan.py [--device N]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

SHADER = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer Data { float v[]; };
layout(push_constant) uniform P { float n; } pc;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < uint(pc.n)) v[i] = v[i] * 2.0;
}
"""


def fail(msg: str) -> None:
    print(f"check_vulkan: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def compile_spirv(src: str) -> bytes:
    exe = shutil.which("glslangValidator")
    if exe is None:
        fail("glslangValidator not found on PATH (apt-get install glslang-tools)")
    with tempfile.TemporaryDirectory() as d:
        comp, spv = os.path.join(d, "double.comp"), os.path.join(d, "double.spv")
        with open(comp, "w") as f:
            f.write(src)
        r = subprocess.run([exe, "-V", comp, "-o", spv], capture_output=True, text=True)
        if r.returncode != 0:
            fail("glslangValidator: " + " ".join((r.stdout + r.stderr).split()))
        with open(spv, "rb") as f:
            return f.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=None,
                    help="Vulkan device index (default: lavapipe if present, else 0)")
    args = ap.parse_args()

    try:
        import numpy as np
    except Exception as e:  # pragma: no cover
        fail(f"cannot import numpy: {e}")
    if int(np.__version__.split(".")[0]) >= 2:
        fail(f"numpy {np.__version__} installed; kp needs numpy < 2")
    try:
        import kp
    except Exception as e:
        fail(f"cannot import kp: {e}")

    spirv = compile_spirv(SHADER)

    try:
        mgr = kp.Manager() if args.device is None else kp.Manager(args.device)
        if args.device is None:
            names = [str(d.get("device_name", "")) for d in mgr.list_devices()]
            lvp = [i for i, n in enumerate(names) if "llvmpipe" in n.lower()]
            if lvp and lvp[0] != 0:
                mgr.destroy()
                mgr = kp.Manager(lvp[0])
        name = str(mgr.get_device_properties().get("device_name", "?"))

        n = 1000
        x = np.arange(n, dtype=np.float32) - 17.25
        t = mgr.tensor(x)
        algo = mgr.algorithm([t], spirv, ((n + 63) // 64, 1, 1), [], [float(n)])
        (mgr.sequence()
            .record(kp.OpTensorSyncDevice([t]))
            .record(kp.OpAlgoDispatch(algo))
            .record(kp.OpTensorSyncLocal([t]))
            .eval())
        y = np.array(t.data(), dtype=np.float32, copy=True)
        mgr.destroy()
    except Exception as e:
        fail(f"kp/Vulkan error: {type(e).__name__}: {e}")

    if y.shape != x.shape or not np.array_equal(y, 2 * x):
        bad = int(np.flatnonzero(y != 2 * x)[0]) if y.shape == x.shape else -1
        fail(f"wrong result on {name}: first mismatch at {bad}")
    try:
        from importlib.metadata import version
        kpv = version("kp")
    except Exception:
        kpv = "?"
    print(f"check_vulkan: OK on {name} (kp {kpv}, numpy {np.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
