"""pagedqvg inside SGLang 0.5.23's multimodal_gen: every causal self-attention KV cache SGLang builds becomes a
`PagedCausalKVCache` over one shared `BlockPool` per device.

Usage (before SGLang builds its pipeline stages)::

    from pagedqvg.integrations import sglang as pagedqvg_sglang
    pagedqvg_sglang.install(memory_fraction=0.5)   # or budget_bytes=24 << 30, or pool=BlockPool(...)

`install()` replaces SGLang's `CausalSelfAttentionKVCache` and `QVGPackedCausalKVCache` in every SGLang module that
binds them by `PagedCausalSelfAttentionKVCache` / `PagedQVGPackedCausalKVCache` (same constructor signatures), and
the stages' `_allocate_causal_kv_cache` by one that builds paged caches without allocating SGLang's dense
`torch.zeros` buffers. `uninstall()` puts SGLang's own back. `import pagedqvg` never imports SGLang; this module
imports it only inside `install()`.

Semantics: the dense cache's contract (docs/SEMANTICS.md), bit for bit with quantization off, including the
cursor forms SGLang keeps (see `PagedCausalSelfAttentionKVCache`). Differences from SGLang's dense class:
- `k` / `v` are read-only, freshly materialized `[B, cache_size, H, D]` tensors (a debugging view, one copy of the
  layer per access); writing them (`cache.k = t` or `cache.k[...] = x`) does not reach the cache.
- Buffers passed to the constructor are read once: their shape, dtype and device define the cache and, when each
  is uniform (e.g. `torch.zeros`, `torch.full`), that value is what never-written slots and heads read; the
  caller's buffers are not kept. A non-uniform buffer's content is not adopted (never-written data reads zeros).
- Differences of `PagedCausalKVCache` itself (README "Where pagedqvg deliberately differs").
Dtype policy (as the dense cache): `key`/`value` of another floating dtype are cast to the cache dtype on write.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

import torch

from pagedqvg.allocator import DEFAULT_PAGE_BYTES, PAGE_ALIGN_BYTES, BlockPool
from pagedqvg.allocator.pool import available_memory_bytes
from pagedqvg.cache.paged_cache import PagedCausalKVCache
from pagedqvg.errors import CacheConfigError, IntegrationError
from pagedqvg.integrations.sglang import attention as _attention
from pagedqvg.integrations.sglang import sessions as _sessions
from pagedqvg.quant import QuantConfig
from pagedqvg.quant.config import SGLANG_KEYS
from pagedqvg.validation import SUPPORTED_DTYPES, check_int
from pagedqvg.view import CausalAttentionKVView

__all__ = [
    "PagedCausalSelfAttentionKVCache",
    "PagedQVGPackedCausalKVCache",
    "install",
    "installed",
    "quant_config_from_sglang",
    "shared_pool",
    "uninstall",
]

#: SGLang 0.5.23 modules: where the cache classes are defined, and the modules that bind or use them.
KVCACHE_MODULE = "sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache"
QVG_MODULE = "sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache"
STAGE_MODULE = "sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising"
LINGBOT_STAGE_MODULE = (
    "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world."
    "lingbot_world_causal_denoising"
)
LONGLIVE2_STAGE_MODULE = "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2"
#: SGLang's realtime session state that keeps a stage's caches across chunk calls (sglang_sessions.dispose_before).
REALTIME_STATE_MODULE = "sglang.multimodal_gen.runtime.realtime.states.causal"
#: Stage classes whose `forward` is one request (sglang_sessions.forward_around): (module, class name).
FORWARD_STAGES = (
    (STAGE_MODULE, "CausalDMDDenoisingStage"),
    (LONGLIVE2_STAGE_MODULE, "LongLive2CausalDenoisingStage"),
    (LINGBOT_STAGE_MODULE, "LingBotWorldCausalDMDDenoisingStage"),
)
#: Modules install() imports (when importable) so that their bindings are patched too.
BINDING_MODULES = (
    "sglang.multimodal_gen.runtime.layers.kvcache",
    STAGE_MODULE,
    LINGBOT_STAGE_MODULE,
    LONGLIVE2_STAGE_MODULE,
    REALTIME_STATE_MODULE,
    "sglang.multimodal_gen.runtime.models.dits.causal_wanvideo",
    "sglang.multimodal_gen.runtime.models.dits.lingbot_world",
    "sglang.multimodal_gen.runtime.models.dits.longlive2",
)
_CLASS_NAMES = ("CausalSelfAttentionKVCache", "QVGPackedCausalKVCache")

_lock = threading.RLock()
# The pool policy of install() and the pools made from it (one per device).
_config: dict[str, Any] = {"pool": None, "memory_fraction": None, "budget_bytes": None, "quant": None}
_pools: dict[str, BlockPool] = {}
# (owner object, attribute, original value) of every patch, in order; empty when not installed.
_patches: list[tuple[Any, str, Any]] = []
_originals: dict[str, Any] = {}
_layer_serial = 0


def _device_key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def shared_pool(device: torch.device | str, *, token_bytes: int = 0) -> BlockPool:
    """The one `BlockPool` of `device` every integrated cache shares: the pool given to `install()` for its
    device, else one made at the first cache from `budget_bytes` or `memory_fraction` of the device's free
    memory (1 MiB pages, or the next 256-byte multiple holding one token of `token_bytes` bytes if larger).

    Raises:
        CacheConfigError: neither a pool for this device nor a budget or fraction was given to `install()`, or the
            budget / fraction is below one page.
    """
    dev = torch.device(device)
    key = _device_key(dev)
    with _lock:
        pool = _pools.get(key)
        if pool is not None:
            return pool
        given = _config["pool"]
        if given is not None and _device_key(given.device) == key:
            _pools[key] = given
            return given
        page = max(DEFAULT_PAGE_BYTES, -(-token_bytes // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES)
        budget, fraction = _config["budget_bytes"], _config["memory_fraction"]
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
        if capacity < page:
            raise CacheConfigError(
                f"{what} gives {capacity} bytes, below one page of {page} bytes; raise the budget or the fraction"
            )
        pool = BlockPool(capacity_bytes=capacity, page_bytes=page, device=dev)
        _pools[key] = pool
        return pool


def _next_name(prefix: str) -> str:
    global _layer_serial
    with _lock:
        _layer_serial += 1
        return f"{prefix}{_layer_serial}"


def _sglang_view_cls() -> type:
    """SGLang's `CausalAttentionKVView` when its module is already imported (never imports it), else pagedqvg's
    (same fields, same order)."""
    module = sys.modules.get(KVCACHE_MODULE)
    view = getattr(module, "CausalAttentionKVView", None) if module is not None else None
    return view if isinstance(view, type) else CausalAttentionKVView


def _uniform_value(t: torch.Tensor) -> float:
    """The single value of a uniform tensor (every element equal, e.g. zeros / full), else 0.0."""
    if t.numel() == 0:
        return 0.0
    first = t.reshape(-1)[:1] if t.is_contiguous() else t[(0,) * t.dim()].reshape(1)
    if all(stride == 0 for stride, size in zip(t.stride(), t.shape, strict=True) if size > 1):
        return float(first.item())  # one element broadcast (expand): uniform without reading the whole shape
    return float(first.item()) if bool((t == first).all()) else 0.0


def _cursor_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        got = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
        raise CacheConfigError(
            f"{name} must be a 1-element integer tensor (e.g. torch.zeros(1, dtype=torch.long)), got {got}"
        )
    if t.device != device:
        raise CacheConfigError(f"{name} is on {t.device}; the cache is on {device}")
    return t


def _cursor_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CacheConfigError(f"{name} must be None or an int >= 0, got {value!r}")
    return value


def _check_buffers(label: str, k: object, v: object) -> None:
    """CacheConfigError unless `k` and `v` are `[batch, cache_size, heads, head_dim]` tensors of one supported
    dtype, shape and device."""
    for what, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CacheConfigError(f"{label}: {what} must be a [batch, cache_size, heads, head_dim] tensor, got {got}")
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise CacheConfigError(
            f"{label}: v ({tuple(v.shape)}, {v.dtype}, {v.device}) differs from k ({tuple(k.shape)}, {k.dtype}, "
            f"{k.device}); they must match"
        )
    if k.dtype not in SUPPORTED_DTYPES:
        raise CacheConfigError(f"{label}: k dtype {k.dtype} is not supported; valid: {SUPPORTED_DTYPES}")


def _check_fields(label: str, pinned_start: object, pinned_len: object, cache_size: object, window: object) -> None:
    """CacheConfigError naming a bad pin, cache_size (an int >= 0, 0 = k.shape[1]) or attention_window_size (an
    int) of the SGLang constructor."""
    for what, value in (("pinned_start", pinned_start), ("pinned_len", pinned_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise CacheConfigError(f"{label}: {what} must be an int, got {value!r}")
    if pinned_start < -1 or pinned_len < 0:  # type: ignore[operator]
        raise CacheConfigError(
            f"{label}: pinned_start={pinned_start}, pinned_len={pinned_len} (valid: -1 or a slot; length >= 0)"
        )
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
        raise CacheConfigError(f"{label}: cache_size must be an int >= 0 (0 = k.shape[1]), got {cache_size!r}")
    if isinstance(window, bool) or not isinstance(window, int):
        raise CacheConfigError(f"{label}: attention_window_size must be an int, got {window!r}")


def _check_start(label: str, g0: int, l0: int, pinned_start: int, pinned_len: int) -> None:
    """CacheConfigError unless the constructor's cursors satisfy 0 <= local <= global and the pin lies below the
    local end."""
    if not 0 <= l0 <= g0:
        raise CacheConfigError(
            f"{label}: cursors global_end_index={g0}, local_end_index={l0} (valid: 0 <= local <= global)"
        )
    if pinned_start >= 0 and pinned_len > 0 and pinned_start + pinned_len > l0:
        raise CacheConfigError(
            f"{label}: pinned_start={pinned_start} + pinned_len={pinned_len} exceeds local_end_index={l0} "
            f"(valid: pinned_start + pinned_len <= the local end, or pinned_start=-1)"
        )


class _SGLangSurface(PagedCausalKVCache):
    """What both SGLang-compatible classes add to `PagedCausalKVCache`: settable `sink_tokens` /
    `attention_window_size` / `allow_growth`, `pinned_start` / `pinned_len`, `reset_pinned_sink()`, the read-only
    materialized `k` / `v`, the dense cache's dtype cast, and fill values for never-written data.

    Built on the base's public API and its documented extension points only (`_view_cls`, `_unwritten_fill`,
    `_before_call`, `_on_cursors_changed`, `_set_spec`, `_unpin`, `_read_slots`, `_adopt`)."""

    # ---------------------------------------------------------------- settable configuration (validated)
    @property
    def sink_tokens(self) -> int:
        """Tokens kept at the front when the window rolls; settable (an int >= 0, as the dense dataclass field);
        takes effect at the next call."""
        return super().sink_tokens

    @sink_tokens.setter
    def sink_tokens(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CacheConfigError(f"{self.debug_name}: sink_tokens must be an int >= 0, got {value!r}")
        self._set_spec(sink_tokens=value)

    @property
    def attention_window_size(self) -> int:
        """Slots a view covers; settable (an int >= 1; the dense cache's 0 = cache_size applies only at
        construction)."""
        return super().attention_window_size

    @attention_window_size.setter
    def attention_window_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CacheConfigError(
                f"{self.debug_name}: attention_window_size must be an int >= 1 (slots), got {value!r}; "
                f"cache_size is {self.cache_size}"
            )
        self._set_spec(window=value)

    @property
    def allow_growth(self) -> bool:
        """Whether an advance that does not fit grows `cache_size` (to max(needed, 2 x cache_size)) instead of
        rolling; settable (a bool)."""
        return super().allow_growth

    @allow_growth.setter
    def allow_growth(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise CacheConfigError(f"{self.debug_name}: allow_growth must be a bool, got {value!r}")
        self._set_spec(allow_growth=value)

    @property
    def pinned_start(self) -> int:
        """The slot where the pinned chunk starts, -1 when nothing is pinned (see `pin_current_chunk`)."""
        return self.pinned_range[0]

    @property
    def pinned_len(self) -> int:
        """The pinned chunk's length in tokens (0 when nothing is pinned)."""
        return self.pinned_range[1]

    def reset_pinned_sink(self) -> None:
        """Unpin (`pinned_start = -1`, `pinned_len = 0`); no data moves."""
        self._unpin("reset_pinned_sink")

    # ---------------------------------------------------------------- the dense buffers, materialized
    def _materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._read_slots("k / v")
        C, L = self.cache_size, out.shape[2]
        k = torch.empty(self.batch_size, C, self.num_cache_heads, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        k[:, :L].copy_(out[0])
        v[:, :L].copy_(out[1])
        k[:, L:].fill_(self._unwritten_fill[0])
        v[:, L:].fill_(self._unwritten_fill[1])
        return k, v

    @property
    def k(self) -> torch.Tensor:
        """A debugging view: the dense cache's K buffer `[B, cache_size, H, D]` as it would read now (slots past
        the local end and never-written data read the fill value, 0 unless the constructor's buffer was uniform).
        Materialized on every access (a copy of the whole layer); read-only: assigning it raises AttributeError
        and writing into the returned tensor does not reach the cache."""
        return self._materialize()[0]

    @property
    def v(self) -> torch.Tensor:
        """The V buffer as `k` describes (materialized on every access, read-only)."""
        return self._materialize()[1]

    # ---------------------------------------------------------------- calls
    def update_and_get_attention_kv(
        self,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str | None = None,
    ):
        """`PagedCausalKVCache.update_and_get_attention_kv`, with the dense cache's dtype policy: `key`/`value` of
        another floating dtype are cast to the cache dtype (the same rounding as the dense buffer's copy)."""
        if isinstance(key, torch.Tensor) and key.dtype != self.dtype and key.dtype.is_floating_point:
            key = key.to(self.dtype)
        if isinstance(value, torch.Tensor) and value.dtype != self.dtype and value.dtype.is_floating_point:
            value = value.to(self.dtype)
        if _attention.attention_mode() in _attention.DEFERRED_MODES:  # attention.py: the view deferred (pages, heads)
            return _attention.pages_view(
                self, key, value, current_chunk_start, cache_head_start, recent_window_tokens, debug_name
            )
        return super().update_and_get_attention_kv(
            key=key,
            value=value,
            current_chunk_start=current_chunk_start,
            cache_head_start=cache_head_start,
            recent_window_tokens=recent_window_tokens,
            debug_name=debug_name,
        )



class PagedCausalSelfAttentionKVCache(_SGLangSurface):
    """SGLang 0.5.23's `CausalSelfAttentionKVCache` (same constructor, fields and methods) over pagedqvg's pool.

    Args (SGLang's dataclass fields, in its order; positional or keyword):
        k, v: `[batch, cache_size, heads, head_dim]` tensors of one floating dtype on one device. Read once: they
            define batch, heads, head_dim, dtype and device; a uniform buffer's value is the fill value of
            never-written data (0 for SGLang's `torch.zeros`). Not kept; `k` / `v` are materialized views.
        global_end_index, local_end_index: 1-element integer tensors, kept (the same objects) and kept current.
        global_end_index_int, local_end_index_int: host cursors (None: read from the tensors at the first call).
            Both forms are kept current as the dense cache does: after the first call the ints are set, and the
            tensors are written whenever a cursor changes. Non-zero cursors start a cache whose slots
            `[0, local)` hold tokens `[global - local, global)` that were never written (they read the fill value).
        cache_size: slots of the window, in tokens; 0 = `k.shape[1]`.
        sink_tokens: tokens kept at the front when the window rolls (settable).
        attention_window_size: slots a view covers; 0 = cache_size (settable).
        allow_growth: grow cache_size instead of rolling (settable).
        global_sink_tokens: the first tokens of the stream, kept for good (a pin adds to them).
        pinned_start, pinned_len: an initial pin (-1, 0: none).
        pool: keyword-only extension: the `BlockPool`; default: `shared_pool(device)` (see `install`).
        quant: keyword-only extension: a `QuantConfig` (None: quantization off).
        name: keyword-only extension: the pool owner label and the prefix of error messages.
    """

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        global_end_index: torch.Tensor,
        local_end_index: torch.Tensor,
        global_end_index_int: int | None = None,
        local_end_index_int: int | None = None,
        cache_size: int = 0,
        sink_tokens: int = 0,
        attention_window_size: int = 0,
        allow_growth: bool = False,
        global_sink_tokens: int = 0,
        pinned_start: int = -1,
        pinned_len: int = 0,
        *,
        pool: BlockPool | None = None,
        quant: QuantConfig | None = None,
        name: str | None = None,
    ) -> None:
        label = name or _next_name("sglang-layer")
        _check_buffers(label, k, v)
        batch, slots, heads, head_dim = k.shape
        g_int = _cursor_int("global_end_index_int", global_end_index_int)
        l_int = _cursor_int("local_end_index_int", local_end_index_int)
        g_t = _cursor_tensor("global_end_index", global_end_index, k.device)
        l_t = _cursor_tensor("local_end_index", local_end_index, k.device)
        if g_t.untyped_storage().data_ptr() == l_t.untyped_storage().data_ptr():
            raise CacheConfigError(f"{label}: global_end_index and local_end_index must be two different tensors")
        _check_fields(label, pinned_start, pinned_len, cache_size, attention_window_size)
        cache_size = cache_size or slots
        if pool is None:
            pool = shared_pool(k.device, token_bytes=2 * batch * heads * head_dim * k.element_size())
        if g_int is not None and l_int is not None:
            g0, l0 = g_int, l_int
        else:
            g0, l0 = int(g_t.item()), int(l_t.item())
        _check_start(label, g0, l0, pinned_start, pinned_len)
        super().__init__(
            pool=pool,
            batch_size=batch,
            cache_size=cache_size,
            num_heads=heads,
            head_dim=head_dim,
            dtype=k.dtype,
            device=k.device,
            sink_tokens=sink_tokens,
            attention_window_size=attention_window_size or None,
            global_sink_tokens=global_sink_tokens,
            allow_growth=allow_growth,
            use_int_indices=False,
            quant=quant,
            name=label,
        )
        self._view_cls = _sglang_view_cls()
        self._unwritten_fill = (_uniform_value(k), _uniform_value(v))
        self._cursor_tensors = (g_t, l_t)  # SGLang's own tensors (any integer dtype), kept current
        self.global_end_index_int, self.local_end_index_int = g_int, l_int
        # Inconsistent cursors (e.g. a local end past cache_size) are kept as given, as the dense dataclass keeps
        # them; they must be reset (reset_indices) before the cache is used.
        self._stale: tuple[int, int] | None = None
        try:
            if g0 or l0 or pinned_start >= 0:
                if l0 > self.cache_size:
                    self._stale = (g0, l0)
                else:
                    self._adopt(g0, l0, pinned_start, pinned_len)
        except BaseException:
            self.close()
            raise

    def _check_fresh(self, what: str) -> None:
        if self._stale is not None:
            g, local = self._stale
            raise CacheConfigError(
                f"{self.debug_name}: {what}: the cache was constructed with global_end_index={g}, local_end_index="
                f"{local}, which no state of a cache of cache_size={self.cache_size} has (valid: 0 <= local <= "
                f"min(global, cache_size)); call reset_indices() first"
            )

    @property
    def global_end_index(self) -> torch.Tensor:
        """The constructor's `global_end_index` tensor (the same object), kept current."""
        return self._cursor_tensors[0]

    @property
    def local_end_index(self) -> torch.Tensor:
        """The constructor's `local_end_index` tensor (the same object), kept current."""
        return self._cursor_tensors[1]

    def _before_call(self, what: str) -> None:
        """Extension point of the base: refuse every call (`what`) until a cache constructed with impossible
        cursors is reset."""
        self._check_fresh(what)

    def _on_cursors_changed(self, global_end: int, local_end: int) -> None:
        """Extension point of the base: both cursor forms, as the dense cache: the ints always, the tensors whenever
        a cursor changed."""
        if (self.global_end_index_int, self.local_end_index_int) == (global_end, local_end):
            return
        self.global_end_index_int, self.local_end_index_int = global_end, local_end
        self._cursor_tensors[0].fill_(global_end)
        self._cursor_tensors[1].fill_(local_end)

    def reset_indices(self) -> None:
        """Empty the cache as the dense one does: cursors 0 (both forms, the same tensors), unpinned, every page
        back to the pool; a grown cache_size stays."""
        self._stale = None
        super().reset_indices()
        self._cursor_tensors[0].zero_()
        self._cursor_tensors[1].zero_()
        if self.global_end_index_int is not None:
            self.global_end_index_int = 0
        if self.local_end_index_int is not None:
            self.local_end_index_int = 0


