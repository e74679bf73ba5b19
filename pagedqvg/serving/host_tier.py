"""The host tier: an idle session's pages moved to a second arena (a `BlockPool` in host memory) and back.

`swap_out(manager, session)` copies every page of every cache of the session into pages of the host pool (packed
segments stay packed: pages are copied as bytes), then gives the device pages back (a page another session shares,
e.g. a fork's, only loses this session's hold) and points the caches' segments at the host pages; the caches are out
of service meanwhile (every call raises CacheClosedError naming the swap). `swap_in(manager, session)` takes device
pages for all of them (any free ones), copies the bytes back, points the segments at the new pages and frees the host
pages. Both are transactions: every page is taken before the first byte moves, so a full pool on either side raises
(PoolExhaustedError on the host side, SessionRefusedError on the device side) and leaves the session where it was.
Views after the round trip are bit-equal to before (the same bytes, other page ids).

Copies are whole pages through the arenas' int64 words: one `index_select` and one `index_copy_` per cache (on CUDA
a device-to-host copy of the gathered pages; the host arena is ordinary, not pinned, memory: not measured here).
A page shared by two swapped sessions is copied by each. Complexity: O(pages of the session) copies.
"""

from __future__ import annotations

import copy

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError

__all__ = ["SWAPPED", "move_pages", "session_pages", "swap_in_caches", "swap_out_caches"]

#: Why a swapped-out cache refuses calls (its `_closed` reason; see PagedCausalKVCache._ensure_open).
SWAPPED = "refused: its session is swapped out to host memory: SessionManager.swap_in(session) brings it back"


def session_pages(caches: list) -> list[list[int]]:
    """Every page of each cache (its segments' pages, in index order). O(pages)."""
    return [[p for e in c._seq.index for p in e.value.pages] for c in caches]


def move_pages(src: BlockPool, src_pages: list[int], dst: BlockPool, dst_pages: list[int]) -> None:
    """Copy whole pages `src_pages` of `src` into `dst_pages` of `dst` (equal page sizes; any devices). O(pages)."""
    if not src_pages:
        return
    index = torch.tensor(src_pages, dtype=torch.int64, device=src.device)
    data = src._page_words().index_select(0, index).to(dst.device)
    dst._page_words().index_copy_(0, torch.tensor(dst_pages, dtype=torch.int64, device=dst.device), data)


def _take(pool: BlockPool, caches: list, counts: list[int]) -> list[list[int]]:
    """Pages for every cache (owner = the cache's), all or nothing: on a failure the ones taken go back."""
    taken: list[list[int]] = []
    try:
        for cache, n in zip(caches, counts, strict=True):
            taken.append(pool.alloc(n, cache.owner))
    except BaseException:
        for cache, pages in zip(caches, taken, strict=False):
            pool.free(pages, cache.owner)
        raise
    return taken


def _repoint(cache, new_pages: list[int]) -> None:
    """The cache's segments hold `new_pages` (in index order) from now on; its plans are dropped."""
    it = iter(new_pages)
    for entry in cache._seq.index:  # new Segment objects: records of the old ones (shared_packing) go stale
        seg = entry.value = copy.copy(entry.value)
        seg.pages = [next(it) for _ in seg.pages]
        seg.pages_t = None
        seg.row_index = None
    cache._structure_changed()


def swap_out_caches(device: BlockPool, host: BlockPool, caches: list) -> int:
    """Move every page of `caches` to `host` (see the module docstring); returns the pages moved. The caller holds
    both pools' locks. PoolExhaustedError (nothing changed) when the host pool has no room."""
    if host.page_bytes != device.page_bytes:
        raise CacheConfigError(f"host pool pages of {host.page_bytes} B differ from the device's {device.page_bytes} B")
    moved = _move_caches(device, host, caches)
    for cache in caches:
        cache._closed = SWAPPED
    return moved


def swap_in_caches(device: BlockPool, host: BlockPool, caches: list) -> int:
    """Bring every page of swapped-out `caches` back into free device pages; returns the pages moved. The caller
    holds both locks and has admitted them. PoolExhaustedError (nothing changed) when the device has no room."""
    moved = _move_caches(host, device, caches)
    for cache in caches:
        cache._closed = False
        cache._packer.report_used()
    return moved


def _move_caches(src: BlockPool, dst: BlockPool, caches: list) -> int:
    """Every page of `caches` from `src` into new pages of `dst` (all taken before a byte moves: PoolExhaustedError
    leaves everything as it was), the old pages freed and the caches' segments pointed at the new ones; returns the
    pages moved. O(pages)."""
    old = session_pages(caches)
    new = _take(dst, caches, [len(p) for p in old])
    for src_pages, dst_pages in zip(old, new, strict=True):
        move_pages(src, src_pages, dst, dst_pages)
    for cache, src_pages, dst_pages in zip(caches, old, new, strict=True):
        src.free(src_pages, cache.owner)
        _repoint(cache, dst_pages)
    return sum(len(p) for p in old)
