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

from dataclasses import dataclass

import torch

from ..debug import debug_checks
from ..layout import page_pieces
from ..quant import PackedFormat
from .dequant import check_packed_dequant, packed_dequant_torch, piece_tokens
from .view_build import gather_plan, view_build_torch

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


def check_view_runs(
    rows: torch.Tensor,
    tokens: torch.Tensor | None,
    codebooks: torch.Tensor | None,
    cb_pages: torch.Tensor | None,
    runs: torch.Tensor,
    head_start: int,
    out_t: torch.Tensor,
    fmt: PackedFormat | None,
) -> None:
    """Shape/dtype checks shared by the reference and the Triton launch (no data is read: no device sync).

    `tokens`, `codebooks`, `cb_pages` and `fmt` are all given (a quantized cache) or all None (no packed runs)."""
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
    check_packed_dequant(tokens, codebooks, runs[:, 1:], cb_pages, head_start, out_t, fmt)
    if rows.device != out_t.device:
        raise ValueError(f"tensors on several devices: {sorted({str(rows.device), str(out_t.device)})}")


def check_run_values(
    rows: torch.Tensor,
    tokens: torch.Tensor | None,
    codebooks: torch.Tensor | None,
    cb_pages: torch.Tensor | None,
    runs: torch.Tensor,
    out_t: torch.Tensor,
    fmt: PackedFormat | None = None,
    max_run: int | None = None,
) -> None:
    """Checks of the table's values (reads it: a device sync). ValueError for a bad kind or count, IndexError for a
    page, slot, output row or codebook page out of range; each names the offending run."""
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


def view_runs_torch(
    rows: torch.Tensor,
    tokens: torch.Tensor | None,
    codebooks: torch.Tensor | None,
    cb_pages: torch.Tensor | None,
    runs: torch.Tensor,
    head_start: int,
    out_t: torch.Tensor,
    fmt: PackedFormat | None,
    max_run: int | None = None,
    plan: RunsTorchPlan | None = None,
) -> None:
    """Reference: the dense runs' rows in one gather (`view_build_torch` on their row index) and one `index_copy_`
    into their output rows, the zero runs' rows in one `index_fill_`, all packed runs through `packed_dequant_torch`.
    The table's values are range-checked (`check_run_values`, a host read) under the debug switch only
    (`pagedqvg.debug`); its shape always. `plan`: the `runs_torch_plan` of these arguments, kept by a caller that
    repeats the view (the row expansion then costs nothing per call).
    """
    check_view_runs(rows, tokens, codebooks, cb_pages, runs, head_start, out_t, fmt)
    if debug_checks():
        check_run_values(rows, tokens, codebooks, cb_pages, runs, out_t, fmt, max_run)
    B, heads = out_t.shape[2], out_t.shape[3]
    if plan is None:
        plan = runs_torch_plan(rows, runs, head_start, heads, B)
    if plan.dense_out is not None:
        assert plan.dense_rows is not None
        page, slot = plan.dense_rows
        src = torch.empty(2, B, page.shape[2], heads, rows.shape[3], dtype=rows.dtype, device=rows.device)
        view_build_torch(rows, page, slot, head_start, heads, src, plan.dense_gather)
        out_t.index_copy_(0, plan.dense_out, src.permute(2, 0, 1, 3, 4))
    if plan.zero_out is not None:
        out_t.index_fill_(0, plan.zero_out, 0)
    if plan.pieces is not None:
        packed_dequant_torch(tokens, codebooks, plan.pieces, cb_pages, head_start, out_t, fmt)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class RunsTorchPlan:
    """What `view_runs_torch` derives from a run table for one head slice: the dense runs token by token (their row
    index `dense_rows` `(page_idx, slot_idx)` `[2, B, n]`, its `view_build.gather_plan` `dense_gather`, their output
    rows `dense_out` `[n]`), the zero runs' output rows `zero_out`, the live packed pieces `pieces` `[P, 5]`; None
    where the table has no such run. All on the table's device."""

    dense_rows: tuple[torch.Tensor, torch.Tensor] | None
    dense_gather: tuple[torch.Tensor, torch.Tensor] | None
    dense_out: torch.Tensor | None
    zero_out: torch.Tensor | None
    pieces: torch.Tensor | None


def runs_torch_plan(rows: torch.Tensor, runs: torch.Tensor, head_start: int, heads: int, B: int) -> RunsTorchPlan:
    """The `RunsTorchPlan` of run table `runs` over `rows` for heads `[head_start, head_start + heads)` of `B` batch
    elements. O(rows of the view); reads counts back to the host (a sync on CUDA: build it once per plan)."""
    tpp = rows.shape[1] // (2 * B)
    live = runs[runs[:, 3] > 0]
    kind = live[:, 0]
    dense = live[kind == DENSE]
    dense_rows = dense_gather = dense_out = zero_out = pieces = None
    if dense.shape[0]:
        page, token, dense_out = piece_tokens(dense[:, 1:])  # token by token
        kv = torch.arange(2, device=runs.device)[:, None, None]
        b = torch.arange(B, device=runs.device)[None, :, None]
        slot = kv * (tpp * B) + token * B + b  # [2, B, n]
        dense_rows = (page.expand_as(slot), slot)
        dense_gather = gather_plan(rows, *dense_rows, head_start, heads)
    zero = live[kind == ZERO]
    if zero.shape[0]:
        _, _, zero_out = piece_tokens(zero[:, 1:])
    packed = live[kind == PACKED, 1:]
    if packed.shape[0]:
        pieces = packed
    return RunsTorchPlan(dense_rows, dense_gather, dense_out, zero_out, pieces)
