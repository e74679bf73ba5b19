"""Replays of the LingBot-World and LongLive2 call patterns (SEMANTICS.md, "How callers use it"), scaled down.

Per chunk, for each denoise step, every layer is called once (the model runs its layers in order): the first step
advances by one chunk, the other steps and the final clean "context" pass rewrite the same range in place. Every
call is compared with the dense reference bit for bit; the pool is checked after each chunk, its usage is compared
with an exact page model, and once the window is full the usage must stop growing (exact page counts).
"""

from __future__ import annotations

import pytest
import torch
from dense_reference import DenseReferenceCache
from helpers import SegmentModel, cache_kwargs, pages_for

from pagedqvg import BlockPool, PagedCausalKVCache, make_layer_caches

PAGE_BYTES = 256


def _kv(B, n, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, n, H, D, generator=g).to(dtype),
        torch.randn(B, n, H, D, generator=g).to(dtype),
    )


class Stack:
    """`layers` paged caches on a shared pool, each paired with a dense reference and a page model."""

    def __init__(self, pool, layers, cfg, use_int):
        self.cfg = cfg
        kw = cache_kwargs({**cfg, "grow": False})
        if use_int:
            self.caches = make_layer_caches(
                layers, pool=pool, dtype=cfg["dtype"], device="cpu", use_int_indices=True, **kw
            )
        else:
            self.caches = [
                PagedCausalKVCache(pool=pool, dtype=cfg["dtype"], device="cpu", use_int_indices=False, **kw)
                for _ in range(layers)
            ]
        assert len({c.owner for c in self.caches}) == layers
        self.refs = [DenseReferenceCache(dtype=cfg["dtype"], **kw) for _ in range(layers)]
        self.models = [SegmentModel() for _ in range(layers)]
        self.branches = set()

    def call(self, layer, s, n, seed, r=None):
        cfg = self.cfg
        k, v = _kv(cfg["B"], n, cfg["H"], cfg["D"], cfg["dtype"], seed)
        ref = self.refs[layer]
        g0 = ref.G
        rv = ref.update_and_get_attention_kv(k, v, s, recent_window_tokens=r)
        cv = self.caches[layer].update_and_get_attention_kv(
            key=k, value=v, current_chunk_start=s, recent_window_tokens=r
        )
        assert (cv.local_start_index, cv.local_end_index, cv.visible_local_end, cv.visible_global_end) == (
            rv.local_start_index,
            rv.local_end_index,
            rv.visible_local_end,
            rv.visible_global_end,
        )
        assert cv.k.shape == rv.k.shape, (layer, s, n, ref.last_branch)
        assert torch.equal(cv.k, rv.k) and torch.equal(cv.v, rv.v), (layer, s, n, ref.last_branch)
        self.branches.add(ref.last_branch)
        if g0 < ref.G:
            self.models[layer].advance(g0, ref.G)
        self.models[layer].prune(ref)

    def pin(self, layer, n):
        self.refs[layer].pin_current_chunk(n)
        self.caches[layer].pin_current_chunk(n)

    def expected_pages(self):
        return sum(m.pages(self.cfg) for m in self.models)

    def check_cursors(self, use_int):
        for c, r in zip(self.caches, self.refs, strict=True):
            if use_int:
                assert (c.global_end_index_int, c.local_end_index_int) == (r.G, r.L)
            else:
                assert (int(c.global_end_index.item()), int(c.local_end_index.item())) == (r.G, r.L)


