"""Device-resident arrays for the Vulkan backend.

A `Buffer` is one kp tensor of uint32 words plus a serial number (pipelines are
cached by the serials of the buffers they bind). A `DeviceArray` is a strided
view of a buffer with a numpy-like shape: the forward pass slices activations
(`a[:n]`, `a[n-1:n]`, `a[:, lo:hi]`, `bias[lo:hi]`) and the shaders receive the
view's element offset and row stride as push constants.

Word layouts by logical dtype:
    float32, int32, uint32   one element per word (slicable)
    uint16                   two elements per word, element 2i in the low half (bf16 KV pages)
    uint8                    four elements per word (raw GGUF blocks)
"""
from __future__ import annotations

import itertools

import numpy as np

_serials = itertools.count(1)

PER_WORD = {np.dtype(np.float32): 1, np.dtype(np.int32): 1, np.dtype(np.uint32): 1,
            np.dtype(np.uint16): 2, np.dtype(np.uint8): 4}


class Buffer:
    """One kp.Tensor (uint32 words [n_words]) and its identity for the pipeline cache."""

    __slots__ = ("tensor", "n_words", "serial", "device_only", "__weakref__")

    def __init__(self, tensor, n_words: int, device_only: bool = False):
        self.tensor = tensor
        self.n_words = n_words
        self.device_only = device_only      # in device memory only: no host copy to read or write
        self.serial = next(_serials)


def to_words(host: np.ndarray) -> tuple[np.ndarray, np.dtype]:
    """Host array -> (uint32 words [>= 1], logical dtype). int64/float64 narrow to 32 bits."""
    a = np.asarray(host)
    if a.dtype == np.int64 or a.dtype == np.bool_:
        a = a.astype(np.int32)
    elif a.dtype == np.float64 or a.dtype == np.float16:
        a = a.astype(np.float32)
    dtype = a.dtype
    if dtype not in PER_WORD:
        raise TypeError(f"vulkan backend: unsupported array dtype {dtype}")
    flat = np.ascontiguousarray(a).reshape(-1)
    per = PER_WORD[dtype]
    n_words = max(1, -(-flat.size // per))
    if flat.size != n_words * per:
        padded = np.zeros(n_words * per, dtype=dtype)
        padded[:flat.size] = flat
        flat = padded
    return flat.view(np.uint32), dtype


class DeviceArray:
    """A view [shape] of a Buffer: element (i, j) of a 2-D float view is word
    offset + i * strides[0] + j * strides[1] (strides[1] == 1 always)."""

    __slots__ = ("buffer", "dtype", "shape", "offset", "strides")

    def __init__(self, buffer: Buffer, dtype, shape, offset: int = 0, strides=None):
        self.buffer = buffer
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.offset = int(offset)
        if strides is None:
            strides = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.strides = tuple(strides)

    # -- numpy-like surface ---------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def row_stride(self) -> int:
        return self.strides[0] if self.ndim > 1 else self.size

    @property
    def contiguous(self) -> bool:
        return self.strides == DeviceArray(self.buffer, self.dtype, self.shape).strides

    def __repr__(self) -> str:
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, offset={self.offset}, "
                f"strides={self.strides})")

    def __getitem__(self, key) -> "DeviceArray":
        if PER_WORD[self.dtype] != 1:
            raise TypeError("vulkan backend: packed (uint16/uint8) arrays cannot be sliced")
        if not isinstance(key, tuple):
            key = (key,)
        if len(key) > self.ndim:
            raise IndexError(f"too many indices for a {self.ndim}-d DeviceArray")
        shape, offset = list(self.shape), self.offset
        for axis, k in enumerate(key):
            if not isinstance(k, slice):
                raise TypeError("vulkan DeviceArray supports slices only (a[i:j], a[:, i:j])")
            start, stop, step = k.indices(shape[axis])
            if step != 1:
                raise TypeError("vulkan DeviceArray slices must have step 1")
            stop = max(stop, start)
            offset += start * self.strides[axis]
            shape[axis] = stop - start
        return DeviceArray(self.buffer, self.dtype, shape, offset, self.strides)

    def reshape(self, shape) -> "DeviceArray":
        """The same elements under another shape of the same size (a contiguous view only:
        a KV pool seen with one head per page)."""
        shape = tuple(int(s) for s in shape)
        if not self.contiguous or int(np.prod(shape)) != self.size:
            raise ValueError(f"vulkan DeviceArray: cannot view {self!r} as shape {shape}")
        return DeviceArray(self.buffer, self.dtype, shape, self.offset)

    def host_view(self, words: np.ndarray) -> np.ndarray:
        """This view's elements out of the buffer's words (a copy, shape self.shape)."""
        per = PER_WORD[self.dtype]
        if per != 1:
            return np.array(words.view(self.dtype)[:self.size].reshape(self.shape))
        flat = words.view(self.dtype)
        if self.size == 0:
            return np.zeros(self.shape, self.dtype)
        item = flat.itemsize
        strided = np.lib.stride_tricks.as_strided(
            flat[self.offset:], shape=self.shape, strides=tuple(s * item for s in self.strides))
        return np.array(strided)
