"""The plan as a JSON-ready dict (schema `PLAN_SCHEMA`): the workload, its geometry, every quantization setting's
steady-state figures and tiers, and with a budget what fits it.
"""

from __future__ import annotations

import argparse
import dataclasses

from pagedqvg.allocator import format_bytes
from pagedqvg.cli.args import UsageError
from pagedqvg.planning.budget import Budget, ResolvedBudget
from pagedqvg.planning.planner import (
    ATTENTION_MODES,
    Geometry,
    max_sessions,
    max_window_frames,
    min_window_frames,
    plan_geometry,
    search_limit_frames,
    setting_geometries,
)
from pagedqvg.planning.presets import Workload, quant_as_dict
from pagedqvg.planning.tier_totals import tier_summary, tier_used_bytes
from pagedqvg.planning.tiers import dense_label

PLAN_SCHEMA = "pagedqvg.plan/2"


def _attention_fits(geom: Geometry, budget: int, lo: int) -> dict[str, dict[str, object]]:
    """Per attention mode: the largest window (frames) that fits `budget`, its budget and the transient bytes."""
    out: dict[str, dict[str, object]] = {}
    for mode in ATTENTION_MODES:
        g = dataclasses.replace(geom, attention=mode)
        frames = max_window_frames(g, budget, lo)
        p = plan_geometry(g.with_window_frames(frames if frames is not None else lo), replay=False)
        out[mode] = {"max_window_frames": frames, "budget_bytes": p.budget_bytes, "transient_bytes": p.view_bytes}
        if mode == "heads":
            out[mode]["heads_per_group"] = g.heads_per_group()
    return out


def _budget_fits(
    w: Workload, budget: int, source: str, attention: str = "view", head_group: int | None = None
) -> list[dict[str, object]]:
    rows = []
    for geom in setting_geometries(w)[0]:
        geom = dataclasses.replace(geom, attention=attention, head_group=head_group)
        lo = min_window_frames(geom, w.chunk_frames)
        frames = max_window_frames(geom, budget, lo)
        row: dict[str, object] = {
            "mode": geom.quant.mode,
            "page_bytes": geom.page_bytes,
            "max_window_frames": frames,
            "search_limited": frames == search_limit_frames(geom),
            "cache_size_tokens": None,
            "budget_bytes": None,
            "pool_bytes": None,
            "min_window_frames": lo,
            "min_budget_bytes": plan_geometry(geom.with_window_frames(lo), replay=False).budget_bytes,
            "max_sessions": max_sessions(geom, budget),
            "by_attention": _attention_fits(geom, budget, lo),
        }
        if frames is not None:
            p = plan_geometry(geom.with_window_frames(frames), replay=False)
            row.update(
                cache_size_tokens=geom.with_window_frames(frames).cache_size,
                budget_bytes=p.budget_bytes,
                pool_bytes=p.pool_bytes,
            )
        rows.append(row)
    if all(r["max_window_frames"] is None for r in rows):
        best = min(rows, key=lambda r: int(r["min_budget_bytes"]))  # type: ignore[arg-type]
        raise UsageError(
            f"{source} leaves {format_bytes(budget)} for the KV cache per rank: too small for even the sink and one "
            f"chunk; the smallest window ({best['min_window_frames']} frames, {w.sessions} session(s)) needs "
            f"{format_bytes(int(best['min_budget_bytes']))} with {best['mode']}"
        )
    return rows


def budget_from_args(args: argparse.Namespace) -> Budget | None:
    """The typed budget the flags describe (`--budget`, or `--gpu` / `--memory-fraction` with `--weights`,
    `--reserve`, `--device`), or None without a budget flag."""
    if args.budget is not None:
        return Budget(bytes=args.budget)
    if args.gpu is None and args.memory_fraction is None:
        return None
    return Budget(
        gpu=args.gpu,
        memory_fraction=args.memory_fraction,
        weights=args.weights,
        reserve=args.reserve or 0,
        device=args.device,
    )


