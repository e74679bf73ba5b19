"""The packed PRQ byte format, defined once. Segment code, kernels and the planner all read sizes and offsets here.

Per-head record (the bytes of ONE token of ONE head), fields back to back, no padding, in this order:

    offset 0                codes   code_bytes    final-residual codes, first element in the high bits:
                                                  int4  byte = c0<<4 | c1
                                                  int2  byte = c0<<6 | c1<<4 | c2<<2 | c3
                                                  trits byte = 81*c0 + 27*c1 + 9*c2 + 3*c3 + c4  (pack_trits; symmetric
                                                        int2 codes are in {0,1,2}; the last byte is padded with 0s)
    scales_offset           scales  D/block_size  fp8 e4m3 (float8_e4m3fn) bit patterns, one per block of channels
    zeros_offset            zeros   D/block_size  fp8 e4m3 block minimum (asymmetric only, else 0 bytes)
    ids_offset              ids     stages        uint8 centroid id of each k-means stage

A *packed token row* is the concatenation over the H heads (head 0 first) of those records:
`token_row_bytes = H * per_head_bytes`. A *codebook row* is one (head, stage) table of `centroids x D` values in the
codebook dtype (`codebook_dtype`: the cache dtype, or fp8 e4m3 bytes with `codebook_fp8`), row index
`head * stages + stage` (`num_codebook_rows = H * stages`).

Decoding element j of a record (what a kernel does): block b = j // block_size,
    int4:  c = (codes[j // 2] >> (4 - 4 * (j % 2))) & 0xF
    int2:  c = (codes[j // 4] >> (6 - 2 * (j % 4))) & 0x3
    trits: c = (codes[j // 5] // 3 ** (4 - j % 5)) % 3
    symmetric:  value = (c - qmax) * scale[b]          (qmax = 2^(bits-1) - 1)
    asymmetric: value = c * scale[b] + zero[b]
plus the sum over stages s of codebook[head, s][ids[s]], all in fp32, cast to the cache dtype at the end.

`fit_scales` changes only how the packer picks a block's scale (quant/prq.py), never the bytes' meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedqvg.quant.config import QuantConfig
from pagedqvg.validation import SUPPORTED_DTYPES, check_int

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8_e4m3fn value; scales and zeros are clamped to [-FP8_MAX, FP8_MAX].
FP8_MAX = 448.0

#: Place values of the five trits packed in a byte (most significant first).
TRIT_WEIGHTS = (81, 27, 9, 3, 1)


@dataclass(frozen=True, slots=True)
class PackedFields:
    """The fields of packed token rows, unpacked. Leading dims `...` are those of the rows.

    codes: uint8 [..., H, D], stored code values (0..2^bits-1; symmetric codes are offset by +qmax).
    scales: float32 [..., H, D/block_size], exact fp8 values.
    zeros: float32 [..., H, D/block_size] (asymmetric) or None.
    ids: uint8 [..., H, stages].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    ids: torch.Tensor


