"""k-means assignment (the inner step of PRQ's k-means): nearest centroid by squared L2, ties to the lowest index.

The torch reference is `quant.prq._assign` itself (the quantizer's own code, so the two can never drift apart): it
ranks centroids by `||c||^2 - 2 x.c` (dropping the per-token constant `||x||^2`), computed with one batched matmul
per token tile, and takes `argmin` (first minimum). The Triton kernel (triton_kmeans.py) evaluates the same expression
tile by tile with a running argmin, never materialising the `[S, K]` distances.

Exactness: the distances are sums of D products, and fp32 addition is not associative. The reference's order is
whatever the BLAS behind `torch.baddbmm` (and `sum`) picks for the shapes at hand; the kernel's is `tl.dot`'s. So
ids agree exactly whenever the computation is exact (e.g. small integers times powers of two) or the two best
centroids are more than a few rounding errors apart; where the two best distances are within the fp32 error bound
of their evaluation (`(D + 2) * 2^-24 * (||c||^2 + 2 sum_i |x_i c_i|)` each), either centroid may be chosen.
"""

from __future__ import annotations

import torch

from ..quant.prq import _assign


def check_kmeans_assign(x: torch.Tensor, c: torch.Tensor) -> None:
    """Shape/dtype checks shared by the reference and the Triton launch."""
    if x.dim() != 3 or c.dim() != 3 or x.shape[0] != c.shape[0] or x.shape[2] != c.shape[2]:
        raise ValueError(f"x must be [H, S, D] and c [H, K, D], got {tuple(x.shape)} and {tuple(c.shape)}")
    if x.dtype != torch.float32 or c.dtype != torch.float32:
        raise TypeError(f"x and c must be float32, got {x.dtype} and {c.dtype}")
    if x.device != c.device:
        raise ValueError(f"x on {x.device}, c on {c.device}")
    if c.shape[1] < 1 and x.shape[1] > 0:
        raise ValueError("no centroids")


def kmeans_assign_torch(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Reference: `quant.prq._assign`. x [H, S, D], c [H, K, D] float32 -> int64 [H, S] (nearest centroid id)."""
    check_kmeans_assign(x, c)
    return _assign(x, c)


def distance_error_bound(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Per (h, s, k) bound on the fp32 rounding error of `||c||^2 - 2 x.c` (float64 [H, S, K], for tests)."""
    x64, c64 = x.double(), c.double()
    d = x.shape[2]
    mag = (c64 * c64).sum(-1)[:, None, :] + 2.0 * torch.bmm(x64.abs(), c64.abs().transpose(1, 2))
    return (d + 2) * 2.0**-24 * mag
