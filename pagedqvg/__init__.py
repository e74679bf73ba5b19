"""pagedqvg: the KV cache of autoregressive video diffusion models as paged device memory.

One `BlockPool` per device owns every K/V byte of every layer under one byte budget; each layer's
`PagedCausalKVCache` reproduces the dense causal cache's contract bit for bit over pool pages.
"""

from typing import TYPE_CHECKING

from pagedqvg.allocator import BlockPool, PoolStats, RangeIndex
from pagedqvg.debug import debug_checks, set_debug_checks
from pagedqvg.errors import (
    CacheClosedError,
    CacheConfigError,
    IntegrationError,
    PackingFailedWarning,
    PagedQVGError,
    PageOwnershipError,
    PoolExhaustedError,
    PoolInvariantError,
    SequencingError,
    SessionRefusedError,
)
from pagedqvg.quant import QuantConfig
from pagedqvg.view import CausalAttentionKVView

if TYPE_CHECKING:
    from pagedqvg.cache.paged_cache import PagedCausalKVCache, make_layer_caches

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`PagedCausalKVCache` and `make_layer_caches` load on first use, so the planner and the CLI's plan commands
    do not import the kernels."""
    if name in ("PagedCausalKVCache", "make_layer_caches"):
        from pagedqvg.cache import paged_cache as cache

        return getattr(cache, name)
    raise AttributeError(f"module 'pagedqvg' has no attribute {name!r}")


__all__ = [
    "BlockPool",
    "CacheClosedError",
    "CacheConfigError",
    "CausalAttentionKVView",
    "IntegrationError",
    "PackingFailedWarning",
    "PageOwnershipError",
    "PagedCausalKVCache",
    "PagedQVGError",
    "PoolExhaustedError",
    "PoolInvariantError",
    "PoolStats",
    "QuantConfig",
    "RangeIndex",
    "SequencingError",
    "SessionRefusedError",
    "debug_checks",
    "make_layer_caches",
    "set_debug_checks",
]
