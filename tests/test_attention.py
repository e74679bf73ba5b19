"""`PagedCausalKVCache.update_and_attend`: the same writes as `update_and_get_attention_kv` (twin caches end in the same
state), attention over exactly the view's rows within the proven fp32 bound of fp64 attention over the materialized
view (tests/float_bounds.py; every dtype, quant off and on, head slices, recent window, pinned sink, zero rows,
adversarial scores, one key, long windows in many tiles), typed errors that change nothing, and transient bytes
independent of the window (counted exactly) and within `attention_scratch_bytes`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float_bounds import assert_attention_within_bound
from helpers import cache_state, page_io, same
from memory_count import AllocatedBytes

import pagedqvg.attention.pages as attention
from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.attention.pages import (
    attention_scratch_bytes,
    attention_tiles,
    packed_decode_bytes,
)
from pagedqvg.quant import PackedFormat

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTS = {
    "off": None,
    "int2": QuantConfig(bits=2, centroids=16, block_size=16),
    "int4-asym": QuantConfig(bits=4, centroids=16, block_size=16, asymmetric=True),
    "compact": QuantConfig.compact(centroids=16),
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 16 key rows and 8 query rows, so every view spans many tiles and tiles split runs; one torch thread
    (many tiny matmuls: a shared CPU's thread pool would dominate their time)."""
    monkeypatch.setattr(attention, "ATTN_TILE_TOKENS", 16)
    monkeypatch.setattr(attention, "ATTN_QUERY_TILE", 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def twins(quant, dtype, *, B=2, H=4, D=32, chunk=24, chunks=5, sink=None, window=None):
    """Two identical caches (own pools): one answers views (the reference), the other update_and_attend."""
    if quant is not None and quant.block_size > D:
        D = quant.block_size
    out = []
    for _ in ("view", "attend"):
        pool = BlockPool(capacity_bytes=16 << 20, page_bytes=16384)
        out.append(PagedCausalKVCache(pool=pool, batch_size=B, cache_size=chunk * chunks, num_heads=H, head_dim=D,
                                      dtype=dtype, device="cpu", sink_tokens=chunk if sink is None else sink,
                                      global_sink_tokens=chunk if sink is None else sink, attention_window_size=window,
                                      quant=quant, name="c"))  # fmt: skip
    return out


def sdpa(q, k, v, scale=None):
    """SDPA of `[B, T, H, D]` tensors, returned as `[B, Tq, H, D]`."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


def call_both(a, b, q, k, v, start, scale=None, **kw):
    """One call on both twins; asserts the error bound; returns (our error, SDPA's error)."""
    view = a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start, **kw)
    out = b.update_and_attend(q, key=k, value=v, current_chunk_start=start, softmax_scale=scale, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    ref = sdpa(q.double(), view.k.double(), view.v.double(), scale)
    e_sdpa = (sdpa(q, view.k, view.v, scale).double() - ref).norm().item()
    e_ours = (out.double() - ref).norm().item()
    assert torch.isfinite(out).all()
    # the proven fp32 bound (tests/float_bounds.py), not a ratio to SDPA's error on this CPU; an explicit scale is
    # the adversarial-scores test (|scores| ~ 1e4), where the bound is ~10% of |v| (not_vacuous=False)
    assert_attention_within_bound(out, q, view.k, view.v, scale, exact=ref, not_vacuous=scale is None)
    return e_ours, e_sdpa


def data(gen, B, n, H, D, dtype, sigma=1.0):
    return (torch.randn(B, n, H, D, generator=gen) * sigma).to(dtype)


@pytest.mark.parametrize("quant", list(QUANTS), ids=list(QUANTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_view_sdpa(quant, dtype):
    """Advances (the window rolls, chunks get packed), each followed by two rewrites (the repeated-call fast path);
    a head slice, a recent window and a pin on the way. Twins end in the same state (same writes)."""
    a, b = twins(QUANTS[quant], dtype)
    B, H, D = a.batch_size, a.num_cache_heads, a.head_dim
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        start = step * 24
        k, v, q = (data(gen, B, 24, H, D, dtype) for _ in range(3))
        call_both(a, b, q, k, v, start)
        for _ in range(2):
            call_both(a, b, data(gen, B, 7, H, D, dtype), k, v, start, recent_window_tokens=30)
        h = 2
        kh, vh, qh = (data(gen, B, 24, h, D, dtype) for _ in range(3))
        call_both(a, b, qh, kh, vh, start, cache_head_start=1)
        if step == 3:
            a.pin_current_chunk(24)
            b.pin_current_chunk(24)
    same_writes(a, b, k, v, start)


def same_writes(a, b, k, v, start):
    """The twins hold the same rows: equal state (cursors, slots, segments, pool accounting) and bit-equal views."""
    same(cache_state(a)[:-1], cache_state(b)[:-1])  # the arenas differ in bytes no segment uses (view buffers)
    va = a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
    vb = b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
    assert torch.equal(va.k, vb.k) and torch.equal(va.v, vb.v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_rows_count_as_score_zero_keys(dtype):
    """A sink longer than the slots filled: the view has zero rows (keys of score 0, value 0)."""
    a, b = twins(None, dtype, B=1, H=2, D=8, chunk=3, chunks=16 // 3, sink=12, window=8)
    gen = torch.Generator().manual_seed(2)
    zeros_seen = 0
    for step in range(5):
        k, v, q = (data(gen, 1, 3, 2, 8, dtype) for _ in range(3))
        call_both(a, b, q, k, v, 3 * step)
        zeros_seen += sum(1 for *_, kind in a.last_view_sources() if kind == "zeros")
    assert zeros_seen > 0


@pytest.mark.parametrize("quant", ["off", "int2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adversarial_scores(quant, dtype):
    """Scores of about +-1e4 (one key dominates each row), and an explicit scale."""
    a, b = twins(QUANTS[quant], dtype, B=1, H=2)
    D = a.head_dim
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        k, v = data(gen, 1, 24, 2, D, dtype, 30.0), data(gen, 1, 24, 2, D, dtype)
        q = data(gen, 1, 5, 2, D, dtype, 30.0)
        call_both(a, b, q, k, v, 24 * step, scale=12.0 / D**0.5)  # q·k·scale ~ N(0, (30·30·12)^2): ~ +-1e4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_key_and_constant_rows(dtype):
    """A one-token first chunk (one key: the output is v exactly) and all-zero keys (uniform weights)."""
    a, b = twins(None, dtype, B=1, H=2, D=16)
    gen = torch.Generator().manual_seed(4)
    k1, v = data(gen, 1, 1, 2, 16, dtype), data(gen, 1, 1, 2, 16, dtype)
    out = b.update_and_attend(data(gen, 1, 3, 2, 16, dtype), key=k1, value=v, current_chunk_start=0)
    a.update_and_get_attention_kv(key=k1, value=v, current_chunk_start=0)
    assert torch.equal(out, v.expand(1, 3, 2, 16))
    k0 = torch.zeros(1, 23, 2, 16, dtype=dtype)
    call_both(a, b, data(gen, 1, 4, 2, 16, dtype), k0, data(gen, 1, 23, 2, 16, dtype), 1)


def test_long_window_default_tiles(monkeypatch):
    """A window of 3,000 tokens in the default tiles (512 key rows), int2 and off."""
    monkeypatch.setattr(attention, "ATTN_TILE_TOKENS", 512)  # the default
    for quant in ("off", "int2"):
        a, b = twins(QUANTS[quant], torch.bfloat16, B=1, H=2, chunk=600, chunks=5)
        gen = torch.Generator().manual_seed(5)
        for step in range(6):
            k, v, q = (data(gen, 1, 600, 2, a.head_dim, torch.bfloat16) for _ in range(3))
            call_both(a, b, q[:, :50], k, v, 600 * step)


def test_tiles_of_one_source_and_zero_count():
    """Tiles never exceed the tile size, each holds dense runs only or one packed segment's runs, and the rows of
    all tiles plus the zero rows are the view's rows."""
    a, b = twins(QUANTS["int2"], torch.bfloat16, B=1, H=2)
    gen = torch.Generator().manual_seed(6)
    for step in range(6):
        k = data(gen, 1, 24, 2, a.head_dim, torch.bfloat16)
        b.update_and_attend(k, key=k, value=k, current_chunk_start=24 * step)
        view = a.update_and_get_attention_kv(key=k, value=k, current_chunk_start=24 * step)
    b.update_and_attend(k, key=k, value=k, current_chunk_start=24 * 5)  # a rewrite: its plans are remembered
    plan = page_io(b).cached(("call", 24 * 5, 24, 0, 2, None)).view_plan
    assert plan.runs is not None  # packed segments in the view: a run table
    cut = attention_tiles(page_io(b), plan, 16)
    assert attention_tiles(page_io(b), plan, 16) is cut  # cached
    assert sum(t.tokens for t in cut.tiles) + cut.zero_rows == view.k.shape[1] == plan.tokens
    for t in cut.tiles:
        assert 1 <= t.tokens <= 16
        kinds = {(int(r[0]), int(r[5]) if int(r[0]) == 1 else -1) for r in t.runs}
        assert len(kinds) == 1 or all(x[0] == 0 for x in kinds)


# ------------------------------------------------------------------------------------------------ errors
def _bad_queries(q):
    return [
        ("not a tensor", q.tolist(), TypeError),
        ("3-d", q[0], ValueError),
        ("dtype", q.float(), TypeError),
        ("device", q.to("meta"), ValueError),
        ("batch", torch.cat([q, q]), ValueError),
        ("heads", q[:, :, :1], ValueError),
        ("head_dim", q[..., :8], ValueError),
        ("no tokens", q[:, :0], ValueError),
    ]


def test_bad_query_or_scale_changes_nothing():
    _, b = twins(QUANTS["int2"], torch.bfloat16, B=1, H=2)
    D = b.head_dim
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        k = data(gen, 1, 24, 2, D, torch.bfloat16)
        b.update_and_attend(k, key=k, value=k, current_chunk_start=24 * step)
    k = data(gen, 1, 24, 2, D, torch.bfloat16)
    cases = [*_bad_queries(k), ("scale str", "x", TypeError), ("scale bool", True, TypeError),
             ("scale nan", float("nan"), ValueError), ("scale inf", float("inf"), ValueError)]  # fmt: skip
    for label, bad, exc in cases:
        for start in (24 * 3, 24 * 4):  # a rewrite and an advance
            before = cache_state(b)
            q, scale = (k, bad) if label.startswith("scale") else (bad, None)
            with pytest.raises(exc) as info:
                b.update_and_attend(q, key=k, value=k, current_chunk_start=start, softmax_scale=scale, debug_name="L7")
            assert "L7" in str(info.value), label
            same(before, cache_state(b))
    before = cache_state(b)
    with pytest.raises(ValueError):  # a bad key: the same error as update_and_get_attention_kv
        b.update_and_attend(k, key=k[:, :, :1], value=k, current_chunk_start=24 * 4)
    same(before, cache_state(b))


# ------------------------------------------------------------------------------------------------ memory
def _peak(quant, chunks, chunk=64, H=4, D=128, tq=40):
    """Peak and remaining counted bytes of a repeated update_and_attend call (plans cached) at a window of
    `chunks` chunks (after the window filled)."""
    pool = BlockPool(capacity_bytes=32 << 20, page_bytes=16384)
    c = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=chunk * chunks, num_heads=H, head_dim=D,
                           dtype=torch.bfloat16, device="cpu", quant=quant, sink_tokens=chunk,
                           global_sink_tokens=chunk)  # fmt: skip
    gen = torch.Generator().manual_seed(8)
    for s in range(chunks + 2):
        k, q = data(gen, 1, chunk, H, D, torch.bfloat16), data(gen, 1, tq, H, D, torch.bfloat16)
        c.update_and_attend(q, key=k, value=k, current_chunk_start=s * chunk)
    c.update_and_attend(q, key=k, value=k, current_chunk_start=s * chunk)  # cached
    with AllocatedBytes() as m:
        out = c.update_and_attend(q, key=k, value=k, current_chunk_start=s * chunk)
    assert m.live == out.numel() * out.element_size()  # only the output stays
    return m.peak


@pytest.mark.parametrize("quant", ["off", "int2", "compact"])
def test_transient_bytes_independent_of_window(quant):
    """Exact: the same peak of counted bytes at windows of 3, 6 and 12 chunks (192 .. 768 tokens, 12 .. 48 tiles),
    within attention_scratch_bytes (+ packed_decode_bytes when packed)."""
    peaks = [_peak(QUANTS[quant], n) for n in (3, 6, 12)]
    assert peaks[0] == peaks[1] == peaks[2]
    if quant == "off":  # exact: the bf16 tile and its fp32 copy, the fp32 output and log-sum-exp of the 40 query
        # rows, the result, and the last query block's fp32 copy (8 rows) still held when the result is made
        B, t, h, D, Tq, qt = 1, 16, 4, 128, 40, 8
        tiles = 2 * B * t * h * D * (2 + 4)
        assert peaks[0] == tiles + B * h * Tq * (D + 1) * 4 + B * Tq * h * D * 2 + B * h * qt * D * 4 == 238208
    bound = attention_scratch_bytes(1, 40, 4, 128, torch.bfloat16, tile_tokens=16, query_tile=8)
    if QUANTS[quant] is not None:
        fmt = PackedFormat(head_dim=128, num_heads=4, cfg=QUANTS[quant], dtype=torch.bfloat16)
        bound += packed_decode_bytes(1, 4, 128, 16, fmt)
    assert peaks[0] <= bound


@pytest.mark.parametrize("quant", ["off", "int2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_path_without_flash_kernel(monkeypatch, quant, dtype):
    """The fp32-matmul tile attention (other devices, or torch builds without aten's CPU flash kernel): the same
    bound on the same calls, and on adversarial scores."""
    monkeypatch.setattr(attention, "_flash_cpu", lambda: None)
    test_matches_view_sdpa(quant, dtype)
    test_adversarial_scores(quant, dtype)


# ------------------------------------------------------------------------------------------------ key-noise correction
def test_key_noise_correction_was_removed():
    """The key-noise score correction was measured not to help: `key_noise_correction=` (any value) is a TypeError
    naming the docs section with the measurement, before anything changes; another unknown keyword is a TypeError
    naming it."""
    _, b = twins(QUANTS["int2"], torch.bfloat16, B=1, H=2)
    k = data(torch.Generator().manual_seed(10), 1, 24, 2, b.head_dim, torch.bfloat16)
    before = cache_state(b)
    for flag in (True, False, 1):
        with pytest.raises(TypeError, match=r"docs/NUMBERS\.md#key-noise-correction"):
            b.update_and_attend(k, key=k, value=k, current_chunk_start=0, key_noise_correction=flag)
        same(before, cache_state(b))
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['bogus'\\]"):
        b.update_and_attend(k, key=k, value=k, current_chunk_start=0, bogus=1)
    same(before, cache_state(b))
    out = b.update_and_attend(k, key=k, value=k, current_chunk_start=0)  # the call itself still works
    assert out.shape == k.shape and b.retained_token_ranges() == [(0, 24)]
