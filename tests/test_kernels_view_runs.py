"""The mixed view build (dense + PRQ-packed + zero runs of a whole view, one launch) against its torch reference.

Runs like tests/test_kernels_page_write.py: without CUDA the Triton kernel runs in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1 is set by helpers.py before anything imports triton; if triton was already imported in compiled
mode, `test_interpreter_in_subprocess` reruns this file in a fresh process). On a CUDA machine the same comparisons
run on CUDA tensors with compiled kernels.

- The reference (`view_runs_torch`) is checked against the established ops it generalises: `view_build_torch` on
  `segment_row_index` rows for dense runs, `packed_dequant_torch` for packed runs, zeros for zero runs.
- The kernel is compared bit for bit with the reference over the whole output buffer (rows and heads no run
  covers must be untouched) and the whole arena (read-only), on tables mixing dense, packed (two segments, own
  codebooks) and zero runs, runs not multiples of the tile's rows, one-token runs, head slices, batch 1-2, every
  code format (int2/int4, asymmetric, trits, 2 stages), float32/float16/bfloat16 and non-contiguous outputs.
- Bad tables and arguments raise typed errors naming the values; the cache's mixed views are one launch each,
  with the table built once per plan.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from helpers import (  # sets TRITON_INTERPRET
    bits,
    compiled_mode_json,
    contract_checked_kmeans,
    random_bits,
    rerun_interpreted,
    set_view_run_cap,
    triton_kernels,
)

from pagedqvg import BlockPool, PagedCausalKVCache
from pagedqvg.kernels import dispatch
from pagedqvg.kernels.rows import segment_row_index, token_rows
from pagedqvg.kernels.view.dequant import packed_dequant_torch, piece_table
from pagedqvg.kernels.view.view_build import view_build_torch
from pagedqvg.kernels.view.view_runs import DENSE, PACKED, ZERO, dense_runs, packed_runs, view_runs_torch, zero_runs
from pagedqvg.layout.segments import DenseTokenLayout
from pagedqvg.quant import QuantConfig, prq_quantize
from pagedqvg.store.packed_store import PackedStore

tvr, TRITON_ERROR, DEVICE, WHY = triton_kernels("view.triton_view_runs", "_view_runs_kernel")
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
#: Where the tensors live: the kernels' device, or the CPU for the reference-only tests when the kernels cannot run.
ON = DEVICE if DEVICE is not None else torch.device("cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Arena:
    """A pool of stale random bytes holding, on scrambled pages, two PRQ-packed segments (own codebooks) and dense
    pages of random bits; with `cfg=None` dense pages only. Both views of the arena exist, as in the cache."""

    def __init__(self, cfg, batch, heads, head_dim, dtype, page_bytes, gen, device, packed_tokens=(9, 5)):
        self.pool = pool = BlockPool(120 * page_bytes, page_bytes=page_bytes, device=device)
        pool.arena.view(torch.uint8).copy_(random_bits(pool.arena.shape, torch.uint8, gen))
        layout = DenseTokenLayout(batch, heads, head_dim, dtype, page_bytes)
        self.tpp = layout.tokens_per_page
        assert self.tpp >= 1
        self.rows = token_rows(pool, dtype, heads, head_dim, layout.rows_per_page)
        pages = pool.alloc(pool.num_pages, pool.new_owner("test"))
        pages = [pages[i] for i in torch.randperm(len(pages), generator=gen).tolist()]
        self.store = self.fmt = None
        self.packed: list[tuple[list[int], list[int], int]] = []  # (token pages, codebook pages, tokens)
        if cfg is not None:
            self.store = st = PackedStore(pool, batch, heads, head_dim, dtype, cfg)
            self.fmt = st.fmt
            for n in packed_tokens:
                dense = (torch.randn(2, n, batch * heads, head_dim, generator=gen) * 3).to(dtype)
                segs = [prq_quantize(dense[kv], cfg) for kv in range(2)]
                tok = torch.stack([s.token_rows.view(n, batch, -1) for s in segs], dim=1)
                cb = torch.cat([s.codebooks for s in segs]).reshape(-1, cfg.centroids, head_dim)
                ntok = st.token_pages(n)
                tp, cp = pages[:ntok], pages[ntok : st.pages_for_tokens(n)]
                pages = pages[st.pages_for_tokens(n) :]
                for page, first, count, o, _ in piece_table(tp, st.tpp, 0, n):
                    st.token_view[page, first : first + count].copy_(tok[o : o + count].to(device))
                for r in range(cb.shape[0]):
                    st.codebook_rows[cp[r // st.cb_rpp], r % st.cb_rpp].copy_(cb[r].to(device))
                self.packed.append((tp, cp, n))
        self.dense_pages = pages[:12]  # random bits: any dense token is as good as any other

    def sources(self, cb_pages: torch.Tensor | None):
        st = self.store
        if st is None:
            return (self.rows, None, None, None)
        return (self.rows, st.token_view, st.codebook_rows, cb_pages)


def build_view(arena: Arena, plan, cap):
    """Run table, codebook pages and the total length for `plan`: a list of ("d", t0, t1) dense tokens of the
    arena's dense pages, ("p", j, t0, t1) tokens of packed segment j, ("z", m) zero rows."""
    runs, cbs, cb_at, o = [], [], {}, 0
    for item in plan:
        if item[0] == "d":
            runs += dense_runs(arena.dense_pages, arena.tpp, item[1], item[2], o, cap)
            o += item[2] - item[1]
        elif item[0] == "p":
            j, t0, t1 = item[1:]
            tp, cp, _ = arena.packed[j]
            if j not in cb_at:
                cb_at[j] = len(cbs)
                cbs += cp
            runs += packed_runs(tp, arena.store.tpp, t0, t1, o, cb_at[j], cap)
            o += t1 - t0
        else:
            runs += zero_runs(o, item[1], cap)
            o += item[1]
    dev = arena.pool.device
    table = torch.tensor(runs, dtype=torch.int64, device=dev).view(-1, 6)
    cb_pages = torch.tensor(cbs, dtype=torch.int64, device=dev) if arena.store is not None else None
    return table, cb_pages, o


