"""Sessions on one pool (pagedqvg/serving/sessions.py): planned peak == measured, admission and refusal (nothing
changes),
close, deterministic reclaim (dropped sessions without garbage collection, idle leases), queueing, and many
sessions at different stages on one pool never meeting PoolExhaustedError."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch
from helpers import read_slots

from pagedqvg import BlockPool, CacheClosedError, CacheConfigError, PoolExhaustedError, QuantConfig
from pagedqvg.allocator.pool import debug_state
from pagedqvg.errors import SessionRefusedError
from pagedqvg.serving.sessions import SessionManager, SessionSpec, planned_session_pages

PAGE = 1024
QUANT = QuantConfig(bits=2, centroids=4, block_size=8, kmeans_iters=1, keep_recent_chunks=1, sink=False)


def spec(**kw) -> SessionSpec:
    base = dict(layers=3, batch_size=1, cache_size=24, num_heads=2, head_dim=32, chunk_tokens=6, sink_tokens=6,
                denoise_steps=2)  # fmt: skip
    return SessionSpec(**(base | kw))


def run_chunk(session, spec: SessionSpec, k: int, seed: int = 0) -> None:
    """Chunk `k` of the planner's call pattern: per denoise step (the advance first), every cache in turn."""
    n = spec.chunk_tokens
    gen = torch.Generator().manual_seed(seed * 7919 + k)
    kv = torch.randn(2, spec.batch_size, n, spec.num_heads, spec.head_dim, generator=gen).to(spec.dtype)
    for _step in range(spec.denoise_steps + 1):  # the advance, the denoise rewrites, the clean pass
        for cache in (c for cs in session.caches for c in cs):
            cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=k * n)


