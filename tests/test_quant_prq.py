"""PRQ (pagedqvg/quant/prq.py): quantize/dequantize accuracy, determinism and edge cases (the byte format itself:
tests/test_quant_format.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_means, check_near_ties

from pagedqvg.planning.synthetic import relative_error, video_kv
from pagedqvg.quant import PackedFormat, PRQSegment, QuantConfig, prq_dequantize, prq_quantize
from pagedqvg.quant.prq import _block_quantize, assign_nearest, update_means

INT2 = QuantConfig(bits=2)


# -------------------------------------------------------------------------------------------------------- dequantize
def test_dequantize_hand_built_segment() -> None:
    # 1 head, D=4, block 2, int4 symmetric (qmax 7), 2 stages, K=2
    fmt = PackedFormat(4, 1, QuantConfig(bits=4, block_size=2, stages=2, centroids=2), dtype=torch.float32)
    codes = torch.tensor([[[7, 8, 0, 14]], [[7, 7, 7, 7]]])
    scales = torch.tensor([[[0.5, 2.0]], [[1.0, 1.0]]])
    ids = torch.tensor([[[1, 0]], [[0, 1]]])
    cb = torch.tensor(
        [[[[10.0, 20.0, 30.0, 40.0], [1.0, 2.0, 3.0, 4.0]], [[0.25, 0.25, 0.25, 0.25], [-1.0, -1.0, -1.0, -1.0]]]]
    )
    rows = fmt.pack_token_rows(codes, scales, None, ids)
    out = prq_dequantize(rows, cb, fmt)
    expect = torch.tensor(
        [
            [[0.0 + 1 + 0.25, 0.5 + 2 + 0.25, -14.0 + 3 + 0.25, 14.0 + 4 + 0.25]],
            [[10.0 - 1, 20.0 - 1, 30.0 - 1, 40.0 - 1]],
        ]
    )
    assert torch.equal(out, expect)
    assert torch.equal(prq_dequantize(rows, fmt.pack_codebooks(cb), fmt), expect)  # packed codebook rows too
    # asymmetric: code * scale + zero
    fa = PackedFormat(4, 1, QuantConfig(bits=2, block_size=2, centroids=1, asymmetric=True), dtype=torch.float32)
    rows = fa.pack_token_rows(
        torch.tensor([[[0, 3, 1, 2]]]),
        torch.tensor([[[0.5, 4.0]]]),
        torch.tensor([[[-1.0, 2.0]]]),
        torch.tensor([[[0]]]),
    )
    cb = torch.tensor([[[[0.0, 8.0, 0.0, 1.0]]]])
    assert prq_dequantize(rows, cb, fa).tolist() == [[[-1.0, 8.5, 6.0, 11.0]]]


def test_dequantize_casts_once_to_cache_dtype() -> None:
    fmt = PackedFormat(2, 1, QuantConfig(bits=4, block_size=2, centroids=1))  # bf16
    rows = fmt.pack_token_rows(torch.tensor([[[8, 7]]]), torch.tensor([[[2.0**-6]]]), None, torch.tensor([[[0]]]))
    cb = torch.tensor([[[[1.0, 1.0]]]]).bfloat16()
    out = prq_dequantize(rows, cb, fmt)
    assert out.dtype == torch.bfloat16
    # fp32 sum 1 + 2^-6 rounds once to bf16 (8 mantissa bits: 1 + 2^-6 is exact)
    assert out.float().tolist() == [[[1.0 + 2.0**-6, 1.0]]]


# ---------------------------------------------------------------------------------------------------------- accuracy
@pytest.fixture(scope="module")
def kv() -> tuple[torch.Tensor, torch.Tensor]:
    k, v = video_kv(2, (12, 20), 2, 128, seed=3)
    return k[0], v[0]


# measured (K, V) relative error on this data at 64 centroids: bound = measured x ~1.25
_BOUNDS = {
    (2, False, 1): (0.178, 0.215),
    (2, False, 2): (0.131, 0.154),
    (2, True, 1): (0.235, 0.159),
    (2, True, 2): (0.124, 0.102),
    (4, False, 1): (0.067, 0.045),
    (4, False, 2): (0.035, 0.027),
    (4, True, 1): (0.045, 0.032),
    (4, True, 2): (0.025, 0.021),
}


@pytest.mark.parametrize(("bits", "asym", "stages"), list(_BOUNDS))
def test_roundtrip_error_bounds(kv, bits: int, asym: bool, stages: int) -> None:
    cfg = QuantConfig(bits=bits, asymmetric=asym, stages=stages, centroids=64)
    for x, measured in zip(kv, _BOUNDS[(bits, asym, stages)], strict=True):
        seg = prq_quantize(x, cfg)
        y = seg.dequantize()
        assert y.dtype == x.dtype and y.shape == x.shape
        err = relative_error(x, y)
        assert err < 1.25 * measured, (err, measured)
        assert err > 0.3 * measured, "suspiciously good: measured baseline changed?"


def test_more_bits_and_stages_help(kv) -> None:
    x = kv[0]
    errs = {
        (b, s): relative_error(x, prq_quantize(x, QuantConfig(bits=b, stages=s, centroids=64)).dequantize())
        for b in (2, 4)
        for s in (1, 2)
    }
    assert errs[(4, 1)] < errs[(2, 1)] and errs[(2, 2)] < errs[(2, 1)] and errs[(4, 2)] < errs[(4, 1)]


def test_trit_packing_same_values_fewer_bytes(kv) -> None:
    x = kv[1]
    ref = prq_quantize(x, INT2)
    tri = prq_quantize(x, QuantConfig(bits=2, pack_trits=True))
    assert ref.fmt.per_head_bytes == 35 and tri.fmt.per_head_bytes == 29
    assert tri.token_rows.shape[1] * 35 == ref.token_rows.shape[1] * 29
    assert torch.equal(ref.codebooks, tri.codebooks)
    assert torch.equal(ref.dequantize(), tri.dequantize())
    fr, ft = ref.fmt.unpack_token_rows(ref.token_rows), tri.fmt.unpack_token_rows(tri.token_rows)
    assert torch.equal(fr.codes, ft.codes) and fr.codes.max() <= 2


def test_dtypes(kv) -> None:
    for dtype in (torch.float32, torch.float16):
        x = kv[0].to(dtype)
        seg = prq_quantize(x, QuantConfig(bits=4, centroids=32))
        assert seg.codebooks.dtype == dtype and seg.dequantize().dtype == dtype
        assert relative_error(x, seg.dequantize()) < 0.1


# ------------------------------------------------------------------------------------------------------- determinism
def test_deterministic_bytes(kv) -> None:
    cfg = QuantConfig(bits=2, stages=2, centroids=32, asymmetric=True)
    a, b = prq_quantize(kv[0], cfg), prq_quantize(kv[0].clone(), cfg)
    assert torch.equal(a.token_rows, b.token_rows) and torch.equal(a.codebooks, b.codebooks)
    c = prq_quantize(kv[0], QuantConfig(bits=2, stages=2, centroids=32, asymmetric=True, seed=99))
    assert not torch.equal(a.codebooks, c.codebooks)


def test_tiling_does_not_change_result(kv, monkeypatch) -> None:
    """The token tiles of `assign_nearest` / `update_means` (at most `_TILE_ELEMS` floats at once; here 7 tokens, the
    last tile partial) change no result: where the arithmetic is exact (dyadic data: every distance and sum is exact in
    any order) ids and means are identical, ties included; on real K/V, where another tile shape may make the BLAS sum
    in another order, ids differ only at verified fp32 near-ties and the means stay within the summation bound of the
    exact means. A tile lost, repeated or misplaced breaks either check."""
    import pagedqvg.quant.prq as prq

    gen = torch.Generator().manual_seed(5)
    H, S, K, D = 2, 200, 16, 128
    xd = torch.randint(-64, 64, (H, S, D), generator=gen).float() / 32  # exact: |sums| < 2^24 units of 2^-10
    cd = torch.randint(-64, 64, (H, K, D), generator=gen).float() / 32
    cd[:, 5] = cd[:, 2]  # a duplicate centroid: exact ties go to the lowest index
    xd[:, :3] = cd[:, 2:3]
    xr = kv[0][:S].float().transpose(0, 1).contiguous()  # [H, S, D] real K
    cr = xr[:, torch.randperm(S, generator=gen)[:K]].contiguous()
    whole = [(assign_nearest(x, c), update_means(x, assign_nearest(x, c), c)) for x, c in ((xd, cd), (xr, cr))]
    monkeypatch.setattr(prq, "_TILE_ELEMS", H * K * 7)  # 7-token tiles
    tiled = [(assign_nearest(x, c), update_means(x, assign_nearest(x, c), c)) for x, c in ((xd, cd), (xr, cr))]
    assert torch.equal(whole[0][0], tiled[0][0]) and torch.equal(whole[0][1], tiled[0][1])
    assert not (whole[0][0] == 5).any() and bool((whole[0][0][:, :3] == 2).all())
    check_near_ties(xr, cr, whole[1][0], tiled[1][0])
    check_means(xr, whole[1][0], cr, whole[1][1])
    check_means(xr, tiled[1][0], cr, tiled[1][1])
    # The whole quantizer with tiny tiles: the same format, and as accurate as with one tile.
    cfg = QuantConfig(bits=4, centroids=16)
    monkeypatch.setattr(prq, "_TILE_ELEMS", 1 << 22)
    err_whole = relative_error(kv[0][:S], prq_quantize(kv[0][:S], cfg).dequantize())
    monkeypatch.setattr(prq, "_TILE_ELEMS", H * K * 7)
    err_tiled = relative_error(kv[0][:S], prq_quantize(kv[0][:S], cfg).dequantize())
    assert abs(err_tiled - err_whole) <= 0.05 * err_whole, (err_whole, err_tiled)


def test_warm_start(kv) -> None:
    cfg = QuantConfig(bits=2, centroids=32)
    first = prq_quantize(kv[0][:240], cfg)
    warm = prq_quantize(kv[0][240:], cfg, init_centroids=first.codebooks)
    cold = prq_quantize(kv[0][240:], cfg)
    assert not torch.equal(warm.codebooks, cold.codebooks)
    assert relative_error(kv[0][240:], warm.dequantize()) < 0.25
    with pytest.raises(ValueError, match=r"init_centroids has shape \(2, 32, 128\)"):
        prq_quantize(kv[0], cfg, init_centroids=first.codebooks[:, 0])
    bad = first.codebooks.clone()
    bad[1, 0, 3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"init_centroids has 1 non-finite.*\(1, 0, 3, 7\)"):
        prq_quantize(kv[0], cfg, init_centroids=bad)


# ----------------------------------------------------------------------------------------------------------- k-means
def test_kmeans_ties_lowest_index_and_empty_keeps_centroid() -> None:
    x = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [4.0, 0.0], [10.0, 0.0]]])  # [H=1, S=4, D=2]
    c = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [3.0, 0.0], [50.0, 0.0]]])
    ids = assign_nearest(x, c)
    assert ids.tolist() == [[0, 0, 1, 1]]  # x=2 is equidistant from 1 and 3 -> 0; duplicates of 3 -> first
    new = update_means(x, ids, c)
    assert new.tolist() == [[[1.0, 0.0], [7.0, 0.0], [3.0, 0.0], [50.0, 0.0]]]  # 2 and 3 empty: kept


def test_one_centroid_is_the_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0], [5.0, 5.0, 5.0, 5.0]])[:, None, :]
    seg = prq_quantize(x, QuantConfig(bits=4, centroids=1, block_size=2))
    assert seg.codebooks.float().tolist() == [[[[3.0, 3.0, 3.0, 3.0]]]]


# --------------------------------------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("asym", [False, True])
def test_all_zero_input_is_exact(asym: bool) -> None:
    cfg = QuantConfig(bits=2, asymmetric=asym, centroids=8, block_size=4)
    seg = prq_quantize(torch.zeros(6, 2, 8, dtype=torch.bfloat16), cfg)
    f = seg.fmt.unpack_token_rows(seg.token_rows)
    assert (f.scales == 0).all() and (f.codes == (0 if asym else 1)).all()
    assert torch.equal(seg.dequantize(), torch.zeros(6, 2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("asym", [False, True])
def test_block_quantize_zero_block(asym: bool) -> None:
    r = torch.zeros(1, 1, 8)
    r[0, 0, 4:] = torch.tensor([0.5, -0.25, 1.0, 0.0])
    cfg = QuantConfig(bits=4, asymmetric=asym, block_size=4)
    codes, scales, zeros = _block_quantize(r, cfg)
    assert scales.float()[0, 0, 0] == 0 and codes[0, 0, :4].tolist() == [0 if asym else 7] * 4
    fmt = PackedFormat(8, 1, cfg, dtype=torch.float32)
    rows = fmt.pack_token_rows(codes, scales, zeros, torch.zeros(1, 1, 1, dtype=torch.uint8))
    out = prq_dequantize(rows, torch.zeros(1, 1, 128, 8), fmt)
    assert out[0, 0, :4].tolist() == [0.0] * 4
    assert (out[0, 0, 4:] - r[0, 0, 4:]).abs().max() < 0.1


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("c", [0.3, -7.0, 100.0])
def test_block_quantize_constant_block(asym: bool, c: float) -> None:
    cfg = QuantConfig(bits=2, asymmetric=asym, block_size=8)
    r = torch.full((2, 1, 8), c)
    codes, scales, zeros = _block_quantize(r, cfg)
    fmt = PackedFormat(8, 1, cfg, dtype=torch.float32)
    rows = fmt.pack_token_rows(codes, scales, zeros, torch.zeros(2, 1, 1, dtype=torch.uint8))
    out = prq_dequantize(rows, torch.zeros(1, 1, 128, 8), fmt)
    assert torch.isfinite(out).all()
    assert (out - c).abs().max() <= abs(c) / 16 + 1e-7  # fp8 rounding of the scale (or zero)


def test_constant_input_is_exact() -> None:
    x = torch.full((10, 3, 8), 2.5, dtype=torch.bfloat16)
    seg = prq_quantize(x, QuantConfig(bits=2, centroids=4, block_size=4))
    assert torch.equal(seg.dequantize(), x)


def test_fewer_tokens_than_centroids_and_singletons() -> None:
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    seg = prq_quantize(x, QuantConfig(bits=2, centroids=256, block_size=8, stages=2))
    y = seg.dequantize()
    assert torch.isfinite(y.float()).all() and seg.codebooks.shape == (2, 2, 256, 16)
    assert relative_error(x, y) < 0.1  # most tokens are singleton clusters (zero residual)
    one = prq_quantize(x[:1], QuantConfig(bits=4, centroids=128, block_size=8))
    assert torch.equal(one.dequantize(), x[:1])  # a single token: its own centroid, residual exactly 0


def test_empty_segment() -> None:
    seg = prq_quantize(torch.zeros(0, 2, 128, dtype=torch.bfloat16), INT2)
    assert seg.token_rows.shape == (0, 70) and seg.num_tokens == 0
    assert seg.dequantize().shape == (0, 2, 128)


@pytest.mark.parametrize("asym", [False, True])
def test_block_quantize_fp8_overflow_clamps(asym: bool) -> None:
    cfg = QuantConfig(bits=2, asymmetric=asym, block_size=4)
    r = torch.tensor([[[5000.0, -3000.0, 10.0, 0.0]]])
    codes, scales, zeros = _block_quantize(r, cfg)
    assert scales.float().max() == 448.0
    fmt = PackedFormat(4, 1, cfg, dtype=torch.float32)
    rows = fmt.pack_token_rows(codes, scales, zeros, torch.zeros(1, 1, 1, dtype=torch.uint8))
    out = prq_dequantize(rows, torch.zeros(1, 1, 128, 4), fmt)[0, 0]
    assert torch.isfinite(out).all()
    if asym:  # zero clamped to -448, values clipped to [-448, -448 + 3 * 448]
        assert out.tolist() == [896.0, -448.0, 0.0, 0.0]
    else:  # clipped to +-448 * qmax = +-448
        assert out.tolist() == [448.0, -448.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_input_with_zero_channels_stays_finite(dtype) -> None:
    """|x| >= 2^127 next to exact zeros: the per-head power-of-two unit must stay finite (0 * inf would be NaN)."""
    x = torch.zeros(16, 1, 8, dtype=dtype)
    x[0, 0, 0] = 1.8e38
    x[1, 0, 1] = 1.0
    seg = prq_quantize(x, QuantConfig(bits=4, centroids=4, block_size=4))
    assert torch.isfinite(seg.codebooks.float()).all() and torch.isfinite(seg.dequantize().float()).all()


def test_huge_inputs_stay_finite() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 2, 8, generator=g) * 1e4
    x[3, 1, 2] = 3.0e38  # near the bf16 / fp32 maximum
    x[7, 0, 0] = -3.0e38
    for dtype in (torch.bfloat16, torch.float32):
        for asym in (False, True):
            seg = prq_quantize(x.to(dtype), QuantConfig(bits=4, asymmetric=asym, centroids=8, block_size=4, stages=2))
            y = seg.dequantize()
            assert torch.isfinite(y.float()).all() and torch.isfinite(seg.codebooks.float()).all()
    fp16 = prq_quantize(
        (torch.randn(64, 1, 8, generator=g) * 6e4).clamp(-65000, 65000).half(),
        QuantConfig(bits=2, centroids=4, block_size=8),
    )
    assert torch.isfinite(fp16.dequantize().float()).all()


@pytest.mark.parametrize("asym", [False, True])
def test_scale_underflow(asym: bool) -> None:
    cfg = QuantConfig(bits=4, asymmetric=asym, block_size=4)
    r = torch.tensor([[[1e-5, -2e-5, 3e-6, 0.0], [1e-2, -1.4e-2, 5e-3, 0.0]]])  # [1, 2 "heads", 4]
    codes, scales, zeros = _block_quantize(r.reshape(1, 1, 8), cfg)
    fmt = PackedFormat(8, 1, cfg, dtype=torch.float32)
    rows = fmt.pack_token_rows(codes, scales, zeros, torch.zeros(1, 1, 1, dtype=torch.uint8))
    out = prq_dequantize(rows, torch.zeros(1, 1, 128, 8), fmt)[0, 0]
    assert torch.isfinite(out).all()
    assert out[:4].abs().max() == 0  # scale (2e-5 / qmax) underflows fp8 -> exact zeros, error <= max|r|
    if asym:  # (max - min) / 15 = 1.6e-3 is an fp8 subnormal: coarse steps, error bounded by a step
        assert (out[4:] - r[0, 1]).abs().max() <= 1.6e-3
    else:  # 1.4e-2 / 7 = 2e-3 is an fp8 subnormal (2^-9 steps): the block is not all zeros, error <= max|r| / 2
        assert 0 < float(scales.float()[0, 0, 1]) < 2.0**-6
        assert out[4:].abs().max() > 0
        assert (out[4:] - r[0, 1]).abs().max() <= 7e-3


def test_non_finite_input_rejected() -> None:
    x = torch.zeros(10, 2, 8)
    x[3, 1, 5] = float("nan")
    x[7, 0, 0] = float("inf")
    x[7, 0, 1] = float("-inf")
    with pytest.raises(ValueError) as exc:
        prq_quantize(x, QuantConfig(bits=2, block_size=4))
    msg = str(exc.value)
    assert "3 non-finite" in msg and "NaN: 1" in msg and "+inf: 1" in msg and "-inf: 1" in msg
    assert "(3, 1, 5)" in msg and "(7, 0, 0)" in msg and "token 3..7" in msg


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"\[S, H, D\]"):
        prq_quantize(torch.zeros(4, 128), INT2)
    with pytest.raises(ValueError, match="dtype"):
        prq_quantize(torch.zeros(4, 1, 128, dtype=torch.int32), INT2)
    with pytest.raises(ValueError, match="bits=None"):
        prq_quantize(torch.zeros(4, 1, 128), QuantConfig())
    with pytest.raises(ValueError, match="block_size=64 does not divide head_dim=96"):
        prq_quantize(torch.zeros(4, 1, 96), INT2)
    with pytest.raises(ValueError, match="codebooks have shape"):
        prq_dequantize(torch.zeros(1, 35, dtype=torch.uint8), torch.zeros(1, 1, 4, 128), PackedFormat(128, 1, INT2))


def test_segment_nbytes() -> None:
    seg = prq_quantize(torch.randn(100, 2, 128).bfloat16(), INT2)
    assert isinstance(seg, PRQSegment)
    assert seg.nbytes == 100 * 70 + 2 * 128 * 128 * 2 == seg.token_rows.numel() + seg.codebooks.numel() * 2


def test_matmul_precision_is_read_never_written(monkeypatch) -> None:
    """PRQ changes no process-global state: `torch.set_float32_matmul_precision` and the per-backend precision
    settings are never written (a write would raise here). Under IEEE settings (the default) the fp32 BLAS path
    runs (bytes as always); under reduced settings (TF32/bf16 allowed) the matmuls run in fp64 rounded to fp32, whose
    assignments and means satisfy the same fp32 contract."""
    from pagedqvg.quant import prq

    assert torch.get_float32_matmul_precision() == "highest"
    assert not prq.fp32_matmul_may_reduce(torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    x, c = torch.randn(3, 200, 32, generator=g), torch.randn(3, 16, 32, generator=g)
    ids_ieee = assign_nearest(x, c)
    means_ieee = update_means(x, ids_ieee, c)
    kv = torch.randn(64, 2, 32, generator=g).to(torch.bfloat16)
    seg = prq_quantize(kv, QuantConfig(bits=2, centroids=8, block_size=32))

    def refuse(*args, **kwargs):
        raise AssertionError("PRQ wrote a process-global matmul precision setting")

    monkeypatch.setattr(torch, "set_float32_matmul_precision", refuse)
    again = prq_quantize(kv, QuantConfig(bits=2, centroids=8, block_size=32))
    assert torch.equal(again.token_rows, seg.token_rows) and torch.equal(again.codebooks, seg.codebooks)

    monkeypatch.setattr(prq, "fp32_matmul_may_reduce", lambda device: True)  # as under TF32 / bf16 settings
    ids_fp64 = assign_nearest(x, c)
    check_near_ties(x, c, ids_fp64, ids_ieee)
    check_means(x, ids_ieee, c, update_means(x, ids_ieee, c), means_ieee)


def test_fp32_matmul_may_reduce_reads_the_settings() -> None:
    """`fp32_matmul_may_reduce` follows torch's legacy and per-backend precision settings (in a fresh process, so
    this test's process keeps its defaults)."""
    import subprocess
    import sys

    script = """
import torch
from pagedqvg.quant.prq import fp32_matmul_may_reduce as r
cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
out = [r(cpu), r(cuda)]
torch.set_float32_matmul_precision("high")
out += [r(cpu), r(cuda)]
torch.set_float32_matmul_precision("highest")
out += [r(cpu), r(cuda)]
torch.backends.cuda.matmul.fp32_precision = "tf32"
out += [r(cuda)]
torch.backends.cuda.matmul.fp32_precision = "ieee"
out += [r(cuda), r(torch.device("meta"))]
print(out)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str([False, False, True, True, False, False, True, False, False])
