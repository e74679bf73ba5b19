"""The `pagedqvg` command: `pagedqvg plan` (what fits) and `pagedqvg simulate` (run the real pool and prove it).

Bad input (an unknown preset, a negative size, a window smaller than a chunk, a budget too small for even the sink,
flags that mean nothing together) prints one line `pagedqvg: error: ...` on stderr, naming the flags as typed, and
exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from pagedqvg import __version__
from pagedqvg.allocator import available_memory_bytes, format_bytes
from pagedqvg.planning.planner import (
    ATTENTION_MODES,
    COMPACT_BLOCK,
    Geometry,
    compact_quant,
    max_sessions,
    max_window_frames,
    min_window_frames,
    plan_geometry,
    search_limit_frames,
    setting_geometries,
)
from pagedqvg.planning.presets import (
    DEFAULT_GPU_MEMORY_FRACTION,
    DEFAULT_PLAN_PRESET,
    DEFAULT_SIMULATE_PRESET,
    GPUS,
    PRESETS,
    Workload,
    get_gpu,
    get_preset,
    quant_as_dict,
    shape_text,
)
from pagedqvg.planning.tiers import dense_label, tier_summary, tier_used_bytes
from pagedqvg.quant.config import SGLANG_KEYS, QuantConfig
from pagedqvg.validation import DTYPES_BY_NAME, PAGE_ALIGN_BYTES, check_int

PLAN_SCHEMA = "pagedqvg.plan/2"
DEFAULT_OUT_DIR = "./pagedqvg-out"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


class UsageError(ValueError):
    """A command-line mistake (reported as one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but every usage error is one line on stderr (`pagedqvg: error: ...`) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(message)
        raise SystemExit(2)


def _fail(message: str) -> None:
    one_line = " ".join(str(message).split())
    sys.stderr.write(f"pagedqvg: error: {one_line}\n")


# ---------------------------------------------------------------------------------------------------- arg types
_SIZE_RE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
_SIZE_HINT = "units B, KiB, MiB, GiB, TiB (x1024) or KB, MB, GB, TB (x1000)"


def _size_value(text: str) -> int:
    """Bytes from `24GiB`, `1.5 GiB`, `512MB`, `2M` (binary), `4096` (any sign: `_size` checks the range)."""
    m = _SIZE_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 24GiB, 512MiB, 2MB or 4096 ({_SIZE_HINT})"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _size(flag: str, *, minimum: int = 1, example: str = "24GiB", auto: bool = False):
    """argparse type for `flag`: a size >= `minimum` bytes (one rule for `0`, `-5GiB` and `=-5GiB`), or `auto`."""

    def parse(text: str) -> int | str:
        if auto and text.strip().lower() == "auto":
            return "auto"
        value = _size_value(text)
        if value < minimum:
            rule = "> 0 bytes" if minimum == 1 else f">= {minimum} bytes"
            raise argparse.ArgumentTypeError(
                f"must be a size {rule}, got {text.strip()!r}; write it like {flag} {example}"
                + (" or auto" if auto else "")
            )
        return value

    parse.__name__ = "size"
    return parse


def _int(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (must be >= {minimum})") from None
        message = "{value} is out of range; must be an integer >= {minimum}"
        return check_int("value", value, minimum=minimum, error=argparse.ArgumentTypeError, message=message)

    parse.__name__ = f"int>={minimum}"
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. --memory-fraction 0.9") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} is out of range; must be in (0, 1], e.g. --memory-fraction 0.9")
    return value


# ---------------------------------------------------------------------------------------------------- parser
_QUANT_FLAGS: tuple[tuple[str, str, dict], ...] = (
    (
        "--kv-cache-quant",
        "quantization of completed chunks: off, int4 or int2 (SGLang's), or compact: trit-packed symmetric int2, "
        "one fitted fp8 scale per 128 channels (per token-head when --head-dim is below 128), fp8 codebooks "
        "(QuantConfig.compact(); the preset's keep-recent/sink/sink-keep/seed apply, flags override) (default off)",
        {"choices": ("off", "int4", "int2", "compact")},
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
        {"choices": ("bf16", "fp8", "int4", "int2", "compact")},
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


def _add_common(p: argparse.ArgumentParser, default_preset: str, *, simulate: bool) -> None:
    g = p.add_argument_group("workload (every field overrides the preset)")
    g.add_argument(
        "--preset", choices=sorted(PRESETS), default=default_preset, help=f"model preset (default {default_preset})"
    )
    g.add_argument("--layers", type=_int(1), help="transformer layers (one cache each)")
    g.add_argument("--heads", type=_int(1), help="K/V heads per layer")
    g.add_argument("--head-dim", type=_int(1), help="channels per head")
    g.add_argument("--tokens-per-frame", type=_int(1), help="tokens per latent frame")
    g.add_argument("--chunk-frames", type=_int(1), help="frames per chunk (one advance)")
    g.add_argument("--sink-frames", type=_int(0), help="sink frames")
    g.add_argument("--window-frames", type=_int(1), help="rolling window in frames, the current chunk included")
    g.add_argument("--sink-tokens", type=_int(0), help="sink tokens S (default sink-frames x tokens-per-frame)")
    g.add_argument("--global-sink-tokens", type=_int(0), help="global sink tokens GS (default S or 0, per preset)")
    g.add_argument(
        "--cache-size",
        type=_int(1),
        dest="cache_size_tokens",
        help="cache_size C in tokens (default max(S, GS) + window)",
    )
    g.add_argument(
        "--attention-window",
        type=_int(0),
        dest="attention_window_tokens",
        help="attention_window_size W in tokens (default 0 = C)",
    )
    g.add_argument("--scene-cut-every", type=_int(0), help="pin the current chunk every N chunks (0: never)")
    g.add_argument("--denoise-steps", type=_int(1), help="denoise steps per chunk (calls = steps + 1 clean pass)")
    g.add_argument("--batch-size", type=_int(1), help="batch size")
    g.add_argument("--dtype", choices=sorted(DTYPES_BY_NAME), help="cache dtype (default bf16)")
    g.add_argument(
        "--page-bytes",
        type=_size("--page-bytes", example="2MiB", auto=True),
        help=f"pool page size, a multiple of {PAGE_ALIGN_BYTES} B, or auto (default): the size whose pages waste "
        "least for the record sizes of every segment kind in use (<= 0.5%% per kind where reachable)",
    )
    g.add_argument("--cache-sets", type=_int(1), help="cache sets per session (2 with classifier-free guidance)")
    g.add_argument("--sessions", type=_int(1), help="concurrent sessions sharing the pool (default 1)")
    g.add_argument(
        "--ulysses", type=_int(1), help="Ulysses sequence-parallel ranks: each rank caches heads / N of every token"
    )
    g.add_argument("--tp", type=_int(1), help="tensor-parallel ranks: heads (and weights) split N ways")
    # plan accepts --chunks only to refuse it with a reason (check_combinations); its --help does not offer it
    chunks_help = "chunks to simulate (default 20)" if simulate else argparse.SUPPRESS
    g.add_argument("--chunks", type=_int(1), help=chunks_help)
    g.add_argument("--stagger", type=_int(0), help="sessions start this many chunks apart (planning/stagger.py)")
    g.add_argument(
        "--session-chunks", type=_int_list, help="with --stagger: chunks each session runs, e.g. 10,20,30"
    )
    q = p.add_argument_group("quantization (SGLang flag names)")
    for flag, help_text, extra in _QUANT_FLAGS:
        q.add_argument(
            flag,
            dest=flag.lstrip("-").replace("-", "_"),
            metavar=None if "choices" in extra else "V",
            help=help_text,
            **extra,
        )


def _add_attention_arg(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--attention",
        choices=ATTENTION_MODES,
        default="view",
        help="view: each call builds a transient K/V view (update_and_get_attention_kv); pages: update_and_attend "
        "(attention from pages: a window-independent scratch instead). Budget lines show both (default view)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `pagedqvg` argument parser."""
    parser = _Parser(
        prog="pagedqvg",
        description="Size and test the paged KV cache of autoregressive video diffusion models.",
    )
    parser.add_argument("--version", action="version", version=f"pagedqvg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{plan,simulate}")
    plan = sub.add_parser(
        "plan",
        help="steady-state memory per layer and for all layers; what fits a budget",
        description="Exact steady-state bytes (dense cache, paged dense, packed) from the page and segment layout; "
        "with --budget or --memory-fraction, the largest window that fits for each quantization setting.",
    )
    _add_common(plan, DEFAULT_PLAN_PRESET, simulate=False)
    b = plan.add_argument_group("budget (per rank; pool + one transient view)")
    b.add_argument("--budget", type=_size("--budget"), help="bytes for the KV cache itself, e.g. 24GiB")
    b.add_argument(
        "--gpu",
        help=f"a whole device from the table: {', '.join(GPUS)}; budget = memory x --memory-fraction - "
        "--weights / --tp - --reserve",
    )
    b.add_argument(
        "--memory-fraction",
        type=_fraction,
        help=f"fraction of the device's memory pagedqvg may use (with --gpu: of its total, default "
        f"{DEFAULT_GPU_MEMORY_FRACTION:g}; alone: of this machine's free memory on --device)",
    )
    b.add_argument(
        "--weights",
        type=_size("--weights", minimum=0, example="28GB"),
        help="model weights on the device before tensor parallelism (default with --gpu: the preset's DiT weights)",
    )
    b.add_argument(
        "--reserve", type=_size("--reserve", minimum=0, example="8GiB"), help="activations and workspace (default 0)"
    )
    b.add_argument(
        "--device", default=None, help="device for --memory-fraction without --gpu (default cuda if present)"
    )
    _add_attention_arg(plan)
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(func=cmd_plan)

    sim = sub.add_parser(
        "simulate",
        help="run the real pool and caches over N chunks; memory timeline (JSON + PNG) vs plan",
        description="Runs every layer's cache on one pool (sized exactly at the plan's pages) with the preset's "
        "call pattern on synthetic video K/V, records memory per call and compares it with the plan. Without "
        f"arguments: preset {DEFAULT_SIMULATE_PRESET} on the CPU. Exit status 0: measured and plan agree within 1%; "
        "1: they do not; 2: bad input.",
    )
    _add_common(sim, DEFAULT_SIMULATE_PRESET, simulate=True)
    sim.add_argument("--out", default=DEFAULT_OUT_DIR, help=f"output directory (default {DEFAULT_OUT_DIR}/)")
    sim.add_argument(
        "--dry-run", action="store_true", help="accounting only, at full size, without tensors (seconds on a CPU)"
    )
    sim.add_argument("--device", default=None, help="device of the pool and data: cpu or cuda (default cpu)")
    sim.add_argument("--seed", type=_int(0), default=None, help="seed of the synthetic K/V (default 0)")
    sim.add_argument("--json", action="store_true", help="print the summary as JSON")
    sim.add_argument("--no-plot", action="store_true", help="skip timeline.png")
    sim.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    sim.set_defaults(func=cmd_simulate)
    return parser


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


def _typed_flags(argv: list[str]) -> set[str]:
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
    quant_knobs = sorted(f for f, _h, _e in _QUANT_FLAGS if f != "--kv-cache-quant" and f in typed)
    if getattr(args, "kv_cache_quant", None) == "off" and quant_knobs:
        raise UsageError(
            f"{', '.join(quant_knobs)} has no effect with --kv-cache-quant off; drop it, or choose "
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
    for flag, _help, _extra in _QUANT_FLAGS:
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


# ---------------------------------------------------------------------------------------------------- plan
def _n(x: int) -> str:
    return f"{x:,}"


def _segment_pages_text(s: dict, dtype: str) -> str:
    """One setting's pages of one chunk-sized segment; dense segments are labelled with the cache `dtype`."""
    if s["mode"] == "off":
        return f"{dtype} {s['segment_pages']['bf16']} pages"
    return f"{s['mode']} {s['segment_pages']['packed']} pages"


def _attention_fits(geom: Geometry, budget: int, lo: int) -> dict[str, dict[str, object]]:
    """Per attention mode: the largest window (frames) that fits `budget`, its budget and the transient bytes."""
    out: dict[str, dict[str, object]] = {}
    for mode in ATTENTION_MODES:
        g = dataclasses.replace(geom, attention=mode)
        frames = max_window_frames(g, budget, lo)
        p = plan_geometry(g.with_window_frames(frames if frames is not None else lo), replay=False)
        out[mode] = {"max_window_frames": frames, "budget_bytes": p.budget_bytes, "transient_bytes": p.view_bytes}
    return out


def _budget_fits(w: Workload, budget: int, source: str, attention: str = "view") -> list[dict[str, object]]:
    rows = []
    for geom in setting_geometries(w)[0]:
        geom = dataclasses.replace(geom, attention=attention)
        lo = min_window_frames(geom, w.chunk_frames)
        frames = max_window_frames(geom, budget, lo)
        row: dict[str, object] = {
            "mode": geom.quant.mode,
            "page_bytes": geom.page_bytes,
            "max_window_frames": frames,
            "search_limited": frames == search_limit_frames(geom),
            "cache_size_tokens": None,
            "budget_bytes": None,
            "pool_bytes": None,
            "min_window_frames": lo,
            "min_budget_bytes": plan_geometry(geom.with_window_frames(lo), replay=False).budget_bytes,
            "max_sessions": max_sessions(geom, budget),
            "by_attention": _attention_fits(geom, budget, lo),
        }
        if frames is not None:
            p = plan_geometry(geom.with_window_frames(frames), replay=False)
            row.update(
                cache_size_tokens=geom.with_window_frames(frames).cache_size,
                budget_bytes=p.budget_bytes,
                pool_bytes=p.pool_bytes,
            )
        rows.append(row)
    if all(r["max_window_frames"] is None for r in rows):
        best = min(rows, key=lambda r: int(r["min_budget_bytes"]))  # type: ignore[arg-type]
        raise UsageError(
            f"{source} leaves {format_bytes(budget)} for the KV cache per rank: too small for even the sink and one "
            f"chunk; the smallest window ({best['min_window_frames']} frames, {w.sessions} session(s)) needs "
            f"{format_bytes(int(best['min_budget_bytes']))} with {best['mode']}"
        )
    return rows


_FREE_MEMORY_WEIGHTS = "0: the free memory measured now excludes what is loaded"


def _device_total(args: argparse.Namespace, w: Workload) -> dict[str, object]:
    """Where the budget starts: the `--gpu` table's total, or this machine's free memory on `--device` now, with the
    fraction, weights (bytes, before --tp) and the labels the budget lines use."""
    if args.gpu is not None:
        name, total, text = get_gpu(args.gpu)
        return {
            "gpu": name,
            "total": total,
            "label": f"{text} total (--gpu {name})",
            "fraction": args.memory_fraction if args.memory_fraction is not None else DEFAULT_GPU_MEMORY_FRACTION,
            "weights": w.weights_bytes,
            "wsource": w.weights_source if w.weights_source == "--weights" else f"{w.name} default: {w.weights_source}",
            "source": f"--gpu {name}",
        }
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    fraction = args.memory_fraction
    return {
        "gpu": None,
        "total": available_memory_bytes(device),
        "label": f"free memory on {device} now (--memory-fraction without --gpu)",
        "fraction": fraction,
        "weights": args.weights or 0,
        "wsource": "--weights" if args.weights is not None else _FREE_MEMORY_WEIGHTS,
        "source": f"--memory-fraction {fraction:g} of free memory on {device}",
    }


def resolve_budget(args: argparse.Namespace, w: Workload) -> dict[str, object] | None:
    """The KV budget per rank and the arithmetic that made it (JSON-ready), or None without a budget flag.

    `--budget B`: B. `--gpu NAME`: the table's total x `--memory-fraction` (default 0.9) - weights / tp - `--reserve`.
    `--memory-fraction F` alone: F x this machine's free memory on `--device` - `--weights` (0 unless given: the
    free memory is measured with whatever is loaded) / tp - `--reserve`. UsageError when nothing is left.
    """
    if args.budget is not None:
        line = {"label": "KV budget (--budget)", "bytes": args.budget, "op": "="}
        return {"bytes": args.budget, "source": "--budget", "lines": [line]}
    if args.gpu is None and args.memory_fraction is None:
        return None
    d = _device_total(args, w)
    total, fraction, weights, source = int(d["total"]), float(d["fraction"]), int(d["weights"]), str(d["source"])
    reserve = args.reserve or 0
    usable = int(total * fraction)
    per_rank_weights = -(-weights // w.tp)
    budget = usable - per_rank_weights - reserve
    default = ", default with --gpu" if args.memory_fraction is None else ""
    tp_text = f" / --tp {w.tp}" if w.tp > 1 else ""
    lines = [
        {"label": d["label"], "bytes": total, "op": ""},
        {"label": f"x {fraction:g} (--memory-fraction{default})", "bytes": usable, "op": "="},
        {"label": f"weights{tp_text} ({d['wsource']})", "bytes": per_rank_weights, "op": "-"},
        {"label": "reserve for activations and workspace (--reserve)", "bytes": reserve, "op": "-"},
        {"label": "KV budget per rank (pool + one transient view)", "bytes": budget, "op": "="},
    ]
    if budget <= 0:
        raise UsageError(
            f"{source}: {format_bytes(usable)} usable (x {fraction:g}) minus weights {format_bytes(per_rank_weights)} "
            f"and reserve {format_bytes(reserve)} leaves nothing for the KV cache; lower --weights or --reserve, raise "
            "--memory-fraction or --tp, or pick a larger --gpu"
        )
    return {
        "bytes": budget,
        "source": source,
        "lines": lines,
        "gpu": d["gpu"],
        "device_bytes": total,
        "memory_fraction": fraction,
        "weights_bytes": weights,
        "weights_per_rank_bytes": per_rank_weights,
        "weights_source": d["wsource"],
        "reserve_bytes": reserve,
    }


def _tier_doc(g: Geometry) -> dict[str, object]:
    """Formats by age of one setting: each role's format and steady-state bytes (rows, codebooks included, no page
    rounding) per layer and for all caches (`pagedqvg.planning.tiers`)."""
    per = tier_used_bytes(g)
    formats = {role: dense_label(g, "bf16" if role == "current" else g.quant.tier_format(role)) for role in per}
    return {"formats": formats, "bytes_per_layer": per, "bytes_all_layers": {r: b * g.caches for r, b in per.items()},
            "summary": tier_summary(g)}  # fmt: skip


def _tier_lines(settings: list) -> list[str]:
    """One line per packed setting: its tiers' formats and bytes for all caches."""
    return [f"  tiers of paged {s['mode']}: {s['tiers']['summary']}" for s in settings if s["mode"] != "off"]


def build_plan(
    w: Workload, budget: dict[str, object] | int | None = None, budget_source: str = "", attention: str = "view"
) -> dict[str, object]:
    """The plan as a JSON-ready dict (schema `pagedqvg.plan/2`). `budget`: from `resolve_budget`, or bytes.
    `attention`: "view" (a transient view per call) or "pages" (update_and_attend's scratch instead)."""
    if isinstance(budget, int):
        budget = {"bytes": budget, "source": budget_source, "lines": []}
    geom = Geometry.from_workload(w)
    geoms, skipped = setting_geometries(w)
    geoms = [dataclasses.replace(g, attention=attention) for g in geoms]
    settings = [plan_geometry(g) for g in geoms]
    dense = geom.dense
    doc: dict[str, object] = {
        "schema": PLAN_SCHEMA,
        "workload": w.as_dict(),
        "geometry": {
            "caches": geom.caches,
            "sessions": geom.sessions,
            "cache_sets": geom.cache_sets,
            "ranks": geom.ranks,
            "heads_per_rank": geom.heads,
            "chunk_tokens": geom.chunk_tokens,
            "sink_tokens": geom.sink_tokens,
            "global_sink_tokens": geom.global_sink_tokens,
            "effective_sink_tokens": geom.effective_sink,
            "window_tokens": geom.window_tokens,
            "cache_size_tokens": geom.cache_size,
            "attention_window_tokens": geom.attention_window or geom.cache_size,
            "page_bytes": geom.page_bytes,
            "dense_row_bytes": dense.row_bytes,
            "dense_rows_per_page": dense.rows_per_page,
            "dense_tokens_per_page": dense.tokens_per_page,
            "dense_cache_bytes_per_layer": geom.dense_cache_bytes(),
            "dense_cache_bytes_all_layers": geom.dense_cache_bytes() * geom.caches,
        },
        "selected": w.quant.mode,
        "settings": [],
        "unavailable": [{"mode": mode, "reason": reason} for mode, reason in skipped],
        "budget": None,
    }
    for g, p in zip(geoms, settings, strict=True):
        d = p.as_dict()
        d["quant"] = quant_as_dict(g.quant)
        d["page_auto"] = g.page_choice is not None
        d["page_waste_by_kind"] = dict(g.page_choice.waste) if g.page_choice is not None else None
        d["tiers"] = _tier_doc(g)
        doc["settings"].append(d)  # type: ignore[union-attr]
    if budget is not None:
        doc["budget"] = {**budget, "fits": _budget_fits(w, int(budget["bytes"]), str(budget["source"]), attention)}
    return doc


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """`rows` as table lines: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows
    ]


def _plan_header_lines(w: dict, g: dict, settings: list, dt: str) -> list[str]:
    """The plan's first lines: workload, ranks, caches, chunk, sink, window and one chunk segment's pages."""
    tpf = int(w["tokens_per_frame"])
    steps = int(w["denoise_steps"])
    wl = Workload(**{k: v for k, v in w.items() if k != "quant"})
    lines = [
        f"pagedqvg plan: {w['name']}"
        + (f" ({w['description']})" if w.get("description") else "")
        + f": {shape_text(wl)}",
        f"  model   {w['layers']} layers x {w['heads']} heads x {w['head_dim']} head_dim, {w['dtype']}, batch "
        f"{w['batch_size']}",
    ]
    if g["ranks"] > 1:
        lines.append(
            f"  ranks   --ulysses {w['ulysses']} x --tp {w['tp']} = {g['ranks']} ranks: {g['heads_per_rank']} heads "
            "per rank; every figure below is per rank (one GPU)"
        )
    return [
        *lines,
        f"  caches  {g['sessions']} session(s) x {g['cache_sets']} cache set(s) x {w['layers']} layers = "
        f"{g['caches']} caches in one pool",
        f"  chunk   {w['chunk_frames']} frames = {_n(g['chunk_tokens'])} tokens; {steps} denoise steps + 1 clean pass"
        f" = {steps + 1} calls per chunk and layer"
        + (f"; scene-cut pin every {w['scene_cut_every']} chunks" if w["scene_cut_every"] else ""),
        f"  sink    S = {_n(g['sink_tokens'])}, global GS = {_n(g['global_sink_tokens'])}, effective E = "
        f"{_n(g['effective_sink_tokens'])} tokens ({g['effective_sink_tokens'] / tpf:g} frames)",
        f"  window  {_n(g['window_tokens'])} tokens ({g['window_tokens'] / tpf:g} frames, current chunk included);"
        f" cache_size C = {_n(g['cache_size_tokens'])} slots; attention window W = "
        f"{_n(g['attention_window_tokens'])}",
        f"  pages   {dt} token row {_n(g['dense_row_bytes'])} B (K or V); one chunk segment: "
        + ", ".join(f"{_segment_pages_text(s, dt)} of {format_bytes(s['page_bytes'])}" for s in settings)
        + ("" if w["page_bytes"] is not None else " (auto page size per setting)"),
        "",
    ]


_PLAN_COLUMNS = (
    "",
    "page",
    "segments/layer",
    "pages/layer",
    "per layer",
    "all caches",
    "vs dense",
    "waste",
    "pool pages",
    "budget needed",
)


def _plan_setting_row(s: dict, selected: str, dt: str) -> tuple[str, ...]:
    """One paged setting's row of the plan table (per layer and all caches, pages, waste, budget)."""
    per, allb = s["per_layer"], s["all_layers"]
    mark = " *" if s["mode"] == selected else ""
    name = f"paged {dt}" if s["mode"] == "off" else f"paged {s['mode']}"
    waste = per["waste_bytes"] / per["bytes"] if per["bytes"] else 0.0
    segs = f"{per['bf16_segments']} {dt}"
    if per["packed_segments"]:
        segs += f" + {per['packed_segments']} packed"
    return (
        name + mark,
        format_bytes(s["page_bytes"]),
        segs,
        _n(per["pages"]),
        format_bytes(per["bytes"]),
        format_bytes(allb["bytes"]),
        f"{s['ratio_vs_dense']:.2f}x",
        f"{100 * waste:.2f}%",
        _n(s["pool_pages"]),
        format_bytes(s["budget_bytes"]),
    )


def _plan_table_lines(doc: dict, g: dict, settings: list, dt: str) -> list[str]:
    """The table (dense reference, then every setting) and the notes under it."""
    dense = (
        f"dense {dt} (reference)",
        "-",
        "-",
        "-",
        format_bytes(g["dense_cache_bytes_per_layer"]),
        format_bytes(g["dense_cache_bytes_all_layers"]),
        "1.00x",
        "-",
        "-",
        "-",
    )
    rows = [_PLAN_COLUMNS, dense] + [_plan_setting_row(s, str(doc["selected"]), dt) for s in settings]
    lines = _aligned(rows)
    for item in doc.get("unavailable") or []:
        lines.append(f"  paged {item['mode']}: not possible with this shape: {speak_flags(item['reason'])}")
    head_dim = doc["workload"]["head_dim"]  # type: ignore[index]
    for s in settings:
        block = s.get("quant", {}).get("block_size")
        if s["mode"] == "compact" and block is not None and block != COMPACT_BLOCK:
            why = " (head_dim below 128: one fitted scale per token-head)" if block == head_dim else ""
            lines.append(f"  paged compact: blocks of {block} channels per fitted scale{why}")
    lines += _tier_lines(settings)
    view = settings[0]
    transient = (
        f"  transient view: {_n(view['transient_view_tokens'])} tokens = {format_bytes(view['transient_view_bytes'])}"
        " per call, one layer at a time, outside the pool"
    )
    if view.get("attention") == "pages":
        transient = (
            f"  attention from pages (--attention pages): scratch {format_bytes(view['transient_view_bytes'])} per "
            f"call ({doc['settings'][0]['mode']}; packed modes add their tile decode), one layer at a time, no view"
        )
    return [
        *lines,
        "",
        transient,
        "  budget needed = pool pages x page size + one transient view (or the attention scratch)",
        f"  * selected quantization ({doc['selected']}); vs dense = dense {dt} bytes / paged bytes; waste = page "
        "tails + rows of evicted tokens in retained segments",
    ]


def _budget_fit_line(r: dict, g: dict, tpf: int, dt: str) -> str:
    """One quantization setting under the budget: the largest window that fits and the sessions at this window."""
    name = dt if r["mode"] == "off" else r["mode"]
    at = f"at {g['window_tokens'] / tpf:g} frames"
    fit = f"{r['max_sessions']} session(s) {at}" if r["max_sessions"] else f"no session fits {at}"
    if r["max_window_frames"] is None:
        return (
            f"    {name:<7} does not fit: even {r['min_window_frames']} frames need "
            f"{format_bytes(r['min_budget_bytes'])}; {fit}"
        )
    at_least = ">=" if r["search_limited"] else "  "
    return (
        f"    {name:<7} {at_least}{r['max_window_frames']:>6} frames (C = "
        f"{_n(r['cache_size_tokens'])} slots): needs {format_bytes(r['budget_bytes'])} "
        f"(pool {format_bytes(r['pool_bytes'])}); {fit}" + ("; the search stops there" if r["search_limited"] else "")
    ) + _attention_modes_text(r)


def _attention_modes_text(r: dict) -> str:
    """Both attention modes side by side (frames that fit, transient bytes per call), or "" without them."""
    by = r.get("by_attention")
    if not by:
        return ""
    return " | attention " + ", ".join(
        f"{a} {v['max_window_frames']} frames ({format_bytes(v['transient_bytes'])} transient)" for a, v in by.items()
    )


def _plan_budget_lines(budget: dict, g: dict, tpf: int, dt: str) -> list[str]:
    """The budget arithmetic (with --gpu or --memory-fraction) and what fits it, per quantization setting."""
    lines: list[str] = []
    arithmetic = budget.get("lines") or []
    if len(arithmetic) > 1:
        lines += ["", "  budget per rank:"]
        for item in arithmetic:
            lines.append(f"    {item['op']:>1} {format_bytes(int(item['bytes'])):>12}  {item['label']}")
    lines += [
        "",
        f"  budget {format_bytes(budget['bytes'])} ({budget['source']}): largest window that fits "
        f"({int(g['sessions'])} session(s)), and sessions that fit at this window",
    ]
    return lines + [_budget_fit_line(r, g, tpf, dt) for r in budget["fits"]]


def format_plan(doc: dict[str, object]) -> str:
    """The human table of a plan dict."""
    w = doc["workload"]
    g = doc["geometry"]
    settings = doc["settings"]
    assert isinstance(w, dict) and isinstance(g, dict) and isinstance(settings, list)
    dt = str(w["dtype"])  # the label of dense (unquantized) rows and segments: bf16, fp16 or fp32
    lines = _plan_header_lines(w, g, settings, dt) + _plan_table_lines(doc, g, settings, dt)
    budget = doc.get("budget")
    if budget:
        assert isinstance(budget, dict)
        lines += _plan_budget_lines(budget, g, int(w["tokens_per_frame"]), dt)
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    """`pagedqvg plan`."""
    w = workload_from_args(args)
    if args.stagger is not None:
        return _cmd_stagger(args, w, measure=False)
    budget = resolve_budget(args, w)
    doc = build_plan(w, budget, attention=args.attention)
    print(json.dumps(doc, indent=2) if args.json else format_plan(doc))
    return 0


# ---------------------------------------------------------------------------------------------------- simulate
def _summary_header_lines(s: dict, w: dict) -> list[str]:
    """The run's first two lines: workload, chunks, quantization, sessions/ranks; engine, calls, seconds, pool."""
    dry = s["engine"] == "accounting"
    engine = "accounting only (--dry-run, no tensors)" if dry else f"real caches on {s['device']}"
    ranks = int(w["ulysses"]) * int(w["tp"])
    scope = ""
    if int(w["sessions"]) > 1 or int(w["cache_sets"]) > 1:
        scope += f", {w['sessions']} session(s) x {w['cache_sets']} cache set(s) in one pool"
    if ranks > 1:
        scope += f", one rank of {ranks} ({int(w['heads']) // ranks} heads)"
    return [
        f"pagedqvg simulate: {w['name']}: {w['layers']} layers x {w['heads']} heads x {w['head_dim']}, "
        f"{w['tokens_per_frame']} tokens/frame, {s['chunks']} chunks of {w['chunk_frames']} frames, quant "
        f"{s['quant_measured']}{scope}",
        f"  {engine}: {_n(int(s['calls']))} calls in {s['seconds']:.2f} s; pool "
        f"{format_bytes(int(s['pool_capacity_bytes']))}",
    ]


def _summary_table_lines(w: dict, m: dict, p: dict, source: str) -> list[str]:
    """Measured (or replayed) vs plan: steady state, high-water, used, waste, transient view; segment bytes."""
    rows = [("", source, "plan", "diff")]
    for label, mk, pk in (
        ("steady state (pool held)", "steady_state_bytes", "steady_state_bytes"),
        ("high-water", "high_water_bytes", "high_water_bytes"),
        ("used (rows)", "used_bytes", "used_bytes"),
        ("waste", "waste_bytes", "waste_bytes"),
        ("transient view (max)", "max_view_bytes", "transient_view_bytes"),
    ):
        mv, pv = int(m[mk]), int(p[pk])
        diff = abs(mv - pv) / pv if pv else 0.0
        rows.append((label, format_bytes(mv), format_bytes(pv), f"{100 * diff:.2f}%"))
    segments = f"{format_bytes(int(m['bf16_bytes']))} / {format_bytes(int(m['packed_bytes']))}"
    rows.append((f"{w['dtype']} / packed segments", segments, "", ""))
    rows.append((f"dense {w['dtype']} cache (reference)", "", format_bytes(int(p["dense_bf16_bytes"])), ""))
    return _aligned(rows)


def _summary_check_lines(s: dict, p: dict, a: dict, source: str) -> list[str]:
    """The verdicts: measured vs plan (or why it was not checked) and the call-by-call comparison."""
    if a["checked"]:
        verdict = "agree" if a["ok"] else "DISAGREE"
        lines = [
            f"  {source} vs plan: {verdict} (steady state {100 * a['steady_state_rel_diff']:.3f}%, "
            f"high-water {100 * a['high_water_rel_diff']:.3f}%; tolerance {100 * a['tolerance']:g}%)"
        ]
    else:
        lines = [
            f"  {source} vs plan: not checked, {s['chunks']} chunks do not reach the steady state "
            f"(plan: {p['warmup_chunks']} chunks); use --chunks {p['warmup_chunks']} or more"
        ]
    acc = s.get("accounting")
    if isinstance(acc, dict):
        lines.append(
            f"  call by call vs the accounting replay: {acc['calls_compared'] - acc['mismatches']}/"
            f"{acc['calls_compared']} calls identical"
            + (f"; first: {acc['first_mismatch']}" if acc["mismatches"] else "")
        )
    return lines


def _summary_output_lines(s: dict) -> list[str]:
    """Plan-only figures of the packed settings (a bf16 run) and the files written."""
    lines = []
    plan_only = s.get("plan_only")
    if plan_only:
        assert isinstance(plan_only, list)
        lines.append(
            "  packed (plan only): "
            + "; ".join(
                f"{q['mode']} steady state {format_bytes(int(q['steady_state_bytes']))} ({q['ratio_vs_dense']:.2f}x "
                "vs dense)"
                for q in plan_only
            )
            + "  (rerun with --kv-cache-quant MODE to measure)"
        )
    outs = s.get("outputs") or {}
    assert isinstance(outs, dict)
    for key, label in (("timeline_json", "timeline"), ("timeline_png", "plot")):
        if outs.get(key):
            lines.append(f"  {label}: {outs[key]}")
    return lines


def format_summary(s: dict[str, object]) -> str:
    """The human summary of a simulate run."""
    w, m, p, a = s["workload"], s["measured"], s["plan"], s["agreement"]
    assert isinstance(w, dict) and isinstance(m, dict) and isinstance(p, dict) and isinstance(a, dict)
    source = "replayed" if s["engine"] == "accounting" else "measured"
    lines = _summary_header_lines(s, w) + _summary_table_lines(w, m, p, source)
    return "\n".join(lines + _summary_check_lines(s, p, a, source) + _summary_output_lines(s))


def cmd_simulate(args: argparse.Namespace) -> int:
    """`pagedqvg simulate`."""
    from pagedqvg.planning import simulate as sim

    w = workload_from_args(args)
    if args.stagger is not None:
        return _cmd_stagger(args, w, measure=not args.dry_run)
    geom = Geometry.from_workload(w)
    device = args.device or "cpu"
    seed = args.seed or 0
    out_dir = Path(args.out)
    try:  # before the run: an unusable output folder is bad input, not a traceback after minutes of work
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".pagedqvg-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {args.out}: cannot write there ({exc.strerror or exc})") from None
    accounting = None
    if args.dry_run:
        timeline = sim.run_accounting(geom, w.chunks, progress=args.progress)
    else:
        plan = plan_geometry(geom)
        sim.check_fits(geom, device, plan.pool_bytes)
        timeline = sim.run_caches(geom, w, device=device, seed=seed, progress=args.progress)
        accounting = sim.run_accounting(geom, w.chunks, progress=False)
    outputs = {"timeline_json": str(out_dir / "timeline.json")}
    plot = not args.no_plot
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plot = False
            sys.stderr.write("pagedqvg: matplotlib is not installed (pip install 'pagedqvg[cli]'): no timeline.png\n")
    if plot:
        outputs["timeline_png"] = str(out_dir / "timeline.png")
    summary = sim.summarize(w, geom, timeline, accounting=accounting, outputs=outputs)
    sim.write_timeline(out_dir / "timeline.json", summary, timeline)
    if plot:
        sim.plot_timeline(out_dir / "timeline.png", summary, timeline)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    agreement = summary["agreement"]
    assert isinstance(agreement, dict)
    acc = summary["accounting"]
    if not agreement["ok"] or (isinstance(acc, dict) and acc["mismatches"]):
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------- stagger
def _int_list(text: str) -> list[int]:
    """`--session-chunks 10,20,30`: positive ints."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, e.g. 10,20,30; got {text!r}")
    return values


def _cmd_stagger(args: argparse.Namespace, w, *, measure: bool) -> int:
    """`plan` / `simulate` with `--stagger K`: staggered sessions (pagedqvg/planning/stagger.py); exit 1 when measured
    and
    planned pages differ at any call."""
    from pagedqvg.planning.stagger import format_stagger, stagger_report

    geom = Geometry.from_workload(w)
    chunks = args.chunks if args.command == "simulate" else None
    doc = stagger_report(geom, args.stagger, args.session_chunks, chunks, measure=measure, device=args.device or "cpu")
    print(json.dumps(doc, indent=2) if args.json else format_stagger(doc))
    return 1 if doc.get("mismatches") else 0


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pagedqvg` console script; returns the exit status (2 for bad input)."""
    parser = build_parser()
    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help/--version (0) or a usage error (2, already reported on one line)
        return int(exc.code or 0)
    if args.command is None:
        _fail("choose a command: plan or simulate (see pagedqvg --help)")
        return 2
    try:
        check_combinations(args, _typed_flags(argv))
        return int(args.func(args))
    except ValueError as exc:  # UsageError, CacheConfigError, QuantConfig and geometry checks
        _fail(speak_flags(str(exc)))
        return 2
    except BrokenPipeError:  # `pagedqvg plan | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
