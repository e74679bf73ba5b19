"""PRQ quantization: config, the packed byte format, and the pure-torch quantizer/dequantizer."""

from .config import QuantConfig
from .format import FP8_DTYPE, FP8_MAX, PackedFields, PackedFormat
from .prq import PRQSegment, prq_dequantize, prq_quantize

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "PRQSegment",
    "PackedFields",
    "PackedFormat",
    "QuantConfig",
    "prq_dequantize",
    "prq_quantize",
]
