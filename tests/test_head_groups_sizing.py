"""Sizing of attention mode `heads` (layout/head_groups.py): the transient the planner budgets equals the bytes a
repeated `update_and_attend_heads` call really allocates (exact, by the dispatcher's allocation counter), and the
cost model's wave arithmetic and group choice.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from memory_count import AllocatedBytes

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.layout.head_groups import (
    choose_head_group,
    head_group_ranges,
    heads_transient_bytes,
    view_transient_bytes,
    wave_efficiency,
)
from pagedqvg.planning.synthetic import video_kv

B, H, D, N = 2, 5, 8, 12


def filled(dtype, quant=None, reuse=False):
    pool = BlockPool(capacity_bytes=4 << 20, page_bytes=1024)
    cache = PagedCausalKVCache(
        pool=pool, batch_size=B, cache_size=4 * N, num_heads=H, head_dim=D, dtype=dtype, device="cpu",
        sink_tokens=N, quant=quant, reuse_view_buffer=reuse,
    )
    k, v = video_kv(6, N, H, D, seed=5, batch=B)
    k, v = k.to(dtype), v.to(dtype)
    for c in range(5):
        cache.update_and_get_attention_kv(key=k[:, c * N : (c + 1) * N], value=v[:, c * N : (c + 1) * N],
                                          current_chunk_start=c * N)  # fmt: skip
    return cache, k, v


def exact_output(q, k, v):
    """An attention stand-in that allocates exactly its output `[B, g, Tq, D]` (the sizing's "one group's output")."""
    return q.clone(memory_format=torch.contiguous_format)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quant", [None, QuantConfig(bits=2, centroids=16, block_size=8)], ids=["off", "int2"])
@pytest.mark.parametrize("group", [1, 2, 5])
@pytest.mark.parametrize("heads", [None, (1, 3)])
def test_heads_transient_is_what_the_call_allocates(production, dtype, quant, group, heads):
    cache, k, v = filled(dtype, quant)
    h0, hin = heads if heads is not None else (0, H)
    group = min(group, hin)
    s = 4 * N
    kw = dict(key=k[:, s : s + N, h0 : h0 + hin], value=v[:, s : s + N, h0 : h0 + hin], current_chunk_start=s,
              head_group_size=group, attention=exact_output)  # fmt: skip
    if heads is not None:
        kw["cache_head_start"] = h0
    q = k[:, s : s + N, h0 : h0 + hin]
    cache.update_and_attend_heads(q, **kw)  # plans the call
    with AllocatedBytes() as mem:
        out = cache.update_and_attend_heads(q, **kw)
    T = 4 * N  # the whole window: 5 chunks of 12 tokens in 48 slots (a sink of 12, rolled)
    assert sum(b - a for a, b, _ in cache.last_view_sources()) == T
    assert mem.peak == heads_transient_bytes(B, N, hin, D, dtype, T, group), mem.log
    assert out.shape == (B, N, hin, D) and torch.equal(out, q)  # the stand-in's output, head by head


def test_view_transient_is_what_view_mode_allocates(production):
    cache, k, v = filled(torch.bfloat16)
    s = 4 * N

    def view_mode():
        view = cache.update_and_get_attention_kv(key=k[:, s : s + N], value=v[:, s : s + N], current_chunk_start=s)
        return exact_output(k[:, s : s + N].transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2))

    view_mode()
    with AllocatedBytes() as mem:
        view_mode()
    assert mem.peak == view_transient_bytes(B, N, H, D, torch.bfloat16, 4 * N)


def test_reused_view_buffer_leaves_result_and_output(production):
    cache, k, v = filled(torch.bfloat16, reuse=True)
    s = 4 * N
    kw = dict(key=k[:, s : s + N], value=v[:, s : s + N], current_chunk_start=s, head_group_size=2,
              attention=exact_output)  # fmt: skip
    cache.update_and_attend_heads(k[:, s : s + N], **kw)
    with AllocatedBytes() as mem:
        cache.update_and_attend_heads(k[:, s : s + N], **kw)
    buffer = 2 * B * 4 * N * 2 * D * 2
    assert mem.peak == heads_transient_bytes(B, N, H, D, torch.bfloat16, 4 * N, 2) - buffer


