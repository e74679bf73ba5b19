"""pagedqvg inside SGLang 0.5.23's multimodal_gen: every causal self-attention KV cache SGLang builds becomes a
`PagedCausalKVCache` over one shared `BlockPool` per device.

Usage (before SGLang builds its pipeline stages)::

    from pagedqvg.integrations import sglang as pagedqvg_sglang
    pagedqvg_sglang.install(memory_fraction=0.5)   # or budget_bytes=24 << 30, or pool=BlockPool(...)

`install()` replaces SGLang's `CausalSelfAttentionKVCache` and `QVGPackedCausalKVCache` in every SGLang module that
binds them by `PagedCausalSelfAttentionKVCache` / `PagedQVGPackedCausalKVCache` (same constructor signatures,
caches.py), and wraps the stages' `_allocate_causal_kv_cache`, `forward` and the realtime state's `dispose` with the
hooks the entry-point plugin registers (allocation.py, sessions.py): what it patches comes from versions.py's table.
`uninstall()` puts SGLang's own back. `import pagedqvg` never imports SGLang; this module imports it only inside
`install()`. The state (pool policy, pools, patches) is the process's one `runtime.integration()` object.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.errors import CacheConfigError, IntegrationError
from pagedqvg.integrations.sglang import attention as _attention
from pagedqvg.integrations.sglang import sessions as _sessions
from pagedqvg.integrations.sglang.allocation import (
    ALLOCATE_PARAMS,
    allocate_around,
    build_paged_caches,
    check_allocate_signature,
    lingbot_allocate_around,
    stage_quant,
)
from pagedqvg.integrations.sglang.caches import (
    KVCACHE_MODULE,
    PagedCausalSelfAttentionKVCache,
    PagedQVGPackedCausalKVCache,
    quant_config_from_sglang,
)
from pagedqvg.integrations.sglang.runtime import PoolShape, SGLangIntegration, integration
from pagedqvg.integrations.sglang.versions import CURRENT, Target, targets_for
from pagedqvg.quant import QuantConfig

__all__ = [
    "ALLOCATE_PARAMS",
    "KVCACHE_MODULE",
    "PagedCausalSelfAttentionKVCache",
    "PagedQVGPackedCausalKVCache",
    "PoolShape",
    "SGLangIntegration",
    "allocate_around",
    "build_paged_caches",
    "check_allocate_signature",
    "configure",
    "install",
    "installed",
    "integration",
    "lingbot_allocate_around",
    "quant_config_from_sglang",
    "shared_pool",
    "stage_quant",
    "uninstall",
]

#: The cache classes' targets: SGLang's classes pagedqvg's replace (by name), and pagedqvg's replacement of each.
CACHE_CLASSES = targets_for(CURRENT, "cache_class")
_OURS = {
    "CausalSelfAttentionKVCache": PagedCausalSelfAttentionKVCache,
    "QVGPackedCausalKVCache": PagedQVGPackedCausalKVCache,
}
#: Modules install() imports (when importable) so that their bindings are patched too (versions.py, kind binding).
BINDING_MODULES = tuple(t.module for t in targets_for(CURRENT, "binding"))
#: The module that must import for install() to work (the base causal stage).
STAGE_MODULE = targets_for(CURRENT, "allocate")[0].module


def shared_pool(device: torch.device | str, *, token_bytes: int = 0, shape: PoolShape | None = None) -> BlockPool:
    """The one `BlockPool` of `device` every integrated cache shares (`SGLangIntegration.shared_pool`): the pool
    given to `install()` for its device, else one made at the first cache from `budget_bytes` or `memory_fraction`;
    a stage allocation makes it at the planner's page for its shapes (`shape`), a cache built directly 1 MiB pages
    (or the next 256-byte multiple holding one token of `token_bytes` bytes).

    Raises:
        CacheConfigError: neither a pool for this device nor a budget or fraction was given to `install()`, or the
            budget / fraction is below one page.
    """
    return integration().shared_pool(device, shape=shape, token_bytes=token_bytes)


def configure(
    *, memory_fraction: float | None = None, budget_bytes: int | None = None, quant: QuantConfig | None = None,
    quant_override: bool = False, host_budget_bytes: int | None = None,
) -> None:  # fmt: skip
    """The pool policy (as `install()`'s, `host_budget_bytes` included) and, with `quant_override`, the quantization
    every stage gets (`quant`, a parsed `QuantConfig`; None or disabled: off) instead of its own, without patching
    anything: for the entry-point plugin, whose SGLang hooks call `allocate_around`. Raises CacheConfigError as
    `install()`."""
    _check_install_args(None, memory_fraction, budget_bytes, host_budget_bytes)
    if quant is not None and not isinstance(quant, QuantConfig):
        raise CacheConfigError(f"quant must be a pagedqvg.QuantConfig or None, got {type(quant).__name__}")
    integration().configure(
        memory_fraction=memory_fraction, budget_bytes=budget_bytes, quant=quant, quant_override=quant_override,
        host_budget_bytes=host_budget_bytes,
    )  # fmt: skip


def _check_install_args(pool: object, memory_fraction: object, budget_bytes: object, host_budget: object) -> None:
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
    if host_budget is not None and (type(host_budget) is not int or host_budget < 0):
        raise CacheConfigError(
            f"host_budget_bytes must be None or an int >= 0 (bytes of the host tier, 0: none), got {host_budget!r}"
        )
    if pool is None and memory_fraction is None and budget_bytes is None:
        raise CacheConfigError(
            "install() needs pool=BlockPool(...), budget_bytes=N or memory_fraction=F (0 < F <= 1) for the shared pool"
        )


def _import_sglang() -> dict[str, Any]:
    """The SGLang modules install() needs (ImportError -> IntegrationError) and the optional binding modules."""
    modules: dict[str, Any] = {}
    for name in (*(t.module for t in CACHE_CLASSES), STAGE_MODULE):
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as exc:
            raise IntegrationError(
                f"SGLang's multimodal_gen is not importable ({name}: {exc}); install sglang=={CURRENT} "
                f"(pip install 'sglang[diffusion]=={CURRENT}') to use pagedqvg.integrations.sglang"
            ) from exc
    for t in CACHE_CLASSES:
        if not isinstance(getattr(modules[t.module], t.qualname, None), type):
            raise IntegrationError(f"{t.module} has no class {t.qualname}: not SGLang {CURRENT}'s layout")
    for name in BINDING_MODULES:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:  # a model module whose own dependencies are missing: it cannot build caches either
            continue
    return modules


def _patch(owner: Any, attr: str, new: Any, label: str, done: list[str]) -> None:
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    integration().patches.append((owner, attr, original))
    setattr(owner, attr, new)
    done.append(label)


def _patch_bindings(done: list[str]) -> None:
    """Bind our classes wherever a loaded SGLang module binds SGLang's originals (modules imported since the
    last call included)."""
    originals = integration().originals
    for mod_name, module in sorted(sys.modules.items()):
        if not mod_name.startswith("sglang.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            for cls_name, cls in _OURS.items():
                if value is originals.get(cls_name) and value is not cls:
                    _patch(module, attr, cls, f"{mod_name}.{attr}", done)


#: The hook each method kind of versions.py's table gets, and whether it runs AROUND (else BEFORE) the original.
HOOKS: dict[str, tuple[Any, bool]] = {
    "allocate": (allocate_around, True),
    "allocate_lingbot": (lingbot_allocate_around, True),
    "forward": (_sessions.forward_around, True),
    "dispose": (_sessions.dispose_before, False),
}


def _wrapped(target: Target, original: Any) -> Any:
    """`original` with its hook applied as SGLang's `plugin_hook` applies it (AROUND: hook(original, self, ...);
    BEFORE: hook(self, ...) then original)."""
    hook, around = HOOKS[target.kind]
    if around:

        def method(self, *args, **kwargs):
            return hook(original, self, *args, **kwargs)
    else:

        def method(self, *args, **kwargs):
            hook(self, *args, **kwargs)
            return original(self, *args, **kwargs)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    method.__name__, method.__qualname__ = target.attribute, target.qualname
    method.__doc__ = f"pagedqvg ({target.kind}): {target.why}. SGLang's own: __wrapped__."
    method._pagedqvg = True  # type: ignore[attr-defined]
    return method


def _patch_stages(modules: dict[str, Any], done: list[str]) -> None:
    """Every method target of versions.py's table with a hook (`HOOKS`) whose class is loaded and defines it."""
    for target in targets_for(CURRENT, *HOOKS):
        cls = getattr(modules.get(target.module) or sys.modules.get(target.module), target.owner, None)
        if isinstance(cls, type) and target.attribute in cls.__dict__:
            original = cls.__dict__[target.attribute]
            _patch(cls, target.attribute, _wrapped(target, original), target.path, done)


