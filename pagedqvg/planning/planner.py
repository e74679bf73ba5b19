"""Memory planning: exact page accounting of the paged cache, from the segment layouts of pagedqvg/layout/segments.py.

The model is the cache's own retention rule (docs/SEMANTICS.md), applied chunk by chunk:

- one appended chunk is one segment; a bf16 segment of `n` tokens takes `DenseTokenLayout.pages_for_tokens(n)` pages,
  a packed one `PackedSegmentLayout.from_format(...).pages_for_tokens(n)` pages;
- a segment goes back to the pool when no slot holds any of its tokens (sink run, pinned run, rolling tail);
- quantization (the QVG policy): at each advance, after eviction and after the new chunk is stored, completed
  segments are packed: non-sink segments older than `keep_recent_chunks` completed chunks and, with `cfg.sink`, sink
  segments past the first `sink_keep_chunks`. A segment is a sink segment while it holds tokens of the slots
  `[0, E)` or of the pinned run. The policy runs after the new chunk's pages are taken; packing one segment frees
  its bf16 pages, then takes its packed pages. The chunk being denoised is never packed.

Steady state per layer, closed form (no scene-cut pins). With `E = max(S, GS)` the effective sink, `k = ceil(E / n)`
sink segments and `T = ceil((C - E) / n)` window segments (the current chunk included):

    packed sink   = max(0, k - sink_keep_chunks) if cfg.sink else 0
    packed window = max(0, T - 1 - keep_recent_chunks)
    bf16          = k + T - packed sink - packed window          (quantization off: k + T, nothing packed)
    pages         = bf16 * dense_pages(n) + packed * packed_pages(n)
    pool pages    = layers * pages + (dense_pages(n) - packed_pages(n) if anything is packed else 0)

(the last term: one layer holds its new chunk in bf16 before it packs the chunk that left `keep_recent_chunks`).

With pins the census comes from `replay_layer`: one cache's own sequencing core and pack policy (sequencing.py,
policy.py) with a page counter for a store (`CountingLayer`, no tensors);
tests check both against `BlockPool.stats()` of real caches. All layers advance one after another inside each
denoise step, so the pool's high-water mark is `max over chunks m of (layers - 1) * max(A[m-1], A[m]) + P[m]`, with
`A[m]` one layer's pages after chunk `m` and `P[m]` its peak during chunk `m`. Views are built outside the pool, one
layer at a time: `2 * B * view_tokens * H * D * itemsize` transient bytes.

Deployment: a geometry is one rank's caches (`heads / (ulysses * tp)` heads each) of `sessions` sessions x
`cache_sets` sets x `layers` layers in one pool; sessions advance in step, their calls interleaved one at a time
(every call step runs session 0's caches, then session 1's), so the pool is the same formula with more caches
(`max_sessions`). A workload without `page_bytes` gets each quantization setting's page size from
`layout.choose_page_bytes` over the segment kinds that setting stores (`Geometry.page_choice`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedqvg.allocator import RangeEntry
from pagedqvg.cache.policy import sink_segment_starts, tier_targets
from pagedqvg.cache.sequencing import CacheSpec, Sequencer, view_slot_ranges
from pagedqvg.layout.attention_scratch import (
    ATTN_TILE_TOKENS,
    attention_scratch_bytes,
    packed_decode_bytes,
    triton_attend_bytes,
)
from pagedqvg.layout.segments import (
    DenseTokenLayout,
    PackedSegmentLayout,
    PageChoice,
    choose_page_bytes,
    dtype_itemsize,
    segment_kinds,
)
from pagedqvg.planning.presets import Workload
from pagedqvg.planning.tiers import tier_layouts
from pagedqvg.quant.config import TIERS, QuantConfig
from pagedqvg.quant.format import PackedFormat
from pagedqvg.quant.formats import format_rank
from pagedqvg.quant.layouts import tier_layout
from pagedqvg.store.segment import SegmentKind
from pagedqvg.validation import PAGE_ALIGN_BYTES, check_int, nearest_page_bytes, page_bytes_at_least

#: Quantization modes `plan` compares, in table order (`QuantConfig.mode` names; see `mode_quant`).
PLAN_MODES: tuple[str, ...] = ("off", "int4", "int2", "compact")
#: Code widths of the reference modes in `PLAN_MODES` (None = off); compact is a format of int2, see `mode_quant`.
PLAN_BITS: tuple[int | None, ...] = (None, 4, 2)
#: QuantConfig fields that say *when* chunks are packed (the QVG policy), not *how*: every mode of a plan keeps the
#: workload's values of these.
POLICY_FIELDS: tuple[str, ...] = ("keep_recent_chunks", "sink", "sink_keep_chunks", "seed")
#: Channels per fitted scale of `QuantConfig.compact()` (its `block_size`).
COMPACT_BLOCK = QuantConfig.compact().block_size
#: Attention modes the planner budgets: a transient view per call, or update_and_attend's scratch (attention.py).
ATTENTION_MODES: tuple[str, ...] = ("view", "pages")
#: Largest window (frames) the budget search tries.
MAX_SEARCH_FRAMES = 1 << 20
#: `plan_geometry` replays caches of up to this many chunks by default (beyond, the closed form: O(1)).
REPLAY_MAX_CHUNKS = 4096
#: With scene-cut pins the search replays the pattern; it stops at windows of this many chunks.
MAX_PINNED_SEARCH_CHUNKS = 1024


# ---------------------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True, slots=True)
class Geometry:
    """One layer's cache geometry in tokens (= slots) and bytes, resolved from a `Workload` and checked."""

    caches: int  # caches sharing the pool: layers * cache_sets * sessions
    cache_sets: int
    batch_size: int
    heads: int  # per rank: the workload's heads / (ulysses * tp)
    head_dim: int
    dtype: torch.dtype
    page_bytes: int
    tokens_per_frame: int
    chunk_tokens: int
    sink_tokens: int
    global_sink_tokens: int
    cache_size: int
    attention_window: int  # 0 means cache_size
    scene_cut_every: int
    denoise_steps: int
    quant: QuantConfig
    sessions: int = 1
    ranks: int = 1  # ulysses * tp: this geometry is one rank's caches
    page_choice: PageChoice | None = None  # set when the page size was chosen automatically
    attention: str = "view"  # "view" (a transient K/V view per call) or "pages" (update_and_attend: tile scratch)

    @classmethod
    def from_workload(cls, w: Workload, quant: QuantConfig | None = None) -> Geometry:
        """Resolve `w` (with `quant` instead of `w.quant` if given); ValueError naming the bad field otherwise."""
        check_workload(w)
        tpf = w.tokens_per_frame
        sink = w.sink_tokens if w.sink_tokens is not None else w.sink_frames * tpf
        gsink = w.global_sink_tokens if w.global_sink_tokens is not None else (sink if w.global_sink else 0)
        e0 = max(sink, gsink)
        cache_size = w.cache_size_tokens if w.cache_size_tokens is not None else e0 + w.window_frames * tpf
        quant = w.quant if quant is None else quant
        heads = w.heads // w.ranks
        choice = None
        page_bytes = w.page_bytes
        if page_bytes is None:
            fmt = PackedFormat(w.head_dim, heads, quant, w.torch_dtype) if quant.enabled else None
            kinds = segment_kinds(
                w.batch_size, heads, w.head_dim, dtype_itemsize(w.torch_dtype), w.chunk_frames * tpf, fmt
            )
            choice = choose_page_bytes(kinds)
            page_bytes = choice.page_bytes
        geom = cls(
            caches=w.layers * w.cache_sets * w.sessions,
            cache_sets=w.cache_sets,
            batch_size=w.batch_size,
            heads=heads,
            head_dim=w.head_dim,
            dtype=w.torch_dtype,
            page_bytes=page_bytes,
            tokens_per_frame=tpf,
            chunk_tokens=w.chunk_frames * tpf,
            sink_tokens=sink,
            global_sink_tokens=gsink,
            cache_size=cache_size,
            attention_window=w.attention_window_tokens or 0,
            scene_cut_every=w.scene_cut_every,
            denoise_steps=w.denoise_steps,
            quant=quant,
            sessions=w.sessions,
            ranks=w.ranks,
            page_choice=choice,
        )
        geom._check()
        return geom

    def _check(self) -> None:
        n, C, E = self.chunk_tokens, self.cache_size, self.effective_sink
        if C <= 0:
            raise ValueError(f"cache size must be > 0 tokens, got {C}")
        if n > C - E:
            raise ValueError(
                f"window smaller than a chunk: the cache holds {C} tokens, {E} of them sink, so the rolling window "
                f"is {C - E} tokens ({(C - E) / self.tokens_per_frame:g} frames) but one chunk is {n} tokens "
                f"({n // self.tokens_per_frame} frames); use --window-frames >= --chunk-frames"
            )
        if self.scene_cut_every and self.sink_tokens > 0:
            e_pin = self.global_sink_tokens + min(self.sink_tokens, n)
            if C - e_pin < n:
                raise ValueError(
                    f"a scene-cut pin makes the sink {e_pin} tokens, leaving {C - e_pin} tokens for a chunk of {n}; "
                    f"raise --window-frames or lower --global-sink-tokens"
                )
        if self.page_bytes % PAGE_ALIGN_BYTES:
            raise ValueError(
                f"--page-bytes must be a multiple of {PAGE_ALIGN_BYTES}, got {self.page_bytes}; nearest valid: "
                f"{nearest_page_bytes(self.page_bytes)} (or auto)"
            )
        packed = self.packed_layout()  # ValueError naming the quantization field
        # A page holds whole tokens: K and V rows of every batch element (layout.py).
        token_bytes = 2 * self.batch_size * self.dense.row_bytes
        need = token_bytes
        if packed is not None:
            need = max(need, 2 * self.batch_size * packed.token_row_bytes, packed.codebook_row_bytes)
        if self.dense.tokens_per_page < 1 or (
            packed is not None and (packed.tokens_per_page < 1 or packed.codebook_row_bytes > self.page_bytes)
        ):
            raise ValueError(
                f"page size {self.page_bytes} B is too small: one token ({token_bytes} B of K and V rows) or one "
                f"packed row must fit a page; use --page-bytes >= {page_bytes_at_least(need)}"
            )

    # ----------------------------------------------------------------------------------------- derived sizes
    @property
    def effective_sink(self) -> int:
        """`E` before any pin: `max(S, GS)` tokens."""
        return max(self.sink_tokens, self.global_sink_tokens)

    @property
    def window_tokens(self) -> int:
        """Rolling window `C - E` in tokens (includes the current chunk)."""
        return self.cache_size - self.effective_sink

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def dense(self) -> DenseTokenLayout:
        """Layout of bf16 (cache-dtype) segments."""
        return DenseTokenLayout(self.batch_size, self.heads, self.head_dim, self.dtype, self.page_bytes)

    def packed_format(self) -> PackedFormat | None:
        """The packed record format, or None when quantization is off."""
        if not self.quant.enabled:
            return None
        return PackedFormat(self.head_dim, self.heads, self.quant, self.dtype)

    def packed_layout(self) -> PackedSegmentLayout | None:
        """Layout of the history format's packed segments (the registry's, `quant/layouts.py`), or None when
        quantization is off."""
        if not self.quant.enabled:
            return None
        layout = tier_layout(
            self.quant, "history", self.batch_size, self.heads, self.head_dim, self.dtype, self.page_bytes
        )
        assert isinstance(layout, PackedSegmentLayout)  # the history's format is a PRQ one
        return layout

    def dense_cache_bytes(self) -> int:
        """Bytes of the dense reference cache's K and V buffers for one layer: `2 * B * C * H * D * itemsize`."""
        return 2 * self.batch_size * self.cache_size * self.heads * self.head_dim * self.itemsize

    def view_bytes(self, tokens: int) -> int:
        """Bytes of one call's K and V view of `tokens` tokens (all heads)."""
        return 2 * self.batch_size * tokens * self.heads * self.head_dim * self.itemsize

    def transient_bytes(self, view_tokens: int) -> int:
        """Bytes one layer's call needs outside the pool: its K/V view of `view_tokens` tokens (`attention="view"`),
        or `update_and_attend`'s scratch (`"pages"`, attention.py: `attention_scratch_bytes` for the chunk's query
        rows plus `packed_decode_bytes` when packed, independent of the window; or, when larger, the Triton path's
        output and split-KV partials, `triton_attend_bytes`, bounded whatever the window)."""
        if self.attention == "view":
            return self.view_bytes(view_tokens)
        args = (self.batch_size, self.chunk_tokens, self.heads, self.head_dim, self.dtype)
        scratch = attention_scratch_bytes(*args)
        fmt = self.packed_format()
        if fmt is not None:
            scratch += packed_decode_bytes(self.batch_size, self.heads, self.head_dim, ATTN_TILE_TOKENS, fmt)
        return max(scratch, triton_attend_bytes(*args, view_tokens, packed=fmt is not None))

    def cache_kwargs(self) -> dict[str, object]:
        """Keyword arguments of `PagedCausalKVCache` for this geometry (pool, device, quant and name excluded)."""
        return {
            "batch_size": self.batch_size,
            "cache_size": self.cache_size,
            "num_heads": self.heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "sink_tokens": self.sink_tokens,
            "attention_window_size": self.attention_window,
            "global_sink_tokens": self.global_sink_tokens,
        }

    def with_window_frames(self, frames: int) -> Geometry:
        """The same geometry with a rolling window of `frames` frames (cache size re-derived)."""
        return dataclasses.replace(self, cache_size=self.effective_sink + frames * self.tokens_per_frame)


