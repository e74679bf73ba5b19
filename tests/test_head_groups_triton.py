"""Attention mode `heads` on the Triton backend: every group runs the whole-head plan itself (the kernels take the
head range as an argument; attention/head_groups.py), so `update_and_attend_heads` equals `view` mode bit for bit
there too: quant off, int2 and the recommended tiers; groups of 1 and 4 of 6 heads; a head slice. Without CUDA the
kernels run in Triton's interpreter (helpers.py sets TRITON_INTERPRET before triton imports)."""

from __future__ import annotations

import pytest
import torch
from helpers import cached_plans, page_io, rerun_interpreted, triton_kernels  # sets TRITON_INTERPRET
from test_head_groups import CHUNK, call, make_cache

from pagedqvg.attention.head_groups import GroupPlans

tvr, TRITON_ERROR, DEVICE, WHY = triton_kernels("view.triton_view_runs", "_view_runs_kernel")
ON_CUDA = "compiled Triton (CUDA): these caches are on CPU; benchmarks/heads_cuda_section.py checks CUDA"
needs_kernels = pytest.mark.skipif(DEVICE is None or DEVICE.type != "cpu", reason=WHY or ON_CUDA)


@needs_kernels
@pytest.mark.parametrize("quant", ["off", "int2", "tiers"])
def test_heads_equal_view_mode_on_triton(monkeypatch, quant):
    monkeypatch.setenv("PAGEDQVG_KERNELS", "triton")
    cache, k, v, q = make_cache(quant, torch.float32)
    assert page_io(cache).backend == "triton"
    s = 4 * CHUNK
    for group in (1, 4):
        got = call(cache, "heads", k, v, q, s, head_group_size=group)
        assert torch.equal(got, call(cache, "view", k, v, q, s)), (quant, group)
    entry = next(p for p in cached_plans(page_io(cache)).values() if isinstance(p, GroupPlans))
    assert all(p is entry.plan for p in entry.plans)  # no per-group derivation: the whole-head plan itself
    got = call(cache, "heads", k, v, q, s, (1, 4), head_group_size=3)
    assert torch.equal(got, call(cache, "view", k, v, q, s, (1, 4)))


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None, reason="the kernels run in this process")
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
