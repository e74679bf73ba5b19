"""Every exact figure README.md quotes that is cheap to recompute (planner, page layout, PRQ byte format).

`exact_figures()` recomputes them from the code and says where each one belongs in README.md: a `Figure` is found
when one line of the README holds its `anchor` and its `text` (bold markers `**` ignored). `readme_plan_blocks()`
reads the README's `$ pagedqvg plan ...` / `$ pagedqvg simulate ...` example blocks so that their lines can be
compared with a fresh run. Used by `tests/test_readme_numbers.py` (a moved figure fails until the README is
regenerated) and `benchmarks/regenerate.py` (which writes them to `benchmarks/results/`). Seconds on a CPU.

Figures that are exact but left to `regenerate.py` because they need real runs (minutes here): PRQ errors (K/V
relative error, SNR, attention-output error: deterministic per device and library build, not bitwise across CPUs),
resident K/V bytes after 60 chunks and peak transient bytes (`bench_vs_baselines.py`), the SGLang memory table
(`bench_sglang_memory.py`, needs SGLang), the long-fuzz step count, and simulate's call-by-call agreement of real
caches (the planner tests assert it on tiny shapes).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pagedqvg.allocator import format_bytes
from pagedqvg.cli.app import build_parser, build_plan, main, workload_from_args
from pagedqvg.planning.planner import Geometry, SettingPlan, max_window_frames, min_window_frames, plan_geometry
from pagedqvg.planning.presets import get_preset
from pagedqvg.quant import PackedFormat, QuantConfig

README = Path(__file__).resolve().parent.parent / "README.md"
#: The user docs the figures and examples may sit in: README.md and docs/*.md (read as one text, README first).
DOCS = (README, *sorted((README.parent / "docs").glob("*.md")))


def _docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in DOCS)
CHUNK = 4680  # one LingBot-World chunk: 3 frames x 1,560 tokens
HEAD_DIM = 128
FULL_PRESETS = ("lingbot-world", "longlive2", "self-forcing")
MINI_PRESETS = ("lingbot-world-mini", "longlive2-mini", "self-forcing-mini")
#: Columns of the README's page-waste table: label -> plan flags.
WASTE_MODES: dict[str, list[str]] = {
    "off": [],
    "int4": ["--kv-cache-quant", "int4"],
    "int2": ["--kv-cache-quant", "int2"],
    "int2 trits": ["--kv-cache-quant", "int2", "--kv-cache-quant-pack-trits"],
    "compact": ["--kv-cache-quant", "compact"],
}
#: The pages the waste table compares with (in brackets): the fixed sizes used before `--page-bytes auto`.
OLD_PAGE = {"full": "2MiB", "mini": "40KiB"}


@dataclass(frozen=True)
class Figure:
    """A figure as README.md writes it: `text` on a line that also holds `anchor`."""

    name: str
    anchor: str
    text: str


def short_bytes(n: int) -> str:
    """`format_bytes` without a `.00` tail, as the README writes page sizes (`321 KiB`, `771.75 KiB`, `3.99 MiB`)."""
    return format_bytes(n).replace(".00 ", " ")


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


@cache
def plan_doc(argv: tuple[str, ...]) -> dict:
    """`pagedqvg plan ARGV --json` as a dict (no budget arguments)."""
    args = build_parser().parse_args(["plan", *argv])
    return build_plan(workload_from_args(args))


def selected(doc: dict) -> dict:
    """The plan's setting for the selected quantization."""
    return next(s for s in doc["settings"] if s["mode"] == doc["selected"])


@cache
def selected_plan(argv: tuple[str, ...]) -> SettingPlan:
    """The plan of the selected quantization of `pagedqvg plan ARGV` (one setting: faster than `plan_doc`)."""
    w = workload_from_args(build_parser().parse_args(["plan", *argv]))
    return plan_geometry(Geometry.from_workload(w))


