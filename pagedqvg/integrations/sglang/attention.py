"""SGLang attention mode `pages`: causal self-attention computed straight from pages (`update_and_attend`'s path),
with SGLang's model code unchanged.

How: in mode `pages` the SGLang cache classes' `update_and_get_attention_kv` writes as always but returns a view
whose `k` / `v` are `PagesKV` tensors: shape, dtype and device of the view's tensors, no storage. SGLang's causal
self-attentions (CausalWan, LongLive2, LingBot-World; Ulysses included: its all-to-all runs before the cache, and the
head slice is the cache's `cache_head_start`) pass them straight to a `LocalAttention`; `install` wraps
`LocalAttention.forward` so that a `(PagesKV k, PagesKV v)` pair of one view, no mask, attends from the pages
(`attention.attend_pages`, scale `LocalAttention.softmax_scale`). Any other use of `view.k` / `view.v` (slicing,
`torch.stack`, an all-gather input, ...) materializes the view once (the exact tensors mode `view` returns) through
`__torch_dispatch__`. A pending view is valid until its cache's next call; using it later raises IntegrationError.

Modes `heads` and `auto` (the default) defer the view the same way; the wrapper then calls SGLang's forward per head
group, or (auto, a backend not on the allowlist) once over the built view: head_groups.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from pagedqvg.errors import CacheConfigError, IntegrationError
from pagedqvg.integrations.sglang.head_groups import auto_attention, heads_attention, heads_may_default, say_default
from pagedqvg.integrations.sglang.runtime import integration
from pagedqvg.integrations.sglang.versions import CURRENT, targets_for

#: The environment variable the plugin reads (`attention_mode_from_env`).
ATTENTION_ENV = "PAGEDQVG_ATTENTION"
#: Valid modes: `view` (SGLang attends over the materialized view), `pages`, `heads` (SGLang's forward per head
#: group over that group's view: head_groups.py) and `auto` (`PAGEDQVG_ATTENTION` unset: per call `heads` where its
#: backend, device type and torch version are on head_groups.HEADS_DEFAULT_ALLOWLIST, else `view`).
ATTENTION_MODES = ("view", "pages", "heads", "auto")
#: The modes whose `LocalAttention.forward` is wrapped and whose cache calls defer the view (`pages_view`; `auto`
#: only where `heads_may_default`: `defers_view`).
DEFERRED_MODES = ("pages", "heads", "auto")
#: SGLang's `LocalAttention.forward` (the attention every causal self-attention calls): versions.py's table.
ATTENTION_TARGET = targets_for(CURRENT, "attention")[0]
ATTENTION_LAYER_MODULE = ATTENTION_TARGET.module


def check_attention_mode(mode: object, source: str = "attention") -> str:
    """`mode` if it is one of `ATTENTION_MODES`, else CacheConfigError naming `source`, the value and the forms."""
    if isinstance(mode, str) and mode.strip().lower() in ATTENTION_MODES:
        return mode.strip().lower()
    raise CacheConfigError(f"{source}={mode!r} is not an attention mode; valid: {' or '.join(ATTENTION_MODES)}")


def attention_mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    """`PAGEDQVG_ATTENTION` (`view`, `pages`, `heads` or `auto`, case-insensitive; unset or empty: `auto`, the
    default). A bad value raises CacheConfigError naming the variable, the value and the valid forms."""
    value = (os.environ if environ is None else environ).get(ATTENTION_ENV, "")
    return "auto" if value.strip() == "" else check_attention_mode(value, ATTENTION_ENV)


def attention_mode() -> str:
    """The mode in force (`view` until `set_attention_mode` / `install(attention=...)`; the integration's)."""
    return integration().attention_mode


def set_attention_mode(mode: str) -> str:
    """Set the mode for every SGLang cache call from now on; returns the previous one."""
    integ = integration()
    before, integ.attention_mode = integ.attention_mode, check_attention_mode(mode)
    return before


def defers_view(cache: Any) -> bool:
    """Whether `cache`'s call in the mode in force defers its view (`pages_view`): always in `pages` and `heads`;
    in `auto` where some allowlist entry is for the cache's device type and the running torch (else the call is
    mode `view`'s, and the reason is logged once). O(allowlist)."""
    mode = integration().attention_mode
    if mode != "auto":
        return mode in DEFERRED_MODES
    device = cache.device.type
    if heads_may_default(device, torch.__version__):
        return True
    say_default("view", f"no heads allowlist entry is for {device}, torch {torch.__version__}")
    return False


class PendingPages:
    """One pages-mode call's view, not built: the cache's plan of the rows, materialized at most once."""

    def __init__(self, cache: Any, plan: Any, h0: int, hin: int, ls: int, le: int) -> None:
        self.cache, self.plan, self.h0, self.hin, self.ls, self.le = cache, plan, h0, hin, ls, le
        self.epoch = _epoch(cache)
        self.state = cache._seq.state
        self.mode = attention_mode()  # "pages", "heads" or "auto": how the LocalAttention wrapper attends
        self.view: Any = None

    def _check_current(self, what: str) -> None:
        if _epoch(self.cache) != self.epoch or self.cache._seq.state is not self.state:
            raise IntegrationError(
                f"{self.cache.debug_name}: {what} of a pages-mode view after its cache's next call (the pages it "
                f"planned may have changed); use view.k / view.v before the cache's next call"
            )

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The view's `(k, v)`, exactly as mode `view` returns them (built on first use, O(window) copy)."""
        if self.view is None:
            self._check_current("view.k / view.v")
            self.view = self.cache._finish_view(self.plan, self.h0, self.hin, self.ls, self.le)
        return self.view.k, self.view.v

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """`softmax(query·kᵀ·scale)·v` over the view's rows from the pages (or the built view, if already built),
        `[B, Tq, Hin, D]` in `query`'s dtype; `query` is cast to the cache dtype as SGLang's dense path computes."""
        from pagedqvg.attention.pages import attend_pages, check_query

        q = query.to(self.cache.dtype)
        if self.view is not None:
            k, v = self.view.k, self.view.v
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
            )
            return out.transpose(1, 2).to(query.dtype)
        self._check_current("attention")
        key_like = torch.empty(q.shape[0], 0, self.hin, q.shape[3], dtype=q.dtype, device=q.device)
        scale = check_query(q, key_like, scale, self.cache.debug_name)
        return attend_pages(self.cache._io, self.plan, self.h0, q, scale).to(query.dtype)


