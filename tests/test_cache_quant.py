"""Quantization on: same slots as quant off, bf16 tokens bit-identical, packed tokens within the measured error,
exact page accounting, rewrites of packed ranges, pinned sink, rewind across packed segments, memory pressure."""

from __future__ import annotations

import pytest
import torch
from helpers import cursor, segment_at, segment_kind, sink_segment_starts

from pagedqvg import BlockPool, CacheConfigError, PagedCausalKVCache, PoolExhaustedError, QuantConfig
from pagedqvg.allocator.pool import debug_state
from pagedqvg.planning.synthetic import video_kv

H, D, TPF = 2, 32, 16
CHUNK = 3 * TPF
Q2 = QuantConfig(bits=2, centroids=16, block_size=16)
Q4 = QuantConfig(bits=4, centroids=16, block_size=16, asymmetric=True)


def caches(quant, *, page_bytes=4096, capacity=8 << 20, **kw):
    pool = BlockPool(capacity_bytes=capacity, page_bytes=page_bytes)
    args = dict(
        pool=pool,
        batch_size=1,
        cache_size=TPF * 12,
        num_heads=H,
        head_dim=D,
        dtype=torch.bfloat16,
        device="cpu",
        sink_tokens=CHUNK,
        global_sink_tokens=CHUNK,
    )
    args.update(kw)
    return pool, PagedCausalKVCache(name="plain", **args), PagedCausalKVCache(name="packed", quant=quant, **args)


def compare(plain_view, packed_view, packed_cache, max_rel):
    """Same fields; dense rows identical; packed rows within `max_rel` relative error."""
    for f in ("local_start_index", "local_end_index", "visible_local_end", "visible_global_end"):
        assert getattr(plain_view, f) == getattr(packed_view, f)
    assert plain_view.k.shape == packed_view.k.shape
    o = 0
    packed_rows = 0
    for g0, g1, kind in packed_cache.last_view_sources():
        m = g1 - g0
        for a, b in ((plain_view.k, packed_view.k), (plain_view.v, packed_view.v)):
            x, y = a[:, o : o + m], b[:, o : o + m]
            if kind == "dense":
                assert torch.equal(x, y)
            else:
                rel = ((x.float() - y.float()).norm() / x.float().norm().clamp_min(1e-12)).item()
                assert rel < max_rel, (g0, g1, rel)
                assert torch.isfinite(y).all()
        packed_rows += m if kind == "packed" else 0
        o += m
    assert o == plain_view.k.shape[1]
    return packed_rows


def accounting(pool, cache):
    pool.check()
    mb = cache.memory_breakdown()
    assert mb["dense_pages"] + mb["packed_pages"] == pool.pages_of(cache.owner)
    assert cache.resident_nbytes() == pool.pages_of(cache.owner) * pool.page_bytes
    assert mb["dense_tokens"] + mb["packed_tokens"] == cursor(cache)[1]
    return mb


@pytest.mark.parametrize(("quant", "max_rel"), [(Q2, 0.35), (Q4, 0.08)])
def test_lingbot_pattern_quant_on_matches_quant_off_slots(quant, max_rel):
    k, v = video_kv(48, TPF, H, D, seed=3)
    pool, plain, packed = caches(quant)
    total_packed = 0
    for c in range(14):
        s = c * CHUNK
        for step in range(3):
            kk, vv = k[:, s : s + CHUNK] + step, v[:, s : s + CHUNK] - step  # each denoise step writes new values
            a = plain.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            b = packed.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            total_packed += compare(a, b, packed, max_rel)
        for r in (0, TPF):
            a = plain.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s, recent_window_tokens=r)
            b = packed.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s, recent_window_tokens=r)
            compare(a, b, packed, max_rel)
        mb = accounting(pool, packed)
        if c >= 2:
            assert mb["packed_tokens"] > 0
    assert total_packed > 0
    # Policy: the sink chunk and every completed chunk but the newest one are packed; the current chunk is dense.
    kinds = [(s, e, kind) for s, e, kind in packed.last_view_sources()]
    assert kinds[0][2] == "packed" and kinds[-1][2] == "dense"