#: The command-line flag of each Workload field (errors name the flag a user types).
FIELD_FLAGS: dict[str, str] = {
    "cache_size_tokens": "--cache-size",
    "attention_window_tokens": "--attention-window",
}


def flag_of(name: str) -> str:
    """The `pagedqvg` flag that sets Workload field `name` (`head_dim` -> `--head-dim`)."""
    return FIELD_FLAGS.get(name, "--" + name.replace("_", "-"))


def valid_rank_counts(heads: int) -> list[int]:
    """Rank counts (ulysses x tp) that split `heads` heads evenly: the divisors of `heads`."""
    return [d for d in range(1, heads + 1) if heads % d == 0]


#: `check_workload`'s messages (`validation.check_int` templates).
_POSITIVE = "{name} must be a positive integer, got {value!r}"
_NON_NEGATIVE = "{name} must be an integer >= 0, got {value!r}"
_PAGE_BYTES = "{name} must be a positive size or auto, got {value!r}"
_SIZE = "{name} must be a size >= 0, got {value!r}"


def check_workload(w: Workload) -> None:
    """ValueError naming the flag of the first field of `w` that is out of range (sizes must be positive)."""
    positive = (
        "layers",
        "heads",
        "head_dim",
        "tokens_per_frame",
        "chunk_frames",
        "window_frames",
        "denoise_steps",
        "batch_size",
        "cache_sets",
        "chunks",
        "sessions",
        "ulysses",
        "tp",
    )
    for name in positive:
        check_int(flag_of(name), getattr(w, name), minimum=1, message=_POSITIVE, type_message=_POSITIVE)
    if w.page_bytes is not None:
        check_int("--page-bytes", w.page_bytes, minimum=1, message=_PAGE_BYTES, type_message=_PAGE_BYTES)
    check_int("--weights", w.weights_bytes, minimum=0, message=_SIZE, type_message=_SIZE)
    for name in (
        "sink_frames",
        "scene_cut_every",
        "sink_tokens",
        "global_sink_tokens",
        "cache_size_tokens",
        "attention_window_tokens",
    ):
        value = getattr(w, name)
        if value is not None:
            check_int(flag_of(name), value, minimum=0, message=_NON_NEGATIVE, type_message=_NON_NEGATIVE)
    if w.dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"--dtype must be bf16, fp16 or fp32, got {w.dtype!r}")
    if w.heads % w.ranks:
        ranks = f"--ulysses {w.ulysses} x --tp {w.tp} = {w.ranks} ranks"
        raise ValueError(
            f"--heads {w.heads} cannot be split evenly across {ranks}; valid rank counts (ulysses x tp) for "
            f"{w.heads} heads: {', '.join(map(str, valid_rank_counts(w.heads)))}"
        )
    if w.window_frames < w.chunk_frames and w.cache_size_tokens is None:
        raise ValueError(
            f"window smaller than a chunk: --window-frames {w.window_frames} < --chunk-frames {w.chunk_frames} "
            f"(the window includes the chunk being denoised)"
        )


