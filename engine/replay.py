"""Decode of one sequence as a recorded step, replayed token after token.

On a GPU a small model's decode token costs more host time than device time: a
launch per op and layer from Python (SmolLM2: 334 a token). DecodeReplay runs the
first token of a cache as usual while the backend records its launches
(backends/base.py: record_step), with every value that changes from token to token
read by the kernels from a small step buffer instead of passed as an argument:

    slot 0            the token id                 (TOKEN_SLOT)
    slot 1            its position                 (POSITION_SLOT)
    slot 2 + 2 l      layer l's row the K/V go to  (row_slot(l))
    slot 3 + 2 l      layer l's rows attended      (row_slot(l) + 1)

Every later token does the cache's page bookkeeping on the host (pages reserved,
tables updated in place, lengths advanced), writes the step buffer and replays the
recording (backend.replay: CUDA on a GPU, one graph launch, on the CPU harness the
launches one by one; Vulkan, the recorded command buffer submitted again), then
downloads the logits. A recording is valid while every
array it bound is the one the step would bind: the cache's page tables, pools and
merged-row biases (compared by identity; the recording holds them, so an identity
cannot be reused while it lives) and the ForwardPass's scratch and weights (fixed);
tables change in place and row counts are values, so page growth, sliding-window
rings and a SnapKV compaction replay the same recording. Another cache, a cache
whose arrays changed, or one whose KV heads hold their own rows (adaptive budgets:
not replayed) records or runs afresh. A backend may decline to keep a recording
(record_step returns None: the step was not recorded whole); the next token records
again. `stats` counts recordings (kept or not) and replays.
"""
from __future__ import annotations

import weakref

import numpy as np

TOKEN_SLOT, POSITION_SLOT = 0, 1


def row_slot(layer: int) -> int:
    """Slot of layer's write row; the next slot holds the rows it attends."""
    return 2 + 2 * layer


class DecodeReplay:
    """ForwardPass.decode through recorded steps (the module docstring)."""

    def __init__(self, forward):
        self.forward = forward
        self._key: tuple | None = None
        self._recording = None
        self._owner = None                   # weakref.finalize dropping the recording with its cache
        self.stats = {"recordings": 0, "replays": 0}

    @staticmethod
    def supported(backend) -> bool:
        return hasattr(backend, "record_step") and hasattr(backend, "replay")

    @staticmethod
    def usable(cache) -> bool:
        return not any(kv.ragged for kv in cache.layers)

    def decode(self, token: int, cache) -> np.ndarray:
        """ForwardPass.decode: one token at position cache.logical_length -> host f32 logits."""
        from .forward import finite
        fp = self.forward
        token = int(token)
        if not 0 <= token < fp.cfg.vocab_size:
            raise ValueError(f"token id {token} outside the vocabulary [0, {fp.cfg.vocab_size})")
        layers = cache.layers
        for kv in layers:                    # pages first: a full cache fails before any write
            kv.reserve(1)
        key = (id(cache),) + tuple((id(kv.page_table()), id(kv.pool.k_pages), id(kv.pool.v_pages), id(kv.bias()))
                                   for kv in layers)
        values = np.empty(row_slot(len(layers)), dtype=np.int32)
        values[TOKEN_SLOT], values[POSITION_SLOT] = token, cache.logical_length
        rows = values[row_slot(0):].reshape(len(layers), 2)   # per layer: write row, rows attended
        rows[:, 0] = [kv.length for kv in layers]
        rows[:, 1] = rows[:, 0] + 1
        s = fp._decode_scratch
        if key == self._key:
            fp.backend.replay(self._recording, values)
            for kv in layers:
                kv.advance(1)
            self.stats["replays"] += 1
        else:
            self.forget()

            def step():
                fp._forward(np.array([token], dtype=np.int32), [(cache, 1)], s, step=True)
                fp._head_logits(s, 1, 0)
            self._recording = fp.backend.record_step(values, step, max_position=fp.max_ctx, readback=s.logits[:1])
            self.stats["recordings"] += 1
            if self._recording is not None:  # None: the backend could not record the step whole
                self._key = key
                self._owner = weakref.finalize(cache, self.forget)
        return finite(fp.backend.download(s.logits[:1]))[0]

    def forget(self) -> None:
        """Drop the recording (and the arrays it holds)."""
        if self._owner is not None:
            self._owner.detach()
        self._key = self._recording = self._owner = None
