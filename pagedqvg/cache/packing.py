"""Packing and memory pressure of one layer's cache: which pages a call needs, packing chunks early when the pool is
short, the pack policy after an advance, swapping a segment between its dense and its PRQ-packed form, and the
page accounting of its segments (bytes used, pages a rewind gives back).

`ChunkPacker` is owned by one `PagedCausalKVCache` (cache.py) and shares its pool owner, `PageIO` (page_io.py) and
sequencing core (sequencing.py); the policy (which chunks, in which order) is policy.py's. Every method that can fail
(quantizing, reading rows) runs before the first page changes hands, so a failure leaves cache and pool as they
were; `store_packed` and `unpack` only move pages and rows.

Formats by age (issue 23): the layer has one store per packed format its tiers use (`stores`, tier_stores.py,
built from the format registry `quant/formats.py`; a packed segment names its format in `Segment.fmt`) and the
policy is `policy.tier_targets`: a dense chunk packs into its tier's format, a packed one leaving the recent tier is
repacked into the history's format from its decoded values (dequantize with its store, quantize with the next one;
both temporaries, before any page moves). Pressure packs always use the history's format (the fewest pages). A
config without tiers is the case whose sink and history tiers share the history's format and whose recent tier is
dense: one store, the same path (`tier_targets` then selects exactly `policy.pack_targets`' segments).
"""

from __future__ import annotations

import warnings

import torch

