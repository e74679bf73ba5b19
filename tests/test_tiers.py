"""Formats by age in the accounting (pagedqvg/planning/tiers.py, policy.tier_targets, the planner's CountingLayer):
one policy path with or without tiers (the planner's candidate set, segments not yet in the tiers' coarsest format,
selects what the cache's scan of every segment selects), tiered replays reach the closed-form bytes per tier, chunks
only ever move to coarser formats, and `plan` reports the tiers."""

from __future__ import annotations

import itertools
import json

import pytest

from pagedqvg.cache.policy import layer_tier_targets
from pagedqvg.cli.app import main
from pagedqvg.planning.planner import CountingLayer, Geometry, PageCounter, is_scene_cut, plan_geometry
from pagedqvg.planning.presets import Workload, get_preset
from pagedqvg.planning.tiers import ROLES, steady_segments, tier_layouts, tier_summary, tier_used_bytes
from pagedqvg.quant.config import QuantConfig, format_rank

SMALL = dict(centroids=4, block_size=16, kmeans_iters=1)


def tiny(**kw) -> Workload:
    """3 layers x 2 heads x 32 channels, 4 tokens/frame, 2-frame chunks, 2-frame global sink, 6-frame window."""
    base = dict(name="tiny", layers=3, heads=2, head_dim=32, tokens_per_frame=4, chunk_frames=2, sink_frames=2,
                window_frames=6, global_sink=True, page_bytes=2048, denoise_steps=2)  # fmt: skip
    base.update(kw)
    return Workload(**base)


class ScanningLayer(CountingLayer):
    """The accounting with the cache's candidate set (`policy.layer_tier_targets`: every segment) instead of the
    planner's (segments not yet in the tiers' coarsest format)."""

    def _apply_pack_policy(self, keep_start: int, keep_end: int) -> None:
        for entry, tier in layer_tier_targets(self.geom.quant, self.seq, (keep_start, keep_end)):
            self._pack_tier(entry, self.geom.quant.tier_format(tier))


def replay(geom: Geometry, chunks: int, scan: bool = False) -> list[tuple[int, int, int]]:
    """(pages after, high water, used bytes) per chunk; `scan=True` takes the cache's candidate set."""
    counter = PageCounter()
    layer = (ScanningLayer if scan else CountingLayer)(geom, counter)
    out = []
    for k in range(chunks):
        counter.high_water = counter.used
        layer.advance()
        for _ in range(geom.denoise_steps):
            layer.rewrite()
        if is_scene_cut(k, geom.scene_cut_every):
            layer.pin()
        out.append((counter.used, counter.high_water, layer.used_bytes()))
    return out


TIERED = [
    dict(bits=2, sink_format="int4", recent_format="int4"),
    dict(bits=2, recent_format="fp8"),
    dict(bits=2, sink=False, recent_format="int4", keep_recent_chunks=2),
    dict(bits=4, sink_format="fp8", recent_format="fp8", sink_keep_chunks=1),
    dict(bits=2, sink_format="int2", recent_format="int2"),  # recent packed in the history's format: no repack
]


@pytest.mark.parametrize("pins", [0, 3])
def test_planner_candidates_select_what_the_cache_scan_selects(pins: int) -> None:
    checked = 0
    for bits, keep, skeep, sink, sf in itertools.product([2, 4], [0, 1, 2], [0, 1], [True, False], [2, 4]):
        q = QuantConfig(bits=bits, keep_recent_chunks=keep, sink_keep_chunks=skeep, sink=sink, **SMALL)
        geom = Geometry.from_workload(tiny(quant=q, sink_frames=sf, scene_cut_every=pins, global_sink=not pins))
        assert replay(geom, 14) == replay(geom, 14, scan=True), (bits, keep, skeep, sink, sf)
        checked += 1
    for kw in TIERED:
        for sf in (2, 3):
            q = QuantConfig(**SMALL, **kw)
            geom = Geometry.from_workload(tiny(quant=q, sink_frames=sf, scene_cut_every=pins, global_sink=not pins))
            assert replay(geom, 14) == replay(geom, 14, scan=True), (kw, sf)
            checked += 1
    assert checked == 48 + 10


