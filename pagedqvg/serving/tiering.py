"""Sessions between the device and the host tier: busy marks, the call gate of a session's caches, LRU victims.

With a host pool, `SessionManager` sets each cache of a session it tracks `cache._tier = SessionCalls(...)`. Every
call of such a cache (update / view / attend / rewind / reset / pin / fork / reads of slots: `_session_call` in
cache/paged_cache.py) runs inside `SessionCalls.call(cache)`: under the pool's lock the session is brought back from
the host first if it is swapped out (`SessionManager.swap_in(session, wait_s=swap_in_wait_s)`, which may swap other
idle sessions out), then counted busy and its `last_used` renewed (O(1): the manager's resident sessions are an
LRU-ordered dict); when the call returns the count drops and waiters are woken. A busy session is never a victim, so
no page of a running call moves; `with session.busy():` marks a session busy for longer (e.g. an SGLang request).
A cache forked from one of them outside the manager (`cache.fork()`) inherits the attribute but not the session:
the gate lets calls of owners it does not know pass.

`make_room(manager, short, exclude)` is the admission option `swap_when_full`: it swaps idle resident sessions out,
least recently used first, until `short` pages are gained or the host pool has no room for the next victim; a
victim whose fork family (its root session and every fork of it) is resident and idle in full goes out with its
family in one move (shared pages copied once). Sessions in `exclude` (the one being admitted, forked, swapped in)
are never victims. A swap-in that does not fit while the host tier is full too trades places with idle resident
sessions (`host_tier.trade_caches`: both sides through transient host memory), so a full host tier never strands a
parked session. O(victims x pages) plus O(resident sessions) per victim.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from pagedqvg.serving import host_tier
from pagedqvg.serving.host_tier import unique_pages

#: serving/sessions.py's SessionManager and its _Record (not imported: sessions.py imports this module)
SessionManager = _Record = Any

__all__ = ["SessionCalls", "make_room", "swap_in_records", "swap_out_records"]


class SessionCalls:
    """The call gate of one session's caches (the cache attribute `_tier`; see the module docstring)."""

    __slots__ = ("manager", "owners", "sid")

    def __init__(self, manager: SessionManager, sid: int, caches: list) -> None:
        self.manager = manager
        self.sid = sid
        self.owners = frozenset(c.owner for c in caches)

    @contextlib.contextmanager
    def call(self, cache) -> Iterator[None]:
        """One call of `cache`: back from the host first (SessionRefusedError if it cannot come back), busy while it
        runs. Re-entrant (a call inside a call counts twice)."""
        if cache.owner not in self.owners:
            yield
            return
        record = self.manager._enter(self.sid, resume=True)
        try:
            yield
        finally:
            if record is not None:
                self.manager._leave(record)

    def resume(self, cache) -> None:
        """Bring the session back from the host if it is swapped out (a call path outside `call`)."""
        if cache.owner in self.owners:
            record = self.manager._enter(self.sid, resume=True)
            if record is not None:
                self.manager._leave(record)


def make_room(manager: SessionManager, short: int, exclude: frozenset[int]) -> int:
    """Swap idle sessions out (LRU first, fork families together) until `short` pages are gained or the next victim
    does not fit the host pool; returns the sessions swapped out. The caller holds the manager's lock. Sets
    `manager._room_note` to why it stopped (for the refusal message)."""
    host = manager.host_pool
    assert host is not None
    gained = swapped = 0
    manager._room_note = ""
    while gained < short:
        group = _next_victims(manager, exclude)
        if not group:
            busy = sum(1 for sid in manager._lru if manager._open[sid].busy)
            manager._room_note = f"no idle session left to swap out ({busy} busy, {len(exclude)} being admitted)"
            break
        caches = [c for r in group for cs in r.caches for c in cs]
        need = unique_pages(caches)
        if need > host.num_free_pages:
            manager._room_note = (
                f"the host tier is full: {host.num_free_pages} of {host.num_pages} host pages free, the next idle "
                f"session(s) need {need}"
            )
            break
        before = manager.available_pages()
        manager._swap_out_records(group)
        gained += manager.available_pages() - before
        swapped += len(group)
    return swapped


def _next_victims(manager: SessionManager, exclude: frozenset[int]) -> list:
    """The least recently used idle resident session not in `exclude`, with the resident members of its fork family
    when all of those are idle and not excluded (in LRU order); [] when there is none."""
    records = manager._open
    for sid in manager._lru:
        record = records[sid]
        if record.busy or sid in exclude:
            continue
        family = [records[m] for m in manager._families.get(record.family, ()) if m in records]
        resident = [r for r in family if not r.swapped]
        if len(resident) > 1 and all(not r.busy and r.sid not in exclude for r in resident):
            order = {s: i for i, s in enumerate(manager._lru)}
            return sorted(resident, key=lambda r: order[r.sid])
        return [record]
    return []


