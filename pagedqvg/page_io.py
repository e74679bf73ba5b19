"""Where one layer's token rows live in the pool, and every move of them: writes, views, fills, dense reads and
stores, dequantizing a packed segment.

`PageIO` owns the pool's token-row views for one layer shape and a small plan cache (row indices, run tables, arena
slices), dropped by `invalidate()` whenever pages, segments or slots change. It knows nothing of sequencing: the
cache passes the range index (global token ranges -> `Segment`s) and, for a view, its spans (per slot range: the
global token ranges the slots hold and the count of never-filled slots after them).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .allocator import BlockPool, RangeEntry, RangeIndex
from .kernels.dispatch import kernel_backend, page_fill, page_write, view_build, view_runs
from .kernels.rows import int64_on, segment_row_index, token_rows
from .kernels.view_runs import RUN_COLUMNS, dense_runs, packed_runs, zero_runs
from .layout import DenseTokenLayout, page_pieces
from .packing import PackedStore
from .segment import Segment

#: Plans `PageIO` keeps (write, view and the cache's call plans); the cache is emptied when full.
PLAN_CACHE_SIZE = 8

#: A view's sources, one per slot range in order: `(global token ranges the slots hold, never-filled slots)`.
Spans = list[tuple[list[tuple[int, int]], int]]


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Destinations of one write (opaque to callers; valid until `PageIO.invalidate`)."""

    part: tuple


@dataclass(frozen=True, slots=True)
class ViewPlan:
    """Sources of one view (opaque to callers; valid until `PageIO.invalidate`); `tokens`: rows of the view."""

    parts: list[tuple]
    tokens: int


