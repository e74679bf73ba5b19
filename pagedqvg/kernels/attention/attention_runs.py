"""Reference of the attention-from-pages kernel (triton_attention.py): `softmax(q·kᵀ·scale)·v` over the rows of a
view plan, computed by expanding the rows (`view_build_torch` for a row index, `view_runs_torch` for a run table:
dense rows copied, packed rows decoded exactly as the view holds them, zero rows 0) and attending in fp64.

Memory: the expanded view `[2, B, T, hin, D]` plus fp64 scores `[B, hin, Tq, T]` (a reference, not a fast path:
`attention.attend_pages` is the CPU path). O(Tq · T · hin · D) flops.
"""

from __future__ import annotations

import torch

from pagedqvg.kernels.ops import AttendArgs, op_entry
from pagedqvg.kernels.view.view_build import view_build_torch
from pagedqvg.kernels.view.view_runs import view_runs_torch
from pagedqvg.quant import PackedFormat


def expand_rows(
    rows: torch.Tensor,
    plan_index: tuple[torch.Tensor, torch.Tensor] | None,
    runs: torch.Tensor | None,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fmt: PackedFormat | None,
    head_start: int,
    hin: int,
    batch: int,
    n_keys: int,
) -> torch.Tensor:
    """The view `[2, B, n_keys, hin, D]` (cache dtype) of a row index `plan_index` or a run table `runs`."""
    out = torch.empty(2, batch, n_keys, hin, rows.shape[3], dtype=rows.dtype, device=rows.device)
    if plan_index is not None:
        view_build_torch(rows, plan_index[0], plan_index[1], head_start, hin, out)
        return out
    assert runs is not None
    tokens, codebooks, cb_pages = packed if packed is not None else (None, None, None)
    view_runs_torch(rows, tokens, codebooks, cb_pages, runs, head_start, out.permute(2, 0, 1, 3, 4), fmt)
    return out


@op_entry(AttendArgs)
def attend_runs_torch(a: AttendArgs) -> torch.Tensor:
    """Attention `[B, Tq, hin, D]` in the query dtype over the plan's rows (heads `[head_start, head_start + hin)`
    of `rows`), softmax and products in fp64. Arguments: `ops.AttendArgs`."""
    query, rows, plan_index, runs, packed, fmt, head_start, n_keys, scale = a
    B, _, hin, _ = query.shape
    kv = expand_rows(rows, plan_index, runs, packed, fmt, head_start, hin, B, n_keys).double()
    q = query.double().transpose(1, 2)  # [B, hin, Tq, D]
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, hin, T, D]
    w = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)
    return torch.matmul(w, v).transpose(1, 2).to(query.dtype).contiguous()
