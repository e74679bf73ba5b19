"""Triton page write and page fill: the same signatures and results as `page_write_torch` / `page_fill_torch`.

Page write scatters `key`/`value` `[B, n, Hin, D]` (any strides) into token rows `rows[page, slot, head_start + h]`
addressed by the row index `(page_idx, slot_idx)` `[2, B, n]` (see rows.py), K and V in one launch. Grid:
`(cdiv(B * n, BLOCK_R), cdiv(Hin, HEADS_PER_BLOCK), 2)`; program `(i, j, kv)` copies flat rows
`r = b * n + t` in `[i * BLOCK_R, (i + 1) * BLOCK_R)`, heads `[j * HEADS_PER_BLOCK, ...)`. It is a copy: loads and
stores of the cache dtype, no arithmetic on values, so it is bit-exact (NaN payloads and -0.0 included).

Compile-time constants are the layer shape only (`HEAD_DIM` and the tile); `num_rows`, `n_tokens`, `head_start` and
`num_heads_in` are runtime and not specialized on. Row offsets are int64 (an arena may exceed 2^31 elements).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from pagedqvg.kernels.ops import PageFillArgs, PageWriteArgs, op_entry
from pagedqvg.kernels.triton_common import NUM_WARPS, cdiv, is_interpreted, launch_on_device, tile_for
from pagedqvg.kernels.triton_tile import row_tile

_RUNTIME = ["num_rows", "n_tokens", "head_start", "num_heads_in"]


@triton.jit(do_not_specialize=_RUNTIME)
def _page_write_kernel(
    rows_ptr, rs0, rs1, rs2, rs3,  # [num_pages, rows_per_page, H, D]
    page_idx_ptr, slot_idx_ptr,  # int64 [2, num_rows], contiguous
    key_ptr, ks0, ks1, ks2, ks3,  # [B, n, Hin, D]
    value_ptr, vs0, vs1, vs2, vs3,  # [B, n, Hin, D]
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

    if kv == 0:
        src = key_ptr + (b * ks0 + t * ks1)[:, None] + (h * ks2 + d * ks3)[None, :]
        vals = tl.load(src, mask=mask)
    else:
        src = value_ptr + (b * vs0 + t * vs1)[:, None] + (h * vs2 + d * vs3)[None, :]
        vals = tl.load(src, mask=mask)

    dst = rows_ptr + (page * rs0 + slot * rs1)[:, None] + ((head_start + h) * rs2 + d * rs3)[None, :]
    tl.store(dst, vals, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _page_fill_kernel(
    rows_ptr, rs0, rs1, rs2, rs3,  # [num_pages, rows_per_page, H, D]
    page_idx_ptr, slot_idx_ptr,  # int64 [num_rows], contiguous
    fill_ptr,  # one element of the rows' dtype
    num_rows, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr,
):  # fmt: skip
    _, page, slot, h, d, mask = row_tile(
        page_idx_ptr, slot_idx_ptr, 0, num_rows, num_heads, HEAD_DIM, BLOCK_R, BLOCK_D, HEADS_PER_BLOCK
    )
    # The fill element splatted: its exact bits (no arithmetic, so -0.0 and NaN payloads survive).
    vals = tl.broadcast_to(tl.load(fill_ptr), [BLOCK_R, HEADS_PER_BLOCK * BLOCK_D])
    dst = rows_ptr + (page * rs0 + slot * rs1)[:, None] + (h * rs2 + d * rs3)[None, :]
    tl.store(dst, vals, mask=mask)


def _check_rows(rows: torch.Tensor) -> None:
    if rows.dim() != 4:
        raise ValueError(f"rows must be [num_pages, rows_per_page, H, D], got shape {tuple(rows.shape)}")


def _check_index(page_idx: torch.Tensor, slot_idx: torch.Tensor, rows: torch.Tensor) -> None:
    if page_idx.shape != slot_idx.shape:
        raise ValueError(f"page_idx {tuple(page_idx.shape)} and slot_idx {tuple(slot_idx.shape)} differ in shape")
    if page_idx.dtype != torch.int64 or slot_idx.dtype != torch.int64:
        raise TypeError(f"page_idx/slot_idx must be int64, got {page_idx.dtype}/{slot_idx.dtype}")
    if page_idx.device != rows.device or slot_idx.device != rows.device:
        raise ValueError(f"row index on {page_idx.device}/{slot_idx.device}, rows on {rows.device}")


@op_entry(PageWriteArgs)
def page_write_launch(a: PageWriteArgs, *, block_rows: int | None = None, block_cols: int | None = None):
    """`(kernel, grid, args, kwargs)` of the page write launch, or None when there is nothing to write."""
    rows, page_idx, slot_idx, head_start, key, value = a.rows, a.page_idx, a.slot_idx, a.head_start, a.key, a.value
    _check_rows(rows)
    _check_index(page_idx, slot_idx, rows)
    if key.shape != value.shape or key.dim() != 4:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be the same [B, n, Hin, D]")
    if key.dtype != rows.dtype or value.dtype != rows.dtype:
        raise TypeError(f"key/value dtype {key.dtype}/{value.dtype} differs from the rows' {rows.dtype}")
    batch, n, hin, d = key.shape
    if d != rows.shape[3] or head_start < 0 or head_start + hin > rows.shape[2]:
        raise ValueError(
            f"key [B={batch}, n={n}, Hin={hin}, D={d}] at head {head_start} does not fit rows {tuple(rows.shape)}"
        )
    if tuple(page_idx.shape) != (2, batch, n):
        raise ValueError(f"row index must be [2, {batch}, {n}], got {tuple(page_idx.shape)}")
    num_rows = batch * n
    if num_rows == 0 or hin == 0:
        return None
    page_idx = page_idx.contiguous()
    slot_idx = slot_idx.contiguous()
    tile = tile_for(d, rows.shape[2], block_rows, block_cols, interpreted=is_interpreted(_page_write_kernel))
    grid = (cdiv(num_rows, tile.block_r), cdiv(hin, tile.heads_per_block), 2)
    args = (
        rows, *rows.stride(),
        page_idx, slot_idx,
        key, *key.stride(),
        value, *value.stride(),
        num_rows, n, head_start, hin,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=d, BLOCK_R=tile.block_r, BLOCK_D=tile.block_d, HEADS_PER_BLOCK=tile.heads_per_block,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return _page_write_kernel, grid, args, kwargs


@op_entry(PageWriteArgs)
def page_write_triton(a: PageWriteArgs, *, block_rows: int | None = None, block_cols: int | None = None) -> None:
    """`page_write_torch` in one Triton launch (K and V). `block_rows`/`block_cols` override the tile (tests)."""
    launch_on_device("page_write", page_write_launch(a, block_rows=block_rows, block_cols=block_cols))


_FILL_CACHE: dict[tuple, torch.Tensor] = {}


def _fill_element(fill: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`fill` as one element of `dtype` on `device`, converted exactly as page_fill_torch converts it (cached)."""
    key = (struct.pack("<d", float(fill)), dtype, device)  # by bits: -0.0 and 0.0 are different fills
    t = _FILL_CACHE.get(key)
    if t is None:
        if len(_FILL_CACHE) > 64:
            _FILL_CACHE.clear()
        t = torch.tensor(fill, dtype=dtype, device=device).reshape(1)
        _FILL_CACHE[key] = t
    return t


