"""The host tier (pagedqvg/serving/host_tier.py, tiering.py, SessionManager's swap_when_full): idle sessions swapped
out least recently used first, busy ones never; a swapped-out session back at the next call of any kind; views
bit-equal to a never-swapped twin (quant off and packed); shared pages of a fork family moved once and still shared;
a full host tier refuses naming the counts and changes nothing; a failing copy in either direction leaves the
session where it was; threads on more sessions than the pool holds."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from helpers import cache_state, read_slots, same

from pagedqvg import BlockPool, CacheConfigError, QuantConfig
from pagedqvg.allocator.pool import debug_state
from pagedqvg.errors import SessionRefusedError
from pagedqvg.serving import host_tier
from pagedqvg.serving.sessions import SessionManager, SessionSpec

PAGE = 1024
QUANT = QuantConfig(bits=2, centroids=4, block_size=8, kmeans_iters=1, keep_recent_chunks=1, sink=False)


def spec(**kw) -> SessionSpec:
    base = dict(layers=2, batch_size=1, cache_size=24, num_heads=2, head_dim=32, chunk_tokens=6, sink_tokens=6,
                denoise_steps=1)  # fmt: skip
    return SessionSpec(**(base | kw))


def kv_of(sp: SessionSpec, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + k)
    return torch.randn(2, sp.batch_size, sp.chunk_tokens, sp.num_heads, sp.head_dim, generator=gen).to(sp.dtype)


def run_chunk(session, sp: SessionSpec, k: int, seed: int = 0) -> None:
    """Chunk `k`: the advance, the denoise rewrites and the clean pass, every cache in turn."""
    kv = kv_of(sp, k, seed)
    for _step in range(sp.denoise_steps + 1):
        for cache in (c for cs in session.caches for c in cs):
            cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=k * sp.chunk_tokens)


def readouts(session) -> list[torch.Tensor]:
    return [read_slots(c, "test") for cs in session.caches for c in cs]


def assert_equal_views(a, b) -> None:
    for x, y in zip(readouts(a), readouts(b), strict=True):
        assert torch.equal(x, y)


def snapshot(mgr: SessionManager, *sessions) -> tuple:
    """Both pools' tables, arenas and counts, every session's state and every cache's `cache_state`."""
    pools = (mgr.pool, mgr.host_pool)
    tables = tuple((p.stats(), debug_state(p), p.arena.clone()) for p in pools)
    caches = tuple(cache_state(c) for s in sessions for cs in s.caches for c in cs)
    states = tuple((s.swapped, s.closed) for s in sessions)
    return (*[x for t in tables for x in t], *[x for c in caches for x in c], states, mgr.reserved_pages())


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def two_session_pool(sp: SessionSpec, host_pages: int = 400, **kw) -> tuple[SessionManager, int]:
    need = SessionManager(BlockPool(PAGE, PAGE)).planned_pages(sp)
    pool = BlockPool(capacity_bytes=2 * need * PAGE, page_bytes=PAGE)
    host = BlockPool(capacity_bytes=host_pages * PAGE, page_bytes=PAGE)
    return SessionManager(pool, host_pool=host, swap_when_full=True, clock=Clock(), **kw), need


def twins(sp: SessionSpec, n: int) -> list:
    mgr = SessionManager(BlockPool(capacity_bytes=400 * PAGE, page_bytes=PAGE))
    return [mgr.open(sp) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ configuration
def test_options_are_checked():
    pool = BlockPool(capacity_bytes=8 * PAGE, page_bytes=PAGE)
    with pytest.raises(CacheConfigError, match="swap_when_full=True needs a host_pool"):
        SessionManager(pool, swap_when_full=True)
    with pytest.raises(CacheConfigError, match="swap_in_wait_s must be seconds >= 0, got -1"):
        SessionManager(pool, host_pool=8 * PAGE, swap_in_wait_s=-1)
    with pytest.raises(CacheConfigError, match="host_pool of 10 bytes"):
        SessionManager(pool, host_pool=10)
    mgr = SessionManager(pool, host_pool=8 * PAGE)  # a size: a host pool with the device pool's pages
    assert mgr.host_pool.num_pages == 8 and mgr.host_pool.page_bytes == PAGE and not mgr.host_pool.pinned
    with pytest.raises(ValueError, match="pin_memory=True is for a host arena"):
        BlockPool(PAGE, PAGE, pin_memory=1)


def test_a_cuda_pool_gets_a_pinned_host_pool(monkeypatch):
    """No GPU here: the host pool of a CUDA pool requests pinned memory (torch.empty's pin_memory argument)."""
    calls = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kw):
        calls.append(pin_memory)
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", empty)

    class CudaPool:  # what host_pool_for reads of a device pool
        device = torch.device("cuda", 0)
        page_bytes = PAGE

    host = host_tier.host_pool_for(CudaPool(), 4 * PAGE)
    assert host.pinned and host.device.type == "cpu" and calls[-1] is True
    assert not host_tier.host_pool_for(BlockPool(PAGE, PAGE), 4 * PAGE).pinned and calls[-1] is False


