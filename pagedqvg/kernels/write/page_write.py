"""Page write: scatter `key`/`value` `[B, n, Hin, D]` (any strides) into token rows at a head offset."""

from __future__ import annotations

import torch

from pagedqvg.kernels.ops import PageFillArgs, PageWriteArgs, op_entry


@op_entry(PageWriteArgs)
def page_write_torch(a: PageWriteArgs, halves: tuple | None = None) -> None:
    """Reference: `rows[page_idx[kv], slot_idx[kv], head_start:head_start+Hin] = (key, value)[kv]` (fields:
    `ops.PageWriteArgs`); `halves`, when a caller kept it, is `split_halves(page_idx, slot_idx)`. One `index_put_`
    per K/V half. Exact (a copy).
    """
    target = head_rows(a.rows, a.head_start, a.key.shape[2])
    write_halves(target, halves or split_halves(a.page_idx, a.slot_idx), a.key, a.value)


def split_halves(page_idx: torch.Tensor, slot_idx: torch.Tensor) -> tuple:
    """The K and V halves of a row index, `((page_idx[0], slot_idx[0]), (page_idx[1], slot_idx[1]))` (views)."""
    return (page_idx[0], slot_idx[0]), (page_idx[1], slot_idx[1])


def head_rows(rows: torch.Tensor, head_start: int, num_heads: int) -> torch.Tensor:
    """Heads `[head_start, head_start + num_heads)` of token rows `[num_pages, rows_per_page, H, D]` (a view; `rows`
    itself for all heads)."""
    return rows if (head_start == 0 and num_heads == rows.shape[2]) else rows[:, :, head_start : head_start + num_heads]


def write_halves(target: torch.Tensor, halves: tuple, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write key into the rows of `halves[0]` and value into those of `halves[1]` (`split_halves`) of `target` (the
    `head_rows` written). One `index_put_` per K/V half (no allocation, no host read)."""
    target.index_put_(halves[0], key)
    target.index_put_(halves[1], value)


@op_entry(PageFillArgs)
def page_fill_torch(a: PageFillArgs) -> None:
    """Reference: set every head of the addressed rows to `fill` (used before a head-sliced append; fields:
    `ops.PageFillArgs`)."""
    a.rows.index_put_((a.page_idx, a.slot_idx), torch.tensor(a.fill, dtype=a.rows.dtype, device=a.rows.device))
