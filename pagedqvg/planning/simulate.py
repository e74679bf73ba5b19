"""`pagedqvg simulate`: run the real pool and every layer's cache over N chunks and record memory per call.

Two engines produce the same per-call timeline (`TIMELINE_FIELDS`):

- `run_caches`: a real `BlockPool` sized by the plan and `sessions * cache_sets * layers` `PagedCausalKVCache`s of
  one rank (`heads / (ulysses * tp)` heads each), fed with
  `pagedqvg.planning.synthetic.video_kv` chunks in the callers' order (see `planner.call_pattern`); figures come from
  `BlockPool.stats()` after every call.
- `run_accounting` (`--dry-run`): the planner's replay (`planner.CountingLayer`: each cache's own sequencing core and
  pack policy with a page counter for a store), at any size, without tensors.

`summarize` compares a timeline with the plan (steady state and high-water must agree within 1%) and, for a real
run, call by call with the accounting replay.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedqvg.allocator import BlockPool, available_memory_bytes, format_bytes
from pagedqvg.planning.planner import (
    PLAN_MODES,
    Call,
    CountingLayer,
    Geometry,
    PageCounter,
    call_pattern,
    mode_quant,
    plan_geometry,
)
from pagedqvg.planning.presets import Workload
from pagedqvg.quant.config import QuantConfig
from pagedqvg.store.segment import SegmentKind

#: Keys of every timeline record (bytes are whole bytes; "held" = pages in use * page_bytes).
TIMELINE_FIELDS: tuple[str, ...] = (
    "call",
    "chunk",
    "step",
    "cache",
    "op",
    "used_pages",
    "held_bytes",
    "used_bytes",
    "waste_bytes",
    "high_water_bytes",
    "bf16_bytes",
    "packed_bytes",
    "view_tokens",
    "view_bytes",
)
#: Fields the real run and the accounting replay must agree on, call by call.
COMPARED_FIELDS: tuple[str, ...] = (
    "used_pages",
    "held_bytes",
    "used_bytes",
    "high_water_bytes",
    "bf16_bytes",
    "packed_bytes",
    "view_tokens",
)
#: Largest relative difference between measured and planned steady state / high-water that counts as agreement.
AGREEMENT_TOLERANCE = 0.01
SUMMARY_SCHEMA = "pagedqvg.simulate/2"  # /2: no "note" (the bf16 fallback is gone)


@dataclass(slots=True)
class Timeline:
    """What one run produced: the per-call records and how it ran."""

    engine: str  # "caches" or "accounting"
    device: str
    quant_mode: str  # the quantization the caches really ran with
    records: list[dict[str, object]] = field(default_factory=list)
    seconds: float = 0.0
    pool_capacity_bytes: int = 0


class _Totals:
    """Per-cache bf16/packed pages and used bytes, summed incrementally (O(1) per update)."""

    def __init__(self, caches: int) -> None:
        self.per = [(0, 0, 0)] * caches
        self.bf16 = self.packed = self.used = 0

    def update(self, cache: int, bf16_pages: int, packed_pages: int, used: int) -> None:
        b, p, u = self.per[cache]
        self.bf16 += bf16_pages - b
        self.packed += packed_pages - p
        self.used += used - u
        self.per[cache] = (bf16_pages, packed_pages, used)


def _record(
    i: int,
    c: Call,
    used_pages: int,
    page_bytes: int,
    used: int,
    high_water_pages: int,
    totals: _Totals,
    view_tokens: int,
    geom: Geometry,
) -> dict[str, object]:
    held = used_pages * page_bytes
    return {
        "call": i,
        "chunk": c.chunk,
        "step": c.step,
        "cache": c.cache,
        "op": c.op,
        "used_pages": used_pages,
        "held_bytes": held,
        "used_bytes": used,
        "waste_bytes": held - used,
        "high_water_bytes": high_water_pages * page_bytes,
        "bf16_bytes": totals.bf16 * page_bytes,
        "packed_bytes": totals.packed * page_bytes,
        "view_tokens": view_tokens,
        "view_bytes": geom.view_bytes(view_tokens),
    }


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def _progress(total: int, enabled: bool | None, desc: str):
    """A tqdm bar on stderr (shown when stderr is a terminal unless `enabled` says otherwise); a no-op without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:  # the `cli` extra is not installed
        return _NoBar()
    return tqdm(
        total=total,
        unit="call",
        desc=desc,
        disable=(None if enabled is None else not enabled),
        dynamic_ncols=True,
        leave=False,
    )


