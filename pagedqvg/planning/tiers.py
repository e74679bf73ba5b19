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

from pagedqvg.layout.segments import PackedSegmentLayout
from pagedqvg.planning.geometry import Geometry
from pagedqvg.quant import PackedFormat
from pagedqvg.quant.fp8 import Fp8Format
from pagedqvg.validation import DTYPES_BY_NAME

#: Segment roles, in the order `tier_used_bytes` reports them.
ROLES: tuple[str, ...] = ("sink", "history", "recent", "current")


def format_used_bytes(geom: Geometry, tier: str, tokens: int) -> int:
    """Bytes of one segment of `tokens` tokens in `tier`'s format ('sink', 'history', 'recent'; K and V, all batch
    elements and heads of the layer). O(1)."""
    name = geom.quant.tier_format(tier)
    if name == "bf16":
        return geom.dense.used_bytes_for_tokens(tokens)
    if name == "fp8":
        return 2 * geom.batch_size * tokens * Fp8Format(geom.head_dim, geom.heads).token_row_bytes
    q = geom.quant.tier_quant(tier)
    assert q is not None
    fmt = PackedFormat(geom.head_dim, geom.heads, q, geom.dtype)
    return PackedSegmentLayout.from_format(geom.batch_size, fmt, geom.page_bytes).used_bytes_for_tokens(tokens)


def steady_segments(geom: Geometry) -> list[tuple[str, str, int]]:
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


def tier_used_bytes(geom: Geometry) -> dict[str, int]:
    """Bytes per role (`ROLES`) of one layer at steady state without pins; their sum is the layer's used bytes."""
    out = dict.fromkeys(ROLES, 0)
    for role, fmt, tokens in steady_segments(geom):
        if fmt == "bf16" or role == "current":
            out[role] += geom.dense.used_bytes_for_tokens(tokens)
        else:
            out[role] += format_used_bytes(geom, role, tokens)
    return out


def dense_label(geom: Geometry, fmt: str) -> str:
    """`fmt` as tables show it: the dense format ("bf16" in the tier configuration) is named by the cache dtype
    (bf16, fp16 or fp32); packed formats by their own names."""
    if fmt != "bf16":
        return fmt
    return next((name for name, dt in DTYPES_BY_NAME.items() if dt == geom.dtype), str(geom.dtype))


def tier_summary(geom: Geometry) -> str:
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


class Fp8SegmentLayout:
    """Pages of an fp8-tier segment: `2 * B` rows of `Fp8Format.token_row_bytes` per token, whole tokens per page
    (K and V of every batch element side by side, as dense and packed token rows are), no codebooks."""

    def __init__(self, batch_size: int, token_row_bytes: int, page_bytes: int) -> None:
        self.batch_size = batch_size
        self.token_row_bytes = token_row_bytes
        self.tokens_per_page = (page_bytes // token_row_bytes) // (2 * batch_size)
        if self.tokens_per_page < 1:
            raise ValueError(
                f"an fp8-tier token ({2 * batch_size} rows of {token_row_bytes} B) does not fit a page of "
                f"{page_bytes} B; use a larger --page-bytes or another tier format"
            )

    def pages_for_tokens(self, tokens: int) -> int:
        """Pages of a segment of `tokens` tokens. O(1)."""
        return -(-tokens // self.tokens_per_page)

    def used_bytes_for_tokens(self, tokens: int) -> int:
        """Bytes the rows really occupy (without page rounding)."""
        return 2 * self.batch_size * tokens * self.token_row_bytes


def tier_layouts(geom: Geometry) -> dict[str, object]:
    """Format name -> layout (`pages_for_tokens`, `used_bytes_for_tokens`) of every format `geom.quant`'s tiers
    use, 'bf16' included. ValueError naming the tier when its segments do not fit `geom.page_bytes`."""
    out: dict[str, object] = {"bf16": geom.dense}
    for tier in ("history", "recent", "sink"):
        name = geom.quant.tier_format(tier)
        if name in out:
            continue
        if name == "fp8":
            out[name] = Fp8SegmentLayout(geom.batch_size, Fp8Format(geom.head_dim, geom.heads).token_row_bytes,
                                         geom.page_bytes)  # fmt: skip
            continue
        q = geom.quant.tier_quant(tier)
        assert q is not None
        fmt = PackedFormat(geom.head_dim, geom.heads, q, geom.dtype)
        layout = PackedSegmentLayout.from_format(geom.batch_size, fmt, geom.page_bytes)
        if layout.tokens_per_page < 1 or layout.codebook_row_bytes > geom.page_bytes:
            raise ValueError(
                f"the {tier} tier's {name} segments do not fit a page of {geom.page_bytes} B (token row "
                f"{layout.token_row_bytes} B x {2 * geom.batch_size}, codebook row {layout.codebook_row_bytes} B); "
                "use a larger --page-bytes"
            )
        out[name] = layout
    return out
