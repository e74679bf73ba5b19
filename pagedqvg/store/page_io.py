"""Where one layer's token rows live in the pool, and every move of them: writes, views, fills, dense reads and
stores, dequantizing a packed segment.

`PageIO` owns the pool's token-row view for one layer shape and a small plan cache (row indices, run tables),
dropped by `invalidate()` whenever pages, segments or slots change. It knows nothing of sequencing: the cache passes
the range index (global token ranges -> `Segment`s) and, for a view, its spans (per slot range: the global token
ranges the slots hold and the count of never-filled slots after them).

One path on every device: a write is one `page_write` over a row index, a view one `view_build` (dense rows only)
or one `view_runs` (a run table of dense, packed and zero runs) through `kernels.dispatch`, i.e. Triton kernels on
CUDA and their torch references on CPU, the code the kernels are tested against (vectorized: one indexed copy per
K/V half, one gather of the view's dense rows, one dequantization per packed segment; no loop over pages).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from pagedqvg.allocator import BlockPool, RangeEntry, RangeIndex
from pagedqvg.kernels.dispatch import kernel_backend, page_fill, page_write, view_build, view_runs
from pagedqvg.kernels.rows import int64_on, segment_row_index, token_rows
from pagedqvg.kernels.view.view_build import gather_plan, view_build_torch
from pagedqvg.kernels.view.view_runs import (
    RUN_COLUMNS,
    RunsTorchPlan,
    dense_runs,
    packed_runs,
    runs_torch_plan,
    zero_runs,
)
from pagedqvg.kernels.write.page_write import split_halves
from pagedqvg.layout.segments import DenseTokenLayout
from pagedqvg.store.packed_store import PackedStore
from pagedqvg.store.segment import Segment
from pagedqvg.store.tier_stores import ExtraRuns, TierStore

#: Plans `PageIO` keeps (write, view and the cache's call plans); the cache is emptied when full.
PLAN_CACHE_SIZE = 8

#: A view's sources, one per slot range in order: `(global token ranges the slots hold, never-filled slots)`.
Spans = list[tuple[list[tuple[int, int]], int]]


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Destinations of one write: the row index (kernels/rows.py) `page_idx`, `slot_idx`, each int64 `[2, B, n]`,
    and its K and V halves split once (`halves`, `kernels.page_write.split_halves`; the torch reference's). Valid
    until `PageIO.invalidate`."""

    page_idx: torch.Tensor
    slot_idx: torch.Tensor
    halves: tuple | None = None


@dataclass(frozen=True, slots=True)
class ViewPlan:
    """Sources of one view of `tokens` rows (valid until `PageIO.invalidate`): dense rows only as a row index
    (`page_idx`, `slot_idx`, int64 `[2, B, tokens]`; one `view_build`), else a run table (`runs` int64
    `[P, RUN_COLUMNS]`, the view's packed segments' codebook pages `cb_pages`, the longest run `max_run`; one
    `view_runs`). On the torch backend a dense view also keeps what `view_build_torch` derives from its row index
    (`gather`: `kernels.view_build.gather_plan`'s source view and unit index), so a repeated view is one
    `index_select` into the output: no index arithmetic, no host read, no allocation; a run table keeps what
    `view_runs_torch` derives from it (`runs_plan`: the dense rows' gathers, the zero ranges and the packed rows'
    decode plan with its scratch), so a repeated view allocates nothing but its output and reads nothing back on
    either kind of plan. `extras`: the view's runs of packed formats other than the history's (a tiered cache;
    `tier_stores.ExtraRuns`), each `(store, piece table, codebook pages)`, read by that store after the `view_runs`
    call."""

    tokens: int
    page_idx: torch.Tensor | None = None
    slot_idx: torch.Tensor | None = None
    runs: torch.Tensor | None = None
    cb_pages: torch.Tensor | None = None
    max_run: int = 0
    gather: tuple[torch.Tensor, torch.Tensor] | None = None
    runs_plan: RunsTorchPlan | None = None
    extras: tuple = ()


