"""Page write: scatter `key`/`value` `[B, n, Hin, D]` (any strides) into token rows at a head offset."""

from __future__ import annotations

import torch


def page_write_torch(
    rows: torch.Tensor,
    page_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    head_start: int,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Reference: `rows[page_idx[kv], slot_idx[kv], head_start:head_start+Hin] = (key, value)[kv]`.

    `rows` is `[num_pages, rows_per_page, H, D]`; `page_idx`/`slot_idx` are `[2, B, n]`. Exact (a copy).
    """
    hin = key.shape[2]
    target = rows if (head_start == 0 and hin == rows.shape[2]) else rows[:, :, head_start : head_start + hin]
    target.index_put_((page_idx[0], slot_idx[0]), key)
    target.index_put_((page_idx[1], slot_idx[1]), value)


def page_fill_torch(rows: torch.Tensor, page_idx: torch.Tensor, slot_idx: torch.Tensor, fill: float = 0.0) -> None:
    """Reference: set every head of the addressed rows to `fill` (used before a head-sliced append)."""
    rows.index_put_((page_idx, slot_idx), torch.tensor(fill, dtype=rows.dtype, device=rows.device))