# ---------------------------------------------------------------------------------------------------- replay
class PageCounter:
    """Pages in use and their high-water mark (a pool without storage)."""

    __slots__ = ("high_water", "used")

    def __init__(self) -> None:
        self.used = 0
        self.high_water = 0

    def alloc(self, n: int) -> None:
        self.used += n
        if self.used > self.high_water:
            self.high_water = self.used

    def free(self, n: int) -> None:
        self.used -= n


@dataclass(slots=True)
class CountedSegment:
    """A segment of the accounting: its kind and page count (no storage); `pack_failed` is always False here."""

    kind: SegmentKind
    pages: int
    pack_failed: bool = False
    fmt: str | None = None  # tiered configs: the tier format the segment holds ('bf16', 'fp8', 'int4', ...)

    @property
    def packed(self) -> bool:
        """Whether the segment is packed."""
        return self.kind == SegmentKind.PACKED


class CountingLayer:
    """One `PagedCausalKVCache` whose store counts pages instead of holding them (no tensors).

    The cache's own `Sequencer` (slot map, roll, pin, view ranges, released segments) and pack policy
    (`policy.tier_targets`, one path with or without tiers) with `PageCounter` for a pool: a segment of `n` tokens
    takes its format's `pages_for_tokens(n)` pages (`tiers.tier_layouts`: bf16, the history's, the tiers'); packing
    frees the old pages, then takes the packed ones, as the cache does. Each call is O(runs + log(segments) +
    segments touched + keep_recent_chunks + sink segments), so a replay of N chunks is O(N log N) whatever the
    window.
    """

    def __init__(self, geom: Geometry, counter: PageCounter | None = None, name: str = "layer") -> None:
        self.geom = geom
        self.name = name
        self.counter = counter if counter is not None else PageCounter()
        self.dense = geom.dense
        self.packed = geom.packed_layout()
        spec = CacheSpec.create(
            cache_size=geom.cache_size,
            attention_window_size=geom.attention_window,
            sink_tokens=geom.sink_tokens,
            global_sink_tokens=geom.global_sink_tokens,
        )
        self.seq: Sequencer[CountedSegment] = Sequencer(spec)
        self.pages = {SegmentKind.DENSE: 0, SegmentKind.PACKED: 0}
        self.segments = {SegmentKind.DENSE: 0, SegmentKind.PACKED: 0}
        self._order: dict[int, RangeEntry[CountedSegment]] = {}  # every segment by start, oldest first
        self._movable: dict[int, RangeEntry[CountedSegment]] = {}  # not in the tiers' coarsest format, oldest first
        # format -> layout of every format the tiers use (pagedqvg/planning/tiers.py; untiered: bf16 and the history's)
        self.tiers = tier_layouts(geom) if self.packed is not None else None
        self._coarsest = min(format_rank(geom.quant.tier_format(t)) for t in TIERS)

    # ---------------------------------------------------------------- state
    @property
    def held_pages(self) -> int:
        """Pages the layer holds."""
        return self.pages[SegmentKind.DENSE] + self.pages[SegmentKind.PACKED]

    def used_bytes(self) -> int:
        """Bytes the retained tokens' rows really occupy (plus codebooks of packed segments), as the cache reports."""
        if self.packed is None:
            return self.dense.used_bytes_for_tokens(self.seq.state.local_end)
        assert self.tiers is not None
        return sum(
            self.tiers[entry.value.fmt or "bf16"].used_bytes_for_tokens(kept)
            for entry, kept in self.seq.retained_tokens()
        )

    # ---------------------------------------------------------------- calls
    def write(self, start: int, n: int) -> int:
        """`update_and_get_attention_kv` of `n` tokens at global `start` (no head slice, the full view): the
        sequencing errors of the cache. Returns the view's token count."""
        seq = self.seq
        plan = seq.plan_write(start, n, self.name)
        for entry in seq.release(plan):
            del self._order[entry.start]
            self._movable.pop(entry.start, None)
            self._release(entry.value)
        segment = None
        if plan.new_tokens:
            segment = CountedSegment(SegmentKind.DENSE, self.dense.pages_for_tokens(plan.new_tokens))
            self._take(segment)
        entry = seq.commit(plan, segment)
        if entry is not None:
            self._order[entry.start] = self._movable[entry.start] = entry
            if self.packed is not None:
                self._apply_pack_policy(start, start + n)
        return sum(b - a for a, b in seq.view_ranges(plan.local_start, None))

    def _apply_pack_policy(self, keep_start: int, keep_end: int) -> None:
        """After an advance: pack (or repack) what `policy.tier_targets` selects into its tier's format, as the
        cache does (only segments not yet in the tiers' coarsest format are candidates, and the newest are read only
        up to `keep_recent_chunks`: O(candidates + keep_recent + sink segments))."""
        sinks = sink_segment_starts(self.seq)
        newest = reversed(self._order.values())
        keep = (keep_start, keep_end)
        for entry, tier in tier_targets(self.geom.quant, sinks, newest, list(self._movable.values()), keep):
            self._pack_tier(entry, self.geom.quant.tier_format(tier))

    def advance(self) -> int:
        """Append one chunk at the global end (the first denoise step). Returns the view's token count."""
        return self.write(self.seq.state.global_end, self.geom.chunk_tokens)

    def rewrite(self) -> int:
        """Rewrite the current chunk in place (a later denoise step or the clean pass). Returns view tokens."""
        n, G = self.geom.chunk_tokens, self.seq.state.global_end
        if n > G:
            raise ValueError(f"{self.name}: rewrite before the first advance (global end {G}, chunk of {n} tokens)")
        return self.write(G - n, n)

    def pin(self) -> None:
        """`pin_current_chunk(n)` with `n` the chunk size."""
        self.seq.pin(self.geom.chunk_tokens)

    # ---------------------------------------------------------------- the counting store
    def _take(self, seg: CountedSegment) -> None:
        self.counter.alloc(seg.pages)
        self.pages[seg.kind] += seg.pages
        self.segments[seg.kind] += 1

    def _release(self, seg: CountedSegment) -> None:
        self.counter.free(seg.pages)
        self.pages[seg.kind] -= seg.pages
        self.segments[seg.kind] -= 1

    def _pack_tier(self, entry: RangeEntry[CountedSegment], fmt: str) -> None:
        """Formats by age: frees the segment's pages (bf16 or an earlier tier's), then takes `fmt`'s pages."""
        assert self.tiers is not None
        if format_rank(fmt) <= self._coarsest:  # it can move no further
            del self._movable[entry.start]
        self._release(entry.value)
        pages = self.tiers[fmt].pages_for_tokens(entry.end - entry.start)
        entry.value = CountedSegment(SegmentKind.PACKED, pages, fmt=fmt)
        self._take(entry.value)


