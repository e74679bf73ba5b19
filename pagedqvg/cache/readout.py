"""The read-only figures of a `PagedCausalKVCache`: geometry, cursors, pin, segments and memory.

`CacheReadout` is an object the cache holds (composition, not a base class): it is built from the cache's
collaborators, passed to its constructor — the pool and owner id, the sequencing core (`sequencing.Sequencer`:
spec, cursors, pin, slot map, segments), the `packing.ChunkPacker` and the `page_io.PageIO` — and reads only their
public attributes and methods, when asked (so a spec the cache replaces, or a state a rollback restores, is what it
reads next). It changes nothing except the packer's `pack_under_pressure` setting. The cache's public properties
and methods of the same names answer through it (`paged_cache.PagedCausalKVCache`). Every figure is O(1) unless its
docstring says otherwise.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedqvg.allocator import BlockPool
    from pagedqvg.cache.packing import ChunkPacker
    from pagedqvg.cache.sequencing import Sequencer
    from pagedqvg.store.page_io import PageIO, Spans
    from pagedqvg.store.segment import Segment

__all__ = ["CacheReadout", "readout_method", "readout_property"]


class CacheReadout:
    """Read-only state of one layer's cache, from its collaborators (held, not copied).

    Args:
        pool, owner: the pool holding the layer's pages and the layer's owner id in it.
        seq: the layer's sequencer; packer: its `ChunkPacker`; io: its `PageIO`.
        num_heads: heads the cache holds.
        cursors: the cache's cursor tensors `(global_end_index, local_end_index)`.

    Attributes:
        last_view_ranges: the slot ranges of the last returned view (the cache sets it; `[]` after a change).
    """

    def __init__(
                self,
        *,
        pool: BlockPool,
        owner: str,
        seq: Sequencer[Segment],
        packer: ChunkPacker,
        io: PageIO,
        num_heads: int,
        cursors: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        self.pool = pool
        self.owner = owner
        self.seq = seq
        self.packer = packer
        self.io = io
        self.num_heads = num_heads
        self.cursors = cursors
        self.last_view_ranges: list[tuple[int, int]] = []

    # ------------------------------------------------------------ settings and counters
    @property
    def pack_under_pressure(self) -> bool:
        """With quantization: pack this layer's bf16 chunks early when an advance does not fit (settable)."""
        return self.packer.pack_under_pressure

    @pack_under_pressure.setter
    def pack_under_pressure(self, value: bool) -> None:
        self.packer.pack_under_pressure = bool(value)

    @property
    def pack_skipped(self) -> int:
        """Chunks the pack policy left unpacked (non-finite values, or packing failed)."""
        return self.packer.skipped

    @property
    def num_cache_heads(self) -> int:
        """Heads the cache holds (`num_heads`)."""
        return self.num_heads

    # ------------------------------------------------------------ geometry
    @property
    def cache_size(self) -> int:
        """Slots of the window, in tokens (grows with `allow_growth`; a grown size survives `reset_indices`)."""
        return self.seq.spec.cache_size

    @property
    def attention_window_size(self) -> int:
        """Slots a view covers, counted back from the newest token (the whole `cache_size` when given as 0/None)."""
        return self.seq.spec.window

    @property
    def sink_tokens(self) -> int:
        """Tokens at the front of the window that do not roll out; the most a scene cut pins."""
        return self.seq.spec.sink_tokens

    @property
    def global_sink_tokens(self) -> int:
        """The first tokens of the stream, kept for good and prepended to views once the window moved past them."""
        return self.seq.spec.global_sink_tokens

    @property
    def allow_growth(self) -> bool:
        """Whether an advance that does not fit grows `cache_size` instead of rolling."""
        return self.seq.spec.allow_growth

    @property
    def global_end_index(self) -> torch.Tensor:
        """Tokens produced so far, as a 1-element int64 tensor; with `use_int_indices=True` it is never written
        (`global_end_index_int` is the truth)."""
        return self.cursors[0]

    @property
    def local_end_index(self) -> torch.Tensor:
        """Slots filled so far, as a 1-element int64 tensor (never written with `use_int_indices=True`)."""
        return self.cursors[1]

    @property
    def pinned_range(self) -> tuple[int, int]:
        """`(slot where the pinned chunk starts, its length in tokens)`; `(-1, 0)` when nothing is pinned."""
        st = self.seq.state
        return st.pin_start, st.pin_len

    def effective_sink_tokens(self) -> int:
        """The number of front slots that never roll now: max(sink_tokens, global_sink_tokens) when nothing is
        pinned; with a pin, global_sink_tokens plus the pinned length once the pin sits right after the global sink,
        else global_sink_tokens (docs/SEMANTICS.md, "Effective sink")."""
        return self.seq.effective_sink()

    def can_direct_current_attention(self, num_tokens: int) -> bool:
        """Whether a chunk of `num_tokens` may attend to itself without the cache (no sink, and the cache and the
        attention window are exactly that chunk), as SGLang's models ask before calling the cache."""
        spec = self.seq.spec
        return spec.sink_tokens == 0 and num_tokens == spec.cache_size and num_tokens == spec.window

    # ------------------------------------------------------------ segments and memory
    def resident_nbytes(self) -> int:
        """Bytes this layer holds in the pool (whole pages, K and V). O(1)."""
        return self.pool.pages_of(self.owner) * self.pool.page_bytes

    def retained_token_ranges(self) -> list[tuple[int, int]]:
        """Global token ranges the slots hold, in slot order (sink, pinned, tail)."""
        return self.seq.state.slot_map.global_ranges()

    def last_view_sources(self) -> list[tuple[int, int, str]]:
        """Where the rows of the last returned view came from, in order: `(global_start, global_end, kind)` with
        kind "dense" (exact rows), "packed" (dequantized), "unpacked" (dense rows of a chunk that was packed and
        then partly rewritten: the rows the rewrite did not touch carry the quantization error), and
        `(-1, count - 1, "zeros")` for `count` slots the cache never filled. Valid until the cache changes.
        O(runs + segments)."""
        return self.io.view_sources(self.seq.index, self.view_spans(self.last_view_ranges))

    def segments(self) -> list[tuple[int, int, int]]:
        """`(global_start, global_end, pages)` of each stored segment, in order."""
        return [(e.start, e.end, len(e.value.pages)) for e in self.seq.index]

    def memory_breakdown(self) -> dict[str, int]:
        """Exact bytes: pages held by dense and packed segments, tokens retained in each, and the bytes those
        retained rows (plus codebooks) occupy. O(segments x runs)."""
        return self.packer.memory_breakdown()

    def describe(self, name: str) -> str:
        """`PagedCausalKVCache(name: G=.. L=.. C=.. W=.. E=.. pin=slot+length, N segments, B resident)`."""
        # G: tokens produced, L: slots filled, C: cache_size, W: attention window, E: effective sink, pin: slot+length
        st, spec = self.seq.state, self.seq.spec
        return (
            f"PagedCausalKVCache({name}: G={st.global_end} L={st.local_end} C={spec.cache_size} "
            f"W={spec.window} E={self.effective_sink_tokens()} pin={st.pin_start}+{st.pin_len}, "
            f"{len(self.seq.index)} segments, {self.resident_nbytes()} B resident)"
        )

    def view_spans(self, ranges: list[tuple[int, int]]) -> Spans:
        """Per slot range of a view: the global token ranges its filled slots hold, and its never-filled slots."""
        st = self.seq.state
        L = st.local_end
        return [(st.slot_map.to_global(a, min(b, L)), b - max(a, L)) for a, b in ranges]


def readout_property(holder: str, name: str, *, settable: bool = False) -> property:
    """A property (for the class holding a `CacheReadout` in its attribute `holder`) answered by that readout's
    property `name`, with its docstring; settable when `settable`."""

    def fset(obj, value):
        setattr(getattr(obj, holder), name, value)

    return property(lambda obj: getattr(getattr(obj, holder), name), fset if settable else None,
                    doc=getattr(CacheReadout, name).__doc__)  # fmt: skip


def readout_method(holder: str, name: str):
    """A method (for the class holding a `CacheReadout` in its attribute `holder`) answered by that readout's
    method `name`, with its signature and docstring."""

    @functools.wraps(getattr(CacheReadout, name))
    def method(obj, *args):
        return getattr(getattr(obj, holder), name)(*args)

    return method