def count_calls(geom: Geometry, chunks: int) -> int:
    """Number of calls (updates and pins) the pattern makes over `chunks` chunks."""
    return sum(1 for _ in call_pattern(geom, chunks))


# ---------------------------------------------------------------------------------------------------- engines
def run_accounting(geom: Geometry, chunks: int, *, progress: bool | None = False) -> Timeline:
    """The pure-Python accounting of the whole pattern (no tensors): what `--dry-run` runs."""
    t0 = time.perf_counter()
    counter = PageCounter()
    layers = [CountingLayer(geom, counter) for _ in range(geom.caches)]
    totals = _Totals(geom.caches)
    out = Timeline("accounting", "none", geom.quant.mode)
    total = count_calls(geom, chunks)
    with _progress(total, progress, "accounting") as bar:
        for i, c in enumerate(call_pattern(geom, chunks)):
            layer = layers[c.cache]
            view = 0
            if c.op == "advance":
                view = layer.advance()
                totals.update(
                    c.cache, layer.pages[SegmentKind.DENSE], layer.pages[SegmentKind.PACKED], layer.used_bytes()
                )
            elif c.op == "pin":
                layer.pin()
            else:
                view = layer.rewrite()
            out.records.append(
                _record(i, c, counter.used, geom.page_bytes, totals.used, counter.high_water, totals, view, geom)
            )
            bar.update()
    out.seconds = time.perf_counter() - t0
    out.pool_capacity_bytes = counter.high_water * geom.page_bytes
    return out


def _pages_by_kind(cache) -> tuple[int, int]:
    """`(bf16, packed)` pages a cache holds (`memory_breakdown()`; `segments()` on caches without it)."""
    breakdown = getattr(cache, "memory_breakdown", None)
    if breakdown is not None:
        b = breakdown()
        return b["dense_pages"], b["packed_pages"]
    return sum(seg[2] for seg in cache.segments()), 0


def cache_names(geom: Geometry) -> list[str]:
    """Names of the pool's caches in call order: `layer{i}`, with `set{s}.` for several cache sets and `session{j}.`
    for several sessions (session-major: every call step runs session 0's caches, then session 1's, ...)."""
    per_session = geom.caches // geom.sessions
    per_set = per_session // geom.cache_sets
    names = []
    for c in range(geom.caches):
        j, r = divmod(c, per_session)
        s, i = divmod(r, per_set)
        name = f"layer{i}"
        if geom.cache_sets > 1:
            name = f"set{s}.{name}"
        if geom.sessions > 1:
            name = f"session{j}.{name}"
        names.append(name)
    return names


def make_caches(geom: Geometry, pool: BlockPool, quant: QuantConfig | None) -> list:
    """`geom.caches` caches on `pool`, named by `cache_names` (one rank's caches: `geom.heads` heads each)."""
    from pagedqvg.cache.paged_cache import PagedCausalKVCache

    kwargs = geom.cache_kwargs()
    return [
        PagedCausalKVCache(pool=pool, device=pool.device, quant=quant, name=name, **kwargs)
        for name in cache_names(geom)
    ]