def expected_by_parts(arena: Arena, plan, head_start, out):
    """The view assembled from the established references, part by part, into `out` [2, B, T, heads, D]."""
    B, heads = out.shape[1], out.shape[3]
    kv_batch = (torch.arange(2)[:, None] * B + torch.arange(B)[None, :])[:, :, None].to(out.device)
    pages_t = torch.tensor(arena.dense_pages, dtype=torch.int64, device=out.device)
    o = 0
    for item in plan:
        if item[0] == "d":
            m = item[2] - item[1]
            p, s = segment_row_index(pages_t, arena.rows.shape[1], item[1], item[2], kv_batch)
            part = torch.empty(2, B, m, heads, out.shape[4], dtype=out.dtype, device=out.device)
            view_build_torch(arena.rows, p, s, head_start, heads, part)
            out[:, :, o : o + m] = part
        elif item[0] == "p":
            j, t0, t1 = item[1:]
            m = t1 - t0
            tp, cp, _ = arena.packed[j]
            pieces = torch.tensor(piece_table(tp, arena.store.tpp, t0, t1), dtype=torch.int64, device=out.device)
            st = arena.store
            cbp = torch.tensor(cp, dtype=torch.int64, device=out.device)
            packed_dequant_torch(st.token_view, st.codebook_rows, pieces.view(-1, 5), cbp, head_start,
                                 out[:, :, o : o + m].permute(2, 0, 1, 3, 4), st.fmt)  # fmt: skip
        else:
            m = item[1]
            out[:, :, o : o + m] = 0
        o += m


