"""PRQ (Quant-VideoGen's progressive residual quantization), pure torch: `prq_quantize` and `prq_dequantize`.

Per head, over the S tokens of one segment (vectors of D channels):

1. `stages` rounds of k-means with K = `centroids` clusters, `kmeans_iters` assign/update iterations each, then one
   final assignment against the stored centroids (cache dtype, or fp8 e4m3 clamped to +-448 with `codebook_fp8`);
   residual -= centroid[id]. Assign = nearest centroid by
   squared L2 computed as ||c||^2 - 2 x.c (ties in that computed value go to the lowest index; two centroids at
   mathematically equal distance may round apart); update = mean in fp32; an empty cluster keeps its old centroid.
   Matmuls run in at least IEEE fp32 precision whatever `torch.set_float32_matmul_precision` (or the per-backend
   `fp32_precision`) says, without changing it: fp32 BLAS under IEEE settings (the default), else fp64 rounded to
   fp32 (`_ieee_baddbmm`; no process-global state is touched, so concurrent threads and streams are unaffected).
   Init: K token indices drawn uniformly with replacement from a CPU `torch.Generator` seeded with `cfg.seed` (a fresh
   draw per stage, per head), or `init_centroids` (warm start, e.g. the previous chunk's codebooks).
2. The final residual is block-quantized per token, per head, per `block_size` channels with fp8 e4m3 scale (and zero).
   With `fit_scales` (symmetric only) the scale is fp8(max|r| * m / qmax) for the multiplier m = (16 - j) / 16,
   j = 0..FIT_STEPS-1, that minimises the block's squared error, measured exactly in integers: u = round(|r| /
   max|r| * 4096) (one IEEE division, a power-of-two product, round half to even), code q = min(qmax, floor((2 u
   qmax + L) / 2L)) with L = 256 (16 - j), error sum((u qmax - q L)^2) in int64; the first j of least error wins.
   The codes are then rounded against the chosen fp8 scale as usual. Exact integer arithmetic makes the choice the
   same in the torch reference and the Triton kernel whatever the summation order.

Numerics (everything below keeps outputs finite; inputs must be finite, else `ValueError`):

- k-means runs on the residual divided by a per-head power of two >= its max |value| (exact in fp32, so assignments
  and centroids are those of unscaled fp32 arithmetic), which keeps sums and distances far from fp32 overflow even
  for inputs near the bf16 maximum.
- Distances are computed as ||c||^2 - 2 x.c in tiles of tokens, so at most `_TILE_ELEMS` floats of distances (and of
  one-hot update weights) exist at once; the update is a one-hot matmul in a fixed tile order (no atomics).
- All-zero block: max|r| = 0 -> scale 0 -> codes at the zero level (symmetric qmax, asymmetric 0) -> dequantizes to
  exactly 0 (symmetric) or to fp8(min) = 0 (asymmetric).
- Constant block c: symmetric gives codes +-qmax with scale fp8(|c|/qmax), error <= |c|/16 (fp8 rounding);
  asymmetric gives scale 0, codes 0, value fp8(c), error <= |c|/16.
- fp8 overflow: scales (and zeros) are clamped to e4m3's max 448 before rounding. A block whose max |r| exceeds
  448*qmax (symmetric: 448 for int2, 3136 for int4) has its values clipped to +-448*qmax; asymmetric blocks are clipped
  to [max(min, -448), zero + 448*qmax] with zero clamped to [-448, 448]. The error of a clipped value is its excess
  over that range. Residuals are also clamped to +-`_RESIDUAL_CLAMP` (far outside every representable range).
- fp8 underflow: a scale below 2^-10 rounds to 0 and the block decodes to its zero level: symmetric error <=
  max|r| < qmax * 2^-10; asymmetric values all decode to fp8(min), error <= (max - min) + |min - fp8(min)|. Scales
  in e4m3's subnormal range (2^-9..2^-6) keep fewer mantissa bits (coarser steps, clipping bounded by max|r|).
  Asymmetric zeros below 2^-10 in magnitude round to 0.
- A scale rounded down by fp8 can push the block max past qmax: it is clamped (error <= 1/16 of the max).
- K > S, duplicate or empty clusters, singleton clusters: well defined (an empty cluster keeps its centroid; a
  singleton cluster has zero residual).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedqvg.quant.config import QuantConfig
from pagedqvg.quant.format import FP8_DTYPE, FP8_MAX, PackedFormat
from pagedqvg.validation import SUPPORTED_DTYPES

#: Most floats in one distance (or one-hot) tile: 4 Mi floats = 16 MiB, i.e. ~410 tokens at 40 heads x 256 centroids.
_TILE_ELEMS = 1 << 22
#: Residuals are clamped to +-this before block quantization (fp8 scales already clip far below it).
_RESIDUAL_CLAMP = float(2**24)
#: `fit_scales`: candidate multipliers m = (16 - j) / 16 for j < FIT_STEPS (1 down to 1/4), and the fixed-point
#: unit of the integer error measure (|r| / max|r| in 1/4096ths).
FIT_STEPS, FIT_ONE = 13, 4096
#: Exponent range of the per-head power-of-two normalisation (keeps 2^-e a finite, normal-ish fp32 value).
_EXP_MIN, _EXP_MAX = -100, 127  # 2^127 is the largest finite power of two in fp32


@dataclass(slots=True)
class PRQSegment:
    """A packed segment: what the pool stores for S tokens of H heads.

    token_rows: uint8 [S, fmt.token_row_bytes], packed token rows (see `format.py`).
    codebooks: [H, stages, K, D] in `fmt.codebook_dtype` (the cache dtype, the dtype of the quantized input; fp8
        e4m3 with `codebook_fp8`).
    fmt: the byte layout these tensors follow.
    """

    token_rows: torch.Tensor
    codebooks: torch.Tensor
    fmt: PackedFormat

    @property
    def num_tokens(self) -> int:
        """Tokens in the segment (S)."""
        return int(self.token_rows.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of token rows plus codebooks (= fmt.segment_bytes(S))."""
        return self.fmt.segment_bytes(self.num_tokens)

    def dequantize(self) -> torch.Tensor:
        """[S, H, D] in the cache dtype (see `prq_dequantize`)."""
        return prq_dequantize(self.token_rows, self.codebooks, self.fmt)


