"""The human table of a plan dict (`plan_doc.build_plan`): header, settings, tiers, budget lines."""

from __future__ import annotations

from pagedqvg.allocator import format_bytes
from pagedqvg.cli.args import speak_flags
from pagedqvg.planning.planner import COMPACT_BLOCK
from pagedqvg.planning.presets import Workload, shape_text


def _n(x: int) -> str:
    return f"{x:,}"


def _segment_pages_text(s: dict, dtype: str) -> str:
    """One setting's pages of one chunk-sized segment; dense segments are labelled with the cache `dtype`."""
    if s["mode"] == "off":
        return f"{dtype} {s['segment_pages']['bf16']} pages"
    return f"{s['mode']} {s['segment_pages']['packed']} pages"


def _tier_lines(settings: list) -> list[str]:
    """One line per packed setting: its tiers' formats and bytes for all caches."""
    return [f"  tiers of paged {s['mode']}: {s['tiers']['summary']}" for s in settings if s["mode"] != "off"]


def aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """`rows` as table lines: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows
    ]


def _plan_header_lines(w: dict, g: dict, settings: list, dt: str) -> list[str]:
    """The plan's first lines: workload, ranks, caches, chunk, sink, window and one chunk segment's pages."""
    tpf = int(w["tokens_per_frame"])
    steps = int(w["denoise_steps"])
    wl = Workload(**{k: v for k, v in w.items() if k != "quant"})
    lines = [
        f"pagedqvg plan: {w['name']}"
        + (f" ({w['description']})" if w.get("description") else "")
        + f": {shape_text(wl)}",
        f"  model   {w['layers']} layers x {w['heads']} heads x {w['head_dim']} head_dim, {w['dtype']}, batch "
        f"{w['batch_size']}",
    ]
    if g["ranks"] > 1:
        lines.append(
            f"  ranks   --ulysses {w['ulysses']} x --tp {w['tp']} = {g['ranks']} ranks: {g['heads_per_rank']} heads "
            "per rank; every figure below is per rank (one GPU)"
        )
    return [
        *lines,
        f"  caches  {g['sessions']} session(s) x {g['cache_sets']} cache set(s) x {w['layers']} layers = "
        f"{g['caches']} caches in one pool",
        f"  chunk   {w['chunk_frames']} frames = {_n(g['chunk_tokens'])} tokens; {steps} denoise steps + 1 clean pass"
        f" = {steps + 1} calls per chunk and layer"
        + (f"; scene-cut pin every {w['scene_cut_every']} chunks" if w["scene_cut_every"] else ""),
        f"  sink    S = {_n(g['sink_tokens'])}, global GS = {_n(g['global_sink_tokens'])}, effective E = "
        f"{_n(g['effective_sink_tokens'])} tokens ({g['effective_sink_tokens'] / tpf:g} frames)",
        f"  window  {_n(g['window_tokens'])} tokens ({g['window_tokens'] / tpf:g} frames, current chunk included);"
        f" cache_size C = {_n(g['cache_size_tokens'])} slots; attention window W = "
        f"{_n(g['attention_window_tokens'])}",
        f"  pages   {dt} token row {_n(g['dense_row_bytes'])} B (K or V); one chunk segment: "
        + ", ".join(f"{_segment_pages_text(s, dt)} of {format_bytes(s['page_bytes'])}" for s in settings)
        + ("" if w["page_bytes"] is not None else " (auto page size per setting)"),
        "",
    ]


_PLAN_COLUMNS = (
    "",
    "page",
    "segments/layer",
    "pages/layer",
    "per layer",
    "all caches",
    "vs dense",
    "waste",
    "pool pages",
    "budget needed",
)


def _plan_setting_row(s: dict, selected: str, dt: str) -> tuple[str, ...]:
    """One paged setting's row of the plan table (per layer and all caches, pages, waste, budget)."""
    per, allb = s["per_layer"], s["all_layers"]
    mark = " *" if s["mode"] == selected else ""
    name = f"paged {dt}" if s["mode"] == "off" else f"paged {s['mode']}"
    waste = per["waste_bytes"] / per["bytes"] if per["bytes"] else 0.0
    segs = f"{per['bf16_segments']} {dt}"
    if per["packed_segments"]:
        segs += f" + {per['packed_segments']} packed"
    return (
        name + mark,
        format_bytes(s["page_bytes"]),
        segs,
        _n(per["pages"]),
        format_bytes(per["bytes"]),
        format_bytes(allb["bytes"]),
        f"{s['ratio_vs_dense']:.2f}x",
        f"{100 * waste:.2f}%",
        _n(s["pool_pages"]),
        format_bytes(s["budget_bytes"]),
    )


