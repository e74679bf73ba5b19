"""Formats by age in the cache (issue 23): one store per tier format of a layer, and the fp8 tier's store.

A quantized cache holds completed chunks in up to three packed formats at once (the sink's, the recent tier's and
the history's; `QuantConfig.tier_format`). Each format has its own store over the same pool pages, with one
interface, the `TierStore` Protocol (`quantize` -> `QuantizedChunk`, `write`, `pages_for_tokens`, `token_pages`,
`layout.used_bytes_for_tokens`, `dequantize_into`, `dequantize_pieces`): `PackedStore` for the PRQ formats (int4,
int2, compact; each with its tier's `QuantConfig.tier_quant`) and `Fp8Store` here for fp8 (`quant/fp8.py`; token
rows only, no codebooks): the registry's codec picks the class (`STORE_CLASSES`, `quant/formats.py`). A packed
segment names its format (`Segment.fmt`); `tier_stores` builds the map format -> store once per cache.

Views: `page_io.PageIO` puts dense, zero and history-format packed runs in its one `view_runs` call and reads the
runs of every other format with that store's `dequantize_pieces` (a `packed_dequant` call: a Triton launch on the
Triton backend; fp8 has no Triton kernel and always runs its torch reference, `Fp8Store.dequantize_pieces`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pagedqvg.allocator import BlockPool
from pagedqvg.kernels.rows import int64_on
from pagedqvg.kernels.view.dequant import piece_table, piece_tokens
from pagedqvg.layout.segments import Fp8SegmentLayout
from pagedqvg.quant import QuantConfig
from pagedqvg.quant.config import TIERS
from pagedqvg.quant.formats import get_format
from pagedqvg.quant.fp8 import Fp8Format
from pagedqvg.store.packed_store import PackedStore, QuantizedChunk

__all__ = ["STORE_CLASSES", "ExtraRuns", "Fp8Store", "TierStore", "tier_stores"]


class _UsedBytes(Protocol):
    def used_bytes_for_tokens(self, tokens: int) -> int: ...


class TierStore(Protocol):
    """One packed format's segments in pool pages: the interface `PackedStore` (PRQ formats) and `Fp8Store` (fp8)
    implement, the cache's packer (`cache/packing.py`) and `page_io.PageIO` use, whatever the format."""

    @property
    def name(self) -> str:
        """The format name (`quant/formats.py`); packed segments record it in `Segment.fmt`."""
        ...

    @property
    def tpp(self) -> int:
        """Whole tokens per token page."""
        ...

    @property
    def layout(self) -> _UsedBytes:
        """The segment layout (`used_bytes_for_tokens`: rows and codebooks really occupied, bytes)."""
        ...

    def token_pages(self, tokens: int) -> int:
        """Token pages of a segment of `tokens` tokens."""
        ...

    def pages_for_tokens(self, tokens: int) -> int:
        """All pages (token pages, then codebook pages) of a segment of `tokens` tokens."""
        ...

    def quantize(self, dense: torch.Tensor) -> QuantizedChunk:
        """Dense K/V `[2, n, B, H, D]` -> staged rows; nothing is written to the pool. ValueError on bad values."""
        ...

    def write(self, tok_pages: list[int], cb_pages: list[int], q: QuantizedChunk) -> None:
        """Copy a `quantize` result into a segment's pages."""
        ...

    def dequantize_into(
        self, out_t: torch.Tensor, tok_pages: list[int], cb_pages: list[int], t0: int, t1: int, head_start: int
    ) -> None:
        """Decode tokens `[t0, t1)` into `out_t` `[t1 - t0, 2, B, Hout, D]` (heads from `head_start`)."""
        ...

    def dequantize_pieces(
        self, out_t: torch.Tensor, pieces: torch.Tensor, cb_pages: torch.Tensor | None, head_start: int
    ) -> None:
        """Decode a view's piece table (`kernels/view/dequant.py`) into rows of `out_t` `[T, 2, B, heads, D]`."""
        ...


