"""Byte layout of segments in pool pages, defined once (read by the cache, the kernels and the planner).

A segment's storage is one or more *row regions*. A region is `rows` fixed-size rows of `row_bytes` bytes laid
over its own pages: row `r` sits in page `pages[r // rows_per_page]` at byte `(r % rows_per_page) * row_bytes`,
with `rows_per_page = page_bytes // row_bytes` (the tail of each page that cannot hold a whole row is waste).

Dense (unquantized) segments hold token rows. A token row is one token of one batch element of K or V:
`num_heads * head_dim` values of the cache dtype. A page holds `tokens_per_page = (page_bytes // row_bytes) // (2 * B)`
whole tokens (a token never straddles two pages) as a K block then a V block, each `[tokens_per_page, B, H, D]`:
`rows_per_page = 2 * B * tokens_per_page` rows, row `kv * tokens_per_page * B + (t % tokens_per_page) * B + b` of
page `pages[t // tokens_per_page]` holds token `t` of the segment (0-based), `kv` (0 = K, 1 = V), batch `b`.
So the K (or V) rows of consecutive tokens in one page are one contiguous block that torch copies as a slice, and a
truncated segment (rewind) gives back its trailing pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return dtype.itemsize


@dataclass(frozen=True, slots=True)
class RowRegion:
    """`row_bytes`-byte rows packed into `page_bytes`-byte pages. All sizes in bytes / rows / pages."""

    row_bytes: int
    page_bytes: int

    def __post_init__(self) -> None:
        if self.row_bytes <= 0:
            raise ValueError(f"row_bytes must be > 0, got {self.row_bytes}")
        if self.row_bytes > self.page_bytes:
            raise ValueError(
                f"one row of {self.row_bytes} B does not fit a page of {self.page_bytes} B; "
                f"use page_bytes >= {-(-self.row_bytes // 256) * 256}"
            )

    @property
    def rows_per_page(self) -> int:
        return self.page_bytes // self.row_bytes

    def pages_for_rows(self, rows: int) -> int:
        """Pages needed for `rows` rows. O(1)."""
        return -(-rows // self.rows_per_page)


@dataclass(frozen=True, slots=True)
class DenseTokenLayout:
    """Layout of dense (cache-dtype) token rows for one layer shape."""

    batch_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    page_bytes: int

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row (one token, one batch element, K or V, all heads)."""
        return self.num_heads * self.head_dim * self.itemsize

    @property
    def region(self) -> RowRegion:
        return RowRegion(self.row_bytes, self.page_bytes)

    @property
    def tokens_per_page(self) -> int:
        """Whole tokens (K and V rows of every batch element) per page; 0 if a page cannot hold one."""
        return (self.page_bytes // self.row_bytes) // (2 * self.batch_size)

    @property
    def rows_per_page(self) -> int:
        return 2 * self.batch_size * self.tokens_per_page

    def rows_for_tokens(self, tokens: int) -> int:
        """Rows of a segment of `tokens` tokens (K and V, every batch element)."""
        return 2 * self.batch_size * tokens

    def pages_for_tokens(self, tokens: int) -> int:
        """Pages of a dense segment of `tokens` tokens. O(1)."""
        return -(-tokens // self.tokens_per_page)

    def used_bytes_for_tokens(self, tokens: int) -> int:
        """Bytes of K/V rows that `tokens` tokens really occupy (without page rounding)."""
        return self.rows_for_tokens(tokens) * self.row_bytes


@dataclass(frozen=True, slots=True)
class PackedSegmentLayout:
    """Layout of a PRQ-packed segment: two row regions, each on its own pages, token pages first.

    - token region: `2 * B * n` packed token rows of `token_row_bytes` (pagedqvg/quant/format.py), whole tokens
      per page, token-major: row `(t % tokens_per_page) * 2 * B + kv * B + b` of page `pages[t // tokens_per_page]`
      (K and V of a token side by side: dequantization reads both at once).
    - codebook region: `2 * B * codebook_rows` rows of `codebook_row_bytes` (one (head, stage) centroid table
      each): row `(kv * B + b) * codebook_rows + head * stages + stage`.
    """

    batch_size: int
    token_row_bytes: int
    codebook_row_bytes: int
    codebook_rows: int  # per (kv, batch): num_heads * stages
    page_bytes: int

    @classmethod
    def from_format(cls, batch_size: int, fmt, page_bytes: int) -> PackedSegmentLayout:
        """From a `pagedqvg.quant.format.PackedFormat` (duck-typed to keep this module dependency-free)."""
        return cls(batch_size, fmt.token_row_bytes, fmt.codebook_row_bytes, fmt.num_codebook_rows, page_bytes)

    @property
    def token_region(self) -> RowRegion:
        return RowRegion(self.token_row_bytes, self.page_bytes)

    @property
    def codebook_region(self) -> RowRegion:
        return RowRegion(self.codebook_row_bytes, self.page_bytes)

    @property
    def tokens_per_page(self) -> int:
        """Whole packed tokens (K and V rows of every batch element) per token page; 0 if none fits."""
        return (self.page_bytes // self.token_row_bytes) // (2 * self.batch_size)

    def token_pages(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_page)

    def codebook_pages(self) -> int:
        return self.codebook_region.pages_for_rows(2 * self.batch_size * self.codebook_rows)

    def pages_for_tokens(self, tokens: int) -> int:
        """Pages of a packed segment of `tokens` tokens (token rows + codebooks). O(1)."""
        return self.token_pages(tokens) + self.codebook_pages()

    def used_bytes_for_tokens(self, tokens: int) -> int:
        """Bytes the packed rows and codebooks really occupy (without page rounding)."""
        return (
            2 * self.batch_size * tokens * self.token_row_bytes
            + 2 * self.batch_size * self.codebook_rows * self.codebook_row_bytes
        )


def page_pieces(pages: list[int], tokens_per_page: int, t0: int, t1: int) -> list[tuple[int, int, int]]:
    """Tokens `[t0, t1)` of a segment whose pages are `pages`, as `(page, first, last)` token slots per page, in
    order (`first`/`last` are token slots inside the page, half-open). O(pages touched)."""
    out: list[tuple[int, int, int]] = []
    t = t0
    while t < t1:
        index, first = divmod(t, tokens_per_page)
        last = min(tokens_per_page, first + t1 - t)
        out.append((pages[index], first, last))
        t += last - first
    return out
