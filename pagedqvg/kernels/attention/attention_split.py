"""Split-KV attention over a view plan ("flash-decoding"): the plan's `n_keys` key rows cut into `S` contiguous
ranges, attention over each range computed apart as an unnormalized *partial* `(acc, m, l)` (fp32; fp64 for fp32
caches, as `attention.merge_dtype`), then the `S` partials merged by log-sum-exp. Pure torch (importing this does
not import triton): the split heuristic, the key ranges, the scratch size and the torch reference of both steps;
kernels/triton_attention_split.py is the Triton launch pair (partials kernel + merge kernel).

Per range `s` (keys `[s·c, min((s+1)·c, T))`, `c = ceil(T / S)`; ranges cut anywhere, mid-run included), per query
row: `m_s = max_j score_j` (score = q·k_j·scale; -inf for an empty range), `l_s = Σ_j e^(score_j - m_s)`,
`acc_s = Σ_j e^(score_j - m_s)·v_j`. The merge: `M = max_s m_s`, `out = Σ_s e^(m_s - M)·acc_s / Σ_s e^(m_s - M)·l_s`,
cast to the query dtype (empty ranges weigh 0). Zero rows of the view (slots never written) are keys of score 0 and
value 0, in whichever range holds them.

Scratch of a split call (`split_scratch_bytes`, exactly what `attend_split_launch` allocates): the partial outputs
`S x B x Tq x hin x D` and `(m, l)` `S x B x Tq x hin x 2`, in the accumulator dtype (4 bytes; 8 for fp32 caches);
one launch (`S = 1`) needs none. Cost of the split over one launch: the partials written and read once
(2 x that scratch) and a second, small launch.

Heuristic (`choose_splits`): one launch has `q_blocks x B x hin` programs, each walking all `T` keys; on a GPU with
`sm_count` multiprocessors, `PROGRAMS_PER_SM` resident each, a grid of `P` programs runs in `ceil(P / slots)` waves.
The modelled cost of `S` ranges, in key-block iterations on the busiest multiprocessor, is
`ceil(P·S / slots) x (ceil(ceil(T / S) / BLOCK_N) + PROGRAM_OVERHEAD_BLOCKS)` plus, for `S > 1`, the merge
`ceil(P / slots) x (S + 1)`. `S` is the cheapest in `[1, min(MAX_SPLITS, T // MIN_SPLIT_KEYS)]` with `P·S <=
MAX_SPLIT_PROGRAMS`, taken only when it models at most `SPLIT_GAIN` of one launch's cost; else 1 (one launch). The
constants are a model, **not measured on a GPU yet** (benchmarks/attention_cuda_section.py times S = 1, 2, 4, 8
and the pick). At
LingBot-World's full 4,680-token chunk (74 query blocks x 40 or 20 heads: 11-22 waves on 132 SMs) it picks 1; it
splits when a call has few query rows (a short chunk, a sub-chunk, decoding). `set_forced_splits(S)` (or
`PAGEDQVG_ATTN_SPLITS=S`, read per call) overrides it for every call. The heuristic, its constants and the byte counts
live in attention_budget.py (kernel-free: the planner counts them) and are re-exported here.
"""

from __future__ import annotations

from functools import cache

import torch

from pagedqvg.env import attn_splits as attn_splits_from_env
from pagedqvg.kernels.attention.attention_runs import expand_rows
from pagedqvg.kernels.ops import AttendArgs, op_entry
from pagedqvg.layout.attention_scratch import (  # the kernel-free sizing half (the planner counts it); re-exported here
    DEFAULT_SM_COUNT,
    KERNEL_BLOCK_M,
    KERNEL_BLOCK_N,
    KERNEL_BLOCK_N_PACKED,
    MAX_SPLIT_PROGRAMS,
    MAX_SPLITS,
    MIN_SPLIT_KEYS,
    PROGRAM_OVERHEAD_BLOCKS,
    PROGRAMS_PER_SM,
    SPLIT_GAIN,
    choose_splits,
    split_cost,
    split_keys,
    split_scratch_bytes,
    triton_attend_bytes,
)

