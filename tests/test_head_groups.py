"""Attention mode `heads` (`PagedCausalKVCache.update_and_attend_heads`): the view of one group of heads at a time in
one reused buffer, the attention called per group. Output `torch.equal` to `view` mode's (the whole view through
`update_and_get_attention_kv`, then the same attention on it) for every quantization (off, int2, compact, tiers),
dtype, head slice and group size, with the reused buffer poisoned (NaN) after every group; repeated calls derive
no plan, read nothing back and allocate only the group buffer and the result; bad calls change nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import cache_state, cached_plans, free_page_ids, page_io, same
from test_repeated_call import NewStorageCounter, no_host_reads

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.attention.head_groups import GroupPlans
from pagedqvg.layout.head_groups import choose_head_group
from pagedqvg.planning.synthetic import video_kv

SDPA = torch.nn.functional.scaled_dot_product_attention
B, H, D, CHUNK = 2, 6, 8, 16

QUANTS = {
    "off": None,
    "int2": QuantConfig(bits=2, centroids=16, block_size=8, keep_recent_chunks=1),
    "compact": QuantConfig.compact(centroids=16, block_size=D),
    "tiers": QuantConfig.compact(
        centroids=16, block_size=D, sink_format="int4", recent_format="int4", keep_recent_chunks=1
    ),
}


def make_cache(quant: str, dtype: torch.dtype = torch.bfloat16, reuse: bool = False, chunks: int = 5):
    """A cache (sink of one chunk, window of 4 chunks: it rolls) after `chunks` chunks; its K/V and queries."""
    pool = BlockPool(capacity_bytes=8 << 20, page_bytes=2048)
    cache = PagedCausalKVCache(
        pool=pool, batch_size=B, cache_size=4 * CHUNK, num_heads=H, head_dim=D, dtype=dtype, device="cpu",
        sink_tokens=CHUNK, quant=QUANTS[quant], reuse_view_buffer=reuse,
    )  # fmt: skip
    k, v = video_kv(chunks + 2, CHUNK, H, D, seed=11, batch=B)
    q, _ = video_kv(chunks + 2, CHUNK, H, D, seed=12, batch=B)
    k, v, q = k.to(dtype), v.to(dtype), q.to(dtype)
    for c in range(chunks):
        call(cache, "view", k, v, q, c * CHUNK)
    return cache, k, v, q


def call(cache, mode, k, v, q, s, heads=None, **kw):
    """One call at chunk start `s` of heads `heads` (`(h0, hin)`; None: all) in `mode` ("view": the view and
    SDPA on it, "heads": `update_and_attend_heads`); returns the attention `[B, n, hin, D]`."""
    h0, hin = heads if heads is not None else (0, H)
    sl = (slice(None), slice(s, s + CHUNK), slice(h0, h0 + hin))
    args = dict(key=k[sl], value=v[sl], current_chunk_start=s)
    if heads is not None:
        args["cache_head_start"] = h0
    if mode == "heads":
        return cache.update_and_attend_heads(q[sl], **args, **kw)
    view = cache.update_and_get_attention_kv(**args)
    attention = kw.get("attention") or SDPA
    return attention(q[sl].transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2)).transpose(1, 2)


def poisoning(attention=SDPA, calls: list | None = None):
    """`attention`, then NaN written over the whole storage of its K (the reused group buffer), as the next group
    would find it if a build missed rows."""

    def attend(q, k, v):
        out = attention(q, k, v)
        torch.empty(0, dtype=k.dtype).set_(k.untyped_storage()).fill_(float("nan"))
        if calls is not None:
            calls.append(q.shape[1])
        return out

    return attend


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_heads_equal_view_mode_bit_for_bit(quant, dtype):
    cache, k, v, q = make_cache(quant, dtype)
    s = 5 * CHUNK
    sources = {kind for *_, kind in cache.last_view_sources()}
    if quant != "off":
        assert "packed" in sources, sources
    for step, group in enumerate((1, 4, H, None)):  # an advance first, then in-place rewrites (denoise steps)
        calls: list[int] = []
        got = call(cache, "heads", k, v, q, s, head_group_size=group, attention=poisoning(calls=calls))
        want = call(cache, "view", k, v, q, s)
        assert torch.equal(got, want), (quant, dtype, group, step)
        g = group or choose_head_group(B, CHUNK, H, D, dtype, 4 * CHUNK).group
        assert calls == [min(g, H - a) for a in range(0, H, g)], calls  # every head once, in groups of g
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("quant", ["off", "compact", "tiers"])
@pytest.mark.parametrize("heads", [(1, 4), (3, 3), (5, 1)])
def test_head_slices_equal_view_mode(quant, heads):
    cache, k, v, q = make_cache(quant)
    s = 4 * CHUNK  # rewrite the newest chunk in place, heads sliced (a Ulysses rank's heads)
    for group in sorted({1, min(2, heads[1]), heads[1]}):
        got = call(cache, "heads", k, v, q, s, heads, head_group_size=group, attention=poisoning())
        want = call(cache, "view", k, v, q, s, heads)
        assert torch.equal(got, want), (heads, group)


def test_scale_and_custom_attention_as_view_mode():
    cache, k, v, q = make_cache("off", torch.float32)
    s = 4 * CHUNK
    got = call(cache, "heads", k, v, q, s, head_group_size=4, scale=0.3)
    want = call(cache, "view", k, v, q, s, attention=lambda q_, k_, v_: SDPA(q_, k_, v_, scale=0.3))
    assert torch.equal(got, want)
    assert not torch.equal(got, call(cache, "view", k, v, q, s))  # the scale was used

    def math_attention(q_, k_, v_):  # not SDPA: an explicit softmax, per head
        return torch.softmax(q_ @ k_.transpose(-1, -2) * D**-0.5, -1) @ v_

    got = call(cache, "heads", k, v, q, s, head_group_size=5, attention=poisoning(math_attention))
    assert torch.equal(got, call(cache, "view", k, v, q, s, attention=math_attention))


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("quant", ["off", "int2", "compact"])
def test_repeated_call_derives_nothing_reads_nothing_and_allocates_buffer_and_result(
    production, monkeypatch, quant, reuse
):
    """Groups of one head (6 groups): the group plans are one plan-cache entry,
    reused; a repeated call reads nothing back to the host, and the cache itself allocates the group buffer and the
    result only (the attention's own allocations are its output per group, as in `view` mode once). (Tiered views
    are left out: their second packed format's decode, `tier_stores`, allocates temporaries in `view` mode too.)"""
    cache, k, v, q = make_cache(quant, reuse=reuse)
    s = 4 * CHUNK
    first = call(cache, "heads", k, v, q, s, head_group_size=1)
    entries = [p for p in cached_plans(page_io(cache)).values() if isinstance(p, GroupPlans)]
    assert len(entries) == 1 and len(entries[0].plans) == H
    counter = NewStorageCounter()
    paused: list[list[str]] = []

    def attention(q_, k_, v_):  # the attention's own allocations are set aside
        before = list(counter.ops)
        out = SDPA(q_, k_, v_)
        paused.append(counter.ops[len(before) :])
        del counter.ops[len(before) :]
        return out

    for _ in range(2):
        paused.clear()
        with counter:
            got = call(cache, "heads", k, v, q, s, head_group_size=1, attention=attention)
        assert counter.ops == ["aten.empty.memory_format"] * (1 if reuse else 2), counter.ops
        assert len(paused) == H and all(ops for ops in paused)  # SDPA's output per group: set aside above
        counter.ops.clear()
    assert torch.equal(got, first)
    assert [p for p in cached_plans(page_io(cache)).values() if isinstance(p, GroupPlans)] == entries  # the same entry
    calls = no_host_reads(monkeypatch)
    again = call(cache, "heads", k, v, q, s, head_group_size=1)
    monkeypatch.undo()
    assert calls == [], calls
    assert torch.equal(again, first)
    with NewStorageCounter() as view_counter:  # view mode's own: its view (none with reuse_view_buffer)
        cache.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    assert view_counter.ops == ([] if reuse else ["aten.empty.memory_format"])


def state(cache) -> tuple:
    """`helpers.cache_state` with the arena's bytes of pages in use only (a rolled-back advance may leave bytes in
    a page it took and gave back: free pages hold nothing anyone reads)."""
    *rest, arena = cache_state(cache)
    pool = cache.pool
    used = sorted(set(range(pool.num_pages)) - set(free_page_ids(pool)))
    return (*rest, used, arena.view(pool.num_pages, -1)[used].clone())


def _bad_calls(k, v, q, s):
    sl = (slice(None), slice(s, s + CHUNK))
    base = dict(key=k[sl], value=v[sl], current_chunk_start=s)
    return [
        (dict(base, head_group_size=0), ValueError, r"head_group_size=0; valid: 1\.\.6"),
        (dict(base, head_group_size=H + 1), ValueError, r"head_group_size=7; valid: 1\.\.6"),
        (dict(base, head_group_size=2.0), TypeError, "head_group_size must be an int or None, got float"),
        (dict(base, head_group_size=True), TypeError, "head_group_size must be an int or None, got bool"),
        (dict(base, attention=3), TypeError, "attention must be a callable"),
        (dict(base, attention=SDPA, scale=0.5), ValueError, "scale=0.5 applies to the default attention only"),
        (dict(base, scale=float("nan")), ValueError, "softmax_scale=nan is not finite"),
        (dict(base, attention=lambda q_, k_, v_: q_[:, :, :1]), ValueError,
         r"the attention function returned \(2, 2, 1, 8\) for heads \[0, 2\); valid: a tensor of shape"),
        (dict(base, attention=lambda q_, k_, v_: 1 / 0), ZeroDivisionError, "division by zero"),
    ]  # fmt: skip


@pytest.mark.parametrize("s", [4 * CHUNK, 5 * CHUNK], ids=["rewrite", "advance"])
@pytest.mark.parametrize("quant", ["off", "compact"])
def test_bad_calls_change_nothing(quant, s):
    """Bad arguments fail before anything changes; an attention that fails or returns the wrong shape (after the
    write) rolls an advance back whole (the transaction rule of `update_and_attend`)."""
    cache, k, v, q = make_cache(quant)
    for kw, error, match in _bad_calls(k, v, q, s):
        before = state(cache)
        with pytest.raises(error, match=match):
            cache.update_and_attend_heads(q[:, s : s + CHUNK], head_group_size=kw.pop("head_group_size", 2), **kw)
        same(before, state(cache))
    got = call(cache, "heads", k, v, q, s, head_group_size=2)  # the cache still works, as view mode
    assert torch.equal(got, call(cache, "view", k, v, q, s))


def test_query_must_match_key():
    cache, k, v, q = make_cache("off")
    s = 5 * CHUNK
    before = cache_state(cache)
    with pytest.raises(ValueError, match=r"query shape \(2, 16, 3, 8\) does not match key"):
        cache.update_and_attend_heads(q[:, s : s + CHUNK, :3], key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK],
                                      current_chunk_start=s)  # fmt: skip
    same(before, cache_state(cache))


