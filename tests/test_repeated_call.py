"""The repeated call (a later denoise step rewriting the current chunk) and the plans kept across an advance.

Production settings (the debug switch off, as in a user's process): a repeated call allocates exactly one tensor
(its view; none with `reuse_view_buffer=True`), reads nothing back to the host (`.item()`, `.tolist()`, `.cpu()`,
`int()`/`bool()`/`float()` of a tensor), and reads no environment variable; an advance rebuilds the row index of the
new segment only. Views stay equal to the dense reference bit for bit.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from dense_reference import DenseReferenceCache
from helpers import cached_plans, page_io, segment_index
from torch.utils._python_dispatch import TorchDispatchMode

import pagedqvg
from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.kernels.view import decode_plan
from pagedqvg.planning.synthetic import video_kv

B, H, D = 1, 4, 8
CHUNK = 4


class NewStorageCounter(TorchDispatchMode):
    """Counts the tensors torch ops return on storages none of their inputs had (allocations, not views)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {
            t.untyped_storage().data_ptr()
            for a in [*args, *kwargs.values()]
            for t in (a if isinstance(a, (list, tuple)) else [a])
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.ops.append(str(func))
        return out


def filled(reuse: bool = False, **kw) -> tuple[PagedCausalKVCache, DenseReferenceCache, torch.Tensor, torch.Tensor]:
    """A cache (sink 4, window rolled twice) and the dense reference after the same 10 chunks."""
    geometry = dict(batch_size=B, cache_size=24, num_heads=H, head_dim=D, sink_tokens=CHUNK)
    geometry.update(kw)
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=1024)
    cache = PagedCausalKVCache(pool=pool, dtype=torch.bfloat16, device="cpu", reuse_view_buffer=reuse, **geometry)
    ref = DenseReferenceCache(dtype=torch.bfloat16, **geometry)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(B, 12 * CHUNK, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    for c in range(10):
        for target in (cache, ref):
            repeat(target, k, v, c * CHUNK)
    return cache, ref, k, v


def repeat(cache, k, v, s=9 * CHUNK, n=CHUNK, **kw):
    return cache.update_and_get_attention_kv(key=k[:, s : s + n], value=v[:, s : s + n], current_chunk_start=s, **kw)


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("heads", [None, (1, 2)])
def test_repeated_call_allocates_only_its_view(production, reuse, heads):
    cache, _, k, v = filled(reuse)
    kw = {}
    if heads is not None:
        h0, hin = heads
        k, v, kw = k[:, :, h0 : h0 + hin], v[:, :, h0 : h0 + hin], {"cache_head_start": h0}
    repeat(cache, k, v, **kw)  # plans the call
    for _ in range(3):
        with NewStorageCounter() as counter:
            view = repeat(cache, k, v, **kw)
        assert counter.ops == ([] if reuse else ["aten.empty.memory_format"]), counter.ops
    assert view.k.shape == (B, 24, H if heads is None else heads[1], D)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        repeat(cache, k, v, **kw)
    allocations = [e.name for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocations == ([] if reuse else ["aten::empty"]), allocations  # nothing inside the ops either


def test_repeated_call_reads_nothing_back_nor_the_environment(production, monkeypatch):
    cache, ref, k, v = filled()
    repeat(cache, k, v)
    calls: list[str] = []
    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real, **kw: calls.append(_n) or _r(
            self, *a, **kw))  # fmt: skip
    environ_reads: list[str] = []
    real_get = os.environ.get
    monkeypatch.setattr(os.environ, "get", lambda key, *a: environ_reads.append(key) or real_get(key, *a))
    view = repeat(cache, k, v)
    monkeypatch.undo()
    assert calls == [] and environ_reads == [], (calls, environ_reads)
    want = repeat(ref, k, v)
    assert torch.equal(view.k, want.k) and torch.equal(view.v, want.v)


def test_debug_switch_turns_the_index_checks_on(production):
    from pagedqvg.kernels.view.view_build import view_build_torch

    rows = torch.zeros(3, 4, 1, 2)
    out = torch.empty(1, 1, 1, 1, 2)
    bad_page, slot = torch.tensor([[[3]]]), torch.tensor([[[0]]])
    assert not pagedqvg.debug_checks()
    pagedqvg.set_debug_checks(True)
    with pytest.raises(IndexError, match=r"page index out of range: 3\.\.3, valid 0\.\.2"):
        view_build_torch(rows, bad_page, slot, 0, 1, out)


def test_an_advance_keeps_the_row_indices_of_unchanged_segments(production):
    cache, ref, k, v = filled()
    repeat(cache, k, v)
    before = {e.start: e.value.row_index for e in segment_index(cache)}
    assert all(x is not None for x in before.values())
    s = 10 * CHUNK
    got = cache.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    want = ref.update_and_get_attention_kv(key=k[:, s : s + CHUNK], value=v[:, s : s + CHUNK], current_chunk_start=s)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    after = {e.start: e.value.row_index for e in segment_index(cache)}
    kept = [g for g in after if g in before]
    assert kept and all(after[g] is before[g] for g in kept)  # the same tensors: not rebuilt
    assert after[s] is not None and s not in before  # only the new segment's index is new
    for step in range(2):  # the denoise steps of the new chunk: equal to the reference
        got = repeat(cache, k, v, s)
        want = repeat(ref, k, v, s)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v), step


