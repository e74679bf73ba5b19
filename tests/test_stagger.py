"""Staggered sessions (pagedqvg/planning/stagger.py): the planner's accounting equals real caches on a pool call by
call,
and the summary's peak / steady state."""

from __future__ import annotations

import dataclasses

import pytest

from pagedqvg import QuantConfig
from pagedqvg.planning.stagger import (
    account_staggered,
    account_staggered_peak,
    measure_staggered,
    session_geometry,
    stagger_summary,
)
from pagedqvg.serving.sessions import SessionSpec, _geometry

QUANT = QuantConfig(bits=2, centroids=4, block_size=8, kmeans_iters=1, keep_recent_chunks=1, sink=False)


def geometry(sessions: int, quant=None, **kw):
    spec = SessionSpec(layers=2, batch_size=1, cache_size=24, num_heads=2, head_dim=16, chunk_tokens=6,
                       sink_tokens=6, denoise_steps=1, quant=quant, **kw)  # fmt: skip
    one = _geometry(spec, 1024)
    return dataclasses.replace(one, sessions=sessions, caches=one.caches * sessions)


CASES = [(0, [5, 5, 5]), (1, [6, 4, 7]), (3, [8, 2, 5]), (2, [1, 1])]


@pytest.mark.parametrize(
    ("quant", "stagger", "lengths"),
    [(None, *c) for c in CASES] + [(QUANT, *c) for c in CASES[1:3]],
    ids=[f"off-{c[0]}-{c[1]}" for c in CASES] + [f"on-{c[0]}-{c[1]}" for c in CASES[1:3]],
)
def test_plan_equals_measured_call_by_call(quant, stagger, lengths):
    one = session_geometry(geometry(len(lengths), quant))
    planned = account_staggered(one, stagger, lengths)
    measured, high_water = measure_staggered(one, stagger, lengths)
    assert measured == planned
    planned_again, planned_peak = account_staggered_peak(one, stagger, lengths)
    assert planned_again == planned and high_water == planned_peak >= max(planned)  # the peak inside calls too
    assert planned[-1] == 0  # every session closed: every page back


def test_summary_peak_steady_and_in_step():
    geom = geometry(3)
    s = stagger_summary(geom, 2, [6, 6, 6])
    used = account_staggered(session_geometry(geom), 2, [6, 6, 6])
    assert s["peak_pages"] == max(used) and s["most_live_sessions"] == 3 and s["steady_tick"] == 5
    in_step = stagger_summary(geom, 0, [6, 6, 6])
    assert in_step["peak_pages"] == in_step["in_step_peak_pages"] == s["in_step_peak_pages"]
    assert s["peak_pages"] <= s["in_step_peak_pages"]  # staggered warm-ups never stack above sessions in step here


def test_bad_stagger_is_value_error():
    with pytest.raises(ValueError, match="--stagger"):
        stagger_summary(geometry(2), -1, [3, 3])
    with pytest.raises(ValueError, match="--session-chunks"):
        stagger_summary(geometry(2), 1, [3])


SMALL = ["--layers", "2", "--heads", "2", "--head-dim", "16", "--tokens-per-frame", "4", "--chunk-frames", "1",
         "--window-frames", "3"]  # fmt: skip


def test_cli_simulate_and_plan_with_stagger(capsys, tmp_path):
    from pagedqvg.cli.app import main

    args = ["--sessions", "3", "--stagger", "2", "--session-chunks", "5,3,6", *SMALL]
    assert main(["simulate", *args, "--out", str(tmp_path), "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["mismatches"] == 0 and doc["measured_peak_pages"] == doc["peak_pages"] == 18
    assert (doc["in_step_peak_pages"], doc["steady_tick"], doc["calls"]) == (36, 4, 146)
    assert main(["plan", *args]) == 0
    assert "peak    18 pages" in capsys.readouterr().out
    assert main(["plan", "--sessions", "3", "--stagger", "1", "--session-chunks", "3,3", *SMALL]) == 2
    assert "one length >= 1 per session (3)" in capsys.readouterr().err