def test_page_runs_group_consecutive_pages_on_both_sides():
    assert host_tier.page_runs([5, 3, 4, 9], [12, 10, 11, 2]) == [(3, 10, 3), (9, 2, 1)]
    assert host_tier.page_runs([1, 2], [7, 9]) == [(1, 7, 1), (2, 9, 1)]


# ------------------------------------------------------------------------------------------------ LRU and busy
def test_idle_sessions_go_out_least_recently_used_first_and_come_back_at_their_next_call():
    sp = spec()
    mgr, _ = two_session_pool(sp)
    a, b = mgr.open(sp, name="a"), mgr.open(sp, name="b")
    ta, tb, tc = twins(sp, 3)
    for s, t in ((a, ta), (b, tb)):
        run_chunk(s, sp, 0)
        run_chunk(t, sp, 0)
    a.touch()  # a used last: b is the least recently used
    assert b.last_used < a.last_used
    c = mgr.open(sp, name="c")
    assert (a.swapped, b.swapped, c.swapped) == (False, True, False)
    assert (mgr.swapped_out_total, mgr.swapped_in_total, mgr.swapped_sessions) == (1, 0, 1)
    run_chunk(c, sp, 0)
    run_chunk(tc, sp, 0)
    run_chunk(b, sp, 1)  # b's next call brings it back; a is now the least recently used
    run_chunk(tb, sp, 1)
    assert (a.swapped, b.swapped, c.swapped) == (True, False, False) and mgr.swapped_in_total == 1
    for s, t in ((a, ta), (b, tb), (c, tc)):
        assert_equal_views(s, t)
    # reading a's slots brought it back (c out, the least recent), then reading c's brought c back (a out)
    assert mgr.swapped_in_total == 3 and (a.swapped, b.swapped, c.swapped) == (True, False, False)
    mgr.close_all()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0
    mgr.pool.check()
    mgr.host_pool.check()


def test_busy_sessions_are_never_swapped_and_a_refusal_says_why():
    sp = spec()
    mgr, _ = two_session_pool(sp)
    a, b = mgr.open(sp, name="a"), mgr.open(sp, name="b")
    run_chunk(a, sp, 0)
    run_chunk(b, sp, 0)
    # a is the least recently used now
    with a.busy(), a.busy():  # re-entrant
        c = mgr.open(sp, name="c")
        assert (a.swapped, b.swapped) == (False, True)
        with pytest.raises(CacheConfigError, match="swap_out: a is busy"):
            mgr.swap_out(a)
        with c.busy():
            before = snapshot(mgr, a, b, c)
            with pytest.raises(SessionRefusedError) as info:
                mgr.open(sp, name="d")
            msg = str(info.value)
            assert "swap_when_full swapped 0 idle session(s) out first" in msg
            assert "no idle session left to swap out (2 busy" in msg
            same(snapshot(mgr, a, b, c), before)
            with pytest.raises(SessionRefusedError, match="swap_in of b: needs"):
                run_chunk(b, sp, 1)  # b cannot come back: the call raises, b stays on the host, nothing changed
            same(snapshot(mgr, a, b, c), before)
    run_chunk(b, sp, 1)  # a is idle again: it goes out, b comes in
    assert a.swapped and not b.swapped and mgr.refusals == 2
    mgr.close_all()
    mgr.pool.check()


