"""The compact PRQ mode inside the cache, through the existing cache machinery (no copies of it):

- tests/test_cache_quant.py's LingBot call pattern (slots, dense rows bit-identical, packed rows within the bound,
  exact page accounting) with a compact config;
- tests/test_cache_fuzz_quant.py's state machine with compact-style configs (fitted scales and fp8 codebooks, trit
  packing where valid) and its deterministic pack / unpack / rewrite / rewind / pin program; the machine's page
  geometry is recomputed here from the format spec with 1-byte fp8 codebook values;
- the planner's plan equals the pool's measured pages call by call (tests/test_planner.py's check);
- views and unpacks of a compact cache bit-identical under the Triton and torch backends: the compact case of
  tests/test_kernels_dequant.py's backend comparison (not repeated here).
"""

from __future__ import annotations

import os

import pytest
import test_cache_fuzz_quant as tfq
import test_cache_quant as tcq
import torch
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test
from test_planner import SMALL_QUANT, _run_and_check, tiny

from pagedqvg import QuantConfig
from pagedqvg.quant import PackedFormat

#: Examples of the compact state machine under the ci profile (the quant machine runs 100; this one adds ~10 s).
COMPACT_EXAMPLES = {"ci": 40}


def test_lingbot_pattern_with_compact_config():
    """test_cache_quant's call pattern; head_dim 32 there, so blocks of 32 (one fitted scale per token-head)."""
    q = QuantConfig.compact(centroids=16, block_size=32)
    assert q.mode == "compact"
    tcq.test_lingbot_pattern_quant_on_matches_quant_off_slots(q, 0.35)


# ------------------------------------------------------------------------------------------------ state machine
def compact_packed_geometry(cfg):
    """tfq.packed_geometry with the codebook value size of the format spec: 1 B (fp8) with codebook_fp8."""
    q, H, B, page = cfg["quant"], cfg["H"], cfg["B"], cfg["page_bytes"]
    D = tfq.D
    nb = D // q.block_size
    code = -(-D // 5) if q.pack_trits else D * q.bits // 8
    token_row = H * (code + nb + (nb if q.asymmetric else 0) + q.stages)
    cb_row = q.centroids * D * (1 if q.codebook_fp8 else tfq.itemsize(cfg["dtype"]))
    cb_rows = 2 * B * H * q.stages
    return (page // token_row) // (2 * B), -(-cb_rows // (page // cb_row))


@st.composite
def compact_configs(draw):
    """The machine's configs with the compact extensions: fitted scales (symmetric codes), fp8 codebooks mostly,
    trit packing for int2 mostly."""
    cfg = draw(tfq.configs())
    q = cfg["quant"]
    bits_ = q.bits
    cfg["quant"] = QuantConfig(
        bits=bits_, centroids=q.centroids, block_size=q.block_size, stages=q.stages, kmeans_iters=q.kmeans_iters,
        asymmetric=False, keep_recent_chunks=q.keep_recent_chunks, sink=q.sink, sink_keep_chunks=q.sink_keep_chunks,
        seed=q.seed, pack_trits=bits_ == 2 and draw(st.sampled_from([True, True, False])), fit_scales=True,
        codebook_fp8=draw(st.sampled_from([True, True, False])),
    )  # fmt: skip
    return cfg


class CompactFuzzMachine(tfq.QuantFuzzMachine):
    """tfq.QuantFuzzMachine, drawing compact-style PRQ configs."""

    @initialize(cfg=compact_configs())
    def setup(self, cfg):
        tfq.QuantFuzzMachine.setup(self, cfg)


def test_geometry_helper_matches_the_format():
    for q in (QuantConfig.compact(block_size=8, centroids=5), QuantConfig(bits=4, block_size=4, centroids=3)):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = dict(quant=q, H=3, B=2, page_bytes=2048, dtype=dtype)
            fmt = PackedFormat(tfq.D, 3, q, dtype)
            tpp, cb_pages = compact_packed_geometry(cfg)
            assert tpp == (2048 // fmt.token_row_bytes) // 4
            assert cb_pages == -(-2 * 2 * fmt.num_codebook_rows // (2048 // fmt.codebook_row_bytes))


def test_state_machine_compact(monkeypatch):
    monkeypatch.setattr(tfq, "packed_geometry", compact_packed_geometry)
    profile = os.environ.get("PAGEDQVG_FUZZ_PROFILE", "ci")
    n = COMPACT_EXAMPLES.get(profile, settings.default.max_examples)
    before = tfq.STEPS[0]
    run_state_machine_as_test(CompactFuzzMachine, settings=settings(parent=settings.default, max_examples=n))
    assert tfq.STEPS[0] - before >= (400 if profile == "ci" else 1)
    assert tfq.MAX_RATIO[0] <= tfq.ERR_BOUND


def test_program_pack_unpack_rewind_pin_compact(monkeypatch):
    """tfq.test_program_pack_unpack_rewind_pin's program (sink packing, head-sliced rewrite of a packed chunk, roll,
    pin, rewind into a packed chunk, reset) with a compact config."""
    monkeypatch.setattr(tfq, "packed_geometry", compact_packed_geometry)
    P, Dn = "packed", "dense"
    q = QuantConfig.compact(centroids=3, block_size=4, stages=2, keep_recent_chunks=0)
    m = tfq.run_program(
        dict(C=12, S=4, H=2, B=2),
        [
            ("w", 0, 0, 4),
            ("w", 0, 4, 4),
            ("w", 0, 8, 4),
            ("expect", 0, [(0, 4, P), (4, 8, P), (8, 12, Dn)]),
            ("w", 0, 5, 2, 1, 1),
            ("expect", 0, [(0, 4, P), (4, 8, Dn), (8, 12, Dn)]),
            ("w", 0, 12, 3),
            ("pin", 0, 3),
            ("w", 0, 15, 3, 1, 0, 2),
            ("expect", 0, [(0, 4, P), (4, 8, P), (8, 12, P), (12, 15, P), (15, 18, Dn)]),
            ("rewind", 0, 14),
            ("expect", 0, [(0, 4, P), (4, 8, P), (8, 12, P), (12, 14, P)]),
            ("w", 0, 14, 4),
            ("w", 1, 0, 5),
            ("w", 1, 5, 5),
            ("reset", 0),
        ],
        quant=q,
    )
    assert m.packed_from[1]


# ------------------------------------------------------------------------------------------------ planner
@pytest.mark.parametrize(
    "w",
    [
        tiny(quant=QuantConfig.compact(**SMALL_QUANT)),
        tiny(global_sink=False, scene_cut_every=3, chunks=12, quant=QuantConfig.compact(**SMALL_QUANT)),
    ],
    ids=["keep1", "pins"],
)
def test_plan_equals_pool_stats_compact(w):
    _run_and_check(w)


# The views under the Triton and torch backends with compact: test_kernels_dequant.py's
# test_cache_packed_views_identical_with_triton_and_torch[bf16-compact].
