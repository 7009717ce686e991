"""Decode steps recorded once and replayed token after token.

On a GPU a small model's decode token costs more host time than device time: a
launch per op and layer from Python (SmolLM2: 334 a token). DecodeReplay runs the
first step of a cache (or of a batch of caches: ForwardPass.decode_batch) as usual
while the backend records its launches (backends/base.py: record_step), with every
value that changes from token to token read by the kernels from a small step buffer
instead of passed as an argument. For a step of n sequences (n = 1: decode):

    slots 0 .. n-1                 their token ids                (TOKEN_SLOT on)
    slots n .. 2n-1                their positions                (position_slot)
    slot 2n + 2 (l n + i)          layer l's row sequence i's K/V go to   (row_slot)
    the slot after it              the rows sequence i attends in layer l

Every later step does the caches' page bookkeeping on the host (pages reserved,
tables updated in place, lengths advanced), writes the step buffer and replays the
recording (backend.replay: CUDA on a GPU, one graph launch, on the CPU harness the
launches one by one; Vulkan, the recorded command buffer submitted again); the
ForwardPass downloads the logits. A recording is valid while every array it bound is
the one the step would bind: each cache's page tables, pools and merged-row biases,
in the batch's order, their layers' key centres, and the scratch (compared by identity;
the kept recording holds them, so an identity cannot be reused while it lives) and the
ForwardPass's weights (fixed); tables change in place and row counts are values, so
page growth, sliding-window rings and a SnapKV compaction replay the same recording.
One recording is kept per batch size (a server alternates between a few) and output
(the logits, or for greedy decoding their argmax: ForwardPass.decode_argmax,
decode_batch with argmax); other caches,
another batch membership or order, or arrays that changed record afresh, as do caches
whose KV heads hold their own rows (adaptive budgets: never replayed). A backend may
decline to keep a recording (record_step returns None: the step was not recorded
whole; CUDA's batched steps of more sequences than its mat-vec takes, whose projections
run as GEMMs); the next step records again. The ForwardPass's decode_counters count
recordings (kept or not) and replays.
"""
from __future__ import annotations

import weakref

import numpy as np

from backends.base import StepValue, StepValues


TOKEN_SLOT = 0      # the first of a step's token ids (one a sequence, in batch order)


def position_slot(n: int = 1) -> int:
    """First slot of a step of n sequences' positions."""
    return n


def row_slot(layer: int, seq: int = 0, n: int = 1) -> int:
    """Slot of the row sequence `seq` (of n) writes in `layer`; the next slot holds the
    rows it attends there."""
    return 2 * n + 2 * (layer * n + seq)


def step_ids(ids: np.ndarray, positions: np.ndarray) -> tuple[StepValues, StepValues]:
    """A recorded step's token ids and positions as the ops take them."""
    n = len(ids)
    return StepValues(ids, TOKEN_SLOT), StepValues(positions, position_slot(n))


def step_rows(start_row: int, layer: int, seq: int, n: int) -> tuple[StepValue, StepValue]:
    """A recorded step's write row and rows attended of one sequence in one layer."""
    slot = row_slot(layer, seq, n)
    return StepValue(start_row, slot), StepValue(start_row + 1, slot + 1)


class DecodeReplay:
    """ForwardPass.decode and decode_batch through recorded steps (the module docstring)."""

    def __init__(self, forward):
        self.forward = forward
        # (batch size, argmax) -> (key, recording, scratch, cache finalizers, the arrays in key)
        self._kept: dict[tuple[int, bool], tuple] = {}
        self._replayed: set[tuple[int, bool]] = set()    # recordings replayed once: their graph exists
        self.steady = False      # the last step replayed a recording replayed before (CUDA: its
                                 # graph captured then, not in this step)

    @property
    def stats(self) -> dict:
        c = self.forward.decode_counters
        return {"recordings": c["recordings"], "replays": c["replays"]}

    @staticmethod
    def supported(backend) -> bool:
        return hasattr(backend, "record_step") and hasattr(backend, "replay")

    @staticmethod
    def usable(caches) -> bool:
        """Not for ragged heads, nor for an empty layer whose keys are centred: its first
        write sets the centre, which a recorded step cannot read back (that step runs
        fresh; the next ones record)."""
        return not any(kv.ragged or (kv.logical_length == 0 and kv.pool.k_dtype != "bf16")
                       for cache in caches for kv in cache.layers)

    def step(self, tokens, caches: list, s, argmax: bool = False):
        """The work of one decode step of caches[i] taking tokens[i] at its logical length,
        in the scratch s: the backend array of their logits [n, vocab], or with `argmax` of
        the logits' argmax_rows [n] (a recording of its own)."""
        fp = self.forward
        counters = fp.decode_counters
        tokens = [int(t) for t in tokens]
        n = len(caches)
        for cache in caches:                 # pages first: a full cache fails before any write
            for kv in cache.layers:
                kv.reserve(1)
        bound = [(kv.page_table(), kv.pool.k_pages, kv.pool.v_pages, kv.bias(), kv.key_centre)
                 for cache in caches for kv in cache.layers]
        key = (id(s),) + tuple(id(c) for c in caches) + tuple(id(a) for arrays in bound for a in arrays)
        n_layers = len(caches[0].layers)
        values = np.empty(row_slot(n_layers, 0, n), dtype=np.int32)
        values[TOKEN_SLOT:TOKEN_SLOT + n] = tokens
        values[position_slot(n):position_slot(n) + n] = [c.logical_length for c in caches]
        rows = values[row_slot(0, 0, n):].reshape(n_layers, n, 2)   # per layer and sequence: write row, rows attended
        rows[:, :, 0] = [[cache.layers[li].length for cache in caches] for li in range(n_layers)]
        rows[:, :, 1] = rows[:, :, 0] + 1
        out = s.ids[:n] if argmax else s.logits[:n]
        # positions the RoPE table a recording binds must hold: the context, doubled while a
        # compacted cache's positions pass it (rows stay few; positions keep counting)
        top, limit = max(c.logical_length for c in caches), fp.max_ctx
        while limit <= top:
            limit *= 2
        kept = self._kept.get((n, argmax))
        self.steady = False
        if kept is not None and kept[0] == key and top < kept[5]:
            fp.backend.replay(kept[1], values)
            self.steady = (n, argmax) in self._replayed
            self._replayed.add((n, argmax))          # (once replayed whole: CUDA's graph captured)
            for cache in caches:
                for kv in cache.layers:
                    kv.advance(1)
            counters["replays"] += 1
        else:
            self.forget(n, argmax)

            def run():
                fp._forward(np.array(tokens, dtype=np.int32), [(c, 1) for c in caches], s, step=True)
                fp._step_output(s, n, argmax)
            recording = fp.backend.record_step(values, run, max_position=limit, readback=out)
            counters["recordings"] += 1
            if recording is not None:        # None: the backend could not record the step whole
                # a cache collected drops this recording (its ids could be reused), not the others
                owners = [weakref.finalize(c, self.forget, n, argmax) for c in caches]
                self._kept[(n, argmax)] = (key, recording, s, owners, bound, limit)   # bound: ids stay theirs
        return out

    def forget(self, n: int | None = None, argmax: bool | None = None) -> None:
        """Drop the recordings of batch size n (None: every size), with or without argmax
        (None: both), and the arrays they hold."""
        for size_argmax in [k for k in self._kept if n in (None, k[0]) and argmax in (None, k[1])]:
            kept = self._kept.pop(size_argmax, None)
            self._replayed.discard(size_argmax)
            if kept is not None:
                for owner in kept[3]:
                    owner.detach()
