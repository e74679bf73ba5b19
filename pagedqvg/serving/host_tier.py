"""The host tier: idle sessions' pages moved to a second arena (a `BlockPool` in host memory) and back.

`swap_out_caches(device, host, caches)` copies every page of every cache of one or more sessions into pages of the
host pool (packed segments stay packed: pages are copied as bytes), then gives the device pages back and points the
caches' segments at the host pages; the caches are parked meanwhile (`_closed` is the `SWAPPED` reason; a cache of a
SessionManager session comes back at its next call, serving/sessions.py). `swap_in_caches` is the way back into any
free device pages. Views after the round trip are bit-equal to before (the same bytes, other page ids).

Shared pages move once: a page held by several of the moved caches (a parent and its forks moved together) is
copied once into one page of the destination held by the same caches (`BlockPool.share`), so forks still share
after a round trip and both pools' `check()` hold. A page one of the moved caches shares with a cache that stays
(e.g. a fork left on the device) is copied: the moved cache's copy is its own, the staying cache keeps the page.

Transactions: every destination page is taken (and shared) before the first byte moves, so a full pool raises
PoolExhaustedError, and a failing copy re-raises, with every page taken given back: the session stays where it
was. Only after the copy are the source pages freed (a shared page only loses the moved caches' holds).
`trade_caches` swaps sessions out and others in as one step when neither side fits alone (a full host tier and a
full device): both sides are copied into transient host memory first (a failure there changes nothing), then the
pages change hands and the copies are written back (synchronous, on the current stream, also on CUDA).

Copies are whole pages through the arenas' int64 words, one `copy_` per run of pages consecutive on both sides
(`page_runs`; on this CPU ~10x faster than an `index_select` + `index_copy_` of the same pages). CPU to CPU (tests,
this machine): plain copies. CUDA (`_move_cuda`; not yet run on a GPU): the host arena is pinned (`host_pool_for`
makes it so for a CUDA pool), the copies run on a side stream (`torch.cuda.Stream`, one per device), each
`copy_(non_blocking=True)`, after the side stream waits on the current one (every write queued so far is in the
bytes copied); then the current stream waits on the copy's event, so the device pages freed after a swap-out are
reused, and the pages brought in by a swap-in are read, only after the copy; a swap-in also synchronizes the event
before the host pages are freed. Complexity: O(distinct pages moved) bytes copied, O(pages x holders) metadata.
"""

from __future__ import annotations

import copy
import threading

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError, PoolExhaustedError

__all__ = ["SWAPPED", "freed_by", "gather_pages", "host_pool_for", "move_pages", "page_runs", "scatter_pages",
           "session_pages", "swap_in_caches", "swap_out_caches", "trade_caches", "unique_pages"]  # fmt: skip

#: Why a swapped-out cache refuses calls (its `_closed` reason; see PagedCausalKVCache._ensure_open).
SWAPPED = "refused: its session is swapped out to host memory: SessionManager.swap_in(session) brings it back"


def host_pool_for(pool: BlockPool, capacity_bytes: int) -> BlockPool:
    """A host `BlockPool` of `capacity_bytes` bytes with `pool`'s page size for `pool`'s host tier: on "cpu", pinned
    (page-locked) when `pool` is on CUDA so that copies are asynchronous DMA. ValueError for a bad size."""
    return BlockPool(capacity_bytes, pool.page_bytes, device="cpu", pin_memory=pool.device.type == "cuda")


def session_pages(caches: list) -> list[list[int]]:
    """Every page of each cache (its segments' pages, in index order). O(pages)."""
    return [[p for e in c._seq.index for p in e.value.pages] for c in caches]


def unique_pages(caches: list) -> int:
    """Distinct pages of `caches` (a page shared by several counts once): the pages a move of them copies."""
    return len({p for pages in session_pages(caches) for p in pages})


