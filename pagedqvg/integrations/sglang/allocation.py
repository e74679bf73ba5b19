"""The stages' `_allocate_causal_kv_cache` as pagedqvg builds it: paged caches over the device's one pool, paged at
the planner's page for the first allocation's shapes (`pagedqvg plan`'s page: `BlockPool.for_layers`), one session of
the pool per allocation (`sessions.admit`), and the quantization the stage gets (the plugin's parsed `QuantConfig`
when it overrides, else the stage's own `--kv-cache-quant*`). The AROUND hooks `install()` and the plugin install.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError, IntegrationError
from pagedqvg.integrations.sglang import sessions as _sessions
from pagedqvg.integrations.sglang.caches import (
    PagedCausalSelfAttentionKVCache,
    PagedQVGPackedCausalKVCache,
    quant_config_from_sglang,
)
from pagedqvg.integrations.sglang.runtime import PoolShape, integration
from pagedqvg.integrations.sglang.versions import stage_quant_args
from pagedqvg.quant import QuantConfig
from pagedqvg.validation import check_int

__all__ = [
    "ALLOCATE_PARAMS",
    "allocate_around",
    "build_paged_caches",
    "check_allocate_signature",
    "lingbot_allocate_around",
    "stage_quant",
]


def _packed_caches(
    blocks: int,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: Any,
    use_int_indices: bool,
    quant_args: Any,
    policy: dict[str, Any],
    pool: BlockPool | None,
) -> list:
    """One `PagedQVGPackedCausalKVCache` per block: `shape` is `(batch, cache_size, heads, head_dim)`, `policy` the
    sink/global-sink/window/growth arguments."""
    batch_size, cache_size, heads, head_dim = shape
    return [
        PagedQVGPackedCausalKVCache(
            batch_size=batch_size,
            cache_size=cache_size,
            num_heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            use_int_indices=use_int_indices,
            global_end_index=torch.zeros(1, dtype=torch.long, device=device),
            local_end_index=torch.zeros(1, dtype=torch.long, device=device),
            quant_args=quant_args,
            name=f"block{i}-{integration().next_name('')}",
            pool=pool,
            **policy,
        )
        for i in range(blocks)
    ]


def _dense_caches(
    blocks: int,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: Any,
    use_int_indices: bool,
    policy: dict[str, Any],
    pool: BlockPool | None,
) -> list:
    """One `PagedCausalSelfAttentionKVCache` per block (quantization off), as `_packed_caches`."""
    int_index = 0 if use_int_indices else None
    # One element stands in for SGLang's [batch, cache_size, heads, head_dim] zeros: only its dtype and device
    # matter, and the shape comes from expand() (no memory).
    proto = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device).expand(*shape)
    return [
        PagedCausalSelfAttentionKVCache(
            k=proto,
            v=proto,
            global_end_index=torch.zeros(1, dtype=torch.long, device=device),
            local_end_index=torch.zeros(1, dtype=torch.long, device=device),
            global_end_index_int=int_index,
            local_end_index_int=int_index,
            cache_size=shape[1],
            name=f"block{i}-{integration().next_name('')}",
            pool=pool,
            **policy,
        )
        for i in range(blocks)
    ]


#: The parameters of SGLang 0.5.23's `_allocate_causal_kv_cache` (both stages), in order; a hook refuses others.
ALLOCATE_PARAMS = (
    "self",
    "batch_size",
    "kv_cache_size",
    "num_attention_heads",
    "attention_head_dim",
    "dtype",
    "device",
    "use_int_indices",
    "sink_tokens",
    "global_sink_tokens",
    "attention_window_size",
    "allow_growth",
)


def check_allocate_signature(fn: Any) -> None:
    """IntegrationError unless `fn` takes exactly SGLang 0.5.23's `_allocate_causal_kv_cache` parameters."""
    try:
        got = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        got = ()
    if got != ALLOCATE_PARAMS:
        raise IntegrationError(
            f"{getattr(fn, '__qualname__', fn)} has parameters {got}; pagedqvg supports SGLang 0.5.23's "
            f"{ALLOCATE_PARAMS}: install sglang==0.5.23 or a pagedqvg release for your SGLang"
        )


def _check_allocation(stage: str, *sizes: object) -> None:
    """CacheConfigError naming the first allocation size (the stage's num_transformer_blocks, batch_size,
    kv_cache_size, num_attention_heads, attention_head_dim) that is not an int >= 1."""
    names = ("num_transformer_blocks", "batch_size", "kv_cache_size", "num_attention_heads", "attention_head_dim")
    wording = f"{stage}._allocate_causal_kv_cache: {{name}} must be an int >= 1, got {{value!r}}"
    for name, value in zip(names, sizes, strict=True):
        check_int(name, value, minimum=1, error=CacheConfigError, message=wording, type_message=wording)


