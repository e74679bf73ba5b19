"""Row addressing shared by the torch references and the Triton kernels (no kernels here).

A *row index* is a pair of int64 tensors `(page_idx, slot_idx)` of shape `[2, B, T]`: for K (0) and V (1), batch
`b` and output token `t`, the page and the row slot inside the page that holds that token row (see layout.py: a page
holds `tokens_per_page` whole tokens as a K block `[tokens_per_page, B]` of rows, then a V block of the same shape).
"""

from __future__ import annotations

import math

import torch

from pagedqvg.allocator import BlockPool


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


def window_view(base: torch.Tensor, unit: int, width: int) -> torch.Tensor:
    """The storage of `base` from its first element as a 2-D `[M, width]` view whose row `j` is elements
    `[j * unit, j * unit + width)` (rows overlap when `width > unit`; a view, no copy): `index_select` of it reads
    `width` consecutive elements at any multiple of `unit`."""
    offset = base.storage_offset()
    total = base.untyped_storage().nbytes() // base.element_size() - offset
    return base.as_strided(((total - width) // unit + 1, width), (unit, 1), offset)


def record_gather(
    base: torch.Tensor, starts: torch.Tensor, length: int, align: int, block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan one `index_select` reading records of `length` consecutive elements of `base`'s storage at element
    offsets `starts` (int64 `[N]`, counted from `base`'s first element, each a multiple of `align`), in order:
    `(source, index)` with `torch.index_select(source, 0, index)` `[N // c, c * length]` = the records concatenated.

    Records that follow each other in memory are read `c` at a time (one copy of `c * length` elements), `c` the
    largest count dividing every maximal run of adjacent records and `block` (0: no constraint; so an output read in
    parts of `block` records gathers each part from whole rows of `index`). Runs may start anywhere (a window view,
    `window_view`, at the stride `gcd(length, align)`; when every block starts at a multiple of its width, a view
    without overlap), so rows of one page coalesce whatever the page stride.
    O(N) plus one host read of the run lengths (a sync on CUDA: build it once per plan)."""
    n = starts.numel()
    c = 1
    if n > 1:
        breaks = torch.nonzero(starts[1:] - starts[:-1] != length).flatten() + 1
        edges = torch.cat([breaks.new_zeros(1), breaks, breaks.new_full((1,), n)])
        c = math.gcd(*torch.diff(edges).tolist(), block)
    first = starts[::c]
    u = c * length if n and not bool((first % (c * length)).any()) else math.gcd(length, align)  # aligned: no overlap
    return window_view(base, u, c * length), (first // u).contiguous()


def row_starts(rows: torch.Tensor, page_idx: torch.Tensor, slot_idx: torch.Tensor, head_start: int) -> torch.Tensor:
    """Element offsets (from `rows`' first element) of heads from `head_start` on of the rows `(page_idx, slot_idx)`
    (any equal shapes), flattened. O(numel)."""
    return (page_idx * rows.stride(0) + slot_idx * rows.stride(1) + head_start * rows.shape[3]).reshape(-1)


def heads_contiguous(rows: torch.Tensor) -> bool:
    """Whether the heads of each row of `rows` `[num_pages, rows_per_page, H, D]` are `H x D` consecutive elements."""
    return rows.stride(3) == 1 and rows.stride(2) == rows.shape[3]
