"""Vulkan backend: Kompute (kp) buffers and pipelines, GLSL compute shaders from shaders/."""
from .device import list_devices

__all__ = ["VulkanBackend", "list_devices"]


def __getattr__(name):
    if name == "VulkanBackend":
        from .backend import VulkanBackend
        return VulkanBackend
    raise AttributeError(name)