# ---------------------------------------------------------------------------------------------------------- quantize
def fp32_matmul_may_reduce(device: torch.device) -> bool:
    """Whether torch's current settings let an fp32 matmul on `device` run below IEEE fp32 precision (TF32 on
    CUDA, bf16 through oneDNN on CPU). Reads the settings, never changes them; unreadable settings (torch refuses a
    mix of its legacy and new precision APIs) count as reduced. Other device types: False."""
    if device.type not in ("cuda", "cpu"):
        return False
    backend = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    try:
        prec = getattr(backend, "fp32_precision", None)  # new API: "ieee", "tf32", "bf16" or "none" (inherit)
        if prec == "ieee":
            return False
        if prec not in (None, "none"):
            return True
        if getattr(torch.backends, "fp32_precision", None) not in (None, "none", "ieee"):
            return True
        if device.type == "cuda":
            return bool(torch.backends.cuda.matmul.allow_tf32)
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return True


def _ieee_baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """`torch.baddbmm(bias, a, b, alpha=alpha)` of fp32 tensors in at least IEEE fp32 precision, whatever the
    process's matmul precision settings: the fp32 BLAS call when those settings are IEEE (the default; bytes as
    always), else the same product in fp64 rounded to fp32 (TF32/bf16 never apply to fp64). Nothing global is
    changed, so it is safe next to other threads and streams; the fp64 result is within the fp32 error bound the
    k-means contract allows (kernels/kmeans.py)."""
    if fp32_matmul_may_reduce(a.device):
        return torch.baddbmm(bias.double(), a.double(), b.double(), alpha=alpha).float()
    return torch.baddbmm(bias, a, b, alpha=alpha)