Q_INT2 = QuantConfig(bits=2, centroids=8, block_size=16)
Q_INT2_ASYM = QuantConfig(bits=2, centroids=8, block_size=8, asymmetric=True)
Q_INT4_2ST = QuantConfig(bits=4, centroids=16, block_size=16, stages=2)
Q_INT4_ASYM_2ST = QuantConfig(bits=4, centroids=5, block_size=32, asymmetric=True, stages=2)
Q_TRITS_2ST = QuantConfig(bits=2, centroids=4, block_size=8, pack_trits=True, stages=2)

# (name, cfg, B, H, D, head_start, heads, page_bytes, cap, tile override)
CASES = [
    ("int2-B1-all", Q_INT2, 1, 2, 32, 0, 2, 1024, None, None),
    ("int2asym-B2-slice-cap3", Q_INT2_ASYM, 2, 3, 16, 1, 2, 1024, 3, None),
    ("int4-2st-B2-slice-tile8x16", Q_INT4_2ST, 2, 4, 16, 1, 2, 1024, None, (8, 16)),
    ("int4asym-2st-B1-slice-cap2", Q_INT4_ASYM_2ST, 1, 3, 32, 2, 1, 2048, 2, (4, 32)),
    ("trits-2st-D24-B2", Q_TRITS_2ST, 2, 2, 24, 0, 2, 1024, 5, None),
    ("dense-only-B2-slice", None, 2, 3, 16, 1, 2, 1024, 4, (2, 32)),
]


def plan_for(arena: Arena):
    """Dense, packed (both segments, one of them twice), zero and one-token runs, in a scrambled order."""
    t = arena.tpp
    if arena.store is None:
        return [("d", 1, 2 * t + 1), ("z", 3), ("d", 0, 1), ("z", 1), ("d", t, t + 1)]
    n0, n1 = arena.packed[0][2], arena.packed[1][2]
    return [("d", 1, 2 * t + 1), ("p", 0, 1, n0 - 1), ("z", 3), ("p", 1, 0, n1), ("d", 0, 1), ("p", 0, n0 - 1, n0),
            ("z", 1), ("d", t, t + 1)]  # fmt: skip


def _id(case):
    return case[0]


def _setup(case, dtype):
    name, cfg, B, H, D, _, _, page_bytes, cap, _ = case
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{dtype}".encode()))
    arena = Arena(cfg, B, H, D, dtype, page_bytes, gen, ON)
    plan = plan_for(arena)
    table, cb_pages, T = build_view(arena, plan, cap)
    return gen, arena, plan, table, cb_pages, T


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_reference_matches_the_established_ops(case, dtype):
    _, _, B, _, D, h0, heads, _, cap, _ = case
    gen, arena, plan, table, cb_pages, T = _setup(case, dtype)
    assert cap is None or int(table[:, 3].max()) <= cap
    kinds = set(table[:, 0].tolist())
    assert kinds == ({DENSE, ZERO} if arena.store is None else {DENSE, PACKED, ZERO})
    ref = random_bits((2, B, T, heads, D), dtype, gen).to(ON)
    direct = ref.clone()
    view_runs_torch(*arena.sources(cb_pages), table, h0, ref.permute(2, 0, 1, 3, 4), arena.fmt, cap)
    expected_by_parts(arena, plan, h0, direct)
    assert torch.equal(bits(ref.cpu()), bits(direct.cpu()))


