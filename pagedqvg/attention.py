"""Attention straight from pages: `softmax(q·kᵀ·scale)·v` over the rows of a view plan, without building the view.

The cache's view of a call (page_io.ViewPlan: a row index of dense rows, or a run table of dense, packed and zero
runs) is cut once per plan into *tiles* of at most `tile_tokens` key rows, each from one kind of source (dense rows,
or the packed rows of one segment); the zero rows (slots never written) are only counted. A call then, tile by tile:

1. builds the tile's K/V `[2, B, t, Hin, D]` in the cache dtype into one reused tile buffer (the same `view_build` /
   `view_runs` kernels as a view, so packed rows are decoded one tile at a time, exactly as the view holds them);
2. folds the tile into an online softmax in fp32 (FlashAttention's running max `m`, sum `l` and output `acc` per
   query row), over query tiles of at most `query_tile` rows so the score tile is bounded too.

Zero rows are keys of score 0 and value 0 (what SDPA over the materialized view sees): they enter as `Z` keys with
`m = 0`, `l = Z`, `acc = 0` before the first tile. The result is `acc / l` cast to the query dtype.

Transient memory is independent of the window length (`attention_scratch_bytes`): the tile buffer, its fp32 copy,
the fp32 query/accumulator/statistics of the `Tq` query rows and one score tile — plus, for packed tiles, the
dequantization temporaries of `t` tokens (kernels/dequant.py: at most `DEQUANT_TILE_ELEMS` fp32 elements per step).
The tile table is cached in the `PageIO` plan cache (dropped with the plan by `invalidate`).

Cost: O(Tq · T · Hin · D) flops like SDPA; K/V rows are read once per call (once per query tile from the fp32 tile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels.dequant import DEQUANT_TILE_ELEMS
from .kernels.rows import int64_on
from .kernels.view_runs import DENSE, RUN_COLUMNS, ZERO
from .page_io import PageIO, ViewPlan

#: Key rows per tile (tokens of the view decoded at a time).
ATTN_TILE_TOKENS = 512
#: Query rows per score tile.
ATTN_QUERY_TILE = 512


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """A view plan cut for attention: `tiles` (sub-plans of at most `tile_tokens` non-zero rows, each of one source
    kind) and `zero_rows` (the view's zero rows, only counted). `plan` is the plan they were cut from."""

    plan: ViewPlan
    tiles: tuple[ViewPlan, ...]
    zero_rows: int
    tile_tokens: int


def _row_tiles(plan: ViewPlan, tile: int) -> tuple[ViewPlan, ...]:
    """A row-index plan (dense rows only) as slices of its index (views: no copy). O(T / tile)."""
    assert plan.page_idx is not None and plan.slot_idx is not None
    p, sl = plan.page_idx, plan.slot_idx
    return tuple(
        ViewPlan(min(tile, plan.tokens - a), page_idx=p[:, :, a : a + tile], slot_idx=sl[:, :, a : a + tile])
        for a in range(0, plan.tokens, tile)
    )


def _table(runs: list[list[int]], device: torch.device) -> torch.Tensor:
    return int64_on([x for r in runs for x in r], device).view(len(runs), RUN_COLUMNS)


def _run_tiles(plan: ViewPlan, tile: int) -> tuple[tuple[ViewPlan, ...], int]:
    """A run-table plan as tiles of at most `tile` rows, each of dense runs only or of one packed segment's runs
    (runs split where a tile fills; output rows renumbered from 0 per tile); its zero rows counted. One host copy of
    the table, one host->device copy per tile. O(runs + T / tile)."""
    assert plan.runs is not None
    device = plan.runs.device
    groups: list[tuple[object, list[list[int]], int]] = []  # (source key, runs, rows)
    zeros = 0
    for kind, page, first, count, _, cb in plan.runs.tolist():
        if kind == ZERO:
            zeros += count
            continue
        source = ("d",) if kind == DENSE else ("p", cb)
        while count > 0:
            if not groups or groups[-1][0] != source or groups[-1][2] == tile:
                groups.append((source, [], 0))
            key, runs, rows = groups[-1]
            take = min(count, tile - rows)
            runs.append([kind, page, first, take, rows, cb])
            groups[-1] = (key, runs, rows + take)
            first, count = first + take, count - take
    tiles = tuple(
        ViewPlan(rows, runs=_table(runs, device), cb_pages=plan.cb_pages, max_run=max(r[3] for r in runs))
        for _, runs, rows in groups
    )
    return tiles, zeros


def attention_tiles(io: PageIO, plan: ViewPlan, tile_tokens: int = ATTN_TILE_TOKENS) -> AttentionTiles:
    """The cached tiles of `plan` (cut once per plan; the `PageIO` plan cache drops them on `invalidate`)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens}; must be >= 1")
    key = ("attn", id(plan), tile_tokens)
    cut = io.cached(key)
    if isinstance(cut, AttentionTiles) and cut.plan is plan:  # `plan` held by the entry: its id is not reused
        return cut
    if plan.page_idx is not None:
        cut = AttentionTiles(plan, _row_tiles(plan, tile_tokens), 0, tile_tokens)
    else:
        tiles, zeros = _run_tiles(plan, tile_tokens)
        cut = AttentionTiles(plan, tiles, zeros, tile_tokens)
    io.remember(key, cut)
    return cut


def check_query(query: object, key: torch.Tensor, softmax_scale: object, name: str) -> float:
    """Check `query` against the (already checked) `key` of the same call: a strided `[B, Tq >= 1, Hin, D]` tensor of
    key's batch, heads, head_dim, dtype and device; and `softmax_scale` (None: `D ** -0.5`, else a finite real
    number). Returns the scale. TypeError / ValueError naming the values; nothing is read or changed."""
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"{name}: query must be a torch.Tensor, got {type(query).__name__}")
    B, _, hin, D = key.shape
    if query.dim() != 4:
        raise ValueError(f"{name}: query must be [batch, tokens, heads, head_dim], got shape {tuple(query.shape)}")
    if query.layout != torch.strided:
        raise TypeError(f"{name}: query has layout {query.layout}; the cache takes dense (strided) tensors")
    if query.dtype != key.dtype:
        raise TypeError(f"{name}: query dtype {query.dtype} differs from the cache dtype {key.dtype}")
    if query.device != key.device:
        raise ValueError(f"{name}: query is on {query.device}, the cache is on {key.device}")
    qb, tq, qh, qd = query.shape
    if (qb, qh, qd) != (B, hin, D) or tq == 0:
        raise ValueError(
            f"{name}: query shape {tuple(query.shape)} does not match key {tuple(key.shape)} (valid: [{B}, tokens "
            f">= 1, {hin}, {D}]: key's batch, heads and head_dim)"
        )
    if softmax_scale is None:
        return D**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{name}: softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{name}: softmax_scale={softmax_scale} is not finite (valid: a finite float, or None)")
    return float(softmax_scale)


class OnlineSoftmax:
    """Running FlashAttention statistics of `Tq` query rows in fp32: max `m` `[B, h, Tq]`, sum `l` `[B, h, Tq]`,
    unnormalized output `acc` `[B, h, Tq, D]`. `q` is the query `[B, h, Tq, D]` in fp32."""

    def __init__(self, q: torch.Tensor, scale: float, query_tile: int) -> None:
        self.q, self.scale, self.query_tile = q, scale, query_tile
        B, h, Tq, D = q.shape
        self.m = torch.full((B, h, Tq), -math.inf, dtype=torch.float32, device=q.device)
        self.l = torch.zeros(B, h, Tq, dtype=torch.float32, device=q.device)
        self.acc = torch.zeros(B, h, Tq, D, dtype=torch.float32, device=q.device)

    def add_zero_keys(self, count: int) -> None:
        """`count` keys of score 0 and value 0 (before any tile: `m = 0`, `l = count`)."""
        if count > 0:
            self.m.zero_()
            self.l.fill_(float(count))

    def add_tile(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold keys `k` and values `v` `[B, h, t, D]` (fp32) into the statistics, `query_tile` rows at a time."""
        kt = k.transpose(-1, -2)
        for a in range(0, self.q.shape[2], self.query_tile):
            b = a + self.query_tile
            s = torch.matmul(self.q[:, :, a:b], kt).mul_(self.scale)  # [B, h, qt, t] scores
            m_old = self.m[:, :, a:b]
            m_new = torch.maximum(m_old, s.amax(-1))
            s.sub_(m_new[..., None]).exp_()
            alpha = m_old.sub_(m_new).exp_()  # exp(m_old - m_new), in the place of m_old (set to m_new below)
            self.l[:, :, a:b].mul_(alpha).add_(s.sum(-1))
            acc = self.acc[:, :, a:b]
            acc.mul_(alpha[..., None]).add_(torch.matmul(s, v))
            m_old.copy_(m_new)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """`acc / l` as `[B, Tq, h, D]` (contiguous) in `dtype`."""
        B, h, Tq, D = self.acc.shape
        out = torch.empty(B, Tq, h, D, dtype=dtype, device=self.acc.device)
        out.copy_(self.acc.div_(self.l[..., None]).transpose(1, 2))
        return out


