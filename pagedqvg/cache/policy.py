"""The pack policy (QVG): which chunks pack, which stay, and which pack early under pool pressure.

One rule for the cache and the planner. A segment is a *sink segment* while it holds tokens of the sink slots
`[0, E)` or of the pinned run (`Sequencer.sink_ranges`). After an advance, of the completed segments (every one but
the newest, the chunk being denoised):

- non-sink segments older than the newest `keep_recent_chunks` non-sink ones pack in the history's format, the
  newest `keep_recent_chunks` in the recent tier's (dense by default: they stay);
- sink segments past the first `sink_keep_chunks` pack in the sink tier's format (dense with `cfg.sink` off);
- a segment only moves to a coarser format (`quant/formats.py` rank): segments already in their tier's format or a
  coarser one, that failed to pack (until rewritten), or that overlap the call's write stay as they are.

A config without tiers is the case whose sink and history tiers share the history's format: one rule
(`tier_targets`), one path in the cache and the planner.

Tensor-free: segments are anything with `packed` and `pack_failed` attributes (`segment.Segment`, the planner's
counted segments). Packing itself (and unpacking a rewritten packed chunk) is the caller's.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

from pagedqvg.allocator.range_index import RangeEntry, RangeIndex
from pagedqvg.cache.sequencing import Sequencer
from pagedqvg.quant.formats import format_rank

if TYPE_CHECKING:
    from pagedqvg.quant import QuantConfig


class PolicySegment(Protocol):
    """What the policy reads of a segment."""

    @property
    def packed(self) -> bool: ...

    pack_failed: bool


S = TypeVar("S", bound=PolicySegment)


def sink_segment_starts(seq: Sequencer[S]) -> set[int]:
    """Global starts of the sink segments (holding sink or pinned slots). O(runs x (log n + k))."""
    index = seq.index
    return {e.start for g0, g1 in seq.sink_ranges() for e in index.overlapping(g0, g1)}


def _overlaps(entry: RangeEntry[S], keep: tuple[int, int]) -> bool:
    return entry.start < keep[1] and keep[0] < entry.end


def tier_targets(
    cfg: QuantConfig,
    sinks: Collection[int],
    newest_first: Iterable[RangeEntry[S]],
    candidates: Iterable[RangeEntry[S]],
    keep: tuple[int, int],
) -> list[tuple[RangeEntry[S], str]]:
    """Formats by age: `(segment, tier)` for each segment to pack or repack into `tier`'s format after an advance, in
    packing order (non-sink segments oldest first, then sink ones). One rule with or without tiers: a config without
    tiers is the case whose sink and history tiers take the history's format and whose recent tier is dense.

    Roles: sink segments past the first `sink_keep_chunks` are 'sink'; of the others, the `keep_recent_chunks`
    newest completed ones are 'recent' and the older ones 'history'. A segment moves only to a format of lower
    precision rank than the one it holds (`format_rank`): bf16 -> any packed format, recent int4/fp8 -> history
    int2/compact; never back up (after a rewind a history chunk may become recent again and stays as it is).
    Segments that failed to pack or overlap the call's write `keep` stay; so does the current chunk.

    Args:
        cfg: the quantization policy (`keep_recent_chunks`, `sink_keep_chunks`, the tiers' formats).
        sinks: `sink_segment_starts` of the layer.
        newest_first: every segment, newest first (the first is the current chunk, which never packs); read only
            until `keep_recent_chunks` non-sink ones were seen.
        candidates: the segments that may move, oldest first (at least every one not yet in the coarsest format of
            the tiers; others are skipped by the rank rule).
        keep: the call's written global range `[start, end)`.

    O(keep_recent_chunks + sinks + candidates).
    """
    it = iter(newest_first)
    current = next(it, None)
    current_start = current.start if current is not None else None
    recent: set[int] = set()
    for entry in it:
        if len(recent) >= cfg.keep_recent_chunks:
            break
        if entry.start not in sinks:
            recent.add(entry.start)
    kept_sinks = set(sorted(start for start in sinks if start != current_start)[: cfg.sink_keep_chunks])
    want = {tier: format_rank(cfg.tier_format(tier)) for tier in ("sink", "recent", "history")}
    others: list[tuple[RangeEntry[S], str]] = []
    sink_targets: list[tuple[RangeEntry[S], str]] = []
    for entry in candidates:
        if entry.start == current_start or entry.value.pack_failed or _overlaps(entry, keep):
            continue
        if entry.start in kept_sinks:
            continue
        is_sink = entry.start in sinks
        tier = "sink" if is_sink else ("recent" if entry.start in recent else "history")
        if want[tier] < format_rank(segment_format(entry.value, cfg)):
            (sink_targets if is_sink else others).append((entry, tier))
    return others + sink_targets


def pack_targets(
    cfg: QuantConfig,
    sinks: Collection[int],
    newest_first: Iterable[RangeEntry[S]],
    candidates: Iterable[RangeEntry[S]],
    keep: tuple[int, int],
) -> list[RangeEntry[S]]:
    """The segments `tier_targets` selects, without their tiers (same arguments, same order). O(as tier_targets)."""
    return [entry for entry, _tier in tier_targets(cfg, sinks, newest_first, candidates, keep)]


def segment_format(seg: PolicySegment, cfg: QuantConfig) -> str:
    """The tier format a segment holds: its `fmt` attribute when it has one (tiered stores), else the history's
    format when packed and 'bf16' when not."""
    fmt = getattr(seg, "fmt", None)
    if fmt is not None:
        return fmt
    return cfg.tier_format("history") if seg.packed else "bf16"


def layer_tier_targets(cfg: QuantConfig, seq: Sequencer[S], keep: tuple[int, int]) -> list[tuple[RangeEntry[S], str]]:
    """`tier_targets` over every segment of `seq` (O(segments))."""
    entries = list(seq.index)
    return tier_targets(cfg, sink_segment_starts(seq), reversed(entries), entries, keep)


def layer_pack_targets(cfg: QuantConfig, seq: Sequencer[S], keep: tuple[int, int]) -> list[RangeEntry[S]]:
    """The segments of `layer_tier_targets` (O(segments))."""
    return [entry for entry, _tier in layer_tier_targets(cfg, seq, keep)]


def pressure_candidates(
    index: RangeIndex[S], sinks: Collection[int], excluded: Collection[int], keep: tuple[int, int]
) -> list[RangeEntry[S]]:
    """Unpacked segments that may pack early when an advance does not fit the pool, in the order to try them:
    oldest first, non-sink before sink. Segments whose start is in `excluded` (released or unpacked by the call) or
    that overlap the call's write `keep` are left out. O(segments)."""
    candidates = [x for x in index if not x.value.packed and x.start not in excluded and not _overlaps(x, keep)]
    candidates.sort(key=lambda x: x.start in sinks)
    return candidates