def install(
    *,
    pool: BlockPool | None = None,
    memory_fraction: float | None = None,
    budget_bytes: int | None = None,
    attention: str = "view",
    host_budget_bytes: int | None = None,
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
        host_budget_bytes: a host tier per device pool (PAGEDQVG_HOST_BUDGET): a CPU pool of this many bytes at the
            pool's page, made with the pool; when a session does not fit, idle sessions (realtime sessions between
            chunk calls) are swapped out there and come back at their next call (None or 0: no host tier).

    Returns:
        What was patched, as `module.attribute` strings (both classes in every SGLang module that binds them, and
        the stages' `_allocate_causal_kv_cache`). Idempotent: a second call patches only modules imported since
        (their names are added) and returns the whole list; the pool arguments of a second call replace the
        first's for devices that have no pool yet.

    Raises:
        CacheConfigError: bad arguments (nothing changes).
        IntegrationError: SGLang 0.5.23's multimodal_gen is not importable (nothing is patched).
    """
    _check_install_args(pool, memory_fraction, budget_bytes, host_budget_bytes)
    mode = _attention.check_attention_mode(attention)
    integ = integration()
    with integ.lock:
        modules = _import_sglang()
        done: list[str] = []
        if not integ.patches:
            for t in CACHE_CLASSES:
                integ.originals[t.qualname] = getattr(modules[t.module], t.qualname)
            _patch_stages(modules, done)
        _patch_bindings(done)
        if mode in _attention.DEFERRED_MODES:
            _attention.patch_attention(_patch, done)
        _attention.set_attention_mode(mode)
        integ.configure(
            pool=pool, memory_fraction=memory_fraction, budget_bytes=budget_bytes, host_budget_bytes=host_budget_bytes
        )
        return installed()


def installed() -> list[str]:
    """What `install()` has patched (`module.attribute` strings, in patch order); empty when not installed."""
    integ = integration()
    with integ.lock:
        out = []
        for owner, attr, _ in integ.patches:
            prefix = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
            out.append(f"{prefix}.{attr}")
        return out


def uninstall() -> list[str]:
    """Undo `install()`: SGLang's classes and allocation back everywhere they were patched (and in SGLang
    modules imported since that bound pagedqvg's classes). Caches already built keep working and keep their
    pool; new ones are SGLang's. Forgets the pool policy and the shared pools. Returns what was restored."""
    integ = integration()
    with integ.lock:
        restored = installed()
        for owner, attr, original in reversed(integ.patches):
            setattr(owner, attr, original)
        back = {ours: integ.originals.get(name) for name, ours in _OURS.items()}
        for mod_name, module in list(sys.modules.items()):
            if not mod_name.startswith("sglang.") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, type) and value in back and back[value] is not None:
                    setattr(module, attr, back[value])
                    restored.append(f"{mod_name}.{attr}")
        integ.reset()
        return restored
