"""Packed view build: dequantize token pieces of PRQ-packed segments, straight from pool pages, into a view.

The flat description of what to read is a *piece table* `pieces`, int64 `[P, 5]`, one row per run of whole tokens
that sit in one token page: `(page, first_slot, count, out_row, cb_offset)` = read token slots
`[first_slot, first_slot + count)` of token page `page`, decode them with the codebooks of the segment whose codebook
pages are `cb_pages[cb_offset:]`, and write them to output rows `[out_row, out_row + count)`. Built on the host from
`layout.page_pieces` (`piece_table`); within a run `out_row` is the running sum of counts (the CSR offsets of the
pieces). Pieces of several packed segments (each with its `cb_offset` into one concatenated `cb_pages`) go in one
table, so several segments' packed runs can be one launch. The cache's views use the generalisation of this table
with a kind column (view_runs.py: dense, packed and zero runs of a whole view in one launch); this packed-only form
reads whole packed segments back (unpacking).

Sources (both are views of the pool arena, see packing.PackedStore):

- `tokens`: uint8 `[num_pages, tokens_per_page, 2, B, token_row_bytes]`, packed token rows (quant/format.py).
- `codebooks`: `[num_pages, rows_per_page, K, D]` in the codebook dtype (the cache dtype, or float8_e4m3fn with
  `codebook_fp8`), the codebook region of the pages; a
  segment's codebook rows are rows `0 .. 2*B*H*stages - 1` laid over its codebook pages (int64, from
  `cb_pages[cb_offset]` on): row `((kv * B + b) * H + h) * stages + s` at page
  `cb_pages[cb_offset + row // rows_per_page]`, slot `row % rows_per_page` (layout.PackedSegmentLayout). A
  contiguous `[R, K, D]` codebook tensor is the one-page case: pass `codebooks[None]` and `cb_pages = [0]`.

Output `out_t` `[T, 2, B, heads, D]` (any strides; the cache passes a permuted view of its `[2, B, T, heads, D]`
view) receives heads `[head_start, head_start + heads)` of every (kv, b). Values follow `prq_dequantize` exactly:
`(code - qmax) * scale` (asymmetric `code * scale + zero`) in fp32, plus the centroid of each stage in stage order,
cast to the cache dtype once.
"""

from __future__ import annotations

import torch

from pagedqvg.kernels.ops import PackedDequantArgs, op_entry
from pagedqvg.layout.segments import page_pieces
from pagedqvg.quant import PackedFormat, prq_dequantize


def piece_table(
    pages: list[int], tokens_per_page: int, t0: int, t1: int, out_row: int = 0, cb_offset: int = 0
) -> list[tuple[int, int, int, int, int]]:
    """Rows `(page, first_slot, count, out_row, cb_offset)` of the piece table for tokens `[t0, t1)` of a segment
    whose token pages are `pages`, written from output row `out_row` on. O(pages touched)."""
    out = []
    o = out_row
    for page, a, b in page_pieces(pages, tokens_per_page, t0, t1):
        out.append((page, a, b - a, o, cb_offset))
        o += b - a
    return out


@op_entry(PackedDequantArgs)
def check_packed_dequant(a: PackedDequantArgs) -> None:
    """Shape/dtype checks shared by the reference and the Triton launch (no data is read: no device sync)."""
    tokens, codebooks, pieces, cb_pages, head_start, out_t, fmt = (
        a.tokens, a.codebooks, a.pieces, a.cb_pages, a.head_start, a.out_t, a.fmt
    )  # fmt: skip
    if tokens.dtype != torch.uint8 or tokens.dim() != 5 or tokens.shape[2] != 2:
        raise ValueError(f"tokens must be uint8 [num_pages, tpp, 2, B, row_bytes], got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")  # fmt: skip
    if tokens.shape[4] != fmt.token_row_bytes or tokens.stride(4) != 1:
        raise ValueError(f"token rows of {tokens.shape[4]} B (stride {tokens.stride(4)}) do not match the format's "
                         f"contiguous {fmt.token_row_bytes} B rows")  # fmt: skip
    K, D = fmt.cfg.centroids, fmt.head_dim
    cb_dtype = fmt.codebook_dtype
    if codebooks.dim() != 4 or tuple(codebooks.shape[2:]) != (K, D) or codebooks.dtype != cb_dtype:
        raise ValueError(f"codebooks must be {cb_dtype} [num_pages, rows_per_page, {K}, {D}], got {codebooks.dtype} "
                         f"{tuple(codebooks.shape)}")  # fmt: skip
    if pieces.dtype != torch.int64 or pieces.dim() != 2 or pieces.shape[1] != 5:
        raise ValueError(f"pieces must be int64 [P, 5], got {pieces.dtype} {tuple(pieces.shape)}")
    if cb_pages.dtype != torch.int64 or cb_pages.dim() != 1:
        raise ValueError(f"cb_pages must be int64 [n], got {cb_pages.dtype} {tuple(cb_pages.shape)}")
    B = tokens.shape[3]
    if out_t.dim() != 5 or tuple(out_t.shape[1:3]) != (2, B) or out_t.shape[4] != D:
        raise ValueError(f"out_t must be [T, 2, {B}, heads, {D}], got {tuple(out_t.shape)}")
    if out_t.dtype != fmt.dtype:
        raise TypeError(f"out_t dtype {out_t.dtype} differs from the cache dtype {fmt.dtype}")
    if head_start < 0 or head_start + out_t.shape[3] > fmt.num_heads:
        raise ValueError(f"heads [{head_start}, {head_start + out_t.shape[3]}) outside the {fmt.num_heads} heads")
    devices = {t.device for t in (tokens, codebooks, pieces, cb_pages, out_t)}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")


