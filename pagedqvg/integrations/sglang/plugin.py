"""SGLang 0.5.23 entry-point plugin: pagedqvg in every SGLang process, spawned workers included.

SGLang runs each pipeline in worker processes started with multiprocessing *spawn*; an `install()` call in the
launching script does not reach them. SGLang's own convention does: entry points of group
`sglang.multimodal_gen.plugins` run once per process in `load_plugins()` (workers, launcher, HTTP child,
`DiffGenerator`). pagedqvg's `pyproject.toml` declares `pagedqvg = "pagedqvg.integrations.sglang.plugin:register"`,
so installing pagedqvg into SGLang's environment is the whole installation.

Configuration (environment variables, inherited by spawned workers):
    PAGEDQVG_BUDGET            the pool of each rank: bytes (`25769803776`) or a size (`24GiB`, `512MiB`, `1.5GB`)
    PAGEDQVG_MEMORY_FRACTION   instead: a fraction in (0, 1] of the device's free memory at the worker's first cache
    PAGEDQVG_KV_CACHE_QUANT    off | int4 | int2 | compact: quantize every causal stage's caches (overrides
                               SGLang's --kv-cache-quant* for LingBot-World); unset: each stage's own setting
    PAGEDQVG_KV_CACHE_QUANT_<FLAG>  each of SGLang's --kv-cache-quant-<flag> (CENTROIDS, BLOCK_SIZE, STAGES, ITERS,
                               KEEP_RECENT, SINK_KEEP, ASYMMETRIC, SINK) and pagedqvg's (SEED, PACK_TRITS,
                               FIT_SCALES, CODEBOOK_FP8, RECENT)
    PAGEDQVG_KV_CACHE_QUANT_SINK    also the sink tier's format: bf16 (dense), fp8, int4, int2, compact; true = the
                               history's (PAGEDQVG_KV_CACHE_QUANT's, the default), false = dense
    PAGEDQVG_KV_CACHE_QUANT_RECENT  the recent tier's format (the KEEP_RECENT newest completed chunks): bf16 (dense,
                               the default), fp8, int4, int2, compact, no coarser than the history's
    PAGEDQVG_ATTENTION         view (default) | pages: SGLang's causal self-attention computes attention straight
                               from the pool's pages (`update_and_attend`) instead of over a materialized view |
                               heads: SGLang's own attention per group of heads over that group's view
    PAGEDQVG_ATTENTION_HEAD_GROUPS  mode heads: heads per group (an int >= 1); unset or auto: the cost model
    PAGEDQVG=off               disable (the plugin registers nothing)
pagedqvg is active only with a budget variable (a pool sized without the user's say could take memory SGLang's
activations need); without one each process logs how to turn it on. Any bad value stops the process with
`SystemExit` naming the variable, the value and the valid forms (SGLang logs and ignores a plugin's `Exception`,
which would fall back silently to SGLang's caches; `SystemExit` is not an `Exception`).

Registration only (as `load_plugins()` documents): `register()` parses the variables and registers AROUND hooks
with SGLang's `plugin_hook` on the stages' `_allocate_causal_kv_cache` and `forward` (each allocation's caches one
session of the pool, closed when the request's forward returns or raises: sglang_sessions.py) and a BEFORE hook on the
realtime state's `dispose`; SGLang's `apply_plugin_hooks()` applies them (and re-points every module bound to the
originals). The pool is built on each worker's device at its first
cache, so every rank of a multi-GPU run has its own pool of the given budget.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedqvg.allocator import DEFAULT_PAGE_BYTES
from pagedqvg.errors import CacheConfigError, IntegrationError

__all__ = [
    "ENV_ATTENTION",
    "ENV_BUDGET",
    "ENV_FRACTION",
    "ENV_QUANT",
    "ENV_QUANT_RECENT",
    "ENV_QUANT_SINK",
    "ENV_SWITCH",
    "PluginSettings",
    "register",
    "settings_from_env",
]

ENV_SWITCH = "PAGEDQVG"
ENV_BUDGET = "PAGEDQVG_BUDGET"
ENV_FRACTION = "PAGEDQVG_MEMORY_FRACTION"
ENV_QUANT = "PAGEDQVG_KV_CACHE_QUANT"
ENV_QUANT_SINK = "PAGEDQVG_KV_CACHE_QUANT_SINK"
ENV_QUANT_RECENT = "PAGEDQVG_KV_CACHE_QUANT_RECENT"
ENV_ATTENTION = "PAGEDQVG_ATTENTION"
SGLANG_VERSION = "0.5.23"
_STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages"
HOOK_TARGETS = (
    f"{_STAGES}.causal_denoising.CausalDMDDenoisingStage._allocate_causal_kv_cache",
    f"{_STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising."
    "LingBotWorldCausalDMDDenoisingStage._allocate_causal_kv_cache",
)
#: Request end and realtime release (sglang_sessions): AROUND hooks on the causal stages' forward, a BEFORE hook
#: on the realtime state's dispose; each allocation's caches are a session closed there.
FORWARD_TARGETS = (
    f"{_STAGES}.causal_denoising.CausalDMDDenoisingStage.forward",
    f"{_STAGES}.model_specific_stages.longlive2.LongLive2CausalDenoisingStage.forward",
    f"{_STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising."
    "LingBotWorldCausalDMDDenoisingStage.forward",
)
DISPOSE_TARGET = "sglang.multimodal_gen.runtime.realtime.states.causal.RealtimeCausalDiTState.dispose"
#: The attention layer every causal self-attention of SGLang 0.5.23 calls with the view's K and V (pages mode).
ATTENTION_TARGET = "sglang.multimodal_gen.runtime.layers.attention.layer.LocalAttention.forward"
#: Resolved from its module after hook application in every SGLang worker (worker_bootstrap.py).
WORKER_TARGET = "sglang.multimodal_gen.runtime.managers.gpu_worker.run_scheduler_process"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_SIZE_FORMS = "bytes (e.g. 25769803776) or a number with a unit B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 24GiB)"
_OFF, _ON = ("off", "0", "false", "no"), ("on", "1", "true", "yes", "")
_log = logging.getLogger("pagedqvg.sglang")


class PluginConfigError(IntegrationError):
    """A PAGEDQVG* environment variable has a bad value (the message names it, the value and the valid forms)."""


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's configuration from the environment. `active` False: `reason` says why and how to enable."""

    active: bool
    reason: str = ""
    budget_bytes: int | None = None
    memory_fraction: float | None = None
    quant: dict[str, str] | None = None  # SGLang flag names (kv_cache_quant, kv_cache_quant_centroids, ...)
    given: dict[str, str] = field(default_factory=dict)
    attention: str = "view"  # PAGEDQVG_ATTENTION: "view", "pages" or "heads"

    def describe(self) -> str:
        """One line: the budget per rank and the quantization."""
        size = f"budget {self.budget_bytes} bytes" if self.budget_bytes else f"{self.memory_fraction} of free memory"
        quant = (
            " ".join(f"{k}={v}" for k, v in self.quant.items()) if self.quant else "each stage's own (dense unless "
            "LingBot-World's --kv-cache-quant)"
        )
        if self.quant:
            from pagedqvg.quant import QuantConfig

            cfg = QuantConfig.from_dict(self.quant)
            if cfg.tiered:
                quant += " (tiers: " + ", ".join(f"{t} {cfg.tier_format(t)}" for t in ("sink", "recent", "history"))
                quant += ")"
        return f"pool per rank on its device at the first cache, {size}; quantization: {quant}; attention: " + (
            "from pages (PAGEDQVG_ATTENTION=pages)" if self.attention == "pages"
            else "by head groups (PAGEDQVG_ATTENTION=heads)" if self.attention == "heads" else "over the view"
        )  # fmt: skip