import pagedqvg.cache.shared_packing as shared_packing
from pagedqvg.allocator import BlockPool, RangeEntry
from pagedqvg.allocator.pool import exhausted_error, set_used_bytes
from pagedqvg.cache.policy import layer_tier_targets, pressure_candidates, sink_segment_starts
from pagedqvg.cache.sequencing import CallPlan, Sequencer
from pagedqvg.errors import PackingFailedWarning
from pagedqvg.layout.segments import DenseTokenLayout
from pagedqvg.quant import QuantConfig
from pagedqvg.store.packed_store import PackedStore, QuantizedChunk
from pagedqvg.store.page_io import PageIO
from pagedqvg.store.segment import Segment, SegmentKind
from pagedqvg.store.tier_stores import TierStore

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
        stores: format name -> store of every tier format (`tier_stores.tier_stores`; default: `store` alone).

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
        stores: dict[str, TierStore] | None = None,
    ) -> None:
        self.pool = pool
        self.owner = owner
        self.layout = layout
        self.io = io
        self.seq = seq
        self.store = store
        self.quant = quant
        self.pack_under_pressure = bool(pack_under_pressure)
        self.stores: dict[str, TierStore] = dict(stores) if stores else ({store.name: store} if store else {})
        #: more than one packed format (a tiered config): `memory_breakdown` reports each format's pages and bytes
        self.tiered = len(self.stores) > 1
        self.skipped = 0
        #: packs the policy put off because the pool had no room for the packed rows (a full shared pool)
        self.deferred_for_room = 0

    # ------------------------------------------------------------ memory pressure
    def fit(self, plan: CallPlan[Segment], unpack: list[RangeEntry[Segment]], name: str) -> list[Packing]:
        """The pressure packs (possibly none) that make `plan` and `unpack` fit the pool; PoolExhaustedError (its
        message starts with `name`) when nothing does. Changes nothing. O(segments) plus the packs' quantization."""
        pool, layout = self.pool, self.layout
        need = layout.pages_for_tokens(plan.new_tokens) if plan.new_tokens else 0
        need += sum(layout.pages_for_tokens(x.end - x.start) - pool.freeable(x.value.pages) for x in unpack)
        freed = sum(pool.freeable(x.value.pages) for x in plan.released)  # pages a fork shares stay held
        G = self.seq.state.global_end
        copies = 0
        if pool.shared_pages_of(self.owner):  # the write's copy-on-write (cache/fork.py) needs pages too
            cow = shared_packing.shared_pages_in(pool, self.seq.index, layout.tokens_per_page, plan.start,
                                                 min(plan.end, G), plan.released)  # fmt: skip
            copies = sum(len(slots) for _, slots in cow)
            need += copies
        deficit = need - (pool.num_free_pages + freed)
        if deficit <= 0:
            return []
        if self.store is not None and self.pack_under_pressure:
            pressure = self.pressure_plan(deficit, plan, unpack)
            if pressure:
                return pressure
        what = f"appending {plan.new_tokens} tokens at {G}" if plan.new_tokens else ""
        if copies:
            what += f"; copy-on-write of {copies} page(s) a fork shares"
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

    def net_pages(self, entry: RangeEntry[Segment], fmt: str | None = None) -> int:
        """Pages a segment gives back when packed in format `fmt` (default: the history's; negative: packing needs
        more)."""
        return self.pool.freeable(entry.value.pages) - self.target(fmt).pages_for_tokens(entry.end - entry.start)

    def target(self, fmt: str | None) -> TierStore:
        """The store of format `fmt` (None: the history's)."""
        store = self.stores[fmt] if fmt is not None else self.store
        assert store is not None
        return store

    def store_of(self, seg: Segment) -> TierStore:
        """The store holding a packed segment (its `fmt`'s; the history's when unnamed)."""
        return self.target(seg.fmt)

    def source_rows(self, entry: RangeEntry[Segment]) -> torch.Tensor:
        """A segment's values as `[2, n, B, H, D]` (a temporary): its dense rows, or a packed segment's decoded rows
        (the repack of an aging chunk starts from them)."""
        if entry.value.packed:
            return self.io.dequantize_segment(entry).permute(1, 0, 2, 3, 4)
        return self.io.read_dense(entry)

    # ------------------------------------------------------------ unpacking (a rewrite of a packed chunk)
    def dequantize_for_unpack(
        self, unpack: list[RangeEntry[Segment]]
    ) -> list[tuple[RangeEntry[Segment], torch.Tensor]]:
        """The packed chunks a rewrite touches, each with its dequantized rows (temporaries; nothing changes), in the
        order `unpack` must run: those that give pages back (packed form bigger than dense, e.g. tiny chunks) first,
        so the pages counted free are free when each later unpack takes its own."""
        pool, layout = self.pool, self.layout
        order = sorted(unpack, key=lambda x: layout.pages_for_tokens(x.end - x.start) - pool.freeable(x.value.pages))
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
        """After an advance: pack (or repack) what `policy.layer_tier_targets` selects, each into its tier's format (the
        current chunk and segments overlapping `[keep_start, keep_end)`, this call's write, stay as they are).
        Returns whether any segment changed (the caller's plans are then stale); nothing with quantization off."""
        if self.store is None or self.quant is None:
            return False
        changed = False
        keep = (keep_start, keep_end)
        for entry, tier in layer_tier_targets(self.quant, self.seq, keep):
            changed |= self.pack(entry, name, self.quant.tier_format(tier))
        return changed

    def pack(self, entry: RangeEntry[Segment], name: str, fmt: str | None = None) -> bool:
        """Replace a segment by its packed form in format `fmt` (default: the history's): a dense one is quantized,
        a packed one (aging out of its tier) repacked from its decoded values; its old pages go back to the pool.
        False (and the segment stays as it was) when it holds non-finite values, the pool cannot hold the packed
        rows, or quantizing fails otherwise (`PackingFailedWarning`; retried at the next advance). Everything that
        can fail happens before the first page changes hands."""
        store = self.target(fmt)
        assert not entry.value.packed or store is not self.store_of(entry.value)
        if shared_packing.adopt(self.pool, self.owner, entry, store.name):  # a fork packed this chunk already
            return True
        if self.net_pages(entry, fmt) + self.pool.num_free_pages < 0:
            self.deferred_for_room += 1  # the policy retries at the next advance
            return False
        try:
            quantized = store.quantize(self.source_rows(entry))
        except ValueError as exc:
            self.skipped += 1
            entry.value.pack_failed = True
            kept = "unpacked" if not entry.value.packed else f"in {self.format_of(entry.value)}"
            warnings.warn(f"{name}: chunk [{entry.start}, {entry.end}) stays {kept}: {exc}", stacklevel=4)
            return False
        except Exception as exc:  # e.g. torch.OutOfMemoryError: this call's write must still happen
            self.skipped += 1
            warnings.warn(
                PackingFailedWarning(
                    f"{name}: packing chunk [{entry.start}, {entry.end}) failed ({type(exc).__name__}: "
                    f"{exc}); it stays {self.format_of(entry.value)} and the policy retries at the next advance"
                ),
                stacklevel=4,
            )
            return False
        source = tuple(entry.value.pages)
        shared = self.pool.freeable(source) < len(source)  # a fork holds these pages too: it may adopt the result
        self.store_packed(entry, quantized, fmt)
        if shared:
            shared_packing.remember(self.pool, self.seq, entry, source, store.name)
        return True

    def format_of(self, seg: Segment) -> str:
        """The format a segment holds: 'bf16' when dense, else its store's name."""
        return self.store_of(seg).name if seg.packed else "bf16"

    def store_packed(self, entry: RangeEntry[Segment], quantized: QuantizedChunk, fmt: str | None = None) -> None:
        """Swap a segment's pages (dense, or packed in another format) for pages of format `fmt` (default: the
        history's) holding `quantized` (from that store's `quantize`)."""
        store = self.target(fmt)
        n = entry.end - entry.start
        self.pool.free(entry.value.pages, self.owner)
        pages = self.pool.alloc(store.pages_for_tokens(n), self.owner)
        n_tok = store.token_pages(n)
        store.write(pages[:n_tok], pages[n_tok:], quantized)
        entry.value = Segment(pages, None, SegmentKind.PACKED, n_tok, fmt=store.name)

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
        retained rows (plus codebooks) occupy; with tier formats also `{fmt}_pages`, `{fmt}_tokens` and
        `{fmt}_bytes` (used bytes) of every packed format. O(segments x runs)."""
        out = {"dense_pages": 0, "packed_pages": 0, "dense_tokens": 0, "packed_tokens": 0, "used_bytes": 0}
        if self.tiered:
            out.update({f"{f}_{k}": 0 for f in self.stores for k in ("pages", "tokens", "bytes")})
        for entry, tokens in self.seq.retained_tokens():
            seg = entry.value
            if seg.packed:
                store = self.store_of(seg)
                used = store.layout.used_bytes_for_tokens(tokens)
                out["packed_pages"] += len(seg.pages)
                out["packed_tokens"] += tokens
                out["used_bytes"] += used
                if self.tiered:
                    out[f"{store.name}_pages"] += len(seg.pages)
                    out[f"{store.name}_tokens"] += tokens
                    out[f"{store.name}_bytes"] += used
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
            keep = self.store_of(seg).token_pages(tokens)
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
