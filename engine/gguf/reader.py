"""Memory-mapped GGUF access. Quantized blocks stay quantized: every tensor is a
uint8 view into the mapped file, shaped [rows, row_bytes]."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as Q
from gguf.constants import GGUFValueType

from ..errors import ModelFileError, UnsupportedError
from .qtypes import SUPPORTED, SUPPORTED_NAMES, block_geometry

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: Q
    shape: tuple[int, int]      # (rows, cols): cols = GGUF ne[0], the contiguous, quantized axis
    raw: np.ndarray             # uint8 [rows, row_bytes], a view into the memory map


class GgufFile:
    """Metadata (plain Python values) and tensors of one GGUF file."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ModelFileError(f"model file not found: {path}")
        if os.path.isdir(path):
            raise ModelFileError(f"model path is a directory, not a GGUF file: {path}")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"not a GGUF file (bad magic {magic!r}): {path}")
        try:
            reader = GGUFReader(path, "r")
        except Exception as e:  # the gguf package raises assorted errors on damaged files
            raise ModelFileError(f"cannot read GGUF file {path}: truncated or malformed "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        self.path = path
        self.metadata: dict[str, object] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = _field_value(field)
        self.tensors: dict[str, TensorInfo] = {}
        unsupported: dict[str, str] = {}
        for t in reader.tensors:
            qtype = Q(t.tensor_type)
            if qtype not in SUPPORTED:
                unsupported.setdefault(qtype.name, t.name)
                continue
            ne = [int(x) for x in t.shape]
            cols = ne[0]
            rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
            elems, nbytes = block_geometry(qtype)
            expected = rows * (cols // elems) * nbytes
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            if raw.size != expected:
                raise ModelFileError(f"tensor {t.name} has {raw.size} bytes, expected {expected}: "
                                     f"truncated or malformed GGUF {path}")
            self.tensors[t.name] = TensorInfo(t.name, qtype, (rows, cols), raw.reshape(rows, -1))
        if unsupported:
            names = ", ".join(f"{k} (e.g. {v})" for k, v in unsupported.items())
            raise UnsupportedError(f"unsupported tensor type {names}; supported: {SUPPORTED_NAMES}")
        self.architecture = str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default=None):
        """Architecture-scoped key, e.g. arch_key("block_count") -> llama.block_count."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)


def _field_value(field):
    """A GGUF field as a plain Python value (str, int, float, bool or list)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if len(types) > 1 and types[1] == GGUFValueType.ARRAY:
            return None  # nested arrays are not used by any key we read
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    if types[0] == GGUFValueType.BOOL:
        return bool(value)
    return value