_FLAG_OF_FIELD = {field: "--" + key.replace("_", "-") for key, field in SGLANG_KEYS.items()}


def quant_config_from_sglang(quant_args: Any, head_dim: int) -> QuantConfig | None:
    """SGLang's `QVGKVQuantArgs` (or any object with its fields, or a dict of `--kv-cache-quant*` flags) as a
    `QuantConfig` for heads of `head_dim` channels; None when quantization is off.

    A `block_size` larger than `head_dim` means one scale per token-head, as SGLang's QVG cache accepts it: it
    maps to `block_size=head_dim`. Other settings pagedqvg cannot pack raise `CacheConfigError` naming the flag.
    """
    if isinstance(quant_args, QuantConfig):
        cfg = quant_args
    elif quant_args is None:
        return None
    else:
        if isinstance(quant_args, dict):
            try:
                cfg = QuantConfig.from_dict(quant_args)
            except ValueError as exc:
                raise CacheConfigError(f"quant_args: {exc}") from None
        else:
            names = (
                "bits",
                "centroids",
                "block_size",
                "stages",
                "kmeans_iters",
                "asymmetric",
                "keep_recent_chunks",
                "sink",
                "sink_keep_chunks",
            )
            missing = [n for n in names if not hasattr(quant_args, n)]
            if missing:
                raise CacheConfigError(
                    f"quant_args ({type(quant_args).__name__}) lacks {missing}; pass SGLang's QVGKVQuantArgs, a "
                    f"pagedqvg.QuantConfig or a dict of --kv-cache-quant* flags"
                )
            values = {n: getattr(quant_args, n) for n in names}
            for n in ("sink_format", "recent_format"):  # pagedqvg's tier formats, when the object carries them
                if getattr(quant_args, n, None) is not None:
                    values[n] = getattr(quant_args, n)
            for n in ("asymmetric", "sink"):
                if isinstance(values[n], int) and values[n] in (0, 1):
                    values[n] = bool(values[n])
            try:
                cfg = QuantConfig(**values)
            except ValueError as exc:
                raise CacheConfigError(f"quant_args: {_with_flags(str(exc))}") from None
    if not cfg.enabled:
        return None
    if isinstance(head_dim, int) and cfg.block_size > head_dim > 0:
        from dataclasses import replace

        cfg = replace(cfg, block_size=head_dim)
    try:
        return cfg.validate(head_dim=head_dim)
    except ValueError as exc:
        raise CacheConfigError(f"quant_args: {_with_flags(str(exc))}") from None


