"""Write a smaller GGUF from a real one: some of its layers, optionally fewer vocabulary rows.

    cut_gguf(src, dst, layers=range(2))                  first two blocks, all else kept
    cut_gguf(src, dst, layers=range(2), n_vocab=4096)    ... and the first 4096 tokens only
    cut_gguf(src, dst, layers=[0, 1] * 15)               the blocks repeated to 30 (real shape, for speed)

Every metadata key is copied with its GGUF type; `<arch>.block_count` becomes len(layers)
and block `layers[i]` of the source is written as block i. Tensors are copied raw, in
their quantized types (never dequantized), so a kept block is byte for byte the source's.

n_vocab keeps the first n_vocab rows of token_embd (and of an untied output head) and
the first n_vocab entries of tokenizer.ggml.tokens / token_type / scores; BPE merges that
name a dropped token are dropped. The tokenizer is then a cut of the real one (the same
ids for the tokens it keeps; text needing a dropped token splits into kept pieces), not the
real one. A special-token id (bos, eos, ...) at or above n_vocab is an error.

`metadata` overrides values of keys that exist (same type), e.g. {"llama.context_length": 32768}.
Needs the `gguf` package (GGUFReader / GGUFWriter). Command line:

    python tools/gguf_cut.py SRC DST --layers 2 [--vocab 4096] [--repeat-to 30] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Iterable

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

_HEADER = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")   # written by GGUFWriter itself
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_VOCAB_ROWS = ("token_embd.weight", "output.weight")
_VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def _field_value(field):
    """(value, vtype, sub_type) of a reader field, as GGUFWriter.add_key_value takes them."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else GGUFValueType.INT32
        return list(field.contents()), vtype, sub
    return field.contents(), vtype, None


def _keep_merge(line: str, kept: set[str]) -> bool:
    parts = line.split(" ")
    return len(parts) == 2 and parts[0] in kept and parts[1] in kept and parts[0] + parts[1] in kept


def cut_gguf(src, dst, layers: Iterable[int], n_vocab: int | None = None,
             metadata: dict | None = None) -> dict:
    """Write dst from src (see the module docstring). Returns a summary dict."""
    layers = [int(i) for i in layers]
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n_src = int(r.fields[f"{arch}.block_count"].contents())
    if not layers or min(layers) < 0 or max(layers) >= n_src:
        raise ValueError(f"layers {layers} out of range: {src} has {n_src} blocks")
    vocab_src = next(t.shape[-1] for t in r.tensors if t.name == "token_embd.weight")   # gguf shape: (cols, rows)
    if n_vocab is not None and not 0 < n_vocab <= vocab_src:
        raise ValueError(f"n_vocab {n_vocab} out of range 1..{vocab_src}")
    cut_vocab = n_vocab is not None and n_vocab < vocab_src
    overrides = dict(metadata or {})
    overrides[f"{arch}.block_count"] = len(layers)

    w = GGUFWriter(str(dst), arch, use_temp_file=False)
    kept_tokens: set[str] = set()
    for name, field in r.fields.items():
        if name in _HEADER or name == "general.architecture":
            continue
        value, vtype, sub = _field_value(field)
        if name in overrides:
            value = overrides.pop(name)
        if cut_vocab:
            if name in _VOCAB_ARRAYS:
                value = value[:n_vocab]
                if name == "tokenizer.ggml.tokens":
                    kept_tokens = set(value)
            elif name == "tokenizer.ggml.merges":
                value = None                           # filtered once the kept tokens are known
            elif re.fullmatch(r"tokenizer\.ggml\.\w+_token_id", name) and int(value) >= n_vocab:
                raise ValueError(f"{name} = {value} is not below n_vocab {n_vocab}")
            elif name == f"{arch}.vocab_size":
                value = n_vocab
        if value is not None:
            w.add_key_value(name, value, vtype, sub)
    if cut_vocab and "tokenizer.ggml.merges" in r.fields:
        merges = [m for m in r.fields["tokenizer.ggml.merges"].contents() if _keep_merge(m, kept_tokens)]
        w.add_key_value("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING)
    if overrides:
        raise ValueError(f"metadata keys not in {src}: {sorted(overrides)}")

    by_name = {t.name: t for t in r.tensors}
    out_names = [t.name for t in r.tensors if not _BLOCK.match(t.name)]
    suffixes: dict[int, list[str]] = {}                # source block -> its tensor names after "blk.N."
    for t in r.tensors:
        if m := _BLOCK.match(t.name):
            suffixes.setdefault(int(m.group(1)), []).append(m.group(2))
    renamed = [(f"blk.{i}.{suffix}", f"blk.{src_layer}.{suffix}")
               for i, src_layer in enumerate(layers) for suffix in suffixes[src_layer]]
    plan = [(n, n) for n in out_names] + renamed
    n_bytes = 0
    for out, src_name in plan:
        t = by_name[src_name]
        data = np.asarray(t.data)                     # numpy order: (rows, row bytes) for quantized types
        if cut_vocab and src_name in _VOCAB_ROWS:
            data = data[:n_vocab]
        w.add_tensor(out, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
        n_bytes += data.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"architecture": arch, "layers": layers, "n_vocab": n_vocab or vocab_src,
            "vocab_source": vocab_src, "blocks_source": n_src, "tensor_bytes": n_bytes}


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/gguf_cut.py", description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True, help="keep the first N blocks")
    ap.add_argument("--repeat-to", type=int, help="repeat the kept blocks cyclically to this many")
    ap.add_argument("--vocab", type=int, help="keep the first N tokens (embedding rows, tokenizer)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a metadata value")
    a = ap.parse_args(argv)
    layers = list(range(a.layers))
    if a.repeat_to:
        layers = [layers[i % len(layers)] for i in range(a.repeat_to)]
    meta = dict((k, _parse_value(v)) for k, v in (s.split("=", 1) for s in a.set))
    print(cut_gguf(a.src, a.dst, layers, a.vocab, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