class Fp8Store:
    """fp8-tier segments of one layer shape in pool pages: `Fp8SegmentLayout` (whole tokens per page, K and V of
    every batch element side by side: `[tokens_per_page, 2, B, token_row_bytes]`), no codebook pages.

    Raises ValueError when one token's rows do not fit a page. `cfg` is accepted for the stores' one constructor
    signature (`STORE_CLASSES`) and ignored: fp8 packs without a PRQ config."""

    name = "fp8"

    def __init__(
        self,
        pool: BlockPool,
        batch_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cfg: QuantConfig | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.fmt = Fp8Format(head_dim, num_heads)
        self.layout = Fp8SegmentLayout(batch_size, self.fmt.token_row_bytes, pool.page_bytes)
        self.tpp = self.layout.tokens_per_page
        row = self.fmt.token_row_bytes
        raw = pool.pages_as(torch.uint8)
        self.token_view = raw[:, : self.tpp * 2 * batch_size * row].view(pool.num_pages, self.tpp, 2, batch_size, row)

    def token_pages(self, tokens: int) -> int:
        """Pages of a segment of `tokens` tokens (all token pages: no codebooks)."""
        return self.layout.pages_for_tokens(tokens)

    def pages_for_tokens(self, tokens: int) -> int:
        return self.layout.pages_for_tokens(tokens)

    def quantize(self, dense: torch.Tensor) -> QuantizedChunk:
        """Dense K/V `[2, n, B, H, D]` -> staged fp8 token rows `[n, 2, B, row_bytes]` (no codebook rows); ValueError
        on non-finite values. Nothing is written to the pool. O(n B H D)."""
        rows = self.fmt.quantize(dense.permute(1, 0, 2, 3, 4))
        return QuantizedChunk(rows.contiguous(), torch.empty(0, 0, dtype=torch.uint8, device=dense.device))

    def _token_index(self, tok_pages: list[int], t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(t0, t1, dtype=torch.int64)
        pages = int64_on(tok_pages, self.token_view.device)
        return pages[(t // self.tpp).to(pages.device)], (t % self.tpp).to(pages.device)

    def write(self, tok_pages: list[int], cb_pages: list[int], q: QuantizedChunk) -> None:
        """Copy a `quantize` result into a segment's pages (one indexed copy; `cb_pages` is empty)."""
        self.token_view.index_put_(self._token_index(tok_pages, 0, q.num_tokens), q.token_rows)

    def _decode(self, rows: torch.Tensor, head_start: int, heads: int) -> torch.Tensor:
        """uint8 token rows `[..., row_bytes]` -> heads `[head_start, head_start + heads)` `[..., heads, D]`."""
        per = self.fmt.per_head_bytes
        sliced = rows[..., head_start * per : (head_start + heads) * per]
        return Fp8Format(self.head_dim, heads).dequantize(sliced, self.dtype)

    def dequantize_into(
        self, out_t: torch.Tensor, tok_pages: list[int], cb_pages: list[int], t0: int, t1: int, head_start: int
    ) -> None:
        """Decode tokens `[t0, t1)` into `out_t` `[t1 - t0, 2, B, Hout, D]` (heads from `head_start`)."""
        rows = self.token_view[self._token_index(tok_pages, t0, t1)]
        out_t.copy_(self._decode(rows, head_start, out_t.shape[3]))

    def dequantize_pieces(
        self, out_t: torch.Tensor, pieces: torch.Tensor, cb_pages: torch.Tensor | None, head_start: int
    ) -> None:
        """Decode a piece table (`kernels/dequant.py`'s `(page, first_slot, count, out_row, cb_offset)` rows) into
        rows of `out_t` `[T, 2, B, heads, D]`: one gather and one `index_copy_` (torch on every backend: fp8 has no
        Triton kernel). `cb_pages` is ignored."""
        page, slot, out_row = piece_tokens(pieces)
        rows = self.token_view[page, slot]
        out_t.index_copy_(0, out_row, self._decode(rows, head_start, out_t.shape[3]))


#: The store class of each packed codec of the registry (`TierFormat.codec`; dense rows are the cache's own), all
#: constructed as `cls(pool, batch_size, num_heads, head_dim, dtype, cfg)` (`cfg`: the tier's `tier_quant`).
STORE_CLASSES: dict[str, Callable[..., TierStore]] = {"prq": PackedStore, "fp8": Fp8Store}


def _new_store(
    pool: BlockPool, quant: QuantConfig, tier: str, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype
) -> TierStore:
    """The store of `tier`'s format: its registry codec's class (`STORE_CLASSES`), packing with
    `quant.tier_quant(tier)` (None for fp8)."""
    fmt = get_format(quant.tier_format(tier))
    return STORE_CLASSES[fmt.codec](pool, batch_size, num_heads, head_dim, dtype, quant.tier_quant(tier))


def tier_stores(
    pool: BlockPool, history: PackedStore, quant: QuantConfig, batch_size: int, num_heads: int, head_dim: int,
    dtype: torch.dtype,
) -> dict[str, TierStore]:  # fmt: skip
    """Format name -> store for every packed format `quant`'s tiers use (the history's is `history`). ValueError
    naming the tier when its rows do not fit a page. O(tiers)."""
    out: dict[str, TierStore] = {history.name: history}
    for tier in TIERS:
        name = quant.tier_format(tier)
        if not get_format(name).packed or name in out:
            continue
        try:
            out[name] = _new_store(pool, quant, tier, batch_size, num_heads, head_dim, dtype)
        except ValueError as exc:
            raise ValueError(f"the {tier} tier's {name!r} segments: {exc}") from None
    return out


class ExtraRuns:
    """The runs of a view that come from packed formats other than the history's (which `view_runs` reads), one
    piece table per format (`kernels/dequant.py`'s columns) with its segments' codebook pages concatenated.

    Built on the host with the view's run table (`page_io.PageIO._run_plan`), copied to the device once per plan."""

    def __init__(self, stores: dict[str, TierStore]) -> None:
        self.stores = stores
        self.by_fmt: dict[str, tuple[list[tuple[int, ...]], list[int], dict[int, int]]] = {}

    def add(self, seg, lo: int, hi: int, out_row: int) -> None:
        """Tokens `[lo, hi)` (segment-relative) of packed segment `seg` to output rows from `out_row` on."""
        pieces, cbs, offsets = self.by_fmt.setdefault(seg.fmt, ([], [], {}))
        off = offsets.get(id(seg))
        if off is None:
            off = offsets[id(seg)] = len(cbs)
            cbs.extend(seg.pages[seg.n_token_pages :])
        pieces.extend(piece_table(seg.pages[: seg.n_token_pages], self.stores[seg.fmt].tpp, lo, hi, out_row, off))

    def build(self, device: torch.device) -> tuple[tuple[TierStore, torch.Tensor, torch.Tensor], ...]:
        """`(store, pieces int64 [P, 5], cb_pages int64 [n])` per format, on `device` (one copy per format)."""
        out = []
        for fmt, (pieces, cbs, _) in self.by_fmt.items():
            desc = int64_on([x for piece in pieces for x in piece] + cbs, device)
            n = 5 * len(pieces)
            out.append((self.stores[fmt], desc[:n].view(-1, 5), desc[n:]))
        return tuple(out)