def _with_flags(message: str) -> str:
    """Name SGLang's flag beside each QuantConfig field a message mentions."""
    for field, flag in _FLAG_OF_FIELD.items():
        message = message.replace(f"QuantConfig.{field}=", f"{flag} (QuantConfig.{field})=")
    if "head_dim=" in message and "bits=" in message:
        message += f" ({_FLAG_OF_FIELD['bits']} picks bits)"
    return message


class PagedQVGPackedCausalKVCache(_SGLangSurface):
    """SGLang 0.5.23's `QVGPackedCausalKVCache` (same keyword-only constructor) over pagedqvg's pool: PRQ packing
    in pool pages with the dense cache's exact contract, where SGLang's class supports only the LingBot path.

    Args (SGLang's): batch_size, cache_size (slots), num_heads, head_dim, dtype, device, global_end_index and
        local_end_index (1-element int64 tensors starting at 0; with `use_int_indices` only the host ints
        `global_end_index_int` / `local_end_index_int` are written, else only the tensors — as SGLang's class),
        use_int_indices, sink_tokens, attention_window_size (None or 0: cache_size), quant_args (SGLang's
        `QVGKVQuantArgs`; see `quant_config_from_sglang`).
    Keyword-only extensions (SGLang's class refuses these features): global_sink_tokens, allow_growth, and
        pin_current_chunk works; pool (default `shared_pool(device)`), name.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        cache_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        global_end_index: torch.Tensor,
        local_end_index: torch.Tensor,
        use_int_indices: bool = False,
        sink_tokens: int = 0,
        attention_window_size: int | None = None,
        quant_args: Any,
        global_sink_tokens: int = 0,
        allow_growth: bool = False,
        pool: BlockPool | None = None,
        name: str | None = None,
    ) -> None:
        label = name or _next_name("sglang-qvg-layer")
        quant = quant_config_from_sglang(quant_args, head_dim)
        if pool is None:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError):
                raise CacheConfigError(f"{label}: unknown device {device!r}") from None
            token = 0
            if isinstance(dtype, torch.dtype) and all(isinstance(x, int) for x in (batch_size, num_heads, head_dim)):
                token = 2 * batch_size * num_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
            pool = shared_pool(dev, token_bytes=token)
        if attention_window_size == 0:
            attention_window_size = None
        super().__init__(
            pool=pool,
            batch_size=batch_size,
            cache_size=cache_size,
            num_heads=num_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            sink_tokens=sink_tokens,
            attention_window_size=attention_window_size,
            global_sink_tokens=global_sink_tokens,
            allow_growth=allow_growth,
            use_int_indices=use_int_indices,
            global_end_index=global_end_index,
            local_end_index=local_end_index,
            quant=quant,
            name=label,
        )
        self._view_cls = _sglang_view_cls()
        self.q = quant_args

    @property
    def num_heads(self) -> int:
        """Cache heads (SGLang's QVG attribute name; `num_cache_heads` is the same)."""
        return self.num_cache_heads

    def reset_indices(self) -> None:
        """Empty the cache (every page back to the pool); cursors 0 in both forms, as SGLang's QVG cache."""
        super().reset_indices()
        self.global_end_index.zero_()
        self.local_end_index.zero_()


# ------------------------------------------------------------------------------------------------ install
def _packed_caches(
    blocks: int,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: Any,
    use_int_indices: bool,
    quant_args: Any,
    policy: dict[str, Any],
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
            name=f"block{i}-{_next_name('')}",
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
            name=f"block{i}-{_next_name('')}",
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
    import inspect

    try:
        got = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        got = ()
    if got != ALLOCATE_PARAMS:
        raise IntegrationError(
            f"{getattr(fn, '__qualname__', fn)} has parameters {got}; pagedqvg supports SGLang 0.5.23's "
            f"{ALLOCATE_PARAMS}: install sglang==0.5.23 or a pagedqvg release for your SGLang"
        )


def _stage_quant(stage: Any) -> Any:
    """The quantization a stage's caches get: the plugin's (PAGEDQVG_KV_CACHE_QUANT*, a dict of SGLang flag names)
    when set, even to off, else the stage's `_kv_quant_args` (LingBot-World's --kv-cache-quant*); None = off."""
    quant = _config.get("quant")
    if quant is None:
        quant = getattr(stage, "_kv_quant_args", None)
    if quant is None:
        return None
    if isinstance(quant, dict):
        mode = str(quant.get("kv_cache_quant", "off")).strip().lower()
        return None if mode in ("off", "none", "bf16") else quant
    return quant if bool(getattr(quant, "enabled", False)) else None


def _check_allocation(stage: str, *sizes: object) -> None:
    """CacheConfigError naming the first allocation size (the stage's num_transformer_blocks, batch_size,
    kv_cache_size, num_attention_heads, attention_head_dim) that is not an int >= 1."""
    names = ("num_transformer_blocks", "batch_size", "kv_cache_size", "num_attention_heads", "attention_head_dim")
    wording = f"{stage}._allocate_causal_kv_cache: {{name}} must be an int >= 1, got {{value!r}}"
    for name, value in zip(names, sizes, strict=True):
        check_int(name, value, minimum=1, error=CacheConfigError, message=wording, type_message=wording)


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
    transformer block, packed (`PagedQVGPackedCausalKVCache`, any sink / global sink / growth / pin, which SGLang's
    QVG path refuses) when `_stage_quant(stage)` is on, else `PagedCausalSelfAttentionKVCache`. O(blocks)."""
    if attention_window_size is None:
        attention_window_size = kv_cache_size
    blocks = getattr(stage, "num_transformer_blocks", None)
    _check_allocation(type(stage).__name__, blocks, batch_size, kv_cache_size, num_attention_heads, attention_head_dim)
    quant_args = _stage_quant(stage)
    shape = (batch_size, kv_cache_size, num_attention_heads, attention_head_dim)
    policy = dict(
        sink_tokens=sink_tokens,
        global_sink_tokens=global_sink_tokens,
        attention_window_size=attention_window_size,
        allow_growth=allow_growth,
    )
    if quant_args is not None:
        caches = _packed_caches(blocks, shape, dtype, device, use_int_indices, quant_args, policy)
    else:
        caches = _dense_caches(blocks, shape, dtype, device, use_int_indices, policy)
    caches = _sessions.admit(stage, caches, allow_growth=allow_growth)  # one session: admitted, closed at request end
    for listener in list(_cache_listeners):
        listener(stage, caches)
    return caches


#: Called as listener(stage, caches) after every allocation (the plugin logs the first per process).
_cache_listeners: list[Any] = []


def allocate_around(original: Any, stage: Any, /, **kwargs: Any) -> list:
    """AROUND hook for `CausalDMDDenoisingStage._allocate_causal_kv_cache` (the base of LongLive2, causal Wan and
    LingBot-World): paged caches instead of SGLang's dense `torch.zeros` ones (the result differs, so the original
    is not called)."""
    check_allocate_signature(original)
    return build_paged_caches(stage, **kwargs)


def lingbot_allocate_around(original: Any, stage: Any, /, **kwargs: Any) -> list:
    """AROUND hook for `LingBotWorldCausalDMDDenoisingStage._allocate_causal_kv_cache`: packed paged caches when
    quantization is on; otherwise SGLang's original, which calls the base stage's (hooked: paged) allocation, so
    the result is the same."""
    check_allocate_signature(original)
    if _stage_quant(stage) is not None or getattr(getattr(stage, "_kv_quant_args", None), "enabled", False):
        return build_paged_caches(stage, **kwargs)  # on (packed), or the flags on and PAGEDQVG_KV_CACHE_QUANT=off
    return original(stage, **kwargs)


def _paged_allocate(original):
    """The stages' `_allocate_causal_kv_cache` for `install()`: `build_paged_caches` (paged, no dense buffers;
    LingBot's `_kv_quant_args` on: packed, with global sink and growth, which SGLang's QVG path refuses)."""

    def _allocate_causal_kv_cache(self, **kwargs) -> list:
        return build_paged_caches(self, **kwargs)

    _allocate_causal_kv_cache.__wrapped__ = original  # type: ignore[attr-defined]
    _allocate_causal_kv_cache.__doc__ = _paged_allocate.__doc__
    _allocate_causal_kv_cache._pagedqvg = True  # type: ignore[attr-defined]
    return _allocate_causal_kv_cache


def configure(*, memory_fraction: float | None = None, budget_bytes: int | None = None, quant: Any = None) -> None:
    """The pool policy (as `install()`'s) and the quantization override of every stage (`quant`: a dict of SGLang
    `--kv-cache-quant*` flag names, e.g. `{"kv_cache_quant": "int2"}`; None = each stage's own) without patching
    anything: for the entry-point plugin, whose SGLang hooks call `allocate_around`. Raises CacheConfigError as
    `install()`."""
    _check_install_args(None, memory_fraction, budget_bytes)
    with _lock:
        _config.update(pool=None, memory_fraction=memory_fraction, budget_bytes=budget_bytes, quant=quant)


def _check_install_args(pool: object, memory_fraction: object, budget_bytes: object) -> None:
    if pool is not None and not isinstance(pool, BlockPool):
        raise CacheConfigError(f"pool must be a pagedqvg.BlockPool or None, got {type(pool).__name__}")
    if memory_fraction is not None and budget_bytes is not None:
        raise CacheConfigError(
            f"give memory_fraction ({memory_fraction!r}) or budget_bytes ({budget_bytes!r}), not both"
        )
    if memory_fraction is not None and (
        isinstance(memory_fraction, bool)
        or not isinstance(memory_fraction, (int, float))
        or not 0 < memory_fraction <= 1
    ):
        raise CacheConfigError(f"memory_fraction must be a number in (0, 1], got {memory_fraction!r}")
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0
    ):
        raise CacheConfigError(f"budget_bytes must be an int > 0 (bytes), got {budget_bytes!r}")
    if pool is None and memory_fraction is None and budget_bytes is None:
        raise CacheConfigError(
            "install() needs pool=BlockPool(...), budget_bytes=N or memory_fraction=F (0 < F <= 1) for the shared pool"
        )


def _import_sglang() -> dict[str, Any]:
    """The SGLang modules install() needs (ImportError -> IntegrationError) and the optional binding modules."""
    modules: dict[str, Any] = {}
    for name in (KVCACHE_MODULE, QVG_MODULE, STAGE_MODULE):
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as exc:
            raise IntegrationError(
                f"SGLang's multimodal_gen is not importable ({name}: {exc}); install sglang==0.5.23 "
                f"(pip install 'sglang[diffusion]==0.5.23') to use pagedqvg.integrations.sglang"
            ) from exc
    for cls_module, cls_name in ((KVCACHE_MODULE, _CLASS_NAMES[0]), (QVG_MODULE, _CLASS_NAMES[1])):
        if not isinstance(getattr(modules[cls_module], cls_name, None), type):
            raise IntegrationError(f"{cls_module} has no class {cls_name}: not SGLang 0.5.23's layout")
    for name in BINDING_MODULES:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:  # a model module whose own dependencies are missing: it cannot build caches either
            continue
    return modules


def _patch(owner: Any, attr: str, new: Any, label: str, done: list[str]) -> None:
    _patches.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
    setattr(owner, attr, new)
    done.append(label)


def _patch_bindings(done: list[str]) -> None:
    """Bind our classes wherever a loaded SGLang module binds SGLang's originals (modules imported since the
    last call included)."""
    ours = {
        _CLASS_NAMES[0]: PagedCausalSelfAttentionKVCache,
        _CLASS_NAMES[1]: PagedQVGPackedCausalKVCache,
    }
    for mod_name, module in sorted(sys.modules.items()):
        if not mod_name.startswith("sglang.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            for cls_name, cls in ours.items():
                if value is _originals.get(cls_name) and value is not cls:
                    _patch(module, attr, cls, f"{mod_name}.{attr}", done)


def _patch_stages(modules: dict[str, Any], done: list[str]) -> None:
    """The stages' `_allocate_causal_kv_cache` (paged caches, one session per call), their `forward` (one request
    scope: sglang_sessions.forward_around) and the realtime state's `dispose` (sglang_sessions.dispose_before)."""
    stage_classes = [getattr(modules.get(m), name, None) for m, name in FORWARD_STAGES]
    for cls in stage_classes:
        if isinstance(cls, type) and "_allocate_causal_kv_cache" in cls.__dict__:
            original = cls.__dict__["_allocate_causal_kv_cache"]
            label = f"{cls.__module__}.{cls.__qualname__}._allocate_causal_kv_cache"
            _patch(cls, "_allocate_causal_kv_cache", _paged_allocate(original), label, done)
    for cls in stage_classes:
        if isinstance(cls, type) and "forward" in cls.__dict__:
            label = f"{cls.__module__}.{cls.__qualname__}.forward"
            _patch(cls, "forward", _scoped_forward(cls.__dict__["forward"]), label, done)
    state = getattr(modules.get(REALTIME_STATE_MODULE), "RealtimeCausalDiTState", None)
    if isinstance(state, type) and "dispose" in state.__dict__:
        _patch(state, "dispose", _disposing(state.__dict__["dispose"]), f"{REALTIME_STATE_MODULE}.dispose", done)


