"""Sessions on one pool: admission by planned peak, close (every page back at once), deterministic reclaim.

A serving process holds many cache sets on one `BlockPool` for their lifetimes (a request, a realtime session, a
prompt of a batch). `SessionManager.open(spec)` builds one session's caches (`cache_sets` sets of `layers` layers)
only if the session's planned peak fits: the planner's page census of one layer (`planner.replay_layer`, the cache's
own sequencing and pack policy with a page counter) gives the pool high-water of the session's caches driven in the
planner's call pattern (per chunk and denoise step, each cache in turn). Every open session reserves its planned
peak; a new one is admitted when

    planned_pages(new) <= pool free pages - sum over open sessions of (planned_pages - pages held now)

so sessions that stay within their plan never meet `PoolExhaustedError`, whatever else holds pages of the pool.
Otherwise `SessionRefusedError` (a `PoolExhaustedError`) names what is free, what is reserved and what the session
needs; `open(spec, wait_s=...)` queues instead, until a close frees enough or the wait ends.

`Session.close()` closes every cache of the set under the pool's lock (the pages go back in one critical section).
`reclaim()` closes abandoned sessions deterministically: sessions whose `Session` object is gone (no reference
left; CPython frees it at once, no garbage collection needed) and sessions idle longer than `idle_timeout_s` (a
lease renewed by `Session.touch()`). `open` reclaims before it refuses.

With a host tier (`host_pool=`; host_tier.py, tiering.py): `swap_out(session, *more)` parks sessions' pages in
host memory (a page several of them share is copied once) and `swap_in` brings them back; a parked session also
comes back at the next call of any of its caches. `swap_when_full=True` makes admission (`open`, `adopt`, `fork`,
`swap_in`) swap idle sessions out, least recently used first, before it waits or refuses; `with session.busy():`
keeps a session resident. `SessionSpec` and the planned peak live in spec.py.

Complexity: `open` is O(replay of one layer) + O(resident sessions); `close` O(pages of the session).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pagedqvg.serving.host_tier as host_tier
import pagedqvg.serving.tiering as tiering
from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError, SessionRefusedError
from pagedqvg.serving.spec import CacheFactory, SessionSpec, _geometry, planned_session_pages  # noqa: F401
from pagedqvg.validation import check_int

__all__ = ["Session", "SessionManager", "SessionSpec", "planned_session_pages"]


class Session:
    """One admitted session: `caches[s][l]` is cache set `s`, layer `l`. Close it (or use it as a context manager)
    to give every page back; `touch()` renews its lease when the manager has an idle timeout."""

    def __init__(self, manager: SessionManager, sid: int, name: str, caches: list[list], planned_pages: int) -> None:
        self.manager = manager
        self.id = sid
        self.name = name
        self.caches = caches
        self.planned_pages = planned_pages

    @property
    def closed(self) -> bool:
        return self.id not in self.manager._open

    @property
    def swapped(self) -> bool:
        """True while the session's pages are in the host pool (its next call brings it back)."""
        record = self.manager._open.get(self.id)
        return record is not None and record.swapped

    @property
    def last_used(self) -> float | None:
        """The manager's clock at the session's last call or `touch()` (None once closed)."""
        record = self.manager._open.get(self.id)
        return None if record is None else record.last_used

    @contextlib.contextmanager
    def busy(self) -> Iterator[Session]:
        """`with session.busy():` the session is never swapped out (re-entrant, thread-safe; e.g. for the whole of a
        request); a swapped-out session stays swapped until its next call. O(1)."""
        record = self.manager._enter(self.id, resume=False)
        try:
            yield self
        finally:
            if record is not None:
                self.manager._leave(record)

    def held_pages(self) -> int:
        """Pages the session's caches hold now. O(caches)."""
        return sum(self.manager.pool.pages_of(c.owner) for cs in self.caches for c in cs)

    def touch(self) -> None:
        """Renew the lease (the idle timeout counts from now). O(1)."""
        self.manager._touch(self.id)

    def close(self) -> None:
        """Every cache closed, every page back, in one critical section of the pool. Idempotent."""
        self.manager._close(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.held_pages()} of {self.planned_pages} planned pages"
        return f"Session({self.name}: {len(self.caches)} sets x {len(self.caches[0])} layers, {state})"


