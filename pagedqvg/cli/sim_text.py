"""The human summary of a `pagedqvg simulate` run (`planning.simulate.summarize`)."""

from __future__ import annotations

from pagedqvg.allocator import format_bytes
from pagedqvg.cli.plan_text import _n, aligned


def _summary_header_lines(s: dict, w: dict) -> list[str]:
    """The run's first two lines: workload, chunks, quantization, sessions/ranks; engine, calls, seconds, pool."""
    dry = s["engine"] == "accounting"
    engine = "accounting only (--dry-run, no tensors)" if dry else f"real caches on {s['device']}"
    ranks = int(w["ulysses"]) * int(w["tp"])
    scope = ""
    if int(w["sessions"]) > 1 or int(w["cache_sets"]) > 1:
        scope += f", {w['sessions']} session(s) x {w['cache_sets']} cache set(s) in one pool"
    if ranks > 1:
        scope += f", one rank of {ranks} ({int(w['heads']) // ranks} heads)"
    return [
        f"pagedqvg simulate: {w['name']}: {w['layers']} layers x {w['heads']} heads x {w['head_dim']}, "
        f"{w['tokens_per_frame']} tokens/frame, {s['chunks']} chunks of {w['chunk_frames']} frames, quant "
        f"{s['quant_measured']}{scope}",
        f"  {engine}: {_n(int(s['calls']))} calls in {s['seconds']:.2f} s; pool "
        f"{format_bytes(int(s['pool_capacity_bytes']))}",
    ]


def _summary_table_lines(w: dict, m: dict, p: dict, source: str) -> list[str]:
    """Measured (or replayed) vs plan: steady state, high-water, used, waste, transient view; segment bytes."""
    rows = [("", source, "plan", "diff")]
    for label, mk, pk in (
        ("steady state (pool held)", "steady_state_bytes", "steady_state_bytes"),
        ("high-water", "high_water_bytes", "high_water_bytes"),
        ("used (rows)", "used_bytes", "used_bytes"),
        ("waste", "waste_bytes", "waste_bytes"),
        ("transient view (max)", "max_view_bytes", "transient_view_bytes"),
    ):
        mv, pv = int(m[mk]), int(p[pk])
        diff = abs(mv - pv) / pv if pv else 0.0
        rows.append((label, format_bytes(mv), format_bytes(pv), f"{100 * diff:.2f}%"))
    segments = f"{format_bytes(int(m['bf16_bytes']))} / {format_bytes(int(m['packed_bytes']))}"
    rows.append((f"{w['dtype']} / packed segments", segments, "", ""))
    rows.append((f"dense {w['dtype']} cache (reference)", "", format_bytes(int(p["dense_bf16_bytes"])), ""))
    return aligned(rows)


def _summary_check_lines(s: dict, p: dict, a: dict, source: str) -> list[str]:
    """The verdicts: measured vs plan (or why it was not checked) and the call-by-call comparison."""
    if a["checked"]:
        verdict = "agree" if a["ok"] else "DISAGREE"
        lines = [
            f"  {source} vs plan: {verdict} (steady state {100 * a['steady_state_rel_diff']:.3f}%, "
            f"high-water {100 * a['high_water_rel_diff']:.3f}%; tolerance {100 * a['tolerance']:g}%)"
        ]
    else:
        lines = [
            f"  {source} vs plan: not checked, {s['chunks']} chunks do not reach the steady state "
            f"(plan: {p['warmup_chunks']} chunks); use --chunks {p['warmup_chunks']} or more"
        ]
    acc = s.get("accounting")
    if isinstance(acc, dict):
        lines.append(
            f"  call by call vs the accounting replay: {acc['calls_compared'] - acc['mismatches']}/"
            f"{acc['calls_compared']} calls identical"
            + (f"; first: {acc['first_mismatch']}" if acc["mismatches"] else "")
        )
    return lines


def _summary_output_lines(s: dict) -> list[str]:
    """Plan-only figures of the packed settings (a bf16 run) and the files written."""
    lines = []
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
            + "  (rerun with --kv-cache-quant MODE to measure)"
        )
    outs = s.get("outputs") or {}
    assert isinstance(outs, dict)
    for key, label in (("timeline_json", "timeline"), ("timeline_png", "plot")):
        if outs.get(key):
            lines.append(f"  {label}: {outs[key]}")
    return lines


def format_summary(s: dict[str, object]) -> str:
    """The human summary of a simulate run."""
    w, m, p, a = s["workload"], s["measured"], s["plan"], s["agreement"]
    assert isinstance(w, dict) and isinstance(m, dict) and isinstance(p, dict) and isinstance(a, dict)
    source = "replayed" if s["engine"] == "accounting" else "measured"
    lines = _summary_header_lines(s, w) + _summary_table_lines(w, m, p, source)
    return "\n".join(lines + _summary_check_lines(s, p, a, source) + _summary_output_lines(s))