@pytest.mark.parametrize("quant", [None, QUANT], ids=["quant_off", "quant_on"])
@pytest.mark.parametrize("chunks", [1, 3, None])
def test_planned_peak_equals_measured(quant, chunks):
    s = spec(quant=quant, chunks=chunks, cache_sets=2, layers=2 if quant else 3)
    pool = BlockPool(capacity_bytes=400 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    session = manager.open(s)
    for k in range(chunks or 8):
        run_chunk(session, s, k)
    assert pool.stats().high_water_pages == session.planned_pages == planned_session_pages(s, PAGE)
    session.close()
    assert pool.stats().used_pages == 0 and session.closed
    pool.check()


def test_refusal_names_sizes_and_changes_nothing():
    pool = BlockPool(capacity_bytes=60 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    s = spec()
    need = manager.planned_pages(s)
    sessions = [manager.open(s) for _ in range(60 // need)]
    before = debug_state(pool), manager.open_sessions, manager.reserved_pages()
    with pytest.raises(PoolExhaustedError) as info:
        manager.open(s)
    err = info.value
    assert (err.needed_pages, err.free_pages) == (need, 60) and err.available_pages == 60 - need * len(sessions)
    assert f"needs {need} pages" in str(err) and "60 of 60 free" in str(err)
    assert (debug_state(pool), manager.open_sessions, manager.reserved_pages()) == before
    assert manager.refusals == 1
    sessions[0].close()
    manager.open(s).close()  # the closed session's reservation is free again


def test_held_pages_count_against_free_not_twice():
    """A session that holds pages reserves only the rest of its plan: admission stays exact mid-run."""
    pool = BlockPool(capacity_bytes=100 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    s = spec()
    a = manager.open(s)
    run_chunk(a, s, 0)
    held = a.held_pages()
    assert 0 < held < a.planned_pages
    assert manager.available_pages() == pool.num_pages - a.planned_pages


def test_close_gives_every_page_back_and_closes_the_caches():
    pool = BlockPool(capacity_bytes=100 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    s = spec(cache_sets=2)
    with manager.open(s) as session:
        run_chunk(session, s, 0)
        assert pool.stats().used_pages > 0
        cache = session.caches[1][2]
    assert pool.stats().used_pages == 0 and session.closed and cache.closed
    with pytest.raises(CacheClosedError):
        run_chunk(session, s, 1)
    session.close()  # idempotent
    pool.check()


def test_dropped_session_reclaimed_without_garbage_collection():
    pool = BlockPool(capacity_bytes=100 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    s = spec()
    session = manager.open(s)
    run_chunk(session, s, 0)
    gc.disable()
    try:
        del session  # no reference left: CPython frees the Session at once
        assert pool.stats().used_pages > 0  # nothing freed behind the pool's back
        assert manager.reclaim() == 1
    finally:
        gc.enable()
    assert pool.stats().used_pages == 0 and manager.open_sessions == 0 and manager.reclaimed == 1


def test_idle_lease_reclaims_and_touch_renews():
    now = [0.0]
    pool = BlockPool(capacity_bytes=100 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool, idle_timeout_s=10.0, clock=lambda: now[0])
    s = spec()
    a, b = manager.open(s), manager.open(s)
    run_chunk(a, s, 0)
    now[0] = 8.0
    b.touch()
    now[0] = 12.0
    assert manager.reclaim() == 1 and a.closed and not b.closed
    assert pool.pages_of(a.caches[0][0].owner) == 0


def test_open_reclaims_before_refusing():
    """A session dropped without close() holds its reservation until reclaimed; an open that would not fit
    reclaims it first (instead of refusing), so the second open succeeds and counts one reclaimed session."""
    pool = BlockPool(capacity_bytes=30 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    s = spec()
    need = manager.planned_pages(s)
    assert need <= 30 < 2 * need  # one session fits the pool, two do not
    gc.disable()  # the dropped session stays uncollected until the manager reclaims it
    try:
        manager.open(s)  # dropped at once
        assert manager.open_sessions == 1 and manager.reserved_pages() == need and manager.reclaimed == 0
        second = manager.open(s)
    finally:
        gc.enable()
    assert manager.reclaimed == 1 and manager.open_sessions == 1 and manager.reserved_pages() == need
    assert not second.closed
    second.close()
    assert manager.open_sessions == 0 and manager.reserved_pages() == 0 and pool.stats().used_pages == 0


def test_open_waits_for_a_close():
    pool = BlockPool(capacity_bytes=30 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    s = spec()
    first = manager.open(s)
    timer = threading.Timer(0.2, first.close)
    timer.start()
    t0 = time.monotonic()
    second = manager.open(s, wait_s=30.0)
    assert first.closed and time.monotonic() - t0 < 30.0
    second.close()
    timer.join()
    with pytest.raises(PoolExhaustedError):
        held = manager.open(s)
        manager.open(s, wait_s=0.05)
    del held


def test_bad_specs_are_config_errors():
    pool = BlockPool(capacity_bytes=30 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    with pytest.raises(CacheConfigError, match="layers"):
        manager.open(spec(layers=0))
    with pytest.raises(CacheConfigError, match="window smaller than a chunk"):
        manager.open(spec(chunk_tokens=20))
    with pytest.raises(CacheConfigError, match="allow_growth"):
        manager.open(spec(cache_kwargs=(("allow_growth", True),)))
    assert pool.stats().used_pages == 0 and manager.open_sessions == 0


@pytest.mark.parametrize("quant", [None, QUANT], ids=["quant_off", "quant_on"])
def test_sessions_at_different_stages_never_exhaust_the_pool(quant):
    """Sessions of random lengths start and end at random times on one pool; each runs its planned chunks. Every
    admitted session completes (no PoolExhaustedError), and the pool's peak stays within the admitted plans."""
    rng = random.Random(5)
    pool = BlockPool(capacity_bytes=40 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    live: list[tuple] = []
    done = refused = 0
    for tick in range(40 if quant else 150):
        if rng.random() < 0.6:
            s = spec(quant=quant, chunks=rng.randint(1, 6), layers=rng.randint(1, 3))
            try:
                live.append((manager.open(s), s, [0]))
            except PoolExhaustedError:
                refused += 1
        for item in list(live):
            session, s, k = item
            run_chunk(session, s, k[0], seed=tick)
            k[0] += 1
            if k[0] == s.chunks:
                session.close()
                live.remove(item)
                done += 1
        pool.check()
        assert pool.stats().used_pages <= sum(x[0].planned_pages for x in live)
    manager.close_all()
    assert pool.stats().used_pages == 0 and done > (5 if quant else 20) and refused > 0


def test_adopt_tracks_caches_built_elsewhere():
    from pagedqvg import PagedCausalKVCache

    pool = BlockPool(capacity_bytes=30 * PAGE, page_bytes=PAGE)
    manager = SessionManager(pool)
    s = spec(layers=2)
    built = [[PagedCausalKVCache(pool=pool, device="cpu", name=f"ext{i}", **s.layer_kwargs()) for i in range(2)]]
    session = manager.adopt(built, planned_pages=manager.planned_pages(s))
    run_chunk(session, s, 0)
    assert pool.stats().used_pages > 0
    with pytest.raises(PoolExhaustedError, match="adopt"):
        manager.adopt([[]], planned_pages=31)
    other = BlockPool(capacity_bytes=4 * PAGE, page_bytes=PAGE)
    with pytest.raises(CacheConfigError, match="not a cache of this manager's pool"):
        SessionManager(other).adopt(built)
    del session
    assert manager.reclaim() == 1 and pool.stats().used_pages == 0 and built[0][0].closed


# ---------------------------------------------------------------------------------------------------- host tier
def _readouts(session) -> list[torch.Tensor]:
    return [read_slots(c, "test") for cs in session.caches for c in cs]


@pytest.mark.parametrize("quant", [None, QUANT], ids=["quant_off", "quant_on"])
def test_swap_out_and_in_round_trip_is_bit_equal_and_frees_the_device(quant):
    sp = spec(quant=quant, cache_sets=2)
    pool = BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE)
    host = BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE)
    twin_mgr = SessionManager(BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE))
    mgr = SessionManager(pool, host_pool=host)
    s, twin = mgr.open(sp), twin_mgr.open(sp)
    for k in range(4):
        run_chunk(s, sp, k)
        run_chunk(twin, sp, k)
    before = _readouts(s)
    held = s.held_pages()
    reserved = mgr.reserved_pages()
    assert mgr.swap_out(s) == held
    assert pool.num_free_pages == pool.num_pages and host.stats().used_pages == held
    assert mgr.reserved_pages() == reserved - max(0, s.planned_pages - held)  # a parked session reserves nothing
    assert s.swapped  # its next call would bring it back (tests/test_host_tier.py); here swap_in does
    assert not any(c.closed for cs in s.caches for c in cs)  # parked, not closed
    with pytest.raises(CacheConfigError, match="swapped out already"):
        mgr.swap_out(s)
    assert mgr.swap_in(s) == held
    assert host.stats().used_pages == 0 and s.held_pages() == held
    for x, y in zip(_readouts(s), before, strict=True):
        assert torch.equal(x, y)
    run_chunk(s, sp, 4)  # and it goes on exactly as the twin that never left
    run_chunk(twin, sp, 4)
    for x, y in zip(_readouts(s), _readouts(twin), strict=True):
        assert torch.equal(x, y)
    pool.check()
    host.check()
    s.close()
    assert pool.num_free_pages == pool.num_pages


def test_a_swap_that_does_not_fit_leaves_the_session_where_it_was():
    sp = spec()
    pool = BlockPool(capacity_bytes=60 * PAGE, page_bytes=PAGE)
    host = BlockPool(capacity_bytes=4 * PAGE, page_bytes=PAGE)
    mgr = SessionManager(pool, host_pool=host)
    s = mgr.open(sp)
    for k in range(3):
        run_chunk(s, sp, k)
    before = (pool.stats(), debug_state(pool), host.stats(), _readouts(s))
    with pytest.raises(PoolExhaustedError):
        mgr.swap_out(s)  # the host pool is too small
    assert (pool.stats(), debug_state(pool), host.stats()) == before[:3]
    for x, y in zip(_readouts(s), before[3], strict=True):
        assert torch.equal(x, y)
    # device side: parked, then the device fills up; swap_in is refused and it stays on the host
    host2 = BlockPool(capacity_bytes=60 * PAGE, page_bytes=PAGE)
    mgr2 = SessionManager(pool, host_pool=host2)
    s.close()
    s2 = mgr2.open(sp)
    for k in range(3):
        run_chunk(s2, sp, k)
    ref = _readouts(s2)
    mgr2.swap_out(s2)
    squeeze = pool.alloc(pool.num_free_pages - 2, "squeeze")
    parked = host2.stats()
    with pytest.raises(SessionRefusedError, match="swap_in of session1"):
        mgr2.swap_in(s2)
    assert host2.stats() == parked and pool.num_free_pages == 2
    pool.free(squeeze, "squeeze")
    mgr2.swap_in(s2)
    for x, y in zip(_readouts(s2), ref, strict=True):
        assert torch.equal(x, y)
    mgr2.swap_out(s2)
    s2.close()  # closing a parked session frees its host pages
    assert host2.stats().used_pages == 0 and pool.num_free_pages == pool.num_pages
    with pytest.raises(CacheConfigError, match="no host_pool"):
        SessionManager(pool).swap_out(s2)


def test_forks_swaps_and_packing_once_together():
    sp = spec(quant=QUANT, layers=2)
    pool = BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE)
    host = BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE)
    mgr = SessionManager(pool, host_pool=host)
    twin_mgr = SessionManager(BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE))
    s, twin = mgr.open(sp), twin_mgr.open(sp)
    for k in range(3):
        run_chunk(s, sp, k)
        run_chunk(twin, sp, k)
    f = mgr.fork(s)
    run_chunk(s, sp, 3)  # packs chunk 1 (chunk 0 is the dense sink), which f shares: f could adopt it
    mgr.swap_out(s)  # ... but s's pages are host pages now: f must pack its own
    with pytest.raises(CacheConfigError, match="not an open session of this manager on the device"):
        mgr.fork(s)
    run_chunk(f, sp, 3)
    run_chunk(twin, sp, 3)
    for x, y in zip(_readouts(f), _readouts(twin), strict=True):
        assert torch.equal(x, y)
    mgr.swap_in(s)
    for x, y in zip(_readouts(s), _readouts(twin), strict=True):
        assert torch.equal(x, y)
    f.close()
    s.close()
    pool.check()
    assert pool.num_free_pages == pool.num_pages and host.stats().used_pages == 0
