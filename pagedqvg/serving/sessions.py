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

Complexity: `open` is O(replay of one layer) + O(open sessions); `close` O(pages of the session).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

import pagedqvg.serving.host_tier as host_tier
from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError, SessionRefusedError
from pagedqvg.quant import QuantConfig
from pagedqvg.validation import check_int

__all__ = ["Session", "SessionManager", "SessionSpec", "planned_session_pages"]

#: Builds one cache: `(pool, name, **cache_kwargs) -> cache` (default: `PagedCausalKVCache`).
CacheFactory = Callable[..., object]


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """One session's caches and the work it plans (tokens are slots; `chunks` None: it runs to steady state and
    beyond, so its peak is the steady-state peak)."""

    layers: int
    batch_size: int
    cache_size: int
    num_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: torch.dtype = torch.bfloat16
    cache_sets: int = 1  # e.g. 2 with classifier-free guidance (conditional and unconditional)
    sink_tokens: int = 0
    global_sink_tokens: int = 0
    attention_window_size: int = 0
    denoise_steps: int = 1
    chunks: int | None = None
    quant: QuantConfig | None = None
    #: extra PagedCausalKVCache arguments as (name, value) pairs, e.g. (("use_int_indices", True),); not the
    #: ones that change the page census (allow_growth)
    cache_kwargs: tuple[tuple[str, object], ...] = ()

    @property
    def caches(self) -> int:
        return self.layers * self.cache_sets

    def layer_kwargs(self) -> dict[str, object]:
        """The `PagedCausalKVCache` shape arguments of one layer (pool, device and name excluded)."""
        return dict(
            batch_size=self.batch_size,
            cache_size=self.cache_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            sink_tokens=self.sink_tokens,
            global_sink_tokens=self.global_sink_tokens,
            attention_window_size=self.attention_window_size or None,
            quant=self.quant,
            **dict(self.cache_kwargs),
        )


def _geometry(spec: SessionSpec, page_bytes: int):
    """The planner's `Geometry` of one layer of `spec` on pages of `page_bytes` bytes; CacheConfigError if invalid."""
    from pagedqvg.planning.planner import Geometry

    wording = "{name} must be an int >= 1, got {value!r}"
    for name in ("layers", "cache_sets", "chunk_tokens", "denoise_steps"):
        check_int(f"SessionSpec.{name}", getattr(spec, name), minimum=1, error=CacheConfigError,
                  message=wording, type_message=wording)  # fmt: skip
    if spec.chunks is not None:
        wording = "{name} must be None or an int >= 1, got {value!r}"
        check_int("SessionSpec.chunks", spec.chunks, minimum=1, error=CacheConfigError,
                  message=wording, type_message=wording)  # fmt: skip
    if "allow_growth" in dict(spec.cache_kwargs):
        raise CacheConfigError("SessionSpec.cache_kwargs: allow_growth has no planned peak; sessions need a fixed size")
    try:
        geom = Geometry(
            caches=spec.caches,
            cache_sets=spec.cache_sets,
            batch_size=spec.batch_size,
            heads=spec.num_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            page_bytes=page_bytes,
            tokens_per_frame=1,
            chunk_tokens=spec.chunk_tokens,
            sink_tokens=spec.sink_tokens,
            global_sink_tokens=spec.global_sink_tokens,
            cache_size=spec.cache_size,
            attention_window=spec.attention_window_size,
            scene_cut_every=0,
            denoise_steps=spec.denoise_steps,
            quant=spec.quant if spec.quant is not None else QuantConfig(),
        )
        geom._check()
    except ValueError as exc:
        raise CacheConfigError(f"SessionSpec: {exc}") from None
    return geom


def planned_session_pages(spec: SessionSpec, page_bytes: int) -> int:
    """Pool high-water pages of one session's caches run in the planner's call pattern for `spec.chunks` chunks
    (None: to steady state). O(replay of one layer)."""
    from pagedqvg.planning.planner import replay_chunks, replay_layer

    geom = _geometry(spec, page_bytes)
    steady = replay_chunks(geom)
    chunks = steady if spec.chunks is None else min(spec.chunks, steady)
    return replay_layer(geom, chunks).pool_high_water(spec.caches)


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


