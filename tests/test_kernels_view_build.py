"""The view build Triton kernel against its torch reference, bit for bit, directly and through the cache.

Runs like tests/test_kernels_page_write.py: without CUDA the Triton kernel runs in Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1 is set by helpers.py before anything imports triton; if triton was already imported in
compiled mode, `test_interpreter_in_subprocess` reruns this file in a fresh process). On a CUDA machine the same
comparisons run on CUDA tensors with compiled kernels. Equality is bitwise over random bit patterns, and the source
arena must stay untouched. The kernel's compile-shape checks are in tests/test_kernels_page_write.py (one AOT
report covers the dense kernels).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import (  # sets TRITON_INTERPRET
    any_rows,
    bits,
    make_rows,
    random_bits,
    rerun_interpreted,
    triton_kernels,
)

from pagedqvg import BlockPool, PagedCausalKVCache
from pagedqvg.kernels import dispatch
from pagedqvg.kernels.view.view_build import view_build_torch

tvb, TRITON_ERROR, DEVICE, WHY = triton_kernels("view.triton_view_build", "_view_build_kernel")
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def to_dev(*ts):
    return tuple(t.to(DEVICE) for t in ts)


# (B, T, H, Hin, head_start, D, rows_per_page, num_pages, tile override, non-contiguous index)
VIEW_CASES = [
    (1, 1, 1, 1, 0, 16, 1, 3, None, False),  # one-token view
    (1, 6, 3, 3, 0, 16, 3, 4, None, False),
    (2, 11, 4, 2, 1, 24, 5, 5, None, True),  # batch 2, head slice, D not a power of two, strided index
    (3, 9, 5, 3, 2, 16, 7, 4, (2, 16), False),  # one head per program
    (2, 17, 3, 1, 2, 8, 3, 7, (4, 8), False),
]


def _view_id(case):
    b, t, h, hin, h0, d, rpp, _p, tile, strided = case
    return (
        f"B{b}-T{t}-H{h}-heads{h0}+{hin}-D{d}-rpp{rpp}"
        + (f"-tile{tile[0]}x{tile[1]}" if tile else "")
        + ("-strided_index" if strided else "")
    )


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", VIEW_CASES, ids=_view_id)
def test_view_build_matches_torch(case, dtype):
    b, t, h, hin, h0, d, rpp, num_pages, tile, strided = case
    gen = torch.Generator().manual_seed(zlib.crc32(_view_id(case).encode()))
    arena, rows = make_rows(num_pages, rpp, h, d, dtype, gen)
    pidx, sidx = any_rows(num_pages, rpp, b, t, gen)
    if strided:
        pidx = pidx.transpose(1, 2).contiguous().transpose(1, 2)
        sidx = sidx.transpose(1, 2).contiguous().transpose(1, 2)
    ref = random_bits((2, b, t, hin, d), dtype, gen)
    out = ref.clone()
    view_build_torch(rows, pidx, sidx, h0, hin, ref)

    arena_d = arena.to(DEVICE)
    rows_d = arena_d[:, : rpp * h * d].view(num_pages, rpp, h, d)
    pidx_d, sidx_d = (pidx, sidx) if DEVICE.type == "cpu" else to_dev(pidx, sidx)
    out_d = out.to(DEVICE)
    kw = {} if tile is None else {"block_rows": tile[0], "block_cols": tile[1]}
    assert tvb.view_build_triton(rows_d, pidx_d, sidx_d, h0, hin, out_d, **kw) is out_d
    assert torch.equal(bits(out_d.cpu()), bits(ref))
    assert torch.equal(bits(arena_d.cpu()), bits(arena))  # the source is untouched


# ---------------------------------------------------------------------------------------------- via the cache
def _scenario(cache: PagedCausalKVCache, hin: int, head_start: int | None, dtype, gen) -> list[torch.Tensor]:
    """Appends that roll past a sink, rewrites of the current chunk, a pin, a rewind; every view's K and V."""
    views = []

    def step(start: int, n: int, **kw):
        k = random_bits((cache.batch_size, n, hin, cache.head_dim), dtype, gen).to(cache.device)
        v = random_bits((cache.batch_size, n, hin, cache.head_dim), dtype, gen).to(cache.device)
        view = cache.update_and_get_attention_kv(
            key=k, value=v, current_chunk_start=start, cache_head_start=head_start, **kw
        )
        views.extend([view.k.cpu(), view.v.cpu()])

    step(0, 3)
    step(0, 3)  # denoise step: rewrite of the current chunk
    step(3, 3)
    step(6, 3)  # rolls (C = 8, sink 2)
    cache.pin_current_chunk(3)
    step(9, 1)  # one-token chunk
    step(10, 3, recent_window_tokens=2)
    cache.rewind_to(11)
    step(11, 2)
    return views


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads", ["all", "slice"])
def test_cache_views_identical_with_triton_and_torch(monkeypatch, dtype, heads):
    h, hin, h0 = 3, (3 if heads == "all" else 2), (None if heads == "all" else 1)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        assert dispatch.kernel_backend(DEVICE) == backend
        pool = BlockPool(16 * 1024, page_bytes=1024, device=DEVICE)
        cache = PagedCausalKVCache(pool=pool, batch_size=2, cache_size=8, num_heads=h, head_dim=16, dtype=dtype,
                                   device=DEVICE, sink_tokens=2)  # fmt: skip
        results[backend] = _scenario(cache, hin, h0, dtype, torch.Generator().manual_seed(11))
    assert len(results["torch"]) == len(results["triton"])
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
