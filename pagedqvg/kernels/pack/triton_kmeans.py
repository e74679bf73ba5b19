"""Triton k-means assignment and update: the signatures of `kmeans_assign_torch` / `kmeans_update_torch`
(kmeans.py); ids equal up to near-ties, means equal up to fp32 summation order.

Assignment.

Grid: `(cdiv(S, BLOCK_S), H)`. Program `(i, h)` takes `BLOCK_S` tokens of head `h` and walks the centroids in
tiles of `BLOCK_K`: `||c||^2` of the tile, `x.c` with an fp32 `tl.dot` (`input_precision="ieee"`: no TF32),
accumulated over slices of `BLOCK_DK` channels, so only a `[BLOCK_S, BLOCK_DK]` token slice and a
`[BLOCK_K, BLOCK_DK]` centroid slice are live (the token slices are re-read per centroid tile, from L1/L2; holding
the whole `[BLOCK_S, D]` rows spilled ~12.5 KB per thread at sm_90), `dist = ||c||^2 - 2 x.c` (the reference's
expression), then a running argmin that keeps the first minimum (within a tile `tl.argmin` breaks ties to the
left; across tiles only a strictly smaller distance replaces the best). Memory: one `[BLOCK_S, BLOCK_K]` tile of
distances per program; the `[S, K]` matrix never exists.

Why ids can differ from the reference: see kmeans.py (fp32 summation order of the dot products and norms).

Update. Grid: `(cdiv(K, BLOCK_K), H)`. Program `(j, h)` owns centroids `[j * BLOCK_K, (j + 1) * BLOCK_K)` of head `h`
and walks the tokens in order, `BLOCK_S` at a time: a `[BLOCK_K, BLOCK_S]` one-hot tile of the ids times the
`[BLOCK_S, D]` token tile (`tl.dot`, IEEE fp32) is added to the `[BLOCK_K, D]` sums, the one-hot row sums to the
counts. No atomics and a fixed order, so the result is deterministic (the same bits on every run); the order differs
from the reference's BLAS order, so means agree within the bound in kernels/kmeans.py (exactly where sums are exact).
The mean is an IEEE division (`div_rn`), an empty cluster keeps its old centroid.

Compile-time constants: `HEAD_DIM` and the tiles; the token count `S` and the centroid count `K` are runtime and not
specialized on (one compile per head_dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedqvg.kernels.ops import KmeansAssignArgs, KmeansUpdateArgs, op_entry
from pagedqvg.kernels.pack.kmeans import check_kmeans_assign, check_kmeans_update
from pagedqvg.kernels.triton_common import NUM_WARPS, cdiv, is_interpreted, launch_on_device, next_pow2

_RUNTIME = ["os0", "num_tokens", "num_centroids"]  # os0 = S for a contiguous out
#: Tokens per program (compiled / interpreted) and centroids per tile.
BLOCK_S, BLOCK_S_INTERPRETED, BLOCK_K = 64, 256, 64
#: Assignment: channels per slice of the dot product.
BLOCK_DK = 32
#: Update kernel: at most this many fp32 sums ([centroids, head_dim]) per program.
UPDATE_TILE_ELEMS = 4096


def kmeans_warps(block_d: int) -> int:
    """Warps per program of both k-means kernels for a padded head_dim `block_d` (ptxas -v, sm_90, Triton 3.9, at
    head_dim 128: assign 64x64 tiles with 32-channel slices, 4 warps: 255 registers and 860 B spills per thread, 8
    warps: 110 registers, 0 spills; update 64 tokens x 32 centroids, 4 warps: 8 B spills, 8 warps: 128 registers, 0
    spills). Pinned by tests/test_kernels_compile_resources.py."""
    return 8 if block_d >= 128 else NUM_WARPS


@triton.jit(do_not_specialize=_RUNTIME)
def _kmeans_assign_kernel(
    x_ptr, xs0, xs1, xs2,  # float32 [H, S, D]
    c_ptr, cs0, cs1, cs2,  # float32 [H, K, D]
    out_ptr, os0, os1,  # int64 [H, S]
    num_tokens, num_centroids,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DK: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = s < num_tokens
    x_rows = x_ptr + h * xs0 + (s * xs1)[:, None]  # [BLOCK_S, 1]

    best = tl.full([BLOCK_S], float("inf"), tl.float32)
    best_id = tl.zeros([BLOCK_S], tl.int32)
    for k0 in range(0, num_centroids, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < num_centroids
        c_rows = c_ptr + h * cs0 + (k * cs1)[:, None]  # [BLOCK_K, 1]
        cn = tl.zeros([BLOCK_K], tl.float32)
        dot = tl.zeros([BLOCK_S, BLOCK_K], tl.float32)
        # Channels in slices of BLOCK_DK: only [BLOCK_S + BLOCK_K, BLOCK_DK] operands live at once (no spills).
        for d0 in tl.static_range(0, BLOCK_D, BLOCK_DK):
            d = d0 + tl.arange(0, BLOCK_DK)
            dmask = d < HEAD_DIM
            x = tl.load(x_rows + (d * xs2)[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
            c = tl.load(c_rows + (d * cs2)[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)
            cn += tl.sum(c * c, axis=1)  # [BLOCK_K]
            dot = tl.dot(x, tl.trans(c), acc=dot, input_precision="ieee")  # [BLOCK_S, BLOCK_K]
        dist = cn[None, :] - 2.0 * dot
        dist = tl.where(kmask[None, :], dist, float("inf"))
        tile_min, tile_arg = tl.min(dist, axis=1, return_indices=True, return_indices_tie_break_left=True)
        better = tile_min < best
        best = tl.where(better, tile_min, best)
        best_id = tl.where(better, tile_arg + k0, best_id)
    tl.store(out_ptr + h * os0 + s * os1, best_id.to(tl.int64), mask=smask)


@op_entry(KmeansAssignArgs)
def kmeans_assign_launch(a: KmeansAssignArgs, out: torch.Tensor):
    """`(kernel, grid, args, kwargs)` of the assignment launch into `out` int64 [H, S], or None when S == 0."""
    check_kmeans_assign(a)
    x, c = a.x, a.c
    H, S, D = x.shape
    if tuple(out.shape) != (H, S) or out.dtype != torch.int64:
        raise ValueError(f"out must be int64 [{H}, {S}], got {out.dtype} {tuple(out.shape)}")
    if S == 0 or H == 0:
        return None
    block_s = BLOCK_S_INTERPRETED if is_interpreted(_kmeans_assign_kernel) else BLOCK_S
    grid = (cdiv(S, block_s), H)
    args = (x, *x.stride(), c, *c.stride(), out, *out.stride(), S, c.shape[1])
    block_d = max(16, next_pow2(D))
    kwargs = dict(HEAD_DIM=D, BLOCK_S=block_s, BLOCK_K=BLOCK_K, BLOCK_D=block_d, BLOCK_DK=min(block_d, BLOCK_DK),
                  num_warps=kmeans_warps(block_d))  # fmt: skip
    return _kmeans_assign_kernel, grid, args, kwargs


@op_entry(KmeansAssignArgs)
def kmeans_assign_triton(a: KmeansAssignArgs) -> torch.Tensor:
    """`kmeans_assign_torch` in one Triton launch: x [H, S, D], c [H, K, D] float32 -> int64 [H, S]."""
    out = torch.empty(a.x.shape[0], a.x.shape[1], dtype=torch.int64, device=a.x.device)
    launch = kmeans_assign_launch(a, out)
    launch_on_device("kmeans_assign", launch)
    return out


@triton.jit(do_not_specialize=["xs0", "is0", "num_tokens", "num_centroids"])  # xs0 = S * D, is0 = S
def _kmeans_update_kernel(
    x_ptr, xs0, xs1, xs2,  # float32 [H, S, D]
    ids_ptr, is0, is1,  # int64 [H, S]
    c_ptr, cs0, cs1, cs2,  # float32 [H, K, D], the old centroids
    out_ptr, os0, os1, os2,  # float32 [H, K, D]
    num_tokens, num_centroids,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1).to(tl.int64)
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    kmask = k < num_centroids
    dmask = d < HEAD_DIM
    sums = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    counts = tl.zeros([BLOCK_K], tl.float32)
    for s0 in range(0, num_tokens, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < num_tokens
        ids = tl.load(ids_ptr + h * is0 + s * is1, mask=smask, other=-1)
        x = tl.load(x_ptr + h * xs0 + (s * xs1)[:, None] + (d * xs2)[None, :], mask=smask[:, None] & dmask[None, :],
                    other=0.0)  # fmt: skip
        onehot = (k[:, None] == ids[None, :]).to(tl.float32)  # [BLOCK_K, BLOCK_S]
        sums = tl.dot(onehot, x, acc=sums, input_precision="ieee")
        counts += tl.sum(onehot, axis=1)
    mask = kmask[:, None] & dmask[None, :]
    old = tl.load(c_ptr + h * cs0 + (k * cs1)[:, None] + (d * cs2)[None, :], mask=mask, other=0.0)
    means = tl.math.div_rn(sums, tl.maximum(counts, 1.0)[:, None])
    new = tl.where(counts[:, None] > 0, means, old)
    tl.store(out_ptr + h * os0 + (k * os1)[:, None] + (d * os2)[None, :], new, mask=mask)


@op_entry(KmeansUpdateArgs)
def kmeans_update_launch(a: KmeansUpdateArgs, out: torch.Tensor):
    """`(kernel, grid, args, kwargs)` of the update launch into `out` float32 [H, K, D], or None when H == 0."""
    check_kmeans_update(a)
    x, ids, c_old = a.x, a.ids, a.c_old
    if tuple(out.shape) != tuple(c_old.shape) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {tuple(c_old.shape)}, got {out.dtype} {tuple(out.shape)}")
    H, S, D = x.shape
    K = c_old.shape[1]
    if H == 0 or K == 0:
        return None
    block_s = BLOCK_S_INTERPRETED if is_interpreted(_kmeans_update_kernel) else BLOCK_S
    block_d = max(16, next_pow2(D))
    # Centroids per program: the [BLOCK_K, D] fp32 sums and the [BLOCK_S, D] token tile live in registers, so fewer
    # centroids per program for wide heads (see `kmeans_warps` for the measured registers and spills).
    block_k = max(16, min(BLOCK_K, UPDATE_TILE_ELEMS // block_d))
    grid = (cdiv(K, block_k), H)
    args = (x, *x.stride(), ids, *ids.stride(), c_old, *c_old.stride(), out, *out.stride(), S, K)
    kwargs = dict(HEAD_DIM=D, BLOCK_S=block_s, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=kmeans_warps(block_d))
    return _kmeans_update_kernel, grid, args, kwargs


@op_entry(KmeansUpdateArgs)
def kmeans_update_triton(a: KmeansUpdateArgs) -> torch.Tensor:
    """`kmeans_update_torch` in one Triton launch: float32 [H, K, D] means (empty clusters keep `c_old`)."""
    out = torch.empty_like(a.c_old, memory_format=torch.contiguous_format)
    launch = kmeans_update_launch(a, out)
    launch_on_device("kmeans_update", launch)
    return out
