"""Attention by head groups (`PagedCausalKVCache.update_and_attend_heads`, mode `heads`): the view of one group of
heads at a time, built into one reused buffer, and the caller's attention function called per group.

Attention is independent per head, so the output equals `view` mode's (the whole view, then the same attention)
bit for bit whenever the attention function computes each head as it would in the whole call (torch SDPA does:
tests/test_head_groups.py), with a transient of one group's view instead of the whole view
(`layout.head_groups.heads_transient_bytes`).

Group plans derive from the call's whole-head `ViewPlan` (the same row index or run table; only the head range
differs): on the Triton backend the kernels take the head range as an argument, so every group runs the whole-head
plan itself; on the torch backend each group keeps what the reference derives for its heads (the gather of a row
index, `runs_torch_plan` of a run table), derived once per whole-head plan and kept in ONE entry of the `PageIO`
plan cache, so a repeated call (a later denoise step) derives nothing, reads nothing back to the host and allocates
only the group buffer and the result (plus what the attention function allocates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pagedqvg.kernels.view.view_build import gather_plan
from pagedqvg.kernels.view.view_runs import runs_torch_plan
from pagedqvg.layout.head_groups import choose_head_group, head_group_ranges
from pagedqvg.store.page_io import PageIO, ViewPlan

__all__ = [
    "Attention", "GroupPlans", "attend_head_groups", "check_head_call", "group_buffer_numel", "group_plans",
    "sdpa_attention",
]  # fmt: skip

#: An attention function of mode `heads`: `(q [B, g, Tq, D], k [B, g, T, D], v [B, g, T, D]) -> [B, g, Tq, D]`,
#: the transposes of `[B, tokens, heads, D]` tensors, exactly as `view` mode passes the whole view to SDPA.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(scale: float | None = None) -> Attention:
    """The default attention: `torch.nn.functional.scaled_dot_product_attention(q, k, v)` (with `scale=` only when
    given, so None is SDPA's own default, as `view` mode calls it)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if scale is None:
        return sdpa
    return lambda q, k, v: sdpa(q, k, v, scale=scale)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPlans:
    """The plans of one whole-head `plan` cut into groups: `ranges` (first head relative to the call's `h0`, heads)
    and one `ViewPlan` per group (the whole plan's tensors; per-group torch derivations)."""

    plan: ViewPlan
    h0: int
    ranges: tuple[tuple[int, int], ...]
    plans: tuple[ViewPlan, ...]


def _derive(io: PageIO, plan: ViewPlan, head_start: int, heads: int) -> ViewPlan:
    """`plan` for heads `[head_start, head_start + heads)`: on the torch backend the gather / run expansion of those
    heads (one host read of the run table on CUDA, none on CPU); on Triton the plan itself (heads are arguments)."""
    if io.backend != "torch":
        return plan
    if plan.page_idx is not None:
        assert plan.slot_idx is not None
        return dataclasses.replace(plan, gather=gather_plan(io.rows, plan.page_idx, plan.slot_idx, head_start, heads))
    assert plan.runs is not None
    st = io.packed
    sources = None
    if st is not None:
        cb = plan.cb_pages.tolist() if plan.cb_pages is not None else []
        sources = (st.token_view, st.codebook_rows, cb, st.fmt)
    derived = runs_torch_plan(io.rows, plan.runs.tolist(), head_start, heads, io.batch_size, sources, io.scratch)
    return dataclasses.replace(plan, runs_plan=derived)


def group_plans(io: PageIO, plan: ViewPlan, h0: int, hin: int, group: int) -> GroupPlans:
    """The cached `GroupPlans` of the whole-head `plan` of heads `[h0, h0 + hin)` in groups of `group` heads: one
    entry of `io`'s plan cache (dropped with the plan by `invalidate`). O(groups x view rows) on its first use,
    O(1) after."""
    key = ("heads", id(plan), h0, hin, group)
    got = io.cached(key)
    if isinstance(got, GroupPlans) and got.plan is plan:  # `plan` held by the entry: its id is not reused
        return got
    ranges = tuple(head_group_ranges(hin, group))
    if len(ranges) == 1:
        plans: tuple[ViewPlan, ...] = (plan,)
    else:
        plans = tuple(_derive(io, plan, h0 + a, g) for a, g in ranges)
    got = GroupPlans(plan, h0, ranges, plans)
    io.remember(key, got)
    return got


def group_buffer_numel(io: PageIO, plan: ViewPlan, group: int) -> int:
    """Elements of the reused group buffer: one group's view `[2, B, T, g, D]`."""
    return 2 * io.batch_size * plan.tokens * group * io.head_dim


def attend_head_groups(io: PageIO, plan: ViewPlan, h0: int, query: torch.Tensor, attention: Attention, group: int,
                       buffer: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Attention of `query` `[B, Tq, Hin, D]` over the view of `plan` (heads `[h0, h0 + Hin)` of `io`'s rows) by
    groups of `group` heads: per group the view is built into `buffer` (1-D, at least `group_buffer_numel`
    elements of the cache dtype, reused by every group), `attention` is called on the group's `[B, g, T, D]`
    transposes and its output copied into the group's heads of the result. Returns `[B, Tq, Hin, D]` (contiguous) in
    the first group's output dtype (the query's for SDPA). ValueError (naming the shapes) when `attention` returns
    something else than a `[B, g, Tq, D]` tensor. Cost: one view build and one attention call per group."""
    B, Tq, hin, D = query.shape
    T = plan.tokens
    cut = group_plans(io, plan, h0, hin, group)
    out: torch.Tensor | None = None  # allocated at the first group's output, in its dtype
    for (a, g), gplan in zip(cut.ranges, cut.plans, strict=True):
        kv = buffer[: 2 * B * T * g * D].view(2, B, T, g, D)
        io.build_view(gplan, h0 + a, g, kv)
        got = attention(query[:, :, a : a + g].transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2))
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (B, g, Tq, D):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(
                f"the attention function returned {shape} for heads [{h0 + a}, {h0 + a + g}); valid: a tensor of "
                f"shape {(B, g, Tq, D)} ([batch, heads, query tokens, head_dim])"
            )
        if out is None:
            out = torch.empty(B, Tq, hin, D, dtype=got.dtype, device=got.device)
        out[:, :, a : a + g].copy_(got.transpose(1, 2))
        del got  # one group's output alive at a time (layout.head_groups.heads_transient_bytes)
    assert out is not None  # hin >= 1: at least one group
    return out


def check_head_call(name: str, query: torch.Tensor, attention: object, head_group_size: object,
                    scale: float | None) -> tuple[Attention, Callable[[int], int]]:  # fmt: skip
    """Check a `heads` call's own arguments (`query` already checked): `attention` a callable or None (then SDPA with
    `scale`; a custom attention takes no `scale`: bind it), `head_group_size` an int in `[1, Hin]` or None (the cost
    model, `layout.head_groups.choose_head_group`, once the view's length is known). Returns the attention function
    and `view tokens -> group size`. TypeError / ValueError naming the values; nothing is read or changed."""
    B, Tq, hin, D = query.shape
    if attention is None:
        attend = sdpa_attention(scale)
    elif not callable(attention):
        raise TypeError(f"{name}: attention must be a callable (q, k, v) -> out or None, got "
                        f"{type(attention).__name__}")  # fmt: skip
    elif scale is not None:
        raise ValueError(f"{name}: scale={scale} applies to the default attention only; bind it in the given "
                         f"attention function (valid: scale=None with attention=...)")  # fmt: skip
    else:
        attend = attention  # type: ignore[assignment]
    if head_group_size is None:
        return attend, lambda tokens: choose_head_group(B, Tq, hin, D, query.dtype, tokens).group
    if isinstance(head_group_size, bool) or not isinstance(head_group_size, int):
        raise TypeError(f"{name}: head_group_size must be an int or None, got {type(head_group_size).__name__}")
    if not 1 <= head_group_size <= hin:
        raise ValueError(f"{name}: head_group_size={head_group_size}; valid: 1..{hin} (the call's heads) or None")
    return attend, lambda tokens: head_group_size