def parse_size(variable: str, raw: str) -> int:
    """Bytes of a size string (`24GiB`, `512 MiB`, `1.5GB`, `1048576`); PluginConfigError naming `variable`."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", raw)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise PluginConfigError(f"{variable}={raw!r} is not a size; valid: {_SIZE_FORMS}")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or (value != int(value) and unit in ("", "b")):
        raise PluginConfigError(f"{variable}={raw!r} is not a whole number of bytes; valid: {_SIZE_FORMS}")
    size = int(value)
    if size < DEFAULT_PAGE_BYTES:
        raise PluginConfigError(
            f"{variable}={raw!r} is {size} bytes, below one page ({DEFAULT_PAGE_BYTES} bytes = 1MiB); valid: "
            f"at least 1MiB, as {_SIZE_FORMS}"
        )
    return size


def parse_fraction(variable: str, raw: str) -> float:
    """A fraction in (0, 1]; PluginConfigError naming `variable` otherwise."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise PluginConfigError(f"{variable}={raw!r}: valid is a number in (0, 1], e.g. 0.5")
    return value


def parse_quant(env: Mapping[str, str]) -> dict[str, str] | None:
    """The PAGEDQVG_KV_CACHE_QUANT* variables as SGLang flag names (validated by `QuantConfig.from_dict`, each
    variable alone so the error names it: the base first, the tier variables last, since their checks involve the
    others); None when none is set."""
    from pagedqvg.quant import QuantConfig

    given = {k: v for k, v in env.items() if k == ENV_QUANT or k.startswith(ENV_QUANT + "_")}
    if not given:
        return None
    if ENV_QUANT not in given:
        names = ", ".join(f"{k}={v!r}" for k, v in sorted(given.items()))
        raise PluginConfigError(f"{names} set without {ENV_QUANT}; valid: also set {ENV_QUANT}=int4|int2|compact")
    quant = {"kv_cache_quant": given[ENV_QUANT]}
    for variable in sorted(given, key=lambda k: (k != ENV_QUANT, k in _TIER_FORMS, k)):
        key = variable[len("PAGEDQVG_") :].lower()
        try:
            QuantConfig.from_dict({**({} if key == "kv_cache_quant" else quant), key: given[variable]})
        except ValueError as exc:
            raise PluginConfigError(_quant_error(variable, given, str(exc))) from None
        quant[key] = given[variable]
    return quant


