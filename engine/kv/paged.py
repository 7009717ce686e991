"""Paged KV cache: one page pool per model cache (or shared by several), one page
table per layer; a layer's pages all lie in one segment (buffer pair) of the pool.

Rows are stored in the pool's KV dtypes (bf16 by default, or a quantized row format
of backends/kvformat.py; keys and values may differ, and named layers may differ from
the rest: each segment holds layers of one format). The cache never looks inside
a row: writes quantize, compaction and branching move whole rows and pages (scales
included), and the byte counts are the formats' real row bytes.

Physical rows (`length`) and logical positions (`logical_length`) are kept
apart: after SnapKV compaction a layer holds fewer rows than tokens processed,
the survivors keep their original RoPE rotation, and the next token is rotated
at `logical_length` but stored at row `length`.

Sliding-window layers (Gemma 3's local layers) attend only to the last `window`
positions. They are never compacted, so their rows are positions and the page
table keeps absolute row numbering; once a step's rows are attended, every page
whose rows all lie below the next query's first visible row goes back to the
pool. Decoding, such a layer is a ring of `ring` = ceil(window / page_size)
pages: table entry j + ring points at the same page as entry j, so row r
overwrites row r - ring * page_size, which no query from r on can see. A
multi-row step (a prefill chunk) writes all its rows before its queries attend,
so it writes to pages of its own (a shared page is copied first) and the layer
holds at most window - 1 + the step's rows (+ a page of rounding); `fold` then
brings it back to `ring` pages by copying the newest page's rows into the
oldest page's unseen slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.kvformat import KvFormat, KvSpec, kv_dtype_name

from ..errors import EngineError
from .merge import EMPTY_BIAS


class KvCacheError(EngineError):
    """An invalid cache operation (bad keep set, out of capacity)."""


class PagePool:
    """Fixed-size pages on one backend, handed out to layers and returned whole.

    The pages live in one or more segments (PageSegment), each a K and a V buffer; a
    layer takes every page from the same segment, so one binding of that segment's
    buffers covers all of its rows. `pages`: an int (one segment for every layer), or
    the pages each layer can come to hold, layer by layer: consecutive layers are then
    grouped into as few segments as keep every buffer within the backend's largest KV
    buffer (`backend.max_kv_buffer_bytes`, None for no limit) and each segment's layers
    in one pair of row formats. `kv`: the formats (a KvSpec or its spelling, "rq4_0",
    "q8_0/rq4_0", "rq4_0:0=q8_0/rq4_0"); layer exceptions need per-layer `pages`.
    """

    def __init__(self, backend, pages, n_kv_heads: int, page_size: int, head_dim: int, kv="bf16"):
        self.backend = backend
        self.n_kv_heads, self.page_size, self.head_dim = n_kv_heads, page_size, head_dim
        self.spec = KvSpec.parse(kv)
        self.k_format, self.v_format = KvFormat.get(self.spec.k, head_dim), KvFormat.get(self.spec.v, head_dim)
        if isinstance(pages, (int, np.integer)):
            if self.spec.layers:
                raise ValueError("PagePool: layer exceptions to the KV dtype need the pages of each layer")
            self.n_layers, groups = None, [(self.spec.k, self.spec.v, [int(pages)])]
        else:
            self.n_layers = len(pages)
            self.spec.check_layers(self.n_layers)
            groups = self._groups([int(p) for p in pages])
        self.segments = [PageSegment(self, sum(g), k, v) for k, v, g in groups]
        self._segment_of = [s for s, (_, _, g) in enumerate(groups) for _ in g]

    def _groups(self, layer_pages: list[int]) -> list[tuple[str, str, list[int]]]:
        """Consecutive layers' page counts, grouped so each group has one pair of row
        formats and its larger buffer fits: (keys, values, [pages of each layer])."""
        limit = getattr(self.backend, "max_kv_buffer_bytes", None)
        groups = []
        for i, n in enumerate(layer_pages):
            k, v = self.spec.at(i)
            page = self.n_kv_heads * self.page_size * max(KvFormat.get(k, self.head_dim).row_bytes,
                                                          KvFormat.get(v, self.head_dim).row_bytes)
            last = groups[-1] if groups else None
            if last is None or last[:2] != (k, v) or (limit and (sum(last[2]) + n) * page > limit):
                groups.append((k, v, []))   # a layer over the limit alone: the backend's allocation says so
            groups[-1][2].append(n)
        return groups

    def empty_like(self) -> "PagePool":
        """A new pool with the same segments and layer layout, every page free."""
        other = object.__new__(PagePool)
        other.__dict__.update(self.__dict__)
        other.segments = [PageSegment(other, s.n_pages, s.k_dtype, s.v_dtype) for s in self.segments]
        return other

    def segment(self, layer: int) -> "PageSegment":
        """The segment layer `layer` takes its pages from."""
        return self.segments[self.segment_index(layer)]

    def segment_index(self, layer: int) -> int:
        return 0 if self.n_layers is None else self._segment_of[layer]

    @property
    def n_pages(self) -> int:
        return sum(s.n_pages for s in self.segments)

    @property
    def free_pages(self) -> int:
        return sum(s.free_pages for s in self.segments)

    @property
    def k_dtype(self) -> str:
        """The keys' format (of every layer the spec names no exception for)."""
        return self.k_format.name

    @property
    def v_dtype(self) -> str:
        return self.v_format.name

    @property
    def kv_dtype(self) -> str:
        """The formats' spelling: "tq4", "q8_0/tq4", "rq4_0:0=q8_0/rq4_0"."""
        return self.spec.name

    @property
    def page_bytes(self) -> int:
        """K + V bytes of one page in the k_dtype/v_dtype formats (quantized rows' scales
        included; a segment of a layer exception has its own page_bytes)."""
        return _page_bytes(self, self.spec.k, self.spec.v)

    @property
    def bytes(self) -> int:
        """Bytes of every page of the pool, each segment in its formats."""
        return sum(s.n_pages * s.page_bytes for s in self.segments)

    @property
    def untouched_bytes(self) -> int:
        """Bytes of the pages never handed out: memory a host backend has reserved but not
        yet committed (the OS maps it on first write), so it is absent from what the OS
        reports taken, and still to be taken."""
        return sum((s.n_pages - s.touched) * s.page_bytes for s in self.segments)


