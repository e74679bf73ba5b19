"""Head groups of attention mode `heads` (`PagedCausalKVCache.update_and_attend_heads`): how a call's heads are cut
into groups, the bytes one call allocates outside the pool, and the cost model that picks the group size.

Mode `heads` builds the view of one group of `g` heads at a time into one reused buffer and calls the user's
attention per group, so its transient is about `g / heads` of `view` mode's. Tensor-free (torch dtypes and
arithmetic only): the planner calls `heads_transient_bytes` and `choose_head_group` with the call's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_SMS", "QUERY_BLOCK", "WAVE_TARGET", "HeadGroupChoice", "choose_head_group", "head_group_ranges",
    "heads_transient_bytes", "view_transient_bytes", "wave_efficiency",
]  # fmt: skip

#: Streaming multiprocessors of the device the default cost model assumes (an NVIDIA H200 / H100 SXM).
DEFAULT_SMS = 132
#: Query rows per thread block of the attention kernels the cost model assumes (FlashAttention's 128).
QUERY_BLOCK = 128
#: The wave efficiency the cost model asks of a group size (the smallest size reaching it wins).
WAVE_TARGET = 0.9


def head_group_ranges(heads: int, group: int) -> list[tuple[int, int]]:
    """`[(first, count), ...]`: heads `[0, heads)` cut into groups of `group` heads (the last one smaller when
    `group` does not divide `heads`). Both ints >= 1, `group <= heads` (checked by the callers). O(heads / group)."""
    return [(a, min(group, heads - a)) for a in range(0, heads, group)]


def view_transient_bytes(batch: int, query_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                         view_tokens: int) -> int:  # fmt: skip
    """Bytes of `view` mode's call outside the pool: the view `[2, B, T, h, D]` and the attention output
    `[B, h, Tq, D]` (the attention kernel's own workspace not counted)."""
    return (2 * view_tokens + query_tokens) * batch * heads * head_dim * dtype.itemsize


def heads_transient_bytes(batch: int, query_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                          view_tokens: int, group: int) -> int:  # fmt: skip
    """Bytes one `update_and_attend_heads` call allocates outside the pool, at its peak (tokens, heads as in the
    call; `group` heads per group): the reused group view buffer `[2, B, T, g, D]`, the result `[B, Tq, h, D]` and
    one group's attention output `[B, g, Tq, D]` (each freed once copied into the result; the attention kernel's own
    workspace not counted). With `reuse_view_buffer` the group buffer is the pool's shared view buffer (counted
    here all the same: it lives outside the page budget). Exact: tests/test_head_groups_sizing.py measures it."""
    g = min(group, heads)
    size = dtype.itemsize
    return (2 * view_tokens * g + query_tokens * heads + query_tokens * g) * batch * head_dim * size


def wave_efficiency(batch: int, query_tokens: int, heads: int, group: int, sms: int = DEFAULT_SMS,
                    query_block: int = QUERY_BLOCK) -> float:  # fmt: skip
    """Busy fraction of `sms` multiprocessors over the launches of `heads` cut into groups of `group`: each launch
    has `batch x g x ceil(Tq / query_block)` thread blocks and takes `ceil(blocks / sms)` waves; efficiency =
    all blocks / (all waves x sms). E.g. LingBot-World's 4,680-query chunk: 37 blocks per head; 40 heads in groups
    of 10 on 132 SMs: 4 launches of 370 blocks in 3 waves, 370 / 396 = 93.4%; groups of 4: 148 / 264 = 56.1%."""
    per_head = batch * math.ceil(query_tokens / query_block)
    blocks = waves = 0
    for _, g in head_group_ranges(heads, group):
        blocks += per_head * g
        waves += math.ceil(per_head * g / sms)
    return blocks / (waves * sms)


@dataclass(frozen=True, slots=True)
class HeadGroupChoice:
    """The cost model's group: `group` heads per group (`groups` launches), its `wave_efficiency` and its
    `transient_bytes` (`heads_transient_bytes`); `reason` says why it won, in words."""

    group: int
    groups: int
    wave_efficiency: float
    transient_bytes: int
    reason: str


def choose_head_group(batch: int, query_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                      view_tokens: int, *, budget_bytes: int | None = None, sms: int = DEFAULT_SMS,
                      target: float = WAVE_TARGET) -> HeadGroupChoice:  # fmt: skip
    """The group size of a `heads` call: the smallest `g` in `[1, heads]` whose `wave_efficiency` reaches `target`
    and whose transient fits `budget_bytes` (None: no limit); if none reaches it, the most efficient size that fits
    (smallest on ties); if none fits, 1 (the least memory). O(heads^2 / g) arithmetic.
    ValueError for a non-positive shape or `sms`."""
    for name, v in (("batch", batch), ("query_tokens", query_tokens), ("heads", heads), ("head_dim", head_dim),
                    ("view_tokens", view_tokens), ("sms", sms)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "view_tokens" else 1):
            raise ValueError(f"choose_head_group: {name}={v!r}; valid: an int >= {0 if name == 'view_tokens' else 1}")

    def choice(g: int, reason: str) -> HeadGroupChoice:
        eff = wave_efficiency(batch, query_tokens, heads, g, sms)
        nbytes = heads_transient_bytes(batch, query_tokens, heads, head_dim, dtype, view_tokens, g)
        return HeadGroupChoice(g, math.ceil(heads / g), eff, nbytes, reason)

    fits = [
        g for g in range(1, heads + 1)
        if budget_bytes is None
        or heads_transient_bytes(batch, query_tokens, heads, head_dim, dtype, view_tokens, g) <= budget_bytes
    ]  # fmt: skip
    if not fits:
        return choice(1, f"no group size fits {budget_bytes} bytes: 1 head per group (the least memory)")
    for g in fits:
        if wave_efficiency(batch, query_tokens, heads, g, sms) >= target:
            return choice(g, f"the smallest group of >= {target:.0%} wave efficiency on {sms} SMs that fits")
    best = max(fits, key=lambda g: (wave_efficiency(batch, query_tokens, heads, g, sms), -g))
    return choice(best, f"no group reaches {target:.0%} on {sms} SMs: the most efficient that fits")