class PageIO:
    """The token rows of one layer shape in `pool`, and the plans and copies that move them.

    Args:
        pool: the `BlockPool` holding the pages.
        layout: the dense page layout (`DenseTokenLayout`) of this layer shape.
        packed: the layer's `PackedStore` (quantized caches), or None.

    Attributes:
        backend: "torch" or "triton" (`kernels.dispatch.kernel_backend` of the pool's device, at construction).
        run_cap: longest run of a run table, in tokens (Triton backend); None: runs are cut at page ends only.
        tok: the arena as whole tokens per page, `[num_pages, 2, tokens_per_page, B, H, D]` (a view).
        rows: the arena as token rows, `[num_pages, rows_per_page, H, D]` (a view; kernels/rows.py).
    """

    def __init__(self, pool: BlockPool, layout: DenseTokenLayout, packed: PackedStore | None) -> None:
        self.device = pool.device
        self.dtype = layout.dtype
        self.batch_size = layout.batch_size
        self.num_heads = layout.num_heads
        self.head_dim = layout.head_dim
        self.packed = packed
        self.tpp = layout.tokens_per_page
        self.rpp = layout.rows_per_page
        self.backend = kernel_backend(pool.device)
        # Longest run of a view's run table (Triton backend): on CUDA runs are split at the dense tokens per page, so
        # the kernel's programs are about equally busy; in the interpreter (CPU tensors), where a program costs
        # milliseconds of Python whatever its size, runs are only cut at page ends.
        self.run_cap: int | None = self.tpp if pool.device.type == "cuda" else None
        B, H, D = self.batch_size, self.num_heads, self.head_dim
        # Whole tokens per page as a K block then a V block: [num_pages, 2, tokens_per_page, B, H, D].
        self.tok = pool.pages_as(self.dtype)[:, : self.rpp * H * D].view(pool.num_pages, 2, self.tpp, B, H, D)
        self.rows = token_rows(pool, self.dtype, H, D, self.rpp)
        b = torch.arange(B, dtype=torch.int64, device=self.device)
        kv = torch.arange(2, dtype=torch.int64, device=self.device)
        self._kv_batch = (kv[:, None] * B + b[None, :])[:, :, None]
        # Cached write/view plans (arena views, page pieces, row indices), dropped whenever pages or slots change.
        self._plans: dict[Hashable, object] = {}

    # ------------------------------------------------------------ plan cache
    def invalidate(self) -> None:
        """Pages, segments, slots or the pin changed: every cached plan is stale."""
        self._plans.clear()

    def cached(self, key: Hashable) -> object | None:
        """The plan remembered under `key`, or None."""
        return self._plans.get(key)

    def remember(self, key: Hashable, plan: object) -> object:
        """Keep `plan` under `key` until `invalidate` (at most `PLAN_CACHE_SIZE` plans; emptied when full)."""
        if len(self._plans) >= PLAN_CACHE_SIZE:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    # ------------------------------------------------------------ where rows live
    def _dense_index(self, entry: RangeEntry[Segment], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row index `[2, B, hi - lo]` of global tokens `[lo, hi)` of a dense segment (Triton backend)."""
        seg = entry.value
        if seg.pages_t is None:
            seg.pages_t = int64_on(seg.pages, self.device)
        return segment_row_index(seg.pages_t, self.rpp, lo - entry.start, hi - entry.start, self._kv_batch)

    def _parts(self, index: RangeIndex[Segment], global_ranges: list[tuple[int, int]]) -> list[tuple]:
        """Where the rows of `global_ranges` live, in order, merged into parts:
        `("d", [(page, first, last), ...], m)` dense token slices (torch backend),
        `("i", page_idx, slot_idx, m)` dense row indices (Triton backend),
        `("p", segment, t0, t1, m)` a token range of a packed segment."""
        parts: list[tuple] = []
        pieces: list[tuple[int, int, int]] = []
        idx_p: list[torch.Tensor] = []
        idx_s: list[torch.Tensor] = []
        count = 0

        def flush() -> None:
            nonlocal pieces, count
            if pieces:
                parts.append(("d", pieces, count))
                pieces = []
            if idx_p:
                pi = idx_p[0] if len(idx_p) == 1 else torch.cat(idx_p, dim=2)
                si = idx_s[0] if len(idx_s) == 1 else torch.cat(idx_s, dim=2)
                parts.append(("i", pi, si, count))
                idx_p.clear()
                idx_s.clear()
            count = 0

        triton = self.backend == "triton"
        for g0, g1 in global_ranges:
            for entry in index.overlapping(g0, g1):
                lo, hi = max(g0, entry.start), min(g1, entry.end)
                seg = entry.value
                if seg.packed:
                    flush()
                    parts.append(("p", seg, lo - entry.start, hi - entry.start, hi - lo))
                    continue
                if triton:
                    p, sl = self._dense_index(entry, lo, hi)
                    idx_p.append(p)
                    idx_s.append(sl)
                else:
                    pieces.extend(page_pieces(seg.pages, self.tpp, lo - entry.start, hi - entry.start))
                count += hi - lo
        flush()
        return parts

    def _head_slice(self, page: int, a: int, b: int, h0: int, hin: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token slots `[a, b)` of a page as K and V views of the arena, each `[m, B, Hin, D]`."""
        block = self.tok[page, :, a:b]
        if hin != self.num_heads:
            block = block[:, :, :, h0 : h0 + hin]
        return block[0], block[1]

    # ------------------------------------------------------------ writes
    def write_plan(self, index: RangeIndex[Segment], s: int, e: int, h0: int, hin: int) -> WritePlan:
        """Cached destinations of a write of global tokens `[s, e)` (dense segments of `index` only), heads
        `[h0, h0 + hin)`: arena views (torch) or a row index (Triton). Valid until `invalidate`."""
        key = ("w", s, e, h0, hin)
        plan = self._plans.get(key)
        if plan is None:
            (part,) = self._parts(index, [(s, e)])  # writes only ever touch dense segments
            if part[0] == "d":
                items, o = [], 0
                for page, a, b in part[1]:
                    k_dst, v_dst = self._head_slice(page, a, b, h0, hin)
                    items.append((k_dst, v_dst, o, b - a))
                    o += b - a
                part = ("d", items)
            plan = self.remember(key, WritePlan(part))
        assert isinstance(plan, WritePlan)
        return plan

    def write(self, plan: WritePlan, h0: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write key/value `[B, n, Hin, D]` into the destinations of `plan` (heads from `h0`)."""
        part = plan.part
        if part[0] == "i":
            page_write(self.rows, part[1], part[2], h0, key, value)
            return
        items = part[1]
        if len(items) == 1:
            k_dst, v_dst, _, _ = items[0]
            k_dst.copy_(key.transpose(0, 1))
            v_dst.copy_(value.transpose(0, 1))
            return
        for k_dst, v_dst, o, m in items:
            k_dst.copy_(key[:, o : o + m].transpose(0, 1))
            v_dst.copy_(value[:, o : o + m].transpose(0, 1))

    def fill_tokens(
        self, entry: RangeEntry[Segment], lo: int, hi: int, k_fill: float = 0.0, v_fill: float = 0.0
    ) -> None:
        """Every head of global tokens `[lo, hi)` of a dense segment := `k_fill` (K rows) and `v_fill` (V rows)."""
        if self.backend == "triton":
            p, sl = self._dense_index(entry, lo, hi)
            page_fill(self.rows, p, sl, 0.0)
        else:
            for page, a, b in page_pieces(entry.value.pages, self.tpp, lo - entry.start, hi - entry.start):
                self.tok[page, :, a:b].zero_()
        if k_fill or v_fill:
            for page, a, b in page_pieces(entry.value.pages, self.tpp, lo - entry.start, hi - entry.start):
                self.tok[page, 0, a:b].fill_(k_fill)
                self.tok[page, 1, a:b].fill_(v_fill)

    # ------------------------------------------------------------ views
    def view_plan(self, index: RangeIndex[Segment], spans: Spans, h0: int, hin: int) -> ViewPlan:
        """Cached sources of a view of heads `[h0, h0 + hin)` whose slot ranges hold `spans`.

        Triton backend: a view of dense rows only is one row-index part (`view_build`, the ranges' indices
        concatenated); a view with packed segments or zero slots is one run-table part `("r", runs, cb_pages,
        max_run, T)` for `view_runs`, built and copied to the device here. Either way one launch per view. Torch
        backend: arena slices, packed token ranges and zero counts."""
        key = ("v", h0, hin, tuple((tuple(g), z) for g, z in spans))
        plan = self._plans.get(key)
        if plan is None:
            if self.backend == "triton":
                if not self._dense_only(index, spans):
                    parts, tokens = self._run_plan(index, spans)
                    return self._remember_view(key, parts, tokens)
                parts = self._parts(index, [g for global_ranges, _ in spans for g in global_ranges])  # one "i" part
                return self._remember_view(key, parts, sum(p[-1] for p in parts))
            parts = []
            for global_ranges, zeros in spans:
                for part in self._parts(index, global_ranges):
                    if part[0] == "d":
                        parts.extend(("s", *self._head_slice(page, x, y, h0, hin), y - x) for page, x, y in part[1])
                    else:
                        parts.append(part)
                if zeros > 0:
                    # Slots the cache never filled (a sink longer than the local end): zeros, as the dense
                    # cache's zero-initialised buffer reads there.
                    parts.append(("z", zeros))
            plan = self._remember_view(key, parts, sum(p[-1] for p in parts))
        assert isinstance(plan, ViewPlan)
        return plan

    def _remember_view(self, key: Hashable, parts: list[tuple], tokens: int) -> ViewPlan:
        plan = ViewPlan(parts, tokens)
        self.remember(key, plan)
        return plan

    def _dense_only(self, index: RangeIndex[Segment], spans: Spans) -> bool:
        """Whether a view's spans are dense rows only (no zero slots, no packed segment).
        O(spans x (log n + k))."""
        if any(zeros > 0 for _, zeros in spans):
            return False
        return not any(e.value.packed for g, _ in spans for g0, g1 in g for e in index.overlapping(g0, g1))

    def _run_plan(self, index: RangeIndex[Segment], spans: Spans) -> tuple[list[tuple], int]:
        """The run table of a whole view (kernels/view_runs.py) from its spans: dense and packed token runs and
        zero runs (split at `run_cap` tokens), plus the concatenated codebook pages of its packed segments; one
        host->device copy. O(pages of the view)."""
        cap = self.run_cap
        store = self.packed
        runs: list[tuple[int, ...]] = []
        cb_pages: list[int] = []
        cb_offset: dict[int, int] = {}  # id(segment) -> its codebook pages' offset in cb_pages
        o = 0
        for global_ranges, zeros in spans:
            for g0, g1 in global_ranges:
                for entry in index.overlapping(g0, g1):
                    lo, hi = max(g0, entry.start) - entry.start, min(g1, entry.end) - entry.start
                    seg = entry.value
                    if seg.packed:
                        assert store is not None
                        off = cb_offset.get(id(seg))
                        if off is None:
                            off = cb_offset[id(seg)] = len(cb_pages)
                            cb_pages.extend(seg.pages[seg.n_token_pages :])
                        runs += packed_runs(seg.pages[: seg.n_token_pages], store.tpp, lo, hi, o, off, cap)
                    else:
                        runs += dense_runs(seg.pages, self.tpp, lo, hi, o, cap)
                    o += hi - lo
            if zeros > 0:
                # Slots the cache never filled (a sink longer than the local end): zeros, as the dense cache's
                # zero-initialised buffer reads there.
                runs += zero_runs(o, zeros, cap)
                o += zeros
        desc = int64_on([x for run in runs for x in run] + cb_pages, self.device)
        n = RUN_COLUMNS * len(runs)
        table = desc[:n].view(len(runs), RUN_COLUMNS)
        max_run = max((run[3] for run in runs), default=0)
        return [("r", table, desc[n:] if store is not None else None, max_run, o)], o

    def build_view(self, plan: ViewPlan, h0: int, hin: int, out: torch.Tensor) -> None:
        """Fill `out` `[2, B, T, Hin, D]`: dense rows copied, packed rows dequantized, in one pass over the plan.

        Triton backend: one launch, `view_build` for a view of dense rows only (an `"i"` part), else `view_runs`
        over the plan's run table (an `"r"` part). Torch backend: slice copies / concatenations, zero fills and the
        torch dequantization of the packed runs (`PackedStore.dequantize_runs_into`)."""
        parts = plan.parts
        if len(parts) == 1 and parts[0][0] == "i":
            view_build(self.rows, parts[0][1], parts[0][2], h0, hin, out)
            return
        if len(parts) == 1 and parts[0][0] == "r":  # Triton: the whole view in one launch
            _, runs, cb_pages, max_run, _ = parts[0]
            st = self.packed
            packed = (st.token_view, st.codebook_rows, cb_pages) if st is not None else (None, None, None)
            fmt = st.fmt if st is not None else None
            view_runs(self.rows, *packed, runs, h0, out.permute(2, 0, 1, 3, 4), fmt, max_run)
            return
        out_k, out_v = out[0].transpose(0, 1), out[1].transpose(0, 1)  # [T, B, Hin, D] (contiguous when B == 1)
        if all(part[0] == "s" for part in parts):  # dense pages only: K and V each one copy / concatenation
            if len(parts) == 1:
                out_k.copy_(parts[0][1])
                out_v.copy_(parts[0][2])
            else:
                torch.cat([part[1] for part in parts], 0, out=out_k)
                torch.cat([part[2] for part in parts], 0, out=out_v)
            return
        out_t = out.permute(2, 0, 1, 3, 4)  # [T, 2, B, Hin, D]
        to_dequantize: list[tuple[int, list[int], list[int], int, int]] = []
        o = 0
        for part in parts:
            kind, m = part[0], part[-1]
            if kind == "s":
                out_k[o : o + m].copy_(part[1])
                out_v[o : o + m].copy_(part[2])
            elif kind == "z":
                out_t[o : o + m].zero_()
            else:
                seg, t0, t1 = part[1], part[2], part[3]
                n_tok = seg.n_token_pages
                to_dequantize.append((o, seg.pages[:n_tok], seg.pages[n_tok:], t0, t1))
            o += m
        if to_dequantize:
            assert self.packed is not None
            self.packed.dequantize_runs_into(out_t, to_dequantize, h0)

    # ------------------------------------------------------------ whole segments
    def read_dense(self, entry: RangeEntry[Segment]) -> torch.Tensor:
        """All tokens of a dense segment as `[2, n, B, H, D]` (a temporary)."""
        n = entry.end - entry.start
        pieces = [self.tok[p, :, a:b] for p, a, b in page_pieces(entry.value.pages, self.tpp, 0, n)]
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def store_dense(self, entry: RangeEntry[Segment], data: torch.Tensor) -> None:
        """Write `data` `[n, 2, B, H, D]` into a dense segment's pages."""
        o = 0
        for page, a, b in page_pieces(entry.value.pages, self.tpp, 0, entry.end - entry.start):
            self.tok[page, :, a:b].copy_(data[o : o + b - a].transpose(0, 1))
            o += b - a

    def dequantize_segment(self, entry: RangeEntry[Segment]) -> torch.Tensor:
        """All tokens of a packed segment as dense `[n, 2, B, H, D]` (a temporary; nothing changes)."""
        store = self.packed
        seg = entry.value
        assert store is not None and seg.packed
        n = entry.end - entry.start
        dense = torch.empty(n, 2, self.batch_size, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        n_tok = seg.n_token_pages
        store.dequantize_into(dense, seg.pages[:n_tok], seg.pages[n_tok:], 0, n, 0)
        return dense
