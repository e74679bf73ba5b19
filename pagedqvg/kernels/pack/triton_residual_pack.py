"""Triton residual pack: the same signature and bytes as `residual_pack_torch` (residual_pack.py), in one launch.

Grid: `(cdiv(S, BLOCK_R), G)`. Program `(i, g)` packs tokens `[i * BLOCK_R, (i + 1) * BLOCK_R)` of folded head `g`:

1. loads the residual as `[BLOCK_R, blocks, block_size]`, takes each block's max |r| (asymmetric: min and max),
   (`fit_scales`: multiplies it by the block's fitted multiplier, found with the reference's exact int64 error
   measure over the same tile), computes the fp8 scale (and zero) and stores their bytes, and copies the stage ids;
2. for each of the `PER_BYTE` code positions of a code byte (2 for int4, 4 for int2, 5 for trits), loads that
   channel of every code byte as `[BLOCK_R, code_bytes]`, picks its block's scale out of the `[BLOCK_R, blocks]`
   registers (a select over blocks: no gather, no re-read of the stored bytes), rounds the code and folds it into
   the byte (first element in the high bits / the highest trit), then stores the code bytes.

Every record byte is written once, straight to its (page, slot); no temporaries.

Bit-exactness with the torch reference, by construction:
- divisions are IEEE (`div_rn`; Triton's plain `/` on the GPU is approximate);
- rounding to nearest even is done with `floor` on magnitudes (`|t| - floor(|t|)` is exact in fp32), for the codes
  (torch.round) and for fp8: `|v| * 2^(3 - e)` (e = max(floor(log2|v|), -6), exact power-of-two scaling) is rounded
  to an integer q in 0..16 and the byte is `8 * (e + 6) + q` (q = 16 carries into the exponent, subnormals are
  e = -6), the e4m3fn encoding torch's `.to(torch.float8_e4m3fn)` produces for |v| <= 448 (inputs are clamped to
  +-448 first, like the reference); the scale used for the codes is the fp8 value `q * 2^(e - 3)`, exact;
- the sign bit of a zero is taken from the input's sign bit (the reference adds +0.0 to the block minimum first, so
  a -0.0 minimum stores +0, in both).

Compile-time constants: `HEAD_DIM` and the PRQ format (code kind, qmax, block size, stages, record offsets); the
token count is runtime and not specialized on (one compile per layer format).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedqvg.kernels.ops import ResidualPackArgs, op_entry
from pagedqvg.kernels.pack.residual_pack import check_residual_pack
from pagedqvg.kernels.triton_common import NUM_WARPS, cdiv, is_interpreted, launch_on_device, next_pow2
from pagedqvg.kernels.view.triton_dequant import code_kind
from pagedqvg.quant.prq import FIT_ONE, FIT_STEPS

#: Tokens per program (compiled / interpreted), and the most [token, code byte, block] select elements per compiled
#: program (ptxas, sm_90, 4 warps: no spills for the SGLang formats at D=128, nor int4-asym block 32 at D=256).
BLOCK_R, BLOCK_R_INTERPRETED = 16, 128
SELECT_ELEMS = 4096


def pack_warps(fit_scales: bool) -> int:
    """Warps per program: the fitted-scale search keeps int64 `[BLOCK_R, blocks, block_size]` errors live (ptxas -v,
    sm_90, Triton 3.9, compact format at head_dim 128, 16 tokens: 4 warps 255 registers and 108 B spills per thread,
    8 warps 154 registers, 0 spills); the other formats need 80-96 registers at 4 warps. Pinned by
    tests/test_kernels_compile_resources.py."""
    return 8 if fit_scales else NUM_WARPS
_FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _rne(t):
    """Round half to even, for |t| < 2^23 or any integral t (exact: `|t| - floor(|t|)` is exact in fp32)."""
    a = tl.abs(t)
    fl = tl.floor(a)
    frac = a - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
    q = fl + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
    return tl.where(t < 0, -q, q)


@triton.jit
def _f32_to_fp8e4m3(v):
    """float32 with |v| <= 448 -> (fp8 e4m3fn byte as int32, its exact float32 value), round to nearest even."""
    u = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # floor(log2 |v|), at least -6
    up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    down = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    q = _rne(a * up)  # 0..16, exact scaling
    byte = (e + 6) * 8 + q.to(tl.int32)
    value = q * down
    neg = u < 0
    return tl.where(neg, byte | 0x80, byte), tl.where(neg, -value, value)


@triton.jit(do_not_specialize=["rs0", "is0", "num_tokens"])  # rs0 = S * D, is0 = S * stages
def _residual_pack_kernel(
    r_ptr, rs0, rs1, rs2,  # float32 [G, S, D]
    ids_ptr, is0, is1, is2,  # uint8 [G, S, stages]
    dst_ptr, ds0, ds1,  # uint8 [num_pages, slots, >= G * PER_HEAD_BYTES], last stride 1
    page_ptr, slot_ptr,  # int64 [S]
    num_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, CODE_KIND: tl.constexpr, ASYM: tl.constexpr,
    QMAX: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_NB: tl.constexpr,
    BLOCK_BS: tl.constexpr, CODE_BYTES: tl.constexpr, BLOCK_CB: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_ST: tl.constexpr, PER_HEAD_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ZEROS_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr, FIT: tl.constexpr, FIT_STEPS: tl.constexpr, FIT_ONE: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_tokens
    page = tl.load(page_ptr + r, mask=rmask, other=0)
    slot = tl.load(slot_ptr + r, mask=rmask, other=0)
    rec = dst_ptr + page * ds0 + slot * ds1 + g * PER_HEAD_BYTES  # [R] record pointers
    src = r_ptr + g * rs0 + r.to(tl.int64) * rs1  # [R] residual rows

    # 1. Block scales (and zeros): [R, NB, BS] tile of the residual.
    nb = tl.arange(0, BLOCK_NB)
    e = tl.arange(0, BLOCK_BS)
    ch = nb[:, None] * BLOCK_SIZE + e[None, :]
    m3 = rmask[:, None, None] & ((nb[:, None] < NUM_BLOCKS) & (e[None, :] < BLOCK_SIZE))[None, :, :]
    v = tl.load(src[:, None, None] + (ch * rs2)[None, :, :], mask=m3, other=0.0)
    bmask = rmask[:, None] & (nb < NUM_BLOCKS)[None, :]
    if ASYM:
        lo = tl.min(tl.where(m3, v, float("inf")), axis=2)
        hi = tl.max(tl.where(m3, v, float("-inf")), axis=2)
        lo = tl.where(bmask, lo, 0.0)
        hi = tl.where(bmask, hi, 0.0)
        scale_byte, scale = _f32_to_fp8e4m3(tl.minimum(tl.math.div_rn(hi - lo, tl.full(hi.shape, QMAX, tl.float32)),
                                                       _FP8_MAX))  # fmt: skip
        zero_byte, zero = _f32_to_fp8e4m3(tl.minimum(tl.maximum(lo, -_FP8_MAX), _FP8_MAX) + 0.0)
        tl.store(rec[:, None] + ZEROS_OFFSET + nb[None, :], zero_byte.to(tl.uint8), mask=bmask)
    else:
        amax = tl.max(tl.abs(v), axis=2)
        if FIT:  # fit_scales: the multiplier of least integer squared error (quant/prq.py, _fit_multiplier)
            safe = tl.where(amax > 0, amax, 1.0)
            u = _rne(tl.math.div_rn(tl.abs(v), tl.broadcast_to(safe[:, :, None], v.shape)) * FIT_ONE)
            u = u.to(tl.int64) * QMAX
            best_err = tl.full(amax.shape, -1, tl.int64)
            best_j = tl.zeros(amax.shape, tl.int32)
            for jj in tl.static_range(FIT_STEPS):
                level = 256 * (16 - jj)
                q = tl.minimum((2 * u + level) // (2 * level), QMAX)
                diff = u - q * level
                err = tl.sum(diff * diff, axis=2)
                better = (err < best_err) | (best_err < 0)
                best_err = tl.where(better, err, best_err)
                best_j = tl.where(better, jj, best_j)
            amax = amax * ((16 - best_j).to(tl.float32) * 0.0625)
        scale_byte, scale = _f32_to_fp8e4m3(tl.minimum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)),
                                                       _FP8_MAX))  # fmt: skip
    tl.store(rec[:, None] + SCALES_OFFSET + nb[None, :], scale_byte.to(tl.uint8), mask=bmask)

    # Stage ids.
    st = tl.arange(0, BLOCK_ST)
    smask = rmask[:, None] & (st < STAGES)[None, :]
    ids = tl.load(ids_ptr + g * is0 + (r * is1)[:, None] + (st * is2)[None, :], mask=smask, other=0)
    tl.store(rec[:, None] + IDS_OFFSET + st[None, :], ids, mask=smask)

    # 2. Codes, byte by byte: channel j * PER_BYTE + i of code byte j.
    if CODE_KIND == 0:
        PER_BYTE: tl.constexpr = 2
    elif CODE_KIND == 1:
        PER_BYTE: tl.constexpr = 4
    else:
        PER_BYTE: tl.constexpr = 5
    j = tl.arange(0, BLOCK_CB)
    acc = tl.zeros([BLOCK_R, BLOCK_CB], tl.int32)
    for i in tl.static_range(PER_BYTE):
        c = j * PER_BYTE + i
        cmask = rmask[:, None] & (c < HEAD_DIM)[None, :]
        x = tl.load(src[:, None] + (c * rs2)[None, :], mask=cmask, other=0.0)
        sel = (c // BLOCK_SIZE)[None, :, None] == nb[None, None, :]  # [1, CB, NB]: the block of each channel
        s_el = tl.sum(tl.where(sel, scale[:, None, :], 0.0), axis=2)  # [R, CB]
        safe = tl.where(s_el > 0, s_el, 1.0)
        if ASYM:
            z_el = tl.sum(tl.where(sel, zero[:, None, :], 0.0), axis=2)
            q = tl.minimum(tl.maximum(_rne(tl.math.div_rn(x - z_el, safe)), 0.0), QMAX)
            q = tl.where(s_el > 0, q, 0.0)
        else:
            q = tl.minimum(tl.maximum(_rne(tl.math.div_rn(x, safe)), -QMAX), QMAX)
            q = tl.where(s_el > 0, q, 0.0) + QMAX
        code = tl.where(cmask, q.to(tl.int32), 0)  # trit padding past HEAD_DIM is 0
        if CODE_KIND == 2:
            acc = acc * 3 + code
        elif CODE_KIND == 0:
            acc = (acc << 4) | code
        else:
            acc = (acc << 2) | code
    tl.store(rec[:, None] + j[None, :], acc.to(tl.uint8), mask=rmask[:, None] & (j < CODE_BYTES)[None, :])


@op_entry(ResidualPackArgs)
def residual_pack_launch(a: ResidualPackArgs, *, block_rows: int | None = None):
    """`(kernel, grid, args, kwargs)` of the residual pack launch, or None when there is nothing to write.
    `block_rows` overrides the tokens per program (tests: the compiled tile in the interpreter)."""
    check_residual_pack(a)
    resid, ids, dest, page_idx, slot_idx, fmt = a.resid, a.ids, a.dest, a.page_idx, a.slot_idx, a.fmt
    G, S, D = resid.shape
    if S == 0:
        return None
    cfg = fmt.cfg
    block_cb, block_nb = next_pow2(fmt.code_bytes), next_pow2(fmt.num_blocks)
    if block_rows is not None:
        block_r = block_rows
    elif is_interpreted(_residual_pack_kernel):
        block_r = BLOCK_R_INTERPRETED
    else:  # the per-channel scale select holds [BLOCK_R, code bytes, blocks] values: fewer tokens for fine blocks
        block_r = max(1, min(BLOCK_R, SELECT_ELEMS // (block_cb * block_nb)))
    grid = (cdiv(S, block_r), G)
    args = (
        resid, *resid.stride(), ids, *ids.stride(), dest, dest.stride(0), dest.stride(1),
        page_idx.contiguous(), slot_idx.contiguous(), S,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=D, BLOCK_R=block_r, CODE_KIND=code_kind(fmt), ASYM=bool(cfg.asymmetric), QMAX=fmt.qmax,
        BLOCK_SIZE=cfg.block_size, NUM_BLOCKS=fmt.num_blocks, BLOCK_NB=block_nb,
        BLOCK_BS=next_pow2(cfg.block_size), CODE_BYTES=fmt.code_bytes, BLOCK_CB=block_cb,
        STAGES=cfg.stages, BLOCK_ST=next_pow2(cfg.stages), PER_HEAD_BYTES=fmt.per_head_bytes,
        SCALES_OFFSET=fmt.scales_offset, ZEROS_OFFSET=fmt.zeros_offset, IDS_OFFSET=fmt.ids_offset,
        FIT=bool(cfg.fit_scales), FIT_STEPS=FIT_STEPS, FIT_ONE=float(FIT_ONE), num_warps=pack_warps(cfg.fit_scales),
    )  # fmt: skip
    return _residual_pack_kernel, grid, args, kwargs


@op_entry(ResidualPackArgs)
def residual_pack_triton(a: ResidualPackArgs, *, block_rows: int | None = None) -> None:
    """`residual_pack_torch` in one Triton launch (`block_rows`: see `residual_pack_launch`)."""
    launch_on_device("residual_pack", residual_pack_launch(a, block_rows=block_rows))
