"""A stored chunk of one layer (`Segment`) and its kind (`SegmentKind`); the range index maps global token ranges to
segments (allocator/range_index.py), the cache decides when they change, `page_io.PageIO` moves their rows."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class SegmentKind(StrEnum):
    """How a segment's tokens are stored: `DENSE` rows of the cache dtype, or `PACKED` PRQ rows plus codebooks.

    A `StrEnum`: members equal their values ("dense", "packed"), so `kind == "packed"` comparisons hold."""

    DENSE = "dense"
    PACKED = "packed"


@dataclass(slots=True)
class Segment:
    """One appended chunk of one layer: its pages (token rows, see layout.py). Its global range is its index key."""

    pages: list[int]  # every page of the segment (packed: token pages, then codebook pages)
    pages_t: torch.Tensor | None = None  # dense, Triton backend: the pages as int64 on the device (row indices)
    kind: SegmentKind = SegmentKind.DENSE
    n_token_pages: int = 0  # packed: pages[:n_token_pages] hold token rows, the rest codebooks
    pack_failed: bool = False  # held non-finite values when the policy tried to pack it (retried after a rewrite)
    lossy: bool = False  # dense rows that came back from a packed form (until a full rewrite of every token and head)
    # dense: the row index `(page_idx, slot_idx)` `[2, B, tokens]` of all its tokens (page_io.PageIO; None when stale)
    row_index: tuple[torch.Tensor, torch.Tensor] | None = None
    # packed: its tier format ('int4', 'int2', 'compact' or 'fp8'; tier_stores.py), None while dense
    fmt: str | None = None

    @property
    def packed(self) -> bool:
        """Whether the segment is PRQ-packed (`kind` is `SegmentKind.PACKED`)."""
        return self.kind == SegmentKind.PACKED
