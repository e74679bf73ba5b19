"""The bad-input catalogue: each bad call raises a typed error naming the values, and changes nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import cache_state, cursor, same

from pagedqvg import (
    BlockPool,
    CacheClosedError,
    CacheConfigError,
    PagedCausalKVCache,
    PoolExhaustedError,
    SequencingError,
    make_layer_caches,
)

B, H, D = 1, 4, 8
DT = torch.float32


def kv(n, heads=H, batch=B, dim=D, dtype=DT, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, n, heads, dim, generator=g).to(dtype),
        torch.randn(batch, n, heads, dim, generator=g).to(dtype),
    )


def make(pool=None, **kw):
    pool = pool or BlockPool(capacity_bytes=64 * 1024, page_bytes=1024)
    args = dict(
        pool=pool,
        batch_size=B,
        cache_size=12,
        num_heads=H,
        head_dim=D,
        dtype=DT,
        device="cpu",
        sink_tokens=2,
        global_sink_tokens=2,
    )
    args.update(kw)
    return PagedCausalKVCache(**args)


def rolled_cache(**kw):
    """A cache that has rolled: C=12, E=2, four chunks of 3 → G=12... then two more → G=18, L=12."""
    cache = make(**kw)
    for i in range(6):
        k, v = kv(3, seed=i)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * i)
    assert cursor(cache) == (18, 12)
    return cache


def call(cache, n=3, start=None, **kw):
    k, v = kv(n)
    args = dict(key=k, value=v, current_chunk_start=cursor(cache)[0] if start is None else start)
    args.update(kw)
    return cache.update_and_get_attention_kv(**args)


CASES = {
    # name: (setup, action, error type, substrings the message must contain)
    "wrong dtype": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(
            key=kv(3, dtype=torch.float16)[0], value=kv(3, dtype=torch.float16)[1], current_chunk_start=18
        ),
        TypeError,
        ["torch.float16", "torch.float32"],
    ),
    "key not a tensor": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(key=[1, 2], value=kv(3)[1], current_chunk_start=18),
        TypeError,
        ["key", "list"],
    ),
    "wrong device": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(
            key=kv(3)[0].to("meta"), value=kv(3)[1].to("meta"), current_chunk_start=18
        ),
        ValueError,
        ["meta", "cpu"],
    ),
    "wrong rank": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(key=kv(3)[0][0], value=kv(3)[1][0], current_chunk_start=18),
        ValueError,
        ["(3, 4, 8)", "[batch, tokens"],
    ),
    "wrong head_dim": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(key=kv(3, dim=4)[0], value=kv(3, dim=4)[1], current_chunk_start=18),
        ValueError,
        ["head_dim 4", "8"],
    ),
    "wrong batch": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(key=kv(3, batch=2)[0], value=kv(3, batch=2)[1], current_chunk_start=18),
        ValueError,
        ["batch 2", "1"],
    ),
    "key/value shape mismatch": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(key=kv(3)[0], value=kv(2)[1], current_chunk_start=18),
        ValueError,
        ["(1, 3, 4, 8)", "(1, 2, 4, 8)"],
    ),
    "heads without cache_head_start": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(key=kv(3, heads=2)[0], value=kv(3, heads=2)[1], current_chunk_start=18),
        ValueError,
        ["2 heads", "has 4", "0..2"],
    ),
    "head slice out of range": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(
            key=kv(3, heads=2)[0], value=kv(3, heads=2)[1], current_chunk_start=18, cache_head_start=3
        ),
        ValueError,
        ["[3, 5)", "0..2"],
    ),
    "negative head start": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(
            key=kv(3, heads=2)[0], value=kv(3, heads=2)[1], current_chunk_start=18, cache_head_start=-1
        ),
        ValueError,
        ["[-1, 1)"],
    ),
    "too many heads": (
        rolled_cache,
        lambda c: c.update_and_get_attention_kv(key=kv(3, heads=5)[0], value=kv(3, heads=5)[1], current_chunk_start=18),
        ValueError,
        ["5 heads", "1..4"],
    ),
    "negative start": (rolled_cache, lambda c: call(c, start=-3), ValueError, ["-3", "0..18"]),
    "float start": (rolled_cache, lambda c: call(c, start=3.0), TypeError, ["current_chunk_start", "3.0"]),
    "gap": (
        rolled_cache,
        lambda c: call(c, start=21),
        SequencingError,
        ["start=21", "global end=18", "current chunk starts at 15", "valid starts are 8..18"],
    ),
    "evicted rewrite": (
        rolled_cache,
        lambda c: call(c, start=3),
        SequencingError,
        ["start=3", "global end=18", "valid starts are 8..18"],
    ),
    "rewrite-and-extend from evicted tokens": (
        rolled_cache,
        lambda c: call(c, n=6, start=7),
        SequencingError,
        ["start=7", "valid starts are 8..18"],
    ),
    "sink rewrite after roll": (
        rolled_cache,
        lambda c: call(c, n=2, start=0),
        SequencingError,
        ["start=0", "valid starts are 8..18"],
    ),
    "chunk larger than C - E": (
        rolled_cache,
        lambda c: call(c, n=11),
        CacheConfigError,
        ["n=11", "C=12", "E=2", "at most C - E = 10"],
    ),
    "negative recent_window_tokens": (
        rolled_cache,
        lambda c: call(c, recent_window_tokens=-1),
        ValueError,
        ["recent_window_tokens=-1", ">= 0"],
    ),
    "zero-length chunk": (rolled_cache, lambda c: call(c, n=0), ValueError, ["zero-length", "0 tokens"]),
    "rewind below the floor": (
        rolled_cache,
        lambda c: c.rewind_to(5),
        SequencingError,
        ["rewind_to(5)", "reachable positions: 8..18"],
    ),
    "rewind past the end": (
        rolled_cache,
        lambda c: c.rewind_to(19),
        SequencingError,
        ["rewind_to(19)", "past the global end 18", "8..18"],
    ),
    "rewind negative": (rolled_cache, lambda c: c.rewind_to(-1), SequencingError, ["rewind_to(-1)", "8..18"]),
    "pin with a float": (rolled_cache, lambda c: c.pin_current_chunk(1.5), TypeError, ["num_tokens", "1.5"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_and_changes_nothing(name):
    setup, action, error, needles = CASES[name]
    cache = setup()
    before = cache_state(cache)
    with pytest.raises(error) as info:
        action(cache)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    same(before, cache_state(cache))
    cache.pool.check()
    call(cache, start=cursor(cache)[0] - 3)  # still usable: a rewrite of the current chunk works


def test_pool_exhausted_mid_advance_changes_nothing():
    # A token row is 4 heads x 8 x 4 B = 128 B; K and V rows of one token: 256 B; a 1 KiB page holds 4 tokens.
    pool = BlockPool(capacity_bytes=6 * 1024, page_bytes=1024)
    a = make(pool, cache_size=40)
    b = make(pool, cache_size=40)
    call(a, n=8, start=0)  # 2 pages
    call(b, n=8, start=0)  # 2 pages -> 2 left
    before_a, before_b = cache_state(a), cache_state(b)
    with pytest.raises(PoolExhaustedError) as info:
        call(a, n=12)  # 3 pages
    msg = str(info.value)
    assert "asked for 3 pages" in msg and "only 2 of 6 pages are free" in msg and "layer#" in msg
    assert "appending 12 tokens at 8" in msg
    same(before_a, cache_state(a))
    same(before_b, cache_state(b))
    pool.check()
    call(a, n=8)  # two pages still fit
    assert pool.stats().free_pages == 0


def test_closed_cache_refuses_everything_and_returned_its_pages():
    cache = rolled_cache()
    pool = cache.pool
    cache.close()
    assert pool.stats().used_pages == 0 and cache.resident_nbytes() == 0
    for action in (
        lambda c: call(c),
        lambda c: c.pin_current_chunk(3),
        lambda c: c.rewind_to(0),
        lambda c: c.reset_indices(),
    ):
        with pytest.raises(CacheClosedError, match="after close"):
            action(cache)
    cache.close()  # idempotent


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"cache_size": 0}, "cache_size must be >= 1, got 0"),
        ({"batch_size": -1}, "batch_size must be >= 1, got -1"),
        ({"num_heads": 2.0}, "num_heads must be an int"),
        ({"sink_tokens": -1}, "sink_tokens must be >= 0"),
        ({"attention_window_size": -4}, "attention_window_size must be >= 0, got -4"),
        ({"dtype": torch.int32}, "dtype must be one of"),
        ({"device": "meta"}, "differs from the pool's device cpu"),
        ({"head_dim": 1024}, "does not fit a page of 1024 B"),
        ({"global_end_index": torch.ones(1, dtype=torch.int64)}, "must start at 0"),
        ({"local_end_index": torch.zeros(2, dtype=torch.int64)}, "1-element int64 tensor"),
        ({"pool": "pool"}, "pagedqvg.BlockPool"),
    ],
)
def test_bad_configuration(kwargs, needle):
    pool = BlockPool(capacity_bytes=64 * 1024, page_bytes=1024)
    args = {"pool": pool, **kwargs}
    with pytest.raises(CacheConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        make(**args)
    assert pool.stats().used_pages == 0


def test_make_layer_caches_share_one_pool():
    pool = BlockPool(capacity_bytes=64 * 1024, page_bytes=1024)
    caches = make_layer_caches(
        3, pool=pool, batch_size=1, cache_size=8, num_heads=H, head_dim=D, dtype=DT, device="cpu"
    )
    assert len({c.owner for c in caches}) == 3
    for c in caches:
        call(c, n=4, start=0)
    assert dict(pool.stats().owner_pages) == {c.owner: 1 for c in caches}  # 4 tokens x 2 rows x 128 B = 1 page
    with pytest.raises(CacheConfigError, match="num_layers"):
        make_layer_caches(0, pool=pool)
    with pytest.raises(CacheConfigError, match="shared by every layer"):
        make_layer_caches(2, pool=pool, global_end_index=torch.zeros(1, dtype=torch.int64))


def test_inputs_that_require_grad_are_copied_without_autograd():
    cache = rolled_cache()
    k = torch.randn(1, 3, H, D, requires_grad=True) * 1.0  # a non-leaf with grad history
    view = cache.update_and_get_attention_kv(key=k, value=k.detach(), current_chunk_start=18)
    assert not view.k.requires_grad and torch.equal(view.k[:, -3:], k.detach())
    other = make(cache.pool)  # the pool's shared views carry no autograd history
    call(other, start=0)


def test_sparse_input_is_refused_before_anything_changes():
    cache = rolled_cache()
    before = cache_state(cache)
    k, v = kv(3)
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo"):
        cache.update_and_get_attention_kv(key=k.to_sparse(), value=v, current_chunk_start=18)
    same(before, cache_state(cache))


def test_one_tensor_for_both_cursors_is_refused():
    cursor = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(CacheConfigError, match="two different tensors"):
        make(global_end_index=cursor, local_end_index=cursor)


def test_a_collected_cache_gives_its_pages_back():
    import gc

    pool = BlockPool(capacity_bytes=64 * 1024, page_bytes=1024)
    cache = make(pool)
    call(cache, start=0)
    assert pool.stats().used_pages > 0
    del cache
    gc.collect()
    assert pool.stats().used_pages == 0
    pool.check()
