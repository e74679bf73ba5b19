"""Argument checks of `PagedCausalKVCache` (cache.py): constructor arguments and the K/V of a call; and the
cached plans of a repeated call (`RepeatedCall`).

Each check raises the typed error the cache documents, with a message that names the values and what would be
valid, before anything changes. None reads tensor data (no reductions, no device sync) except `cursor_tensor`, which
reads a given cursor's value once at construction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError
from pagedqvg.layout.segments import DenseTokenLayout
from pagedqvg.quant import QuantConfig
from pagedqvg.store.packed_store import PackedStore
from pagedqvg.store.page_io import ViewPlan, WritePlan
from pagedqvg.store.tier_stores import TierStore, tier_stores
from pagedqvg.validation import as_index, page_bytes_at_least

__all__ = [
    "RepeatedCall",
    "check_device",
    "check_kv",
    "check_quant",
    "cursor_tensor",
    "cursor_tensors",
    "dense_layout",
    "layer_stores",
    "packed_store",
    "recent_window",
    "removed_keywords_error",
    "tier_store_map",
]


def check_device(device: object, pool: BlockPool) -> None:
    """CacheConfigError unless `device` names the pool's device."""
    try:
        dev = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise CacheConfigError(f"unknown device {device!r}") from None
    if dev.type != pool.device.type or (dev.index is not None and dev.index != pool.device.index):
        raise CacheConfigError(f"device {dev} differs from the pool's device {pool.device}")


def check_quant(quant: object, head_dim: int) -> None:
    """CacheConfigError unless `quant` is None or a `QuantConfig` valid for `head_dim`."""
    if quant is None:
        return
    if not isinstance(quant, QuantConfig):
        raise CacheConfigError(f"quant must be a pagedqvg.QuantConfig or None, got {type(quant).__name__}")
    try:
        quant.validate(head_dim=head_dim)
    except ValueError as exc:
        raise CacheConfigError(f"quant: {exc}") from None


def dense_layout(pool: BlockPool, B: int, H: int, D: int, dtype: torch.dtype) -> DenseTokenLayout:
    """The page layout of a layer's dense rows (batch `B`, `H` heads of `D` channels); CacheConfigError when one
    token does not fit a page of the pool."""
    page_bytes = pool.page_bytes
    layout = DenseTokenLayout(B, H, D, dtype, page_bytes)
    if layout.tokens_per_page < 1:
        token_bytes = 2 * B * layout.row_bytes
        raise CacheConfigError(
            f"one token (K and V for {B} batch x {H} heads x {D} x {layout.itemsize} B = {token_bytes} B) does "
            f"not fit a page of {page_bytes} B; use a pool with page_bytes >= {page_bytes_at_least(token_bytes)}"
        )
    return layout


def packed_store(pool: BlockPool, layout: DenseTokenLayout, quant: QuantConfig | None) -> PackedStore | None:
    """The PRQ store of a layer's packed segments (None with quantization off); CacheConfigError naming a bad
    field."""
    if quant is None or not quant.enabled:
        return None
    try:
        return PackedStore(pool, layout.batch_size, layout.num_heads, layout.head_dim, layout.dtype, quant)
    except ValueError as exc:
        raise CacheConfigError(f"quant: {exc}") from None


