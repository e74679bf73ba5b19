"""Triton FlashAttention over a view plan, straight from pages: the same op as `attend_runs_torch`
(attention_runs.py), one launch per call.

Grid: `(cdiv(Tq, BLOCK_M), B * hin)`. Program `(i, j)` owns query rows `[i * BLOCK_M, (i + 1) * BLOCK_M)` of batch
element `j // hin`, head `j % hin` of the slice, keeps its `[BLOCK_M, BLOCK_D]` query tile in registers and walks
the whole view in key blocks of `BLOCK_N` rows with an online softmax (running max `m`, sum `l`, output `acc`, all
fp32; fp64 for fp32 caches, as `attention.merge_dtype`):

- a row-index plan (`INDEXED`: dense views) reads key block `t` of `page_idx` / `slot_idx` `[2, B, T]` and loads
  its rows in place from the pool's pages;
- a run-table plan walks the runs in order; per run, per key block of the run:
  - dense (kind 0): rows read in place (row `kv * tpp * B + slot * B + b` of the page, as `view_runs`);
  - packed (kind 1): K and V decoded in registers by `packed_tile` (triton_dequant.py, the helper the view
    kernels run: every PRQ format — int2/int4 codes, sym/asym fp8 block scales, trits, fp8 or cache-dtype
    codebooks), bit-exact with the view's rows;
  - zero (kind 2): `count` keys of score 0 and value 0, folded in without reading anything
    (`l = l * e^(m - m') + count * e^(-m')`).

Scores are `tl.dot(q, kᵀ)` in the cache dtype with fp32 accumulation (fp32 caches: IEEE fp32, not TF32) times
`scale`; for 16-bit caches the P·V product takes `p` rounded (to nearest even) to the cache dtype, as
FlashAttention (measured through the interpreter: 1.0x SDPA-on-view's error vs fp64 in bf16; a truncating bf16
rounding measured 1.6x, hence `round_to`), fp32 caches one IEEE fp32 product into fp64 accumulators.
Output `acc / l` cast to the query dtype. Nothing is allocated besides the output; no host work besides the launch
(the plan's tensors exist already). Cost: O(Tq · T · D) flops per (b, head); K/V rows read once per query block.

`dense_block`, `packed_block`, `softmax_step`, `round_to` and `RUNTIME_ARGS` are public: the split kernel
(triton_attention_split.py) runs the same helpers.

Compile-time constants: `HEAD_DIM`, the blocks, the plan kind, the PRQ format (per layer); the query length, the
view length, the run count, the head slice and the scale are runtime arguments (one compile per layer shape).
`attend_triton` launches this kernel alone, or (for calls with few query blocks x heads over many keys) the
split-KV pair of triton_attention_split.py (the keys cut into ranges, partials merged by a second launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedqvg.kernels.ops import AttendArgs, op_entry
from pagedqvg.kernels.triton_common import NUM_WARPS, cdiv, is_interpreted, next_pow2
from pagedqvg.kernels.view.triton_dequant import (
    OUT_KIND,
    f32_to_bf16_rtne,
    format_constants,
    kernel_codebooks,
    packed_tile,
)
from pagedqvg.kernels.view.triton_view_runs import NO_FORMAT

#: The runtime (not specialized) arguments of the attention kernels.
RUNTIME_ARGS = ["q_len", "n_keys", "n_runs", "batch", "num_heads", "head_start", "hin", "dense_tpp", "cb_rows_per_page"]

#: Query rows and key rows per block on CUDA (Triton's interpreter: the same; its cost is per program).
BLOCK_M = 64
BLOCK_N = 64
#: Key rows per block when the cache has packed sources (the decode's registers; compact spilled at 64).
BLOCK_N_PACKED = 32


@triton.jit
def dense_block(rows_ptr, rs0, rs1, rs2, page, row, hd, d, kmask, HEAD_DIM: tl.constexpr):
    """`[N, D]` rows `row` of pages `page` (both `[N]`, int64), head `hd`, from the dense pool (masked: 0)."""
    ptr = rows_ptr + (page * rs0 + row * rs1 + hd * rs2)[:, None] + d[None, :]
    return tl.load(ptr, mask=kmask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def packed_block(
    tok_ptr, row_off, kv, b, hd, ts2, ts3, cb_ptr, cs0, cs1, cs2, cs3, seg_cb_pages, batch, num_heads, d, kmask,
    cb_rows_per_page, out_ptr,
    CODE_KIND: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    STAGES: tl.constexpr, PER_HEAD_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ZEROS_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr, OUT_KIND: tl.constexpr, CB_FP8: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`[N, D]` packed rows (token byte offsets `row_off` `[N]`) of record (kv, b, head `hd`), decoded in registers
    by `packed_tile` as a one-column tile."""
    one = tl.arange(0, 1)
    col = (kv * ts2 + b * ts3 + hd * PER_HEAD_BYTES) + one * 0  # [1]
    head_row = (((kv * batch + b) * num_heads + hd) * STAGES).to(tl.int64) + one * 0
    d3 = d[None, None, :]
    mask2 = kmask[:, None] & (one >= 0)[None, :]
    mask3 = mask2[:, :, None] & (d3 < HEAD_DIM)
    res = packed_tile(
        tok_ptr, row_off, col, cb_ptr, cs0, cs1, cs2, cs3, seg_cb_pages, head_row, one >= 0, d3, mask2, mask3,
        cb_rows_per_page, out_ptr,
        CODE_KIND, ASYM, QMAX, BLOCK_SIZE, STAGES, PER_HEAD_BYTES, SCALES_OFFSET, ZEROS_OFFSET, IDS_OFFSET,
        OUT_KIND, CB_FP8,
    )  # fmt: skip
    res = tl.where(mask3, res, 0.0).to(out_ptr.dtype.element_ty)
    return tl.reshape(res, (BLOCK_N, BLOCK_D))