class PagesKV(torch.Tensor):
    """`view.k` (which=0) or `view.v` (which=1) of a pages-mode view: metadata only; any torch op on it runs on the
    materialized view (`PendingPages.materialize`)."""

    pending: PendingPages
    which: int

    @staticmethod
    def __new__(cls, pending: PendingPages, which: int, shape: tuple[int, ...], dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t.pending, t.which = pending, which
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x.pending.materialize()[x.which] if isinstance(x, PagesKV) else x

        return func(*tree_map(real, args), **tree_map(real, kwargs or {}))

    def __repr__(self) -> str:  # printing would otherwise go through the dispatch of a storage-less tensor
        return f"PagesKV({'kv'[self.which]}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _epoch(cache: Any) -> int:
    return cache.__dict__.get("_pagedqvg_pages_epoch", 0)


def pages_view(cache: Any, key, value, current_chunk_start, cache_head_start, recent_window_tokens, debug_name):
    """Mode `pages` of an SGLang cache's `update_and_get_attention_kv` (its arguments already cast to the cache
    dtype): the write now (same errors, nothing changed on error), the view deferred (`PagesKV` tensors)."""
    cache.__dict__["_pagedqvg_pages_epoch"] = _epoch(cache) + 1
    own = cache.debug_name
    if debug_name is not None and debug_name != own:
        cache.debug_name = f"{debug_name} ({own})"
    try:
        with torch.no_grad():  # writes into the pool must not join an autograd graph
            plan, h0, hin, ls, le = cache._transactional(  # a failed write is rolled back whole, as the view's
                lambda: cache._write_and_plan(key, value, current_chunk_start, cache_head_start, recent_window_tokens)
            )
    finally:
        cache.debug_name = own
    pending = PendingPages(cache, plan, h0, hin, ls, le)
    shape = (cache.batch_size, plan.tokens, hin, cache.head_dim)
    k = PagesKV(pending, 0, shape, cache.dtype, cache.device)
    v = PagesKV(pending, 1, shape, cache.dtype, cache.device)
    st = cache._seq.state
    return cache._view_cls(k, v, ls, le, st.local_end, st.global_end)


def _pages_forward(original):
    def forward(self, q, k, v, attn_mask=None):
        if _is_pages_pair(q, k, v, attn_mask):
            return _attend_pair(original, self, q, k)
        return original(self, q, k, v, attn_mask)

    forward.__wrapped__ = original
    forward.__pagedqvg_pages__ = True
    return forward


def _is_pages_pair(q: Any, k: Any, v: Any, attn_mask: Any) -> bool:
    """Whether `LocalAttention(q, k, v, attn_mask)` is a pages-mode call: K and V of one pending view, no mask."""
    return (
        attn_mask is None
        and isinstance(k, PagesKV)
        and isinstance(v, PagesKV)
        and k.pending is v.pending
        and (k.which, v.which) == (0, 1)
        and not isinstance(q, PagesKV)
    )


def pages_attention_around(original: Any, layer: Any, q: Any, k: Any, v: Any, attn_mask: Any = None) -> Any:
    """AROUND hook (SGLang's `plugin_hook`, the entry-point plugin's way in) for `LocalAttention.forward`: attention
    from pages for a pages-mode view, SGLang's own forward otherwise."""
    if _is_pages_pair(q, k, v, attn_mask):
        return _attend_pair(original, layer, q, k)
    return original(layer, q, k, v, attn_mask)


def _attend_pair(original: Any, layer: Any, q: Any, k: Any) -> Any:
    """A pending view's attention: from pages (mode `pages`), SGLang's forward per head group (`heads`), or as the
    default decides for the layer's backend (`auto`: heads or view)."""
    mode = k.pending.mode
    if mode == "heads":
        return heads_attention(original, layer, q, k.pending)
    if mode == "auto":
        return auto_attention(original, layer, q, k.pending)
    return k.pending.attend(q, float(layer.softmax_scale))


def patch_attention(patch: Any, done: list[str]) -> None:
    """Wrap SGLang's `LocalAttention.forward` (once; `patch(owner, attr, new, label, done)` records it for
    uninstall). IntegrationError when SGLang's attention layer is not importable."""
    import importlib

    try:
        layer = importlib.import_module(ATTENTION_LAYER_MODULE)
    except ImportError as exc:
        raise IntegrationError(f"attention='pages' needs {ATTENTION_LAYER_MODULE} ({exc})") from exc
    owner, attr = ATTENTION_TARGET.owner, ATTENTION_TARGET.attribute
    cls = getattr(layer, owner, None)
    if not isinstance(cls, type) or attr not in cls.__dict__:
        raise IntegrationError(f"{ATTENTION_LAYER_MODULE} has no {owner}.{attr}: not SGLang {CURRENT}'s layout")
    if getattr(cls.__dict__[attr], "__pagedqvg_pages__", False):
        return
    patch(cls, attr, _pages_forward(cls.__dict__[attr]), ATTENTION_TARGET.path, done)
