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
    CPU flash kernel adds its own per-thread scratch), whatever the window length; the larger of its two paths:

    - one tile (CPU, no zero rows): the tile `[2, B, t, h, D]` and the kernel's output and log-sum-exp;
    - several tiles: the tile buffer and its fp32 copy (16-bit caches), the merged output and log-sum-exp of the
      `Tq` query rows in the merge dtype (fp32; fp64 for fp32 caches) plus one more log-sum-exp (the zero keys'
      merge), per query block of `query_tile` rows its fp32 query copy (16-bit caches), fp32 output and
      log-sum-exp and the merge's two temporaries, the result; without the flash kernel, one fp32 score tile
      `[B, h, query_tile, t]` with its two row statistics."""
    B, Tq, h, D, t, qt = batch, query_tokens, heads, head_dim, tile_tokens, min(query_tile, query_tokens)
    f32, size, m = 4, dtype.itemsize, (8 if dtype == torch.float32 else 4)
    tile = 2 * B * t * h * D * size
    one = tile + B * Tq * h * D * size + B * h * Tq * f32
    up = size < f32  # 16-bit caches: tiles and query blocks upcast to fp32
    tile32 = 2 * B * t * h * D * f32 if up else 0
    merged = B * h * Tq * (D * m + 2 * m) + B * Tq * h * D * size  # output, log-sum-exp (twice), the result
    block = B * h * qt * ((D * f32 if up else 0) + D * f32 + f32 + 2 * m)
    fallback = B * h * qt * (t + 2) * f32
    return max(one, tile + tile32 + merged + block + fallback)


def key_noise_bytes(batch: int, query_tokens: int, heads: int, cache_heads: int, fmt, *,
                    tile_tokens: int = ATTN_TILE_TOKENS, query_tile: int = ATTN_QUERY_TILE) -> int:  # fmt: skip
    """Upper bound of the extra transient bytes of `key_noise_correction` (key_noise.py): per packed tile its K
    records' rows (all `cache_heads`), their scales as bytes and as two fp32 copies; per query block the squared
    fp32 query, its block sums and the fp32 bias `[B, h, query_tile, t]`. The plan's row index (16 bytes per
    packed key row) is cached with the plan, not counted here."""
    B, h, t, qt, nb = batch, heads, tile_tokens, min(query_tile, query_tokens), fmt.num_blocks
    tile = t * B * cache_heads * fmt.per_head_bytes + t * B * h * nb * (1 + 2 * 4)
    block = B * h * qt * (fmt.head_dim + nb + t) * 4
    return tile + block


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


