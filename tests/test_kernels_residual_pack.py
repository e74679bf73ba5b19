"""The residual pack kernel (PRQ's last quantize step, into pages) against its torch reference, and the pack path
with the Triton k-means steps (the k-means kernels themselves: test_kernels_kmeans.py).

Runs like tests/test_kernels_dequant.py: without CUDA the Triton kernels run in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1 is set before anything imports triton; `test_interpreter_in_subprocess` reruns this file in a
fresh process if triton was imported in compiled mode first). On a CUDA machine the same comparisons run compiled.

- Residual pack: bit for bit, over the whole destination (bytes outside the written records must be untouched), for
  every code format, D not a power of two, token counts that are not multiples of the tile, one token, scrambled
  (page, slot) destinations and blocks at the edges of the number format (zero, constant, fp8 underflow, clipping,
  -0.0). Its fp8 encoder and round-half-even are checked against torch exhaustively at every rounding boundary.
- The cache's pack path (PackedStore.quantize + write) gives the same page bytes with the Triton steps as with
  torch, given the same k-means results; the Triton k-means results of every step are checked against their
  contract on the way (helpers.contract_checked_kmeans). Free-running k-means is never compared bit for bit
  between the backends: which near-ties and last bits differ depends on the machine's BLAS and instruction set.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import (  # sets TRITON_INTERPRET
    compiled_mode_json,
    contract_checked_kmeans,
    kernel_device,
    random_bits,
    rerun_interpreted,
)

from pagedqvg import BlockPool
from pagedqvg.kernels import dispatch
from pagedqvg.kernels.pack.residual_pack import residual_pack_torch
from pagedqvg.layout.segments import page_pieces
from pagedqvg.quant import FP8_DTYPE, PackedFormat, QuantConfig, pack_residual_rows, prq_kmeans, prq_quantize
from pagedqvg.store.packed_store import PackedStore

try:
    import triton
    import triton.language as tl

    from pagedqvg.kernels.pack import triton_residual_pack as trp

    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the install
    trp = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"

DEVICE, WHY = kernel_device(TRITON_ERROR, trp and trp._residual_pack_kernel)
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)

if TRITON_ERROR is None:

    @triton.jit
    def _encode_kernel(v_ptr, byte_ptr, val_ptr, rne_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        v = tl.load(v_ptr + i, mask=m, other=0.0)
        byte, val = trp._f32_to_fp8e4m3(v)
        tl.store(byte_ptr + i, byte, mask=m)
        tl.store(val_ptr + i, val, mask=m)
        tl.store(rne_ptr + i, trp._rne(v), mask=m)


# ---------------------------------------------------------------------------------------------- number format
def _fp8_boundaries() -> torch.Tensor:
    """Every finite e4m3fn value, every midpoint between neighbours and the float32 values one ulp either side of
    each (the round-to-nearest-even decisions), both signs, plus tiny and zero values."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    pos = vals[torch.isfinite(vals) & (vals >= 0)].unique().sort().values  # 0 .. 448
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32
    pts = torch.cat([pos, mids, torch.tensor([1e-30, 2.0**-10, 2.0**-11, 1e-45])])
    pts = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, 1e9)), torch.nextafter(pts, -torch.ones_like(pts))])
    pts = pts[(pts >= 0) & (pts <= 448)]
    return torch.cat([pts, -pts, torch.tensor([0.0, -0.0])])


