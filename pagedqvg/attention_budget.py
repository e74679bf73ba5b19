"""Bytes `update_and_attend` (attention.py) needs outside the pool, per call: what the planner budgets for
`--attention pages`. Kernel-free (the planner imports no kernels); the tile sizes live here.
"""

from __future__ import annotations

import torch

#: Key rows per tile (tokens of the view decoded at a time).
ATTN_TILE_TOKENS = 512
#: Query rows per score tile (the fp32-matmul tile path).
ATTN_QUERY_TILE = 512
#: Elements `packed_dequant_torch` decodes per step: kernels.dequant.DEQUANT_TILE_ELEMS (a test checks they agree).
DECODE_STEP_ELEMS = 1 << 18


def attention_scratch_bytes(
    batch: int,
    query_tokens: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    tile_tokens: int = ATTN_TILE_TOKENS,
    query_tile: int = ATTN_QUERY_TILE,
) -> int:
    """Upper bound of the bytes `attend_pages` allocates over dense rows (as tensors the dispatcher sees; aten's
    CPU flash kernel adds its own per-thread scratch), whatever the window length: the tile buffer, the merged
    output and log-sum-exp of the query rows (fp32; fp64 for fp32 caches, `attention.merge_dtype`) plus one tile's
    output and log-sum-exp and the merge's temporaries (3 x `[B, h, Tq]`), the result; without the flash kernel,
    the fp32 copies of the tile and one fp32 score tile of `query_tile` rows with its row statistics."""
    B, Tq, h, D, t = batch, query_tokens, heads, head_dim, tile_tokens
    f32, size, m = 4, dtype.itemsize, (8 if dtype == torch.float32 else 4)
    tile = 2 * B * t * h * D * size
    per_query = B * h * Tq * (D * m + m) + B * h * Tq * (D * size + f32) + 3 * B * h * Tq * m
    per_query += B * Tq * h * D * size  # the result
    fallback = 2 * B * t * h * D * f32 + B * h * min(query_tile, Tq) * (t + 2 * D + 4) * f32
    return tile + per_query + fallback


def packed_decode_bytes(batch: int, cache_heads: int, head_dim: int, tile_tokens: int, fmt) -> int:
    """Upper bound of the extra transient bytes of decoding a packed tile of `tile_tokens` tokens
    (`packed_dequant_torch`: the segment's codebooks, the tile's gathered token rows and int64 row indices, and its
    fp32 decode steps of at most `DECODE_STEP_ELEMS` elements, counted as 8 live fp32 copies of a step)."""
    rows = 2 * batch * cache_heads
    codebooks = rows * fmt.cfg.stages * fmt.cfg.centroids * head_dim * fmt.codebook_dtype.itemsize
    tokens = tile_tokens * 2 * batch * fmt.token_row_bytes
    index = 8 * tile_tokens * 8
    step = min(DECODE_STEP_ELEMS, tile_tokens * rows * head_dim)
    return codebooks + tokens + index + 8 * step * 4