_FROM_ENV = "env"  #: `_forced[0]` before any `set_forced_splits`: `PAGEDQVG_ATTN_SPLITS` decides, at call time
_forced: list[int | str | None] = [_FROM_ENV]


def set_forced_splits(splits: int | None, *, from_env: bool = False) -> None:
    """Force every Triton attention call to `splits` key ranges (1: one launch), or None: `choose_splits` decides.
    Overrides `PAGEDQVG_ATTN_SPLITS` (which decides until the first call of this; `from_env=True` hands the
    choice back to it). For benchmarks and tuning."""
    if from_env:
        _forced[0] = _FROM_ENV
        return
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits={splits!r}: must be an int >= 1 or None")
    _forced[0] = splits


def forced_splits() -> int | None:
    """The forced split count: `set_forced_splits`'s, else `PAGEDQVG_ATTN_SPLITS` (`pagedqvg.env.attn_splits`, read
    now; ValueError for a bad value), or None."""
    forced = _forced[0]
    if forced == _FROM_ENV:
        return attn_splits_from_env()
    assert forced is None or isinstance(forced, int)
    return forced


@cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` when it is a CUDA device (read once per device), else `DEFAULT_SM_COUNT`."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@op_entry(AttendArgs)
def attend_partials_torch(a: AttendArgs, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference partials of `splits` key ranges (`split_keys`): `acc` `[S, B, hin, Tq, D]`, `m` and `l`
    `[S, B, hin, Tq]`, fp64 (rows expanded as `attend_runs_torch` expands them). Memory: the expanded view."""
    query, rows, plan_index, runs, packed, fmt, head_start, n_keys, scale = a
    B, _, hin, _ = query.shape
    kv = expand_rows(rows, plan_index, runs, packed, fmt, head_start, hin, B, n_keys).double()
    q = query.double().transpose(1, 2)  # [B, hin, Tq, D]
    c, n = split_keys(n_keys, splits)
    accs, ms, ls = [], [], []
    for s in range(n):
        k, v = kv[0, :, s * c : (s + 1) * c].transpose(1, 2), kv[1, :, s * c : (s + 1) * c].transpose(1, 2)
        score = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, hin, Tq, t]
        m = score.amax(-1)
        p = torch.exp(score - m[..., None])
        accs.append(torch.matmul(p, v))
        ms.append(m)
        ls.append(p.sum(-1))
    return torch.stack(accs), torch.stack(ms), torch.stack(ls)


__all__ = [
    "DEFAULT_SM_COUNT", "KERNEL_BLOCK_M", "KERNEL_BLOCK_N", "KERNEL_BLOCK_N_PACKED", "MAX_SPLITS",
    "MAX_SPLIT_PROGRAMS", "MIN_SPLIT_KEYS", "PROGRAMS_PER_SM", "PROGRAM_OVERHEAD_BLOCKS", "SPLIT_GAIN",
    "attend_partials_torch", "attend_split_torch", "choose_splits", "forced_splits", "merge_partials_torch",
    "set_forced_splits", "sm_count", "split_cost", "split_keys", "split_scratch_bytes", "triton_attend_bytes",
]  # fmt: skip


def merge_partials_torch(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The log-sum-exp merge of partials `acc` `[S, B, hin, Tq, D]`, `m`, `l` `[S, B, hin, Tq]` (any float dtype;
    computed in it): `[B, Tq, hin, D]` in `dtype`. Ranges with `m = -inf` (empty) weigh 0."""
    top = m.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(m - top)  # [S, B, hin, Tq]; exp(-inf) = 0
    out = (acc * w[..., None]).sum(0) / (l * w).sum(0)[..., None]
    return out.transpose(1, 2).to(dtype).contiguous()


@op_entry(AttendArgs)
def attend_split_torch(a: AttendArgs, splits: int) -> torch.Tensor:
    """`attend_runs_torch` computed as `splits` ranges and merged (`attend_partials_torch`, `merge_partials_torch`):
    the split path's math in fp64. `[B, Tq, hin, D]` in the query dtype."""
    return merge_partials_torch(*attend_partials_torch(a, splits), a.query.dtype)
