"""What pagedqvg hooks in each supported SGLang version: one table per version, each hooked function or class listed
once (module, qualname, kind, why). `install()` patches and the entry-point plugin hooks what they derive from it.

Kinds:
- `cache_class`: a cache class SGLang's code builds; `install()` binds pagedqvg's class wherever an SGLang module
  binds it (the plugin needs none: its allocation hooks build pagedqvg's caches directly).
- `allocate`: a stage's `_allocate_causal_kv_cache`, AROUND: paged caches, one session per call (`allocation.py`).
- `allocate_lingbot`: LingBot-World's own allocation, AROUND: packed paged caches when quantization is on.
- `forward`: a causal stage's `forward`, AROUND: one request scope (`sessions.forward_around`).
- `dispose`: the realtime state's `dispose`, BEFORE: its caches closed (`sessions.dispose_before`).
- `attention`: `LocalAttention.forward`, AROUND, only with attention mode `pages` (`attention.py`).
- `worker`: the worker's entry, BEFORE (plugin only): stop when SGLang skipped one of the hooks.
- `binding`: a module `install()` imports (when importable) so that its bindings of the cache classes are patched.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedqvg.errors import IntegrationError

__all__ = ["SUPPORTED", "Target", "patched_targets", "realtime_states", "stage_quant_args", "targets_for"]

_RT = "sglang.multimodal_gen.runtime"
_STAGES = f"{_RT}.pipelines_core.stages"
_LINGBOT = f"{_STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising"
_LONGLIVE2 = f"{_STAGES}.model_specific_stages.longlive2"


@dataclass(frozen=True)
class Target:
    """One SGLang function or class pagedqvg hooks: `module`, `qualname` (`Class.method`, or a module for kind
    `binding`), `kind` (see the module doc) and why."""

    module: str
    qualname: str
    kind: str
    why: str

    @property
    def path(self) -> str:
        """`module.qualname`, the name SGLang's `plugin_hook` takes."""
        return f"{self.module}.{self.qualname}" if self.qualname else self.module

    @property
    def owner(self) -> str:
        """The class name of a method target."""
        return self.qualname.rsplit(".", 1)[0]

    @property
    def attribute(self) -> str:
        """The method name of a method target."""
        return self.qualname.rsplit(".", 1)[-1]


SGLANG_0_5_23: tuple[Target, ...] = (
    Target(f"{_RT}.layers.kvcache.causal_attention_cache", "CausalSelfAttentionKVCache", "cache_class",
           "the dense causal self-attention KV cache every causal stage builds"),
    Target(f"{_RT}.layers.kvcache.qvg_packed_cache", "QVGPackedCausalKVCache", "cache_class",
           "LingBot-World's quantized KV cache (--kv-cache-quant)"),
    Target(f"{_STAGES}.causal_denoising", "CausalDMDDenoisingStage._allocate_causal_kv_cache", "allocate",
           "the base allocation of LongLive2, causal Wan and LingBot-World: paged caches, no dense torch.zeros"),
    Target(_LINGBOT, "LingBotWorldCausalDMDDenoisingStage._allocate_causal_kv_cache", "allocate_lingbot",
           "LingBot-World's own allocation (its QVG path): packed paged caches when quantization is on"),
    Target(f"{_STAGES}.causal_denoising", "CausalDMDDenoisingStage.forward", "forward",
           "one request: the sessions it allocated close when it returns or raises"),
    Target(_LONGLIVE2, "LongLive2CausalDenoisingStage.forward", "forward", "LongLive2's request (its own forward)"),
    Target(_LINGBOT, "LingBotWorldCausalDMDDenoisingStage.forward", "forward", "LingBot-World's request"),
    Target(f"{_RT}.realtime.states.causal", "RealtimeCausalDiTState.dispose", "dispose",
           "a realtime session's caches kept across chunk calls close when SGLang disposes its state"),
    Target(f"{_RT}.layers.attention.layer", "LocalAttention.forward", "attention",
           "the attention every causal self-attention calls with the view's K and V (attention mode pages)"),
    Target(f"{_RT}.managers.gpu_worker", "run_scheduler_process", "worker",
           "the worker's entry, after hook application: a worker whose hooks did not apply stops"),
    Target(f"{_RT}.layers.kvcache", "", "binding", "re-exports the cache classes"),
    Target(f"{_RT}.realtime.states.causal", "", "binding", "the realtime state module"),
    Target(f"{_STAGES}.causal_denoising", "", "binding", "the base causal stage"),
    Target(_LINGBOT, "", "binding", "LingBot-World's stage"),
    Target(_LONGLIVE2, "", "binding", "LongLive2's stage"),
    Target(f"{_RT}.models.dits.causal_wanvideo", "", "binding", "causal Wan's DiT"),
    Target(f"{_RT}.models.dits.lingbot_world", "", "binding", "LingBot-World's DiT"),
    Target(f"{_RT}.models.dits.longlive2", "", "binding", "LongLive2's DiT"),
)  # fmt: skip