def _scoped_forward(original):
    """A stage's `forward` for `install()`: one request scope around SGLang's (sglang_sessions.forward_around)."""

    def forward(self, *args, **kwargs):
        return _sessions.forward_around(original, self, *args, **kwargs)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    forward.__doc__ = _scoped_forward.__doc__
    return forward


def _disposing(original):
    """`RealtimeCausalDiTState.dispose` for `install()`: the state's caches closed first (dispose_before)."""

    def dispose(self, *args, **kwargs):
        _sessions.dispose_before(self)
        return original(self, *args, **kwargs)

    dispose.__wrapped__ = original  # type: ignore[attr-defined]
    return dispose


def install(
    *,
    pool: BlockPool | None = None,
    memory_fraction: float | None = None,
    budget_bytes: int | None = None,
    attention: str = "view",
) -> list[str]:
    """Make SGLang build pagedqvg caches wherever it builds `CausalSelfAttentionKVCache` or
    `QVGPackedCausalKVCache`; every cache of a device shares one `BlockPool`.

    Args:
        pool: the `BlockPool` of its device (e.g. `BlockPool(capacity_bytes=24 << 30, device="cuda")`).
        memory_fraction: for devices without a given pool: size the pool, at the first cache, to this fraction
            (0, 1] of the device's free memory then.
        budget_bytes: instead of `memory_fraction`: the pool's size in bytes.
        At least one is required; `memory_fraction` and `budget_bytes` exclude each other.
        attention: `view` (SGLang attends over the materialized view) or `pages` (SGLang's causal self-attention
            computed from the pages; sglang_attention.py). The plugin passes `attention_mode_from_env()`.

    Returns:
        What was patched, as `module.attribute` strings (both classes in every SGLang module that binds them, and
        the stages' `_allocate_causal_kv_cache`). Idempotent: a second call patches only modules imported since
        (their names are added) and returns the whole list; the pool arguments of a second call replace the
        first's for devices that have no pool yet.

    Raises:
        CacheConfigError: bad arguments (nothing changes).
        IntegrationError: SGLang 0.5.23's multimodal_gen is not importable (nothing is patched).
    """
    _check_install_args(pool, memory_fraction, budget_bytes)
    mode = _attention.check_attention_mode(attention)
    with _lock:
        modules = _import_sglang()
        done: list[str] = []
        if not _patches:
            _originals[_CLASS_NAMES[0]] = getattr(modules[KVCACHE_MODULE], _CLASS_NAMES[0])
            _originals[_CLASS_NAMES[1]] = getattr(modules[QVG_MODULE], _CLASS_NAMES[1])
            _patch_stages(modules, done)
        _patch_bindings(done)
        if mode in _attention.DEFERRED_MODES:
            _attention.patch_attention(_patch, done)
        _attention.set_attention_mode(mode)
        _config.update(pool=pool, memory_fraction=memory_fraction, budget_bytes=budget_bytes)
        return installed()


