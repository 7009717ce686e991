"""Memory-mapped GGUF access. Quantized blocks stay quantized: every tensor is a
uint8 view into the mapped file, shaped [rows, row_bytes].

The header is parsed here rather than by `gguf.GGUFReader`, which builds a numpy
view per array element and takes ~2.5 s on the default model's 49K-token
vocabulary and merges; this parser takes ~0.1 s. tests/unit/test_gguf_reader.py
checks it against GGUFReader, field by field and tensor by tensor."""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..errors import ModelFileError, UnsupportedError, cut
from .qtypes import SUPPORTED, SUPPORTED_NAMES, block_geometry

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> (struct format, size); 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY, BOOL = 8, 9, 7
MAX_NESTING = 8      # arrays of arrays deeper than this: a malformed file (none is nested at all)
# Bounds past which a header is junk, checked before it is expanded into Python objects (each
# element costs ~30x its bytes there): the largest vocabularies and merge lists hold ~300K
# entries, the largest models a few thousand tensors; GGUF names a tensor in 64 bytes at most.
MAX_ARRAY = 1 << 22
MAX_TENSORS = 1 << 16
MAX_TENSOR_NAME = 64


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: Q
    shape: tuple[int, int]      # (rows, cols): cols = GGUF ne[0], the contiguous, quantized axis
    raw: np.ndarray             # uint8 [rows, row_bytes], a view into the memory map


class _Malformed(ValueError):
    """A header that cannot be what it claims; the message is written for the user."""


