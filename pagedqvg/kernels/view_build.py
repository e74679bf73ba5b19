"""View builder: gather the visible token rows of K and V into one `[2, B, T, Hin, D]` output, in one pass."""

from __future__ import annotations

import torch

from ..debug import debug_checks
from .rows import check_row_index, coalesce_units, row_units, rows_index_units


def gather_plan(
    rows: torch.Tensor, page_idx: torch.Tensor, slot_idx: torch.Tensor, head_start: int, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What `view_build_torch` derives from its row index, computed once: `(source, index)` such that
    `torch.index_select(source, 0, index)` is the view's rows of heads `[head_start, head_start + num_heads)` in
    order (`source`: a `[M, w]` view of the rows' storage, `w` elements per block, blocks of consecutive units
    coalesced by `rows.coalesce_units`; `index`: int64 `[numel // w]`). None when the rows' heads are not contiguous.
    O(numel of the index) plus one host read per run of consecutive rows (a sync on CUDA: build it once per plan)."""
    units = row_units(rows, head_start, num_heads)
    if units is None:
        return None
    flat, u = units
    index = rows_index_units(rows, page_idx, slot_idx, head_start, num_heads, u)
    k = coalesce_units(index)  # whole blocks of k consecutive units (rows of one page in a row): one copy each
    if k > 1:
        flat = flat.as_strided((flat.shape[0] // k, k * u), (k * u, 1), flat.storage_offset())
        index = index[::k] // k
    return flat, index.contiguous()


def gather_rows(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` with the rows of a `gather_plan`: one `index_select` straight into `out` when it is contiguous (no
    allocation, no host sync), else into a temporary and one copy."""
    if out.is_contiguous():
        torch.index_select(source, 0, index, out=out.view(-1, source.shape[1]))
    else:
        out.copy_(torch.index_select(source, 0, index).view(out.shape))
    return out


def view_build_torch(
    rows: torch.Tensor,
    page_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
    gather: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference: `out[kv, b, t] = rows[page_idx[kv, b, t], slot_idx[kv, b, t], head_start:head_start+num_heads]`.

    `rows` is `[num_pages, rows_per_page, H, D]`; `page_idx`/`slot_idx` are `[2, B, T]` (any equal shapes: `out`
    is `[*shape, num_heads, D]`); IndexError for an index outside `rows` (under the debug switch, `pagedqvg.debug`:
    the check reads the indices). One gather: `gather_plan` (an `index_select` of whole row units: `rows.row_units`;
    blocks of consecutive units coalesced by `rows.coalesce_units`, so rows that sit together in a page are one
    copy), then `gather_rows` into `out`. Exact (a copy). A caller that repeats a view passes the `gather_plan` of
    these arguments it kept (`gather`): the call is then one `index_select`.
    """
    if debug_checks():
        check_row_index(rows, page_idx, slot_idx)
    plan = gather if gather is not None else gather_plan(rows, page_idx, slot_idx, head_start, num_heads)
    if plan is None:  # heads not contiguous in a row: an indexed access per element
        source = rows[:, :, head_start : head_start + num_heads]
        torch.ops.aten.index.Tensor_out(source, [page_idx, slot_idx], out=out)
        return out
    return gather_rows(*plan, out)