def page_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """The page pairs as runs `(src start, dst start, length)` consecutive on both sides (sorted by source page):
    one copy each on CUDA. O(pages log pages)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in sorted(zip(src_pages, dst_pages, strict=True)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def move_pages(src: BlockPool, src_pages: list[int], dst: BlockPool, dst_pages: list[int]) -> None:
    """Copy whole pages `src_pages` of `src` into `dst_pages` of `dst` (equal page sizes; CPU or CUDA, see the
    module docstring). O(pages)."""
    if not src_pages:
        return
    if src.device.type == "cuda" or dst.device.type == "cuda":
        _move_cuda(src, src_pages, dst, dst_pages)
        return
    src_words, dst_words = src._page_words(), dst._page_words()
    for s, d, n in page_runs(src_pages, dst_pages):
        dst_words[d : d + n].copy_(src_words[s : s + n])


_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The host tier's copy stream of a CUDA device (one per device, made on first use)."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


def _move_cuda(src: BlockPool, src_pages: list[int], dst: BlockPool, dst_pages: list[int]) -> None:
    """`move_pages` with a CUDA side: runs of pages copied on the side stream, ordered by an event (module
    docstring). A host side that is not pinned still works (the copies are then synchronous)."""
    gpu = src if src.device.type == "cuda" else dst
    current = torch.cuda.current_stream(gpu.device)
    side = _side_stream(gpu.device)
    side.wait_stream(current)  # every write queued so far on the current stream is in the bytes copied
    src_words, dst_words = src._page_words(), dst._page_words()
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        for s, d, n in page_runs(src_pages, dst_pages):
            dst_words[d : d + n].copy_(src_words[s : s + n], non_blocking=True)
        done.record(side)
    current.wait_event(done)  # freed device pages are reused, new device pages read, only after the copy
    if dst is gpu:
        done.synchronize()  # the host pages of a swap-in are freed (and may be rewritten) only after the copy


def _take(dst: BlockPool, caches: list, old: list[list[int]]) -> tuple[list[list[int]], dict[int, int]]:
    """Pages of `dst` for every cache, all or nothing: a source page seen first is a new page of its cache's owner,
    a source page seen again (held by several of `caches`) the same new page, shared (`BlockPool.share`). Returns
    each cache's new pages (in the order of `old`) and the map source page -> new page. On a failure every page taken
    goes back and the exception propagates."""
    mapping: dict[int, int] = {}
    taken: list[tuple[str, list[int]]] = []
    new: list[list[int]] = []
    high_water = dst._high_water
    try:
        for cache, pages in zip(caches, old, strict=True):
            again = [mapping[p] for p in pages if p in mapping]
            fresh = [p for p in pages if p not in mapping]
            got = dst.alloc(len(fresh), cache.owner)
            taken.append((cache.owner, got))
            if again:
                dst.share(again, cache.owner)
                taken.append((cache.owner, again))
            mapping.update(zip(fresh, got, strict=True))
            new.append([mapping[p] for p in pages])
    except BaseException:
        _give_back(dst, taken, high_water)
        raise
    return new, mapping


def _give_back(pool: BlockPool, taken: list[tuple[str, list[int]]], high_water: int) -> None:
    """Undo `_take`: holds and pages freed, newest first (the free list as it was), the high-water mark restored."""
    for owner, pages in reversed(taken):
        pool.free(pages, owner)
    pool._high_water = high_water


def _move_caches(src: BlockPool, dst: BlockPool, caches: list) -> int:
    """Every page of `caches` from `src` into pages of `dst` (the module docstring's transaction), the old pages
    freed and the caches' segments pointed at the new ones; returns the distinct pages copied. O(pages)."""
    old = session_pages(caches)
    high_water = dst._high_water
    new, mapping = _take(dst, caches, old)
    try:
        move_pages(src, list(mapping), dst, list(mapping.values()))
    except BaseException:
        _give_back(dst, [(c.owner, pages) for c, pages in zip(caches, new, strict=True)], high_water)
        raise
    for cache, src_pages, dst_pages in zip(caches, old, new, strict=True):
        src.free(src_pages, cache.owner)
        _repoint(cache, dst_pages)
    return len(mapping)


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
    """Move every page of `caches` to `host` (see the module docstring); returns the distinct pages copied. The
    caller holds both pools' locks. PoolExhaustedError (nothing changed) when the host pool has no room; an error of
    the copy propagates (nothing changed)."""
    if host.page_bytes != device.page_bytes:
        raise CacheConfigError(f"host pool pages of {host.page_bytes} B differ from the device's {device.page_bytes} B")
    moved = _move_caches(device, host, caches)
    for cache in caches:
        cache._closed = SWAPPED
    return moved


def swap_in_caches(device: BlockPool, host: BlockPool, caches: list) -> int:
    """Bring every page of swapped-out `caches` back into free device pages; returns the distinct pages copied. The
    caller holds both locks and has admitted them. PoolExhaustedError (nothing changed) when the device has no room;
    an error of the copy propagates (nothing changed)."""
    moved = _move_caches(host, device, caches)
    for cache in caches:
        cache._closed = False
        cache._packer.report_used()
    return moved


def gather_pages(pool: BlockPool, pages: list[int]) -> torch.Tensor:
    """A copy of whole `pages` of `pool` as int64 words, in host memory (transient, outside every pool; one `copy_`
    per run; a host pool's pending side-stream copies are waited for first). O(pages)."""
    if pool.device.type == "cpu":  # a swap-out's device-to-host copies may still be in flight on a side stream
        with _streams_lock:
            pending = list(_streams.values())
        for stream in pending:
            stream.synchronize()
    words = pool._page_words()
    out = torch.empty((len(pages), words.shape[1]), dtype=torch.int64)
    for s, d, n in page_runs(pages, list(range(len(pages)))):
        out[d : d + n].copy_(words[s : s + n])
    return out


def scatter_pages(pool: BlockPool, pages: list[int], data: torch.Tensor) -> None:
    """Write `gather_pages` words `data` into `pages` of `pool` (one `copy_` per run). O(pages)."""
    words = pool._page_words()
    for s, d, n in page_runs(list(range(len(pages))), pages):
        words[d : d + n].copy_(data[s : s + n])


def freed_by(pool: BlockPool, caches: list) -> int:
    """Pages of `caches` that go back to `pool`'s free list when all of them let go (held by no other owner)."""
    owners = {c.owner for c in caches}
    pages = {p for ps in session_pages(caches) for p in ps}
    return sum(1 for p in pages if owners.issuperset(pool.holders(p)))


def trade_caches(device: BlockPool, host: BlockPool, out_caches: list, in_caches: list) -> tuple[int, int]:
    """Swap resident `out_caches` out and parked `in_caches` in as one trade, for when neither fits alone (the device
    has room for `in_caches` only once `out_caches` left, the host for `out_caches` only once `in_caches` left): both
    sides' bytes are first copied into transient host memory (`gather_pages`; an error there changes nothing), then
    the pages change hands (frees, then takes, shared pages once as in `_move_caches`) and the copies are written into
    the new pages. The caller holds both locks and checked the room (`freed_by`); returns the distinct pages moved
    out and in. Transient memory: the bytes of both sides. O(pages)."""
    old_out, old_in = session_pages(out_caches), session_pages(in_caches)
    unique_out = list(dict.fromkeys(p for ps in old_out for p in ps))
    unique_in = list(dict.fromkeys(p for ps in old_in for p in ps))
    if len(unique_in) > device.num_free_pages + freed_by(device, out_caches) or len(unique_out) > (
        host.num_free_pages + freed_by(host, in_caches)
    ):
        raise PoolExhaustedError(f"trade of {len(unique_out)} pages out for {len(unique_in)} in does not fit")
    staged_out = gather_pages(device, unique_out) if unique_out else None
    staged_in = gather_pages(host, unique_in) if unique_in else None
    for cache, pages in zip(out_caches, old_out, strict=True):  # from here on nothing raises
        device.free(pages, cache.owner)
    for cache, pages in zip(in_caches, old_in, strict=True):
        host.free(pages, cache.owner)
    new_in, map_in = _take(device, in_caches, old_in)
    new_out, map_out = _take(host, out_caches, old_out)
    if staged_in is not None:
        scatter_pages(device, [map_in[p] for p in unique_in], staged_in)
    if staged_out is not None:
        scatter_pages(host, [map_out[p] for p in unique_out], staged_out)
    for cache, pages in zip(out_caches, new_out, strict=True):
        _repoint(cache, pages)
        cache._closed = SWAPPED
    for cache, pages in zip(in_caches, new_in, strict=True):
        _repoint(cache, pages)
        cache._closed = False
        cache._packer.report_used()
    return len(unique_out), len(unique_in)