@needs_kernels
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_view_runs_matches_torch(case, dtype):
    _, _, B, _, D, h0, heads, _, cap, tile = case
    gen, arena, _plan, table, cb_pages, T = _setup(case, dtype)
    arena_bits = arena.pool.arena.clone()
    # Two rows more than the view and one more head: what no run covers must stay as it was.
    big = random_bits((2, B, T + 2, heads + 1, D), dtype, gen).to(ON)
    ref = big.clone()
    view_runs_torch(*arena.sources(cb_pages), table, h0, ref[:, :, 1 : T + 1, :heads].permute(2, 0, 1, 3, 4),
                    arena.fmt, cap)  # fmt: skip
    kw = {} if tile is None else {"block_rows": tile[0], "block_cols": tile[1]}
    out_t = big[:, :, 1 : T + 1, :heads].permute(2, 0, 1, 3, 4)
    tvr.view_runs_triton(*arena.sources(cb_pages), table, h0, out_t, arena.fmt, cap, **kw)
    assert torch.equal(bits(big.cpu()), bits(ref.cpu()))
    assert torch.equal(arena.pool.arena, arena_bits)  # sources untouched


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_view_runs_strided_out_and_no_max_run(dtype):
    """`out_t` with no unit or contiguous stride; max_run=None (the launch covers T rows per run)."""
    case = ("strided", Q_INT4_2ST, 2, 3, 16, 0, 3, 1024, None, None)
    gen, arena, _plan, table, cb_pages, T = _setup(case, dtype)
    big = random_bits((T, 5, 2 * 2, 3 + 1, 2 * 16), dtype, gen).to(ON)
    expect = big.clone()
    view_runs_torch(*arena.sources(cb_pages), table, 0, expect[:, 1:5:2, ::2, 1:, ::2], arena.fmt)
    tvr.view_runs_triton(*arena.sources(cb_pages), table, 0, big[:, 1:5:2, ::2, 1:, ::2], arena.fmt)
    assert torch.equal(bits(big.cpu()), bits(expect.cpu()))


def test_run_builders_split_and_offsets():
    assert dense_runs([7, 3, 9], 4, 2, 11, 5, cap=3) == [
        (DENSE, 7, 2, 2, 5, 0), (DENSE, 3, 0, 3, 7, 0), (DENSE, 3, 3, 1, 10, 0), (DENSE, 9, 0, 3, 11, 0)]  # fmt: skip
    assert packed_runs([4, 6], 10, 8, 13, 0, 2) == [(PACKED, 4, 8, 2, 0, 2), (PACKED, 6, 0, 3, 2, 2)]
    assert zero_runs(3, 5, cap=2) == [(ZERO, 0, 0, 2, 3, 0), (ZERO, 0, 0, 2, 5, 0), (ZERO, 0, 0, 1, 7, 0)]
    assert zero_runs(3, 0) == [] and dense_runs([1], 4, 2, 2) == []
    with pytest.raises(ValueError, match="cap must be >= 1"):
        zero_runs(0, 3, cap=0)