#: The tier variables and their valid forms (PAGEDQVG_KV_CACHE_QUANT_SINK is also SGLang's --kv-cache-quant-sink).
_TIER_FORMS = {
    ENV_QUANT_SINK: "a tier format bf16 (dense), fp8, int4, int2, compact, or a boolean: true (the history's format) "
    "/ false (dense)",
    ENV_QUANT_RECENT: "a tier format bf16 (dense, the default), fp8, int4, int2, compact, no coarser than "
    f"{ENV_QUANT}'s (bf16 > fp8 > int4 > int2 = compact)",
}


def _quant_error(variable: str, given: Mapping[str, str], reason: str) -> str:
    """The message of a PAGEDQVG_KV_CACHE_QUANT* variable `QuantConfig.from_dict` refused: the variable, its value,
    the reason (naming what is allowed); a tier variable's also names the other variables it was checked with."""
    from pagedqvg.quant import QuantConfig

    if variable in _TIER_FORMS:
        others = ", ".join(f"{k}={v!r}" for k, v in sorted(given.items()) if k != variable)
        return f"{variable}={given[variable]!r} (with {others}): {reason}; valid: {_TIER_FORMS[variable]}"
    flags = ", ".join("PAGEDQVG_" + k.upper() for k in QuantConfig.known_keys() if k.startswith("kv_"))
    return f"{variable}={given[variable]!r}: {reason}; valid variables: {flags}"