def run_chunks(pool, stacks, num_chunks, chunk_tokens, steps, pins=(), recent=None, use_int=False):
    """Drive every stack through `num_chunks` chunks; returns pool used pages after each chunk."""
    used = []
    seed = 0
    for c in range(num_chunks):
        s = c * chunk_tokens
        for _step in range(steps):
            for stack in stacks:
                for layer in range(len(stack.caches)):
                    seed += 1
                    stack.call(layer, s, chunk_tokens, seed, r=recent)
        if c in pins:
            for stack in stacks:
                for layer in range(len(stack.caches)):
                    stack.pin(layer, chunk_tokens)
        pool.check()
        stats = pool.stats()
        assert stats.used_pages == sum(st.expected_pages() for st in stacks), (c, stats)
        owner = dict(stats.owner_pages)
        for st in stacks:
            st.check_cursors(use_int)
            for cache, model in zip(st.caches, st.models, strict=True):
                assert owner.get(cache.owner, 0) == model.pages(st.cfg)
                assert cache.resident_nbytes() == model.pages(st.cfg) * pool.page_bytes
        used.append(stats.used_pages)
    return used


# ------------------------------------------------------------------------------------------------ LingBot-World
LINGBOT = {
    # 3-frame chunks, 3-frame sink (sink_tokens), 21-frame cache, full window
    "sink3_window18": dict(tpf=4, chunk_frames=3, S=3, GS=0, C=21, W=None, layers=4),
    # 5-frame chunks, global sink of one chunk, 30-frame cache, 20-frame attention window (ps view branch)
    "globalsink5_window20": dict(tpf=6, chunk_frames=5, S=5, GS=5, C=30, W=20, layers=3),
}


def scenario_cfg(p: dict) -> dict:
    """The cache shape of a scenario preset: its frame counts in tokens (`tpf` tokens per frame), 2 heads of 8."""
    tpf = p["tpf"]
    return dict(
        B=1,
        C=p["C"] * tpf,
        S=p["S"] * tpf,
        GS=p["GS"] * tpf,
        W=None if p["W"] is None else p["W"] * tpf,
        H=2,
        D=8,
        dtype=torch.bfloat16,
        page_bytes=PAGE_BYTES,
    )


@pytest.mark.parametrize("use_int", [False, True])
@pytest.mark.parametrize("name", sorted(LINGBOT))
def test_lingbot_world(name, use_int):
    p = LINGBOT[name]
    tpf = p["tpf"]
    n = p["chunk_frames"] * tpf
    cfg = scenario_cfg(p)
    per_seg = pages_for(cfg, n)
    sink_chunks = max(p["S"], p["GS"]) // p["chunk_frames"]
    window_chunks = (p["C"] - max(p["S"], p["GS"])) // p["chunk_frames"]
    live = sink_chunks + window_chunks
    pool = BlockPool(capacity_bytes=(p["layers"] * live * per_seg + 3) * PAGE_BYTES, page_bytes=PAGE_BYTES)
    stack = Stack(pool, p["layers"], cfg, use_int)
    num_chunks = 32
    used = run_chunks(pool, [stack], num_chunks, n, steps=4, use_int=use_int)
    # growth while filling, one segment per chunk and layer ...
    full = live  # chunks after which every slot is filled
    for c in range(full):
        assert used[c] == p["layers"] * per_seg * (c + 1)
    # ... then exactly flat: sink chunk(s) + the window's chunks per layer
    assert used[full - 1 :] == [p["layers"] * live * per_seg] * (num_chunks - full + 1)
    assert pool.stats().high_water_pages == p["layers"] * live * per_seg
    assert num_chunks * n == stack.refs[0].G
    if p["GS"]:
        assert "ps" in stack.branches
    for cache in stack.caches:
        cache.reset_indices()
    assert pool.stats().used_pages == 0
    pool.check()


# ------------------------------------------------------------------------------------------------ LongLive2
LONGLIVE = {
    # sink 8 frames, 32-frame cache, full window, scene cuts: the pinned chunk scrolls to slot 0 and becomes the sink
    "sink8_cache32": dict(tpf=4, chunk_frames=8, S=8, GS=0, C=32, W=None, layers=3, live=4),
    # same with a 16-frame attention window: the pinned chunk is shown before it reaches the sink (pp branch)
    "sink8_cache32_window16": dict(tpf=4, chunk_frames=8, S=8, GS=0, C=32, W=16, layers=3, live=4),
    # 6-frame sink, 4-frame chunks: the sink ends inside chunk 1, so 2 sink segments + 6 tail chunks stay live
    # (the pinned chunk then scrolls past slot 0 unaligned and the pin lapses; the count stays 8)
    "sink6_cache30_window20": dict(tpf=4, chunk_frames=4, S=6, GS=0, C=30, W=20, layers=2, live=8),
}


