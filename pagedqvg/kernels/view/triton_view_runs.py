"""Triton mixed view build: the same signature and result as `view_runs_torch` (view_runs.py), in one launch.

Grid: `(P, cdiv(min(max_run, T), BLOCK_R), cdiv(2 * B * heads, HEADS_PER_BLOCK))`. Program `(p, i, j)` reads run
`p` of the run table and writes its output rows `out_row + [i * BLOCK_R, (i + 1) * BLOCK_R)` (masked to the run's
count) for `HEADS_PER_BLOCK` columns `j * HEADS_PER_BLOCK + ...` of the view's `2 * B * heads` (kv, b, head)
records per token, as a `[BLOCK_R, HEADS_PER_BLOCK, BLOCK_D]` tile (each column one contiguous `head_dim` vector
in source and output). It branches once on the run's kind (a scalar, uniform over the program):

- dense: loads the tile from the dense token rows (row `kv * tpp * B + slot * B + b` of the page) and stores it —
  a copy, bit-exact;
- packed: `packed_tile` (triton_dequant.py, the same jit helper the packed-only kernel runs) dequantizes the
  tile in registers from the packed token page and the segment's codebook pages — bit-exact with
  `prq_dequantize` (see triton_dequant.py for why);
- zero: stores `+0.0`;
- any other kind: writes nothing (the debug switch and the reference refuse it).

K and V, every batch element, every run of every segment of the view: one launch, no temporaries, no host-side
work once the run table exists (the cache keeps it in its view plan). `max_run` bounds the rows per run (the
cache passes its table's longest run; on CUDA it splits runs at the dense tokens per page, so dense and packed
programs are about equally busy).

Compile-time constants: the layer shape (`HEAD_DIM`; the tile, chosen for the cache's `2 * B * H` columns),
whether the cache has packed sources at all (`HAS_PACKED`) and the PRQ format — all fixed per layer. Run counts,
token counts, batch, heads, the head slice, the dense tokens per page and page ids are runtime and not specialized
on: one compile per layer shape.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedqvg.kernels.ops import ViewRunsArgs, op_entry
from pagedqvg.kernels.triton_common import (
    CUDA_GRID_MAX,
    NUM_WARPS,
    GridLimitError,
    cdiv,
    is_interpreted,
    launch_on_device,
    tile_for,
)
from pagedqvg.kernels.view.triton_dequant import OUT_KIND, format_constants, kernel_codebooks, packed_tile
from pagedqvg.kernels.view.view_runs import RUN_COLUMNS, check_view_runs

_RUNTIME = ["num_tokens", "batch", "num_heads", "head_start", "heads", "dense_tpp", "cb_rows_per_page"]


@triton.jit(do_not_specialize=_RUNTIME)
def _view_runs_kernel(
    rows_ptr, rs0, rs1, rs2, rs3,  # dense rows [num_pages, rows_per_page, H, D], cache dtype
    tok_ptr, ts0, ts1, ts2, ts3,  # uint8 [num_pages, tpp, 2, B, row_bytes], last stride 1 (unused: HAS_PACKED off)
    cb_ptr, cs0, cs1, cs2, cs3,  # [num_pages, cb_rows_per_page, K, D], cache dtype (CB_FP8: uint8 fp8 bytes)
    runs_ptr,  # int64 [P, 6] contiguous: kind, page, first slot, count, out row, codebook page offset
    cb_pages_ptr,  # int64 [n]
    out_ptr, os0, os1, os2, os3, os4,  # [T, 2, B, heads, D]
    num_tokens, batch, num_heads, head_start, heads, dense_tpp, cb_rows_per_page,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr,
    HAS_PACKED: tl.constexpr,
    CODE_KIND: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    STAGES: tl.constexpr, PER_HEAD_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ZEROS_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr, OUT_KIND: tl.constexpr, CB_FP8: tl.constexpr,
):  # fmt: skip
    run = runs_ptr + tl.program_id(0).to(tl.int64) * 6
    kind = tl.load(run)
    page = tl.load(run + 1)
    first = tl.load(run + 2)
    count = tl.load(run + 3)
    out_row = tl.load(run + 4)

    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # row within the run
    c = tl.program_id(2) * HEADS_PER_BLOCK + tl.arange(0, HEADS_PER_BLOCK)  # column (kv * B + b) * heads + h
    h = c % heads
    kvb = c // heads  # kv * B + b
    kv = kvb // batch
    b = kvb % batch
    d = tl.arange(0, BLOCK_D)
    rmask = (r < count) & (out_row + r < num_tokens)
    cmask = c < 2 * batch * heads
    mask2 = rmask[:, None] & cmask[None, :]  # [R, C]
    mask3 = mask2[:, :, None] & (d < HEAD_DIM)[None, None, :]  # [R, C, D]
    d3 = d[None, None, :]
    orow = (out_row + r) * os0  # [R]
    ocol = kv.to(tl.int64) * os1 + b.to(tl.int64) * os2 + h.to(tl.int64) * os3  # [C]
    optr = out_ptr + (orow[:, None] + ocol[None, :])[:, :, None] + d3 * os4

    if kind == 0:  # dense token rows (row (kv * tpp + slot) * B + b of the page): a copy
        srow = page * rs0 + ((first + r) * batch) * rs1  # [R], int64
        scol = (kv * dense_tpp * batch + b).to(tl.int64) * rs1 + (head_start + h) * rs2  # [C]
        vals = tl.load(rows_ptr + (srow[:, None] + scol[None, :])[:, :, None] + d3 * rs3, mask=mask3)
        tl.store(optr, vals, mask=mask3)
    elif kind == 1:  # packed token rows: dequantized in registers
        if HAS_PACKED:
            res = packed_tile(
                tok_ptr, page * ts0 + (first + r) * ts1, kv * ts2 + b * ts3 + (head_start + h) * PER_HEAD_BYTES,
                cb_ptr, cs0, cs1, cs2, cs3, cb_pages_ptr + tl.load(run + 5),
                (kvb * num_heads + head_start + h).to(tl.int64) * STAGES, cmask, d3, mask2, mask3,
                cb_rows_per_page, out_ptr,
                CODE_KIND, ASYM, QMAX, BLOCK_SIZE, STAGES, PER_HEAD_BYTES, SCALES_OFFSET, ZEROS_OFFSET, IDS_OFFSET,
                OUT_KIND, CB_FP8,
            )  # fmt: skip
            tl.store(optr, res, mask=mask3)
    elif kind == 2:  # rows the cache never filled
        tl.store(optr, tl.zeros([BLOCK_R, HEADS_PER_BLOCK, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=mask3)


#: CUDA's limit on grid axes 1 and 2.
_GRID_YZ_MAX = CUDA_GRID_MAX[1]

#: Format constexprs of a cache without packed sources (the packed branch is not compiled).
NO_FORMAT = dict(CODE_KIND=0, ASYM=False, QMAX=0, BLOCK_SIZE=1, STAGES=1, PER_HEAD_BYTES=0, SCALES_OFFSET=0,
                  ZEROS_OFFSET=0, IDS_OFFSET=0, CB_FP8=False)  # fmt: skip


@op_entry(ViewRunsArgs)
def view_runs_launch(a: ViewRunsArgs, *, block_rows: int | None = None, block_cols: int | None = None):
    """`(kernel, grid, args, kwargs)` of the mixed view build launch, or None when there is nothing to write.

    `max_run`: an upper bound of every run's count (None: T). No data is read on the host: the launch never
    synchronizes with the device.
    """
    check_view_runs(a)
    rows, tokens, codebooks, cb_pages, runs, head_start, out_t, fmt, max_run = (
        a.rows, a.tokens, a.codebooks, a.cb_pages, a.runs, a.head_start, a.out_t, a.fmt, a.max_run
    )  # fmt: skip
    if max_run is not None and max_run < 0:
        raise ValueError(f"max_run must be >= 0 or None, got {max_run}")
    T, _, B, heads, d = out_t.shape
    P = runs.shape[0]
    bound = T if max_run is None else min(max_run, T)
    if T == 0 or heads == 0 or P == 0 or bound == 0:
        return None
    runs = runs.contiguous()
    assert runs.shape[1] == RUN_COLUMNS
    # Columns are the (kv, b, head) records of a token: the tile of a layer with 2 * B * H heads.
    tile = tile_for(d, 2 * B * rows.shape[2], block_rows, block_cols, interpreted=is_interpreted(_view_runs_kernel))
    grid = (P, cdiv(bound, tile.block_r), cdiv(2 * B * heads, tile.heads_per_block))
    if grid[1] > _GRID_YZ_MAX or grid[2] > _GRID_YZ_MAX:
        raise GridLimitError(
            f"view_runs grid {grid} exceeds CUDA's {_GRID_YZ_MAX} programs on axis 1/2: pass max_run (the longest "
            f"run; {tile.block_r * _GRID_YZ_MAX} rows at most, the cache splits runs at a page) or fewer columns"
        )
    if fmt is None:  # no packed sources: placeholders the kernel never reads
        tokens_a, codebooks_a, cb_pages_a, cb_rpp = (rows, 0, 0, 0, 0), (rows, 0, 0, 0, 0), runs, 1
        fmt_kw = dict(NO_FORMAT, OUT_KIND=OUT_KIND[rows.dtype])
    else:
        assert tokens is not None and codebooks is not None and cb_pages is not None
        codebooks = kernel_codebooks(codebooks)
        tokens_a, codebooks_a = (tokens, *tokens.stride()[:4]), (codebooks, *codebooks.stride())
        cb_pages_a, cb_rpp = cb_pages.contiguous(), codebooks.shape[1]
        fmt_kw = format_constants(fmt)
    args = (
        rows, *rows.stride(),
        *tokens_a,
        *codebooks_a,
        runs, cb_pages_a,
        out_t, *out_t.stride(),
        T, B, rows.shape[2], head_start, heads, rows.shape[1] // (2 * B), cb_rpp,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=d, BLOCK_R=tile.block_r, BLOCK_D=tile.block_d, HEADS_PER_BLOCK=tile.heads_per_block,
        HAS_PACKED=fmt is not None, **fmt_kw, num_warps=NUM_WARPS,
    )  # fmt: skip
    return _view_runs_kernel, grid, args, kwargs


@op_entry(ViewRunsArgs)
def view_runs_triton(a: ViewRunsArgs, *, block_rows: int | None = None, block_cols: int | None = None) -> None:
    """`view_runs_torch` in one Triton launch. `block_rows`/`block_cols` override the tile (tests)."""
    launch_on_device("view_runs", view_runs_launch(a, block_rows=block_rows, block_cols=block_cols))