def _bad_table_cases(arena: Arena, table: torch.Tensor, T: int):
    """(description, mutate(table) in place, exception type, message pattern)."""
    n_pages = arena.rows.shape[0]
    dense = int((table[:, 0] == DENSE).nonzero()[0, 0])
    packed = int((table[:, 0] == PACKED).nonzero()[0, 0])

    def setter(i, col, value):
        def mutate(t):
            t[i, col] = value

        return mutate

    return [
        ("kind 7", setter(0, 0, 7), ValueError, r"run 0 \(7, .*kind must be one of \(0, 1, 2\)"),
        ("negative count", setter(dense, 3, -1), ValueError, "negative count"),
        ("dense page", setter(dense, 1, n_pages), IndexError, rf"dense page outside \[0, {n_pages}\)"),
        ("dense slot", setter(dense, 2, arena.tpp), IndexError, rf"dense token slots outside \[0, {arena.tpp}\)"),
        ("out row", setter(dense, 4, T), IndexError, rf"output rows outside \[0, {T}\)"),
        ("token page", setter(packed, 1, -1), IndexError, "token page outside"),
        ("cb offset", setter(packed, 5, 99), IndexError, r"cb_pages\[cb_offset : cb_offset \+ \d+\] outside the"),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_tables_raise_naming_the_run(monkeypatch, backend, debug_on):
    """The reference always, and the Triton path under the debug switch, refuse bad table values."""
    if backend == "triton" and DEVICE is None:
        pytest.skip(WHY)
    monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
    case = ("bad", Q_INT2, 1, 2, 16, 0, 2, 1024, 2, None)
    _gen, arena, _plan, table, cb_pages, T = _setup(case, torch.bfloat16)
    out_t = torch.zeros(T, 2, 1, 2, 16, dtype=torch.bfloat16, device=ON)
    for what, mutate, exc, pattern in _bad_table_cases(arena, table, T):
        bad = table.clone()
        mutate(bad)
        with pytest.raises(exc, match=pattern):
            dispatch.view_runs(*arena.sources(cb_pages), bad, 0, out_t, arena.fmt, 2)
        assert not out_t.any(), what  # nothing written
    with pytest.raises(ValueError, match="count exceeds max_run=1"):
        dispatch.view_runs(*arena.sources(cb_pages), table, 0, out_t, arena.fmt, 1)
    bad_cb = cb_pages.clone()
    bad_cb[-1] = 10_000
    with pytest.raises(IndexError, match="codebook page out of range"):
        dispatch.view_runs(*arena.sources(bad_cb), table, 0, out_t, arena.fmt, 2)
    with pytest.raises(ValueError, match="a packed run but no packed sources"):
        dispatch.view_runs(arena.rows, None, None, None, table, 0, out_t, None, 2)


@pytest.mark.parametrize("fn", ["reference", "triton"])
def test_bad_arguments_raise_typed_errors(fn):
    if fn == "triton" and DEVICE is None:
        pytest.skip(WHY)
    run = view_runs_torch if fn == "reference" else tvr.view_runs_triton
    case = ("args", Q_INT2, 1, 2, 16, 0, 2, 1024, 2, None)
    _gen, arena, _plan, table, cb_pages, T = _setup(case, torch.bfloat16)
    src = arena.sources(cb_pages)
    out_t = torch.zeros(T, 2, 1, 2, 16, dtype=torch.bfloat16, device=ON)
    with pytest.raises(ValueError, match=r"runs must be int64 \[P, 6\], got torch.int32"):
        run(*src, table.int(), 0, out_t, arena.fmt)
    with pytest.raises(ValueError, match=r"runs must be int64 \[P, 6\], got torch.int64 \(\d+, 5\)"):
        run(*src, table[:, 1:], 0, out_t, arena.fmt)
    with pytest.raises(TypeError, match=r"out_t dtype torch\.float32 differs from the rows' torch\.bfloat16"):
        run(*src, table, 0, out_t.float(), arena.fmt)
    with pytest.raises(ValueError, match=r"heads \[1, 3\) outside the rows' 2 heads"):
        run(*src, table, 1, out_t, arena.fmt)
    with pytest.raises(ValueError, match=r"out_t must be \[T, 2, B, heads, D\], got \(\d+, 2, 1, 2\)"):
        run(*src, table, 0, out_t[..., 0], arena.fmt)
    with pytest.raises(ValueError, match="rows have head_dim 16, out_t 8"):
        run(*src, table, 0, out_t[..., :8], arena.fmt)
    with pytest.raises(ValueError, match=r"rows must be \[num_pages, rows_per_page, H, D\], got shape"):
        run(arena.rows[0], *src[1:], table, 0, out_t, arena.fmt)
    with pytest.raises(ValueError, match=r"got only \['tokens', 'codebooks', 'cb_pages'\]"):
        run(*src, table, 0, out_t, None)
    rpp = arena.rows.shape[1]
    with pytest.raises(ValueError, match=rf"rows_per_page {rpp} is not a multiple of 2 \* batch = 6"):
        run(*src, table, 0, torch.zeros(T, 2, 3, 2, 16, dtype=torch.bfloat16, device=ON), arena.fmt)
    # Empty table or empty view: nothing written, no error.
    run(*src, table[:0], 0, out_t, arena.fmt)
    run(*src, table[:0], 0, out_t[:0], arena.fmt)
    assert not out_t.any()


def test_torch_backend_dispatch_is_the_reference(monkeypatch):
    monkeypatch.setenv("PAGEDQVG_KERNELS", "torch")
    case = ("dispatch", Q_INT2_ASYM, 2, 2, 16, 1, 1, 1024, 3, None)
    gen, arena, _plan, table, cb_pages, T = _setup(case, torch.float16)
    a = random_bits((T, 2, 2, 1, 16), torch.float16, gen).to(ON)
    b = a.clone()
    dispatch.view_runs(*arena.sources(cb_pages), table, 1, a, arena.fmt, 3)
    view_runs_torch(*arena.sources(cb_pages), table, 1, b, arena.fmt, 3)
    assert torch.equal(bits(a.cpu()), bits(b.cpu()))


# ---------------------------------------------------------------------------------------------- via the cache
def _count_launches(monkeypatch):
    from pagedqvg.kernels.view import triton_dequant, triton_view_build

    calls = {"view_runs": [], "view_build": 0, "packed_dequant": 0}
    real_runs = tvr.view_runs_triton
    real_vb, real_dq = triton_view_build.view_build_triton, triton_dequant.packed_dequant_triton

    def runs(*a, **k):
        # the dispatcher hands on its ViewRunsArgs; its run table is plan-cached (the same tensor on a repeated view)
        calls["view_runs"].append(a[0].runs)
        return real_runs(*a, **k)

    def vb(*a, **k):
        calls["view_build"] += 1
        return real_vb(*a, **k)

    def dq(*a, **k):
        calls["packed_dequant"] += 1
        return real_dq(*a, **k)

    monkeypatch.setattr(tvr, "view_runs_triton", runs)
    monkeypatch.setattr(triton_view_build, "view_build_triton", vb)
    monkeypatch.setattr(triton_dequant, "packed_dequant_triton", dq)
    return calls


@needs_kernels
@pytest.mark.parametrize(("dtype", "run_cap"), [(torch.bfloat16, None), (torch.float16, 2)], ids=["bf16", "fp16-cap2"])
def test_cache_mixed_views_one_launch_identical_to_torch(monkeypatch, dtype, run_cap):
    """A quantized cache (batch 2, sink, head slices): every view equals the torch backend's bit for bit, and on
    the Triton backend every view is exactly one launch (packed views: the run kernel only, no packed-only
    dequant); a repeated call reuses its plan's run table (no new table, no host->device copy). `run_cap`: runs
    split as on CUDA (at most that many tokens each; None: cut at page ends only, the CPU default). Both caches pack
    with the torch k-means results (the Triton steps run too and are checked against their contract: they may
    resolve a near-tie the other way, depending on the machine's BLAS, and this test is about views: same packed
    bytes in, same view out)."""
    checked = contract_checked_kmeans(monkeypatch)
    quant = QuantConfig(bits=2, centroids=4, block_size=8, keep_recent_chunks=0, stages=2)
    steps = ((0, None), (3, 1), (6, None), (6, None), (9, 1), (12, None), (12, None), (15, 1), (18, None))
    results = {}
    calls = _count_launches(monkeypatch)
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        pool = BlockPool(64 * 1024, page_bytes=1024, device=ON)
        cache = PagedCausalKVCache(pool=pool, batch_size=2, cache_size=12, num_heads=3, head_dim=16, dtype=dtype,
                                   device=ON, sink_tokens=3, quant=quant)  # fmt: skip
        if backend == "triton":
            set_view_run_cap(cache, run_cap)
        gen = torch.Generator().manual_seed(9)
        views, tables = [], []
        for start, hs in steps:
            before = (len(calls["view_runs"]), calls["view_build"], calls["packed_dequant"])
            kv = [torch.randn(2, 3, 3 if hs is None else 2, 16, generator=gen).to(dtype).to(ON) for _ in range(2)]
            view = cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=start,
                                                     cache_head_start=hs)  # fmt: skip
            sources = cache.last_view_sources()
            views.append((view.k.cpu().clone(), view.v.cpu().clone(), sources))
            if backend == "triton":
                launches = len(calls["view_runs"]) - before[0] + calls["view_build"] - before[1]
                assert launches == 1, (start, sources)
                if any(kind == "packed" for *_, kind in sources):
                    assert len(calls["view_runs"]) == before[0] + 1
                    assert calls["packed_dequant"] == before[2]  # (no unpack in these steps)
                    tables.append((start, calls["view_runs"][-1]))
                    assert run_cap is None or int(tables[-1][1][:, 3].max()) <= run_cap
        results[backend] = views
    assert any(kind == "packed" for _, _, src in results["torch"] for *_, kind in src)
    assert checked["assign"] > 0 and checked["update"] > 0
    for (ka, va, sa), (kb, vb, sb) in zip(results["torch"], results["triton"], strict=True):
        assert sa == sb
        assert torch.equal(bits(ka), bits(kb)) and torch.equal(bits(va), bits(vb))
    repeated = [(a, b) for (sa, a), (sb, b) in itertools.pairwise(tables) if sa == sb]
    assert repeated and all(a is b for a, b in repeated)  # the denoise-step repeat reuses the cached table


