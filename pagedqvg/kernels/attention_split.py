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
constants are a model, **not measured on a GPU yet** (benchmarks/attention_cuda_section.py times every `S`). At
LingBot-World's full 4,680-token chunk (74 query blocks x 40 or 20 heads: 11-22 waves on 132 SMs) it picks 1; it
splits when a call has few query rows (a short chunk, a sub-chunk, decoding).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from .attention_runs import expand_rows
from .ops import AttendArgs, op_entry
from .triton_common import cdiv

#: Multiprocessors assumed when the tensors are not on CUDA (the interpreter; H100/H200 SXM have 132).
DEFAULT_SM_COUNT = 132
#: Attention programs resident per multiprocessor (8 warps and up to 255 registers per thread: one per SM).
PROGRAMS_PER_SM = 1
#: Most key ranges of one call.
MAX_SPLITS = 32
#: Fewest keys per range (tokens): a range shorter than this does not pay for its partial's write and read.
MIN_SPLIT_KEYS = 512
#: Key-block iterations a program costs besides its key blocks (query load, partial store, run-table search).
PROGRAM_OVERHEAD_BLOCKS = 2
#: A split is taken only when its modelled cost is at most this fraction of one launch's.
SPLIT_GAIN = 0.9
#: Most programs of a split partials launch (bounds its scratch: at most this many `BLOCK_M x (D + 2)` partials).
MAX_SPLIT_PROGRAMS = 8 * DEFAULT_SM_COUNT


def _env_splits() -> int | None:
    raw = os.environ.get("PAGEDQVG_ATTN_SPLITS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"PAGEDQVG_ATTN_SPLITS={raw!r}: must be an integer >= 1 (1: one launch), or unset")
    return int(raw)


_forced: list[int | None] = [_env_splits()]


def set_forced_splits(splits: int | None) -> None:
    """Force every Triton attention call to `splits` key ranges (1: one launch), or None: `choose_splits` decides
    (the default; `PAGEDQVG_ATTN_SPLITS` at import sets the initial value). For benchmarks and tuning."""
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits={splits!r}: must be an int >= 1 or None")
    _forced[0] = splits


def forced_splits() -> int | None:
    """The forced split count (`set_forced_splits`), or None."""
    return _forced[0]


@cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` when it is a CUDA device (read once per device), else `DEFAULT_SM_COUNT`."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_cost(programs: int, n_keys: int, splits: int, slots: int, block_n: int) -> int:
    """Modelled cost of `splits` key ranges (key-block iterations on the busiest multiprocessor; module docstring)."""
    waves = cdiv(programs * splits, slots)
    blocks = cdiv(cdiv(n_keys, splits), block_n) + PROGRAM_OVERHEAD_BLOCKS
    merge = cdiv(programs, slots) * (splits + 1) if splits > 1 else 0
    return waves * blocks + merge


def choose_splits(q_blocks: int, heads: int, n_keys: int, sms: int, block_n: int) -> int:
    """Key ranges for a call of `q_blocks` query blocks x `heads` (batch x heads) programs over `n_keys` keys on
    `sms` multiprocessors with key blocks of `block_n` rows (module docstring). O(MAX_SPLITS)."""
    programs, slots = q_blocks * heads, max(1, sms * PROGRAMS_PER_SM)
    limit = min(MAX_SPLITS, n_keys // MIN_SPLIT_KEYS, MAX_SPLIT_PROGRAMS // max(1, programs))
    one = split_cost(programs, n_keys, 1, slots, block_n)
    best, best_cost = 1, one
    for s in range(2, limit + 1):
        c = split_cost(programs, n_keys, s, slots, block_n)
        if c < best_cost:
            best, best_cost = s, c
    return best if best_cost <= SPLIT_GAIN * one else 1


def split_keys(n_keys: int, splits: int) -> tuple[int, int]:
    """`(keys per range, ranges)`: `c = ceil(n_keys / splits)` and the `ceil(n_keys / c)` non-empty ranges that
    cover `[0, n_keys)` (at most `splits`; 1 range for no keys)."""
    if splits < 1:
        raise ValueError(f"splits={splits}: must be >= 1")
    c = max(1, cdiv(n_keys, splits))
    return c, max(1, cdiv(n_keys, c))


def split_scratch_bytes(splits: int, batch: int, query_tokens: int, heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:  # fmt: skip
    """Bytes of a split call's partials (module docstring): `S·B·Tq·hin·(D + 2)` accumulator elements (4 bytes;
    8 for fp32 caches); 0 for `splits == 1` (one launch, no partials)."""
    if splits <= 1:
        return 0
    acc = 8 if dtype == torch.float32 else 4
    return splits * batch * query_tokens * heads * (head_dim + 2) * acc


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
