"""Vulkan devices: enumeration (for `engine info --devices`) and the shared kp.Manager.

Enumeration calls the Vulkan loader directly through ctypes (vkEnumeratePhysicalDevices
+ vkGetPhysicalDeviceProperties), which gives the device type and vendor that kp
does not report; the order is the loader's, the same indices kp.Manager(i) takes.
Where the loader has VK_KHR_portability_enumeration (macOS: MoltenVK is a
"portability" driver the loader lists only when asked), the instance asks for it, as
the kp that tools/setup.sh builds does (tools/kp-0.9.0.patch).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

from engine.errors import BackendUnavailable

_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_VENDORS = {0x1002: "AMD", 0x1010: "ImgTec", 0x10DE: "NVIDIA", 0x13B5: "ARM", 0x5143: "Qualcomm",
            0x8086: "Intel", 0x106B: "Apple", 0x10005: "Mesa"}
_PREFERENCE = {"discrete": 0, "integrated": 1, "virtual": 2, "other": 3, "cpu": 4}
PORTABILITY_EXT = b"VK_KHR_portability_enumeration"
_ENUMERATE_PORTABILITY = 0x1        # VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
PORTABILITY_SUBSET = "VK_KHR_portability_subset"   # a device with it must enable it


class _AppInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
                ("applicationVersion", ctypes.c_uint32), ("pEngineName", ctypes.c_char_p),
                ("engineVersion", ctypes.c_uint32), ("apiVersion", ctypes.c_uint32)]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.POINTER(_AppInfo)), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


class _Limits(ctypes.Structure):
    """The head of VkPhysicalDeviceLimits, up to the compute limits (unread fields as padding)."""
    _fields_ = [("_images", ctypes.c_uint32 * 7), ("maxStorageBufferRange", ctypes.c_uint32),
                ("_push_alloc", ctypes.c_uint32 * 3), ("_granularity_sparse", ctypes.c_uint64 * 2),
                ("_sets_samplers_uniform", ctypes.c_uint32 * 3),
                ("maxPerStageDescriptorStorageBuffers", ctypes.c_uint32), ("_more", ctypes.c_uint32 * 34),
                ("maxComputeSharedMemorySize", ctypes.c_uint32),
                ("maxComputeWorkGroupCount", ctypes.c_uint32 * 3),
                ("maxComputeWorkGroupInvocations", ctypes.c_uint32),
                ("maxComputeWorkGroupSize", ctypes.c_uint32 * 3)]


class _Properties(ctypes.Structure):
    """VkPhysicalDeviceProperties up to the limits above (the buffer passed is larger)."""
    _fields_ = [("apiVersion", ctypes.c_uint32), ("driverVersion", ctypes.c_uint32),
                ("vendorID", ctypes.c_uint32), ("deviceID", ctypes.c_uint32), ("deviceType", ctypes.c_uint32),
                ("deviceName", ctypes.c_char * 256), ("pipelineCacheUUID", ctypes.c_uint8 * 16),
                ("limits", _Limits)]


class _Maintenance3(ctypes.Structure):
    """VkPhysicalDeviceMaintenance3Properties (Vulkan 1.1): maxMemoryAllocationSize."""
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("maxPerSetDescriptors", ctypes.c_uint32),
                ("maxMemoryAllocationSize", ctypes.c_uint64)]


class _Properties2(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("properties", ctypes.c_uint8 * 1024)]


class _MemoryProperties(ctypes.Structure):
    """VkPhysicalDeviceMemoryProperties: 32 memory types (flags, heap), then 16 heaps."""
    _fields_ = [("memoryTypeCount", ctypes.c_uint32), ("memoryTypes", ctypes.c_uint32 * 64),
                ("memoryHeapCount", ctypes.c_uint32),
                ("memoryHeaps", (ctypes.c_uint64 * 2) * 16)]        # VkMemoryHeap: size, flags (+ padding)


_HEAP_DEVICE_LOCAL = 0x1            # VK_MEMORY_HEAP_DEVICE_LOCAL_BIT


def _device_local_bytes(vk, handle) -> int | None:
    """The largest device-local memory heap (a discrete GPU's memory), or None."""
    mem = _MemoryProperties()
    vk.vkGetPhysicalDeviceMemoryProperties(handle, ctypes.byref(mem))
    sizes = [int(mem.memoryHeaps[i][0]) for i in range(min(mem.memoryHeapCount, 16))
             if mem.memoryHeaps[i][1] & _HEAP_DEVICE_LOCAL]
    return max(sizes) if sizes else None


_PROPERTIES_2 = 1000059001          # VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2
_MAINTENANCE_3 = 1000168000         # VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES


def _limits(vk, handle, props: _Properties) -> dict:
    """The limits the backend checks its buffers and dispatches against."""
    lim = props.limits
    out = {"max_storage_buffer_range": lim.maxStorageBufferRange,
           "max_storage_buffers_per_stage": lim.maxPerStageDescriptorStorageBuffers,
           "max_workgroup_count": tuple(lim.maxComputeWorkGroupCount),
           "max_workgroup_invocations": min(lim.maxComputeWorkGroupInvocations, lim.maxComputeWorkGroupSize[0]),
           "max_allocation_size": None}
    if props.apiVersion >= (1 << 22) | (1 << 12) and hasattr(vk, "vkGetPhysicalDeviceProperties2"):
        m3 = _Maintenance3(_MAINTENANCE_3, None, 0, 0)
        p2 = _Properties2(_PROPERTIES_2, ctypes.cast(ctypes.pointer(m3), ctypes.c_void_p))
        vk.vkGetPhysicalDeviceProperties2(handle, ctypes.byref(p2))
        out["max_allocation_size"] = m3.maxMemoryAllocationSize or None
    return out


def _vendor(vendor_id: int, name: str) -> str:
    if "llvmpipe" in name.lower() or "lavapipe" in name.lower():
        return "Mesa"
    return _VENDORS.get(vendor_id, f"0x{vendor_id:04x}")


def _instance_extensions(vk) -> set[bytes]:
    """Names of the instance extensions the loader offers (vkEnumerateInstanceExtensionProperties)."""
    count = ctypes.c_uint32(0)
    if vk.vkEnumerateInstanceExtensionProperties(None, ctypes.byref(count), None) != 0:
        return set()
    props = (ctypes.c_uint8 * (260 * count.value))()   # VkExtensionProperties: char[256] + uint32
    if vk.vkEnumerateInstanceExtensionProperties(None, ctypes.byref(count), props) not in (0, 5):
        return set()                                   # 5: VK_INCOMPLETE (the list grew)
    return {bytes(props[260 * i:260 * i + 256]).split(b"\0")[0] for i in range(count.value)}


def instance_request(available: set[bytes]) -> tuple[int, list[bytes]]:
    """(VkInstanceCreateInfo flags, extensions to enable) for an instance that also lists
    portability drivers (MoltenVK) when the loader can."""
    if PORTABILITY_EXT in available:
        return _ENUMERATE_PORTABILITY, [PORTABILITY_EXT]
    return 0, []


def _loader(system: str):
    """The Vulkan loader library (macOS: Homebrew's is not on dyld's default path)."""
    names = {"Darwin": ["libvulkan.1.dylib", "/opt/homebrew/lib/libvulkan.1.dylib",
                        "/usr/local/lib/libvulkan.1.dylib"],
             "Windows": ["vulkan-1.dll"]}.get(system, ["libvulkan.so.1"])
    for name in filter(None, [ctypes.util.find_library("vulkan")] + names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no Vulkan loader library")


def _enumerate_ctypes() -> list[dict]:
    vk = _loader(platform.system())
    app = _AppInfo(0, None, b"snapkv-engine", 1, b"snapkv-engine", 1, (1 << 22) | (1 << 12))
    flags, exts = instance_request(_instance_extensions(vk))
    names = (ctypes.c_char_p * max(1, len(exts)))(*exts)
    info = _InstanceInfo(1, None, flags, ctypes.pointer(app), 0, None, len(exts),
                         ctypes.cast(names, ctypes.c_void_p))
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
            buf = (ctypes.c_uint8 * 4096)()            # VkPhysicalDeviceProperties (< 1 KiB)
            vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(h), buf)
            props = _Properties.from_buffer(buf)
            name = props.deviceName.decode(errors="replace")
            api = props.apiVersion
            out.append({"index": i, "name": name, "type": _TYPES.get(props.deviceType, "other"),
                        "vendor": _vendor(props.vendorID, name),
                        "api_version": f"{api >> 22}.{(api >> 12) & 0x3FF}.{api & 0xFFF}",
                        "limits": _limits(vk, ctypes.c_void_p(h), props),
                        "device_local_bytes": _device_local_bytes(vk, ctypes.c_void_p(h))})
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
    vendor, api_version?, limits?}], in the order kp.Manager(index) uses (api_version and
    limits come from the loader; `check_device` reads them). [] when there is no loader."""
    try:
        return _enumerate_ctypes()
    except Exception:
        pass
    try:
        return _enumerate_kp()
    except Exception:
        return []


def no_device_hint(system: str) -> str:
    """What to install when the loader lists no device, for platform.system()."""
    if system == "Darwin":
        return ("Vulkan on macOS runs through MoltenVK: install the LunarG Vulkan SDK, or "
                "`brew install molten-vk vulkan-loader`, then rerun `make setup`")
    if system == "Windows":
        return "install or update the GPU vendor's driver, which provides Vulkan"
    return "install a Vulkan driver; mesa-vulkan-drivers provides the lavapipe CPU device"


def pick_device(devices: list[dict], allow_cpu: bool = True) -> dict:
    """Discrete GPU first, then integrated, ..., a CPU implementation (lavapipe) last."""
    usable = [d for d in devices if allow_cpu or d["type"] != "cpu"]
    if not usable:
        if devices:
            raise BackendUnavailable("backend 'vulkan': only a CPU Vulkan device (" + devices[0]["name"]
                                     + ") is present and a GPU was required")
        raise BackendUnavailable(f"backend 'vulkan': no Vulkan device found ({no_device_hint(platform.system())})")
    return min(usable, key=lambda d: (_PREFERENCE.get(d["type"], 9), d["index"]))


# What the backend needs of a device: SPIR-V 1.3 (shaders are compiled for Vulkan 1.1),
# nine storage buffers bound by one shader (kv_write's ROPE variant: K and V pages, page
# table, the q | k | v rows, values, step buffer, RoPE table, positions, key centre;
# attention binds seven), and buffers that kp can size (it computes them in 32 bits).
MIN_API = (1, 1)
STORAGE_BUFFERS_PER_SHADER = 9
WORKGROUP_SIZE = 256                # our largest local_size_x (copy_words, kv_copy_pages): the spec asks for 128
KP_MAX_BUFFER = 1 << 32


def check_device(info: dict) -> None:
    """BackendUnavailable naming the device and the limit when it cannot run our shaders."""
    api = info.get("api_version")
    if api and tuple(int(x) for x in api.split(".")[:2]) < MIN_API:
        raise BackendUnavailable(f"backend 'vulkan': {info['name']} supports Vulkan {api}; our shaders "
                                 f"need Vulkan {MIN_API[0]}.{MIN_API[1]} (SPIR-V 1.3)")
    n = (info.get("limits") or {}).get("max_storage_buffers_per_stage")
    if n is not None and n < STORAGE_BUFFERS_PER_SHADER:
        raise BackendUnavailable(f"backend 'vulkan': {info['name']} allows {n} storage buffers per shader "
                                 f"(maxPerStageDescriptorStorageBuffers); our shaders bind up to "
                                 f"{STORAGE_BUFFERS_PER_SHADER}")
    n = (info.get("limits") or {}).get("max_workgroup_invocations")
    if n is not None and n < WORKGROUP_SIZE:
        raise BackendUnavailable(f"backend 'vulkan': {info['name']} runs workgroups of at most {n} invocations "
                                 f"(maxComputeWorkGroupInvocations, maxComputeWorkGroupSize); our shaders "
                                 f"use up to {WORKGROUP_SIZE}")


def check_buffer(info: dict, nbytes: int) -> None:
    """BackendUnavailable when one buffer of `nbytes` exceeds what kp or the device allocates."""
    limits = info.get("limits") or {}
    cap = limits.get("max_allocation_size")
    if nbytes >= KP_MAX_BUFFER or (cap and nbytes > cap):
        limit = (f"maxMemoryAllocationSize, {cap / 2**20:.0f} MiB" if cap and cap < KP_MAX_BUFFER
                 else "kp sizes buffers in 32 bits: 4 GiB")
        raise BackendUnavailable(f"backend 'vulkan': one buffer of {nbytes / 2**20:.0f} MiB is more than "
                                 f"{info['name']} allocates ({limit}); lower --ctx or use a smaller "
                                 f"--kv-dtype")


SPEC_MIN_STORAGE_RANGE = 1 << 27    # maxStorageBufferRange every Vulkan device has (128 MiB)


def max_buffer_bytes(info: dict) -> int:
    """The largest buffer one shader binding may cover here (maxStorageBufferRange, the
    allocation limit, kp's 32-bit sizes); the spec's minimum range when the limits are
    unknown (devices enumerated without the loader's properties)."""
    limits = info.get("limits") or {}
    caps = [c for c in (limits.get("max_storage_buffer_range"), limits.get("max_allocation_size")) if c]
    return min(caps + [KP_MAX_BUFFER - 4]) if caps else SPEC_MIN_STORAGE_RANGE


def check_grid(info: dict, shader: str, grid: tuple) -> None:
    """BackendUnavailable when a dispatch has more workgroups along an axis than the device allows."""
    most = (info.get("limits") or {}).get("max_workgroup_count") or (65535, 65535, 65535)
    for axis, (n, cap) in enumerate(zip(grid, most)):
        if n > cap:
            raise BackendUnavailable(f"backend 'vulkan': {shader} needs {n} workgroups along axis {axis}, "
                                     f"{info['name']} allows {cap} (maxComputeWorkGroupCount)")


_MANAGERS: dict[int, object] = {}


def manager(index: int):
    """One kp.Manager per device for the whole process (creating one is expensive)."""
    if index not in _MANAGERS:
        import kp
        try:
            _MANAGERS[index] = kp.Manager(index, [], [PORTABILITY_SUBSET])   # kp enables it only if offered
        except Exception as e:
            raise BackendUnavailable(f"backend 'vulkan': cannot open Vulkan device {index}: "
                                     f"{type(e).__name__}: {e}") from None
    return _MANAGERS[index]
