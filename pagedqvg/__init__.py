"""pagedqvg: the KV cache of autoregressive video diffusion models as paged device memory.

One `BlockPool` per device owns every K/V byte of every layer under one byte budget; each layer's
`PagedCausalKVCache` reproduces the dense causal cache's contract bit for bit over pool pages.
"""

from .allocator import BlockPool, PoolStats, RangeIndex
from .cache import PagedCausalKVCache, make_layer_caches
from .errors import (
    CacheClosedError,
    CacheConfigError,
    IntegrationError,
    PackingFailedWarning,
    PagedQVGError,
    PageOwnershipError,
    PoolExhaustedError,
    PoolInvariantError,
    SequencingError,
)
from .quant import QuantConfig
from .view import CausalAttentionKVView

__version__ = "0.1.0"

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
    "make_layer_caches",
]