def resolve_budget(args: argparse.Namespace, w: Workload) -> ResolvedBudget | None:
    """The KV budget per rank of the flags for `w` (`Budget.resolve`), or None without a budget flag."""
    budget = budget_from_args(args)
    return None if budget is None else budget.resolve(w)


def _tier_doc(g: Geometry) -> dict[str, object]:
    """Formats by age of one setting: each role's format and steady-state bytes (rows, codebooks included, no page
    rounding) per layer and for all caches (`pagedqvg.planning.tiers`)."""
    per = tier_used_bytes(g)
    formats = {role: dense_label(g, "bf16" if role == "current" else g.quant.tier_format(role)) for role in per}
    return {"formats": formats, "bytes_per_layer": per, "bytes_all_layers": {r: b * g.caches for r, b in per.items()},
            "summary": tier_summary(g)}  # fmt: skip


def build_plan(
    w: Workload,
    budget: Budget | ResolvedBudget | int | None = None,
    budget_source: str = "",
    attention: str = "view",
    head_group: int | None = None,
) -> dict[str, object]:
    """The plan as a JSON-ready dict (schema `PLAN_SCHEMA`). `budget`: a `Budget` (resolved for `w`), a
    `ResolvedBudget`, or bytes (labelled `budget_source`). `attention`: "view" (a transient view per call) or
    "pages" (update_and_attend's scratch instead) or "heads" (update_and_attend_heads: one group of heads' view at
    a time; `head_group` heads per group, None: the cost model's)."""
    if isinstance(budget, Budget):
        budget = budget.resolve(w)
    elif isinstance(budget, int):
        budget = ResolvedBudget(budget, budget_source)
    geom = Geometry.from_workload(w)
    geoms, skipped = setting_geometries(w)
    geoms = [dataclasses.replace(g, attention=attention, head_group=head_group) for g in geoms]
    settings = [plan_geometry(g) for g in geoms]
    dense = geom.dense
    doc: dict[str, object] = {
        "schema": PLAN_SCHEMA,
        "workload": w.as_dict(),
        "geometry": {
            "caches": geom.caches,
            "sessions": geom.sessions,
            "cache_sets": geom.cache_sets,
            "ranks": geom.ranks,
            "heads_per_rank": geom.heads,
            "chunk_tokens": geom.chunk_tokens,
            "sink_tokens": geom.sink_tokens,
            "global_sink_tokens": geom.global_sink_tokens,
            "effective_sink_tokens": geom.effective_sink,
            "window_tokens": geom.window_tokens,
            "cache_size_tokens": geom.cache_size,
            "attention_window_tokens": geom.attention_window or geom.cache_size,
            "page_bytes": geom.page_bytes,
            "dense_row_bytes": dense.row_bytes,
            "dense_rows_per_page": dense.rows_per_page,
            "dense_tokens_per_page": dense.tokens_per_page,
            "dense_cache_bytes_per_layer": geom.dense_cache_bytes(),
            "dense_cache_bytes_all_layers": geom.dense_cache_bytes() * geom.caches,
        },
        "selected": w.quant.mode,
        "settings": [],
        "unavailable": [{"mode": mode, "reason": reason} for mode, reason in skipped],
        "budget": None,
    }
    for g, p in zip(geoms, settings, strict=True):
        d = p.as_dict()
        d["quant"] = quant_as_dict(g.quant)
        d["page_auto"] = g.page_choice is not None
        d["page_waste_by_kind"] = dict(g.page_choice.waste) if g.page_choice is not None else None
        d["tiers"] = _tier_doc(g)
        doc["settings"].append(d)  # type: ignore[union-attr]
    if budget is not None:
        fits = _budget_fits(w, budget.bytes, budget.source, attention, head_group)
        doc["budget"] = {**budget.as_dict(), "fits": fits}
    return doc