#: Supported SGLang versions -> their table.
SUPPORTED: dict[str, tuple[Target, ...]] = {"0.5.23": SGLANG_0_5_23}
#: The version whose table `install()` uses (it does not read SGLang's package metadata).
CURRENT = "0.5.23"


def targets_for(version: str, *kinds: str) -> tuple[Target, ...]:
    """The targets of `version` of the given kinds (all kinds when none is given), in table order. IntegrationError
    naming the version found and the supported ones otherwise."""
    table = SUPPORTED.get(version)
    if table is None:
        raise IntegrationError(
            f"SGLang {version} found; pagedqvg hooks SGLang {' or '.join(SUPPORTED)} (its causal stages' "
            f"_allocate_causal_kv_cache): pip install sglang=={CURRENT}, or set PAGEDQVG=off"
        )
    return tuple(t for t in table if not kinds or t.kind in kinds)


# ---------------------------------------------------------------- adapters: the only reads of SGLang private attributes
# SGLang offers no public way to ask these; each adapter checks the shape it assumes and fails loudly otherwise
# (tests/test_integrations_sglang_versions.py checks each against SGLang's source when PAGEDQVG_SGLANG_SRC is set).


def stage_quant_args(stage: object) -> object | None:
    """LingBot-World's `--kv-cache-quant*` of a stage (`stage._kv_quant_args`, SGLang's `QVGKVQuantArgs`, with an
    `enabled` field), None for a stage without it. IntegrationError when it is there without `enabled`."""
    args = getattr(stage, "_kv_quant_args", None)
    if args is not None and not hasattr(args, "enabled"):
        raise IntegrationError(
            f"{type(stage).__name__}._kv_quant_args is {type(args).__name__} without `enabled`, not SGLang {CURRENT}'s "
            f"QVGKVQuantArgs; install sglang=={CURRENT} or set PAGEDQVG=off"
        )
    return args


def realtime_states(session: object) -> dict:
    """The states SGLang's `RealtimeSession` keeps across chunk calls (`session._states`, a dict of state objects,
    each with its `kv_cache`); {} for no session (a request that is not realtime). IntegrationError when a session
    is there without that dict."""
    if session is None:
        return {}
    states = getattr(session, "_states", None)
    if not isinstance(states, dict):
        raise IntegrationError(
            f"{type(session).__name__}._states is {type(states).__name__}, not the dict of realtime states of SGLang "
            f"{CURRENT}'s RealtimeSession: pagedqvg cannot tell which caches a realtime session keeps; install "
            f"sglang=={CURRENT} or set PAGEDQVG=off"
        )
    return states


def patched_targets(registry: type) -> set[str]:
    """The hook targets SGLang's `HookRegistry` applied (`HookRegistry._patched`, a set of `module.qualname` strings
    in SGLang 0.5.23).
    IntegrationError when it is not that shape any more."""
    patched = getattr(registry, "_patched", None)
    if not isinstance(patched, (set, frozenset)) or not all(isinstance(t, str) for t in patched):
        raise IntegrationError(
            f"SGLang's {getattr(registry, '__qualname__', registry)}._patched is {type(patched).__name__}, not the "
            f"set of applied hook targets (module.qualname strings) of SGLang {CURRENT}: pagedqvg cannot tell "
            f"whether its hooks applied; install sglang=={CURRENT} or set PAGEDQVG=off"
        )
    return set(patched)
