"""Staggered sessions: `plan` / `simulate --sessions N --stagger K` (sessions starting K chunks apart, each running
its own number of chunks, then closed).

Time runs in ticks of one chunk. At tick `t` every live session (start <= t < start + chunks) runs its chunk
`t - start` in the planner's call pattern: per denoise step (the advance first, the clean pass last), session by
session (oldest first), each of its caches in turn; scene-cut pins after the clean pass. A session whose last chunk
ran closes at the end of that tick (every page back). Sessions in step (`planner`) are the case K = 0 with equal
lengths.

Two engines give the pool's pages after every call: `account_staggered` (the planner's `CountingLayer` per cache on
one `PageCounter`, no tensors) and `measure_staggered` (real caches on a `BlockPool` sized at the accounting's
peak, so a wrong plan fails with PoolExhaustedError); tests check they agree call by call, and the real pool's
high water equals the accounting's (inside calls too: `account_staggered_peak`). `stagger_summary` gives the peak
(pool high-water pages, inside calls), the steady state (pages at the end of the last tick at which the most
sessions were live, before that tick's closes) and the same figures for the sessions in step.

Complexity: O(calls) for the accounting (each call O(log segments)), plus the cache work for the real run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedqvg.planning.budget import ResolvedBudget
from pagedqvg.planning.planner import (
    CountingLayer,
    Geometry,
    PageCounter,
    check_replayable,
    is_scene_cut,
    plan_geometry,
)

__all__ = [
    "StaggerCall",
    "account_staggered",
    "account_staggered_peak",
    "measure_staggered",
    "session_geometry",
    "stagger_summary",
]


@dataclass(frozen=True, slots=True)
class StaggerCall:
    """One call: tick, session, the session's own chunk, step (0 advance .. denoise_steps clean, +1 pin, -1
    close), the cache within the session, and op ("advance", "denoise", "clean", "pin" or "close")."""

    tick: int
    session: int
    chunk: int
    step: int
    cache: int
    op: str


def session_geometry(geom: Geometry) -> Geometry:
    """One session's geometry (its `layers * cache_sets` caches) of a workload geometry of `geom.sessions`."""
    return dataclasses.replace(geom, sessions=1, caches=geom.caches // geom.sessions)


def check_stagger(sessions: int, stagger: int, lengths: list[int]) -> None:
    """ValueError naming the bad value: sessions >= 1, stagger >= 0, one length >= 1 per session."""
    if sessions < 1 or stagger < 0:
        raise ValueError(f"--sessions must be >= 1 and --stagger >= 0 chunks, got {sessions} and {stagger}")
    if len(lengths) != sessions or min(lengths) < 1:
        raise ValueError(f"--session-chunks needs one length >= 1 per session ({sessions}), got {lengths}")


def staggered_pattern(geom: Geometry, stagger: int, lengths: list[int]) -> Iterator[StaggerCall]:
    """The calls of `len(lengths)` sessions of `geom` (one session's geometry) starting `stagger` chunks apart."""
    starts = [i * stagger for i in range(len(lengths))]
    steps, caches = geom.denoise_steps, geom.caches
    for t in range(max(s + n for s, n in zip(starts, lengths, strict=True))):
        live = [j for j, (s, n) in enumerate(zip(starts, lengths, strict=True)) if s <= t < s + n]
        for step in range(steps + 1):
            op = "advance" if step == 0 else ("clean" if step == steps else "denoise")
            for j in live:
                for c in range(caches):
                    yield StaggerCall(t, j, t - starts[j], step, c, op)
        for j in live:
            if is_scene_cut(t - starts[j], geom.scene_cut_every):
                for c in range(caches):
                    yield StaggerCall(t, j, t - starts[j], steps + 1, c, "pin")
        for j in live:
            if t == starts[j] + lengths[j] - 1:
                for c in range(caches):
                    yield StaggerCall(t, j, t - starts[j], -1, c, "close")


def account_staggered(geom: Geometry, stagger: int, lengths: list[int]) -> list[int]:
    """Pool pages after every call of `staggered_pattern`, from the planner's accounting (no tensors)."""
    return account_staggered_peak(geom, stagger, lengths)[0]


def account_staggered_peak(geom: Geometry, stagger: int, lengths: list[int]) -> tuple[list[int], int]:
    """`account_staggered` and the pool's high-water pages: the peak inside calls too (an advance takes its new
    chunk's pages before a pack or a roll gives older ones back), which the pages after each call can miss."""
    counter = PageCounter()
    layers: dict[tuple[int, int], CountingLayer] = {}
    used: list[int] = []
    for call in staggered_pattern(geom, stagger, lengths):
        key = (call.session, call.cache)
        layer = layers.get(key)
        if layer is None:
            layer = layers[key] = CountingLayer(geom, counter, name=f"session{call.session}.cache{call.cache}")
        if call.op == "advance":
            layer.advance()
        elif call.op == "pin":
            layer.pin()
        elif call.op == "close":
            counter.free(layers.pop(key).held_pages)
        else:
            layer.rewrite()
        used.append(counter.used)
    return used, counter.high_water


def measure_staggered(
    geom: Geometry, stagger: int, lengths: list[int], *, device: str = "cpu", seed: int = 0
) -> tuple[list[int], int]:
    """Pool pages after every call with real caches (pool sized at the accounting's peak); returns them and the
    pool's high-water pages."""
    from pagedqvg.allocator import BlockPool
    from pagedqvg.cache.paged_cache import PagedCausalKVCache

    peak = account_staggered_peak(geom, stagger, lengths)[1]
    pool = BlockPool(capacity_bytes=max(peak, 1) * geom.page_bytes, page_bytes=geom.page_bytes, device=device)
    quant = geom.quant if geom.quant.enabled else None
    n = geom.chunk_tokens
    caches: dict[tuple[int, int], object] = {}
    used: list[int] = []
    try:
        for call in staggered_pattern(geom, stagger, lengths):
            key = (call.session, call.cache)
            cache = caches.get(key)
            if cache is None:
                name = f"session{call.session}.cache{call.cache}"
                cache = caches[key] = PagedCausalKVCache(
                    pool=pool, device=pool.device, quant=quant, name=name, **geom.cache_kwargs()
                )
            _run(cache, call, geom, n, seed, caches, key)
            used.append(pool.stats().used_pages)
    finally:
        for cache in caches.values():
            cache.close()  # type: ignore[attr-defined]
    return used, pool.stats().high_water_pages


def _run(cache, call: StaggerCall, geom: Geometry, n: int, seed: int, caches: dict, key: tuple[int, int]) -> None:
    """One call of the pattern on a real cache (K/V: `simulate.chunk_kv` of the session's chunk)."""
    from pagedqvg.planning.simulate import chunk_kv

    if call.op == "close":
        caches.pop(key).close()
    elif call.op == "pin":
        cache.pin_current_chunk(n)
    else:
        k, v = chunk_kv(geom, n // geom.tokens_per_frame, call.chunk, seed + 1000 * call.session, cache.device)
        with torch.no_grad():
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=call.chunk * n)


def stagger_summary(geom: Geometry, stagger: int, lengths: list[int]) -> dict[str, object]:
    """Peak and steady state (pages and bytes) of the staggered sessions and of the same sessions in step."""
    check_stagger(geom.sessions, stagger, lengths)
    one = session_geometry(geom)
    used, peak = account_staggered_peak(one, stagger, lengths)
    in_step_peak = account_staggered_peak(one, 0, [max(lengths)] * len(lengths))[1]
    calls = list(staggered_pattern(one, stagger, lengths))
    tick_end: dict[int, int] = {}
    live: dict[int, set[int]] = {}
    for call, pages in zip(calls, used, strict=True):
        live.setdefault(call.tick, set()).add(call.session)
        if call.op != "close":
            tick_end[call.tick] = pages
    most = max(len(s) for s in live.values())
    steady_tick = max(t for t, s in live.items() if len(s) == most)
    page = geom.page_bytes
    return {
        "sessions": len(lengths),
        "stagger_chunks": stagger,
        "session_chunks": lengths,
        "calls": len(calls),
        "peak_pages": peak,
        "peak_bytes": peak * page,
        "steady_pages": tick_end[steady_tick],
        "steady_tick": steady_tick,
        "most_live_sessions": most,
        "in_step_peak_pages": in_step_peak,
        "in_step_peak_bytes": in_step_peak * page,
        "page_bytes": page,
    }


def default_lengths(geom: Geometry, stagger: int, chunks: int | None) -> list[int]:
    """Chunks per session when `--session-chunks` is not given: `chunks` (simulate's --chunks) each, or for plan
    the planner's replay length plus the stagger of the last session (every session reaches its steady state)."""
    from pagedqvg.planning.planner import replay_chunks

    if chunks is not None:
        return [chunks] * geom.sessions
    return [replay_chunks(session_geometry(geom)) + stagger * (geom.sessions - 1)] * geom.sessions


def stagger_report(
    geom: Geometry, stagger: int, lengths: list[int] | None, chunks: int | None, *, measure: bool, device: str = "cpu"
) -> dict[str, object]:
    """`stagger_summary`, plus with `measure` the real caches' pages call by call against the accounting
    (`mismatches`: calls where they differ; `measured_peak_pages`: the real pool's high-water)."""
    check_replayable(session_geometry(geom), "--stagger (every call is accounted)")
    lengths = lengths if lengths is not None else default_lengths(geom, stagger, chunks)
    if len(lengths) == 1 and geom.sessions > 1:
        lengths = lengths * geom.sessions
    doc = stagger_summary(geom, stagger, lengths)
    if measure:
        one = session_geometry(geom)
        planned = account_staggered(one, stagger, lengths)
        measured, high_water = measure_staggered(one, stagger, lengths, device=device)
        doc["mismatches"] = sum(1 for a, b in zip(planned, measured, strict=True) if a != b)
        doc["measured_peak_pages"] = high_water
    return doc


def stagger_budget(doc: dict[str, object], geom: Geometry, budget: ResolvedBudget) -> dict[str, object]:
    """Whether the staggered peak fits `budget`: the pool's peak pages plus one transient view (or attention scratch,
    one layer at a time, as `plan` counts it) against the budget's bytes. JSON-ready; O(plan)."""
    transient = plan_geometry(geom).view_bytes
    needed = int(doc["peak_bytes"]) + transient
    return {**budget.as_dict(), "transient_bytes": transient, "needed_bytes": needed, "fits": needed <= budget.bytes}


def _budget_line(b: dict[str, object]) -> str:
    """The budget verdict of `stagger_budget`: peak + transient vs the budget, and what to do when it does not fit."""
    from pagedqvg.allocator import format_bytes

    needed, have = int(b["needed_bytes"]), int(b["bytes"])
    verdict = "fits" if b["fits"] else (
        f"does NOT fit (over by {format_bytes(needed - have)}): lower --sessions, raise --stagger, shorten "
        "--session-chunks or quantize (--kv-cache-quant)"
    )
    return (
        f"  budget  {format_bytes(have)} ({b['source']}): peak {format_bytes(needed - int(b['transient_bytes']))} + "
        f"one transient view {format_bytes(int(b['transient_bytes']))} = {format_bytes(needed)}: {verdict}"
    )


def format_stagger(doc: dict[str, object]) -> str:
    """The human lines of `stagger_report`."""
    from pagedqvg.allocator import format_bytes

    lengths = doc["session_chunks"]
    lines = [
        f"staggered sessions: {doc['sessions']} session(s) starting {doc['stagger_chunks']} chunk(s) apart, "
        f"running {lengths} chunks, then closed; {doc['calls']} calls",
        f"  peak    {doc['peak_pages']} pages ({format_bytes(int(doc['peak_bytes']))})   in step: "
        f"{doc['in_step_peak_pages']} pages ({format_bytes(int(doc['in_step_peak_bytes']))})",
        f"  steady  {doc['steady_pages']} pages at the end of chunk {doc['steady_tick']} "
        f"({doc['most_live_sessions']} session(s) live)",
    ]
    if isinstance(doc.get("budget"), dict):
        lines.append(_budget_line(doc["budget"]))  # type: ignore[arg-type]
    if "mismatches" in doc:
        lines.append(
            f"  measured (real caches): peak {doc['measured_peak_pages']} pages; plan == measured at every call: "
            f"{'yes' if doc['mismatches'] == 0 else 'NO, ' + str(doc['mismatches']) + ' calls differ'}"
        )
    return "\n".join(lines)
