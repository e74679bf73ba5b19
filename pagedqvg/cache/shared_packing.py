"""Packing a shared chunk happens once: the first branch whose policy packs (or ages) a chunk that a fork shares
records its packed segment here; every other holder adopts those same pages when its own policy reaches that chunk.

A record is keyed by the chunk's source pages (the page ids of the segment being packed, still held by the other
branches), its token range and the target format. Adopting is exactly what the adopter would compute itself: the
source pages hold the same bytes (a write into a shared page copies it first, and a write into a page the adopter
holds alone drops the records of that page, `forget_written`), and quantization is deterministic. A record is used
only while the packing branch's segment table still holds that very packed segment (not rewound, unpacked,
repacked, rolled back or closed); otherwise it is dropped. The adopter then drops its holds on the source pages and
holds the packed pages too: no quantization, no new page. Records live per pool, under its lock.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from pagedqvg.allocator import BlockPool, RangeEntry, RangeIndex
from pagedqvg.store.segment import Segment, SegmentKind

__all__ = ["adopt", "forget_written", "remember", "shared_pages_in"]

#: pool -> {(source pages, start, end, format name): the packed segment of the branch that packed it}
_RECORDS: weakref.WeakKeyDictionary[BlockPool, dict[tuple, _Packed]] = weakref.WeakKeyDictionary()


@dataclass(slots=True)
class _Packed:
    index: weakref.ref  # the packing branch's sequencer (its segment table lives at `.index`)
    segment: Segment  # the packed segment it stored


def remember(pool: BlockPool, seq, entry: RangeEntry[Segment], source: tuple[int, ...], fmt: str) -> None:
    """`entry` (of the sequencer `seq`) was just packed in format `fmt` from the shared pages `source`. O(1)."""
    _RECORDS.setdefault(pool, {})[(source, entry.start, entry.end, fmt)] = _Packed(weakref.ref(seq), entry.value)


def adopt(pool: BlockPool, owner: str, entry: RangeEntry[Segment], fmt: str) -> bool:
    """If another branch packed this very chunk in format `fmt` from the pages `entry` holds, make `entry` that
    packed segment (its pages now held by `owner` too; the source pages' holds dropped) and return True; else False
    and nothing changes. The caller holds the pool's lock. O(pages of the chunk)."""
    table = _RECORDS.get(pool)
    if not table:
        return False
    key = (tuple(entry.value.pages), entry.start, entry.end, fmt)
    record = table.get(key)
    if record is None:
        return False
    seq = record.index()
    found = seq.index.find(entry.start) if seq is not None else None
    seg = record.segment
    if found is None or (found.start, found.end) != (entry.start, entry.end) or found.value is not seg:
        del table[key]  # the packing branch changed that chunk since: the record is stale
        return False
    if owner in pool.holders(seg.pages[0]):
        return False  # it is this branch's own packed segment (cannot happen for a dense source)
    pool.free(entry.value.pages, owner)
    pool.share(seg.pages, owner)
    entry.value = Segment(list(seg.pages), None, SegmentKind.PACKED, seg.n_token_pages, fmt=seg.fmt)
    return True


def forget_written(pool: BlockPool, index: RangeIndex[Segment], lo: int, hi: int) -> None:
    """A write of global tokens `[lo, hi)` changes the segments of `index` it overlaps: drop the records whose
    source pages are those segments' (their bytes are no longer what was packed). O(1) without records."""
    table = _RECORDS.get(pool)
    if not table:
        return
    with pool.lock:
        for entry in index.overlapping(lo, hi):
            pages = tuple(entry.value.pages)
            for key in [k for k in table if k[0] == pages]:
                del table[key]


def shared_pages_in(pool: BlockPool, index: RangeIndex[Segment], tpp: int, lo: int, hi: int, skip=()) -> list:
    """`(segment, positions in its pages)` of every dense segment of `index` overlapping global tokens `[lo, hi)`
    (except entries in `skip`) whose pages holding those tokens (`tpp` tokens per page) another holder shares: what
    a write there copies first (cache/fork.py). Packed segments are never written in place. O(segments x pages)."""
    out: list[tuple[Segment, list[int]]] = []
    for entry in index.overlapping(lo, hi):
        seg = entry.value
        if seg.packed or any(entry is x for x in skip):
            continue
        first = (max(lo, entry.start) - entry.start) // tpp
        last = (min(hi, entry.end) - 1 - entry.start) // tpp
        slots = [i for i in range(first, last + 1) if len(pool.holders(seg.pages[i])) > 1]
        if slots:
            out.append((seg, slots))
    return out
