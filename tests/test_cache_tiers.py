"""Formats by age in the cache (issue 23, item 2): chunks pack into their tier's format and age into the next one.

Deterministic programs on tiered `QuantConfig`s (the fuzz machine `TieredFuzzMachine` in test_cache_fuzz_quant.py
draws them at random; tests/test_planner.py checks plan == measured for tiered settings):

- formats after every advance (sink, recent, history, the current chunk dense), repacks of aging chunks from their
  decoded values, `memory_breakdown` per format against the layouts' bytes;
- views: dense rows exact, fp8 rows exactly the fp8 round trip of what was written, PRQ rows within the error of
  their format; head slices; attention over a tiered view (`update_and_attend`) against SDPA over the view;
- rewrites of aged chunks (unpack), rewinds into them, pins of a quantized sink, pressure packs;
- a failing repack: quantizing fails -> the chunk stays as it was (warning, retried); the commit fails -> the whole
  call rolls back (cache and pool exactly as before);
- Triton: the views of a tiered cache through the Triton backend (interpreter on CPU) equal the torch backend's bit
  for bit; the fp8 runs go through the torch reference on both;
- typed errors for tier settings the cache cannot hold, leaving the pool as it was.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from helpers import (  # sets TRITON_INTERPRET
    bits,
    cache_state,
    chunk_packer,
    contract_checked_kmeans,
    rerun_interpreted,
    same,
    segment_entries,
    tier_store,
    triton_kernels,
)

from pagedqvg import BlockPool, CacheConfigError, PagedCausalKVCache, QuantConfig
from pagedqvg.allocator.pool import PoolStats, debug_state
from pagedqvg.errors import PackingFailedWarning
from pagedqvg.quant.fp8 import Fp8Format

_, TRITON_ERROR, DEVICE, WHY = triton_kernels("view.triton_view_runs", "_view_runs_kernel")
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
ON = DEVICE if DEVICE is not None else torch.device("cpu")

D, H, N = 32, 2, 4  # head_dim (fp8 needs a multiple of 32), heads, tokens per chunk
#: sink int4 / recent fp8 / history int2 (the second planner setting's tiers, with a packed sink)
TIERED = QuantConfig(bits=2, centroids=4, block_size=16, kmeans_iters=1, sink_format="int4", recent_format="fp8")


def make_cache(quant=TIERED, pool=None, device="cpu", **kw):
    pool = pool or BlockPool(capacity_bytes=1 << 20, page_bytes=2048, device=device)
    args = dict(batch_size=1, cache_size=7 * N, num_heads=H, head_dim=D, dtype=torch.bfloat16, sink_tokens=N)
    args.update(kw)
    return PagedCausalKVCache(pool=pool, device=device, quant=quant, **args)


def chunk(i, heads=H, device="cpu"):
    g = torch.Generator().manual_seed(100 + i)
    return tuple(torch.randn(1, N, heads, D, generator=g).to(torch.bfloat16).to(device) for _ in range(2))


def formats(cache):
    return [e.value.fmt if e.value.packed else "bf16" for e in segment_entries(cache)]


def advance(cache, i, **kw):
    k, v = chunk(i)
    return cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N, **kw)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_chunks_pack_into_their_tier_and_age_from_decoded_values():
    cache = make_cache()
    want = [
        ["bf16"],
        ["int4", "bf16"],  # the sink packs in the sink's format
        ["int4", "fp8", "bf16"],  # the newest completed chunk in the recent tier's
        ["int4", "int2", "fp8", "bf16"],  # the chunk leaving the recent tier is repacked into the history's
        ["int4", "int2", "int2", "fp8", "bf16"],
    ]
    kv = [chunk(i) for i in range(5)]
    aged = {}
    for i, fmts in enumerate(want):
        view = advance(cache, i)
        assert formats(cache) == fmts
        if i >= 2:  # the recent chunk: exactly the fp8 round trip of what was written
            fp8 = Fp8Format(D, H)
            for t, x in ((0, kv[i - 1][0]), (1, kv[i - 1][1])):
                got = (view.k, view.v)[t][:, (i - 1) * N : i * N]
                assert torch.equal(bits(got), bits(fp8.dequantize(fp8.quantize(x), torch.bfloat16)))
            aged[i - 1] = view.k[:, (i - 1) * N : i * N].clone()  # what aging will repack from
        k_now = view.k[:, i * N :]
        assert torch.equal(bits(k_now), bits(kv[i][0]))  # the current chunk: exact
    # history rows: int2 of the fp8-decoded values (aging), within int2's error of them and of the originals
    view = advance(cache, 5)
    for j in (1, 2, 3):
        got = view.k[:, j * N : (j + 1) * N]
        assert rel(got, aged[j]) < 0.6 and rel(got, kv[j][0]) < 0.6
    mb = cache.memory_breakdown()
    entries = segment_entries(cache)
    for fmt in ("int4", "int2", "fp8"):
        store = tier_store(cache, fmt)
        segs = [e for e in entries if e.value.packed and e.value.fmt == fmt]
        assert mb[f"{fmt}_tokens"] == sum(e.end - e.start for e in segs)
        assert mb[f"{fmt}_pages"] == sum(len(e.value.pages) for e in segs)
        assert mb[f"{fmt}_bytes"] == sum(store.layout.used_bytes_for_tokens(e.end - e.start) for e in segs)
    assert mb["used_bytes"] == cache.pool.stats().used_bytes
    cache.close()
    cache.pool.check()
    assert cache.pool.stats().used_pages == 0


def test_head_slices_and_attention_over_a_tiered_view():
    cache = make_cache()
    for i in range(4):
        advance(cache, i)
    k, v = chunk(9, heads=1)
    full = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * N, cache_head_start=1)
    again = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * N, cache_head_start=1)
    assert torch.equal(bits(full.k), bits(again.k)) and torch.equal(bits(full.v), bits(again.v))  # the cached plan
    whole = cache.update_and_get_attention_kv(key=chunk(3)[0], value=chunk(3)[1], current_chunk_start=3 * N)
    assert torch.equal(bits(full.k[:, : 3 * N]), bits(whole.k[:, : 3 * N, 1:]))  # packed rows of head 1
    q = torch.randn(1, 5, H, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    k3, v3 = chunk(3)
    out = cache.update_and_attend(q, key=k3, value=v3, current_chunk_start=3 * N)
    view = cache.update_and_get_attention_kv(key=k3, value=v3, current_chunk_start=3 * N)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).double(), view.k.transpose(1, 2).double(), view.v.transpose(1, 2).double()
    ).transpose(1, 2)
    assert float((out.double() - ref).abs().max()) < 2e-2  # bf16 output rounding (|out| < 2: 2^-7 steps)
    cache.close()


def test_rewrite_and_rewind_of_aged_chunks_and_a_pinned_sink():
    cache = make_cache()
    for i in range(5):
        advance(cache, i)
    assert formats(cache) == ["int4", "int2", "int2", "fp8", "bf16"]
    k, v = chunk(20)
    cache.update_and_get_attention_kv(key=k[:, :2], value=v[:, :2], current_chunk_start=N + 1)  # into aged chunk 1
    assert formats(cache) == ["int4", "bf16", "int2", "fp8", "bf16"]  # unpacked (dequantized rows + the rewrite)
    view = advance(cache, 5)
    assert formats(cache) == ["int4", "int2", "int2", "int2", "fp8", "bf16"]  # back into its tier's format
    assert view.k.shape[1] == 6 * N
    cache.pin_current_chunk(N)  # a scene cut: the current chunk becomes the (quantized) sink
    advance(cache, 6)
    fmts = formats(cache)
    assert fmts[-2:] == ["int4", "bf16"] or fmts[-3:] == ["int4", "fp8", "bf16"], fmts
    cache.rewind_to(5 * N + 2)  # into the pinned (now int4) chunk: keeps its codebooks and 2 tokens
    entries = segment_entries(cache)
    assert entries[-1].end == 5 * N + 2 and entries[-1].value.packed
    store = tier_store(cache, entries[-1].value.fmt)
    assert len(entries[-1].value.pages) == store.pages_for_tokens(2)
    advance_k, advance_v = chunk(30)
    cache.update_and_get_attention_kv(key=advance_k, value=advance_v, current_chunk_start=5 * N + 2)
    assert cache.memory_breakdown()["used_bytes"] == cache.pool.stats().used_bytes
    cache.close()
    cache.pool.check()


def state_but_high_water(cache):
    """`cache_state` without the pool's high-water mark (a rolled-back call did reach its peak)."""
    return tuple(dataclasses.replace(x, high_water_pages=0) if isinstance(x, PoolStats) else x
                 for x in cache_state(cache))  # fmt: skip


