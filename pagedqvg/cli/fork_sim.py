"""`simulate --branches` and `simulate --host-budget`: real caches driven through `SessionManager.fork`,
`swap_out` and `swap_in`, measured against the planner's figures (planning/branches.py, planning/host_budget.py).

This lives above serving/ (the planner may not import the session manager). Each run builds its own pool(s), drives
the planner's pattern with synthetic K/V (`simulate.chunk_kv`; branch j's own chunks seeded by j), records
`BlockPool.stats()` and closes everything again (0 pages left, `pool.check()`). A difference from the plan is
reported in `mismatches` / `mismatch_text` (simulate exits 1 then).
"""

from __future__ import annotations

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.errors import PoolExhaustedError, SessionRefusedError
from pagedqvg.planning.branches import account_branches, branch_pattern, branches_report, default_history
from pagedqvg.planning.geometry import Geometry
from pagedqvg.planning.host_budget import host_report
from pagedqvg.planning.simulate import chunk_kv
from pagedqvg.serving.sessions import Session, SessionManager, SessionSpec

__all__ = ["measure_branches", "measure_host", "session_spec"]


def session_spec(geom: Geometry, chunks: int | None = None) -> SessionSpec:
    """The `SessionSpec` of one session's geometry `geom` (its layers and cache sets, running `chunks` chunks)."""
    return SessionSpec(
        layers=geom.caches // geom.cache_sets, batch_size=geom.batch_size, cache_size=geom.cache_size,
        num_heads=geom.heads, head_dim=geom.head_dim, chunk_tokens=geom.chunk_tokens, dtype=geom.dtype,
        cache_sets=geom.cache_sets, sink_tokens=geom.sink_tokens, global_sink_tokens=geom.global_sink_tokens,
        attention_window_size=geom.attention_window, denoise_steps=geom.denoise_steps, chunks=chunks,
        quant=geom.quant if geom.quant.enabled else None,
    )  # fmt: skip