def stage_quant(stage: Any, head_dim: int) -> QuantConfig | None:
    """The quantization `stage`'s caches of `head_dim` channels get: the integration's parsed `QuantConfig` when it
    overrides the stages' (the plugin's PAGEDQVG_KV_CACHE_QUANT*, even off), else the stage's `_kv_quant_args`
    (LingBot-World's --kv-cache-quant*, `quant_config_from_sglang`); None = off. O(1)."""
    integ = integration()
    if integ.quant_override:
        quant: Any = integ.quant
    else:
        quant = stage_quant_args(stage)
    if quant is None or not bool(getattr(quant, "enabled", False)):
        return None
    return quant_config_from_sglang(quant, head_dim)


def _pool_shape(stage: Any, shape: tuple[int, int, int, int], dtype: Any, quant: QuantConfig | None, sink: int):
    """The `PoolShape` of one allocation: its heads, head_dim, batch, dtype, quantization and the stage's chunk
    (`sessions.chunk_tokens`: frames per block x tokens per frame, at most the window past the sink)."""
    batch, cache_size, heads, head_dim = shape
    chunk = _sessions.chunk_tokens(stage, max(1, cache_size - sink))
    return PoolShape(heads, head_dim, chunk, batch, dtype, quant)


def _stage_pool(stage: Any, shape: tuple[int, int, int, int], dtype: Any, device: Any, quant, sinks: tuple) -> Any:
    """The device's pool for this allocation (made at the planner's page for its shapes if it is the first), or None
    for a dtype / device the cache constructors refuse (they raise their own CacheConfigError)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    sink = max(s for s in sinks if isinstance(s, int)) if any(isinstance(s, int) for s in sinks) else 0
    return integration().shared_pool(dev, shape=_pool_shape(stage, shape, dtype, quant, sink))


def build_paged_caches(
    stage: Any,
    *,
    batch_size: int,
    kv_cache_size: int,
    num_attention_heads: int,
    attention_head_dim: int,
    dtype: torch.dtype,
    device,
    use_int_indices: bool = False,
    sink_tokens: int = 0,
    global_sink_tokens: int = 0,
    attention_window_size: int | None = None,
    allow_growth: bool = False,
) -> list:
    """What the stages' `_allocate_causal_kv_cache` returns, as paged caches (no dense buffers): one per
    transformer block over the device's one pool (made now, at the planner's page for this allocation's shapes, if
    it is the first), packed (`PagedQVGPackedCausalKVCache`, any sink / global sink / growth / pin, which SGLang's
    QVG path refuses) when `stage_quant(stage)` is on, else `PagedCausalSelfAttentionKVCache`; one session
    (`sessions.admit`). O(blocks)."""
    if attention_window_size is None:
        attention_window_size = kv_cache_size
    blocks = getattr(stage, "num_transformer_blocks", None)
    _check_allocation(type(stage).__name__, blocks, batch_size, kv_cache_size, num_attention_heads, attention_head_dim)
    quant = stage_quant(stage, attention_head_dim)
    shape = (batch_size, kv_cache_size, num_attention_heads, attention_head_dim)
    pool = _stage_pool(stage, shape, dtype, device, quant, (sink_tokens, global_sink_tokens))
    policy = dict(
        sink_tokens=sink_tokens,
        global_sink_tokens=global_sink_tokens,
        attention_window_size=attention_window_size,
        allow_growth=allow_growth,
    )
    if quant is not None:
        caches = _packed_caches(blocks, shape, dtype, device, use_int_indices, quant, policy, pool)
    else:
        caches = _dense_caches(blocks, shape, dtype, device, use_int_indices, policy, pool)
    caches = _sessions.admit(stage, caches, allow_growth=allow_growth)  # one session: admitted, closed at request end
    for listener in list(integration().cache_listeners):
        listener(stage, caches)
    return caches


def allocate_around(original: Any, stage: Any, /, **kwargs: Any) -> list:
    """AROUND hook for `CausalDMDDenoisingStage._allocate_causal_kv_cache` (the base of LongLive2, causal Wan and
    LingBot-World): paged caches instead of SGLang's dense `torch.zeros` ones (the result differs, so the original
    is not called)."""
    check_allocate_signature(original)
    return build_paged_caches(stage, **kwargs)


def lingbot_allocate_around(original: Any, stage: Any, /, **kwargs: Any) -> list:
    """AROUND hook for `LingBotWorldCausalDMDDenoisingStage._allocate_causal_kv_cache`: packed paged caches when
    quantization is on (or its flags on and the plugin's override off); otherwise SGLang's original, which calls the
    base stage's (hooked: paged) allocation, so the result is the same."""
    check_allocate_signature(original)
    head_dim = kwargs.get("attention_head_dim")
    if stage_quant(stage, head_dim) is not None or getattr(stage_quant_args(stage), "enabled", False):
        return build_paged_caches(stage, **kwargs)
    return original(stage, **kwargs)


