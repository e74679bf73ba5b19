"""A sorted map from disjoint global token ranges `[start, end)` to records (one per segment).

Backed by `sortedcontainers.SortedDict` keyed by `start`. With n entries and k results:
insert O(log n), find O(log n), overlapping O(log n + k), remove O(log n), truncate O(k log n).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from sortedcontainers import SortedDict

T = TypeVar("T")


@dataclass(slots=True)
class RangeEntry(Generic[T]):
    """One indexed range of global tokens `[start, end)` and its record."""

    start: int
    end: int
    value: T


class RangeIndex(Generic[T]):
    """Disjoint half-open ranges in sorted order. Empty ranges are rejected."""

    def __init__(self) -> None:
        self._by_start: SortedDict = SortedDict()

    def __len__(self) -> int:
        return len(self._by_start)

    def __iter__(self) -> Iterator[RangeEntry[T]]:
        return iter(self._by_start.values())

    def __bool__(self) -> bool:
        return bool(self._by_start)

    def first(self) -> RangeEntry[T] | None:
        return self._by_start.peekitem(0)[1] if self._by_start else None

    def last(self) -> RangeEntry[T] | None:
        return self._by_start.peekitem(-1)[1] if self._by_start else None

    def _containing_or_before(self, pos: int) -> RangeEntry[T] | None:
        i = self._by_start.bisect_right(pos) - 1
        return self._by_start.peekitem(i)[1] if i >= 0 else None

    def find(self, pos: int) -> RangeEntry[T] | None:
        """The entry containing token `pos`, or None. O(log n)."""
        entry = self._containing_or_before(pos)
        return entry if entry is not None and entry.end > pos else None

    def insert(self, start: int, end: int, value: T) -> RangeEntry[T]:
        """Add `[start, end)`; ValueError if empty or overlapping an existing range. O(log n)."""
        if end <= start:
            raise ValueError(f"range [{start}, {end}) is empty")
        before = self._containing_or_before(start)
        if before is not None and before.end > start:
            raise ValueError(f"range [{start}, {end}) overlaps [{before.start}, {before.end})")
        i = self._by_start.bisect_left(start)
        if i < len(self._by_start):
            after = self._by_start.peekitem(i)[1]
            if after.start < end:
                raise ValueError(f"range [{start}, {end}) overlaps [{after.start}, {after.end})")
        entry = RangeEntry(start, end, value)
        self._by_start[start] = entry
        return entry

    def overlapping(self, a: int, b: int) -> list[RangeEntry[T]]:
        """Entries that intersect `[a, b)`, in order. O(log n + k)."""
        if b <= a:
            return []
        out: list[RangeEntry[T]] = []
        first = self._containing_or_before(a)
        if first is not None and first.start < a < first.end:
            out.append(first)
        by_start = self._by_start
        out.extend(by_start[key] for key in by_start.irange(a, b, inclusive=(True, False)))
        return out

    def remove(self, entry: RangeEntry[T]) -> None:
        """Drop `entry` (which must be in the index). O(log n)."""
        current = self._by_start.get(entry.start)
        if current is not entry:
            raise KeyError(f"range [{entry.start}, {entry.end}) is not in the index")
        del self._by_start[entry.start]

    def truncate(self, pos: int) -> tuple[list[RangeEntry[T]], RangeEntry[T] | None]:
        """Drop everything at or after `pos`: entries starting at/after it are removed (returned first), and
        an entry straddling `pos` is shortened to end at `pos` (returned second). O(k log n)."""
        removed: list[RangeEntry[T]] = []
        while self._by_start:
            entry = self._by_start.peekitem(-1)[1]
            if entry.start < pos:
                break
            self._by_start.popitem(-1)
            removed.append(entry)
        removed.reverse()
        straddler = self._containing_or_before(pos - 1) if pos > 0 else None
        if straddler is not None and straddler.end > pos:
            straddler.end = pos
            return removed, straddler
        return removed, None

    def clear(self) -> list[RangeEntry[T]]:
        """Remove and return every entry, in order. O(n)."""
        out = list(self._by_start.values())
        self._by_start.clear()
        return out