@needs_kernels
def test_fp8_encoder_and_round_half_even_match_torch():
    gen = torch.Generator().manual_seed(3)
    spread = (torch.rand(20000, generator=gen) * 2 - 1) * 448 * torch.rand(20000, generator=gen) ** 8
    v = torch.cat([_fp8_boundaries(), spread])
    # _rne on values with halves: k + 0.5, k +- ulp, large integers.
    k = torch.arange(-40, 40, dtype=torch.float32)
    v = torch.cat([v, k + 0.5, torch.nextafter(k + 0.5, k), torch.nextafter(k + 0.5, k + 1), k * 2.0**20 + 0.5])
    v = v.to(DEVICE)
    n = v.numel()
    byte = torch.empty(n, dtype=torch.int32, device=DEVICE)
    val = torch.empty(n, device=DEVICE)
    rne = torch.empty(n, device=DEVICE)
    _encode_kernel[(triton.cdiv(n, 4096),)](v, byte, val, rne, n, BLOCK=4096)
    fp8_in = v.abs() <= 448
    ref = v[fp8_in].to(FP8_DTYPE)
    assert torch.equal(byte[fp8_in].to(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(val[fp8_in].view(torch.int32), ref.float().view(torch.int32))  # -0.0 included
    assert torch.equal(rne, torch.round(v))


# ---------------------------------------------------------------------------------------------- residual pack
Q_INT2 = QuantConfig(bits=2, block_size=16)
Q_INT4 = QuantConfig(bits=4, block_size=8)
Q_TRITS = QuantConfig(bits=2, block_size=8, pack_trits=True)
Q_INT2_ASYM_2ST = QuantConfig(bits=2, block_size=32, asymmetric=True, stages=2)
Q_INT4_ASYM_3ST = QuantConfig(bits=4, block_size=24, asymmetric=True, stages=3)

# (name, cfg, G folded heads, S tokens, D)
PACK_CASES = [
    ("int2-D48", Q_INT2, 5, 37, 48),
    ("int4-D24", Q_INT4, 3, 130, 24),
    ("int2-D16-block4-ties", QuantConfig(bits=2, block_size=4), 3, 40, 16),
    ("trits-D24-pad", Q_TRITS, 4, 37, 24),  # 5 code bytes, the last one padded
    ("trits-D128", Q_TRITS, 2, 9, 128),
    ("int2asym-2st-D96", Q_INT2_ASYM_2ST, 5, 37, 96),
    ("int4asym-3st-D48", Q_INT4_ASYM_3ST, 2, 1, 48),  # one token, block 24 (not a power of two)
    ("int2-D128-G80", QuantConfig(bits=2), 80, 3, 128),  # LingBot's folded K/V heads, SGLang defaults
]


def _residual(cfg, G, S, D, gen):
    """Residuals over 12 decades with edge rows: zero, constant, fp8 underflow, clipping, -0.0, and from token 6
    on rows of exact ties (`_tie_rows`)."""
    r = torch.randn(G, S, D, generator=gen) * torch.exp(torch.randn(G, S, 1, generator=gen) * 3)
    edits = [(0, 0.0), (1, 2.0), (2, 1e-7), (3, 1e6), (4, -0.0)]
    for s, value in edits:
        if s < S:
            r[s % G, s] = value
    if S > 5:
        r[0, 5, : D // 2] = -0.0  # a block of -0.0 and +0.0
    if S > 6:
        ties = min(S - 6, 8)
        r[:, 6 : 6 + ties] = _tie_rows(cfg, G * ties, D, gen).view(G, ties, D)
    return r


def _tie_rows(cfg, n, D, gen):
    """[n, D] rows whose every block hits both rounding ties exactly: the block's scale before fp8 rounding is an
    fp8 midpoint m (max |r| = m * qmax, or max - min = m * qmax), and the other values sit at code + 1/2 steps of
    the rounded scale fp8(m), so both the scale byte and the codes round half to even."""
    pos = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    pos = pos[torch.isfinite(pos) & (pos > 0)].unique().sort().values
    mids = ((pos[1:] + pos[:-1]) / 2)[pos[1:] < 64]  # keep m * qmax * D well inside fp32's exact range
    bs, qmax = cfg.block_size, cfg.qmax
    m = mids[torch.randint(len(mids), (n, D // bs), generator=gen)]  # [n, nb]
    s = m.to(FP8_DTYPE).float()[..., None]  # the stored scale
    if cfg.asymmetric:
        lo = -pos[torch.randint(len(pos) // 2, (n, D // bs), generator=gen)][..., None]  # an exact fp8 zero
        k = torch.randint(qmax, (n, D // bs, bs), generator=gen).float()
        rows = lo + (k + 0.5) * s
        rows[..., 0:1] = lo
        rows[..., 1:2] = lo + m[..., None] * qmax
    else:
        k = torch.randint(-qmax, qmax, (n, D // bs, bs), generator=gen).float()
        rows = (k + 0.5) * s
        rows[..., 0:1] = m[..., None] * qmax
    return rows.reshape(n, D)


def _scrambled_dest(fmt, S, gen, extra=5, slots=7):
    pages = -(-S // slots) + 2
    dest = random_bits((pages, slots, fmt.token_row_bytes + extra), torch.uint8, gen)
    where = torch.randperm(pages * slots, generator=gen)[:S]
    return dest, where // slots, where % slots


@needs_kernels
@pytest.mark.parametrize("case", PACK_CASES, ids=lambda c: c[0])
def test_residual_pack_bit_exact(case):
    name, cfg, G, S, D = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    fmt = PackedFormat(head_dim=D, num_heads=G, cfg=cfg)
    resid = _residual(cfg, G, S, D, gen)
    ids = torch.randint(256, (G, S, cfg.stages), dtype=torch.uint8, generator=gen)
    dest, pi, si = _scrambled_dest(fmt, S, gen)
    ref = dest.clone()
    residual_pack_torch(resid, ids, ref, pi, si, fmt)
    for block_rows in (None, 4):  # the interpreter's tile, and a compiled-size one (rows not a multiple of it)
        got = dest.to(DEVICE)
        trp.residual_pack_triton(resid.to(DEVICE), ids.to(DEVICE), got, pi.to(DEVICE), si.to(DEVICE), fmt,
                                 block_rows=block_rows)  # fmt: skip
        assert torch.equal(got.cpu(), ref), block_rows
    # The reference itself is prq's packing: token s's record is pack_residual_rows' row s.
    assert torch.equal(ref[pi, si, : fmt.token_row_bytes], pack_residual_rows(resid, ids, fmt))


@needs_kernels
def test_residual_pack_strided_inputs_and_dispatch(monkeypatch):
    """Non-contiguous residual (a transposed view) and ids; through the dispatch point with the Triton backend."""
    gen = torch.Generator().manual_seed(11)
    fmt = PackedFormat(head_dim=32, num_heads=3, cfg=Q_INT4)
    resid = torch.randn(40, 3, 32, generator=gen).transpose(0, 1)
    ids = torch.randint(256, (40, 3, 1), dtype=torch.uint8, generator=gen).transpose(0, 1)
    dest, pi, si = _scrambled_dest(fmt, 40, gen)
    ref = dest.clone()
    residual_pack_torch(resid, ids, ref, pi, si, fmt)
    monkeypatch.setenv("PAGEDQVG_KERNELS", "triton")
    got = dest.to(DEVICE)
    dispatch.residual_pack(resid.to(DEVICE), ids.to(DEVICE), got, pi.to(DEVICE), si.to(DEVICE), fmt)
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_residual_pack_bad_arguments_change_nothing(backend, monkeypatch, debug_on):
    if backend == "triton" and DEVICE is None:
        pytest.skip(WHY)
    monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    gen = torch.Generator().manual_seed(2)
    fmt = PackedFormat(head_dim=16, num_heads=2, cfg=Q_INT2)
    resid, ids = torch.randn(2, 4, 16, device=dev), torch.zeros(2, 4, 1, dtype=torch.uint8, device=dev)
    dest = random_bits((3, 2, fmt.token_row_bytes), torch.uint8, gen).to(dev)
    pi, si = torch.tensor([0, 1, 2, 0], device=dev), torch.tensor([0, 0, 1, 1], device=dev)
    before = dest.clone()
    bad = [
        ((resid.double(), ids, dest, pi, si), ValueError, r"resid must be float32 \[2, S, 16\], got torch.float64"),
        ((resid[:1], ids, dest, pi, si), ValueError, r"resid must be float32 \[2, S, 16\]"),
        ((resid, ids.long(), dest, pi, si), ValueError, r"ids must be uint8 \[2, 4, 1\]"),
        ((resid, ids, dest[..., :-1], pi, si), ValueError, r"dest must be uint8 \[num_pages, slots, >= 12\]"),
        ((resid, ids, dest, pi[:3], si), ValueError, r"page_idx must be int64 \[4\], got torch.int64 \(3,\)"),
        ((resid, ids, dest, pi.int(), si), ValueError, r"page_idx must be int64"),
        ((resid, ids, dest, pi + 1, si), IndexError, r"page index out of range: 1\.\.3, valid 0\.\.2"),
        ((resid, ids, dest, pi, si + 1), IndexError, r"slot index out of range: 1\.\.2, valid 0\.\.1"),
    ]
    for args, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            dispatch.residual_pack(*args, fmt)
        assert torch.equal(dest, before)


# ---------------------------------------------------------------------------------------------- compact: fitted scales
def _edge_residual(G: int, S: int, D: int, gen: torch.Generator) -> torch.Tensor:
    r = torch.randn(G, S, D, generator=gen) * torch.rand(G, S, 1, generator=gen) * 3
    r[0, 0] = 0.0
    r[0, 1] = -0.0
    r[1 % G, 2] = 2.5  # constant
    r[0, 3, 5] = 5000.0  # clips at the fp8 maximum
    r[0, 4] = r[0, 4] * 1e-5  # fp8 underflow
    r[0, 5, 0] = 60.0  # an outlier among small values: a small fitted multiplier
    return r


# (cfg, D, G)
FIT_CASES = [
    (QuantConfig.compact(), 128, 3),
    (QuantConfig.compact(block_size=20, centroids=5), 40, 2),
    (QuantConfig(bits=2, fit_scales=True, codebook_fp8=True, block_size=32), 96, 2),
    (QuantConfig(bits=4, fit_scales=True, block_size=16, stages=2), 48, 3),
]


@needs_kernels
@pytest.mark.parametrize(("cfg", "D", "G"), FIT_CASES, ids=["compact", "compact-b20-D40", "int2-fit", "int4-fit"])
def test_residual_pack_fitted_scales_bit_exact(cfg, D, G):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{cfg}-{D}".encode()))
    S = 37
    fmt = PackedFormat(D, G, cfg)
    r = _edge_residual(G, S, D, gen)
    ids = torch.randint(0, cfg.centroids, (G, S, cfg.stages), generator=gen).to(torch.uint8)
    dest = random_bits((6, 8, G * fmt.per_head_bytes + 5), torch.uint8, gen)
    perm = torch.randperm(6 * 8, generator=gen)[:S]
    page, slot = perm // 8, perm % 8
    ref = dest.clone()
    residual_pack_torch(r, ids, ref, page, slot, fmt)
    out = dest.to(DEVICE)
    args = (r.to(DEVICE), ids.to(DEVICE), out, page.to(DEVICE), slot.to(DEVICE), fmt)
    trp.residual_pack_triton(*args)
    assert torch.equal(out.cpu(), ref)
    out2 = dest.to(DEVICE)
    trp.residual_pack_triton(*args[:2], out2, *args[3:], block_rows=4)  # the compiled tile size
    assert torch.equal(out2.cpu(), ref)
    # the fit changed some scales (else this test would not test it)
    plain = dest.clone()
    residual_pack_torch(r, ids, plain, page, slot, PackedFormat(D, G, QuantConfig(
        bits=cfg.bits, block_size=cfg.block_size, stages=cfg.stages, centroids=cfg.centroids,
        pack_trits=cfg.pack_trits)))  # fmt: skip
    assert not torch.equal(plain, ref)


# ---------------------------------------------------------------------------------------------- whole PRQ
def _clustered(n, heads, D, clusters, gen, dtype=torch.bfloat16):
    """Tokens around well-separated centres plus continuous noise: [n, heads, D] (PRQ-like data: the first stage
    finds the centres, the second clusters the noise, where near-ties and last-bit differences of the means between
    summation orders do occur)."""
    centres = torch.randint(-8, 8, (heads, clusters, D), generator=gen).float() * 4
    which = torch.randint(clusters, (n, heads), generator=gen)
    noise = torch.randn(n, heads, D, generator=gen) * 0.25
    return (centres[torch.arange(heads), which] + noise).to(dtype)


@needs_kernels
@pytest.mark.parametrize("cfg", [QuantConfig(bits=2, centroids=4, block_size=8, stages=2),
                                 QuantConfig(bits=4, centroids=6, block_size=16, asymmetric=True)],
                         ids=["int2-2st", "int4asym"])  # fmt: skip
def test_prq_kmeans_triton_steps_meet_the_contract(cfg, monkeypatch):
    """prq_kmeans with the Triton assign and update kernels: at every step of a real run (both stages; the second
    clusters the continuous noise) the Triton result meets the contract against torch on the same input (ids equal
    except verified near-ties, means within the summation bound), and the run carries the torch result forward so
    that the ids, codebooks and residuals equal the torch run's bit for bit. (Comparing two free-running k-means
    bit for bit would test the machine: which near-ties and last bits differ depends on its BLAS.)"""
    import types

    gen = torch.Generator().manual_seed(8)
    x = _clustered(150, 3, 32, cfg.centroids, gen)
    ref = prq_kmeans(x, cfg)
    monkeypatch.setenv("PAGEDQVG_KERNELS", "triton")
    steps = types.SimpleNamespace()
    checked = contract_checked_kmeans(monkeypatch, steps)
    got = prq_kmeans(x.to(DEVICE), cfg, assign=steps.kmeans_assign, update=steps.kmeans_update)
    assert checked == {"assign": cfg.stages * (cfg.kmeans_iters + 1), "update": cfg.stages * cfg.kmeans_iters}
    assert torch.equal(got.ids.cpu(), ref.ids)
    assert torch.equal(got.codebooks.cpu().float(), ref.codebooks.float())
    assert torch.equal(got.resid.cpu(), ref.resid)


def _store(cfg, backend, monkeypatch, B=2, H=3, D=32, dtype=torch.bfloat16):
    monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
    pool = BlockPool(64 * 1024, page_bytes=1024, device=DEVICE if backend == "triton" else "cpu")
    pool.arena.zero_()
    return pool, PackedStore(pool, B, H, D, dtype, cfg)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [QuantConfig(bits=2, centroids=4, block_size=8, pack_trits=True),
                                 QuantConfig(bits=4, centroids=3, block_size=16, asymmetric=True, stages=2)],
                         ids=["trits", "int4asym-2st"])  # fmt: skip
def test_packed_store_triton_pages_equal_torch(monkeypatch, cfg, dtype):
    """The cache's pack (quantize: staged rows; write: into scrambled pages) with the Triton steps writes the torch
    bytes, and every token row is what prq_quantize of its K/V half gives. Batch 2, 23 tokens over 4 token pages.
    The k-means steps are contract-checked and carry the torch result (`contract_checked_kmeans`): fp32 sums in
    another order may resolve a near-tie or round a mean the other way, depending on the machine's BLAS."""
    checked = contract_checked_kmeans(monkeypatch)
    gen = torch.Generator().manual_seed(21)
    n, B, H, D = 23, 2, 3, 32
    dense = _clustered(2 * n * B, H, D, cfg.centroids, gen, dtype).view(2, n, B, H, D)
    arenas = []
    for backend in ("torch", "triton"):
        pool, store = _store(cfg, backend, monkeypatch, dtype=dtype)
        q = store.quantize(dense.to(pool.device))
        pages = torch.randperm(pool.num_pages, generator=torch.Generator().manual_seed(4))
        pages = pages[: store.pages_for_tokens(n)].tolist()
        n_tok = store.token_pages(n)
        assert n_tok > 1
        store.write(pages[:n_tok], pages[n_tok:], q)
        arenas.append(pool.arena.cpu())
    assert checked == {"assign": 2 * cfg.stages * (cfg.kmeans_iters + 1), "update": 2 * cfg.stages * cfg.kmeans_iters}
    assert torch.equal(arenas[0], arenas[1])
    stored = torch.cat([store.token_view[p, a:b].cpu() for p, a, b in page_pieces(pages[:n_tok], store.tpp, 0, n)])
    for kv in range(2):  # the reference bytes are prq_quantize's, token by token
        seg = prq_quantize(dense[kv].reshape(n, B * H, D), cfg)
        assert torch.equal(stored[:, kv].reshape(n, -1), seg.token_rows)
        assert torch.equal(store.codebooks(pages[n_tok:])[kv * B * H : (kv + 1) * B * H].cpu(), seg.codebooks)


# ---------------------------------------------------------------------------------------------- subprocess checks
_AOT_SCRIPT = r"""
import json, torch
from tools.triton_report import aot as triton_aot
from pagedqvg.kernels.pack.triton_residual_pack import residual_pack_launch, _residual_pack_kernel
from pagedqvg.kernels.pack.triton_kmeans import kmeans_update_launch, _kmeans_update_kernel
from pagedqvg.quant import PackedFormat, QuantConfig
M = torch.device("meta")
res = {"params": {k.__name__: [p.name for p in k.params if p.do_not_specialize]
                  for k in (_residual_pack_kernel, _kmeans_update_kernel)}}
for name, cfg in (("int2", QuantConfig(bits=2)), ("int4asym2", QuantConfig(bits=4, asymmetric=True, stages=2)),
                  ("trits", QuantConfig(bits=2, pack_trits=True))):
    fmt = PackedFormat(128, 80, cfg, torch.bfloat16)
    keys = set()
    for S in (1, 17, 4680, 10800):
        dest = torch.empty(64, 100, fmt.token_row_bytes, dtype=torch.uint8, device=M)
        idx = torch.empty(S, dtype=torch.int64, device=M)
        launch = residual_pack_launch(torch.empty(80, S, 128, device=M),
                                      torch.empty(80, S, cfg.stages, dtype=torch.uint8, device=M), dest, idx, idx, fmt)
        keys.add(triton_aot.specialization_key(launch))
    ptx = triton_aot.compile_ptx(launch, 90)
    res[name] = {"keys": len(keys), "div_approx": ptx.count("div.approx"), "div_rn": ptx.count("div.rn")}
keys = set()
for S in (1, 17, 4680, 10800):
    launch = kmeans_update_launch(torch.empty(40, S, 128, device=M), torch.empty(40, S, dtype=torch.int64, device=M),
                                  torch.empty(40, 128, 128, device=M), torch.empty(40, 128, 128, device=M))
    keys.add(triton_aot.specialization_key(launch))
ptx = triton_aot.compile_ptx(launch, 90)
res["update"] = {"keys": len(keys), "tf32": ptx.count(".tf32"), "div_approx": ptx.count("div.approx"),
                 "div_rn": ptx.count("div.rn")}
print("JSON" + json.dumps(res))
"""


@pytest.mark.skipif(TRITON_ERROR is not None, reason=f"triton does not import: {TRITON_ERROR}")
def test_compiled_mode_specialization_and_ptx():
    """Compiled mode (fresh process, no GPU needed): both kernels compile for sm_90, one specialization per layer
    format whatever the token count, IEEE divisions only (no div.approx), no TF32 in the update's dot."""
    res = compiled_mode_json(_AOT_SCRIPT)
    assert "num_tokens" in res["params"]["_residual_pack_kernel"]
    assert {"num_tokens", "num_centroids"} <= set(res["params"]["_kmeans_update_kernel"])
    for name in ("int2", "int4asym2", "trits", "update"):
        assert res[name]["keys"] == 1 and res[name]["div_approx"] == 0 and res[name]["div_rn"] > 0, (name, res[name])
    assert res["update"]["tf32"] == 0


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
