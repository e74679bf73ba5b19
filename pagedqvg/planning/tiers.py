"""Bytes by tier (issue 23): which format each segment of a layer's steady-state window holds, and its bytes.

Roles of the segments of one layer at steady state without pins (the pack policy of policy.py, with formats by
age from `QuantConfig.tier_format`):

- `sink`: the `k = ceil(E / n)` sink segments; the first `sink_keep_chunks` stay dense, the rest take the sink
  tier's format (dense when `sink` is off);
- `current`: the newest window segment (the chunk being denoised), always dense;
- `recent`: the `keep_recent_chunks` next newest, in `recent_format`;
- `history`: the older window segments (the oldest holds `(C - E) - (T - 1) n` tokens), in the history's format.

Bytes are the rows the tokens really occupy (no page rounding; codebooks included), as `closed_form_used_bytes`
and the cache's `memory_breakdown` count them. Tensor-free; O(segments).
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedqvg.layout.segments import DenseTokenLayout, PackedSegmentLayout
from pagedqvg.quant import QuantConfig
from pagedqvg.quant.formats import get_format
from pagedqvg.quant.layouts import SegmentLayout, tier_layout
from pagedqvg.validation import DTYPES_BY_NAME

#: Segment roles, in the order `tier_used_bytes` reports them.
ROLES: tuple[str, ...] = ("sink", "history", "recent", "current")
#: The tiers, in the order `tier_layouts` builds their layouts.
_TIER_ORDER: tuple[str, ...] = ("history", "recent", "sink")


class TierGeometry(Protocol):
    """What this module reads of a layer's geometry (`planner.Geometry`)."""

    @property
    def quant(self) -> QuantConfig: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def chunk_tokens(self) -> int: ...
    @property
    def cache_size(self) -> int: ...
    @property
    def caches(self) -> int: ...
    @property
    def effective_sink(self) -> int: ...
    @property
    def dense(self) -> DenseTokenLayout: ...


def _layout(geom: TierGeometry, tier: str) -> SegmentLayout:
    """`tier`'s segment layout (the registry's: `quant/layouts.py`); the cache dtype's for a dense tier."""
    if geom.quant.tier_format(tier) == "bf16":
        return geom.dense
    return tier_layout(geom.quant, tier, geom.batch_size, geom.heads, geom.head_dim, geom.dtype, geom.page_bytes)


def format_used_bytes(geom: TierGeometry, tier: str, tokens: int) -> int:
    """Bytes of one segment of `tokens` tokens in `tier`'s format ('sink', 'history', 'recent'; K and V, all batch
    elements and heads of the layer). O(1)."""
    return _layout(geom, tier).used_bytes_for_tokens(tokens)


def steady_segments(geom: TierGeometry) -> list[tuple[str, str, int]]:
    """`(role, format, tokens)` of every segment of a layer at steady state without pins, sink first, then the
    window oldest first. O(segments)."""
    n, E, C = geom.chunk_tokens, geom.effective_sink, geom.cache_size
    q = geom.quant
    k, T = -(-E // n), -(-(C - E) // n)
    out: list[tuple[str, str, int]] = []
    for i in range(k):
        tokens = n if i < k - 1 else E - (k - 1) * n
        dense = not q.enabled or i < q.sink_keep_chunks
        out.append(("sink", "bf16" if dense else q.tier_format("sink"), tokens))
    recent = min(q.keep_recent_chunks, T - 1) if q.enabled else T - 1
    for i in range(T):
        tokens = (C - E) - (T - 1) * n if i == 0 else n
        newer = T - 1 - i  # window segments newer than this one
        role = "current" if newer == 0 else ("recent" if newer <= recent else "history")
        out.append((role, "bf16" if role == "current" else q.tier_format(role), tokens))
    return out


def format_layouts(geom: TierGeometry) -> dict[str, SegmentLayout]:
    """Format name -> layout of every format `geom.quant`'s tiers use, 'bf16' (the cache dtype) included; a config
    without tiers (quantization off) maps 'bf16' alone. No page-fit check (`tier_layouts` adds it). O(tiers)."""
    out: dict[str, SegmentLayout] = {"bf16": geom.dense}
    for tier in _TIER_ORDER:
        out.setdefault(geom.quant.tier_format(tier), _layout(geom, tier))
    return out


def tier_used_bytes(geom: TierGeometry) -> dict[str, int]:
    """Bytes per role (`ROLES`) of one layer at steady state without pins; their sum is the layer's used bytes."""
    out = dict.fromkeys(ROLES, 0)
    layouts = format_layouts(geom)
    for role, fmt, tokens in steady_segments(geom):
        out[role] += layouts[fmt].used_bytes_for_tokens(tokens)
    return out


def dense_label(geom: TierGeometry, fmt: str) -> str:
    """`fmt` as tables show it: the dense format ("bf16" in the tier configuration) is named by the cache dtype
    (bf16, fp16 or fp32); packed formats by their own names."""
    if fmt != "bf16":
        return fmt
    return next((name for name, dt in DTYPES_BY_NAME.items() if dt == geom.dtype), str(geom.dtype))


def tier_summary(geom: TierGeometry) -> str:
    """One line: each role's format, segment count and bytes for all caches, e.g. 'sink int4 x1 1.03 GiB, ...'."""
    counts: dict[str, list[str]] = {}
    for role, fmt, _tokens in steady_segments(geom):
        counts.setdefault(role, []).append(fmt)
    total = tier_used_bytes(geom)
    parts = []
    for role in ROLES:
        if role in counts:
            fmts = sorted(set(counts[role]), key=counts[role].index)
            label = "+".join(f"{dense_label(geom, f)} x{counts[role].count(f)}" for f in fmts)
            parts.append(f"{role} {label} {total[role] * geom.caches / 2**30:.2f} GiB")
    return ", ".join(parts) + f"; total {sum(total.values()) * geom.caches / 2**30:.2f} GiB"


def tier_layouts(geom: TierGeometry) -> dict[str, SegmentLayout]:
    """Format name -> layout (`pages_for_tokens`, `used_bytes_for_tokens`) of every format `geom.quant`'s tiers
    use, 'bf16' included (a config without tiers maps 'bf16' alone, or with quantization on 'bf16' and the history's
    format). ValueError naming the tier when its segments do not fit `geom.page_bytes`."""
    out: dict[str, SegmentLayout] = {"bf16": geom.dense}
    for tier in _TIER_ORDER:
        name = geom.quant.tier_format(tier)
        if name in out:
            continue
        layout = out[name] = _layout(geom, tier)  # an fp8 layout raises ValueError when a token does not fit a page
        if not get_format(name).prq:
            continue
        assert isinstance(layout, PackedSegmentLayout)
        if layout.tokens_per_page < 1 or layout.codebook_row_bytes > geom.page_bytes:
            raise ValueError(
                f"the {tier} tier's {name} segments do not fit a page of {geom.page_bytes} B (token row "
                f"{layout.token_row_bytes} B x {2 * geom.batch_size}, codebook row {layout.codebook_row_bytes} B); "
                "use a larger --page-bytes"
            )
    return out
