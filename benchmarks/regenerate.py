"""Regenerate every figure README.md quotes, one dated file per benchmark in benchmarks/results/.

    python benchmarks/regenerate.py                 # everything this machine can run (tens of minutes on 2 cores)
    python benchmarks/regenerate.py --quick         # the benchmarks' own quick modes; simulate as --dry-run
    python benchmarks/regenerate.py --only plan,readme_figures
    python benchmarks/regenerate.py --sglang-src /tmp/sglang-src   # adds the SGLang rows (see bench_sglang_memory.py)

Each `<out>/<name>-<YYYY-MM-DD>.md` starts with the command, the UTC date and the machine (CPU model, cores, torch,
triton and Python versions), then the benchmark's output. `<out>/regenerate-<YYYY-MM-DD>.md` lists every benchmark
with its status (ok, failed with its exit status, or skipped with the reason: no SGLang sources, no CUDA device) and
wall time (an `--only` run adds its rows to the day's index). The exact figures of the README are checked against
the code by tests/test_readme_numbers.py; timings are quoted in the README with the date and command of the file
they come from. On a shared machine, `OMP_NUM_THREADS=1` keeps other processes' load from swinging the multi-threaded
ops (the machine line shows the thread count).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


@dataclass
class Benchmark:
    """One results file: `commands` (argv lists run with this Python) or an in-process `write` function."""

    name: str
    what: str
    commands: Callable[[argparse.Namespace], list[list[str]]] = lambda _a: []
    write: Callable[[argparse.Namespace], str] | None = None
    skip: Callable[[argparse.Namespace], str] = lambda _a: ""
    env: Callable[[argparse.Namespace], dict[str, str]] = field(default=lambda _a: {})


def _cli(*argv: str) -> list[str]:
    return ["-m", "pagedqvg.cli", *argv]


def _script(name: str, *argv: str) -> list[str]:
    return [str(BENCH / name), *argv]


#: The README's `pagedqvg plan` commands (examples and the Numbers table's rows).
PLAN_COMMANDS: tuple[str, ...] = (
    "plan --preset lingbot-world --budget 24GiB",
    "plan --preset longlive2 --budget 24GiB",
    "plan --preset self-forcing --budget 24GiB",
    "plan --preset lingbot-world --gpu H200 --ulysses 2 --sessions 2 --reserve 8GiB --kv-cache-quant int2",
    "plan --preset lingbot-world --kv-cache-quant int2",
    "plan --preset lingbot-world --kv-cache-quant int2 --kv-cache-quant-keep-recent 0 --kv-cache-quant-pack-trits",
    "plan --preset lingbot-world --kv-cache-quant compact --kv-cache-quant-keep-recent 0",
)


def _simulate_commands(args: argparse.Namespace) -> list[list[str]]:
    out = str(Path(args.scratch) / "simulate")
    dry = ["--dry-run"] if args.quick else []
    runs = ([], ["--kv-cache-quant", "int2"], ["--kv-cache-quant", "compact"])
    return [_cli("simulate", *r, *dry, "--no-plot", "--no-progress", "--out", out) for r in runs]


def _readme_figures(_args: argparse.Namespace) -> str:
    """The exact figures test_readme_numbers.py checks, as computed now, and the page-waste table."""
    import readme_figures as rf

    lines = rf.readme_lines()
    rows = ["| figure | value | in README.md |", "|---|---|---|"]
    for f in rf.exact_figures():
        found = "yes" if rf.find(f, lines) else "**no: update the README**"
        rows.append(f"| {f.name} | `{f.text}` | {found} |")
    rows += ["", "Page waste at steady state, auto page size (in brackets: the old fixed pages, 2 MiB / 40 KiB):", ""]
    modes = list(rf.WASTE_MODES)
    rows += ["| preset | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    cells = rf.waste_cells()
    for preset in rf.FULL_PRESETS + rf.MINI_PRESETS:
        text = [f"{rf.pct(a)} @ {rf.short_bytes(p)} ({rf.pct(f)})" for a, p, f in (cells[preset, m] for m in modes)]
        rows.append(f"| {preset} | " + " | ".join(text) + " |")
    return "\n".join(rows) + "\n"


def _sglang_env(args: argparse.Namespace) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([args.sglang_src, str(ROOT / ".ci")])} if args.sglang_src else {}


def _cuda_missing(_args: argparse.Namespace) -> str:
    import torch

    return "" if torch.cuda.is_available() else "no CUDA device on this machine"


#: bench_forks.py's shapes: the committed JSON's (the fork timed on 1 full-shape layer of LingBot-World, 40 heads x 128
#: at 1,560 tokens per frame; 8 branches vs 8 sessions and the swap at 1 layer x 2 heads, 64 tokens per frame; ~10 min
#: on 2 cores).
_FORKS_FULL = ("--fork-heads", "40", "--fork-tokens-per-frame", "1560", "--tokens-per-frame", "64", "--json",
               str(BENCH / "results" / "bench_forks.json"))  # fmt: skip
_FORKS_QUICK = ("--quick",)


def _quick(args: argparse.Namespace, *flags: str) -> list[str]:
    return list(flags) if args.quick else []


def _sglang_flag(args: argparse.Namespace) -> list[str]:
    return ["--placeholders"] if args.sglang_src else []


def _sglang_missing(args: argparse.Namespace) -> str:
    return "" if args.sglang_src else "needs SGLang's sources: --sglang-src DIR (see .ci/sglang_suite.sh)"


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "readme_figures", "exact README figures, recomputed (planner, layout, PRQ format)", write=_readme_figures
    ),
    Benchmark(
        "plan",
        "pagedqvg plan: the README's examples and Numbers rows",
        lambda _a: [_cli(*c.split()) for c in PLAN_COMMANDS]
    ),
    Benchmark(
        "simulate",
        "pagedqvg simulate on lingbot-world-mini: off, int2, compact (--quick: --dry-run)",
        _simulate_commands,
    ),
    Benchmark(
        "prq",
        "PRQ bytes, errors and quantize time (bench_prq.py)",
        lambda a: [_script("bench_prq.py", *_quick(a, "--quick"))],
    ),
    Benchmark(
        "prq_compact",
        "compact mode: ideas, attention error, windows (bench_prq.py --compact)",
        lambda _a: [_script("bench_prq.py", "--compact")],
    ),
    Benchmark(
        "vs_baselines",
        "pagedqvg vs the dense cache and the segment list (bench_vs_baselines.py)",
        lambda a: [_script("bench_vs_baselines.py", *_quick(a, "--quick"), "--out", a.out)],
        env=_sglang_env,  # SGLang's QVG cache in the host-overhead table when --sglang-src is given
    ),
    Benchmark(
        "cpu_views",
        "CPU ms per call vs SGLang's QVG cache, or the segment list without SGLang (bench_cpu_views.py)",
        lambda a: [_script("bench_cpu_views.py", *_quick(a, "--reps", "5"), *_sglang_flag(a))],
        env=_sglang_env,
    ),
    Benchmark(
        "allocator", "page alloc/free and range index (bench_allocator.py)", lambda _a: [_script("bench_allocator.py")]
    ),
    Benchmark(
        "sglang_memory",
        "SGLang stages' KV memory, dense vs pool (bench_sglang_memory.py)",
        lambda _a: [_script("bench_sglang_memory.py", "--placeholders", "--steps", "0")],
        skip=_sglang_missing,
        env=_sglang_env,
    ),
    Benchmark(
        "attention",
        "attention from pages vs view + SDPA on CPU: ms and transient bytes (bench_attention.py)",
        lambda a: [_script("bench_attention.py", "--reps", "1" if a.quick else "3",
                           "--json", str(Path(a.out) / "attention_cpu.json"))],
    ),
    Benchmark(
        "tiers",
        "formats by age: bytes per tier and attention error (bench_tiers.py)",
        lambda a: [_script("bench_tiers.py", "--json", str(Path(a.out) / "bench_tiers.json"))],
    ),
    Benchmark(
        "cache_aging",
        "aged (repacked from decoded values) vs quantized-once error through the cache (bench_cache_aging.py)",
        lambda _a: [_script("bench_cache_aging.py")],
    ),
    Benchmark(
        "sglang_rollout",
        "rollout through SGLang's real LongLive2 stage: per-chunk error, Pareto table (bench_sglang_rollout.py)",
        lambda a: [_script("bench_sglang_rollout.py", a.sglang_src, *_quick(a, "--chunks", "8", "--cut-every", "4"),
                           "--json", str(Path(a.out) / "sglang_rollout.json"),
                           "--plot", str(Path(a.out) / "sglang_rollout.png"),
                           "--pareto", str(Path(a.out) / "bench_tiers.json"))],
        skip=_sglang_missing,
        env=_sglang_env,
    ),
    Benchmark(
        "sessions",
        "10,000 sessions on one pool: leaks, refusals, peak vs plan, calls/s (bench_sessions.py)",
        lambda a: [_script("bench_sessions.py", "--sessions", "1000" if a.quick else "10000",
                           "--json", str(Path(a.out) / "sessions.json"))],
    ),
    Benchmark(
        "transactions",
        "the cost of a call's transaction (journal and rollback) per advance and rewrite (bench_transactions.py)",
        lambda a: [_script("bench_transactions.py", "--quant", "off", "--rounds", "10" if a.quick else "40"),
                   _script("bench_transactions.py", "--quant", "int2", "--chunk", "512",
                           "--rounds", "4" if a.quick else "16")],
    ),
    Benchmark(
        "forks",
        "fork time, bytes copied, 8 branches vs 8 sessions, host-tier swap (bench_forks.py)",
        lambda a: [_script("bench_forks.py", *(_FORKS_QUICK if a.quick else _FORKS_FULL))],
    ),
    Benchmark(
        "host_tier",
        "sessions per device with a host tier of 2x the budget vs plain admission, 10,000 opens (bench_host_tier.py)",
        lambda a: [_script("bench_host_tier.py", *(("--sessions", "1000", "--calls", "300", "--json", "")
                                                   if a.quick else ()))],
    ),
    Benchmark(
        "kernels_cuda",
        "Triton kernels on a GPU (bench_kernels_cuda.py)",
        lambda _a: [_script("bench_kernels_cuda.py")],
        skip=_cuda_missing,
    ),
)


def machine() -> str:
    """CPU model, cores, torch / triton / Python versions, OS."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = []
    for pkg in ("torch", "triton"):
        try:
            versions.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{pkg} not installed")
    gpu = ""
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            gpu = f"; GPU {torch.cuda.get_device_name(0)}"
    threads = ""
    with contextlib.suppress(Exception):
        import torch

        threads = f" ({torch.get_num_threads()} torch threads)"
    return (
        f"{cpu}, {os.cpu_count()} cores{threads}; {', '.join(versions)}; Python {platform.python_version()}; "
        f"{platform.system()} {platform.release()}{gpu}"
    )


