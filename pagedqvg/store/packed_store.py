"""Packed (PRQ) segments in pool pages: quantize a dense segment into pages, read and dequantize token ranges.

Geometry comes from `layout.PackedSegmentLayout` and bytes from `quant.format.PackedFormat`; this module only
moves rows between pages and the PRQ steps. Packing is `quantize` (`quant.prq.prq_kmeans`, its assign and update
steps through the kernel dispatch: Triton k-means kernels on CUDA, then one `residual_pack` launch per K/V half that
block-quantizes the final residual into staged packed rows; torch references on CPU) and then `write` (page copies).

Reads go through the kernel dispatch like every other move of rows: `dequantize_into` (unpacking a segment for a
rewrite) and `dequantize_runs_into` describe the token range as a piece table (kernels/dequant.py) and make one
`packed_dequant` call that reads token and codebook pages directly: a Triton launch (CUDA, or PAGEDQVG_KERNELS=
triton), else the torch reference, vectorized per segment. (Views do not come here: `page_io.PageIO` builds a whole
view, dense, packed and zero rows, with one `view_runs` call.) Both backends give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.kernels.dispatch import kernel_backend, kmeans_assign, kmeans_update, packed_dequant, residual_pack
from pagedqvg.kernels.rows import int64_on
from pagedqvg.kernels.view.dequant import piece_table
from pagedqvg.layout.segments import PackedSegmentLayout
from pagedqvg.quant import PackedFormat, QuantConfig, prq_kmeans


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
        self.name = cfg.mode  # the tier format name (int4, int2 or compact; segments name it in `Segment.fmt`)
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
        chunk (35 vs 1,280 B per token-head at int2, D=128). Raises ValueError on non-finite values. Runs with
        autocast off: callers (SGLang's DiT forward) write K/V inside `torch.autocast`, which would change the
        k-means matmul precision and refuses fp8 codebooks (compact) in `torch.cat`."""
        with torch.autocast(dense.device.type, enabled=False):
            return self._quantize(dense)

    def _quantize(self, dense: torch.Tensor) -> QuantizedChunk:
        """`quantize` outside autocast."""
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

    def _token_index(self, tok_pages: list[int], t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(page, slot)` of tokens `[t0, t1)` of a packed segment whose token pages are `tok_pages` (int64 [t1 - t0]
        on the pool's device)."""
        t = torch.arange(t0, t1, dtype=torch.int64)
        pages = int64_on(tok_pages, self.token_view.device)
        return pages[(t // self.tpp).to(pages.device)], (t % self.tpp).to(pages.device)

    def _codebook_index(self, cb_pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(page, slot)` of a packed segment's `num_cb_rows` codebook rows (int64, on the pool's device)."""
        r = torch.arange(self.num_cb_rows, dtype=torch.int64)
        pages = int64_on(cb_pages, self.codebook_view.device)
        return pages[(r // self.cb_rpp).to(pages.device)], (r % self.cb_rpp).to(pages.device)

    def write(self, tok_pages: list[int], cb_pages: list[int], q: QuantizedChunk) -> None:
        """Copy a `quantize` result into a packed segment's pages: one indexed copy of its token rows, one of its
        codebook rows."""
        self.token_view.index_put_(self._token_index(tok_pages, 0, q.num_tokens), q.token_rows)
        self.codebook_view.index_put_(self._codebook_index(cb_pages), q.codebook_rows)

    # ------------------------------------------------------------------ read
    def codebooks(self, cb_pages: list[int]) -> torch.Tensor:
        """Codebooks `[2*B*H, stages, K, D]` of one packed segment (a small copy out of its pages)."""
        return self.fmt_all.unpack_codebooks(self.codebook_view[self._codebook_index(cb_pages)])

    def dequantize_into(
        self, out_t: torch.Tensor, tok_pages: list[int], cb_pages: list[int], t0: int, t1: int, head_start: int
    ) -> None:
        """Dequantize tokens `[t0, t1)` into `out_t` `[t1 - t0, 2, B, Hout, D]` (heads from `head_start`)."""
        self.dequantize_runs_into(out_t, [(0, tok_pages, cb_pages, t0, t1)], head_start)

    def dequantize_runs_into(
        self, out_t: torch.Tensor, runs: list[tuple[int, list[int], list[int], int, int]], head_start: int
    ) -> None:
        """Packed runs: each `(out_row, tok_pages, cb_pages, t0, t1)` dequantizes tokens `[t0, t1)` of a packed
        segment into `out_t[out_row : out_row + t1 - t0]` (`out_t` `[T, 2, B, Hout, D]`): one piece table and
        codebook page list (one host->device copy), one `packed_dequant` (Triton launch, or the vectorized torch
        reference). Views do not come here (`page_io.PageIO` builds a whole view with `view_runs`)."""
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

    def dequantize_pieces(
        self, out_t: torch.Tensor, pieces: torch.Tensor, cb_pages: torch.Tensor | None, head_start: int
    ) -> None:
        """A view's runs of this store's segments (a piece table `[P, 5]` on the device and the concatenated codebook
        pages its `cb_offset`s index) into `out_t` `[T, 2, B, heads, D]`: one `packed_dequant` (a Triton launch on
        the Triton backend, else the torch reference). Used by `page_io.PageIO` for the packed formats of a tiered
        cache other than the history's."""
        assert cb_pages is not None
        packed_dequant(self.token_view, self.codebook_rows, pieces, cb_pages, head_start, out_t, self.fmt)
