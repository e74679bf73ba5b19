"""The compact PRQ mode (`QuantConfig.compact()`: trit-packed int2, fitted fp8 scales, fp8 codebooks).

- config: the preset, `mode`, `from_dict` / SGLang-style flags (`kv_cache_quant=compact` plus overrides), typed
  errors for invalid combinations; the reference formats are unchanged.
- format: 28 B per token-head + a 16 KiB fp8 codebook per (K/V, head) at D=128, >= 8x at 4,680 tokens; codebook
  rows round-trip through fp8 (saturating at +-448).
- quantizer: compact beats the reference int2's K and V error on one synthetic 4,680-token chunk; packing is
  deterministic; the fitted multiplier is the argmin of the documented integer error (an independent scalar
  re-implementation); fp8 codebooks are what the residual was computed against.
The kernels on compact formats are tested with the kernels: residual pack with fitted scales in
tests/test_kernels_residual_pack.py, the packed dequant of fp8 codebooks in tests/test_kernels_dequant.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedqvg.planning.synthetic import relative_error, video_kv
from pagedqvg.quant import FP8_DTYPE, PackedFormat, QuantConfig, prq_kmeans, prq_quantize
from pagedqvg.quant.prq import FIT_ONE, FIT_STEPS, _fit_multiplier

REFERENCE = QuantConfig(bits=2)  # SGLang's int2 defaults: 128 centroids, block 64, 1 stage, 2 iterations, symmetric


# ---------------------------------------------------------------------------------------------- config
def test_compact_preset_and_mode():
    c = QuantConfig.compact()
    assert (c.bits, c.centroids, c.block_size, c.stages, c.kmeans_iters) == (2, 128, 128, 1, 2)
    assert c.pack_trits and c.fit_scales and c.codebook_fp8 and not c.asymmetric
    assert c.mode == "compact" and "fp8 codebooks" in c.describe()
    assert QuantConfig.compact(keep_recent_chunks=3).keep_recent_chunks == 3
    assert QuantConfig(bits=2, fit_scales=True).mode == "int2"  # one extension alone is not the compact mode
    assert REFERENCE.mode == "int2" and QuantConfig().mode == "off"
    assert not REFERENCE.fit_scales and not REFERENCE.codebook_fp8  # reference formats untouched by default


def test_compact_from_dict_and_flags():
    assert QuantConfig.from_dict({"kv_cache_quant": "compact"}) == QuantConfig.compact()
    got = QuantConfig.from_dict({"--kv-cache-quant-keep-recent": "2", "--kv-cache-quant": "Compact"})
    assert got == QuantConfig.compact(keep_recent_chunks=2)
    got = QuantConfig.from_dict({"kv_cache_quant": "compact", "kv_cache_quant_block_size": "64"})
    assert got.block_size == 64 and got.mode == "compact"
    got = QuantConfig.from_dict({"kv_cache_quant": "int4", "kv_cache_quant_fit_scales": "yes",
                                 "kv_cache_quant_codebook_fp8": "1"})  # fmt: skip
    assert got.bits == 4 and got.fit_scales and got.codebook_fp8
    assert "kv_cache_quant_codebook_fp8" in QuantConfig.known_keys()
    with pytest.raises(ValueError, match="compact"):
        QuantConfig.from_dict({"kv_cache_quant": "int3"})
    with pytest.raises(ValueError, match=r"fit_scales.*not a boolean"):
        QuantConfig.from_dict({"kv_cache_quant_fit_scales": "maybe"})


def test_compact_invalid_combinations():
    with pytest.raises(ValueError, match=r"fit_scales=True needs symmetric.*asymmetric=False"):
        QuantConfig(bits=4, fit_scales=True, asymmetric=True)
    with pytest.raises(ValueError, match=r"codebook_fp8=1 must be a bool"):
        QuantConfig(bits=2, codebook_fp8=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pack_trits=True needs symmetric int2"):
        QuantConfig.compact(asymmetric=True)
    with pytest.raises(ValueError, match=r"block_size=128 does not divide head_dim=64"):
        PackedFormat(64, 2, QuantConfig.compact())
    QuantConfig(bits=None, fit_scales=True, asymmetric=True)  # quantization off: the extensions are inert


# ---------------------------------------------------------------------------------------------- format
def test_compact_format_bytes():
    fmt = PackedFormat(128, 40, QuantConfig.compact())
    assert fmt.layout() == {"codes": (0, 26), "scales": (26, 1), "zeros": (27, 0), "ids": (27, 1)}
    assert fmt.per_head_bytes == 28 and fmt.codebook_dtype == FP8_DTYPE
    assert fmt.codebook_row_bytes == 128 * 128  # one byte per centroid value
    assert fmt.segment_bytes(4680) == 4680 * 40 * 28 + 40 * 128 * 128
    assert fmt.compression_ratio(4680) >= 8.0 and fmt.compression_ratio(10800) >= 8.6
    ref = PackedFormat(128, 40, REFERENCE)
    assert (ref.per_head_bytes, ref.codebook_row_bytes, ref.codebook_dtype) == (35, 128 * 128 * 2, torch.bfloat16)
    assert round(ref.compression_ratio(4680), 2) == 6.09


def test_fp8_codebook_rows_round_trip_and_saturate():
    fmt = PackedFormat(16, 2, QuantConfig.compact(block_size=16, centroids=3, stages=2), dtype=torch.float16)
    cb = torch.tensor([0.1, -2.5, 1000.0, -1e4, 448.0, 0.0]).repeat(2 * 2 * 3 * 16 // 6).view(2, 2, 3, 16)
    rows = fmt.pack_codebooks(cb)
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (4, 3 * 16)
    back = fmt.unpack_codebooks(rows)
    assert back.dtype == FP8_DTYPE
    want = cb.clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(back.view(torch.uint8), want.view(torch.uint8))
    assert torch.isfinite(back.float()).all()


# ---------------------------------------------------------------------------------------------- quantizer
def test_compact_error_at_most_reference_on_a_synthetic_chunk():
    """The issue's target on one 4,680-token chunk (2 heads here to keep CPU time down; bench_prq.py uses 4)."""
    k_all, v_all = video_kv(3, (30, 52), 2, 128, seed=0)
    errs = {}
    for name, cfg in (("ref", REFERENCE), ("compact", QuantConfig.compact())):
        for kv, x in (("k", k_all[0]), ("v", v_all[0])):
            seg = prq_quantize(x, cfg)
            errs[name, kv] = relative_error(x, seg.dequantize())
    assert PackedFormat(128, 2, QuantConfig.compact()).compression_ratio(k_all.shape[1]) >= 8.0
    for kv in ("k", "v"):
        assert errs["compact", kv] <= errs["ref", kv], errs


