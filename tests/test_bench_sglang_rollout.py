"""benchmarks/bench_sglang_rollout.py at tiny size (6 chunks, a scene cut every 2): SGLang 0.5.23's real LongLive2
stage over pagedqvg's caches with scene cuts and pins. Needs SGLang's source: set PAGEDQVG_SGLANG_SRC to a folder
holding its `sglang` package (the wheel extracted as .ci/sglang_suite.sh does, which runs this file); skipped
otherwise. About a minute, most of it SGLang's imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TIERED = "sink int4 / recent int4 / history compact"  # presets.RECOMMENDED_TIERS


@pytest.mark.skipif(not os.environ.get("PAGEDQVG_SGLANG_SRC"), reason="PAGEDQVG_SGLANG_SRC (SGLang source) unset")
def test_rollout_with_scene_cuts_on_the_real_longlive2_stage(tmp_path):
    """Quant off through pagedqvg equals SGLang's dense cache bit for bit at every chunk, its pins (slot, length)
    after every chunk are the dense cache's, and the cuts pinned; int2 and int4 differ from it from the second chunk
    on (the first attends only to itself, which stays dense), int4 less than int2 at every one of those chunks; int2
    keeps two 128-token chunks dense at the end (current, recent); the recommended tiered setting is at or below int2
    at every chunk and holds int4 and compact chunks; the plot is written (with SGLang's placeholder
    modules loaded)."""
    out = tmp_path / "rollout.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_sglang_rollout.py"), os.environ["PAGEDQVG_SGLANG_SRC"],
         "--chunks", "6", "--cut-every", "2", "--settings", "reference int2", "reference int4", TIERED,
         "--json", str(out), "--plot", str(tmp_path / "rollout.png")],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, *sys.path])}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "rollout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads(out.read_text())["runs"]
    dense_pins = runs["SGLang dense cache"]["pins"]
    assert [p[0] for p in dense_pins] == list(range(6)) and {p[0] for p in dense_pins if p[1] >= 0} == {2, 3, 4, 5}
    for label, run in runs.items():
        if label != "SGLang dense cache":
            assert run["pins"] == dense_pins, label
    assert runs["pagedqvg quant off"]["errors"] == [0.0] * 6
    int2, int4 = runs["reference int2"]["errors"], runs["reference int4"]["errors"]
    assert int2[0] == int4[0] == 0.0
    assert all(0 < b < a for a, b in zip(int2[1:], int4[1:], strict=True)), (int2, int4)
    tiered = runs[TIERED]["errors"]  # issue 23 item 5's setting: at or below int2 at every chunk (measured <= 0.54x)
    assert tiered[0] == 0.0 and all(0 < t <= a for a, t in zip(int2[1:], tiered[1:], strict=True)), (int2, tiered)
    tokens = runs[TIERED]["tokens_layer0"]  # the cache's tiers: int4 sink(s) and recent chunk, compact history
    assert tokens["int4_tokens"] > 0 and tokens["compact_tokens"] > 0 and tokens["dense_tokens"] == 128
    off, packed = runs["pagedqvg quant off"]["tokens_layer0"], runs["reference int2"]["tokens_layer0"]
    assert off["packed_tokens"] == 0 and packed["dense_tokens"] == 2 * 128  # the current and the recent chunk
    assert packed["dense_tokens"] + packed["packed_tokens"] == off["dense_tokens"]
