"""Vulkan decisions that need no device: the sync mode between dispatches, the
instance a MoltenVK loader needs (portability enumeration), the platform's hint
when no device is found, and f16 decoding in the shaders."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from backends.vulkan import device
from backends.vulkan.backend import sync_mode
from engine.errors import BackendUnavailable

SHADERS = Path(__file__).resolve().parents[2] / "shaders"


@pytest.mark.parametrize("device_type", ["discrete", "integrated", "virtual", "other"])
@pytest.mark.parametrize("device_local", [True, False])
def test_gpus_order_dispatches_whatever_the_memory_type(device_type, device_local):
    assert sync_mode(device_type, device_local, have_barrier=True) == "barrier"
    assert sync_mode(device_type, device_local, have_barrier=False) == "submit"


def test_cpu_device_runs_in_order_unless_imitating_a_gpu():
    assert sync_mode("cpu", False, True) is None
    assert sync_mode("cpu", True, True) == "barrier"       # test_vulkan_sync's GPU imitation
    assert sync_mode("cpu", True, False) == "submit"


def test_instance_asks_for_portability_enumeration_when_offered():
    assert device.instance_request({b"VK_KHR_surface"}) == (0, [])
    flags, exts = device.instance_request({b"VK_KHR_surface", b"VK_KHR_portability_enumeration"})
    assert flags == 0x1 and exts == [b"VK_KHR_portability_enumeration"]


class _FakeLoader:
    """A libvulkan that offers `extensions` and records vkCreateInstance's request."""

    def __init__(self, extensions: list[bytes]):
        self.extensions, self.request = extensions, None

    def vkEnumerateInstanceExtensionProperties(self, layer, count, props):
        count._obj.value = len(self.extensions)
        if props is not None:
            for i, name in enumerate(self.extensions):
                ctypes.memmove(ctypes.addressof(props) + 260 * i, name, len(name))
        return 0

    def vkCreateInstance(self, info, alloc, inst):
        ci = info._obj
        names = ctypes.cast(ci.ppEnabledExtensionNames, ctypes.POINTER(ctypes.c_char_p))
        self.request = (ci.flags, [names[i] for i in range(ci.enabledExtensionCount)])
        return -9                                           # VK_ERROR_INCOMPATIBLE_DRIVER


@pytest.mark.parametrize("offered", [True, False])
def test_enumeration_enables_portability_when_the_loader_has_it(monkeypatch, offered):
    exts = [b"VK_KHR_surface"] + ([b"VK_KHR_portability_enumeration"] if offered else [])
    fake = _FakeLoader(exts)
    monkeypatch.setattr(device.ctypes, "CDLL", lambda name: fake)
    with pytest.raises(OSError):
        device._enumerate_ctypes()
    assert fake.request == ((1, [b"VK_KHR_portability_enumeration"]) if offered else (0, []))


@pytest.mark.parametrize("system,wanted,unwanted", [("Darwin", "MoltenVK", "mesa"),
                                                    ("Linux", "mesa-vulkan-drivers", "MoltenVK"),
                                                    ("Windows", "driver", "mesa")])
def test_no_device_hint_fits_the_platform(monkeypatch, system, wanted, unwanted):
    monkeypatch.setattr(device.platform, "system", lambda: system)
    with pytest.raises(BackendUnavailable, match="no Vulkan device found") as e:
        device.pick_device([])
    msg = str(e.value)
    assert wanted in msg and unwanted.lower() not in msg.lower() and "\n" not in msg


def test_shaders_decode_f16_without_unpack_half():
    """unpackHalf2x16 may flush f16 subnormals (Vulkan allows it): every shader decodes
    f16 with common.glsl's f16_to_f32 (checked on a device by test_vulkan_quant)."""
    users = [p.name for p in sorted(SHADERS.glob("*.*")) if re.search(r"unpackHalf2x16\s*\(", p.read_text())]
    assert users == []