def test_compact_packing_is_deterministic_and_uses_the_stored_fp8_codebook():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(200, 3, 32, generator=g) * torch.tensor([1.0, 20.0, 0.01])[None, :, None]).to(torch.bfloat16)
    cfg = QuantConfig.compact(block_size=16, centroids=8)
    a, b = prq_quantize(x, cfg), prq_quantize(x, cfg)
    assert torch.equal(a.token_rows, b.token_rows) and torch.equal(a.codebooks.view(torch.uint8),
                                                                   b.codebooks.view(torch.uint8))  # fmt: skip
    assert a.codebooks.dtype == FP8_DTYPE
    km = prq_kmeans(x, cfg)
    heads = torch.arange(3)[:, None]
    centroid = km.codebooks.float()[heads, 0, km.ids[..., 0].long()]  # [H, S, D], the stored fp8 values
    assert torch.equal(km.resid, x.float().transpose(0, 1) - centroid)
    plain = prq_quantize(x, QuantConfig(bits=2, block_size=16, centroids=8, pack_trits=True))  # no extensions
    assert relative_error(x, a.dequantize()) < 0.9 * relative_error(x, plain.dequantize())


def _fit_scalar(block: list[float], qmax: int) -> float:
    """The documented fit, one block, in Python integers (independent of the tensor code)."""
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 1.0
    u = [round(float(torch.tensor(abs(v)) / torch.tensor(amax)) * FIT_ONE) * qmax for v in block]
    best = None
    for j in range(FIT_STEPS):
        level = 256 * (16 - j)
        err = sum((x - min(qmax, (2 * x + level) // (2 * level)) * level) ** 2 for x in u)
        if best is None or err < best[0]:
            best = (err, j)
    assert best is not None
    return (16 - best[1]) / 16


@pytest.mark.parametrize("qmax", [1, 7])
def test_fit_multiplier_matches_a_scalar_reimplementation(qmax):
    g = torch.Generator().manual_seed(qmax)
    blocks = torch.randn(60, 16, generator=g) * torch.rand(60, 1, generator=g) * 5
    blocks[0] = 0
    blocks[1] = 3.0  # constant
    blocks[2] = torch.linspace(-1.0, 1.0, 16)  # uniform values: levels well inside the range win
    blocks[4, 0] = 40.0  # one outlier dominates the squared error: m = 1 keeps it
    blocks[3] = torch.tensor([1.0, -1.0] * 8)
    got = _fit_multiplier(blocks, blocks.abs().amax(-1), qmax)
    want = [_fit_scalar(b.tolist(), qmax) for b in blocks]
    assert got.tolist() == want
    assert got[0] == 1.0 and got[1] == 1.0 and got[4] == 1.0
    if qmax == 1:  # ternary codes of uniform values: the MSE-optimal level is ~2/3 of the range
        assert got[2] < 0.8
