"""The read-only surface of a `PagedCausalKVCache`: geometry, cursors, pin, segments and memory figures.

`CacheReadout` is the cache's base class: everything here reads the state that `cache.py` (calls), the sequencing
core (`sequencing.Sequencer`: spec, cursors, pin, slot map, segments) and `cache_packing.ChunkPacker` keep, and
changes nothing except the `pack_under_pressure` setting. Split from cache.py so that the class holding the calls
stays small (one job each: the calls there, their readout here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedqvg.allocator import BlockPool
    from pagedqvg.cache.packing import ChunkPacker
    from pagedqvg.cache.sequencing import Sequencer
    from pagedqvg.store.page_io import PageIO, Spans
    from pagedqvg.store.segment import Segment

__all__ = ["CacheReadout"]


class CacheReadout:
    """Read-only state of one layer's cache (the base of `PagedCausalKVCache`; not built on its own).

    Reads these attributes, which the cache sets in `__init__`: `pool`, `owner`, `debug_name`, `_seq` (the
    sequencer), `_packer`, `_io`, `_num_heads`, `_g_tensor` / `_l_tensor` (cursor tensors), `_closed`,
    and `_last_view_ranges`. Every figure is O(1) unless its docstring says otherwise.
    """

    pool: BlockPool
    owner: str
    debug_name: str
    _seq: Sequencer[Segment]
    _packer: ChunkPacker
    _io: PageIO
    _num_heads: int
    _g_tensor: torch.Tensor
    _l_tensor: torch.Tensor
    _closed: bool
    _last_view_ranges: list[tuple[int, int]]

    # ------------------------------------------------------------ read-only state
    @property
    def pack_under_pressure(self) -> bool:
        """With quantization: pack this layer's bf16 chunks early when an advance does not fit (settable)."""
        return self._packer.pack_under_pressure

    @pack_under_pressure.setter
    def pack_under_pressure(self, value: bool) -> None:
        self._packer.pack_under_pressure = bool(value)

    @property
    def pack_skipped(self) -> int:
        """Chunks the pack policy left unpacked (non-finite values, or packing failed)."""
        return self._packer.skipped

    @property
    def num_cache_heads(self) -> int:
        """Heads the cache holds (`num_heads`)."""
        return self._num_heads

    @property
    def cache_size(self) -> int:
        """Slots of the window, in tokens (grows with `allow_growth`; a grown size survives `reset_indices`)."""
        return self._seq.spec.cache_size

    @property
    def attention_window_size(self) -> int:
        """Slots a view covers, counted back from the newest token (the whole `cache_size` when given as 0/None)."""
        return self._seq.spec.window

    @property
    def sink_tokens(self) -> int:
        """Tokens at the front of the window that do not roll out; the most a scene cut pins."""
        return self._seq.spec.sink_tokens

    @property
    def global_sink_tokens(self) -> int:
        """The first tokens of the stream, kept for good and prepended to views once the window moved past them."""
        return self._seq.spec.global_sink_tokens

    @property
    def allow_growth(self) -> bool:
        """Whether an advance that does not fit grows `cache_size` instead of rolling."""
        return self._seq.spec.allow_growth

    @property
    def global_end_index(self) -> torch.Tensor:
        """Tokens produced so far, as a 1-element int64 tensor; with `use_int_indices=True` it is never written
        (`global_end_index_int` is the truth)."""
        return self._g_tensor

    @property
    def local_end_index(self) -> torch.Tensor:
        """Slots filled so far, as a 1-element int64 tensor (never written with `use_int_indices=True`)."""
        return self._l_tensor

    @property
    def pinned_range(self) -> tuple[int, int]:
        """`(slot where the pinned chunk starts, its length in tokens)`; `(-1, 0)` when nothing is pinned."""
        st = self._seq.state
        return st.pin_start, st.pin_len

    @property
    def closed(self) -> bool:
        """True after `close()`: the pages are back in the pool and every call raises CacheClosedError."""
        return self._closed

    def effective_sink_tokens(self) -> int:
        """The number of front slots that never roll now: max(sink_tokens, global_sink_tokens) when nothing is
        pinned; with a pin, global_sink_tokens plus the pinned length once the pin sits right after the global sink,
        else global_sink_tokens (docs/SEMANTICS.md, "Effective sink")."""
        return self._seq.effective_sink()

    def can_direct_current_attention(self, num_tokens: int) -> bool:
        """Whether a chunk of `num_tokens` may attend to itself without the cache (no sink, and the cache and the
        attention window are exactly that chunk), as SGLang's models ask before calling the cache."""
        spec = self._seq.spec
        return spec.sink_tokens == 0 and num_tokens == spec.cache_size and num_tokens == spec.window

    def resident_nbytes(self) -> int:
        """Bytes this layer holds in the pool (whole pages, K and V). O(1)."""
        return self.pool.pages_of(self.owner) * self.pool.page_bytes

    def retained_token_ranges(self) -> list[tuple[int, int]]:
        """Global token ranges the slots hold, in slot order (sink, pinned, tail)."""
        return self._seq.state.slot_map.global_ranges()

    def last_view_sources(self) -> list[tuple[int, int, str]]:
        """Where the rows of the last returned view came from, in order: `(global_start, global_end, kind)` with
        kind "dense" (exact rows), "packed" (dequantized), "unpacked" (dense rows of a chunk that was packed and
        then partly rewritten: the rows the rewrite did not touch carry the quantization error), and
        `(-1, count - 1, "zeros")` for `count` slots the cache never filled. Valid until the cache changes.
        O(runs + segments)."""
        return self._io.view_sources(self._seq.index, self._view_spans(self._last_view_ranges))

    def segments(self) -> list[tuple[int, int, int]]:
        """`(global_start, global_end, pages)` of each stored segment, in order."""
        return [(e.start, e.end, len(e.value.pages)) for e in self._seq.index]

    def __repr__(self) -> str:
        # G: tokens produced, L: slots filled, C: cache_size, W: attention window, E: effective sink, pin: slot+length
        st, spec = self._seq.state, self._seq.spec
        return (
            f"PagedCausalKVCache({self.debug_name}: G={st.global_end} L={st.local_end} C={spec.cache_size} "
            f"W={spec.window} E={self.effective_sink_tokens()} pin={st.pin_start}+{st.pin_len}, "
            f"{len(self._seq.index)} segments, {self.resident_nbytes()} B resident)"
        )

    def memory_breakdown(self) -> dict[str, int]:
        """Exact bytes: pages held by dense and packed segments, tokens retained in each, and the bytes those
        retained rows (plus codebooks) occupy. O(segments x runs)."""
        return self._packer.memory_breakdown()

    def _view_spans(self, ranges: list[tuple[int, int]]) -> Spans:
        """Per slot range of a view: the global token ranges its filled slots hold, and its never-filled slots."""
        st = self._seq.state
        L = st.local_end
        return [(st.slot_map.to_global(a, min(b, L)), b - max(a, L)) for a, b in ranges]
