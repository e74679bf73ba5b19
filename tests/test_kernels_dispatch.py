"""The kernel dispatch point: backend choice and the opt-in index checks of Triton launches."""

from __future__ import annotations

import pytest
import torch
from helpers import bits, make_rows, random_bits, unique_rows

from pagedqvg import debug
from pagedqvg.kernels import dispatch


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("PAGEDQVG_KERNELS", "auto")
    assert dispatch.kernel_backend("cpu") == "torch"
    monkeypatch.setenv("PAGEDQVG_KERNELS", "torch")
    assert dispatch.kernel_backend("cpu") == "torch"
    monkeypatch.setenv("PAGEDQVG_KERNELS", "triton")
    assert dispatch.kernel_backend("cpu") == "triton"
    monkeypatch.setenv("PAGEDQVG_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="'cuda-please' is not one of"):
        dispatch.kernel_backend("cpu")


def test_index_checks_name_the_bad_range(debug_on):
    rows = torch.zeros(3, 4, 1, 2)  # 3 pages x 4 row slots
    ok_pages, ok_slots = torch.tensor([[[0, 2]]]), torch.tensor([[[3, 0]]])
    dispatch._check_rows(rows, ok_pages, ok_slots)
    with pytest.raises(IndexError, match=r"slot index out of range: 0..4, valid 0..3"):
        dispatch._check_rows(rows, ok_pages, torch.tensor([[[4, 0]]]))
    with pytest.raises(IndexError, match=r"page index out of range: -1..2, valid 0..2"):
        dispatch._check_rows(rows, torch.tensor([[[-1, 2]]]), ok_slots)
    debug.set_debug_checks(False)  # the fixture restores the suite's setting
    dispatch._check_rows(rows, ok_pages, torch.tensor([[[4, 0]]]))  # off by default: no host sync


def test_kernels_package_exports_no_name_of_a_submodule():
    """`pagedqvg.kernels.<name>` must be the submodule `<name>.py` whenever one exists: re-exporting a function
    called like a submodule (it was `page_write`, `view_build`) makes `import pagedqvg.kernels.write.page_write` and
    `from pagedqvg.kernels import page_write` give different kinds of object."""
    import importlib
    import pkgutil
    import types

    import pagedqvg.kernels as kernels

    submodules = {m.name for m in pkgutil.iter_modules(kernels.__path__)}
    assert {"dispatch", "write", "view", "pack", "attention"} <= submodules
    assert set(kernels.__all__) == {"kernel_backend", "triton_available"}
    assert not set(kernels.__all__) & submodules
    clashes = {
        name: type(value).__name__
        for name, value in vars(kernels).items()
        if name in submodules and not isinstance(value, types.ModuleType)
    }
    assert clashes == {}
    for name in ("dispatch", "write", "view", "pack", "attention", "rows"):
        module = importlib.import_module(f"pagedqvg.kernels.{name}")
        assert getattr(kernels, name) is module
    assert kernels.kernel_backend is dispatch.kernel_backend and kernels.triton_available is dispatch.triton_available


def test_kernel_backend_choices(monkeypatch):
    monkeypatch.delenv("PAGEDQVG_KERNELS", raising=False)
    assert dispatch.kernel_backend(torch.device("cpu")) == "torch"
    assert dispatch.kernel_backend("cpu") == "torch"
    if dispatch.triton_available():
        assert dispatch.kernel_backend(torch.device("cuda")) == "triton"
    else:  # auto: CUDA tensors fall back to torch, with a warning naming the import error (once per process)
        dispatch._warn_fallback.cache_clear()
        with pytest.warns(RuntimeWarning, match=r"Triton kernels unavailable \(.+\); CUDA tensors use the slower"):
            assert dispatch.kernel_backend(torch.device("cuda")) == "torch"
    for forced in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", forced.upper())
        assert dispatch.kernel_backend(torch.device("cpu")) == forced
        assert dispatch.kernel_backend(torch.device("cuda")) == forced
    monkeypatch.setenv("PAGEDQVG_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGEDQVG_KERNELS"):
        dispatch.kernel_backend(torch.device("cpu"))


def test_torch_backend_never_touches_triton(monkeypatch):
    """With PAGEDQVG_KERNELS=torch the torch references run (no interpreter needed)."""
    monkeypatch.setenv("PAGEDQVG_KERNELS", "torch")
    gen = torch.Generator().manual_seed(5)
    _, rows = make_rows(3, 3, 2, 16, torch.float16, gen)
    pidx, sidx = unique_rows(3, 3, 1, 2, gen)
    key = random_bits((1, 2, 2, 16), torch.float16, gen)
    dispatch.page_write(rows, pidx, sidx, 0, key, key)
    out = torch.empty(2, 1, 2, 2, 16, dtype=torch.float16)
    dispatch.view_build(rows, pidx, sidx, 0, 2, out)
    assert torch.equal(bits(out[0]), bits(key)) and torch.equal(bits(out[1]), bits(key))
