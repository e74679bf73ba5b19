"""pagedqvg/env.py (every library environment switch, one function each, read at call time), the debug switch
(`PAGEDQVG_DEBUG`, read once at import; `set_debug_checks` at run time; the old alias `PAGEDQVG_KERNEL_CHECKS` no
longer read), and attention through the one dispatch point (`dispatch.attend`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import clean_env, newest_view_plan, page_io

from pagedqvg import BlockPool, PagedCausalKVCache, env
from pagedqvg.attention.pages import plan_sources
from pagedqvg.kernels import dispatch
from pagedqvg.kernels.attention.attention_runs import attend_runs_torch
from pagedqvg.kernels.ops import AttendArgs


def test_kernels_switch_is_read_at_call_time(monkeypatch):
    monkeypatch.delenv("PAGEDQVG_KERNELS", raising=False)
    assert env.kernels() == "auto"
    for raw, want in (("", "auto"), (" Torch ", "torch"), ("TRITON", "triton"), ("auto", "auto")):
        monkeypatch.setenv("PAGEDQVG_KERNELS", raw)
        assert env.kernels() == want
    monkeypatch.setenv("PAGEDQVG_KERNELS", "gpu")
    with pytest.raises(ValueError, match=r"PAGEDQVG_KERNELS='gpu' is not one of \('auto', 'torch', 'triton'\)"):
        env.kernels()


def test_debug_and_splits_switches(monkeypatch):
    for raw, want in (("1", True), (" 1", True), ("0", False), ("yes", False), ("", False)):
        monkeypatch.setenv("PAGEDQVG_DEBUG", raw)
        assert env.debug() is want
    monkeypatch.delenv("PAGEDQVG_DEBUG")
    assert env.debug() is False
    monkeypatch.delenv("PAGEDQVG_ATTN_SPLITS", raising=False)
    assert env.attn_splits() is None
    for raw, want in (("1", 1), (" 8 ", 8), ("", None)):
        monkeypatch.setenv("PAGEDQVG_ATTN_SPLITS", raw)
        assert env.attn_splits() == want
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("PAGEDQVG_ATTN_SPLITS", bad)
        with pytest.raises(ValueError, match=f"PAGEDQVG_ATTN_SPLITS='{bad}': must be an integer >= 1"):
            env.attn_splits()


def test_the_table_lists_every_switch_the_library_reads():
    """env.py's docstring table names each variable that pagedqvg/ (the SGLang integration's own aside) reads."""
    doc = env.__doc__
    assert doc is not None
    for name in ("PAGEDQVG_KERNELS", "PAGEDQVG_DEBUG", "PAGEDQVG_ATTN_SPLITS", "TRITON_INTERPRET"):
        assert f"| `{name}` |" in doc, name
    assert "`PAGEDQVG_KERNEL_CHECKS`" in doc and "no longer read" in doc


@pytest.mark.parametrize(("variables", "on"), [({"PAGEDQVG_DEBUG": "1"}, True), ({}, False),
                                               ({"PAGEDQVG_KERNEL_CHECKS": "1"}, False)])  # fmt: skip
def test_debug_switch_read_once_at_import(variables, on):
    """A fresh interpreter: on with PAGEDQVG_DEBUG=1, off without it (the dropped alias turns nothing on); changing
    the variable later changes nothing, `set_debug_checks` does and returns the previous setting."""
    code = (
        "import os, pagedqvg\n"
        "first = pagedqvg.debug_checks()\n"
        "os.environ['PAGEDQVG_DEBUG'] = '0' if first else '1'\n"
        "second = pagedqvg.debug_checks()\n"
        "previous = pagedqvg.set_debug_checks(not first)\n"
        "print(first, second, previous, pagedqvg.debug_checks())\n"
    )
    base = {k: v for k, v in clean_env().items() if k not in ("PAGEDQVG_DEBUG", "PAGEDQVG_KERNEL_CHECKS")}
    proc = subprocess.run([sys.executable, "-c", code], env=base | variables, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(on), str(on), str(on), str(not on)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_attend_torch_is_the_reference(monkeypatch, dtype):
    """`dispatch.attend` on the torch backend is `attend_runs_torch` (bit for bit), writes `out` when given, and
    equals fp64 attention over the materialized view within the one rounding of its output to `dtype`."""
    monkeypatch.setenv("PAGEDQVG_KERNELS", "torch")
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=4096)
    cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=24, num_heads=2, head_dim=16, dtype=dtype,
                               device="cpu", sink_tokens=4)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    for s in range(0, 30, 6):
        k, v = (torch.randn(1, 6, 2, 16, generator=gen).to(dtype) for _ in range(2))
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    q = torch.randn(1, 5, 2, 16, generator=gen).to(dtype)
    plan, io = newest_view_plan(cache), page_io(cache)
    a = AttendArgs(q, io.rows, *plan_sources(io, plan), 0, plan.tokens, 0.25)
    got = dispatch.attend(a)
    assert torch.equal(got, attend_runs_torch(a))
    out = torch.full_like(q, float("nan"))
    assert dispatch.attend(a, out=out) is out and torch.equal(out, got)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), view.k.double().transpose(1, 2), view.v.double().transpose(1, 2), scale=0.25
    ).transpose(1, 2)
    ulp = torch.finfo(dtype).eps  # one rounding to dtype: at most half an ulp of |ref| (+ fp64's own error)
    assert float(((got.double() - ref).abs() - ref.abs() * ulp).max()) <= 1e-12
    cache.close()
