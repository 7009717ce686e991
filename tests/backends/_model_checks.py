"""End-to-end checks shared by the device backends' model tests (Vulkan, CUDA):
a device model against the CPU backend on the same GGUF.

Tolerances: last-token logits NMSE < 1e-5 (or the caller's) against CPU (f32 accumulation in a
different order), the same argmax and identical greedy tokens; with SnapKV, per
layer and KV head >= 95% of the keep set equal to CPU's (near-ties in votes may
swap), identical tokens after compaction, and the device cache holding exactly
the kept rows of the full cache, bit for bit (a branched copy too).
"""
from __future__ import annotations

import numpy as np

from _backends import nmse
from backends.reference import read_rows
from engine.snapkv import SnapKvConfig


def greedy(model, ids, n, snapkv=False):
    """Prefill once, then n greedy tokens: (cache, prompt logits, tokens)."""
    cache, logits = model.prefill(ids, snapkv=snapkv)
    first, tokens = logits, []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = model.forward.decode(tokens[-1], cache)
    return cache, first, tokens


def _pool_rows(model, cache, layer, n_rows):
    """f64 [n_kv, n_rows, head_dim] K and V rows of one layer, read back from the device."""
    b = model.backend
    table = np.asarray(cache.layers[layer]._table)
    return (read_rows(b.download(cache.layers[layer].pool.k_pages), table, n_rows),
            read_rows(b.download(cache.layers[layer].pool.v_pages), table, n_rows))


def check_logits_and_tokens(cpu, dev, ids, n, tol=1e-5):
    _, lc, tc = greedy(cpu, ids, n)
    _, lg, tg = greedy(dev, ids, n)
    assert nmse(lg, lc) < tol
    assert int(np.argmax(lg)) == int(np.argmax(lc))
    assert tg == tc


def check_decode_moves_only_the_logits(model, ids):
    """Per decode token: nothing to the device (the token id is a kernel argument or
    push constant) but, where decode replays a recorded step (engine/replay.py), its
    step buffer (int32: token, position, two per layer); the logits back."""
    cache, logits = model.prefill(ids)
    b = model.backend
    token = int(np.argmax(model.forward.decode(int(np.argmax(logits)), cache)))   # a replay records here
    before = (b.bytes_to_device, b.bytes_to_host)
    model.forward.decode(token, cache)
    step_bytes = 4 * (2 + 2 * model.config.n_layers) if model.forward.replay is not None else 0
    assert b.bytes_to_device - before[0] == step_bytes
    assert b.bytes_to_host - before[1] == 4 * model.config.vocab_size


def check_snapkv(cpu, dev, ids, budget, window, n_tokens, layers):
    cfg = SnapKvConfig(budget=budget, window=window, min_tokens=32)
    cache_c, _, tc = greedy(cpu, ids, n_tokens, snapkv=cfg)
    cache_g, _, tg = greedy(dev, ids, n_tokens, snapkv=cfg)
    assert cache_g.eviction["rows_after"] == budget
    assert cache_g.length == budget + n_tokens and cache_g.logical_length == len(ids) + n_tokens
    for lc, lg in zip(cache_c.layers, cache_g.layers):
        assert lg.last_keep.shape == lc.last_keep.shape == (dev.config.n_kv_heads, budget)
        for h in range(lg.last_keep.shape[0]):
            same = len(np.intersect1d(lg.last_keep[h], lc.last_keep[h]))
            assert same >= 0.95 * budget, f"keep sets differ beyond ties: {same}/{budget}"
    assert tg == tc                                   # greedy continuation after compaction
    full, _ = dev.prefill(ids, snapkv=False)         # the compacted cache = kept rows of the full one
    for layer in layers:
        keep = cache_g.layers[layer].last_keep
        kf, vf = _pool_rows(dev, full, layer, len(ids))
        kc, vc = _pool_rows(dev, cache_g, layer, budget)
        for h in range(keep.shape[0]):
            np.testing.assert_array_equal(kc[h], kf[h, keep[h]])
            np.testing.assert_array_equal(vc[h], vf[h, keep[h]])
    branch = cache_g.copy()                           # kv_copy_pages on the device
    for got, want in zip(_pool_rows(dev, branch, 0, budget), _pool_rows(dev, cache_g, 0, budget)):
        np.testing.assert_array_equal(got, want)