def test_an_admitted_session_is_never_a_victim_of_its_own_admission():
    sp = spec()
    mgr, need = two_session_pool(sp)
    a = mgr.open(sp, name="a")
    run_chunk(a, sp, 0)
    f = mgr.fork(a, divergence_pages=need)  # a is the parent being forked: not a victim
    assert not a.swapped and not f.swapped
    with pytest.raises(SessionRefusedError, match="no idle session left to swap out"):
        mgr.fork(a, divergence_pages=need + 1)  # the only other resident session is f, idle ...
    assert not a.swapped  # ... f went out, a stayed; still no room for need + 1 more
    mgr.close_all()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0


# ------------------------------------------------------------------------------------------------ every call kind
CALLS = ["update_and_get_attention_kv", "update_and_attend", "update_and_attend_heads", "rewind_to",
         "reset_indices", "pin_current_chunk", "fork", "read_slots"]  # fmt: skip


def _call(kind: str, cache, sp: SessionSpec, k: int):
    kv = kv_of(sp, k, 1)
    start = k * sp.chunk_tokens
    if kind == "update_and_get_attention_kv":
        view = cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=start)
        return [view.k, view.v]
    if kind == "update_and_attend":
        return [cache.update_and_attend(kv[0], key=kv[0], value=kv[1], current_chunk_start=start)]
    if kind == "update_and_attend_heads":
        return [cache.update_and_attend_heads(kv[0], key=kv[0], value=kv[1], current_chunk_start=start)]
    if kind == "rewind_to":
        cache.rewind_to(start - 2)
        return [read_slots(cache, "t")]
    if kind == "reset_indices":
        cache.reset_indices()
        return [read_slots(cache, "t")]
    if kind == "pin_current_chunk":
        cache.pin_current_chunk(sp.chunk_tokens)
        return [torch.tensor(cache.pinned_range)]
    if kind == "fork":
        child = cache.fork()
        out = [read_slots(child, "t")]
        child.close()
        return out
    return [read_slots(cache, "t")]


@pytest.mark.parametrize("kind", CALLS)
def test_every_call_kind_brings_a_swapped_session_back(kind):
    sp = spec()
    mgr, _ = two_session_pool(sp)
    s, (t,) = mgr.open(sp), twins(sp, 1)
    for k in range(3):
        run_chunk(s, sp, k)
        run_chunk(t, sp, k)
    mgr.swap_out(s)
    assert s.swapped and mgr.pool.stats().used_pages == 0
    got = _call(kind, s.caches[0][1], sp, 3)
    assert not s.swapped and mgr.swapped_in_total == 1
    for x, y in zip(got, _call(kind, t.caches[0][1], sp, 3), strict=True):
        assert torch.equal(x, y)
    assert_equal_views(s, t)
    mgr.close_all()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0


# ------------------------------------------------------------------------------------------------ bit-equal twins
@pytest.mark.parametrize("quant", [None, QUANT], ids=["quant_off", "packed"])
def test_random_schedule_on_three_sessions_equals_never_swapped_twins(quant):
    sp = spec(quant=quant)
    mgr, _ = two_session_pool(sp)
    sessions = [mgr.open(sp, name=f"s{i}") for i in range(3)]  # the third open swaps the first out
    tw = twins(sp, 3)
    chunk = [0, 0, 0]
    rng = random.Random(7)
    for _ in range(18):
        i = rng.randrange(3)
        run_chunk(sessions[i], sp, chunk[i], seed=i)
        run_chunk(tw[i], sp, chunk[i], seed=i)
        chunk[i] += 1
        assert_equal_views(sessions[i], tw[i])
        mgr.pool.check()
        mgr.host_pool.check()
    assert mgr.swapped_in_total > 0 and mgr.swapped_out_total > mgr.swapped_in_total
    for s, t in zip(sessions, tw, strict=True):
        assert_equal_views(s, t)
    mgr.close_all()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0


