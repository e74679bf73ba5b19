"""Split-KV attention from pages (kernels/attention_split.py: heuristic, ranges, scratch, torch reference;
kernels/triton_attention_split.py: the partials + merge launches) against the references.

The kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 from helpers.py;
`test_interpreter_in_subprocess` reruns this file in a fresh process when triton was imported compiled). Each kernel
case takes a cache's own view plan (row index or run table: dense, packed and zero runs; a head slice) and runs the
split path at several `S` (ranges cut mid-run included) on the same plan: the output must stay within the proven fp32
bound of fp64 attention (tests/float_bounds.py), and with a zero query every partial's `l` must equal its range's key
count exactly (scores 0: each key adds e^0 = 1), which pins the ranges' edges. Tiny shapes and 16-row key blocks: the
interpreter costs milliseconds per program.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float_bounds import assert_attention_within_bound
from helpers import newest_view_plan, page_io, rerun_interpreted, triton_kernels  # sets TRITON_INTERPRET

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.attention.pages import plan_sources
from pagedqvg.kernels.attention import attention_split as asp
from pagedqvg.kernels.attention.attention_runs import attend_runs_torch, expand_rows
from pagedqvg.kernels.attention.triton_attention_split import attend_triton
from pagedqvg.kernels.ops import AttendArgs

tas, TRITON_ERROR, DEVICE, WHY = triton_kernels("attention.triton_attention_split", "_attend_split_kernel")
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
QUANTS = {
    "off": None,
    "int2": QuantConfig(bits=2, centroids=16, block_size=16),
    "compact": QuantConfig.compact(centroids=16, block_size=16),
}


def filled_cache(quant, dtype, *, H=3, D=32, chunk=16, chunks=4, sink=None, window=None, steps=5, device="cpu",
                 hin=None, head_start=0, backend="torch", monkeypatch=None):  # fmt: skip
    """A cache advanced `steps` chunks; returns (cache, the last call's view, query, args of its plan)."""
    if monkeypatch is not None:
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
    pool = BlockPool(capacity_bytes=8 << 20, page_bytes=16384, device=device)
    c = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=chunk * chunks, num_heads=H, head_dim=D, dtype=dtype,
                           device=device, sink_tokens=chunk if sink is None else sink,
                           global_sink_tokens=chunk if sink is None else sink, attention_window_size=window,
                           quant=quant, name="c")  # fmt: skip
    hin = H if hin is None else hin
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        k, v, q = (torch.randn(1, chunk, hin, D, generator=gen).to(dtype).to(device) for _ in range(3))
        view = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=chunk * step,
                                             cache_head_start=head_start if hin != H else None)  # fmt: skip
    plan = newest_view_plan(c)  # the last view's plan
    args = AttendArgs(q, page_io(c).rows, *plan_sources(page_io(c), plan), head_start, plan.tokens, D**-0.5)
    return c, view, q, args


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


# ------------------------------------------------------------------------------------------ pure torch (no triton)
@pytest.mark.parametrize("quant", ["off", "int2"])
def test_split_reference_merges_to_one_pass(quant):
    """Partials of any S merged by log-sum-exp (fp64) equal one fp64 softmax over the whole view (rounding only)."""
    _, view, q, a = filled_cache(QUANTS[quant], torch.bfloat16, sink=24)
    assert a.runs is not None or a.plan_index is not None
    kv = expand_rows(a.rows, a.plan_index, a.runs, a.packed, a.fmt, 0, 3, 1, a.n_keys).double()
    want = sdpa(q.double(), kv[0], kv[1])
    assert torch.equal(kv[0].to(view.k.dtype), view.k) and torch.equal(kv[1].to(view.v.dtype), view.v)
    for s in (1, 2, 3, 5, 7, a.n_keys, a.n_keys + 3):
        got = asp.merge_partials_torch(*asp.attend_partials_torch(a, s), torch.float64)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), s
    assert torch.equal(asp.attend_split_torch(a, 3), attend_runs_torch(a))  # bf16 outputs: the same rounding