# ---------------------------------------------------------------------------------------------------- call pattern
@dataclass(frozen=True, slots=True)
class Call:
    """One cache call of the simulated pattern."""

    chunk: int
    step: int  # 0 = advance, 1..denoise_steps-1 = denoise rewrites, denoise_steps = clean pass, +1 = pin
    cache: int  # set * layers + layer
    op: str  # "advance", "denoise", "clean" or "pin"


def is_scene_cut(chunk: int, every: int) -> bool:
    """Whether 0-based chunk `chunk` is pinned after its clean pass: every > 0, chunk > 0, chunk % every == 0."""
    return every > 0 and chunk > 0 and chunk % every == 0


def call_pattern(geom: Geometry, chunks: int) -> Iterator[Call]:
    """The callers' order: per chunk, per denoise step (then the clean pass, then pins), every cache in turn."""
    steps = geom.denoise_steps
    for k in range(chunks):
        for step in range(steps + 1):
            op = "advance" if step == 0 else ("clean" if step == steps else "denoise")
            for c in range(geom.caches):
                yield Call(k, step, c, op)
        if is_scene_cut(k, geom.scene_cut_every):
            for c in range(geom.caches):
                yield Call(k, steps + 1, c, "pin")


# ---------------------------------------------------------------------------------------------------- census
@dataclass(frozen=True, slots=True)
class LayerCensus:
    """One layer's pages over a replay: per chunk `after[m]` (pages after chunk m) and `peak[m]` (max during m)."""

    after: tuple[int, ...]
    peak: tuple[int, ...]
    steady_index: int  # chunk index where `after` first reaches its maximum
    bf16_segments: int  # at that chunk
    packed_segments: int
    bf16_pages: int
    packed_pages: int
    used_bytes: int
    view_tokens: int  # largest view over the replay

    @property
    def steady_pages(self) -> int:
        return self.after[self.steady_index]

    def pool_high_water(self, caches: int) -> int:
        """Pool high-water pages when `caches` identical layers run this pattern one after another."""
        best, prev = 0, 0
        for a, p in zip(self.after, self.peak, strict=True):
            best = max(best, (caches - 1) * max(prev, a) + p)
            prev = a
        return best


