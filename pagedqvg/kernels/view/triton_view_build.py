"""Triton view builder: the same signature and result as `view_build_torch`, K and V in one launch.

`out[kv, b, t] = rows[page_idx[kv, b, t], slot_idx[kv, b, t], head_start : head_start + Hin]` for an `out` of shape
`[2, B, T, Hin, D]`. The row index is the flat description of the view: one (page, slot) per output token row, in
view order, whatever segment each row comes from (see rows.py). Grid: `(cdiv(B * T, BLOCK_R),
cdiv(Hin, HEADS_PER_BLOCK), 2)`; program `(i, j, kv)` gathers flat rows `r = b * T + t` in
`[i * BLOCK_R, (i + 1) * BLOCK_R)`, heads `[j * HEADS_PER_BLOCK, ...)`, and writes them to `out`. A copy: bit-exact.

The cache uses this kernel for views of dense rows only (one range or several: their row indices concatenated).
Views that hold PRQ-packed segments or slots the cache never filled (zeros) go through the mixed view build
instead (view_runs.py, triton_view_runs.py): one launch over a run table that has a kind per run (dense / packed /
zero); its dense runs copy rows exactly like this kernel, its packed runs dequantize in registers
(`triton_dequant.packed_tile`).

Compile-time constants are the layer shape only; `num_rows`, `n_tokens` (T), `head_start` and `num_heads_in` are
runtime and not specialized on, so the view length never triggers a recompile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedqvg.kernels.ops import ViewBuildArgs, op_entry
from pagedqvg.kernels.triton_common import NUM_WARPS, cdiv, is_interpreted, launch_on_device, tile_for
from pagedqvg.kernels.triton_tile import row_tile

_RUNTIME = ["num_rows", "n_tokens", "head_start", "num_heads_in"]


@triton.jit(do_not_specialize=_RUNTIME)
def _view_build_kernel(
    rows_ptr, rs0, rs1, rs2, rs3,  # [num_pages, rows_per_page, H, D]
    page_idx_ptr, slot_idx_ptr,  # int64 [2, num_rows], contiguous
    out_ptr, os0, os1, os2, os3, os4,  # [2, B, T, Hin, D]
    num_rows, n_tokens, head_start, num_heads_in,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr,
):  # fmt: skip
    kv = tl.program_id(2)
    r, page, slot, h, d, mask = row_tile(
        page_idx_ptr, slot_idx_ptr, kv.to(tl.int64) * num_rows, num_rows, num_heads_in,
        HEAD_DIM, BLOCK_R, BLOCK_D, HEADS_PER_BLOCK,
    )  # fmt: skip
    b = (r // n_tokens).to(tl.int64)
    t = (r % n_tokens).to(tl.int64)

    # Dense source rows (packed rows: triton_view_runs.py).
    src = rows_ptr + (page * rs0 + slot * rs1)[:, None] + ((head_start + h) * rs2 + d * rs3)[None, :]
    vals = tl.load(src, mask=mask)

    dst = out_ptr + kv.to(tl.int64) * os0 + (b * os1 + t * os2)[:, None] + (h * os3 + d * os4)[None, :]
    tl.store(dst, vals, mask=mask)


@op_entry(ViewBuildArgs)
def view_build_launch(a: ViewBuildArgs, *, block_rows: int | None = None, block_cols: int | None = None):
    """`(kernel, grid, args, kwargs)` of the view build launch, or None when the view is empty."""
    rows, page_idx, slot_idx, head_start, num_heads, out = (
        a.rows, a.page_idx, a.slot_idx, a.head_start, a.num_heads, a.out
    )  # fmt: skip
    if rows.dim() != 4:
        raise ValueError(f"rows must be [num_pages, rows_per_page, H, D], got shape {tuple(rows.shape)}")
    if page_idx.shape != slot_idx.shape or page_idx.dim() != 3 or page_idx.shape[0] != 2:
        raise ValueError(
            f"page_idx/slot_idx must both be [2, B, T], got {tuple(page_idx.shape)}/{tuple(slot_idx.shape)}"
        )
    if page_idx.dtype != torch.int64 or slot_idx.dtype != torch.int64:
        raise TypeError(f"page_idx/slot_idx must be int64, got {page_idx.dtype}/{slot_idx.dtype}")
    _, batch, tokens = page_idx.shape
    d = rows.shape[3]
    if tuple(out.shape) != (2, batch, tokens, num_heads, d):
        raise ValueError(f"out must be [2, {batch}, {tokens}, {num_heads}, {d}], got {tuple(out.shape)}")
    if out.dtype != rows.dtype:
        raise TypeError(f"out dtype {out.dtype} differs from the rows' {rows.dtype}")
    if head_start < 0 or head_start + num_heads > rows.shape[2]:
        raise ValueError(f"heads [{head_start}, {head_start + num_heads}) outside the rows' {rows.shape[2]} heads")
    num_rows = batch * tokens
    if num_rows == 0 or num_heads == 0:
        return None
    page_idx = page_idx.contiguous()
    slot_idx = slot_idx.contiguous()
    interpreted = is_interpreted(_view_build_kernel)
    tile = tile_for(d, rows.shape[2], block_rows, block_cols, interpreted=interpreted)
    grid = (cdiv(num_rows, tile.block_r), cdiv(num_heads, tile.heads_per_block), 2)
    args = (
        rows, *rows.stride(),
        page_idx, slot_idx,
        out, *out.stride(),
        num_rows, tokens, head_start, num_heads,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=d, BLOCK_R=tile.block_r, BLOCK_D=tile.block_d, HEADS_PER_BLOCK=tile.heads_per_block,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return _view_build_kernel, grid, args, kwargs


def kernels_interpreted() -> bool:
    """Whether this process's Triton kernels run in Triton's CPU interpreter (decided by `TRITON_INTERPRET` when the
    kernel modules were imported)."""
    return is_interpreted(_view_build_kernel)


@op_entry(ViewBuildArgs)
def view_build_triton(
    a: ViewBuildArgs, *, block_rows: int | None = None, block_cols: int | None = None
) -> torch.Tensor:
    """`view_build_torch` in one Triton launch (K and V). `block_rows`/`block_cols` override the tile (tests)."""
    launch_on_device("view_build", view_build_launch(a, block_rows=block_rows, block_cols=block_cols))
    return a.out
