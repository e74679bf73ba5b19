"""Residual pack: block-quantize PRQ's final residual and write the packed token records into token slots.

The last step of `prq_quantize` (quant/prq.py: `pack_residual_rows`), with the destination given as pages:

- `resid` float32 `[G, S, D]`: the final residual of G folded heads (the cache folds K/V x batch x heads, in
  storage order), `ids` uint8 `[G, S, stages]`: the centroid id of each k-means stage.
- `dest` uint8 `[num_pages, slots_per_page, >= G * per_head_bytes]` (last stride 1): token slots; token `s` goes to
  `dest[page_idx[s], slot_idx[s]]`, whose first `G * per_head_bytes` bytes become the records of heads `0..G-1`
  (quant/format.py). Other bytes of the slot are not touched.
- `fmt`: the per-head record format; `fmt.num_heads` must be G.

Per block of `block_size` channels (quant/prq.py, `_block_quantize`): symmetric scale = fp8(max|r| / qmax), code =
round(r / scale) clamped to +-qmax, stored + qmax; asymmetric scale = fp8((max - min) / qmax), zero = fp8(min), code
= round((r - zero) / scale) clamped to 0..qmax; a zero scale gives the zero-level code. fp8 is e4m3fn, round to
nearest even, clamped to +-448; `round` is half to even. The Triton kernel (triton_residual_pack.py) writes the same
bytes.
"""

from __future__ import annotations

import torch

from pagedqvg.kernels.ops import ResidualPackArgs, op_entry
from pagedqvg.quant import pack_residual_rows

#: Residual elements packed per step by the torch reference (bounds its fp32 temporaries to a few MiB).
PACK_TILE_ELEMS = 1 << 20


@op_entry(ResidualPackArgs)
def check_residual_pack(a: ResidualPackArgs) -> None:
    """Shape/dtype checks shared by the reference and the Triton launch (no data is read: no device sync)."""
    resid, ids, dest, page_idx, slot_idx, fmt = a.resid, a.ids, a.dest, a.page_idx, a.slot_idx, a.fmt
    G, D, st = fmt.num_heads, fmt.head_dim, fmt.cfg.stages
    if resid.dtype != torch.float32 or resid.dim() != 3 or resid.shape[0] != G or resid.shape[2] != D:
        raise ValueError(f"resid must be float32 [{G}, S, {D}], got {resid.dtype} {tuple(resid.shape)}")
    S = resid.shape[1]
    if ids.dtype != torch.uint8 or tuple(ids.shape) != (G, S, st):
        raise ValueError(f"ids must be uint8 [{G}, {S}, {st}], got {ids.dtype} {tuple(ids.shape)}")
    if dest.dtype != torch.uint8 or dest.dim() != 3 or dest.shape[2] < fmt.token_row_bytes or dest.stride(2) != 1:
        raise ValueError(
            f"dest must be uint8 [num_pages, slots, >= {fmt.token_row_bytes}] with last stride 1, got {dest.dtype} "
            f"{tuple(dest.shape)} strides {dest.stride()}"
        )
    for name, idx in (("page_idx", page_idx), ("slot_idx", slot_idx)):
        if idx.dtype != torch.int64 or tuple(idx.shape) != (S,):
            raise ValueError(f"{name} must be int64 [{S}], got {idx.dtype} {tuple(idx.shape)}")
    devices = {t.device for t in (resid, ids, dest, page_idx, slot_idx)}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")


@op_entry(ResidualPackArgs)
def residual_pack_torch(a: ResidualPackArgs) -> None:
    """Reference: `pack_residual_rows` on token tiles, each tile's rows copied to its (page, slot) destinations
    (fields: `ops.ResidualPackArgs`). Indices are checked first (IndexError naming the range; nothing written)."""
    check_residual_pack(a)
    resid, ids, dest, page_idx, slot_idx, fmt = a.resid, a.ids, a.dest, a.page_idx, a.slot_idx, a.fmt
    for name, idx, bound in (("page", page_idx, dest.shape[0]), ("slot", slot_idx, dest.shape[1])):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= bound):
            raise IndexError(f"{name} index out of range: {int(idx.min())}..{int(idx.max())}, valid 0..{bound - 1}")
    G, S, D = resid.shape
    step = max(1, PACK_TILE_ELEMS // max(1, G * D))
    row = fmt.token_row_bytes
    for a in range(0, S, step):
        b = min(S, a + step)
        dest[page_idx[a:b], slot_idx[a:b], :row] = pack_residual_rows(resid[:, a:b], ids[:, a:b], fmt)