@needs_kernels
def test_cache_zero_slots_without_quant_one_launch(monkeypatch):
    """Quant off, a global sink longer than the local end: the view's zero slots and dense rows, one launch."""
    calls = _count_launches(monkeypatch)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        pool = BlockPool(32 * 1024, page_bytes=1024, device=ON)
        cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=8, num_heads=2, head_dim=16,
                                   dtype=torch.bfloat16, device=ON, attention_window_size=4,
                                   global_sink_tokens=6)  # fmt: skip
        gen = torch.Generator().manual_seed(4)
        k, v = (random_bits((1, 5, 2, 16), torch.bfloat16, gen).to(ON) for _ in range(2))
        n_runs = len(calls["view_runs"])
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
        assert any(kind == "zeros" for *_, kind in cache.last_view_sources())
        if backend == "triton":
            assert len(calls["view_runs"]) == n_runs + 1 and calls["view_build"] == 0
        results[backend] = (view.k.cpu(), view.v.cpu())
    assert torch.equal(bits(results["torch"][0]), bits(results["triton"][0]))
    assert torch.equal(bits(results["torch"][1]), bits(results["triton"][1]))
    assert not results["triton"][0][:, -1].any()  # the zero slot


@needs_kernels
def test_cache_dense_views_of_several_ranges_one_row_index_launch(monkeypatch):
    """Quant off, sink + rolling tail (two slot ranges): one row-index launch (the ranges' indices concatenated)."""
    calls = _count_launches(monkeypatch)
    monkeypatch.setenv("PAGEDQVG_KERNELS", "triton")
    pool = BlockPool(32 * 1024, page_bytes=1024, device=ON)
    cache = PagedCausalKVCache(pool=pool, batch_size=2, cache_size=8, num_heads=2, head_dim=16, dtype=torch.float16,
                               device=ON, sink_tokens=2)  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    first = None
    for start in (0, 3, 6, 9):
        k, v = (random_bits((2, 3, 2, 16), torch.float16, gen).to(ON) for _ in range(2))
        first = (k, v) if first is None else first
        before = calls["view_build"]
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
        assert calls["view_build"] == before + 1 and not calls["view_runs"]
    assert len(cache.retained_token_ranges()) == 2  # sink and tail
    for got, sink, new in ((view.k, first[0], k), (view.v, first[1], v)):
        assert torch.equal(bits(got[:, :2].cpu()), bits(sink[:, :2].cpu()))
        assert torch.equal(bits(got[:, -3:].cpu()), bits(new.cpu()))