def _caches(records: list[_Record]) -> list:
    return [c for r in records for cs in r.caches for c in cs]


def swap_out_records(manager: SessionManager, records: list[_Record]) -> int:
    """Swap resident `records` out in one move (host_tier.swap_out_caches; the caller holds the manager's lock and
    checked them); returns the distinct pages copied. Counted in the manager's counters; waiters woken."""
    host = manager.host_pool
    assert host is not None
    t0 = time.perf_counter()
    with host.lock:
        moved = host_tier.swap_out_caches(manager.pool, host, _caches(records))
    manager.swap_s_total += time.perf_counter() - t0
    for record in records:
        record.swapped = True
        manager._lru.pop(record.sid, None)
    manager.swapped_out_total += len(records)
    manager.swapped_out_pages += moved
    manager._changed.notify_all()
    return moved


def swap_in_records(manager: SessionManager, records: list[_Record], wait_s: float) -> int:
    """Wait for room (`manager._wait_for_room`, making room with `swap_when_full`) and swap `records` back in, in
    one move; returns the distinct pages copied, 0 when other threads brought every one back meanwhile. The caller
    holds the manager's lock. SessionRefusedError (all of them still on the host) when there is no room in time."""
    host = manager.host_pool
    assert host is not None
    names = ", ".join(manager._name(r) for r in records)

    def parked() -> list[_Record]:
        return [r for r in records if r.swapped and manager._open.get(r.sid) is r]

    def need() -> int:
        left = parked()
        return unique_pages(_caches(left)) + sum(max(0, r.planned_pages - manager._held(r, host)) for r in left)

    left = parked()
    if manager.swap_when_full and left and need() > manager.available_pages():
        traded = _trade(manager, left, need(), frozenset(r.sid for r in records))
        if traded is not None:
            return traded
    manager._wait_for_room(
        need,
        time.monotonic() + wait_s,
        lambda n, available: manager._room_error(
            f"swap_in of {names}: needs {n} pages", n, available, "; close or swap out sessions, or wait (wait_s)"
        ),
        reclaim=False,
        exclude=frozenset(r.sid for r in records),
        done=lambda: not parked(),
    )
    left = parked()
    if not left:
        return 0
    t0 = time.perf_counter()
    with host.lock:
        moved = host_tier.swap_in_caches(manager.pool, host, _caches(left))
    manager.swap_s_total += time.perf_counter() - t0
    now = manager.clock()
    for record in left:
        record.swapped = False
        record.last_used = now
        manager._lru[record.sid] = None
    manager.swapped_in_total += len(left)
    manager.swapped_in_pages += moved
    return moved


def _trade(manager: SessionManager, left: list[_Record], need: int, exclude: frozenset[int]) -> int | None:
    """Bring parked `left` back by trading places with idle resident sessions (LRU first, families together) when the
    victims that make room do not fit the host pool's free pages but do once `left` has left it; returns the pages
    brought in, or None (nothing changed) when a plain swap-out fits or no trade fits."""
    host, device = manager.host_pool, manager.pool
    in_caches = _caches(left)
    available = manager.available_pages()
    chosen: list[_Record] = []
    skip = set(exclude)
    while True:
        out_caches = _caches(chosen)
        gained = host_tier.freed_by(device, out_caches) + sum(
            max(0, r.planned_pages - manager._held(r)) for r in chosen
        )
        if need <= available + gained:
            break
        group = _next_victims(manager, frozenset(skip))
        if not group:
            return None
        skip.update(r.sid for r in group)
        chosen += group
    out_pages = unique_pages(out_caches)
    if out_pages <= host.num_free_pages or out_pages > host.num_free_pages + host_tier.freed_by(host, in_caches):
        return None
    t0 = time.perf_counter()
    with host.lock:
        moved_out, moved_in = host_tier.trade_caches(device, host, out_caches, in_caches)
    manager.swap_s_total += time.perf_counter() - t0
    now = manager.clock()
    for record in chosen:
        record.swapped = True
        manager._lru.pop(record.sid, None)
    for record in left:
        record.swapped = False
        record.last_used = now
        manager._lru[record.sid] = None
    manager.swapped_out_total += len(chosen)
    manager.swapped_out_pages += moved_out
    manager.swapped_in_total += len(left)
    manager.swapped_in_pages += moved_in
    manager._changed.notify_all()
    return moved_in