def cursor_tensors(
    global_end_index: torch.Tensor | None, local_end_index: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cursor tensors (given, checked by `cursor_tensor`, or new zeros); CacheConfigError when both are one
    tensor."""
    g = cursor_tensor("global_end_index", global_end_index, device)
    local = cursor_tensor("local_end_index", local_end_index, device)
    if g.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        raise CacheConfigError("global_end_index and local_end_index must be two different tensors (G and L differ)")
    return g, local


def cursor_tensor(name: str, given: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The cursor tensor `given` (a 1-element int64 tensor on `device` holding 0), or new zeros when None;
    CacheConfigError naming what is wrong otherwise."""
    if given is None:
        return torch.zeros(1, dtype=torch.int64, device=device)
    if not isinstance(given, torch.Tensor) or given.shape != (1,) or given.dtype != torch.int64:
        raise CacheConfigError(f"{name} must be a 1-element int64 tensor, got {given!r}")
    if given.device != device:
        raise CacheConfigError(f"{name} is on {given.device}, the cache on {device}")
    if int(given.item()) != 0:
        raise CacheConfigError(f"{name} must start at 0 for an empty cache, got {int(given.item())}")
    return given


def _check_tensor(name: str, label: str, t: object, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name}: {label} must be [batch, tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: {label} dtype {t.dtype} differs from the cache dtype {dtype}")
    if t.device != device:
        raise ValueError(f"{name}: {label} is on {t.device}, the cache is on {device}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: {label} has layout {t.layout}; the cache takes dense (strided) tensors")


def check_kv(
    name: str,
    key: object,
    value: object,
    cache_head_start: object,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[int, int, int]:
    """`(tokens, heads written, first head)` of a call's `key` / `value` for a cache of `shape` `(batch_size,
    num_heads, head_dim)`; TypeError / ValueError (prefixed `name`) naming a bad tensor, shape or head slice.
    Metadata only (no data read). O(1)."""
    _check_tensor(name, "key", key, dtype, device)
    _check_tensor(name, "value", value, dtype, device)
    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    if key.shape != value.shape:
        raise ValueError(f"{name}: key shape {tuple(key.shape)} differs from value shape {tuple(value.shape)}")
    batch_size, H, head_dim = shape
    batch, n, hin, d = key.shape
    if batch != batch_size:
        raise ValueError(f"{name}: batch {batch} differs from the cache's batch_size {batch_size}")
    if d != head_dim:
        raise ValueError(f"{name}: head_dim {d} differs from the cache's head_dim {head_dim}")
    if n == 0:
        raise ValueError(f"{name}: zero-length chunk (key has 0 tokens); pass at least one token")
    if hin == 0 or hin > H:
        raise ValueError(f"{name}: key has {hin} heads; the cache has {H} (valid: 1..{H})")
    if cache_head_start is None:
        if hin != H:
            raise ValueError(
                f"{name}: key has {hin} heads but the cache has {H}; pass cache_head_start "
                f"(valid: 0..{H - hin}) to write and view heads [cache_head_start, cache_head_start + {hin})"
            )
        return n, hin, 0
    h0 = as_index("cache_head_start", cache_head_start, name)
    if h0 < 0 or h0 + hin > H:
        raise ValueError(
            f"{name}: head slice [{h0}, {h0 + hin}) is outside the cache's {H} heads "
            f"(valid cache_head_start for {hin} heads: 0..{H - hin})"
        )
    return n, hin, h0


def recent_window(name: str, recent_window_tokens: object) -> int | None:
    """`recent_window_tokens` as None or an int >= 0; ValueError / TypeError (prefixed `name`) otherwise."""
    if recent_window_tokens is None:
        return None
    r = as_index("recent_window_tokens", recent_window_tokens, name)
    if r < 0:
        raise ValueError(f"{name}: recent_window_tokens={r} is negative (valid: None or >= 0)")
    return r


def tier_store_map(
    pool: BlockPool, layout: DenseTokenLayout, quant: QuantConfig | None, history: PackedStore | None
) -> dict[str, TierStore]:
    """Format name -> store of every packed format of `quant`'s tiers (`tier_stores.tier_stores`; formats by age),
    empty with quantization off; CacheConfigError naming the tier whose segments do not fit a page."""
    if history is None or quant is None:
        return {}
    try:
        return tier_stores(pool, history, quant, layout.batch_size, layout.num_heads, layout.head_dim, layout.dtype)
    except ValueError as exc:
        raise CacheConfigError(f"quant: {exc}") from None


def layer_stores(
    pool: BlockPool, layout: DenseTokenLayout, quant: QuantConfig | None
) -> tuple[PackedStore | None, dict[str, TierStore]]:
    """`(packed_store, tier_store_map)` of a layer: the history format's store (None with quantization off) and the
    store of every tier format; CacheConfigError naming a bad field or tier."""
    history = packed_store(pool, layout, quant)
    return history, tier_store_map(pool, layout, quant, history)


def removed_keywords_error(removed: dict[str, object]) -> TypeError:
    """The TypeError of unknown keywords of `update_and_attend`; `key_noise_correction` says why it went."""
    if "key_noise_correction" in removed:
        return TypeError(
            "update_and_attend() no longer takes key_noise_correction: the key-noise score correction was removed "
            "because it was measured not to help (worse in 11 of 12 synthetic cases and on the real LongLive2 "
            "stage; docs/NUMBERS.md#key-noise-correction)"
        )
    return TypeError(f"update_and_attend() got unexpected keyword arguments {sorted(removed)}")


class RepeatedCall(NamedTuple):
    """The cached plans of an in-place rewrite, reused by the same call repeated (a later denoise step)."""

    local_start: int
    local_end: int
    write_plan: WritePlan  # where the chunk's rows go
    ranges: list[tuple[int, int]]  # the view's slot ranges
    view_plan: ViewPlan  # where the view's rows come from
