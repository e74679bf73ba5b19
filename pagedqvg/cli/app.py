"""The `pagedqvg` command: `pagedqvg plan` (what fits) and `pagedqvg simulate` (run the real pool and prove it).

Bad input (an unknown preset, a negative size, a window smaller than a chunk, a budget too small for even the sink,
flags that mean nothing together) prints one line `pagedqvg: error: ...` on stderr, naming the flags as typed, and
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pagedqvg import __version__
from pagedqvg.cli.args import (
    QUANT_FLAGS,
    Parser,
    UsageError,
    check_combinations,
    fail,
    fraction_arg,
    int_arg,
    int_list_arg,
    join_negative_values,
    size_arg,
    speak_flags,
    typed_flags,
    workload_from_args,
)
from pagedqvg.cli.plan_doc import build_plan, resolve_budget
from pagedqvg.cli.plan_text import format_plan
from pagedqvg.cli.sim_text import format_summary
from pagedqvg.planning.geometry import PAGE_BYTES_RANGE
from pagedqvg.planning.planner import ATTENTION_MODES, Geometry, plan_geometry
from pagedqvg.planning.presets import (
    DEFAULT_GPU_MEMORY_FRACTION,
    DEFAULT_PLAN_PRESET,
    DEFAULT_SIMULATE_PRESET,
    GPUS,
    PRESETS,
)
from pagedqvg.validation import DTYPES_BY_NAME

DEFAULT_OUT_DIR = "./pagedqvg-out"


def _add_common(p: argparse.ArgumentParser, default_preset: str, *, simulate: bool) -> None:
    g = p.add_argument_group("workload (every field overrides the preset)")
    g.add_argument(
        "--preset", choices=sorted(PRESETS), default=default_preset, help=f"model preset (default {default_preset})"
    )
    g.add_argument("--layers", type=int_arg(1), help="transformer layers (one cache each)")
    g.add_argument("--heads", type=int_arg(1), help="K/V heads per layer")
    g.add_argument("--head-dim", type=int_arg(1), help="channels per head")
    g.add_argument("--tokens-per-frame", type=int_arg(1), help="tokens per latent frame")
    g.add_argument("--chunk-frames", type=int_arg(1), help="frames per chunk (one advance)")
    g.add_argument("--sink-frames", type=int_arg(0), help="sink frames")
    g.add_argument("--window-frames", type=int_arg(1), help="rolling window in frames, the current chunk included")
    g.add_argument("--sink-tokens", type=int_arg(0), help="sink tokens S (default sink-frames x tokens-per-frame)")
    g.add_argument("--global-sink-tokens", type=int_arg(0), help="global sink tokens GS (default S or 0, per preset)")
    g.add_argument(
        "--cache-size",
        type=int_arg(1),
        dest="cache_size_tokens",
        help="cache_size C in tokens (default max(S, GS) + window)",
    )
    g.add_argument(
        "--attention-window",
        type=int_arg(0),
        dest="attention_window_tokens",
        help="attention_window_size W in tokens (default 0 = C)",
    )
    g.add_argument("--scene-cut-every", type=int_arg(0), help="pin the current chunk every N chunks (0: never)")
    g.add_argument("--denoise-steps", type=int_arg(1), help="denoise steps per chunk (calls = steps + 1 clean pass)")
    g.add_argument("--batch-size", type=int_arg(1), help="batch size")
    g.add_argument("--dtype", choices=sorted(DTYPES_BY_NAME), help="cache dtype (default bf16)")
    g.add_argument(
        "--page-bytes",
        type=size_arg("--page-bytes", example="2MiB", auto=True),
        help=f"pool page size, {PAGE_BYTES_RANGE}, or auto (default): the size whose pages waste least "
        " for the record sizes of every segment kind in use (<= 0.5%% per kind where reachable)",
    )
    g.add_argument("--cache-sets", type=int_arg(1), help="cache sets per session (2 with classifier-free guidance)")
    g.add_argument("--sessions", type=int_arg(1), help="concurrent sessions sharing the pool (default 1)")
    g.add_argument(
        "--ulysses", type=int_arg(1), help="Ulysses sequence-parallel ranks: each rank caches heads / N of every token"
    )
    g.add_argument("--tp", type=int_arg(1), help="tensor-parallel ranks: heads (and weights) split N ways")
    # plan accepts --chunks only to refuse it with a reason (check_combinations); its --help does not offer it
    chunks_help = "chunks to simulate (default 20)" if simulate else argparse.SUPPRESS
    g.add_argument("--chunks", type=int_arg(1), help=chunks_help)
    g.add_argument("--stagger", type=int_arg(0), help="sessions start this many chunks apart (planning/stagger.py)")
    g.add_argument(
        "--session-chunks", type=int_list_arg, help="with --stagger: chunks each session runs, e.g. 10,20,30"
    )
    q = p.add_argument_group("quantization (SGLang flag names)")
    for flag, help_text, extra in QUANT_FLAGS:
        q.add_argument(
            flag,
            dest=flag.lstrip("-").replace("-", "_"),
            metavar=None if "choices" in extra else "V",
            help=help_text,
            **extra,
        )


def _add_fork_args(p: argparse.ArgumentParser, *, simulate: bool) -> None:
    """--branches / --diverge-chunks / --fork-at-chunk and --host-budget (planning/branches.py, host_budget.py)."""
    g = p.add_argument_group("branches and the host tier (planning/branches.py, planning/host_budget.py)")
    g.add_argument(
        "--branches",
        type=int_arg(1),
        metavar="N",
        help="N copy-on-write branches of one session (SessionManager.fork at a chunk boundary, the session itself "
        "included), each then running --diverge-chunks chunks of its own, in step: the shared history (held once) "
        "and each branch's divergence vs N independent sessions"
        + ("; measured through SessionManager.fork" if simulate else "; with a budget, how many branches fit"),
    )
    g.add_argument("--diverge-chunks", type=int_arg(0), metavar="K", help="with --branches: chunks each branch runs "
                   "after the fork (default 1)")  # fmt: skip
    g.add_argument(
        "--fork-at-chunk",
        type=int_arg(1),
        metavar="P",
        help="with --branches: chunks the session runs before the fork (default: its warm-up to the steady state)",
    )
    g.add_argument(
        "--host-budget",
        type=size_arg("--host-budget", example="64GiB"),
        metavar="SIZE",
        help="host memory for parked sessions (SessionManager.swap_out): sessions per device resident and parked"
        + ("; needs --budget (the device pool), measured through swap_out/swap_in" if simulate else
           "; needs a device budget (--budget, --gpu or --memory-fraction)"),
    )  # fmt: skip
    if simulate:
        g.add_argument("--budget", type=size_arg("--budget"), help="with --host-budget: the device budget, e.g. 4MiB")


def _add_attention_arg(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--attention",
        choices=ATTENTION_MODES,
        default="view",
        help="view: each call builds a transient K/V view (update_and_get_attention_kv); pages: update_and_attend "
        "(attention from pages: a window-independent scratch instead); heads: update_and_attend_heads (the view of "
        "one group of heads at a time, the user's attention per group). Budget lines show all three (default view)",
    )
    plan.add_argument(
        "--head-group",
        type=int_arg(1),
        default=None,
        metavar="HEADS",
        help="mode heads: heads per group (default: the smallest group of >= 90%% wave efficiency on an H200's 132 "
        "SMs for the chunk's queries; clamped to the heads per rank)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `pagedqvg` argument parser."""
    parser = Parser(
        prog="pagedqvg",
        description="Size and test the paged KV cache of autoregressive video diffusion models.",
    )
    parser.add_argument("--version", action="version", version=f"pagedqvg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{plan,simulate}")
    plan = sub.add_parser(
        "plan",
        help="steady-state memory per layer and for all layers; what fits a budget",
        description="Exact steady-state bytes (dense cache, paged dense, packed) from the page and segment layout; "
        "with --budget or --memory-fraction, the largest window that fits for each quantization setting.",
    )
    _add_common(plan, DEFAULT_PLAN_PRESET, simulate=False)
    b = plan.add_argument_group("budget (per rank; pool + one transient view)")
    b.add_argument("--budget", type=size_arg("--budget"), help="bytes for the KV cache itself, e.g. 24GiB")
    b.add_argument(
        "--gpu",
        help=f"a whole device from the table: {', '.join(GPUS)}; budget = memory x --memory-fraction - "
        "--weights / --tp - --reserve",
    )
    b.add_argument(
        "--memory-fraction",
        type=fraction_arg,
        help=f"fraction of the device's memory pagedqvg may use (with --gpu: of its total, default "
        f"{DEFAULT_GPU_MEMORY_FRACTION:g}; alone: of this machine's free memory on --device)",
    )
    b.add_argument(
        "--weights",
        type=size_arg("--weights", minimum=0, example="28GB"),
        help="model weights on the device before tensor parallelism (default with --gpu: the preset's DiT weights)",
    )
    b.add_argument(
        "--reserve", type=size_arg("--reserve", minimum=0, example="8GiB"), help="activations and workspace (default 0)"
    )
    b.add_argument(
        "--device", default=None, help="device for --memory-fraction without --gpu (default cuda if present)"
    )
    _add_attention_arg(plan)
    _add_fork_args(plan, simulate=False)
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
    _add_common(sim, DEFAULT_SIMULATE_PRESET, simulate=True)
    _add_fork_args(sim, simulate=True)
    sim.add_argument("--out", default=DEFAULT_OUT_DIR, help=f"output directory (default {DEFAULT_OUT_DIR}/)")
    sim.add_argument(
        "--dry-run", action="store_true", help="accounting only, at full size, without tensors (seconds on a CPU)"
    )
    sim.add_argument("--device", default=None, help="device of the pool and data: cpu or cuda (default cpu)")
    sim.add_argument("--seed", type=int_arg(0), default=None, help="seed of the synthetic K/V (default 0)")
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


