"""pagedqvg/store/page_io.py: PageIO against a dense model of the rows and the kernels' torch references.

- Writes (any head slice, segments over shuffled pages) then views of any spans equal a dense `[2, B, tokens, H, D]`
  model bit for bit (random bit patterns, NaNs included), and each view is one kernel call (a row index for dense
  views, a run table for views with zero slots or packed segments).
- Packed segments: a mixed view equals `prq_dequantize` of the quantized rows; `dequantize_segment` too.
- Fills, dense read/store round trips, the plan cache (same plan until `invalidate`, bounded), and the unit view of
  kernels/rows.py that the torch references gather through (odd page strides, storage offsets, head slices), with
  out-of-range indices refused.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import bits, cached_plans, random_bits

from pagedqvg import BlockPool
from pagedqvg.allocator import RangeIndex
from pagedqvg.kernels import dispatch
from pagedqvg.kernels.rows import record_gather
from pagedqvg.kernels.view.view_build import gather_plan, view_build_torch
from pagedqvg.layout.segments import DenseTokenLayout
from pagedqvg.quant import QuantConfig, prq_dequantize
from pagedqvg.store.packed_store import PackedStore
from pagedqvg.store.page_io import PLAN_CACHE_SIZE, PageIO, ViewPlan, WritePlan
from pagedqvg.store.segment import Segment, SegmentKind

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Layer:
    """A PageIO over a fresh pool, its range index, and the dense model `ref` `[2, B, tokens, H, D]` of every token
    written so far (global position = model position)."""

    def __init__(self, *, B=2, H=3, D=8, dtype=torch.bfloat16, page_bytes=1024, quant=None, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.pool = BlockPool(256 * page_bytes, page_bytes=page_bytes, device="cpu")
        self.owner = self.pool.new_owner("t")
        self.layout = DenseTokenLayout(B, H, D, dtype, page_bytes)
        self.store = PackedStore(self.pool, B, H, D, dtype, quant) if quant is not None else None
        self.io = PageIO(self.pool, self.layout, self.store)
        self.index: RangeIndex[Segment] = RangeIndex()
        self.B, self.H, self.D, self.dtype = B, H, D, dtype
        self.ref = torch.empty(2, B, 0, H, D, dtype=dtype)
        # Scramble the free list so that segments sit on non-consecutive pages.
        junk = self.pool.alloc(40, self.owner)
        self.pool.free(self.rng.sample(junk, len(junk)), self.owner)

    def append(self, n: int, finite: bool = False) -> None:
        """A new dense segment of `n` tokens, written through `write_plan`/`write` (all heads)."""
        g = self.ref.shape[2]
        self.index.insert(g, g + n, Segment(self.pool.alloc(self.layout.pages_for_tokens(n), self.owner)))
        self.io.invalidate()
        k, v = self.kv(n, self.H, finite)
        self.io.write(self.io.write_plan(self.index, g, g + n, 0, self.H), 0, k, v)
        self.ref = torch.cat([self.ref, torch.stack([k, v])], dim=2)

    def kv(self, n: int, heads: int, finite: bool) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.B, n, heads, self.D)
        if finite:
            return tuple(torch.randn(shape, generator=self.gen).to(self.dtype) for _ in range(2))  # type: ignore
        return random_bits(shape, self.dtype, self.gen), random_bits(shape, self.dtype, self.gen)

    def view(self, spans, h0: int, hin: int) -> torch.Tensor:
        plan = self.io.view_plan(self.index, spans, h0, hin)
        out = torch.empty(2, self.B, plan.tokens, hin, self.D, dtype=self.dtype)
        self.io.build_view(plan, h0, hin, out)
        return out

    def expect(self, spans, h0: int, hin: int) -> torch.Tensor:
        parts = []
        for ranges, zeros in spans:
            parts += [self.ref[:, :, a:b, h0 : h0 + hin] for a, b in ranges]
            parts.append(torch.zeros(2, self.B, zeros, hin, self.D, dtype=self.dtype))
        return torch.cat(parts, dim=2)


def count_calls(monkeypatch) -> dict[str, int]:
    """Counts of the dispatch functions PageIO calls (patched in page_io's namespace)."""
    import pagedqvg.store.page_io as page_io

    calls = {"page_write": 0, "view_build": 0, "view_runs": 0, "page_fill": 0}
    for name in calls:
        real = getattr(page_io, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(page_io, name, counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_bytes", [512, 1024, 4096])
def test_writes_and_views_equal_the_dense_model(monkeypatch, dtype, page_bytes):
    layer = Layer(dtype=dtype, page_bytes=page_bytes, seed=page_bytes)
    for n in (5, 1, 13, 7, 9):
        layer.append(n)
    calls = count_calls(monkeypatch)
    total = layer.ref.shape[2]
    # Head-sliced rewrites of token ranges that straddle segments and pages.
    for s, e, h0, hin in ((3, 11, 1, 2), (0, total, 0, 3), (17, 30, 2, 1), (6, 7, 0, 1)):
        k, v = layer.kv(e - s, hin, finite=False)
        plan = layer.io.write_plan(layer.index, s, e, h0, hin)
        assert isinstance(plan, WritePlan) and plan.page_idx.shape == (2, layer.B, e - s)
        layer.io.write(plan, h0, k, v)
        layer.ref[:, :, s:e, h0 : h0 + hin] = torch.stack([k, v])
    assert calls["page_write"] == 4
    for spans, h0, hin in (
        ([([(0, total)], 0)], 0, 3),
        ([([(0, 5)], 0), ([(20, 35)], 0)], 1, 2),
        ([([(4, 6), (30, 31)], 0)], 2, 1),
        ([([(0, 3)], 4), ([(10, 12)], 0)], 0, 3),  # never-filled slots read as zeros (a run table)
    ):
        before = calls["view_build"] + calls["view_runs"]
        got = layer.view(spans, h0, hin)
        assert calls["view_build"] + calls["view_runs"] == before + 1  # one kernel call per view
        assert torch.equal(bits(got), bits(layer.expect(spans, h0, hin)))
    assert calls["view_runs"] == 1


def test_plan_cache_reuses_until_invalidated_and_stays_bounded():
    layer = Layer()
    layer.append(20)
    spans = [([(2, 9)], 0)]
    plan = layer.io.view_plan(layer.index, spans, 0, 3)
    assert isinstance(plan, ViewPlan) and plan.tokens == 7 and plan.page_idx is not None
    assert layer.io.view_plan(layer.index, spans, 0, 3) is plan
    assert layer.io.view_plan(layer.index, spans, 1, 2) is not plan  # heads are part of the key
    w = layer.io.write_plan(layer.index, 0, 4, 0, 3)
    assert layer.io.write_plan(layer.index, 0, 4, 0, 3) is w
    layer.io.invalidate()
    assert layer.io.cached(("w", 0, 4, 0, 3)) is None
    assert layer.io.write_plan(layer.index, 0, 4, 0, 3) is not w
    for i in range(3 * PLAN_CACHE_SIZE):
        layer.io.remember(("x", i), i)
        assert len(cached_plans(layer.io)) <= PLAN_CACHE_SIZE
    assert layer.io.cached(("x", 3 * PLAN_CACHE_SIZE - 1)) == 3 * PLAN_CACHE_SIZE - 1


@pytest.mark.parametrize(("k_fill", "v_fill"), [(0.0, 0.0), (1.5, -2.0), (0.25, 0.25)])
def test_fill_tokens_sets_every_head_of_k_and_v(monkeypatch, k_fill, v_fill):
    layer = Layer(dtype=torch.float16)
    layer.append(11)
    layer.append(6)
    calls = count_calls(monkeypatch)
    entry = layer.index.find(2)
    layer.io.fill_tokens(entry, 3, 10, k_fill, v_fill)
    assert calls["page_fill"] == (1 if k_fill == v_fill else 2)
    layer.ref[0, :, 3:10] = k_fill
    layer.ref[1, :, 3:10] = v_fill
    spans = [([(0, 17)], 0)]
    assert torch.equal(bits(layer.view(spans, 0, 3)), bits(layer.expect(spans, 0, 3)))


def test_read_and_store_dense_round_trip():
    layer = Layer(B=3, dtype=torch.float32, page_bytes=2048)
    layer.append(4)
    layer.append(23)
    entry = layer.index.find(4)
    dense = layer.io.read_dense(entry)  # [2, n, B, H, D]
    assert dense.shape == (2, 23, 3, 3, 8)
    assert torch.equal(bits(dense), bits(layer.ref[:, :, 4:27].transpose(1, 2)))
    new = random_bits((23, 2, 3, 3, 8), torch.float32, layer.gen)
    layer.io.store_dense(entry, new)
    layer.ref[:, :, 4:27] = new.permute(1, 2, 0, 3, 4)
    spans = [([(0, 27)], 0)]
    assert torch.equal(bits(layer.view(spans, 0, 3)), bits(layer.expect(spans, 0, 3)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mixed_views_and_dequantize_segment_equal_prq_dequantize(monkeypatch, dtype):
    quant = QuantConfig(bits=2, centroids=4, block_size=8, stages=2, keep_recent_chunks=0)
    layer = Layer(B=2, H=2, D=16, dtype=dtype, page_bytes=1024, quant=quant, seed=3)
    for n in (9, 12, 5):
        layer.append(n, finite=True)
    store = layer.store
    assert store is not None
    # Pack the middle segment as the cache does (quantize its dense rows, swap its pages).
    entry = layer.index.find(9)
    q = store.quantize(layer.io.read_dense(entry))
    layer.pool.free(entry.value.pages, layer.owner)
    pages = layer.pool.alloc(store.pages_for_tokens(12), layer.owner)
    n_tok = store.token_pages(12)
    store.write(pages[:n_tok], pages[n_tok:], q)
    entry.value = Segment(pages, None, SegmentKind.PACKED, n_tok)
    layer.io.invalidate()
    full = prq_dequantize(q.token_rows.reshape(12, -1), q.codebook_rows, store.fmt_all).view(12, 2, 2, 2, 16)
    layer.ref[:, :, 9:21] = full.permute(1, 2, 0, 3, 4)

    assert torch.equal(bits(layer.io.dequantize_segment(entry)), bits(full))
    calls = count_calls(monkeypatch)
    for spans, h0, hin in (([([(0, 26)], 0)], 0, 2), ([([(3, 4), (11, 19)], 2), ([(24, 26)], 0)], 1, 1)):
        got = layer.view(spans, h0, hin)
        assert torch.equal(bits(got), bits(layer.expect(spans, h0, hin)))
    assert calls == {"page_write": 0, "view_build": 0, "view_runs": 2, "page_fill": 0}


@pytest.mark.parametrize(
    ("page_elems", "offset", "h0", "hin"),
    [(3 * 64 + 40, 0, 0, 4), (3 * 64 + 40, 8, 1, 2), (256, 0, 3, 1), (250, 2, 0, 4)],
    ids=["odd-page-stride", "offset-head-slice", "last-head", "unit-of-2"],
)
def test_unit_view_gathers_exactly_what_indexing_does(page_elems, offset, h0, hin):
    """`gather_plan` (`record_gather` over a window view of the rows' storage) addresses the same elements as
    `rows[page, slot, h0:h0 + hin]`, whatever the page stride and storage offset; `view_build_torch` through it
    equals aten indexing bit for bit."""
    gen = torch.Generator().manual_seed(page_elems + offset)
    H, D, rpp, pages = 4, 8, 6, 5
    arena = random_bits((offset + pages * page_elems,), torch.float16, gen)
    rows = arena[offset:].view(pages, page_elems)[:, : rpp * H * D].view(pages, rpp, H, D)
    p = torch.randint(0, pages, (2, 3, 7), generator=gen)
    s = torch.randint(0, rpp, (2, 3, 7), generator=gen)
    plan = gather_plan(rows, p, s, h0, hin)
    assert plan is not None and plan[0].data_ptr() == rows.data_ptr()
    got = torch.index_select(plan[0], 0, plan[1]).view(2, 3, 7, hin, D)
    assert torch.equal(bits(got), bits(rows[p, s, h0 : h0 + hin]))
    out = torch.empty(2, 3, 7, hin, D, dtype=torch.float16)
    view_build_torch(rows, p, s, h0, hin, out)
    assert torch.equal(bits(out), bits(rows[p, s, h0 : h0 + hin]))
    strided = torch.empty(2, 7, 3, hin, D, dtype=torch.float16).transpose(1, 2)  # a non-contiguous out
    view_build_torch(rows, p, s, h0, hin, strided)
    assert torch.equal(bits(strided), bits(out))


@pytest.mark.parametrize(
    ("starts", "block", "c"),
    [([8, 9, 10, 11, 0, 1, 2, 3], 0, 4), ([8, 9, 10, 11, 2, 3], 0, 2), ([4, 5, 6, 7, 8, 9, 10, 11], 0, 8),
     ([3, 4], 0, 2), ([5], 0, 1), ([], 0, 1), ([6, 7, 2, 3, 4, 5], 0, 2), ([0, 1, 2, 3, 4, 5, 6, 7], 4, 4),
     ([1, 2, 3, 5, 6, 7], 0, 3)],
)  # fmt: skip
def test_record_gather_reads_adjacent_records_as_one_block(starts, block, c):
    """Runs [8, 12) and [0, 4): blocks of 4; a run of 2 halves it; a run may start anywhere ([3, 5), [1, 4) and
    [5, 8): the window view starts a block at any element); `block` bounds the count; the index reads the same
    elements as the records one by one."""
    base = torch.arange(16, dtype=torch.float32)
    source, index = record_gather(base, torch.tensor(starts, dtype=torch.int64), 1, 1, block)
    assert source.shape[1] == c and index.numel() == len(starts) // c
    assert torch.equal(torch.index_select(source, 0, index).reshape(-1), base[starts])


def test_views_coalesce_rows_of_a_page_into_one_copy(monkeypatch):
    """A dense view of whole chunks gathers blocks of consecutive rows (index_select over wider units), with the
    same bits as the per-row gather."""
    seen = []
    real = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda src, *a, **k: (seen.append(src.shape[1]), real(src, *a, **k))[1])
    layer = Layer(B=1, H=2, D=8, dtype=torch.float16, page_bytes=1024, seed=5)  # 16 tokens per page
    for _ in range(3):
        layer.append(32)
    spans = [([(0, 32), (64, 96)], 0)]
    assert torch.equal(bits(layer.view(spans, 0, 2)), bits(layer.expect(spans, 0, 2)))
    assert seen == [16 * 2 * 8]  # a unit of 16 tokens (one page's K or V block) per copy


@pytest.mark.parametrize("zeros", [0, 5], ids=["dense-only", "run-table"])
@pytest.mark.parametrize("B", [1, 2])
def test_rows_coalesce_in_pages_of_an_odd_token_count(monkeypatch, zeros, B):
    """Pages of an odd token count (101 per page here; the auto page size holds 783 at the LingBot-like layer) whose
    size is no whole number of rows, so page starts are not row-aligned: a page's rows still coalesce into one
    block per page run (read from a window view of the arena, which starts a block at any element; before, the
    block had to start at a multiple of its size, which capped it at a fraction of a row), and the view is one
    gather (per output range and (kv, b) with zero slots); bits equal the reference's. With B = 2 a batch
    element's rows are B rows apart in a page (token-major pages), so they gather row by row (as head slices do)."""
    D, H = 8, 3
    page_bytes = 256 * -(-101 * 2 * B * H * D * 2 // 256)  # 101 tokens per page and a tail that is no whole row
    layer = Layer(B=B, H=H, D=D, dtype=torch.float16, page_bytes=page_bytes, seed=11)
    assert layer.layout.tokens_per_page == 101 and (page_bytes // 2) % (H * D)
    for _ in range(2):
        layer.append(202)
    spans = [([(0, 202), (303, 404)], zeros)]  # three whole pages
    widths = []
    real = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda s, *a, **k: (widths.append(s.shape[1]), real(s, *a, **k))[1])
    for h0, hin in ((0, 3), (1, 2)):
        layer.io.invalidate()
        widths.clear()
        got = layer.view(spans, h0, hin)
        assert torch.equal(bits(got), bits(layer.expect(spans, h0, hin)))
        rows = 101 if B == 1 and hin == H else 1  # a head slice of a row is no neighbour of the next row's
        assert set(widths) == {rows * hin * D} and len(widths) == (1 if zeros == 0 else 2 * B)


def test_gather_plan_refuses_rows_whose_heads_are_not_contiguous():
    rows = torch.zeros(3, 4, 2, 8)[:, :, :, ::2]  # D elements 2 apart
    assert gather_plan(rows, torch.tensor([[2]]), torch.tensor([[3]]), 0, 2) is None
    out = torch.empty(1, 1, 2, 4)
    view_build_torch(rows, torch.tensor([[2]]), torch.tensor([[3]]), 0, 2, out)  # the per-element fallback
    assert torch.equal(out[0, 0], rows[2, 3])


@pytest.mark.parametrize(
    ("page", "slot", "match"),
    [(5, 0, r"page index out of range: 0\.\.5, valid 0\.\.4"), (0, 6, r"slot index out of range: 0\.\.6, valid 0\.\.5"),
     (-1, 0, r"page index out of range: -1\.\.0")],
)  # fmt: skip
def test_view_build_torch_refuses_indices_outside_the_rows(page, slot, match):
    rows = torch.zeros(5, 6, 2, 4)
    p = torch.tensor([[[0, page]]])
    s = torch.tensor([[[0, slot]]])
    with pytest.raises(IndexError, match=match):
        view_build_torch(rows, p, s, 0, 2, torch.empty(1, 1, 2, 2, 4))


def test_pageio_refuses_a_layout_that_does_not_fit_the_pool():
    pool = BlockPool(8 * 1024, page_bytes=1024, device="cpu")
    with pytest.raises(ValueError, match=r"layout of 2048 B pages .* the pool's 1024 B pages"):
        PageIO(pool, DenseTokenLayout(1, 2, 8, torch.float16, 2048), None)
    with pytest.raises(ValueError, match="holding 0 tokens"):
        PageIO(pool, DenseTokenLayout(4, 8, 32, torch.float32, 1024), None)


def test_cpu_pageio_runs_the_torch_references(monkeypatch):
    """On CPU (PAGEDQVG_KERNELS unset) every dispatch call PageIO makes ends in a torch reference."""
    monkeypatch.delenv("PAGEDQVG_KERNELS", raising=False)
    assert dispatch.kernel_backend("cpu") == "torch"
    seen = []
    for name in ("page_write_torch", "view_build_torch", "view_runs_torch", "page_fill_torch"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _r=real, _n=name, **k: (seen.append(_n), _r(*a, **k))[1])
    layer = Layer()
    layer.append(10)
    layer.io.fill_tokens(layer.index.find(0), 0, 2)
    layer.view([([(0, 10)], 0)], 0, 3)
    layer.view([([(0, 10)], 1)], 0, 3)
    assert seen == ["page_write_torch", "page_fill_torch", "view_build_torch", "view_runs_torch"]