LAVAPIPE = {"name": "llvmpipe", "api_version": "1.3.230",
            "limits": {"max_storage_buffer_range": 1 << 27, "max_storage_buffers_per_stage": 32,
                       "max_workgroup_count": (65535, 65535, 65535), "max_allocation_size": 1 << 31}}


def test_device_checks_name_the_limit():
    device.check_device(LAVAPIPE)
    device.check_device({"name": "old", "type": "other"})          # kp's enumeration: no limits known
    with pytest.raises(BackendUnavailable, match=r"supports Vulkan 1\.0\.68; our shaders need Vulkan 1\.1"):
        device.check_device(dict(LAVAPIPE, api_version="1.0.68"))
    with pytest.raises(BackendUnavailable, match="maxPerStageDescriptorStorageBuffers"):
        device.check_device(dict(LAVAPIPE, limits=dict(LAVAPIPE["limits"], max_storage_buffers_per_stage=4)))


def test_buffer_checks_kp_32_bit_sizes_and_the_allocation_limit():
    device.check_buffer(LAVAPIPE, 1 << 31)
    with pytest.raises(BackendUnavailable, match=r"maxMemoryAllocationSize, 2048 MiB"):
        device.check_buffer(LAVAPIPE, (1 << 31) + 4)
    huge = dict(LAVAPIPE, limits=dict(LAVAPIPE["limits"], max_allocation_size=1 << 40))
    device.check_buffer(huge, (1 << 32) - 4)
    with pytest.raises(BackendUnavailable, match="kp sizes buffers in 32 bits"):   # would wrap to 0
        device.check_buffer(huge, 1 << 32)
    with pytest.raises(BackendUnavailable, match="kp sizes buffers in 32 bits"):
        device.check_buffer({"name": "kp-enumerated"}, 5 << 30)


def test_grid_check():
    device.check_grid(LAVAPIPE, "attention", (65535, 1, 1))
    with pytest.raises(BackendUnavailable, match=r"kv_copy_pages needs 65536 workgroups along axis 1"):
        device.check_grid(LAVAPIPE, "kv_copy_pages", (1, 65536, 1))


@pytest.mark.parametrize("rows,cols", [(151936, 1024), (262144, 640), (262144, 2560), (49152, 576), (7, 256)])
@pytest.mark.parametrize("cpu_threads", [None, 1, 2, 16])
def test_matmul_grid_within_the_guaranteed_workgroup_count(rows, cols, cpu_threads):
    from backends.vulkan import shaders
    for n in (1, 512):
        _, lpr_log2, grid, spec = shaders.matmul_geometry(rows, cols, n, cpu_threads)
        assert max(grid) <= 65535 and 0 <= lpr_log2 <= 5
        if cpu_threads is None:     # every row has a slot: grid x * rows per workgroup covers them
            assert grid[0] * (shaders.MATMUL_WG >> lpr_log2) >= rows
        else:                       # LX lanes of TR rows each
            assert spec[0] in shaders.MATMUL_TR_CHOICES and grid[0] * shaders.MATMUL_LANES_CPU * spec[0] >= rows


@pytest.mark.parametrize("rows,threads,tr,workgroups", [(576, 2, 12, 6), (576, 1, 24, 3), (960, 2, 12, 10),
                                                         (3072, 2, 32, 12), (49152, 2, 32, 192), (7, 2, 1, 1)])
def test_cpu_matmul_rows_per_lane_balance_the_threads(rows, threads, tr, workgroups):
    """ROW_PER_LANE picks the rows per lane that give each thread the fewest rows over its
    rounds of workgroups: the default model's 576-row matrices in 6 workgroups on 2 threads
    (3 rounds of 96 rows; 3 workgroups of 256 rows would take 2 rounds of 256)."""
    from backends.vulkan import shaders
    _, _, grid, spec = shaders.matmul_geometry(rows, 576, 1, threads)
    assert (spec[0], grid[0]) == (tr, workgroups)
