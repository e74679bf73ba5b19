"""View builder: gather the visible token rows of K and V into one `[2, B, T, Hin, D]` output, in one pass."""

from __future__ import annotations

import torch

from .rows import check_row_index, coalesce_units, row_units, rows_index_units


def view_build_torch(
    rows: torch.Tensor,
    page_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Reference: `out[kv, b, t] = rows[page_idx[kv, b, t], slot_idx[kv, b, t], head_start:head_start+num_heads]`.

    `rows` is `[num_pages, rows_per_page, H, D]`; `page_idx`/`slot_idx` are `[2, B, T]` (any equal shapes: `out`
    is `[*shape, num_heads, D]`); IndexError for an index outside `rows`. One gather: an `index_select` of whole
    row units into `out` (`rows.row_units`; blocks of consecutive units coalesced by `rows.coalesce_units`, so
    rows that sit together in a page are one copy; into a temporary first when `out` is not contiguous). Exact (a
    copy).
    """
    check_row_index(rows, page_idx, slot_idx)
    units = row_units(rows, head_start, num_heads)
    if units is None:  # heads not contiguous in a row: an indexed access per element
        source = rows[:, :, head_start : head_start + num_heads]
        torch.ops.aten.index.Tensor_out(source, [page_idx, slot_idx], out=out)
        return out
    flat, u = units
    index = rows_index_units(rows, page_idx, slot_idx, head_start, num_heads, u)
    k = coalesce_units(index)  # whole blocks of k consecutive units (rows of one page in a row): one copy each
    if k > 1:
        flat = flat.as_strided((flat.shape[0] // k, k * u), (k * u, 1), flat.storage_offset())
        index = index[::k] // k
    if out.is_contiguous():
        torch.index_select(flat, 0, index, out=out.view(-1, flat.shape[1]))
    else:
        out.copy_(torch.index_select(flat, 0, index).view(out.shape))
    return out