def replay_chunks(geom: Geometry) -> int:
    """Chunks a single-layer replay runs to cover the warm-up and one full pin period after it."""
    n = geom.chunk_tokens
    fill = -(-geom.cache_size // n)
    every = geom.scene_cut_every
    q = geom.quant
    extra = (q.keep_recent_chunks + q.sink_keep_chunks) if q.enabled else 0
    return 2 * fill + 4 + extra + (3 * every if every else 0)


def replay_layer(geom: Geometry, chunks: int | None = None) -> LayerCensus:
    """Run one layer's accounting for `chunks` chunks (default `replay_chunks`) and take its census. O(N log N)."""
    chunks = replay_chunks(geom) if chunks is None else chunks
    counter = PageCounter()
    layer = CountingLayer(geom, counter)
    after: list[int] = []
    peak: list[int] = []
    best: tuple[int, int, int, int] = (0, 0, 0, 0)
    top, idx = -1, 0
    view = 0
    for k in range(chunks):
        counter.high_water = counter.used
        view = max(view, layer.advance())
        for _ in range(geom.denoise_steps):
            view = max(view, layer.rewrite())
        if is_scene_cut(k, geom.scene_cut_every):
            layer.pin()
        if counter.used > top:
            top, idx = counter.used, k
            segs, pages = layer.segments, layer.pages
            best = (
                segs[SegmentKind.DENSE],
                segs[SegmentKind.PACKED],
                pages[SegmentKind.DENSE],
                pages[SegmentKind.PACKED],
            )
        after.append(counter.used)
        peak.append(counter.high_water)
    # used bytes at the steady chunk: replay again up to it (used_bytes() walks every segment).
    again = CountingLayer(geom)
    for k in range(idx + 1):
        again.advance()
        if is_scene_cut(k, geom.scene_cut_every):
            again.pin()
    return LayerCensus(tuple(after), tuple(peak), idx, *best, again.used_bytes(), view)


def closed_form_segments(geom: Geometry) -> tuple[int, int]:
    """`(bf16, packed)` segments per layer at steady state without pins (the module docstring's formula)."""
    n, E = geom.chunk_tokens, geom.effective_sink
    k = -(-E // n)
    T = -(-(geom.cache_size - E) // n)
    q = geom.quant
    if not q.enabled:
        return k + T, 0
    packed = (max(0, k - q.sink_keep_chunks) if q.sink else 0) + max(0, T - 1 - q.keep_recent_chunks)
    return k + T - packed, packed


def closed_form_used_bytes(geom: Geometry) -> int:
    """Bytes the retained rows occupy per layer at steady state without pins (what the cache reports as used).

    Sink segments hold `n` tokens each except the last (`E - (k-1) n`); the oldest window segment holds
    `(C - E) - (T-1) n`; packed segments are the oldest window ones and the sink ones past `sink_keep_chunks`.
    """
    n, E, C = geom.chunk_tokens, geom.effective_sink, geom.cache_size
    k, T = -(-E // n), -(-(C - E) // n)
    q = geom.quant
    packed = geom.packed_layout()
    dense = geom.dense
    if packed is None:
        return dense.used_bytes_for_tokens(C)

    def used(is_packed: bool, count: int, tokens: int) -> int:
        return count * (packed if is_packed else dense).used_bytes_for_tokens(tokens) if count > 0 else 0

    total = 0
    if k:  # sink: k - 1 full segments (indices 0..k-2), then the last one with E - (k-1) n tokens
        sink_packed_full = max(0, k - 1 - q.sink_keep_chunks) if q.sink else 0
        total += used(True, sink_packed_full, n) + used(False, k - 1 - sink_packed_full, n)
        total += used(q.sink and k - 1 >= q.sink_keep_chunks, 1, E - (k - 1) * n)
    n_packed = max(0, T - 1 - q.keep_recent_chunks)  # window: the oldest (partial) first, then T - 1 full ones
    total += used(n_packed > 0, 1, (C - E) - (T - 1) * n)
    full_packed = max(0, n_packed - 1)
    total += used(True, full_packed, n) + used(False, T - 1 - full_packed, n)
    return total


def segment_pages(geom: Geometry) -> tuple[int, int]:
    """`(bf16, packed)` pages of one chunk-sized segment (packed is 0 when quantization is off)."""
    packed = geom.packed_layout()
    n = geom.chunk_tokens
    return geom.dense.pages_for_tokens(n), (packed.pages_for_tokens(n) if packed is not None else 0)


def closed_form_view_tokens(geom: Geometry) -> int:
    """Tokens of the largest view at steady state without pins (full cache, current chunk at the end)."""
    C, n = geom.cache_size, geom.chunk_tokens
    ranges = view_slot_ranges(
        local_end=C,
        window=geom.attention_window or C,
        sink=geom.effective_sink,
        global_sink_tokens=geom.global_sink_tokens,
        pin_start=-1,
        pin_len=0,
        local_start=C - n,
        recent_window_tokens=None,
    )
    return sum(b - a for a, b in ranges)


# ---------------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True, slots=True)
class SettingPlan:
    """Steady-state memory of one quantization setting. Bytes are exact; `all_*` cover every cache in the pool."""

    mode: str  # "off", "int4", "int2" or "compact" (`QuantConfig.mode`)
    quant: QuantConfig
    caches: int
    page_bytes: int
    chunk_tokens: int
    bf16_segments: int  # per layer at steady state
    packed_segments: int
    bf16_segment_pages: int  # pages of one chunk-sized segment
    packed_segment_pages: int
    pages: int  # per layer at steady state
    bf16_pages: int
    packed_pages: int
    used_bytes: int  # per layer: bytes really occupied inside the pages
    high_water_pages: int  # the whole pool
    view_tokens: int
    view_bytes: int  # transient, one layer's view (attention scratch with "pages") at a time, outside the pool
    dense_bytes: int  # the dense reference cache, per layer
    warmup_chunks: int | None  # chunks until the steady state is first reached (None: closed form, not computed)
    exact_by: str  # "closed form" or "replay"
    attention: str = "view"  # what `view_bytes` is: the view ("view") or update_and_attend's scratch ("pages")

    @property
    def bytes(self) -> int:
        """Pool bytes one layer holds at steady state (whole pages)."""
        return self.pages * self.page_bytes

    @property
    def waste_bytes(self) -> int:
        return self.bytes - self.used_bytes

    @property
    def all_bytes(self) -> int:
        return self.bytes * self.caches

    @property
    def pool_pages(self) -> int:
        """Pages the pool needs: its high-water mark (== all layers' steady state for this pattern)."""
        return self.high_water_pages

    @property
    def pool_bytes(self) -> int:
        return self.high_water_pages * self.page_bytes

    @property
    def budget_bytes(self) -> int:
        """Device memory this setting needs: the pool plus one transient view."""
        return self.pool_bytes + self.view_bytes

    def as_dict(self) -> dict[str, object]:
        """JSON-ready figures (ints, bytes)."""
        return {
            "mode": self.mode,
            "exact_by": self.exact_by,
            "page_bytes": self.page_bytes,
            "per_layer": {
                "bytes": self.bytes,
                "pages": self.pages,
                "used_bytes": self.used_bytes,
                "waste_bytes": self.waste_bytes,
                "bf16_bytes": self.bf16_pages * self.page_bytes,
                "packed_bytes": self.packed_pages * self.page_bytes,
                "bf16_segments": self.bf16_segments,
                "packed_segments": self.packed_segments,
                "dense_bytes": self.dense_bytes,
            },
            "all_layers": {
                "bytes": self.all_bytes,
                "pages": self.pages * self.caches,
                "used_bytes": self.used_bytes * self.caches,
                "waste_bytes": self.waste_bytes * self.caches,
                "dense_bytes": self.dense_bytes * self.caches,
            },
            "segment_pages": {"bf16": self.bf16_segment_pages, "packed": self.packed_segment_pages},
            "ratio_vs_dense": self.dense_bytes / self.bytes if self.bytes else math.inf,
            "pool_pages": self.pool_pages,
            "pool_bytes": self.pool_bytes,
            "transient_view_tokens": self.view_tokens,
            "transient_view_bytes": self.view_bytes,
            "attention": self.attention,
            "budget_bytes": self.budget_bytes,
            "warmup_chunks": self.warmup_chunks,
        }


def plan_geometry(geom: Geometry, *, replay: bool | None = None) -> SettingPlan:
    """The steady-state plan of `geom`, from the single-layer replay (`replay=True`; exact for every pattern, and
    it knows the warm-up) or the closed form (`replay=False`; O(1), no pins only; tests check that both agree).
    Default: the replay with pins or for caches of up to `REPLAY_MAX_CHUNKS` chunks, else the closed form."""
    bf16_seg, packed_seg = segment_pages(geom)
    common = dict(
        mode=geom.quant.mode,
        quant=geom.quant,
        attention=geom.attention,
        caches=geom.caches,
        page_bytes=geom.page_bytes,
        chunk_tokens=geom.chunk_tokens,
        bf16_segment_pages=bf16_seg,
        packed_segment_pages=packed_seg,
        dense_bytes=geom.dense_cache_bytes(),
    )
    if replay is None:
        replay = bool(geom.scene_cut_every) or geom.cache_size <= REPLAY_MAX_CHUNKS * geom.chunk_tokens
    if replay or geom.scene_cut_every or geom.quant.tiered:  # tiers: the replay (the closed form is untiered)
        census = replay_layer(geom)
        return SettingPlan(
            **common,
            bf16_segments=census.bf16_segments,
            packed_segments=census.packed_segments,
            pages=census.steady_pages,
            bf16_pages=census.bf16_pages,
            packed_pages=census.packed_pages,
            used_bytes=census.used_bytes,
            high_water_pages=census.pool_high_water(geom.caches),
            view_tokens=census.view_tokens,
            view_bytes=geom.transient_bytes(census.view_tokens),
            warmup_chunks=census.steady_index + 1,
            exact_by="replay",
        )
    nb, npk = closed_form_segments(geom)
    pages = nb * bf16_seg + npk * packed_seg
    view = closed_form_view_tokens(geom)
    return SettingPlan(
        **common,
        bf16_segments=nb,
        packed_segments=npk,
        pages=pages,
        bf16_pages=nb * bf16_seg,
        packed_pages=npk * packed_seg,
        used_bytes=closed_form_used_bytes(geom),
        high_water_pages=pages * geom.caches + (max(0, bf16_seg - packed_seg) if npk else 0),
        view_tokens=view,
        view_bytes=geom.transient_bytes(view),
        warmup_chunks=None,
        exact_by="closed form",
    )


def setting_quant(base: QuantConfig, bits: int | None) -> QuantConfig:
    """`base` with `bits` (trit packing only where it is valid: symmetric int2)."""
    trits = base.pack_trits and bits == 2 and not base.asymmetric
    return dataclasses.replace(base, bits=bits, pack_trits=trits)


def policy_fields(cfg: QuantConfig) -> dict[str, object]:
    """`cfg`'s `POLICY_FIELDS` (when chunks are packed: keep_recent_chunks, sink, sink_keep_chunks, seed)."""
    return {name: getattr(cfg, name) for name in POLICY_FIELDS}


def compact_quant(policy: QuantConfig, head_dim: int | None = None, **overrides: object) -> QuantConfig:
    """`QuantConfig.compact()` with `policy`'s `POLICY_FIELDS` and then `overrides`.

    With `head_dim` below compact's 128-channel block (the `*-mini` presets' 64), the block is `head_dim`: one fitted
    scale per token-head, which is what the 128-channel block is at head_dim 128 (and what a block larger than
    head_dim means in SGLang). A `block_size` in `overrides` is taken as given. ValueError for an invalid result."""
    fields: dict[str, object] = policy_fields(policy)
    if head_dim is not None and 0 < head_dim < COMPACT_BLOCK:
        fields["block_size"] = head_dim
    fields.update(overrides)
    return QuantConfig.compact(**fields)


def mode_quant(base: QuantConfig, mode: str, head_dim: int | None = None) -> QuantConfig:
    """The config of plan mode `mode` (one of `PLAN_MODES`) next to a workload whose config is `base`.

    `base` itself when it is that mode. Else: compact is `compact_quant(base, head_dim)` (compact's format, `base`'s
    policy); off, int4 and int2 are `setting_quant(base, bits)` (`base`'s other knobs kept), except next to a compact
    `base` (or where keeping `base`'s knobs would turn int2 into compact), where they are the reference formats with
    `base`'s policy. ValueError for an unknown mode."""
    if mode == base.mode:
        return base
    if mode == "compact":
        return compact_quant(base, head_dim)
    bits = {"off": None, "int4": 4, "int2": 2}.get(mode, 0)
    if bits == 0:
        raise ValueError(f"unknown plan mode {mode!r}; allowed: {', '.join(PLAN_MODES)}")
    q = setting_quant(base, bits)
    if base.mode == "compact" or q.mode != mode:
        q = QuantConfig(bits=bits, **policy_fields(base))  # type: ignore[arg-type]
    return q


def setting_geometries(w: Workload) -> tuple[list[Geometry], list[tuple[str, str]]]:
    """Geometries for quantization off, int4, int2 and compact (`PLAN_MODES`, configs from `mode_quant`: the
    workload's other quant knobs kept where they apply), and `(mode, reason)` for the modes that cannot work with
    this shape (e.g. a block size that does not divide head_dim). The workload's own setting must work (ValueError
    otherwise)."""
    geoms: list[Geometry] = []
    skipped: list[tuple[str, str]] = []
    Geometry.from_workload(w)
    for mode in PLAN_MODES:
        try:
            geoms.append(Geometry.from_workload(w, mode_quant(w.quant, mode, w.head_dim)))
        except ValueError as exc:
            skipped.append((mode, str(exc)))
    return geoms, skipped


def plan_settings(w: Workload) -> list[SettingPlan]:
    """Plans for quantization off, int4, int2 and compact (see `setting_geometries`; modes that cannot work with
    this shape are left out)."""
    return [plan_geometry(g) for g in setting_geometries(w)[0]]


def budget_needed(geom: Geometry, window_frames: int) -> int:
    """Device bytes (pool + one view) `geom` needs with a window of `window_frames` frames."""
    return plan_geometry(geom.with_window_frames(window_frames), replay=False).budget_bytes


def search_limit_frames(geom: Geometry) -> int:
    """Largest window (frames) `max_window_frames` tries: 2^20 frames, or 1,024 chunks with scene-cut pins (each
    try then replays ~2x the window chunk by chunk)."""
    if geom.scene_cut_every:
        return MAX_PINNED_SEARCH_CHUNKS * max(1, geom.chunk_tokens // geom.tokens_per_frame)
    return MAX_SEARCH_FRAMES


def max_window_frames(geom: Geometry, budget: int, min_frames: int) -> int | None:
    """Largest window (frames, >= `min_frames`, <= `search_limit_frames`) whose pool + view fit in `budget` bytes;
    None if none fits. Memory grows with the window, so a doubling search then bisection: O(log window) plans.
    """
    if budget_needed(geom, min_frames) > budget:
        return None
    limit = max(min_frames, search_limit_frames(geom))
    lo, hi = min_frames, min_frames * 2
    while True:
        if hi >= limit:
            if budget_needed(geom, limit) <= budget:
                return limit
            hi = limit
            break
        if budget_needed(geom, hi) > budget:
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if budget_needed(geom, mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def min_window_frames(geom: Geometry, chunk_frames: int) -> int:
    """Smallest window (frames) the geometry accepts: one chunk, more if a scene-cut pin grows the sink."""
    frames = chunk_frames
    if geom.scene_cut_every and geom.sink_tokens > 0:
        e_pin = geom.global_sink_tokens + min(geom.sink_tokens, geom.chunk_tokens)
        extra = max(0, e_pin - geom.effective_sink)
        frames += -(-extra // geom.tokens_per_frame)
    return frames


#: `max_sessions` stops counting here.
MAX_SESSIONS = 1 << 16


def max_sessions(geom: Geometry, budget: int, limit: int = MAX_SESSIONS) -> int:
    """Most concurrent sessions (each `geom.caches // geom.sessions` caches, advancing together, their calls
    interleaved one at a time) whose pool high-water plus one transient view fit in `budget` bytes; 0 if not even
    one. The pool grows linearly with the caches, so one plan and O(log sessions) arithmetic steps."""
    per = geom.caches // geom.sessions
    one = dataclasses.replace(geom, caches=per, sessions=1)
    if one.scene_cut_every:
        census = replay_layer(one)
        view = geom.transient_bytes(census.view_tokens)

        def pages(caches: int) -> int:
            return census.pool_high_water(caches)

    else:
        plan = plan_geometry(one, replay=False)
        view = plan.view_bytes
        extra = plan.high_water_pages - plan.pages * per

        def pages(caches: int) -> int:
            return plan.pages * caches + extra

    def fits(n: int) -> bool:
        return pages(per * n) * geom.page_bytes + view <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