def _head_rows(model, cache, layer):
    """Per KV head, f64 [rows, head_dim] K and V rows of a layer with ragged heads, read
    back from the device through each head's own table."""
    kv, b = cache.layers[layer], model.backend
    k_view, v_view = (b.download(a) for a in kv.pool.head_view())
    return [(read_rows(k_view, kv._head_tables[h], int(n))[0], read_rows(v_view, kv._head_tables[h], int(n))[0])
            for h, n in enumerate(kv.head_len)]


def check_adaptive(cpu, dev, ids, budget, window, n_tokens):
    """allocation="adaptive" on the device: each layer's KV heads keep their own number
    of rows (summing to n_kv_heads x budget), each head holds exactly its kept rows of
    the full cache (through its own page table: the layer holds only the pages they
    fill), and decoding appends to each head (greedy tokens equal the CPU backend's,
    which computes its own keep sets)."""
    cfg = SnapKvConfig(budget=budget, window=window, min_tokens=32, allocation="adaptive")
    _, _, tc = greedy(cpu, ids, n_tokens, snapkv=cfg)
    cache, _, tg = greedy(dev, ids, n_tokens, snapkv=cfg)
    full, _ = dev.prefill(ids, snapkv=False)
    H, ps, ragged = dev.config.n_kv_heads, dev.forward.page_size, 0
    for layer, kv in enumerate(cache.layers):
        sets = kv.last_keep
        lengths = [len(k) for k in sets]
        assert sum(lengths) == H * budget and kv.length == max(lengths) + n_tokens
        kf, vf = _pool_rows(dev, full, layer, len(ids))
        if len(set(lengths)) == 1:
            continue
        ragged += 1
        assert kv.ragged and kv.n_pages == -(-sum(-(-(n + n_tokens) // ps) for n in lengths) // H)
        for h, ((kc, vc), keep) in enumerate(zip(_head_rows(dev, cache, layer), sets)):
            assert len(kc) == len(keep) + n_tokens
            np.testing.assert_array_equal(kc[:len(keep)], kf[h, keep])
            np.testing.assert_array_equal(vc[:len(keep)], vf[h, keep])
    assert ragged > 0, "every layer kept equal sets: the check would not see ragged heads"
    assert tg == tc

def check_decode_batch(cpu, dev, prompts, n_steps=3, tol=1e-5):
    """Batched decode on the device over caches of different lengths (the first
    compacted by SnapKV) equals the device decoding each sequence alone (within `tol`
    NMSE, same argmax; a last step with argmax=True, the same ids), and the uncompacted
    ones stay near the CPU backend's logits.
    (A compacted cache is compared with the device's own: the CPU may keep a near-tie
    row instead, see check_snapkv.)"""
    snap = SnapKvConfig(budget=32, window=8, min_tokens=32)

    def start(model):
        out = []
        for i, ids in enumerate(prompts):
            cache, logits = model.prefill(ids, snapkv=snap if i == 0 else False)
            out.append([cache, int(np.argmax(logits))])
        return out

    got, ref = start(dev), start(cpu)
    alone = [[cache.copy(), token] for cache, token in got]       # branched on the device
    assert got[0][0].eviction is not None
    for _ in range(n_steps):
        rows = dev.forward.decode_batch([t for _, t in got], [c for c, _ in got])
        for i, row in enumerate(rows):
            expect = dev.forward.decode(alone[i][1], alone[i][0])
            assert nmse(row, expect) < tol and int(np.argmax(row)) == int(np.argmax(expect))
            if i > 0:
                assert nmse(row, cpu.forward.decode(ref[i][1], ref[i][0])) < max(tol, 1e-4)
            got[i][1] = alone[i][1] = ref[i][1] = int(np.argmax(expect))
    # a greedy batch's step: each row's argmax (argmax_rows on the device where it has it)
    best = dev.forward.decode_batch([t for _, t in got], [c for c, _ in got], argmax=True)
    assert best.tolist() == [int(np.argmax(dev.forward.decode(t, c))) for c, t in alone]