@dataclass(slots=True)
class _Record:
    caches: list[list]
    planned_pages: int
    ref: weakref.ref
    last_used: float
    #: a fork's record: its plan counts only the pages it holds alone (the shared ones are its parent's)
    forked: bool = False
    #: swapped out to the host pool: it reserves nothing on the device until `swap_in`
    swapped: bool = False
    sid: int = 0
    #: calls running and `busy()` blocks entered (never swapped out while > 0)
    busy: int = 0
    #: the fork family: the id of the session it was (transitively) forked from, else its own
    family: int = 0


class SessionManager:
    """Admits, closes, reclaims and (with a host tier) swaps sessions on one pool (thread-safe: every step holds the
    pool's lock).

    Args:
        pool: the shared `BlockPool`.
        idle_timeout_s: a session not touched (`Session.touch()`) for this many seconds is reclaimed by `reclaim()`
            (None: no lease, only dropped sessions are reclaimed).
        clock: seconds, monotonic (default `time.monotonic`; tests pass a fake clock).
        cache_factory: builds a cache from `(pool=..., name=..., device=..., **SessionSpec.layer_kwargs())`
            (default `PagedCausalKVCache`).
        host_pool: the host tier for `swap_out` / `swap_in`: a second `BlockPool` with the device pool's page size
            (e.g. on "cpu"), or its size in bytes (`host_tier.host_pool_for`: on "cpu", pinned for a CUDA pool);
            None: no host tier. With one, a swapped-out session comes back at the next call of any of its caches
            (`swap_in(session, wait_s=swap_in_wait_s)`; SessionRefusedError from that call, the cache unchanged and
            still swapped, when it cannot).
        swap_when_full: an `open`, `adopt`, `fork` or `swap_in` that does not fit first swaps idle sessions out
            (least recently used first, fork families together; never a busy one or the one being admitted) until
            it fits or the host pool has no room for the next one, and only then waits / refuses (default False;
            CacheConfigError without a host pool).
        swap_in_wait_s: seconds a call of a swapped-out session waits for room to come back (default 0.0).

    Counters: `refusals`, `reclaimed`, `swapped_out_total` / `swapped_in_total` (sessions), `swapped_out_pages` /
    `swapped_in_pages` (distinct pages copied), `swap_s_total` (seconds in page moves), `swap_in_wait_s_total` and
    `swap_in_wait_s_max` (seconds calls of swapped-out sessions waited to be back: room and copies).
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        idle_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        cache_factory: CacheFactory | None = None,
        host_pool: BlockPool | int | None = None,
        swap_when_full: bool = False,
        swap_in_wait_s: float = 0.0,
    ) -> None:
        if not isinstance(pool, BlockPool):
            raise CacheConfigError(f"pool must be a pagedqvg.BlockPool, got {type(pool).__name__}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise CacheConfigError(f"idle_timeout_s must be None or > 0 seconds, got {idle_timeout_s!r}")
        if isinstance(host_pool, int) and not isinstance(host_pool, bool):
            try:
                host_pool = host_tier.host_pool_for(pool, host_pool)
            except ValueError as exc:
                raise CacheConfigError(f"host_pool of {host_pool} bytes: {exc}") from None
        if host_pool is not None and (not isinstance(host_pool, BlockPool) or host_pool.page_bytes != pool.page_bytes):
            raise CacheConfigError(
                f"host_pool must be a BlockPool with the device pool's {pool.page_bytes} B pages (or its size in "
                f"bytes), got {host_pool!r}"
            )
        if not isinstance(swap_when_full, bool) or (swap_when_full and host_pool is None):
            raise CacheConfigError(f"swap_when_full=True needs a host_pool; got {swap_when_full!r} with {host_pool!r}")
        if isinstance(swap_in_wait_s, bool) or not isinstance(swap_in_wait_s, int | float) or not swap_in_wait_s >= 0:
            raise CacheConfigError(f"swap_in_wait_s must be seconds >= 0, got {swap_in_wait_s!r}")
        self.pool = pool
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._factory = cache_factory
        self.host_pool = host_pool
        self.swap_when_full = swap_when_full
        self.swap_in_wait_s = float(swap_in_wait_s)
        self._open: dict[int, _Record] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident (not swapped) sessions, least recent first
        self._families: dict[int, set[int]] = {}  # family id -> its open sessions (forks only)
        self._dropped: deque[int] = deque()  # sessions whose Session object is gone (weakref callbacks)
        self._serial = 0
        self._plans: dict[SessionSpec, int] = {}
        self._changed = threading.Condition(pool.lock)
        self._room_note = ""
        self.refusals = 0
        self.reclaimed = 0
        self.swapped_out_total = self.swapped_in_total = 0
        self.swapped_out_pages = self.swapped_in_pages = 0
        self.swap_s_total = self.swap_in_wait_s_total = self.swap_in_wait_s_max = 0.0

    # ---------------------------------------------------------------- admission
    def planned_pages(self, spec: SessionSpec) -> int:
        """The session's planned peak in pages (cached per spec). O(replay) the first time, then O(1)."""
        pages = self._plans.get(spec)
        if pages is None:
            pages = self._plans[spec] = planned_session_pages(spec, self.pool.page_bytes)
        return pages

    def available_pages(self) -> int:
        """Pages a new session may plan for: free pages minus what open sessions may still take of their plans."""
        with self.pool.lock:
            return self.pool.num_free_pages - self.reserved_pages()

    def reserved_pages(self) -> int:
        """Pages resident sessions may still take (planned peak minus pages held now, at least 0; a swapped-out
        session reserves nothing). O(resident sessions x caches)."""
        with self.pool.lock:
            records = self._open
            return sum(max(0, records[sid].planned_pages - self._held(records[sid])) for sid in self._lru)

    def _held(self, record: _Record, pool: BlockPool | None = None) -> int:
        """Pages a record's caches hold toward its plan in `pool` (default the device pool): all of them, or for a
        fork those it holds alone."""
        pool = self.pool if pool is None else pool
        caches = [c for cs in record.caches for c in cs]
        held = sum(pool.pages_of(c.owner) for c in caches)
        return held - sum(pool.shared_pages_of(c.owner) for c in caches) if record.forked else held

    def open(self, spec: SessionSpec, *, name: str | None = None, wait_s: float = 0.0) -> Session:
        """Admit and build one session's caches, or raise SessionRefusedError (nothing allocated) when its planned
        peak does not fit, after reclaiming abandoned sessions, swapping idle ones out (`swap_when_full`) and
        waiting up to `wait_s` seconds for closes."""
        need = self.planned_pages(spec)
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._wait_for_room(lambda: need, deadline, lambda n, available: self._refusal(spec, n, available))
            return self._admit(spec, name, need)

    def adopt(self, caches: list[list], *, name: str | None = None, planned_pages: int = 0) -> Session:
        """Track caches built elsewhere (e.g. by a framework's allocate hook: `caches[set][layer]`, on this pool) as
        one session, so `close`, `reclaim` and the host tier apply to them. `planned_pages` is reserved like an opened
        session's plan (SessionRefusedError, nothing changed, when it does not fit after `swap_when_full`'s swaps;
        0: nothing reserved). O(open sessions)."""
        pool = self.pool
        for cache in (c for cs in caches for c in cs):
            if getattr(cache, "pool", None) is not pool:
                raise CacheConfigError(f"adopt: {cache!r} is not a cache of this manager's pool {pool!r}")
        with self._changed:
            self._wait_for_room(
                lambda: planned_pages,
                time.monotonic(),
                lambda n, available: self._room_error(f"adopt: {planned_pages} planned pages", n, available, ""),
            )
            return self._track(caches, name, planned_pages)

    def fork(
        self, session: Session, *, name: str | None = None, divergence_pages: int | None = None, wait_s: float = 0.0
    ) -> Session:
        """A new session whose caches are copy-on-write forks of `session`'s (every layer of every cache set, e.g.
        both CFG sets; `PagedCausalKVCache.fork`): 0 bytes copied, its pages shared until either side writes them.

        It is admitted with a reservation for its divergence: `divergence_pages` pages (default and minimum: the
        pages of every cache's current chunk, which its next rewrite copies), counted against the pages the fork
        holds alone, so what it copies or appends draws from its own reservation. SessionRefusedError (nothing
        changed) when the reservation does not fit, after reclaiming, swapping idle sessions out (`swap_when_full`;
        never `session`) and waiting up to `wait_s` seconds; CacheConfigError for a closed or swapped-out session
        or a bad count. O(pages of the session)."""
        if session.manager is not self or session.closed or self._open[session.id].swapped:
            raise CacheConfigError(f"fork: {session.name} is not an open session of this manager on the device")
        if divergence_pages is not None:
            check_int("fork: divergence_pages", divergence_pages, minimum=0, error=CacheConfigError)
        deadline = time.monotonic() + wait_s
        with self._changed:
            need = self._wait_for_room(
                lambda: max(divergence_pages or 0, _current_chunk_pages(session.caches)),
                deadline,
                lambda n, available: self._room_error(
                    f"fork of {session.name}: its divergence needs {n} pages", n, available,
                    "; close sessions, wait (wait_s), or plan less divergence",
                ),
                exclude=frozenset((session.id,)),
            )  # fmt: skip
            parent = self._open.get(session.id)
            if parent is None or parent.swapped:  # closed or swapped out while this waited
                raise CacheConfigError(f"fork: {session.name} was closed or swapped out while the fork waited")
            label = name or f"{session.name}.fork{self._serial + 1}"
            caches = [[c.fork(name=f"{label}.set{s}.layer{i}") for i, c in enumerate(cs)]
                      for s, cs in enumerate(session.caches)]  # fmt: skip
            child = self._track(caches, label, need, forked=True, family=parent.family)
            self._families.setdefault(parent.family, {parent.family}).add(child.id)
            return child

    # ---------------------------------------------------------------- the host tier (host_tier.py, tiering.py)
    def swap_out(self, session: Session, *more: Session) -> int:
        """Move every page of open sessions (e.g. a parent and its forks: a page several of them hold is copied
        once) into `host_pool` and give their device pages back (their next call brings them back; they reserve
        nothing meanwhile). Returns the distinct pages copied. PoolExhaustedError when the host pool has no room, an
        error of the copy as raised, CacheConfigError without a host pool or for a session not open here, swapped
        out already, listed twice or busy: every session stays where it was. O(pages of the sessions)."""
        with self._changed:
            records = self._tier_records((session, *more), "swap_out", swapped=False)
            for s, r in zip((session, *more), records, strict=True):
                if r.busy:
                    raise CacheConfigError(f"swap_out: {s.name} is busy (a call or a busy() block is running)")
            return self._swap_out_records(records)

    def swap_in(self, session: Session, *more: Session, wait_s: float = 0.0) -> int:
        """Bring swapped-out sessions back into any free device pages (views bit-equal to before the swap; a page
        several of them share comes back as one shared page) once their planned peaks (at least the pages they
        bring) fit what resident sessions leave, after swapping idle sessions out (`swap_when_full`) and waiting up
        to `wait_s` seconds for room; returns the distinct pages copied. SessionRefusedError (every session stays
        on the host) otherwise; CacheConfigError for a session not swapped out. O(pages of the sessions)."""
        with self._changed:
            records = self._tier_records((session, *more), "swap_in", swapped=True)
            return self._swap_in_records(records, wait_s)

    def _swap_out_records(self, records: list[_Record]) -> int:
        """Swap resident `records` out together (the caller holds the lock and checked them): `tiering`."""
        return tiering.swap_out_records(self, records)

    def _swap_in_records(self, records: list[_Record], wait_s: float) -> int:
        """Wait for room and swap `records` back in together (the caller holds the lock): `tiering`."""
        return tiering.swap_in_records(self, records, wait_s)

    def _tier_records(self, sessions: tuple[Session, ...], what: str, *, swapped: bool) -> list[_Record]:
        """The records of distinct open sessions of this manager in the given swap state; CacheConfigError
        otherwise."""
        if self.host_pool is None:
            raise CacheConfigError(f"{what}: this SessionManager has no host_pool (give one to use the host tier)")
        records = []
        for session in sessions:
            record = self._open.get(session.id) if isinstance(session, Session) and session.manager is self else None
            if record is None or record.swapped != swapped or record in records:
                state = "not an open session of this manager" if record is None else (
                    "listed twice" if record in records else
                    "swapped out already" if record.swapped else "not swapped out")  # fmt: skip
                raise CacheConfigError(f"{what}: {getattr(session, 'name', session)!r} is {state}")
            records.append(record)
        return records

    def _enter(self, sid: int, *, resume: bool) -> _Record | None:
        """A call (or a `busy()` block) of session `sid` starts: back from the host first when `resume` and it is
        swapped out (SessionRefusedError if it cannot come back), then busy, its last use renewed. None for a
        closed session."""
        with self._changed:
            record = self._open.get(sid)
            if record is None:
                return None
            if resume and record.swapped:
                t0 = time.monotonic()
                try:
                    self._swap_in_records([record], self.swap_in_wait_s)
                finally:
                    waited = time.monotonic() - t0
                    self.swap_in_wait_s_total += waited
                    self.swap_in_wait_s_max = max(self.swap_in_wait_s_max, waited)
                if self._open.get(sid) is not record:
                    return None  # closed while it waited: the call raises CacheClosedError
            record.busy += 1
            record.last_used = self.clock()
            if sid in self._lru:
                self._lru.move_to_end(sid)
            return record

    def _leave(self, record: _Record) -> None:
        """The call (or `busy()` block) that `_enter` started ended; waiters for idle sessions are woken."""
        with self._changed:
            record.busy -= 1
            if not record.busy:
                self._changed.notify_all()

    def _wait_for_room(
        self,
        need: Callable[[], int],
        deadline: float,
        refusal: Callable[[int, int], SessionRefusedError],
        *,
        reclaim: bool = True,
        exclude: frozenset[int] = frozenset(),
        done: Callable[[], bool] | None = None,
    ) -> int:
        """With `self._changed` held: wait until `need()` pages fit what resident sessions leave (reclaiming
        abandoned sessions before each look when `reclaim`; swapping idle sessions out of `exclude` first with
        `swap_when_full`), or until `done()`, until `deadline` (`time.monotonic()` seconds); returns the need.
        Otherwise counts a refusal and raises `refusal(need, available)` (with `swap_when_full`, saying how many
        sessions were swapped out and why it stopped). O(resident sessions) per look."""
        swapped = 0
        while True:
            if reclaim:
                self.reclaim()
            if done is not None and done():
                return 0
            pages, available = need(), self.available_pages()
            if pages > available and self.swap_when_full:
                swapped += tiering.make_room(self, pages - available, exclude)
                pages, available = need(), self.available_pages()
            if pages <= available:
                return pages
            left = deadline - time.monotonic()
            if left <= 0:
                self.refusals += 1
                exc = refusal(pages, available)
                if self.swap_when_full:
                    exc.args = (f"{exc.args[0]} (swap_when_full swapped {swapped} idle session(s) out first; "
                                f"then {self._room_note})",)  # fmt: skip
                raise exc
            self._changed.wait(left)

    def _room_error(self, head: str, need: int, available: int, advice: str) -> SessionRefusedError:
        """`SessionRefusedError` "`head`, but only N are available (F of T free, R reserved)`advice`" with its
        page counts."""
        pool, reserved = self.pool, self.reserved_pages()
        return SessionRefusedError(
            f"{head}, but only {available} are available ({pool.num_free_pages} of {pool.num_pages} free, "
            f"{reserved} reserved){advice}",
            needed_pages=need, available_pages=available, free_pages=pool.num_free_pages, reserved_pages=reserved,
        )  # fmt: skip

    def _refusal(self, spec: SessionSpec, need: int, available: int) -> SessionRefusedError:
        pool = self.pool
        return SessionRefusedError(
            f"session of {spec.cache_sets} set(s) x {spec.layers} layers needs {need} pages of {pool.page_bytes} B "
            f"at its planned peak, but only {available} are available: {pool.num_free_pages} of {pool.num_pages} "
            f"free, {self.reserved_pages()} reserved by {len(self._lru)} resident session(s) for their planned "
            f"peaks; close sessions, wait (wait_s), or plan a smaller one",
            needed_pages=need,
            available_pages=available,
            free_pages=pool.num_free_pages,
            reserved_pages=self.reserved_pages(),
        )

    def _admit(self, spec: SessionSpec, name: str | None, need: int) -> Session:
        label = name or f"session{self._serial + 1}"
        return self._track(self._build(spec, label), label, need)

    def _track(
        self, caches: list[list], name: str | None, planned: int, *, forked: bool = False, family: int = 0
    ) -> Session:
        """A new record and `Session` for `caches` (resident, most recently used; the caller holds the lock)."""
        self._serial += 1
        sid = self._serial
        session = Session(self, sid, name or f"session{sid}", caches, planned)
        ref = weakref.ref(session, lambda _, sid=sid, dropped=self._dropped: dropped.append(sid))
        record = _Record(caches, planned, ref, self.clock(), forked=forked, sid=sid, family=family or sid)
        self._open[sid] = record
        self._lru[sid] = None
        if self.host_pool is not None:
            gate = tiering.SessionCalls(self, sid, [c for cs in caches for c in cs])
            for cache in gate_targets(caches):
                cache._tier = gate
        return session

    def _name(self, record: _Record) -> str:
        session = record.ref()
        return session.name if session is not None else f"session{record.sid}"

    def _build(self, spec: SessionSpec, label: str) -> list[list]:
        """Every cache of the session; on a failure the ones built are closed again (nothing stays allocated)."""
        factory = self._factory
        if factory is None:
            from pagedqvg.cache.paged_cache import PagedCausalKVCache

            factory = PagedCausalKVCache
        built: list[list] = []
        try:
            for s in range(spec.cache_sets):
                built.append([])
                for layer in range(spec.layers):
                    name = f"{label}.set{s}.layer{layer}"
                    built[-1].append(factory(pool=self.pool, name=name, device=self.pool.device, **spec.layer_kwargs()))
        except BaseException:
            for cache in (c for cs in built for c in cs):
                cache.close()
            raise
        return built

    # ---------------------------------------------------------------- closing
    def _touch(self, sid: int) -> None:
        with self.pool.lock:
            record = self._open.get(sid)
            if record is not None:
                record.last_used = self.clock()
                if sid in self._lru:
                    self._lru.move_to_end(sid)

    def _close(self, sid: int) -> None:
        with self._changed:
            record = self._open.pop(sid, None)
            if record is None:
                return
            self._lru.pop(sid, None)
            family = self._families.get(record.family)
            if family is not None:
                family.discard(sid)
                if not family:
                    del self._families[record.family]
            for cache in (c for cs in record.caches for c in cs):
                cache._tier = None
                if record.swapped:  # its segments list host pages: those go back, the cache is emptied
                    assert self.host_pool is not None
                    self.host_pool.release_owner(cache.owner)
                    cache._seq.reset()
                    cache._structure_changed()
                    cache._closed = True
                    continue
                cache.close()
            self._changed.notify_all()

    def reclaim(self) -> int:
        """Close every abandoned session: its `Session` object is gone, or its lease ran out. Returns how many.
        O(dropped sessions), plus O(open sessions) with an idle timeout."""
        with self._changed:
            dead: set[int] = set()
            while self._dropped:
                sid = self._dropped.popleft()
                if sid in self._open:
                    dead.add(sid)
            timeout = self.idle_timeout_s
            if timeout is not None:
                now = self.clock()
                dead.update(sid for sid, r in self._open.items() if now - r.last_used > timeout and not r.busy)
            for sid in sorted(dead):
                self._close(sid)
            self.reclaimed += len(dead)
            return len(dead)

    def close_all(self) -> None:
        """Close every open session."""
        with self._changed:
            for sid in list(self._open):
                self._close(sid)

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    @property
    def swapped_sessions(self) -> int:
        """Open sessions swapped out to the host pool now. O(1)."""
        return len(self._open) - len(self._lru)


def gate_targets(caches: list[list]) -> list:
    """The caches of a session that take the host tier's call gate (those with a `_tier` hook:
    `PagedCausalKVCache` and its subclasses; a foreign cache factory's objects without one are left alone)."""
    return [c for cs in caches for c in cs if hasattr(type(c), "_tier")]


def _current_chunk_pages(caches: list[list]) -> int:
    """Pages of every cache's current chunk (the segments holding tokens from its start to the end): what the first
    rewrite of a fork copies. O(caches x segments of the chunk)."""
    total = 0
    for cache in (c for cs in caches for c in cs):
        seq = cache._seq
        start, end = seq.current_chunk_start(), seq.state.global_end
        if end > start:
            total += sum(len(e.value.pages) for e in seq.index.overlapping(start, end))
    return total
