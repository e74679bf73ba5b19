"""Attention straight from pages: `softmax(q·kᵀ·scale)·v` over the rows of a view plan, without building the view.

The cache's view of a call (page_io.ViewPlan: a row index of dense rows, or a run table of dense, packed and zero
runs) is cut once per plan into *tiles* of at most `tile_tokens` key rows, each from one kind of source (dense rows,
or the packed rows of one segment); the zero rows (slots never written) are only counted. A call then, tile by tile:

1. builds the tile's K/V `[2, B, t, Hin, D]` in the cache dtype into one reused tile buffer (the same `view_build` /
   `view_runs` kernels as a view, so packed rows are decoded one tile at a time, exactly as the view holds them),
   and upcasts it exactly into a second reused fp32 buffer (16-bit caches);
2. attends each query block of at most `query_tile` rows (upcast to fp32) to the tile (`tile_attention`: aten's CPU
   flash kernel, which returns the log-sum-exp with the output; elsewhere fp32 matmuls), so tile outputs stay fp32,
   and merges them into the running output by log-sum-exp (`LseMerge`: fp32, fp64 for fp32 caches).

A window of a single tile without zero rows is one flash call in the cache dtype instead (on CPU): its output is the
result, rounded once as SDPA over the view rounds it (same kernel, same rows: bit-equal). With several tiles the
outputs are no longer rounded to the cache dtype before the merge (which measured 4.26e-3 relative L2 on SGLang's
real LongLive2 stage in bf16 at 16-token tiles; see the README).

Zero rows are keys of score 0 and value 0 (what SDPA over the materialized view sees): they enter as one key set of
log-sum-exp `log(Z)` and output 0. The result is the merged output cast to the query dtype.

Transient memory is independent of the window length (`attention_scratch_bytes`): the tile buffer and its fp32 copy,
the merged output and log-sum-exp of the `Tq` query rows, one query block's fp32 copy and output, the result — plus,
for packed tiles, the dequantization temporaries of `t` tokens (kernels/dequant.py: at most `DEQUANT_TILE_ELEMS` fp32
elements per step; `packed_decode_bytes`).
The tile table is cached in the `PageIO` plan cache (dropped with the plan by `invalidate`).

On the Triton backend the call goes through the dispatch point (`kernels.dispatch.attend`: one launch of the
attention kernel, or the split-KV pair), with no tiles.

Cost: O(Tq · T · Hin · D) flops like SDPA; K/V rows are decoded once per call, the fp32 tile read once per query block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedqvg.kernels import dispatch
from pagedqvg.kernels.ops import AttendArgs
from pagedqvg.kernels.rows import int64_on
from pagedqvg.kernels.view.view_runs import DENSE, RUN_COLUMNS, ZERO
from pagedqvg.layout.attention_scratch import (
    ATTN_QUERY_TILE,
    ATTN_TILE_TOKENS,
    attention_scratch_bytes,
    packed_decode_bytes,
)
from pagedqvg.store.page_io import PageIO, ViewPlan

__all__ = [
    "ATTN_QUERY_TILE", "ATTN_TILE_TOKENS", "AttentionTiles", "LseMerge", "attend_pages", "attention_scratch_bytes",
    "attention_tiles", "check_query", "merge_dtype", "packed_decode_bytes", "plan_sources", "tile_attention",
]  # fmt: skip

@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """A view plan cut for attention: `tiles` (sub-plans of at most `tile_tokens` non-zero rows, each of one source
    kind) and `zero_rows` (the view's zero rows, only counted). `plan` is the plan they were cut from."""

    plan: ViewPlan
    tiles: tuple[ViewPlan, ...]
    zero_rows: int
    tile_tokens: int
    host_runs: tuple[list[list[int]], ...] | None = None  #: each tile's run table on the host (run-table plans)


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


def _run_tiles(plan: ViewPlan, tile: int) -> tuple[tuple[ViewPlan, ...], int, tuple[list[list[int]], ...]]:
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
    return tiles, zeros, tuple(runs for _, runs, _ in groups)


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
        tiles, zeros, host_runs = _run_tiles(plan, tile_tokens)
        cut = AttentionTiles(plan, tiles, zeros, tile_tokens, host_runs)
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


def _flash_cpu():
    """aten's CPU flash-attention kernel (returns the output and its log-sum-exp), or None on builds without it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def tile_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `q·kᵀ·scale` of `q` `[B, h, Tq, D]` over one tile `k`, `v` `[B, h, t, D]` (any strides, one
    dtype): the output `[B, h, Tq, D]` and its log-sum-exp
    `[B, h, Tq]` (fp32). On CPU aten's flash kernel (output in q's dtype, fp32 accumulation; its own scratch per
    thread); elsewhere (or without it) fp32 matmuls with one `[B, h, Tq, t]` fp32 score tile (output fp32: the
    caller bounds `Tq` by query blocks)."""
    flash = _flash_cpu()
    if flash is not None and q.device.type == "cpu":
        out, lse = flash(q, k, v, scale=scale)
        return out, lse
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # [B, h, Tq, t] fp32 scores
    m = s.amax(-1, keepdim=True)
    s.sub_(m).exp_()
    total = s.sum(-1, keepdim=True)
    out = torch.matmul(s, v.float()).div_(total)
    return out, total.log_().add_(m).squeeze(-1)


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `LseMerge` accumulates in: fp32, or fp64 for fp32 caches (so merging adds no error of the order
    of the tiles' own: SDPA on the whole view makes fp32 errors once, the tiles once each)."""
    return torch.float64 if dtype == torch.float32 else torch.float32


class LseMerge:
    """Attention over several key sets, merged by log-sum-exp in `merge_dtype(dtype)`: `acc` `[B, h, Tq, D]` is the
    attention over the keys so far, `lse` `[B, h, Tq]` their log-sum-exp (-inf before any)."""

    def __init__(self, B: int, h: int, Tq: int, D: int, dtype: torch.dtype, device: torch.device) -> None:
        acc = merge_dtype(dtype)
        self.acc = torch.zeros(B, h, Tq, D, dtype=acc, device=device)
        self.lse = torch.full((B, h, Tq), -math.inf, dtype=acc, device=device)

    def add_zero_keys(self, count: int) -> None:
        """`count` keys of score 0 and value 0: log-sum-exp `log(count)`, output 0."""
        if count > 0:
            new = torch.logaddexp(self.lse, torch.tensor(math.log(count), device=self.lse.device))
            self.acc.mul_(self.lse.sub_(new).exp_()[..., None])
            self.lse = new

    def add(self, out: torch.Tensor, lse: torch.Tensor, rows: slice = slice(None)) -> None:
        """Fold in the attention `out` `[B, h, n, D]` (fp32 or wider) of query rows `rows` (n of them) over another
        key set with log-sum-exp `lse` `[B, h, n]`. Temporaries: two `[B, h, n]` in the merge dtype."""
        acc, cur = self.acc[:, :, rows], self.lse[:, :, rows]
        new = torch.logaddexp(cur, lse)
        acc.mul_(cur.sub_(new).exp_()[..., None])
        acc.addcmul_(out, new.neg().add_(lse).exp_()[..., None])  # out * exp(lse - new)
        cur.copy_(new)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The attention `[B, Tq, h, D]` (contiguous) in `dtype`."""
        B, h, Tq, D = self.acc.shape
        return torch.empty(B, Tq, h, D, dtype=dtype, device=self.acc.device).copy_(self.acc.transpose(1, 2))


def plan_sources(io: PageIO, plan: ViewPlan) -> tuple:
    """`(plan_index, runs, packed, fmt)` of `plan`: the arguments of the attention kernel and its reference
    (kernels/triton_attention.py, kernels/attention_runs.py). No copy."""
    if plan.page_idx is not None:
        assert plan.slot_idx is not None
        return (plan.page_idx, plan.slot_idx), None, None, None
    st = io.packed
    if st is None:
        return None, plan.runs, None, None
    return None, plan.runs, (st.token_view, st.codebook_rows, plan.cb_pages), st.fmt


def _attend_pages_triton(io: PageIO, plan: ViewPlan, head_start: int, query: torch.Tensor, scale: float):
    """The Triton backend's `attend_pages`: `dispatch.attend` (one launch of the attention kernel over the plan, no
    tiles, no scratch besides the output; or for calls with few query blocks x heads the split-KV pair,
    kernels/attention/triton_attention_split.py, partials scratch: `split_scratch_bytes`)."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    a = AttendArgs(query, io.rows, *plan_sources(io, plan), head_start, plan.tokens, scale)
    dispatch.attend(a, backend="triton", out=out)
    return out


def _attend_one_tile(io: PageIO, tile: ViewPlan, head_start: int, query: torch.Tensor, scale: float):
    """A window of one tile (no zero rows), on CPU: the flash kernel in the cache dtype over the tile;
    its output is the result (one rounding to the query dtype, as SDPA over the view: the same kernel, same rows)."""
    B, _, hin, D = query.shape
    kv = torch.empty(2, B, tile.tokens, hin, D, dtype=io.dtype, device=io.device)
    io.build_view(tile, head_start, hin, kv)
    out, _ = tile_attention(query.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2), scale)
    return out.transpose(1, 2).contiguous()  # the kernel's output is [B, Tq, hin, D] in memory: no copy


