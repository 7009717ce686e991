"""Vulkan-specific checks the shared op table does not cover: device-array views
(the slices the forward pass takes), device listing, and the one-line errors.
Tolerance for f32 ops against the f64 reference: NMSE < 1e-10 (as in test_ops)."""
from __future__ import annotations

import numpy as np
import pytest

from _backends import available_backends, make_backend
from backends.reference import ReferenceBackend

pytestmark = pytest.mark.skipif("vulkan" not in available_backends(), reason="no Vulkan device / kp")
REF = ReferenceBackend()


@pytest.fixture(scope="module")
def vk():
    return make_backend("vulkan")


def nmse(a, b):
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_views_shape_and_download(vk):
    host = np.arange(7 * 10, dtype=np.float32).reshape(7, 10)
    a = vk.upload(host)
    assert a.shape == (7, 10) and a[:3].shape[0] == 3 and a[6:7].shape == (1, 10)
    np.testing.assert_array_equal(vk.download(a[2:5][:, 3:8]), host[2:5, 3:8])
    np.testing.assert_array_equal(vk.download(a[6:7]), host[6:7])
    b = vk.upload(np.arange(20, dtype=np.float32))
    np.testing.assert_array_equal(vk.download(b[5:9]), np.arange(5, 9, dtype=np.float32))


def test_column_slices_in_and_out(vk):
    """rms_norm / silu_gate / add / rope on column views leave the other columns alone."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 200)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    out = np.full((7, 200), 5.0, np.float32)
    dx, dw, do = vk.upload(x), vk.upload(w), vk.upload(out)
    vk.rms_norm(dx[:, 64:128], dw[10:74], 1e-6, do[:, 100:164])
    want = np.empty((7, 64), np.float32)
    REF.rms_norm(x[:, 64:128], w[10:74], 1e-6, want)
    got = vk.download(do)
    assert nmse(got[:, 100:164], want) < 1e-10
    assert np.all(got[:, :100] == 5.0) and np.all(got[:, 164:] == 5.0)
    vk.silu_gate(dx[2:5][:, :50], dx[2:5][:, 50:100], do[2:5][:, :50])
    REF.silu_gate(x[2:5, :50], x[2:5, 50:100], want := np.empty((3, 50), np.float32))
    assert nmse(vk.download(do)[2:5, :50], want) < 1e-10
    vk.add(dx[:, 100:150], dx[:, 150:200], dx[:, 100:150])
    np.testing.assert_array_equal(vk.download(dx)[:, 100:150], x[:, 100:150] + x[:, 150:200])
    y = rng.standard_normal((3, 300)).astype(np.float32)
    dy = vk.upload(y)
    vk.rope(dy[1:3][:, 12:], np.array([7, 8], np.int32), 2, 64, 64, 10000.0, True)
    want = y[1:3, 12:].copy()
    REF.rope(want, np.array([7, 8], np.int32), 2, 64, 64, 10000.0, True)
    got = vk.download(dy)
    assert nmse(got[1:3, 12:], want) < 1e-10
    np.testing.assert_array_equal(got[0], y[0])
    np.testing.assert_array_equal(got[1:3, :12], y[1:3, :12])


def test_list_devices_and_name():
    from backends.vulkan import list_devices
    devs = list_devices()
    assert devs and {"name", "type", "vendor"} <= set(devs[0])
    assert all(d["type"] in ("cpu", "discrete", "integrated", "virtual", "other") for d in devs)


def test_missing_kp_is_one_line(monkeypatch):
    from backends.vulkan import backend as mod
    from engine.errors import BackendUnavailable
    monkeypatch.setattr(mod, "kp", None)
    monkeypatch.setattr(mod, "_KP_ERROR", "ModuleNotFoundError: No module named 'kp'", raising=False)
    with pytest.raises(BackendUnavailable, match="needs the Python package 'kp'") as e:
        mod.VulkanBackend()
    assert "\n" not in str(e.value)


def test_gpu_required_but_only_cpu_device():
    from backends.vulkan.device import pick_device
    from engine.errors import BackendUnavailable
    with pytest.raises(BackendUnavailable, match="only a CPU Vulkan device"):
        pick_device([{"index": 0, "name": "llvmpipe", "type": "cpu", "vendor": "Mesa"}], allow_cpu=False)
    with pytest.raises(BackendUnavailable, match="no Vulkan device found"):
        pick_device([])
