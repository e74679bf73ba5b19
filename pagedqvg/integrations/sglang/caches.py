"""pagedqvg's SGLang 0.5.23 cache classes: `PagedCausalSelfAttentionKVCache` (SGLang's `CausalSelfAttentionKVCache`)
and `PagedQVGPackedCausalKVCache` (its `QVGPackedCausalKVCache`), same constructors, over the process's shared pool
(`runtime.integration().shared_pool`).

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

import sys
from typing import Any

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.cache.paged_cache import PagedCausalKVCache
from pagedqvg.errors import CacheConfigError
from pagedqvg.integrations.sglang import attention as _attention
from pagedqvg.integrations.sglang.runtime import integration
from pagedqvg.integrations.sglang.versions import CURRENT, targets_for
from pagedqvg.quant import QuantConfig
from pagedqvg.quant.config import SGLANG_KEYS
from pagedqvg.validation import SUPPORTED_DTYPES
from pagedqvg.view import CausalAttentionKVView

__all__ = ["PagedCausalSelfAttentionKVCache", "PagedQVGPackedCausalKVCache", "quant_config_from_sglang"]

#: The module of SGLang's dense cache class (and its `CausalAttentionKVView`).
KVCACHE_MODULE = targets_for(CURRENT, "cache_class")[0].module


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
        if _attention.defers_view(self):  # attention.py: the view deferred (pages, heads; auto where allowlisted)
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
        label = name or integration().next_name("sglang-layer")
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
            pool = integration().shared_pool(k.device, token_bytes=2 * batch * heads * head_dim * k.element_size())
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
        label = name or integration().next_name("sglang-qvg-layer")
        quant = quant_config_from_sglang(quant_args, head_dim)
        if pool is None:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError):
                raise CacheConfigError(f"{label}: unknown device {device!r}") from None
            token = 0
            if isinstance(dtype, torch.dtype) and all(isinstance(x, int) for x in (batch_size, num_heads, head_dim)):
                token = 2 * batch_size * num_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
            pool = integration().shared_pool(dev, token_bytes=token)
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


# The public module users import them from (integration.py re-exports them; repr, pickling and the checks of
# tests/sglang_*.py and benchmarks name it).
PagedCausalSelfAttentionKVCache.__module__ = PagedQVGPackedCausalKVCache.__module__ = (
    "pagedqvg.integrations.sglang.integration"
)
