"""The single-layer accounting replay: one cache's own sequencing core and pack policy with a page counter for a
store (`CountingLayer`, no tensors), the callers' order (`call_pattern`) and a layer's census over a replay
(`replay_layer`). Tests check it against `BlockPool.stats()` of real caches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pagedqvg.allocator import RangeEntry
from pagedqvg.cache.policy import sink_segment_starts, tier_targets
from pagedqvg.cache.sequencing import CacheSpec, Sequencer
from pagedqvg.planning.geometry import Geometry
from pagedqvg.planning.tiers import tier_layouts
from pagedqvg.quant.config import TIERS
from pagedqvg.quant.formats import format_rank
from pagedqvg.store.segment import SegmentKind


class PageCounter:
    """Pages in use and their high-water mark (a pool without storage)."""

    __slots__ = ("high_water", "used")

    def __init__(self) -> None:
        self.used = 0
        self.high_water = 0

    def alloc(self, n: int) -> None:
        self.used += n
        if self.used > self.high_water:
            self.high_water = self.used

    def free(self, n: int) -> None:
        self.used -= n


@dataclass(slots=True)
class CountedSegment:
    """A segment of the accounting: its kind and page count (no storage); `pack_failed` is always False here."""

    kind: SegmentKind
    pages: int
    pack_failed: bool = False
    fmt: str | None = None  # tiered configs: the tier format the segment holds ('bf16', 'fp8', 'int4', ...)

    @property
    def packed(self) -> bool:
        """Whether the segment is packed."""
        return self.kind == SegmentKind.PACKED


class CountingLayer:
    """One `PagedCausalKVCache` whose store counts pages instead of holding them (no tensors).

    The cache's own `Sequencer` (slot map, roll, pin, view ranges, released segments) and pack policy
    (`policy.tier_targets`, one path with or without tiers) with `PageCounter` for a pool: a segment of `n` tokens
    takes its format's `pages_for_tokens(n)` pages (`tiers.tier_layouts`: bf16, the history's, the tiers'); packing
    frees the old pages, then takes the packed ones, as the cache does. Each call is O(runs + log(segments) +
    segments touched + keep_recent_chunks + sink segments), so a replay of N chunks is O(N log N) whatever the
    window.
    """

    def __init__(self, geom: Geometry, counter: PageCounter | None = None, name: str = "layer") -> None:
        self.geom = geom
        self.name = name
        self.counter = counter if counter is not None else PageCounter()
        self.dense = geom.dense
        self.packed = geom.packed_layout()
        spec = CacheSpec.create(
            cache_size=geom.cache_size,
            attention_window_size=geom.attention_window,
            sink_tokens=geom.sink_tokens,
            global_sink_tokens=geom.global_sink_tokens,
        )
        self.seq: Sequencer[CountedSegment] = Sequencer(spec)
        self.pages = {SegmentKind.DENSE: 0, SegmentKind.PACKED: 0}
        self.segments = {SegmentKind.DENSE: 0, SegmentKind.PACKED: 0}
        self._order: dict[int, RangeEntry[CountedSegment]] = {}  # every segment by start, oldest first
        self._movable: dict[int, RangeEntry[CountedSegment]] = {}  # not in the tiers' coarsest format, oldest first
        # format -> layout of every format the tiers use (pagedqvg/planning/tiers.py; untiered: bf16 and the history's)
        self.tiers = tier_layouts(geom) if self.packed is not None else None
        self._coarsest = min(format_rank(geom.quant.tier_format(t)) for t in TIERS)

    # ---------------------------------------------------------------- state
    @property
    def held_pages(self) -> int:
        """Pages the layer holds."""
        return self.pages[SegmentKind.DENSE] + self.pages[SegmentKind.PACKED]

    def used_bytes(self) -> int:
        """Bytes the retained tokens' rows really occupy (plus codebooks of packed segments), as the cache reports."""
        if self.packed is None:
            return self.dense.used_bytes_for_tokens(self.seq.state.local_end)
        assert self.tiers is not None
        return sum(
            self.tiers[entry.value.fmt or "bf16"].used_bytes_for_tokens(kept)
            for entry, kept in self.seq.retained_tokens()
        )

    # ---------------------------------------------------------------- calls
    def write(self, start: int, n: int) -> int:
        """`update_and_get_attention_kv` of `n` tokens at global `start` (no head slice, the full view): the
        sequencing errors of the cache. Returns the view's token count."""
        seq = self.seq
        plan = seq.plan_write(start, n, self.name)
        for entry in seq.release(plan):
            del self._order[entry.start]
            self._movable.pop(entry.start, None)
            self._release(entry.value)
        segment = None
        if plan.new_tokens:
            segment = CountedSegment(SegmentKind.DENSE, self.dense.pages_for_tokens(plan.new_tokens))
            self._take(segment)
        entry = seq.commit(plan, segment)
        if entry is not None:
            self._order[entry.start] = self._movable[entry.start] = entry
            if self.packed is not None:
                self._apply_pack_policy(start, start + n)
        return sum(b - a for a, b in seq.view_ranges(plan.local_start, None))

    def _apply_pack_policy(self, keep_start: int, keep_end: int) -> None:
        """After an advance: pack (or repack) what `policy.tier_targets` selects into its tier's format, as the
        cache does (only segments not yet in the tiers' coarsest format are candidates, and the newest are read only
        up to `keep_recent_chunks`: O(candidates + keep_recent + sink segments))."""
        sinks = sink_segment_starts(self.seq)
        newest = reversed(self._order.values())
        keep = (keep_start, keep_end)
        for entry, tier in tier_targets(self.geom.quant, sinks, newest, list(self._movable.values()), keep):
            self._pack_tier(entry, self.geom.quant.tier_format(tier))

    def advance(self) -> int:
        """Append one chunk at the global end (the first denoise step). Returns the view's token count."""
        return self.write(self.seq.state.global_end, self.geom.chunk_tokens)

    def rewrite(self) -> int:
        """Rewrite the current chunk in place (a later denoise step or the clean pass). Returns view tokens."""
        n, G = self.geom.chunk_tokens, self.seq.state.global_end
        if n > G:
            raise ValueError(f"{self.name}: rewrite before the first advance (global end {G}, chunk of {n} tokens)")
        return self.write(G - n, n)

    def pin(self) -> None:
        """`pin_current_chunk(n)` with `n` the chunk size."""
        self.seq.pin(self.geom.chunk_tokens)

    # ---------------------------------------------------------------- the counting store
    def _take(self, seg: CountedSegment) -> None:
        self.counter.alloc(seg.pages)
        self.pages[seg.kind] += seg.pages
        self.segments[seg.kind] += 1

    def _release(self, seg: CountedSegment) -> None:
        self.counter.free(seg.pages)
        self.pages[seg.kind] -= seg.pages
        self.segments[seg.kind] -= 1

    def _pack_tier(self, entry: RangeEntry[CountedSegment], fmt: str) -> None:
        """Formats by age: frees the segment's pages (bf16 or an earlier tier's), then takes `fmt`'s pages."""
        assert self.tiers is not None
        if format_rank(fmt) <= self._coarsest:  # it can move no further
            del self._movable[entry.start]
        self._release(entry.value)
        pages = self.tiers[fmt].pages_for_tokens(entry.end - entry.start)
        entry.value = CountedSegment(SegmentKind.PACKED, pages, fmt=fmt)
        self._take(entry.value)


