"""SGLang attention mode `heads` (`PAGEDQVG_ATTENTION=heads`): SGLang's own `LocalAttention.forward` called once per
group of heads over that group's view (attention/head_groups.py), so the user's attention backend (FlashAttention,
SDPA, cuDNN, Sage) runs unchanged with a transient of one group's view instead of the whole view.

As in mode `pages` the cache call defers the view (`attention.PendingPages`: `PagesKV` tensors); the wrapper of
`LocalAttention.forward` (attention.py) hands a `(k, v)` pair of one pending view without a mask to
`heads_attention` here, which calls the original forward per group: `q[:, :, group]` and the group's `[B, T, g, D]`
view, each output copied into its heads of the result. Everything else behaves as mode `view`.

A call runs whole, as mode `view` (the view built, the original forward called once; one log line per reason) when
heads would not give view mode's result or would not save memory: a backend not known to compute heads
independently (`PER_HEAD_BACKENDS`: sliding-tile, video-sparse and other head-indexed or block-sparse kernels are
not in it), a query with other heads than the view (GQA: SGLang repeats K/V heads), or SGLang's attention autotune
not yet decided while the whole call is large enough to trigger it (`AUTOTUNE_MIN_NUMEL` query elements: the
autotune must time the whole call, as in mode view, not a group, so no group switches backend where the whole
call would not; after it has chosen, groups run the chosen backend; below the threshold no call tunes).

The default (`PAGEDQVG_ATTENTION` unset, mode `auto`): each call runs as mode `heads` where its `(backend, device
type, torch version)` is on `HEADS_DEFAULT_ALLOWLIST` (`default_attention`, decided at the `LocalAttention` call,
where the backend is known; the fallbacks above still apply), as mode `view` otherwise; a cache call defers its view
only where some entry is for its device type and torch version (`heads_may_default`; elsewhere it is mode `view`'s
call). One log line per process and decision says which mode the default chose and why; mode `heads` logs once per
group size (`attention heads: ... per group of g heads`), so a run's log shows which path ran.

Group size: `PAGEDQVG_ATTENTION_HEAD_GROUPS` (heads per group, an int >= 1, clamped to the call's heads; unset,
empty or `auto`: the cost model `layout.head_groups.choose_head_group` with the device's SM count and, on CUDA, the
free device memory as the budget, once per call shape). Composes with Ulysses: the cache call's heads are the rank's
head slice, cut into groups.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from pagedqvg.attention.head_groups import attend_head_groups, group_buffer_numel
from pagedqvg.errors import CacheConfigError
from pagedqvg.integrations.sglang.runtime import integration
from pagedqvg.layout.head_groups import DEFAULT_SMS, choose_head_group

__all__ = [
    "AUTOTUNE_MIN_NUMEL", "HEADS_DEFAULT_ALLOWLIST", "HEADS_DEFAULT_MARGIN", "HEAD_GROUPS_ENV", "PER_HEAD_BACKENDS",
    "auto_attention", "default_attention", "fallback_reason", "head_group_size_from_env", "heads_attention",
    "heads_is_default", "heads_may_default", "set_head_group_size",
]  # fmt: skip

#: The environment variable of the group size (heads per group).
HEAD_GROUPS_ENV = "PAGEDQVG_ATTENTION_HEAD_GROUPS"
#: SGLang's attention autotune looks only at calls of at least this many query elements (its `_MIN_TUNE_NUMEL`,
#: sglang/multimodal_gen/runtime/layers/attention/autotune.py).
AUTOTUNE_MIN_NUMEL = 4 << 20
#: SGLang backends (`AttentionBackendEnum` names) whose attention of a head depends on that head's q, k, v only and
#: that take any head count: mode `heads` runs them per group. Any other backend runs whole (mode `view`).
PER_HEAD_BACKENDS = frozenset({"TORCH_SDPA", "FA", "FA2", "FA3", "FA4", "SAGE_ATTN", "SAGE_ATTN_3", "AITER"})
#: The margin of an allowlist entry: mode `heads` takes at most this many times mode `view`'s time per layer call at
#: LingBot-World's shapes (`benchmarks/bench_head_groups.py --per-head` on CPU: the median ratio of CPU time;
#: `bench_kernels_cuda.py` on a GPU).
HEADS_DEFAULT_MARGIN = 1.05
#: `(backend, device type, torch version prefix)` on which mode `heads` is proven bit-identical to mode `view` and at
#: most `HEADS_DEFAULT_MARGIN` x view's time, so the default (`PAGEDQVG_ATTENTION` unset) runs it there:
#: SGLang's SDPA backend on CPU under torch 2.13. Bits: tests/test_head_groups*.py (SGLang stand-ins, every tier
#: format, head slices, bf16 / fp16 / fp32) and .ci/sglang_runtime.py (SGLang's real DiffGenerator: heads, view and
#: the default give torch.equal samples, quant off and int2). Time: LingBot-World's per-head shape (4,680 queries x
#: 28,080 keys x 128, 2 heads, groups of 1 vs the whole call, the same SDPA; `bench_head_groups.py --per-head`),
#: torch 2.13.0 CPU, 2 threads on a shared 2-core machine, median heads/view CPU time of two runs (7 and 9
#: alternating pairs): fp32 0.977x / 0.987x, bf16 0.996x / 1.009x. Wall time there swings 0.6-1.9x per pair with the
#: other jobs: medians fp32 1.039x / 0.939x, bf16 0.968x / 1.055x (an earlier 5-pair run: 1.289x / 1.059x), so it
#: cannot resolve a 5% margin on that machine; docs/ATTENTION_MODES.md has the runs.
#: GPU entries are added only from `benchmarks/bench_kernels_cuda.py` runs, which print the entry they prove.
HEADS_DEFAULT_ALLOWLIST: tuple[tuple[str, str, str], ...] = (("TORCH_SDPA", "cpu", "2.13"),)

_log = logging.getLogger("pagedqvg")


def _version_matches(torch_version: str, prefix: str) -> bool:
    return torch_version == prefix or torch_version.startswith(prefix + ".")


def heads_is_default(backend: str, device_type: str, torch_version: str) -> bool:
    """Whether mode `heads` is proven for `(backend, device_type, torch_version)` (`HEADS_DEFAULT_ALLOWLIST`;
    the version matches by prefix: "2.13" covers "2.13.0+cpu"). O(allowlist)."""
    return any(backend == b and device_type == d and _version_matches(torch_version, v)
               for b, d, v in HEADS_DEFAULT_ALLOWLIST)  # fmt: skip


def heads_may_default(device_type: str, torch_version: str) -> bool:
    """Whether any allowlist entry is for `device_type` and `torch_version` (some backend there may default to
    mode `heads`): only then does a cache call of the default defer its view. O(allowlist)."""
    return any(device_type == d and _version_matches(torch_version, v) for _, d, v in HEADS_DEFAULT_ALLOWLIST)


def default_attention(backend: str | None, device_type: str, torch_version: str) -> tuple[str, str]:
    """The mode the default (`PAGEDQVG_ATTENTION` unset) gives a call of SGLang backend `backend` (an
    `AttentionBackendEnum` name; None: not known) on `device_type` under `torch_version`: `("heads", why)` where
    the triple is on `HEADS_DEFAULT_ALLOWLIST`, else `("view", why)`. O(allowlist)."""
    where = f"backend {backend} on {device_type}, torch {torch_version}"
    if backend is not None and heads_is_default(backend, device_type, torch_version):
        margin = f"bit-identical to view, at most {HEADS_DEFAULT_MARGIN}x view's time"
        return "heads", f"{where} is on the heads allowlist ({margin})"
    allowed = ", ".join("/".join(e) for e in HEADS_DEFAULT_ALLOWLIST) or "none"
    return "view", f"{where} is not on the heads allowlist ({allowed})"


def head_group_size_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """`PAGEDQVG_ATTENTION_HEAD_GROUPS`: heads per group (an int >= 1), or None (unset, empty or `auto`: the cost
    model). CacheConfigError naming the variable, the value and the valid forms otherwise."""
    raw = (os.environ if environ is None else environ).get(HEAD_GROUPS_ENV, "").strip()
    if raw.lower() in ("", "auto"):
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise CacheConfigError(f"{HEAD_GROUPS_ENV}={raw!r} is not a group size; valid: an int >= 1 (heads per "
                               f"group), or auto / unset (the cost model)")  # fmt: skip
    return int(raw)


def set_head_group_size(group: int | None) -> int | None:
    """Fix the heads per group of every `heads` call from now on (None: the cost model; the environment is not read
    afterwards); returns the previous setting. CacheConfigError for a non-int or a value < 1."""
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise CacheConfigError(f"head group size {group!r}; valid: an int >= 1 (heads per group) or None")
    state = integration()
    before = state.head_group
    state.head_group, state.head_group_read_env = group, True
    return before


def _group_size(batch: int, tq: int, hin: int, d: int, dtype: torch.dtype, tokens: int, device: torch.device) -> int:
    """The heads per group of a call: the fixed size (clamped to `hin`), else the cost model's choice, computed once
    per call shape and device (the SM count; on CUDA the free memory as the budget)."""
    state = integration()
    if not state.head_group_read_env:
        state.head_group, state.head_group_read_env = head_group_size_from_env(), True
    if state.head_group is not None:
        return min(state.head_group, hin)
    key = (batch, tq, hin, d, dtype, tokens, str(device))
    got = state.head_group_choices.get(key)
    if got is None:
        sms, budget = DEFAULT_SMS, None
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            budget = torch.cuda.mem_get_info(device)[0]
        got = state.head_group_choices[key] = choose_head_group(batch, tq, hin, d, dtype, tokens, budget_bytes=budget,
                                                         sms=sms).group  # fmt: skip
    return got


def _autotune_pending(layer: Any) -> bool:
    """Whether SGLang's autotune still waits for this layer's first call worth timing (its `tuning_forward` wrapper
    is the backend's forward)."""
    forward = getattr(getattr(layer, "attn_impl", None), "forward", None)
    return getattr(forward, "__name__", "") == "tuning_forward"


def fallback_reason(layer: Any, q: torch.Tensor, hin: int) -> str | None:
    """Why this `LocalAttention` call must run whole (mode `view`), or None: it may run by head groups."""
    backend = getattr(getattr(layer, "backend", None), "name", None)
    if backend not in PER_HEAD_BACKENDS:
        return f"backend {backend} is not known to attend heads independently (known: {sorted(PER_HEAD_BACKENDS)})"
    if q.dim() != 4 or q.shape[2] != hin:
        return f"query of shape {tuple(q.shape)} has other heads than the view's {hin} (GQA)"
    if q.numel() >= AUTOTUNE_MIN_NUMEL and _autotune_pending(layer):
        return "SGLang's attention autotune has not chosen yet: this call runs whole so that it times the whole call"
    return None


def _say_once(reason: str) -> None:
    _log_once(f"pagedqvg: attention heads: running the call whole (mode view): {reason}")


def _log_once(message: str) -> None:
    """Log `message` (INFO, logger `pagedqvg`) the first time this process sees it. O(1)."""
    said = integration().heads_said
    if message not in said:
        said.add(message)
        _log.info("%s", message)


def say_default(mode: str, why: str) -> None:
    """Log, once per process and decision, the mode the default chose and why."""
    _log_once(f"pagedqvg: attention default (PAGEDQVG_ATTENTION unset): mode {mode}: {why}")


def auto_attention(original: Any, layer: Any, q: torch.Tensor, pending: Any) -> torch.Tensor:
    """The default's `LocalAttention.forward(q, k, v)` for `(k, v)` of the pending view `pending`: mode `heads`
    (`heads_attention`) where `default_attention` says so for the layer's backend, the cache's device type and the
    running torch, else mode `view` (the view built, `original` called once over it)."""
    backend = getattr(getattr(layer, "backend", None), "name", None)
    mode, why = default_attention(backend, pending.cache.device.type, torch.__version__)
    say_default(mode, why)
    if mode == "heads":
        return heads_attention(original, layer, q, pending)
    k, v = pending.materialize()
    return original(layer, q, k, v, None)


def heads_attention(original: Any, layer: Any, q: torch.Tensor, pending: Any) -> torch.Tensor:
    """Mode `heads` of `LocalAttention.forward(q, k, v)` for `(k, v)` of the pending view `pending`: SGLang's
    `original` forward per head group (or once over the built view: `fallback_reason`). `[B, Tq, Hin, D]`, what the
    original forward returns, head by head."""
    reason = fallback_reason(layer, q, pending.hin)
    if reason is not None or pending.view is not None:
        if reason is not None:
            _say_once(reason)
        k, v = pending.materialize()
        return original(layer, q, k, v, None)
    pending._check_current("attention")
    cache = pending.cache
    B, Tq, hin, D = q.shape
    plan = pending.plan
    group = _group_size(B, Tq, hin, D, cache.dtype, plan.tokens, cache.device)
    backend = layer.backend.name
    _log_once(f"pagedqvg: attention heads: SGLang's LocalAttention.forward ({backend}) per group of {group} heads "
              f"(calls of {hin} heads: {-(-hin // group)} groups)")  # fmt: skip
    n = group_buffer_numel(cache._io, plan, group)
    if cache.reuse_view_buffer:
        buffer = cache.pool.view_buffer(n, cache.dtype)
    else:
        buffer = torch.empty(n, dtype=cache.dtype, device=cache.device)

    def attend(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor) -> torch.Tensor:
        out = original(layer, qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), None)
        return out.transpose(1, 2)

    return attend_head_groups(cache._io, plan, pending.h0, q, attend, group, buffer)
