"""SGLang 0.5.23 entry-point plugin: pagedqvg in every SGLang process, spawned workers included.

SGLang runs each pipeline in worker processes started with multiprocessing *spawn*; an `install()` call in the
launching script does not reach them. SGLang's own convention does: entry points of group
`sglang.multimodal_gen.plugins` run once per process in `load_plugins()` (workers, launcher, HTTP child,
`DiffGenerator`). pagedqvg's `pyproject.toml` declares `pagedqvg = "pagedqvg.integrations.sglang.plugin:register"`,
so installing pagedqvg into SGLang's environment is the whole installation.

Configuration (environment variables, inherited by spawned workers):
    PAGEDQVG_BUDGET            the pool of each rank: bytes (`25769803776`) or a size (`24GiB`, `512MiB`, `1.5GB`,
                               `2M`), read by `pagedqvg.sizes.parse_size` as the CLI reads it; at least 1MiB
    PAGEDQVG_MEMORY_FRACTION   instead: a fraction in (0, 1] of the device's free memory at the worker's first cache
    PAGEDQVG_HOST_BUDGET       a host tier per rank: a size (the same forms, at least 1MiB; unset or 0: none) of CPU
                               memory (pinned on CUDA) where idle realtime sessions are swapped out when a session
                               does not fit the pool; needs PAGEDQVG_BUDGET or PAGEDQVG_MEMORY_FRACTION
    PAGEDQVG_KV_CACHE_QUANT    off | int4 | int2 | compact: quantize every causal stage's caches (overrides
                               SGLang's --kv-cache-quant* for LingBot-World); unset: each stage's own setting
    PAGEDQVG_KV_CACHE_QUANT_<FLAG>  each of SGLang's --kv-cache-quant-<flag> (CENTROIDS, BLOCK_SIZE, STAGES, ITERS,
                               KEEP_RECENT, SINK_KEEP, ASYMMETRIC, SINK) and pagedqvg's (SEED, PACK_TRITS,
                               FIT_SCALES, CODEBOOK_FP8, RECENT)
    PAGEDQVG_KV_CACHE_QUANT_SINK    also the sink tier's format: bf16 (dense), fp8, int4, int2, compact; true = the
                               history's (PAGEDQVG_KV_CACHE_QUANT's, the default), false = dense
    PAGEDQVG_KV_CACHE_QUANT_RECENT  the recent tier's format (the KEEP_RECENT newest completed chunks): bf16 (dense,
                               the default), fp8, int4, int2, compact, no coarser than the history's
    PAGEDQVG_ATTENTION         unset or auto (default): per call heads where (backend, device type, torch version)
                               is on head_groups.HEADS_DEFAULT_ALLOWLIST, else view | view: SGLang attends over the
                               materialized view, always | pages: SGLang's causal self-attention computes attention
                               straight from the pool's pages (`update_and_attend`) | heads: SGLang's own attention
                               per group of heads over that group's view
    PAGEDQVG_ATTENTION_HEAD_GROUPS  modes heads and auto: heads per group (an int >= 1); unset or auto: the cost model
    PAGEDQVG=off               disable (the plugin registers nothing)
The variables are parsed once, at registration, into `PluginSettings` (the quantization a `QuantConfig`, tiers
included), which configures the process's one integration object (`runtime.integration()`). Any
PAGEDQVG_KV_CACHE_QUANT_* knob with PAGEDQVG_KV_CACHE_QUANT=off is refused (it would be ignored).
pagedqvg is active only with a budget variable (a pool sized without the user's say could take memory SGLang's
activations need); without one each process logs how to turn it on. Any bad value stops the process with
`SystemExit` naming the variable, the value and the valid forms (SGLang logs and ignores a plugin's `Exception`,
which would fall back silently to SGLang's caches; `SystemExit` is not an `Exception`).

Registration only (as `load_plugins()` documents): `register()` parses the variables and registers, with SGLang's
`plugin_hook`, the hooks of versions.py's table for the installed SGLang: AROUND on the stages'
`_allocate_causal_kv_cache` and `forward` (each allocation's caches one session of the pool, closed when the
request's forward returns or raises: sessions.py), BEFORE on the realtime state's `dispose` and the worker's entry;
SGLang's `apply_plugin_hooks()` applies them (and re-points every module bound to the originals). The pool is built
on each worker's device at its first stage allocation, paged as `pagedqvg plan` pages that allocation's shapes, so
every rank of a multi-GPU run has its own pool of the given budget and the plan's figures hold there.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedqvg.allocator import DEFAULT_PAGE_BYTES
from pagedqvg.errors import CacheConfigError, IntegrationError
from pagedqvg.integrations.sglang.versions import CURRENT, patched_targets, targets_for
from pagedqvg.quant import QuantConfig
from pagedqvg.quant.formats import TIER_FORMAT_NAMES
from pagedqvg.sizes import SIZE_FORMS, SizeError
from pagedqvg.sizes import parse_size as _parse_size

__all__ = [
    "ENV_ATTENTION",
    "ENV_BUDGET",
    "ENV_FRACTION",
    "ENV_HOST_BUDGET",
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
ENV_HOST_BUDGET = "PAGEDQVG_HOST_BUDGET"
ENV_QUANT = "PAGEDQVG_KV_CACHE_QUANT"
ENV_QUANT_SINK = "PAGEDQVG_KV_CACHE_QUANT_SINK"
ENV_QUANT_RECENT = "PAGEDQVG_KV_CACHE_QUANT_RECENT"
ENV_ATTENTION = "PAGEDQVG_ATTENTION"
SGLANG_VERSION = CURRENT
_TABLE = targets_for(CURRENT)
#: Derived from versions.py's table (each target listed there once): the allocations, the request ends (forward),
#: the realtime release (dispose), the attention layer (pages mode), the worker entry.
HOOK_TARGETS = tuple(t.path for t in _TABLE if t.kind in ("allocate", "allocate_lingbot"))
FORWARD_TARGETS = tuple(t.path for t in _TABLE if t.kind == "forward")
DISPOSE_TARGET = next(t.path for t in _TABLE if t.kind == "dispose")
ATTENTION_TARGET = next(t.path for t in _TABLE if t.kind == "attention")
WORKER_TARGET = next(t.path for t in _TABLE if t.kind == "worker")
_OFF, _ON = ("off", "0", "false", "no"), ("on", "1", "true", "yes", "")
_log = logging.getLogger("pagedqvg.sglang")


class PluginConfigError(IntegrationError):
    """A PAGEDQVG* environment variable has a bad value (the message names it, the value and the valid forms)."""


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's configuration from the environment, parsed once at registration. `active` False: `reason` says
    why and how to enable. `quant`: the parsed PAGEDQVG_KV_CACHE_QUANT* (`QuantConfig`, tiers included; disabled for
    `off`), which then overrides every stage's own; None when unset (each stage's own setting). `host_budget_bytes`:
    the host tier of each rank (PAGEDQVG_HOST_BUDGET; None: no host tier)."""

    active: bool
    reason: str = ""
    budget_bytes: int | None = None
    memory_fraction: float | None = None
    quant: QuantConfig | None = None
    given: dict[str, str] = field(default_factory=dict)
    attention: str = "auto"  # PAGEDQVG_ATTENTION: "auto" (unset), "view", "pages" or "heads"
    host_budget_bytes: int | None = None

    def describe(self) -> str:
        """One line: the budget per rank, the host tier (when there is one), the quantization and the attention
        mode."""
        size = f"budget {self.budget_bytes} bytes" if self.budget_bytes else f"{self.memory_fraction} of free memory"
        if self.host_budget_bytes:
            size += (
                f", host tier {self.host_budget_bytes} bytes ({ENV_HOST_BUDGET}: idle realtime sessions swapped out "
                f"when a session does not fit)"
            )
        cfg = self.quant
        if cfg is None:
            quant = "each stage's own (dense unless LingBot-World's --kv-cache-quant)"
        elif not cfg.enabled:
            quant = f"off ({ENV_QUANT}=off, every stage)"
        else:
            quant = f"{cfg.mode} (bits {cfg.bits}, {cfg.centroids} centroids, block {cfg.block_size}, keep_recent "
            quant += f"{cfg.keep_recent_chunks})"
            if cfg.tiered:
                quant += " (tiers: " + ", ".join(f"{t} {cfg.tier_format(t)}" for t in ("sink", "recent", "history"))
                quant += ")"
        return f"pool per rank on its device at the first cache, {size}; quantization: {quant}; attention: " + (
            "from pages (PAGEDQVG_ATTENTION=pages)" if self.attention == "pages"
            else "by head groups (PAGEDQVG_ATTENTION=heads)" if self.attention == "heads"
            else "over the view (PAGEDQVG_ATTENTION=view)" if self.attention == "view"
            else "over the view, by head groups where the backend is allowlisted (PAGEDQVG_ATTENTION unset)"
        )  # fmt: skip


