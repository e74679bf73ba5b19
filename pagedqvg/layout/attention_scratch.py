"""Bytes `update_and_attend` (attention.py) needs outside the pool, per call: what the planner budgets for
`--attention pages`. Kernel-free (the planner imports no kernels); the tile sizes live here.
"""

from __future__ import annotations

from functools import lru_cache

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


# ------------------------------------------------------------------ Triton split-KV attention: sizing (kernel-free)
# The heuristic and the bytes of kernels/triton_attention_split.py (kernels/attention_split.py explains the split
# and holds its torch reference); here so that the planner counts them without importing the kernels package.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
#: The attention kernels' blocks (kernels/triton_attention.py `BLOCK_M`, `BLOCK_N`, `BLOCK_N_PACKED`; a test checks
#: they agree), for sizing a call without importing triton (`triton_attend_bytes`).
KERNEL_BLOCK_M, KERNEL_BLOCK_N, KERNEL_BLOCK_N_PACKED = 64, 64, 32


def split_cost(programs: int, n_keys: int, splits: int, slots: int, block_n: int) -> int:
    """Modelled cost of `splits` key ranges (key-block iterations on the busiest multiprocessor;
    the model: kernels/attention_split.py)."""
    waves = _cdiv(programs * splits, slots)
    blocks = _cdiv(_cdiv(n_keys, splits), block_n) + PROGRAM_OVERHEAD_BLOCKS
    merge = _cdiv(programs, slots) * (splits + 1) if splits > 1 else 0
    return waves * blocks + merge


@lru_cache(maxsize=4096)  # per call on the hot path: a dict hit instead of up to MAX_SPLITS cost evaluations
def choose_splits(q_blocks: int, heads: int, n_keys: int, sms: int, block_n: int) -> int:
    """Key ranges for a call of `q_blocks` query blocks x `heads` (batch x heads) programs over `n_keys` keys on
    `sms` multiprocessors with key blocks of `block_n` rows (the model: kernels/attention_split.py). O(MAX_SPLITS)."""
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
    c = max(1, _cdiv(n_keys, splits))
    return c, max(1, _cdiv(n_keys, c))


def split_scratch_bytes(splits: int, batch: int, query_tokens: int, heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:  # fmt: skip
    """Bytes of a split call's partials (kernels/attention_split.py): `S·B·Tq·hin·(D + 2)` accumulator elements
    (4 bytes; 8 for fp32 caches); 0 for `splits == 1` (one launch, no partials)."""
    if splits <= 1:
        return 0
    acc = 8 if dtype == torch.float32 else 4
    return splits * batch * query_tokens * heads * (head_dim + 2) * acc


def triton_attend_bytes(batch: int, query_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                        view_tokens: int, *, packed: bool, sms: int = DEFAULT_SM_COUNT) -> int:  # fmt: skip
    """Bytes one `update_and_attend` call allocates on the Triton backend: its output `[B, Tq, heads, D]` plus the
    partials (`split_scratch_bytes`) of the split `choose_splits` picks for `view_tokens` keys on `sms`
    multiprocessors (0 for one launch). Whatever the window, at most the output plus
    `MAX_SPLIT_PROGRAMS x KERNEL_BLOCK_M x (D + 2)` accumulator elements."""
    block_n = KERNEL_BLOCK_N_PACKED if packed else KERNEL_BLOCK_N
    s = choose_splits(_cdiv(query_tokens, KERNEL_BLOCK_M), batch * heads, view_tokens, sms, block_n)
    s = split_keys(view_tokens, s)[1]
    out = batch * query_tokens * heads * head_dim * dtype.itemsize
    return out + split_scratch_bytes(s, batch, query_tokens, heads, head_dim, dtype)