def test_lingbot_pattern_with_compact_config():
    """The call pattern above with the compact mode; head_dim 32 there, so blocks of 32 (one fitted scale per
    token-head)."""
    q = QuantConfig.compact(centroids=16, block_size=32)
    assert q.mode == "compact"
    test_lingbot_pattern_quant_on_matches_quant_off_slots(q, 0.35)


def test_keep_recent_and_sink_keep_policy():
    k, v = video_kv(40, TPF, H, D, seed=4)
    quant = QuantConfig(bits=2, centroids=16, block_size=16, keep_recent_chunks=2, sink=True, sink_keep_chunks=1)
    _pool, _, packed = caches(quant, cache_size=TPF * 24)
    for c in range(6):
        s = c * CHUNK
        packed.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    kinds = {start: segment_kind(packed, start) for start, _, _ in packed.segments()}
    # chunk 0 is the sink chunk (kept: sink_keep_chunks=1); chunks 1..2 packed; 3, 4 are the 2 recent; 5 current.
    assert kinds == {0: "dense", 48: "packed", 96: "packed", 144: "dense", 192: "dense", 240: "dense"}
    quant_nosink = QuantConfig(bits=2, centroids=16, block_size=16, keep_recent_chunks=0, sink=False)
    _pool, _, packed = caches(quant_nosink, cache_size=TPF * 24)
    for c in range(3):
        s = c * CHUNK
        packed.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    kinds = [segment_kind(packed, start) for start, _, _ in packed.segments()]
    assert kinds == ["dense", "packed", "dense"]


def test_rewrite_of_packed_range_unpacks_then_repacks():
    k, v = video_kv(30, TPF, H, D, seed=5)
    pool, plain, packed = caches(Q2, cache_size=TPF * 24)
    for c in range(4):
        s = c * CHUNK
        for cache in (plain, packed):
            cache.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    assert segment_kind(packed, CHUNK) == "packed"
    new_k, new_v = k[:, CHUNK : 2 * CHUNK] * 2, v[:, CHUNK : 2 * CHUNK] * 2
    a = plain.update_and_get_attention_kv(key=new_k, value=new_v, current_chunk_start=CHUNK)
    b = packed.update_and_get_attention_kv(key=new_k, value=new_v, current_chunk_start=CHUNK)
    assert segment_kind(packed, CHUNK) == "dense"
    compare(a, b, packed, 0.35)
    accounting(pool, packed)
    s = 4 * CHUNK
    for cache in (plain, packed):
        cache.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    assert segment_kind(packed, CHUNK) == "packed"  # the policy packed it again
    accounting(pool, packed)


def test_pinned_sink_follows_sink_policy_and_rolls_with_quant():
    k, v = video_kv(60, TPF, H, D, seed=6)
    for sink_flag in (True, False):
        quant = QuantConfig(bits=2, centroids=16, block_size=16, sink=sink_flag)
        # GS=0, S=CHUNK: a pin of the chunk at slot 0 (P == GS) makes the pinned chunk the protected sink.
        pool, plain, packed = caches(quant, global_sink_tokens=0)
        for c in range(12):
            s = c * CHUNK
            kk, vv = k[:, s : s + CHUNK], v[:, s : s + CHUNK]
            for cache in (plain, packed):
                cache.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            if c in (0, 7):
                for cache in (plain, packed):
                    cache.pin_current_chunk(CHUNK)
            a = plain.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            b = packed.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            compare(a, b, packed, 0.35)
            accounting(pool, packed)
        pinned_starts = sink_segment_starts(packed)
        assert pinned_starts
        for start in pinned_starts:
            assert segment_kind(packed, start) == ("packed" if sink_flag else "dense")


