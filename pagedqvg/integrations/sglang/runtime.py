"""The one SGLang integration object of a process (`integration()`): its pool policy and the pools made from it (one
per device, paged at the planner's page for the first stage allocation's shapes), the host tier of each pool (a CPU
`BlockPool` of `host_budget_bytes` at the same page, PAGEDQVG_HOST_BUDGET), the quantization override, the patches
`install()` made, the listeners, the session managers and request scopes, and the attention mode.

`install()` / `uninstall()` and the entry-point plugin (`plugin.register`) both configure and use this object; it is
the only mutable state of `pagedqvg.integrations.sglang` (everything else is code and constant tables).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedqvg.allocator import DEFAULT_PAGE_BYTES, PAGE_ALIGN_BYTES, BlockPool
from pagedqvg.allocator.pool import available_memory_bytes
from pagedqvg.errors import CacheConfigError
from pagedqvg.quant import QuantConfig
from pagedqvg.serving.host_tier import host_pool_for
from pagedqvg.serving.sessions import SessionManager

__all__ = ["PoolShape", "SGLangIntegration", "integration"]


@dataclass(frozen=True)
class PoolShape:
    """The shapes of one stage allocation that choose (or share) a pool's page: heads and head_dim per cache, chunks
    of `chunk_tokens` tokens (the stage's `num_frames_per_block x num_token_per_frame`), batch, dtype, quantization
    (None: off). `pagedqvg plan` picks its page from the same fields (`Geometry.from_workload`)."""

    num_heads: int
    head_dim: int
    chunk_tokens: int
    batch_size: int
    dtype: torch.dtype
    quant: QuantConfig | None = None

    def kinds(self) -> tuple:
        """The segment kinds caches of this shape store (`layout.segments.segment_kinds`)."""
        from pagedqvg.layout.segments import segment_kinds
        from pagedqvg.quant.format import PackedFormat

        fmt = None
        if self.quant is not None and self.quant.enabled:
            fmt = PackedFormat(self.head_dim, self.num_heads, self.quant, self.dtype)
        itemsize = self.dtype.itemsize
        return segment_kinds(self.batch_size, self.num_heads, self.head_dim, itemsize, self.chunk_tokens, fmt)

    def waste(self, page_bytes: int) -> float:
        """The worst page waste (fraction of a segment's pages not holding records) of this shape at `page_bytes`."""
        return max(k.waste(page_bytes) for k in self.kinds())

    def describe(self) -> str:
        quant = "off" if self.quant is None or not self.quant.enabled else self.quant.mode
        return (
            f"{self.batch_size}x{self.num_heads} heads x {self.head_dim} {str(self.dtype).removeprefix('torch.')}, "
            f"chunks of {self.chunk_tokens} tokens, quant {quant}"
        )


def _device_key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


class SGLangIntegration:
    """Everything `install()`, the plugin, the cache classes and the session hooks share in one process.

    Attributes (read them; change them through the methods):
        lock: guards every field (re-entrant).
        pools: device key (`cuda:0`) -> its `BlockPool`.
        pool_shapes: device key -> {PoolShape: page waste at the pool's page} of every allocation shape seen there
            (the first one chose the page).
        quant_override: whether `quant` replaces each stage's own quantization (the plugin's
            PAGEDQVG_KV_CACHE_QUANT, even `off`); `quant` the parsed `QuantConfig` (None: off).
        patches: (owner, attribute, original) of every `install()` patch, in order; originals: SGLang's classes.
        cache_listeners: called as listener(stage, caches) after every allocation.
        request_listeners: called as listener(stage, pools) after every request end.
        managers: id(pool) -> its `SessionManager`; scopes: this thread's open request scopes (`.stack`).
        host_budget_bytes: the host tier of each pool (None: none); host_pools: id(pool) -> its host `BlockPool`
            (CPU, the pool's page; made with the pool), whose manager swaps idle sessions out when one does not fit.
        attention_mode: `view`, `pages` or `heads` (`attention.py`).
        head_group, head_group_read_env, head_group_choices, heads_said: mode heads (`head_groups.py`).
        announced: the pools and (device key, PoolShape) pairs already logged (the plugin's log lines).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cache_listeners: list[Callable[[Any, list], None]] = []
        self.request_listeners: list[Callable[[Any, list[BlockPool]], None]] = []
        self.scopes = threading.local()
        self.layer_serial = 0
        self.reset()

    def reset(self) -> None:
        """Forget the pool policy, the pools, the patches record, the managers and the quantization override; the
        attention mode back to `view` (what `uninstall()` leaves). Listeners stay. Open sessions stay open."""
        with self.lock:
            self.pool_given: BlockPool | None = None
            self.memory_fraction: float | None = None
            self.budget_bytes: int | None = None
            self.host_budget_bytes: int | None = None
            self.host_pools: dict[int, BlockPool] = {}
            self.quant_override = False
            self.quant: QuantConfig | None = None
            self.pools: dict[str, BlockPool] = {}
            self.pool_shapes: dict[str, dict[PoolShape, float]] = {}
            self.patches: list[tuple[Any, str, Any]] = []
            self.originals: dict[str, Any] = {}
            self.managers: dict[int, SessionManager] = {}
            self.attention_mode = "view"
            # mode heads (head_groups.py): the fixed heads per group (None: the cost model), whether the environment
            # was read, and the cost model's choice per call shape
            self.head_group: int | None = None
            self.head_group_read_env = False
            self.head_group_choices: dict[tuple, int] = {}
            self.heads_said: set[str] = set()  # fallback reasons already logged
            self.announced: set = set()  # the pools and (pool, shape) pairs the plugin has logged

    def configure(
        self,
        *,
        pool: BlockPool | None = None,
        memory_fraction: float | None = None,
        budget_bytes: int | None = None,
        quant: QuantConfig | None = None,
        quant_override: bool | None = None,
        host_budget_bytes: int | None = None,
    ) -> None:
        """Set the pool policy (as `install()`'s arguments, `host_budget_bytes` the host tier of each pool made from
        now on: None or 0, none) and, when `quant_override` is given, the quantization every stage gets (`quant`, a
        `QuantConfig`; None or disabled: off) instead of its own."""
        with self.lock:
            self.pool_given, self.memory_fraction, self.budget_bytes = pool, memory_fraction, budget_bytes
            self.host_budget_bytes = host_budget_bytes or None
            if quant_override is not None:
                self.quant_override = quant_override
                self.quant = quant if quant_override and quant is not None and quant.enabled else None

    def next_name(self, prefix: str) -> str:
        """`prefix` and a process-wide serial number (the default names of caches)."""
        with self.lock:
            self.layer_serial += 1
            return f"{prefix}{self.layer_serial}"

    def shared_pool(self, device: torch.device | str, *, shape: PoolShape | None = None, token_bytes: int = 0):
        """The one `BlockPool` of `device`: the pool given for its device, else one made now from `budget_bytes` or
        `memory_fraction` of the free memory, paged as `pagedqvg plan` pages `shape` (`BlockPool.for_layers`), or,
        without a shape (a cache built outside a stage allocation), 1 MiB pages or the next 256-byte multiple holding
        one token of `token_bytes` bytes. A later `shape` shares the pool; its page waste is recorded in
        `pool_shapes`. CacheConfigError when no pool can be made (no policy, or a budget below one page)."""
        dev = torch.device(device)
        key = _device_key(dev)
        with self.lock:
            pool = self.pools.get(key)
            if pool is None:
                pool = self._make_pool(dev, key, shape, token_bytes)
                self.host_pool_for(pool)  # a host budget below one page is refused before any cache is built
                self.pools[key] = pool
            if shape is not None:
                _check_fits(key, pool, shape, self.pool_shapes.get(key, {}))
                self.pool_shapes.setdefault(key, {}).setdefault(shape, shape.waste(pool.page_bytes))
            return pool

    def _make_pool(self, dev: torch.device, key: str, shape: PoolShape | None, token_bytes: int) -> BlockPool:
        given = self.pool_given
        if given is not None and _device_key(given.device) == key:
            return given
        budget, fraction = self.budget_bytes, self.memory_fraction
        if budget is None and fraction is None:
            have = f"the pool given is on {given.device}" if given is not None else "no pool was given"
            raise CacheConfigError(
                f"no BlockPool for device {key}: {have} and neither budget_bytes nor memory_fraction was set; call "
                f"pagedqvg.integrations.sglang.install(pool=BlockPool(..., device={key!r})) or "
                f"install(budget_bytes=N) / install(memory_fraction=0.5) before SGLang builds its caches"
            )
        if budget is not None:
            capacity, what = budget, f"budget_bytes={budget}"
        else:
            free = available_memory_bytes(dev)
            capacity, what = int(free * fraction), f"memory_fraction={fraction} of {free} free bytes on {key}"
        if shape is not None:
            page = _planner_page(shape)
        else:
            page = max(DEFAULT_PAGE_BYTES, -(-token_bytes // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES)
        if capacity < page:
            raise CacheConfigError(
                f"{what} gives {capacity} bytes, below one page of {page} bytes; raise the budget or the fraction"
            )
        if shape is None:
            return BlockPool(capacity_bytes=capacity, page_bytes=page, device=dev)
        return BlockPool.for_layers(capacity, **_for_layers_args(shape), device=dev)

    def host_pool_for(self, pool: BlockPool) -> BlockPool | None:
        """The host tier of `pool`: a CPU `BlockPool` of `host_budget_bytes` at `pool`'s page (made at the first
        call; pinned memory when `pool` is on CUDA), or None without a host budget. CacheConfigError when the budget
        is below one page of `pool`. O(1) after the first call (which allocates the arena: O(bytes))."""
        with self.lock:
            budget, host = self.host_budget_bytes, self.host_pools.get(id(pool))
            if budget is None or (host is not None and host.page_bytes == pool.page_bytes):
                return host if budget is not None else None
            if budget < pool.page_bytes:
                raise CacheConfigError(
                    f"PAGEDQVG_HOST_BUDGET (host_budget_bytes={budget}) is below one page of the {pool.device} pool "
                    f"({pool.page_bytes} bytes, the planner's page for its caches); valid: at least {pool.page_bytes} "
                    f"bytes (a host tier holds whole pages), or 0 / unset for no host tier"
                )
            host = self.host_pools[id(pool)] = host_pool_for(pool, budget)
            return host

    def manager_for(self, pool: BlockPool) -> SessionManager:
        """The one `SessionManager` of `pool` (made at its first session); with a host tier (`host_pool_for`) it
        swaps idle sessions out to the host pool when a session does not fit (`swap_when_full`). O(1)."""
        with self.lock:
            manager = self.managers.get(id(pool))
            if manager is None or manager.pool is not pool:
                host = self.host_pool_for(pool)
                if host is None:
                    manager = SessionManager(pool)
                else:
                    manager = SessionManager(pool, host_pool=host, swap_when_full=True)
                self.managers[id(pool)] = manager
            return manager


def _check_fits(key: str, pool: BlockPool, shape: PoolShape, earlier: dict[PoolShape, float]) -> None:
    """CacheConfigError unless every record of `shape` (a token's K and V rows, a codebook row) fits one page of the
    device's pool, naming the page, the shape that chose it and the page this one needs."""
    need = max(record for kind in shape.kinds() for record, _ in kind.regions)
    if need > pool.page_bytes:
        first = next(iter(earlier), None)
        chose = f"chosen for {first.describe()}" if first is not None else "given to install()"
        raise CacheConfigError(
            f"caches of {shape.describe()} need pages of at least {need} bytes (one record), but the one pool of "
            f"{key} has pages of {pool.page_bytes} bytes ({chose}); valid: install(pool=BlockPool(..., "
            f"page_bytes>={need})) or shapes whose records fit {pool.page_bytes} bytes"
        )


def _for_layers_args(shape: PoolShape) -> dict[str, Any]:
    return dict(
        num_heads=shape.num_heads,
        head_dim=shape.head_dim,
        chunk_tokens=shape.chunk_tokens,
        dtype=shape.dtype,
        batch_size=shape.batch_size,
        quant=shape.quant,
    )


def _planner_page(shape: PoolShape) -> int:
    """The page `pagedqvg plan` (and `BlockPool.for_layers`) picks for `shape`: `layout.choose_page_bytes`."""
    from pagedqvg.layout.segments import choose_page_bytes

    return choose_page_bytes(shape.kinds()).page_bytes


_INSTANCE = SGLangIntegration()


def integration() -> SGLangIntegration:
    """The process's one `SGLangIntegration` (what `install()` and the plugin configure)."""
    return _INSTANCE