@op_entry(PageFillArgs)
def page_fill_launch(a: PageFillArgs, *, block_rows: int | None = None, block_cols: int | None = None):
    """`(kernel, grid, args, kwargs)` of the page fill launch, or None when there is nothing to fill."""
    rows, page_idx, slot_idx, fill = a.rows, a.page_idx, a.slot_idx, a.fill
    _check_rows(rows)
    _check_index(page_idx, slot_idx, rows)
    num_rows = page_idx.numel()
    if num_rows == 0:
        return None
    page_idx = page_idx.reshape(-1).contiguous()
    slot_idx = slot_idx.reshape(-1).contiguous()
    heads, d = rows.shape[2], rows.shape[3]
    tile = tile_for(d, heads, block_rows, block_cols, interpreted=is_interpreted(_page_fill_kernel))
    grid = (cdiv(num_rows, tile.block_r), cdiv(heads, tile.heads_per_block))
    args = (
        rows, *rows.stride(),
        page_idx, slot_idx,
        _fill_element(fill, rows.dtype, rows.device),
        num_rows, heads,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=d, BLOCK_R=tile.block_r, BLOCK_D=tile.block_d, HEADS_PER_BLOCK=tile.heads_per_block,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return _page_fill_kernel, grid, args, kwargs


@op_entry(PageFillArgs)
def page_fill_triton(a: PageFillArgs, *, block_rows: int | None = None, block_cols: int | None = None) -> None:
    """`page_fill_torch` in one Triton launch: every head of the addressed rows (any index shape) set to `fill`."""
    launch_on_device("page_fill", page_fill_launch(a, block_rows=block_rows, block_cols=block_cols))