@pytest.mark.parametrize("use_int", [False, True])
@pytest.mark.parametrize("name", sorted(LONGLIVE))
def test_longlive2_with_scene_cuts_and_cfg(name, use_int):
    p = LONGLIVE[name]
    tpf = p["tpf"]
    n = p["chunk_frames"] * tpf
    cfg = scenario_cfg(p)
    per_seg = pages_for(cfg, n)
    max_live = -(-cfg["C"] // n) + 2  # at most: chunks overlapping the slots
    pool = BlockPool(capacity_bytes=2 * p["layers"] * max_live * per_seg * PAGE_BYTES, page_bytes=PAGE_BYTES)
    # classifier-free guidance: two cache sets on one pool
    stacks = [Stack(pool, p["layers"], cfg, use_int), Stack(pool, p["layers"], cfg, use_int)]
    num_chunks = 34
    pins = (9, 10, 20, 27)  # scene cuts (two in a row at 9, 10)
    used = run_chunks(pool, stacks, num_chunks, n, steps=4, pins=pins, use_int=use_int)
    assert len(used) == num_chunks
    branches = set().union(*(st.branches for st in stacks))
    if name == "sink8_cache32_window16":
        assert {"pp", "ps"} <= branches, branches
    # once full, pool usage is exactly flat (through the scene cuts too) and never exceeded
    full = -(-cfg["C"] // n)
    for c in range(full - 1):
        assert used[c] == 2 * p["layers"] * per_seg * (c + 1)
    steady = 2 * p["layers"] * p["live"] * per_seg
    assert used[full - 1 :] == [steady] * (num_chunks - full + 1), used
    assert pool.stats().high_water_pages == steady
    for st in stacks:
        for cache in st.caches:
            cache.reset_indices()
    assert pool.stats().used_pages == 0
    pool.check()


def test_longlive2_pinned_chunk_becomes_sink():
    """Hand-checked: after a scene-cut pin the pinned chunk scrolls down and becomes the sink at slot 0."""
    n = 8
    cfg = dict(B=1, C=32, S=8, GS=0, W=None, H=2, D=8, dtype=torch.float32, page_bytes=PAGE_BYTES)
    pool = BlockPool(capacity_bytes=64 * PAGE_BYTES, page_bytes=PAGE_BYTES)
    st = Stack(pool, 1, cfg, use_int=False)
    for c in range(6):
        for step in range(3):
            st.call(0, c * n, n, seed=100 * c + step)
    # G = 48, L = 32: slots = sink [0,8) + [24,48)
    ref = st.refs[0]
    assert ref.slot_global == list(range(8)) + list(range(24, 48))
    st.pin(0, n)  # P = 24 != GS -> E = 0: the old sink will roll out
    assert (ref.P, ref.PL, ref.E) == (24, 8, 0)
    for c in range(6, 9):
        for step in range(3):
            st.call(0, c * n, n, seed=100 * c + step)
    # three more chunks: the pinned chunk [40, 48) moved from slot 24 to slot 0 and became the sink (E = 8)
    assert (ref.P, ref.PL, ref.E) == (0, 8, 8)
    assert ref.slot_global == list(range(40, 48)) + list(range(48, 72))
    st.call(0, 72, n, seed=1)
    assert ref.slot_global == list(range(40, 48)) + list(range(56, 80))
    assert pool.stats().used_pages == 4 * pages_for(cfg, n)
    pool.check()
