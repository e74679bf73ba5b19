"""The `pagedqvg` command: `pagedqvg plan` (what fits) and `pagedqvg simulate` (run the real pool and prove it).

Bad input (an unknown preset, a negative size, a window smaller than a chunk, a budget too small for even the sink)
prints one line `pagedqvg: error: ...` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .allocator import available_memory_bytes, format_bytes
from .planner import (
    Geometry,
    max_window_frames,
    min_window_frames,
    plan_geometry,
    search_limit_frames,
    setting_geometries,
    setting_quant,
)
from .presets import DEFAULT_PLAN_PRESET, DEFAULT_SIMULATE_PRESET, DTYPES, PRESETS, Workload, get_preset
from .quant.config import SGLANG_KEYS, QuantConfig

PLAN_SCHEMA = "pagedqvg.plan/1"
DEFAULT_OUT_DIR = "./pagedqvg-out"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


class UsageError(ValueError):
    """A command-line mistake (reported as one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but every usage error is one line on stderr (`pagedqvg: error: ...`) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(message)
        raise SystemExit(2)


def _fail(message: str) -> None:
    one_line = " ".join(str(message).split())
    sys.stderr.write(f"pagedqvg: error: {one_line}\n")


# ---------------------------------------------------------------------------------------------------- arg types
def parse_size(text: str) -> int:
    """Bytes from `24GiB`, `1.5 GiB`, `512MB`, `2M` (binary), `4096`. Raises ArgumentTypeError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use e.g. 24GiB, 512MiB, 2MB or a number of bytes (sizes are >= 0)"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be > 0")
    return value


def _int(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is out of range; must be >= {minimum}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; must be in (0, 1]")
    return value


# ---------------------------------------------------------------------------------------------------- parser
_QUANT_FLAGS: tuple[tuple[str, str, dict], ...] = (
    (
        "--kv-cache-quant",
        "quantization of completed chunks: off, int4 or int2 (default off)",
        {"choices": ("off", "int4", "int2")},
    ),
    ("--kv-cache-quant-centroids", "k-means centroids per (head, stage), 1..256 (default 128)", {}),
    ("--kv-cache-quant-block-size", "channels per fp8 scale; divides head_dim (default 64)", {}),
    ("--kv-cache-quant-stages", "residual k-means stages (default 1)", {}),
    ("--kv-cache-quant-iters", "k-means iterations per stage (default 2)", {}),
    ("--kv-cache-quant-keep-recent", "completed chunks kept in bf16 (default 1)", {}),
    ("--kv-cache-quant-sink-keep", "sink chunks kept in bf16 when the sink is packed (default 0)", {}),
    ("--kv-cache-quant-asymmetric", "per-block scale and zero (default false)", {"nargs": "?", "const": "true"}),
    ("--kv-cache-quant-sink", "pack sink chunks too (default true)", {"nargs": "?", "const": "true"}),
    ("--kv-cache-quant-seed", "k-means seed (default 1234)", {}),
    (
        "--kv-cache-quant-pack-trits",
        "pack symmetric int2 codes 5 per byte (default false)",
        {"nargs": "?", "const": "true"},
    ),
)


def _add_common(p: argparse.ArgumentParser, default_preset: str) -> None:
    g = p.add_argument_group("workload (every field overrides the preset)")
    g.add_argument(
        "--preset", choices=sorted(PRESETS), default=default_preset, help=f"model preset (default {default_preset})"
    )
    g.add_argument("--layers", type=_int(1), help="transformer layers (one cache each)")
    g.add_argument("--heads", type=_int(1), help="K/V heads per layer")
    g.add_argument("--head-dim", type=_int(1), help="channels per head")
    g.add_argument("--tokens-per-frame", type=_int(1), help="tokens per latent frame")
    g.add_argument("--chunk-frames", type=_int(1), help="frames per chunk (one advance)")
    g.add_argument("--sink-frames", type=_int(0), help="sink frames")
    g.add_argument("--window-frames", type=_int(1), help="rolling window in frames, the current chunk included")
    g.add_argument("--sink-tokens", type=_int(0), help="sink tokens S (default sink-frames x tokens-per-frame)")
    g.add_argument("--global-sink-tokens", type=_int(0), help="global sink tokens GS (default S or 0, per preset)")
    g.add_argument(
        "--cache-size",
        type=_int(1),
        dest="cache_size_tokens",
        help="cache_size C in tokens (default max(S, GS) + window)",
    )
    g.add_argument(
        "--attention-window",
        type=_int(0),
        dest="attention_window_tokens",
        help="attention_window_size W in tokens (default 0 = C)",
    )
    g.add_argument("--scene-cut-every", type=_int(0), help="pin the current chunk every N chunks (0: never)")
    g.add_argument("--denoise-steps", type=_int(1), help="denoise steps per chunk (calls = steps + 1 clean pass)")
    g.add_argument("--batch-size", type=_int(1), help="batch size")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="cache dtype (default bf16)")
    g.add_argument("--page-bytes", type=parse_size, help="pool page size, e.g. 2MiB (multiple of 256 B)")
    g.add_argument("--cache-sets", type=_int(1), help="independent cache sets (2 with classifier-free guidance)")
    g.add_argument("--chunks", type=_int(1), help="chunks to simulate (default 20)")
    q = p.add_argument_group("quantization (SGLang flag names)")
    for flag, help_text, extra in _QUANT_FLAGS:
        q.add_argument(
            flag,
            dest=flag.lstrip("-").replace("-", "_"),
            metavar=None if "choices" in extra else "V",
            help=help_text,
            **extra,
        )


def build_parser() -> argparse.ArgumentParser:
    """The `pagedqvg` argument parser."""
    parser = _Parser(
        prog="pagedqvg",
        description="Size and test the paged KV cache of autoregressive video diffusion models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{plan,simulate}")
    plan = sub.add_parser(
        "plan",
        help="steady-state memory per layer and for all layers; what fits a budget",
        description="Exact steady-state bytes (dense bf16, paged bf16, packed) from the page and segment layout; "
        "with --budget or --memory-fraction, the largest window that fits for each quantization setting.",
    )
    _add_common(plan, DEFAULT_PLAN_PRESET)
    b = plan.add_mutually_exclusive_group()
    b.add_argument("--budget", type=parse_size, help="device memory for KV (pool + one view), e.g. 24GiB")
    b.add_argument("--memory-fraction", type=_fraction, help="fraction of the device's free memory, e.g. 0.9")
    plan.add_argument("--device", default=None, help="device for --memory-fraction (default cuda if present)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(func=cmd_plan)

    sim = sub.add_parser(
        "simulate",
        help="run the real pool and caches over N chunks; memory timeline (JSON + PNG) vs plan",
        description="Runs every layer's cache on one pool (sized exactly at the plan's pages) with the preset's "
        "call pattern on synthetic video K/V, records memory per call and compares it with the plan. Without "
        f"arguments: preset {DEFAULT_SIMULATE_PRESET} on the CPU. Exit status 0: measured and plan agree within 1%; "
        "1: they do not; 2: bad input.",
    )
    _add_common(sim, DEFAULT_SIMULATE_PRESET)
    sim.add_argument("--out", default=DEFAULT_OUT_DIR, help=f"output directory (default {DEFAULT_OUT_DIR}/)")
    sim.add_argument(
        "--dry-run", action="store_true", help="accounting only, at full size, without tensors (seconds on a CPU)"
    )
    sim.add_argument("--device", default="cpu", help="device of the pool and data: cpu or cuda (default cpu)")
    sim.add_argument("--seed", type=_int(0), default=0, help="seed of the synthetic K/V (default 0)")
    sim.add_argument("--json", action="store_true", help="print the summary as JSON")
    sim.add_argument("--no-plot", action="store_true", help="skip timeline.png")
    sim.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    sim.set_defaults(func=cmd_simulate)
    return parser


# ---------------------------------------------------------------------------------------------------- workload
_WORKLOAD_FLAGS = (
    "layers",
    "heads",
    "head_dim",
    "tokens_per_frame",
    "chunk_frames",
    "sink_frames",
    "window_frames",
    "sink_tokens",
    "global_sink_tokens",
    "cache_size_tokens",
    "attention_window_tokens",
    "scene_cut_every",
    "denoise_steps",
    "batch_size",
    "dtype",
    "page_bytes",
    "cache_sets",
    "chunks",
)


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The preset with every given flag applied. ValueError for a bad value (exit status 2)."""
    w = get_preset(args.preset)
    w = w.replace(**{name: getattr(args, name) for name in _WORKLOAD_FLAGS})
    given = {}
    for flag, _help, _extra in _QUANT_FLAGS:
        key = flag.lstrip("-").replace("-", "_")
        value = getattr(args, key)
        if value is not None:
            given[SGLANG_KEYS[key]] = value
    if given:
        merged = {name: getattr(w.quant, name) for name in QuantConfig.known_keys() if hasattr(w.quant, name)}
        merged.update(given)
        w = w.replace(quant=QuantConfig.from_dict(merged))
    return w


# ---------------------------------------------------------------------------------------------------- plan
def _n(x: int) -> str:
    return f"{x:,}"


def _segment_pages_text(s: dict) -> str:
    if s["mode"] == "off":
        return f"bf16 {s['segment_pages']['bf16']} pages"
    return f"{s['mode']} {s['segment_pages']['packed']} pages"


def _budget_fits(w: Workload, budget: int) -> list[dict[str, object]]:
    rows = []
    for geom in setting_geometries(w)[0]:
        lo = min_window_frames(geom, w.chunk_frames)
        frames = max_window_frames(geom, budget, lo)
        row: dict[str, object] = {
            "mode": geom.quant.mode,
            "max_window_frames": frames,
            "search_limited": frames == search_limit_frames(geom),
            "cache_size_tokens": None,
            "budget_bytes": None,
            "pool_bytes": None,
            "min_window_frames": lo,
            "min_budget_bytes": plan_geometry(geom.with_window_frames(lo), replay=False).budget_bytes,
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
            f"budget {format_bytes(budget)} is too small for even the sink and one chunk: the smallest window "
            f"({best['min_window_frames']} frames) needs {format_bytes(int(best['min_budget_bytes']))} "
            f"with {best['mode']}"
        )
    return rows


def build_plan(w: Workload, budget: int | None = None, budget_source: str = "") -> dict[str, object]:
    """The plan as a JSON-ready dict (schema `pagedqvg.plan/1`)."""
    geom = Geometry.from_workload(w)
    geoms, skipped = setting_geometries(w)
    settings = [plan_geometry(g) for g in geoms]
    dense = geom.dense
    doc: dict[str, object] = {
        "schema": PLAN_SCHEMA,
        "workload": w.as_dict(),
        "geometry": {
            "caches": geom.caches,
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
        "settings": [s.as_dict() for s in settings],
        "unavailable": [{"mode": mode, "reason": reason} for mode, reason in skipped],
        "budget": None,
    }
    if budget is not None:
        doc["budget"] = {"bytes": budget, "source": budget_source, "fits": _budget_fits(w, budget)}
    return doc


def format_plan(doc: dict[str, object]) -> str:
    """The human table of a plan dict."""
    w = doc["workload"]
    g = doc["geometry"]
    assert isinstance(w, dict) and isinstance(g, dict)
    tpf = int(w["tokens_per_frame"])
    steps = int(w["denoise_steps"])
    settings = doc["settings"]
    assert isinstance(settings, list)
    lines = [
        f"pagedqvg plan: {w['name']}" + (f" ({w['description']})" if w.get("description") else ""),
        f"  model   {w['layers']} layers x {w['heads']} heads x {w['head_dim']} head_dim, {w['dtype']}, batch "
        f"{w['batch_size']}, {w['cache_sets']} cache set(s): {g['caches']} caches in one pool",
        f"  chunk   {w['chunk_frames']} frames = {_n(g['chunk_tokens'])} tokens; {steps} denoise steps + 1 clean pass"
        f" = {steps + 1} calls per chunk and layer"
        + (f"; scene-cut pin every {w['scene_cut_every']} chunks" if w["scene_cut_every"] else ""),
        f"  sink    S = {_n(g['sink_tokens'])}, global GS = {_n(g['global_sink_tokens'])}, effective E = "
        f"{_n(g['effective_sink_tokens'])} tokens ({g['effective_sink_tokens'] / tpf:g} frames)",
        f"  window  {_n(g['window_tokens'])} tokens ({g['window_tokens'] / tpf:g} frames, current chunk included);"
        f" cache_size C = {_n(g['cache_size_tokens'])} slots; attention window W = "
        f"{_n(g['attention_window_tokens'])}",
        f"  pages   {format_bytes(g['page_bytes'])}; bf16 token row {_n(g['dense_row_bytes'])} B (K or V), "
        f"{_n(g['dense_tokens_per_page'])} tokens/page; one chunk segment: "
        + ", ".join(_segment_pages_text(s) for s in settings),
        "",
    ]
    header = (
        "",
        "segments/layer",
        "pages/layer",
        "per layer",
        "all layers",
        "vs dense",
        "waste",
        "pool pages",
        "budget needed",
    )
    rows = [header]
    rows.append(
        (
            "dense bf16 (reference)",
            "-",
            "-",
            format_bytes(g["dense_cache_bytes_per_layer"]),
            format_bytes(g["dense_cache_bytes_all_layers"]),
            "1.00x",
            "-",
            "-",
            "-",
        )
    )
    for s in settings:
        per, allb = s["per_layer"], s["all_layers"]
        mark = " *" if s["mode"] == doc["selected"] else ""
        name = "paged bf16" if s["mode"] == "off" else f"paged {s['mode']}"
        waste = per["waste_bytes"] / per["bytes"] if per["bytes"] else 0.0
        segs = (
            f"{per['bf16_segments']} bf16"
            if not per["packed_segments"]
            else f"{per['bf16_segments']} bf16 + {per['packed_segments']} packed"
        )
        rows.append(
            (
                name + mark,
                segs,
                _n(per["pages"]),
                format_bytes(per["bytes"]),
                format_bytes(allb["bytes"]),
                f"{s['ratio_vs_dense']:.2f}x",
                f"{100 * waste:.2f}%",
                _n(s["pool_pages"]),
                format_bytes(s["budget_bytes"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    for item in doc.get("unavailable") or []:
        lines.append(f"  paged {item['mode']}: not possible with this shape: {item['reason']}")
    view = settings[0]
    lines += [
        "",
        f"  transient view: {_n(view['transient_view_tokens'])} tokens = {format_bytes(view['transient_view_bytes'])}"
        " per call, one layer at a time, outside the pool",
        "  budget needed = pool pages x page size + one transient view",
        f"  * selected quantization ({doc['selected']}); vs dense = dense bf16 bytes / paged bytes; waste = page "
        "tails + rows of evicted tokens in retained segments",
    ]
    budget = doc.get("budget")
    if budget:
        assert isinstance(budget, dict)
        lines += ["", f"  budget {format_bytes(budget['bytes'])} ({budget['source']}): largest window that fits"]
        for r in budget["fits"]:
            name = "bf16" if r["mode"] == "off" else r["mode"]
            if r["max_window_frames"] is None:
                lines.append(
                    f"    {name:<5} does not fit: even {r['min_window_frames']} frames need "
                    f"{format_bytes(r['min_budget_bytes'])}"
                )
            else:
                at_least = ">=" if r["search_limited"] else "  "
                lines.append(
                    f"    {name:<5} {at_least}{r['max_window_frames']:>6} frames (C = "
                    f"{_n(r['cache_size_tokens'])} slots): needs {format_bytes(r['budget_bytes'])} "
                    f"(pool {format_bytes(r['pool_bytes'])})"
                    + ("; the search stops there" if r["search_limited"] else "")
                )
    return "\n".join(lines)


def _budget(args: argparse.Namespace) -> tuple[int | None, str]:
    if args.budget is not None:
        return args.budget, "--budget"
    if args.memory_fraction is not None:
        device = args.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        free = available_memory_bytes(device)
        return int(free * args.memory_fraction), f"{args.memory_fraction:g} of {format_bytes(free)} free on {device}"
    return None, ""


def cmd_plan(args: argparse.Namespace) -> int:
    """`pagedqvg plan`."""
    w = workload_from_args(args)
    budget, source = _budget(args)
    doc = build_plan(w, budget, source)
    print(json.dumps(doc, indent=2) if args.json else format_plan(doc))
    return 0


# ---------------------------------------------------------------------------------------------------- simulate
def format_summary(s: dict[str, object]) -> str:
    """The human summary of a simulate run."""
    w, m, p, a = s["workload"], s["measured"], s["plan"], s["agreement"]
    assert isinstance(w, dict) and isinstance(m, dict) and isinstance(p, dict) and isinstance(a, dict)
    if s["engine"] == "accounting":
        engine = "accounting only (--dry-run, no tensors)"
    else:
        engine = f"real caches on {s['device']}"
    lines = [
        f"pagedqvg simulate: {w['name']}: {w['layers']} layers x {w['heads']} heads x {w['head_dim']}, "
        f"{w['tokens_per_frame']} tokens/frame, {s['chunks']} chunks of {w['chunk_frames']} frames, quant "
        f"{s['quant_measured']}",
        f"  {engine}: {_n(int(s['calls']))} calls in {s['seconds']:.2f} s; pool "
        f"{format_bytes(int(s['pool_capacity_bytes']))}",
    ]
    if s["note"]:
        lines.append(f"  note: {s['note']}")
    rows = [("", "measured", "plan", "diff")]

    def row(label: str, mk: str, pk: str) -> None:
        mv, pv = int(m[mk]), int(p[pk])
        diff = abs(mv - pv) / pv if pv else 0.0
        rows.append((label, format_bytes(mv), format_bytes(pv), f"{100 * diff:.2f}%"))

    row("steady state (pool held)", "steady_state_bytes", "steady_state_bytes")
    row("high-water", "high_water_bytes", "high_water_bytes")
    row("used (rows)", "used_bytes", "used_bytes")
    row("waste", "waste_bytes", "waste_bytes")
    row("transient view (max)", "max_view_bytes", "transient_view_bytes")
    rows.append(
        (
            "bf16 / packed segments",
            f"{format_bytes(int(m['bf16_bytes']))} / {format_bytes(int(m['packed_bytes']))}",
            "",
            "",
        )
    )
    rows.append(("dense bf16 cache (reference)", "", format_bytes(int(p["dense_bf16_bytes"])), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    if a["checked"]:
        verdict = "agree" if a["ok"] else "DISAGREE"
        lines.append(
            f"  measured vs plan: {verdict} (steady state {100 * a['steady_state_rel_diff']:.3f}%, "
            f"high-water {100 * a['high_water_rel_diff']:.3f}%; tolerance {100 * a['tolerance']:g}%)"
        )
    else:
        lines.append(
            f"  measured vs plan: not checked, {s['chunks']} chunks do not reach the steady state "
            f"(plan: {p['warmup_chunks']} chunks); use --chunks {p['warmup_chunks']} or more"
        )
    acc = s.get("accounting")
    if isinstance(acc, dict):
        lines.append(
            f"  call by call vs the accounting replay: {acc['calls_compared'] - acc['mismatches']}/"
            f"{acc['calls_compared']} calls identical"
            + (f"; first: {acc['first_mismatch']}" if acc["mismatches"] else "")
        )
    plan_only = s.get("plan_only")
    if plan_only:
        assert isinstance(plan_only, list)
        lines.append(
            "  packed (plan only): "
            + "; ".join(
                f"{q['mode']} steady state {format_bytes(int(q['steady_state_bytes']))} ({q['ratio_vs_dense']:.2f}x "
                "vs dense)"
                for q in plan_only
            )
            + "  (rerun with --kv-cache-quant int2 to measure)"
        )
    outs = s.get("outputs") or {}
    assert isinstance(outs, dict)
    for key, label in (("timeline_json", "timeline"), ("timeline_png", "plot")):
        if outs.get(key):
            lines.append(f"  {label}: {outs[key]}")
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    """`pagedqvg simulate`."""
    from . import simulate as sim

    w = workload_from_args(args)
    geom = Geometry.from_workload(w)
    out_dir = Path(args.out)
    try:  # before the run: an unusable output folder is bad input, not a traceback after minutes of work
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".pagedqvg-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {args.out}: cannot write there ({exc.strerror or exc})") from None
    accounting = None
    if args.dry_run:
        timeline = sim.run_accounting(geom, w.chunks, progress=args.progress)
    else:
        plan = plan_geometry(geom)
        sim.check_fits(geom, args.device, plan.pool_bytes)
        timeline = sim.run_caches(geom, w, device=args.device, seed=args.seed, progress=args.progress)
        measured = (
            geom
            if timeline.quant_mode == geom.quant.mode
            else Geometry.from_workload(w, setting_quant(geom.quant, None))
        )
        accounting = sim.run_accounting(measured, w.chunks, progress=False)
    outputs = {"timeline_json": str(out_dir / "timeline.json")}
    plot = not args.no_plot
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plot = False
            sys.stderr.write("pagedqvg: matplotlib is not installed (pip install 'pagedqvg[cli]'): no timeline.png\n")
    if plot:
        outputs["timeline_png"] = str(out_dir / "timeline.png")
    summary = sim.summarize(w, geom, timeline, accounting=accounting, outputs=outputs)
    sim.write_timeline(out_dir / "timeline.json", summary, timeline)
    if plot:
        sim.plot_timeline(out_dir / "timeline.png", summary, timeline)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    agreement = summary["agreement"]
    assert isinstance(agreement, dict)
    acc = summary["accounting"]
    if not agreement["ok"] or (isinstance(acc, dict) and acc["mismatches"]):
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pagedqvg` console script; returns the exit status (2 for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already reported on one line)
        return int(exc.code or 0)
    if args.command is None:
        _fail("choose a command: plan or simulate (see pagedqvg --help)")
        return 2
    try:
        return int(args.func(args))
    except ValueError as exc:  # UsageError, CacheConfigError, QuantConfig and geometry checks
        _fail(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
