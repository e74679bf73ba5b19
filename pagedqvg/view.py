"""The attention view a cache call returns (same fields as SGLang's CausalAttentionKVView)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CausalAttentionKVView:
    """`k`, `v`: `[B, tokens, Hin, D]` in the cache dtype; indices are slots (local) and tokens (global)."""

    k: torch.Tensor
    v: torch.Tensor
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int
