"""The planner's formulas against the real pool: `plan` (closed form and replay) == `BlockPool.stats()` of real caches.

Real runs use tiny shapes (2 heads x 16 channels, 4-5 tokens per frame, 1 KiB-ish pages) and random data, so every
configuration below runs in well under a second or two; quantized ones run the real PRQ packing.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest
import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.layout.segments import AUTO_PAGE_MAX_BYTES, AUTO_PAGE_WASTE, choose_page_bytes, segment_kinds
from pagedqvg.planning.planner import (
    PLAN_MODES,
    POLICY_FIELDS,
    CountingLayer,
    Geometry,
    budget_needed,
    call_pattern,
    closed_form_segments,
    compact_quant,
    max_sessions,
    max_window_frames,
    min_window_frames,
    mode_quant,
    plan_geometry,
    plan_settings,
    replay_layer,
    search_limit_frames,
    setting_geometries,
    setting_quant,
)
from pagedqvg.planning.presets import PRESETS, Workload, get_preset
from pagedqvg.planning.simulate import chunk_end_records, compare_records, run_accounting, run_caches, summarize
from pagedqvg.quant.config import QuantConfig
from pagedqvg.quant.format import PackedFormat

SMALL_QUANT = dict(centroids=4, block_size=16, kmeans_iters=1)


def tiny(**kw) -> Workload:
    """A tiny lingbot-like workload: 3 layers x 2 heads x 16, 4 tokens/frame, 2-frame chunks, 2-frame global sink."""
    base = dict(
        name="tiny",
        layers=3,
        heads=2,
        head_dim=16,
        tokens_per_frame=4,
        chunk_frames=2,
        sink_frames=2,
        window_frames=6,
        global_sink=True,
        page_bytes=1024,
        chunks=14,
        denoise_steps=2,
    )
    base.update(kw)
    return Workload(**base)


def random_data(geom: Geometry, seed: int = 0):
    """Chunk k -> random K/V `[B, n, H, D]` in the cache dtype (deterministic per chunk)."""

    def data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1000 + k)
        shape = (geom.batch_size, geom.chunk_tokens, geom.heads, geom.head_dim)
        return torch.randn(shape, generator=g).to(geom.dtype), torch.randn(shape, generator=g).to(geom.dtype)

    return data


# Quantization off: every configuration must match the pool exactly, call by call.
BF16_CASES = {
    "aligned": tiny(),
    "unaligned-sink-and-pages": tiny(sink_frames=3, page_bytes=768),
    "window-not-a-chunk-multiple": tiny(window_frames=5, page_bytes=1280),
    "no-sink": tiny(sink_frames=0),
    "longlive-pins-gs0": tiny(global_sink=False, scene_cut_every=3, chunks=16),
    "pins-with-global-sink": tiny(scene_cut_every=4, window_frames=8, chunks=18),
    "pins-unaligned": tiny(global_sink=False, sink_frames=1, scene_cut_every=3, window_frames=7, chunks=16),
    "batch2-fp32-two-sets": tiny(batch_size=2, dtype="fp32", cache_sets=2, page_bytes=2048),
    "attention-window": tiny(attention_window_tokens=12, chunks=10),
    "sink-tokens-override": tiny(sink_tokens=5, global_sink_tokens=3, window_frames=4, chunks=10),
}

QUANT_CASES = {
    "int2-keep1": tiny(quant=QuantConfig(bits=2, **SMALL_QUANT)),
    "int4-keep0-sinkkeep1": tiny(quant=QuantConfig(bits=4, keep_recent_chunks=0, sink_keep_chunks=1, **SMALL_QUANT)),
    "int2-sink-off-unaligned": tiny(
        sink_frames=3, page_bytes=768, quant=QuantConfig(bits=2, sink=False, keep_recent_chunks=2, **SMALL_QUANT)
    ),
    "int2-pins": tiny(global_sink=False, scene_cut_every=3, chunks=12, quant=QuantConfig(bits=2, **SMALL_QUANT)),
    # compact's format (trits, fitted scales, fp8 codebooks) at head_dim 16: one scale per token-head
    "compact-keep1": tiny(quant=QuantConfig.compact(**SMALL_QUANT)),
    "compact-keep0-sinkkeep1-unaligned": tiny(
        sink_frames=3,
        page_bytes=768,
        quant=QuantConfig.compact(keep_recent_chunks=0, sink_keep_chunks=1, **SMALL_QUANT),
    ),
    "compact-pins": tiny(global_sink=False, scene_cut_every=3, chunks=12, quant=QuantConfig.compact(**SMALL_QUANT)),
}


# Formats by age (issue 23): chunks pack into their tier's format and age (repacked) into the history's; the planner
# replays the same tier policy (policy.tier_targets), so plan == measured holds call by call here too.
TIER_CASES = {
    "sink-int4-recent-int4-history-compact": tiny(
        quant=QuantConfig.compact(sink_format="int4", recent_format="int4", **SMALL_QUANT)
    ),
    "sink-bf16-recent-fp8-history-int2": tiny(
        head_dim=32, quant=QuantConfig(bits=2, sink=False, recent_format="fp8", **SMALL_QUANT)
    ),
    "sink-int4-recent-fp8-history-int2-keep2-pins": tiny(
        head_dim=32,
        global_sink=False,
        window_frames=10,
        scene_cut_every=3,
        chunks=12,
        quant=QuantConfig(bits=2, sink_format="int4", recent_format="fp8", keep_recent_chunks=2, **SMALL_QUANT),
    ),
    "sink-fp8-recent-int4-history-int2-unaligned": tiny(
        head_dim=32,
        sink_frames=3,
        page_bytes=768,
        quant=QuantConfig(bits=2, sink_format="fp8", recent_format="int4", sink_keep_chunks=1, **SMALL_QUANT),
    ),
}


def _run_and_check(w: Workload) -> None:
    geom = Geometry.from_workload(w)
    plan = plan_geometry(geom, replay=True)
    # The pool is sized exactly at the plan's high-water mark: a plan one page short would raise here.
    measured = run_caches(geom, w, data=random_data(geom), progress=False)
    assert measured.quant_mode == geom.quant.mode
    assert measured.pool_capacity_bytes == plan.pool_bytes
    accounting = run_accounting(geom, w.chunks)
    compared, mismatches, first = compare_records(measured.records, accounting.records)
    assert compared == len(measured.records) == len(accounting.records)
    assert mismatches == 0, first
    ends = chunk_end_records(measured.records)
    assert w.chunks >= plan.warmup_chunks
    assert max(r["held_bytes"] for r in ends) == plan.all_bytes
    assert max(r["high_water_bytes"] for r in measured.records) == plan.pool_bytes
    steady = next(r for r in ends if r["held_bytes"] == plan.all_bytes)
    assert steady["used_bytes"] == plan.used_bytes * plan.caches
    assert steady["bf16_bytes"] == plan.bf16_pages * plan.page_bytes * plan.caches
    assert steady["packed_bytes"] == plan.packed_pages * plan.page_bytes * plan.caches
    assert max(r["view_tokens"] for r in measured.records) == plan.view_tokens
    summary = summarize(w, geom, measured, accounting=accounting)
    assert summary["agreement"]["checked"] and summary["agreement"]["ok"]
    assert summary["agreement"]["steady_state_rel_diff"] == 0.0
    if not geom.scene_cut_every:
        closed = plan_geometry(geom, replay=False)
        for name in ("pages", "bf16_segments", "packed_segments", "used_bytes", "high_water_pages", "view_tokens"):
            assert getattr(closed, name) == getattr(plan, name), name


@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_plan_equals_pool_stats_bf16(case: str) -> None:
    _run_and_check(BF16_CASES[case])


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_plan_equals_pool_stats_quantized(case: str) -> None:
    _run_and_check(QUANT_CASES[case])


@pytest.mark.parametrize("case", sorted(TIER_CASES))
def test_plan_equals_pool_stats_tiered(case: str) -> None:
    """Tiered configs: pages, held/used/bf16/packed bytes and views equal the plan's after every call (the pool is
    sized at the plan's high-water mark), with repacks of aging chunks in between."""
    _run_and_check(TIER_CASES[case])