def _cache(session: Session, geom: Geometry, c: int):
    s, layer = divmod(c, geom.caches // geom.cache_sets)
    return session.caches[s][layer]


def _breakdown(session: Session) -> tuple[int, int]:
    parts = [c.memory_breakdown() for cs in session.caches for c in cs]
    return sum(b["dense_pages"] for b in parts), sum(b["packed_pages"] for b in parts)


def measure_branches(
    geom: Geometry, branches: int, diverge: int, history: int | None = None, *, device: str = "cpu", seed: int = 0
) -> dict[str, object]:
    """`branches_report` plus the same pattern on real caches (root opened by a `SessionManager`, the branches
    forked by `SessionManager.fork` with a reservation of the planned divergence): pool pages after every call,
    the peaks, the shared and exclusive pages at the end, compared with the plan (`mismatches`, `figures_equal`)."""
    history = default_history(geom) if history is None else history
    doc = branches_report(geom, branches, diverge, history)
    plan = account_branches(geom, branches, history, diverge)
    page = geom.page_bytes
    spec = session_spec(geom, history + diverge)
    # the forks' reservation: the planned divergence, at least the current chunk (what SessionManager.fork reserves)
    divergence = max(max(plan.exclusive_pages), geom.caches * geom.dense.pages_for_tokens(geom.chunk_tokens))
    from pagedqvg.serving.sessions import planned_session_pages

    capacity = max(plan.high_water, planned_session_pages(spec, page) + (branches - 1) * divergence, 1)
    pool = BlockPool(capacity_bytes=capacity * page, page_bytes=page, device=device)
    mgr = SessionManager(pool)
    sessions = {0: mgr.open(spec, name="branch0")}
    used: list[int] = []
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    n, frames = geom.chunk_tokens, geom.chunk_tokens // geom.tokens_per_frame
    hist: tuple[int, int, int, int] | None = None
    try:
        for call in branch_pattern(geom, branches, history, diverge):
            if hist is None and (call.op == "fork" or call.chunk >= history):
                st = pool.stats()
                hist = (st.used_pages, *_breakdown(sessions[0]), st.high_water_pages)
                pool.reset_high_water()
            if call.op == "fork":
                if call.cache == 0:
                    sessions[call.branch] = mgr.fork(sessions[0], name=f"branch{call.branch}",
                                                     divergence_pages=divergence)  # fmt: skip
            elif call.op == "pin":
                _cache(sessions[call.branch], geom, call.cache).pin_current_chunk(n)
            else:
                key = (call.chunk, call.branch if call.chunk >= history else 0)
                if key not in kv:
                    kv = {k: v for k, v in kv.items() if k[0] == call.chunk}
                    kv[key] = chunk_kv(geom, frames, call.chunk, seed + 1000 * key[1], pool.device)
                k, v = kv[key]
                with torch.no_grad():
                    _cache(sessions[call.branch], geom, call.cache).update_and_get_attention_kv(
                        key=k, value=v, current_chunk_start=call.chunk * n
                    )
            used.append(pool.stats().used_pages)
        st = pool.stats()
        if hist is None:
            hist = (st.used_pages, *_breakdown(sessions[0]), st.high_water_pages)
        owners = {j: [c.owner for cs in s.caches for c in cs] for j, s in sessions.items()}
        measured = {
            "history_pages": hist[0], "history_bf16_pages": hist[1], "history_packed_pages": hist[2],
            "history_high_water": hist[3], "high_water": max(hist[3], st.high_water_pages),
            "divergence_high_water": st.high_water_pages, "shared_pages": st.shared_pages,
            "branch_pages": [sum(pool.pages_of(o) for o in owners[j]) for j in range(branches)],
            "exclusive_pages": [sum(st.exclusive_pages(o) for o in owners[j]) for j in range(branches)],
        }  # fmt: skip
    finally:
        mgr.close_all()
    pool.check()
    calls, wrong = _compare(plan, measured, used, pool.stats().used_pages)
    doc.update(
        mismatches=calls, figures_equal=not wrong, mismatch_text="; ".join(wrong),
        measured_high_water_pages=measured["high_water"], measured_pages=used[-1] if used else 0,
        measured_shared_pages=measured["shared_pages"], measured_exclusive_pages=measured["exclusive_pages"],
        measured_pool_pages=pool.num_pages, measured_device=str(pool.device),
    )  # fmt: skip
    return doc


def _compare(plan, measured: dict[str, object], used: list[int], left: int) -> tuple[int, list[str]]:
    """(calls whose pool pages differ, every difference in words) between the plan (`BranchAccount`) and a run."""
    wrong = [f"{k} {measured[k]} != planned {getattr(plan, k)}" for k in measured if measured[k] != getattr(plan, k)]
    if left:
        wrong.append(f"{left} pages left after closing every branch")
    calls = [i for i, (a, b) in enumerate(zip(plan.used, used, strict=True)) if a != b]
    if calls:
        wrong.insert(0, f"call {calls[0]}: {used[calls[0]]} pages measured, {plan.used[calls[0]]} planned")
    return len(calls), wrong


def measure_independent(geom: Geometry, sessions: int, chunks: int, *, device: str = "cpu", seed: int = 0) -> dict:
    """`sessions` unforked sessions of `geom` opened by a `SessionManager` and run in step for `chunks` chunks (per
    chunk, per denoise step, session by session, each cache in turn) on a pool of twice their planned peak: the
    measured pages at the end and high water next to the planner's (`branches.independent_sessions`)."""
    from pagedqvg.planning.branches import independent_sessions

    end, peak = independent_sessions(geom, sessions, chunks)
    spec = session_spec(geom, chunks)
    pool = BlockPool(capacity_bytes=2 * max(peak, 1) * geom.page_bytes, page_bytes=geom.page_bytes, device=device)
    mgr = SessionManager(pool)
    n, frames = geom.chunk_tokens, geom.chunk_tokens // geom.tokens_per_frame
    try:
        opened = [mgr.open(spec, name=f"s{j}") for j in range(sessions)]
        for k in range(chunks):
            data = [chunk_kv(geom, frames, k, seed + 1000 * j, pool.device) for j in range(sessions)]
            for _ in range(geom.denoise_steps + 1):
                for s, (key, value) in zip(opened, data, strict=True):
                    for cache in (c for cs in s.caches for c in cs):
                        with torch.no_grad():
                            cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=k * n)
            for s in opened:
                if geom.scene_cut_every and k > 0 and k % geom.scene_cut_every == 0:
                    for cache in (c for cs in s.caches for c in cs):
                        cache.pin_current_chunk(n)
        st = pool.stats()
    finally:
        mgr.close_all()
    pool.check()
    return {"planned_pages": end, "planned_high_water_pages": peak, "pages": st.used_pages,
            "high_water_pages": st.high_water_pages}  # fmt: skip