def test_rewind_across_packed_segments_keeps_codebooks():
    k, v = video_kv(40, TPF, H, D, seed=7)
    pool, plain, packed = caches(Q2, cache_size=TPF * 30, page_bytes=1024)
    for c in range(6):
        s = c * CHUNK
        for cache in (plain, packed):
            cache.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    seg = segment_at(packed, 2 * CHUNK).value
    assert seg.kind == "packed"
    cb_pages = seg.pages[seg.n_token_pages :]
    before_tok = seg.n_token_pages
    pos = 2 * CHUNK + 5
    for cache in (plain, packed):
        cache.rewind_to(pos)
    seg = segment_at(packed, 2 * CHUNK).value
    assert seg.kind == "packed" and seg.pages[seg.n_token_pages :] == cb_pages and seg.n_token_pages < before_tok
    assert [s for s, _, _ in packed.segments()] == [0, CHUNK, 2 * CHUNK]
    accounting(pool, packed)
    for c in range(3):
        s = pos + c * CHUNK
        kk, vv = k[:, s : s + CHUNK], v[:, s : s + CHUNK]
        a = plain.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
        b = packed.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
        compare(a, b, packed, 0.35)
        accounting(pool, packed)
    for cache in (plain, packed):
        cache.reset_indices()
    assert pool.stats().used_pages == 0


def _pressure_setup(pressure):
    # Dense chunk: 48 tokens x 2 rows x 128 B = 12 KiB = 12 pages of 1 KiB; packed: 4 pages tokens + 2 codebook.
    pool = BlockPool(capacity_bytes=40 * 1024, page_bytes=1024)
    quant = QuantConfig(bits=2, centroids=16, block_size=16, keep_recent_chunks=8, sink=False)
    cache = PagedCausalKVCache(
        pool=pool,
        batch_size=1,
        cache_size=TPF * 30,
        num_heads=H,
        head_dim=D,
        dtype=torch.bfloat16,
        device="cpu",
        quant=quant,
        pack_under_pressure=pressure,
    )
    return pool, cache


def test_memory_pressure_packs_recent_chunks_early():
    k, v = video_kv(20, TPF, H, D, seed=8)
    for pressure in (False, True):
        pool, cache = _pressure_setup(pressure)
        for c in range(3):
            s = c * CHUNK
            cache.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
        assert pool.stats().free_pages == 4  # 3 dense chunks of 12 pages
        s = 3 * CHUNK
        kk, vv = k[:, s : s + CHUNK], v[:, s : s + CHUNK]
        if not pressure:
            before = (pool.stats(), debug_state(pool), cache.segments())
            with pytest.raises(PoolExhaustedError, match="asked for 12 pages"):
                cache.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            assert (pool.stats(), debug_state(pool), cache.segments()) == before
        else:
            cache.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            kinds = [segment_kind(cache, st) for st, _, _ in cache.segments()]
            assert kinds[0] == "packed" and kinds[-1] == "dense"
            accounting(pool, cache)


def test_non_finite_chunk_stays_unpacked_with_a_warning():
    k, v = video_kv(20, TPF, H, D, seed=9)
    k = k.clone()
    k[0, 3, 1, 5] = float("inf")
    pool, _plain, packed = caches(Q2, cache_size=TPF * 24)
    with pytest.warns(UserWarning, match="stays unpacked: .*non-finite"):
        for c in range(4):
            s = c * CHUNK
            packed.update_and_get_attention_kv(
                key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s
            )
    assert packed.pack_skipped == 1
    assert segment_kind(packed, 0) == "dense"
    assert segment_kind(packed, CHUNK) == "packed"
    accounting(pool, packed)