def _page_bytes(pool: PagePool, k_dtype: str, v_dtype: str) -> int:
    """K + V bytes of one page of `pool`'s shape in these row formats (scales included)."""
    return pool.n_kv_heads * pool.page_size * (KvFormat.get(k_dtype, pool.head_dim).row_bytes
                                               + KvFormat.get(v_dtype, pool.head_dim).row_bytes)


class PageSegment:
    """Pages of a PagePool in one pair of backend buffers:
    k_pages: backend storage [n_pages, n_kv_heads, page_size, row_width] of format k_dtype
    v_pages: the same of v_dtype (see backends/kvformat.py; bf16: uint16 [.., head_dim])
    Page ids are the segment's own (0 .. n_pages - 1). (No reference back to the pool: a
    cycle would keep a dropped cache's buffers until Python's cycle collector ran.)"""

    def __init__(self, pool: PagePool, n_pages: int, k_dtype: str, v_dtype: str):
        self.n_pages = n_pages
        self.backend, self.n_kv_heads, self.page_size = pool.backend, pool.n_kv_heads, pool.page_size
        self.k_dtype, self.v_dtype = k_dtype, v_dtype
        self.page_bytes = _page_bytes(pool, k_dtype, v_dtype)
        self.k_pages, self.v_pages = pool.backend.alloc_kv_pool(n_pages, pool.n_kv_heads, pool.page_size,
                                                                pool.head_dim, k_dtype=k_dtype, v_dtype=v_dtype)
        self._free = list(range(n_pages - 1, -1, -1))   # stack: lowest page id handed out first
        self.touched = 0        # pages below it were handed out at least once (written: host memory committed)
        self._head_view = None

    @property
    def kv_dtype(self) -> str:
        """Its rows' formats: "tq4", or "q8_0/tq4" when keys and values differ."""
        return kv_dtype_name(self.k_dtype, self.v_dtype)

    def head_view(self) -> tuple:
        """(k, v): the same buffers seen with one KV head per page, [n_pages * n_kv_heads,
        1, page_size, row_width]: sub-page p * n_kv_heads + h is head h's slot of page p.
        A layer whose KV heads hold different row counts (PagedKvCache.heads) addresses
        each head's rows through its own table of sub-pages, and the ops see one KV head."""
        if self._head_view is None:
            self._head_view = tuple(a.reshape((self.n_pages * self.n_kv_heads, 1) + tuple(a.shape[2:]))
                                    for a in (self.k_pages, self.v_pages))
        return self._head_view

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise KvCacheError("KV page pool exhausted: the context is full")
        page = self._free.pop()
        self.touched = max(self.touched, page + 1)
        return page

    def give(self, page: int) -> None:
        self._free.append(page)