def _ieee_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(a, b)` of fp32 tensors in at least IEEE fp32 precision (see `_ieee_baddbmm`)."""
    if fp32_matmul_may_reduce(a.device):
        return torch.bmm(a.double(), b.double()).float()
    return torch.bmm(a, b)


def prq_quantize(x: torch.Tensor, cfg: QuantConfig, *, init_centroids: torch.Tensor | None = None) -> PRQSegment:
    """PRQ-pack one segment: `prq_kmeans`, then `pack_residual_rows`.

    Args:
        x: [S, H, D] float32/float16/bfloat16 (fold a batch into heads: [S, B*H, D]); its dtype is the cache dtype.
        cfg: an enabled `QuantConfig` (block_size must divide D).
        init_centroids: optional warm start [H, stages, K, D] (any float dtype, e.g. the previous segment's
            codebooks), replacing the seeded random init of every stage.

    Returns:
        `PRQSegment` with token rows uint8 [S, H * per_head_bytes] and codebooks [H, stages, K, D] in
        `fmt.codebook_dtype` (x.dtype, or fp8 with `cfg.codebook_fp8`).
        Same input, config and init -> identical bytes.

    Raises:
        ValueError: bad shape/dtype/config, or non-finite values in x or init_centroids (with count and positions).
    """
    km = prq_kmeans(x, cfg, init_centroids=init_centroids)
    rows = pack_residual_rows(km.resid, km.ids, km.fmt)
    return PRQSegment(token_rows=rows, codebooks=km.codebooks, fmt=km.fmt)


@dataclass(slots=True)
class PRQResidual:
    """A segment after its k-means stages, before the final residual is block-quantized (`pack_residual_rows`).

    resid: float32 [H, S, D], the final residual (clamped to +-`_RESIDUAL_CLAMP`).
    ids: uint8 [H, S, stages], the centroid id of every stage.
    codebooks: [H, stages, K, D] in `fmt.codebook_dtype`.
    fmt: the byte layout of the packed segment.
    """

    resid: torch.Tensor
    ids: torch.Tensor
    codebooks: torch.Tensor
    fmt: PackedFormat


#: `assign(x [H, S, D], c [H, K, D]) -> int64 [H, S]` and `update(x, ids, c_old) -> c [H, K, D]`, all float32.
AssignFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
UpdateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def prq_kmeans(
    x: torch.Tensor,
    cfg: QuantConfig,
    *,
    init_centroids: torch.Tensor | None = None,
    assign: AssignFn | None = None,
    update: UpdateFn | None = None,
) -> PRQResidual:
    """The k-means stages of PRQ (step 1 of the module docstring): codebooks, ids and the final residual.

    Args:
        x, cfg, init_centroids: as `prq_quantize`.
        assign, update: the k-means steps (default: this module's torch `assign_nearest` / `update_means`). The
            cache passes the dispatching versions (kernels/dispatch.py: Triton on CUDA), which may pick the other
            centroid of a near-tie (kernels/kmeans.py) and round centroid sums in another order.

    Raises:
        ValueError: as `prq_quantize` (nothing is computed for a bad input).
    """
    assign = assign or assign_nearest
    update = update or update_means
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"prq_quantize: x must be a [S, H, D] tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"prq_quantize: x.dtype={x.dtype}; allowed: {', '.join(map(str, SUPPORTED_DTYPES))}")
    S, H, D = x.shape
    fmt = PackedFormat(head_dim=D, num_heads=H, cfg=cfg, dtype=x.dtype)
    _check_finite("x", x, ("token", "head", "channel"))
    K, stages = cfg.centroids, cfg.stages
    if init_centroids is not None:
        if tuple(init_centroids.shape) != (H, stages, K, D):
            raise ValueError(
                f"prq_quantize: init_centroids has shape {tuple(init_centroids.shape)}, expected {(H, stages, K, D)}"
            )
        _check_finite("init_centroids", init_centroids, ("head", "stage", "centroid", "channel"))
    device = x.device
    resid = x.float().transpose(0, 1).contiguous()  # [H, S, D] fp32
    cb_dtype = fmt.codebook_dtype
    codebooks = torch.zeros(H, stages, K, D, dtype=cb_dtype, device=device)
    ids = torch.zeros(H, S, stages, dtype=torch.uint8, device=device)
    if S == 0:
        return PRQResidual(resid=resid, ids=ids, codebooks=codebooks, fmt=fmt)

    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    dmax = torch.finfo(cb_dtype).max  # 448 for fp8 e4m3
    heads = torch.arange(H, device=device)[:, None]
    for stage in range(stages):
        # Work in units of a per-head power of two >= max|resid| (exact; see module docstring).
        amax = resid.abs().amax(dim=(1, 2))
        exp = torch.frexp(amax).exponent.clamp(_EXP_MIN, _EXP_MAX)  # amax < 2^exp
        unit = torch.ldexp(torch.ones_like(amax), exp)[:, None, None]  # [H, 1, 1]
        inv_unit = torch.ldexp(torch.ones_like(amax), -exp)[:, None, None]
        xn = resid * inv_unit
        if init_centroids is not None:
            cn = init_centroids[:, stage].to(device=device, dtype=torch.float32) * inv_unit
        else:
            idx = torch.randint(S, (H, K), generator=gen).to(device)
            cn = xn[heads, idx]  # [H, K, D]
        for _ in range(cfg.kmeans_iters):
            cn = update(xn, assign(xn, cn), cn)
        stored = (cn * unit).clamp(-dmax, dmax).to(cb_dtype)  # the codebook as the cache holds it
        cf = stored.float()
        stage_ids = assign(xn, cf * inv_unit)  # final ids against the stored centroids
        codebooks[:, stage] = stored
        ids[:, :, stage] = stage_ids.to(torch.uint8)
        resid = resid - cf[heads, stage_ids]
        resid.clamp_(-_RESIDUAL_CLAMP, _RESIDUAL_CLAMP)
    return PRQResidual(resid=resid, ids=ids, codebooks=codebooks, fmt=fmt)


def pack_residual_rows(resid: torch.Tensor, ids: torch.Tensor, fmt: PackedFormat) -> torch.Tensor:
    """Step 2: block-quantize the final residual float32 [H, S, D] and pack it with the ids uint8 [H, S, stages]
    into token rows uint8 [S, H * per_head_bytes] (`fmt.num_heads` = H). The reference of kernels/residual_pack."""
    codes, scales, zeros = _block_quantize(resid.transpose(0, 1), fmt.cfg)  # [S, H, D], [S, H, nb] x2
    return fmt.pack_token_rows(codes, scales, zeros, ids.transpose(0, 1))


def assign_nearest(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """k-means assignment step, the torch reference: nearest centroid by squared L2 (ties -> lowest index).
    x [H, S, D], c [H, K, D] float32 -> int64 [H, S]. No input checks (see `kernels.kmeans.kmeans_assign_torch`)."""
    H, S, _ = x.shape
    K = c.shape[1]
    cn = (c * c).sum(-1)[:, None, :]  # [H, 1, K]
    ct = c.transpose(1, 2)  # [H, D, K]
    out = torch.empty(H, S, dtype=torch.int64, device=x.device)
    tile = max(1, _TILE_ELEMS // (H * K))
    for t0 in range(0, S, tile):
        t1 = min(S, t0 + tile)
        dist = _ieee_baddbmm(cn, x[:, t0:t1], ct, -2.0)  # ||c||^2 - 2 x.c  (||x||^2 is constant per row)
        out[:, t0:t1] = dist.argmin(dim=-1)
    return out


def update_means(x: torch.Tensor, ids: torch.Tensor, c_old: torch.Tensor) -> torch.Tensor:
    """k-means update step, the torch reference: cluster means float32 [H, K, D] of x [H, S, D] grouped by ids int64
    [H, S] (one-hot matmul per token tile, fixed order); empty clusters keep `c_old`. No input checks (see
    `kernels.kmeans.kmeans_update_torch`)."""
    H, S, _ = x.shape
    K = c_old.shape[1]
    sums = torch.zeros_like(c_old)
    counts = torch.zeros(H, K, dtype=torch.float32, device=x.device)
    tile = max(1, _TILE_ELEMS // (H * K))
    for t0 in range(0, S, tile):
        t1 = min(S, t0 + tile)
        onehot = torch.zeros(H, t1 - t0, K, dtype=torch.float32, device=x.device)
        onehot.scatter_(2, ids[:, t0:t1, None], 1.0)
        sums += _ieee_bmm(onehot.transpose(1, 2), x[:, t0:t1])
        counts += onehot.sum(dim=1)
    nonempty = counts > 0
    means = sums / counts.clamp(min=1.0)[..., None]
    return torch.where(nonempty[..., None], means, c_old)


def _block_quantize(r: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Final-residual block quantization. r fp32 [S, H, D] -> codes uint8 [S, H, D], scales fp8, zeros fp8 | None."""
    S, H, D = r.shape
    nb = D // cfg.block_size
    rb = r.reshape(S, H, nb, cfg.block_size)
    qmax = float(cfg.qmax)
    # Divide by a tensor, not a Python float: CUDA turns `x / scalar` into `x * (1 / scalar)`, which can round
    # differently from the IEEE division the CPU and the Triton kernel do (a different fp8 scale byte).
    qmax_t = r.new_full((), qmax)
    if cfg.asymmetric:
        lo, hi = rb.amin(dim=-1), rb.amax(dim=-1)
        scale8 = ((hi - lo) / qmax_t).clamp(0.0, FP8_MAX).to(FP8_DTYPE)
        zero8 = (lo.clamp(-FP8_MAX, FP8_MAX) + 0.0).to(FP8_DTYPE)  # + 0.0: a -0.0 minimum stores +0
        s, z = scale8.float()[..., None], zero8.float()[..., None]
        q = torch.round((rb - z) / torch.where(s > 0, s, 1.0)).clamp(0.0, qmax)
        q = torch.where(s > 0, q, 0.0)
        return q.to(torch.uint8).reshape(S, H, D), scale8, zero8
    amax = rb.abs().amax(dim=-1)
    if cfg.fit_scales:
        amax = amax * _fit_multiplier(rb, amax, cfg.qmax)
    scale8 = (amax / qmax_t).clamp(0.0, FP8_MAX).to(FP8_DTYPE)
    s = scale8.float()[..., None]
    q = torch.round(rb / torch.where(s > 0, s, 1.0)).clamp(-qmax, qmax)
    q = torch.where(s > 0, q, 0.0) + qmax
    return q.to(torch.uint8).reshape(S, H, D), scale8, None


def _fit_multiplier(rb: torch.Tensor, amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """`fit_scales` (module docstring, step 2): the multiplier m of each block, float32 like `amax` ([..., nb]).
    rb: float32 [..., nb, block_size]; amax: its max |r| per block. Exact integer arithmetic (int64)."""
    safe = torch.where(amax > 0, amax, 1.0)[..., None]
    u = torch.round((rb.abs() / safe) * float(FIT_ONE)).to(torch.int64) * qmax  # u * qmax, 0..4096 * qmax
    best_err = best_j = None
    for j in range(FIT_STEPS):
        level = 256 * (16 - j)  # m * 4096 in the same units (times qmax / qmax)
        q = torch.clamp((2 * u + level) // (2 * level), max=qmax)
        err = ((u - q * level) ** 2).sum(dim=-1)
        if best_err is None or best_j is None:
            best_err, best_j = err, torch.zeros_like(err)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_j = torch.where(better, j, best_j)
    assert best_j is not None
    return (16 - best_j).to(torch.float32) * 0.0625


# -------------------------------------------------------------------------------------------------------- dequantize
def prq_dequantize(token_rows: torch.Tensor, codebooks: torch.Tensor, fmt: PackedFormat) -> torch.Tensor:
    """Unpack a segment to [..., H, D] in `fmt.dtype`.

    value = (code - qmax) * scale  (asymmetric: code * scale + zero), then += codebook[h, s][id_s] for s = 0, 1, ...
    in fp32, cast to the cache dtype once at the end.

    Args:
        token_rows: uint8 [..., H * per_head_bytes] (usually [S, row_bytes]).
        codebooks: [H, stages, K, D] (any float dtype) or its packed form uint8 [H * stages, codebook_row_bytes].
        fmt: the segment's `PackedFormat`.
    """
    if codebooks.dtype == torch.uint8:
        codebooks = fmt.unpack_codebooks(codebooks)
    H, D, st = fmt.num_heads, fmt.head_dim, fmt.cfg.stages
    if tuple(codebooks.shape) != (H, st, fmt.cfg.centroids, D):
        raise ValueError(f"codebooks have shape {tuple(codebooks.shape)}, expected {(H, st, fmt.cfg.centroids, D)}")
    f = fmt.unpack_token_rows(token_rows)
    lead = f.codes.shape[:-2]
    q = f.codes.float().reshape(*lead, H, fmt.num_blocks, fmt.cfg.block_size)
    if fmt.cfg.asymmetric:
        assert f.zeros is not None
        out = q * f.scales[..., None] + f.zeros[..., None]
    else:
        out = (q - float(fmt.qmax)) * f.scales[..., None]
    out = out.reshape(*lead, H, D)
    cb = codebooks.to(device=out.device, dtype=torch.float32)
    heads = torch.arange(H, device=out.device)
    ids = f.ids.long()
    for stage in range(st):
        out = out + cb[heads, stage, ids[..., stage]]
    return out.to(fmt.dtype)


# ------------------------------------------------------------------------------------------------------------ checks
def _check_finite(name: str, t: torch.Tensor, axes: tuple[str, ...]) -> None:
    """Raise `ValueError` with the count, kinds and first positions of non-finite values in `t`."""
    bad = ~torch.isfinite(t)
    n_bad = int(bad.sum())
    if not n_bad:
        return
    n_nan = int(torch.isnan(t).sum())
    n_pinf = int((t == float("inf")).sum())
    where = bad.nonzero()[:5].tolist()
    first = ", ".join("(" + ", ".join(str(v) for v in pos) + ")" for pos in where)
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
    raise ValueError(
        f"prq_quantize: {name} has {n_bad} non-finite value(s) of {t.numel()} (NaN: {n_nan}, +inf: {n_pinf}, "
        f"-inf: {n_bad - n_nan - n_pinf}) at ({', '.join(axes)}) {first}{' ...' if n_bad > 5 else ''}; "
        f"{axes[0]}s affected: {len(rows)} ({axes[0]} {int(rows[0])}..{int(rows[-1])}); nothing was packed"
    )
