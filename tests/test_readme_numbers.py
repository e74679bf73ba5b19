"""The exact figures of README.md and docs/*.md (docs/NUMBERS.md, docs/PLANNING.md) against the code: each is recomputed
(planner, page layout, PRQ byte format) and must appear on its line of those docs, so a change that moves a figure
fails here until the README is regenerated (`python benchmarks/regenerate.py` writes every figure to
benchmarks/results/).

Recomputed here (about 20 s on 2 busy cores): packed chunk vs bf16 in bytes and in pool pages, whole-cache bytes and
ratios of LingBot-World, the page-waste table and its summary, the byte columns of both PRQ tables, the 24 GiB windows,
compact vs int2 steady state of simulate, and every line of the README's `$ pagedqvg plan ...` examples and of its `$
pagedqvg simulate --kv-cache-quant int2` example (as the accounting replay, `--dry-run`). Not recomputed (slow, see
benchmarks/readme_figures.py): PRQ errors, bench_vs_baselines' resident and transient bytes, the SGLang memory table,
the long-fuzz step count; timings are quoted with their command. Every sample block is compared in full, exactly, by
tests/test_docs_samples.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import readme_figures


def test_every_exact_figure_is_in_the_readme() -> None:
    lines = readme_figures.readme_lines()
    figures = readme_figures.exact_figures()
    assert len(figures) >= 60
    missing = [f"{f.name}: expected {f.text!r} on a line with {f.anchor!r}" for f in figures
               if not readme_figures.find(f, lines)]  # fmt: skip
    assert not missing, "README figures moved (regenerate: python benchmarks/regenerate.py):\n" + "\n".join(missing)


BLOCKS = readme_figures.readme_plan_blocks()


def test_the_readme_has_its_examples() -> None:
    commands = [" ".join(argv) for argv, _lines in BLOCKS]
    assert "plan --preset lingbot-world --budget 24GiB" in commands
    assert "simulate --kv-cache-quant int2" in commands
    assert len(BLOCKS) >= 5 and all(lines for _argv, lines in BLOCKS)


@pytest.mark.parametrize("argv,lines", BLOCKS, ids=[" ".join(a) for a, _ in BLOCKS])
def test_readme_example_matches_a_fresh_run(argv: list[str], lines: list[str], tmp_path: Path) -> None:
    missing = readme_figures.example_lines_missing(argv, lines, str(tmp_path))
    assert not missing, f"README lines of `pagedqvg {' '.join(argv)}` a fresh run does not print:\n" + "\n".join(
        missing
    )


def test_the_checker_notices_a_moved_figure() -> None:
    figure = readme_figures._prq_table_figures()[0]  # the default int2 row: "| 35 | 6.09x | 6.73x |"
    lines = readme_figures.readme_lines()
    assert readme_figures.find(figure, lines)
    moved = [line.replace(figure.text, figure.text.replace("6.09x", "6.10x")) for line in lines]
    assert not readme_figures.find(figure, moved)
    elsewhere = readme_figures.Figure(figure.name, "| int4 sym, K=128, 1 stage |", figure.text)
    assert not readme_figures.find(elsewhere, lines)  # the figure must sit on its own row