def chunk_kv(geom: Geometry, chunk_frames: int, chunk: int, seed: int, device: torch.device):
    """Synthetic K and V of chunk `chunk`, `[B, n, H, D]` in the cache dtype on `device`."""
    from pagedqvg.planning.synthetic import video_kv

    k, v = video_kv(
        chunk_frames,
        geom.tokens_per_frame,
        geom.heads,
        geom.head_dim,
        batch=geom.batch_size,
        seed=seed + chunk,
        dtype=geom.dtype,
    )
    return k.to(device), v.to(device)


def _call(cache, c: Call, kv: tuple[torch.Tensor, torch.Tensor] | None, n: int) -> int:
    """Run call `c` of the pattern on `cache` (chunk K/V `kv`, `n` tokens); returns the view's token count."""
    if c.op == "pin":
        cache.pin_current_chunk(n)
        return 0
    assert kv is not None
    view = cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=c.chunk * n)
    return int(view.k.shape[1])


def run_caches(
    geom: Geometry,
    w: Workload,
    *,
    device: str = "cpu",
    capacity_bytes: int | None = None,
    seed: int = 0,
    progress: bool | None = None,
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Timeline:
    """Run real caches over `w.chunks` chunks on `device` and record `BlockPool.stats()` after every call.

    The pool holds `capacity_bytes` (default: exactly the plan's pool pages, so a wrong plan fails loudly with
    PoolExhaustedError). The caches run the requested quantization; any error building them propagates.
    """
    plan = plan_geometry(geom, replay=True)
    capacity = capacity_bytes if capacity_bytes is not None else plan.pool_bytes
    pool = BlockPool(capacity_bytes=capacity, page_bytes=geom.page_bytes, device=device)
    caches = make_caches(geom, pool, geom.quant if geom.quant.enabled else None)
    out = Timeline("caches", str(pool.device), geom.quant.mode, pool_capacity_bytes=pool.num_pages * pool.page_bytes)
    totals = _Totals(geom.caches)
    n = geom.chunk_tokens
    chunk_frames = n // geom.tokens_per_frame
    total = count_calls(geom, w.chunks)
    kv = None
    current = -1
    t0 = time.perf_counter()
    try:
        with _progress(total, progress, f"simulate {w.name}") as bar:
            for i, c in enumerate(call_pattern(geom, w.chunks)):
                cache = caches[c.cache]
                if c.chunk != current:
                    current = c.chunk
                    kv = data(c.chunk) if data is not None else chunk_kv(geom, chunk_frames, c.chunk, seed, pool.device)
                view_tokens = _call(cache, c, kv, n)
                if c.op == "advance" or (c.op != "pin" and geom.quant.enabled):
                    bf16, packed = _pages_by_kind(cache)
                    totals.update(c.cache, bf16, packed, 0)
                st = pool.stats()
                rec = _record(
                    i, c, st.used_pages, st.page_bytes, st.used_bytes, st.high_water_pages, totals, view_tokens, geom
                )
                out.records.append(rec)
                bar.update()
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)
    finally:
        out.seconds = time.perf_counter() - t0
        for cache in caches:
            cache.close()
    return out


# ---------------------------------------------------------------------------------------------------- summary
def _rel(a: int, b: int) -> float:
    return abs(a - b) / b if b else (0.0 if a == b else float("inf"))


def chunk_end_records(records: list[dict[str, object]]) -> list[dict[str, object]]:
    """The last record of every chunk (the pool state between chunks)."""
    ends: dict[object, dict[str, object]] = {}
    for r in records:
        ends[r["chunk"]] = r
    return list(ends.values())


def compare_records(a: Iterable[dict[str, object]], b: Iterable[dict[str, object]]) -> tuple[int, int, str]:
    """`(calls compared, mismatching calls, first mismatch text)` over `COMPARED_FIELDS`."""
    compared = mismatches = 0
    first = ""
    for ra, rb in zip(a, b, strict=False):
        compared += 1
        bad = [k for k in COMPARED_FIELDS if ra[k] != rb[k]]
        if bad:
            mismatches += 1
            if not first:
                first = f"call {ra['call']} ({ra['op']} chunk {ra['chunk']} cache {ra['cache']}): " + ", ".join(
                    f"{k} {ra[k]} != {rb[k]}" for k in bad
                )
    return compared, mismatches, first