def test_split_keys_cover_the_keys_without_empty_ranges():
    for n in (1, 2, 7, 80, 81, 1000):
        for s in (1, 2, 3, 5, 7, 64, 2000):
            c, k = asp.split_keys(n, s)
            assert k <= min(s, n) and (k - 1) * c < n <= k * c, (n, s, c, k)
    with pytest.raises(ValueError, match="splits=0"):
        asp.split_keys(10, 0)


def test_choose_splits_model():
    """One launch at LingBot-World's full chunk (40 or 20 heads, 18- and 96-frame windows: 11-22 waves on 132
    SMs); splits for short queries over long windows; the caps hold; too few keys never split."""
    for heads in (40, 20):
        for keys in (21 * 1560, 99 * 1560):
            for bn in (64, 32):
                assert asp.choose_splits(74, heads, keys, 132, bn) == 1
    assert asp.choose_splits(1, 20, 99 * 1560, 132, 64) > 1
    assert asp.choose_splits(1, 1, 2 * asp.MIN_SPLIT_KEYS - 1, 132, 64) == 1
    for qb, h, t in ((1, 40, 32760), (2, 8, 20000), (1, 1, 10**6), (3, 20, 150000)):
        s = asp.choose_splits(qb, h, t, 132, 64)
        assert 1 <= s <= asp.MAX_SPLITS and qb * h * s <= max(qb * h, asp.MAX_SPLIT_PROGRAMS)
        assert s == 1 or t // s >= asp.MIN_SPLIT_KEYS
        if s > 1:
            one = asp.split_cost(qb * h, t, 1, 132, 64)
            assert asp.split_cost(qb * h, t, s, 132, 64) <= asp.SPLIT_GAIN * one
    assert asp.sm_count(torch.device("cpu")) == asp.DEFAULT_SM_COUNT


def test_split_scratch_bytes():
    assert asp.split_scratch_bytes(1, 1, 4680, 40, 128, torch.bfloat16) == 0
    assert asp.split_scratch_bytes(4, 2, 100, 20, 128, torch.bfloat16) == 4 * 2 * 100 * 20 * 130 * 4
    assert asp.split_scratch_bytes(3, 1, 64, 8, 64, torch.float32) == 3 * 64 * 8 * 66 * 8


def test_planner_pages_budget_counts_the_triton_path():
    """`plan --attention pages` budgets the larger of the CPU path's scratch and the Triton path's bytes per call
    (output + the picked split's partials): at LingBot-World's full chunk the CPU path's (the Triton path does not
    split), at the mini presets' short chunks the Triton path's at long windows (it splits); for any shape the
    Triton path stays within the output plus `MAX_SPLIT_PROGRAMS` partial tiles, whatever the window."""
    import dataclasses

    from pagedqvg.layout.attention_scratch import ATTN_TILE_TOKENS, attention_scratch_bytes, packed_decode_bytes
    from pagedqvg.planning.planner import Geometry
    from pagedqvg.planning.presets import PRESETS

    triton_larger = set()
    for name, w in PRESETS.items():
        g = dataclasses.replace(Geometry.from_workload(w), attention="pages")
        args = (g.batch_size, g.chunk_tokens, g.heads, g.head_dim, g.dtype)
        fmt = g.packed_format()
        scratch = attention_scratch_bytes(*args)  # the CPU path's (window-independent)
        if fmt is not None:
            scratch += packed_decode_bytes(g.batch_size, g.heads, g.head_dim, ATTN_TILE_TOKENS, fmt)
        for frames in (18, 96):
            keys = (w.sink_frames + frames) * w.tokens_per_frame
            triton = asp.triton_attend_bytes(*args, keys, packed=fmt is not None)
            assert g.transient_bytes(keys) == max(scratch, triton), (name, frames)
            if triton > scratch:
                triton_larger.add(name)
    assert "lingbot-world" not in triton_larger and "lingbot-world-mini" in triton_larger, triton_larger
    split_seen = False
    for tq in (1, 64, 256, 4680):
        for heads in (1, 8, 40):
            for keys in (100, 32760, 154440, 10**6):
                got = asp.triton_attend_bytes(1, tq, heads, 128, torch.bfloat16, keys, packed=False)
                out = tq * heads * 128 * 2
                assert got <= out + asp.MAX_SPLIT_PROGRAMS * asp.KERNEL_BLOCK_M * 130 * 4
                split_seen |= got > out
    assert split_seen