def settings_from_env(env: Mapping[str, str] | None = None) -> PluginSettings:
    """The plugin's settings from `env` (default `os.environ`). Raises PluginConfigError on any bad value."""
    env = os.environ if env is None else env
    given = {k: v for k, v in env.items() if k == ENV_SWITCH or k.startswith(ENV_SWITCH + "_")}
    switch = env.get(ENV_SWITCH, "").strip().lower()
    if switch not in _OFF + _ON:
        raise PluginConfigError(f"{ENV_SWITCH}={env[ENV_SWITCH]!r}; valid: off, 0, false, no (disable) or on, 1")
    if switch in _OFF:
        return PluginSettings(False, f"{ENV_SWITCH}={env[ENV_SWITCH]} (unset it to enable)", given=given)
    budget = parse_size(ENV_BUDGET, env[ENV_BUDGET]) if ENV_BUDGET in env else None
    fraction = parse_fraction(ENV_FRACTION, env[ENV_FRACTION]) if ENV_FRACTION in env else None
    if budget is not None and fraction is not None:
        raise PluginConfigError(
            f"{ENV_BUDGET}={env[ENV_BUDGET]!r} and {ENV_FRACTION}={env[ENV_FRACTION]!r} are both set; valid: one"
        )
    quant = parse_quant(env)
    attention = parse_attention(env)
    if budget is None and fraction is None:
        if quant is not None or attention != "view" or switch in ("on", "1", "true", "yes"):
            asked = (
                f"{ENV_QUANT}={env[ENV_QUANT]!r}"
                if quant is not None
                else f"{ENV_ATTENTION}={env[ENV_ATTENTION]!r}"
                if attention != "view"
                else f"{ENV_SWITCH}={env[ENV_SWITCH]!r}"
            )
            raise PluginConfigError(
                f"{asked} asks for pagedqvg but neither {ENV_BUDGET} nor {ENV_FRACTION} is set; valid: also set "
                f"{ENV_BUDGET}=24GiB (per rank) or {ENV_FRACTION}=0.5"
            )
        return PluginSettings(
            False,
            f"no budget: set {ENV_BUDGET}=24GiB (pool per rank) or {ENV_FRACTION}=0.5 (of the device's free memory) "
            f"to enable",
            given=given,
        )
    return PluginSettings(
        True, budget_bytes=budget, memory_fraction=fraction, quant=quant, given=given, attention=attention
    )


def parse_attention(env: Mapping[str, str]) -> str:
    """`PAGEDQVG_ATTENTION`: "view" (unset or empty), "pages" or "heads" (then `PAGEDQVG_ATTENTION_HEAD_GROUPS` is
    checked too); PluginConfigError naming the value otherwise."""
    from pagedqvg.integrations.sglang.attention import attention_mode_from_env
    from pagedqvg.integrations.sglang.head_groups import head_group_size_from_env

    try:
        mode = attention_mode_from_env(env)
        if mode == "heads":
            head_group_size_from_env(env)  # checked here: a bad value stops the process before anything registers
        return mode
    except CacheConfigError as exc:
        raise PluginConfigError(str(exc)) from None


def _check_sglang_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = "none installed"
    if found != SGLANG_VERSION:
        raise PluginConfigError(
            f"SGLang {found} found; pagedqvg's plugin patches SGLang {SGLANG_VERSION}'s causal stages "
            f"(_allocate_causal_kv_cache): pip install sglang=={SGLANG_VERSION}, or set {ENV_SWITCH}=off"
        )


def _say(level: int, message: str) -> None:
    """Log `message` on the `pagedqvg.sglang` logger; a handler on stderr when nothing else would show it."""
    if not _log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[pagedqvg] %(levelname)s %(message)s"))
        _log.addHandler(handler)
        _log.propagate = False
    if _log.level == logging.NOTSET:
        _log.setLevel(logging.INFO)
    _log.log(level, "%s (pid %d)", message, os.getpid())


def _announce_first_caches(stage: Any, caches: list) -> None:
    """Log the pool and the caches of the first allocation of this process (one line), then stop listening."""
    from pagedqvg.integrations.sglang import integration as integ

    integ._cache_listeners.remove(_announce_first_caches)
    pools = ", ".join(
        f"{key}: {pool.num_pages * pool.page_bytes} bytes in {pool.num_pages} pages of {pool.page_bytes} bytes"
        for key, pool in sorted(integ._pools.items())
    )
    kinds = sorted({type(c).__name__ for c in caches})
    _say(
        logging.INFO,
        f"pagedqvg: {type(stage).__name__} got {len(caches)} {'/'.join(kinds)} caches; pool {pools}",
    )


