"""Vulkan synchronization between dependent dispatches, checked by the Khronos
synchronization validation layer on lavapipe with device-local buffers (what a GPU
gets): prefill, SnapKV compaction, a cache branch and decode record no hazard with
the global barrier (and with one submission per dispatch), the validator does flag
the race when the barrier is left out, and the results match the CPU backend."""
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


def run_child(model: str, mode: str) -> tuple[str, dict | None]:
    env = dict(os.environ, VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation",
               VK_LAYER_SETTINGS_PATH=os.path.join(ROOT, "tests", "fixtures"),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, os.path.join(HERE, "_vulkan_sync_run.py"), model, mode],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = next((json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"tokens"')), None)
    return r.stdout, result


@pytest.fixture(scope="module")
def cpu_reference(tiny_llama):
    import engine
    model = engine.load(str(tiny_llama), backend="cpu", snapkv_budget=24, snapkv_window=8, snapkv_min_tokens=16)
    return run_sequence(model)


@pytest.mark.parametrize("mode", ["barrier", "submit"])
def test_no_hazards_and_cpu_results(tiny_llama, cpu_reference, mode):
    out, got = run_child(str(tiny_llama), mode)
    hazards = [line for line in out.splitlines() if "SYNC-HAZARD" in line or "Validation Error" in line]
    assert not hazards, "\n".join(hazards[:5])
    assert got is not None, out[-2000:]
    ref = cpu_reference
    assert got["tokens"] == ref["tokens"] and got["rows"] == ref["rows"]
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["branch"], ref["branch"], rtol=1e-4, atol=1e-4)


def test_validator_sees_the_race_without_a_barrier(tiny_llama):
    out, _ = run_child(str(tiny_llama), "none")
    assert "SYNC-HAZARD-READ-AFTER-WRITE" in out
