"""Bytes by tier in closed form: `tiers.steady_segments`' segments as runs of equal segments, so a plan's tier
figures cost O(1) whatever the window (`tiers.tier_used_bytes` and `tier_summary` walk every segment: O(window)).

`steady_runs(geom)` gives `(role, format, tokens, count)` in `steady_segments`' order; `tier_used_bytes` and
`tier_summary` here return exactly what `tiers`' functions of the same names return (tests compare them).
"""

from __future__ import annotations

from pagedqvg.planning.geometry import Geometry
from pagedqvg.planning.tiers import ROLES, dense_label, format_used_bytes


def _sink_runs(geom: Geometry) -> list[tuple[str, str, int, int]]:
    """The `k = ceil(E / n)` sink segments as runs: the first `sink_keep_chunks` dense, the rest in the sink tier's
    format; each holds `n` tokens but the last (`E - (k - 1) n`)."""
    n, E, q = geom.chunk_tokens, geom.effective_sink, geom.quant
    k = -(-E // n)
    keep = min(q.sink_keep_chunks, k) if q.enabled else k
    out: list[tuple[str, str, int, int]] = []
    for fmt, lo, hi in (("bf16", 0, keep), (q.tier_format("sink") if q.enabled else "bf16", keep, k)):
        full = min(hi, k - 1) - lo
        if full > 0:
            out.append(("sink", fmt, n, full))
        if lo < hi == k:
            out.append(("sink", fmt, E - (k - 1) * n, 1))
    return out


def steady_runs(geom: Geometry) -> list[tuple[str, str, int, int]]:
    """`(role, format, tokens, count)`: the segments of a layer at steady state without pins, sink first, then the
    window oldest first (history, recent, current), equal neighbours merged. O(1)."""
    n, E, C, q = geom.chunk_tokens, geom.effective_sink, geom.cache_size, geom.quant
    T = -(-(C - E) // n)
    recent = min(q.keep_recent_chunks, T - 1) if q.enabled else T - 1
    out = _sink_runs(geom)
    for role, lo, hi in (("history", 0, T - 1 - recent), ("recent", T - 1 - recent, T - 1), ("current", T - 1, T)):
        fmt = "bf16" if role == "current" else q.tier_format(role)
        if lo < hi and lo == 0:  # the oldest window segment holds what is left of the window
            out.append((role, fmt, (C - E) - (T - 1) * n, 1))
            lo = 1
        if lo < hi:
            out.append((role, fmt, n, hi - lo))
    return out


def tier_used_bytes(geom: Geometry) -> dict[str, int]:
    """Bytes per role (`ROLES`) of one layer at steady state without pins (as `tiers.tier_used_bytes`). O(1)."""
    out = dict.fromkeys(ROLES, 0)
    for role, fmt, tokens, count in steady_runs(geom):
        if fmt == "bf16" or role == "current":
            out[role] += count * geom.dense.used_bytes_for_tokens(tokens)
        else:
            out[role] += count * format_used_bytes(geom, role, tokens)
    return out


def tier_summary(geom: Geometry) -> str:
    """One line: each role's formats, segment counts and bytes for all caches (as `tiers.tier_summary`). O(1)."""
    counts: dict[str, dict[str, int]] = {}
    for role, fmt, _tokens, count in steady_runs(geom):
        by_format = counts.setdefault(role, {})
        by_format[fmt] = by_format.get(fmt, 0) + count  # insertion order: the format's first segment
    total = tier_used_bytes(geom)
    parts = []
    for role in ROLES:
        if role in counts:
            label = "+".join(f"{dense_label(geom, f)} x{c}" for f, c in counts[role].items())
            parts.append(f"{role} {label} {total[role] * geom.caches / 2**30:.2f} GiB")
    return ", ".join(parts) + f"; total {sum(total.values()) * geom.caches / 2**30:.2f} GiB"
