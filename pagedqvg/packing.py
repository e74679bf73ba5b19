"""Packed (PRQ) segments in pool pages: quantize a dense segment into pages, read and dequantize token ranges.

Geometry comes from `layout.PackedSegmentLayout` and bytes from `quant.format.PackedFormat`; this module only
moves rows between pages and the torch PRQ reference (`quant.prq`). The Triton view builder reads the same rows.
"""

from __future__ import annotations

import torch

from .allocator import BlockPool
from .layout import PackedSegmentLayout
from .quant import PackedFormat, QuantConfig, prq_dequantize, prq_quantize


class PackedStore:
    """Row views of the arena for one layer shape's packed segments, and the pack / unpack operations."""

    def __init__(
        self, pool: BlockPool, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, cfg: QuantConfig
    ) -> None:
        self.cfg = cfg
        self.batch_size = batch_size
        self.num_heads = num_heads
        self.fmt = PackedFormat(head_dim=head_dim, num_heads=num_heads, cfg=cfg, dtype=dtype)
        self.fmt_folded = PackedFormat(head_dim=head_dim, num_heads=batch_size * num_heads, cfg=cfg, dtype=dtype)
        self.layout = PackedSegmentLayout.from_format(batch_size, self.fmt, pool.page_bytes)
        tok, cb = self.layout.token_region, self.layout.codebook_region  # raise ValueError if a row exceeds a page
        raw = pool.pages_as(torch.uint8)
        self.token_rows = raw[:, : tok.rows_per_page * tok.row_bytes].view(pool.num_pages, tok.rows_per_page, -1)
        self.codebook_rows = raw[:, : cb.rows_per_page * cb.row_bytes].view(pool.num_pages, cb.rows_per_page, -1)
        self.tok_rpp, self.cb_rpp = tok.rows_per_page, cb.rows_per_page
        device = pool.device
        b = torch.arange(batch_size, dtype=torch.int64, device=device)
        kv = torch.arange(2, dtype=torch.int64, device=device)
        self.kv_batch = (kv[:, None] * batch_size + b[None, :])[:, :, None]  # [2, B, 1]
        n_cb = 2 * batch_size * self.layout.codebook_rows
        self.cb_row_ids = torch.arange(n_cb, dtype=torch.int64, device=device)

    def token_pages(self, tokens: int) -> int:
        return self.layout.token_pages(tokens)

    def codebook_pages(self) -> int:
        return self.layout.codebook_pages()

    def pages_for_tokens(self, tokens: int) -> int:
        return self.layout.pages_for_tokens(tokens)

    # ------------------------------------------------------------------ pack
    def quantize(self, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V `[2, B, n, H, D]` → (token rows uint8 `[2*B*n, row_bytes]` token-major, codebook rows uint8
        `[2*B*H*stages, codebook_row_bytes]`). Each (batch, head) gets its own codebooks. Raises ValueError on
        non-finite values (nothing is written)."""
        _, B, n, H, D = dense.shape
        tok_parts, cb_parts = [], []
        for kv in range(2):
            x = dense[kv].permute(1, 0, 2, 3).reshape(n, B * H, D)
            seg = prq_quantize(x, self.cfg)
            tok_parts.append(seg.token_rows.view(n, B, -1))
            cb_parts.append(self.fmt_folded.pack_codebooks(seg.codebooks))
        tok = torch.stack(tok_parts, dim=1).reshape(2 * B * n, -1)
        return tok, torch.cat(cb_parts, dim=0)

    def write(self, tok_pages_t: torch.Tensor, cb_pages_t: torch.Tensor, tok: torch.Tensor, cb: torch.Tensor) -> None:
        """Store rows produced by `quantize` into a packed segment's pages."""
        r = torch.arange(tok.shape[0], dtype=torch.int64, device=tok.device)
        self.token_rows.index_put_((tok_pages_t[r // self.tok_rpp], r % self.tok_rpp), tok)
        c = self.cb_row_ids
        self.codebook_rows.index_put_((cb_pages_t[c // self.cb_rpp], c % self.cb_rpp), cb)

    # ------------------------------------------------------------------ read
    def token_row_index(self, tok_pages_t: torch.Tensor, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(page_idx, slot_idx)` `[2, B, m]` of the packed token rows of tokens `[t0, t1)`."""
        t = torch.arange(t0, t1, dtype=torch.int64, device=tok_pages_t.device)
        rows = t * self.kv_batch.numel() + self.kv_batch
        return tok_pages_t[rows // self.tok_rpp], rows % self.tok_rpp

    def read_codebooks(self, cb_pages_t: torch.Tensor) -> torch.Tensor:
        """Codebook rows `[2, B, H*stages, codebook_row_bytes]` of one packed segment."""
        c = self.cb_row_ids
        rows = self.codebook_rows[cb_pages_t[c // self.cb_rpp], c % self.cb_rpp]
        return rows.view(2, self.batch_size, self.layout.codebook_rows, -1)

    def dequantize(
        self, tok_pages_t: torch.Tensor, cb_pages_t: torch.Tensor, t0: int, t1: int, head_start: int, heads: int
    ) -> torch.Tensor:
        """Tokens `[t0, t1)` of a packed segment, heads `[head_start, head_start + heads)`, as
        `[2, B, m, heads, D]` in the cache dtype (torch reference: one temporary per (kv, batch))."""
        pidx, sidx = self.token_row_index(tok_pages_t, t0, t1)
        tok = self.token_rows[pidx, sidx]  # [2, B, m, row_bytes]
        cb = self.read_codebooks(cb_pages_t)
        B = self.batch_size
        out = torch.empty(2, B, t1 - t0, heads, self.fmt.head_dim, dtype=self.fmt.dtype, device=tok.device)
        for kv in range(2):
            for b in range(B):
                codebooks = self.fmt.unpack_codebooks(cb[kv, b])
                full = prq_dequantize(tok[kv, b], codebooks, self.fmt)  # [m, H, D]
                out[kv, b] = full[:, head_start : head_start + heads]
        return out
