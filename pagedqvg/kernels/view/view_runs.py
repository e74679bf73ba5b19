"""Mixed view build: a whole view (dense rows, PRQ-packed rows and zero rows) from one flat run table, one launch.

The flat description of the view is a *run table* `runs`, int64 `[P, 6]`, one row per run of output rows:
`(kind, page, first_slot, count, out_row, cb_offset)` = write output rows `[out_row, out_row + count)` from

- kind 0 `DENSE`: token slots `[first_slot, first_slot + count)` of dense page `page`. Dense rows are `rows`
  `[num_pages, rows_per_page, H, D]` of the cache dtype with `rows_per_page = 2 * B * tokens_per_page`; token slot
  `t` of (kv, b) is row `kv * tokens_per_page * B + t * B + b` (layout.py, rows.py). `cb_offset` is ignored (0).
- kind 1 `PACKED`: a piece of the packed piece table (dequant.py: columns 1..5 are its `(page, first_slot, count,
  out_row, cb_offset)`): token slots of packed token page `page`, decoded with the codebooks of the segment whose
  codebook pages are `cb_pages[cb_offset:]`.
- kind 2 `ZERO`: zeros (`page`, `first_slot`, `cb_offset` ignored, 0).

Output `out_t` `[T, 2, B, heads, D]` (any strides; the cache passes a permuted view of its `[2, B, T, heads, D]`
view) receives heads `[head_start, head_start + heads)` of every (kv, b) of every run: dense rows copied, packed
rows exactly as `packed_dequant_torch` (`prq_dequantize`) gives them, zero rows `+0.0`. Runs must not overlap; rows
no run covers are left as they are. `max_run`, when given, bounds every run's count (the Triton launch covers
`min(max_run, T)` rows per run; the builders below split runs at `cap` so that `max_run = cap` holds).

The table is built on the host once per view plan (the cache keeps it in the plan, on the device, with the
concatenated codebook pages of the view's packed segments: one host->device copy per new plan) from
`dense_runs` / `packed_runs` / `zero_runs`; within a view `out_row` is the running sum of counts (CSR offsets).
`packed_dequant` (dequant.py) remains the packed-only read (unpacking a segment).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedqvg.debug import debug_checks
from pagedqvg.kernels.ops import PackedDequantArgs, ViewRunsArgs, op_entry
from pagedqvg.kernels.view.decode_plan import PackedDecodePlan, decode_plan, run_decode
from pagedqvg.kernels.view.dequant import check_packed_dequant
from pagedqvg.kernels.view.view_build import DenseCopies, dense_copies
from pagedqvg.layout.segments import page_pieces
from pagedqvg.quant import PackedFormat

DENSE, PACKED, ZERO = 0, 1, 2
KINDS = (DENSE, PACKED, ZERO)
RUN_COLUMNS = 6


def _split(kind: int, page: int, first: int, count: int, out_row: int, cb_offset: int, cap: int | None) -> list:
    step = count if cap is None else cap
    return [(kind, page, first + x, min(step, count - x), out_row + x, cb_offset) for x in range(0, count, step)]


def _page_runs(kind, pages, tokens_per_page, t0, t1, out_row, cb_offset, cap) -> list[tuple[int, ...]]:
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1 or None, got {cap}")
    out: list[tuple[int, ...]] = []
    o = out_row
    for page, a, b in page_pieces(pages, tokens_per_page, t0, t1):
        out.extend(_split(kind, page, a, b - a, o, cb_offset, cap))
        o += b - a
    return out


def dense_runs(
    pages: list[int], tokens_per_page: int, t0: int, t1: int, out_row: int = 0, cap: int | None = None
) -> list[tuple[int, ...]]:
    """Run rows for tokens `[t0, t1)` of a dense segment whose pages are `pages`, written from `out_row` on; runs
    longer than `cap` tokens are split. O(rows returned)."""
    return _page_runs(DENSE, pages, tokens_per_page, t0, t1, out_row, 0, cap)


def packed_runs(
    pages: list[int],
    tokens_per_page: int,
    t0: int,
    t1: int,
    out_row: int = 0,
    cb_offset: int = 0,
    cap: int | None = None,
) -> list[tuple[int, ...]]:
    """Run rows for tokens `[t0, t1)` of a packed segment whose token pages are `pages` and whose codebook pages
    start at `cb_pages[cb_offset]`; runs longer than `cap` tokens are split. O(rows returned)."""
    return _page_runs(PACKED, pages, tokens_per_page, t0, t1, out_row, cb_offset, cap)


def zero_runs(out_row: int, count: int, cap: int | None = None) -> list[tuple[int, ...]]:
    """Run rows for `count` zero rows from `out_row` on, split at `cap`."""
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1 or None, got {cap}")
    step = count if cap is None else cap
    return [(ZERO, 0, 0, min(step, count - x), out_row + x, 0) for x in range(0, max(0, count), max(1, step))]


@op_entry(ViewRunsArgs)
def check_view_runs(a: ViewRunsArgs) -> None:
    """Shape/dtype checks shared by the reference and the Triton launch (no data is read: no device sync).

    `tokens`, `codebooks`, `cb_pages` and `fmt` are all given (a quantized cache) or all None (no packed runs)."""
    rows, tokens, codebooks, cb_pages, runs, head_start, out_t, fmt = (
        a.rows, a.tokens, a.codebooks, a.cb_pages, a.runs, a.head_start, a.out_t, a.fmt
    )  # fmt: skip
    if rows.dim() != 4:
        raise ValueError(f"rows must be [num_pages, rows_per_page, H, D], got shape {tuple(rows.shape)}")
    if runs.dtype != torch.int64 or runs.dim() != 2 or runs.shape[1] != RUN_COLUMNS:
        raise ValueError(f"runs must be int64 [P, {RUN_COLUMNS}], got {runs.dtype} {tuple(runs.shape)}")
    if out_t.dim() != 5 or out_t.shape[1] != 2:
        raise ValueError(f"out_t must be [T, 2, B, heads, D], got {tuple(out_t.shape)}")
    B, heads, D = out_t.shape[2], out_t.shape[3], out_t.shape[4]
    if rows.shape[3] != D:
        raise ValueError(f"rows have head_dim {rows.shape[3]}, out_t {D}")
    if rows.shape[1] % (2 * B):
        raise ValueError(f"rows_per_page {rows.shape[1]} is not a multiple of 2 * batch = {2 * B}")
    if out_t.dtype != rows.dtype:
        raise TypeError(f"out_t dtype {out_t.dtype} differs from the rows' {rows.dtype}")
    if head_start < 0 or head_start + heads > rows.shape[2]:
        raise ValueError(f"heads [{head_start}, {head_start + heads}) outside the rows' {rows.shape[2]} heads")
    sources = {"tokens": tokens, "codebooks": codebooks, "cb_pages": cb_pages, "fmt": fmt}
    given = [name for name, x in sources.items() if x is not None]
    if len(given) < len(sources):
        if given:
            raise ValueError(f"packed sources: give tokens, codebooks, cb_pages and fmt together, got only {given}")
        devices = {t.device for t in (rows, runs, out_t)}
        if len(devices) != 1:
            raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
        return
    assert tokens is not None and codebooks is not None and cb_pages is not None and fmt is not None
    if fmt.num_heads != rows.shape[2] or fmt.dtype != rows.dtype:
        raise ValueError(f"format of {fmt.num_heads} heads of {fmt.dtype} does not match the rows' {rows.shape[2]} "
                         f"heads of {rows.dtype}")  # fmt: skip
    check_packed_dequant(PackedDequantArgs(tokens, codebooks, runs[:, 1:], cb_pages, head_start, out_t, fmt))
    if rows.device != out_t.device:
        raise ValueError(f"tensors on several devices: {sorted({str(rows.device), str(out_t.device)})}")


@op_entry(ViewRunsArgs)
def check_run_values(a: ViewRunsArgs) -> None:
    """Checks of the table's values (reads it: a device sync). ValueError for a bad kind or count, IndexError for a
    page, slot, output row or codebook page out of range; each names the offending run."""
    rows, tokens, codebooks, cb_pages, runs, out_t, fmt, max_run = (
        a.rows, a.tokens, a.codebooks, a.cb_pages, a.runs, a.out_t, a.fmt, a.max_run
    )  # fmt: skip
    if runs.numel() == 0:
        return
    table = runs.cpu()
    kind, page, first, count, out_row, cb_off = table.unbind(1)
    T, B = out_t.shape[0], out_t.shape[2]

    def bad(mask: torch.Tensor, exc: type[Exception], what: str) -> None:
        if bool(mask.any()):
            i = int(mask.nonzero()[0, 0])
            raise exc(f"run {i} {tuple(table[i].tolist())} (kind, page, first, count, out_row, cb_offset): {what}")

    bad(~torch.isin(kind, torch.tensor(KINDS)), ValueError, f"kind must be one of {KINDS}")
    bad(count < 0, ValueError, "negative count")
    if max_run is not None:
        bad(count > max_run, ValueError, f"count exceeds max_run={max_run}")
    live = count > 0
    bad(live & ((out_row < 0) | (out_row + count > T)), IndexError, f"output rows outside [0, {T})")
    dense = live & (kind == DENSE)
    tpp = rows.shape[1] // (2 * B)
    bad(dense & ((page < 0) | (page >= rows.shape[0])), IndexError, f"dense page outside [0, {rows.shape[0]})")
    bad(dense & ((first < 0) | (first + count > tpp)), IndexError, f"dense token slots outside [0, {tpp})")
    packed = live & (kind == PACKED)
    if not bool(packed.any()):
        return
    if tokens is None or codebooks is None or cb_pages is None:
        bad(packed, ValueError, "a packed run but no packed sources (tokens, codebooks, cb_pages, fmt) were given")
        return
    bad(packed & ((page < 0) | (page >= tokens.shape[0])), IndexError, f"token page outside [0, {tokens.shape[0]})")
    bad(packed & ((first < 0) | (first + count > tokens.shape[1])), IndexError,
        f"packed token slots outside [0, {tokens.shape[1]})")  # fmt: skip
    n_cb = 1  # codebook pages per segment
    if fmt is not None:
        n_cb = -(-2 * B * fmt.num_codebook_rows // codebooks.shape[1])
    bad(packed & ((cb_off < 0) | (cb_off + n_cb > cb_pages.shape[0])), IndexError,
        f"codebook pages cb_pages[cb_offset : cb_offset + {n_cb}] outside the {cb_pages.shape[0]} given")  # fmt: skip
    cbp = cb_pages.cpu()
    if cbp.numel() and (int(cbp.min()) < 0 or int(cbp.max()) >= codebooks.shape[0]):
        raise IndexError(f"codebook page out of range: {cbp.tolist()} (pages: {codebooks.shape[0]})")


@op_entry(ViewRunsArgs)
def view_runs_torch(a: ViewRunsArgs, plan: RunsTorchPlan | None = None) -> None:
    """Reference: the dense runs' rows copied into their output rows (`view_build.DenseCopies`: one gather per
    output range and (kv, b), or one copy per long run), the zero runs' rows zeroed, the packed runs decoded
    (`decode_plan.run_decode`, the values of `packed_dequant_torch`). The table's values are range-checked
    (`check_run_values`, a host read) under the debug switch only (`pagedqvg.debug`); its shape always. `plan`: the
    `runs_torch_plan` of these arguments, kept by a caller that repeats the view (the call then allocates nothing
    and reads nothing back). Fields: `ops.ViewRunsArgs`.
    """
    check_view_runs(a)
    if debug_checks():
        check_run_values(a)
    out_t = a.out_t
    if plan is None:
        sources = None
        if a.tokens is not None:
            assert a.codebooks is not None and a.cb_pages is not None and a.fmt is not None
            sources = (a.tokens, a.codebooks, a.cb_pages.tolist(), a.fmt)
        plan = runs_torch_plan(a.rows, a.runs.tolist(), a.head_start, out_t.shape[3], out_t.shape[2], sources,
                               lambda n: torch.empty(n, dtype=torch.uint8, device=out_t.device))  # fmt: skip
    out = out_t.permute(1, 2, 0, 3, 4)  # [2, B, T, heads, D]
    if plan.dense is not None:
        plan.dense.run(out)
    for t0, count in plan.zeros:
        out.narrow(2, t0, count).zero_()
    if plan.packed is not None:
        run_decode(plan.packed, out_t)


@dataclass(frozen=True, slots=True)
class RunsTorchPlan:
    """What `view_runs_torch` derives from a run table for one head slice, once: the dense runs' copies (`dense`,
    `view_build.DenseCopies`), the zero runs' `(out_row, count)` (`zeros`), the packed runs' decode (`packed`,
    `decode_plan.PackedDecodePlan`); None / empty where the table has no such run. On the table's device."""

    dense: DenseCopies | None
    zeros: tuple[tuple[int, int], ...]
    packed: PackedDecodePlan | None


