"""Every environment variable the library reads, one function each (SGLang's plugin variables are the integration's
own and live in `pagedqvg.integrations.sglang`).

| Variable | Values | Default | Read | Effect |
|---|---|---|---|---|
| `PAGEDQVG_KERNELS` | `auto`, `torch`, `triton` (case-insensitive) | `auto` | per dispatch call without a resolved backend (a cache resolves it once, at construction) | `auto`: Triton for CUDA tensors when `import triton` works, else torch; `torch`: the torch references everywhere; `triton`: Triton everywhere (CPU tensors need `TRITON_INTERPRET=1`). Anything else: ValueError. |
| `PAGEDQVG_DEBUG` | `1` on, anything else off | off | once, when `pagedqvg.debug` is imported; `set_debug_checks` changes it at run time | The data-reading argument checks (index ranges of row indices, run and piece tables: a host-device sync per kernel call). |
| `PAGEDQVG_ATTN_SPLITS` | an integer >= 1, or unset / empty | unset (the heuristic `choose_splits` decides) | per Triton attention call, unless `set_forced_splits` set a value | The key ranges of every Triton attention call (1: one launch). Anything else: ValueError. |
| `TRITON_INTERPRET` | `1` | unset | by Triton, when it decorates the kernels (before they are imported) | Triton's own: its interpreter, which runs the Triton kernels on CPU tensors. Listed because `PAGEDQVG_KERNELS=triton` on CPU needs it. |

`PAGEDQVG_KERNEL_CHECKS` (an undocumented alias of `PAGEDQVG_DEBUG`) is no longer read: set `PAGEDQVG_DEBUG=1`.

Each function reads `os.environ` when it is called (O(1)); callers on a hot path read it once (their docstrings
say so).
"""  # noqa: E501 (the table's rows)

from __future__ import annotations

import os

__all__ = ["KERNEL_CHOICES", "attn_splits", "debug", "kernels"]

#: The values of `PAGEDQVG_KERNELS`.
KERNEL_CHOICES = ("auto", "torch", "triton")


def kernels() -> str:
    """`PAGEDQVG_KERNELS`: "auto" (unset or empty), "torch" or "triton"; ValueError naming the value otherwise."""
    choice = os.environ.get("PAGEDQVG_KERNELS", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"PAGEDQVG_KERNELS={choice!r} is not one of {KERNEL_CHOICES}")
    return choice


def debug() -> bool:
    """`PAGEDQVG_DEBUG`: True when it is "1"."""
    return os.environ.get("PAGEDQVG_DEBUG", "0").strip() == "1"


def attn_splits() -> int | None:
    """`PAGEDQVG_ATTN_SPLITS`: None when unset or empty, else an int >= 1; ValueError naming the value otherwise."""
    raw = os.environ.get("PAGEDQVG_ATTN_SPLITS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"PAGEDQVG_ATTN_SPLITS={raw!r}: must be an integer >= 1 (1: one launch), or unset")
    return int(raw)
