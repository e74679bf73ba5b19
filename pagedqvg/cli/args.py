"""The command line's argument types and checks: sizes (`pagedqvg.sizes.parse_size`), integers, fractions, the
quantization flags, which flag combinations mean nothing, and the `Workload` the flags describe.

Every mistake is a `UsageError` (a `PagedQVGError` and `ValueError`) whose message names the flags as typed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from pagedqvg.errors import PagedQVGError
from pagedqvg.planning.planner import compact_quant
from pagedqvg.planning.presets import Workload, get_preset
from pagedqvg.quant.config import SGLANG_KEYS, QuantConfig
from pagedqvg.quant.formats import QUANT_MODE_NAMES, TIER_FORMAT_NAMES
from pagedqvg.sizes import SizeError, parse_size
from pagedqvg.validation import check_int


class UsageError(PagedQVGError, ValueError):
    """A command-line mistake (reported as one line, exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse, but every usage error is one line on stderr (`pagedqvg: error: ...`) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(message)
        raise SystemExit(2)


def fail(message: str) -> None:
    one_line = " ".join(str(message).split())
    sys.stderr.write(f"pagedqvg: error: {one_line}\n")


# ---------------------------------------------------------------------------------------------------- arg types
def size_arg(flag: str, *, minimum: int = 1, example: str = "24GiB", auto: bool = False):
    """argparse type for `flag`: a size (`pagedqvg.sizes.parse_size`, the plugin's and the Python API's forms) of
    at least `minimum` bytes (one rule for `0`, `-5GiB` and `=-5GiB`), or `auto`."""

    def parse(text: str) -> int | str:
        if auto and text.strip().lower() == "auto":
            return "auto"
        negative = text.strip().startswith("-")  # refused by the range rule below, whatever follows the sign
        try:
            value = -1 if negative else parse_size(text, name=flag)
        except SizeError as exc:  # names the text, what it is and the valid forms (as the plugin says it)
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < minimum:
            rule = "> 0 bytes" if minimum == 1 else f">= {minimum} bytes"
            raise argparse.ArgumentTypeError(
                f"must be a size {rule}, got {text.strip()!r}; write it like {flag} {example}"
                + (" or auto" if auto else "")
            )
        return value

    parse.__name__ = "size"
    return parse


def int_arg(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (must be >= {minimum})") from None
        message = "{value} is out of range; must be an integer >= {minimum}"
        return check_int("value", value, minimum=minimum, error=argparse.ArgumentTypeError, message=message)

    parse.__name__ = f"int>={minimum}"
    return parse


def fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. --memory-fraction 0.9") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} is out of range; must be in (0, 1], e.g. --memory-fraction 0.9")
    return value


def int_list_arg(text: str) -> list[int]:
    """`--session-chunks 10,20,30`: positive ints."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, e.g. 10,20,30; got {text!r}")
    return values


# ---------------------------------------------------------------------------------------------------- parser
QUANT_FLAGS: tuple[tuple[str, str, dict], ...] = (
    (
        "--kv-cache-quant",
        "quantization of completed chunks: off, int4 or int2 (SGLang's), or compact: trit-packed symmetric int2, "
        "one fitted fp8 scale per 128 channels (per token-head when --head-dim is below 128), fp8 codebooks "
        "(QuantConfig.compact(); the preset's keep-recent/sink/sink-keep/seed apply, flags override) (default off)",
        {"choices": QUANT_MODE_NAMES},
    ),
    ("--kv-cache-quant-centroids", "k-means centroids per (head, stage), 1..256 (default 128)", {}),
    ("--kv-cache-quant-block-size", "channels per fp8 scale; divides head_dim (default 64)", {}),
    ("--kv-cache-quant-stages", "residual k-means stages (default 1)", {}),
    ("--kv-cache-quant-iters", "k-means iterations per stage (default 2)", {}),
    ("--kv-cache-quant-keep-recent", "completed chunks kept dense, in the cache dtype (default 1)", {}),
    ("--kv-cache-quant-sink-keep", "sink chunks kept dense when the sink is packed (default 0)", {}),
    ("--kv-cache-quant-asymmetric", "per-block scale and zero (default false)", {"nargs": "?", "const": "true"}),
    (
        "--kv-cache-quant-sink",
        "sink chunks' format: true (packed like the history, the default), false or bf16 (kept dense), or a tier "
        "format int4, int2, compact, fp8 (fp8 e4m3 with power-of-two scales per 32 channels)",
        {"nargs": "?", "const": "true"},
    ),
    (
        "--kv-cache-quant-recent",
        "format of the --kv-cache-quant-keep-recent chunks: bf16 (dense, default), fp8, int4, int2 or compact, no "
        "coarser than --kv-cache-quant (the history's); a chunk leaving the recent tier is repacked",
        {"choices": TIER_FORMAT_NAMES},
    ),
    ("--kv-cache-quant-seed", "k-means seed (default 1234)", {}),
    (
        "--kv-cache-quant-pack-trits",
        "pack symmetric int2 codes 5 per byte (default false; true with compact)",
        {"nargs": "?", "const": "true"},
    ),
    (
        "--kv-cache-quant-fit-scales",
        "fit each block's fp8 scale to its least squared error, symmetric codes only (default false; true with "
        "compact)",
        {"nargs": "?", "const": "true"},
    ),
    (
        "--kv-cache-quant-codebook-fp8",
        "store codebooks as fp8 e4m3, 1 B per centroid value (default false; true with compact)",
        {"nargs": "?", "const": "true"},
    ),
)
#: What `--kv-cache-quant compact` fixes: flag -> (QuantConfig field, compact's value). Typing the opposite is refused.
_COMPACT_FIXED: dict[str, tuple[str, bool]] = {
    "--kv-cache-quant-pack-trits": ("pack_trits", True),
    "--kv-cache-quant-fit-scales": ("fit_scales", True),
    "--kv-cache-quant-codebook-fp8": ("codebook_fp8", True),
    "--kv-cache-quant-asymmetric": ("asymmetric", False),
}


# ---------------------------------------------------------------------------------------------------- workload
_WORKLOAD_FLAGS = (
    "layers",
    "heads",
    "head_dim",
    "tokens_per_frame",
    "chunk_frames",
    "sink_frames",
    "window_frames",
    "sink_tokens",
    "global_sink_tokens",
    "cache_size_tokens",
    "attention_window_tokens",
    "scene_cut_every",
    "denoise_steps",
    "batch_size",
    "dtype",
    "cache_sets",
    "sessions",
    "ulysses",
    "tp",
    "chunks",
)

#: QuantConfig field -> the flag that sets it.
_QUANT_FIELD_FLAGS = {field: "--" + key.replace("_", "-") for key, field in SGLANG_KEYS.items()}


def speak_flags(message: str) -> str:
    """`message` with internal names (`QuantConfig.centroids=999`, `head_dim=48`, `device='cpu'`) written as the
    flags a user types (`--kv-cache-quant-centroids 999`, `--head-dim 48`, `--device cpu`)."""

    def quant(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        if name == "bits":
            value = {"None": "off", "2": "int2", "4": "int4"}.get(value, value)
        elif value in ("True", "False"):
            value = value.lower()
        return f"{_QUANT_FIELD_FLAGS[name]} {value}"

    fields = "|".join(sorted(_QUANT_FIELD_FLAGS, key=len, reverse=True))
    message = re.sub(rf"(?:QuantConfig\.|PackedFormat\.cfg\.)?\b({fields})=([^\s,;:)]+)", quant, message)
    message = re.sub(r"\bQuantConfig\.(\w+)", lambda m: _QUANT_FIELD_FLAGS.get(m.group(1), m.group(0)), message)
    message = re.sub(
        r"\b(kv_cache_quant\w*)=",
        lambda m: "--" + m.group(1).replace("_", "-") + " ",
        message,
    )
    message = re.sub(r"\bhead_dim=(\d+)", r"--head-dim \1", message)
    message = re.sub(r"\bnum_heads=(\d+)", r"--heads \1", message)
    message = re.sub(r"\bdevice[= ]'([\w:]+)'", r"--device \1", message)
    return message


def typed_flags(argv: list[str]) -> set[str]:
    """The long flags present in `argv` (`--budget=1` counts as `--budget`)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def join_negative_values(argv: list[str]) -> list[str]:
    """`--budget -5GiB` as `--budget=-5GiB`: argparse would take `-5GiB` for an option and say only that the flag
    needs a value; joined, the flag's own rule reports it (`must be a size > 0 bytes`)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" not in a and i + 1 < len(argv) and re.match(r"-[0-9.]", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def check_device(text: str) -> str:
    """`text` if it names a device pagedqvg runs on (`cpu`, `cuda`, `cuda:N`), else UsageError naming `--device`."""
    if re.fullmatch(r"cpu|cuda(:[0-9]+)?", text.strip()):
        return text.strip()
    raise UsageError(
        f"--device {text}: pagedqvg runs on cpu or cuda (e.g. --device cpu, --device cuda, --device cuda:1)"
    )


def check_combinations(args: argparse.Namespace, typed: set[str]) -> None:
    """UsageError naming the flags when a combination means nothing (or contradicts itself)."""
    quant_knobs = sorted(f for f, _h, _e in QUANT_FLAGS if f != "--kv-cache-quant" and f in typed)
    mode = getattr(args, "kv_cache_quant", None)
    if quant_knobs and (mode == "off" or (mode is None and not get_preset(args.preset).quant.enabled)):
        # the same refusal whether off is typed or the preset's default
        off = "--kv-cache-quant off" if mode == "off" else f"quantization off (--preset {args.preset}'s default)"
        raise UsageError(
            f"{', '.join(quant_knobs)} has no effect with {off}; drop it, or choose "
            "--kv-cache-quant int2, int4 or compact"
        )
    if getattr(args, "kv_cache_quant", None) == "compact":
        for flag, (name, fixed) in _COMPACT_FIXED.items():
            text = getattr(args, flag.lstrip("-").replace("-", "_"), None)
            if text is None:
                continue
            value = getattr(QuantConfig.from_dict({flag: text}), name)  # ValueError for a bad boolean
            if value != fixed:
                raise UsageError(
                    f"--kv-cache-quant compact with {flag} {str(value).lower()}: compact is symmetric int2, "
                    "trit-packed, with fitted scales and fp8 codebooks; drop the flag, or use --kv-cache-quant int2 "
                    "with the --kv-cache-quant-pack-trits/-fit-scales/-codebook-fp8 flags you want"
                )
    pairs = (
        ("--sink-tokens", "--sink-frames", "--sink-tokens sets the sink in tokens, --sink-frames in frames"),
        ("--cache-size", "--window-frames", "--cache-size fixes the cache, --window-frames derives it"),
    )
    for a, b, why in pairs:
        if a in typed and b in typed:
            raise UsageError(f"{a} and {b} together: {why}; give one")
    if args.device is not None:
        check_device(args.device)
    _check_fork_flags(args, typed)
    if args.command == "plan":
        if args.chunks is not None:
            raise UsageError(
                "--chunks applies to pagedqvg simulate only: plan computes the steady state, not a run of N chunks"
            )
        if args.budget is not None:
            for flag in ("--gpu", "--memory-fraction", "--weights", "--reserve", "--device"):
                if flag in typed:
                    raise UsageError(
                        f"--budget and {flag} together: --budget is the KV budget itself; use --gpu with "
                        "--memory-fraction/--weights/--reserve to derive it instead"
                    )
        if args.gpu is not None and args.device is not None:
            raise UsageError("--gpu and --device together: --gpu names the device to plan for; drop --device")
        if args.gpu is None and args.memory_fraction is None:
            for flag in ("--weights", "--reserve", "--device"):
                if flag in typed:
                    need = "--memory-fraction" if flag == "--device" else "--gpu NAME or --memory-fraction"
                    raise UsageError(f"{flag} needs a device budget to act on: add {need}")
    else:
        if args.dry_run:
            for flag in ("--device", "--seed"):
                if flag in typed:
                    raise UsageError(f"--dry-run and {flag} together: the dry run uses no device and no data")


def _check_fork_flags(args: argparse.Namespace, typed: set[str]) -> None:
    """UsageError naming the flags when --branches / --host-budget and their companions mean nothing together."""
    branches, host = getattr(args, "branches", None), getattr(args, "host_budget", None)
    for flag in ("--diverge-chunks", "--fork-at-chunk"):
        if flag in typed and branches is None:
            raise UsageError(f"{flag} applies to --branches N only; add --branches N (N >= 1) or drop {flag}")
    if branches is not None and host is not None:
        raise UsageError("--branches and --host-budget together: plan one at a time (branches of one session, or "
                         "sessions per device with a host tier)")  # fmt: skip
    if branches is None and host is None:
        if args.command == "simulate" and getattr(args, "budget", None) is not None:
            raise UsageError("--budget applies to pagedqvg simulate only with --host-budget (the device pool beside "
                             "the host tier); drop it, or add --host-budget SIZE")  # fmt: skip
        return
    flag = "--branches" if branches is not None else "--host-budget"
    for other in ("--stagger", "--session-chunks", "--sessions"):
        if other in typed:
            raise UsageError(f"{flag} and {other} together: {flag} plans one session's caches (its branches, or how "
                             f"many sessions fit); drop {other}")  # fmt: skip
    if args.command == "simulate" and "--chunks" in typed:
        raise UsageError(f"{flag} and --chunks together: " + ("the session runs --fork-at-chunk chunks, then "
                         "--diverge-chunks per branch" if branches is not None else "each session runs to its steady "
                         "state"))  # fmt: skip
    if host is not None:
        if args.command == "plan" and args.budget is None and args.gpu is None and args.memory_fraction is None:
            raise UsageError("--host-budget needs a device budget beside it: add --budget SIZE, --gpu NAME or "
                             "--memory-fraction F (the device pool its resident sessions share)")  # fmt: skip
        if args.command == "simulate" and args.budget is None:
            raise UsageError("--host-budget needs --budget SIZE beside it in pagedqvg simulate (the device pool its "
                             "resident sessions share, e.g. --budget 4MiB)")  # fmt: skip


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The preset with every given flag applied. ValueError for a bad value (exit status 2)."""
    w = get_preset(args.preset)
    w = w.replace(**{name: getattr(args, name) for name in _WORKLOAD_FLAGS})
    if args.page_bytes == "auto":
        w = dataclasses.replace(w, page_bytes=None)
    elif args.page_bytes is not None:
        w = dataclasses.replace(w, page_bytes=args.page_bytes)
    if getattr(args, "weights", None) is not None:
        w = dataclasses.replace(w, weights_bytes=args.weights, weights_source="--weights")
    given = {}
    for flag, _help, _extra in QUANT_FLAGS:
        key = flag.lstrip("-").replace("-", "_")
        value = getattr(args, key)
        if value is not None:
            given[SGLANG_KEYS[key]] = value
    if given.get("bits") == "compact":
        # compact's format fields (not the preset's, e.g. its block 64), the preset's policy, then the typed flags
        del given["bits"]
        base = compact_quant(w.quant, None if "block_size" in given else w.head_dim)
        if "block_size" not in given and w.head_dim % base.block_size:
            divisors = [d for d in range(1, w.head_dim + 1) if w.head_dim % d == 0]
            raise UsageError(
                f"--kv-cache-quant compact packs blocks of {base.block_size} channels, which do not divide --head-dim "
                f"{w.head_dim}; use a --head-dim that is a multiple of {base.block_size} (or below it), or add "
                f"--kv-cache-quant-block-size with a divisor of {w.head_dim}: {', '.join(map(str, divisors))}"
            )
        merged = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        merged.update(given)
        w = w.replace(quant=QuantConfig.from_dict(merged))
    elif given:
        merged = {f.name: getattr(w.quant, f.name) for f in dataclasses.fields(w.quant)}
        merged.update(given)
        w = w.replace(quant=QuantConfig.from_dict(merged))
    return w