def run_benchmark(b: Benchmark, args: argparse.Namespace) -> tuple[str, str, float]:
    """(status, body, seconds) of one benchmark."""
    t0 = time.perf_counter()
    if b.write is not None:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            body = b.write(args)
        return "ok", buf.getvalue() + body, time.perf_counter() - t0
    env = dict(os.environ)
    extra = b.env(args)
    paths = [extra.get("PYTHONPATH", ""), str(ROOT), str(BENCH), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    parts, status = [], "ok"
    for argv in b.commands(args):
        shown = "python " + " ".join(a.replace(str(ROOT) + os.sep, "") for a in argv)
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
        parts.append(f"### `{shown}`\n\n```text\n{proc.stdout.rstrip()}\n```\n")
        if proc.returncode != 0:
            status = f"failed (exit status {proc.returncode})"
            tail = "\n".join(proc.stderr.splitlines()[-40:])
            parts.append(f"stderr (last 40 lines):\n\n```text\n{tail}\n```\n")
    return status, "\n".join(parts), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the benchmarks' quick modes; simulate as --dry-run")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(b.name for b in BENCHMARKS)}")
    ap.add_argument("--out", default=str(BENCH / "results"), help="results folder (default benchmarks/results)")
    ap.add_argument("--sglang-src", default="", help="folder holding SGLang's sources (adds the SGLang rows)")
    ap.add_argument("--scratch", default=str(ROOT / "pagedqvg-out" / "regenerate"), help="simulate's outputs")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {b.name for b in BENCHMARKS})
    if unknown:
        ap.error(f"--only: unknown benchmark(s) {', '.join(unknown)}")
    now = datetime.now(timezone.utc)
    day, stamp, host = now.strftime("%Y-%m-%d"), now.strftime("%Y-%m-%d %H:%M UTC"), machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"# regenerate {stamp}{' (--quick)' if args.quick else ''}"
    index = [title, "", f"Machine: {host}", "", "| benchmark | file | status | seconds |", "|---|---|---|---:|"]
    failed = False
    for b in BENCHMARKS:
        if names and b.name not in names:
            continue
        reason = b.skip(args)
        if reason:
            index.append(f"| {b.name} | - | skipped: {reason} | - |")
            continue
        print(f"regenerate: {b.name} ...", file=sys.stderr, flush=True)
        status, body, seconds = run_benchmark(b, args)
        failed |= status != "ok"
        path = out / f"{b.name}-{day}.md"
        header = f"# {b.what}\n\nRun {stamp} by `python benchmarks/regenerate.py{' --quick' if args.quick else ''}`"
        path.write_text(f"{header} ({seconds:.0f} s wall).\n\nMachine: {host}\n\n{body}", encoding="utf-8")
        index.append(f"| {b.name} | {path.name} | {status} | {seconds:.0f} |")
    path = out / f"regenerate-{day}.md"
    if names and path.exists():  # a subset: add its rows to the day's index instead of replacing the others
        index[0] = f"## --only {args.only}, {stamp}{' (--quick)' if args.quick else ''}"
        index = [path.read_text(encoding="utf-8").rstrip("\n"), "", *index]
    path.write_text("\n".join(index) + "\n", encoding="utf-8")
    print("\n".join(index))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
