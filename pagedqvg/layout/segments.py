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

from pagedqvg.validation import PAGE_ALIGN_BYTES, check_int, page_bytes_at_least, page_bytes_floor


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return dtype.itemsize


@dataclass(frozen=True, slots=True)
class RowRegion:
    """`row_bytes`-byte rows packed into `page_bytes`-byte pages. All sizes in bytes / rows / pages."""

    row_bytes: int
    page_bytes: int

    def __post_init__(self) -> None:
        check_int("row_bytes", self.row_bytes, minimum=1, message="{name} must be > 0, got {value}")
        if self.row_bytes > self.page_bytes:
            raise ValueError(
                f"one row of {self.row_bytes} B does not fit a page of {self.page_bytes} B; "
                f"use page_bytes >= {page_bytes_at_least(self.row_bytes)}"
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


class Fp8SegmentLayout:
    """Pages of an fp8-tier segment: `2 * B` rows of `Fp8Format.token_row_bytes` per token, whole tokens per page
    (K and V of every batch element side by side, as dense and packed token rows are), no codebooks."""

    def __init__(self, batch_size: int, token_row_bytes: int, page_bytes: int) -> None:
        self.batch_size = batch_size
        self.token_row_bytes = token_row_bytes
        self.tokens_per_page = (page_bytes // token_row_bytes) // (2 * batch_size)
        if self.tokens_per_page < 1:
            raise ValueError(
                f"an fp8-tier token ({2 * batch_size} rows of {token_row_bytes} B) does not fit a page of "
                f"{page_bytes} B; use a larger --page-bytes or another tier format"
            )

    def pages_for_tokens(self, tokens: int) -> int:
        """Pages of a segment of `tokens` tokens. O(1)."""
        return -(-tokens // self.tokens_per_page)

    def used_bytes_for_tokens(self, tokens: int) -> int:
        """Bytes the rows really occupy (without page rounding)."""
        return 2 * self.batch_size * tokens * self.token_row_bytes


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


# ---------------------------------------------------------------------------------------------------- page size
#: `choose_page_bytes` picks the largest page whose worst segment kind wastes at most this fraction of its pages.
AUTO_PAGE_WASTE = 0.005
#: Largest page `choose_page_bytes` considers (bytes).
AUTO_PAGE_MAX_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class SegmentShape:
    """One kind of segment a cache stores: row regions `(record_bytes, records)`, each on its own pages, whole
    records per page. A dense chunk: one region of tokens (`2 * B * H * D * itemsize` bytes per token); a packed
    chunk: its token region (`2 * B * token_row_bytes` per token) and its codebook region (one row per table)."""

    name: str
    regions: tuple[tuple[int, int], ...]

    def pages(self, page_bytes: int) -> int:
        """Pages one segment of this kind takes with `page_bytes` pages (0 if a record does not fit)."""
        total = 0
        for record, count in self.regions:
            per_page = page_bytes // record
            if per_page < 1:
                return 0
            total += -(-count // per_page)
        return total

    @property
    def used_bytes(self) -> int:
        """Bytes the records occupy (no page rounding)."""
        return sum(record * count for record, count in self.regions)

    def waste(self, page_bytes: int) -> float:
        """Fraction of this segment's pages not holding records, with `page_bytes` pages (1.0 if none fits)."""
        pages = self.pages(page_bytes)
        return 1.0 if pages == 0 else 1.0 - self.used_bytes / (pages * page_bytes)


def segment_kinds(
    batch_size: int, num_heads: int, head_dim: int, itemsize: int, chunk_tokens: int, packed_format=None
) -> tuple[SegmentShape, ...]:
    """The segment kinds a cache of this shape stores for chunks of `chunk_tokens` tokens: dense chunks (named "bf16",
    whatever the dtype: the name is a key of `pagedqvg plan --json`'s `page_waste_by_kind`, schema pagedqvg.plan/2),
    plus packed chunks when `packed_format` (a `quant.format.PackedFormat`, duck-typed) is given."""
    kinds = [SegmentShape("bf16", ((2 * batch_size * num_heads * head_dim * itemsize, chunk_tokens),))]
    if packed_format is not None:
        f = packed_format
        kinds.append(
            SegmentShape(
                "packed",
                (
                    (2 * batch_size * f.token_row_bytes, chunk_tokens),
                    (f.codebook_row_bytes, 2 * batch_size * f.num_codebook_rows),
                ),
            )
        )
    return tuple(kinds)


@dataclass(frozen=True, slots=True)
class PageChoice:
    """What `choose_page_bytes` picked: the page size (bytes) and each segment kind's waste fraction with it."""

    page_bytes: int
    waste: tuple[tuple[str, float], ...]  # (kind name, fraction of that kind's pages not holding records)
    target: float
    met: bool  # every kind wastes <= target

    @property
    def worst(self) -> float:
        return max(w for _, w in self.waste)


def choose_page_bytes(
    kinds: tuple[SegmentShape, ...], *, target: float = AUTO_PAGE_WASTE, max_page_bytes: int = AUTO_PAGE_MAX_BYTES
) -> PageChoice:
    """The page size for segments of `kinds` (`--page-bytes auto`): the largest multiple of 256 B up to
    `max_page_bytes` whose worst kind wastes at most `target` of its pages (page tails plus the unfilled last page
    of each region). Larger pages mean fewer pages per segment (fewer page pieces per view), and any mix of
    whole-chunk segments then wastes at most `target`. If no page meets it: the page with the least waste over one
    segment of each kind together (ties: the larger page). O(max_page_bytes / 256 * regions)."""
    smallest = max(record for k in kinds for record, _ in k.regions)
    lo = page_bytes_at_least(smallest)
    hi = max(lo, page_bytes_floor(max_page_bytes))
    used = sum(k.used_bytes for k in kinds)
    best_p, best_pooled = lo, 2.0
    for p in range(hi, lo - 1, -PAGE_ALIGN_BYTES):
        if max(k.waste(p) for k in kinds) <= target:
            best_p = p
            break
        pooled = 1.0 - used / (p * sum(k.pages(p) for k in kinds))
        if pooled < best_pooled:
            best_p, best_pooled = p, pooled
    waste = tuple((k.name, k.waste(best_p)) for k in kinds)
    return PageChoice(best_p, waste, target, max(w for _, w in waste) <= target)
