"""The portable (plain numba) mat-vec kernels, which machines without AVX-512 VNNI run.

On a VNNI host the main suite exercises only the VNNI kernels, so this reruns the
quantized-kernel tests in a child process with SHARPI_CPU_KERNELS=portable."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backends.cpu.vnni import HOST_VNNI

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(not HOST_VNNI, reason="no AVX-512 VNNI here: the whole suite already runs the portable kernels")
def test_portable_kernels_match_gguf_dequantize():
    env = dict(os.environ, SHARPI_CPU_KERNELS="portable")
    check = "from backends.cpu import quant_kernels as K; assert not K.HAVE_VNNI; print('portable')"
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(HERE)))
    assert r.returncode == 0 and "portable" in r.stdout, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.join(HERE, "test_cpu_quant.py")], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(HERE)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
