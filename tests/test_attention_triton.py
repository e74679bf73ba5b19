"""The Triton attention-from-pages kernel (kernels/triton_attention.py) against its references.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set by helpers.py before
anything imports triton; `test_interpreter_in_subprocess` reruns this file in a fresh process otherwise). Twin caches:
one on the torch backend answers views, the other (`PAGEDQVG_KERNELS=triton`) `update_and_attend` through the kernel;
the kernel's error against fp64 attention over the materialized view must stay within the proven fp32 bound
(tests/float_bounds.py: any summation order) — dense views (row index), packed rows of every PRQ format (int2, int4
asymmetric, trits, compact with fp8 codebooks), zero rows, head slices, a recent window. The reference
(`attend_runs_torch`: rows expanded, fp64 softmax) equals fp64 SDPA on the view. Tiny shapes: the interpreter costs
milliseconds per program.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float_bounds import assert_attention_within_bound
from helpers import newest_view_plan, page_io, rerun_interpreted, triton_kernels  # sets TRITON_INTERPRET

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.attention.pages import plan_sources
from pagedqvg.kernels.attention.attention_runs import attend_runs_torch

tat, TRITON_ERROR, DEVICE, WHY = triton_kernels("attention.triton_attention", "_attend_kernel")
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
QUANTS = {
    "off": None,
    "int2": QuantConfig(bits=2, centroids=16, block_size=16),
    "int4-asym": QuantConfig(bits=4, centroids=16, block_size=16, asymmetric=True),
    "trits": QuantConfig(bits=2, centroids=16, block_size=16, pack_trits=True),
    "compact": QuantConfig.compact(centroids=16, block_size=16),
}


def twins(monkeypatch, quant, dtype, *, B=1, H=3, D=32, chunk=16, chunks=4, sink=None, window=None):
    """(view cache on the torch backend, attend cache on the Triton backend), identical otherwise."""
    out = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        pool = BlockPool(capacity_bytes=8 << 20, page_bytes=16384, device=DEVICE)
        out.append(PagedCausalKVCache(pool=pool, batch_size=B, cache_size=chunk * chunks, num_heads=H, head_dim=D,
                                      dtype=dtype, device=DEVICE, sink_tokens=chunk if sink is None else sink,
                                      global_sink_tokens=chunk if sink is None else sink,
                                      attention_window_size=window, quant=quant, name="c"))  # fmt: skip
    assert page_io(out[1]).backend == "triton" and page_io(out[0]).backend == "torch"
    return out


def sdpa(q, k, v, scale=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


def call_both(a, b, q, k, v, start, scale=None, **kw):
    """One call on both twins: asserts the bound; returns (kernel's error, SDPA's error) vs fp64."""
    view = a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start, **kw)
    out = b.update_and_attend(q, key=k, value=v, current_chunk_start=start, softmax_scale=scale, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = sdpa(q.double(), view.k.double(), view.v.double(), scale)
    e_sdpa = (sdpa(q, view.k, view.v, scale).double() - ref).norm().item()
    e_ours = (out.double() - ref).norm().item()
    assert torch.isfinite(out).all()
    # the proven fp32 bound (tests/float_bounds.py), not a ratio to SDPA's error on this CPU; an explicit scale is
    # the adversarial-scores test (|scores| ~ 1e4), where the bound is ~10% of |v| (not_vacuous=False)
    assert_attention_within_bound(out, q, view.k, view.v, scale, exact=ref, not_vacuous=scale is None)
    return e_ours, e_sdpa


def data(gen, B, n, H, D, dtype, sigma=1.0):
    return (torch.randn(B, n, H, D, generator=gen) * sigma).to(dtype).to(DEVICE)


CASES = [("off", torch.bfloat16), ("off", torch.float16), ("off", torch.float32), ("int2", torch.bfloat16),
         ("int2", torch.float32), ("int4-asym", torch.bfloat16), ("trits", torch.float16),
         ("compact", torch.bfloat16)]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize(("quant", "dtype"), CASES, ids=[f"{q}-{str(d)[6:]}" for q, d in CASES])
def test_kernel_matches_view_sdpa(monkeypatch, quant, dtype):
    """Advances (the window rolls, chunks get packed: run tables with dense and packed runs), a head slice and a
    recent window; the twins' views agree bit for bit at the end (same writes)."""
    a, b = twins(monkeypatch, QUANTS[quant], dtype)
    B, H, D = a.batch_size, a.num_cache_heads, a.head_dim
    gen = torch.Generator().manual_seed(1)
    packed_seen = 0
    for step in range(5):
        k, v, q = (data(gen, B, 16, H, D, dtype) for _ in range(3))
        call_both(a, b, q, k, v, 16 * step)
        kh, vh, qh = (data(gen, B, 16, 2, D, dtype) for _ in range(3))
        call_both(a, b, qh, kh, vh, 16 * step, cache_head_start=1, recent_window_tokens=24)
        packed_seen += sum(1 for *_, kind in a.last_view_sources() if kind == "packed")
    assert (packed_seen > 0) == (quant != "off")
    va = a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=64)
    vb = b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=64)
    assert torch.equal(va.k, vb.k) and torch.equal(va.v, vb.v)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_zero_rows(monkeypatch, dtype):
    """A sink longer than the slots filled: zero runs in the table count as keys of score 0 and value 0."""
    a, b = twins(monkeypatch, None, dtype, H=2, D=16, chunk=3, chunks=5, sink=12, window=8)
    gen = torch.Generator().manual_seed(2)
    zeros_seen = 0
    for step in range(4):
        k, v, q = (data(gen, 1, 3, 2, 16, dtype) for _ in range(3))
        call_both(a, b, q, k, v, 3 * step)
        zeros_seen += sum(1 for *_, kind in a.last_view_sources() if kind == "zeros")
    assert zeros_seen > 0


@needs_kernels
def test_kernel_adversarial_scores_and_query_blocks(monkeypatch):
    """Scores of about +-1e4 and more query rows than one block (two query blocks, the second partial)."""
    a, b = twins(monkeypatch, None, torch.bfloat16, H=1, D=16, chunk=40, chunks=2)
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        k, v = data(gen, 1, 40, 1, 16, torch.bfloat16, 30.0), data(gen, 1, 40, 1, 16, torch.bfloat16)
        q = data(gen, 1, 70, 1, 16, torch.bfloat16, 30.0)
        call_both(a, b, q, k, v, 40 * step, scale=12.0 / 16**0.5)


@pytest.mark.parametrize("quant", ["off", "int2"])
def test_reference_is_fp64_sdpa_on_the_view(quant):
    """`attend_runs_torch` over a cache's plan (row index, or run table with packed rows) equals fp64 SDPA over
    the view the cache returns (torch backend, CPU)."""
    c = PagedCausalKVCache(pool=BlockPool(capacity_bytes=8 << 20, page_bytes=16384), batch_size=1, cache_size=64,
                           num_heads=2, head_dim=32, dtype=torch.bfloat16, device="cpu", sink_tokens=16,
                           global_sink_tokens=16, quant=QUANTS[quant], name="c")  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        k, v, q = (torch.randn(1, 16, 2, 32, generator=gen).bfloat16() for _ in range(3))
        view = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=16 * step)
        plan = newest_view_plan(c)  # this view's plan
        got = attend_runs_torch(q, page_io(c).rows, *plan_sources(page_io(c), plan), 0, plan.tokens, 32**-0.5)
        want = sdpa(q.double(), view.k.double(), view.v.double()).to(torch.bfloat16)
        assert torch.equal(got, want)


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