class PageIO:
    """The token rows of one layer shape in `pool`, and the plans and copies that move them.

    Args:
        pool: the `BlockPool` holding the pages.
        layout: the dense page layout (`DenseTokenLayout`) of this layer shape.
        packed: the layer's `PackedStore` (quantized caches), or None: the history's format with tiers.
        stores: format name -> store of every tier format (tier_stores.py; default: `packed` alone).

    Raises:
        ValueError: the layout's page size differs from the pool's, or a page holds no whole token.

    Attributes:
        backend: "torch" or "triton", resolved once here (`kernels.dispatch.kernel_backend`, which reads
            `PAGEDQVG_KERNELS`) and passed to every kernel call, so no call reads the environment.
        run_cap: longest run of a run table, in tokens; None: runs are cut at page ends only. (It balances the
            Triton kernel's programs; the torch reference expands runs to rows, so it does not care.)
        rows: the arena as token rows, `[num_pages, rows_per_page, H, D]` (a view; kernels/rows.py): what every
            plan indexes, on both backends.
    """

    def __init__(
        self, pool: BlockPool, layout: DenseTokenLayout, packed: PackedStore | None,
        stores: dict[str, TierStore] | None = None,
    ) -> None:  # fmt: skip
        if layout.page_bytes != pool.page_bytes or layout.tokens_per_page < 1:
            raise ValueError(
                f"layout of {layout.page_bytes} B pages holding {layout.tokens_per_page} tokens does not fit the "
                f"pool's {pool.page_bytes} B pages (needs equal page sizes and at least one token per page)"
            )
        self.device = pool.device
        self.backend = kernel_backend(pool.device)
        self.dtype = layout.dtype
        self.batch_size = layout.batch_size
        self.num_heads = layout.num_heads
        self.head_dim = layout.head_dim
        self.packed = packed
        self.stores: dict[str, TierStore] = dict(stores) if stores else ({packed.name: packed} if packed else {})
        self.tpp = layout.tokens_per_page
        self.rpp = layout.rows_per_page
        # Longest run of a view's run table (Triton backend): on CUDA runs are split at the dense tokens per page, so
        # the kernel's programs are about equally busy; in the interpreter (CPU tensors), where a program costs
        # milliseconds of Python whatever its size, runs are only cut at page ends.
        self.run_cap: int | None = self.tpp if pool.device.type == "cuda" else None
        B, H, D = self.batch_size, self.num_heads, self.head_dim
        self.rows = token_rows(pool, self.dtype, H, D, self.rpp)
        b = torch.arange(B, dtype=torch.int64, device=self.device)
        kv = torch.arange(2, dtype=torch.int64, device=self.device)
        self._kv_batch = (kv[:, None] * B + b[None, :])[:, :, None]
        # Cached write/view plans (row indices, run tables), dropped whenever pages or slots change.
        self._plans: dict[Hashable, object] = {}
        # The torch backend's decode scratch (uint8), shared by this layer's plans; grown at plan time only.
        self._scratch = torch.empty(0, dtype=torch.uint8, device=self.device)

    # ------------------------------------------------------------ plan cache
    def invalidate(self) -> None:
        """Pages, segments, slots or the pin changed: every cached plan is stale."""
        self._plans.clear()

    def cached(self, key: Hashable) -> object | None:
        """The plan remembered under `key`, or None."""
        return self._plans.get(key)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """The decode scratch of this layer's view plans (torch backend), at least `nbytes` (uint8): one buffer,
        reallocated only when a new plan needs more (plans hold views of it; the calls of one cache run one at a
        time). About 12 B per `kernels.dequant.DEQUANT_TILE_ELEMS` element (~3 MiB)."""
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._scratch

    def remember(self, key: Hashable, plan: object) -> object:
        """Keep `plan` under `key` until `invalidate` (at most `PLAN_CACHE_SIZE` plans; emptied when full)."""
        if len(self._plans) >= PLAN_CACHE_SIZE:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    # ------------------------------------------------------------ where rows live
    def _dense_index(self, entry: RangeEntry[Segment], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row index `[2, B, hi - lo]` of global tokens `[lo, hi)` of a dense segment: a slice (a view) of the
        segment's whole row index, built at its first use and kept with the segment until its pages change (so a
        plan rebuilt after an advance recomputes only the new segments' indices)."""
        seg = entry.value
        if seg.row_index is None:
            if seg.pages_t is None:
                seg.pages_t = int64_on(seg.pages, self.device)
            n = entry.end - entry.start
            seg.row_index = segment_row_index(seg.pages_t, self.rpp, 0, n, self._kv_batch)
        p, sl = seg.row_index
        a, b = lo - entry.start, hi - entry.start
        return p[:, :, a:b], sl[:, :, a:b]

    def _row_index(
        self, index: RangeIndex[Segment], global_ranges: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row index `[2, B, n]` of the global tokens `global_ranges` (dense segments only), in order."""
        idx_p: list[torch.Tensor] = []
        idx_s: list[torch.Tensor] = []
        for g0, g1 in global_ranges:
            for entry in index.overlapping(g0, g1):
                assert not entry.value.packed
                p, sl = self._dense_index(entry, max(g0, entry.start), min(g1, entry.end))
                idx_p.append(p)
                idx_s.append(sl)
        if len(idx_p) == 1:
            return idx_p[0], idx_s[0]
        if not idx_p:
            empty = torch.empty(2, self.batch_size, 0, dtype=torch.int64, device=self.device)
            return empty, empty
        return torch.cat(idx_p, dim=2), torch.cat(idx_s, dim=2)

    # ------------------------------------------------------------ writes
    def write_plan(self, index: RangeIndex[Segment], s: int, e: int, h0: int, hin: int) -> WritePlan:
        """Cached destinations of a write of global tokens `[s, e)` (dense segments of `index` only) as a row index.
        Valid until `invalidate`. (`h0`, `hin`: the heads the write will cover; part of the cache key.)"""
        key = ("w", s, e, h0, hin)
        plan = self._plans.get(key)
        if plan is None:
            p, sl = self._row_index(index, [(s, e)])
            plan = self.remember(key, WritePlan(p, sl, split_halves(p, sl)))
        assert isinstance(plan, WritePlan)
        return plan

    def write(self, plan: WritePlan, h0: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write key/value `[B, n, Hin, D]` (any strides) into heads `[h0, h0 + Hin)` of the rows of `plan`: one
        `page_write` (one indexed copy per K/V half on torch, one Triton launch)."""
        page_write(self.rows, plan.page_idx, plan.slot_idx, h0, key, value, self.backend, plan.halves)

    def fill_tokens(
        self, entry: RangeEntry[Segment], lo: int, hi: int, k_fill: float = 0.0, v_fill: float = 0.0
    ) -> None:
        """Every head of global tokens `[lo, hi)` of a dense segment := `k_fill` (K rows) and `v_fill` (V rows):
        `page_fill` over their row index (once, or once per K/V half when the fills differ)."""
        p, sl = self._dense_index(entry, lo, hi)
        if k_fill == v_fill:
            page_fill(self.rows, p, sl, k_fill, self.backend)
        else:
            page_fill(self.rows, p[0], sl[0], k_fill, self.backend)
            page_fill(self.rows, p[1], sl[1], v_fill, self.backend)

    # ------------------------------------------------------------ views
    def view_plan(self, index: RangeIndex[Segment], spans: Spans, h0: int, hin: int) -> ViewPlan:
        """Cached sources of a view of heads `[h0, h0 + hin)` whose slot ranges hold `spans`: a view of dense rows
        only is a row index (the ranges' indices concatenated; `view_build`), a view with packed segments or zero
        slots a run table (`view_runs`), built and copied to the device here. Either way one kernel call per view
        on either backend. Valid until `invalidate`."""
        key = ("v", h0, hin, tuple((tuple(g), z) for g, z in spans))
        plan = self._plans.get(key)
        if plan is None:
            if self._dense_only(index, spans):
                plan = self._dense_plan(index, spans, h0, hin)
            else:
                plan = self._run_plan(index, spans, h0, hin)
            self.remember(key, plan)
        assert isinstance(plan, ViewPlan)
        return plan

    @staticmethod
    def view_sources(index: RangeIndex[Segment], spans: Spans) -> list[tuple[int, int, str]]:
        """Where the rows of a view of `spans` come from, in order: `(global_start, global_end, kind)` with kind
        "dense", "packed" or "unpacked" (a dense segment marked lossy), and `(-1, count - 1, "zeros")` for `count`
        never-filled slots. O(spans x (log n + k))."""
        out: list[tuple[int, int, str]] = []
        for global_ranges, zeros in spans:
            for g0, g1 in global_ranges:
                for entry in index.overlapping(g0, g1):
                    kind = "unpacked" if entry.value.lossy else str(entry.value.kind)
                    out.append((max(g0, entry.start), min(g1, entry.end), kind))
            if zeros > 0:
                out.append((-1, zeros - 1, "zeros"))
        return out

    def _dense_only(self, index: RangeIndex[Segment], spans: Spans) -> bool:
        """Whether a view's spans are dense rows only (no zero slots, no packed segment).
        O(spans x (log n + k))."""
        if any(zeros > 0 for _, zeros in spans):
            return False
        return not any(e.value.packed for g, _ in spans for g0, g1 in g for e in index.overlapping(g0, g1))

    def _dense_plan(self, index: RangeIndex[Segment], spans: Spans, h0: int, hin: int) -> ViewPlan:
        """The plan of a view of dense rows only: its row index and, on the torch backend, its gather (one
        `index_select`)."""
        p, sl = self._row_index(index, [g for global_ranges, _ in spans for g in global_ranges])
        gather = gather_plan(self.rows, p, sl, h0, hin) if self.backend == "torch" else None
        return ViewPlan(p.shape[2], page_idx=p, slot_idx=sl, gather=gather)

    def _runs(
        self, index: RangeIndex[Segment], spans: Spans, cap: int | None
    ) -> tuple[list[tuple[int, ...]], list[int], int, ExtraRuns | None]:
        """A view's run table rows (kernels/view_runs.py) from its spans, split at `cap` tokens, the concatenated
        codebook pages of its packed segments, its token count, and the runs of packed formats other than the
        history's (a tiered cache; None without tiers). O(pages of the view)."""
        store = self.packed
        runs: list[tuple[int, ...]] = []
        cb_pages: list[int] = []
        cb_offset: dict[int, int] = {}  # id(segment) -> its codebook pages' offset in cb_pages
        extra = ExtraRuns(self.stores) if len(self.stores) > 1 else None  # packed runs of the other tier formats
        o = 0
        for global_ranges, zeros in spans:
            for g0, g1 in global_ranges:
                for entry in index.overlapping(g0, g1):
                    lo, hi = max(g0, entry.start) - entry.start, min(g1, entry.end) - entry.start
                    seg = entry.value
                    if seg.packed and extra is not None and seg.fmt not in (None, store.name):
                        extra.add(seg, lo, hi, o)
                    elif seg.packed:
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
        return runs, cb_pages, o, extra

    def _run_plan(self, index: RangeIndex[Segment], spans: Spans, h0: int, hin: int) -> ViewPlan:
        """The run table of a whole view (`_runs`: dense, packed and zero runs split at `run_cap` tokens) and the
        concatenated codebook pages of its packed segments, in one host->device copy; on the torch backend also what
        `view_runs_torch` derives from them (`runs_torch_plan`). O(pages of the view)."""
        store = self.packed
        runs, cb_pages, o, extra = self._runs(index, spans, self.run_cap)
        desc = int64_on([x for run in runs for x in run] + cb_pages, self.device)
        n = RUN_COLUMNS * len(runs)
        table = desc[:n].view(len(runs), RUN_COLUMNS)
        max_run = max((run[3] for run in runs), default=0)
        cb = desc[n:] if store is not None else None
        derived = None
        if self.backend == "torch":
            sources = (store.token_view, store.codebook_rows, cb_pages, store.fmt) if store is not None else None
            derived = runs_torch_plan(self.rows, runs, h0, hin, self.batch_size, sources, self.scratch)
        extras = extra.build(self.device) if extra is not None else ()
        return ViewPlan(o, runs=table, cb_pages=cb, max_run=max_run, runs_plan=derived, extras=extras)

    def build_view(self, plan: ViewPlan, h0: int, hin: int, out: torch.Tensor) -> None:
        """Fill `out` `[2, B, plan.tokens, hin, D]` with heads `[h0, h0 + hin)` of the plan's rows: dense rows
        copied, packed rows dequantized, zero rows; one `view_build` or `view_runs` call (one Triton launch, or the
        torch reference: one gather of the dense rows, one dequantization per packed segment)."""
        if plan.page_idx is not None:
            assert plan.slot_idx is not None
            view_build(self.rows, plan.page_idx, plan.slot_idx, h0, hin, out, self.backend, plan.gather)
            return
        st = self.packed
        packed = (st.token_view, st.codebook_rows, plan.cb_pages) if st is not None else (None, None, None)
        fmt = st.fmt if st is not None else None
        out_t = out.permute(2, 0, 1, 3, 4)
        view_runs(self.rows, *packed, plan.runs, h0, out_t, fmt, plan.max_run, self.backend, plan.runs_plan)
        for other, pieces, cb in plan.extras:  # a tiered cache's other packed formats (fp8: torch on every backend)
            other.dequantize_pieces(out_t, pieces, cb, h0)

    # ------------------------------------------------------------ whole segments
    def read_dense(self, entry: RangeEntry[Segment]) -> torch.Tensor:
        """All tokens of a dense segment as `[2, n, B, H, D]` (a temporary; one gather by `view_build_torch` on every
        device: packing reads a chunk once, its k-means dominates, and views stay the only view_build launches)."""
        p, sl = self._dense_index(entry, entry.start, entry.end)
        out = torch.empty(*p.shape, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        view_build_torch(self.rows, p, sl, 0, self.num_heads, out)
        return out.transpose(1, 2)

    def store_dense(self, entry: RangeEntry[Segment], data: torch.Tensor) -> None:
        """Write `data` `[n, 2, B, H, D]` into a dense segment's pages (one `page_write`)."""
        p, sl = self._dense_index(entry, entry.start, entry.end)
        page_write(self.rows, p, sl, 0, data[:, 0].transpose(0, 1), data[:, 1].transpose(0, 1))

    def dequantize_segment(self, entry: RangeEntry[Segment]) -> torch.Tensor:
        """All tokens of a packed segment as dense `[n, 2, B, H, D]` (a temporary; nothing changes)."""
        seg = entry.value
        store = self.stores[seg.fmt] if seg.fmt is not None else self.packed
        assert store is not None and seg.packed
        n = entry.end - entry.start
        dense = torch.empty(n, 2, self.batch_size, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        n_tok = seg.n_token_pages
        store.dequantize_into(dense, seg.pages[:n_tok], seg.pages[n_tok:], 0, n, 0)
        return dense
