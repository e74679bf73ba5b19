"""`QuantConfig`: the PRQ knobs of a packed KV cache (SGLang's `--kv-cache-quant*` flags plus a seed and the
pagedqvg extensions `pack_trits`, `fit_scales`, `codebook_fp8`; `QuantConfig.compact()` combines them).

Defaults are SGLang's: quantization off, 128 centroids, 64-channel scale blocks, 1 k-means stage, 2 k-means
iterations, symmetric codes, the newest completed chunk kept dense, sink chunks packed (none kept dense).

Formats by age (tiers): the history (completed chunks older than the `keep_recent_chunks` newest) is packed in the
`mode` format (int4, int2 or compact); the recent chunks in `recent_format` (bf16 = dense, the default, or a packed
format); the sink chunks in `sink_format` (None = the history's, the default; bf16 = dense, as `sink=False`). A
recent chunk that ages into the history is repacked in the history's format (`tier_quant` gives each tier's config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagedqvg.errors import CacheConfigError
from pagedqvg.quant.formats import FORMATS, TIER_FORMAT_NAMES, format_rank, get_format
from pagedqvg.quant.formats import FP8_BLOCK as FP8_BLOCK  # re-exported: the fp8 format's block (tests, fp8 docs)
from pagedqvg.validation import check_int

#: Allowed values of `QuantConfig.bits` (None = quantization off: a dense cache).
ALLOWED_BITS: tuple[int | None, ...] = (None, 2, 4)
#: Centroid ids are stored as uint8, so a stage has at most 256 centroids.
MAX_CENTROIDS = 256

#: `kv_cache_quant` value selecting `QuantConfig.compact()` (other keys given with it override its fields).
COMPACT_MODE = "compact"
#: `kv_cache_quant` values naming a code width: off (and its aliases), then the reference PRQ formats (registry).
_MODE_TO_BITS: dict[str, int | None] = {
    **dict.fromkeys(("off", "none", "bf16")),
    **{f.name: f.bits for f in FORMATS if f.prq and f.name != COMPACT_MODE},
}
_BITS_TO_MODE: dict[int | None, str] = {None: "off", 4: "int4", 2: "int2"}
_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}

# SGLang flag name (normalised: no leading dashes, '-' -> '_') -> QuantConfig field.
SGLANG_KEYS: dict[str, str] = {
    "kv_cache_quant": "bits",
    "kv_cache_quant_centroids": "centroids",
    "kv_cache_quant_block_size": "block_size",
    "kv_cache_quant_stages": "stages",
    "kv_cache_quant_iters": "kmeans_iters",
    "kv_cache_quant_keep_recent": "keep_recent_chunks",
    "kv_cache_quant_sink_keep": "sink_keep_chunks",
    "kv_cache_quant_asymmetric": "asymmetric",
    "kv_cache_quant_sink": "sink",
    # pagedqvg extensions, spelled like the SGLang flags
    "kv_cache_quant_seed": "seed",
    "kv_cache_quant_pack_trits": "pack_trits",
    "kv_cache_quant_fit_scales": "fit_scales",
    "kv_cache_quant_codebook_fp8": "codebook_fp8",
}
_BOOL_FIELDS = ("asymmetric", "sink", "pack_trits", "fit_scales", "codebook_fp8")
SGLANG_KEYS["kv_cache_quant_recent"] = "recent_format"

#: Formats a tier may take (the registry's, `quant/formats.py`): dense in the cache dtype, fp8 e4m3 with power-of-two
#: block scales (near-lossless, `quant/fp8.py`), PRQ int4 / int2 / compact. The history takes a PRQ format.
TIER_FORMATS: tuple[str, ...] = TIER_FORMAT_NAMES
#: The tiers of a packed cache, oldest role first.
TIERS: tuple[str, ...] = ("sink", "history", "recent")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """PRQ settings of one cache. Invalid values raise `ValueError` at construction (see `validate`).

    Attributes:
        bits: code width of the final residual, 2 or 4 bits per channel; None = quantization off (a dense cache).
        centroids: k-means clusters per (head, stage), 1..256 (ids are uint8).
        block_size: channels sharing one fp8 scale (and zero); must divide head_dim.
        stages: residual k-means rounds, each adds one uint8 id per token-head and a `centroids x head_dim` table.
        kmeans_iters: assign/update iterations per stage.
        asymmetric: per-block scale and zero (min) instead of a symmetric scale.
        keep_recent_chunks: completed non-sink chunks kept dense (newest first) before packing.
        sink: pack sink chunks too (beyond `sink_keep_chunks`).
        sink_keep_chunks: sink chunks kept dense when `sink` is on.
        seed: seed of the k-means initialisation (packing is deterministic for a seed).
        pack_trits: beyond the reference: symmetric int2 codes use only 3 levels {-1, 0, +1}, so pack 5 codes per
            byte in base 3 (ceil(D/5) code bytes instead of D/4). Same codes, same error, 17% fewer bytes per
            token-head at D=128 (29 B vs 35 B). Requires bits=2 and asymmetric=False. Off (reference) by default.
        fit_scales: beyond the reference: each block's scale is fp8(max|r| * m / qmax) with the multiplier m in
            {16/16, 15/16, ..., 4/16} that minimises the block's squared error (measured exactly in integer units of
            max|r| / 4096, ties to the larger m), instead of m = 1. Same byte format and decoder; codes beyond the
            scale clip at +-qmax. Requires asymmetric=False. Off (reference) by default.
        codebook_fp8: beyond the reference: codebooks are stored as fp8 e4m3 (1 B per value, centroids clamped to
            +-448) instead of the cache dtype; the final k-means assignment and the residual use the stored fp8
            centroids, so the residual absorbs their rounding. Off (reference) by default.
        sink_format: format of packed sink chunks (beyond `sink_keep_chunks`): None = the history's (`mode`), or one
            of `TIER_FORMATS` ('bf16' = kept dense, as `sink=False`). Needs `sink=True` unless 'bf16'.
        recent_format: format of the `keep_recent_chunks` newest completed chunks: 'bf16' (dense, the default) or
            a packed format of equal or higher precision than the history's (fp8 > int4 > int2 = compact). A recent
            chunk leaving the tier is repacked into the history's format.
    """

    bits: int | None = None
    centroids: int = 128
    block_size: int = 64
    stages: int = 1
    kmeans_iters: int = 2
    asymmetric: bool = False
    keep_recent_chunks: int = 1
    sink: bool = True
    sink_keep_chunks: int = 0
    seed: int = 1234
    pack_trits: bool = False
    fit_scales: bool = False
    codebook_fp8: bool = False
    sink_format: str | None = None
    recent_format: str = "bf16"

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def compact(cls, **overrides: Any) -> QuantConfig:
        """The compact mode: >= 8x fewer bytes than bf16 per 4,680-token chunk at head_dim 128, codebooks included,
        at no more K/V error than the reference int2 on `pagedqvg.planning.synthetic` video (benchmarks/bench_prq.py).

        Symmetric int2 codes trit-packed (26 B), one fitted fp8 scale per 128 channels (1 B), one uint8 id (1 B):
        28 B per token-head, plus a 128 x 128 fp8 codebook per (K/V, head) (16 KiB, 3.5 B per token-head at 4,680
        tokens): 8.13x at 4,680 tokens, 8.67x at 10,800. Needs head_dim a multiple of 128 (the block size).
        `overrides` replace fields (e.g. `keep_recent_chunks=2`); the result is validated.
        """
        base: dict[str, Any] = dict(centroids=128, kmeans_iters=2, **dict(get_format(COMPACT_MODE).quant_fixed))
        base.update(overrides)
        return cls(**base)

    # ------------------------------------------------------------------ properties
    @property
    def enabled(self) -> bool:
        """True when packed (PRQ) segments are produced, i.e. `bits` is not None."""
        return self.bits is not None

    @property
    def mode(self) -> str:
        """The `--kv-cache-quant` value: 'off', 'int4' or 'int2' (SGLang's), or 'compact' for symmetric trit-packed
        int2 with fitted scales and fp8 codebooks (the format-defining fields of `compact()`)."""
        if self.bits == 2 and self.pack_trits and self.fit_scales and self.codebook_fp8 and not self.asymmetric:
            return COMPACT_MODE
        return _BITS_TO_MODE[self.bits]

    @property
    def levels(self) -> int:
        """Distinct code values used: 2^bits (asymmetric) or 2^bits - 1 (symmetric); 0 when off."""
        if self.bits is None:
            return 0
        return (1 << self.bits) if self.asymmetric else (1 << self.bits) - 1

    @property
    def qmax(self) -> int:
        """Largest code magnitude: 2^(bits-1)-1 (symmetric, codes are stored +qmax) or 2^bits-1 (asymmetric)."""
        if self.bits is None:
            return 0
        return (1 << self.bits) - 1 if self.asymmetric else (1 << (self.bits - 1)) - 1

    # ------------------------------------------------------------------ validation
    def validate(self, head_dim: int | None = None) -> QuantConfig:
        """Check every field (and, given `head_dim` with quantization on, that `block_size` divides it); return self.

        Raises:
            ValueError: naming the field, the value and the allowed values.
        """
        if not (self.bits is None or (type(self.bits) is int and self.bits in ALLOWED_BITS)):
            raise CacheConfigError(f"QuantConfig.bits={self.bits!r} is not supported; allowed: None (off), 2, 4")
        _check_int("centroids", self.centroids, lo=1, hi=MAX_CENTROIDS, why="ids are stored as uint8")
        _check_int("block_size", self.block_size, lo=1)
        _check_int("stages", self.stages, lo=1)
        _check_int("kmeans_iters", self.kmeans_iters, lo=1)
        _check_int("keep_recent_chunks", self.keep_recent_chunks, lo=0)
        _check_int("sink_keep_chunks", self.sink_keep_chunks, lo=0)
        _check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise CacheConfigError(f"QuantConfig.{name}={value!r} must be a bool (True or False)")
        if self.pack_trits and self.enabled and (self.bits != 2 or self.asymmetric):
            raise CacheConfigError(
                f"QuantConfig.pack_trits=True needs symmetric int2 codes (3 levels), got bits={self.bits}, "
                f"asymmetric={self.asymmetric}; allowed: pack_trits=False, or bits=2 with asymmetric=False"
            )
        if self.fit_scales and self.enabled and self.asymmetric:
            raise CacheConfigError(
                "QuantConfig.fit_scales=True needs symmetric codes, got asymmetric=True; allowed: fit_scales=False, "
                "or asymmetric=False"
            )
        self._validate_tiers()
        if head_dim is not None:
            _check_int("head_dim", head_dim, lo=1)
            if not self.enabled:
                return self  # quantization off: block_size and bits never apply, so every head_dim works
            for tier in ("sink", "recent"):
                q = self.tier_quant(tier)
                if q is not None and q is not self:
                    _validate_tier_head_dim(tier, q, head_dim)
                fmt = get_format(self.tier_format(tier))
                if fmt.channel_block and head_dim % fmt.channel_block:
                    raise CacheConfigError(
                        f"the {tier} tier's format {fmt.name!r} scales blocks of {fmt.channel_block} channels, which "
                        f"do not divide head_dim={head_dim}; allowed: head_dim a multiple of {fmt.channel_block}, or "
                        "another format"
                    )
            if head_dim % self.block_size:
                divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
                raise CacheConfigError(
                    f"QuantConfig.block_size={self.block_size} does not divide head_dim={head_dim}; "
                    f"allowed: a divisor of {head_dim} {divisors}"
                )
            if self.bits is not None and not self.pack_trits and (head_dim * self.bits) % 8:
                raise CacheConfigError(
                    f"head_dim={head_dim} at bits={self.bits} does not fill whole bytes; "
                    f"allowed: head_dim a multiple of {8 // self.bits}"
                )
        return self

    def _validate_tiers(self) -> None:
        """Tier formats: known names; a sink format needs the sink packed; a recent format needs recent chunks and
        may not be coarser than the history's (a chunk cannot gain precision by aging). With quantization off only
        the dense formats are allowed (a dense cache has no tiers)."""
        for name, value, allowed in (
            ("sink_format", self.sink_format, (None, *TIER_FORMATS)),
            ("recent_format", self.recent_format, TIER_FORMATS),
        ):
            if value not in allowed:
                raise CacheConfigError(
                    f"QuantConfig.{name}={value!r} is not a tier format; allowed: {', '.join(map(str, allowed))}"
                )
        if not self.enabled:
            if self.sink_format not in (None, "bf16") or self.recent_format != "bf16":
                raise CacheConfigError(
                    f"QuantConfig(bits=None) with sink_format={self.sink_format!r}, recent_format="
                    f"{self.recent_format!r}: quantization is off, so a dense cache has no packed tiers; allowed: "
                    "bits=2/4 (or QuantConfig.int4/int2/compact) with the tier formats, or sink_format None/'bf16' "
                    "and recent_format 'bf16'"
                )
            return
        if self.sink_format not in (None, "bf16") and not self.sink:
            raise CacheConfigError(
                f"QuantConfig.sink_format={self.sink_format!r} with sink=False: the sink chunks stay dense; allowed: "
                "sink=True with a sink format, or sink_format None/'bf16'"
            )
        if self.recent_format != "bf16" and self.keep_recent_chunks == 0:
            raise CacheConfigError(
                f"QuantConfig.recent_format={self.recent_format!r} with keep_recent_chunks=0: no chunk is in the "
                "recent tier; allowed: keep_recent_chunks >= 1, or recent_format 'bf16'"
            )
        if format_rank(self.recent_format) < format_rank(self.mode):
            finer = [f for f in TIER_FORMATS if format_rank(f) >= format_rank(self.mode)]
            raise CacheConfigError(
                f"QuantConfig.recent_format={self.recent_format!r} is coarser than the history's {self.mode!r}: a "
                f"recent chunk would gain no precision by aging; allowed: {', '.join(finer)}"
            )

    # ------------------------------------------------------------------ tiers
    def tier_format(self, tier: str) -> str:
        """The format name of `tier` ('sink', 'history' or 'recent'): one of `TIER_FORMATS` ('bf16' when
        quantization is off). ValueError for an unknown tier."""
        if tier not in TIERS:
            raise CacheConfigError(f"unknown tier {tier!r}; allowed: {', '.join(TIERS)}")
        if not self.enabled:
            return "bf16"
        if tier == "history":
            return self.mode if self.mode != "off" else "bf16"
        if tier == "recent":
            return self.recent_format
        if not self.sink:
            return "bf16"
        return self.mode if self.sink_format is None else self.sink_format

    @property
    def tiered(self) -> bool:
        """True when a tier differs from today's defaults (recent dense, sink like the history or dense)."""
        return self.enabled and (self.recent_format != "bf16" or self.sink_format not in (None, "bf16", self.mode))

    def tier_quant(self, tier: str) -> QuantConfig | None:
        """The PRQ config packing `tier`'s chunks: self for the history's format, a derived config (this config's
        centroids, block, stages, iterations, seed; compact's format fields) for another int4/int2/compact tier,
        None for a dense ('bf16') or fp8 tier (fp8 is `quant/fp8.py`'s codec). The derived config is the format's
        registry record: its `quant_fixed` fields over this config's `quant_inherits` ones (`quant/formats.py`)."""
        name = self.tier_format(tier)
        fmt = get_format(name)
        if not fmt.prq:
            return None
        if name == self.mode:
            return self
        return QuantConfig(**{k: getattr(self, k) for k in fmt.quant_inherits}, **dict(fmt.quant_fixed))

    # ------------------------------------------------------------------ text
    def describe(self) -> str:
        """One line for logs, e.g. 'PRQ int2 sym, 128 centroids x 1 stage, block 64, 2 iters, ...'."""
        if not self.enabled:
            return "KV quantization off (dense cache)"
        kind = "asym" if self.asymmetric else "sym"
        packing = ", trit-packed" if self.pack_trits else ""
        packing += ", fitted scales" if self.fit_scales else ""
        packing += ", fp8 codebooks" if self.codebook_fp8 else ""
        stage_word = "stage" if self.stages == 1 else "stages"
        sink = f"sink packed (keep {self.sink_keep_chunks} dense)" if self.sink else "sink kept dense"
        recent = "dense" if self.recent_format == "bf16" else f"in {self.recent_format}"
        if self.tiered:
            sink += f"; tiers: sink {self.tier_format('sink')}, recent {self.recent_format}, history {self.mode}"
        return (
            f"PRQ {self.mode} {kind}{packing}, {self.centroids} centroids x {self.stages} {stage_word}, "
            f"block {self.block_size}, {self.kmeans_iters} k-means iters, seed {self.seed}; "
            f"keep {self.keep_recent_chunks} recent chunk(s) {recent}, {sink}"
        )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def known_keys(cls) -> list[str]:
        """Every key `from_dict` accepts (SGLang flag names and field names, underscore spelling)."""
        return sorted(set(SGLANG_KEYS) | {f.name for f in fields(cls)})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantConfig:
        """Build a config from SGLang flag names (`kv_cache_quant`, `--kv-cache-quant-centroids`, ...) or field names.

        Keys may use dashes or underscores and a leading `--`. Values may be strings (as parsed from a command line):
        `kv_cache_quant` takes off/none/bf16/int4/int2, or compact (`QuantConfig.compact()`, whose fields the other
        keys given override); booleans take true/false/1/0/yes/no/on/off. `kv_cache_quant_sink` also takes a tier
        format (int4, int2, compact, fp8: the sink tier's `sink_format`; bf16: the sink kept dense) and
        `kv_cache_quant_recent` the recent tier's (`recent_format`).

        Raises:
            ValueError: an unknown key (listing the known ones), a key given twice, or a bad value.
        """
        field_names = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        source: dict[str, str] = {}
        compact = False
        sink_tier: str | None = None
        for raw_key, value in d.items():
            key = str(raw_key).lstrip("-").replace("-", "_")
            name = SGLANG_KEYS.get(key, key if key in field_names else None)
            if name is None:
                raise CacheConfigError(
                    f"unknown quantization key {raw_key!r}; known keys: {', '.join(cls.known_keys())}"
                )
            if name in kwargs:
                raise CacheConfigError(f"quantization setting {name!r} given twice ({source[name]!r} and {raw_key!r})")
            if name == "bits" and isinstance(value, str) and value.strip().lower() == COMPACT_MODE:
                compact = True
                kwargs[name] = 2
            elif name == "sink" and isinstance(value, str) and value.strip().lower() in TIER_FORMATS:
                sink_tier = value.strip().lower()  # a format names the sink tier's; 'bf16' keeps the sink dense
                kwargs[name] = sink_tier != "bf16"
            elif name in ("sink_format", "recent_format") and isinstance(value, str):
                kwargs[name] = value.strip().lower()
            else:
                kwargs[name] = _parse_value(name, key, value)
            source[name] = str(raw_key)
        if sink_tier is not None and sink_tier != "bf16":
            if kwargs.get("sink_format") not in (None, sink_tier):
                raise CacheConfigError(
                    f"sink format given twice ({source['sink']!r}={sink_tier!r} and "
                    f"{source['sink_format']!r}={kwargs['sink_format']!r})"
                )
            kwargs["sink_format"] = sink_tier
        if compact:
            return cls.compact(**kwargs)
        return cls(**kwargs)


def _validate_tier_head_dim(tier: str, q: QuantConfig, head_dim: int) -> None:
    """A derived tier config's block must divide `head_dim` (compact's 128-channel block needs head_dim % 128 == 0)."""
    try:
        q.validate(head_dim=head_dim)
    except ValueError as exc:
        raise CacheConfigError(f"the {tier} tier's format {q.mode!r}: {exc}") from None


def _check_int(name: str, value: object, *, lo: int, hi: int | None = None, why: str = "") -> None:
    reason = f" ({why})" if why else ""
    message = "QuantConfig.{name}={value!r} is out of range; allowed: {allowed}" + reason
    check_int(name, value, minimum=lo, maximum=hi, message=message, type_message=message)


def _parse_value(name: str, key: str, value: Any) -> Any:
    """Turn a flag value (possibly a string) into the field's type; leave bad values for `validate` to report."""
    if name == "bits":
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text in _MODE_TO_BITS:
            return _MODE_TO_BITS[text]
        if text.isdigit():
            return int(text)
        modes = ", ".join([*_MODE_TO_BITS, COMPACT_MODE])
        raise CacheConfigError(f"{key}={value!r} is not a quantization mode; allowed: {modes}")
    if name in _BOOL_FIELDS:
        if isinstance(value, str):
            text = value.strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise CacheConfigError(f"{key}={value!r} is not a boolean; allowed: {', '.join(sorted(_TRUE | _FALSE))}")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            raise CacheConfigError(f"{key}={value!r} is not an integer") from None
    return value
