"""Packed rows of a repeated view, decoded with no allocation and no host read (the torch path of `view_runs`).

`decode_plan` derives once per view plan everything `packed_dequant_torch` recomputes per call: the packed tokens'
record gather (one `index_select` of whole head records per tile, `rows.record_gather`), each token's segment and
the element offsets of its segment's codebook rows (so no `unique().tolist()` of the codebook offsets), the output
rows, the tiles, and typed views of one scratch buffer (the owner's, sized once per plan) for every step of the
decode. `run_decode` then decodes tile by tile with in-place and `out=` ops only: the same arithmetic, in the same
order, as `prq_dequantize` (`(code - qmax) * scale`, or `code * scale + zero`, in fp32, plus each stage's centroid in
stage order, cast to the cache dtype once), so the values are bit for bit `packed_dequant_torch`'s. Only heads
`[head_start, head_start + heads)` are decoded (the format is per head, so the other heads do not change them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedqvg.kernels.rows import int64_on, record_gather, window_view
from pagedqvg.kernels.view.dequant import DEQUANT_TILE_ELEMS
from pagedqvg.quant import PackedFormat
from pagedqvg.quant.format import FP8_DTYPE, TRIT_WEIGHTS


@dataclass(frozen=True, slots=True)
class PackedDecodePlan:
    """What `run_decode` needs, all on the view's device. `tiles`: `(first, last)` token of each tile (host ints);
    `records`/`rec_index`: the token records' gather (`record_gather`; `rec_per_row` records per index entry);
    `tok_seg`: each token's segment; `seg_base`: `[segments, G * heads * stages]` element offsets (in `cb_unit`
    units) of the segments' codebook rows; `cb_source`: a window view of the codebook bytes, one centroid per row;
    `out_rows`: each token's output row; `unpack`: the shifts (or trit weights) of the code bytes; `consts`: the
    scalars of the arithmetic as 0-dim tensors of their operands' dtypes (a Python scalar would be converted into
    a fresh tensor per op); `buf`: the scratch views (`_carve`)."""

    fmt: PackedFormat
    groups: int
    heads: int
    tiles: tuple[tuple[int, int], ...]
    records: torch.Tensor
    rec_index: torch.Tensor
    rec_per_row: int
    tok_seg: torch.Tensor
    seg_base: torch.Tensor
    id_step: int
    cb_source: torch.Tensor
    out_rows: torch.Tensor
    unpack: torch.Tensor
    consts: dict[str, torch.Tensor]
    buf: dict[str, torch.Tensor]


def _tokens(pieces: list[tuple[int, ...]], cb_offsets: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Pieces `(page, first, count, out_row, cb_offset)` token by token: pages, slots, output rows, segment ids."""
    page, slot, out_row, seg = [], [], [], []
    for p, first, count, o, off in pieces:
        page += [p] * count
        slot += range(first, first + count)
        out_row += range(o, o + count)
        seg += [cb_offsets.index(off)] * count
    return page, slot, out_row, seg