def test_repeated_view_with_zero_slots_keeps_its_row_expansion(production, monkeypatch):
    """A view with never-filled slots is a run table (view_runs): its row expansion is derived once with the plan, so
    the repeated call reads nothing back either; bits equal the reference's."""
    geometry = dict(batch_size=B, cache_size=8, num_heads=H, head_dim=D, attention_window_size=4, global_sink_tokens=6)
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=1024)
    cache = PagedCausalKVCache(pool=pool, dtype=torch.bfloat16, device="cpu", **geometry)
    ref = DenseReferenceCache(dtype=torch.bfloat16, **geometry)
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(B, 5, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    first = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert any(kind == "zeros" for *_, kind in cache.last_view_sources())
    calls: list[str] = []
    for name in ("item", "tolist", "cpu", "__int__", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real, **kw: calls.append(_n) or _r(
            self, *a, **kw))  # fmt: skip
    got = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    monkeypatch.undo()
    assert calls == [], calls
    want = ref.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v) and torch.equal(first.k, got.k)


def no_host_reads(monkeypatch) -> list[str]:
    """Record every read of tensor data back to the host (and `.numpy()`); undo with `monkeypatch.undo()`."""
    calls: list[str] = []
    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real, **kw: calls.append(_n) or _r(
            self, *a, **kw))  # fmt: skip
    return calls