def _require_hooks_applied(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on the worker's `run_scheduler_process`: SGLang logs and skips a hook it cannot apply; a worker
    whose allocation hooks did not apply would run on SGLang's dense caches, so it stops instead."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

    missing = [t for t in _hook_targets() if t not in HookRegistry._patched]
    if missing:
        message = f"pagedqvg: SGLang could not apply the hooks on {missing} (see its log); set {ENV_SWITCH}=off to run"
        _say(logging.ERROR, message + " without pagedqvg")
        raise SystemExit(message + " without pagedqvg")


def _hook_targets() -> tuple[str, ...]:
    """The targets this process's hooks must have patched: the allocations, and the attention layer in pages mode."""
    from pagedqvg.integrations.sglang.attention import DEFERRED_MODES, attention_mode

    pages = (ATTENTION_TARGET,) if attention_mode() in DEFERRED_MODES else ()
    return HOOK_TARGETS + FORWARD_TARGETS + (DISPOSE_TARGET,) + pages


def _register_session_hooks(plugin_hook: Any, hook_type: Any) -> None:
    """The request-end and realtime-release hooks of sglang_sessions, and a log line of the pool after each
    request."""
    from pagedqvg.integrations.sglang import sessions

    for target in FORWARD_TARGETS:
        plugin_hook(target, hook_type.AROUND)(sessions.forward_around)
    plugin_hook(DISPOSE_TARGET, hook_type.BEFORE)(sessions.dispose_before)
    if _log_request_end not in sessions.request_listeners:
        sessions.request_listeners.append(_log_request_end)


def _log_request_end(stage: Any, pools: list) -> None:
    """One line per request: the pages each pool holds after it (0 unless a realtime session keeps caches)."""
    from pagedqvg.integrations.sglang import sessions

    held = ", ".join(f"{p.device}: {p.num_pages - p.num_free_pages} of {p.num_pages} pages in use" for p in pools)
    opened = sum(sessions.manager_for(p).open_sessions for p in pools)
    _say(logging.INFO, f"pagedqvg: {type(stage).__name__} request done; pool {held or 'none'}; {opened} open sessions")


def register() -> None:
    """The entry point SGLang's `load_plugins()` calls once per process: read the variables, register the hooks,
    log one line. A bad value or another SGLang version raises SystemExit with the message (see module doc)."""
    try:
        settings = settings_from_env()
        if settings.active:
            _check_sglang_version()
    except PluginConfigError as exc:
        _say(logging.ERROR, f"pagedqvg: {exc}")
        raise SystemExit(f"pagedqvg: {exc}") from None
    if not settings.active:
        _say(logging.INFO, f"pagedqvg: installed, not active: {settings.reason}")
        return
    from sglang.multimodal_gen.runtime.platforms.plugins import HookType, plugin_hook

    from pagedqvg.integrations.sglang import integration as integ

    integ.configure(
        budget_bytes=settings.budget_bytes, memory_fraction=settings.memory_fraction, quant=settings.quant
    )
    plugin_hook(HOOK_TARGETS[0], HookType.AROUND)(integ.allocate_around)
    plugin_hook(HOOK_TARGETS[1], HookType.AROUND)(integ.lingbot_allocate_around)
    if settings.attention in ("pages", "heads"):
        from pagedqvg.integrations.sglang.attention import pages_attention_around, set_attention_mode
        from pagedqvg.integrations.sglang.head_groups import head_group_size_from_env, set_head_group_size

        set_attention_mode(settings.attention)
        set_head_group_size(head_group_size_from_env())
        plugin_hook(ATTENTION_TARGET, HookType.AROUND)(pages_attention_around)
    _register_session_hooks(plugin_hook, HookType)
    plugin_hook(WORKER_TARGET, HookType.BEFORE)(_require_hooks_applied)
    if _announce_first_caches not in integ._cache_listeners:
        integ._cache_listeners.append(_announce_first_caches)
    targets = ", ".join(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t in _hook_targets())
    _say(logging.INFO, f"pagedqvg: active: {settings.describe()}; AROUND hooks on {targets}")