class SessionManager:
    """Admits, closes and reclaims sessions on one pool (thread-safe: every step holds the pool's lock).

    Args:
        pool: the shared `BlockPool`.
        idle_timeout_s: a session not touched (`Session.touch()`) for this many seconds is reclaimed by `reclaim()`
            (None: no lease, only dropped sessions are reclaimed).
        clock: seconds, monotonic (default `time.monotonic`; tests pass a fake clock).
        cache_factory: builds a cache from `(pool=..., name=..., device=..., **SessionSpec.layer_kwargs())`
            (default `PagedCausalKVCache`).
        host_pool: a second `BlockPool` (e.g. on "cpu", same page size) for `swap_out` / `swap_in` (None: no host
            tier).
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        idle_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        cache_factory: CacheFactory | None = None,
        host_pool: BlockPool | None = None,
    ) -> None:
        if not isinstance(pool, BlockPool):
            raise CacheConfigError(f"pool must be a pagedqvg.BlockPool, got {type(pool).__name__}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise CacheConfigError(f"idle_timeout_s must be None or > 0 seconds, got {idle_timeout_s!r}")
        self.pool = pool
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._factory = cache_factory
        if host_pool is not None and (not isinstance(host_pool, BlockPool) or host_pool.page_bytes != pool.page_bytes):
            raise CacheConfigError(
                f"host_pool must be a BlockPool with the device pool's {pool.page_bytes} B pages, got {host_pool!r}"
            )
        self.host_pool = host_pool
        self._open: dict[int, _Record] = {}
        self._serial = 0
        self._plans: dict[SessionSpec, int] = {}
        self._changed = threading.Condition(pool.lock)
        self.refusals = 0
        self.reclaimed = 0

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
        """Pages open sessions may still take (planned peak minus pages held now, at least 0). O(caches)."""
        pool = self.pool
        with pool.lock:
            return sum(max(0, r.planned_pages - self._held(r)) for r in self._open.values() if not r.swapped)

    def _held(self, record: _Record) -> int:
        """Pages a record's caches hold toward its plan: all of them, or for a fork those it holds alone."""
        pool = self.pool
        caches = [c for cs in record.caches for c in cs]
        held = sum(pool.pages_of(c.owner) for c in caches)
        return held - sum(pool.shared_pages_of(c.owner) for c in caches) if record.forked else held

    def open(self, spec: SessionSpec, *, name: str | None = None, wait_s: float = 0.0) -> Session:
        """Admit and build one session's caches, or raise SessionRefusedError (nothing allocated) when its planned
        peak does not fit, after reclaiming abandoned sessions and waiting up to `wait_s` seconds for closes."""
        need = self.planned_pages(spec)
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._wait_for_room(lambda: need, deadline, lambda n, available: self._refusal(spec, n, available))
            return self._admit(spec, name, need)

    def adopt(self, caches: list[list], *, name: str | None = None, planned_pages: int = 0) -> Session:
        """Track caches built elsewhere (e.g. by a framework's allocate hook: `caches[set][layer]`, on this pool) as
        one session, so `close` and `reclaim` apply to them. `planned_pages` is reserved like an opened session's plan
        (SessionRefusedError, nothing changed, when it does not fit; 0: nothing reserved). O(open sessions)."""
        pool = self.pool
        for cache in (c for cs in caches for c in cs):
            if getattr(cache, "pool", None) is not pool:
                raise CacheConfigError(f"adopt: {cache!r} is not a cache of this manager's pool {pool!r}")
        with self._changed:
            self.reclaim()
            available = self.available_pages()
            if planned_pages > available:
                self.refusals += 1
                raise self._room_error(f"adopt: {planned_pages} planned pages", planned_pages, available, "")
            self._serial += 1
            sid = self._serial
            session = Session(self, sid, name or f"session{sid}", caches, planned_pages)
            self._open[sid] = _Record(caches, planned_pages, weakref.ref(session), self.clock())
            return session

    def fork(
        self, session: Session, *, name: str | None = None, divergence_pages: int | None = None, wait_s: float = 0.0
    ) -> Session:
        """A new session whose caches are copy-on-write forks of `session`'s (every layer of every cache set, e.g.
        both CFG sets; `PagedCausalKVCache.fork`): 0 bytes copied, its pages shared until either side writes them.

        It is admitted with a reservation for its divergence: `divergence_pages` pages (default and minimum: the
        pages of every cache's current chunk, which its next rewrite copies), counted against the pages the fork
        holds alone, so what it copies or appends draws from its own reservation. SessionRefusedError (nothing
        changed) when the reservation does not fit, after reclaiming and waiting up to `wait_s` seconds;
        CacheConfigError for a closed session or a bad count. O(pages of the session)."""
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
            )  # fmt: skip
            self._serial += 1
            sid = self._serial
            label = name or f"{session.name}.fork{sid}"
            caches = [[c.fork(name=f"{label}.set{s}.layer{i}") for i, c in enumerate(cs)]
                      for s, cs in enumerate(session.caches)]  # fmt: skip
            child = Session(self, sid, label, caches, need)
            self._open[sid] = _Record(caches, need, weakref.ref(child), self.clock(), forked=True)
            return child

    # ---------------------------------------------------------------- the host tier (serving/host_tier.py)
    def swap_out(self, session: Session) -> int:
        """Move every page of an open session into `host_pool` and give its device pages back (its caches refuse
        calls until `swap_in`; it reserves nothing meanwhile). Returns the pages moved. PoolExhaustedError when the
        host pool has no room, CacheConfigError without a host pool or for a session not open here or swapped out
        already: the session stays where it was. O(pages of the session)."""
        record = self._tier_record(session, "swap_out", swapped=False)
        assert self.host_pool is not None
        with self._changed, self.host_pool.lock:
            moved = host_tier.swap_out_caches(self.pool, self.host_pool, [c for cs in record.caches for c in cs])
            record.swapped = True
            self._changed.notify_all()
        return moved

    def swap_in(self, session: Session, *, wait_s: float = 0.0) -> int:
        """Bring a swapped-out session back into any free device pages (views bit-equal to before the swap), once
        its planned peak (at least the pages it brings) fits what open sessions leave, waiting up to `wait_s`
        seconds for closes; returns the pages moved. SessionRefusedError (the session stays on the host) otherwise.
        O(pages of the session)."""
        record = self._tier_record(session, "swap_in", swapped=True)
        caches = [c for cs in record.caches for c in cs]
        need = max(record.planned_pages, sum(len(p) for p in host_tier.session_pages(caches)))
        deadline = time.monotonic() + wait_s
        assert self.host_pool is not None
        with self._changed:
            self._wait_for_room(
                lambda: need,
                deadline,
                lambda n, available: self._room_error(
                    f"swap_in of {session.name}: needs {n} pages", n, available,
                    "; close or swap out sessions, or wait (wait_s)",
                ),
                reclaim=False,
            )  # fmt: skip
            with self.host_pool.lock:
                moved = host_tier.swap_in_caches(self.pool, self.host_pool, caches)
            record.swapped = False
            record.last_used = self.clock()
        return moved

    def _tier_record(self, session: Session, what: str, *, swapped: bool) -> _Record:
        """The record of an open session of this manager in the given swap state; CacheConfigError otherwise."""
        if self.host_pool is None:
            raise CacheConfigError(f"{what}: this SessionManager has no host_pool (give one to use the host tier)")
        record = self._open.get(session.id) if session.manager is self else None
        if record is None or record.swapped != swapped:
            state = "not an open session of this manager" if record is None else (
                "swapped out already" if record.swapped else "not swapped out")  # fmt: skip
            raise CacheConfigError(f"{what}: {session.name} is {state}")
        return record

    def _wait_for_room(
        self,
        need: Callable[[], int],
        deadline: float,
        refusal: Callable[[int, int], SessionRefusedError],
        *,
        reclaim: bool = True,
    ) -> int:
        """With `self._changed` held: wait until `need()` pages fit what open sessions leave (reclaiming abandoned
        sessions before each look when `reclaim`), until `deadline` (`time.monotonic()` seconds); returns the need.
        Otherwise counts a refusal and raises `refusal(need, available)`. O(open sessions) per look."""
        while True:
            if reclaim:
                self.reclaim()
            pages, available = need(), self.available_pages()
            if pages <= available:
                return pages
            left = deadline - time.monotonic()
            if left <= 0:
                self.refusals += 1
                raise refusal(pages, available)
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
            f"free, {self.reserved_pages()} reserved by {len(self._open)} open session(s) for their planned peaks; "
            f"close sessions, wait (wait_s), or plan a smaller one",
            needed_pages=need,
            available_pages=available,
            free_pages=pool.num_free_pages,
            reserved_pages=self.reserved_pages(),
        )

    def _admit(self, spec: SessionSpec, name: str | None, need: int) -> Session:
        self._serial += 1
        sid = self._serial
        label = name or f"session{sid}"
        caches = self._build(spec, label)
        session = Session(self, sid, label, caches, need)
        self._open[sid] = _Record(caches, need, weakref.ref(session), self.clock())
        return session

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

    def _close(self, sid: int) -> None:
        with self._changed:
            record = self._open.pop(sid, None)
            if record is None:
                return
            for cache in (c for cs in record.caches for c in cs):
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
        """Close every abandoned session: its `Session` object is gone, or its lease ran out. Returns how many."""
        with self._changed:
            now = self.clock()
            timeout = self.idle_timeout_s
            dead = [
                sid
                for sid, r in self._open.items()
                if r.ref() is None or (timeout is not None and now - r.last_used > timeout)
            ]
            for sid in dead:
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
