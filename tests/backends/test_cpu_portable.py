"""The mat-vec kernels the main suite does not run here. It runs the best this host has
(AVX-512 VNNI, AVX2, or the portable LLVM vector IR), so this reruns the quantized-kernel
tests in child processes: with SHARPI_CPU_KERNELS=portable compiled, through numba's
target settings, for a baseline x86-64 (SSE2, no F16C: scales stay f32 there), and with
the AVX2 kernels on a Haswell target where the host has more than AVX2."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from backends.cpu.vnni import AUTO_KERNELS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
X86 = platform.machine().lower() in ("x86_64", "amd64")
TARGETS = {
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma,+f16c,+popcnt,+bmi2,-avx512f"},
    "sse2": {"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": "+sse2,-avx,-avx2,-avx512f,-f16c"},
}


# The portable IR compiled for baseline x86-64 covers it on any target (and the f32 scales
# such targets need); the AVX2 kernels run on a Haswell target where the host has more.
CASES = [("portable", "sse2"), ("auto", "avx2")]


@pytest.mark.parametrize("kernels,target", CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_other_kernels_match_gguf_dequantize(kernels, target, tmp_path):
    if not X86:
        pytest.skip("x86 targets")
    expect = kernels if kernels == "portable" else "avx2"
    if expect == AUTO_KERNELS or AUTO_KERNELS == "portable":
        pytest.skip(f"the whole suite already runs the {AUTO_KERNELS} kernels here")
    env = dict(os.environ, SHARPI_CPU_KERNELS=kernels, NUMBA_CACHE_DIR=str(tmp_path), **TARGETS[target])
    check = ("from backends.cpu import quant_kernels as K; from backends.cpu.vnni import F16_SCALES; "
             "print(K.KERNELS, F16_SCALES)")
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.split() == [expect, "False" if target == "sse2" else "True"], \
        r.stdout + r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.join(HERE, "test_cpu_quant.py")], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
