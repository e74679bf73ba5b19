"""Split-KV attention from pages in Triton: the op of triton_attention.py (`attend_runs_torch`) with the view's keys
cut into `S` contiguous ranges (kernels/attention_split.py: the math, the heuristic and its torch reference), in two
launches:

1. `_attend_split_kernel`, grid `(cdiv(Tq, BLOCK_M), B * hin, S)`: program `(i, j, s)` runs triton_attention's
   online softmax (the same `dense_block` / `packed_block` / `softmax_step` helpers, blocks and constants) over
   keys `[s·c, min((s+1)·c, T))` only, `c = ceil(T / S)`, and stores its unnormalized partial `acc` `[BLOCK_M, D]`
   and `(m, l)` `[BLOCK_M]` in the accumulator dtype (fp32; fp64 for fp32 caches). A row index is sliced directly;
   a run table (`out_row`, column 4, ascending from 0: kernels/view_runs.py) is searched for the first and the
   past-the-end run of the range (two binary searches of `ceil(log2(P)) + 1` steps), runs cut mid-run by offsets;
   a zero run folds in its rows inside the range.
2. `_merge_kernel`, grid `(cdiv(Tq, BLOCK_M), B * hin)`: reads the `S` partials of its tile, merges them online by
   log-sum-exp (`M = max m_s`; weights `e^(m_s - M)`), writes `acc / l` in the query dtype (bf16 rounded to nearest
   even, as triton_attention).

Scratch: one tensor of `split_scratch_bytes` (partials `[S, B * hin, Tq, D]` then `(m, l)` `[S, B * hin, 2, Tq]`),
allocated per call. Cost over one launch: the scratch written and read once, the merge launch, and per program the
run-table searches; the gain is `S` times the programs for a call with few query blocks x heads (see the heuristic).
`attend_triton` (this module) picks `S` (`attention_split.choose_splits`, or `set_forced_splits`) and
launches one kernel for `S = 1`, these two otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedqvg.kernels.attention.attention_split import choose_splits, forced_splits, sm_count, split_keys
from pagedqvg.kernels.attention.triton_attention import (
    BLOCK_M,
    BLOCK_N,
    BLOCK_N_PACKED,
    RUNTIME_ARGS,
    attend_launch,
    dense_block,
    packed_block,
    round_to,
    softmax_step,
)
from pagedqvg.kernels.ops import AttendArgs, op_entry
from pagedqvg.kernels.triton_common import NUM_WARPS, cdiv, launch_on_device
from pagedqvg.kernels.view.view_runs import RUN_COLUMNS

RUNTIME_SPLIT_ARGS = [*RUNTIME_ARGS, "keys_per_split", "search_steps"]


@triton.jit
def _first_run_after(runs_ptr, n_runs, key, search_steps, RUN_COLS: tl.constexpr):
    """The number of runs whose `out_row` (column 4, ascending, run 0 at 0) is <= `key`, minus one: the run holding
    view row `key` (`n_runs - 1` past the end). A fixed-step binary search (`search_steps >= ceil(log2(P)) + 1`)."""
    lo = n_runs * 0
    hi = n_runs
    for _ in range(0, search_steps):
        active = hi - lo > 1
        mid = (lo + hi) // 2
        below = tl.load(runs_ptr + mid.to(tl.int64) * RUN_COLS + 4, mask=active, other=0) <= key
        lo = tl.where(active & below, mid, lo)
        hi = tl.where(active & (below == 0), mid, hi)
    return lo


@triton.jit(do_not_specialize=RUNTIME_SPLIT_ARGS)
def _attend_split_kernel(
    q_ptr, qs0, qs1, qs2, qs3,  # [B, Tq, hin, D], cache dtype
    rows_ptr, rs0, rs1, rs2,  # dense rows [num_pages, rows_per_page, H, D] (last stride 1)
    pidx_ptr, ps0, ps1, ps2,  # INDEXED: int64 [2, B, T] page of each key row
    sidx_ptr, ss0, ss1, ss2,  # INDEXED: int64 [2, B, T] row (within its page) of each key row
    tok_ptr, ts0, ts1, ts2, ts3,  # packed token pages (HAS_PACKED), uint8, last stride 1
    cb_ptr, cs0, cs1, cs2, cs3,  # codebook pages
    runs_ptr, cb_pages_ptr,  # run table int64 [P, RUN_COLS] contiguous; codebook pages of the view's segments
    out_ptr, os0, os1, os2, os3,  # the output (not written here: the merge kernel writes it)
    scale, q_len, n_keys, n_runs, batch, num_heads, head_start, hin, dense_tpp, cb_rows_per_page,
    part_ptr, as0, as1, as2, as3,  # partial acc [S, B * hin, Tq, D], ACC_T
    ml_ptr, ms0, ms1, ms2, ms3,  # partial (m, l) [S, B * hin, 2, Tq], ACC_T
    keys_per_split, search_steps,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INDEXED: tl.constexpr, HAS_PACKED: tl.constexpr, ACC_T: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    CODE_KIND: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    STAGES: tl.constexpr, PER_HEAD_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ZEROS_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr, OUT_KIND: tl.constexpr, CB_FP8: tl.constexpr, RUN_COLS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    b = bh // hin
    h = bh % hin
    hd = head_start + h
    sp = tl.program_id(2)
    k0 = sp * keys_per_split
    k1 = tl.minimum(k0 + keys_per_split, n_keys)
    qm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    qmask = (qm < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    qoff = b.to(tl.int64) * qs0 + qm.to(tl.int64)[:, None] * qs1 + h * qs2 + d[None, :] * qs3
    q = tl.load(q_ptr + qoff, mask=qmask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), ACC_T)
    l_i = tl.zeros([BLOCK_M], ACC_T)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_T)
    if INDEXED:
        for t0 in range(k0, k1, BLOCK_N):
            t = t0 + n
            kmask = t < k1
            po = pidx_ptr + b.to(tl.int64) * ps1 + t.to(tl.int64) * ps2
            so = sidx_ptr + b.to(tl.int64) * ss1 + t.to(tl.int64) * ss2
            k = dense_block(rows_ptr, rs0, rs1, rs2, tl.load(po, mask=kmask, other=0),
                             tl.load(so, mask=kmask, other=0), hd, d, kmask, HEAD_DIM)  # fmt: skip
            v = dense_block(rows_ptr, rs0, rs1, rs2, tl.load(po + ps0, mask=kmask, other=0),
                             tl.load(so + ss0, mask=kmask, other=0), hd, d, kmask, HEAD_DIM)  # fmt: skip
            m_i, l_i, acc = softmax_step(q, k, v, kmask, m_i, l_i, acc, scale, ACC_T, DOT_PREC, UPCAST)
    else:
        p_first = _first_run_after(runs_ptr, n_runs, k0, search_steps, RUN_COLS)
        p_end = _first_run_after(runs_ptr, n_runs, k1 - 1, search_steps, RUN_COLS) + 1
        for p in range(p_first, p_end):
            run = runs_ptr + p * RUN_COLS
            kind = tl.load(run)
            page = tl.load(run + 1)
            first = tl.load(run + 2)
            out_row = tl.load(run + 4)
            r_lo = tl.maximum(k0 - out_row, 0)  # the run's rows [r_lo, r_hi) lie in the range
            r_hi = tl.minimum(k1 - out_row, tl.load(run + 3))
            if kind == 2:  # never-written rows: `r_hi - r_lo` keys of score 0, value 0
                m_new = tl.maximum(m_i, 0.0)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + (r_hi - r_lo).to(ACC_T) * tl.exp(-m_new)
                acc = acc * alpha[:, None]
                m_i = m_new
            else:
                for r0 in range(r_lo, r_hi, BLOCK_N):
                    r = r0 + n
                    kmask = r < r_hi
                    slot = (first + r).to(tl.int64)
                    if kind == 0:
                        pages = page + r * 0
                        k = dense_block(rows_ptr, rs0, rs1, rs2, pages, slot * batch + b, hd, d, kmask, HEAD_DIM)
                        v = dense_block(rows_ptr, rs0, rs1, rs2, pages, (dense_tpp + slot) * batch + b, hd, d,
                                         kmask, HEAD_DIM)  # fmt: skip
                    else:
                        if HAS_PACKED:
                            row_off = page * ts0 + slot * ts1
                            seg = cb_pages_ptr + tl.load(run + 5)
                            k = packed_block(
                                tok_ptr, row_off, 0, b, hd, ts2, ts3, cb_ptr, cs0, cs1, cs2, cs3, seg, batch,
                                num_heads, d, kmask, cb_rows_per_page, q_ptr,
                                CODE_KIND, ASYM, QMAX, BLOCK_SIZE, STAGES, PER_HEAD_BYTES, SCALES_OFFSET,
                                ZEROS_OFFSET, IDS_OFFSET, OUT_KIND, CB_FP8, HEAD_DIM, BLOCK_N, BLOCK_D,
                            )  # fmt: skip
                            v = packed_block(
                                tok_ptr, row_off, 1, b, hd, ts2, ts3, cb_ptr, cs0, cs1, cs2, cs3, seg, batch,
                                num_heads, d, kmask, cb_rows_per_page, q_ptr,
                                CODE_KIND, ASYM, QMAX, BLOCK_SIZE, STAGES, PER_HEAD_BYTES, SCALES_OFFSET,
                                ZEROS_OFFSET, IDS_OFFSET, OUT_KIND, CB_FP8, HEAD_DIM, BLOCK_N, BLOCK_D,
                            )  # fmt: skip
                        else:
                            k = tl.zeros([BLOCK_N, BLOCK_D], q_ptr.dtype.element_ty)
                            v = tl.zeros([BLOCK_N, BLOCK_D], q_ptr.dtype.element_ty)
                    m_i, l_i, acc = softmax_step(q, k, v, kmask, m_i, l_i, acc, scale, ACC_T, DOT_PREC, UPCAST)
    qrow = qm < q_len
    poff = sp.to(tl.int64) * as0 + bh.to(tl.int64) * as1 + qm.to(tl.int64)[:, None] * as2 + d[None, :] * as3
    tl.store(part_ptr + poff, acc, mask=qmask)
    moff = sp.to(tl.int64) * ms0 + bh.to(tl.int64) * ms1 + qm.to(tl.int64) * ms3
    tl.store(ml_ptr + moff, m_i, mask=qrow)
    tl.store(ml_ptr + moff + ms2, l_i, mask=qrow)


@triton.jit(do_not_specialize=["q_len", "hin", "splits"])
def _merge_kernel(
    part_ptr, as0, as1, as2, as3,  # partial acc [S, B * hin, Tq, D]
    ml_ptr, ms0, ms1, ms2, ms3,  # partial (m, l) [S, B * hin, 2, Tq]
    out_ptr, os0, os1, os2, os3,  # [B, Tq, hin, D], the query dtype
    q_len, hin, splits,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC_T: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    b = bh // hin
    h = bh % hin
    qm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qrow = qm < q_len
    qmask = qrow[:, None] & (d < HEAD_DIM)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), ACC_T)
    l_i = tl.zeros([BLOCK_M], ACC_T)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_T)
    poff = bh.to(tl.int64) * as1 + qm.to(tl.int64)[:, None] * as2 + d[None, :] * as3
    moff = bh.to(tl.int64) * ms1 + qm.to(tl.int64) * ms3
    for s in range(0, splits):
        s64 = bh.to(tl.int64) * 0 + s
        m_s = tl.load(ml_ptr + s64 * ms0 + moff, mask=qrow, other=float("-inf"))
        l_s = tl.load(ml_ptr + s64 * ms0 + moff + ms2, mask=qrow, other=0.0)
        a_s = tl.load(part_ptr + s64 * as0 + poff, mask=qmask, other=0.0)
        m_new = tl.maximum(m_i, m_s)
        top = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys yet: every weight e^(-inf) = 0
        alpha = tl.exp(m_i - top)
        beta = tl.exp(m_s - top)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_i = m_new
    out = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(tl.float32)
    ooff = b.to(tl.int64) * os0 + qm.to(tl.int64)[:, None] * os1 + h * os2 + d[None, :] * os3
    tl.store(out_ptr + ooff, round_to(out, tl.zeros([1], out_ptr.dtype.element_ty)), mask=qmask)


@op_entry(AttendArgs)
def attend_split_launch(a: AttendArgs, out: torch.Tensor, splits: int, *, block_m: int = BLOCK_M,
                        block_n: int | None = None):  # fmt: skip
    """`(partials launch, merge launch, scratch)` of a split call over `splits` key ranges (fewer when the keys run
    out: `attention_split.split_keys`), or None for no queries. The partials launch takes triton_attention's
    `attend_launch` arguments (same checks, blocks and constants) plus the scratch and the range; `scratch` is the
    one tensor both launches use (`split_scratch_bytes`)."""
    single = attend_launch(a, out, block_m=block_m, block_n=block_n)
    if single is None:
        return None
    _kernel, (q_blocks, bh), args, kwargs = single
    _, Tq, hin, D = a.query.shape
    per_split, s = split_keys(a.n_keys, splits)
    acc_dtype = torch.float64 if a.query.dtype == torch.float32 else torch.float32
    scratch = torch.empty(s * bh * Tq * (D + 2), dtype=acc_dtype, device=a.query.device)
    part = scratch[: s * bh * Tq * D].view(s, bh, Tq, D)
    ml = scratch[s * bh * Tq * D :].view(s, bh, 2, Tq)
    n_runs = 0 if a.runs is None else a.runs.shape[0]
    extra = (part, *part.stride(), ml, *ml.stride(), per_split, max(1, n_runs).bit_length() + 1)
    partials = (_attend_split_kernel, (q_blocks, bh, s), (*args, *extra), dict(kwargs, RUN_COLS=RUN_COLUMNS))
    block_d = kwargs["BLOCK_D"]
    merge = (
        _merge_kernel, (q_blocks, bh), (part, *part.stride(), ml, *ml.stride(), out, *out.stride(), Tq, hin, s),
        dict(HEAD_DIM=D, BLOCK_M=kwargs["BLOCK_M"], BLOCK_D=block_d, ACC_T=kwargs["ACC_T"],
             num_warps=NUM_WARPS if block_d < 128 else 8),
    )  # fmt: skip
    return partials, merge, scratch


def auto_splits(a: AttendArgs, *, block_m: int = BLOCK_M, block_n: int | None = None) -> int:
    """The key ranges of a call: `set_forced_splits`'s value when set, else `choose_splits` for the call's query
    blocks x batch x heads, keys and the device's multiprocessors. O(MAX_SPLITS) host arithmetic, no sync."""
    forced = forced_splits()
    if forced is not None:
        return forced
    B, Tq, hin, _ = a.query.shape
    bn = block_n if block_n is not None else BLOCK_N if a.packed is None else BLOCK_N_PACKED
    return choose_splits(cdiv(Tq, block_m), B * hin, a.n_keys, sm_count(a.query.device), bn)


@op_entry(AttendArgs)
def attend_split_triton(a: AttendArgs, out: torch.Tensor, splits: int, **blocks) -> None:
    """`attend_triton` as `splits` key ranges: the partials launch, then the merge launch writing `out`
    `[B, Tq, hin, D]` (both through `launch_on_device`: grids checked, launched on the tensors' device)."""
    launch = attend_split_launch(a, out, splits, **blocks)
    if launch is None:
        return
    partials, merge, _scratch = launch
    launch_on_device("attention split", partials)
    launch_on_device("attention merge", merge)


@op_entry(AttendArgs)
def attend_triton(a: AttendArgs, out: torch.Tensor, *, splits: int | None = None, **blocks) -> None:
    """`attend_runs_torch` in Triton (arguments: `ops.AttendArgs`, then `out` `[B, Tq, hin, D]`, which it writes):
    one launch, or the keys split into `splits` ranges with a merge launch (this module; None: its
    `auto_splits` picks, 1 for most calls)."""
    s = auto_splits(a, **blocks) if splits is None else splits
    if s == 1:
        launch_on_device("attention", attend_launch(a, out, **blocks))
    else:
        attend_split_triton(a, out, s, **blocks)
