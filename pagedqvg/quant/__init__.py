"""PRQ quantization: config, the packed byte format, and the pure-torch quantizer/dequantizer."""

from pagedqvg.quant.config import QuantConfig
from pagedqvg.quant.format import FP8_DTYPE, FP8_MAX, PackedFields, PackedFormat
from pagedqvg.quant.prq import PRQResidual, PRQSegment, pack_residual_rows, prq_dequantize, prq_kmeans, prq_quantize

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "PRQResidual",
    "PRQSegment",
    "PackedFields",
    "PackedFormat",
    "QuantConfig",
    "pack_residual_rows",
    "prq_dequantize",
    "prq_kmeans",
    "prq_quantize",
]
