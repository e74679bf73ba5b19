"""The row tile every row-indexed Triton kernel starts from (see triton_common.py for the tiling)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_tile(
    page_idx_ptr, slot_idx_ptr, idx_base, num_rows, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr,
):  # fmt: skip
    """This program's tile: flat rows `r` (grid axis 0), their page and slot (read at `idx_base + r`), the head `h`
    and channel `d` of each column (grid axis 1), and the mask of valid (row, column) pairs."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    page = tl.load(page_idx_ptr + idx_base + r, mask=rmask, other=0)
    slot = tl.load(slot_idx_ptr + idx_base + r, mask=rmask, other=0)
    c = tl.arange(0, HEADS_PER_BLOCK * BLOCK_D)
    h = tl.program_id(1) * HEADS_PER_BLOCK + c // BLOCK_D
    d = c % BLOCK_D
    mask = rmask[:, None] & ((h < num_heads) & (d < HEAD_DIM))[None, :]
    return r, page, slot, h, d, mask
