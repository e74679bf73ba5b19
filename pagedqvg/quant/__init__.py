"""Quantization: the format registry (`formats.py`: every storage format by name), the PRQ config, the packed and fp8
byte formats, each format's segment layout (`layouts.py`), and the pure-torch quantizer/dequantizer."""

from pagedqvg.quant.config import QuantConfig
from pagedqvg.quant.format import FP8_DTYPE, FP8_MAX, PackedFields, PackedFormat
from pagedqvg.quant.formats import (
    FORMATS,
    PRQ_MODE_NAMES,
    QUANT_MODE_NAMES,
    TIER_FORMAT_NAMES,
    TierFormat,
    UnknownFormatError,
    format_rank,
    get_format,
)
from pagedqvg.quant.prq import PRQResidual, PRQSegment, pack_residual_rows, prq_dequantize, prq_kmeans, prq_quantize

__all__ = [
    "FORMATS",
    "FP8_DTYPE",
    "FP8_MAX",
    "PRQ_MODE_NAMES",
    "QUANT_MODE_NAMES",
    "TIER_FORMAT_NAMES",
    "PRQResidual",
    "PRQSegment",
    "PackedFields",
    "PackedFormat",
    "QuantConfig",
    "TierFormat",
    "UnknownFormatError",
    "format_rank",
    "get_format",
    "pack_residual_rows",
    "prq_dequantize",
    "prq_kmeans",
    "prq_quantize",
]