class _Cursor:
    """Little-endian reads from a buffer; _Malformed past its end."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise _Malformed(f"{what} at byte {self.pos} runs past the end of the file ({len(self.buf)} bytes)")

    def scalar(self, vtype: int):
        fmt, size = _SCALARS[vtype]
        self.need(size, "a header field")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        n = self.u64()
        self.need(n, f"a {n}-byte string")
        end = self.pos + n
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, vtype: int, depth: int = 0):
        """One metadata value as a plain Python value (nested arrays: None; nested past
        MAX_NESTING: malformed, not a recursion error)."""
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.u32(), self.u64()
            if count > MAX_ARRAY:
                raise _Malformed(f"an array of {count} values (more than {MAX_ARRAY})")
            if etype == STRING:                  # every element takes at least its 8-byte length
                self.need(8 * count, f"an array of {count} strings")
                return [self.string() for _ in range(count)]
            if etype == ARRAY:                   # at least a 4-byte type and an 8-byte count each
                if depth >= MAX_NESTING:
                    raise _Malformed(f"arrays nested more than {MAX_NESTING} deep")
                self.need(12 * count, f"an array of {count} arrays")
                for _ in range(count):
                    self.value(ARRAY, depth + 1)
                return None                      # nested arrays are not used by any key we read
            if etype not in _NUMPY:
                raise _Malformed(f"unknown GGUF array element type {etype}")
            size = _SCALARS[etype][1] * count
            self.need(size, f"an array of {count} values")
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
            self.pos += size
            return (arr != 0).tolist() if etype == BOOL else arr.tolist()
        if vtype not in _SCALARS:
            raise _Malformed(f"unknown GGUF value type {vtype}")
        return self.scalar(vtype)


class GgufFile:
    """Metadata (plain Python values) and tensors of one GGUF file."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ModelFileError(f"model file not found: {path}")
        if os.path.isdir(path):
            raise ModelFileError(f"model path is a directory, not a GGUF file: {path}")
        if not os.path.isfile(path):                 # a FIFO or device would block or never end
            raise ModelFileError(f"model path is not a regular file: {path}")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
                if magic != GGUF_MAGIC:
                    raise ModelFileError(f"not a GGUF file (bad magic {magic!r}): {path}")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            mm = np.frombuffer(self._map, dtype=np.uint8)
        except (OSError, ValueError) as e:          # ValueError: emptied after its magic was read
            raise ModelFileError(f"cannot read model file {path}: {getattr(e, 'strerror', None) or e}") from None
        self.path = path
        try:
            self.metadata, infos, data_start, self.alignment = self._parse(memoryview(mm))
        except _Malformed as e:
            raise ModelFileError(f"cannot read GGUF file {path}: truncated or malformed ({e})") from None
        self.architecture = str(self.metadata.get("general.architecture", ""))
        self.tensors: dict[str, TensorInfo] = {}
        unsupported: dict[str, str] = {}
        spans = []                                   # (start, end, name) in the file
        for name, qtype, ne, offset in infos:
            if qtype not in SUPPORTED:
                unsupported.setdefault(qtype.name, name)
                continue
            if name in self.tensors:
                raise ModelFileError(f"tensor {name} appears twice: malformed GGUF {path}")
            if not ne or min(ne) < 1:
                raise ModelFileError(f"tensor {name} has shape {ne}: malformed GGUF {path}")
            if offset % self.alignment:
                raise ModelFileError(f"tensor {name} starts at data offset {offset}, not a multiple of the "
                                     f"file's alignment {self.alignment}: malformed GGUF {path}")
            cols = ne[0]
            rows = 1
            for n in ne[1:]:
                rows *= n
            elems, nbytes = block_geometry(qtype)
            if cols % elems:
                raise ModelFileError(f"tensor {name} has {cols} columns, not a multiple of the "
                                     f"{qtype.name} block ({elems}): malformed GGUF {path}")
            size = rows * (cols // elems) * nbytes
            start = data_start + offset
            if start + size > mm.size:
                raise ModelFileError(f"tensor {name} ({qtype.name}, {rows}x{cols}) ends at byte {start + size} "
                                     f"of a {mm.size}-byte file: truncated or malformed GGUF {path}")
            spans.append((start, start + size, name))
            self.tensors[name] = TensorInfo(name, qtype, (rows, cols), mm[start:start + size].reshape(rows, -1))
        if unsupported:
            names = ", ".join(f"{k} (e.g. {v})" for k, v in unsupported.items())
            raise UnsupportedError(f"unsupported tensor type {names}; supported: {SUPPORTED_NAMES}")
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:                          # e.g. a quantized tensor relabelled F32
                raise ModelFileError(f"tensors {a} and {b} overlap in the file (a wrong type or shape "
                                     f"in the header): malformed GGUF {path}")

    def release_pages(self) -> None:
        """Drop this process's resident pages of the file (once the backend holds its own
        copy of every tensor): arrays viewing the file stay valid and read their pages
        back from the OS page cache when next touched. A no-op where madvise is missing."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _parse(self, buf: memoryview) -> tuple[dict, list[tuple[str, Q, list[int], int]], int, int]:
        """(metadata, tensor infos as (name, type, ne, offset in the data section),
        byte offset of the data section, alignment of tensor offsets)."""
        c = _Cursor(buf)
        c.pos = 4
        version = c.u32()
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            what = "big-endian GGUF" if swapped in (2, 3) else f"GGUF version {version}"
            raise UnsupportedError(f"{what} is not supported (little-endian versions 2 and 3 are): {self.path}")
        n_tensors, n_kv = c.u64(), c.u64()
        if n_tensors > min(len(buf), MAX_TENSORS) or n_kv > len(buf):
            raise _Malformed(f"the header claims {n_tensors} tensors and {n_kv} keys in a {len(buf)}-byte file")
        metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            if key in metadata:                      # as gguf-py and llama.cpp refuse it
                raise _Malformed(f"metadata key {cut(key)!r} appears twice")
            metadata[key] = c.value(c.u32())
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            if len(name.encode()) > MAX_TENSOR_NAME:
                raise _Malformed(f"tensor name {cut(name)!r} is longer than GGUF's {MAX_TENSOR_NAME} bytes")
            n_dims = c.u32()
            if n_dims > 8:
                raise _Malformed(f"tensor {name} has {n_dims} dimensions")
            ne = [c.u64() for _ in range(n_dims)]
            type_id, offset = c.u32(), c.u64()
            try:
                qtype = Q(type_id)
            except ValueError:
                raise UnsupportedError(f"unsupported tensor type id {type_id} (tensor {name}); "
                                       f"supported: {SUPPORTED_NAMES}") from None
            infos.append((name, qtype, ne, offset))
        align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 2**16 or align & (align - 1):
            raise _Malformed(f"general.alignment is {align!r}, not a power of two up to 65536")
        return metadata, infos, -(-c.pos // align) * align, align

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default=None):
        """Architecture-scoped key, e.g. arch_key("block_count") -> llama.block_count."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)
