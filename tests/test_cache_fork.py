"""Copy-on-write forks of PagedCausalKVCache and SessionManager.fork on tiny pools: exact page ids and counts, 0 bytes
copied at the fork, page-granular copies on write, both branches equal to the dense reference (quant off) or to an
unforked twin (quant on), plans dropped on fork, a copy meeting a full pool leaving everything as it was, closes
in any order."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from dense_reference import DenseReferenceCache
from helpers import cache_state, cached_plans, page_io, same, sequencer

from pagedqvg import BlockPool, PagedCausalKVCache, PoolExhaustedError
from pagedqvg.allocator.pool import used_bytes_of
from pagedqvg.errors import CacheClosedError, CacheConfigError, SessionRefusedError
from pagedqvg.quant import QuantConfig
from pagedqvg.serving.sessions import SessionManager, SessionSpec

B, H, D = 1, 2, 4
ROW = 2 * B * H * D * 4  # float32 bytes of one token (K and V)
PAGE = 256  # 4 tokens per page


def kv(n, seed, heads=H):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, n, heads, D, generator=g), torch.randn(B, n, heads, D, generator=g)


def make(pool, **kw):
    args = dict(batch_size=B, cache_size=16, num_heads=H, head_dim=D, dtype=torch.float32, device="cpu")
    args.update(kw)
    return PagedCausalKVCache(pool=pool, **args)


def ref_of(**kw):
    args = dict(batch_size=B, cache_size=16, num_heads=H, head_dim=D, dtype=torch.float32)
    args.update(kw)
    return DenseReferenceCache(**args)


def write(cache, ref, s, n, seed, h0=None, heads=H):
    k, v = kv(n, seed, heads)
    got = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s, cache_head_start=h0)
    want = ref.update_and_get_attention_kv(k, v, s, cache_head_start=h0)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert (got.local_start_index, got.local_end_index) == (want.local_start_index, want.local_end_index)
    return got


def pages(cache):
    return [p for e in sequencer(cache).index for p in e.value.pages]


def test_fork_at_a_chunk_boundary_copies_nothing_and_advances_copy_nothing():
    pool = BlockPool(capacity_bytes=16 * PAGE, page_bytes=PAGE)
    a, ra = make(pool), ref_of()
    write(a, ra, 0, 8, 1)  # pages 0, 1
    assert pages(a) == [0, 1]
    arena = pool.arena.clone()
    b = a.fork(name="b")
    rb = copy.deepcopy(ra)
    assert torch.equal(pool.arena, arena)  # 0 bytes copied
    s = pool.stats()
    assert (s.used_pages, s.shared_pages) == (2, 2)
    assert dict(s.owner_pages) == {a.owner: 2, b.owner: 2} and b.owner.startswith("b#")
    assert pool.holders(0) == (a.owner, b.owner) and b.resident_nbytes() == 2 * PAGE
    write(a, ra, 8, 4, 2)  # a new chunk on each side: new pages, the shared history stays shared
    write(b, rb, 8, 4, 3)
    assert pages(a) == [0, 1, 2] and pages(b) == [0, 1, 3]
    assert pool.stats().shared_pages == 2 and pool.stats().used_pages == 4
    pool.check()


def test_a_mid_chunk_fork_copies_the_written_page_only_on_either_side():
    pool = BlockPool(capacity_bytes=16 * PAGE, page_bytes=PAGE)
    a, ra = make(pool), ref_of()
    write(a, ra, 0, 8, 1)
    write(a, ra, 8, 8, 2)  # the current chunk: pages 2, 3
    b = a.fork()
    rb = copy.deepcopy(ra)
    write(b, rb, 12, 2, 3)  # a rewrite of tokens 12, 13: page 3 only (4 tokens per page)
    assert pages(b) == [0, 1, 2, 4] and pages(a) == [0, 1, 2, 3]
    assert pool.holders(3) == (a.owner,) and pool.holders(4) == (b.owner,) and pool.stats().shared_pages == 3
    write(a, ra, 8, 8, 4)  # the parent rewrites the whole chunk: it copies page 2 (page 3 is its own now)
    assert pages(a) == [0, 1, 5, 3] and pool.holders(2) == (b.owner,)
    write(b, rb, 8, 8, 5)  # b's pages 2 and 4 are its own: nothing copied
    assert pages(b) == [0, 1, 2, 4] and pool.stats().used_pages == 6
    write(a, ra, 4, 2, 6, h0=1, heads=1)  # a head-sliced write into shared page 1
    assert pages(a) == [0, 6, 5, 3] and pool.holders(1) == (b.owner,)
    for cache, ref in ((a, ra), (b, rb)):
        write(cache, ref, 16, 4, 7)
    pool.check()


def test_fork_drops_cached_plans_in_both_branches_between_two_identical_rewrites():
    pool = BlockPool(capacity_bytes=16 * PAGE, page_bytes=PAGE)
    a, ra = make(pool), ref_of()
    write(a, ra, 0, 4, 1)
    write(a, ra, 0, 4, 2)  # a rewrite: its plans are cached for the next identical call
    assert cached_plans(page_io(a))
    b = a.fork()
    assert not cached_plans(page_io(a)) and not cached_plans(page_io(b))
    rb = copy.deepcopy(ra)
    write(a, ra, 0, 4, 3)  # the same call again: re-planned, copies page 0
    write(a, ra, 0, 4, 4)  # and now the fast path again, on its own page
    write(b, rb, 0, 4, 5)
    write(b, rb, 0, 4, 6)
    assert pages(a) == [1] and pages(b) == [0] and pool.stats().shared_pages == 0


def test_a_copy_on_write_that_meets_a_full_pool_changes_nothing():
    pool = BlockPool(capacity_bytes=4 * PAGE, page_bytes=PAGE)
    a, ra = make(pool), ref_of()
    write(a, ra, 0, 8, 1)
    b = a.fork()
    squeeze = pool.alloc(pool.num_free_pages, "squeeze")
    before = (cache_state(a), cache_state(b))
    k, v = kv(4, 2)
    with pytest.raises(PoolExhaustedError, match="copy-on-write of 1 page"):  # an in-place rewrite
        b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4)
    same(cache_state(a), before[0])
    same(cache_state(b), before[1])
    pool.free(squeeze[1:], "squeeze")  # room for the advance's page, not for the copy of page 1 too
    assert pool.num_free_pages == 1
    before = (cache_state(a), cache_state(b))
    k, v = kv(6, 3)
    with pytest.raises(PoolExhaustedError, match="copy-on-write"):  # a rewrite-and-extend: the transaction rolls back
        b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=6)
    same(cache_state(a), before[0])
    same(cache_state(b), before[1])
    pool.free(squeeze[:1], "squeeze")
    rb = copy.deepcopy(ra)
    write(b, rb, 6, 6, 3)  # now it fits: page 1 copied, one new page
    assert pages(a) == [0, 1] and pages(b) == [0, 3, 2] and pool.num_free_pages == 0  # the advance took 2 first
    b.close()  # pages 2 and 3 back; page 0 is a's alone again
    write(a, ra, 8, 4, 4)
    pool.check()


def test_closing_branches_in_any_order_frees_exactly_the_pages_nobody_else_holds():
    for order in itertools.permutations(range(3)):
        pool = BlockPool(capacity_bytes=16 * PAGE, page_bytes=PAGE)
        a, ra = make(pool), ref_of()
        write(a, ra, 0, 8, 1)
        b = a.fork()
        c = b.fork()
        k, v = kv(2, 9)
        b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=8)  # b: one page of its own
        branches = [a, b, c]
        for i in order:
            mine = set(pages(branches[i]))
            others = {p for j, x in enumerate(branches) if x is not None and j != i for p in pages(x)}
            free = pool.num_free_pages
            branches[i].close()
            branches[i] = None
            assert pool.num_free_pages == free + len(mine - others)
            pool.check()
        assert pool.num_free_pages == pool.num_pages


def test_fork_of_a_packed_cache_shares_packed_chunks_and_rewrites_unpack_into_new_pages():
    q = QuantConfig(bits=4, centroids=2, block_size=4, keep_recent_chunks=0, sink=False)
    pool = BlockPool(capacity_bytes=64 * 512, page_bytes=512)
    twin_pool = BlockPool(capacity_bytes=64 * 512, page_bytes=512)
    a, twin = make(pool, quant=q), make(twin_pool, quant=q)
    calls = [(0, 4, 1), (4, 4, 2), (8, 4, 3)]  # two completed chunks are packed
    for s, n, seed in calls:
        k, v = kv(n, seed)
        for c in (a, twin):
            c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    assert [e.value.packed for e in sequencer(a).index] == [True, True, False]
    b = a.fork()
    assert pool.stats().shared_pages == len(pages(a)) == pool.stats().used_pages
    # the fork takes its parent's used bytes (O(1)): what recounting its own retained rows gives
    assert used_bytes_of(pool, b.owner) == used_bytes_of(pool, a.owner) == b.memory_breakdown()["used_bytes"] > 0
    k, v = kv(4, 4)
    vb = b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4)  # unpacks chunk [4, 8) into new pages
    vt = twin.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4)
    assert torch.equal(vb.k, vt.k) and torch.equal(vb.v, vt.v)
    assert b.memory_breakdown() == twin.memory_breakdown()
    assert sequencer(a).index.find(4).value.packed and not sequencer(b).index.find(4).value.packed
    k, v = kv(4, 5)
    va = a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=12)
    twin_a = make(BlockPool(capacity_bytes=64 * 512, page_bytes=512), quant=q)
    for s, n, seed in [*calls, (12, 4, 5)]:
        k, v = kv(n, seed)
        tv = twin_a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    assert torch.equal(va.k, tv.k) and torch.equal(va.v, tv.v)
    b.rewind_to(2)  # into the shared packed chunk [0, 4): b trims its hold only
    assert sequencer(a).index.find(0).value.packed and pool.holders(pages(a)[0]) == (a.owner, b.owner)
    pool.check()


def test_fork_with_a_pin_keeps_the_pin_and_errors_are_typed():
    pool = BlockPool(capacity_bytes=16 * PAGE, page_bytes=PAGE)
    a, ra = make(pool, sink_tokens=4), ref_of(sink_tokens=4)
    write(a, ra, 0, 4, 1)
    a.pin_current_chunk(4)
    ra.pin_current_chunk(4)
    b = a.fork()
    assert b.pinned_range == a.pinned_range
    with pytest.raises(CacheConfigError, match="fork name must be a non-empty str"):
        a.fork(name="")
    a.close()
    with pytest.raises(CacheClosedError, match="fork after close"):
        a.fork()
    rb = copy.deepcopy(ra)
    for s in range(4, 40, 4):
        write(b, rb, s, 4, s)  # the pinned sink does not roll
    b.reset_indices()
    assert pool.num_free_pages == pool.num_pages
    pool.check()


# ---------------------------------------------------------------------------------------------------- sessions
def _spec(**kw):
    base = dict(layers=2, batch_size=B, cache_size=8, num_heads=H, head_dim=D, chunk_tokens=4, dtype=torch.float32,
                cache_sets=2, chunks=2)  # fmt: skip
    base.update(kw)
    return SessionSpec(**base)


def test_session_fork_forks_every_layer_of_every_set_and_reserves_its_divergence():
    pool = BlockPool(capacity_bytes=40 * PAGE, page_bytes=PAGE)
    mgr = SessionManager(pool)
    s = mgr.open(_spec())
    for cs in s.caches:
        for c in cs:
            k, v = kv(4, 1)
            c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    used = pool.stats().used_pages
    assert used == 4  # 2 sets x 2 layers x one page
    reserved = mgr.reserved_pages()
    f = mgr.fork(s)
    assert len(f.caches) == 2 and len(f.caches[0]) == 2 and f.planned_pages == 4  # the current chunks' pages
    assert pool.stats().used_pages == used and pool.stats().shared_pages == 4
    assert mgr.reserved_pages() == reserved + 4
    k, v = kv(4, 2)
    f.caches[0][0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)  # copies one page
    assert mgr.reserved_pages() == reserved + 3  # drawn from the fork's own reservation
    assert f.caches[1][1].debug_name == f"{f.name}.set1.layer1"
    f.close()
    assert pool.stats().used_pages == used and mgr.reserved_pages() == reserved
    s.close()
    assert pool.num_free_pages == pool.num_pages


def test_session_fork_refused_when_its_divergence_does_not_fit():
    pool = BlockPool(capacity_bytes=8 * PAGE, page_bytes=PAGE)
    mgr = SessionManager(pool)
    s = mgr.open(_spec(cache_sets=1, layers=1))
    k, v = kv(4, 1)
    s.caches[0][0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    before = (pool.stats(), mgr.open_sessions)
    with pytest.raises(SessionRefusedError, match="fork of session1: its divergence needs 50 pages") as err:
        mgr.fork(s, divergence_pages=50)
    assert err.value.needed_pages == 50 and (pool.stats(), mgr.open_sessions) == before
    with pytest.raises(CacheConfigError):
        mgr.fork(s, divergence_pages=-1)
    s.close()
    with pytest.raises(CacheConfigError, match="not an open session"):
        mgr.fork(s)


def test_packing_a_shared_chunk_happens_once_and_the_other_branch_adopts_it():
    q = QuantConfig(bits=4, centroids=2, block_size=4, keep_recent_chunks=0, sink=False)
    pool = BlockPool(capacity_bytes=64 * 512, page_bytes=512)
    a = make(pool, quant=q)
    k, v = kv(4, 1)
    a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)  # the current chunk [0, 4): dense
    b = a.fork()
    dense = pages(a)
    twins = []
    for _branch in (a, b):
        twin = make(BlockPool(capacity_bytes=64 * 512, page_bytes=512), quant=q)
        twin.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
        twins.append(twin)
    k2, v2 = kv(4, 2)
    for cache, twin in zip((a, b), twins, strict=True):  # each advance packs [0, 4): a quantizes, b adopts
        got = cache.update_and_get_attention_kv(key=k2, value=v2, current_chunk_start=4)
        want = twin.update_and_get_attention_kv(key=k2, value=v2, current_chunk_start=4)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
        assert cache.memory_breakdown() == twin.memory_breakdown()
    packed_a, packed_b = sequencer(a).index.find(0).value, sequencer(b).index.find(0).value
    assert packed_a.packed and packed_b.packed and packed_a is not packed_b
    assert packed_a.pages == packed_b.pages  # the same pages: packed once, held by both
    assert all(pool.holders(p) == (a.owner, b.owner) for p in packed_a.pages)
    assert all(pool.holders(p) == () or p in pages(a) + pages(b) for p in dense)  # the dense source is free
    assert pool.stats().used_pages == len(packed_a.pages) + 2  # + one dense page per branch's new chunk
    b.rewind_to(2)  # b trims its hold on the shared packed chunk; a keeps every page
    a.close()
    pool.check()
    b.close()
    assert pool.num_free_pages == pool.num_pages


def test_a_rewrite_of_the_source_after_the_other_branch_packed_is_packed_again():
    q = QuantConfig(bits=4, centroids=2, block_size=4, keep_recent_chunks=0, sink=False)
    pool = BlockPool(capacity_bytes=64 * 512, page_bytes=512)
    a = make(pool, quant=q)
    twin = make(BlockPool(capacity_bytes=64 * 512, page_bytes=512), quant=q)
    calls = [(4, 0, 1), (4, 4, 2)]  # a packs [0, 4) at its advance
    b = None
    for i, (n, s, seed) in enumerate(calls):
        if i == 1:
            b = a.fork()
        k, v = kv(n, seed)
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    k, v = kv(4, 1)
    twin.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    k, v = kv(2, 7)  # b rewrites its dense [0, 4), which it now holds alone: a's record no longer applies
    for c in (b, twin):
        c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=1)
    k, v = kv(4, 2)
    got = b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4)
    want = twin.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert sequencer(b).index.find(0).value.pages != sequencer(a).index.find(0).value.pages  # b packed its own
    pool.check()