def test_closed_cache_raises():
    cache, k, v, q = make_cache("off", chunks=1)
    cache.close()
    from pagedqvg.errors import CacheClosedError

    with pytest.raises(CacheClosedError, match="update_and_attend_heads after close"):
        call(cache, "heads", k, v, q, 0)


def test_group_plans_are_one_entry_whatever_the_group_count():
    """12 heads in groups of 1 (12 group plans) keep one plan-cache entry: view and write plans stay cached."""
    pool = BlockPool(capacity_bytes=8 << 20, page_bytes=2048)
    cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=32, num_heads=12, head_dim=8,
                               dtype=torch.bfloat16, device="cpu")  # fmt: skip
    k, v = video_kv(2, 16, 12, 8, seed=1, batch=1)
    k, v = k.bfloat16(), v.bfloat16()
    args = dict(key=k[:, :16], value=v[:, :16], current_chunk_start=0)
    cache.update_and_attend_heads(k[:, :16], **args, head_group_size=1)
    plans = dict(cached_plans(page_io(cache)))
    assert sum(isinstance(p, GroupPlans) for p in plans.values()) == 1
    cache.update_and_attend_heads(k[:, :16], **args, head_group_size=1)
    assert all(cached_plans(page_io(cache))[key] is p for key, p in plans.items())  # nothing rebuilt, nothing evicted
    assert dataclasses.is_dataclass(next(p for p in plans.values() if isinstance(p, GroupPlans)))