def _measured(recs: list[dict[str, object]], ends: list[dict[str, object]]) -> dict[str, int]:
    """The measured figures of a timeline: steady state (the largest held bytes at a chunk end), high-water, and
    the steady record's used/waste/bf16/packed bytes (bytes)."""
    steady = max((int(r["held_bytes"]) for r in ends), default=0)
    rec = next((r for r in ends if r["held_bytes"] == steady), None)

    def at_steady(key: str) -> int:
        return int(rec[key]) if rec else 0

    return {
        "steady_state_bytes": steady,
        "high_water_bytes": max((int(r["high_water_bytes"]) for r in recs), default=0),
        "used_bytes": at_steady("used_bytes"),
        "waste_bytes": at_steady("waste_bytes"),
        "bf16_bytes": at_steady("bf16_bytes"),
        "packed_bytes": at_steady("packed_bytes"),
        "max_view_bytes": max((int(r["view_bytes"]) for r in recs), default=0),
    }


def _plan_only(w: Workload, geom: Geometry) -> list[dict[str, object]]:
    """Plan figures of every quantization mode (not off) the shape allows."""
    out: list[dict[str, object]] = []
    for mode in PLAN_MODES:
        if mode == "off":
            continue
        try:
            g = Geometry.from_workload(w, mode_quant(geom.quant, mode, w.head_dim))
        except ValueError:
            continue  # this mode cannot work with the shape (e.g. block size vs head_dim)
        p = plan_geometry(g, replay=True)
        out.append(
            {
                "mode": p.mode,
                "steady_state_bytes": p.all_bytes,
                "high_water_bytes": p.pool_bytes,
                "ratio_vs_dense": p.dense_bytes / p.bytes if p.bytes else None,
            }
        )
    return out


def summarize(
    w: Workload,
    geom: Geometry,
    timeline: Timeline,
    *,
    accounting: Timeline | None = None,
    outputs: dict[str, str] | None = None,
) -> dict[str, object]:
    """The run's summary (JSON-ready): measured vs plan, the accounting check, plan-only packed figures."""
    plan = plan_geometry(geom, replay=True)
    recs = timeline.records
    measured = _measured(recs, chunk_end_records(recs))
    assert plan.warmup_chunks is not None
    reached = w.chunks >= plan.warmup_chunks
    rel_steady = _rel(measured["steady_state_bytes"], plan.all_bytes)
    rel_hw = _rel(measured["high_water_bytes"], plan.pool_bytes)
    summary: dict[str, object] = {
        "schema": SUMMARY_SCHEMA,
        "workload": w.as_dict(),
        "engine": timeline.engine,
        "device": timeline.device,
        "quant_requested": geom.quant.mode,
        "quant_measured": timeline.quant_mode,
        "chunks": w.chunks,
        "calls": len(recs),
        "seconds": round(timeline.seconds, 3),
        "pool_capacity_bytes": timeline.pool_capacity_bytes,
        "measured": measured,
        "plan": {
            "mode": plan.mode,
            "steady_state_bytes": plan.all_bytes,
            "high_water_bytes": plan.pool_bytes,
            "used_bytes": plan.used_bytes * plan.caches,
            "waste_bytes": plan.waste_bytes * plan.caches,
            "dense_bf16_bytes": plan.dense_bytes * plan.caches,
            "transient_view_bytes": plan.view_bytes,
            "warmup_chunks": plan.warmup_chunks,
        },
        "agreement": {
            "checked": reached,
            "steady_state_rel_diff": rel_steady,
            "high_water_rel_diff": rel_hw,
            "tolerance": AGREEMENT_TOLERANCE,
            "ok": (not reached) or (rel_steady <= AGREEMENT_TOLERANCE and rel_hw <= AGREEMENT_TOLERANCE),
        },
        "accounting": None,
        "plan_only": [],
        "outputs": outputs or {},
    }
    if accounting is not None:
        compared, mismatches, first = compare_records(recs, accounting.records)
        summary["accounting"] = {"calls_compared": compared, "mismatches": mismatches, "first_mismatch": first}
    if not geom.quant.enabled:
        summary["plan_only"] = _plan_only(w, geom)
    return summary