def test_simulate_propagates_cache_errors_instead_of_running_bf16(monkeypatch) -> None:
    """A cache that refuses its quantization (here a SequencingError, a NotImplementedError) fails the run: no
    silent bf16 run whose figures would pass for the requested mode's."""
    import pagedqvg.planning.simulate as sim
    from pagedqvg.errors import SequencingError

    real = sim.make_caches

    def refuse_quantized(geom, pool, quant):
        if quant is not None:
            raise SequencingError("refused for the test")
        return real(geom, pool, quant)

    monkeypatch.setattr(sim, "make_caches", refuse_quantized)
    w = tiny(chunks=3, quant=QuantConfig(bits=2, **SMALL_QUANT))
    with pytest.raises(SequencingError, match="refused for the test"):
        run_caches(Geometry.from_workload(w), w, data=random_data(Geometry.from_workload(w)), progress=False)


def test_closed_form_equals_replay_on_a_grid() -> None:
    """Without pins the O(1) closed form and the replay agree on every figure (sinks, windows, pages, quant)."""
    checked = 0
    grid = itertools.product(
        [4, 5], [1, 2, 3], [0, 1, 4], [2, 3, 7], [True, False], [None, 2], [0, 1], [0, 1], [True, False]
    )
    for tpf, cf, sf, wf, gs, bits, keep, skeep, sink in grid:
        if wf < cf:
            continue
        q = QuantConfig(bits=bits, keep_recent_chunks=keep, sink_keep_chunks=skeep, sink=sink, **SMALL_QUANT)
        w = tiny(tokens_per_frame=tpf, chunk_frames=cf, sink_frames=sf, window_frames=wf, global_sink=gs, quant=q)
        geom = Geometry.from_workload(w)
        a, b = plan_geometry(geom, replay=True), plan_geometry(geom, replay=False)
        for name in ("pages", "bf16_segments", "packed_segments", "used_bytes", "high_water_pages", "view_tokens"):
            assert getattr(a, name) == getattr(b, name), (name, tpf, cf, sf, wf, gs, bits, keep, skeep, sink)
        checked += 1
    assert checked > 500


