"""Copy-on-write forks of a layer cache: a branch shares every page of its parent and copies a page when it writes.

`fork_cache(cache)` makes a new cache (same class, same configuration) whose segments, dense and packed (bf16
chunks, packed and aged tiers, the pinned sink), are its parent's pages, held by both (`BlockPool.share`): the cost
is O(segments + pages) metadata and 0 bytes copied, at any point (mid-chunk, after rewrites, with a pin, after
packing). Each branch has its own segment table, slot map, cursors and plans; the pages are the only shared thing.

Copy-on-write, at page granularity: the only writes into existing pages are rewrites of dense rows (a denoise step,
a head-sliced write, the rewrite part of an advance); before one, `unshare_rows` copies each page of the written
tokens that another branch still holds into a fresh page (one page copy each, all pages taken at once) and drops
this branch's hold on the old one. Every other change of a shared segment makes new pages anyway (an advance writes
its new tokens into a new segment; packing, aging and unpacking write the new form into new pages) or only lets go
(a rewind trims pages, a reset or close frees them), and a page goes back to the free list when its last holder
frees it. A copy that meets a full pool raises PoolExhaustedError before anything changed (inside a call that
already changed something, the call's transaction rolls back), so both branches and the pool stay as they were.

Packing a shared chunk happens once (cache/shared_packing.py): the first branch whose policy packs or ages it
computes the packed segment; the others adopt those same pages when their own policy reaches the chunk, so the
history stays shared and each branch's views equal its unforked twin's.
"""

from __future__ import annotations

import copy
import weakref

import torch

import pagedqvg.cache.shared_packing as shared_packing
from pagedqvg.allocator import BlockPool, sharing
from pagedqvg.allocator.pool import exhausted_error, set_used_bytes, used_bytes_of
from pagedqvg.cache.packing import ChunkPacker
from pagedqvg.cache.readout import CacheReadout
from pagedqvg.cache.sequencing import Sequencer
from pagedqvg.cache.shared_packing import shared_pages_in
from pagedqvg.cache.transaction import CallTransaction
from pagedqvg.errors import CacheConfigError
from pagedqvg.store.page_io import PageIO
from pagedqvg.store.segment import Segment

__all__ = ["fork_cache", "unshare_rows"]


def fork_cache(parent, name: str | None = None):
    """`PagedCausalKVCache.fork(name=None)`: a new cache (same class and settings) sharing every page of this one,
    dense and packed (bf16 chunks, packed and aged tiers, the pinned sink): O(segments + pages) metadata, 0 bytes
    copied, at any point. Each branch then behaves as if it alone had received the calls so far; a write into a page
    the other branch still holds copies that page first (page granularity; a full pool raises PoolExhaustedError
    and leaves both branches and the pool as they were). Both branches' cached plans are dropped. `name`: the
    branch's label (default: this one's + "/fork"). Closing branches in any order frees exactly the pages nobody
    else holds. CacheClosedError after `close()`; CacheConfigError for a bad name."""
    if name is not None and (not isinstance(name, str) or not name):
        raise CacheConfigError(f"{parent.debug_name}: fork name must be a non-empty str or None, got {name!r}")
    pool: BlockPool = parent.pool
    with pool.lock:
        parent._ensure_open("fork")
        child = copy.copy(parent)  # every setting; the per-branch state is replaced below
        child.debug_name = name if name is not None else f"{parent.debug_name}/fork"
        child.owner = pool.new_owner(child.debug_name)
        child._seq = _copy_sequencer(parent._seq)
        pages = [p for entry in child._seq.index for p in entry.value.pages]
        if pool.pages_of(parent.owner) == len(pages):  # the parent's segments list exactly the pages it holds
            sharing.add_holds(pool, pages, child.owner)  # (a new owner: no page is its yet) O(pages), no re-check
        else:  # a broken invariant: the checked path names the page
            pool.share(pages, child.owner)  # validated whole before any hold changes
        child._io = PageIO(pool, parent.layout, parent._packed, parent._io.stores)
        child._io.run_cap = parent._io.run_cap
        old = parent._packer
        child._packer = ChunkPacker(
            pool=pool, owner=child.owner, layout=parent.layout, io=child._io, seq=child._seq, store=old.store,
            quant=old.quant, pack_under_pressure=old.pack_under_pressure, stores=old.stores,
        )  # fmt: skip
        child._packer.skipped, child._packer.deferred_for_room = old.skipped, old.deferred_for_room
        child._g_tensor, child._l_tensor = parent._g_tensor.clone(), parent._l_tensor.clone()
        child._readout = CacheReadout(pool=pool, owner=child.owner, seq=child._seq, packer=child._packer,
                                      io=child._io, num_heads=parent._num_heads,
                                      cursors=(child._g_tensor, child._l_tensor))  # fmt: skip
        child._readout.last_view_ranges = list(parent._readout.last_view_ranges)
        child._txn = CallTransaction(pool=pool, owner=child.owner, seq=child._seq)
        child._finalizer = weakref.finalize(child, _release_later, pool, child.owner)
        # the same retained rows as the parent's: its used bytes, O(1) (report_used would recount O(segments x runs))
        set_used_bytes(pool, child.owner, used_bytes_of(pool, parent.owner))
        parent._structure_changed()
        child._structure_changed()
    return child