def attend_pages(
    io: PageIO,
    plan: ViewPlan,
    head_start: int,
    query: torch.Tensor,
    scale: float,
    *,
    tile_tokens: int | None = None,
    query_tile: int | None = None,
) -> torch.Tensor:
    """`softmax(query·kᵀ·scale)·v` over the rows of `plan` (heads `[head_start, head_start + Hin)` of `io`'s pages),
    without materializing them: tiles of at most `tile_tokens` rows built and folded one at a time (see the module
    docstring). `query` `[B, Tq, Hin, D]` in the cache dtype (checked by the caller). Returns `[B, Tq, Hin, D]` in the
    query dtype. Transient bytes: `attention_scratch_bytes`; O(Tq · T · Hin · D) flops. Tile sizes default to
    `ATTN_TILE_TOKENS` and `ATTN_QUERY_TILE` (read at call time)."""
    tile_tokens = ATTN_TILE_TOKENS if tile_tokens is None else tile_tokens
    query_tile = ATTN_QUERY_TILE if query_tile is None else query_tile
    cut = attention_tiles(io, plan, tile_tokens)
    B, _, hin, D = query.shape
    q = torch.empty(B, hin, query.shape[1], D, dtype=torch.float32, device=query.device)
    state = OnlineSoftmax(q.copy_(query.transpose(1, 2)), scale, query_tile)
    state.add_zero_keys(cut.zero_rows)
    n = 2 * B * tile_tokens * hin * D
    buf = torch.empty(n, dtype=io.dtype, device=io.device)  # the tile's K/V in the cache dtype
    buf32 = torch.empty(n, dtype=torch.float32, device=io.device)  # its fp32 copy, [2, B, Hin, t, D] contiguous
    for tile in cut.tiles:
        t = tile.tokens
        kv = buf[: 2 * B * t * hin * D].view(2, B, t, hin, D)
        io.build_view(tile, head_start, hin, kv)
        kv = kv.permute(0, 1, 3, 2, 4)  # [2, B, Hin, t, D]
        kv = buf32[: kv.numel()].view(kv.shape).copy_(kv)
        state.add_tile(kv[0], kv[1])
    return state.result(query.dtype)


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
    """Upper bound of the transient bytes of `attend_pages` over dense rows, whatever the window length: the tile
    buffer (cache dtype) and its fp32 copy, the fp32 query, accumulator and statistics of the query rows, one fp32
    score tile and the per-tile temporaries of the query tile (row max, sum, the new max, `s·v`), and the output.
    Packed tiles add `packed_decode_bytes`."""
    B, Tq, h, D, t = batch, query_tokens, heads, head_dim, tile_tokens
    qt = min(query_tile, Tq)
    f32 = 4
    tile = 2 * B * t * h * D * (dtype.itemsize + f32)
    per_query = B * h * Tq * (2 * D + 2) * f32 + B * Tq * h * D * dtype.itemsize  # q, acc, m, l; the output
    score = B * h * qt * t * f32 + B * h * qt * (3 + D) * f32
    return tile + per_query + score


def packed_decode_bytes(batch: int, cache_heads: int, head_dim: int, tile_tokens: int, fmt) -> int:
    """Upper bound of the extra transient bytes of decoding a packed tile of `tile_tokens` tokens
    (`packed_dequant_torch`: the segment's codebooks, the tile's gathered token rows and int64 row indices, and its
    fp32 decode steps of at most `DEQUANT_TILE_ELEMS` elements, counted as 8 live fp32 copies of a step)."""
    rows = 2 * batch * cache_heads
    codebooks = rows * fmt.cfg.stages * fmt.cfg.centroids * head_dim * fmt.codebook_dtype.itemsize
    tokens = tile_tokens * 2 * batch * fmt.token_row_bytes
    index = 8 * tile_tokens * 8
    step = min(DEQUANT_TILE_ELEMS, tile_tokens * rows * head_dim)
    return codebooks + tokens + index + 8 * step * 4