#: Elements dequantized per step by `packed_dequant_torch` (its fp32 temporaries stay at a few MiB whatever the size
#: of the range).
DEQUANT_TILE_ELEMS = 1 << 18


def segment_codebooks(
    codebooks: torch.Tensor, cb_pages: torch.Tensor, cb_offset: int, fmt_all: PackedFormat
) -> torch.Tensor:
    """Codebooks `[2*B*H, stages, K, D]` of the segment whose codebook pages are `cb_pages[cb_offset:]` (one gather
    of its `fmt_all.num_codebook_rows` rows out of `codebooks` `[num_pages, rows_per_page, K, D]`)."""
    rpp = codebooks.shape[1]
    r = torch.arange(fmt_all.num_codebook_rows, device=codebooks.device)
    pages = cb_pages[cb_offset + r // rpp]
    return codebooks[pages, r % rpp].reshape(fmt_all.num_heads, fmt_all.cfg.stages, -1, fmt_all.head_dim)


def piece_tokens(pieces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces `[P, >=4]` `(page, first_slot, count, out_row, ...)` token by token: `(page, slot, out_row)`, each
    int64 `[sum of counts]`, in piece order. O(tokens)."""
    page, first, count, out_row = pieces[:, 0], pieces[:, 1], pieces[:, 2], pieces[:, 3]
    total = int(count.sum())
    start = torch.cumsum(count, 0) - count  # each piece's first position in the flat token list
    within = torch.arange(total, device=pieces.device) - start.repeat_interleave(count, output_size=total)
    return (
        page.repeat_interleave(count, output_size=total),
        first.repeat_interleave(count, output_size=total) + within,
        out_row.repeat_interleave(count, output_size=total) + within,
    )


@op_entry(PackedDequantArgs)
def packed_dequant_torch(a: PackedDequantArgs) -> None:
    """Reference: `prq_dequantize` of every piece's token rows (all 2*B*H heads) and a copy of the head slice
    (fields: `ops.PackedDequantArgs`).

    Per segment (pieces sharing a `cb_offset`): one gather of its token rows, `prq_dequantize` in steps of
    `DEQUANT_TILE_ELEMS` elements, one `index_copy_` of each step into its output rows. `fmt` is the format of one
    (kv, b) row: `fmt.num_heads` = H, the cache's heads. Exact `prq_dequantize` values (it is elementwise per token,
    so the step size does not change them).
    """
    check_packed_dequant(a)
    tokens, codebooks, cb_pages, out_t, fmt = a.tokens, a.codebooks, a.cb_pages, a.out_t, a.fmt
    head_start = a.head_start
    pieces = a.pieces[a.pieces[:, 2] > 0]
    if pieces.shape[0] == 0:
        return
    B = tokens.shape[3]
    H, D, heads = fmt.num_heads, fmt.head_dim, out_t.shape[3]
    fmt_all = PackedFormat(head_dim=D, num_heads=2 * B * H, cfg=fmt.cfg, dtype=fmt.dtype)
    step = max(1, DEQUANT_TILE_ELEMS // (2 * B * H * D))  # tokens per step: bounded fp32 temporaries
    for cb_off in torch.unique(pieces[:, 4]).tolist():
        cb = segment_codebooks(codebooks, cb_pages, cb_off, fmt_all)
        page, slot, out_row = piece_tokens(pieces[pieces[:, 4] == cb_off])
        rows = tokens[page, slot].reshape(page.shape[0], -1)  # [n, 2*B*row_bytes], K then V per token
        for x in range(0, rows.shape[0], step):
            full = prq_dequantize(rows[x : x + step], cb, fmt_all)
            full = full.view(-1, 2, B, H, D)[:, :, :, head_start : head_start + heads]
            out_t.index_copy_(0, out_row[x : x + step], full)
