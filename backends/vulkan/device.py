"""Vulkan devices: enumeration (for `engine info --devices`) and the shared kp.Manager.

Enumeration calls the Vulkan loader directly through ctypes (vkEnumeratePhysicalDevices
+ vkGetPhysicalDeviceProperties), which gives the device type and vendor that kp
does not report; the order is the loader's, the same indices kp.Manager(i) takes.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from engine.errors import BackendUnavailable

_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_VENDORS = {0x1002: "AMD", 0x1010: "ImgTec", 0x10DE: "NVIDIA", 0x13B5: "ARM", 0x5143: "Qualcomm",
            0x8086: "Intel", 0x106B: "Apple", 0x10005: "Mesa"}
_PREFERENCE = {"discrete": 0, "integrated": 1, "virtual": 2, "other": 3, "cpu": 4}


class _AppInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
                ("applicationVersion", ctypes.c_uint32), ("pEngineName", ctypes.c_char_p),
                ("engineVersion", ctypes.c_uint32), ("apiVersion", ctypes.c_uint32)]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.POINTER(_AppInfo)), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


def _vendor(vendor_id: int, name: str) -> str:
    if "llvmpipe" in name.lower() or "lavapipe" in name.lower():
        return "Mesa"
    return _VENDORS.get(vendor_id, f"0x{vendor_id:04x}")


def _enumerate_ctypes() -> list[dict]:
    lib = ctypes.util.find_library("vulkan") or "libvulkan.so.1"
    vk = ctypes.CDLL(lib)
    app = _AppInfo(0, None, b"snapkv-engine", 1, b"snapkv-engine", 1, (1 << 22) | (1 << 12))
    info = _InstanceInfo(1, None, 0, ctypes.pointer(app), 0, None, 0, None)
    inst = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(inst)) != 0:
        raise OSError("vkCreateInstance failed")
    try:
        count = ctypes.c_uint32(0)
        vk.vkEnumeratePhysicalDevices(inst, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(inst, ctypes.byref(count), handles)
        out = []
        for i, h in enumerate(handles[:count.value]):
            props = (ctypes.c_uint8 * 4096)()          # VkPhysicalDeviceProperties (< 1 KiB)
            vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(h), props)
            head = (ctypes.c_uint32 * 5).from_buffer(props)   # api, driver, vendorID, deviceID, type
            name = bytes(props[20:276]).split(b"\0")[0].decode(errors="replace")
            api = head[0]
            out.append({"index": i, "name": name, "type": _TYPES.get(head[4], "other"),
                        "vendor": _vendor(head[2], name),
                        "api_version": f"{api >> 22}.{(api >> 12) & 0x3FF}.{api & 0xFFF}"})
        return out
    finally:
        vk.vkDestroyInstance(inst, None)


def _enumerate_kp() -> list[dict]:
    import kp
    mgr = kp.Manager()
    try:
        names = [str(d.get("device_name", "?")) for d in mgr.list_devices()]
    finally:
        mgr.destroy()
    out = []
    for i, name in enumerate(names):
        low = name.lower()
        cpu = any(s in low for s in ("llvmpipe", "lavapipe", "swiftshader"))
        vendor = next((v for k, v in (("nvidia", "NVIDIA"), ("geforce", "NVIDIA"), ("radeon", "AMD"),
                                      ("amd", "AMD"), ("intel", "Intel"), ("apple", "Apple")) if k in low),
                      "Mesa" if cpu else "?")
        out.append({"index": i, "name": name, "type": "cpu" if cpu else "other", "vendor": vendor})
    return out


def list_devices() -> list[dict]:
    """Vulkan physical devices: [{index, name, type (cpu|discrete|integrated|virtual|other),
    vendor, api_version?}], in the order kp.Manager(index) uses. [] when there is no loader."""
    try:
        return _enumerate_ctypes()
    except Exception:
        pass
    try:
        return _enumerate_kp()
    except Exception:
        return []


def pick_device(devices: list[dict], allow_cpu: bool = True) -> dict:
    """Discrete GPU first, then integrated, ..., a CPU implementation (lavapipe) last."""
    usable = [d for d in devices if allow_cpu or d["type"] != "cpu"]
    if not usable:
        if devices:
            raise BackendUnavailable("backend 'vulkan': only a CPU Vulkan device (" + devices[0]["name"]
                                     + ") is present and a GPU was required")
        raise BackendUnavailable("backend 'vulkan': no Vulkan device found (install a Vulkan driver; "
                                 "mesa-vulkan-drivers provides the lavapipe CPU device)")
    return min(usable, key=lambda d: (_PREFERENCE.get(d["type"], 9), d["index"]))


_MANAGERS: dict[int, object] = {}


def manager(index: int):
    """One kp.Manager per device for the whole process (creating one is expensive)."""
    if index not in _MANAGERS:
        import kp
        try:
            _MANAGERS[index] = kp.Manager(index)
        except Exception as e:
            raise BackendUnavailable(f"backend 'vulkan': cannot open Vulkan device {index}: "
                                     f"{type(e).__name__}: {e}") from None
    return _MANAGERS[index]
