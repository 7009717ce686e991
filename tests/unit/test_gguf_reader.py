"""Our GGUF header parser against the `gguf` package's GGUFReader: the same
metadata values and the same tensor bytes, on SmolLM2 and on small
models of every supported tensor type; malformed headers are one-line errors."""
import os
import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGMLQuantizationType as Q
from gguf.constants import GGUFValueType

from engine.errors import ModelFileError, UnsupportedError
from engine.gguf import GgufFile
from tiny_gguf import write_tiny_gguf


def reference_value(field):
    """A GGUFReader field as a plain Python value (nested arrays: None)."""
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if types[1] == GGUFValueType.ARRAY:
            return None
        values = [field.parts[i].tolist()[0] for i in field.data]
        return [bool(v) for v in values] if types[1] == GGUFValueType.BOOL else values
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value


def assert_same_as_gguf_reader(path):
    ours, ref = GgufFile(path), GGUFReader(path, "r")
    want = {k: reference_value(f) for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == want.keys()
    for key, value in want.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == Q(t.tensor_type)
        ne = [int(x) for x in t.shape]
        assert mine.shape == (int(np.prod(ne[1:])) if len(ne) > 1 else 1, ne[0])
        assert np.array_equal(mine.raw.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8)), t.name


def test_smollm2_matches_gguf_reader(smollm2_path):
    assert_same_as_gguf_reader(str(smollm2_path))


def _rss_file_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssFile from Linux /proc")
def test_release_pages_drops_the_file_from_rss_and_keeps_tensors_readable(smollm2_path):
    """What Model does once the backend holds its weights: the file's pages leave this
    process's RSS, and arrays viewing the file read the same bytes afterwards."""
    g = GgufFile(str(smollm2_path))
    size = sum(t.raw.nbytes for t in g.tensors.values()) / 2**20
    sums = {n: int(t.raw.sum(dtype=np.uint64)) for n, t in g.tensors.items()}      # touches every page
    before = _rss_file_mib()
    g.release_pages()
    assert before - _rss_file_mib() > 0.8 * size
    assert {n: int(t.raw.sum(dtype=np.uint64)) for n, t in g.tensors.items()} == sums


@pytest.mark.parametrize("kw", [dict(), dict(qtype=Q.Q8_0), dict(arch="qwen2", qtype=Q.Q4_1),
                                dict(dim=256, ffn_dim=256, qtype=Q.Q4_K), dict(dim=256, ffn_dim=256, qtype=Q.Q6_K),
                                dict(qtype=Q.F16, rope_scaling=("linear", 2.0))],
                         ids=["f32", "q8_0", "qwen2-q4_1", "q4_k", "q6_k", "f16-linear"])
def test_small_models_match_gguf_reader(tmp_path, kw):
    assert_same_as_gguf_reader(str(write_tiny_gguf(tmp_path / "m.gguf", **kw)))


def _patched(tmp_path, tiny_llama, offset, fmt, value):
    data = bytearray(open(tiny_llama, "rb").read())
    struct.pack_into(fmt, data, offset, value)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    return str(p)


def test_bad_versions_are_refused(tmp_path, tiny_llama):
    with pytest.raises(UnsupportedError, match="GGUF version 1 is not supported"):
        GgufFile(_patched(tmp_path, tiny_llama, 4, "<I", 1))
    with pytest.raises(UnsupportedError, match="big-endian GGUF"):
        GgufFile(_patched(tmp_path, tiny_llama, 4, ">I", 3))


def test_absurd_counts_and_types_are_malformed(tmp_path, tiny_llama):
    with pytest.raises(ModelFileError, match="truncated or malformed"):
        GgufFile(_patched(tmp_path, tiny_llama, 8, "<Q", 2 ** 60))          # tensor count
    first_key_len = struct.unpack_from("<Q", open(tiny_llama, "rb").read(), 24)[0]
    with pytest.raises(ModelFileError, match="truncated or malformed"):
        GgufFile(_patched(tmp_path, tiny_llama, 32 + first_key_len, "<I", 77))   # value type of the first key


def test_arrays_nested_past_any_use_are_malformed_not_a_recursion_error(tmp_path):
    """One key whose value is arrays of arrays 3000 deep (36 KB): a one-line ModelFileError."""
    key = b"deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * 3000 + struct.pack("<IQ", 4, 0)
    p = tmp_path / "deep.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    with pytest.raises(ModelFileError, match="truncated or malformed.*nested more than 8 deep"):
        GgufFile(str(p))


def test_a_path_that_is_not_a_regular_file_is_refused_without_reading(tmp_path):
    import os
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)                           # reading it would block for ever
    with pytest.raises(ModelFileError, match="model path is not a regular file"):
        GgufFile(str(fifo))


def _header(kvs: bytes, n_kv: int, tensors: bytes = b"", n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors


def _key(name: str, vtype: int, payload: bytes) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype) + payload


def _text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<Q", len(raw)) + raw


def test_a_metadata_key_given_twice_is_malformed_not_last_one_wins(tmp_path):
    """As gguf-py and llama.cpp refuse it: which architecture would be meant?"""
    p = tmp_path / "twice.gguf"
    p.write_bytes(_header(_key("general.architecture", 8, _text("llama"))
                          + _key("general.architecture", 8, _text("qwen2")), 2))
    with pytest.raises(ModelFileError, match="metadata key 'general.architecture' appears twice"):
        GgufFile(str(p))


def test_a_junk_array_is_refused_before_it_is_expanded(tmp_path):
    """5M one-byte values (5 MB): refused by its count, not turned into a 5M-element list."""
    n = (1 << 22) + 1
    p = tmp_path / "junk.gguf"
    p.write_bytes(_header(_key("junk", 9, struct.pack("<IQ", 7, n) + bytes(n)), 1))
    with pytest.raises(ModelFileError, match=f"an array of {n} values"):
        GgufFile(str(p))


def test_a_tensor_name_past_ggufs_64_bytes_is_malformed_in_a_short_message(tmp_path):
    name = "blk.0." + "x" * 100_000
    tensor = _text(name) + struct.pack("<I", 1) + struct.pack("<Q", 32) + struct.pack("<IQ", 0, 0)
    p = tmp_path / "long.gguf"
    p.write_bytes(_header(_key("general.architecture", 8, _text("llama")), 1, tensor, 1) + bytes(256))
    with pytest.raises(ModelFileError, match="longer than GGUF's 64 bytes") as info:
        GgufFile(str(p))
    assert len(str(info.value)) < 300


def test_a_layer_index_of_other_digits_is_not_a_crash(tmp_path):
    """"²".isdigit() is True but int("²") fails: such a tensor is not a layer's."""
    from engine.gguf import model_config
    path = write_tiny_gguf(tmp_path / "m.gguf", extra_tensors={"blk.\u00b2.attn_norm.weight": np.ones(64, np.float32)})
    assert model_config(GgufFile(path)).n_layers == 2
