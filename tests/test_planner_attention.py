"""`pagedqvg plan --attention pages|view`: with attention from pages the budget holds update_and_attend's scratch
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
