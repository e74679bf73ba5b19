"""Packed (PRQ) segments in pool pages: quantize a dense segment into pages, read and dequantize token ranges.

Geometry comes from `layout.PackedSegmentLayout` and bytes from `quant.format.PackedFormat`; this module only
moves rows between pages and the PRQ steps. Packing is `quantize` (`quant.prq.prq_kmeans`, its assign and update
steps through the kernel dispatch: Triton k-means kernels on CUDA, then one `residual_pack` launch per K/V half that
block-quantizes the final residual into staged packed rows; torch references on CPU) and then `write` (page copies).

Token pages are read as slices (whole tokens per page), so dequantizing a visible range needs no gather: one
`prq_dequantize` per page piece, for K and V and every batch element and head at once (they are folded into
`2 * B * H` heads, the order the rows are stored in).

With the Triton backend (`kernels.kernel_backend`: CUDA, or PAGEDQVG_KERNELS=triton), `dequantize_into` (unpacking
a segment for a rewrite) instead describes the range as a piece table and makes one `packed_dequant` launch that
reads token and codebook pages directly (kernels/dequant.py, kernels/triton_dequant.py); `dequantize_runs_into`
does the same for the packed runs of several segments at once. (Views on the Triton backend do not come here: the
cache builds a whole view, dense, packed and zero rows, in one `view_runs` launch.) The values are the same bits as
the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocator import BlockPool
from .kernels.dequant import piece_table
from .kernels.dispatch import kernel_backend, kmeans_assign, kmeans_update, packed_dequant, residual_pack
from .kernels.rows import int64_on
from .layout import PackedSegmentLayout, page_pieces
from .quant import PackedFormat, QuantConfig, prq_dequantize, prq_kmeans

#: Elements dequantized per step on the torch path (fp32 temporaries stay at a few MiB whatever the view size).
DEQUANT_TILE_ELEMS = 1 << 18


@dataclass(frozen=True, slots=True)
class QuantizedChunk:
    """A chunk between `PackedStore.quantize` and `PackedStore.write`: packed, but nothing of the cache changed yet.

    token_rows: uint8 `[n, 2, B, row_bytes]` packed token rows (quant/format.py), K then V per token.
    codebook_rows: uint8 `[2*B*H*stages, codebook_row_bytes]` in (kv, b, h, stage) order.
    """

    token_rows: torch.Tensor
    codebook_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Tokens in the chunk (n)."""
        return int(self.token_rows.shape[0])