def _codebook_base(
    codebooks: torch.Tensor, cb_pages: list[int], cb_offsets: list[int], fmt: PackedFormat, B: int, h0: int, hin: int
) -> tuple[torch.Tensor, int, int]:
    """Per segment, the byte offsets (in units of `unit` bytes) of its codebook rows `(kv, b, head, stage)` for heads
    `[h0, h0 + hin)`, `[segments, 2B * hin * stages]`; the unit; a centroid's step in units."""
    isz = codebooks.element_size()
    s0, s1, s2 = (codebooks.stride(i) * isz for i in range(3))
    D, st, H = fmt.head_dim, fmt.cfg.stages, fmt.num_heads
    unit = math.gcd(s0, s1, s2, D * isz)
    rpp = codebooks.shape[1]
    base = []
    for off in cb_offsets:
        for g in range(2 * B):
            for h in range(h0, h0 + hin):
                for s in range(st):
                    r = (g * H + h) * st + s
                    base.append((cb_pages[off + r // rpp] * s0 + (r % rpp) * s1) // unit)
    return torch.tensor(base, dtype=torch.int64).view(len(cb_offsets), -1), unit, s2 // unit


def _carve(scratch: Callable[[int], torch.Tensor], shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    """Typed views of one scratch buffer (`scratch(nbytes)` returns a uint8 tensor of at least `nbytes`), one per
    name, each 64-byte aligned."""
    sizes = {k: math.prod(shape) * dtype.itemsize for k, (shape, dtype) in shapes.items()}
    total = sum(-(-n // 64) * 64 for n in sizes.values())
    raw = scratch(total)
    out, at = {}, 0
    for k, (shape, dtype) in shapes.items():
        out[k] = raw[at : at + sizes[k]].view(dtype).view(shape)
        at += -(-sizes[k] // 64) * 64
    return out


def decode_plan(
    tokens: torch.Tensor,
    codebooks: torch.Tensor,
    pieces: list[tuple[int, ...]],
    cb_pages: list[int],
    head_start: int,
    heads: int,
    fmt: PackedFormat,
    scratch: Callable[[int], torch.Tensor],
) -> PackedDecodePlan:
    """The `PackedDecodePlan` of the live packed pieces `pieces` (host tuples `(page, first, count, out_row,
    cb_offset)`) of a view over `tokens`/`codebooks` (packing.PackedStore's views; `fmt`: one (kv, b) row's format,
    `fmt.num_heads` = H). O(tokens x 2B) plus one host read of the gather's run lengths (build it once per plan)."""
    B, dev = tokens.shape[3], tokens.device
    G, phb, D, st = 2 * B, fmt.per_head_bytes, fmt.head_dim, fmt.cfg.stages
    cb_offsets = sorted({p[4] for p in pieces})
    page, slot, out_row, seg = _tokens(pieces, cb_offsets)
    n = len(page)
    step = max(1, min(n, DEQUANT_TILE_ELEMS // (G * heads * D)))  # tokens per tile; the scratch is one tile
    tiles = tuple((a, min(a + step, n)) for a in range(0, n, step))
    s0, s1, s2, s3 = (tokens.stride(i) for i in range(4))
    p, sl = int64_on(page, dev), int64_on(slot, dev)
    gb = torch.arange(G, dtype=torch.int64, device=dev)
    starts = (p * s0 + sl * s1)[:, None] + (gb // B) * s2 + (gb % B) * s3 + head_start * phb
    align = math.gcd(s0, s1, s2, s3, head_start * phb)
    records, rec_index = record_gather(tokens, starts.reshape(-1), heads * phb, align, step * G)
    rec_per_row = records.shape[1] // (heads * phb)
    base, unit, id_step = _codebook_base(codebooks, cb_pages, cb_offsets, fmt, B, head_start, heads)
    width = D * codebooks.element_size()
    cb_source = window_view(codebooks.view(torch.uint8) if codebooks.dtype != torch.uint8 else codebooks, unit, width)
    if fmt.cfg.pack_trits:
        unpack = torch.tensor(TRIT_WEIGHTS, dtype=torch.int32, device=dev)
    else:
        unpack = torch.arange(8 // fmt.bits - 1, -1, -1, dtype=torch.int32, device=dev) * fmt.bits
    m = step * G * heads  # head records per tile
    cb = fmt.codebook_dtype
    buf = _carve(scratch, {
        "raw": ((step * G * heads * phb,), torch.uint8),
        "codes": ((m, fmt.code_bytes), torch.int32),
        "bits": ((m, fmt.code_bytes, unpack.numel()), torch.int32),  # also the fp32 staging of fp8 centroids
        "acc": ((m, D), torch.float32),
        "scale": ((m, fmt.num_blocks), torch.float32),
        "zero": ((m, fmt.num_blocks if fmt.cfg.asymmetric else 0), torch.float32),
        "base": ((step, G * heads * st), torch.int64),
        "idx": ((m,), torch.int64),
        "cent": ((m, D), cb),
        "cast": ((step, 2, B, heads, D), fmt.dtype),
    })  # fmt: skip
    consts = {
        "mask": torch.tensor((1 << fmt.bits) - 1 if not fmt.cfg.pack_trits else 3, dtype=torch.int32, device=dev),
        "qmax": torch.tensor(float(fmt.qmax), dtype=torch.float32, device=dev),
        "id_step": torch.tensor(id_step, dtype=torch.int64, device=dev),
    }
    return PackedDecodePlan(fmt, G, heads, tiles, records, rec_index, rec_per_row, int64_on(seg, dev),
                            base.to(dev), id_step, cb_source, int64_on(out_row, dev), unpack, consts,
                            buf)  # fmt: skip


def _fields(plan: PackedDecodePlan, a: int, b: int) -> tuple[torch.Tensor, int]:
    """Gather the head records of tokens `[a, b)` into the scratch; returns them as uint8 `[m, per_head_bytes]` and
    `m`, the head-record count."""
    G, heads, phb = plan.groups, plan.heads, plan.fmt.per_head_bytes
    m = (b - a) * G * heads
    raw = plan.buf["raw"][: m * phb]
    c = plan.rec_per_row
    index = plan.rec_index[a * G // c : b * G // c]
    torch.index_select(plan.records, 0, index, out=raw.view(-1, plan.records.shape[1]))
    return raw.view(m, phb), m


def _values(plan: PackedDecodePlan, rec: torch.Tensor, m: int) -> torch.Tensor:
    """`(code - qmax) * scale` (asymmetric: `code * scale + zero`) of `m` head records, fp32 `[m, D]` in scratch."""
    fmt, buf = plan.fmt, plan.buf
    codes, bits, acc = buf["codes"][:m], buf["bits"][:m], buf["acc"][:m]
    codes.copy_(rec[:, fmt.codes_offset : fmt.codes_offset + fmt.code_bytes])
    if fmt.cfg.pack_trits:
        torch.floor_divide(codes[:, :, None], plan.unpack, out=bits)
        bits.remainder_(plan.consts["mask"])  # % 3
    else:
        torch.bitwise_right_shift(codes[:, :, None], plan.unpack, out=bits)
        bits.bitwise_and_(plan.consts["mask"])
    acc.copy_(bits.view(m, -1)[:, : fmt.head_dim])
    blocks = acc.view(m, fmt.num_blocks, -1)
    scale = buf["scale"][:m]
    scale.copy_(rec[:, fmt.scales_offset : fmt.scales_offset + fmt.scale_bytes].view(FP8_DTYPE))
    if fmt.cfg.asymmetric:
        zero = buf["zero"][:m]
        zero.copy_(rec[:, fmt.zeros_offset : fmt.zeros_offset + fmt.zero_bytes].view(FP8_DTYPE))
        blocks.mul_(scale[:, :, None]).add_(zero[:, :, None])
    else:
        blocks.sub_(plan.consts["qmax"]).mul_(scale[:, :, None])
    return acc


def _add_centroids(plan: PackedDecodePlan, rec: torch.Tensor, acc: torch.Tensor, a: int, b: int, m: int) -> None:
    """`acc += codebook[segment, head, stage][id]` for each stage in order (fp32 adds, as `prq_dequantize`)."""
    fmt, buf, st = plan.fmt, plan.buf, plan.fmt.cfg.stages
    base = buf["base"][: b - a]
    torch.index_select(plan.seg_base, 0, plan.tok_seg[a:b], out=base)
    base = base.view(m, st)
    ids = rec[:, fmt.ids_offset : fmt.ids_offset + st]
    idx, cent = buf["idx"][:m], buf["cent"][:m]
    for s in range(st):
        idx.copy_(ids[:, s])
        idx.mul_(plan.consts["id_step"]).add_(base[:, s])
        torch.index_select(plan.cb_source, 0, idx, out=cent.view(torch.uint8))
        if cent.dtype == torch.float32:
            acc.add_(cent)
        else:  # fp32 staging: a mixed-dtype add_ would convert into a fresh tensor
            staged = buf["bits"].view(-1).view(torch.float32)[: m * fmt.head_dim].view(m, -1)
            staged.copy_(cent)
            acc.add_(staged)


def run_decode(plan: PackedDecodePlan, out_t: torch.Tensor) -> None:
    """Decode the plan's packed tokens into their rows of `out_t` `[T, 2, B, heads, D]` (any strides): per tile one
    record gather, the code/scale arithmetic, one centroid gather and add per stage, one cast and one `index_copy_`,
    all into the plan's scratch. No allocation, no host read."""
    cast = plan.buf["cast"]
    for a, b in plan.tiles:
        rec, m = _fields(plan, a, b)
        acc = _values(plan, rec, m)
        _add_centroids(plan, rec, acc, a, b, m)
        tile = cast[: b - a]
        tile.view(m, -1).copy_(acc)
        out_t.index_copy_(0, plan.out_rows[a:b], tile)
