"""Triton packed view build: the same signature and result as `packed_dequant_torch` (dequant.py), in one launch.

Grid: `(P * 2 * B * head_blocks, cdiv(min(tokens_per_page, T), BLOCK_R))`, `head_blocks = cdiv(heads,
HEADS_PER_BLOCK)`; axis 0 folds `(p, g)` (`p = x // (2 * B * head_blocks)`, `g = x % ...`) so the column groups
never meet CUDA's 65535 limit of axes y/z. Program `(p, i, g)` reads
piece `p` of the piece table (pieces of one or several packed segments), token slots
`first + [i * BLOCK_R, (i + 1) * BLOCK_R)` (masked to the piece's count), of one (kv, b) = `g // head_blocks` and
`HEADS_PER_BLOCK` heads of the requested slice, as a `[BLOCK_R, HEADS_PER_BLOCK, BLOCK_D]` tile. Everything happens
in registers: per element it loads the code byte, the fp8 scale (and zero) byte of its block and, per (token, head),
the stage ids; it decodes them with integer ops, gathers the centroids of each stage from the codebook pages, adds
in fp32 in `prq_dequantize`'s order and stores the cache dtype. K and V, every batch element and every piece of
every listed segment: one launch, no temporaries. The tile is computed by `packed_tile`, a `@triton.jit` helper
that the mixed view build (triton_view_runs.py: dense, packed and zero runs of a whole view in one launch) calls
too. This kernel remains for packed-only reads (`PackedStore.dequantize_into`: unpacking a segment).

Bit-exactness with the torch reference (`prq_dequantize`), for every finite input:
- fp8 e4m3 scales/zeros are decoded with integer ops into exact fp32 (no fp8 hardware type: works on sm_80, and
  the interpreter's fp8 path is not used); bf16 codebook values are widened by a 16-bit shift (exact); fp8
  codebooks (`codebook_fp8`) are read as bytes and decoded like the scales (the launch passes a uint8 view).
- `(c - qmax) * scale` and `c * scale` are exact in fp32 (integers < 16 times 4-significant-bit scales), so a
  fused multiply-add on the GPU rounds exactly like torch's separate multiply and add; the centroid adds are
  plain fp32 adds in stage order.
- fp32 -> bf16 is rounded to nearest even with integer ops (Triton's interpreter truncates in `.to(tl.bfloat16)`;
  the integer rounding is what the GPU's `cvt.rn.bf16.f32` does). fp32 -> fp16 uses the native cast (RTNE on
  both). Only NaN payloads may differ (torch itself writes 0x7FC0 or 0xFFFF for bf16 NaN depending on the path).

Compile-time constants: the layer shape (`HEAD_DIM`, the tile) and the PRQ format (code kind, qmax, block size,
stages, record offsets, cache dtype) — all fixed per layer. Piece counts, token counts, batch, heads, the head
slice and page ids are runtime and not specialized on, so no segment or view length recompiles the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedqvg.kernels.ops import PackedDequantArgs, op_entry
from pagedqvg.kernels.triton_common import NUM_WARPS, cdiv, is_interpreted, launch_on_device, tile_for
from pagedqvg.kernels.view.dequant import check_packed_dequant
from pagedqvg.quant import PackedFormat

_RUNTIME = ["num_tokens", "batch", "num_heads", "head_start", "heads", "head_blocks", "cb_rows_per_page"]

#: OUT_KIND constexpr per cache dtype (shared by every kernel that writes cache-dtype views).
OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: CODE_KIND constexpr: 4-bit codes, 2-bit codes, base-3 trits (5 per byte).
INT4, INT2, TRITS = 0, 1, 2


@triton.jit
def fp8e4m3_to_f32(byte):
    """uint8/int32 fp8 e4m3fn bit patterns -> exact float32 (NaN for S.1111.111; e4m3fn has no infinities)."""
    x = byte.to(tl.uint32) & 0xFF
    sign = (x >> 7) << 31
    e = (x >> 3) & 0xF
    m = x & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # (1 + m/8) * 2^(e-7)
    sub = m.to(tl.float32) * 0.001953125  # m/8 * 2^-6 = m * 2^-9, exact
    sub = tl.where(sign != 0, -sub, sub)
    nan = (sign | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(e == 0, sub, tl.where((e == 15) & (m == 7), nan, normal))


@triton.jit
def f32_to_bf16_rtne(x):
    """float32 -> bfloat16, round to nearest even (what `torch.Tensor.to(torch.bfloat16)` does), via integer ops."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def packed_tile(
    tok_ptr,  # uint8 [num_pages, tpp, 2, B, row_bytes], last stride 1
    row_off,  # [R] int64: byte offset of each tile row's token (page * ts0 + slot * ts1)
    col_off,  # [C]: byte offset of each tile column's record in that token (kv * ts2 + b * ts3 + h * per-head bytes)
    cb_ptr, cs0, cs1, cs2, cs3,  # [num_pages, cb_rows_per_page, K, D], cache dtype (CB_FP8: uint8 fp8 bytes)
    seg_cb_pages,  # int64 pointer: this segment's codebook pages
    head_row,  # [C] int64: codebook row of each column's stage 0, ((kv * B + b) * H + h) * STAGES
    cmask, d3, mask2, mask3,  # valid columns [C], channels [1, 1, D], valid [R, C] and [R, C, D]
    cb_rows_per_page, out_ptr,
    CODE_KIND: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    STAGES: tl.constexpr, PER_HEAD_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ZEROS_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr, OUT_KIND: tl.constexpr, CB_FP8: tl.constexpr,
):  # fmt: skip
    """Dequantized `[R, C, D]` tile: rows are tokens, columns are (kv, b, head) records of them (any mix), in the
    element type of `out_ptr` (masked-off elements hold garbage; store with `mask3`). Shared by the packed view
    build and the mixed view build (triton_view_runs.py)."""
    # Per-head records of these tokens: [R, C, 1] byte pointers.
    rec = (tok_ptr + row_off[:, None] + col_off[None, :])[:, :, None]

    # Codes.
    if CODE_KIND == 0:
        byte = tl.load(rec + d3 // 2, mask=mask3, other=0).to(tl.int32)
        c = (byte >> (4 - 4 * (d3 % 2))) & 0xF
    elif CODE_KIND == 1:
        byte = tl.load(rec + d3 // 4, mask=mask3, other=0).to(tl.int32)
        c = (byte >> (6 - 2 * (d3 % 4))) & 0x3
    else:
        byte = tl.load(rec + d3 // 5, mask=mask3, other=0).to(tl.int32)
        k = d3 % 5
        div = tl.where(k == 0, 81, tl.where(k == 1, 27, tl.where(k == 2, 9, tl.where(k == 3, 3, 1))))
        c = (byte // div) % 3
    q = c.to(tl.float32)

    # Block scale (and zero): fp8 bytes, decoded exactly.
    blk = d3 // BLOCK_SIZE
    scale = fp8e4m3_to_f32(tl.load(rec + SCALES_OFFSET + blk, mask=mask3, other=0))
    if ASYM:
        zero = fp8e4m3_to_f32(tl.load(rec + ZEROS_OFFSET + blk, mask=mask3, other=0))
        val = q * scale + zero
    else:
        val = (q - QMAX) * scale

    # Centroids of each stage, added in stage order (codebook row ((kv * B + b) * H + h) * STAGES + s).
    for s in tl.static_range(STAGES):
        ids = tl.load(rec + IDS_OFFSET + s, mask=mask2[:, :, None], other=0).to(tl.int64)  # [R, C, 1]
        cb_row = head_row + s
        cb_page = tl.load(seg_cb_pages + cb_row // cb_rows_per_page, mask=cmask, other=0)
        cb_base = cb_page * cs0 + (cb_row % cb_rows_per_page) * cs1  # [C]
        cptr = cb_ptr + cb_base[None, :, None] + ids * cs2 + d3 * cs3
        cent = tl.load(cptr, mask=mask3, other=0)
        if CB_FP8:
            centf = fp8e4m3_to_f32(cent)
        elif OUT_KIND == 2:
            centf = (cent.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            centf = cent.to(tl.float32)
        val = val + centf

    if OUT_KIND == 2:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        res = f32_to_bf16_rtne(val)
    else:
        res = val.to(out_ptr.dtype.element_ty)
    return res


@triton.jit(do_not_specialize=_RUNTIME)
def _packed_dequant_kernel(
    tok_ptr, ts0, ts1, ts2, ts3,  # uint8 [num_pages, tpp, 2, B, row_bytes], last stride 1
    cb_ptr, cs0, cs1, cs2, cs3,  # [num_pages, cb_rows_per_page, K, D], cache dtype (CB_FP8: uint8 fp8 bytes)
    pieces_ptr,  # int64 [P, 5] contiguous: page, first slot, count, out row, codebook page offset
    cb_pages_ptr,  # int64 [n]
    out_ptr, os0, os1, os2, os3, os4,  # [T, 2, B, heads, D]
    num_tokens, batch, num_heads, head_start, heads, head_blocks, cb_rows_per_page,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr,
    CODE_KIND: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    STAGES: tl.constexpr, PER_HEAD_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ZEROS_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr, OUT_KIND: tl.constexpr, CB_FP8: tl.constexpr,
):  # fmt: skip
    # Axis 0 folds (piece, column group): P * 2 * B * head_blocks programs fit CUDA's 2^31 - 1 on x, where the
    # column groups alone could exceed the 65535 of axis y/z.
    groups = 2 * batch * head_blocks
    pid_p = tl.program_id(0) // groups
    pid_g = tl.program_id(0) % groups
    pid_r = tl.program_id(1)
    kvb = pid_g // head_blocks
    hblock = pid_g % head_blocks
    kv = kvb // batch
    b = kvb % batch

    prow = pieces_ptr + pid_p.to(tl.int64) * 5
    page = tl.load(prow)
    first = tl.load(prow + 1)
    count = tl.load(prow + 2)
    out_row = tl.load(prow + 3)
    seg_cb_pages = cb_pages_ptr + tl.load(prow + 4)  # this piece's segment's codebook pages

    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # token within the piece
    hh = hblock * HEADS_PER_BLOCK + tl.arange(0, HEADS_PER_BLOCK)  # head within the requested slice
    d = tl.arange(0, BLOCK_D)
    rmask = (r < count) & (out_row + r < num_tokens)
    hmask = hh < heads
    mask2 = rmask[:, None] & hmask[None, :]  # [R, Hb]
    mask3 = mask2[:, :, None] & (d < HEAD_DIM)[None, None, :]  # [R, Hb, D]
    d3 = d[None, None, :]

    row_off = page * ts0 + (first + r) * ts1  # [R]
    col_off = kv * ts2 + b * ts3 + (head_start + hh) * PER_HEAD_BYTES  # [Hb]
    head_row = (kvb * num_heads + head_start + hh).to(tl.int64) * STAGES  # [Hb]
    res = packed_tile(
        tok_ptr, row_off, col_off, cb_ptr, cs0, cs1, cs2, cs3, seg_cb_pages, head_row, hmask, d3, mask2, mask3,
        cb_rows_per_page, out_ptr,
        CODE_KIND, ASYM, QMAX, BLOCK_SIZE, STAGES, PER_HEAD_BYTES, SCALES_OFFSET, ZEROS_OFFSET, IDS_OFFSET, OUT_KIND,
        CB_FP8,
    )  # fmt: skip
    orow = (out_row + r) * os0 + kv * os1 + b * os2  # [R]
    optr = out_ptr + (orow[:, None] + (hh * os3)[None, :])[:, :, None] + d3 * os4
    tl.store(optr, res, mask=mask3)


def code_kind(fmt: PackedFormat) -> int:
    """The CODE_KIND constexpr of `fmt` (INT4, INT2 or TRITS; shared with the residual-pack kernel)."""
    if fmt.cfg.pack_trits:
        return TRITS
    return INT4 if fmt.bits == 4 else INT2


def format_constants(fmt: PackedFormat) -> dict:
    """The `tl.constexpr` arguments of `packed_tile` for a PRQ format (layer constants)."""
    return dict(
        CODE_KIND=code_kind(fmt), ASYM=bool(fmt.cfg.asymmetric), QMAX=fmt.qmax, BLOCK_SIZE=fmt.cfg.block_size,
        STAGES=fmt.cfg.stages, PER_HEAD_BYTES=fmt.per_head_bytes, SCALES_OFFSET=fmt.scales_offset,
        ZEROS_OFFSET=fmt.zeros_offset, IDS_OFFSET=fmt.ids_offset, OUT_KIND=OUT_KIND[fmt.dtype],
        CB_FP8=bool(fmt.cfg.codebook_fp8),
    )  # fmt: skip


def kernel_codebooks(codebooks: torch.Tensor) -> torch.Tensor:
    """The codebook tensor as the kernels read it: fp8 codebooks as their uint8 bytes (a view), others as is."""
    return codebooks.view(torch.uint8) if codebooks.dtype == torch.float8_e4m3fn else codebooks


@op_entry(PackedDequantArgs)
def packed_dequant_launch(a: PackedDequantArgs, *, block_rows: int | None = None, block_cols: int | None = None):
    """`(kernel, grid, args, kwargs)` of the packed view build launch, or None when there is nothing to write.

    No data is read on the host (the grid uses `min(tokens_per_page, T)` as the bound of a piece's length), so the
    launch never synchronizes with the device.
    """
    check_packed_dequant(a)
    tokens, codebooks, pieces, cb_pages, head_start, out_t, fmt = (
        a.tokens, a.codebooks, a.pieces, a.cb_pages, a.head_start, a.out_t, a.fmt
    )  # fmt: skip
    T, _, B, heads, d = out_t.shape
    P = pieces.shape[0]
    if T == 0 or heads == 0 or P == 0:
        return None
    pieces = pieces.contiguous()
    cb_pages = cb_pages.contiguous()
    codebooks = kernel_codebooks(codebooks)
    tile = tile_for(d, fmt.num_heads, block_rows, block_cols, interpreted=is_interpreted(_packed_dequant_kernel))
    head_blocks = cdiv(heads, tile.heads_per_block)
    grid = (P * 2 * B * head_blocks, cdiv(min(tokens.shape[1], T), tile.block_r))
    args = (
        tokens, *tokens.stride()[:4],
        codebooks, *codebooks.stride(),
        pieces, cb_pages,
        out_t, *out_t.stride(),
        T, B, fmt.num_heads, head_start, heads, head_blocks, codebooks.shape[1],
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=d, BLOCK_R=tile.block_r, BLOCK_D=tile.block_d, HEADS_PER_BLOCK=tile.heads_per_block,
        **format_constants(fmt), num_warps=NUM_WARPS,
    )  # fmt: skip
    return _packed_dequant_kernel, grid, args, kwargs


@op_entry(PackedDequantArgs)
def packed_dequant_triton(
    a: PackedDequantArgs, *, block_rows: int | None = None, block_cols: int | None = None
) -> None:
    """`packed_dequant_torch` in one Triton launch. `block_rows`/`block_cols` override the tile (tests)."""
    launch_on_device("packed_dequant", packed_dequant_launch(a, block_rows=block_rows, block_cols=block_cols))