# ---------------------------------------------------------------------------------------------------- call pattern
@dataclass(frozen=True, slots=True)
class Call:
    """One cache call of the simulated pattern."""

    chunk: int
    step: int  # 0 = advance, 1..denoise_steps-1 = denoise rewrites, denoise_steps = clean pass, +1 = pin
    cache: int  # set * layers + layer
    op: str  # "advance", "denoise", "clean" or "pin"


def is_scene_cut(chunk: int, every: int) -> bool:
    """Whether 0-based chunk `chunk` is pinned after its clean pass: every > 0, chunk > 0, chunk % every == 0."""
    return every > 0 and chunk > 0 and chunk % every == 0


def call_pattern(geom: Geometry, chunks: int) -> Iterator[Call]:
    """The callers' order: per chunk, per denoise step (then the clean pass, then pins), every cache in turn."""
    steps = geom.denoise_steps
    for k in range(chunks):
        for step in range(steps + 1):
            op = "advance" if step == 0 else ("clean" if step == steps else "denoise")
            for c in range(geom.caches):
                yield Call(k, step, c, op)
        if is_scene_cut(k, geom.scene_cut_every):
            for c in range(geom.caches):
                yield Call(k, steps + 1, c, "pin")


# ---------------------------------------------------------------------------------------------------- census
@dataclass(frozen=True, slots=True)
class LayerCensus:
    """One layer's pages over a replay: per chunk `after[m]` (pages after chunk m) and `peak[m]` (max during m)."""

    after: tuple[int, ...]
    peak: tuple[int, ...]
    steady_index: int  # chunk index where `after` first reaches its maximum
    bf16_segments: int  # at that chunk
    packed_segments: int
    bf16_pages: int
    packed_pages: int
    used_bytes: int
    view_tokens: int  # largest view over the replay

    @property
    def steady_pages(self) -> int:
        return self.after[self.steady_index]

    def pool_high_water(self, caches: int) -> int:
        """Pool high-water pages when `caches` identical layers run this pattern one after another."""
        best, prev = 0, 0
        for a, p in zip(self.after, self.peak, strict=True):
            best = max(best, (caches - 1) * max(prev, a) + p)
            prev = a
        return best