def cmd_plan(args: argparse.Namespace) -> int:
    """`pagedqvg plan`."""
    w = workload_from_args(args)
    if args.stagger is not None:
        return _cmd_stagger(args, w, measure=False)
    if args.branches is not None or args.host_budget is not None:
        return _cmd_forks(args, w, measure=False)
    budget = resolve_budget(args, w)
    doc = build_plan(w, budget, attention=args.attention, head_group=args.head_group)
    print(json.dumps(doc, indent=2) if args.json else format_plan(doc))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """`pagedqvg simulate`."""
    from pagedqvg.planning import simulate as sim

    w = workload_from_args(args)
    if args.stagger is not None:
        return _cmd_stagger(args, w, measure=not args.dry_run)
    if args.branches is not None or args.host_budget is not None:
        return _cmd_forks(args, w, measure=not args.dry_run)
    geom = Geometry.from_workload(w)
    device = args.device or "cpu"
    seed = args.seed or 0
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
        sim.check_fits(geom, device, plan.pool_bytes)
        timeline = sim.run_caches(geom, w, device=device, seed=seed, progress=args.progress)
        accounting = sim.run_accounting(geom, w.chunks, progress=False)
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


def _cmd_stagger(args: argparse.Namespace, w, *, measure: bool) -> int:
    """`plan` / `simulate` with `--stagger K`: staggered sessions (pagedqvg/planning/stagger.py); exit 1 when measured
    and
    planned pages differ at any call."""
    from pagedqvg.planning.stagger import format_stagger, stagger_budget, stagger_report

    geom = Geometry.from_workload(w)
    chunks = args.chunks if args.command == "simulate" else None
    budget = resolve_budget(args, w) if args.command == "plan" else None
    doc = stagger_report(geom, args.stagger, args.session_chunks, chunks, measure=measure, device=args.device or "cpu")
    if budget is not None:  # the staggered peak against --budget / --gpu / --memory-fraction
        doc["budget"] = stagger_budget(doc, geom, budget)
    print(json.dumps(doc, indent=2) if args.json else format_stagger(doc))
    return 1 if doc.get("mismatches") else 0


