"""Property tests: several layers of PagedCausalKVCache on one small BlockPool against the dense reference.

A Hypothesis RuleBasedStateMachine draws a random configuration per example and drives random programs: appends,
rewrites (current chunk, older retained ranges, rewrite-and-extend), pins, resets, rewinds (valid and invalid),
recent-window views, head-sliced writes, growth, int and tensor cursors, and invalid writes. After every call the
view must equal the reference's bit for bit (torch.equal), errors must be of the same kind and change nothing, and
the pool's accounting must match an exact page model derived from the reference.

Profiles (tests/conftest.py): "ci" (default, >= 5,000 steps), "long" (>= 200,000 steps; PAGEDQVG_FUZZ_PROFILE=long)
and "interp" (a reduced budget for the Triton-interpreter rerun in .ci/triton_suite.sh).
"""

from __future__ import annotations

import os

import pytest
import torch
from dense_reference import CacheConfigError, DenseReferenceCache, SequencingError
from fuzz_rules import MAX_LIVE_SEGMENTS_WITH_GROWTH, write_order_rules
from helpers import (
    SegmentModel,
    cache_kwargs,
    itemsize,
    make_kv,
    note,
    pages_for,
    same_error_kind,
    seeds,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, run_state_machine_as_test

from pagedqvg import BlockPool, PagedCausalKVCache, PoolExhaustedError
from pagedqvg.allocator.pool import debug_state

NUM_LAYERS = 3
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_C = 16
STEPS = [0]  # state-machine steps run in this process (invariant checks), for measuring the profiles


@st.composite
def configs(draw):
    C = draw(st.integers(2, MAX_C))
    S = min(C - 1, draw(st.sampled_from([0, 1, 2, 3, C // 2, C // 2, C - 1])))
    GS = min(C - 1, draw(st.sampled_from([0, 0, 0, 1, 2, 3])))
    W = draw(st.sampled_from([None, None, 0, "small", "small", "small", C]))
    if W == "small":
        W = draw(st.integers(1, C - 1))
    if GS > 0 and W and max(GS, S) > W:
        # Known disagreement (see test_view_sink_longer_than_local_end): with GS > 0 and W < L < E the ps view
        # branch reads slots [0, E) past L, i.e. slots never written. Kept out of the main machine so it can find
        # other bugs; the dedicated test documents it.
        W = draw(st.integers(max(GS, S), C))
    H = draw(st.integers(1, 4))
    D = draw(st.integers(2, 8))
    dtype = draw(st.sampled_from(DTYPES))
    B = draw(st.integers(1, 2))
    grow = draw(st.sampled_from([False, False, False, True]))
    use_int = draw(st.booleans())
    # a page must hold one whole token (K and V of every batch element)
    min_page = -(-2 * B * H * D * itemsize(dtype) // 256) * 256
    page_bytes = draw(st.sampled_from([min_page, min_page, min_page + 256, max(1024, min_page)]))
    return dict(C=C, S=S, GS=GS, W=W, H=H, D=D, dtype=dtype, B=B, grow=grow, use_int=use_int, page_bytes=page_bytes)


def max_new_tokens(cfg):
    return cfg["C"] + 3


def pool_pages_needed(cfg):
    """An upper bound of the pages all layers can hold at once under the machine's rules."""
    live = MAX_LIVE_SEGMENTS_WITH_GROWTH if cfg["grow"] else cfg["C"]
    return NUM_LAYERS * live * pages_for(cfg, max_new_tokens(cfg))




# ------------------------------------------------------------------------------------------------ the machine
class PagedCacheMachine(write_order_rules(NUM_LAYERS)):
    """The rules are tests/fuzz_rules.py's (shared with the quantized machine); here: setup, the checked calls, the
    page model and the invariants."""

    @initialize(cfg=configs())
    def setup(self, cfg):
        note(f"config: {cfg}")
        self.cfg = cfg
        self.pool = BlockPool(capacity_bytes=pool_pages_needed(cfg) * cfg["page_bytes"], page_bytes=cfg["page_bytes"])
        kw = cache_kwargs(cfg)
        self.caches = [
            PagedCausalKVCache(pool=self.pool, dtype=cfg["dtype"], device="cpu", use_int_indices=cfg["use_int"], **kw)
            for _ in range(NUM_LAYERS)
        ]
        self.refs = [DenseReferenceCache(dtype=cfg["dtype"], **kw) for _ in range(NUM_LAYERS)]
        self.models = [SegmentModel() for _ in range(NUM_LAYERS)]
        self.last_chunk = [None] * NUM_LAYERS  # (s, e) of the last advance per layer
        self.ready = True

    # ---------------------------------------------------------------- plumbing
    def snapshot(self, i):
        c = self.caches[i]
        pool = self.pool
        dbg = debug_state(pool)
        return (
            pool.stats(),
            dbg,
            c.global_end_index_int,
            c.local_end_index_int,
            int(c.global_end_index.item()),
            int(c.local_end_index.item()),
            c.resident_nbytes(),
            c.cache_size,
            c.attention_window_size,
        )

    def call_write(self, i, s, n, hin, h0, r, seed):
        cfg = self.cfg
        ref, cache = self.refs[i], self.caches[i]
        if n > 0:
            k, v = make_kv(cfg, n, hin, seed)
        else:
            k = v = torch.empty(cfg["B"], 0, hin, cfg["D"], dtype=cfg["dtype"])
        note(
            f"layer {i}: write s={s} n={n} hin={hin} h0={h0} r={r}  (ref G={ref.G} L={ref.L} E={ref.E} "
            f"P={ref.P} PL={ref.PL} C={ref.C} W={ref.W})"
        )
        g_before = ref.G
        before = self.snapshot(i)
        try:
            rv = ref.update_and_get_attention_kv(k, v, s, cache_head_start=h0, recent_window_tokens=r)
            rexc = None
        except Exception as exc:
            rv, rexc = None, exc
        try:
            cv = cache.update_and_get_attention_kv(
                key=k, value=v, current_chunk_start=s, cache_head_start=h0, recent_window_tokens=r
            )
            cexc = None
        except Exception as exc:
            cv, cexc = None, exc
        if rexc is not None:
            assert same_error_kind(rexc, cexc), f"reference raised {type(rexc).__name__}({rexc}) but the cache " + (
                "returned a view" if cexc is None else f"raised {type(cexc).__name__}({cexc})"
            )
            assert self.snapshot(i) == before, "a failed call changed the cache or the pool"
            return None
        if cexc is not None:
            raise AssertionError(f"reference accepted the call but the cache raised {type(cexc).__name__}: {cexc}")
        assert (cv.local_start_index, cv.local_end_index, cv.visible_local_end, cv.visible_global_end) == (
            rv.local_start_index,
            rv.local_end_index,
            rv.visible_local_end,
            rv.visible_global_end,
        ), (cv, rv)
        assert cv.k.dtype == rv.k.dtype and cv.v.dtype == rv.v.dtype
        assert cv.k.shape == rv.k.shape, (tuple(cv.k.shape), tuple(rv.k.shape), ref.last_branch)
        assert torch.equal(cv.k, rv.k), f"k differs (view branch {ref.last_branch})"
        assert torch.equal(cv.v, rv.v), f"v differs (view branch {ref.last_branch})"
        if g_before < ref.G:
            self.models[i].advance(g_before, ref.G)
            self.last_chunk[i] = (s, s + n)
        self.models[i].prune(ref)
        return rv

    def call_simple(self, i, name, *args):
        """pin / rewind / reset on both; same error kind; a failed call changes nothing."""
        ref, cache = self.refs[i], self.caches[i]
        note(f"layer {i}: {name}{args}  (ref G={ref.G} L={ref.L} E={ref.E} P={ref.P} PL={ref.PL})")
        before = self.snapshot(i)
        try:
            getattr(ref, name)(*args)
            rexc = None
        except Exception as exc:
            rexc = exc
        try:
            getattr(cache, name)(*args)
            cexc = None
        except Exception as exc:
            cexc = exc
        if rexc is not None:
            assert same_error_kind(rexc, cexc), (
                f"reference raised {type(rexc).__name__}({rexc}) on {name}{args} but the cache "
                + ("did not raise" if cexc is None else f"raised {type(cexc).__name__}({cexc})")
            )
            assert self.snapshot(i) == before, f"a failed {name} changed the cache or the pool"
            return False
        if cexc is not None:
            raise AssertionError(f"reference accepted {name}{args} but the cache raised {type(cexc).__name__}: {cexc}")
        return True

    def max_new_tokens(self):
        return max_new_tokens(self.cfg)

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        if not getattr(self, "ready", False):
            return
        STEPS[0] += 1
        self.pool.check()
        stats = self.pool.stats()
        owner_pages = dict(stats.owner_pages)
        total = 0
        for i, (cache, ref) in enumerate(zip(self.caches, self.refs, strict=True)):
            if self.cfg["use_int"]:
                assert (cache.global_end_index_int, cache.local_end_index_int) == (ref.G, ref.L)
            else:
                assert cache.global_end_index_int is None and cache.local_end_index_int is None
                assert cache.global_end_index.dtype == torch.int64 and cache.global_end_index.shape == (1,)
                assert (int(cache.global_end_index.item()), int(cache.local_end_index.item())) == (ref.G, ref.L)
            assert cache.cache_size == ref.C
            if self.cfg["W"]:
                assert cache.attention_window_size == ref.W
            else:
                assert cache.attention_window_size in (ref.W, None, 0)
            assert cache.num_cache_heads == ref.H
            assert cache.sink_tokens == ref.S and cache.global_sink_tokens == ref.GS
            for n in (ref.C, ref.W, 1):
                assert cache.can_direct_current_attention(n) == ref.can_direct_current_attention(n)
            pages = owner_pages.get(cache.owner, 0)
            total += pages
            assert cache.resident_nbytes() == pages * self.pool.page_bytes
            assert (cache.resident_nbytes() > 0) == (ref.L > 0), (cache.resident_nbytes(), ref.L)
            expected = self.models[i].pages(self.cfg)
            assert pages == expected, (
                f"layer {i} holds {pages} pages, the segment model expects {expected} "
                f"(segments {self.models[i].segs}, slots {ref.slot_global[: ref.L]})"
            )
        assert stats.used_pages == total == self.pool.num_pages - self.pool.num_free_pages
        assert stats.held_bytes == stats.used_pages * self.pool.page_bytes

    def teardown(self):
        if not getattr(self, "ready", False):
            return
        for i in range(NUM_LAYERS):
            self.caches[i].reset_indices()
        assert self.pool.stats().used_pages == 0
        self.pool.check()


#: The least number of state-machine steps a profile must reach (the issue's budget for CI and for the long run).
MIN_STEPS = {"ci": 5_000, "long": 200_000}


def test_state_machine_against_dense_reference():
    """Runs the machine under the active profile and checks that the profile really ran its step budget."""
    before = STEPS[0]
    run_state_machine_as_test(PagedCacheMachine)
    profile = os.environ.get("PAGEDQVG_FUZZ_PROFILE", "ci")
    ran = STEPS[0] - before
    print(f"state machine: {ran} steps under profile {profile!r}")
    if profile in MIN_STEPS:
        assert ran >= MIN_STEPS[profile], f"profile {profile!r} ran {ran} steps, below {MIN_STEPS[profile]}"


# ------------------------------------------------------------------------------------------------ pool exhaustion
def _exhaustion_setup(dtype=torch.bfloat16, use_int=False):
    # H*D*2 = 64 B rows, 256 B pages, B = 1 -> 2 whole tokens per page; a chunk of 4 tokens -> 2 pages.
    pool = BlockPool(capacity_bytes=5 * 256, page_bytes=256)
    kw = dict(batch_size=1, cache_size=8, num_heads=2, head_dim=16, dtype=dtype, device="cpu", use_int_indices=use_int)
    caches = [PagedCausalKVCache(pool=pool, **kw) for _ in range(2)]
    refs = [DenseReferenceCache(1, 8, 2, 16, dtype=dtype) for _ in range(2)]
    return pool, caches, refs


def _kv(n, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, 2, 16, generator=g).to(dtype), torch.randn(1, n, 2, 16, generator=g).to(dtype)


@pytest.mark.parametrize("use_int", [False, True])
def test_pool_exhausted_changes_nothing(use_int):
    pool, caches, refs = _exhaustion_setup(use_int=use_int)
    for i, s in ((0, 0), (1, 0)):
        k, v = _kv(4, s + i)
        caches[i].update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
        refs[i].update_and_get_attention_kv(k, v, s)
    assert pool.stats().used_pages == 4 and pool.num_free_pages == 1

    def snapshot():
        cache = caches[0]
        return (pool.stats(), debug_state(pool), cache.resident_nbytes(), cache.global_end_index_int,
                int(cache.global_end_index.item()), cache.local_end_index_int)  # fmt: skip

    before = snapshot()
    k, v = _kv(4, 99)
    with pytest.raises(PoolExhaustedError):
        caches[0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=4)
    assert snapshot() == before
    pool.check()
    # the cache still works and still equals the reference: an in-place rewrite, and a 1-page append
    k, v = _kv(4, 7)
    cv = caches[0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    rv = refs[0].update_and_get_attention_kv(k, v, 0)
    assert torch.equal(cv.k, rv.k) and torch.equal(cv.v, rv.v)
    k, v = _kv(2, 8)  # 2 tokens -> 4 rows -> 1 page
    cv = caches[0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=4)
    rv = refs[0].update_and_get_attention_kv(k, v, 4)
    assert torch.equal(cv.k, rv.k) and torch.equal(cv.v, rv.v)
    assert pool.num_free_pages == 0
    # freeing the other layer makes room
    caches[1].reset_indices()
    k, v = _kv(2, 9)
    cv = caches[0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=6)
    rv = refs[0].update_and_get_attention_kv(k, v, 6)
    assert torch.equal(cv.k, rv.k) and torch.equal(cv.v, rv.v)
    assert (cv.visible_global_end, cv.visible_local_end) == (8, 8)
    pool.check()


def test_pool_exhausted_roll_counts_evicted_pages_as_free():
    # A roll that frees a whole segment in the same call may reuse its pages.
    pool = BlockPool(capacity_bytes=4 * 256, page_bytes=256)
    cache = PagedCausalKVCache(
        pool=pool, batch_size=1, cache_size=8, num_heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu"
    )
    ref = DenseReferenceCache(1, 8, 2, 16, dtype=torch.bfloat16)
    for s in (0, 4, 8, 12):
        k, v = _kv(4, s)
        cv = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
        rv = ref.update_and_get_attention_kv(k, v, s)
        assert torch.equal(cv.k, rv.k) and torch.equal(cv.v, rv.v)
        assert pool.stats().used_pages == min(4, 2 * (s // 4 + 1))
        pool.check()


@settings(max_examples=25)
@given(cfg=configs(), seed=seeds, extra=st.integers(0, 3))
def test_pool_exhaustion_random(cfg, seed, extra):
    """A pool with room for a few chunks: appends until the pool refuses; the refused call changes nothing."""
    e0 = max(cfg["GS"], cfg["S"])
    a = max(1, (cfg["C"] - e0) // 2)
    per = pages_for(cfg, a)
    extra = extra % per  # room for fewer than 3 chunks; two layers hold at least 4 once they are full
    pool = BlockPool(capacity_bytes=(per * 2 + extra) * cfg["page_bytes"], page_bytes=cfg["page_bytes"])
    kw = cache_kwargs(cfg)
    caches = [
        PagedCausalKVCache(pool=pool, dtype=cfg["dtype"], device="cpu", use_int_indices=cfg["use_int"], **kw)
        for _ in range(2)
    ]
    refs = [DenseReferenceCache(dtype=cfg["dtype"], **kw) for _ in range(2)]
    raised = False
    for step in range(12):
        i = step % 2
        k, v = make_kv(cfg, a, cfg["H"], seed + step)
        s = refs[i].G
        before = (
            pool.stats(),
            debug_state(pool),
            caches[i].resident_nbytes(),
            int(caches[i].global_end_index.item()),
            caches[i].global_end_index_int,
        )
        try:
            cv = caches[i].update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
        except PoolExhaustedError:
            raised = True
            after = (
                pool.stats(),
                debug_state(pool),
                caches[i].resident_nbytes(),
                int(caches[i].global_end_index.item()),
                caches[i].global_end_index_int,
            )
            assert before == after
            pool.check()
            continue
        except (SequencingError, CacheConfigError):
            with pytest.raises((SequencingError, CacheConfigError)):
                refs[i].update_and_get_attention_kv(k, v, s)
            continue
        rv = refs[i].update_and_get_attention_kv(k, v, s)
        assert torch.equal(cv.k, rv.k) and torch.equal(cv.v, rv.v)
        pool.check()
    # with two layers and room for ~2 chunks, some append must have been refused
    assert raised


# ------------------------------------------------------------------------------------------------ targeted programs
def run_program(cfg, ops, layers=1):
    """Run `ops` on paged caches and references side by side with the machine's checks (deterministic replays).

    ops: ("w", layer, s, n[, hin, h0, r]) writes, ("pin", layer, n), ("rewind", layer, pos), ("reset", layer).
    """
    cfg = dict(
        dict(B=1, H=1, D=2, dtype=torch.float32, grow=False, use_int=False, page_bytes=256, S=0, GS=0, W=None), **cfg
    )
    m = PagedCacheMachine.__new__(PagedCacheMachine)
    RuleBasedStateMachine.__init__(m)
    global NUM_LAYERS
    saved, NUM_LAYERS = NUM_LAYERS, layers
    try:
        PagedCacheMachine.setup(m, cfg)
        for seed, op in enumerate(ops):
            if op[0] == "w":
                _, i, s, n, *rest = op
                hin, h0, r = (rest + [cfg["H"], None, None][len(rest) :])[:3]
                m.call_write(i, s, n, hin, h0, r, seed)
            elif op[0] == "pin":
                m.call_simple(op[1], "pin_current_chunk", op[2])
            elif op[0] == "rewind":
                g = m.refs[op[1]].G
                if m.call_simple(op[1], "rewind_to", op[2]) and op[2] < g:
                    m.models[op[1]].rewind(op[2])
                    m.models[op[1]].prune(m.refs[op[1]])
            elif op[0] == "reset":
                m.do_reset(op[1])
            m.consistent()
        m.teardown()
    finally:
        NUM_LAYERS = saved
    return m


def test_program_basic_roll_and_rewrites():
    run_program(
        dict(C=8, S=2),
        [
            ("w", 0, 0, 4),
            ("w", 0, 0, 4),
            ("w", 0, 4, 4),
            ("w", 0, 8, 3),
            ("w", 0, 8, 3, 1, None, 0),
            ("w", 0, 5, 2),
            ("w", 0, 9, 3),
            ("w", 0, 3, 1),
            ("w", 0, 4, 8),
        ],
    )


def test_rewind_to_empty_tail_frees_dead_segment():
    # C = 4, no sink, chunks of 3: G = 9, L = 4, slots hold [5, 9). rewind_to(5) empties the cache (L = 0):
    # segment [3, 6) keeps no token in any slot and must go back to the pool (resident 0 with L = 0).
    run_program(dict(C=4), [("w", 0, 0, 3), ("w", 0, 3, 3), ("w", 0, 6, 3), ("rewind", 0, 5)])


def test_rewind_to_sink_only_then_rewrite_evicted_token():
    # GS = 1, C = 4, chunks of 3: after rewind_to(6) only the sink slot (token 0) is left; a rewrite of token 5
    # (evicted long ago) must raise SequencingError like the reference (ls = 0 would hit the sink slot).
    run_program(dict(C=4, GS=1), [("w", 0, 0, 3), ("w", 0, 3, 3), ("w", 0, 6, 3), ("rewind", 0, 6), ("w", 0, 5, 1)])


def test_rewind_negative_position_is_sequencing_error():
    # SEMANTICS.md: rewind_to is valid for pos == G, pos in the rolling tail, or pos inside the sink before a roll;
    # "otherwise SequencingError". A negative position is one of the "otherwise" cases.
    run_program(dict(C=8), [("w", 0, 0, 3), ("rewind", 0, -1)])


def test_pin_longer_than_local_end():
    # pin_current_chunk(n) with n > L: P = L - n < 0, so the cache counts as not pinned (E = max(GS, S)).
    run_program(dict(C=8, S=2, W=4), [("w", 0, 0, 3), ("pin", 0, 5), ("w", 0, 3, 3), ("w", 0, 6, 3), ("w", 0, 9, 2)])


def test_view_sink_longer_than_local_end():
    # GS > 0, W < L < E: the "ps" view branch is [0, E) + [max(E, ...), L); with E > L the dense cache returns E
    # slots, including slots [L, E) that were never written (zeros in a fresh dense cache).
    run_program(dict(C=3, S=3, GS=1, W=1), [("w", 0, 0, 1), ("w", 0, 1, 1)])


def test_program_pin_branches():
    # pp, then the pinned chunk scrolls to slot 0 and becomes the sink (hand-checked in test_dense_reference.py)
    m = run_program(
        dict(C=8, S=2, W=4),
        [
            ("w", 0, 0, 2),
            ("w", 0, 2, 2),
            ("pin", 0, 2),
            ("w", 0, 4, 2),
            ("w", 0, 6, 2),
            ("w", 0, 6, 2, 1, None, 1),
            ("w", 0, 8, 2),
            ("w", 0, 10, 2),
            ("w", 0, 10, 2, 1, None, 0),
        ],
    )
    # ps + pp with a global sink, then the pin reaches slot GS and becomes part of the sink
    m = run_program(
        dict(C=8, S=2, GS=1, W=4, H=2, B=2, dtype=torch.bfloat16),
        [
            ("w", 0, 0, 3),
            ("w", 0, 3, 2),
            ("pin", 0, 2),
            ("w", 0, 5, 2),
            ("w", 0, 7, 1),
            ("w", 0, 7, 1, 1, 1, None),
            ("w", 0, 8, 2),
            ("w", 0, 10, 2, 1, 0, 3),
            ("w", 0, 9, 3),
        ],
    )
    assert m.refs[0].E == 3


def test_program_pin_lapses_when_it_scrolls_past_slot_zero():
    # E = 0 while pinned elsewhere; chunks of 3 move P from 5 to 2 to -1: the pin lapses and E = S again
    run_program(
        dict(C=8, S=2, W=6),
        [
            ("w", 0, 0, 5),
            ("w", 0, 5, 3),
            ("pin", 0, 3),
            ("w", 0, 8, 3),
            ("w", 0, 11, 3),
            ("w", 0, 14, 3),
            ("w", 0, 14, 3, 1, None, 0),
        ],
    )


def test_program_head_slices_multi_layer():
    run_program(
        dict(C=6, S=1, H=4, D=4, B=2, dtype=torch.float16),
        [
            ("w", 0, 0, 3, 2, 2),
            ("w", 1, 0, 3),
            ("w", 0, 0, 3, 2, 0),
            ("w", 0, 3, 3, 1, 3),
            ("w", 1, 3, 4),
            ("w", 0, 6, 2, 4, 0),
            ("reset", 1),
            ("w", 1, 0, 2, 3, 1),
            ("rewind", 0, 6),
            ("w", 0, 6, 1, 1, 2),
        ],
        layers=2,
    )


def test_program_growth():
    run_program(
        dict(C=3, grow=True, S=1, use_int=True),
        [
            ("w", 0, 0, 2),
            ("w", 0, 2, 3),
            ("w", 0, 1, 5),
            ("rewind", 0, 2),
            ("w", 0, 2, 9),
            ("reset", 0),
            ("w", 0, 0, 1),
        ],
    )


def test_close_returns_pages_and_leaves_other_layers_alone():
    pool = BlockPool(capacity_bytes=64 * 256, page_bytes=256)
    kw = dict(batch_size=1, cache_size=8, num_heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu")
    a, b = PagedCausalKVCache(pool=pool, **kw), PagedCausalKVCache(pool=pool, **kw)
    ref = DenseReferenceCache(1, 8, 2, 16, dtype=torch.bfloat16)
    for s in (0, 4, 8):
        k, v = _kv(4, s)
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
        b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
        ref.update_and_get_attention_kv(k, v, s)
    held_b = pool.pages_of(b.owner) if hasattr(pool, "pages_of") else dict(pool.stats().owner_pages)[b.owner]
    a.close()
    stats = pool.stats()
    assert dict(stats.owner_pages).get(a.owner, 0) == 0 and a.resident_nbytes() == 0
    assert stats.used_pages == held_b == 4
    pool.check()
    k, v = _kv(2, 12)
    cv = b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=12)
    rv = ref.update_and_get_attention_kv(k, v, 12)
    assert torch.equal(cv.k, rv.k) and torch.equal(cv.v, rv.v)
    b.close()
    assert pool.stats().used_pages == 0