def test_a_failing_repack_leaves_everything_as_before(monkeypatch):
    cache = make_cache()
    for i in range(3):
        advance(cache, i)
    assert formats(cache) == ["int4", "fp8", "bf16"]
    int2 = tier_store(cache, "int2")

    def broken_quantize(dense):
        raise RuntimeError("injected: out of memory while quantizing")

    monkeypatch.setattr(int2, "quantize", broken_quantize)
    with pytest.warns(PackingFailedWarning, match="stays fp8"):
        advance(cache, 3)  # the fp8 chunk cannot age: it stays fp8, the call succeeds
    assert formats(cache) == ["int4", "fp8", "fp8", "bf16"]
    monkeypatch.undo()

    def broken_write(tok_pages, cb_pages, q):
        raise RuntimeError("injected: the commit's page copy fails")

    monkeypatch.setattr(tier_store(cache, "int2"), "write", broken_write)
    before = state_but_high_water(cache)
    with pytest.raises(RuntimeError, match="page copy"):
        advance(cache, 4)  # a repack commit fails after pages changed hands: the whole call rolls back
    same(state_but_high_water(cache), before)
    cache.pool.check()
    monkeypatch.undo()
    advance(cache, 4)  # the retry ages both fp8 chunks
    assert formats(cache) == ["int4", "int2", "int2", "fp8", "bf16"]
    cache.close()