def waste_cells() -> dict[tuple[str, str], tuple[float, int, float]]:
    """(preset, mode label) -> (waste at the auto page size, that page size, waste at the old fixed page size)."""
    cells = {}
    for preset in FULL_PRESETS + MINI_PRESETS:
        old = OLD_PAGE["mini" if preset.endswith("-mini") else "full"]
        for label, flags in WASTE_MODES.items():
            auto = selected_plan(("--preset", preset, *flags))
            fixed = selected_plan(("--preset", preset, *flags, "--page-bytes", old))
            cells[preset, label] = (auto.waste_bytes / auto.bytes, auto.page_bytes, fixed.waste_bytes / fixed.bytes)
    return cells


def _waste_figures() -> list[Figure]:
    cells = waste_cells()
    out = [
        Figure(f"waste {p} {m}", f"| {p} |", f"{pct(a)} @ {short_bytes(page)} ({pct(f)})")
        for (p, m), (a, page, f) in cells.items()
    ]
    full = [c for (p, _m), c in cells.items() if p in FULL_PRESETS]
    mini = [c for (p, _m), c in cells.items() if p in MINI_PRESETS]
    row = "| page waste at steady state"
    out.append(Figure("waste max full presets (auto)", row, f"<= {pct(max(a for a, _p, _f in full))}"))
    out.append(Figure("waste max full presets (2 MiB)", row, f"up to {pct(max(f for _a, _p, f in full))}"))
    out.append(Figure("waste max minis (auto)", "four `*-mini` cases", f"up to {pct(max(a for a, _p, _f in mini))}"))
    return out


def _chunk_bytes_figures() -> list[Figure]:
    """Packed chunk vs bf16 in bytes (PackedFormat) and in pool pages (the plan's segment pages x page size)."""
    i2, i4 = (PackedFormat(HEAD_DIM, 1, QuantConfig(bits=b)).compression_ratio(CHUNK) for b in (2, 4))
    compact = PackedFormat(HEAD_DIM, 1, QuantConfig.compact()).compression_ratio(CHUNK)
    out = [
        Figure("int2/int4 chunk ratio (bytes)", "`benchmarks/bench_prq.py`): int2 / int4", f"{i2:.2f}x / {i4:.2f}x"),
        Figure("compact chunk ratio (bytes)", "packs a chunk", f"**{compact:.2f}x** smaller"),
    ]
    doc = plan_doc(("--preset", "lingbot-world"))
    by_mode = {s["mode"]: s for s in doc["settings"]}

    def seg(mode: str) -> tuple[int, int]:
        s = by_mode[mode]
        return int(s["segment_pages"]["bf16" if mode == "off" else "packed"]), int(s["page_bytes"])

    bf16_pages, bf16_page = seg("off")
    parts, ratios = [], []
    for mode in ("compact", "int2", "int4"):
        n, page = seg(mode)
        parts.append(f"{mode} {n} x {short_bytes(page)}")
        ratios.append(f"{bf16_pages * bf16_page / (n * page):.2f}x")
    text = ", ".join(parts) + f" vs bf16 {bf16_pages} x {short_bytes(bf16_page)}"
    out.append(Figure("chunk in pool pages", "| same in pool pages", text))
    out.append(Figure("chunk in pool pages, ratios", "| same in pool pages", " / ".join(ratios)))
    return out


def _whole_cache_figures() -> list[Figure]:
    """All 40 LingBot-World layers at steady state: int2 defaults, trits with keep-recent 0, compact keep-recent 0."""
    cases = (
        ("int2 defaults", "| all 40 LingBot-World layers", ("--kv-cache-quant", "int2")),
        (
            "int2 trits keep 0",
            "--kv-cache-quant-keep-recent 0 --kv-cache-quant-pack-trits` |",
            ("--kv-cache-quant", "int2", "--kv-cache-quant-keep-recent", "0", "--kv-cache-quant-pack-trits"),
        ),
        (
            "compact keep 0",
            "| same with `--kv-cache-quant compact --kv-cache-quant-keep-recent 0` |",
            ("--kv-cache-quant", "compact", "--kv-cache-quant-keep-recent", "0"),
        ),
    )
    out = []
    for name, anchor, flags in cases:
        doc = plan_doc(("--preset", "lingbot-world", *flags))
        s = selected(doc)
        dense = format_bytes(doc["geometry"]["dense_cache_bytes_all_layers"])
        text = f"| {format_bytes(s['all_layers']['bytes'])} | dense {dense} | {s['ratio_vs_dense']:.2f}x smaller |"
        out.append(Figure(f"whole cache {name}", anchor, text))
    return out