def _attend_tiles(io: PageIO, cut: AttentionTiles, head_start: int, query: torch.Tensor, scale: float,
                  query_tile: int) -> torch.Tensor:  # fmt: skip
    """Tile by tile: the tile built in the cache dtype, upcast to fp32 into a second reused buffer (16-bit caches),
    attended in fp32 by query blocks of `query_tile` rows (fp32 outputs) and each block merged into the running
    output by log-sum-exp (module docstring)."""
    B, Tq, hin, D = query.shape
    q = query.transpose(1, 2)  # [B, Hin, Tq, D], a view
    qt = min(query_tile, Tq)
    merged = LseMerge(B, hin, Tq, D, query.dtype, query.device)
    merged.add_zero_keys(cut.zero_rows)
    size = 2 * B * cut.tile_tokens * hin * D
    buf = torch.empty(size, dtype=io.dtype, device=io.device)  # the tile's K/V as the view holds them
    buf32 = buf if io.dtype == torch.float32 else torch.empty(size, dtype=torch.float32, device=io.device)
    for tile in cut.tiles:
        n = 2 * B * tile.tokens * hin * D
        kv = buf[:n].view(2, B, tile.tokens, hin, D)
        io.build_view(tile, head_start, hin, kv)
        kv32 = kv if buf32 is buf else buf32[:n].view(kv.shape).copy_(kv)  # exact upcast
        k, v = kv32[0].transpose(1, 2), kv32[1].transpose(1, 2)
        for a in range(0, Tq, qt):
            qb = q[:, :, a : a + qt].float()  # fp32 caches: a view
            merged.add(*tile_attention(qb, k, v, scale), slice(a, a + qt))
    return merged.result(query.dtype)


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
    without materializing them: tiles of at most `tile_tokens` rows built one at a time into one buffer, each
    attended in fp32 by query blocks of `query_tile` rows and merged by log-sum-exp (see the module docstring; a
    window of one tile on CPU: one flash call in the cache dtype; the Triton backend: `dispatch.attend`).
    `query` `[B, Tq, Hin, D]` in the cache dtype (checked by the caller).
    Returns `[B, Tq, Hin, D]` in the query dtype. Transient bytes: `attention_scratch_bytes`;
    O(Tq · T · Hin · D) flops. Tile sizes default to `ATTN_TILE_TOKENS` and `ATTN_QUERY_TILE` (read at call time)."""
    if plan.extras:  # a tiered view with a second packed format (tier_stores.py): attend over the built view
        return attend_built_view(io, plan, head_start, query, scale)
    if io.backend == "triton":
        return _attend_pages_triton(io, plan, head_start, query, scale)
    tile_tokens = ATTN_TILE_TOKENS if tile_tokens is None else tile_tokens
    query_tile = ATTN_QUERY_TILE if query_tile is None else query_tile
    cut = attention_tiles(io, plan, tile_tokens)
    one = len(cut.tiles) == 1 and cut.zero_rows == 0
    if one and _flash_cpu() is not None and query.device.type == "cpu":
        return _attend_one_tile(io, cut.tiles[0], head_start, query, scale)
    return _attend_tiles(io, cut, head_start, query, scale, query_tile)


def attend_built_view(io: PageIO, plan: ViewPlan, head_start: int, query: torch.Tensor, scale: float) -> torch.Tensor:
    """The fallback of `attend_pages` for views holding packed runs of more than one format (a tiered cache,
    `ViewPlan.extras`): build the whole view (`PageIO.build_view`: one `view_runs` plus one read per other format)
    and attend over it as one tile (`_attend_one_tile`: zero rows are in it as zeros, keys of score 0 and value 0,
    as SDPA over the view). Transient memory: the view's K/V (`2 * B * T * Hin * D` elements) instead of one tile."""
    return _attend_one_tile(io, plan, head_start, query, scale).to(query.dtype)