def _copy_sequencer(seq: Sequencer[Segment]) -> Sequencer[Segment]:
    """A sequencer with `seq`'s spec and state and its own segment objects (same page ids, own page lists; the
    derived row indices are read-only and stay shared until a branch's pages change)."""
    out: Sequencer[Segment] = Sequencer(seq.spec)
    out.state = copy.deepcopy(seq.state)
    for entry in seq.index:
        seg = entry.value
        clone = copy.copy(seg)
        clone.pages = list(seg.pages)
        out.index.insert(entry.start, entry.end, clone)
    return out


def _release_later(pool: BlockPool, owner: str) -> None:
    """Finalizer of a branch collected without close(): its holds go back at the pool's next operation."""
    pool.release_owner_later(owner)


def unshare_rows(cache, lo: int, hi: int) -> bool:
    """Before a write of global tokens `[lo, hi)` into `cache`'s dense segments: copy every page of those tokens
    that another holder shares into a new page of this cache (page granularity: whole pages, one copy each), so the
    write changes no other branch. Returns whether any page changed (the cache's plans are then dropped). O(1) for a
    cache holding no shared page, else O(segments written + pages copied). PoolExhaustedError (nothing changed) when
    the pool has no room for the copies."""
    pool: BlockPool = cache.pool
    shared_packing.forget_written(pool, cache._seq.index, lo, hi)  # "packing happens once" records of these rows
    if not pool.shared_pages_of(cache.owner):
        return False
    with pool.lock:
        todo = shared_pages_in(pool, cache._seq.index, cache.layout.tokens_per_page, lo, hi)
        if not todo:
            return False
        count = sum(len(slots) for _, slots in todo)
        if count > pool.num_free_pages:
            raise exhausted_error(
                pool, count, f"{cache.debug_name}: copy-on-write of {count} page(s) of tokens [{lo}, {hi}) that a "
                f"fork shares",
            )  # fmt: skip
        new = pool.alloc(count, cache.owner)
        old: list[int] = []
        for seg, slots in todo:
            for i in slots:
                old.append(seg.pages[i])
                seg.pages[i] = new[len(old) - 1]
            seg.pages_t = None
            seg.row_index = None
        words = pool._page_words()  # int64 words: the fast whole-page copy (as the journal's)
        src = torch.tensor(old, dtype=torch.int64, device=pool.device)
        dst = torch.tensor(new, dtype=torch.int64, device=pool.device)
        words.index_copy_(0, dst, words.index_select(0, src))
        pool.free(old, cache.owner)  # only holds drop: the others keep those pages
        cache._structure_changed()
    return True