@triton.jit
def round_to(x, like):
    """fp32 `x` rounded to nearest even in `like`'s dtype (bf16 by integer ops: the interpreter truncates)."""
    if like.dtype == tl.bfloat16:
        return f32_to_bf16_rtne(x)
    else:
        return x.to(like.dtype)


@triton.jit
def softmax_step(
    q, k, v, kmask, m_i, l_i, acc, scale, ACC_T: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr
):
    """Fold one key block into the online softmax (`m`, `l`, `acc`). `UPCAST` (bf16 in the interpreter, whose
    `tl.dot` misreads bf16): the same products from the same bf16 values, upcast exactly to fp32 first."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC).to(ACC_T) * scale
    s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if ACC_T == tl.float64:  # noqa: SIM300 (a constexpr dtype)
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=DOT_PREC).to(ACC_T)
    else:  # p rounded to the cache dtype (as FlashAttention): one tensor-core product, fp32 accumulation
        p16 = round_to(p, v)
        if UPCAST:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
            pv = tl.dot(p16.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p16, v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _attend_kernel(
    q_ptr, qs0, qs1, qs2, qs3,  # [B, Tq, hin, D], cache dtype
    rows_ptr, rs0, rs1, rs2,  # dense rows [num_pages, rows_per_page, H, D] (last stride 1)
    pidx_ptr, ps0, ps1, ps2,  # INDEXED: int64 [2, B, T] page of each key row
    sidx_ptr, ss0, ss1, ss2,  # INDEXED: int64 [2, B, T] row (within its page) of each key row
    tok_ptr, ts0, ts1, ts2, ts3,  # packed token pages (HAS_PACKED), uint8, last stride 1
    cb_ptr, cs0, cs1, cs2, cs3,  # codebook pages
    runs_ptr, cb_pages_ptr,  # run table int64 [P, 6] contiguous; codebook pages of the view's segments
    out_ptr, os0, os1, os2, os3,  # [B, Tq, hin, D]
    scale, q_len, n_keys, n_runs, batch, num_heads, head_start, hin, dense_tpp, cb_rows_per_page,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INDEXED: tl.constexpr, HAS_PACKED: tl.constexpr, ACC_T: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    CODE_KIND: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    STAGES: tl.constexpr, PER_HEAD_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ZEROS_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr, OUT_KIND: tl.constexpr, CB_FP8: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    b = bh // hin
    h = bh % hin
    hd = head_start + h
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
        for t0 in range(0, n_keys, BLOCK_N):
            t = t0 + n
            kmask = t < n_keys
            po = pidx_ptr + b.to(tl.int64) * ps1 + t.to(tl.int64) * ps2
            so = sidx_ptr + b.to(tl.int64) * ss1 + t.to(tl.int64) * ss2
            k = dense_block(rows_ptr, rs0, rs1, rs2, tl.load(po, mask=kmask, other=0),
                             tl.load(so, mask=kmask, other=0), hd, d, kmask, HEAD_DIM)  # fmt: skip
            v = dense_block(rows_ptr, rs0, rs1, rs2, tl.load(po + ps0, mask=kmask, other=0),
                             tl.load(so + ss0, mask=kmask, other=0), hd, d, kmask, HEAD_DIM)  # fmt: skip
            m_i, l_i, acc = softmax_step(q, k, v, kmask, m_i, l_i, acc, scale, ACC_T, DOT_PREC, UPCAST)
    else:
        for p in range(0, n_runs):
            run = runs_ptr + p * 6
            kind = tl.load(run)
            page = tl.load(run + 1)
            first = tl.load(run + 2)
            count = tl.load(run + 3)
            if kind == 2:  # never-written rows: `count` keys of score 0, value 0
                m_new = tl.maximum(m_i, 0.0)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + count.to(ACC_T) * tl.exp(-m_new)
                acc = acc * alpha[:, None]
                m_i = m_new
            else:
                for r0 in range(0, count, BLOCK_N):
                    r = r0 + n
                    kmask = r < count
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
    out = (acc / l_i[:, None]).to(tl.float32)
    ooff = b.to(tl.int64) * os0 + qm.to(tl.int64)[:, None] * os1 + h * os2 + d[None, :] * os3
    tl.store(out_ptr + ooff, round_to(out, q), mask=qmask)


@op_entry(AttendArgs)
def attend_launch(a: AttendArgs, out: torch.Tensor, *, block_m: int = BLOCK_M, block_n: int | None = None):
    """`(kernel, grid, args, kwargs)` of one attention launch (see the module docstring), or None for no queries.

    `plan_index`: `(page_idx, slot_idx)` `[2, B, T]` of a dense view, else `runs` (int64 `[P, 6]`) with `packed =
    (token pages, codebook rows, cb_pages)` and `fmt` when the cache quantizes. `query`, `out` `[B, Tq, hin, D]`."""
    query, rows, plan_index, runs, packed, fmt, head_start, n_keys, scale = a
    B, Tq, hin, D = query.shape
    if Tq == 0 or hin == 0:
        return None
    if rows.stride(3) != 1 or query.shape != out.shape:
        raise ValueError(f"attention: rows need a last stride of 1 (got {rows.stride()}) and out the query's shape "
                         f"{tuple(query.shape)} (got {tuple(out.shape)})")  # fmt: skip
    if block_n is None:  # packed decode holds more registers: half the key block (no spills at sm_90, head_dim 128)
        block_n = BLOCK_N if packed is None else BLOCK_N_PACKED
    block_d = max(16, next_pow2(D))
    acc_t = tl.float64 if query.dtype == torch.float32 else tl.float32
    dot_prec = "ieee" if query.dtype == torch.float32 else "tf32"
    upcast = query.dtype == torch.bfloat16 and is_interpreted(_attend_kernel)
    if plan_index is not None:
        pidx, sidx = plan_index
        idx_a, runs_a, n_runs = (pidx, *pidx.stride(), sidx, *sidx.stride()), pidx, 0
    else:
        assert runs is not None
        runs = runs.contiguous()
        idx_a, runs_a, n_runs = (runs, 0, 0, 0, runs, 0, 0, 0), runs, runs.shape[0]
    if packed is None:
        tok_a, cb_a, cbp, cb_rpp = (rows, 0, 0, 0, 0), (rows, 0, 0, 0, 0), runs_a, 1
        fmt_kw = dict(NO_FORMAT, OUT_KIND=OUT_KIND[rows.dtype])
    else:
        assert fmt is not None
        tokens, codebooks, cb_pages = packed
        codebooks = kernel_codebooks(codebooks)
        tok_a, cb_a = (tokens, *tokens.stride()[:4]), (codebooks, *codebooks.stride())
        cbp, cb_rpp = cb_pages.contiguous(), codebooks.shape[1]
        fmt_kw = format_constants(fmt)
    grid = (cdiv(Tq, block_m), B * hin)
    args = (
        query, *query.stride(), rows, *rows.stride()[:3], *idx_a, *tok_a, *cb_a, runs_a, cbp, out, *out.stride(),
        float(scale), Tq, n_keys, n_runs, B, rows.shape[2], head_start, hin, rows.shape[1] // (2 * B), cb_rpp,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, INDEXED=plan_index is not None,
        HAS_PACKED=packed is not None, ACC_T=acc_t, DOT_PREC=dot_prec, UPCAST=upcast, **fmt_kw,
        num_warps=NUM_WARPS if is_interpreted(_attend_kernel) else 8 if block_d >= 128 else NUM_WARPS,
    )  # fmt: skip
    return _attend_kernel, grid, args, kwargs
