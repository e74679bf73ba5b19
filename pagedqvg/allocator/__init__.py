"""The allocator part: the page pool and the sorted global-range index. Nothing here knows about attention."""

from pagedqvg.allocator.pool import (
    DEFAULT_PAGE_BYTES,
    PAGE_ALIGN_BYTES,
    BlockPool,
    PoolStats,
    available_memory_bytes,
    format_bytes,
)
from pagedqvg.allocator.range_index import RangeEntry, RangeIndex

__all__ = [
    "DEFAULT_PAGE_BYTES",
    "PAGE_ALIGN_BYTES",
    "BlockPool",
    "PoolStats",
    "RangeEntry",
    "RangeIndex",
    "available_memory_bytes",
    "format_bytes",
]
