"""Score correction for quantized keys ("quantized keys steal attention"), from bytes the pool already stores.

A packed key is `k + e`: its final PRQ residual is rounded per block of `block_size` channels to a multiple of the
block's fp8 scale Δ (symmetric: `(c - qmax)·Δ`, int2 / int4 / trits; asymmetric: `c·Δ + zero`), so the rounding error
`e_d` of a channel lies in `[-Δ/2, Δ/2]`; modelled as uniform there (the residual spread over several steps), it has
mean 0 and variance `σ_d² = Δ_b(d)² / 12` — one formula for every format (the k-means stages and the fp8 codebooks
add no noise: the residual is taken after the stored centroids). The noise inflates a key's softmax weight on
average: `E[exp(s·q·(k + e))] ≈ exp(s·q·k) · exp(s²/2 · Σ_d q_d² σ_d²)` (second order; exact for Gaussian `e`), so
the corrected score of a packed key is

    s·q·k̃ - s²/2 · Σ_b Δ_b²/12 · Σ_{d in block b} q_d²          (dense and never-written keys: no correction)

Off by default (`update_and_attend(..., key_noise_correction=True)`); what it does to the error is measured in the
README ("Quantized keys steal attention"). The model's limits: clipped values (`fit_scales` multipliers < 1, fp8
scales rounded down) err beyond Δ/2, and int2's three levels leave a non-uniform error when the residual is
concentrated near 0; `benchmarks/bench_key_noise.py` prints the measured error variance over Δ²/12.

Cost: per packed tile of t keys, the keys' block scales gathered from the token pages (`[B, hin, t, nb]` fp32, nb =
head_dim / block_size), and per query block of n rows one `[B, hin, n, nb] @ [B, hin, nb, t]` matmul (the bias).
"""

from __future__ import annotations

import torch

from pagedqvg.kernels.rows import int64_on
from pagedqvg.kernels.view.view_runs import PACKED
from pagedqvg.quant import PackedFormat
from pagedqvg.quant.format import FP8_DTYPE


def packed_rows(runs: list[list[int]]) -> tuple[list[int], list[int]] | None:
    """`(pages, slots)` of a tile's packed key rows in tile order (host lists), or None for a tile without packed
    runs. `runs`: the tile's run table rows `[kind, page, first, count, out_row, cb]` (rows renumbered per tile)."""
    pages: list[int] = []
    slots: list[int] = []
    for kind, page, first, count, out_row, _ in runs:
        if kind != PACKED:
            return None
        assert out_row == len(pages)
        pages += [page] * count
        slots += range(first, first + count)
    return pages, slots


def rows_on(rows: tuple[list[int], list[int]] | None, device: torch.device):
    """`packed_rows` as int64 tensors on `device` (or None)."""
    return None if rows is None else (int64_on(rows[0], device), int64_on(rows[1], device))


def block_variance(token_view: torch.Tensor, rows, fmt: PackedFormat, head_start: int, hin: int) -> torch.Tensor:
    """Noise variance `Δ²/12` `[B, hin, t, nb]` (fp32) of the K records of packed rows `rows` (`(pages, slots)`
    int64 `[t]`) of heads `[head_start, head_start + hin)`. `token_view`: the packed store's `[pages, tpp, 2, B,
    H * per_head_bytes]` uint8 pages. Allocates `t·B·H·per_head_bytes` bytes (the rows) and O(t·B·hin·nb) floats."""
    B = token_view.shape[3]
    nb, a = fmt.num_blocks, fmt.scales_offset
    rec = token_view[rows[0], rows[1], 0].view(-1, B, fmt.num_heads, fmt.per_head_bytes)  # [t, B, H, phb]
    scale = rec[:, :, head_start : head_start + hin, a : a + nb].contiguous().view(FP8_DTYPE).float()
    return scale.square_().div_(12.0).permute(1, 2, 0, 3)  # [B, hin, t, nb]


def noise_bias(q: torch.Tensor, var: torch.Tensor, scale: float) -> torch.Tensor:
    """The score bias `-s²/2 · Σ_b var_b · Σ_{d in b} q_d²` `[B, h, n, t]` (fp32) of queries `q` `[B, h, n, D]` over
    keys of block variances `var` `[B, h, t, nb]`."""
    B, h, n, D = q.shape
    nb = var.shape[-1]
    qsq = q.float().square().view(B, h, n, nb, D // nb).sum(-1)  # [B, h, n, nb]
    return torch.matmul(qsq, var.transpose(-1, -2)).mul_(-0.5 * scale * scale)
