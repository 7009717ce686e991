"""The portable mat-vec kernels (plain LLVM vector IR), which CPUs without AVX-512
VNNI run. On a VNNI host the main suite exercises only the VNNI kernels, so this
reruns the quantized-kernel tests in child processes with SHARPI_CPU_KERNELS=portable,
compiled for this host and, through numba's target settings, for an AVX2 CPU
(Haswell) and a baseline x86-64 (SSE2, no F16C: scales stay f32 there)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from backends.cpu.vnni import HOST_VNNI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
X86 = platform.machine().lower() in ("x86_64", "amd64")
TARGETS = {
    "host": {},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma,+f16c,+popcnt,+bmi2,-avx512f"},
    "sse2": {"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": "+sse2,-avx,-avx2,-avx512f,-f16c"},
}


@pytest.mark.skipif(not HOST_VNNI, reason="no AVX-512 VNNI here: the whole suite already runs the portable kernels")
@pytest.mark.parametrize("target", list(TARGETS))
def test_portable_kernels_match_gguf_dequantize(target, tmp_path):
    if target != "host" and not X86:
        pytest.skip("x86 targets")
    env = dict(os.environ, SHARPI_CPU_KERNELS="portable", NUMBA_CACHE_DIR=str(tmp_path), **TARGETS[target])
    check = ("from backends.cpu import quant_kernels as K; from backends.cpu.vnni import F16_SCALES; "
             "assert not K.HAVE_VNNI; print('portable', F16_SCALES)")
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "portable" in r.stdout, r.stderr[-2000:]
    assert r.stdout.split()[-1] == ("False" if target == "sse2" else "True")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.join(HERE, "test_cpu_quant.py")], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