def _run_session(session: Session, geom: Geometry, chunks: int, seed: int) -> None:
    """`chunks` chunks of the planner's call pattern on every cache of `session` (no pins: SessionSpec has none)."""
    n, frames = geom.chunk_tokens, geom.chunk_tokens // geom.tokens_per_frame
    caches = [c for cs in session.caches for c in cs]
    for k in range(chunks):
        key, value = chunk_kv(geom, frames, k, seed, session.manager.pool.device)
        for _ in range(geom.denoise_steps + 1):
            for cache in caches:
                with torch.no_grad():
                    cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=k * n)


def _slots(session: Session) -> list[torch.Tensor]:
    """Every cache's slots as a view reads them (the cache's own readout; changes nothing), cloned."""
    return [c._read_slots("host-budget").clone() for cs in session.caches for c in cs]


def measure_host(geom: Geometry, pool_pages: int, host_bytes: int, *, device: str = "cpu") -> dict[str, object]:
    """`host_report` plus a measured run: a device pool of `pool_pages` pages and a host pool of `host_bytes` bytes
    under one `SessionManager`; sessions are opened and run to their steady state one after another, and when one
    is refused the least recently used resident is swapped out, until the host has no room either; then one
    resident closes and one parked session is swapped back in (its pages and views checked)."""
    doc = host_report(geom, pool_pages, host_bytes)
    from pagedqvg.planning.replay import replay_layer

    after = replay_layer(geom).after
    warm = after.index(max(after)) + 1  # chunks to the steady pages
    page = geom.page_bytes
    spec = session_spec(geom)
    pool = BlockPool(capacity_bytes=max(pool_pages, 1) * page, page_bytes=page, device=device)
    host = BlockPool(capacity_bytes=host_bytes, page_bytes=page, device="cpu")
    mgr = SessionManager(pool, host_pool=host)
    resident: list[Session] = []
    parked: list[Session] = []
    out_pages: set[int] = set()
    in_pages = 0
    first: list[torch.Tensor] = []  # the first parked session's slots before its swap-out
    equal = True
    try:
        while True:
            try:
                s = mgr.open(spec, name=f"s{len(resident) + len(parked)}")
            except SessionRefusedError:
                if not resident:
                    break
                views = [] if parked else _slots(resident[0])
                try:
                    out_pages.add(mgr.swap_out(resident[0]))
                except PoolExhaustedError:
                    break  # the host is full too
                parked.append(resident.pop(0))
                first = first or views
                continue
            _run_session(s, geom, warm, seed=len(resident) + len(parked))
            resident.append(s)
        counts = (len(resident), len(parked))
        if parked and resident:
            resident.pop(0).close()
            back = parked.pop(0)
            in_pages = mgr.swap_in(back)
            equal = all(torch.equal(x, y) for x, y in zip(first, _slots(back), strict=True))
    finally:
        mgr.close_all()
    pool.check()
    host.check()
    measured = {
        "resident_sessions": counts[0],
        "parked_sessions": counts[1],
        "swap_out_pages": sorted(out_pages)[0] if len(out_pages) == 1 else sorted(out_pages),
        "swap_in_pages": in_pages,
        "pages_left": pool.stats().used_pages + host.stats().used_pages,
        "views_equal_after_swap": equal,
    }
    wrong = []
    if counts != (doc["resident_sessions"], doc["parked_sessions"]):
        wrong.append(f"{counts[0]} resident + {counts[1]} parked measured, planned {doc['resident_sessions']} + "
                     f"{doc['parked_sessions']}")  # fmt: skip
    if out_pages and out_pages != {doc["parked_session_pages"]}:
        wrong.append(f"swap-out pages {sorted(out_pages)} != planned {doc['parked_session_pages']}")
    if in_pages and in_pages != doc["parked_session_pages"]:
        wrong.append(f"swap-in pages {in_pages} != planned {doc['parked_session_pages']}")
    if measured["pages_left"]:
        wrong.append(f"{measured['pages_left']} pages left after closing every session")
    if not equal:
        wrong.append("a session's slots differ after its swap-out and swap-in")
    doc.update(measured=measured, mismatches=len(wrong), mismatch_text="; ".join(wrong))
    return doc