def test_bad_quant_configuration():
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=4096)
    base = dict(pool=pool, batch_size=1, cache_size=64, num_heads=H, head_dim=D, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(CacheConfigError, match="block_size"):
        PagedCausalKVCache(quant=QuantConfig(bits=2, block_size=24), **base)
    with pytest.raises(CacheConfigError, match="QuantConfig"):
        PagedCausalKVCache(quant={"bits": 2}, **base)
    small = BlockPool(capacity_bytes=1 << 20, page_bytes=256)
    with pytest.raises(CacheConfigError, match="does not fit a page"):
        PagedCausalKVCache(quant=QuantConfig(bits=2, centroids=128, block_size=16), **{**base, "pool": small})
    assert pool.stats().used_pages == 0 and small.stats().used_pages == 0


def test_packing_failure_after_the_commit_keeps_the_call_and_retries(monkeypatch):
    """An unexpected error while the pack policy quantizes (injected: a device out-of-memory) does not abort the
    call that triggered it: its write lands, the view is the quant-off view (the chunk stayed bf16, unchanged), the
    pool and the cache's accounting stay consistent, a PackingFailedWarning says so, and the next advance packs."""
    from pagedqvg import PackingFailedWarning
    from pagedqvg.store.packed_store import PackedStore

    real = PackedStore.quantize
    failures = [1]

    def flaky(self, dense):
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, dense)

    monkeypatch.setattr(PackedStore, "quantize", flaky)
    k, v = video_kv(12, TPF, H, D, seed=5)
    pool, plain, packed = caches(QuantConfig(bits=2, centroids=16, block_size=16, keep_recent_chunks=0, sink=False))
    for c in range(4):
        s = c * CHUNK
        kk, vv = k[:, s : s + CHUNK], v[:, s : s + CHUNK]
        a = plain.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
        if c == 2:  # the policy's first pack: chunk 1 (chunk 0 is the sink, not packed with sink=False)
            with pytest.warns(PackingFailedWarning, match=r"packing chunk \[\d+, \d+\) failed \(OutOfMemoryError"):
                b = packed.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
            assert [kind for _, _, kind in packed.last_view_sources()] == ["dense"] * len(packed.last_view_sources())
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
            assert packed.pack_skipped == 1
        else:
            b = packed.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=s)
        mb = accounting(pool, packed)
        assert pool.stats().used_bytes == mb["used_bytes"] + plain.memory_breakdown()["used_bytes"]
        assert (b.local_end_index, b.visible_global_end) == (a.local_end_index, a.visible_global_end)
    assert any(kind == "packed" for _, _, kind in packed.last_view_sources())  # retried and packed


def test_rewind_past_the_non_finite_rows_lets_the_policy_pack_the_rest():
    """A chunk the policy could not pack (a non-finite row) is retried once a rewind has cut that row off: its finite
    head packs at the next advance (found by the compact fuzz machine: the flag outlived the rows that set it)."""
    q = QuantConfig(bits=2, centroids=2, block_size=4, keep_recent_chunks=0, sink=False)
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=256)
    cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=64, num_heads=1, head_dim=8, dtype=torch.bfloat16,
                               device="cpu", quant=q)  # fmt: skip
    k, v = video_kv(3, 8, 1, 8, seed=2, batch=1)
    k[:, 6] = float("inf")
    cache.update_and_get_attention_kv(key=k[:, 0:8], value=v[:, 0:8], current_chunk_start=0)
    with pytest.warns(UserWarning, match=r"chunk \[0, 8\) stays unpacked: prq_quantize: x has 8 non-finite value"):
        cache.update_and_get_attention_kv(key=k[:, 8:16], value=v[:, 8:16], current_chunk_start=8)
    assert segment_kind(cache, 0) == "dense"  # the policy tried: token 6 is not finite
    cache.rewind_to(4)  # drops [4, 16): chunk [0, 8) keeps its finite tokens [0, 4)
    cache.update_and_get_attention_kv(key=k[:, 16:24], value=v[:, 16:24], current_chunk_start=4)
    assert segment_kind(cache, 0) == "packed"
    pool.check()
