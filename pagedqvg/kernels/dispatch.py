"""The single dispatch point between the cache and the kernels.

Backend per call, from the device of the tensors and `PAGEDQVG_KERNELS`:

- `auto` (default): CUDA tensors → Triton when `import triton` works, else torch; every other device → torch.
- `torch`: torch everywhere.
- `triton`: Triton everywhere. Tensors that are not on CUDA need Triton's interpreter, i.e. `TRITON_INTERPRET=1` in
  the environment *before* triton and the kernel modules are imported (triton reads it when it decorates kernels);
  otherwise the call raises a RuntimeError that says so.

Triton is imported lazily (on the first Triton call), so `import pagedqvg` never imports triton. When `auto` cannot
import the kernels for CUDA tensors it warns once (with the import error) and uses torch. Triton is a dependency only
on Linux x86_64 / aarch64 (where it has wheels); without it every device uses the torch path, and
`PAGEDQVG_KERNELS=triton` raises a RuntimeError that says to install it.

The debug switch (`pagedqvg.debug`: `PAGEDQVG_DEBUG=1` or `PAGEDQVG_KERNEL_CHECKS=1` at import, or
`set_debug_checks(True)`) makes every Triton launch check its row indices on the host first (an IndexError naming the
bad value, like the torch references raise; costs a device sync per launch — for tests and debugging). The torch
references check index ranges under the same switch only.

Each op takes an optional `backend` ("torch" or "triton"): callers that resolved it once (`page_io.PageIO`, at
construction) pass it, so a repeated call reads no environment variable; None resolves it per call.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from functools import cache
from types import SimpleNamespace

import torch

from ..debug import debug_checks
from .dequant import packed_dequant_torch
from .kmeans import kmeans_assign_torch, kmeans_update_torch
from .page_write import page_fill_torch, page_write_torch
from .residual_pack import residual_pack_torch
from .view_build import view_build_torch
from .view_runs import check_run_values, view_runs_torch

_VALID = ("auto", "torch", "triton")
#: The Triton kernel modules; all import, or the Triton backend is unavailable (auto falls back to torch).
_TRITON_MODULES = (
    "triton_page_write", "triton_view_build", "triton_view_runs", "triton_dequant", "triton_kmeans",
    "triton_residual_pack", "triton_attention",
)  # fmt: skip


def _choice() -> str:
    choice = os.environ.get("PAGEDQVG_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _VALID:
        raise ValueError(f"PAGEDQVG_KERNELS={choice!r} is not one of {_VALID}")
    return choice


@cache
def _triton_import_error() -> str | None:
    """None when the Triton kernel modules import, else why not (cached: one import attempt per process)."""
    try:
        for name in _TRITON_MODULES:
            importlib.import_module(f".{name}", __package__)
    except Exception as exc:  # ImportError, or a broken triton install failing at import
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """Whether the Triton kernels can be imported in this process."""
    return _triton_import_error() is None


def kernel_backend(device: torch.device | str) -> str:
    """'torch' or 'triton' for tensors on `device`, honouring the PAGEDQVG_KERNELS environment variable."""
    choice = _choice()
    if choice == "auto":
        if torch.device(device).type != "cuda":
            return "torch"
        if not triton_available():
            _warn_fallback()
            return "torch"
        return "triton"
    return choice


@cache
def _warn_fallback() -> None:
    warnings.warn(
        f"pagedqvg: Triton kernels unavailable ({_triton_import_error()}); CUDA tensors use the slower torch path",
        RuntimeWarning,
        stacklevel=3,
    )


def _check_rows(rows: torch.Tensor, page_idx: torch.Tensor, slot_idx: torch.Tensor) -> None:
    """Under the debug switch: the row indices a Triton launch will follow must lie inside `rows`."""
    if not debug_checks() or page_idx.numel() == 0:
        return
    for name, idx, bound in (("page", page_idx, rows.shape[0]), ("slot", slot_idx, rows.shape[1])):
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= bound:
            raise IndexError(f"{name} index out of range: {lo}..{hi}, valid 0..{bound - 1}")


def _triton(device: torch.device):
    """The Triton kernel modules (attributes named like `_TRITON_MODULES`), after checking they run on `device`."""
    err = _triton_import_error()
    if err is not None:
        raise RuntimeError(
            f"PAGEDQVG_KERNELS=triton but the Triton kernels cannot be imported ({err}); install triton or set "
            f"PAGEDQVG_KERNELS=torch"
        )
    from .triton_view_build import kernels_interpreted

    if device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"Triton kernels on {device.type} tensors run in Triton's interpreter, which needs TRITON_INTERPRET=1 in "
            f"the environment before triton and pagedqvg's Triton kernels are imported; set it at process start, "
            f"or set PAGEDQVG_KERNELS=torch (or auto) for {device.type} tensors"
        )
    return SimpleNamespace(**{name: sys.modules[f"{__package__}.{name}"] for name in _TRITON_MODULES})


def page_write(rows, page_idx, slot_idx, head_start, key, value, backend: str | None = None, halves=None) -> None:
    """Scatter key/value into token rows (see page_write.py); `halves`: the torch reference's split index, kept by
    the caller."""
    if (backend or kernel_backend(rows.device)) == "triton":
        _check_rows(rows, page_idx, slot_idx)
        _triton(rows.device).triton_page_write.page_write_triton(rows, page_idx, slot_idx, head_start, key, value)
    else:
        page_write_torch(rows, page_idx, slot_idx, head_start, key, value, halves)


def page_fill(rows, page_idx, slot_idx, fill: float = 0.0, backend: str | None = None) -> None:
    """Fill every head of the addressed token rows."""
    if (backend or kernel_backend(rows.device)) == "triton":
        _check_rows(rows, page_idx, slot_idx)
        _triton(rows.device).triton_page_write.page_fill_triton(rows, page_idx, slot_idx, fill)
    else:
        page_fill_torch(rows, page_idx, slot_idx, fill)


def view_build(rows, page_idx, slot_idx, head_start, num_heads, out, backend: str | None = None, gather=None):
    """Gather visible token rows into `out` (see view_build.py); `gather`: the torch reference's `gather_plan`,
    kept by the caller."""
    if (backend or kernel_backend(rows.device)) == "triton":
        _check_rows(rows, page_idx, slot_idx)
        kernels = _triton(rows.device).triton_view_build
        return kernels.view_build_triton(rows, page_idx, slot_idx, head_start, num_heads, out)
    return view_build_torch(rows, page_idx, slot_idx, head_start, num_heads, out, gather)


def packed_dequant(tokens, codebooks, pieces, cb_pages, head_start, out_t, fmt) -> None:
    """Dequantize pieces of packed segments straight from their pages into `out_t` (see dequant.py)."""
    if kernel_backend(out_t.device) == "triton":
        if debug_checks() and pieces.numel():
            first, count = pieces[:, 1], pieces[:, 2]
            if int(pieces[:, 0].max()) >= tokens.shape[0] or int((first + count).max()) > tokens.shape[1]:
                raise IndexError(f"packed piece table leaves the token pages: {pieces.tolist()}")
            if int(cb_pages.max()) >= codebooks.shape[0]:
                raise IndexError(f"codebook page out of range: {cb_pages.tolist()} (pages: {codebooks.shape[0]})")
        kernels = _triton(out_t.device).triton_dequant
        kernels.packed_dequant_triton(tokens, codebooks, pieces, cb_pages, head_start, out_t, fmt)
    else:
        packed_dequant_torch(tokens, codebooks, pieces, cb_pages, head_start, out_t, fmt)


def kmeans_assign(x, c):
    """Nearest-centroid ids int64 [H, S] of x [H, S, D] among c [H, K, D] (see kmeans.py; Triton may differ from
    torch on near-ties only)."""
    if kernel_backend(x.device) == "triton":
        return _triton(x.device).triton_kmeans.kmeans_assign_triton(x, c)
    return kmeans_assign_torch(x, c)


def kmeans_update(x, ids, c_old):
    """Cluster means float32 [H, K, D] of x [H, S, D] by ids int64 [H, S]; empty clusters keep c_old (see kmeans.py;
    Triton sums in another fixed order: equal within the bound in kernels/kmeans.py)."""
    if kernel_backend(x.device) == "triton":
        if debug_checks() and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= c_old.shape[1]:
                raise IndexError(f"centroid id out of range: {lo}..{hi}, valid 0..{c_old.shape[1] - 1}")
        return _triton(x.device).triton_kmeans.kmeans_update_triton(x, ids, c_old)
    return kmeans_update_torch(x, ids, c_old)


def residual_pack(resid, ids, dest, page_idx, slot_idx, fmt) -> None:
    """Block-quantize PRQ's final residual and write packed records to (page, slot) token slots (see
    residual_pack.py). Same bytes on both backends."""
    if kernel_backend(dest.device) == "triton":
        _check_rows(dest, page_idx, slot_idx)
        _triton(dest.device).triton_residual_pack.residual_pack_triton(resid, ids, dest, page_idx, slot_idx, fmt)
    else:
        residual_pack_torch(resid, ids, dest, page_idx, slot_idx, fmt)


def view_runs(
    rows, tokens, codebooks, cb_pages, runs, head_start, out_t, fmt, max_run=None, backend=None, torch_plan=None
) -> None:
    """A whole mixed view from its run table: dense rows copied, packed rows dequantized, zero rows (see
    view_runs.py); K and V of every run in one Triton launch. `tokens`/`codebooks`/`cb_pages`/`fmt` are None for a
    cache without packed segments; `torch_plan`: the torch reference's `runs_torch_plan`, kept by the caller."""
    if (backend or kernel_backend(out_t.device)) == "triton":
        if debug_checks():
            check_run_values(rows, tokens, codebooks, cb_pages, runs, out_t, fmt, max_run)
        _triton(out_t.device).triton_view_runs.view_runs_triton(
            rows, tokens, codebooks, cb_pages, runs, head_start, out_t, fmt, max_run
        )
    else:
        view_runs_torch(rows, tokens, codebooks, cb_pages, runs, head_start, out_t, fmt, max_run, torch_plan)