def _prq_table_figures() -> list[Figure]:
    """The PRQ table's byte columns (B/token-head, ratios at 4,680 and 10,800 tokens) and the compact table's."""
    rows = (
        ("| int2 sym, K=128, 1 stage (default) |", QuantConfig(bits=2)),
        ("| int2 sym, K=256, 1 stage |", QuantConfig(bits=2, centroids=256)),
        ("| int2 sym, K=128, 2 stages |", QuantConfig(bits=2, stages=2)),
        ("| int2 asym, K=128, 1 stage |", QuantConfig(bits=2, asymmetric=True)),
        ("| int4 sym, K=128, 1 stage |", QuantConfig(bits=4)),
        ("| int4 asym, K=128, 1 stage |", QuantConfig(bits=4, asymmetric=True)),
        ("| int4 sym, K=128, 2 stages |", QuantConfig(bits=4, stages=2)),
        ("| **int2 trits** (`pack_trits`), K=128, blk 64 |", QuantConfig(bits=2, pack_trits=True)),
        (
            "| **int2 trits**, K=128, blk 16 (same bytes as default) |",
            QuantConfig(bits=2, pack_trits=True, block_size=16),
        ),
    )
    out = []
    for anchor, cfg in rows:
        fmt = PackedFormat(HEAD_DIM, 1, cfg)
        text = f"| {fmt.per_head_bytes} | {fmt.compression_ratio(CHUNK):.2f}x | {fmt.compression_ratio(10800):.2f}x |"
        out.append(Figure(f"prq table {anchor}", anchor.replace("**", ""), text))
    return out


#: The compact table's rows: label in the README -> config.
COMPACT_ROWS: tuple[tuple[str, QuantConfig | None], ...] = (
    ("| bf16 |", None),
    ("| int4 (reference flags) |", QuantConfig(bits=4)),
    ("| int2 (reference) |", QuantConfig(bits=2)),
    ("| int2 trits, blk 64 |", QuantConfig(bits=2, pack_trits=True)),
    ("| int2 trits, blk 16 |", QuantConfig(bits=2, pack_trits=True, block_size=16)),
    ("| compact |", QuantConfig.compact()),
)


def lingbot_window_24gib(cfg: QuantConfig | None) -> int | None:
    """Largest LingBot-World window (frames) in a 24 GiB KV budget with quantization `cfg` (bench_prq's table)."""
    w = get_preset("lingbot-world")
    geom = Geometry.from_workload(w.replace(quant=cfg or QuantConfig()))
    return max_window_frames(geom, 24 << 30, min_window_frames(geom, w.chunk_frames))


def _compact_table_figures() -> list[Figure]:
    out = []
    for anchor, cfg in COMPACT_ROWS:
        frames = lingbot_window_24gib(cfg)
        if cfg is None:
            cells = "| 256 | 1.00x | 1.00x |"
        else:
            fmt = PackedFormat(HEAD_DIM, 1, cfg)
            per_token = fmt.per_head_bytes + cfg.stages * fmt.codebook_row_bytes / CHUNK
            cells = (
                f"| {per_token:.2f} | {fmt.compression_ratio(CHUNK):.2f}x | {fmt.compression_ratio(10800):.2f}x |"
            )
        out.append(Figure(f"compact table {anchor}", anchor, cells))
        out.append(Figure(f"compact table window {anchor}", anchor, f"| {frames} frames |"))
    return out