def _cmd_forks(args: argparse.Namespace, w, *, measure: bool) -> int:
    """`plan` / `simulate` with `--branches` or `--host-budget` (planning/branches.py, planning/host_budget.py;
    measured by cli/fork_sim.py); exit 1 when a measured figure differs from the plan."""
    from pagedqvg.planning.branches import branches_report, format_branches
    from pagedqvg.planning.host_budget import format_host, host_report

    geom = Geometry.from_workload(w)
    device = args.device or "cpu"
    pool_pages = None
    if args.command == "plan":
        budget = resolve_budget(args, w)
        budget_doc = budget.as_dict() if budget is not None else None
        budget_bytes = budget.bytes if budget is not None else None
    else:
        budget_bytes = args.budget
        budget_doc = {"bytes": args.budget, "source": "--budget"} if args.budget is not None else None
    if budget_bytes is not None:
        transient = plan_geometry(geom).view_bytes
        pool_pages = max(0, budget_bytes - transient) // geom.page_bytes
        budget_doc = {**(budget_doc or {}), "transient_bytes": transient, "pool_pages": pool_pages}
    if args.branches is not None:
        diverge = 1 if args.diverge_chunks is None else args.diverge_chunks
        if measure:
            from pagedqvg.cli.fork_sim import measure_branches

            doc = measure_branches(geom, args.branches, diverge, args.fork_at_chunk, device=device, seed=args.seed or 0)
        else:
            doc = branches_report(geom, args.branches, diverge, args.fork_at_chunk, pool_pages=pool_pages)
        text = format_branches(doc)
        bad = bool(doc.get("mismatches")) or doc.get("figures_equal") is False
    else:
        assert pool_pages is not None  # check_combinations: --host-budget needs a device budget
        if measure:
            from pagedqvg.cli.fork_sim import measure_host

            doc = measure_host(geom, pool_pages, args.host_budget, device=device)
        else:
            doc = host_report(geom, pool_pages, args.host_budget)
        text = format_host(doc)
        bad = bool(doc.get("mismatches"))
    if budget_doc is not None:
        doc["budget"] = budget_doc
    doc = {"schema": "pagedqvg.forks/1", "workload": w.as_dict(), **doc}
    print(json.dumps(doc, indent=2) if args.json else text)
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pagedqvg` console script; returns the exit status (2 for bad input)."""
    parser = build_parser()
    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help/--version (0) or a usage error (2, already reported on one line)
        return int(exc.code or 0)
    if args.command is None:
        fail("choose a command: plan or simulate (see pagedqvg --help)")
        return 2
    try:
        check_combinations(args, typed_flags(argv))
        return int(args.func(args))
    except ValueError as exc:  # UsageError, CacheConfigError, QuantConfig and geometry checks
        fail(speak_flags(str(exc)))
        return 2
    except BrokenPipeError:  # `pagedqvg plan | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
