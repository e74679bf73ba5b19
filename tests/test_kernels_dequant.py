"""The packed-view dequantization kernel against its torch reference (the k-means kernels: test_kernels_kmeans.py).

Runs like tests/test_kernels_page_write.py: without CUDA the Triton kernels run in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1 is set here before anything imports triton; if triton was already imported in compiled mode,
`test_interpreter_in_subprocess` reruns this file in a fresh process). On a CUDA machine the same comparisons run
on CUDA tensors with compiled kernels.

- Dequantization is compared bit for bit, over the whole output buffer (rows and heads outside the request must be
  untouched) and the whole arena (read-only), on segments quantized by `prq_quantize` and stored in scrambled pool
  pages, for every code format (int2/int4, symmetric/asymmetric, trits, 1-2 stages), batch 1-2, head slices, cache
  dtypes float32/float16/bfloat16, ranges over several pages and one-token pieces. A stress test fills codes,
  scales and zeros with random bytes (fp8 NaN/subnormal/negative patterns) and codebooks with random finite bits;
  there NaN positions must agree and every other element is bit-identical (NaN payloads are not compared: torch
  itself writes different bf16 NaN payloads on its scalar and vector paths).
- The cache-level comparison packs both caches with the torch k-means results and checks the Triton k-means results
  against that contract at every step (helpers.contract_checked_kmeans).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import (  # sets TRITON_INTERPRET
    bits,
    compiled_mode_json,
    contract_checked_kmeans,
    packed_store,
    random_bits,
    rerun_interpreted,
    triton_kernels,
)

from pagedqvg import BlockPool, PagedCausalKVCache
from pagedqvg.kernels.view.dequant import packed_dequant_torch, piece_table
from pagedqvg.quant import FP8_DTYPE, PackedFormat, QuantConfig, prq_dequantize, prq_quantize
from pagedqvg.store.packed_store import PackedStore

tdq, TRITON_ERROR, DEVICE, WHY = triton_kernels("view.triton_dequant", "_packed_dequant_kernel")
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def same_bits_nan_as_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN equals any NaN (payload and sign not compared)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb) and torch.equal(bits(a)[~na], bits(b)[~nb]))


# ---------------------------------------------------------------------------------------------- packed segments
class Segment:
    """One packed segment of `n` tokens in scrambled pages of a real pool, via the cache's PackedStore geometry."""

    def __init__(self, cfg, batch, heads, head_dim, dtype, n, page_bytes, gen, device, after=None):
        if after is None:  # a fresh pool of stale bytes, pages handed out in a scrambled order
            pool = BlockPool(160 * page_bytes, page_bytes=page_bytes, device=device)
            pool.arena.view(torch.uint8).copy_(random_bits(pool.arena.shape, torch.uint8, gen))
            store = PackedStore(pool, batch, heads, head_dim, dtype, cfg)
            pages = pool.alloc(pool.num_pages, pool.new_owner("test"))
            order = torch.randperm(len(pages), generator=gen).tolist()
            pages = [pages[i] for i in order]
        else:  # another segment in the pool of segment `after`, on its spare pages
            pool, store, pages = after.pool, after.store, after.spare
        self.pool, self.store, st = pool, store, store
        self.fmt = st.fmt
        self.n = n
        self.dense = (torch.randn(2, n, batch, heads, head_dim, generator=gen) * 3).to(dtype)
        tok, cb = [], []
        for kv in range(2):
            seg = prq_quantize(self.dense[kv].reshape(n, batch * heads, head_dim), cfg)
            tok.append(seg.token_rows.view(n, batch, -1))
            cb.append(seg.codebooks)
        self.tok_rows = tok_rows = torch.stack(tok, dim=1)  # [n, 2, B, row_bytes]
        self.codebooks = torch.cat(cb)  # [2*B*H, stages, K, D]
        ntok = st.token_pages(n)
        ncb = st.pages_for_tokens(n) - ntok
        self.tok_pages, self.cb_pages = pages[:ntok], pages[ntok : ntok + ncb]
        self.spare = pages[ntok + ncb :]
        for page, first, count, o, _ in piece_table(self.tok_pages, st.tpp, 0, n):
            st.token_view[page, first : first + count].copy_(tok_rows[o : o + count].to(device))
        flat = self.codebooks.reshape(-1, cfg.centroids, head_dim)
        for r in range(flat.shape[0]):
            st.codebook_rows[self.cb_pages[r // st.cb_rpp], r % st.cb_rpp].copy_(flat[r].to(device))
        self.cb_pages_t = torch.tensor(self.cb_pages, dtype=torch.int64, device=device)

    def pieces(self, t0: int, t1: int) -> torch.Tensor:
        table = piece_table(self.tok_pages, self.store.tpp, t0, t1)
        return torch.tensor(table, dtype=torch.int64, device=self.pool.device).view(-1, 5)

    def run(self, fn, t0, t1, head_start, heads, out, **kw):
        """`fn` (reference or kernel) on tokens [t0, t1) into `out` [2, B, T, heads, D] (a permuted target)."""
        st = self.store
        fn(st.token_view, st.codebook_rows, self.pieces(t0, t1), self.cb_pages_t, head_start,
           out.permute(2, 0, 1, 3, 4), self.fmt, **kw)  # fmt: skip


Q_INT2 = QuantConfig(bits=2, centroids=8, block_size=16)
Q_INT2_ASYM = QuantConfig(bits=2, centroids=8, block_size=8, asymmetric=True)
Q_INT4_2ST = QuantConfig(bits=4, centroids=16, block_size=16, stages=2)
Q_INT4_ASYM_2ST = QuantConfig(bits=4, centroids=5, block_size=32, asymmetric=True, stages=2)
Q_TRITS_2ST = QuantConfig(bits=2, centroids=4, block_size=8, pack_trits=True, stages=2)

Q_INT4_K2 = QuantConfig(bits=4, centroids=2, block_size=16)

# (name, cfg, B, H, D, head_start, heads, page_bytes (raised to fit a codebook row), range, tile override)
# range: "all" tokens [0, n), "mid" [tpp // 2, n - 1) over 3 pages, "one" a single token; n = 2 * tpp + 3.
DEQUANT_CASES = [
    ("int2-B1-all", Q_INT2, 1, 2, 32, 0, 2, 256, "all", None),
    ("int2asym-B2-slice-mid", Q_INT2_ASYM, 2, 3, 16, 1, 2, 256, "mid", None),
    ("int4-2stages-B2-slice-one-token", Q_INT4_2ST, 2, 4, 32, 1, 2, 256, "one", None),
    ("int4asym-2stages-mid-tile2x32", Q_INT4_ASYM_2ST, 1, 3, 32, 1, 2, 256, "mid", (2, 32)),
    ("trits-2stages-D24-B2-mid", Q_TRITS_2ST, 2, 2, 24, 0, 2, 256, "mid", None),
    ("int4-one-token-pages", Q_INT4_K2, 2, 8, 16, 2, 5, 512, "all", None),
]


def _dq_id(case):
    return case[0]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DEQUANT_CASES, ids=_dq_id)
def test_packed_dequant_matches_torch(case, dtype):
    name, cfg, B, H, D, h0, heads, page_bytes, kind, tile = case
    fmt = PackedFormat(D, H, cfg, dtype)
    page_bytes = max(page_bytes, -(-fmt.codebook_row_bytes // 256) * 256)  # pool pages are 256-byte multiples
    tpp = (page_bytes // fmt.token_row_bytes) // (2 * B)
    n = 2 * tpp + 3
    t0, t1 = {"all": (0, n), "mid": (tpp // 2, n - 1), "one": (tpp + 1, tpp + 2)}[kind]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{dtype}".encode()))
    seg = Segment(cfg, B, H, D, dtype, n, page_bytes, gen, DEVICE)
    assert seg.store.tpp == tpp
    pieces = seg.pieces(t0, t1)
    assert pieces.shape[0] == (1 if kind == "one" else 3 if kind == "mid" else 3 if tpp > 1 else n), pieces
    arena = seg.pool.arena.clone()
    ref = random_bits((2, B, t1 - t0, heads, D), dtype, gen).to(DEVICE)
    out = ref.clone()
    seg.run(packed_dequant_torch, t0, t1, h0, heads, ref)
    # The reference is prq_dequantize of the segment, head slice and range taken afterwards.
    fmt_b = PackedFormat(D, B * H, cfg, dtype)
    cbs = seg.codebooks.view(2, B * H, cfg.stages, cfg.centroids, D)
    direct = torch.stack([prq_dequantize(seg.tok_rows[:, kv].reshape(n, -1), cbs[kv], fmt_b) for kv in range(2)])
    direct = direct.view(2, n, B, H, D)
    assert torch.equal(bits(ref.cpu()), bits(direct[:, t0:t1, :, h0 : h0 + heads].permute(0, 2, 1, 3, 4).contiguous()))
    kw = {} if tile is None else {"block_rows": tile[0], "block_cols": tile[1]}
    seg.run(tdq.packed_dequant_triton, t0, t1, h0, heads, out, **kw)
    assert torch.equal(bits(out.cpu()), bits(ref.cpu()))
    assert torch.equal(seg.pool.arena, arena)  # sources untouched


@needs_kernels
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 +-inf, as torch gives
@pytest.mark.filterwarnings("ignore:overflow encountered in add:RuntimeWarning")  # random codebooks: sums reach +-inf
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", [Q_INT4_ASYM_2ST, Q_TRITS_2ST, Q_INT2], ids=["int4asym2st", "trits2st", "int2"])
def test_packed_dequant_random_bytes(cfg, dtype):
    """Random codes/scales/zeros bytes (every fp8 class, out-of-range trit bytes), random finite codebooks."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"random-{cfg}-{dtype}".encode()))
    B, H, D, n = 2, 3, 24 if cfg.pack_trits else 32, 10
    seg = Segment(cfg, B, H, D, dtype, n, 2048 if dtype != torch.float32 else 4096, gen, DEVICE)
    st, fmt = seg.store, seg.fmt
    for page in seg.tok_pages:  # random record bytes, valid ids
        rows = st.token_view[page].reshape(-1, H, fmt.per_head_bytes)
        rows.copy_(random_bits(rows.shape, torch.uint8, gen).to(DEVICE))
        rows[..., fmt.ids_offset :] %= cfg.centroids
    rec = st.token_view[seg.tok_pages[0]].reshape(-1, H, fmt.per_head_bytes)
    for i, fp8 in enumerate((0x7F, 0xFF, 0x80, 0x03, 0x85, 0x00, 0x7E)):  # NaN, -NaN, -0, subnormals, 0, 448
        rec[i, 0, fmt.scales_offset] = fp8
        rec[i, 1, fmt.zeros_offset - (0 if cfg.asymmetric else 1)] = fp8
    for page in seg.cb_pages:
        cb = random_bits(st.codebook_rows[page].shape, dtype, gen)
        cb[~torch.isfinite(cb)] = 0.5
        if dtype == torch.float32:
            cb = cb.clamp(-1e30, 1e30)  # keep a few sums finite
        st.codebook_rows[page].copy_(cb.to(DEVICE))
    ref = torch.zeros(2, B, n, H, D, dtype=dtype, device=DEVICE)
    out = torch.ones_like(ref)
    seg.run(packed_dequant_torch, 0, n, 0, H, ref)
    seg.run(tdq.packed_dequant_triton, 0, n, 0, H, out, block_rows=4)
    assert torch.isnan(ref).any()
    assert same_bits_nan_as_nan(out.cpu(), ref.cpu())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_packed_dequant_contiguous_codebooks_and_strided_out(dtype):
    """A plain `[R, K, D]` codebook tensor is the one-page case; `out_t` may have any strides."""
    gen = torch.Generator().manual_seed(21)
    B, H, D, n = 2, 3, 16, 7
    seg = Segment(Q_INT2_ASYM, B, H, D, dtype, n, 1024, gen, DEVICE)
    st = seg.store
    cb = seg.codebooks.reshape(-1, Q_INT2_ASYM.centroids, D)[None].to(DEVICE)
    one_page = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    pieces = seg.pieces(2, n)
    big = random_bits((n - 2, 5, 2 * B, H + 1, 2 * D), dtype, gen).to(DEVICE)  # padded, interleaved target
    out_t = big[:, 1:5:2, ::2, 1:, ::2]  # [T, 2, B, H, D], no stride is 1 or contiguous
    expect = big.clone()
    packed_dequant_torch(st.token_view, cb, pieces, one_page, 0, expect[:, 1:5:2, ::2, 1:, ::2], seg.fmt)
    tdq.packed_dequant_triton(st.token_view, cb, pieces, one_page, 0, out_t, seg.fmt)
    assert torch.equal(bits(big.cpu()), bits(expect.cpu()))
    ref = torch.empty(2, B, n - 2, H, D, dtype=dtype, device=DEVICE)
    seg.run(packed_dequant_torch, 2, n, 0, H, ref)
    assert torch.equal(bits(ref.permute(2, 0, 1, 3, 4).cpu()), bits(expect[:, 1:5:2, ::2, 1:, ::2].cpu()))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_packed_runs_of_several_segments_in_one_launch(monkeypatch, dtype):
    """PackedStore.dequantize_runs_into: runs of three segments (own codebooks each) -> one kernel launch, equal to
    the torch backend's per-run `dequantize_into`."""
    gen = torch.Generator().manual_seed(33)
    B, H, D, cfg = 2, 3, 16, Q_INT4_2ST
    first = Segment(cfg, B, H, D, dtype, 9, 1024, gen, DEVICE)
    segs = [first, Segment(cfg, B, H, D, dtype, 14, 1024, gen, DEVICE, after=first)]
    segs.append(Segment(cfg, B, H, D, dtype, 5, 1024, gen, DEVICE, after=segs[1]))
    assert first.store.tpp < 9  # runs over several token pages
    runs = [(0, segs[1].tok_pages, segs[1].cb_pages, 2, 13), (11, segs[0].tok_pages, segs[0].cb_pages, 0, 9),
            (20, segs[2].tok_pages, segs[2].cb_pages, 4, 5)]  # fmt: skip
    outs, calls = {}, []
    real = tdq.packed_dequant_triton
    monkeypatch.setattr(tdq, "packed_dequant_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        store = PackedStore(first.pool, B, H, D, dtype, cfg)
        assert store.backend == backend
        out = torch.zeros(2, B, 21, 2, D, dtype=dtype, device=DEVICE)
        store.dequantize_runs_into(out.permute(2, 0, 1, 3, 4), runs, 1)
        outs[backend] = out.cpu()
        assert len(calls) == (backend == "triton")  # one launch for the three runs
    assert torch.equal(bits(outs["torch"]), bits(outs["triton"]))
    ref = torch.zeros(2, B, 11, 2, D, dtype=dtype, device=DEVICE)
    segs[1].run(packed_dequant_torch, 2, 13, 1, 2, ref)
    assert torch.equal(bits(outs["triton"][:, :, :11]), bits(ref.cpu()))


@needs_kernels
def test_packed_dequant_empty_and_bad_arguments():
    gen = torch.Generator().manual_seed(5)
    seg = Segment(Q_INT2, 1, 2, 16, torch.bfloat16, 4, 1024, gen, DEVICE)
    st = seg.store
    out = torch.empty(0, 2, 1, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    no_pieces = torch.empty(0, 5, dtype=torch.int64, device=DEVICE)
    tdq.packed_dequant_triton(st.token_view, st.codebook_rows, no_pieces, seg.cb_pages_t, 0, out, seg.fmt)
    good = torch.empty(4, 2, 1, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    pieces = seg.pieces(0, 4)
    with pytest.raises(TypeError, match="dtype"):
        tdq.packed_dequant_triton(st.token_view, st.codebook_rows, pieces, seg.cb_pages_t, 0, good.float(), seg.fmt)
    with pytest.raises(ValueError, match="heads"):
        tdq.packed_dequant_triton(st.token_view, st.codebook_rows, pieces, seg.cb_pages_t, 1, good, seg.fmt)
    with pytest.raises(ValueError, match="pieces"):
        tdq.packed_dequant_triton(st.token_view, st.codebook_rows, pieces.int(), seg.cb_pages_t, 0, good, seg.fmt)


_INT2_2ST = QuantConfig(bits=2, centroids=4, block_size=8, keep_recent_chunks=0, stages=2)
_COMPACT = QuantConfig.compact(centroids=4, block_size=8, keep_recent_chunks=0, stages=2)


@needs_kernels
@pytest.mark.parametrize(("dtype", "quant"), [(torch.bfloat16, _INT2_2ST), (torch.float16, _INT2_2ST),
                                              (torch.bfloat16, _COMPACT)],
                         ids=["bf16-int2-2st", "fp16-int2-2st", "bf16-compact"])  # fmt: skip
def test_cache_packed_views_identical_with_triton_and_torch(monkeypatch, dtype, quant):
    """A quantized cache (batch 2, head slice): every view and every unpack identical under both backends. Both
    caches pack with the torch k-means results; on the Triton backend the Triton k-means kernels run as well and
    meet their contract at every step (`contract_checked_kmeans`: which near-ties resolve which way, and the last
    bits of the means, depend on the machine's BLAS), so the packed bytes, and hence the views, must be equal.
    The compact case (fitted scales, fp8 codebooks) goes through the same view_runs launch with fp8 codebook rows."""
    checked = contract_checked_kmeans(monkeypatch)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        pool = BlockPool(64 * 1024, page_bytes=1024, device=DEVICE)
        cache = PagedCausalKVCache(pool=pool, batch_size=2, cache_size=12, num_heads=3, head_dim=16, dtype=dtype,
                                   device=DEVICE, sink_tokens=3, quant=quant)  # fmt: skip
        store = packed_store(cache)
        assert store is not None and store.backend == backend
        cb_dtype = torch.float8_e4m3fn if quant.codebook_fp8 else dtype
        assert store.codebook_rows.dtype == cb_dtype
        gen = torch.Generator().manual_seed(9)
        views = []
        for start, hs in ((0, None), (3, 1), (6, None), (9, 1), (12, None), (6, None), (9, 1), (15, None)):
            kv = [torch.randn(2, 3, 3 if hs is None else 2, 16, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
            view = cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=start,
                                                     cache_head_start=hs)  # fmt: skip
            views.append((view.k.cpu().clone(), view.v.cpu().clone(), cache.last_view_sources()))
        results[backend] = views
    assert any(kind == "packed" for _, _, src in results["torch"] for *_, kind in src)
    assert checked["assign"] > 0 and checked["update"] > 0  # the Triton k-means kernels ran and were checked
    for (ka, va, sa), (kb, vb, sb) in zip(results["torch"], results["triton"], strict=True):
        assert sa == sb
        assert torch.equal(bits(ka), bits(kb)) and torch.equal(bits(va), bits(vb))


@needs_kernels
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 +-inf, as torch gives
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_packed_dequant_fp8_codebooks_bit_exact(dtype):
    """The compact mode's fp8 codebooks: real packed segments in scrambled pages, then random fp8 codebook bytes
    (every class incl. NaN, subnormals)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"fp8cb-{dtype}".encode()))
    cfg = QuantConfig.compact(block_size=16, centroids=6, stages=2)
    B, H, D = 2, 3, 48
    n = 11
    seg = Segment(cfg, B, H, D, dtype, n, 1024, gen, DEVICE)
    st = seg.store
    assert st.codebook_rows.dtype == FP8_DTYPE
    for t0, t1, hs, heads in ((0, n, 0, H), (3, 9, 1, 2)):
        ref = torch.zeros(2, B, t1 - t0, heads, D, dtype=dtype, device=DEVICE)
        out = torch.ones_like(ref)
        seg.run(packed_dequant_torch, t0, t1, hs, heads, ref)
        seg.run(tdq.packed_dequant_triton, t0, t1, hs, heads, out, block_rows=4)
        assert torch.equal(out.cpu().view(torch.uint8), ref.cpu().view(torch.uint8))
    # the dequantized segment is the PRQ round trip of what was packed
    full = torch.zeros(2, B, n, H, D, dtype=dtype, device=DEVICE)
    seg.run(tdq.packed_dequant_triton, 0, n, 0, H, full)
    for kv in range(2):
        rows = seg.tok_rows[:, kv].reshape(n, -1)
        want = prq_dequantize(rows, seg.codebooks[kv * B * H : (kv + 1) * B * H], PackedFormat(D, B * H, cfg, dtype))
        assert torch.equal(full[kv].cpu().transpose(0, 1).reshape(n, B * H, D).view(torch.uint8),
                           want.view(torch.uint8))  # fmt: skip
    for page in seg.cb_pages:
        st.codebook_rows[page].view(torch.uint8).copy_(random_bits(st.codebook_rows[page].shape, torch.uint8, gen))
    ref = torch.zeros(2, B, n, H, D, dtype=dtype, device=DEVICE)
    out = torch.ones_like(ref)
    seg.run(packed_dequant_torch, 0, n, 0, H, ref)
    seg.run(tdq.packed_dequant_triton, 0, n, 0, H, out, block_rows=4)
    assert torch.isnan(ref).any()
    assert same_bits_nan_as_nan(out.cpu(), ref.cpu())


def test_packed_dequant_rejects_cache_dtype_codebooks_for_fp8_format():
    from pagedqvg.kernels.view.dequant import check_packed_dequant

    fmt = PackedFormat(16, 2, QuantConfig.compact(block_size=16, centroids=4))
    tokens = torch.zeros(2, 4, 2, 1, fmt.token_row_bytes, dtype=torch.uint8)
    out = torch.zeros(3, 2, 1, 2, 16, dtype=torch.bfloat16)
    pieces, cb_pages = torch.zeros(0, 5, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"codebooks must be torch\.float8_e4m3fn"):
        check_packed_dequant(tokens, torch.zeros(2, 4, 4, 16, dtype=torch.bfloat16), pieces, cb_pages, 0, out, fmt)
    check_packed_dequant(tokens, torch.zeros(2, 4, 4, 16, dtype=FP8_DTYPE), pieces, cb_pages, 0, out, fmt)


# ---------------------------------------------------------------------------------------------- subprocess checks
_AOT_SCRIPT = r"""
import json, torch
from tools.triton_report import aot as triton_aot
from pagedqvg.kernels.view.triton_dequant import packed_dequant_launch, _packed_dequant_kernel
from pagedqvg.kernels.pack.triton_kmeans import kmeans_assign_launch, _kmeans_assign_kernel
from pagedqvg.quant import PackedFormat, QuantConfig
M = torch.device("meta")
res = {"params": {}}
for k in (_packed_dequant_kernel, _kmeans_assign_kernel):
    res["params"][k.__name__] = {"constexpr": [p.name for p in k.params if p.is_constexpr],
                                 "not_specialized": [p.name for p in k.params if p.do_not_specialize]}
res["dequant"] = {}
for name, cfg in (("int2", QuantConfig(bits=2)), ("int4asym2", QuantConfig(bits=4, asymmetric=True, stages=2)),
                  ("trits", QuantConfig(bits=2, pack_trits=True))):
    fmt = PackedFormat(128, 40, cfg, torch.bfloat16)
    tpp = (1 << 21) // (2 * fmt.token_row_bytes)
    tokens = torch.empty(64, 1 << 21, dtype=torch.uint8, device=M)[:, : tpp * 2 * fmt.token_row_bytes]
    tokens = tokens.view(64, tpp, 2, 1, fmt.token_row_bytes)
    rpp = (1 << 20) // (cfg.centroids * 128)
    cb = torch.empty(64, 1 << 20, dtype=torch.bfloat16, device=M)[:, : rpp * cfg.centroids * 128]
    cb = cb.view(64, rpp, cfg.centroids, 128)
    keys, launch = set(), None
    for T, h0, heads in ((1, 0, 40), (17, 3, 20), (4680, 0, 40), (32760, 0, 40), (32761, 1, 39)):
        pieces = torch.empty(-(-T // tpp) + 1, 5, dtype=torch.int64, device=M)
        cbp = torch.empty(3, dtype=torch.int64, device=M)
        out = torch.empty(2, 1, T, heads, 128, dtype=torch.bfloat16, device=M).permute(2, 0, 1, 3, 4)
        launch = packed_dequant_launch(tokens, cb, pieces, cbp, h0, out, fmt)
        keys.add(triton_aot.specialization_key(launch))
    entry = {"distinct_keys": len(keys)}
    for arch in (90, 80):
        entry[f"sm{arch}"] = triton_aot.ptx_access_counts(triton_aot.compile_ptx(launch, arch))
    res["dequant"][name] = entry
keys = set()
for S in (1, 17, 4680, 10800):
    x = torch.empty(40, S, 128, device=M)
    launch = kmeans_assign_launch(x, torch.empty(40, 128, 128, device=M), torch.empty(40, S, dtype=torch.int64,
                                  device=M))
    keys.add(triton_aot.specialization_key(launch))
ptx = triton_aot.compile_ptx(launch, 90)
res["kmeans"] = {"distinct_keys": len(keys), "tf32": ptx.count(".tf32")}
print("JSON" + json.dumps(res))
"""


@pytest.mark.skipif(TRITON_ERROR is not None, reason=f"triton does not import: {TRITON_ERROR}")
def test_compiled_mode_specialization_and_ptx():
    """Compiled mode (fresh process, no GPU needed): one specialization per layer shape and format whatever the
    token count, head slice or piece count; the dequant kernel compiles for sm_90 and sm_80 (no fp8 hardware type
    needed) with 16-byte stores; the k-means dot products are IEEE fp32 (no TF32)."""
    res = compiled_mode_json(_AOT_SCRIPT)
    dq = res["params"]["_packed_dequant_kernel"]
    assert {"num_tokens", "batch", "head_start", "heads", "head_blocks"} <= set(dq["not_specialized"])
    assert "HEAD_DIM" in dq["constexpr"] and "num_tokens" not in dq["constexpr"]
    km = res["params"]["_kmeans_assign_kernel"]
    assert {"num_tokens", "num_centroids"} <= set(km["not_specialized"])
    for name, entry in res["dequant"].items():
        assert entry["distinct_keys"] == 1, name
        for arch in ("sm90", "sm80"):
            assert entry[arch]["st.v4"] > 0 and entry[arch]["st.scalar"] == 0, (name, arch, entry[arch])
    assert res["kmeans"]["distinct_keys"] == 1 and res["kmeans"]["tf32"] == 0


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