def replay_chunks(geom: Geometry) -> int:
    """Chunks a single-layer replay runs to cover the warm-up and one full pin period after it."""
    n = geom.chunk_tokens
    fill = -(-geom.cache_size // n)
    every = geom.scene_cut_every
    q = geom.quant
    extra = (q.keep_recent_chunks + q.sink_keep_chunks) if q.enabled else 0
    return 2 * fill + 4 + extra + (3 * every if every else 0)


def replay_layer(geom: Geometry, chunks: int | None = None) -> LayerCensus:
    """Run one layer's accounting for `chunks` chunks (default `replay_chunks`) and take its census. O(N log N)."""
    chunks = replay_chunks(geom) if chunks is None else chunks
    counter = PageCounter()
    layer = CountingLayer(geom, counter)
    after: list[int] = []
    peak: list[int] = []
    best: tuple[int, int, int, int] = (0, 0, 0, 0)
    top, idx = -1, 0
    view = 0
    for k in range(chunks):
        counter.high_water = counter.used
        view = max(view, layer.advance())
        for _ in range(geom.denoise_steps):
            view = max(view, layer.rewrite())
        if is_scene_cut(k, geom.scene_cut_every):
            layer.pin()
        if counter.used > top:
            top, idx = counter.used, k
            segs, pages = layer.segments, layer.pages
            best = (
                segs[SegmentKind.DENSE],
                segs[SegmentKind.PACKED],
                pages[SegmentKind.DENSE],
                pages[SegmentKind.PACKED],
            )
        after.append(counter.used)
        peak.append(counter.high_water)
    # used bytes at the steady chunk: replay again up to it (used_bytes() walks every segment).
    again = CountingLayer(geom)
    for k in range(idx + 1):
        again.advance()
        if is_scene_cut(k, geom.scene_cut_every):
            again.pin()
    return LayerCensus(tuple(after), tuple(peak), idx, *best, again.used_bytes(), view)
