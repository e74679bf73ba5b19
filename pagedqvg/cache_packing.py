"""Packing and memory pressure of one layer's cache: which pages a call needs, packing chunks early when the pool is
short, the pack policy after an advance, swapping a segment between its dense and its PRQ-packed form, and the
page accounting of its segments (bytes used, pages a rewind gives back).

`ChunkPacker` is owned by one `PagedCausalKVCache` (cache.py) and shares its pool owner, `PageIO` (page_io.py) and
sequencing core (sequencing.py); the policy (which chunks, in which order) is policy.py's. Every method that can fail
(quantizing, reading rows) runs before the first page changes hands, so a failure leaves cache and pool as they
were; `store_packed` and `unpack` only move pages and rows.
"""

from __future__ import annotations

import warnings

import torch

from .allocator import BlockPool, RangeEntry
from .allocator.pool import exhausted_error, set_used_bytes
from .errors import PackingFailedWarning
from .layout import DenseTokenLayout
from .packing import PackedStore, QuantizedChunk
from .page_io import PageIO
from .policy import layer_pack_targets, pressure_candidates, sink_segment_starts
from .quant import QuantConfig
from .segment import Segment, SegmentKind
from .sequencing import CallPlan, Sequencer

__all__ = ["ChunkPacker", "Packing"]

#: A dense segment and its PRQ-packed form, computed before anything changes (packed early under pool pressure).
Packing = tuple[RangeEntry[Segment], QuantizedChunk]


