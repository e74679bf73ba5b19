"""The KV budget per rank, as typed settings shared by the CLI (`pagedqvg plan --budget/--gpu/--memory-fraction`)
and the Python API: `Budget` says where the bytes come from, `Budget.resolve(workload)` gives them
(`ResolvedBudget`: bytes, where they came from, and the arithmetic, JSON-ready with `as_dict`).

Three forms, exactly one per budget:

- `Budget(bytes=24 << 30)` (or `Budget.parse("24GiB")`, one size parser: `pagedqvg.sizes.parse_size`): the bytes;
- `Budget(gpu="H200", memory_fraction=0.9, weights=..., reserve=...)`: a device from the table
  (`presets.GPUS`): total x fraction (default `DEFAULT_GPU_MEMORY_FRACTION`) - weights / tp - reserve, weights
  defaulting to the workload's DiT weights;
- `Budget(memory_fraction=0.8, device="cuda", weights=..., reserve=...)`: this machine's free memory on `device`
  now x fraction - weights (default 0: what is loaded is already not free) / tp - reserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedqvg.allocator import available_memory_bytes, format_bytes
from pagedqvg.errors import PagedQVGError
from pagedqvg.planning.presets import DEFAULT_GPU_MEMORY_FRACTION, Workload, get_gpu
from pagedqvg.sizes import parse_size

_FREE_MEMORY_WEIGHTS = "0: the free memory measured now excludes what is loaded"


class BudgetError(PagedQVGError, ValueError):
    """A budget that is malformed, contradicts itself or leaves nothing for the KV cache (the message names the
    values and what would be valid)."""


@dataclass(frozen=True, slots=True)
class ResolvedBudget:
    """A budget in bytes per rank, where it came from (`source`, e.g. "--budget" or "--gpu H200") and the arithmetic
    (`lines`: label, bytes, op); `details` holds the device figures of a derived budget."""

    bytes: int
    source: str
    lines: tuple[dict[str, object], ...] = ()
    details: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: bytes, source, lines and, for a derived budget, gpu, device_bytes, memory_fraction,
        weights_bytes, weights_per_rank_bytes, weights_source, reserve_bytes (the plan JSON's `budget`)."""
        return {"bytes": self.bytes, "source": self.source, "lines": [dict(x) for x in self.lines], **self.details}


