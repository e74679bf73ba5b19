"""The fp8 tier format: near-lossless storage of K/V rows as fp8 e4m3 values with a power-of-two scale per block.

Per-head record (one token of one head), no padding:

    offset 0     values     D bytes            float8_e4m3fn bit patterns of x / 2^e
    offset D     exponents  D / FP8_BLOCK      uint8 e + 127 (an E8M0 scale, as the MX formats'), one per block

For a block with max |x| = a > 0 the exponent is e = ceil(log2(a / 448)) (clamped to [-127, 127]), so x / 2^e lies
within e4m3's range +-448 (no saturation) and the scaling is exact. An all-zero block stores e = -127 and zeros.
Decoding: value = float(fp8) * 2^e, in fp32, clamped to the cache dtype's finite range, cast to it.

Error (proven by e4m3's rounding, round to nearest even): |x - decode(x)| <= 2^-4 |x| for |x| / 2^e >= 2^-6 (normal
range), else <= 2^-10 * 2^e (half a subnormal step). Since a / 2^e > 224, the subnormal range holds only values below
2^-6 / 224 ~ 7e-5 of the block max. At head_dim 128: 128 + 4 = 132 B per token-head vs 256 B in bf16 (1.94x), no
codebooks. Torch only (every device); no Triton kernel yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedqvg.quant.format import FP8_DTYPE, FP8_MAX
from pagedqvg.quant.formats import FP8_BLOCK

_EXP_BIAS = 127


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """Byte layout of fp8 tier rows for `num_heads` heads of `head_dim` channels (sizes in bytes)."""

    head_dim: int
    num_heads: int

    def __post_init__(self) -> None:
        if not (isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % FP8_BLOCK == 0):
            raise ValueError(f"Fp8Format.head_dim={self.head_dim!r}; allowed: a positive multiple of {FP8_BLOCK}")
        if not (isinstance(self.num_heads, int) and self.num_heads > 0):
            raise ValueError(f"Fp8Format.num_heads={self.num_heads!r}; allowed: an int >= 1")

    @property
    def num_blocks(self) -> int:
        """Scale blocks per token-head: head_dim / FP8_BLOCK."""
        return self.head_dim // FP8_BLOCK

    @property
    def per_head_bytes(self) -> int:
        """Bytes of one token of one head: head_dim values + one exponent byte per block (132 at D=128)."""
        return self.head_dim + self.num_blocks

    @property
    def token_row_bytes(self) -> int:
        """Bytes of one token row (all heads)."""
        return self.num_heads * self.per_head_bytes

    def segment_bytes(self, num_tokens: int) -> int:
        """Bytes of a segment of `num_tokens` tokens (no codebooks)."""
        return num_tokens * self.token_row_bytes

    def compression_ratio(self, num_tokens: int, itemsize: int = 2) -> float:
        """Dense bytes (cache dtype of `itemsize` bytes) / fp8 bytes."""
        return self.head_dim * itemsize / self.per_head_bytes

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., H, D]` (finite, any float dtype) -> uint8 rows `[..., H * per_head_bytes]`. O(numel).

        Raises:
            ValueError: wrong trailing shape or non-finite values.
        """
        H, D, nb = self.num_heads, self.head_dim, self.num_blocks
        if tuple(x.shape[-2:]) != (H, D):
            raise ValueError(f"fp8 quantize: x has shape {tuple(x.shape)}, expected [..., {H}, {D}]")
        xf = x.float()
        if not bool(torch.isfinite(xf).all()):
            raise ValueError(f"fp8 quantize: {int((~torch.isfinite(xf)).sum())} non-finite values; need finite K/V")
        blocks = xf.reshape(*x.shape[:-1], nb, FP8_BLOCK)
        amax = blocks.abs().amax(-1)
        exp = torch.ceil(torch.log2(amax / FP8_MAX))
        exp = torch.where(amax > 0, exp, torch.full_like(exp, -_EXP_BIAS)).clamp(-_EXP_BIAS, _EXP_BIAS)
        # log2 may round: step e up while the scaled max still exceeds the fp8 range (at most once)
        exp = torch.where(amax * torch.exp2(-exp) > FP8_MAX, exp + 1, exp)
        scaled = (blocks * torch.exp2(-exp).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
        values = scaled.to(FP8_DTYPE).view(torch.uint8).reshape(*x.shape[:-1], D)
        record = torch.cat([values, (exp + _EXP_BIAS).to(torch.uint8)], dim=-1)
        return record.reshape(*x.shape[:-2], H * self.per_head_bytes)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """uint8 rows `[..., H * per_head_bytes]` -> `[..., H, D]` in `dtype` (inverse of `quantize` up to the
        rounding bound of the module docstring). O(numel)."""
        if rows.dtype != torch.uint8 or rows.shape[-1:] != (self.token_row_bytes,):
            raise ValueError(
                f"fp8 rows must be uint8 [..., {self.token_row_bytes}], got {rows.dtype} {tuple(rows.shape)}"
            )
        H, D, nb = self.num_heads, self.head_dim, self.num_blocks
        rec = rows.reshape(*rows.shape[:-1], H, self.per_head_bytes)
        values = rec[..., :D].contiguous().view(FP8_DTYPE).float().reshape(*rec.shape[:-1], nb, FP8_BLOCK)
        exp = rec[..., D:].float() - _EXP_BIAS
        out = values * torch.exp2(exp).unsqueeze(-1)
        top = torch.finfo(dtype).max  # rounding up near the dtype's max must not decode to inf
        return out.reshape(*rec.shape[:-1], D).clamp(-top, top).to(dtype)
