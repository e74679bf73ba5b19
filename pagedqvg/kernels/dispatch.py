"""The single dispatch point between the cache and the kernels.

Backend per call, from the device of the tensors and `PAGEDQVG_KERNELS` (read by `pagedqvg.env.kernels`):

- `auto` (default): CUDA tensors → Triton when `import triton` works, else torch; every other device → torch.
- `torch`: torch everywhere.
- `triton`: Triton everywhere. Tensors that are not on CUDA need Triton's interpreter, i.e. `TRITON_INTERPRET=1` in
  the environment *before* triton and the kernel modules are imported (triton reads it when it decorates kernels);
  otherwise the call raises a RuntimeError that says so.

Triton is imported lazily (on the first Triton call), so `import pagedqvg` never imports triton. When `auto` cannot
import the kernels for CUDA tensors it warns once (with the import error) and uses torch. Triton is a dependency only
on Linux x86_64 / aarch64 (where it has wheels); without it every device uses the torch path, and
`PAGEDQVG_KERNELS=triton` raises a RuntimeError that says to install it.

The debug switch (`pagedqvg.debug`: `PAGEDQVG_DEBUG=1` at import, or `set_debug_checks(True)`) makes every Triton
launch check its row indices on the host first (an IndexError naming the bad value, like the torch references raise;
costs a device sync per launch — for tests and debugging). The torch
references check index ranges under the same switch only.

Each op takes an optional `backend` ("torch" or "triton"): callers that resolved it once (`page_io.PageIO`, at
construction) pass it, so a repeated call reads no environment variable; None resolves it per call.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from functools import cache
from types import SimpleNamespace

import torch

from pagedqvg.debug import debug_checks
from pagedqvg.env import kernels as kernels_from_env
from pagedqvg.kernels.attention.attention_runs import attend_runs_torch
from pagedqvg.kernels.ops import (
    AttendArgs,
    KmeansAssignArgs,
    KmeansUpdateArgs,
    PackedDequantArgs,
    PageFillArgs,
    PageWriteArgs,
    ResidualPackArgs,
    ViewBuildArgs,
    ViewRunsArgs,
    op_entry,
)
from pagedqvg.kernels.pack.kmeans import kmeans_assign_torch, kmeans_update_torch
from pagedqvg.kernels.pack.residual_pack import residual_pack_torch
from pagedqvg.kernels.view.dequant import packed_dequant_torch
from pagedqvg.kernels.view.view_build import view_build_torch
from pagedqvg.kernels.view.view_runs import check_run_values, view_runs_torch
from pagedqvg.kernels.write.page_write import page_fill_torch, page_write_torch

#: The Triton kernel modules; all import, or the Triton backend is unavailable (auto falls back to torch).
_TRITON_MODULES = (
    "write.triton_page_write", "view.triton_view_build", "view.triton_view_runs", "view.triton_dequant",
    "pack.triton_kmeans", "pack.triton_residual_pack", "attention.triton_attention", "attention.triton_attention_split",
)  # fmt: skip


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
    choice = kernels_from_env()
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
    from pagedqvg.kernels.view.triton_view_build import kernels_interpreted

    if device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"Triton kernels on {device.type} tensors run in Triton's interpreter, which needs TRITON_INTERPRET=1 in "
            f"the environment before triton and pagedqvg's Triton kernels are imported; set it at process start, "
            f"or set PAGEDQVG_KERNELS=torch (or auto) for {device.type} tensors"
        )
    modules = {name.rpartition(".")[2]: sys.modules[f"{__package__}.{name}"] for name in _TRITON_MODULES}
    return SimpleNamespace(**modules)


@op_entry(PageWriteArgs)
def page_write(a: PageWriteArgs, backend: str | None = None, halves=None) -> None:
    """Scatter key/value into token rows (see page_write.py); `halves`: the torch reference's split index, kept by
    the caller."""
    if (backend or kernel_backend(a.rows.device)) == "triton":
        _check_rows(a.rows, a.page_idx, a.slot_idx)
        _triton(a.rows.device).triton_page_write.page_write_triton(a)
    else:
        page_write_torch(a, halves)


@op_entry(PageFillArgs)
def page_fill(a: PageFillArgs, backend: str | None = None) -> None:
    """Fill every head of the addressed token rows."""
    if (backend or kernel_backend(a.rows.device)) == "triton":
        _check_rows(a.rows, a.page_idx, a.slot_idx)
        _triton(a.rows.device).triton_page_write.page_fill_triton(a)
    else:
        page_fill_torch(a)


@op_entry(ViewBuildArgs)
def view_build(a: ViewBuildArgs, backend: str | None = None, gather=None):
    """Gather visible token rows into `out` (see view_build.py); `gather`: the torch reference's `gather_plan`,
    kept by the caller."""
    if (backend or kernel_backend(a.rows.device)) == "triton":
        _check_rows(a.rows, a.page_idx, a.slot_idx)
        return _triton(a.rows.device).triton_view_build.view_build_triton(a)
    return view_build_torch(a, gather)


@op_entry(PackedDequantArgs)
def packed_dequant(a: PackedDequantArgs) -> None:
    """Dequantize pieces of packed segments straight from their pages into `out_t` (see dequant.py)."""
    if kernel_backend(a.out_t.device) == "triton":
        pieces = a.pieces
        if debug_checks() and pieces.numel():
            first, count = pieces[:, 1], pieces[:, 2]
            if int(pieces[:, 0].max()) >= a.tokens.shape[0] or int((first + count).max()) > a.tokens.shape[1]:
                raise IndexError(f"packed piece table leaves the token pages: {pieces.tolist()}")
            if int(a.cb_pages.max()) >= a.codebooks.shape[0]:
                raise IndexError(
                    f"codebook page out of range: {a.cb_pages.tolist()} (pages: {a.codebooks.shape[0]})"
                )
        _triton(a.out_t.device).triton_dequant.packed_dequant_triton(a)
    else:
        packed_dequant_torch(a)


@op_entry(KmeansAssignArgs)
def kmeans_assign(a: KmeansAssignArgs):
    """Nearest-centroid ids int64 [H, S] of x [H, S, D] among c [H, K, D] (see kmeans.py; Triton may differ from
    torch on near-ties only)."""
    if kernel_backend(a.x.device) == "triton":
        return _triton(a.x.device).triton_kmeans.kmeans_assign_triton(a)
    return kmeans_assign_torch(a)


@op_entry(KmeansUpdateArgs)
def kmeans_update(a: KmeansUpdateArgs):
    """Cluster means float32 [H, K, D] of x [H, S, D] by ids int64 [H, S]; empty clusters keep c_old (see kmeans.py;
    Triton sums in another fixed order: equal within the bound in kernels/kmeans.py)."""
    if kernel_backend(a.x.device) == "triton":
        ids, k = a.ids, a.c_old.shape[1]
        if debug_checks() and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= k:
                raise IndexError(f"centroid id out of range: {lo}..{hi}, valid 0..{k - 1}")
        return _triton(a.x.device).triton_kmeans.kmeans_update_triton(a)
    return kmeans_update_torch(a)


@op_entry(ResidualPackArgs)
def residual_pack(a: ResidualPackArgs) -> None:
    """Block-quantize PRQ's final residual and write packed records to (page, slot) token slots (see
    residual_pack.py). Same bytes on both backends."""
    if kernel_backend(a.dest.device) == "triton":
        _check_rows(a.dest, a.page_idx, a.slot_idx)
        _triton(a.dest.device).triton_residual_pack.residual_pack_triton(a)
    else:
        residual_pack_torch(a)


@op_entry(ViewRunsArgs)
def view_runs(a: ViewRunsArgs, backend: str | None = None, torch_plan=None) -> None:
    """A whole mixed view from its run table: dense rows copied, packed rows dequantized, zero rows (see
    view_runs.py); K and V of every run in one Triton launch. `tokens`/`codebooks`/`cb_pages`/`fmt` are None for a
    cache without packed segments; `torch_plan`: the torch reference's `runs_torch_plan`, kept by the caller."""
    if (backend or kernel_backend(a.out_t.device)) == "triton":
        if debug_checks():
            check_run_values(a)
        _triton(a.out_t.device).triton_view_runs.view_runs_triton(a)
    else:
        view_runs_torch(a, torch_plan)


@op_entry(AttendArgs)
def attend(a: AttendArgs, backend: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`softmax(query·kᵀ·scale)·v` over a view plan's rows, straight from pages (see ops.AttendArgs): Triton's
    attention kernel (kernels/attention/triton_attention_split.py: one launch, or the split-KV pair), or the torch
    reference `attend_runs_torch` (fp64, expands the view: for tests; the CPU fast path is the tiled
    `pagedqvg.attention.pages.attend_pages`). Writes `out` `[B, Tq, hin, D]` when given (else a new tensor of the
    query's shape and dtype) and returns it."""
    if (backend or kernel_backend(a.query.device)) == "triton":
        if a.plan_index is not None:  # under the debug switch: the row index stays inside the pages
            _check_rows(a.rows, a.plan_index[0], a.plan_index[1])
        if out is None:
            out = torch.empty(a.query.shape, dtype=a.query.dtype, device=a.query.device)
        _triton(a.query.device).triton_attention_split.attend_triton(a, out)
        return out
    result = attend_runs_torch(a)
    if out is None:
        return result
    return out.copy_(result)