class PackedStore:
    """Slice views of the arena for one layer shape's packed segments, and the pack / unpack operations."""

    def __init__(
        self, pool: BlockPool, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, cfg: QuantConfig
    ) -> None:
        self.cfg = cfg
        self.batch_size = batch_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.fmt = PackedFormat(head_dim=head_dim, num_heads=num_heads, cfg=cfg, dtype=dtype)
        # K/V x batch x heads folded into one head axis, in storage order (kv, b, h).
        self.fmt_all = PackedFormat(head_dim=head_dim, num_heads=2 * batch_size * num_heads, cfg=cfg, dtype=dtype)
        self.fmt_batch = PackedFormat(head_dim=head_dim, num_heads=batch_size * num_heads, cfg=cfg, dtype=dtype)
        self.layout = PackedSegmentLayout.from_format(batch_size, self.fmt, pool.page_bytes)
        cb = self.layout.codebook_region  # raises ValueError if a codebook row exceeds a page
        self.tpp = self.layout.tokens_per_page
        if self.tpp < 1:
            raise ValueError(
                f"a packed token ({2 * batch_size} rows of {self.fmt.token_row_bytes} B) does not fit a page of "
                f"{pool.page_bytes} B; use page_bytes >= {-(-2 * batch_size * self.fmt.token_row_bytes // 256) * 256}"
            )
        raw = pool.pages_as(torch.uint8)
        row = self.fmt.token_row_bytes
        self.token_view = raw[:, : self.tpp * 2 * batch_size * row].view(pool.num_pages, self.tpp, 2, batch_size, row)
        self.cb_rpp = cb.rows_per_page
        self.codebook_view = raw[:, : cb.rows_per_page * cb.row_bytes].view(pool.num_pages, cb.rows_per_page, -1)
        self.num_cb_rows = 2 * batch_size * self.layout.codebook_rows
        # The codebook region again, typed: [num_pages, rows_per_page, K, D] of the codebook dtype (the cache dtype,
        # or fp8 with codebook_fp8; the kernels read it).
        K = cfg.centroids
        self.codebook_rows = pool.pages_as(self.fmt.codebook_dtype)[:, : cb.rows_per_page * K * head_dim].view(
            pool.num_pages, cb.rows_per_page, K, head_dim
        )
        self.backend = kernel_backend(pool.device)

    def token_pages(self, tokens: int) -> int:
        return self.layout.token_pages(tokens)

    def pages_for_tokens(self, tokens: int) -> int:
        return self.layout.pages_for_tokens(tokens)

    # ------------------------------------------------------------------ pack
    def quantize(self, dense: torch.Tensor) -> QuantizedChunk:
        """Dense K/V `[2, n, B, H, D]` → packed rows (`QuantizedChunk`), nothing written to the pool yet.

        K, then V: `prq_kmeans` over the B*H folded heads (its assign and update steps through the kernel dispatch:
        Triton on CUDA), then `residual_pack` (one launch) block-quantizes the final residual straight into that
        half of the staged token rows, so one half's float32 residual exists at a time. The rows are staged, not
        written to pages, because the cache frees the chunk's dense pages before it takes the packed ones (the
        pool's peak stays what the planner computes) and everything that can fail must happen before that: the
        commit is then page copies only (`write`). The staging costs 2*B*row_bytes per token, ~3% of the dense
        chunk (35 vs 1,280 B per token-head at int2, D=128). Raises ValueError on non-finite values."""
        _, n, B, H, D = dense.shape
        rows = torch.empty(n, 2, B * self.fmt.token_row_bytes, dtype=torch.uint8, device=dense.device)
        token = torch.arange(n, device=dense.device)
        slot = torch.zeros(n, dtype=torch.int64, device=dense.device)
        codebooks = []
        for kv in range(2):
            km = prq_kmeans(dense[kv].reshape(n, B * H, D), self.cfg, assign=kmeans_assign, update=kmeans_update)
            residual_pack(km.resid, km.ids, rows[:, kv : kv + 1], token, slot, self.fmt_batch)
            codebooks.append(km.codebooks)
        return QuantizedChunk(
            token_rows=rows.view(n, 2, B, -1), codebook_rows=self.fmt_all.pack_codebooks(torch.cat(codebooks))
        )

    def write(self, tok_pages: list[int], cb_pages: list[int], q: QuantizedChunk) -> None:
        """Copy a `quantize` result into a packed segment's pages (token rows, then codebook rows; page copies
        only)."""
        o = 0
        for page, a, b in page_pieces(tok_pages, self.tpp, 0, q.num_tokens):
            self.token_view[page, a:b].copy_(q.token_rows[o : o + b - a])
            o += b - a
        o = 0
        for page, a, b in page_pieces(cb_pages, self.cb_rpp, 0, self.num_cb_rows):
            self.codebook_view[page, a:b].copy_(q.codebook_rows[o : o + b - a])
            o += b - a

    # ------------------------------------------------------------------ read
    def codebooks(self, cb_pages: list[int]) -> torch.Tensor:
        """Codebooks `[2*B*H, stages, K, D]` of one packed segment (a small copy out of its pages)."""
        pieces = [self.codebook_view[p, a:b] for p, a, b in page_pieces(cb_pages, self.cb_rpp, 0, self.num_cb_rows)]
        rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return self.fmt_all.unpack_codebooks(rows)

    def dequantize_into(
        self, out_t: torch.Tensor, tok_pages: list[int], cb_pages: list[int], t0: int, t1: int, head_start: int
    ) -> None:
        """Dequantize tokens `[t0, t1)` into `out_t` `[t1 - t0, 2, B, Hout, D]` (heads from `head_start`)."""
        if self.backend == "triton":
            self.dequantize_runs_into(out_t, [(0, tok_pages, cb_pages, t0, t1)], head_start)
            return
        codebooks = self.codebooks(cb_pages)
        heads = out_t.shape[3]
        B, H, D = self.batch_size, self.num_heads, self.head_dim
        hs = slice(head_start, head_start + heads)
        step = max(1, DEQUANT_TILE_ELEMS // (2 * B * H * D))  # tokens per step: bounded fp32 temporaries
        o = 0
        for page, a, b in page_pieces(tok_pages, self.tpp, t0, t1):
            for x in range(a, b, step):
                m = min(b, x + step) - x
                rows = self.token_view[page, x : x + m].reshape(m, -1)
                full = prq_dequantize(rows, codebooks, self.fmt_all).view(m, 2, B, H, D)
                out_t[o : o + m, 0].copy_(full[:, 0, :, hs])  # K and V separately: contiguous copies when B == 1
                out_t[o : o + m, 1].copy_(full[:, 1, :, hs])
                o += m

    def dequantize_runs_into(
        self, out_t: torch.Tensor, runs: list[tuple[int, list[int], list[int], int, int]], head_start: int
    ) -> None:
        """Packed runs: each `(out_row, tok_pages, cb_pages, t0, t1)` dequantizes tokens `[t0, t1)` of a packed
        segment into `out_t[out_row : out_row + t1 - t0]` (`out_t` `[T, 2, B, Hout, D]`). The torch backend's view
        build passes every packed run of a view (`dequantize_into` per run); on the Triton backend views use the
        run kernel instead and this serves `dequantize_into` (one run, one `packed_dequant` launch; any number of
        runs would be one launch too: piece table and codebook pages in one host->device copy). Same values
        either way."""
        if self.backend != "triton":
            for o, tok_pages, cb_pages, t0, t1 in runs:
                self.dequantize_into(out_t[o : o + t1 - t0], tok_pages, cb_pages, t0, t1, head_start)
            return
        flat: list[int] = []
        cbs: list[int] = []
        for o, tok_pages, cb_pages, t0, t1 in runs:
            for piece in piece_table(tok_pages, self.tpp, t0, t1, o, len(cbs)):
                flat.extend(piece)
            cbs.extend(cb_pages)
        if not flat:
            return
        desc = int64_on(flat + cbs, out_t.device)
        n = len(flat)
        packed_dequant(self.token_view, self.codebook_rows, desc[:n].view(-1, 5), desc[n:], head_start, out_t, self.fmt)