@pytest.mark.parametrize("kw", TIERED, ids=str)
@pytest.mark.parametrize("sf", [2, 4, 3])
def test_tiered_replay_reaches_the_closed_form(kw: dict, sf: int) -> None:
    geom = Geometry.from_workload(tiny(quant=QuantConfig(**SMALL, **kw), sink_frames=sf))
    steady = replay(geom, 14)[-1]
    assert steady[2] == sum(tier_used_bytes(geom).values())
    plan = plan_geometry(geom)
    assert plan.exact_by == "replay" and plan.used_bytes == steady[2] and plan.pages == steady[0]
    formats = [f for _role, f, _t in steady_segments(geom)]
    assert plan.bf16_segments == formats.count("bf16") and plan.packed_segments == len(formats) - formats.count("bf16")


def test_chunks_only_age_into_coarser_formats_with_pins() -> None:
    q = QuantConfig(bits=2, sink_format="int4", recent_format="fp8", keep_recent_chunks=2, **SMALL)
    geom = Geometry.from_workload(tiny(quant=q, global_sink=False, scene_cut_every=3, window_frames=8))
    layer = CountingLayer(geom)
    held: dict[int, str] = {}
    for k in range(20):
        layer.advance()
        layer.rewrite()
        if is_scene_cut(k, 3):
            layer.pin()
        for entry in layer.seq.index:
            fmt = entry.value.fmt or "bf16"
            if entry.start in held:
                assert format_rank(fmt) <= format_rank(held[entry.start]), (k, entry.start, held[entry.start], fmt)
            held[entry.start] = fmt
    assert {"fp8", "int2", "bf16"} <= set(held.values())


def test_lingbot_world_tiers() -> None:
    w = get_preset("lingbot-world")
    geom = Geometry.from_workload(w.replace(quant=QuantConfig.compact(sink_format="int4", recent_format="int4")))
    per = tier_used_bytes(geom)
    assert list(per) == list(ROLES)
    assert [(r, f) for r, f, _t in steady_segments(geom)] == [("sink", "int4"), *[("history", "compact")] * 4,
                                                              ("recent", "int4"), ("current", "bf16")]  # fmt: skip
    dense_chunk = 2 * 4680 * 40 * 128 * 2
    assert per["current"] == dense_chunk and sum(per.values()) * 40 <= 7.6 * 2**30
    assert "history compact x4 1.76 GiB" in tier_summary(geom)


def test_a_tier_that_does_not_fit_the_page_is_named() -> None:
    # compact's fp8 codebook rows (16 x 32 B) fit 512 B pages; the recent tier's int4 bf16 codebook rows (1 KiB) do not
    q = QuantConfig.compact(block_size=32, centroids=16, recent_format="int4")
    geom = Geometry.from_workload(tiny(quant=q, page_bytes=512))
    with pytest.raises(ValueError, match="recent tier's int4 segments do not fit a page of 512 B"):
        tier_layouts(geom)


def test_plan_reports_bytes_per_tier(capsys) -> None:
    assert main(["plan", "--kv-cache-quant", "compact", "--kv-cache-quant-sink", "int4", "--kv-cache-quant-recent",
                 "int4", "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    s = next(s for s in doc["settings"] if s["mode"] == "compact")
    assert s["tiers"]["formats"] == {"sink": "int4", "history": "compact", "recent": "int4", "current": "bf16"}
    assert sum(s["tiers"]["bytes_per_layer"].values()) == s["per_layer"]["used_bytes"]
    assert main(["plan", "--kv-cache-quant", "int2", "--kv-cache-quant-recent", "int4"]) == 0
    out = capsys.readouterr().out
    assert "tiers of paged int2: sink int2 x1 0.59 GiB, history int2 x4 2.34 GiB, recent int4 x1 1.03 GiB" in out


def test_recommended_tiers_per_preset() -> None:
    from pagedqvg.planning.presets import RECOMMENDED_TIERS, get_preset

    for name, q in RECOMMENDED_TIERS.items():
        w = get_preset(name)
        tiered = tier_used_bytes(Geometry.from_workload(w.replace(quant=q)))
        int2 = tier_used_bytes(Geometry.from_workload(w.replace(quant=QuantConfig(bits=2))))
        assert q.tiered and sum(tiered.values()) < sum(int2.values()), name