def test_pressure_packs_use_the_historys_format():
    quant = QuantConfig(bits=2, centroids=4, block_size=16, kmeans_iters=1, recent_format="int4",
                        keep_recent_chunks=2, sink=False)  # fmt: skip
    pool = BlockPool(capacity_bytes=9 * 2048, page_bytes=2048)
    cache = make_cache(quant, pool=pool, pack_under_pressure=True)
    for i in range(4):
        advance(cache, i)
    other = pool.new_owner("ballast")
    ballast = pool.alloc(pool.num_free_pages, other)
    pool.free(ballast[:1], other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        advance(cache, 4)
    assert "int2" in formats(cache) and formats(cache)[-1] == "bf16"
    pool.free(ballast[1:], other)
    cache.close()
    pool.check()


@pytest.mark.parametrize(
    ("quant", "head_dim", "page_bytes", "words"),
    [
        (QuantConfig(bits=2, block_size=16, recent_format="fp8"), 48, 1 << 16,
         ["recent tier", "'fp8'", "head_dim=48", "multiple of 32"]),
        (QuantConfig.compact(sink_format="int4"), 128, 1 << 14,
         ["sink tier", "'int4'", "32768 B", "16384 B", "page_bytes >= 32768"]),
        (QuantConfig(bits=2, block_size=16, sink_format="compact"), 64, 1 << 16,
         ["sink tier", "'compact'", "block_size=128", "head_dim=64"]),
    ],
    ids=["fp8-block", "tier-page", "compact-block"],
)  # fmt: skip
def test_tiers_the_cache_cannot_hold_are_typed_errors(quant, head_dim, page_bytes, words):
    pool = BlockPool(capacity_bytes=32 * page_bytes, page_bytes=page_bytes)
    other = make_cache(None, pool=pool, head_dim=head_dim)  # a neighbour holding pages: the snapshot must not move
    advance_k = torch.zeros(1, N, H, head_dim, dtype=torch.bfloat16)
    other.update_and_get_attention_kv(key=advance_k, value=advance_k, current_chunk_start=0)
    before = (pool.stats(), debug_state(pool), pool.arena.clone())
    with pytest.raises(CacheConfigError) as info:
        make_cache(quant, pool=pool, head_dim=head_dim)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    after = (pool.stats(), debug_state(pool), pool.arena.clone())
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])
    pool.check()
    other.close()


