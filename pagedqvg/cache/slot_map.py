"""Which global token each cache slot holds: a short sorted list of runs `(slot_start, slot_end, global_start)`.

The dense cache's slots `[0, L)` map onto global tokens monotonically: the sink run(s), an optional pinned run,
and the rolling tail. The map is immutable; every operation returns a new one, so the cache can plan a call
completely before it changes anything. Runs are kept maximal (adjacent runs that continue each other in both
slot and global position are merged), so there are a handful of them and each operation is O(runs).
"""

from __future__ import annotations

from dataclasses import dataclass

Run = tuple[int, int, int]  # (slot_start, slot_end, global_start)


def _merged(runs: list[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for s0, s1, g0 in runs:
        if s1 <= s0:
            continue
        if out:
            p0, p1, pg = out[-1]
            if p1 == s0 and pg + (p1 - p0) == g0:
                out[-1] = (p0, s1, pg)
                continue
        out.append((s0, s1, g0))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SlotMap:
    """Slots `[0, end)` → global tokens, as maximal runs."""

    runs: tuple[Run, ...] = ()

    @property
    def end(self) -> int:
        """Number of mapped slots (the cache's local end `L`)."""
        return self.runs[-1][1] if self.runs else 0

    def tail_start(self, global_end: int) -> int:
        """First slot of the rolling tail: slots from here to `end` hold consecutive tokens ending at `global_end`.

        `end` when no run ends at `global_end` (e.g. a rewind dropped the whole tail and only sink slots remain).
        """
        if self.runs:
            s0, s1, g0 = self.runs[-1]
            if g0 + s1 - s0 == global_end:
                return s0
        return self.end

    def appended(self, slot_start: int, count: int, global_start: int) -> SlotMap:
        """Map `count` more slots from `slot_start` (must equal `end`) to tokens from `global_start`."""
        return SlotMap(_merged([*self.runs, (slot_start, slot_start + count, global_start)]))

    def rolled(self, sink: int, evict: int) -> tuple[SlotMap, list[tuple[int, int]]]:
        """The dense roll: slots `[sink, sink + evict)` are dropped and `[sink + evict, end)` move down by `evict`.

        Returns the new map and the global ranges that were dropped.
        """
        kept: list[Run] = []
        dropped: list[tuple[int, int]] = []
        cut = sink + evict
        for s0, s1, g0 in self.runs:
            if s0 < sink:
                kept.append((s0, min(s1, sink), g0))
            lo, hi = max(s0, sink), min(s1, cut)
            if lo < hi:
                dropped.append((g0 + lo - s0, g0 + hi - s0))
            lo = max(s0, cut)
            if lo < s1:
                kept.append((lo - evict, s1 - evict, g0 + lo - s0))
        return SlotMap(_merged(kept)), dropped

    def truncated(self, end: int) -> SlotMap:
        """Only slots `[0, end)`."""
        return SlotMap(_merged([(s0, min(s1, end), g0) for s0, s1, g0 in self.runs if s0 < end]))

    def to_global(self, a: int, b: int) -> list[tuple[int, int]]:
        """Global token ranges held by slots `[a, b)`, in slot order (`[a, b)` must lie within `[0, end)`)."""
        out: list[tuple[int, int]] = []
        for s0, s1, g0 in self.runs:
            lo, hi = max(a, s0), min(b, s1)
            if lo < hi:
                out.append((g0 + lo - s0, g0 + hi - s0))
        return out

    def holds_any(self, g0: int, g1: int) -> bool:
        """Whether some slot holds a token of the global range `[g0, g1)`. O(runs)."""
        return any(r0 < g1 and g0 < r0 + s1 - s0 for s0, s1, r0 in self.runs)

    def global_ranges(self) -> list[tuple[int, int]]:
        """Every global range the map holds, in slot order."""
        return [(g0, g0 + s1 - s0) for s0, s1, g0 in self.runs]
