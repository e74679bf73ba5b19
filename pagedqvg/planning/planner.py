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
from dataclasses import dataclass

from pagedqvg.cache.sequencing import view_slot_ranges

# Geometry and the replay live in their own modules; their names stay importable from here.
from pagedqvg.planning.geometry import Geometry as Geometry
from pagedqvg.planning.geometry import check_workload as check_workload
from pagedqvg.planning.geometry import flag_of as flag_of
from pagedqvg.planning.geometry import largest_fitting
from pagedqvg.planning.presets import Workload
from pagedqvg.planning.replay import Call as Call
from pagedqvg.planning.replay import CountedSegment as CountedSegment
from pagedqvg.planning.replay import CountingLayer as CountingLayer
from pagedqvg.planning.replay import LayerCensus as LayerCensus
from pagedqvg.planning.replay import PageCounter as PageCounter
from pagedqvg.planning.replay import call_pattern as call_pattern
from pagedqvg.planning.replay import is_scene_cut as is_scene_cut
from pagedqvg.planning.replay import replay_chunks as replay_chunks
from pagedqvg.planning.replay import replay_layer as replay_layer
from pagedqvg.quant.config import QuantConfig

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
ATTENTION_MODES: tuple[str, ...] = ("view", "pages", "heads")
#: Largest window (frames) the budget search tries.
MAX_SEARCH_FRAMES = 1 << 20
#: `plan_geometry` replays caches of up to this many chunks by default (beyond, the closed form: O(1)).
REPLAY_MAX_CHUNKS = 4096
#: With scene-cut pins or tier formats the search replays the pattern; it stops at windows of this many chunks.
MAX_PINNED_SEARCH_CHUNKS = 1024


def check_replayable(geom: Geometry, why: str) -> None:
    """ValueError naming the window and the largest one allowed when `geom`'s cache holds more than
    `REPLAY_MAX_CHUNKS` chunks: a replay (`why`: what needs it) runs chunk by chunk, O(window), so a window of
    10^9 frames would take hours; the bound keeps every plan to seconds. O(1)."""
    n, tpf = geom.chunk_tokens, geom.tokens_per_frame
    if geom.cache_size <= REPLAY_MAX_CHUNKS * n:
        return
    frames = max(0, (REPLAY_MAX_CHUNKS * n - geom.effective_sink) // tpf)
    raise ValueError(
        f"a cache of {geom.cache_size:,} tokens ({geom.window_tokens / tpf:g}-frame window) with {why} is planned by "
        f"replaying it chunk by chunk, up to caches of {REPLAY_MAX_CHUNKS} chunks ({REPLAY_MAX_CHUNKS * n:,} tokens); "
        f"use --window-frames <= {frames}"
    )


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
        why = "a replayed plan (warm-up and high-water, as simulate compares them)"
        if geom.scene_cut_every or geom.quant.tiered:
            why = "--scene-cut-every" if geom.scene_cut_every else "tier formats (recent/sink)"
        check_replayable(geom, why)  # O(1); the default replays only caches within the bound
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
    """Largest window (frames) `max_window_frames` tries: 2^20 frames, or 1,024 chunks with scene-cut pins or tier
    formats (each try then replays ~2x the window chunk by chunk)."""
    if geom.scene_cut_every or geom.quant.tiered:
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

    return largest_fitting(fits, limit)