def _check_size(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise BudgetError(f"Budget.{name}={value!r} must be a whole number of bytes >= {minimum}")


@dataclass(frozen=True, slots=True)
class Budget:
    """Where the KV budget per rank comes from (bytes; see the module docstring for the three forms). Validated on
    construction: `BudgetError` naming the field otherwise."""

    bytes: int | None = None
    gpu: str | None = None
    memory_fraction: float | None = None
    weights: int | None = None  # model weights on the device before tensor parallelism, bytes
    reserve: int = 0  # activations and workspace, bytes
    device: str | None = None  # free-memory form only; default cuda when present, else cpu

    def __post_init__(self) -> None:
        _check_size("bytes", self.bytes, 1)
        _check_size("weights", self.weights, 0)
        _check_size("reserve", self.reserve, 0)
        if self.bytes is not None:
            extra = [n for n in ("gpu", "memory_fraction", "weights", "device") if getattr(self, n) is not None]
            if extra or self.reserve:
                raise BudgetError(
                    f"Budget(bytes=...) with {', '.join(extra or ['reserve'])}: bytes is the KV budget itself; give "
                    "either bytes, or gpu / memory_fraction with weights and reserve to derive it"
                )
            return
        if self.gpu is None and self.memory_fraction is None:
            raise BudgetError("Budget needs bytes, gpu (a device from the table) or memory_fraction (of free memory)")
        if self.gpu is not None and self.device is not None:
            raise BudgetError("Budget(gpu=..., device=...): gpu names the device to plan for; drop device")
        f = self.memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise BudgetError(f"Budget.memory_fraction={f!r} is out of range; valid: a number in (0, 1], e.g. 0.9")
        if self.gpu is not None:
            get_gpu(self.gpu)  # ValueError listing the known names

    @classmethod
    def parse(cls, text: str) -> Budget:
        """`Budget(bytes=parse_size(text))`: `24GiB`, `512MB`, `4096` (`pagedqvg.sizes`; `SizeError` otherwise)."""
        return cls(bytes=parse_size(text, name="budget", minimum=1))

    def resolve(self, w: Workload) -> ResolvedBudget:
        """The bytes per rank for workload `w` (its tp and default weights). A derived budget reads the device table
        or this machine's free memory now. `BudgetError` when nothing is left for the KV cache. O(1)."""
        if self.bytes is not None:
            line = {"label": "KV budget (--budget)", "bytes": self.bytes, "op": "="}
            return ResolvedBudget(self.bytes, "--budget", (line,))
        d = self._device_total(w)
        total, fraction, weights, source = int(d["total"]), float(d["fraction"]), int(d["weights"]), str(d["source"])
        usable = int(total * fraction)
        per_rank_weights = -(-weights // w.tp)
        budget = usable - per_rank_weights - self.reserve
        default = ", default with --gpu" if self.memory_fraction is None else ""
        tp_text = f" / --tp {w.tp}" if w.tp > 1 else ""
        lines = (
            {"label": d["label"], "bytes": total, "op": ""},
            {"label": f"x {fraction:g} (--memory-fraction{default})", "bytes": usable, "op": "="},
            {"label": f"weights{tp_text} ({d['wsource']})", "bytes": per_rank_weights, "op": "-"},
            {"label": "reserve for activations and workspace (--reserve)", "bytes": self.reserve, "op": "-"},
            {"label": "KV budget per rank (pool + one transient view)", "bytes": budget, "op": "="},
        )
        if budget <= 0:
            raise BudgetError(
                f"{source}: {format_bytes(usable)} usable (x {fraction:g}) minus weights "
                f"{format_bytes(per_rank_weights)} and reserve {format_bytes(self.reserve)} leaves nothing for the "
                "KV cache; lower --weights or --reserve, raise --memory-fraction or --tp, or pick a larger --gpu"
            )
        details = {
            "gpu": d["gpu"],
            "device_bytes": total,
            "memory_fraction": fraction,
            "weights_bytes": weights,
            "weights_per_rank_bytes": per_rank_weights,
            "weights_source": d["wsource"],
            "reserve_bytes": self.reserve,
        }
        return ResolvedBudget(budget, source, lines, details)

    def _device_total(self, w: Workload) -> dict[str, object]:
        """Where a derived budget starts: the table's total or the free memory on `device` now, with the fraction,
        weights (bytes, before tp) and the labels of the budget lines."""
        if self.gpu is not None:
            name, total, text = get_gpu(self.gpu)
            weights, wsource = w.weights_bytes, f"{w.name} default: {w.weights_source}"
            if self.weights is not None:
                weights, wsource = self.weights, "--weights"
            fraction = self.memory_fraction if self.memory_fraction is not None else DEFAULT_GPU_MEMORY_FRACTION
            return {"gpu": name, "total": total, "label": f"{text} total (--gpu {name})", "fraction": fraction,
                    "weights": weights, "wsource": wsource, "source": f"--gpu {name}"}  # fmt: skip
        device = self.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        fraction = self.memory_fraction
        assert fraction is not None and not math.isnan(fraction)  # __post_init__: gpu or memory_fraction
        return {
            "gpu": None,
            "total": available_memory_bytes(device),
            "label": f"free memory on {device} now (--memory-fraction without --gpu)",
            "fraction": fraction,
            "weights": self.weights or 0,
            "wsource": "--weights" if self.weights is not None else _FREE_MEMORY_WEIGHTS,
            "source": f"--memory-fraction {fraction:g} of free memory on {device}",
        }