def test_untiered_configs_hold_one_store_and_no_format_keys():
    cache = make_cache(QuantConfig(bits=2, centroids=4, block_size=16, sink_format="int2"))
    for i in range(3):
        advance(cache, i)
    assert set(chunk_packer(cache).stores) == {"int2"} and not chunk_packer(cache).tiered
    assert set(cache.memory_breakdown()) == {"dense_pages", "packed_pages", "dense_tokens", "packed_tokens",
                                             "used_bytes", "dense_bytes", "packed_bytes"}  # fmt: skip
    cache.close()


@needs_kernels
def test_tiered_views_through_triton_equal_torch(monkeypatch):
    """Every view of a tiered cache (int4 sink, fp8 recent, int2 history; head slices; a rewrite of an aged chunk)
    equals the torch backend's bit for bit, and so does `update_and_attend` over it; on the Triton backend the
    history's runs go through the view-runs kernel and the int4 runs through the packed-dequant kernel, the fp8 runs
    through their torch reference."""
    contract_checked_kmeans(monkeypatch)
    from pagedqvg.kernels.view import triton_dequant, triton_view_runs

    launches = {"view_runs": 0, "packed_dequant": 0}
    real_runs, real_dq = triton_view_runs.view_runs_triton, triton_dequant.packed_dequant_triton

    def runs(*a, **k):
        launches["view_runs"] += 1
        return real_runs(*a, **k)

    def dq(*a, **k):
        launches["packed_dequant"] += 1
        return real_dq(*a, **k)

    monkeypatch.setattr(triton_view_runs, "view_runs_triton", runs)
    monkeypatch.setattr(triton_dequant, "packed_dequant_triton", dq)
    views = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        cache = make_cache(device=ON)
        out = []
        for i in range(5):
            k, v = (x.to(ON) for x in chunk(i))
            view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
            out.append((view.k.cpu().clone(), view.v.cpu().clone()))
        k, v = (x[:, :, :1].to(ON) for x in chunk(7))
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4 * N, cache_head_start=1)
        out.append((view.k.cpu().clone(), view.v.cpu().clone()))
        q = torch.randn(1, 3, H, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(ON)
        k, v = (x.to(ON) for x in chunk(8))
        att = cache.update_and_attend(q, key=k, value=v, current_chunk_start=4 * N)  # over the built tiered view
        out.append((att.cpu(), att.cpu()))
        views[backend] = (out, formats(cache))
        cache.close()
    assert views["torch"][1] == views["triton"][1] == ["int4", "int2", "int2", "fp8", "bf16"]
    for (ka, va), (kb, vb) in zip(views["torch"][0], views["triton"][0], strict=True):
        assert torch.equal(bits(ka), bits(kb)) and torch.equal(bits(va), bits(vb))
    assert launches["view_runs"] > 0 and launches["packed_dequant"] > 0


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)


def test_aging_error_is_printed():
    """The aging choice's measurement at test size (README "Formats by age"; benchmarks/bench_cache_aging.py prints
    it at LingBot-World's chunk size): history rows of a tiered cache (repacked from the recent tier's decoded
    values) against the originals, next to quantizing the originals once in the history's format."""
    from pagedqvg.quant import prq_dequantize, prq_quantize

    q = QuantConfig(bits=2, centroids=4, block_size=16, kmeans_iters=1, recent_format="int4", sink=False)
    cache = make_cache(q, sink_tokens=0)
    kv = [chunk(i) for i in range(4)]
    for i in range(4):
        view = advance(cache, i)
    assert formats(cache) == ["int2", "int2", "int4", "bf16"]
    aged = rel(view.k[:, :N], kv[0][0])
    x = kv[0][0][0]  # [N, H, D]
    seg = prq_quantize(x, q)
    once = rel(prq_dequantize(seg.token_rows, seg.codebooks, seg.fmt)[None], kv[0][0])
    print(f"aged K rel err {aged:.4f}, quantized once {once:.4f} ({100 * (aged / once - 1):+.1f}%)")
    assert math.isfinite(aged) and aged < 1.0
    cache.close()