def test_forced_splits_setter(monkeypatch):
    monkeypatch.delenv("PAGEDQVG_ATTN_SPLITS", raising=False)
    try:
        asp.set_forced_splits(4)
        assert asp.forced_splits() == 4
        monkeypatch.setenv("PAGEDQVG_ATTN_SPLITS", "2")
        assert asp.forced_splits() == 4  # the setter overrides the variable
        asp.set_forced_splits(None)
        assert asp.forced_splits() is None
        for bad in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match="splits="):
                asp.set_forced_splits(bad)
        asp.set_forced_splits(None, from_env=True)
        assert asp.forced_splits() == 2  # the variable, read at call time
        monkeypatch.setenv("PAGEDQVG_ATTN_SPLITS", "")
        assert asp.forced_splits() is None
        monkeypatch.setenv("PAGEDQVG_ATTN_SPLITS", "x")
        with pytest.raises(ValueError, match="PAGEDQVG_ATTN_SPLITS='x'"):
            asp.forced_splits()
    finally:
        asp.set_forced_splits(None, from_env=True)


# ------------------------------------------------------------------------------------------- Triton (interpreter)
def check_bound(out, view, q):
    ref = sdpa(q.double(), view.k.double(), view.v.double())
    e_sdpa = (sdpa(q, view.k, view.v).double() - ref).norm().item()
    e_ours = (out.double() - ref).norm().item()
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert_attention_within_bound(out, q, view.k, view.v, exact=ref)  # the proven bound (tests/float_bounds.py)
    del e_sdpa, e_ours


def check_partial_counts(a, splits, block_n):
    """Zero query: every partial has m = 0 and l = its range's key count, exactly."""
    a0 = a._replace(query=torch.zeros_like(a.query))
    out = torch.empty_like(a0.query)
    partials, _merge, scratch = tas.attend_split_launch(a0, out, splits, block_n=block_n)
    tas.launch_on_device("attention split", partials)
    c, s = asp.split_keys(a.n_keys, splits)
    B, Tq, hin, D = a.query.shape
    ml = scratch[s * B * hin * Tq * D :].view(s, B * hin, 2, Tq)
    counts = torch.tensor([min(c, a.n_keys - i * c) for i in range(s)], dtype=ml.dtype)
    assert torch.equal(ml[:, :, 0], torch.zeros_like(ml[:, :, 0])), ml[:, :, 0]
    assert torch.equal(ml[:, :, 1], counts[:, None, None].expand(s, B * hin, Tq)), (ml[:, :, 1], counts)
    assert scratch.numel() * scratch.element_size() == asp.split_scratch_bytes(s, B, Tq, hin, D, a.query.dtype)


CASES = [("off", torch.bfloat16, 3, 0), ("off", torch.float32, 3, 0), ("int2", torch.bfloat16, 2, 1),
         ("compact", torch.bfloat16, 3, 0)]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize(("quant", "dtype", "hin", "head_start"), CASES,
                         ids=[f"{q}-{str(d)[6:]}-h{h}@{s}" for q, d, h, s in CASES])  # fmt: skip
def test_split_kernel_matches_view_sdpa(quant, dtype, hin, head_start):
    """S in {1, 2, 3, 7} on one cache's plan (64 keys; quant off: a row index; int2 / compact: a run table of
    16-token packed and dense runs, which S = 3 and 7 cut mid-run; 16-row key blocks): within the bound; the
    partials' key counts exact; S = 1 is the one-launch kernel (the auto pick at this size: the same output)."""
    _, view, q, a = filled_cache(QUANTS[quant], dtype, hin=hin, head_start=head_start, device=DEVICE)
    assert (a.packed is not None) == (quant != "off")
    outs = {}
    for s in (1, 2, 3, 7):
        out = torch.empty_like(q)
        attend_triton(a, out, splits=s, block_n=16)
        check_bound(out, view, q)
        outs[s] = out
        if s > 1 and dtype == torch.bfloat16:
            check_partial_counts(a, s, 16)
    auto = torch.empty_like(q)
    attend_triton(a, auto, block_n=16)
    assert torch.equal(auto, outs[1])


