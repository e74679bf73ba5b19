"""Planner time independent of the window: tier figures in closed form (equal to the segment-by-segment walk),
windows of 10^9 frames planned in O(1) without pins or tiers, and a stated bound where only a replay can plan."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pagedqvg.planning import tier_totals, tiers
from pagedqvg.planning.geometry import Geometry
from pagedqvg.planning.planner import (
    REPLAY_MAX_CHUNKS,
    check_replayable,
    closed_form_used_bytes,
    plan_geometry,
)
from pagedqvg.planning.presets import get_preset
from pagedqvg.planning.stagger import stagger_report
from pagedqvg.quant.config import QuantConfig

GRID = itertools.product(
    ("lingbot-world-mini", "longlive2-mini"),
    (None, 4, 2),
    ("bf16", "fp8", "int4"),
    (None, "bf16", "int4", "fp8"),
    (0, 1, 3),
    (0, 2),
    (True, False),
    (3, 8),
)


def _geometries():
    for preset, bits, recent, sink_format, keep, sink_keep, sink, frames in GRID:
        w = dataclasses.replace(get_preset(preset), page_bytes=64 << 10)  # a fixed page: no page-size search
        try:
            q = QuantConfig(bits=bits, recent_format=recent, sink_format=sink_format, keep_recent_chunks=keep,
                            sink_keep_chunks=sink_keep, sink=sink)
            yield Geometry.from_workload(w.replace(quant=q, window_frames=max(frames, w.chunk_frames)))
        except ValueError:
            continue


def test_tier_runs_equal_the_segment_walk():
    """`tier_totals` (O(1) runs) gives exactly `tiers`' figures (O(segments)), segment by segment."""
    count = 0
    for g in _geometries():
        runs = tier_totals.steady_runs(g)
        assert [seg for role, fmt, tokens, n in runs for seg in [(role, fmt, tokens)] * n] == tiers.steady_segments(g)
        assert tier_totals.tier_used_bytes(g) == tiers.tier_used_bytes(g)
        assert tier_totals.tier_summary(g) == tiers.tier_summary(g)
        count += 1
    assert count > 300


@pytest.mark.parametrize("bits", [None, 4, 2])
def test_a_billion_frame_window_is_planned_in_closed_form(bits):
    w = get_preset("lingbot-world").replace(window_frames=10**9, quant=QuantConfig(bits=bits))
    g = Geometry.from_workload(w)
    p = plan_geometry(g)
    assert p.exact_by == "closed form" and p.warmup_chunks is None
    per_role = tier_totals.tier_used_bytes(g)
    assert sum(per_role.values()) == p.used_bytes == closed_form_used_bytes(g)
    n = g.chunk_tokens
    T = -(-(g.cache_size - g.effective_sink) // n)
    assert p.bf16_segments + p.packed_segments == T + -(-g.effective_sink // n)


@pytest.mark.parametrize(
    ("quant", "pins", "why"),
    [(QuantConfig(bits=4, recent_format="fp8"), 0, "tier formats"), (QuantConfig(), 4, "--scene-cut-every")],
)
def test_replayed_plans_have_a_stated_window_bound(quant, pins, why):
    w = get_preset("lingbot-world").replace(quant=quant, scene_cut_every=pins)
    g = Geometry.from_workload(w)
    n, tpf = g.chunk_tokens, g.tokens_per_frame
    largest = (REPLAY_MAX_CHUNKS * n - g.effective_sink) // tpf
    check_replayable(g.with_window_frames(largest), why)  # the bound itself is planned
    with pytest.raises(ValueError, match=rf"{why}.*use --window-frames <= {largest}$") as info:
        plan_geometry(g.with_window_frames(10**9))
    assert f"{REPLAY_MAX_CHUNKS} chunks" in str(info.value)
    with pytest.raises(ValueError, match=rf"--window-frames <= {largest}"):
        plan_geometry(g.with_window_frames(largest + 1))


def test_stagger_refuses_windows_beyond_the_replay_bound():
    w = get_preset("lingbot-world").replace(window_frames=10**9, sessions=2)
    with pytest.raises(ValueError, match=r"--stagger.*--window-frames <= "):
        stagger_report(Geometry.from_workload(w), 2, None, None, measure=False)
