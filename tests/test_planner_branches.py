"""Branches of one session (pagedqvg/planning/branches.py): the planner's replay with shared pages equals real caches
forked through `SessionManager.fork` call by call (pages after every call, peaks, shared and exclusive pages), quant
off and the recommended tiers, with sinks and scene-cut pins; bad counts are typed errors; the CLI's plan and
simulate."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedqvg import QuantConfig
from pagedqvg.cli.app import main
from pagedqvg.cli.fork_sim import measure_branches
from pagedqvg.errors import CacheConfigError
from pagedqvg.planning.branches import account_branches, branches_report, check_branches, max_branches
from pagedqvg.planning.planner import compact_quant, replay_layer
from pagedqvg.serving.sessions import SessionSpec, _geometry

#: The recommended tiers (presets.RECOMMENDED_TIERS: sink int4, recent int4, history compact) at head_dim 32.
TIERS = compact_quant(QuantConfig(), 32, sink_format="int4", recent_format="int4")


def geometry(quant=None, pins: int = 0, sets: int = 1):
    """2 layers x 4 heads x 32, chunks of 48 tokens (2 pages of 16 KiB in bf16), a 48-token global sink, 5 chunks
    of cache, 2 denoise steps."""
    spec = SessionSpec(layers=2, batch_size=1, cache_size=240, num_heads=4, head_dim=32, chunk_tokens=48,
                       sink_tokens=48, global_sink_tokens=48, denoise_steps=2, quant=quant,
                       cache_sets=sets)  # fmt: skip
    return dataclasses.replace(_geometry(spec, 16384), scene_cut_every=pins)


CASES = [
    (None, 0, 1, 1, 0, None),
    (None, 0, 1, 2, 1, None),
    (None, 0, 1, 4, 3, 3),
    (None, 2, 1, 3, 4, 5),
    (TIERS, 0, 1, 2, 1, None),
    (TIERS, 0, 1, 3, 4, None),
    (TIERS, 2, 1, 3, 3, 5),
    (TIERS, 0, 2, 2, 2, 2),
]


@pytest.mark.parametrize(("quant", "pins", "sets", "branches", "diverge", "history"), CASES,
                         ids=[f"{'tiers' if c[0] else 'off'}-pins{c[1]}-sets{c[2]}-N{c[3]}-K{c[4]}-P{c[5]}"
                              for c in CASES])  # fmt: skip
def test_plan_equals_measured_through_session_manager_fork(quant, pins, sets, branches, diverge, history):
    geom = geometry(quant, pins, sets)
    doc = measure_branches(geom, branches, diverge, history)
    assert doc["mismatches"] == 0 and doc["figures_equal"], doc["mismatch_text"]
    assert doc["measured_high_water_pages"] == doc["high_water_pages"]
    end = doc["end"]
    assert doc["measured_pages"] == end["pages"] and doc["measured_shared_pages"] == end["shared_pages"]
    assert doc["measured_exclusive_pages"] == end["exclusive_pages"]
    # every page at the end is either shared (held once) or one branch's alone
    assert end["pages"] == end["shared_pages"] + sum(end["exclusive_pages"])


def test_branches_hold_the_history_once_aged_chunks_included():
    geom = geometry(TIERS)
    doc = branches_report(geom, 8, 1)
    h, end, ind = doc["history"], doc["end"], doc["independent"]
    assert h["packed_pages"] > 0  # the fork is at the steady state: aged (packed) chunks in the history
    assert end["shared_pages"] > 0 and end["pages"] < ind["pages"]
    # the shared history is held once: 8 branches hold far less than 8 copies of the history plus divergence
    assert end["pages"] == end["shared_pages"] + sum(end["exclusive_pages"])
    assert end["pages"] + 7 * end["shared_pages"] == sum(end["branch_pages"])
    # one branch is one session: the same pages as the planner's census of an unforked session
    one = branches_report(geom, 1, 1)
    census = replay_layer(geom, one["history_chunks"] + 1)
    assert one["end"]["pages"] == geom.caches * census.after[-1] == one["independent"]["pages"]
    assert one["high_water_pages"] == census.pool_high_water(geom.caches) == one["independent"]["high_water_pages"]


def test_max_branches_is_the_largest_count_whose_peak_fits():
    geom = geometry(TIERS)
    history = 6
    peaks = [account_branches(geom, n, history, 1).high_water for n in range(1, 8)]
    assert peaks == sorted(peaks)
    pool = peaks[4]  # exactly 5 branches' peak
    assert max_branches(geom, history, 1, pool) == 5
    assert max_branches(geom, history, 1, pool - 1) == 4
    assert max_branches(geom, history, 1, peaks[0] - 1) == 0
    doc = branches_report(geom, 6, 1, history, pool_pages=pool)
    assert doc["fits"] is False and doc["max_branches"] == 5


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((0, 1, None), "--branches must be an int >= 1"),
        ((-3, 1, None), "got -3"),
        ((2, -1, None), "--diverge-chunks must be an int >= 0"),
        ((2, 1.5, None), "got 1.5"),
        ((2, 1, 0), "--fork-at-chunk must be an int >= 1"),
        (("8", 1, None), "got '8'"),
    ],
)
def test_bad_counts_are_typed_errors_naming_the_value(args, needle):
    with pytest.raises(CacheConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        check_branches(*args)
    with pytest.raises(CacheConfigError):
        branches_report(geometry(), *args[:2], args[2])


SMALL = ["--preset", "lingbot-world-mini", "--layers", "2", "--heads", "2", "--head-dim", "32", "--tokens-per-frame",
         "16", "--chunk-frames", "2", "--sink-frames", "2", "--window-frames", "6", "--denoise-steps", "2",
         "--page-bytes", "16KiB"]  # fmt: skip


def test_cli_plan_and_simulate_branches(capsys, tmp_path):
    assert main(["plan", *SMALL, "--branches", "3", "--diverge-chunks", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "pagedqvg.forks/1" and doc["branches"] == 3 and doc["diverge_chunks"] == 2
    planned = doc["end"]["pages"]
    assert main(["simulate", *SMALL, "--branches", "3", "--diverge-chunks", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "plan == measured at every call: yes" in out and f"at the end      {planned:,} pages" in out
    assert main(["plan", *SMALL, "--branches", "3", "--budget", "4MiB"]) == 0
    assert "branch(es) fit" in capsys.readouterr().out


def test_cli_simulate_exits_1_on_a_mismatch(capsys, tmp_path, monkeypatch):
    import pagedqvg.cli.fork_sim as fork_sim

    real = fork_sim.measure_branches

    def off_by_one(*a, **k):
        doc = real(*a, **k)
        doc.update(mismatches=1, mismatch_text="call 0: 1 pages measured, 0 planned")
        return doc

    monkeypatch.setattr(fork_sim, "measure_branches", off_by_one)
    assert main(["simulate", *SMALL, "--branches", "2", "--diverge-chunks", "0", "--out", str(tmp_path)]) == 1
    assert "NO (call 0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--branches", "0"], "--branches: 0 is out of range; must be an integer >= 1"),
        (["plan", "--branches", "two"], "'two' is not an integer"),
        (["plan", "--branches", "2", "--diverge-chunks", "-1"], "--diverge-chunks: -1 is out of range"),
        (["plan", "--diverge-chunks", "2"], "--diverge-chunks applies to --branches N only"),
        (["plan", "--fork-at-chunk", "2"], "--fork-at-chunk applies to --branches N only"),
        (["plan", "--branches", "2", "--fork-at-chunk", "0"], "--fork-at-chunk: 0 is out of range"),
        (["plan", "--branches", "2", "--sessions", "2"], "--branches and --sessions together"),
        (["plan", "--branches", "2", "--stagger", "1"], "--branches and --stagger together"),
        (["simulate", "--branches", "2", "--chunks", "3"], "--branches and --chunks together"),
    ],
)
def test_cli_bad_branch_flags_exit_2_naming_them(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedqvg: error: ") and needle in err, err