def _simulate_figures() -> list[Figure]:
    """`pagedqvg simulate --kv-cache-quant compact` on the default mini: its steady state vs int2's (plan figures;
    the real run equals them, see the planner tests)."""
    w = get_preset("lingbot-world-mini")
    steady = {}
    for name, flags in (("compact", ("--kv-cache-quant", "compact")), ("int2", ("--kv-cache-quant", "int2"))):
        args = build_parser().parse_args(["simulate", "--preset", w.name, *flags])
        steady[name] = format_bytes(plan_geometry(Geometry.from_workload(workload_from_args(args))).all_bytes)
    text = f"steady state {steady['compact']} vs {steady['int2']} for"
    return [Figure("simulate compact vs int2 steady state", "400/400 calls identical to the plan", text)]


def exact_figures() -> list[Figure]:
    """Every cheap exact figure of the README, recomputed (a few seconds)."""
    return (
        _chunk_bytes_figures()
        + _whole_cache_figures()
        + _waste_figures()
        + _prq_table_figures()
        + _compact_table_figures()
        + _simulate_figures()
    )


def readme_lines() -> list[str]:
    return [line.replace("**", "") for line in _docs_text().splitlines()]


def find(figure: Figure, lines: list[str]) -> bool:
    """Whether one README line holds both the figure's anchor and its text (bold markers removed)."""
    anchor, text = figure.anchor.replace("**", ""), figure.text.replace("**", "")
    return any(anchor in line and text in line for line in lines)


# ---------------------------------------------------------------------------------------------------- example blocks
def readme_plan_blocks() -> list[tuple[list[str], list[str]]]:
    """(argv, README lines) of every `$ pagedqvg plan ...` / `$ pagedqvg simulate ...` example in a text block."""
    blocks: list[tuple[list[str], list[str]]] = []
    in_text = False
    for line in _docs_text().splitlines():
        if line.startswith("```"):
            in_text = line.strip() == "```text"
            continue
        if not in_text:
            continue
        if line.startswith("$ pagedqvg "):
            blocks.append((shlex.split(line[len("$ pagedqvg ") :]), []))
        elif blocks and line.strip():
            blocks[-1][1].append(line)
    return blocks


def run_cli(argv: list[str]) -> str:
    """`pagedqvg ARGV`'s stdout (in this process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    if status != 0:
        raise RuntimeError(f"pagedqvg {' '.join(argv)} exited with {status}")
    return out.getvalue()


#: What an example's line may differ in between runs or engines, replaced before comparing: the engine and seconds
#: (`real caches on cpu: 400 calls in 7.72 s` vs the dry run's `accounting only (...): 400 calls in 0.45 s`) and
#: `measured` vs `replayed`.
_NORMALIZE = (
    (re.compile(r"^  (real caches on \S+|accounting only \(--dry-run, no tensors\)): ([0-9,]+) calls in [0-9.]+ s"),
     r"  ENGINE: \2 calls in T s"),
    (re.compile(r"\b(measured|replayed)\b"), "SOURCE"),
)
#: Lines a dry run does not print (output paths; the real run's call-by-call comparison, which the planner tests
#: assert on tiny shapes).
_REAL_RUN_ONLY = re.compile(r"^  (timeline|plot): |calls identical$")


def _normalized(line: str) -> str:
    for pattern, repl in _NORMALIZE:
        line = pattern.sub(repl, line)
    return line


def example_lines_missing(argv: list[str], lines: list[str], out_dir: str) -> list[str]:
    """The README lines of one example that a fresh run does not print. `simulate` examples run as `--dry-run`
    (the accounting replay, whose figures real caches reproduce call by call) with outputs in `out_dir`."""
    if argv[0] == "simulate":
        argv = [*argv, "--dry-run", "--no-plot", "--out", out_dir]
        lines = [x for x in lines if not _REAL_RUN_ONLY.search(x)]
    fresh = {_normalized(x) for x in run_cli(argv).splitlines()}
    return [x for x in lines if _normalized(x) not in fresh]