@needs_kernels
def test_split_kernel_zero_runs_and_row_index():
    """A sink longer than the slots filled: dense runs and a 3-row zero run (12 keys; S = 6 cuts the zero run,
    S = 3 a dense run); and a dense row-index plan."""
    _, view, q, a = filled_cache(None, torch.bfloat16, H=2, D=16, chunk=3, chunks=5, sink=12, window=8, steps=3,
                                 device=DEVICE)  # fmt: skip
    assert a.runs is not None and int((a.runs[:, 0] == 2).sum()) > 0
    for s in (2, 3, 6):
        out = torch.empty_like(q)
        attend_triton(a, out, splits=s, block_n=16)
        check_bound(out, view, q)
        check_partial_counts(a, s, 16)
    _, view, q, a = filled_cache(None, torch.bfloat16, H=2, D=16, chunk=8, chunks=3, sink=0, steps=2, device=DEVICE)
    assert a.plan_index is not None
    for s in (2, 3):
        out = torch.empty_like(q)
        attend_triton(a, out, splits=s, block_n=16)
        check_bound(out, view, q)
        check_partial_counts(a, s, 16)


@needs_kernels
def test_split_grid_checked_before_launch():
    """Both launches go through `launch_on_device`: a split axis past CUDA's 65,535 raises `GridLimitError` naming
    the op before anything runs (meta tensors: nothing allocated, nothing launched)."""
    from pagedqvg.kernels.triton_common import GridLimitError

    meta = torch.device("meta")
    q = torch.empty(1, 8, 2, 16, dtype=torch.bfloat16, device=meta)
    rows = torch.empty(4, 64, 2, 16, dtype=torch.bfloat16, device=meta)
    idx = torch.empty(2, 1, 70000, dtype=torch.int64, device=meta)
    a = AttendArgs(q, rows, (idx, idx), None, None, None, 0, 70000, 0.25)
    with pytest.raises(GridLimitError, match="attention split: grid axis z needs 70000 programs"):
        tas.attend_split_triton(a, torch.empty_like(q), 70000)


@needs_kernels
def test_kernel_blocks_mirrored():
    from pagedqvg.kernels.attention import triton_attention as ta

    assert (ta.BLOCK_M, ta.BLOCK_N, ta.BLOCK_N_PACKED) == (asp.KERNEL_BLOCK_M, asp.KERNEL_BLOCK_N,
                                                          asp.KERNEL_BLOCK_N_PACKED)  # fmt: skip


@needs_kernels
def test_update_and_attend_through_forced_splits(monkeypatch):
    """`update_and_attend` on the Triton backend with `set_forced_splits(3)`: the split launches, within the
    bound against a torch-backend twin's view (two query blocks: 70 queries)."""
    monkeypatch.setattr(asp, "_forced", [3])
    a_cache, *_ = filled_cache(None, torch.bfloat16, H=2, D=16, chunk=16, steps=1, monkeypatch=monkeypatch)
    b_cache, *_ = filled_cache(None, torch.bfloat16, H=2, D=16, chunk=16, steps=1, monkeypatch=monkeypatch,
                               backend="triton", device=DEVICE)  # fmt: skip
    assert page_io(b_cache).backend == "triton" and page_io(a_cache).backend == "torch"
    gen = torch.Generator().manual_seed(9)
    k, v = (torch.randn(1, 16, 2, 16, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(1, 70, 2, 16, generator=gen).bfloat16()
    view = a_cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=16)
    out = b_cache.update_and_attend(q, key=k, value=v, current_chunk_start=16)
    check_bound(out, view, q)
    assert tas.auto_splits(AttendArgs(q, None, None, None, None, None, 0, 100, 1.0)) == 3


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