@dataclass(frozen=True, slots=True)
class PackedFormat:
    """Byte layout of packed PRQ segments for `num_heads` heads of `head_dim` channels (see the module docstring).

    All sizes are in bytes. `dtype` is the cache dtype (of dense rows, codebooks, dequantized output).
    """

    head_dim: int
    num_heads: int
    cfg: QuantConfig
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if not self.cfg.enabled:
            raise ValueError("PackedFormat needs a QuantConfig with bits=2 or 4 (got bits=None: quantization off)")
        self.cfg.validate(head_dim=self.head_dim)
        message = "PackedFormat.{name}={value!r}; allowed: {allowed}"
        check_int("num_heads", self.num_heads, minimum=1, message=message, type_message=message)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"PackedFormat.dtype={self.dtype}; allowed: {', '.join(map(str, SUPPORTED_DTYPES))}")

    # ------------------------------------------------------------------ per-head record
    @property
    def bits(self) -> int:
        """Code width in bits (2 or 4)."""
        assert self.cfg.bits is not None
        return self.cfg.bits

    @property
    def qmax(self) -> int:
        """Symmetric: 2^(bits-1)-1 (stored code = q + qmax); asymmetric: 2^bits-1 (largest code)."""
        return self.cfg.qmax

    @property
    def num_blocks(self) -> int:
        """Scale blocks per token-head: head_dim / block_size."""
        return self.head_dim // self.cfg.block_size

    @property
    def code_bytes(self) -> int:
        """Bytes of codes per token-head: D*bits/8, or ceil(D/5) when trit-packed."""
        if self.cfg.pack_trits:
            return -(-self.head_dim // 5)
        return self.head_dim * self.bits // 8

    @property
    def scale_bytes(self) -> int:
        """Bytes of fp8 scales per token-head (one per block)."""
        return self.num_blocks

    @property
    def zero_bytes(self) -> int:
        """Bytes of fp8 zeros per token-head (asymmetric only, else 0)."""
        return self.num_blocks if self.cfg.asymmetric else 0

    @property
    def id_bytes(self) -> int:
        """Bytes of uint8 centroid ids per token-head (one per stage)."""
        return self.cfg.stages

    @property
    def codes_offset(self) -> int:
        """Offset of the codes within a per-head record (always 0)."""
        return 0

    @property
    def scales_offset(self) -> int:
        """Offset of the scales within a per-head record."""
        return self.code_bytes

    @property
    def zeros_offset(self) -> int:
        """Offset of the zeros within a per-head record (== ids_offset when symmetric)."""
        return self.scales_offset + self.scale_bytes

    @property
    def ids_offset(self) -> int:
        """Offset of the ids within a per-head record."""
        return self.zeros_offset + self.zero_bytes

    @property
    def per_head_bytes(self) -> int:
        """Bytes of one token of one head (e.g. 35 for D=128, int2, block 64, 1 stage)."""
        return self.ids_offset + self.id_bytes

    # ------------------------------------------------------------------ rows and segments
    @property
    def token_row_bytes(self) -> int:
        """Bytes of one packed token row (all heads): num_heads * per_head_bytes."""
        return self.num_heads * self.per_head_bytes

    @property
    def codebook_dtype(self) -> torch.dtype:
        """dtype of stored codebook values: float8_e4m3fn with `cfg.codebook_fp8`, else the cache dtype."""
        return FP8_DTYPE if self.cfg.codebook_fp8 else self.dtype

    @property
    def codebook_row_bytes(self) -> int:
        """Bytes of one (head, stage) codebook: centroids * head_dim * itemsize(codebook_dtype)."""
        return self.cfg.centroids * self.head_dim * self.codebook_dtype.itemsize

    @property
    def num_codebook_rows(self) -> int:
        """Codebook rows per segment: num_heads * stages (row index head * stages + stage)."""
        return self.num_heads * self.cfg.stages

    @property
    def dense_token_row_bytes(self) -> int:
        """Bytes of one unpacked token row in the cache dtype: num_heads * head_dim * itemsize."""
        return self.num_heads * self.head_dim * self.dtype.itemsize

    def segment_bytes(self, num_tokens: int) -> int:
        """Bytes of a packed segment of `num_tokens` tokens: token rows plus all codebook rows."""
        return num_tokens * self.token_row_bytes + self.num_codebook_rows * self.codebook_row_bytes

    def compression_ratio(self, num_tokens: int) -> float:
        """Dense bytes / packed bytes for a segment of `num_tokens` tokens (codebooks included)."""
        return num_tokens * self.dense_token_row_bytes / self.segment_bytes(num_tokens)

    def layout(self) -> dict[str, tuple[int, int]]:
        """Per-head record fields as name -> (offset, nbytes)."""
        return {
            "codes": (self.codes_offset, self.code_bytes),
            "scales": (self.scales_offset, self.scale_bytes),
            "zeros": (self.zeros_offset, self.zero_bytes),
            "ids": (self.ids_offset, self.id_bytes),
        }

    def describe(self) -> str:
        """One line: the record layout and sizes."""
        fields = ", ".join(f"{name} {n}B@{off}" for name, (off, n) in self.layout().items() if n)
        return (
            f"packed token-head {self.per_head_bytes} B ({fields}); token row {self.token_row_bytes} B "
            f"x {self.num_heads} heads; codebook row {self.codebook_row_bytes} B x {self.num_codebook_rows}"
        )

    # ------------------------------------------------------------------ codes
    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Pack integer codes [..., D] (values < 2^bits, or < 3 when trit-packed) into uint8 [..., code_bytes]."""
        if codes.shape[-1] != self.head_dim:
            raise ValueError(f"codes last dim {codes.shape[-1]} != head_dim {self.head_dim}")
        c = codes.to(torch.int32)
        levels = 3 if self.cfg.pack_trits else 1 << self.bits
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= levels):
            raise ValueError(f"codes must lie in 0..{levels - 1}, got {int(c.min())}..{int(c.max())}")
        lead = c.shape[:-1]
        if self.cfg.pack_trits:
            pad = self.code_bytes * 5 - self.head_dim
            if pad:
                c = torch.cat([c, c.new_zeros(*lead, pad)], dim=-1)
            weights = torch.tensor(TRIT_WEIGHTS, dtype=torch.int32, device=c.device)
            return (c.view(*lead, self.code_bytes, 5) * weights).sum(-1).to(torch.uint8)
        per_byte = 8 // self.bits
        shifts = torch.arange(per_byte - 1, -1, -1, dtype=torch.int32, device=c.device) * self.bits
        return (c.view(*lead, self.code_bytes, per_byte) << shifts).sum(-1).to(torch.uint8)

    def unpack_codes(self, packed: torch.Tensor) -> torch.Tensor:
        """Unpack uint8 [..., code_bytes] into codes uint8 [..., D] (inverse of `pack_codes`)."""
        if packed.shape[-1] != self.code_bytes:
            raise ValueError(f"packed codes last dim {packed.shape[-1]} != code_bytes {self.code_bytes}")
        p = packed.to(torch.int32).unsqueeze(-1)
        lead = packed.shape[:-1]
        if self.cfg.pack_trits:
            weights = torch.tensor(TRIT_WEIGHTS, dtype=torch.int32, device=p.device)
            c = (p // weights) % 3
        else:
            per_byte = 8 // self.bits
            shifts = torch.arange(per_byte - 1, -1, -1, dtype=torch.int32, device=p.device) * self.bits
            c = (p >> shifts) & ((1 << self.bits) - 1)
        return c.reshape(*lead, c.shape[-2] * c.shape[-1])[..., : self.head_dim].to(torch.uint8)

    # ------------------------------------------------------------------ token rows
    def pack_token_rows(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """Assemble packed token rows.

        Args:
            codes: integer [..., H, D], stored code values (symmetric codes already offset by +qmax).
            scales: [..., H, D/block_size], float8_e4m3fn or a float dtype (cast to fp8, values should be exact).
            zeros: like `scales` when asymmetric, else None.
            ids: integer [..., H, stages], 0..centroids-1.

        Returns:
            uint8 [..., H * per_head_bytes].
        """
        H, D, nb = self.num_heads, self.head_dim, self.num_blocks
        lead = codes.shape[:-2]
        _expect("codes", codes, (*lead, H, D))
        _expect("scales", scales, (*lead, H, nb))
        _expect("ids", ids, (*lead, H, self.cfg.stages))
        if self.cfg.asymmetric:
            if zeros is None:
                raise ValueError("asymmetric format needs zeros, got None")
            _expect("zeros", zeros, (*lead, H, nb))
        elif zeros is not None:
            raise ValueError("symmetric format stores no zeros; pass zeros=None")
        parts = [self.pack_codes(codes), _fp8_bytes(scales)]
        if zeros is not None:
            parts.append(_fp8_bytes(zeros))
        parts.append(ids.to(torch.uint8))
        record = torch.cat(parts, dim=-1)
        return record.reshape(*lead, H * self.per_head_bytes)

    def unpack_token_rows(self, rows: torch.Tensor) -> PackedFields:
        """Split packed token rows uint8 [..., H * per_head_bytes] into `PackedFields`."""
        if rows.dtype != torch.uint8 or rows.shape[-1:] != (self.token_row_bytes,):
            raise ValueError(
                f"token rows must be uint8 [..., {self.token_row_bytes}], got {rows.dtype} {tuple(rows.shape)}"
            )
        rec = rows.reshape(*rows.shape[:-1], self.num_heads, self.per_head_bytes)
        codes = self.unpack_codes(rec[..., self.codes_offset : self.codes_offset + self.code_bytes])
        scales = _fp8_values(rec[..., self.scales_offset : self.scales_offset + self.scale_bytes])
        zeros = None
        if self.cfg.asymmetric:
            zeros = _fp8_values(rec[..., self.zeros_offset : self.zeros_offset + self.zero_bytes])
        ids = rec[..., self.ids_offset : self.ids_offset + self.id_bytes]
        return PackedFields(codes=codes, scales=scales, zeros=zeros, ids=ids)

    # ------------------------------------------------------------------ codebooks
    def pack_codebooks(self, codebooks: torch.Tensor) -> torch.Tensor:
        """Codebooks [H, stages, K, D] (any float dtype, cast to `codebook_dtype`; fp8 saturates at +-448) -> uint8
        [H*stages, codebook_row_bytes]."""
        _expect("codebooks", codebooks, (self.num_heads, self.cfg.stages, self.cfg.centroids, self.head_dim))
        if self.cfg.codebook_fp8 and codebooks.dtype != FP8_DTYPE:
            codebooks = codebooks.float().clamp(-FP8_MAX, FP8_MAX)
        cb = codebooks.to(self.codebook_dtype).contiguous()
        return cb.view(torch.uint8).reshape(self.num_codebook_rows, self.codebook_row_bytes)

    def unpack_codebooks(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [H*stages, codebook_row_bytes] -> codebooks [H, stages, K, D] in `codebook_dtype` (inverse of
        pack)."""
        _expect("codebook rows", rows, (self.num_codebook_rows, self.codebook_row_bytes))
        rows = rows.contiguous()
        if rows.storage_offset() % self.codebook_dtype.itemsize:
            rows = rows.clone()  # a dtype view needs an aligned start
        cb = rows.view(self.codebook_dtype)
        return cb.reshape(self.num_heads, self.cfg.stages, self.cfg.centroids, self.head_dim)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 (or float, cast with saturation at +-448) tensor -> its uint8 bit patterns."""
    if t.dtype != FP8_DTYPE:
        t = t.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return t.contiguous().view(torch.uint8)


def _fp8_values(b: torch.Tensor) -> torch.Tensor:
    """uint8 fp8 bit patterns -> float32 values (exact)."""
    return b.contiguous().view(FP8_DTYPE).float()
