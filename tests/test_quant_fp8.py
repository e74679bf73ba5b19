"""The fp8 tier format (quant/fp8.py): byte sizes, the round trip within its proven bound, exact edge cases."""

from __future__ import annotations

import pytest
import torch

from pagedqvg.quant.config import FP8_BLOCK
from pagedqvg.quant.fp8 import Fp8Format


def bound(x: torch.Tensor) -> torch.Tensor:
    """2^-4 |x| (e4m3's normal rounding) + 2^-10 * 2^e with 2^e < block max / 224 (its subnormal half step)."""
    amax = x.reshape(*x.shape[:-1], -1, FP8_BLOCK).abs().amax(-1, keepdim=True)
    sub = (amax / 224.0 * 2.0**-10).expand(*amax.shape[:-1], FP8_BLOCK).reshape(x.shape)
    return x.abs() * 2.0**-4 + sub


def test_sizes():
    f = Fp8Format(head_dim=128, num_heads=40)
    assert (f.num_blocks, f.per_head_bytes, f.token_row_bytes) == (4, 132, 40 * 132)
    assert f.segment_bytes(4680) == 4680 * 40 * 132
    assert f.compression_ratio(4680) == pytest.approx(256 / 132)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_the_bound(dtype):
    g = torch.Generator().manual_seed(0)
    lo, hi = (-6, 3) if dtype == torch.float16 else (-20, 20)  # float16 overflows past 65,504
    scale = torch.logspace(lo, hi, 64).view(64, 1, 1)
    x = torch.randn(64, 3, 64, generator=g) * scale
    x[3] = 0.0
    x[5, 1, :FP8_BLOCK] = 1e-40  # subnormals: exponent clamped at -127
    x = x.to(dtype).float()  # what the cache holds
    f = Fp8Format(head_dim=64, num_heads=3)
    rows = f.quantize(x.to(dtype))
    assert rows.dtype == torch.uint8 and rows.shape == (64, 3 * f.per_head_bytes)
    y = f.dequantize(rows, torch.float32)
    assert bool(((x - y).abs() <= bound(x)).all())
    assert torch.equal(y[3], torch.zeros_like(y[3]))
    # decoding to bf16 is exact in bf16's normal range: a 4-bit significand times a power of two fits bf16's 8
    normal = y.abs() >= 2.0**-126
    assert torch.equal(f.dequantize(rows, torch.bfloat16).float()[normal], y[normal])


def test_extremes_do_not_saturate_or_overflow():
    f = Fp8Format(head_dim=32, num_heads=1)
    x = torch.tensor([3.3e38, -3.3e38, 448.0, 449.0] + [1.0] * 28).view(1, 1, 32)
    y = f.dequantize(f.quantize(x), torch.float32)
    assert bool(torch.isfinite(y).all()) and bool(((x - y).abs() <= bound(x)).all())
    c = torch.full((2, 1, 32), 7.0)
    assert torch.equal(f.dequantize(f.quantize(c), torch.float32), c)  # 7 = 1.75 * 2^2: exact in e4m3


def test_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        Fp8Format(head_dim=48, num_heads=1)
    with pytest.raises(ValueError, match="num_heads=0"):
        Fp8Format(head_dim=64, num_heads=0)
    f = Fp8Format(head_dim=64, num_heads=2)
    with pytest.raises(ValueError, match=r"expected \[..., 2, 64\]"):
        f.quantize(torch.zeros(3, 2, 32))
    with pytest.raises(ValueError, match="1 non-finite"):
        f.quantize(torch.tensor([float("nan")] + [0.0] * 127).view(1, 2, 64))
    with pytest.raises(ValueError, match=r"uint8 \[..., 132\]"):
        f.dequantize(torch.zeros(1, 131, dtype=torch.uint8))
