"""Each kernel op's parameter list, written once: one immutable record (a `typing.NamedTuple`) per op.

An op (page_write, page_fill, view_build, view_runs, packed_dequant, kmeans_assign, kmeans_update, residual_pack,
attend)
has four entry points: its argument check, its torch reference, its Triton launch (and the `*_triton` that runs it)
and the dispatcher (kernels/dispatch.py). Each of them is written as `body(a: <Op>Args, ...extras)` and wrapped by
`op_entry`, which also accepts the op's fields positionally or by keyword (the historical call signatures, used by
page_io, packing, prq, the tests and the benchmarks), binds them to the dataclass once, and passes the instance on.
So the fields, their order, defaults and docs live here only; a dispatcher hands the instance it built to the torch
reference or the Triton launch unchanged (one small object per call; no tensor is allocated, nothing is read back).

Why a NamedTuple and not a frozen dataclass: both are immutable records with typed, documented fields, but the hot
path builds one per op per call, and a frozen dataclass's `__init__` (one `object.__setattr__` per field) costs
~4 us for 6 fields against ~1.7 us for the NamedTuple (measured side by side on the 2-core dev machine, Python 3.11).
Records compare by value and unpack like tuples; nothing relies on that, read fields by name.

Extras are what is not an op parameter: the caller-kept plans of the torch references (`halves`, `gather`,
`torch_plan`), the dispatcher's `backend`, the Triton entries' tile overrides (`block_rows`, `block_cols`) and the
k-means launches' output tensor. They follow the fields positionally or come by keyword, as before.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

from pagedqvg.quant import PackedFormat

F = TypeVar("F", bound=Callable[..., Any])


def op_entry(args_type: type) -> Callable[[F], F]:
    """Decorator: `body(a, *extras, **extras)` callable as `body(a, ...)` with an `args_type` instance, or as
    `body(<fields of args_type, positional or keyword>, <extras>)`: the fields are bound to one `args_type`
    (positional arguments past the fields go to the extras in order). The wrapper's `__signature__` is the fields
    followed by the body's extras, so `help()` shows the whole call. O(fields) per call."""
    names = args_type._fields
    n = len(names)

    def wrap(body: F) -> F:
        @functools.wraps(body)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if args and type(args[0]) is args_type:
                return body(*args, **kwargs)
            if not kwargs:  # the hot path: every field positional
                return body(args_type(*args[:n]), *args[n:])
            field_kw = {k: kwargs.pop(k) for k in names if k in kwargs}
            return body(args_type(*args[:n], **field_kw), *args[n:], **kwargs)

        params = list(inspect.signature(args_type).parameters.values())
        extras = list(inspect.signature(body).parameters.values())[1:]
        entry.__signature__ = inspect.Signature(params + extras)  # type: ignore[attr-defined]
        return entry  # type: ignore[return-value]

    return wrap


class PageWriteArgs(NamedTuple):
    """page_write: `rows[page_idx[kv], slot_idx[kv], head_start:head_start+Hin] = (key, value)[kv]`."""

    rows: torch.Tensor  #: token rows `[num_pages, rows_per_page, H, D]`, cache dtype
    page_idx: torch.Tensor  #: int64 `[2, B, n]`: the page of each (kv, batch, token)
    slot_idx: torch.Tensor  #: int64 `[2, B, n]`: the row within that page (slots)
    head_start: int  #: first head written (heads)
    key: torch.Tensor  #: `[B, n, Hin, D]` (any strides), cache dtype
    value: torch.Tensor  #: like `key`


class PageFillArgs(NamedTuple):
    """page_fill: every head of the addressed token rows set to `fill`."""

    rows: torch.Tensor  #: token rows `[num_pages, rows_per_page, H, D]`
    page_idx: torch.Tensor  #: int64, any shape: the page of each row
    slot_idx: torch.Tensor  #: int64, shape of `page_idx`: the row within its page (slots)
    fill: float = 0.0  #: the value, converted to the rows' dtype as `torch.tensor(fill, dtype=...)` does


class ViewBuildArgs(NamedTuple):
    """view_build: `out[kv, b, t] = rows[page_idx[kv, b, t], slot_idx[kv, b, t], head_start:head_start+num_heads]`."""

    rows: torch.Tensor  #: token rows `[num_pages, rows_per_page, H, D]`
    page_idx: torch.Tensor  #: int64 `[2, B, T]`: the page of each (kv, batch, token)
    slot_idx: torch.Tensor  #: int64 `[2, B, T]`: the row within that page (slots)
    head_start: int  #: first head read (heads)
    num_heads: int  #: heads read (heads)
    out: torch.Tensor  #: `[2, B, T, num_heads, D]`, rows' dtype, any strides


