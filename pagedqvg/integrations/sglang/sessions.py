"""The caches of every SGLang allocation as one `SessionManager` session: admitted, closed when the request ends.

SGLang 0.5.23's causal stages allocate a layer-list of KV caches per request (`_allocate_causal_kv_cache`; twice with
classifier-free guidance). `admit(stage, caches, ...)` (called by `build_paged_caches` for every allocation) makes the
list one session of the pool's `SessionManager`:

- **Admission** by planned peak: the session reserves the page census of its caches run in the stage's chunk
  pattern (`SessionSpec`: blocks, batch, window, heads, head_dim, sinks, quantization; chunk = the stage's
  `num_frames_per_block x num_token_per_frame` tokens, or the largest chunk the window holds when the stage does not
  say). A list that does not fit the pool's free pages minus what open sessions may still take is refused with
  `SessionRefusedError` naming the stage, the pages needed, free and reserved, at allocation, before any token is
  written (nothing stays allocated), instead of a `PoolExhaustedError` deep inside a forward.
- **The list holds its session**: SGLang gets a `SessionCaches` (a `list` of the caches with a `session`
  attribute). While SGLang keeps the list (the stage's `causal_kv_cache`, a realtime session's state), the session
  is open; once SGLang drops it, the session is abandoned and `SessionManager.reclaim()` closes it at the next
  reclaim point (every admission and every request end): deterministic, no garbage collection involved.
- **Request end** (`request_scope`, entered by the AROUND hook on the stages' `forward`): when the outermost forward
  returns or raises, every session the request allocated is closed (all pages back in one critical section) and the
  stage's references to it (`causal_kv_cache` / `causal_kv_cache_neg` and their cross-attention partners) are cleared
  so that the next request allocates (and is admitted) afresh, except a list a realtime session state holds
  (`batch.session`, SGLang's `RealtimeSession`: LingBot-World keeps its caches across chunk calls); that one stays
  open until SGLang disposes the state (`dispose_before`, a BEFORE hook on `RealtimeCausalDiTState.dispose`:
  release, eviction, a restart at block 0) or drops it. Then abandoned sessions of every pool are reclaimed.

So after each request the pool holds only the pages of realtime sessions SGLang keeps; with none, 0 pages.

**The host tier** (PAGEDQVG_HOST_BUDGET, `install(host_budget_bytes=...)`): the pool's manager has a CPU host pool and
`swap_when_full`. Every session of a request is busy for the request (`Session.busy()`, entered by `request_scope`
for the sessions it admits and for the lists the request's realtime session state holds, left when the outermost
scope ends), so nothing a request runs on is swapped out under it. Between chunk calls a kept realtime session is
idle: an admission (another request, another realtime session) that does not fit swaps idle sessions out to the host
pool, least recently used first, instead of refusing; the swapped session comes back at its next chunk call, at the
first call on one of its caches (views bit-equal), swapping other idle sessions out if it must. Disposing a swapped
session frees its host pages. So after each request: device pages only of kept realtime sessions, host pages only of
swapped ones, 0 on both once SGLang disposes them.
Complexity: admit O(planner replay of one layer, cached per shape) + O(open sessions); request end O(pages closed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError, SessionRefusedError
from pagedqvg.integrations.sglang.runtime import integration
from pagedqvg.integrations.sglang.versions import realtime_states
from pagedqvg.serving.sessions import Session, SessionManager, SessionSpec

__all__ = [
    "SessionCaches",
    "admit",
    "chunk_tokens",
    "dispose_before",
    "forward_around",
    "host_pages_in_use",
    "manager_for",
    "pages_in_use",
    "request_scope",
]


class SessionCaches(list):
    """The caches of one allocation (one per transformer block), as SGLang gets them: a `list`, holding the
    `Session` that owns them (`session`), so the session lives exactly as long as SGLang keeps the list."""

    __slots__ = ("session",)

    def __init__(self, caches: list, session: Session) -> None:
        super().__init__(caches)
        self.session = session


def manager_for(pool: BlockPool) -> SessionManager:
    """The one `SessionManager` of `pool` (made at its first session; `SGLangIntegration.manager_for`). O(1)."""
    return integration().manager_for(pool)


def forget_managers() -> None:
    """Drop the managers (`uninstall()`): sessions already open stay open; their caches keep working."""
    integ = integration()
    with integ.lock:
        integ.managers.clear()


def chunk_tokens(stage: Any, window: int) -> int:
    """Tokens per chunk of `stage` (`num_frames_per_block x num_token_per_frame`), else `window` (the largest)."""
    frames, per_frame = getattr(stage, "num_frames_per_block", None), getattr(stage, "num_token_per_frame", None)
    if all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (frames, per_frame)):
        return min(frames * per_frame, window)
    return window


def session_spec(stage: Any, caches: list, *, allow_growth: bool) -> SessionSpec | None:
    """The `SessionSpec` of one allocation's caches in `stage`'s chunk pattern; None when no peak can be planned
    (growth, or a geometry the planner refuses, e.g. a chunk larger than the window)."""
    first = caches[0]
    sink = max(first.sink_tokens, first.global_sink_tokens)
    if allow_growth or first.cache_size - sink < 1:
        return None
    return SessionSpec(
        layers=len(caches),
        batch_size=first.batch_size,
        cache_size=first.cache_size,
        num_heads=first.num_cache_heads,
        head_dim=first.head_dim,
        chunk_tokens=chunk_tokens(stage, first.cache_size - sink),
        dtype=first.dtype,
        sink_tokens=first.sink_tokens,
        global_sink_tokens=first.global_sink_tokens,
        attention_window_size=first.attention_window_size,
        quant=first.quant,
    )


def _planned_pages(manager: SessionManager, spec: SessionSpec | None) -> int:
    if spec is None:
        return 0
    try:
        return manager.planned_pages(spec)
    except CacheConfigError:
        return 0  # the planner refuses this geometry: the session is tracked and closed, not reserved


def admit(stage: Any, caches: list, *, allow_growth: bool = False) -> SessionCaches:
    """`caches` (one allocation, built on one pool, no token written) as one session: reserved at its planned peak,
    registered with the current request scope. SessionRefusedError (the caches closed, the pool as before) when the
    plan does not fit. O(replay) the first time a shape is seen, then O(open sessions)."""
    pool = caches[0].pool
    manager = manager_for(pool)
    spec = session_spec(stage, caches, allow_growth=allow_growth)
    need = _planned_pages(manager, spec)
    label = f"{type(stage).__name__}.kv{len(caches)}"
    try:
        session = manager.adopt([list(caches)], name=label, planned_pages=need)
    except SessionRefusedError as exc:
        for cache in caches:
            cache.close()
        raise _refusal(stage, caches, spec, exc) from None
    out = SessionCaches(caches, session)
    stack = getattr(integration().scopes, "stack", None)
    if stack:
        stack[0].allocated.append(out)
        stack[0].hold(session)
    return out


def _refusal(stage: Any, caches: list, spec: SessionSpec | None, exc: SessionRefusedError) -> SessionRefusedError:
    first = caches[0]
    chunk = f"chunks of {spec.chunk_tokens} tokens" if spec is not None else "no chunk plan"
    pool = first.pool
    tier, note = ", set PAGEDQVG_HOST_BUDGET (a host tier for idle realtime sessions)", ""
    if manager_for(pool).host_pool is not None:  # the manager's note: the idle sessions it swapped out, why it stopped
        tier, said = " or PAGEDQVG_HOST_BUDGET", str(exc)
        note = f" {said[said.index('(swap_when_full') :]}" if "(swap_when_full" in said else ""
    return SessionRefusedError(
        f"{type(stage).__name__}: KV caches of {len(caches)} blocks x batch {first.batch_size} x {first.cache_size} "
        f"slots x {first.num_cache_heads} heads x {first.head_dim} ({first.dtype}, {chunk}) need {exc.needed_pages} "
        f"pages of {pool.page_bytes} B at their planned peak, but only {exc.available_pages} are available: "
        f"{exc.free_pages} of {pool.num_pages} free, {exc.reserved_pages} reserved by open sessions; raise "
        f"PAGEDQVG_BUDGET (install(budget_bytes=...)){tier}, end realtime sessions, or quantize "
        f"(PAGEDQVG_KV_CACHE_QUANT){note}",
        needed_pages=exc.needed_pages,
        available_pages=exc.available_pages,
        free_pages=exc.free_pages,
        reserved_pages=exc.reserved_pages,
    )


def _realtime_lists(batch: Any) -> list[Any]:
    """The cache lists the request's realtime session (SGLang's `RealtimeSession`) keeps across calls."""
    states = realtime_states(getattr(batch, "session", None))
    return [getattr(state, "kv_cache", None) for state in states.values()]


class _Scope:
    """One request (the outermost `request_scope` of a thread): the sessions it allocated and the busy marks it
    holds (`Session.busy()` on a manager with a host tier: never swapped out while the request runs)."""

    __slots__ = ("allocated", "marks")

    def __init__(self) -> None:
        self.allocated: list[SessionCaches] = []
        self.marks = ExitStack()

    def hold(self, session: Session) -> None:
        """`session` busy until the request ends (only where a host tier could swap it out). O(1)."""
        if session.manager.host_pool is not None and not session.closed:
            self.marks.enter_context(session.busy())

    def hold_realtime(self, batch: Any) -> None:
        """The lists the request's realtime session state keeps (from earlier chunk calls) busy for this call; no
        reference to a list is kept (a restart at block 0 drops the old one: it must be reclaimable)."""
        for caches in _realtime_lists(batch):
            if isinstance(caches, SessionCaches):
                self.hold(caches.session)


_STAGE_REFS = (("causal_kv_cache", "crossattn_cache"), ("causal_kv_cache_neg", "crossattn_cache_neg"))


def end_request(stage: Any, batch: Any, allocated: list[SessionCaches]) -> None:
    """Close every session of `allocated` no realtime state keeps and clear `stage`'s references to it; then
    reclaim abandoned sessions of every pool and tell the listeners. O(pages closed + open sessions)."""
    kept = {id(caches) for caches in _realtime_lists(batch)}
    for caches in allocated:
        if id(caches) in kept:
            continue
        caches.session.close()
        for kv_attr, cross_attr in _STAGE_REFS:
            if stage is not None and getattr(stage, kv_attr, None) is caches:
                setattr(stage, kv_attr, None)
                if hasattr(stage, cross_attr):
                    setattr(stage, cross_attr, None)
    integ = integration()
    with integ.lock:
        managers = list(integ.managers.values())
    for manager in managers:
        manager.reclaim()
    for listener in list(integ.request_listeners):
        listener(stage, [m.pool for m in managers])


@contextmanager
def request_scope(stage: Any, batch: Any = None) -> Iterator[list[SessionCaches]]:
    """One request: the sessions allocated inside (on this thread) end with the outermost scope, returned or
    raised (see the module doc). Nested scopes (a forward calling another) join the outermost."""
    scopes = integration().scopes
    stack = getattr(scopes, "stack", None)
    if stack is None:
        stack = scopes.stack = []
    outermost = not stack
    scope = stack[0] if stack else _Scope()
    stack.append(scope)
    try:
        if outermost:
            scope.hold_realtime(batch)
        yield scope.allocated
    finally:
        stack.pop()
        if outermost:
            try:
                scope.marks.close()  # idle again: swappable between calls
            finally:
                end_request(stage, batch, scope.allocated)


def forward_around(original: Any, stage: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook for the causal stages' `forward(batch, server_args)`: the call is one request scope."""
    batch = args[0] if args else kwargs.get("batch")
    with request_scope(stage, batch):
        return original(stage, *args, **kwargs)


def dispose_before(state: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook for SGLang's `RealtimeCausalDiTState.dispose`: the state's caches (a realtime session SGLang
    releases, evicts or restarts) are closed now, every page back."""
    caches = getattr(state, "kv_cache", None)
    if isinstance(caches, SessionCaches):
        caches.session.close()


def pages_in_use(pools: list[BlockPool]) -> int:
    """Pages held in `pools` now. O(pools)."""
    return sum(p.num_pages - p.num_free_pages for p in pools)


def host_pages_in_use(pools: list[BlockPool]) -> int:
    """Pages held now in the host tiers of `pools` (swapped-out sessions; 0 without a host tier). O(pools)."""
    integ = integration()
    with integ.lock:
        hosts = [integ.host_pools.get(id(p)) for p in pools]
    return pages_in_use([h for h in hosts if h is not None])
