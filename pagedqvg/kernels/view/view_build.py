"""View builder: gather the visible token rows of K and V into one `[2, B, T, Hin, D]` output, in one pass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedqvg.debug import debug_checks
from pagedqvg.kernels.ops import ViewBuildArgs, op_entry
from pagedqvg.kernels.rows import check_row_index, heads_contiguous, record_gather, row_starts


def gather_plan(
    rows: torch.Tensor, page_idx: torch.Tensor, slot_idx: torch.Tensor, head_start: int, num_heads: int, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What `view_build_torch` derives from its row index, computed once: `(source, index)` such that
    `torch.index_select(source, 0, index)` is the view's rows of heads `[head_start, head_start + num_heads)` in
    order (`rows.record_gather`: `source` a window view of the rows' storage, rows that follow each other in a page
    read as one block; `index` int64; `parts`: the output is split in that many equal parts, each gathered from whole
    blocks). None when the rows' heads are not contiguous. O(numel of the index) plus one host read of the run
    lengths (a sync on CUDA: build it once per plan)."""
    if not heads_contiguous(rows):
        return None
    starts = row_starts(rows, page_idx, slot_idx, head_start)
    align = math.gcd(rows.stride(0), rows.stride(1), head_start * rows.shape[3])
    return record_gather(rows, starts, num_heads * rows.shape[3], align, starts.numel() // parts)


def gather_rows(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` with the rows of a `gather_plan`: one `index_select` straight into `out` when it is contiguous (no
    allocation, no host sync), else into a temporary and one copy."""
    if out.is_contiguous():
        torch.index_select(source, 0, index, out=out.view(-1, source.shape[1]))
    else:
        out.copy_(torch.index_select(source, 0, index).view(out.shape))
    return out


@op_entry(ViewBuildArgs)
def view_build_torch(a: ViewBuildArgs, gather: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Reference: `out[kv, b, t] = rows[page_idx[kv, b, t], slot_idx[kv, b, t], head_start:head_start+num_heads]`
    (fields: `ops.ViewBuildArgs`).

    `page_idx`/`slot_idx` may be any equal shapes (`out` is `[*shape, num_heads, D]`); IndexError for an index
    outside `rows` (under the debug switch, `pagedqvg.debug`: the check reads the indices). One gather:
    `gather_plan` (an `index_select` of whole rows: `rows.record_gather`; rows that sit together in a page are one
    copy), then `gather_rows` into `out`. Exact
    (a copy). A caller that repeats a view passes the `gather_plan` of these arguments it kept (`gather`): the call
    is then one `index_select`.
    """
    rows, page_idx, slot_idx, out = a.rows, a.page_idx, a.slot_idx, a.out
    if debug_checks():
        check_row_index(rows, page_idx, slot_idx)
    plan = gather if gather is not None else gather_plan(rows, page_idx, slot_idx, a.head_start, a.num_heads)
    if plan is None:  # heads not contiguous in a row: an indexed access per element
        source = rows[:, :, a.head_start : a.head_start + a.num_heads]
        torch.ops.aten.index.Tensor_out(source, [page_idx, slot_idx], out=out)
        return out
    return gather_rows(*plan, out)


@dataclass(frozen=True, slots=True)
class DenseCopies:
    """Dense rows of a run-table view written into its output `[2, B, T, heads, D]` with no allocation: one
    `index_select` per range of consecutive output rows and (kv, b) (`gathers`: `(out_row, count, source, index
    [2, B, n])` of `gather_plan`). Built once per plan (`dense_copies`)."""

    gathers: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...] = ()

    def run(self, out: torch.Tensor) -> None:
        """Copy the rows into `out` `[2, B, T, heads, D]` (into it directly when it is contiguous)."""
        for t0, count, source, index in self.gathers:
            for kv in range(index.shape[0]):
                for b in range(index.shape[1]):
                    gather_rows(source, index[kv, b], out[kv, b].narrow(0, t0, count))


def dense_copies(
    rows: torch.Tensor, runs: list[tuple[int, ...]], batch: int, head_start: int, heads: int
) -> DenseCopies | None:
    """The `DenseCopies` of dense runs `(page, first_slot, count, out_row)` (token slots of pages of `rows`, in
    output order; layout.py's token-major pages), or None when the rows' heads are not contiguous. O(rows) plus one
    host read of run lengths per range of consecutive output rows."""
    if not heads_contiguous(rows):
        return None
    tpp = rows.shape[1] // (2 * batch)
    ranges: list[list[tuple[int, ...]]] = []
    for run in runs:
        if ranges and ranges[-1][-1][3] + ranges[-1][-1][2] == run[3]:
            ranges[-1].append(run)
        else:
            ranges.append([run])
    kv = torch.arange(2, device=rows.device)[:, None, None]
    b = torch.arange(batch, device=rows.device)[None, :, None]
    gathers = []
    for group in ranges:
        page = torch.tensor([p for p, _, c, _ in group for _ in range(c)], dtype=torch.int64).to(rows.device)
        token = torch.tensor([f + i for _, f, c, _ in group for i in range(c)], dtype=torch.int64).to(rows.device)
        slot = kv * (tpp * batch) + token * batch + b
        plan = gather_plan(rows, page.expand_as(slot), slot, head_start, heads, 2 * batch)
        assert plan is not None
        gathers.append((group[0][3], page.numel(), plan[0], plan[1].view(2, batch, -1)))
    return DenseCopies(tuple(gathers))
