"""A format's segment layout for one layer shape: the registry record's layout class (`quant/formats.py`) built from
the format's byte codec (`quant/format.py` for PRQ, `quant/fp8.py` for fp8, the cache dtype for dense).

The layout answers `pages_for_tokens(n)` and `used_bytes_for_tokens(n)` (rows really occupied, codebooks included,
no page rounding): the cache's stores, `memory_breakdown` and the planner all count bytes through it. O(1).
"""

from __future__ import annotations

import torch

from pagedqvg.layout.segments import DenseTokenLayout, Fp8SegmentLayout, PackedSegmentLayout
from pagedqvg.quant.config import QuantConfig
from pagedqvg.quant.format import PackedFormat
from pagedqvg.quant.formats import TierFormat, get_format
from pagedqvg.quant.fp8 import Fp8Format

__all__ = ["SegmentLayout", "format_layout", "tier_layout"]

#: A segment layout of any format (each has `pages_for_tokens` and `used_bytes_for_tokens`).
SegmentLayout = DenseTokenLayout | Fp8SegmentLayout | PackedSegmentLayout


def format_layout(
    fmt: TierFormat | str,
    quant: QuantConfig | None,
    batch_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page_bytes: int,
) -> SegmentLayout:
    """The layout of format `fmt`'s segments for a layer of `batch_size` x `num_heads` x `head_dim` in `dtype` on
    `page_bytes`-byte pages. `quant` is the PRQ config the format packs with (`QuantConfig.tier_quant`; ignored by
    dense and fp8). UnknownFormatError for an unknown name; ValueError when a PRQ format gets no config or an fp8
    token does not fit a page."""
    rec = get_format(fmt) if isinstance(fmt, str) else fmt
    if rec.codec == "dense":
        return DenseTokenLayout(batch_size, num_heads, head_dim, dtype, page_bytes)
    if rec.codec == "fp8":
        return Fp8SegmentLayout(batch_size, Fp8Format(head_dim, num_heads).token_row_bytes, page_bytes)
    if quant is None or not quant.enabled:
        raise ValueError(f"format {rec.name!r} packs with a QuantConfig (bits 2 or 4), got {quant!r}")
    packed = PackedFormat(head_dim, num_heads, quant, dtype)
    return PackedSegmentLayout.from_format(batch_size, packed, page_bytes)


def tier_layout(
    quant: QuantConfig, tier: str, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, page_bytes: int
) -> SegmentLayout:
    """The layout of `tier`'s segments ('sink', 'history' or 'recent') under `quant`: its `tier_format`, packed
    with its `tier_quant`. A config without tiers (quantization off) gives the dense layout for every tier."""
    return format_layout(
        quant.tier_format(tier), quant.tier_quant(tier), batch_size, num_heads, head_dim, dtype, page_bytes
    )
