"""Fuzz worker for test_gguf_fuzz.py: mutated GGUF files through the whole load path.

Run as a child process so it can cap its own memory: after a warm-up load it sets
RLIMIT_AS to its current size plus MEMORY_HEADROOM, then loads every case with a
per-case alarm. A case passes when it raises an EngineError whose message is one
line, or loads and produces finite logits. Anything else (another exception, the
alarm, a MemoryError from the cap) is a failure. Prints one JSON report on stdout.

    python tests/unit/_gguf_fuzz.py SEED N_RANDOM WORKDIR [REAL_MODEL.gguf]
"""
from __future__ import annotations

import json
import pathlib
import resource
import signal
import struct
import sys
import time
import traceback

import numpy as np

_TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TESTS.parent)]          # the project (backends/, models/), as under pytest
sys.path.append(str(_TESTS))                 # tests/tiny_gguf.py

CASE_SECONDS = 10            # per case; a valid tiny model loads and runs in ~0.1 s
MEMORY_HEADROOM = 2 << 30    # bytes of address space a case may add

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def header_fields(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, kind) of every length, count, type and value field of a valid
    GGUF header. kind: count | length | vtype | value | dim | ttype | offset."""
    out, pos = [], 8
    out += [(pos, 8, "count"), (pos + 8, 8, "count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def string():
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        out.append((pos, 8, "length"))
        pos += 8 + n

    def value(vtype):
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, pos)
            out.extend([(pos, 4, "vtype"), (pos + 4, 8, "count")])
            pos += 12
            for _ in range(count):
                value(etype)
        else:
            out.append((pos, _SCALAR_SIZES[vtype], "value"))
            pos += _SCALAR_SIZES[vtype]

    for _ in range(n_kv):
        string()
        vtype = struct.unpack_from("<I", data, pos)[0]
        out.append((pos, 4, "vtype"))
        pos += 4
        value(vtype)
    for _ in range(n_tensors):
        string()
        n_dims = struct.unpack_from("<I", data, pos)[0]
        out.append((pos, 4, "count"))
        pos += 4
        out += [(pos + 8 * i, 8, "dim") for i in range(n_dims)]
        pos += 8 * n_dims
        out += [(pos, 4, "ttype"), (pos + 4, 8, "offset")]
        pos += 12
    return out


def _hostile_int(rng, size: int, original: int) -> int:
    top = (1 << (8 * size)) - 1
    choices = [0, 1, 2, top, top - 1, top >> 1, 1 << (8 * size - 1), original + 1, max(original - 1, 0),
               original * 2, original * 1000, int(rng.integers(0, 1 << 16)), int(rng.integers(0, 1 << 31))]
    return choices[int(rng.integers(len(choices)))] & top


def byte_mutations(base: bytes, rng, n: int):
    """(description, bytes) of n random mutations of a valid GGUF: truncations, byte
    flips, hostile counts, lengths, dimensions and offsets, type swaps."""
    fields = header_fields(base)
    header_end = max(off + size for off, size, _ in fields)
    for i in range(n):
        kind = ("truncate", "flip", "field", "field", "field", "type")[int(rng.integers(6))]
        data = bytearray(base)
        if kind == "truncate":
            cut = int(rng.integers(4, header_end + 64)) if rng.random() < 0.7 else int(rng.integers(4, len(base)))
            yield f"truncate at {cut}", bytes(data[:cut])
            continue
        if kind == "flip":
            spots = [int(rng.integers(8, header_end)) for _ in range(int(rng.integers(1, 5)))]
            for p in spots:
                data[p] ^= 1 << int(rng.integers(8))
            yield f"flip bytes {spots}", bytes(data)
            continue
        if kind == "type":
            pool = [f for f in fields if f[2] in ("vtype", "ttype")]
        else:
            pool = [f for f in fields if f[2] not in ("vtype", "ttype")]
        off, size, what = pool[int(rng.integers(len(pool)))]
        original = int.from_bytes(data[off:off + size], "little")
        new = int(rng.integers(0, 42)) if kind == "type" else _hostile_int(rng, size, original)
        data[off:off + size] = new.to_bytes(size, "little")
        yield f"{what} at byte {off}: {original} -> {new}", bytes(data)


def semantic_cases(workdir: pathlib.Path, rng, n_random: int):
    """(description, path) of tiny models with hostile metadata values and tensor shapes."""
    from gguf import GGMLQuantizationType as Q, GGUFValueType as T

    from tiny_gguf import write_tiny_gguf

    keys = ["{arch}.block_count", "{arch}.embedding_length", "{arch}.feed_forward_length",
            "{arch}.attention.head_count", "{arch}.attention.head_count_kv", "{arch}.attention.key_length",
            "{arch}.rope.dimension_count", "{arch}.rope.freq_base", "{arch}.context_length",
            "{arch}.attention.layer_norm_rms_epsilon", "{arch}.rope.scaling.factor", "general.alignment",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
            "tokenizer.chat_template", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "general.architecture"]
    values = [(0, T.UINT32), (1, T.UINT32), (3, T.UINT32), (2**32 - 1, T.UINT32), (2**31, T.UINT32),
              (-1, T.INT32), (2**63, T.UINT64), (float("nan"), T.FLOAT32), (float("inf"), T.FLOAT32),
              (-1e4, T.FLOAT32), (0.0, T.FLOAT32), (1e30, T.FLOAT64), (2.0, T.FLOAT32), ("2", T.STRING),
              ("", T.STRING), ("\xff\x00garbage", T.STRING), (True, T.BOOL), ([2, 3], T.ARRAY), ([], T.ARRAY)]
    fixed = {
        "layers 0": {"{arch}.block_count": (0, T.UINT32)},
        "layers as string": {"{arch}.block_count": ("2", T.STRING)},
        "layers as float": {"{arch}.block_count": (2.0, T.FLOAT32)},
        "layers 2^32-1": {"{arch}.block_count": (2**32 - 1, T.UINT32)},
        "heads 0": {"{arch}.attention.head_count": (0, T.UINT32)},
        "kv heads 0": {"{arch}.attention.head_count_kv": (0, T.UINT32)},
        "context 2^32-1": {"{arch}.context_length": (2**32 - 1, T.UINT32)},
        "rope base NaN": {"{arch}.rope.freq_base": (float("nan"), T.FLOAT32)},
        "rope base negative": {"{arch}.rope.freq_base": (-10000.0, T.FLOAT32)},
        "norm eps NaN": {"{arch}.attention.layer_norm_rms_epsilon": (float("nan"), T.FLOAT32)},
    }
    for i, (desc, meta) in enumerate(fixed.items()):
        yield desc, write_tiny_gguf(workdir / f"fixed{i}.gguf", metadata=meta)
    short = np.zeros((200, 64), np.float32).view(np.uint8)
    yield "embedding rows < tokens", write_tiny_gguf(workdir / "short.gguf",
                                                      tensor_overrides={"token_embd.weight": (short, Q.F32)})
    nan = np.full((64, 64), np.nan, np.float32).view(np.uint8)
    yield "NaN weights", write_tiny_gguf(workdir / "nan.gguf", tensor_overrides={"blk.0.attn_q.weight": (nan, Q.F32)})
    for i in range(n_random):
        picks = {keys[int(rng.integers(len(keys)))]: values[int(rng.integers(len(values)))]
                 for _ in range(int(rng.integers(1, 3)))}
        desc = "metadata " + ", ".join(f"{k}={v[0]!r}:{v[1].name}" for k, v in picks.items())
        try:
            path = write_tiny_gguf(workdir / f"meta{i}.gguf", metadata=picks)
        except Exception:           # the writer itself refuses the value (e.g. -1 as UINT32)
            continue
        yield desc, path


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def check(path) -> str:
    """'loaded' | 'error' for a passing case; raises for a failing one."""
    from engine.config import Settings
    from engine.errors import EngineError
    from engine.model import Model

    try:
        m = Model(path, Settings(backend="cpu", threads=1, ctx=64, snapkv_budget=0))
        for prompt in ([0, 1, 2], "hi there"):
            logits = m.logits(prompt)
            if not np.isfinite(logits).all():
                raise AssertionError("non-finite logits returned without an error")
        return "loaded"
    except EngineError as e:
        text = str(e)
        if not text or "\n" in text:
            raise AssertionError(f"EngineError not one line: {text!r}") from None
        return "error"


def main() -> None:
    seed, n_random, workdir = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
    real = sys.argv[4] if len(sys.argv) > 4 else None
    from tiny_gguf import write_tiny_gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    bases = [pathlib.Path(write_tiny_gguf(workdir / "base_f32.gguf")),
             pathlib.Path(write_tiny_gguf(workdir / "base_q4_1.gguf", qtype=Q.Q4_1, seed=1))]
    assert check(bases[0]) == "loaded"           # warm-up: numba kernels compiled / loaded from cache
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * resource.getpagesize()
    cap = vm_bytes + MEMORY_HEADROOM
    if hard == resource.RLIM_INFINITY or cap < hard:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    signal.signal(signal.SIGALRM, _alarm)

    def cases():
        yield from semantic_cases(workdir, rng, n_random // 3)
        for base in bases:
            for desc, data in byte_mutations(base.read_bytes(), rng, n_random // 3):
                path = workdir / "mutant.gguf"
                path.write_bytes(data)
                yield f"{base.name}: {desc}", path
        if real:                                 # the real model's header, with a truncated data section
            head = pathlib.Path(real).read_bytes()[:4 << 20]
            for desc, data in byte_mutations(head, rng, n_random // 10):
                path = workdir / "real_mutant.gguf"
                path.write_bytes(data)
                yield f"smollm2 header: {desc}", path

    counts, failures, slowest = {"loaded": 0, "error": 0}, [], (0.0, "")
    t_start = time.perf_counter()
    for desc, path in cases():
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
        try:
            counts[check(path)] += 1
        except _Timeout:
            failures.append({"case": desc, "error": f"no answer within {CASE_SECONDS} s"})
        except BaseException as e:              # noqa: BLE001 - every other outcome is a finding
            last = traceback.extract_tb(e.__traceback__)[-1]
            failures.append({"case": desc, "error": f"{type(e).__name__}: {str(e)[:200]}",
                             "where": f"{last.filename}:{last.lineno}"})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        dt = time.perf_counter() - t0
        if dt > slowest[0]:
            slowest = (dt, desc)
    print(json.dumps({"counts": counts, "failures": failures, "seconds": time.perf_counter() - t_start,
                      "slowest": {"seconds": slowest[0], "case": slowest[1]},
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