class PackedDequantArgs(NamedTuple):
    """packed_dequant: the token pieces of a piece table decoded straight from packed pages (dequant.py)."""

    tokens: torch.Tensor  #: uint8 `[num_pages, tokens_per_page, 2, B, token_row_bytes]`, packed token rows
    codebooks: torch.Tensor  #: `[num_pages, rows_per_page, K, D]` in the format's codebook dtype
    pieces: torch.Tensor  #: int64 `[P, 5]`: `(page, first_slot, count, out_row, cb_offset)` per piece (tokens)
    cb_pages: torch.Tensor  #: int64 `[n]`: codebook pages of the segments, concatenated
    head_start: int  #: first head written (heads)
    out_t: torch.Tensor  #: `[T, 2, B, heads, D]`, cache dtype, any strides
    fmt: PackedFormat  #: format of one (kv, b) row: `fmt.num_heads` = H, the cache's heads


class ViewRunsArgs(NamedTuple):
    """view_runs: a whole mixed view (dense, packed and zero runs) from one run table (view_runs.py)."""

    rows: torch.Tensor  #: dense token rows `[num_pages, rows_per_page, H, D]`, cache dtype
    tokens: torch.Tensor | None  #: packed token pages (`PackedDequantArgs.tokens`); None without packed segments
    codebooks: torch.Tensor | None  #: codebook pages (`PackedDequantArgs.codebooks`); None likewise
    cb_pages: torch.Tensor | None  #: int64 `[n]` codebook pages of the view's packed segments; None likewise
    runs: torch.Tensor  #: int64 `[P, 6]`: `(kind, page, first_slot, count, out_row, cb_offset)` per run
    head_start: int  #: first head written (heads)
    out_t: torch.Tensor  #: `[T, 2, B, heads, D]`, cache dtype, any strides
    fmt: PackedFormat | None  #: the packed format (`PackedDequantArgs.fmt`); None likewise
    max_run: int | None = None  #: an upper bound of every run's count (tokens); None: T


class KmeansAssignArgs(NamedTuple):
    """kmeans_assign: nearest centroid (squared L2, ties to the lowest id) of each token."""

    x: torch.Tensor  #: float32 `[H, S, D]`: S tokens of H heads
    c: torch.Tensor  #: float32 `[H, K, D]`: K centroids per head


class KmeansUpdateArgs(NamedTuple):
    """kmeans_update: cluster means; an empty cluster keeps its old centroid."""

    x: torch.Tensor  #: float32 `[H, S, D]`
    ids: torch.Tensor  #: int64 `[H, S]`: each token's cluster, 0..K-1
    c_old: torch.Tensor  #: float32 `[H, K, D]`: the previous centroids


class ResidualPackArgs(NamedTuple):
    """residual_pack: block-quantize PRQ's final residual and write packed records into token slots."""

    resid: torch.Tensor  #: float32 `[G, S, D]`: the final residual of G folded heads
    ids: torch.Tensor  #: uint8 `[G, S, stages]`: centroid id per k-means stage
    dest: torch.Tensor  #: uint8 `[num_pages, slots_per_page, >= G * per_head_bytes]`, last stride 1
    page_idx: torch.Tensor  #: int64 `[S]`: destination page of each token
    slot_idx: torch.Tensor  #: int64 `[S]`: destination slot of each token
    fmt: PackedFormat  #: the per-head record format; `fmt.num_heads` = G


class AttendArgs(NamedTuple):
    """attention over a view plan straight from pages: `softmax(query·kᵀ·scale)·v` over the plan's `n_keys` rows
    (kernels/attention_runs.py reference, kernels/triton_attention.py launch)."""

    query: torch.Tensor  #: `[B, Tq, hin, D]`, cache dtype
    rows: torch.Tensor  #: token rows `[num_pages, rows_per_page, H, D]`, cache dtype
    plan_index: tuple[torch.Tensor, torch.Tensor] | None  #: `(page_idx, slot_idx)` `[2, B, T]` of a dense view
    runs: torch.Tensor | None  #: else the run table, int64 `[P, 6]`
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  #: `(token pages, codebook rows, cb_pages)`
    fmt: PackedFormat | None  #: the packed format (None without packed rows)
    head_start: int  #: first head of `rows` attended (heads)
    n_keys: int  #: rows of the view (tokens), never-written rows included
    scale: float  #: softmax scale
