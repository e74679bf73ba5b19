"""The two steps of PRQ's k-means: assignment (nearest centroid by squared L2, ties to the lowest index) and
update (cluster means; an empty cluster keeps its centroid).

The torch reference is `quant.prq.assign_nearest` itself (the quantizer's own code, so the two can never drift apart):
it ranks centroids by `||c||^2 - 2 x.c` (dropping the per-token constant `||x||^2`), computed with one batched matmul
per token tile, and takes `argmin` (first minimum). The Triton kernel (triton_kmeans.py) evaluates the same expression
tile by tile with a running argmin, never materialising the `[S, K]` distances.

Exactness: the distances are sums of D products, and fp32 addition is not associative. The reference's order is
whatever the BLAS behind `torch.baddbmm` (and `sum`) picks for the shapes at hand; the kernel's is `tl.dot`'s. So
ids agree exactly whenever the computation is exact (e.g. small integers times powers of two) or the two best
centroids are more than a few rounding errors apart; where the two best distances are within the fp32 error bound
of their evaluation (`(D + 2) * 2^-24 * (||c||^2 + 2 sum_i |x_i c_i|)` each, `distance_error_bound`), either
centroid may be chosen. The update (`quant.prq.update_means`) sums the same fp32 values in the BLAS's order, the
kernel in its own fixed tile order: each mean is within `(n - 1) * 2^-24 * mean|x| + 2^-24 * mean|x|` of the exact
mean of its n members (a sum of n terms is off by at most (n - 1) * 2^-24 * sum |x|, the division adds half an ulp;
the tests check it, tests/helpers.py), and equal wherever the sums are exact.
"""

from __future__ import annotations

import torch

from pagedqvg.kernels.ops import KmeansAssignArgs, KmeansUpdateArgs, op_entry
from pagedqvg.quant.prq import assign_nearest, update_means


@op_entry(KmeansAssignArgs)
def check_kmeans_assign(a: KmeansAssignArgs) -> None:
    """Shape/dtype checks shared by the reference and the Triton launch."""
    x, c = a.x, a.c
    if x.dim() != 3 or c.dim() != 3 or x.shape[0] != c.shape[0] or x.shape[2] != c.shape[2]:
        raise ValueError(f"x must be [H, S, D] and c [H, K, D], got {tuple(x.shape)} and {tuple(c.shape)}")
    if x.dtype != torch.float32 or c.dtype != torch.float32:
        raise TypeError(f"x and c must be float32, got {x.dtype} and {c.dtype}")
    if x.device != c.device:
        raise ValueError(f"x on {x.device}, c on {c.device}")
    if c.shape[1] < 1 and x.shape[1] > 0:
        raise ValueError("no centroids")


@op_entry(KmeansAssignArgs)
def kmeans_assign_torch(a: KmeansAssignArgs) -> torch.Tensor:
    """Reference: `quant.prq.assign_nearest`. x [H, S, D], c [H, K, D] float32 -> int64 [H, S] (nearest centroid
    id)."""
    check_kmeans_assign(a)
    return assign_nearest(a.x, a.c)


@op_entry(KmeansUpdateArgs)
def check_kmeans_update(a: KmeansUpdateArgs) -> None:
    """Shape/dtype checks shared by the update reference and the Triton launch (no data is read)."""
    x, ids = a.x, a.ids
    check_kmeans_assign(x, a.c_old)
    if ids.dtype != torch.int64 or tuple(ids.shape) != tuple(x.shape[:2]) or ids.device != x.device:
        raise ValueError(f"ids must be int64 [H, S] = {tuple(x.shape[:2])} on {x.device}, got {ids.dtype} "
                         f"{tuple(ids.shape)} on {ids.device}")  # fmt: skip


@op_entry(KmeansUpdateArgs)
def kmeans_update_torch(a: KmeansUpdateArgs) -> torch.Tensor:
    """Reference: `quant.prq.update_means`. Cluster means float32 [H, K, D] of x [H, S, D] grouped by ids int64 [H, S]
    (0..K-1); empty clusters keep `c_old`. Deterministic (one-hot matmuls in a fixed tile order, no atomics)."""
    check_kmeans_update(a)
    return update_means(a.x, a.ids, a.c_old)


def distance_error_bound(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Per (h, s, k) bound on the fp32 rounding error of `||c||^2 - 2 x.c`, float64 [H, S, K]: where two centroids'
    distances are within the sum of their bounds, the backends may pick either (tests, bench_kernels_cuda)."""
    x64, c64 = x.double(), c.double()
    d = x.shape[2]
    mag = (c64 * c64).sum(-1)[:, None, :] + 2.0 * torch.bmm(x64.abs(), c64.abs().transpose(1, 2))
    return (d + 2) * 2.0**-24 * mag