def runs_torch_plan(
    rows: torch.Tensor,
    runs: list[list[int]] | list[tuple[int, ...]],
    head_start: int,
    heads: int,
    B: int,
    packed: tuple[torch.Tensor, torch.Tensor, list[int], PackedFormat] | None,
    scratch: Callable[[int], torch.Tensor],
) -> RunsTorchPlan:
    """The `RunsTorchPlan` of run table rows `runs` (host lists `(kind, page, first, count, out_row, cb_offset)`)
    over `rows` for heads `[head_start, head_start + heads)` of `B` batch elements; `packed`: `(tokens, codebooks,
    cb_pages as host ints, fmt)` of a quantized cache; `scratch(nbytes)`: the decode's scratch buffer (uint8, at
    least `nbytes`; the owner keeps it). O(rows of the view); may read back to the host (build it once per plan)."""
    live = sorted((tuple(r) for r in runs if r[3] > 0), key=lambda r: r[4])
    dense = [r[1:5] for r in live if r[0] == DENSE]
    pieces = [r[1:] for r in live if r[0] == PACKED]
    copies = dense_copies(rows, dense, B, head_start, heads) if dense else None
    zeros = tuple((r[4], r[3]) for r in live if r[0] == ZERO)
    decode = None
    if pieces:
        assert packed is not None
        tokens, codebooks, cb_pages, fmt = packed
        decode = decode_plan(tokens, codebooks, pieces, cb_pages, head_start, heads, fmt, scratch)
    return RunsTorchPlan(copies, zeros, decode)
