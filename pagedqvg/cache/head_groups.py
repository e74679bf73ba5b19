"""The cache call of attention mode `heads`: `PagedCausalKVCache.update_and_attend_heads` (the class binds this
function as its method), the write of `update_and_get_attention_kv` then attention by head groups
(attention/head_groups.py). Kept out of paged_cache.py so the cache class stays one delegating line.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedqvg.attention.head_groups import Attention, attend_head_groups, check_head_call, group_buffer_numel
from pagedqvg.attention.pages import check_query
from pagedqvg.cache.args import check_kv

__all__ = ["update_and_attend_heads"]


@torch.no_grad()
def update_and_attend_heads(
    self: Any, query: torch.Tensor, *, key: torch.Tensor, value: torch.Tensor, current_chunk_start: int,
    cache_head_start: int | None = None, recent_window_tokens: int | None = None, attention: Attention | None = None,
    head_group_size: int | None = None, scale: float | None = None, debug_name: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Write one chunk's K/V exactly as `update_and_get_attention_kv` does (same arguments, errors, transaction rule
    and repeated-call fast path), then attention mode `heads`: the view of `head_group_size` heads at a time built
    into one reused buffer and `attention` called per group, each group's output written into its heads of the
    result. Equal bit for bit to that attention over the whole view for attention functions that compute each head
    alone (torch SDPA on CPU: tests/test_head_groups.py).

    Args:
        query: `[batch, query tokens, heads, head_dim]`, the cache dtype and device, `key`'s heads (no GQA: the
            cache's calls take as many query heads as K/V heads).
        attention: `(q, k, v) -> out`, each `[B, g, tokens, D]` (the `[B, tokens, g, D]` tensors transposed, as
            `view` mode passes the whole view); default `torch.nn.functional.scaled_dot_product_attention`.
        head_group_size: heads per group, 1..Hin (the last group smaller when it does not divide Hin); None: the
            cost model's (`layout.head_groups.choose_head_group`: wave-efficient groups on 132 SMs).
        scale: the default attention's softmax scale (None: SDPA's default); a given `attention` binds its own.
        The rest: as `update_and_get_attention_kv`.

    Returns: `[batch, query tokens, heads, head_dim]` in the attention output's dtype (the query's for SDPA).

    Raises: as `update_and_attend`, plus TypeError / ValueError for a bad `attention`, `head_group_size` or `scale`
    (before anything changes) and ValueError for an attention output of the wrong shape; an error raised during the
    attention rolls an advance back whole. Transient bytes: `layout.head_groups.heads_transient_bytes` (the group
    buffer is the pool's shared view buffer with `reuse_view_buffer`), plus the attention function's own.
    Cost: one view build and one attention call per group; the group plans are derived once per view plan."""
    own = self.debug_name
    if debug_name is not None and debug_name != own:
        self.debug_name = f"{debug_name} ({own})"  # every error of this call names the caller's label
    try:
        what = "update_and_attend_heads"
        self._before_call(what)
        self._ensure_open(what)
        shape = (self.batch_size, self._num_heads, self.head_dim)
        check_kv(self.debug_name, key, value, cache_head_start, shape, self.dtype, self.device)
        check_query(query, key, scale, self.debug_name)
        attend, group_of = check_head_call(self.debug_name, query, attention, head_group_size, scale)

        def write_and_attend():
            plan, h0, _, _, _ = self._write_and_plan(
                key, value, current_chunk_start, cache_head_start, recent_window_tokens, what
            )
            group = group_of(plan.tokens)
            n = group_buffer_numel(self._io, plan, group)
            if self.reuse_view_buffer:
                buffer = self.pool.view_buffer(n, self.dtype)
            else:
                buffer = torch.empty(n, dtype=self.dtype, device=self.device)
            return attend_head_groups(self._io, plan, h0, query, attend, group, buffer)

        return self._transactional(write_and_attend)
    finally:
        self.debug_name = own