# ------------------------------------------------------------------------------------------------ shared pages
def test_a_fork_family_moves_its_shared_pages_once_and_shares_them_after_the_round_trip():
    sp = spec(quant=QUANT)
    pool = BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE)
    host = BlockPool(capacity_bytes=200 * PAGE, page_bytes=PAGE)
    mgr = SessionManager(pool, host_pool=host)
    s, (t,) = mgr.open(sp), twins(sp, 1)
    for k in range(4):
        run_chunk(s, sp, k)
        run_chunk(t, sp, k)
    f = mgr.fork(s)
    unique = pool.stats().used_pages
    shared = {c.owner: pool.shared_pages_of(c.owner) for x in (s, f) for cs in x.caches for c in cs}
    assert all(shared.values()) and sum(shared.values()) == 2 * unique  # every page held by s and f
    assert mgr.swap_out(s, f) == unique  # one copy per distinct page
    assert host.stats().used_pages == unique and pool.stats().used_pages == 0 and mgr.swapped_out_pages == unique
    assert {c.owner: host.shared_pages_of(c.owner) for x in (s, f) for cs in x.caches for c in cs} == shared
    host.check()
    assert mgr.swap_in(f, s) == unique
    assert pool.stats().used_pages == unique and host.stats().used_pages == 0
    assert {c.owner: pool.shared_pages_of(c.owner) for x in (s, f) for cs in x.caches for c in cs} == shared
    pool.check()
    host.check()
    run_chunk(f, sp, 4)
    run_chunk(s, sp, 4)
    run_chunk(t, sp, 4)
    assert_equal_views(f, t)
    assert_equal_views(s, t)
    # one of them alone: the pages it shares with the one that stays are copied, the other keeps them
    before = pool.stats().used_pages
    f_pages = sum(pool.pages_of(c.owner) for cs in f.caches for c in cs)
    f_alone = f_pages - sum(pool.shared_pages_of(c.owner) for cs in f.caches for c in cs)
    assert 0 < f_alone < f_pages
    assert mgr.swap_out(f) == f_pages and host.stats().used_pages == f_pages
    assert pool.stats().used_pages == before - f_alone
    assert sum(pool.shared_pages_of(c.owner) for cs in s.caches for c in cs) == 0  # s alone holds them now
    pool.check()
    host.check()
    assert_equal_views(f, t)  # back at this read
    mgr.close_all()
    assert pool.stats().used_pages == 0 and host.stats().used_pages == 0


def test_swap_when_full_moves_an_idle_fork_family_together():
    sp = spec()
    mgr, _ = two_session_pool(sp)
    a = mgr.open(sp, name="a")
    run_chunk(a, sp, 0)
    f = mgr.fork(a, name="f")
    unique = mgr.pool.stats().used_pages
    b = mgr.open(sp, name="b")  # a and f are idle: they go out together, the shared pages copied once
    assert a.swapped and f.swapped and not b.swapped
    assert mgr.swapped_out_total == 2 and mgr.swapped_out_pages == unique
    assert mgr.host_pool.stats().used_pages == unique
    mgr.host_pool.check()
    mgr.close_all()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0


# ------------------------------------------------------------------------------------------------ refusals, faults
def test_a_full_host_tier_refuses_naming_the_counts_and_changes_nothing():
    sp = spec()
    mgr, need = two_session_pool(sp, host_pages=1)
    a, b = mgr.open(sp, name="a"), mgr.open(sp, name="b")
    run_chunk(a, sp, 0)
    run_chunk(b, sp, 0)
    before = snapshot(mgr, a, b)
    with pytest.raises(SessionRefusedError) as info:
        mgr.open(sp, name="c")
    msg = str(info.value)
    assert f"needs {need} pages" in msg and "swap_when_full swapped 0 idle session(s) out first" in msg
    held = sum(mgr.pool.pages_of(c.owner) for cs in a.caches for c in cs)
    assert f"the host tier is full: 1 of 1 host pages free, the next idle session(s) need {held}" in msg
    same(snapshot(mgr, a, b), before)
    assert mgr.open_sessions == 2 and mgr.refusals == 1