# ---------------------------------------------------------------------------------------------------- outputs
def write_timeline(path: Path, summary: dict[str, object], timeline: Timeline) -> None:
    """`{"summary": ..., "fields": [...], "records": [...]}` as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"summary": summary, "fields": list(TIMELINE_FIELDS), "records": timeline.records}
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if max_bytes >= 2 * scale:
            return float(scale), name
    return 1.0, "B"


def plot_timeline(path: Path, summary: dict[str, object], timeline: Timeline) -> None:
    """Memory per call (pool held, used, bf16, packed, waste, high-water) with the plan's steady state, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = timeline.records
    plan = summary["plan"]
    assert isinstance(plan, dict)
    x = [r["call"] for r in recs]
    peak = max([int(r["high_water_bytes"]) for r in recs] + [int(plan["dense_bf16_bytes"]), 1])
    scale, unit = _unit(peak)
    fig, ax = plt.subplots(figsize=(12.5, 5.5), dpi=110)
    series = (
        ("held_bytes", "pool held (pages x page size)", "C0", 2.0),
        ("used_bytes", "used (rows)", "C2", 1.2),
        ("bf16_bytes", "bf16 segments", "C1", 1.0),
        ("packed_bytes", "packed segments", "C4", 1.0),
        ("waste_bytes", "waste (held - used)", "C3", 1.0),
        ("high_water_bytes", "high-water", "C7", 1.0),
    )
    for key, label, color, lw in series:
        ys = [int(r[key]) / scale for r in recs]
        if key == "packed_bytes" and not any(ys):
            continue
        ax.plot(x, ys, label=label, color=color, linewidth=lw, linestyle="--" if key == "high_water_bytes" else "-")
    ax.axhline(
        int(plan["steady_state_bytes"]) / scale,
        color="k",
        linestyle=":",
        linewidth=1.2,
        label=f"plan steady state ({plan['mode']})",
    )
    ax.axhline(
        int(plan["dense_bf16_bytes"]) / scale,
        color="C5",
        linestyle="-.",
        linewidth=1.0,
        label="dense bf16 cache (reference)",
    )
    pins = [r["call"] for r in recs if r["op"] == "pin"]
    if pins:
        ax.vlines(pins, 0, peak / scale, colors="C6", alpha=0.35, linewidth=1.0, label="scene-cut pins")
    w = summary["workload"]
    assert isinstance(w, dict)
    ax.set_title(
        f"pagedqvg simulate: {w['name']} ({timeline.engine}, quant {timeline.quant_mode}, "
        f"{w['layers']} layers x {w['chunks']} chunks)"
    )
    ax.set_xlabel("call (advance, denoise rewrites, clean pass, pins; layer by layer)")
    ax.set_ylabel(f"bytes [{unit}]")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def check_fits(geom: Geometry, device: str, capacity: int) -> None:
    """ValueError when a real run would not fit the device's free memory (pool + one view + one chunk of data)."""
    need = capacity + geom.view_bytes(geom.cache_size) + 2 * geom.view_bytes(geom.chunk_tokens)
    free = available_memory_bytes(device)
    if need > 0.9 * free:
        raise ValueError(
            f"a real run needs about {format_bytes(need)} on {device} but only {format_bytes(free)} is free; "
            f"use --dry-run for the accounting at full size, a '-mini' preset, or --device cuda"
        )