def assert_allocation_free(call, reuse: bool) -> torch.Tensor:
    """The call allocates its view only (nothing with `reuse_view_buffer`), by the dispatch counter and the
    profiler (which also sees allocations inside ops); returns its last view."""
    for _ in range(2):
        with NewStorageCounter() as counter:
            view = call()
        assert counter.ops == ([] if reuse else ["aten.empty.memory_format"]), counter.ops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    allocations = [e.name for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocations == ([] if reuse else ["aten::empty"]), allocations
    return view


QUANTS = {
    "int2": dict(bits=2, centroids=16, block_size=8),
    "int4-asymmetric": dict(bits=4, centroids=16, block_size=4, asymmetric=True),
    "compact": "compact",  # trits, fp8 codebooks, fitted scales
}


def packed_cache(quant: str, reuse: bool):
    """A quantized cache (4 heads x 8, 16-token chunks, nothing kept dense but the current chunk) after 5 chunks:
    its views hold packed rows of 4 segments, and dense rows."""
    q = QuantConfig.compact(centroids=16, block_size=D) if quant == "compact" else QuantConfig(**QUANTS[quant])
    q = dataclasses.replace(q, keep_recent_chunks=0, sink=False)
    pool = BlockPool(capacity_bytes=4 << 20, page_bytes=1024)
    cache = PagedCausalKVCache(pool=pool, batch_size=B, cache_size=96, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                               device="cpu", quant=q, reuse_view_buffer=reuse)  # fmt: skip
    k, v = video_kv(6, 16, H, D, seed=7, batch=B)
    for c in range(5):
        repeat(cache, k, v, c * 16, 16)
    return cache, k, v


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("heads", [None, (1, 2)])
@pytest.mark.parametrize("tile", [None, 3], ids=["one-tile", "tiles-of-3-tokens"])
def test_repeated_view_with_packed_rows_allocates_only_its_view(production, monkeypatch, quant, reuse, heads, tile):
    """Packed rows decoded from the plan's kept gathers into its kept scratch: 1 allocation (0 with
    `reuse_view_buffer`), no host read; the packed rows equal `packed_dequant_torch`'s decode of their segment (bit
    for bit) and the dense rows the written chunk. With tiles of 3 tokens the 64 packed tokens take 22 tiles (the
    last of 1 token)."""
    cache, k, v = packed_cache(quant, reuse)
    kw, h0, hin = {}, 0, H
    if heads is not None:
        h0, hin = heads
        k, v, kw = k[:, :, h0 : h0 + hin], v[:, :, h0 : h0 + hin], {"cache_head_start": h0}
    if tile is not None:
        monkeypatch.setattr(decode_plan, "DEQUANT_TILE_ELEMS", tile * 2 * B * hin * D)
        page_io(cache).invalidate()  # the fill planned this view already
    s = 4 * 16
    first = repeat(cache, k, v, s, 16, **kw)
    k0, v0 = first.k.clone(), first.v.clone()
    sources = cache.last_view_sources()
    assert sum(kind == "packed" for *_, kind in sources) == 4, sources
    if tile is not None:
        plans = [p.runs_plan.packed for p in cached_plans(page_io(cache)).values() if getattr(p, "runs_plan", None)]
        assert [len(p.tiles) for p in plans] == [22]
    view = assert_allocation_free(lambda: repeat(cache, k, v, s, 16, **kw), reuse)
    calls = no_host_reads(monkeypatch)
    view = repeat(cache, k, v, s, 16, **kw)
    monkeypatch.undo()
    assert calls == [], calls
    assert torch.equal(view.k, k0) and torch.equal(view.v, v0)
    o = 0
    for entry in segment_index(cache):
        n = entry.end - entry.start
        if entry.value.packed:
            dense = page_io(cache).dequantize_segment(entry)  # [n, 2, B, H, D] by packed_dequant_torch
            want = dense[:, :, :, h0 : h0 + hin].permute(1, 2, 0, 3, 4)
        else:
            want = torch.stack([k[:, entry.start : entry.end], v[:, entry.start : entry.end]])
        assert torch.equal(view.k[:, o : o + n], want[0]) and torch.equal(view.v[:, o : o + n], want[1])
        o += n
    assert o == view.k.shape[1]


@pytest.mark.parametrize("reuse", [False, True])
def test_repeated_view_with_zero_slots_allocates_only_its_view(production, reuse):
    geometry = dict(batch_size=B, cache_size=8, num_heads=H, head_dim=D, attention_window_size=4, global_sink_tokens=6)
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=1024)
    cache = PagedCausalKVCache(pool=pool, dtype=torch.bfloat16, device="cpu", reuse_view_buffer=reuse, **geometry)
    ref = DenseReferenceCache(dtype=torch.bfloat16, **geometry)
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(B, 5, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert any(kind == "zeros" for *_, kind in cache.last_view_sources())
    got = assert_allocation_free(lambda: cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0),
                                 reuse)  # fmt: skip
    want = ref.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