def parse_size(variable: str, raw: str) -> int:
    """Bytes of a size string (`24GiB`, `512 MiB`, `1.5GB`, `2M`, `1048576`), read by `pagedqvg.sizes.parse_size`
    exactly as the CLI reads it, at least one 1 MiB page; PluginConfigError naming `variable` otherwise."""
    try:
        return _parse_size(raw, name=variable, minimum=DEFAULT_PAGE_BYTES)
    except SizeError as exc:
        if "out of range" in str(exc):
            size = _parse_size(raw, name=variable, minimum=-(1 << 128))
            raise PluginConfigError(
                f"{variable}={raw!r} is {size} bytes, below one page ({DEFAULT_PAGE_BYTES} bytes = 1MiB); valid: "
                f"at least 1MiB, as {SIZE_FORMS}"
            ) from None
        raise PluginConfigError(str(exc)) from None


def parse_host_budget(variable: str, raw: str) -> int | None:
    """Bytes of the host tier (`PAGEDQVG_HOST_BUDGET`): a size as `parse_size` reads it, at least one 1 MiB page, or
    0 in any form (`0`, `0GiB`): no host tier (None); PluginConfigError naming `variable` otherwise."""
    try:
        size = _parse_size(raw, name=variable, minimum=-(1 << 128))
    except SizeError as exc:
        raise PluginConfigError(str(exc)) from None
    if size == 0:
        return None
    if size < DEFAULT_PAGE_BYTES:
        raise PluginConfigError(
            f"{variable}={raw!r} is {size} bytes, below one page ({DEFAULT_PAGE_BYTES} bytes = 1MiB); valid: 0 or "
            f"unset (no host tier), or at least 1MiB, as {SIZE_FORMS}"
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


def parse_quant(env: Mapping[str, str]) -> QuantConfig | None:
    """The PAGEDQVG_KV_CACHE_QUANT* variables as one `QuantConfig` (tiers included), each variable validated alone
    by `QuantConfig.from_dict` so the error names it (the base first, the tier variables last, since their checks
    involve the others); None when none is set. `PAGEDQVG_KV_CACHE_QUANT=off` with any other
    PAGEDQVG_KV_CACHE_QUANT_* knob is refused (the knob would be ignored), as the CLI refuses it."""
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
            cfg = QuantConfig.from_dict({**({} if key == "kv_cache_quant" else quant), key: given[variable]})
        except ValueError as exc:
            raise PluginConfigError(_quant_error(variable, given, str(exc))) from None
        if key == "kv_cache_quant" and not cfg.enabled and len(given) > 1:
            knobs = ", ".join(f"{k}={v!r}" for k, v in sorted(given.items()) if k != ENV_QUANT)
            raise PluginConfigError(
                f"{knobs} set with {ENV_QUANT}={given[ENV_QUANT]!r} (quantization off, so they would be ignored); "
                f"valid: {ENV_QUANT}=int4|int2|compact with them, or unset them"
            )
        quant[key] = given[variable]
    return QuantConfig.from_dict(quant)


#: The tier variables and their valid forms (PAGEDQVG_KV_CACHE_QUANT_SINK is also SGLang's --kv-cache-quant-sink).
_PACKED_FORMS = ", ".join(TIER_FORMAT_NAMES[1:])  # the registry's formats after bf16 (quant/formats.py)
_TIER_FORMS = {
    ENV_QUANT_SINK: f"a tier format {TIER_FORMAT_NAMES[0]} (dense), {_PACKED_FORMS}, or a boolean: true (the "
    "history's format) / false (dense)",
    ENV_QUANT_RECENT: f"a tier format {TIER_FORMAT_NAMES[0]} (dense, the default), {_PACKED_FORMS}, no coarser than "
    f"{ENV_QUANT}'s (bf16 > fp8 > int4 > int2 = compact)",
}


def _quant_error(variable: str, given: Mapping[str, str], reason: str) -> str:
    """The message of a PAGEDQVG_KV_CACHE_QUANT* variable `QuantConfig.from_dict` refused: the variable, its value,
    the reason (naming what is allowed); a tier variable's also names the other variables it was checked with."""
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
    host = parse_host_budget(ENV_HOST_BUDGET, env[ENV_HOST_BUDGET]) if ENV_HOST_BUDGET in env else None
    quant = parse_quant(env)
    attention = parse_attention(env)
    if budget is None and fraction is None:
        if (
            host is not None
            or quant is not None
            or attention in ("pages", "heads")
            or switch in ("on", "1", "true", "yes")
        ):
            asked = (
                f"{ENV_HOST_BUDGET}={env[ENV_HOST_BUDGET]!r} (a host tier for the device pool)"
                if host is not None
                else f"{ENV_QUANT}={env[ENV_QUANT]!r}"
                if quant is not None
                else f"{ENV_ATTENTION}={env[ENV_ATTENTION]!r}"
                if attention in ("pages", "heads")
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
        True, budget_bytes=budget, memory_fraction=fraction, quant=quant, given=given, attention=attention,
        host_budget_bytes=host,
    )  # fmt: skip


def parse_attention(env: Mapping[str, str]) -> str:
    """`PAGEDQVG_ATTENTION`: "auto" (unset or empty: the default), "view", "pages" or "heads" (with heads and auto
    `PAGEDQVG_ATTENTION_HEAD_GROUPS` is checked too); PluginConfigError naming the value otherwise."""
    from pagedqvg.integrations.sglang.attention import attention_mode_from_env
    from pagedqvg.integrations.sglang.head_groups import head_group_size_from_env

    try:
        mode = attention_mode_from_env(env)
        if mode in ("heads", "auto"):
            head_group_size_from_env(env)  # checked here: a bad value stops the process before anything registers
        return mode
    except CacheConfigError as exc:
        raise PluginConfigError(str(exc)) from None


def _check_sglang_version() -> tuple:
    """The hook table of the installed SGLang (versions.py); PluginConfigError naming the version found and the
    supported ones otherwise."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = "none installed"
    try:
        return targets_for(found)
    except IntegrationError as exc:
        raise PluginConfigError(str(exc)) from None


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


def _announce_caches(stage: Any, caches: list) -> None:
    """Log the pool (its page: the planner's for the first allocation's shapes) and the caches of the first
    allocation of this process (one line), and one line for each later allocation of another shape: the page waste
    it gets at the shared pool's page. O(devices + shapes)."""
    from pagedqvg.integrations.sglang.runtime import integration

    integ = integration()
    with integ.lock:
        seen = integ.announced
        fresh = [(key, shape, waste) for key, shapes in sorted(integ.pool_shapes.items())
                 for shape, waste in shapes.items() if (key, shape) not in seen]  # fmt: skip
        seen.update((key, shape) for key, shape, _ in fresh)
        pools = {key: pool for key, pool in integ.pools.items() if key not in seen}
        seen.update(pools)
    kinds = "/".join(sorted({type(c).__name__ for c in caches}))
    for key, pool in sorted(pools.items()):
        host = integ.host_pool_for(pool)
        tier = "" if host is None else (
            f"; host tier {host.device}: {host.num_pages * host.page_bytes} bytes in {host.num_pages} pages "
            f"(idle sessions swapped out when a session does not fit)"
        )  # fmt: skip
        _say(
            logging.INFO,
            f"pagedqvg: {type(stage).__name__} got {len(caches)} {kinds} caches; pool {key}: "
            f"{pool.num_pages * pool.page_bytes} bytes in {pool.num_pages} pages of {pool.page_bytes} bytes{tier}",
        )
    for key, shape, waste in fresh:
        _say(logging.INFO, f"pagedqvg: pool {key} ({integ.pools[key].page_bytes} B pages): caches of "
             f"{shape.describe()} waste {waste:.2%} of their pages")  # fmt: skip


def _require_hooks_applied(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on the worker's `run_scheduler_process`: SGLang logs and skips a hook it cannot apply; a worker
    whose allocation hooks did not apply would run on SGLang's dense caches, so it stops instead."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

    try:
        applied = patched_targets(HookRegistry)
    except IntegrationError as exc:
        _say(logging.ERROR, f"pagedqvg: {exc}")
        raise SystemExit(f"pagedqvg: {exc}") from None
    missing = [t for t in _hook_targets() if t not in applied]
    if missing:
        message = f"pagedqvg: SGLang could not apply the hooks on {missing} (see its log); set {ENV_SWITCH}=off to run"
        _say(logging.ERROR, message + " without pagedqvg")
        raise SystemExit(message + " without pagedqvg")


def _hook_targets() -> tuple[str, ...]:
    """The targets this process's hooks must have patched: the allocations, the request ends, the realtime release,
    and the attention layer in the modes that defer the view (pages, heads, auto)."""
    from pagedqvg.integrations.sglang.attention import DEFERRED_MODES, attention_mode

    pages = (ATTENTION_TARGET,) if attention_mode() in DEFERRED_MODES else ()
    return HOOK_TARGETS + FORWARD_TARGETS + (DISPOSE_TARGET,) + pages


def _hooks() -> dict[str, tuple[Any, str]]:
    """Each kind of versions.py's table the plugin hooks: (the hook, SGLang's HookType name)."""
    from pagedqvg.integrations.sglang import allocation, sessions
    from pagedqvg.integrations.sglang.attention import pages_attention_around

    return {
        "allocate": (allocation.allocate_around, "AROUND"),
        "allocate_lingbot": (allocation.lingbot_allocate_around, "AROUND"),
        "forward": (sessions.forward_around, "AROUND"),
        "dispose": (sessions.dispose_before, "BEFORE"),
        "attention": (pages_attention_around, "AROUND"),
        "worker": (_require_hooks_applied, "BEFORE"),
    }


def _log_request_end(stage: Any, pools: list) -> None:
    """One line per request: the pages each pool holds after it (0 unless a realtime session keeps caches)."""
    from pagedqvg.integrations.sglang import sessions

    held = ", ".join(f"{p.device}: {p.num_pages - p.num_free_pages} of {p.num_pages} pages in use" for p in pools)
    managers = [sessions.manager_for(p) for p in pools]
    opened = sum(m.open_sessions for m in managers)
    hosts = [m.host_pool for m in managers if m.host_pool is not None]
    tier = ""
    if hosts:
        outs, ins = sum(m.swapped_out_total for m in managers), sum(m.swapped_in_total for m in managers)
        tier = f"; host tier {sessions.pages_in_use(hosts)} of {sum(h.num_pages for h in hosts)} pages in use "
        tier += f"(swapped-out sessions); {outs} swap-outs, {ins} swap-ins so far"
    _say(logging.INFO, f"pagedqvg: {type(stage).__name__} request done; pool {held or 'none'}; {opened} open sessions"
         + tier)  # fmt: skip


def register() -> None:
    """The entry point SGLang's `load_plugins()` calls once per process: read the variables (once, into
    `PluginSettings`), register the hooks of versions.py's table for the installed SGLang, log one line. A bad value
    or another SGLang version raises SystemExit with the message (see module doc)."""
    try:
        settings = settings_from_env()
        table = _check_sglang_version() if settings.active else ()
    except PluginConfigError as exc:
        _say(logging.ERROR, f"pagedqvg: {exc}")
        raise SystemExit(f"pagedqvg: {exc}") from None
    if not settings.active:
        _say(logging.INFO, f"pagedqvg: installed, not active: {settings.reason}")
        return
    from sglang.multimodal_gen.runtime.platforms.plugins import HookType, plugin_hook

    from pagedqvg.integrations.sglang import integration as integ
    from pagedqvg.integrations.sglang.attention import DEFERRED_MODES, set_attention_mode
    from pagedqvg.integrations.sglang.runtime import integration

    integ.configure(
        budget_bytes=settings.budget_bytes,
        memory_fraction=settings.memory_fraction,
        quant=settings.quant,
        quant_override=settings.quant is not None,
        host_budget_bytes=settings.host_budget_bytes,
    )
    set_attention_mode(settings.attention)
    if settings.attention in ("heads", "auto"):
        from pagedqvg.integrations.sglang.head_groups import head_group_size_from_env, set_head_group_size

        set_head_group_size(head_group_size_from_env())
    hooks = _hooks()
    for target in table:
        if target.kind in hooks and (target.kind != "attention" or settings.attention in DEFERRED_MODES):
            hook, kind = hooks[target.kind]
            plugin_hook(target.path, getattr(HookType, kind))(hook)
    state = integration()
    if _log_request_end not in state.request_listeners:
        state.request_listeners.append(_log_request_end)
    if _announce_caches not in state.cache_listeners:
        state.cache_listeners.append(_announce_caches)
    targets = ", ".join(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t in _hook_targets())
    _say(logging.INFO, f"pagedqvg: active: {settings.describe()}; AROUND hooks on {targets}")
