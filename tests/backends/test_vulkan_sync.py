"""Vulkan synchronization between dependent dispatches, checked by the Khronos
synchronization validation layer on lavapipe with device-local buffers (what a GPU
gets): prefill, SnapKV compaction, a cache branch and decode record no hazard with
the global barrier (and with one submission per dispatch), also with quantized KV
pages (tq4 keys / tq3 values: the rotations before and after attention, rows that
share words), the validator does flag the race when the barrier is left out, and the
results match the CPU backend. The child turns the layer on itself (VK_INSTANCE_LAYERS,
settings in tests/fixtures/vk_layer_settings.txt): kp is built without its debug layers,
and the child reports whether the layer's library is loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _backends import available_backends
from _vulkan_sync_run import run_sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAYER = "/usr/share/vulkan/explicit_layer.d/VkLayer_khronos_validation.json"

pytestmark = [
    pytest.mark.skipif("vulkan" not in available_backends(), reason="no Vulkan device / kp"),
    pytest.mark.skipif(not os.path.exists(LAYER), reason="Vulkan validation layers not installed "
                                                         "(apt-get install vulkan-validationlayers)"),
]


def layer_env(settings: str) -> dict:
    """The environment of a child with the validation layer on, its settings from the
    folder `settings` of tests/fixtures."""
    return dict(os.environ, VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation",
                VK_LAYER_SETTINGS_PATH=os.path.join(ROOT, "tests", "fixtures", settings),
                PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))


def run_child(model: str, mode: str, kv_dtype: str = "bf16", merge: int = 0, settings: str = "",
              timeout: int = 600) -> tuple[str, dict | None]:
    """settings: a folder of tests/fixtures holding the layer's settings (default: sync validation)."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "_vulkan_sync_run.py"), model, mode, kv_dtype, str(merge)],
                       capture_output=True, text=True, env=layer_env(settings), cwd=ROOT, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    result = next((json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"tokens"')), None)
    return r.stdout, result


@pytest.fixture(scope="module")
def cpu_reference(tiny_llama):
    """(kv_dtype, merge) -> run_sequence on the CPU backend (computed once each)."""
    import engine
    runs = {}

    def get(kv_dtype: str, merge: int = 0) -> dict:
        if (kv_dtype, merge) not in runs:
            model = engine.load(str(tiny_llama), backend="cpu", snapkv_budget=24, snapkv_window=8,
                                snapkv_min_tokens=16, kv_dtype=kv_dtype, snapkv_merge=merge)
            runs[kv_dtype, merge] = run_sequence(model)
        return runs[kv_dtype, merge]
    return get


# bf16 in both sync modes; quantized pages with the barrier (tq4 rows of head_dim 16
# are 10 bytes, so neighbouring rows share words). Tolerance: f32 sums in a different
# order; with tq rows a code at a near-tie of the rotated row may also differ from CPU's
# (see test_ops' kv_write tolerance), which moves a logit by ~1e-2 at most here.
# merge 4: the compaction also writes 4 merged rows per KV head and attention binds their
# bias; the merged rows are means of each backend's own rows (6e-4 apart measured).
@pytest.mark.parametrize("mode,kv_dtype,merge,tol", [("barrier", "bf16", 0, 1e-4), ("submit", "bf16", 0, 1e-4),
                                                     ("barrier", "tq4/tq3", 0, 2e-2), ("barrier", "bf16", 4, 2e-3)])
def test_no_hazards_and_cpu_results(tiny_llama, cpu_reference, mode, kv_dtype, merge, tol):
    out, got = run_child(str(tiny_llama), mode, kv_dtype, merge)
    hazards = [line for line in out.splitlines() if "SYNC-HAZARD" in line or "Validation Error" in line]
    assert not hazards, "\n".join(hazards[:5])
    assert got is not None, out[-2000:]
    assert got["validation_layer"], "the validation layer did not load in the child"
    ref = cpu_reference(kv_dtype, merge)
    assert got["tokens"] == ref["tokens"] and got["rows"] == ref["rows"]
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=tol, atol=tol)
    np.testing.assert_allclose(got["branch"], ref["branch"], rtol=tol, atol=tol)


def test_validator_sees_the_race_without_a_barrier(tiny_llama):
    out, _ = run_child(str(tiny_llama), "none")
    assert "SYNC-HAZARD-READ-AFTER-WRITE" in out


@pytest.mark.skipif(os.environ.get("SNAPKV_GPU_AV") != "1",
                    reason="GPU-assisted validation takes ~15 min on lavapipe: SNAPKV_GPU_AV=1 runs it")
def test_gpu_assisted_validation_finds_no_out_of_bounds_access(tmp_path):
    """GPU-assisted validation (every descriptor access of every shader checked) over
    prefill, compaction, a branch and decode of a q4_1 model (on a CPU device with 64-bit
    integers: weights padded for 64-bit loads, read through a second, 64-bit view of the
    buffer): no out-of-bounds access; and it does report one (a copy of 1024 words into
    a 64-word buffer), so it was on."""
    from gguf import GGMLQuantizationType as Q
    from tiny_gguf import write_tiny_gguf
    model = write_tiny_gguf(tmp_path / "tiny-llama-q4_1.gguf", qtype=Q.Q4_1)
    out, got = run_child(str(model), "barrier", settings="gpu_av", timeout=2400)
    errors = [line for line in out.splitlines() if "Validation Error" in line]
    assert not errors and got is not None and got["validation_layer"], "\n".join(errors[:5]) or out[-2000:]
    oob = ("import numpy as np; from backends.vulkan.backend import VulkanBackend, _u32; "
           "b = VulkanBackend(device_local=True); src = b._buffer(np.arange(64, dtype=np.uint32)); "
           "dst = b._buffer(np.zeros(64, np.uint32)); "
           "b._dispatch('copy_words', (), [src, dst], (4, 1, 1), _u32(1024)); b.flush()")
    r = subprocess.run([sys.executable, "-c", oob], capture_output=True, text=True, env=layer_env("gpu_av"),
                       cwd=ROOT, timeout=600)
    assert "out of bounds" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
