"""Row addressing shared by the torch references and the Triton kernels (no kernels here).

A *row index* is a pair of int64 tensors `(page_idx, slot_idx)` of shape `[2, B, T]`: for K (0) and V (1), batch
`b` and output token `t`, the page and the row slot inside the page that holds that token row (see layout.py: a page
holds `tokens_per_page` whole tokens as a K block `[tokens_per_page, B]` of rows, then a V block of the same shape).
"""

from __future__ import annotations

import math

import torch

from ..allocator import BlockPool


def token_rows(pool: BlockPool, dtype: torch.dtype, num_heads: int, head_dim: int, rows_per_page: int) -> torch.Tensor:
    """The arena as `[num_pages, rows_per_page, num_heads, head_dim]` token rows of `dtype` (a view, no copy)."""
    pages = pool.pages_as(dtype)
    return pages[:, : rows_per_page * num_heads * head_dim].view(pool.num_pages, rows_per_page, num_heads, head_dim)


def segment_row_index(
    pages_t: torch.Tensor,
    rows_per_page: int,
    token_start: int,
    token_end: int,
    kv_batch: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index of tokens `[token_start, token_end)` of one dense segment whose pages are `pages_t` (int64).

    `kv_batch` is the `[2, B, 1]` tensor `kv * B + b`; `rows_per_page = 2 * B * tokens_per_page`. Token `t` sits in
    page `pages_t[t // tokens_per_page]`, row `kv * tokens_per_page * B + (t % tokens_per_page) * B + b`.
    Returns `(page_idx, slot_idx)`, each `[2, B, n]`. O(B n).
    """
    batch = kv_batch.shape[1]
    tpp = rows_per_page // (2 * batch)
    t = torch.arange(token_start, token_end, device=pages_t.device, dtype=torch.int64)
    kv, b = kv_batch // batch, kv_batch % batch
    slot = kv * (tpp * batch) + (t % tpp) * batch + b
    return pages_t[t // tpp].expand_as(slot), slot


def int64_on(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`. On CUDA through pinned host memory and a non-blocking copy, so
    building a plan's index or run table does not synchronize the host with the GPU (PyTorch's pinned-memory
    allocator keeps the staging buffer alive until the copy has run)."""
    t = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_row_index(rows: torch.Tensor, page_idx: torch.Tensor, slot_idx: torch.Tensor) -> None:
    """IndexError naming the range when a row index leaves `rows` `[num_pages, rows_per_page, H, D]` (reads the
    indices: a device sync on CUDA)."""
    if page_idx.numel() == 0:
        return
    for name, idx, bound in (("page", page_idx, rows.shape[0]), ("slot", slot_idx, rows.shape[1])):
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= bound:
            raise IndexError(f"{name} index out of range: {lo}..{hi}, valid 0..{bound - 1}")


def row_units(rows: torch.Tensor, head_start: int, num_heads: int) -> tuple[torch.Tensor, int] | None:
    """The storage of token rows `[num_pages, rows_per_page, H, D]` as a 2-D `[M, u]` tensor of `u`-element units
    (a view, no copy) such that heads `[head_start, head_start + num_heads)` of every row are whole consecutive
    units; returns `(units, u)`, or None when the rows' heads are not contiguous (`H x D` elements per row).

    The view starts at the rows' first element; `u` is the largest element count dividing the page and row strides
    and the head slice's start and length, so `rows_index_units` can address every row with one flat unit index: a
    gather of whole units is one `index_select` (contiguous copies of `u` elements) instead of an indexed access per
    element."""
    D = rows.shape[3]
    if rows.stride(3) != 1 or rows.stride(2) != D:
        return None
    u = math.gcd(rows.stride(0), rows.stride(1), head_start * D, num_heads * D)
    offset = rows.storage_offset()
    total = rows.untyped_storage().nbytes() // rows.element_size() - offset
    return rows.as_strided((total // u, u), (u, 1), offset), u


def rows_index_units(
    rows: torch.Tensor, page_idx: torch.Tensor, slot_idx: torch.Tensor, head_start: int, num_heads: int, u: int
) -> torch.Tensor:
    """Flat unit indices (into `row_units`' `[M, u]` view) of heads `[head_start, head_start + num_heads)` of the
    rows `(page_idx, slot_idx)` (any equal shapes `S`): shape `[*S, num_heads * D // u]`, flattened. O(numel)."""
    D = rows.shape[3]
    first = page_idx * rows.stride(0) + slot_idx * rows.stride(1) + head_start * D
    k = num_heads * D // u
    if k == 1:
        return (first // u).reshape(-1)
    step = torch.arange(k, dtype=torch.int64, device=first.device)
    return ((first // u).unsqueeze(-1) + step).reshape(-1)


def coalesce_units(index: torch.Tensor) -> int:
    """The largest `k` such that the flat unit index `index` is whole aligned blocks of `k` consecutive units (every
    maximal run of consecutive units starts at a multiple of `k` and is a multiple of `k` long): gathering blocks of
    `k` units instead of single units reads the same elements with `k` times fewer copies. O(len(index)) plus the
    host reads of the run starts and lengths (one per run)."""
    n = index.numel()
    if n < 2:
        return max(n, 1)
    breaks = torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1
    starts = torch.cat([breaks.new_zeros(1), breaks])
    lengths = torch.diff(starts, append=starts.new_full((1,), n))
    return math.gcd(*lengths.tolist(), *index[starts].tolist())