def layer_pages(max_rows: int, page_size: int, window: int = 0, max_step: int | None = None) -> int:
    """Pages one layer can ever hold: the whole context for a full-attention layer
    (window 0); for a sliding-window layer, the rows a step of up to `max_step` new
    rows can touch: the window - 1 rows before it and the step itself, which span at
    most ceil((window - 1 + max_step) / page_size) + 1 pages."""
    full = -(-max_rows // page_size)
    if window <= 0:
        return full
    step = max_rows if max_step is None else max_step
    return min(full, -(-(window - 1 + step) // page_size) + 1)


def _synced(backend, dev, host: np.ndarray, stale: bool):
    """The backend copy of a host page table: uploaded when there is none, updated in
    place when stale (the device buffer, and the pipelines that bind it, stay)."""
    if dev is None:
        return backend.upload(host)
    if stale:
        backend.update(dev, host)
    return dev


@dataclass(frozen=True)
class CompactReport:
    rows_before: int
    rows_after: int
    bytes_before: int
    bytes_after: int


class PagedKvCache:
    """One layer's K/V rows in pages of `pool` (its segment of the cache's PagePool).
    With `window` > 0 a sliding-window layer: the next query (at row `length`) sees rows
    length - window + 1 .. length, and pages wholly below that are returned as soon as
    a step has been attended.

    Ragged heads: after a compaction that leaves the KV heads different row counts
    (adaptive head budgets), each head holds only its own rows: `heads[h]` lists its
    sub-pages (PageSegment.head_view: one head's slot of a page) and `head_len[h]` its
    rows, and the layer holds ceil(sum of the heads' sub-pages / n_kv_heads) pages, a
    spare slot going to whichever head grows next. The ops then run once per KV head
    over the head view with that head's table (ForwardPass._attend)."""

    def __init__(self, pool: PageSegment, max_rows: int, window: int = 0, max_step: int | None = None):
        self.pool = pool
        self.max_rows = max_rows
        self.window = window          # 0: full attention; > 0: positions a query sees (itself included)
        self.max_pages = layer_pages(max_rows, pool.page_size, window, max_step)   # most pages ever held
        self.length = 0               # physical rows in use (sliding-window layer: rows written)
        self.logical_length = 0       # tokens processed: the next RoPE position
        self.first_page = 0           # table index of pages[0]; > 0 once a window layer returned pages
        self.pages: list[int] = []    # page ids by table index first_page.. (a window layer's entry
                                      # i + ring may repeat entry i: one page, see `ring`)
        self.ring = -(-window // pool.page_size) if window else 0   # pages a decoding window layer cycles
        self.intact_from = 0          # rows below this were overwritten by rows sharing their slots
        self._table = np.zeros(-(-max_rows // pool.page_size), dtype=np.int32)   # [max_pages_in_context]
        self._table_dev = None        # backend copy, updated in place when pages change
        self._table_stale = False
        self.last_keep = None         # the last compaction's keep sets: int64 [n_kv_heads, n_keep], or
                                      # a list of one array per KV head when their lengths differ
        self.row_bias: np.ndarray | None = None    # f32 [n_kv_heads, n_bias]: log-counts of rows 0..n_bias-1
        self._bias_dev = None                      # (merged rows, engine/kv/merge.py); never changed in place
        self._head_bias_dev: dict = {}             # ragged heads: head -> its row of row_bias, uploaded
        self.heads: list[list[int]] | None = None  # ragged heads: each head's sub-page ids by table index
        self.head_len: np.ndarray | None = None    # ragged heads: int64 [n_kv_heads] rows of each head
        self._head_tables: np.ndarray | None = None  # int32 [n_kv_heads, max_pages_in_context] of heads
        self._head_dev: list = []                  # backend copies of _head_tables' rows
        self._tables_dev = None                    # backend copy of _head_tables (one-call ops)
        self._head_stale: set[int] = set()
        self._tables_stale = False
        self._free_slots: list[int] = []           # sub-pages of held pages no head uses
        self.key_centre = None        # quantized keys: minus their centre, f32 [1, n_kv_heads*head_dim] on
                                      # the device, set by the layer's first write (ForwardPass._key_centre)
        self.centre_rows = 0          # ... from that many rows (positions 0 .. centre_rows-1)

    @property
    def first_row(self) -> int:
        """Lowest row still held (0 unless a sliding-window layer returned or reused pages)."""
        return max(self.first_page * self.pool.page_size, self.intact_from)

    @property
    def ragged(self) -> bool:
        """Whether the KV heads hold their own rows (different counts, own page tables)."""
        return self.heads is not None

    @property
    def head_rows(self) -> np.ndarray | None:
        """Rows each KV head attends to, int64 [n_kv_heads], when they differ from `length`
        (ragged heads, a merge short of rows); None when every head uses all."""
        rows = self.head_len.copy() if self.ragged else None
        if self.row_bias is not None:
            unseen = (self.row_bias <= EMPTY_BIAS / 2).sum(axis=1)      # filler rows bias EMPTY_BIAS
            if unseen.any():
                rows = (self.length if rows is None else rows) - unseen
        return rows

    @property
    def n_pages(self) -> int:
        """Distinct pages held."""
        return len(set(self.pages)) if self.ring else len(self.pages)

    def _shared(self, j: int) -> bool:
        """Whether table index j uses the same page as index j - ring (both held)."""
        i = j - self.first_page
        return self.ring > 0 and i - self.ring >= 0 and i < len(self.pages) \
            and self.pages[i] == self.pages[i - self.ring]

    def _move_rows(self, dst: int, src: int, n: int) -> None:
        """Rows 0..n-1 of page `src` -> the same slots of page `dst` (whole rows, scales included)."""
        ps = self.pool.page_size
        table = self.pool.backend.upload(np.array([dst, src], dtype=np.int32))
        keep = np.broadcast_to(np.arange(ps, ps + n, dtype=np.int64), (self.pool.n_kv_heads, n))
        self.pool.backend.kv_gather(self.pool.k_pages, self.pool.v_pages, table, np.ascontiguousarray(keep))

    # -- capacity ---------------------------------------------------------------
    def reserve(self, n_new: int, per_head=None) -> None:
        """Make room for rows length .. length + n_new - 1 (of every head: rows
        head_len[h] .. of head h when ragged; `per_head`: head h's own count of new rows)."""
        if per_head is not None:
            new_rows = np.asarray(per_head, dtype=np.int64) + n_new
            need_rows = int((self.head_len + new_rows).max())
        else:
            need_rows = self.length + n_new
        if need_rows > self.max_rows:
            raise KvCacheError(f"KV cache full: {need_rows} rows exceed the context of {self.max_rows}")
        if self.ragged:
            ps = self.pool.page_size
            for h, subs in enumerate(self.heads):
                while len(subs) * ps < self.head_len[h] + (n_new if per_head is None else new_rows[h]):
                    self._set_head(h, len(subs), self._take_slot())
            return
        need_pages = -(-need_rows // self.pool.page_size)
        if need_pages - self.first_page > self.max_pages:
            raise KvCacheError(f"a step of {n_new} rows does not fit a sliding-window layer "
                               f"(window {self.window}, {self.max_pages} pages): steps must be "
                               f"no longer than the prefill chunk the cache was made for")
        ps = self.pool.page_size
        j = self.length // ps
        if n_new > 1 and self._shared(j):    # the step's queries still see the rows its writes would hit
            page = self.pool.take()
            try:
                self._move_rows(page, self.pages[j - self.first_page], ps)
            except BaseException:            # (a device error in the copy) the page goes back
                self.pool.give(page)
                raise
            self._set(j, page)
        while self.first_page + len(self.pages) < need_pages:
            j = self.first_page + len(self.pages)
            if n_new == 1 and self.ring and j - self.ring >= self.first_page:
                page = self.pages[j - self.ring - self.first_page]    # row j * ps overwrites an unseen row
            else:
                page = self.pool.take()
            self.pages.append(page)
            self._set(j, page)

    def _set(self, j: int, page: int) -> None:
        self.pages[j - self.first_page] = page
        self._table[j] = page
        self._table_stale = True

    def advance(self, n: int) -> None:
        """n rows at positions logical_length.. were written at rows length.. and attended.
        A sliding-window layer then returns the pages the next query cannot see."""
        self.length += n
        self.logical_length += n
        if self.ragged:
            self.head_len += n
        if self.window:
            last = self.length - 1
            if self._shared(last // self.pool.page_size):
                self.intact_from = max(self.intact_from, last - self.ring * self.pool.page_size + 1)
            self._release_below(self.length - self.window + 1)

    def fold(self) -> None:
        """A window layer spanning ring + 1 pages (after a multi-row step) goes back to
        `ring` pages: the newest page's rows move into the same slots of the oldest
        page, whose rows there lie below every later query's window, and the newest
        page's table entry then points at the oldest page."""
        if not self.ring or not self.length:
            return
        ps = self.pool.page_size
        j = (self.length - 1) // ps
        if j - self.ring < self.first_page or self._shared(j):
            return
        old, new = self.pages[j - self.ring - self.first_page], self.pages[j - self.first_page]
        self._move_rows(old, new, self.length - j * ps)
        self._set(j, old)
        self.pool.give(new)
        self.intact_from = max(self.intact_from, self.length - self.ring * ps)

    def _release_below(self, row: int) -> None:
        """Return every page whose rows all lie below `row` (table entries stay, unread);
        a page a later table entry still uses stays."""
        below = max(row, 0) // self.pool.page_size       # pages 0 .. below-1 are wholly below
        while self.first_page < below and self.pages:
            self.first_page += 1
            self._give(self.pages.pop(0))

    def _release_from(self, row: int) -> None:
        """Return every page whose rows all lie at or past `row` (0: every page)."""
        end = -(-row // self.pool.page_size)              # table index of the first such page
        while self.pages and self.first_page + len(self.pages) > end:
            self._give(self.pages.pop())
        self._table_stale = True

    def _give(self, page: int) -> None:
        """A page no longer at a table entry goes back to the pool, unless a ring entry still uses it."""
        if page not in self.pages:
            self.pool.give(page)

    def pages_needed(self, more_rows: int) -> int:
        """Pages held at most while `more_rows` rows are appended (never past max_pages)."""
        ps = self.pool.page_size
        if self.ragged:
            slots = sum(-(-min(int(n) + more_rows, self.max_rows) // ps) for n in self.head_len)
            return max(len(self.pages), -(-slots // self.pool.n_kv_heads))
        rows = min(self.length + more_rows, self.max_rows)
        return min(-(-rows // ps) - self.first_page, self.max_pages)

    def truncate(self, n: int) -> None:
        """Rows (= positions: never compacted) n.. are dropped, their pages returned."""
        self.length = self.logical_length = n
        self._release_from(n)
        if n == 0:
            self.key_centre, self.centre_rows = None, 0  # empty again: the next first write sets them

    def release(self) -> None:
        """Every page back to the pool; the layer is empty."""
        self._release_from(0)
        self.first_page = self.length = self.logical_length = self.intact_from = 0
        self.key_centre, self.centre_rows = None, 0      # the next first write sets them
        self.last_keep = None
        self._set_bias(None)
        self._set_heads(None)

    @property
    def host_table(self) -> np.ndarray:
        """The host copy of the page table, int32 [max_pages_in_context] (read only)."""
        return self._table

    def page_table(self):
        """Backend int32 [max_pages_in_context] page table: uploaded once, then updated in
        place when pages change (one device buffer for the cache's life, so the pipelines
        that bind it stay cached). Not for ragged heads (head_table)."""
        if self.ragged:
            raise KvCacheError("a layer whose KV heads hold their own rows has a page table per head")
        self._table_dev = _synced(self.pool.backend, self._table_dev, self._table, self._table_stale)
        self._table_stale = False
        return self._table_dev

    def head_table(self, h: int):
        """Ragged heads: backend int32 [max_pages_in_context] table of head h's sub-pages
        (PageSegment.head_view), kept and updated in place like page_table."""
        self._head_dev[h] = _synced(self.pool.backend, self._head_dev[h], self._head_tables[h], h in self._head_stale)
        self._head_stale.discard(h)
        return self._head_dev[h]

    def head_tables(self):
        """Ragged heads: backend int32 [n_kv_heads, max_pages_in_context], every head's
        table (for the backends' one-call ops), kept and updated in place."""
        self._tables_dev = _synced(self.pool.backend, self._tables_dev, self._head_tables, self._tables_stale)
        self._tables_stale = False
        return self._tables_dev

    def _set_head(self, h: int, j: int, slot: int) -> None:
        subs = self.heads[h]
        if j == len(subs):
            subs.append(slot)
        else:
            subs[j] = slot
        self._head_tables[h, j] = slot
        self._head_stale.add(h)
        self._tables_stale = True

    def _take_slot(self) -> int:
        """A free sub-page of the layer's pages, or of a page newly taken from the pool."""
        if not self._free_slots:
            page = self.pool.take()
            self.pages.append(page)
            H = self.pool.n_kv_heads
            self._free_slots = [page * H + s for s in range(H - 1, -1, -1)]
        return self._free_slots.pop()

    def _set_heads(self, lengths: np.ndarray | None) -> None:
        """Ragged heads from the shared layout (each head's rows 0..lengths[h]-1 where the
        layer's table puts them), or back to the shared layout (None: the layer is empty)."""
        if lengths is None:
            self.heads = self.head_len = self._head_tables = self._tables_dev = None
            self._head_dev, self._head_stale, self._free_slots = [], set(), []
            return
        H, ps = self.pool.n_kv_heads, self.pool.page_size
        self.head_len = np.asarray(lengths, dtype=np.int64).copy()
        self.heads = [[] for _ in range(H)]
        self._head_tables = np.zeros((H, len(self._table)), dtype=np.int32)
        self._head_dev, self._head_stale, self._tables_dev = [None] * H, set(), None
        for h, n in enumerate(self.head_len):
            for j in range(-(-int(n) // ps)):
                self._set_head(h, j, self.pages[j] * H + h)
        self.length = int(self.head_len.max())
        self._repack()

    def _repack(self) -> None:
        """Ragged heads onto the fewest pages: the ceil(slots used / n_kv_heads) pages
        holding the most used slots stay, the other pages' used slots are copied into
        their free slots (one kv_copy_pages over the head view), and those pages go back
        to the pool."""
        H = self.pool.n_kv_heads
        used = {s for subs in self.heads for s in subs}
        count = {p: 0 for p in self.pages}
        for s in used:
            count[s // H] += 1
        n_keep = -(-len(used) // H)
        kept = sorted(self.pages, key=lambda p: -count[p])[:n_keep]      # (stable: earlier pages first)
        stay = set(kept)
        free = [p * H + s for p in reversed(kept) for s in range(H - 1, -1, -1) if p * H + s not in used]
        src, dst = [], []
        for h, subs in enumerate(self.heads):
            for j, s in enumerate(subs):
                if s // H not in stay:
                    src.append(s)
                    dst.append(free.pop())
                    self._set_head(h, j, dst[-1])
        if src:
            b, (k, v) = self.pool.backend, self.pool.head_view()
            b.kv_copy_pages(k, v, k, v, np.array(src, dtype=np.int32), np.array(dst, dtype=np.int32))
        for p in self.pages:
            if p not in stay:
                self.pool.give(p)
        self.pages = [p for p in self.pages if p in stay]
        self._free_slots = free

    def take_heads(self, other: "PagedKvCache", remap: np.ndarray | None) -> None:
        """Ragged heads of `other` (a cache this one copies), page ids mapped by remap
        (None: the same ids)."""
        H = self.pool.n_kv_heads
        slot = (lambda s: s) if remap is None else (lambda s: int(remap[s // H]) * H + s % H)
        self.head_len = other.head_len.copy()
        self.heads = [[slot(s) for s in subs] for subs in other.heads]
        self._head_tables = np.zeros_like(other._head_tables)
        for h, subs in enumerate(self.heads):
            self._head_tables[h, :len(subs)] = subs
        self._head_dev, self._head_stale, self._tables_dev = [None] * H, set(), None
        self._free_slots = [slot(s) for s in other._free_slots]

    def bias(self):
        """Backend f32 [n_kv_heads, n_bias] row_bias for the attention ops, or None."""
        if self.row_bias is not None and self._bias_dev is None:
            self._bias_dev = self.pool.backend.upload(self.row_bias)
        return self._bias_dev

    def head_bias(self, h: int):
        """Ragged heads: backend f32 [1, n_bias], head h's row of row_bias, or None."""
        if self.row_bias is not None and h not in self._head_bias_dev:
            self._head_bias_dev[h] = self.pool.backend.upload(np.ascontiguousarray(self.row_bias[h:h + 1]))
        return self._head_bias_dev.get(h)

    def _set_bias(self, row_bias: np.ndarray | None) -> None:
        self.row_bias, self._bias_dev, self._head_bias_dev = row_bias, None, {}

    @property
    def bytes(self) -> int:
        return self.n_pages * self.pool.page_bytes + (0 if self.row_bias is None else self.row_bias.nbytes)

    # -- compaction -------------------------------------------------------------
    def compact(self, keep, window: int = 0, merged=None) -> CompactReport:
        """Keep only the given rows: `keep` int [n_kv_heads, n_keep] (one sorted set per
        KV head, equal lengths), [n_keep] (one set for the layer), or a list of one sorted
        1-D set per KV head whose lengths differ (adaptive head budgets). Survivors move
        to rows 0.. in order, trailing pages return to the pool. `window`: the last
        `window` rows (of each head) must be kept. `merged`: (k, v f32 [n_kv_heads, c,
        head_dim], log-counts f32 [n_kv_heads, c]) rows written after each head's
        survivors that attention weighs by their counts (engine/kv/merge.py). Invalid
        sets raise and leave the cache untouched.

        Sets of different lengths make the heads ragged (see the class): each head
        keeps only its own rows, and the layer only the pages those fill."""
        if self.window:
            raise KvCacheError("a sliding-window layer is never compacted (it holds only its window)")
        keep, lengths = self._validated(keep, window)
        H, ps = self.pool.n_kv_heads, self.pool.page_size
        before = CompactReport(self.length, self.length, self.bytes, self.bytes)
        n_keep = keep.shape[1]
        n_merged = 0 if merged is None else merged[2].shape[1]
        ragged = self.ragged or bool((lengths < n_keep).any())
        kept = keep if not ragged else [keep[h, :n] for h, n in enumerate(lengths)]
        if (lengths == (self.head_len if self.ragged else self.length)).all():   # keep-all is the identity
            self.last_keep = kept
            return before
        bias = np.zeros((H, n_keep + n_merged), dtype=np.float32)
        if self.row_bias is not None:      # earlier merged rows keep their counts where they stay
            old = np.zeros((H, max(self.length, n_keep)), dtype=np.float32)
            old[:, :self.row_bias.shape[1]] = self.row_bias
            bias[:, :n_keep] = np.take_along_axis(old, keep, axis=1)
        b = self.pool.backend
        if self.ragged:                    # each head's rows through its own table
            k_view, v_view = self.pool.head_view()
            for h, k in enumerate(kept):
                b.kv_gather(k_view, v_view, self.head_table(h), np.ascontiguousarray(k[None]))
            for h, n in enumerate(lengths):
                subs = self.heads[h]
                self._free_slots += subs[-(-int(n) // ps):]
                del subs[-(-int(n) // ps):]
            self.head_len, self.length = lengths.copy(), int(lengths.max())
            self._repack()
        else:
            b.kv_gather(self.pool.k_pages, self.pool.v_pages, self.page_table(), keep)
            if ragged:
                self._set_heads(lengths)
            else:
                self.length = n_keep
                self._release_from(n_keep)
        for h, n in enumerate(lengths):    # (a ragged set's padding is no row of its head)
            bias[h, n:] = 0
        if n_merged:
            k, v, counts = merged
            dtypes = {"k_dtype": self.pool.k_dtype, "v_dtype": self.pool.v_dtype}
            if self.ragged:                # each head only its own merged rows (no unfilled slots:
                real = [np.flatnonzero(counts[h] > EMPTY_BIAS / 2) for h in range(H)]   # they would
                self.reserve(0, [len(r) for r in real])          # take rows past its dropped ones)
                k_view, v_view = self.pool.head_view()
                for h, (n, r) in enumerate(zip(self.head_len, real)):
                    if r.size:
                        rows = [np.ascontiguousarray(a[h, r], dtype=np.float32) for a in (k, v)]
                        b.kv_write(k_view, v_view, self.head_table(h), *(b.upload(a) for a in rows), int(n),
                                   **dtypes)
                        bias[h, n:n + r.size] = counts[h, r]
                self.head_len += [len(r) for r in real]
                self.length = int(self.head_len.max())
                bias = bias[:, :self.length]
            else:
                self.reserve(n_merged)
                bias[:, n_keep:] = counts
                flat = [np.ascontiguousarray(a.transpose(1, 0, 2).reshape(n_merged, -1), dtype=np.float32)
                        for a in (k, v)]
                b.kv_write(self.pool.k_pages, self.pool.v_pages, self.page_table(), *(b.upload(a) for a in flat),
                           n_keep, **dtypes)
                self.length += n_merged
        self._set_bias(bias if bias.any() else None)
        self.last_keep = kept
        return CompactReport(before.rows_before, self.length, before.bytes_before, self.bytes)

    def _validated(self, keep, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(keep int64 [n_kv_heads, n_max], lengths int64 [n_kv_heads]): a ragged set is
        padded past each head's length with rows that stay where they are (row i -> i,
        finite rows the gather need not move). Ragged heads check each set against their
        own rows."""
        H = self.pool.n_kv_heads
        if not isinstance(keep, (list, tuple)):
            keep = np.asarray(keep)
            if keep.ndim == 1:
                keep = np.broadcast_to(keep, (H, keep.shape[0]))
            if keep.ndim != 2 or keep.shape[0] != H:
                raise KvCacheError(f"keep set must be [n_keep], [{H}, n_keep] or a list of {H} sets, "
                                   f"got shape {keep.shape}")
            if not self.ragged:
                keep = np.ascontiguousarray(self._checked(keep, window, "keep set", self.length))
                return keep, np.full(H, keep.shape[1], dtype=np.int64)
            keep = list(keep)
        if len(keep) != H:
            raise KvCacheError(f"a keep set per KV head needs {H} sets, got {len(keep)}")
        rows = self.head_len if self.ragged else [self.length] * H
        sets = [self._checked(np.asarray(k), window, f"head {h}'s keep set", int(rows[h]))
                for h, k in enumerate(keep)]
        lengths = np.array([len(k) for k in sets], dtype=np.int64)
        padded = np.empty((H, int(lengths.max())), dtype=np.int64)
        for h, k in enumerate(sets):
            padded[h, :len(k)] = k
            padded[h, len(k):] = np.arange(len(k), padded.shape[1])
        return padded, lengths

    def _checked(self, keep: np.ndarray, window: int, what: str, length: int) -> np.ndarray:
        """keep [..., n_keep] of rows 0..length-1 as int64, or KvCacheError naming `what`."""
        if keep.ndim not in (1, 2) or keep.shape[-1] == 0:
            raise KvCacheError(f"{what} is empty" if keep.size == 0 else f"{what} must be one set of rows")
        if not np.issubdtype(keep.dtype, np.integer):
            raise KvCacheError(f"{what} must hold integers, got {keep.dtype}")
        keep = keep.astype(np.int64)
        if keep.min() < 0 or keep.max() >= length:
            raise KvCacheError(f"{what} out of range: rows must lie in 0..{length - 1}")
        if keep.shape[-1] > 1 and not (np.diff(keep, axis=-1) > 0).all():
            raise KvCacheError(f"{what} must be sorted ascending without duplicates")
        if window:
            tail = np.arange(length - window, length)
            if keep.shape[-1] < window or not (keep[..., -window:] == tail).all():
                raise KvCacheError(f"{what} drops part of the observation window (last {window} rows)")
        return keep


class KvCache:
    """The whole model's cache: one PagedKvCache per layer sharing one page pool.

    `windows[i]` > 0 makes layer i a sliding-window layer; `max_step` is the most rows
    one forward step appends (the prefill chunk). The pool holds exactly the pages
    the layers can ever hold together: the whole context for each full-attention
    layer, `layer_pages(..., window, max_step)` for each sliding-window layer.
    `kv`: the row formats of keys and values (a KvSpec or its spelling: "q8_0/rq4_0",
    "rq4_0:0=q8_0/rq4_0"; backends/kvformat.py)."""

    def __init__(self, backend, n_layers: int, n_kv_heads: int, head_dim: int, max_rows: int,
                 page_size: int = 64, windows=None, max_step: int | None = None,
                 kv="bf16", pool: PagePool | None = None):
        self.windows = tuple(int(w) for w in windows) if windows is not None else (0,) * n_layers
        if len(self.windows) != n_layers:
            raise ValueError(f"KvCache: {len(self.windows)} windows for {n_layers} layers")
        self.max_step = max_step
        if pool is None:             # a pool of its own, exactly what the cache can ever hold
            pool = PagePool(backend, [layer_pages(max_rows, page_size, w, max_step) for w in self.windows],
                            n_kv_heads, page_size, head_dim, kv)
        elif (pool.n_kv_heads, pool.head_dim, pool.page_size, pool.spec) != (
                n_kv_heads, head_dim, page_size, KvSpec.parse(kv)):
            raise ValueError("KvCache: the shared pool's heads, head_dim, page size or row formats differ")
        elif pool.n_layers not in (None, n_layers):
            raise ValueError(f"KvCache: the shared pool is laid out for {pool.n_layers} layers, not {n_layers}")
        self.pool = pool
        self.layers = [PagedKvCache(pool.segment(i), max_rows, w, max_step) for i, w in enumerate(self.windows)]
        self.max_rows = max_rows
        self.compactions: list[CompactReport] = []   # the last compaction, one report per layer
        self.eviction: dict | None = None             # summary of the last SnapKV eviction
        # (first position, f32 [n_layers, n_heads, m, head_dim]): the post-RoPE queries of
        # positions first .. first+m-1 (an eviction's observation window, kept with a branch of
        # the prompt it scored), so a continuation whose window reaches back into them need not
        # run them again (ForwardPass.prefill_steps); None when unknown
        self.tail_queries: tuple[int, np.ndarray] | None = None
        # why a step failed after some layer took its rows (an error, Ctrl-C): the layers
        # then hold different positions, and the cache refuses further steps until released
        self.interrupted: str | None = None

    def check_usable(self) -> None:
        """KvCacheError when a step was interrupted in this cache (`interrupted`)."""
        if self.interrupted is not None:
            raise KvCacheError(f"this KV cache was left in the middle of a step ({self.interrupted}): its layers "
                               f"hold different positions; start a new cache (or release this one)")

    @property
    def centre_rows(self) -> int:
        """The positions 0 .. n-1 whose keys centre the quantized key rows (the first write's
        first rows, ForwardPass._key_centre); 0 when no layer is centred. Rows written after
        them are stored relative to that centre, so a cache continues a prompt exactly as a
        fresh prefill would only when that prefill's first write would take the same rows."""
        return max((layer.centre_rows for layer in self.layers if layer.key_centre is not None), default=0)

    def copy(self) -> "KvCache":
        """An independent cache with the same rows (same page ids in a new pool laid out
        as this one's), so one prefill can be branched into several eviction policies. The
        new pool's pages are all free but this cache's (on a shared pool, those other caches
        hold too)."""
        self.check_usable()
        p = self.pool
        other = self._twin(p.empty_like())
        for s, (mine, theirs) in enumerate(zip(p.segments, other.pool.segments)):
            used = self._used_pages(s)
            if used.size:
                p.backend.kv_copy_pages(mine.k_pages, mine.v_pages, theirs.k_pages, theirs.v_pages, used)
            held = set(used.tolist())
            theirs._free = [page for page in theirs._free if page not in held]
            theirs.touched = int(used.max()) + 1 if used.size else 0
        return self._copy_state(other, [None] * len(p.segments))

    def branch(self) -> "KvCache":
        """An independent cache with the same rows on the same pool: fresh pages of each
        layer's segment, filled on the device (the server keeps a prompt's full cache this
        way beside the compacted one it decodes with). KvCacheError, with nothing taken,
        when a segment lacks the free pages."""
        self.check_usable()
        p = self.pool
        used = [self._used_pages(s) for s in range(len(p.segments))]
        short = [s for s, seg in enumerate(p.segments) if used[s].size > seg.free_pages]
        if short:
            raise KvCacheError(f"KV page pool exhausted: branching the cache needs {used[short[0]].size} free "
                               f"pages, segment {short[0]} has {p.segments[short[0]].free_pages}")
        remaps, taken = [], []
        try:
            for seg, ids in zip(p.segments, used):
                fresh = np.array([seg.take() for _ in ids], dtype=np.int32)
                taken.append((seg, fresh))
                if ids.size:
                    p.backend.kv_copy_pages(seg.k_pages, seg.v_pages, seg.k_pages, seg.v_pages, ids, fresh)
                remap = np.arange(seg.n_pages, dtype=np.int32)                # page id -> the branch's page id
                remap[ids] = fresh
                remaps.append(remap)
        except BaseException:                    # (a device error in the copy) nothing stays taken
            for seg, fresh in taken:
                for page in fresh:
                    seg.give(int(page))
            raise
        return self._copy_state(self._twin(p), remaps)

    def _twin(self, pool: PagePool) -> "KvCache":
        p = self.pool
        return KvCache(p.backend, len(self.layers), p.n_kv_heads, p.head_dim, self.max_rows, p.page_size,
                       self.windows, self.max_step, p.spec, pool=pool)

    def _used_pages(self, segment: int) -> np.ndarray:
        """int32 sorted ids of the pages the layers of one pool segment hold."""
        return np.array(sorted({pg for i, layer in enumerate(self.layers)
                                if self.pool.segment_index(i) == segment for pg in layer.pages}), dtype=np.int32)

    def _copy_state(self, other: "KvCache", remaps: list) -> "KvCache":
        """other's layers take this cache's lengths, tables and keep sets, page ids mapped by
        remaps[segment] (None: the same ids)."""
        for i, (mine, theirs) in enumerate(zip(self.layers, other.layers)):
            remap = remaps[self.pool.segment_index(i)]
            theirs.pages = list(mine.pages) if remap is None else [int(remap[pg]) for pg in mine.pages]
            theirs._table[:] = mine._table if remap is None else remap[mine._table]
            theirs.first_page, theirs.intact_from = mine.first_page, mine.intact_from
            theirs.length, theirs.logical_length = mine.length, mine.logical_length
            theirs.last_keep = mine.last_keep
            theirs.row_bias, theirs._bias_dev = mine.row_bias, mine._bias_dev   # read-only, shared
            theirs._head_bias_dev = mine._head_bias_dev
            theirs.key_centre = mine.key_centre                                 # read-only, shared
            theirs.centre_rows = mine.centre_rows
            if mine.ragged:
                theirs.take_heads(mine, remap)
        other.eviction, other.tail_queries = self.eviction, self.tail_queries      # (read-only, shared)
        return other

    def pages_held(self, segment: int | None = None) -> int:
        """Distinct pages held (in one segment of the pool only, when `segment` is given)."""
        return sum(layer.n_pages for i, layer in enumerate(self.layers)
                   if segment is None or self.pool.segment_index(i) == segment)

    def pages_needed(self, more_rows: int, segment: int | None = None) -> int:
        """Pages the cache holds at most while `more_rows` rows are appended to what it
        holds now (a sliding-window layer never more than its bound); of one segment of
        the pool only, when `segment` is given."""
        return sum(layer.pages_needed(more_rows) for i, layer in enumerate(self.layers)
                   if segment is None or self.pool.segment_index(i) == segment)

    def truncate(self, n: int) -> None:
        """Keep the first n positions only (pages past them return to the pool), so the
        cache can continue a prompt that shares those n tokens. Only an uncompacted cache
        whose sliding-window layers still hold the rows position n would see; otherwise
        KvCacheError and the cache is unchanged."""
        if self.eviction is not None or any(l.length != l.logical_length for l in self.layers):
            raise KvCacheError("a compacted cache cannot be truncated (its rows are not positions)")
        if not 0 <= n <= self.logical_length:
            raise KvCacheError(f"cannot truncate a cache of {self.logical_length} positions to {n}")
        for layer in self.layers:
            if layer.window and layer.first_row > max(0, n - layer.window + 1):
                raise KvCacheError(f"a sliding-window layer no longer holds the rows position {n} sees")
        for layer in self.layers:
            layer.truncate(n)
        if self.tail_queries is not None:
            first, q = self.tail_queries
            self.tail_queries = (first, q[:, :, :n - first]) if n > first else None

    def fold(self) -> None:
        """Bring every sliding-window layer back to its ring of pages (after a prefill)."""
        for layer in self.layers:
            layer.fold()

    def release(self) -> None:
        """Return every page to the pool and leave the cache empty (idempotent): a
        cache on a shared pool must be released, a private one may just be dropped."""
        for layer in self.layers:
            layer.release()
        self.compactions, self.eviction, self.tail_queries, self.interrupted = [], None, None, None

    @property
    def full_layers(self) -> list[int]:
        """Indices of the full-attention layers: the ones SnapKV scores and compacts."""
        return [i for i, w in enumerate(self.windows) if not w]

    @property
    def k_dtype(self) -> str:
        """The keys' format (of the layers with no exception; a layer's: layers[i].pool)."""
        return self.pool.k_dtype

    @property
    def v_dtype(self) -> str:
        return self.pool.v_dtype

    @property
    def kv_dtype(self) -> str:
        """"tq4", "q8_0/tq4" when keys and values differ, "rq4_0:0=q8_0/rq4_0" with a
        layer exception (the --kv-dtype spelling)."""
        return self.pool.kv_dtype

    @property
    def logical_length(self) -> int:
        return self.layers[0].logical_length

    @property
    def length(self) -> int:
        """Physical rows of the longest full-attention layer (of the longest layer when
        every layer slides)."""
        full = self.full_layers or range(len(self.layers))
        return max(self.layers[i].length for i in full)

    @property
    def bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    def stats(self) -> dict:
        """Per-layer lengths, pages and bytes held, and the keep sets of the last compaction.
        A sliding-window layer (window > 0) holds rows first_row .. length - 1."""
        return {
            "logical_length": self.logical_length,
            "bytes": self.bytes,
            "page_size": self.pool.page_size,
            "kv_dtype": self.kv_dtype, "k_dtype": self.k_dtype, "v_dtype": self.v_dtype,
            "eviction": self.eviction,
            "layers": [{"length": l.length, "logical_length": l.logical_length, "pages": l.n_pages,
                        "bytes": l.bytes, "kv_dtype": l.pool.kv_dtype,
                        "keep": l.last_keep, "head_rows": l.head_rows, "window": l.window,
                        "first_row": l.first_row} for l in self.layers],
        }