def test_lingbot_world_plan_from_the_layout() -> None:
    """The preset's figures, derived by hand from the row and page sizes (no per-token constants in the planner)."""
    lingbot = dataclasses.replace(get_preset("lingbot-world"), page_bytes=2 << 20)
    geom = Geometry.from_workload(lingbot)
    assert (geom.chunk_tokens, geom.sink_tokens, geom.global_sink_tokens) == (4680, 4680, 4680)
    assert geom.cache_size == 21 * 1560 == 32760
    row = 40 * 128 * 2  # one token, K or V, all heads, bf16
    tokens_per_page = ((2 << 20) // row) // 2  # whole tokens (K and V rows) per page: 102
    chunk_pages = -(-4680 // tokens_per_page)  # 46
    plan = plan_geometry(geom)
    assert (plan.bf16_segments, plan.packed_segments) == (7, 0)  # 1 sink chunk + 6 window chunks (current included)
    assert plan.pages == 7 * chunk_pages == 322
    assert plan.bytes == 322 * (2 << 20)
    assert plan.dense_bytes == 2 * 1 * 32760 * 40 * 128 * 2
    assert plan.used_bytes == plan.dense_bytes
    assert plan.pool_pages == 40 * 322
    assert plan.view_tokens == 32760
    int2 = plan_geometry(Geometry.from_workload(lingbot, QuantConfig(bits=2)))
    packed_row = 40 * (32 + 2 + 1)  # codes + fp8 scales + centroid id, per head
    token_pages = -(-4680 // (((2 << 20) // packed_row) // 2))
    codebook_pages = -(-(2 * 40) // ((2 << 20) // (128 * 128 * 2)))
    assert int2.packed_segment_pages == token_pages + codebook_pages == 9
    # sink packed, 4 window chunks packed, current + 1 recent chunk in bf16
    assert (int2.bf16_segments, int2.packed_segments) == (2, 5)
    assert int2.pages == 2 * 46 + 5 * 9
    assert int2.pool_pages == 40 * int2.pages + (46 - 9)


@pytest.mark.parametrize("name", ["lingbot-world", "longlive2", "self-forcing"])
def test_presets_plan(name: str) -> None:
    plans = plan_settings(PRESETS[name])
    assert [p.mode for p in plans] == ["off", "int4", "int2", "compact"]
    off, int4, int2, compact = plans
    assert off.bytes >= int4.bytes >= int2.bytes > compact.bytes  # each setting has its own auto page size
    assert compact.quant == QuantConfig.compact()  # the preset's policy is the default one
    assert off.bytes >= off.dense_bytes  # whole pages never hold less than the rows
    assert all(p.waste_bytes <= 0.01 * p.bytes for p in plans)  # auto pages: page tails under 1%
    assert all(p.pool_bytes >= p.all_bytes for p in plans)


def test_longlive2_geometry() -> None:
    geom = Geometry.from_workload(PRESETS["longlive2"])
    assert (geom.sink_tokens, geom.global_sink_tokens, geom.chunk_tokens) == (8 * 880, 0, 8 * 880)
    assert geom.cache_size == 40 * 880
    assert geom.scene_cut_every == 10
    plan = plan_geometry(geom)
    assert plan.exact_by == "replay" and plan.pages == 5 * geom.dense.pages_for_tokens(8 * 880)


def test_call_pattern_counts() -> None:
    geom = Geometry.from_workload(tiny(global_sink=False, scene_cut_every=3, cache_sets=2))
    calls = list(call_pattern(geom, 10))
    caches = 6
    assert len(calls) == 10 * 3 * caches + 3 * caches  # (advance + 1 denoise + clean) per cache; pins at 3, 6, 9
    assert [c.op for c in calls[: 3 * caches : caches]] == ["advance", "denoise", "clean"]
    assert sum(c.op == "pin" for c in calls) == 3 * caches


@pytest.mark.parametrize(
    "w",
    [tiny(), tiny(quant=QuantConfig(bits=2, **SMALL_QUANT)), tiny(global_sink=False, scene_cut_every=3)],
    ids=["bf16", "int2", "pins"],
)
def test_max_window_frames_is_the_largest_that_fits(w: Workload) -> None:
    geom = Geometry.from_workload(w)
    lo = min_window_frames(geom, w.chunk_frames)
    needs = {f: plan_geometry(geom.with_window_frames(f), replay=True).budget_bytes for f in range(lo, 60)}
    for budget in (needs[lo], needs[lo] + 5000, needs[20], needs[37] + 1):
        best = max(f for f, need in needs.items() if need <= budget)
        assert max_window_frames(geom, budget, lo) == best
        assert budget_needed(geom, best) <= budget < budget_needed(geom, best + 1)
    assert max_window_frames(geom, needs[lo] - 1, lo) is None


def test_search_limit_with_pins() -> None:
    geom = Geometry.from_workload(tiny(global_sink=False, scene_cut_every=3))
    limit = search_limit_frames(geom)
    assert max_window_frames(geom, 1 << 50, 2) == limit


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"window_frames": 1}, "window smaller than a chunk"),
        ({"cache_size_tokens": 10}, "window smaller than a chunk"),
        ({"page_bytes": 1000}, "multiple of 256"),
        ({"page_bytes": 256, "heads": 8}, "page size"),
        ({"layers": 0}, "layers"),
        ({"sink_frames": -1}, "sink-frames"),
        ({"scene_cut_every": 2, "window_frames": 2, "global_sink_tokens": 8}, "scene-cut pin"),
        ({"quant": QuantConfig(bits=2, block_size=64)}, "block_size"),
    ],
)
def test_geometry_rejects_bad_workloads(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        w = dataclasses.replace(tiny(), **changes)
        geom = Geometry.from_workload(w)
        plan_settings(w) if geom else None


def test_replay_is_fast_for_long_windows() -> None:
    """The replay is O(N log N): 20,000 chunks of a pinned, quantized pattern in a few seconds at most."""
    w = tiny(global_sink=False, scene_cut_every=7, window_frames=4000, quant=QuantConfig(bits=2, **SMALL_QUANT))
    census = replay_layer(Geometry.from_workload(w), chunks=5000)
    assert len(census.after) == 5000


def test_planner_imports_neither_the_cache_nor_the_kernels() -> None:
    code = (
        "import sys, pagedqvg.planning.planner; "
        "print(sorted(m for m in sys.modules if 'kernels' in m or m == 'pagedqvg.cache.paged_cache'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_counting_layer_rejects_rewrite_before_advance() -> None:
    with pytest.raises(ValueError, match="before the first advance"):
        CountingLayer(Geometry.from_workload(tiny())).rewrite()


def test_segment_formula_text_matches_docstring() -> None:
    geom = Geometry.from_workload(tiny(quant=QuantConfig(bits=2, keep_recent_chunks=1, **SMALL_QUANT)))
    # E = 8 tokens -> k = 1 sink segment; window 24 tokens -> T = 3 segments: current + 1 recent bf16, 1 packed
    assert closed_form_segments(geom) == (2, 2)
    assert closed_form_segments(Geometry.from_workload(tiny())) == (4, 0)
    assert setting_quant(QuantConfig(pack_trits=True, bits=2), 4).pack_trits is False


# ---------------------------------------------------------------------------------------------------- compact mode
POLICY = dict(keep_recent_chunks=3, sink=False, sink_keep_chunks=2, seed=77)


def test_compact_quant_takes_only_the_policy_fields() -> None:
    """compact next to any config: compact's format fields, the config's policy fields (not e.g. its block 64)."""
    base = QuantConfig(bits=2, centroids=16, block_size=32, stages=2, kmeans_iters=5, **POLICY)
    q = compact_quant(base)
    assert q == QuantConfig.compact(**POLICY) and q.mode == "compact" and q.block_size == 128
    assert set(POLICY) == set(POLICY_FIELDS)
    # below 128 channels the block is the head: one fitted scale per token-head; 128 and above keep 128
    assert compact_quant(base, 64).block_size == 64 and compact_quant(base, 48).block_size == 48
    assert compact_quant(base, 128).block_size == 128 and compact_quant(base, 256).block_size == 128
    assert compact_quant(base, 64, block_size=32).block_size == 32  # an explicit block is kept
    with pytest.raises(ValueError, match="pack_trits"):
        compact_quant(base, 64, asymmetric=True)


def test_mode_quant_per_plan_mode() -> None:
    """Each plan row's config: the workload's own for its mode; compact from the policy; the reference int4/int2
    next to compact; off/int4/int2 keep the workload's other knobs otherwise (as before)."""
    assert PLAN_MODES == ("off", "int4", "int2", "compact")
    base = QuantConfig(bits=2, centroids=64, **POLICY)
    assert mode_quant(base, "int2") is base
    assert mode_quant(base, "int4") == dataclasses.replace(base, bits=4)
    assert mode_quant(base, "off") == dataclasses.replace(base, bits=None)
    assert mode_quant(base, "compact", 128) == QuantConfig.compact(**POLICY)
    compact = QuantConfig.compact(centroids=64, **POLICY)
    assert mode_quant(compact, "compact") is compact
    for mode, bits in (("off", None), ("int4", 4), ("int2", 2)):
        q = mode_quant(compact, mode)
        assert q == QuantConfig(bits=bits, **POLICY) and q.mode == mode
    # knobs that would make int2 compact (typed without a mode) do not turn the int2 row into a second compact row
    knobs = QuantConfig(pack_trits=True, fit_scales=True, codebook_fp8=True, **POLICY)
    assert mode_quant(knobs, "int2") == QuantConfig(bits=2, **POLICY)
    assert mode_quant(knobs, "int4") == QuantConfig(bits=4, fit_scales=True, codebook_fp8=True, **POLICY)
    with pytest.raises(ValueError, match="unknown plan mode 'int3'; allowed: off, int4, int2, compact"):
        mode_quant(base, "int3")


def test_compact_row_and_its_shape_limits() -> None:
    """Every preset plans a compact row (the minis with blocks of 64); a head_dim that 128 does not divide leaves
    it out with the reason, and the workload's own compact config is planned as given."""
    for name, w in PRESETS.items():
        geoms, skipped = setting_geometries(w)
        assert [g.quant.mode for g in geoms] == list(PLAN_MODES) and skipped == [], name
        assert geoms[-1].quant.block_size == min(128, w.head_dim)
    geoms, skipped = setting_geometries(dataclasses.replace(PRESETS["lingbot-world"], head_dim=192))
    assert [g.quant.mode for g in geoms] == ["off", "int4", "int2"]
    assert skipped == [("compact", skipped[0][1])] and "block_size=128 does not divide head_dim=192" in skipped[0][1]
    own = QuantConfig.compact(block_size=64, keep_recent_chunks=0)
    geoms, _ = setting_geometries(dataclasses.replace(PRESETS["lingbot-world"], quant=own))
    assert geoms[-1].quant is own
    assert [g.quant for g in geoms[1:3]] == [
        QuantConfig(bits=4, keep_recent_chunks=0),
        QuantConfig(bits=2, keep_recent_chunks=0),
    ]


def test_compact_chunk_is_at_least_8x_smaller_in_the_plan() -> None:
    """Issue 15's target as the planner counts it: one packed 4,680-token LingBot-World chunk (token records and
    codebooks) vs its bf16 records: 28 B per token-head + a 128 x 128 fp8 codebook per (K/V, head) = 8.13x; in auto
    pool pages (records plus page tails) still >= 8x."""
    geom = Geometry.from_workload(dataclasses.replace(PRESETS["lingbot-world"], quant=QuantConfig.compact()))
    n, heads = geom.chunk_tokens, geom.heads
    packed, dense = geom.packed_layout(), geom.dense
    bf16_bytes = dense.used_bytes_for_tokens(n)
    assert bf16_bytes == 2 * n * heads * 128 * 2
    packed_bytes = packed.used_bytes_for_tokens(n)
    assert packed_bytes == 2 * heads * (n * 28 + 128 * 128)
    assert round(bf16_bytes / packed_bytes, 2) == 8.13
    plan = plan_geometry(geom)
    off = plan_geometry(Geometry.from_workload(PRESETS["lingbot-world"]))
    ratio_in_pages = (off.bf16_segment_pages * off.page_bytes) / (plan.packed_segment_pages * plan.page_bytes)
    assert ratio_in_pages >= 8.0, ratio_in_pages


# ---------------------------------------------------------------------------------------------------- auto pages
TRITS = QuantConfig(bits=2, pack_trits=True)
MODES = {
    "off": None,
    "int4": QuantConfig(bits=4),
    "int2": QuantConfig(bits=2),
    "int2-trits": TRITS,
    "compact": "compact",
}


def mode_config(mode: str, head_dim: int) -> QuantConfig:
    """`MODES[mode]` (compact: the plan's compact row config at `head_dim`)."""
    q = MODES[mode]
    return compact_quant(QuantConfig(), head_dim) if q == "compact" else (q or QuantConfig())


#: Page size alone cannot reach 1% here (test below): a packed chunk's trit token region (768 tokens x 120 B =
#: 90 KiB, compact's at head_dim 64 too) spans only a few pages, and no page may be smaller than one codebook row
#: (128 x 64 x 2 B = 16 KiB; compact's fp8 codebooks: 8 KiB).
PAGE_SIZE_CANNOT_REACH = {
    ("lingbot-world-mini", "int2-trits"),
    ("self-forcing-mini", "int2-trits"),
    ("lingbot-world-mini", "compact"),
    ("self-forcing-mini", "compact"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_auto_pages_waste_at_most_one_percent(name: str, mode: str) -> None:
    """Issue 14's target: with `--page-bytes auto` (the default), the steady state of every preset x {off, int4,
    int2, int2 trits} wastes <= 1% of its pages (the 2 MiB pages of before: up to 11.7%), except the two mini cases
    that no page size can bring there (checked by brute force below)."""
    if (name, mode) in PAGE_SIZE_CANNOT_REACH:
        pytest.skip("no page size reaches 1% (test_page_size_cannot_reach_one_percent_for_tiny_trit_chunks)")
    w = dataclasses.replace(PRESETS[name], quant=mode_config(mode, PRESETS[name].head_dim))
    geom = Geometry.from_workload(w)
    assert w.page_bytes is None and geom.page_choice is not None
    plan = plan_geometry(geom)
    assert plan.waste_bytes <= 0.01 * plan.bytes, (plan.waste_bytes / plan.bytes, geom.page_bytes)
    assert geom.page_bytes % 256 == 0 and geom.page_bytes <= 4 << 20


@pytest.mark.parametrize(("name", "mode"), sorted(PAGE_SIZE_CANNOT_REACH))
def test_page_size_cannot_reach_one_percent_for_tiny_trit_chunks(name: str, mode: str) -> None:
    """Every page size from one codebook row (16 KiB; compact: 8 KiB) to 1 MiB wastes > 1% at steady state; auto is
    within 0.1% of the best of them."""
    geom = Geometry.from_workload(dataclasses.replace(PRESETS[name], quant=mode_config(mode, PRESETS[name].head_dim)))
    row = geom.packed_format().codebook_row_bytes
    assert row == (8192 if mode == "compact" else 16384)

    def waste(page: int) -> float:
        p = plan_geometry(dataclasses.replace(geom, page_bytes=page, page_choice=None), replay=False)
        return p.waste_bytes / p.bytes

    best = min(waste(p) for p in range(row, 1 << 20, 256))
    assert best > 0.01
    assert waste(geom.page_bytes) <= best + 0.001


def test_choose_page_bytes_is_the_largest_page_under_the_target() -> None:
    """Brute force over every 256-B multiple: the choice is the largest page whose worst segment kind wastes
    <= the target, and a page 256 B larger than it does not meet the target."""
    fmt = PackedFormat(128, 40, QuantConfig(bits=2))
    kinds = segment_kinds(1, 40, 128, 2, 4680, fmt)
    choice = choose_page_bytes(kinds)
    assert choice.met and choice.worst <= AUTO_PAGE_WASTE
    above = [p for p in range(choice.page_bytes + 256, AUTO_PAGE_MAX_BYTES + 1, 256)]
    assert all(max(k.waste(p) for k in kinds) > AUTO_PAGE_WASTE for p in above)
    # the waste figure is the pages' bytes minus the records' bytes, by hand for the packed kind
    packed = next(k for k in kinds if k.name == "packed")
    p = choice.page_bytes
    pages = -(-4680 // (p // (2 * fmt.token_row_bytes))) + -(-80 // (p // fmt.codebook_row_bytes))
    assert packed.pages(p) == pages
    assert packed.waste(p) == 1 - (4680 * 2 * fmt.token_row_bytes + 80 * fmt.codebook_row_bytes) / (pages * p)


def test_choose_page_bytes_falls_back_to_the_least_waste() -> None:
    """A target no page size can meet: the page with the least waste over one segment of each kind, flagged."""
    kinds = segment_kinds(1, 4, 64, 2, 768, PackedFormat(64, 4, QuantConfig(bits=2)))
    choice = choose_page_bytes(kinds, target=0.0)
    assert not choice.met

    def pooled(p: int) -> float:
        return 1 - sum(k.used_bytes for k in kinds) / (p * sum(k.pages(p) for k in kinds))

    best = min(pooled(p) for p in range(16384, AUTO_PAGE_MAX_BYTES + 1, 256))
    assert pooled(choice.page_bytes) == best


def test_auto_pages_plan_equals_pool_stats() -> None:
    """Auto-sized pages (not a multiple of anything in particular) keep plan == measured, call by call."""
    w = tiny(page_bytes=None, quant=QuantConfig(bits=2, **SMALL_QUANT))
    geom = Geometry.from_workload(w)
    assert geom.page_choice is not None and geom.page_bytes not in (1024, 2048)
    _run_and_check(w)


def test_block_pool_for_layers_makes_the_planners_choice() -> None:
    w = dataclasses.replace(PRESETS["self-forcing"], quant=QuantConfig(bits=4))
    geom = Geometry.from_workload(w)
    pool = BlockPool.for_layers(
        1 << 22, num_heads=12, head_dim=128, chunk_tokens=geom.chunk_tokens, quant=QuantConfig(bits=4)
    )
    assert pool.page_bytes == geom.page_bytes
    off = BlockPool.for_layers(1 << 23, num_heads=12, head_dim=128, chunk_tokens=geom.chunk_tokens)
    assert off.page_bytes == Geometry.from_workload(PRESETS["self-forcing"]).page_bytes
    assert BlockPool.for_layers(1 << 20, num_heads=1, head_dim=8, chunk_tokens=4, page_bytes=4096).page_bytes == 4096
    with pytest.raises(ValueError, match="block_size"):
        BlockPool.for_layers(1 << 20, num_heads=2, head_dim=48, chunk_tokens=4, quant=QuantConfig(bits=2))
    with pytest.raises(ValueError, match="auto"):
        BlockPool.for_layers(1 << 20, num_heads=2, head_dim=48, chunk_tokens=4, page_bytes="big")


# ---------------------------------------------------------------------------------------------------- ranks, sessions
def test_ranks_split_heads_and_the_plan_is_per_rank() -> None:
    w = dataclasses.replace(PRESETS["lingbot-world"], ulysses=2, tp=2, page_bytes=2 << 20)
    geom = Geometry.from_workload(w)
    assert (geom.heads, geom.ranks) == (10, 4)
    full = Geometry.from_workload(dataclasses.replace(w, ulysses=1, tp=1, heads=10))
    assert plan_geometry(geom) == plan_geometry(full)  # one rank's caches == a 10-head model's


@pytest.mark.parametrize(("ulysses", "tp"), [(3, 1), (1, 3), (2, 3), (80, 1)])
def test_ranks_that_do_not_divide_the_heads_are_refused(ulysses: int, tp: int) -> None:
    w = dataclasses.replace(PRESETS["lingbot-world"], ulysses=ulysses, tp=tp)
    with pytest.raises(ValueError, match=r"valid rank counts .* 1, 2, 4, 5, 8, 10, 20, 40$"):
        Geometry.from_workload(w)


@pytest.mark.parametrize("case", ["bf16", "int2", "pins"])
def test_sessions_share_one_pool_plan_equals_pool_stats(case: str) -> None:
    """Two sessions x two cache sets (CFG) of one rank of two, interleaved call by call in one pool: plan ==
    measured exactly, and the pool is the sum of the sessions' caches."""
    quant = QuantConfig(bits=2, **SMALL_QUANT) if case == "int2" else QuantConfig()
    extra = dict(global_sink=False, scene_cut_every=3, chunks=12) if case == "pins" else {}
    w = tiny(sessions=2, cache_sets=2, heads=4, ulysses=2, quant=quant, **extra)
    geom = Geometry.from_workload(w)
    assert (geom.caches, geom.heads) == (3 * 2 * 2, 2)
    _run_and_check(w)
    one = plan_geometry(Geometry.from_workload(dataclasses.replace(w, sessions=1)))
    two = plan_geometry(geom)
    assert two.all_bytes == 2 * one.all_bytes


@pytest.mark.parametrize("pins", [False, True])
def test_max_sessions_is_the_most_that_fit(pins: bool) -> None:
    extra = dict(global_sink=False, scene_cut_every=3) if pins else {}
    geom = Geometry.from_workload(tiny(**extra))

    def need(n: int) -> int:
        g = dataclasses.replace(geom, caches=geom.caches * n, sessions=n)
        return plan_geometry(g, replay=True).budget_bytes

    for n in (1, 2, 5, 13):
        assert max_sessions(geom, need(n)) == n
        assert max_sessions(geom, need(n + 1) - 1) == n
    assert max_sessions(geom, need(1) - 1) == 0
