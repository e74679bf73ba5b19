"""A proven per-element bound on the rounding error of softmax attention, for tests that compare float paths.

`attention_error_bound(q, k, v, scale, out_dtype)` bounds |computed - exact| for *any* implementation that computes
`softmax(q·kᵀ·scale)·v` over the given K/V values with fp32 arithmetic (fp32 inputs or 16-bit inputs upcast exactly,
any summation order, any tiling of the keys into <= T tiles merged by log-sum-exp in fp32 or wider, online-softmax
rescaling, probabilities optionally rounded to `out_dtype` before the p·v product) and rounds its result once to
`out_dtype`. It is what SDPA over a view, attention from pages (tiles + log-sum-exp merge), the split path and the
Triton kernel all compute, so a test can assert each path against fp64 attention with this bound instead of
"within k x another path's error" (which holds only for the summation orders of the CPU it was measured on).

Derivation, per query row and head (u = 2^-24, fp32's unit roundoff; gamma(n) = n·u / (1 - n·u); u_d = `out_dtype`'s
unit roundoff; exact p_j = softmax(s)_j with s_j = scale·q·k_j; A_j = |scale|·sum_d |q_d·k_jd|; M = max_j A_j):

1. A computed score is s_j + d_j with |d_j| <= gamma(D + 1)·A_j (a D-term dot product in any order, and the scale).
2. Subtracting a running maximum (itself a computed score) rounds by u·|s_j - m| <= 2.1·u·M.
3. exp has relative error <= eta = 40·u (aten's `exp_u20` in the CPU flash kernel: 20 ulp; Sleef's and numpy's:
   1 ulp), i.e. a score perturbation <= eta / (1 - eta).
4. The log-sum-exp of a tile is off by at most the above plus gamma(2T + 2) (its sum) plus 2·u·(M + log(T + 1) + 1)
   (the log and the add), and each of <= T merge steps rounds the exponent difference by <= u·(2M + 2·log(T+1) + 4).
   Both perturb every key of a tile by the same factor, i.e. they are score perturbations too.
   Summing 1-4 gives Delta: every computed weight is exp(s_j + e_j) with |e_j| <= Delta, so the normalised weights
   p'_j satisfy |p'_j - p_j| <= p_j·(exp(2·Delta) - 1).
5. Numerator and normaliser are sums of <= T terms with <= T rescalings each (the rescale factor's own error is
   common to both and cancels): relative error <= gamma(2T + 2) each. The probabilities may be rounded to `out_dtype`
   for p·v (u_d), the division rounds (u), the result is rounded to `out_dtype` (u_d). So with
   r = (1 + g)·(1 + u_d)·(1 + u)·(1 + u_d) / (1 - g), g = gamma(2T + 2):

       |computed - exact| <= (exp(2·Delta)·r - 1) · sum_j p_j·|v_j|        (per output element)

The bound is worst case (every rounding aligned), so it is loose against typical errors (by ~100x); a wrong, missing
or duplicated row still moves the output by O(|v|), far beyond it (the tests also check the bound is not vacuous).
"""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24  #: fp32's unit roundoff
EXP_ULPS = 20  #: the widest exp error among the paths: aten's `Vectorized<float>::exp_u20` ("ULP=20")


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next number of `dtype` (2^-24 for fp32, 2^-8 bf16, 2^-11 fp16)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n·u / (1 - n·u): the relative error bound of an n-term sum or product in any order."""
    assert n * u < 1
    return n * u / (1 - n * u)


def attention_error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                          out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Per-element bound (float64, shape of `q`) on |computed attention - exact attention| for `[B, Tq, H, D]` query
    and `[B, T, H, D]` K/V (the values both paths attend over; heads equal), derivation in the module docstring.
    O(B·H·Tq·T·D)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))  # [B, H, *, D]
    D, T = q.shape[-1], k.shape[-2]
    scale = D**-0.5 if scale is None else scale
    p = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)  # exact weights [B, H, Tq, T]
    M = (q.abs() @ k.abs().transpose(-1, -2) * abs(scale)).amax(-1, keepdim=True)  # [B, H, Tq, 1]
    eta = 2 * EXP_ULPS * U32
    log_t = math.log(T + 1)
    g = gamma(2 * T + 2)
    delta = (gamma(D + 1) + 2.1 * U32) * M + eta / (1 - eta)
    delta = delta + (delta + g + 2 * U32 * (M + log_t + 1)) + T * U32 * (2 * M + 2 * log_t + 4)
    u_d = max(unit_roundoff(out_dtype), U32)
    r = (1 + g) * (1 + u_d) ** 2 * (1 + U32) / (1 - g)
    mass = p @ v.abs()  # sum_j p_j |v_j|  [B, H, Tq, D]
    return ((2 * delta).exp() * r - 1).mul(mass).transpose(1, 2)


def assert_attention_within_bound(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  scale: float | None = None, exact: torch.Tensor | None = None,
                                  not_vacuous: bool = True) -> float:  # fmt: skip
    """Assert `out` (any path's attention of `q` over `k`, `v`, in `q`'s dtype) within `attention_error_bound` of
    fp64 attention (`exact`, computed here when None), and (`not_vacuous`) the bound below 5% of max |v|: false for
    adversarial scores (|q·k·scale| ~ 1e4, where fp32 itself guarantees only ~10%; the bound still catches NaN,
    inf and a wrong dominant key). Returns the largest error / bound ratio (<= 1)."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    if exact is None:
        exact = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale).transpose(1, 2)
    bound = attention_error_bound(q, k, v, scale, out.dtype)
    err = (out.double() - exact).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert bool((err <= bound).all()), f"attention error {err.max().item():.3e} beyond the proven bound (ratio {worst})"
    loose = not_vacuous and bound.max().item() > 0.05 * vd.abs().amax().item()
    assert not loose, "bound too loose to catch a wrong row"
    return worst