def installed() -> list[str]:
    """What `install()` has patched (`module.attribute` strings, in patch order); empty when not installed."""
    with _lock:
        out = []
        for owner, attr, _ in _patches:
            prefix = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
            out.append(f"{prefix}.{attr}")
        return out


def uninstall() -> list[str]:
    """Undo `install()`: SGLang's classes and allocation back everywhere they were patched (and in SGLang
    modules imported since that bound pagedqvg's classes). Caches already built keep working and keep their
    pool; new ones are SGLang's. Forgets the pool policy and the shared pools. Returns what was restored."""
    with _lock:
        restored = installed()
        for owner, attr, original in reversed(_patches):
            setattr(owner, attr, original)
        back = {
            PagedCausalSelfAttentionKVCache: _originals.get(_CLASS_NAMES[0]),
            PagedQVGPackedCausalKVCache: _originals.get(_CLASS_NAMES[1]),
        }
        for mod_name, module in list(sys.modules.items()):
            if not mod_name.startswith("sglang.") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, type) and value in back and back[value] is not None:
                    setattr(module, attr, back[value])
                    restored.append(f"{mod_name}.{attr}")
        _patches.clear()
        _originals.clear()
        _pools.clear()
        _sessions.forget_managers()
        _config.update(pool=None, memory_fraction=None, budget_bytes=None, quant=None)
        _attention.set_attention_mode("view")
        return restored