class ChunkPacker:
    """Packing and memory pressure for one layer (the cache's; shares its pool owner, rows and segments).

    Args:
        pool, owner: the `BlockPool` and the cache's owner id in it (every page taken or freed here is the owner's).
        layout: the dense page layout of the layer's rows.
        io: the cache's `PageIO` (reads and writes rows; its plans are the cache's to invalidate).
        seq: the cache's sequencing core (`Sequencer`: segments, slots, pin).
        store: the layer's `PackedStore` (None with quantization off: nothing is ever packed).
        quant: the layer's `QuantConfig` (None with quantization off).
        pack_under_pressure: pack dense chunks early (oldest first) when an advance does not fit the pool.

    Attributes:
        skipped: chunks the pack policy left dense (non-finite values, or packing failed).
    """

    def __init__(
        self,
        *,
        pool: BlockPool,
        owner: str,
        layout: DenseTokenLayout,
        io: PageIO,
        seq: Sequencer[Segment],
        store: PackedStore | None,
        quant: QuantConfig | None,
        pack_under_pressure: bool,
    ) -> None:
        self.pool = pool
        self.owner = owner
        self.layout = layout
        self.io = io
        self.seq = seq
        self.store = store
        self.quant = quant
        self.pack_under_pressure = bool(pack_under_pressure)
        self.skipped = 0
        #: packs the policy put off because the pool had no room for the packed rows (a full shared pool)
        self.deferred_for_room = 0

    # ------------------------------------------------------------ memory pressure
    def fit(self, plan: CallPlan[Segment], unpack: list[RangeEntry[Segment]], name: str) -> list[Packing]:
        """The pressure packs (possibly none) that make `plan` and `unpack` fit the pool; PoolExhaustedError (its
        message starts with `name`) when nothing does. Changes nothing. O(segments) plus the packs' quantization."""
        pool, layout = self.pool, self.layout
        need = layout.pages_for_tokens(plan.new_tokens) if plan.new_tokens else 0
        need += sum(layout.pages_for_tokens(x.end - x.start) - len(x.value.pages) for x in unpack)
        freed = sum(len(x.value.pages) for x in plan.released)
        deficit = need - (pool.num_free_pages + freed)
        if deficit <= 0:
            return []
        if self.store is not None and self.pack_under_pressure:
            pressure = self.pressure_plan(deficit, plan, unpack)
            if pressure:
                return pressure
        G = self.seq.state.global_end
        what = f"appending {plan.new_tokens} tokens at {G}" if plan.new_tokens else ""
        if unpack:
            chunks = ", ".join(f"[{x.start}, {x.end})" for x in unpack)
            what += ("; " if what else "") + f"unpacking packed chunk(s) {chunks} for the rewrite at {plan.start}"
        hint = ""
        if self.store is not None and not self.pack_under_pressure:
            hint = "; pack_under_pressure=True would pack this layer's bf16 chunks early"
        raise exhausted_error(
            pool, need, f"{name}: {what} ({freed} pages freed by this call's eviction count as free{hint})"
        )

    def pressure_plan(self, deficit: int, plan: CallPlan[Segment], unpack: list[RangeEntry[Segment]]) -> list[Packing]:
        """Dense chunks to pack early so that `deficit` more pages become free, in `policy.pressure_candidates`'
        order, each already quantized (`(entry, QuantizedChunk)`; nothing changes here); empty if even packing all
        of them would not be enough."""
        excluded = {x.start for x in plan.released} | {x.start for x in unpack}
        sinks = sink_segment_starts(self.seq)
        candidates = pressure_candidates(self.seq.index, sinks, excluded, (plan.start, plan.end))
        assert self.store is not None
        chosen: list[Packing] = []
        for entry in candidates:
            if deficit <= 0:
                break
            gain = self.net_pages(entry)
            if gain <= 0 or entry.value.pack_failed:
                continue
            try:
                quantized = self.store.quantize(self.io.read_dense(entry))
            except ValueError:  # non-finite values: this chunk cannot be packed
                continue
            chosen.append((entry, quantized))
            deficit -= gain
        return chosen if deficit <= 0 else []

    def net_pages(self, entry: RangeEntry[Segment]) -> int:
        """Pages a dense segment gives back when packed (negative: packing needs more)."""
        assert self.store is not None
        return len(entry.value.pages) - self.store.pages_for_tokens(entry.end - entry.start)

    # ------------------------------------------------------------ unpacking (a rewrite of a packed chunk)
    def dequantize_for_unpack(
        self, unpack: list[RangeEntry[Segment]]
    ) -> list[tuple[RangeEntry[Segment], torch.Tensor]]:
        """The packed chunks a rewrite touches, each with its dequantized rows (temporaries; nothing changes), in the
        order `unpack` must run: those that give pages back (packed form bigger than dense, e.g. tiny chunks) first,
        so the pages counted free are free when each later unpack takes its own."""
        order = sorted(unpack, key=lambda x: self.layout.pages_for_tokens(x.end - x.start) - len(x.value.pages))
        return [(x, self.io.dequantize_segment(x)) for x in order]

    def unpack(self, entry: RangeEntry[Segment], dense: torch.Tensor) -> None:
        """Turn a packed segment back into dense rows holding `dense` (from `PageIO.dequantize_segment`); the policy
        repacks it later."""
        n = entry.end - entry.start
        self.pool.free(entry.value.pages, self.owner)
        entry.value = self.new_dense_segment(n)
        entry.value.lossy = True
        self.io.store_dense(entry, dense)

    # ------------------------------------------------------------ packing
    def apply_policy(self, keep_start: int, keep_end: int, name: str) -> bool:
        """After an advance: pack what `policy.layer_pack_targets` selects (the current chunk and segments overlapping
        `[keep_start, keep_end)`, this call's write, stay dense). Returns whether any segment changed (the caller's
        plans are then stale); nothing with quantization off."""
        if self.store is None or self.quant is None:
            return False
        changed = False
        for entry in layer_pack_targets(self.quant, self.seq, (keep_start, keep_end)):
            changed |= self.pack(entry, name)
        return changed

    def pack(self, entry: RangeEntry[Segment], name: str) -> bool:
        """Replace a dense segment by its PRQ-packed form (its dense pages go back to the pool). False (and the
        segment stays dense, unchanged) when it holds non-finite values, the pool cannot hold the packed rows, or
        quantizing fails otherwise (`PackingFailedWarning`; retried at the next advance). Everything that can fail
        happens before the first page changes hands."""
        store = self.store
        assert store is not None and not entry.value.packed
        if self.net_pages(entry) + self.pool.num_free_pages < 0:
            self.deferred_for_room += 1  # the policy retries at the next advance
            return False
        try:
            quantized = store.quantize(self.io.read_dense(entry))
        except ValueError as exc:
            self.skipped += 1
            entry.value.pack_failed = True
            warnings.warn(f"{name}: chunk [{entry.start}, {entry.end}) stays unpacked: {exc}", stacklevel=4)
            return False
        except Exception as exc:  # e.g. torch.OutOfMemoryError: this call's write must still happen
            self.skipped += 1
            warnings.warn(
                PackingFailedWarning(
                    f"{name}: packing chunk [{entry.start}, {entry.end}) failed ({type(exc).__name__}: "
                    f"{exc}); it stays bf16 and the policy retries at the next advance"
                ),
                stacklevel=4,
            )
            return False
        self.store_packed(entry, quantized)
        return True

    def store_packed(self, entry: RangeEntry[Segment], quantized: QuantizedChunk) -> None:
        """Swap a dense segment's pages for packed pages holding `quantized` (from `PackedStore.quantize`)."""
        store = self.store
        assert store is not None
        n = entry.end - entry.start
        self.pool.free(entry.value.pages, self.owner)
        pages = self.pool.alloc(store.pages_for_tokens(n), self.owner)
        n_tok = store.token_pages(n)
        store.write(pages[:n_tok], pages[n_tok:], quantized)
        entry.value = Segment(pages, None, SegmentKind.PACKED, n_tok)

    # ------------------------------------------------------------ page accounting
    def new_dense_segment(self, tokens: int) -> Segment:
        """A dense segment of pages for `tokens` tokens, taken from the pool (PoolExhaustedError if they do not
        fit)."""
        return Segment(self.pool.alloc(self.layout.pages_for_tokens(tokens), self.owner))

    def release_all(self) -> None:
        """Every segment back to the pool; cursors 0, unpinned (the sequencer's `reset`)."""
        for entry in self.seq.reset():
            self.pool.free(entry.value.pages, self.owner)
        set_used_bytes(self.pool, self.owner, 0)

    def memory_breakdown(self) -> dict[str, int]:
        """Exact bytes: pages held by dense and packed segments, tokens retained in each, and the bytes those
        retained rows (plus codebooks) occupy. O(segments x runs)."""
        out = {"dense_pages": 0, "packed_pages": 0, "dense_tokens": 0, "packed_tokens": 0, "used_bytes": 0}
        for entry, tokens in self.seq.retained_tokens():
            seg = entry.value
            if seg.packed:
                assert self.store is not None
                out["packed_pages"] += len(seg.pages)
                out["packed_tokens"] += tokens
                out["used_bytes"] += self.store.layout.used_bytes_for_tokens(tokens)
            else:
                out["dense_pages"] += len(seg.pages)
                out["dense_tokens"] += tokens
                out["used_bytes"] += self.layout.used_bytes_for_tokens(tokens)
        out["dense_bytes"] = out["dense_pages"] * self.pool.page_bytes
        out["packed_bytes"] = out["packed_pages"] * self.pool.page_bytes
        return out

    def report_used(self) -> None:
        """Tell the pool how many bytes of the owner's pages hold retained rows (the rest is waste)."""
        set_used_bytes(self.pool, self.owner, self.memory_breakdown()["used_bytes"])

    def trim_pages(self, entry: RangeEntry[Segment]) -> None:
        """Give back the pages a segment shortened by a rewind no longer needs (a packed one keeps its codebooks)."""
        seg = entry.value
        tokens = entry.end - entry.start
        if seg.packed:
            assert self.store is not None
            keep = self.store.token_pages(tokens)
            if keep < seg.n_token_pages:
                self.pool.free(seg.pages[keep : seg.n_token_pages], self.owner)
                del seg.pages[keep : seg.n_token_pages]
                seg.n_token_pages = keep
        else:
            keep = self.layout.pages_for_tokens(tokens)
            if keep < len(seg.pages):
                self.pool.free(seg.pages[keep:], self.owner)
                del seg.pages[keep:]
                seg.pages_t = None
                seg.row_index = None