# ---------------------------------------------------------------------------------------------- subprocess checks
_AOT_SCRIPT = r"""
import json, torch
from tools.triton_report import aot as triton_aot
from pagedqvg.kernels.view.triton_view_runs import _view_runs_kernel, view_runs_launch
from pagedqvg.quant import PackedFormat, QuantConfig
M = torch.device("meta")
k = _view_runs_kernel
res = {"params": {"constexpr": [p.name for p in k.params if p.is_constexpr],
                  "not_specialized": [p.name for p in k.params if p.do_not_specialize]}, "formats": {}}
H, D = 40, 128
for name, cfg, batch, arch in (("none", None, 1, 90), ("int2", QuantConfig(bits=2), 1, 90),
                               ("int4asym2-B2", QuantConfig(bits=4, asymmetric=True, stages=2), 2, 80)):
    rows = triton_aot.meta_rows(H, D, torch.bfloat16, 1 << 20)
    rows = rows[:, : rows.shape[1] // (2 * batch) * 2 * batch]
    tokens = cb = cbp = fmt = None
    if cfg is not None:
        fmt = PackedFormat(D, H, cfg, torch.bfloat16)
        tpp = (1 << 21) // (2 * batch * fmt.token_row_bytes)
        tokens = torch.empty(64, 1 << 21, dtype=torch.uint8, device=M)[:, : tpp * 2 * batch * fmt.token_row_bytes]
        tokens = tokens.view(64, tpp, 2, batch, fmt.token_row_bytes)
        rpp = (1 << 20) // (cfg.centroids * D)
        cb = torch.empty(64, 1 << 20, dtype=torch.bfloat16, device=M)[:, : rpp * cfg.centroids * D]
        cb = cb.view(64, rpp, cfg.centroids, D)
        cbp = torch.empty(3, dtype=torch.int64, device=M)
    keys, launch = set(), None
    for T, h0, heads, max_run in ((1, 0, 40, 1), (17, 3, 20, 51), (4680, 0, 40, 51), (32760, 0, 40, 16),
                                  (32761, 1, 39, None)):
        runs = torch.empty(-(-T // 51) + 3, 6, dtype=torch.int64, device=M)
        out = torch.empty(2, batch, T, heads, D, dtype=torch.bfloat16, device=M).permute(2, 0, 1, 3, 4)
        launch = view_runs_launch(rows, tokens, cb, cbp, runs, h0, out, fmt, max_run=max_run)
        keys.add(triton_aot.specialization_key(launch, arch))
    res["formats"][name] = {"distinct_keys": len(keys),
                            "ptx": triton_aot.ptx_access_counts(triton_aot.compile_ptx(launch, arch))}
print("JSON" + json.dumps(res))
"""


@pytest.mark.skipif(TRITON_ERROR is not None, reason=f"triton does not import: {TRITON_ERROR}")
def test_compiled_mode_one_specialization_per_layer_shape_and_ptx():
    """Compiled mode (fresh process, no GPU needed): one JIT key per layer shape and format whatever the view
    length, run count, head slice or max_run; the kernel compiles for sm_90/sm_80 with 16-byte loads and stores."""
    res = compiled_mode_json(_AOT_SCRIPT)
    params = res["params"]
    assert {"num_tokens", "batch", "head_start", "heads", "dense_tpp"} <= set(params["not_specialized"])
    assert "HEAD_DIM" in params["constexpr"] and "num_tokens" not in params["constexpr"]
    for name, entry in res["formats"].items():
        assert entry["distinct_keys"] == 1, name
        assert entry["ptx"]["st.v4"] > 0 and entry["ptx"]["st.scalar"] == 0, (name, entry["ptx"])
        assert entry["ptx"]["ld.v4"] > 0, (name, entry["ptx"])  # dense rows: 16-byte loads


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