def _efficiency(per_head: int, heads: int, group: int, sms: int) -> Fraction:
    sizes = [min(group, heads - a) for a in range(0, heads, group)]
    return Fraction(sum(per_head * g for g in sizes), sum(-(-per_head * g // sms) * sms for g in sizes))


def test_wave_efficiency_at_lingbot_world_shape():
    """4,680 queries: 37 blocks of 128 per head. 40 heads on 132 SMs: groups of 4 = 148 blocks in 2 waves (56.1%),
    of 10 = 370 blocks in 3 waves (93.4%); groups of 7: five of 259 blocks (2 waves) and one of 185 (2 waves)."""
    assert math.ceil(4680 / 128) == 37
    assert wave_efficiency(1, 4680, 40, 4) == pytest.approx(148 / 264, abs=1e-15)
    assert wave_efficiency(1, 4680, 40, 10) == pytest.approx(370 / 396, abs=1e-15)
    assert wave_efficiency(1, 4680, 40, 7) == pytest.approx((5 * 259 + 185) / (6 * 264), abs=1e-15)
    for g in range(1, 41):
        assert wave_efficiency(1, 4680, 40, g) == pytest.approx(float(_efficiency(37, 40, g, 132)), abs=1e-15)


def test_choose_head_group():
    lingbot = (1, 4680, 40, 128, torch.bfloat16, 28080)
    best = choose_head_group(*lingbot)
    assert (best.group, best.groups) == (7, 6)  # the smallest group size of >= 90%
    assert best.wave_efficiency >= 0.9 and best.transient_bytes == heads_transient_bytes(*lingbot, 7)
    budget = heads_transient_bytes(*lingbot, 6)  # 7 no longer fits: the most efficient that does (3 or 6: 80.1%)
    tight = choose_head_group(*lingbot, budget_bytes=budget)
    assert tight.group == 3 and tight.transient_bytes <= budget and "most efficient" in tight.reason
    assert choose_head_group(*lingbot, budget_bytes=1).group == 1
    ulysses = choose_head_group(1, 4680, 5, 128, torch.bfloat16, 28080)  # 5 heads per rank at degree 8
    assert ulysses.group == 3 and ulysses.wave_efficiency == pytest.approx(185 / 264, abs=1e-15)
    with pytest.raises(ValueError, match=r"heads=0; valid: an int >= 1"):
        choose_head_group(1, 4680, 0, 128, torch.bfloat16, 28080)


def test_group_ranges_and_transient_arithmetic():
    assert head_group_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert head_group_ranges(3, 3) == [(0, 3)]
    # LingBot-World, one layer's window of 28,080 tokens, bf16: the view 548.4 MiB + the output 45.7 MiB; groups of
    # 10 heads: a quarter of the view, plus the whole result and one group's output.
    assert view_transient_bytes(1, 4680, 40, 128, torch.bfloat16, 28080) == (2 * 28080 + 4680) * 40 * 128 * 2
    assert heads_transient_bytes(1, 4680, 40, 128, torch.bfloat16, 28080, 10) == (
        (2 * 28080 * 10 + 4680 * 40 + 4680 * 10) * 128 * 2
    )


def test_attention_modes_doc_figures_are_the_codes():
    """docs/ATTENTION_MODES.md's per-preset group choices and transients, recomputed."""
    import os

    from pagedqvg.planning.planner import Geometry, closed_form_view_tokens
    from pagedqvg.planning.presets import get_preset

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "ATTENTION_MODES.md")
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    for name in ("lingbot-world", "longlive2", "self-forcing"):
        w = get_preset(name)
        g = Geometry.from_workload(w)
        T, Tq, H, D = closed_form_view_tokens(g), g.chunk_tokens, w.heads, w.head_dim
        best = choose_head_group(1, Tq, H, D, torch.bfloat16, T)
        tflop = 4 * Tq * T * H * D / 1e12
        eff = best.wave_efficiency
        row = f"| {Tq:,} | {T:,} | {H} × {D} | {tflop:.2f} | {best.group} ({best.groups} groups, {eff:.1%}"
        assert row in doc, (name, row)
        assert f"| heads (g={best.group}) |" in doc and f"{best.transient_bytes / 2**20:,.1f} MiB" in doc, name
        view = view_transient_bytes(1, Tq, H, D, torch.bfloat16, T)
        assert f"{view / 2**20:,.1f} MiB (view {2 * T * H * D * 2 / 2**20:,.1f} MiB)" in doc, name


def test_lingbot_world_target_frames_with_the_heads_transient(monkeypatch):
    """Issue 29's target, with the planner's transient replaced by `heads_transient_bytes` (the integrator wires
    `plan --attention heads`): LingBot-World, 24 GiB, the recommended tiers (sink int4 / recent int4 / history
    compact): view 105 frames, pages 126, heads in groups of 7 (93.4% wave efficiency on 132 SMs) 123 >= 122."""
    import dataclasses

    from pagedqvg import QuantConfig
    from pagedqvg.planning import planner
    from pagedqvg.planning.presets import get_preset

    w = get_preset("lingbot-world")
    geom = planner.Geometry.from_workload(w, QuantConfig.compact(sink_format="int4", recent_format="int4"))
    budget = 24 << 30
    modes = ("view", "pages")
    frames = {m: planner.max_window_frames(dataclasses.replace(geom, attention=m), budget, 3) for m in modes}
    assert frames == {"view": 105, "pages": 126}

    def heads_transient(self, view_tokens):
        return heads_transient_bytes(self.batch_size, self.chunk_tokens, self.heads, self.head_dim, self.dtype,
                                     view_tokens, 7)  # fmt: skip

    monkeypatch.setattr(planner.Geometry, "transient_bytes", heads_transient)
    assert wave_efficiency(1, geom.chunk_tokens, geom.heads, 7) >= 0.9
    assert planner.max_window_frames(geom, budget, 3) == 123