def _plan_table_lines(doc: dict, g: dict, settings: list, dt: str) -> list[str]:
    """The table (dense reference, then every setting) and the notes under it."""
    dense = (
        f"dense {dt} (reference)",
        "-",
        "-",
        "-",
        format_bytes(g["dense_cache_bytes_per_layer"]),
        format_bytes(g["dense_cache_bytes_all_layers"]),
        "1.00x",
        "-",
        "-",
        "-",
    )
    rows = [_PLAN_COLUMNS, dense] + [_plan_setting_row(s, str(doc["selected"]), dt) for s in settings]
    lines = aligned(rows)
    for item in doc.get("unavailable") or []:
        lines.append(f"  paged {item['mode']}: not possible with this shape: {speak_flags(item['reason'])}")
    head_dim = doc["workload"]["head_dim"]  # type: ignore[index]
    for s in settings:
        block = s.get("quant", {}).get("block_size")
        if s["mode"] == "compact" and block is not None and block != COMPACT_BLOCK:
            why = " (head_dim below 128: one fitted scale per token-head)" if block == head_dim else ""
            lines.append(f"  paged compact: blocks of {block} channels per fitted scale{why}")
    lines += _tier_lines(settings)
    view = settings[0]
    transient = (
        f"  transient view: {_n(view['transient_view_tokens'])} tokens = {format_bytes(view['transient_view_bytes'])}"
        " per call, one layer at a time, outside the pool"
    )
    if view.get("attention") == "pages":
        transient = (
            f"  attention from pages (--attention pages): scratch {format_bytes(view['transient_view_bytes'])} per "
            f"call ({doc['settings'][0]['mode']}; packed modes add their tile decode), one layer at a time, no view"
        )
    return [
        *lines,
        "",
        transient,
        "  budget needed = pool pages x page size + one transient view (or the attention scratch)",
        f"  * selected quantization ({doc['selected']}); vs dense = dense {dt} bytes / paged bytes; waste = page "
        "tails + rows of evicted tokens in retained segments",
    ]


def _budget_fit_line(r: dict, g: dict, tpf: int, dt: str) -> str:
    """One quantization setting under the budget: the largest window that fits and the sessions at this window."""
    name = dt if r["mode"] == "off" else r["mode"]
    at = f"at {g['window_tokens'] / tpf:g} frames"
    fit = f"{r['max_sessions']} session(s) {at}" if r["max_sessions"] else f"no session fits {at}"
    if r["max_window_frames"] is None:
        return (
            f"    {name:<7} does not fit: even {r['min_window_frames']} frames need "
            f"{format_bytes(r['min_budget_bytes'])}; {fit}"
        )
    at_least = ">=" if r["search_limited"] else "  "
    return (
        f"    {name:<7} {at_least}{r['max_window_frames']:>6} frames (C = "
        f"{_n(r['cache_size_tokens'])} slots): needs {format_bytes(r['budget_bytes'])} "
        f"(pool {format_bytes(r['pool_bytes'])}); {fit}" + ("; the search stops there" if r["search_limited"] else "")
    ) + _attention_modes_text(r)


def _attention_modes_text(r: dict) -> str:
    """The attention modes side by side (frames that fit, transient bytes per call), or "" without them."""
    by = r.get("by_attention")
    if not by:
        return ""
    return " | attention " + ", ".join(_attention_mode_text(a, v) for a, v in by.items())


def _attention_mode_text(mode: str, v: dict) -> str:
    """`view 105 frames (3.21 GiB transient)`; mode heads names its group: `heads of 7 123 frames (...)`."""
    name = f"{mode} of {v['heads_per_group']}" if "heads_per_group" in v else mode
    return f"{name} {v['max_window_frames']} frames ({format_bytes(v['transient_bytes'])} transient)"


def _plan_budget_lines(budget: dict, g: dict, tpf: int, dt: str) -> list[str]:
    """The budget arithmetic (with --gpu or --memory-fraction) and what fits it, per quantization setting."""
    lines: list[str] = []
    arithmetic = budget.get("lines") or []
    if len(arithmetic) > 1:
        lines += ["", "  budget per rank:"]
        for item in arithmetic:
            lines.append(f"    {item['op']:>1} {format_bytes(int(item['bytes'])):>12}  {item['label']}")
    lines += [
        "",
        f"  budget {format_bytes(budget['bytes'])} ({budget['source']}): largest window that fits "
        f"({int(g['sessions'])} session(s)), and sessions that fit at this window",
    ]
    return lines + [_budget_fit_line(r, g, tpf, dt) for r in budget["fits"]]


def format_plan(doc: dict[str, object]) -> str:
    """The human table of a plan dict."""
    w = doc["workload"]
    g = doc["geometry"]
    settings = doc["settings"]
    assert isinstance(w, dict) and isinstance(g, dict) and isinstance(settings, list)
    dt = str(w["dtype"])  # the label of dense (unquantized) rows and segments: bf16, fp16 or fp32
    lines = _plan_header_lines(w, g, settings, dt) + _plan_table_lines(doc, g, settings, dt)
    budget = doc.get("budget")
    if budget:
        assert isinstance(budget, dict)
        lines += _plan_budget_lines(budget, g, int(w["tokens_per_frame"]), dt)
    return "\n".join(lines)
