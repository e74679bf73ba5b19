"""View builder: gather the visible token rows of K and V into one `[2, B, T, Hin, D]` output, in one pass."""

from __future__ import annotations

import torch


def view_build_torch(
    rows: torch.Tensor,
    page_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Reference: `out[kv, b, t] = rows[page_idx[kv, b, t], slot_idx[kv, b, t], head_start:head_start+num_heads]`.

    `out` is `[2, B, T, num_heads, D]` (contiguous). No temporaries besides `out`. Exact (a copy).
    """
    source = (
        rows if (head_start == 0 and num_heads == rows.shape[2]) else rows[:, :, head_start : head_start + num_heads]
    )
    torch.ops.aten.index.Tensor_out(source, [page_idx, slot_idx], out=out)
    return out
