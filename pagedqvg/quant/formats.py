"""The format registry: one record per storage format a cache segment may hold, looked up by name.

A format is chosen by name everywhere (`QuantConfig.tier_format`, `--kv-cache-quant-recent/-sink`,
`PAGEDQVG_KV_CACHE_QUANT_SINK/_RECENT`); everything that depends on the choice reads the record instead of comparing
strings:

    name     rank  codec  layout                store        decoded by
    bf16     4     dense  DenseTokenLayout      dense rows   view_runs (Triton) / torch reference
    fp8      3     fp8    Fp8SegmentLayout      Fp8Store     torch reference only (no Triton kernel)
    int4     2     prq    PackedSegmentLayout   PackedStore  view_runs / packed_dequant (Triton) / torch reference
    int2     1     prq    PackedSegmentLayout   PackedStore  view_runs / packed_dequant (Triton) / torch reference
    compact  1     prq    PackedSegmentLayout   PackedStore  view_runs / packed_dequant (Triton) / torch reference

`rank` orders precision: a chunk only ever moves to a format of lower rank (aging). The `QuantConfig` a PRQ format
packs with is `quant_fixed` (the fields that define the format) over the `quant_inherits` fields of the cache's
config (`QuantConfig.tier_quant`). Trit packing (`pack_trits`) is not a format of its own: it is an option of int2
(same codes, fewer bytes) and one of compact's defining fields. Bytes per segment: `quant/layouts.py`
(`format_layout`) builds the record's layout class for a layer shape. Tensor-free; every lookup is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedqvg.errors import PagedQVGError
from pagedqvg.layout.segments import DenseTokenLayout, Fp8SegmentLayout, PackedSegmentLayout

__all__ = [
    "FORMATS",
    "FP8_BLOCK",
    "PRQ_MODE_NAMES",
    "QUANT_MODE_NAMES",
    "TIER_FORMAT_NAMES",
    "TierFormat",
    "UnknownFormatError",
    "format_rank",
    "get_format",
]

#: Channels sharing one power-of-two scale in the fp8 format (as MX formats' 32-element blocks).
FP8_BLOCK = 32

#: `QuantConfig` fields a derived PRQ tier config takes from the cache's config (int4 / int2 tiers).
_PRQ_KNOBS = ("centroids", "block_size", "stages", "kmeans_iters", "asymmetric", "seed")


class UnknownFormatError(PagedQVGError, ValueError):
    """A format name that is not in the registry (the message names it and the valid ones)."""


@dataclass(frozen=True, slots=True)
class TierFormat:
    """One storage format of cache segments.

    Attributes:
        name: the name users type (`--kv-cache-quant-recent int4`) and segments record (`Segment.fmt`).
        rank: precision order (higher = finer): a chunk may only age into a format of equal or lower rank.
        codec: 'dense' (rows in the cache dtype), 'prq' (PRQ-packed rows + codebooks, `quant/format.py`) or 'fp8'
            (`quant/fp8.py`): selects the layout's constructor (`quant/layouts.py`) and the store class
            (`store/tier_stores.py`'s `STORE_CLASSES`).
        layout: the `layout/segments.py` class that computes a segment's pages and used bytes.
        store: name of the class holding the format in a cache ('' for dense: the cache's own dense rows).
        kernels: what decodes it in a view, in dispatch order.
        history: whether the history (`--kv-cache-quant`) may take it (the PRQ formats).
        bits: code width of the PRQ format's final residual (None for dense and fp8).
        quant_fixed: `(field, value)` pairs of `QuantConfig` that define a PRQ format (empty otherwise).
        quant_inherits: `QuantConfig` fields a derived tier config copies from the cache's config.
        channel_block: channels sharing one scale fixed by the format itself (fp8: `FP8_BLOCK`; head_dim must be a
            multiple), 0 when the format has none of its own (a PRQ block is `QuantConfig.block_size`).
    """

    name: str
    rank: int
    codec: str
    layout: type
    store: str
    kernels: tuple[str, ...]
    history: bool
    bits: int | None = None
    quant_fixed: tuple[tuple[str, Any], ...] = ()
    quant_inherits: tuple[str, ...] = ()
    channel_block: int = 0

    @property
    def packed(self) -> bool:
        """True for every format but dense (the segment is packed: `SegmentKind.PACKED`)."""
        return self.codec != "dense"

    @property
    def prq(self) -> bool:
        """True for the PRQ formats (packed by `PackedStore` with a `QuantConfig`)."""
        return self.codec == "prq"


_PRQ_KERNELS = ("view_runs (Triton)", "packed_dequant (Triton)", "torch reference")

#: Every format, finest first.
FORMATS: tuple[TierFormat, ...] = (
    TierFormat("bf16", 4, "dense", DenseTokenLayout, "", ("view_runs (Triton)", "torch reference"), False),
    TierFormat("fp8", 3, "fp8", Fp8SegmentLayout, "Fp8Store", ("torch reference",), False, channel_block=FP8_BLOCK),
    TierFormat("int4", 2, "prq", PackedSegmentLayout, "PackedStore", _PRQ_KERNELS, True, 4, (("bits", 4),), _PRQ_KNOBS),
    TierFormat("int2", 1, "prq", PackedSegmentLayout, "PackedStore", _PRQ_KERNELS, True, 2, (("bits", 2),), _PRQ_KNOBS),
    TierFormat(
        "compact",
        1,
        "prq",
        PackedSegmentLayout,
        "PackedStore",
        _PRQ_KERNELS,
        True,
        2,
        (
            ("bits", 2),
            ("block_size", 128),
            ("stages", 1),
            ("asymmetric", False),
            ("pack_trits", True),
            ("fit_scales", True),
            ("codebook_fp8", True),
        ),
        ("centroids", "kmeans_iters", "seed"),
    ),
)
_BY_NAME: dict[str, TierFormat] = {f.name: f for f in FORMATS}

#: Formats a tier may take (`--kv-cache-quant-recent` choices; `--kv-cache-quant-sink` also takes true/false).
TIER_FORMAT_NAMES: tuple[str, ...] = tuple(f.name for f in FORMATS)
#: Formats the history may take (the PRQ formats).
PRQ_MODE_NAMES: tuple[str, ...] = tuple(f.name for f in FORMATS if f.history)
#: `--kv-cache-quant` / `PAGEDQVG_KV_CACHE_QUANT` choices: off, then the history formats.
QUANT_MODE_NAMES: tuple[str, ...] = ("off", *PRQ_MODE_NAMES)


def get_format(name: str) -> TierFormat:
    """The record of format `name`. UnknownFormatError (a ValueError) naming `name` and the valid names. O(1)."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise UnknownFormatError(f"unknown format {name!r}; valid formats: {', '.join(TIER_FORMAT_NAMES)}") from None


def format_rank(name: str) -> int:
    """Precision rank of a format (bf16 4, fp8 3, int4 2, int2 and compact 1): a chunk only ever moves to a format of
    lower rank (aging), never back up. UnknownFormatError for an unknown name."""
    return get_format(name).rank