@pytest.mark.parametrize("direction", ["out", "in"])
def test_a_failing_copy_leaves_the_session_where_it_was(monkeypatch, direction):
    sp = spec(quant=QUANT)
    mgr, _ = two_session_pool(sp)
    s, (t,) = mgr.open(sp), twins(sp, 1)
    for k in range(3):
        run_chunk(s, sp, k)
        run_chunk(t, sp, k)
    if direction == "in":
        mgr.swap_out(s)
    before = snapshot(mgr, s)
    real = host_tier.move_pages

    def broken(*args):
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(host_tier, "move_pages", broken)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        if direction == "out":
            mgr.swap_out(s)
        else:
            run_chunk(s, sp, 3)  # the auto swap-in fails: the call raises, s stays on the host
    same(snapshot(mgr, s), before)
    if direction == "out":  # an admission that needs the room propagates the fault and changes nothing either
        b = mgr.open(sp, name="b")
        with pytest.raises(RuntimeError, match="injected copy fault"):
            mgr.open(sp, name="c")
        assert not s.swapped and not b.swapped and mgr.open_sessions == 2
        b.close()
    monkeypatch.setattr(host_tier, "move_pages", real)
    run_chunk(s, sp, 3)
    run_chunk(t, sp, 3)
    assert_equal_views(s, t)
    mgr.close_all()
    mgr.pool.check()
    mgr.host_pool.check()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0


# ------------------------------------------------------------------------------------------------ threads
def test_four_threads_on_six_sessions_of_a_pool_that_holds_two():
    sp = spec(layers=1)
    mgr, _ = two_session_pool(sp, swap_in_wait_s=60.0)
    mgr.clock = time.monotonic
    sessions = [mgr.open(sp, name=f"s{i}") for i in range(6)]
    locks = [threading.Lock() for _ in sessions]  # one thread drives a session at a time (the cache's rule)
    chunks = [0] * 6
    served, errors, count = [0], [], threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(8):
                i = rng.randrange(6)
                with locks[i]:
                    run_chunk(sessions[i], sp, chunks[i], seed=i)
                    chunks[i] += 1
                with count:
                    served[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors and served[0] == 32 and mgr.refusals == 0
    assert mgr.swapped_in_total > 0 and mgr.swap_in_wait_s_total >= 0
    mgr.pool.check()
    mgr.host_pool.check()
    tw = twins(sp, 6)
    for i, t in enumerate(tw):
        for k in range(chunks[i]):
            run_chunk(t, sp, k, seed=i)
        assert_equal_views(sessions[i], t)
    mgr.close_all()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0
    mgr.pool.check()
    mgr.host_pool.check()


def test_a_full_host_tier_and_a_full_device_trade_places_at_the_next_call(monkeypatch):
    sp = spec()
    ta, tb, tc = twins(sp, 3)
    for t in (ta, tb, tc):
        run_chunk(t, sp, 0)
    held = ta.held_pages()
    mgr, _ = two_session_pool(sp, host_pages=held)  # the host tier holds exactly one parked session
    a, b = mgr.open(sp, name="a"), mgr.open(sp, name="b")
    run_chunk(a, sp, 0)
    run_chunk(b, sp, 0)
    c = mgr.open(sp, name="c")  # a goes out: the host tier is full now
    run_chunk(c, sp, 0)
    assert a.swapped and mgr.host_pool.num_free_pages == 0
    before = snapshot(mgr, a, b, c)

    def broken(*args):
        raise RuntimeError("injected copy fault")

    real = host_tier.gather_pages
    monkeypatch.setattr(host_tier, "gather_pages", broken)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        run_chunk(a, sp, 1)  # the trade fails before any page changes hands
    same(snapshot(mgr, a, b, c), before)
    monkeypatch.setattr(host_tier, "gather_pages", real)
    run_chunk(a, sp, 1)  # a and b (the least recently used resident one) trade places
    run_chunk(ta, sp, 1)
    assert not a.swapped and b.swapped and not c.swapped
    assert mgr.swapped_out_total == 2 and mgr.swapped_in_total == 1 and mgr.host_pool.num_free_pages == 0
    mgr.pool.check()
    mgr.host_pool.check()
    for s, t in ((c, tc), (a, ta), (b, tb)):  # b's read trades places with c (4 pages, as b's), not a (8)
        assert_equal_views(s, t)
    assert c.swapped and not b.swapped and mgr.swapped_in_total == 2
    mgr.close_all()
    assert mgr.pool.stats().used_pages == 0 and mgr.host_pool.stats().used_pages == 0
