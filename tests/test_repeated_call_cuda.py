"""The repeated call on CUDA tensors synchronizes nothing with the host (issue 20 item 1), Triton and torch paths alike.

`torch.cuda.set_sync_debug_mode("error")` makes every op that waits for the device (a `.item()`, a `nonzero`, a
device-to-host copy, a `torch.unique`) raise. A repeated call (a later denoise step rewriting the current chunk) runs
under it with quantization off, int2 and compact (packed rows decoded in the view), with never-filled slots, with and
without `reuse_view_buffer`, on both kernel backends; its views equal the first call's (or the dense reference's,
quant off) bit for bit. The first call of a chunk plans (it may synchronize: plans read host lists); only the
repeats are checked. The CPU twin of this test (instrumented `.item/.tolist/.cpu`) is tests/test_repeated_call.py.

Part of the GPU subset: skipped without a CUDA device (no GPU in CI; run on a GPU with
`python -m pytest -q tests/test_repeated_call_cuda.py`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dense_reference import DenseReferenceCache

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.planning.synthetic import video_kv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU subset)")

B, H, D, CHUNK = 1, 4, 32, 16


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("PAGEDQVG_KERNELS", request.param)  # read when a cache fixes its backend
    return request.param


def quant_config(name: str | None) -> QuantConfig | None:
    if name is None:
        return None
    q = QuantConfig.compact(centroids=16, block_size=D) if name == "compact" else QuantConfig(
        bits=2, centroids=16, block_size=8)  # fmt: skip
    return dataclasses.replace(q, keep_recent_chunks=0, sink=False)


def repeat(cache, k, v, s, n=CHUNK):
    return cache.update_and_get_attention_kv(key=k[:, s : s + n], value=v[:, s : s + n], current_chunk_start=s)


def without_syncs(call, times: int = 3):
    """Runs `call` `times` times with every host-device synchronization an error; returns the last result."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(times):
            out = call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("quant", [None, "int2", "compact"])
def test_repeated_call_does_not_synchronize(production, backend, quant, reuse):
    pool = BlockPool(capacity_bytes=8 << 20, page_bytes=4096, device="cuda")
    cache = PagedCausalKVCache(pool=pool, batch_size=B, cache_size=6 * CHUNK, num_heads=H, head_dim=D,
                               sink_tokens=CHUNK, dtype=torch.bfloat16, device="cuda", quant=quant_config(quant),
                               reuse_view_buffer=reuse)  # fmt: skip
    k, v = (t.cuda() for t in video_kv(8, CHUNK, H, D, seed=5, batch=B))
    for c in range(7):  # the window rolls; with quantization, finished chunks are packed
        repeat(cache, k, v, c * CHUNK)
    if quant is not None:
        assert any(kind == "packed" for *_, kind in cache.last_view_sources())
    first = repeat(cache, k, v, 6 * CHUNK)
    k0, v0 = first.k.clone(), first.v.clone()
    view = without_syncs(lambda: repeat(cache, k, v, 6 * CHUNK))
    assert torch.equal(view.k, k0) and torch.equal(view.v, v0)
    if quant is None:
        ref = DenseReferenceCache(batch_size=B, cache_size=6 * CHUNK, num_heads=H, head_dim=D, sink_tokens=CHUNK,
                                  dtype=torch.bfloat16)  # fmt: skip
        kc, vc = k.cpu(), v.cpu()
        for c in range(7):
            want = repeat(ref, kc, vc, c * CHUNK)
        assert torch.equal(view.k.cpu(), want.k) and torch.equal(view.v.cpu(), want.v)


@pytest.mark.parametrize("reuse", [False, True])
def test_repeated_view_with_zero_slots_does_not_synchronize(production, backend, reuse):
    geometry = dict(batch_size=B, cache_size=8, num_heads=H, head_dim=D, attention_window_size=4, global_sink_tokens=6)
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=1024, device="cuda")
    cache = PagedCausalKVCache(pool=pool, dtype=torch.bfloat16, device="cuda", reuse_view_buffer=reuse, **geometry)
    ref = DenseReferenceCache(dtype=torch.bfloat16, **geometry)
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(B, 5, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    kc, vc = k.cuda(), v.cuda()  # host-to-device copies of pageable memory synchronize: made before the check
    call = lambda: cache.update_and_get_attention_kv(key=kc, value=vc, current_chunk_start=0)  # noqa: E731
    call()
    assert any(kind == "zeros" for *_, kind in cache.last_view_sources())
    got = without_syncs(call)
    want = ref.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert torch.equal(got.k.cpu(), want.k) and torch.equal(got.v.cpu(), want.v)
