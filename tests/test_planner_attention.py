"""`pagedqvg plan --attention view|pages|heads`: with attention from pages the budget holds update_and_attend's scratch
(window-independent) instead of a transient view; both modes side by side in every budget line and in JSON.
LingBot-World in 24 GiB: compact reaches >= 110 frames with pages (96 with the view)."""

from __future__ import annotations

import dataclasses
import json

import torch

from pagedqvg.attention.pages import ATTN_TILE_TOKENS, attention_scratch_bytes, packed_decode_bytes
from pagedqvg.cli.app import main
from pagedqvg.planning.planner import Geometry, plan_geometry
from pagedqvg.planning.presets import PRESETS


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_lingbot_24gib_both_attention_modes(capsys) -> None:
    for attention in ("view", "pages"):
        code, out = run(capsys, "plan", "--preset", "lingbot-world", "--budget", "24GiB", "--json",
                        "--attention", attention)  # fmt: skip
        assert code == 0
        doc = json.loads(out)
        fits = {f["mode"]: f for f in doc["budget"]["fits"]}
        by = fits["compact"]["by_attention"]
        assert by["view"]["max_window_frames"] == 96 and by["pages"]["max_window_frames"] >= 110
        assert fits["compact"]["max_window_frames"] == by[attention]["max_window_frames"]
        for f in fits.values():  # pages never fit fewer frames than the view
            assert f["by_attention"]["pages"]["max_window_frames"] >= f["by_attention"]["view"]["max_window_frames"]
        assert all(s["attention"] == attention for s in doc["settings"])
    code, out = run(capsys, "plan", "--preset", "lingbot-world", "--budget", "24GiB", "--attention", "pages")
    compact = next(line for line in out.splitlines() if line.strip().startswith("compact"))
    assert "| attention view 96 frames" in compact and "attention from pages" in out


def test_pages_scratch_is_window_independent() -> None:
    """The pages transient is attention_scratch_bytes (+ packed_decode_bytes) of one chunk's queries, the same at
    every window; the view's grows with it."""
    w = PRESETS["lingbot-world"]
    g = Geometry.from_workload(w)
    pages = dataclasses.replace(g, attention="pages")
    args = (g.batch_size, g.chunk_tokens, g.heads, g.head_dim, g.dtype)
    assert pages.transient_bytes(10) == pages.transient_bytes(10**6) == attention_scratch_bytes(*args)
    assert g.transient_bytes(1000) == g.view_bytes(1000)
    small, big = (plan_geometry(pages.with_window_frames(f), replay=False) for f in (18, 96))
    assert small.view_bytes == big.view_bytes and small.attention == "pages"
    fmt_geom = dataclasses.replace(pages, quant=dataclasses.replace(w.quant, bits=2))
    fmt = fmt_geom.packed_format()
    extra = packed_decode_bytes(g.batch_size, g.heads, g.head_dim, ATTN_TILE_TOKENS, fmt)
    assert fmt_geom.transient_bytes(5) == attention_scratch_bytes(*args) + extra
    assert g.dtype == torch.bfloat16


def test_decode_step_matches_the_dequant_reference() -> None:
    from pagedqvg.kernels.view.dequant import DEQUANT_TILE_ELEMS
    from pagedqvg.layout.attention_scratch import DECODE_STEP_ELEMS

    assert DECODE_STEP_ELEMS == DEQUANT_TILE_ELEMS


# ------------------------------------------------------------------------------------------ attention mode heads
def test_heads_mode_fits_the_issue_target_at_lingbot_world_in_24_gib():
    """LingBot-World, 24 GiB, the recommended tiers (sink int4 / recent int4 / history compact): mode heads in the
    cost model's wave-efficient groups (7 heads: 93.4% of 132 SMs) fits 123 frames (target >= 122; view 105, pages
    126), its transient exactly `heads_transient_bytes` at that window."""
    from pagedqvg.cli.plan_doc import build_plan
    from pagedqvg.layout.head_groups import heads_transient_bytes, wave_efficiency
    from pagedqvg.planning.presets import get_preset
    from pagedqvg.quant import QuantConfig

    w = get_preset("lingbot-world").replace(quant=QuantConfig.compact(sink_format="int4", recent_format="int4"))
    doc = build_plan(w, 24 << 30, "--budget", attention="heads")
    fit = {r["mode"]: r for r in doc["budget"]["fits"]}["compact"]
    by = fit["by_attention"]
    assert {m: v["max_window_frames"] for m, v in by.items()} == {"view": 105, "pages": 126, "heads": 123}
    assert fit["max_window_frames"] == 123 and by["heads"]["heads_per_group"] == 7
    assert wave_efficiency(1, 4680, 40, 7) >= 0.9 > wave_efficiency(1, 4680, 40, 6)
    geom = Geometry.from_workload(w).with_window_frames(123)  # the whole window is one call's view
    expected = heads_transient_bytes(1, 4680, 40, 128, torch.bfloat16, geom.cache_size, 7)
    assert by["heads"]["transient_bytes"] == expected < by["view"]["transient_bytes"]


def test_heads_mode_takes_a_fixed_group_and_refuses_a_bad_one(capsys):
    assert main(["plan", "--preset", "lingbot-world", "--budget", "24GiB", "--attention", "heads", "--head-group",
                 "10", "--json"]) == 0  # fmt: skip
    fits = json.loads(capsys.readouterr().out)["budget"]["fits"]
    assert {r["by_attention"]["heads"]["heads_per_group"] for r in fits} == {10}
    assert main(["plan", "--preset", "lingbot-world", "--budget", "24GiB", "--head-group", "99"]) == 0  # clamped
    assert "heads of 40 " in capsys.readouterr().out
    assert main(["plan", "--head-group", "0"]) == 2
    assert "--head-group: 0 is out of range; must be an integer >= 1" in capsys.readouterr().err
