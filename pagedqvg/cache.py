"""The per-layer paged causal KV cache: the dense cache's contract (docs/SEMANTICS.md) over pool pages.

Data path: pool pages ← range index (global token ranges → segments) ← slot map (slots → global tokens) ← this
cache (sequencing rules, roll, pin, rewind) → kernels (page write, view build) → `CausalAttentionKVView`.

Every call is planned completely (new slot map, cursors, segments to free, pages to take) before anything changes,
so every error leaves the cache and the pool exactly as they were.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from .allocator import BlockPool, RangeEntry, RangeIndex
from .errors import CacheClosedError, CacheConfigError, PackingFailedWarning, SequencingError
from .layout import DenseTokenLayout
from .packing import PackedStore, QuantizedChunk
from .page_io import PageIO, Spans, ViewPlan, WritePlan
from .quant import QuantConfig
from .segment import Segment, SegmentKind
from .slot_map import SlotMap
from .view import CausalAttentionKVView

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(slots=True)
class _WritePlan:
    """Everything one update call will change, computed before anything changes."""

    ls: int
    le: int
    new_tokens: int  # a = e - G (0 for an in-place rewrite)
    cache_size: int
    window: int
    global_end: int
    local_end: int
    pin_start: int
    slot_map: SlotMap
    free_entries: list[RangeEntry[Segment]] = field(default_factory=list)
    unpack_entries: list[RangeEntry[Segment]] = field(default_factory=list)
    pressure_entries: list[tuple] = field(default_factory=list)  # (entry, QuantizedChunk): packed before the commit


def _as_index(name: str, value: object, debug_name: str) -> int:
    """An int-like argument as int (Python ints, numpy ints, 0-d integer tensors); bools and floats are refused."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        raise TypeError(f"{debug_name}: {name} must be an int, got bool {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{debug_name}: {name} must be an int, got a tensor of shape {tuple(value.shape)}")
        return int(value.item())
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{debug_name}: {name} must be an int, got {value!r} ({type(value).__name__})") from None


def _config_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CacheConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise CacheConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def effective_sink(sink_tokens: int, global_sink_tokens: int, pin_start: int, pin_len: int) -> int:
    """`E` of SEMANTICS.md: slots `[0, E)` never roll."""
    if pin_start >= 0 and pin_len > 0:
        return global_sink_tokens + pin_len if pin_start == global_sink_tokens else global_sink_tokens
    return max(global_sink_tokens, sink_tokens)


def released_segments(index: RangeIndex, new_map: SlotMap, dropped: list[tuple[int, int]]) -> list[RangeEntry]:
    """Entries of `index` touched by the `dropped` global ranges of a roll that no slot of `new_map` holds any more
    (their pages go back to the pool), each once, in order. O(dropped x (log n + k) x runs)."""
    out: list[RangeEntry] = []
    seen: set[int] = set()
    for g0, g1 in dropped:
        for entry in index.overlapping(g0, g1):
            if entry.start not in seen:
                seen.add(entry.start)
                if not new_map.holds_any(entry.start, entry.end):
                    out.append(entry)
    return out


def view_slot_ranges(
    *,
    local_end: int,
    window: int,
    sink: int,
    global_sink_tokens: int,
    pin_start: int,
    pin_len: int,
    local_start: int,
    recent_window_tokens: int | None,
) -> list[tuple[int, int]]:
    """The slot ranges of the view, in order (SEMANTICS.md step 5). Pure; O(1)."""
    L, W, E, P, PL = local_end, window, sink, pin_start, pin_len
    pinned = P >= 0 and PL > 0
    A = max(0, L - W)
    if recent_window_tokens is None:
        if global_sink_tokens > 0 or pinned:
            ps = E > 0 and A > 0
            pp = pinned and E <= P < A
            if ps and pp:
                return [(0, E), (P, P + PL), (max(E, L - max(0, W - E - PL)), L)]
            if ps:
                return [(0, E), (max(E, L - max(0, W - E)), L)]
            if pp:
                return [(P, P + PL), (max(0, L - max(0, W - PL)), L)]
        return [(A, L)]
    se = min(E, L)
    rs = max(se, local_start - recent_window_tokens)
    if rs <= se:
        return [(0, L)]
    ranges = [(0, se)] if se > 0 else []
    if pinned and se <= P < rs:
        ranges.append((P, P + PL))
    ranges.append((rs, L))
    return ranges


class PagedCausalKVCache:
    """One layer's causal K/V cache whose bytes live in pages of a shared `BlockPool`.

    The contract of SGLang's dense `CausalSelfAttentionKVCache` (written out in docs/SEMANTICS.md): a window of
    `cache_size` slots over the tokens produced so far, a sink at its front that never rolls, and a view per call.
    With quantization off every view equals the dense cache's bit for bit. A repeated call (a denoise step
    rewriting the current chunk) reuses its cached plan: on CPU one copy per page piece of the write and two
    concatenations for the view; on CUDA one Triton launch each. An advance also runs the eviction and pack policy
    (O(segments x runs)). For SGLang's own constructor signatures use `pagedqvg.integrations.sglang`.

    Args (keyword-only):
        pool: the `BlockPool` holding this layer's pages (share one pool between all layers of a device).
        batch_size: batch elements per token (int >= 1).
        cache_size: slots of the window, in tokens (int >= 1); with `allow_growth` it grows instead of rolling.
        num_heads: K/V heads the cache holds (int >= 1); a call may write a slice of them (`cache_head_start`).
        head_dim: channels per head (int >= 1).
        dtype: torch.float32, torch.float16 or torch.bfloat16; `key` / `value` must have it.
        device: the pool's device ("cpu" or "cuda[:i]").
        sink_tokens: tokens at the front of the window that do not roll out (default 0); also the most a scene
            cut pins (`pin_current_chunk`).
        attention_window_size: slots a view covers, counted back from the newest token (default None or 0: the
            whole `cache_size`).
        global_sink_tokens: the first tokens of the stream, kept for good and prepended to every view once the
            window has moved past them (default 0); a pin adds to them.
        allow_growth: when an advance does not fit, grow `cache_size` to max(needed, 2 x cache_size) (and the
            attention window with it if it was the whole cache) instead of rolling (default False).
        use_int_indices: keep the cursors as host ints `global_end_index_int` / `local_end_index_int` (no device
            work per call; the tensors are never written) instead of the tensors (default False).
        global_end_index, local_end_index: 1-element int64 tensors (starting at 0) to use as the cursors; default:
            new ones. They must be two different tensors.
        quant: a `QuantConfig` to pack completed chunks with PRQ (2 or 4 bits); None or bits=None: exact bf16.
        name: this layer's label: the pool owner's prefix and the first word of every error message
            (default "layer").
        reuse_view_buffer: build every view into one per-pool scratch buffer instead of a fresh tensor (no
            allocation per call); such a view is valid only until the next call on any cache of the pool
            (default False).
        pack_under_pressure: with quantization, when an advance does not fit the pool, pack this layer's bf16
            chunks early (oldest first) if that frees enough pages, instead of raising PoolExhaustedError
            (default False).

    Attributes:
        pool, batch_size, head_dim, dtype, device, quant, reuse_view_buffer, pack_under_pressure: as given
            (`device` is the pool's).
        debug_name: `name`; owner: this layer's owner id in the pool.
        layout: the page layout of bf16 rows (`pagedqvg.layout.DenseTokenLayout`).
        pack_skipped: chunks the pack policy left unpacked (non-finite values, or packing failed).
        global_end_index_int, local_end_index_int: the host cursors (None unless `use_int_indices`): tokens
            produced so far, and slots filled.

    Raises:
        CacheConfigError: a bad argument (naming it and the valid values); nothing is allocated.
    """

    #: The class of returned views (fields in `CausalAttentionKVView`'s order); the SGLang integration uses SGLang's.
    _view_cls: type = CausalAttentionKVView

    def __init__(
        self,
        *,
        pool: BlockPool,
        batch_size: int,
        cache_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sink_tokens: int = 0,
        attention_window_size: int | None = None,
        global_sink_tokens: int = 0,
        allow_growth: bool = False,
        use_int_indices: bool = False,
        global_end_index: torch.Tensor | None = None,
        local_end_index: torch.Tensor | None = None,
        quant: QuantConfig | None = None,
        name: str = "layer",
        reuse_view_buffer: bool = False,
        pack_under_pressure: bool = False,
    ) -> None:
        if not isinstance(pool, BlockPool):
            raise CacheConfigError(f"pool must be a pagedqvg.BlockPool, got {type(pool).__name__}")
        self.batch_size = _config_int("batch_size", batch_size, 1)
        cache_size = _config_int("cache_size", cache_size, 1)
        self._num_heads = _config_int("num_heads", num_heads, 1)
        self.head_dim = _config_int("head_dim", head_dim, 1)
        self._sink = _config_int("sink_tokens", sink_tokens, 0)
        self._global_sink = _config_int("global_sink_tokens", global_sink_tokens, 0)
        if attention_window_size is None:
            attention_window_size = 0
        window = _config_int("attention_window_size", attention_window_size, 0)
        if dtype not in SUPPORTED_DTYPES:
            raise CacheConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise CacheConfigError(f"unknown device {device!r}") from None
        if dev.type != pool.device.type or (dev.index is not None and dev.index != pool.device.index):
            raise CacheConfigError(f"device {dev} differs from the pool's device {pool.device}")
        if quant is not None:
            if not isinstance(quant, QuantConfig):
                raise CacheConfigError(f"quant must be a pagedqvg.QuantConfig or None, got {type(quant).__name__}")
            try:
                quant.validate(head_dim=self.head_dim)
            except ValueError as exc:
                raise CacheConfigError(f"quant: {exc}") from None
        self.pool = pool
        self.device = pool.device
        self.dtype = dtype
        self.quant = quant
        self.debug_name = name
        self.owner = pool.new_owner(name)
        self.reuse_view_buffer = bool(reuse_view_buffer)
        self.layout = DenseTokenLayout(self.batch_size, self._num_heads, self.head_dim, dtype, pool.page_bytes)
        if self.layout.tokens_per_page < 1:
            token_bytes = 2 * self.batch_size * self.layout.row_bytes
            raise CacheConfigError(
                f"one token (K and V for {self.batch_size} batch x {self._num_heads} heads x {self.head_dim} x "
                f"{self.layout.itemsize} B = {token_bytes} B) does not fit a page of {pool.page_bytes} B; use a pool "
                f"with page_bytes >= {-(-token_bytes // 256) * 256}"
            )
        self._packed: PackedStore | None = None
        if quant is not None and quant.enabled:
            try:
                self._packed = PackedStore(pool, self.batch_size, self._num_heads, self.head_dim, dtype, quant)
            except ValueError as exc:
                raise CacheConfigError(f"quant: {exc}") from None
        self.pack_under_pressure = bool(pack_under_pressure)
        self.pack_skipped = 0  # chunks left dense because they held non-finite values or packing failed
        # The token rows of this layer in the pool, every move of them, and the cached write/view plans.
        self._io = PageIO(pool, self.layout, self._packed)
        self._grow = bool(allow_growth)
        self._use_int = bool(use_int_indices)
        self._C = cache_size
        self._W = window if window > 0 else cache_size
        self._G = 0
        self._L = 0
        self._P = -1
        self._PL = 0
        self._map = SlotMap()
        self._index: RangeIndex[Segment] = RangeIndex()
        self._closed = False
        self._last_view_ranges: list[tuple[int, int]] = []
        self._g_tensor = self._cursor("global_end_index", global_end_index)
        self._l_tensor = self._cursor("local_end_index", local_end_index)
        if self._g_tensor.untyped_storage().data_ptr() == self._l_tensor.untyped_storage().data_ptr():
            raise CacheConfigError(
                "global_end_index and local_end_index must be two different tensors (G and L differ)"
            )
        # A cache collected without close() still gives its pages back.
        self._finalizer = weakref.finalize(self, _release_owner, pool, self.owner)
        self.global_end_index_int: int | None = 0 if self._use_int else None
        self.local_end_index_int: int | None = 0 if self._use_int else None

    def _cursor(self, name: str, given: torch.Tensor | None) -> torch.Tensor:
        if given is None:
            return torch.zeros(1, dtype=torch.int64, device=self.device)
        if not isinstance(given, torch.Tensor) or given.shape != (1,) or given.dtype != torch.int64:
            raise CacheConfigError(f"{name} must be a 1-element int64 tensor, got {given!r}")
        if given.device != self.device:
            raise CacheConfigError(f"{name} is on {given.device}, the cache on {self.device}")
        if int(given.item()) != 0:
            raise CacheConfigError(f"{name} must start at 0 for an empty cache, got {int(given.item())}")
        return given

    # ------------------------------------------------------------ read-only state
    @property
    def num_cache_heads(self) -> int:
        """Heads the cache holds (`num_heads`)."""
        return self._num_heads

    @property
    def cache_size(self) -> int:
        """Slots of the window, in tokens (grows with `allow_growth`; a grown size survives `reset_indices`)."""
        return self._C

    @property
    def attention_window_size(self) -> int:
        """Slots a view covers, counted back from the newest token (the whole `cache_size` when given as 0/None)."""
        return self._W

    @property
    def sink_tokens(self) -> int:
        """Tokens at the front of the window that do not roll out; the most a scene cut pins."""
        return self._sink

    @property
    def global_sink_tokens(self) -> int:
        """The first tokens of the stream, kept for good and prepended to views once the window moved past them."""
        return self._global_sink

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
        return self._P, self._PL

    @property
    def closed(self) -> bool:
        """True after `close()`: the pages are back in the pool and every call raises CacheClosedError."""
        return self._closed

    def effective_sink_tokens(self) -> int:
        """The number of front slots that never roll now: max(sink_tokens, global_sink_tokens) when nothing is
        pinned; with a pin, global_sink_tokens plus the pinned length once the pin sits right after the global sink,
        else global_sink_tokens (docs/SEMANTICS.md, "Effective sink")."""
        return effective_sink(self._sink, self._global_sink, self._P, self._PL)

    def can_direct_current_attention(self, num_tokens: int) -> bool:
        """Whether a chunk of `num_tokens` may attend to itself without the cache (no sink, and the cache and the
        attention window are exactly that chunk), as SGLang's models ask before calling the cache."""
        return self._sink == 0 and num_tokens == self._C and num_tokens == self._W

    def resident_nbytes(self) -> int:
        """Bytes this layer holds in the pool (whole pages, K and V). O(1)."""
        return self.pool.pages_of(self.owner) * self.pool.page_bytes

    def retained_token_ranges(self) -> list[tuple[int, int]]:
        """Global token ranges the slots hold, in slot order (sink, pinned, tail)."""
        return self._map.global_ranges()

    def last_view_sources(self) -> list[tuple[int, int, str]]:
        """Where the rows of the last returned view came from, in order: `(global_start, global_end, kind)` with
        kind "dense" (exact rows), "packed" (dequantized), "unpacked" (dense rows of a chunk that was packed and
        then partly rewritten: the rows the rewrite did not touch carry the quantization error), and
        `(-1, count - 1, "zeros")` for `count` slots the cache never filled. Valid until the cache changes.
        O(runs + segments)."""
        out: list[tuple[int, int, str]] = []
        for a, b in self._last_view_ranges:
            for g0, g1 in self._map.to_global(a, min(b, self._L)):
                for entry in self._index.overlapping(g0, g1):
                    kind = "unpacked" if entry.value.lossy else entry.value.kind
                    out.append((max(g0, entry.start), min(g1, entry.end), kind))
            if b > max(a, self._L):
                out.append((-1, b - max(a, self._L) - 1, "zeros"))
        return out

    def segments(self) -> list[tuple[int, int, int]]:
        """`(global_start, global_end, pages)` of each stored segment, in order."""
        return [(e.start, e.end, len(e.value.pages)) for e in self._index]

    def __repr__(self) -> str:
        # G: tokens produced, L: slots filled, C: cache_size, W: attention window, E: effective sink, pin: slot+length
        return (
            f"PagedCausalKVCache({self.debug_name}: G={self._G} L={self._L} C={self._C} W={self._W} "
            f"E={self.effective_sink_tokens()} pin={self._P}+{self._PL}, {len(self._index)} segments, "
            f"{self.resident_nbytes()} B resident)"
        )

    # ------------------------------------------------------------ checks
    def _ensure_open(self, what: str) -> None:
        if self._closed:
            raise CacheClosedError(
                f"{self.debug_name}: {what} after close(); its pages are back in the pool — make a new cache"
            )

    def _check_kv(self, key: object, value: object, cache_head_start: object) -> tuple[int, int, int]:
        name = self.debug_name
        for label, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(
                    f"{name}: {label} must be [batch, tokens, heads, head_dim], got shape {tuple(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise TypeError(f"{name}: {label} dtype {t.dtype} differs from the cache dtype {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name}: {label} is on {t.device}, the cache is on {self.device}")
            if t.layout != torch.strided:
                raise TypeError(f"{name}: {label} has layout {t.layout}; the cache takes dense (strided) tensors")
        assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
        if key.shape != value.shape:
            raise ValueError(f"{name}: key shape {tuple(key.shape)} differs from value shape {tuple(value.shape)}")
        batch, n, hin, d = key.shape
        if batch != self.batch_size:
            raise ValueError(f"{name}: batch {batch} differs from the cache's batch_size {self.batch_size}")
        if d != self.head_dim:
            raise ValueError(f"{name}: head_dim {d} differs from the cache's head_dim {self.head_dim}")
        if n == 0:
            raise ValueError(f"{name}: zero-length chunk (key has 0 tokens); pass at least one token")
        H = self._num_heads
        if hin == 0 or hin > H:
            raise ValueError(f"{name}: key has {hin} heads; the cache has {H} (valid: 1..{H})")
        if cache_head_start is None:
            if hin != H:
                raise ValueError(
                    f"{name}: key has {hin} heads but the cache has {H}; pass cache_head_start "
                    f"(valid: 0..{H - hin}) to write and view heads [cache_head_start, cache_head_start + {hin})"
                )
            return n, hin, 0
        h0 = _as_index("cache_head_start", cache_head_start, name)
        if h0 < 0 or h0 + hin > H:
            raise ValueError(
                f"{name}: head slice [{h0}, {h0 + hin}) is outside the cache's {H} heads "
                f"(valid cache_head_start for {hin} heads: 0..{H - hin})"
            )
        return n, hin, h0

    def _current_chunk_start(self) -> int:
        last = self._index.last()
        return last.start if last is not None else 0

    def _oldest_rewritable(self) -> int:
        """The smallest global start a write may have now (tokens before it are not in the rolling tail)."""
        return self._G - (self._L - self._map.tail_start(self._G))

    def _sequencing_error(self, what: str, start: int, n: int) -> SequencingError:
        floor = self._oldest_rewritable()
        return SequencingError(
            f"{self.debug_name}: {what}: start={start}, {n} tokens, global end={self._G}, current chunk starts at "
            f"{self._current_chunk_start()}; valid starts are {floor}..{self._G} (a rewrite of retained tail "
            f"tokens [{floor}, {self._G}) or an append at {self._G})"
        )

    # ------------------------------------------------------------ planning (pure)
    def _plan(self, s: int, n: int) -> _WritePlan:
        G, L, C, W = self._G, self._L, self._C, self._W
        e = s + n
        smap = self._map
        if s < 0:
            raise ValueError(f"{self.debug_name}: current_chunk_start={s} is negative (valid: 0..{G})")
        if s > G:
            raise self._sequencing_error(f"gap: the chunk starts after the global end {G}", s, n)
        if e <= G:
            ls = s - (G - L)
            if ls < smap.tail_start(G):
                raise self._sequencing_error("rewrite of tokens that are no longer in the rolling tail", s, n)
            return _WritePlan(ls, ls + n, 0, C, W, G, L, self._P, smap)
        a = e - G
        if self._grow and L + a > C:
            new_c = max(L + a, 2 * C)
            if W == C:
                W = new_c
            C = new_c
        P = self._P
        free_entries: list[RangeEntry[Segment]] = []
        if L + a > C:
            ev = L + a - C
            E = effective_sink(self._sink, self._global_sink, P, self._PL)
            le = C
            ls = le - n
            if ls < E:
                raise CacheConfigError(
                    f"{self.debug_name}: a chunk of n={n} tokens (start={s}, global end={G}) would roll onto the "
                    f"sink: cache_size C={C}, effective sink E={E}, so a chunk may be at most C - E = {C - E} "
                    f"tokens; raise cache_size, shrink the chunk or the sink"
                )
            if L - (G - s) < smap.tail_start(G):
                raise self._sequencing_error("rewrite of tokens that are no longer in the rolling tail", s, n)
            new_map, dropped = smap.rolled(E, ev)
            if P >= 0 and self._PL > 0 and P >= E:
                P -= ev
            # Segments whose every token left the slots go back to the pool in this call.
            free_entries = released_segments(self._index, new_map, dropped)
        else:
            le = L + a
            ls = le - n
            if ls < smap.tail_start(G):
                raise self._sequencing_error("rewrite of tokens that are no longer in the rolling tail", s, n)
            new_map = smap
        new_map = new_map.appended(le - a, a, G)
        return _WritePlan(ls, le, a, C, W, e, le, P, new_map, free_entries)

    def _structure_changed(self) -> None:
        """Pages, segments, slots or the pin changed: every cached plan is stale."""
        self._io.invalidate()
        self._last_view_ranges = []

    # ------------------------------------------------------------ data movement (page_io.PageIO)
    def _view_spans(self, ranges: list[tuple[int, int]]) -> Spans:
        """Per slot range of a view: the global token ranges its filled slots hold, and its never-filled slots."""
        L = self._L
        return [(self._map.to_global(a, min(b, L)), b - max(a, L)) for a, b in ranges]

    def _view_plan(self, ranges: list[tuple[int, int]], h0: int, hin: int) -> ViewPlan:
        """Cached sources of the view of slot `ranges`, heads `[h0, h0 + hin)`."""
        return self._io.view_plan(self._index, self._view_spans(ranges), h0, hin)

    def _build_view(self, plan: ViewPlan, h0: int, hin: int, out: torch.Tensor) -> None:
        """Fill `out` `[2, B, T, Hin, D]` from `plan`."""
        self._io.build_view(plan, h0, hin, out)

    def _zero_tokens(self, entry: RangeEntry[Segment], lo: int, hi: int) -> None:
        """Every head of global tokens `[lo, hi)` of a dense segment := 0."""
        self._io.fill_tokens(entry, lo, hi)

    def _new_dense_segment(self, tokens: int) -> Segment:
        return Segment(self.pool.alloc(self.layout.pages_for_tokens(tokens), self.owner))

    def _packed_net_pages(self, entry: RangeEntry[Segment]) -> int:
        """Pages a dense segment gives back when packed (negative: packing needs more)."""
        assert self._packed is not None
        return len(entry.value.pages) - self._packed.pages_for_tokens(entry.end - entry.start)

    def _pack(self, entry: RangeEntry[Segment]) -> bool:
        """Replace a dense segment by its PRQ-packed form (its dense pages go back to the pool). False (and the
        segment stays dense, unchanged) when it holds non-finite values, the pool cannot hold the packed rows, or
        quantizing fails otherwise (`PackingFailedWarning`; retried at the next advance). Everything that can fail
        happens before the first page changes hands."""
        store = self._packed
        assert store is not None and not entry.value.packed
        if self._packed_net_pages(entry) + self.pool.num_free_pages < 0:
            return False
        try:
            quantized = store.quantize(self._io.read_dense(entry))
        except ValueError as exc:
            self.pack_skipped += 1
            entry.value.pack_failed = True
            warnings.warn(f"{self.debug_name}: chunk [{entry.start}, {entry.end}) stays unpacked: {exc}", stacklevel=4)
            return False
        except Exception as exc:  # e.g. torch.OutOfMemoryError: this call's write must still happen
            self.pack_skipped += 1
            warnings.warn(
                PackingFailedWarning(
                    f"{self.debug_name}: packing chunk [{entry.start}, {entry.end}) failed ({type(exc).__name__}: "
                    f"{exc}); it stays bf16 and the policy retries at the next advance"
                ),
                stacklevel=4,
            )
            return False
        self._store_packed(entry, quantized)
        return True

    def _store_packed(self, entry: RangeEntry[Segment], quantized: QuantizedChunk) -> None:
        """Swap a dense segment's pages for packed pages holding `quantized` (from `PackedStore.quantize`)."""
        store = self._packed
        assert store is not None
        n = entry.end - entry.start
        self.pool.free(entry.value.pages, self.owner)
        pages = self.pool.alloc(store.pages_for_tokens(n), self.owner)
        n_tok = store.token_pages(n)
        store.write(pages[:n_tok], pages[n_tok:], quantized)
        entry.value = Segment(pages, None, SegmentKind.PACKED, n_tok)

    def _unpack(self, entry: RangeEntry[Segment], dense: torch.Tensor) -> None:
        """Turn a packed segment back into dense rows holding `dense` (from `PageIO.dequantize_segment`); the policy
        repacks it later."""
        n = entry.end - entry.start
        self.pool.free(entry.value.pages, self.owner)
        entry.value = self._new_dense_segment(n)
        entry.value.lossy = True
        self._io.store_dense(entry, dense)

    def _sink_segment_starts(self) -> set[int]:
        """Segments holding sink slots `[0, E)` or the pinned slots: they follow the sink policy."""
        ranges = self._map.to_global(0, min(self.effective_sink_tokens(), self._L))
        if self._P >= 0 and self._PL > 0:
            ranges += self._map.to_global(self._P, min(self._P + self._PL, self._L))
        return {e.start for g0, g1 in ranges for e in self._index.overlapping(g0, g1)}

    def _apply_pack_policy(self, keep_start: int, keep_end: int) -> None:
        """After an advance: pack completed non-sink chunks older than `keep_recent_chunks`, and (with `sink`) sink
        chunks past `sink_keep_chunks`. The current chunk and segments overlapping `[keep_start, keep_end)` (this
        call's write) stay dense."""
        cfg = self.quant
        assert cfg is not None
        entries = list(self._index)
        current = entries[-1] if entries else None
        sinks = self._sink_segment_starts()
        sink_entries = [e for e in entries if e.start in sinks and e is not current]
        others = [e for e in entries if e.start not in sinks and e is not current]
        targets = others[: max(0, len(others) - cfg.keep_recent_chunks)]
        if cfg.sink:
            targets += sink_entries[cfg.sink_keep_chunks :]
        changed = False
        for entry in targets:
            if entry.value.packed or entry.value.pack_failed or (entry.start < keep_end and keep_start < entry.end):
                continue
            changed |= self._pack(entry)
        if changed:
            self._structure_changed()

    def _pressure_plan(self, deficit: int, plan: _WritePlan, s: int, e: int) -> list[tuple]:
        """Dense chunks to pack early so that `deficit` more pages become free, oldest first (non-sink before
        sink), each already quantized (`(entry, QuantizedChunk)`; nothing changes here); empty if even
        packing all of them would not be enough."""
        excluded = {x.start for x in plan.free_entries} | {x.start for x in plan.unpack_entries}
        sinks = self._sink_segment_starts()
        candidates = [
            x for x in self._index if not x.value.packed and x.start not in excluded and not (x.start < e and s < x.end)
        ]
        candidates.sort(key=lambda x: x.start in sinks)
        assert self._packed is not None
        chosen: list[tuple] = []
        for entry in candidates:
            if deficit <= 0:
                break
            gain = self._packed_net_pages(entry)
            if gain <= 0 or entry.value.pack_failed:
                continue
            try:
                quantized = self._packed.quantize(self._io.read_dense(entry))
            except ValueError:  # non-finite values: this chunk cannot be packed
                continue
            chosen.append((entry, quantized))
            deficit -= gain
        return chosen if deficit <= 0 else []

    def _report_used(self) -> None:
        """Tell the pool how many bytes of our pages hold retained rows (the rest is waste)."""
        self.pool.set_used_bytes(self.owner, self.memory_breakdown()["used_bytes"])

    def memory_breakdown(self) -> dict[str, int]:
        """Exact bytes: pages held by dense and packed segments, tokens retained in each, and the bytes those
        retained rows (plus codebooks) occupy. O(segments x runs)."""
        live = self._map.global_ranges()
        out = {"dense_pages": 0, "packed_pages": 0, "dense_tokens": 0, "packed_tokens": 0, "used_bytes": 0}
        for entry in self._index:
            seg = entry.value
            tokens = sum(max(0, min(g1, entry.end) - max(g0, entry.start)) for g0, g1 in live)
            if seg.packed:
                assert self._packed is not None
                out["packed_pages"] += len(seg.pages)
                out["packed_tokens"] += tokens
                out["used_bytes"] += self._packed.layout.used_bytes_for_tokens(tokens)
            else:
                out["dense_pages"] += len(seg.pages)
                out["dense_tokens"] += tokens
                out["used_bytes"] += self.layout.used_bytes_for_tokens(tokens)
        out["dense_bytes"] = out["dense_pages"] * self.pool.page_bytes
        out["packed_bytes"] = out["packed_pages"] * self.pool.page_bytes
        return out

    def _sync_cursors(self) -> None:
        if self._use_int:
            self.global_end_index_int, self.local_end_index_int = self._G, self._L
        else:
            self._g_tensor.fill_(self._G)
            self._l_tensor.fill_(self._L)

    # ------------------------------------------------------------ the call
    @torch.no_grad()
    def update_and_get_attention_kv(
        self,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str | None = None,
    ) -> CausalAttentionKVView:
        """Write one chunk's K/V at its global token positions and return what attention sees (docs/SEMANTICS.md).

        Args:
            key, value: `[batch, tokens, heads, head_dim]` tensors of the cache dtype on its device; `heads` is
                `num_heads`, or fewer with `cache_head_start`.
            current_chunk_start: the global position (in tokens) of the chunk's first token. A chunk that ends
                past the tokens produced so far is an advance: it appends the new tokens (rolling the window, or
                growing it, when full). A chunk inside the produced range rewrites those tokens in place (a later
                denoise step or the clean pass): nothing rolls, nothing is appended, and a repeated identical call
                reuses the cached plan of the previous one (no planning, one copy per page piece).
            cache_head_start: the first cache head of `key`'s heads when they are a slice of the cache's (Ulysses
                or tensor parallelism: rank x local heads); only those heads are written and viewed. Required when
                `key` has fewer heads than the cache; the other heads of newly appended tokens read as zeros.
            recent_window_tokens: None: the view is the attention window (with the sink and a pinned chunk
                prepended once the window moved past them). An int >= 0: the sink, a pinned chunk, at most this
                many tokens before the chunk, and the chunk itself (0: sink and chunk only).
            debug_name: a label for this call's error messages (e.g. SGLang's block name); default: `name`.

        Returns:
            `CausalAttentionKVView(k, v, local_start_index, local_end_index, visible_local_end,
            visible_global_end)`: `k`, `v` are `[batch, view tokens, heads written, head_dim]`; the indices are the
            chunk's slots, the slots filled and the tokens produced after the call.

        Raises (before anything changes; cache and pool stay exactly as they were):
            SequencingError: a gap (the chunk starts after the tokens produced) or a rewrite of tokens no longer in
                the window; the message lists the valid starts.
            CacheConfigError: an advance that would roll onto the sink (the chunk is longer than cache_size minus
                the sink).
            PoolExhaustedError: the pool cannot hold the new tokens.
            ValueError, TypeError: bad shapes, dtype, device, heads or negative numbers (naming the values).
        """
        if debug_name is None or debug_name == self.debug_name:
            return self._update(key, value, current_chunk_start, cache_head_start, recent_window_tokens)
        own = self.debug_name
        self.debug_name = f"{debug_name} ({own})"  # every error of this call names the caller's label
        try:
            return self._update(key, value, current_chunk_start, cache_head_start, recent_window_tokens)
        finally:
            self.debug_name = own

    def _update(self, key, value, current_chunk_start, cache_head_start, recent_window_tokens):
        self._ensure_open("update_and_get_attention_kv")
        n, hin, h0 = self._check_kv(key, value, cache_head_start)
        s = _as_index("current_chunk_start", current_chunk_start, self.debug_name)
        r = None
        if recent_window_tokens is not None:
            r = _as_index("recent_window_tokens", recent_window_tokens, self.debug_name)
            if r < 0:
                raise ValueError(f"{self.debug_name}: recent_window_tokens={r} is negative (valid: None or >= 0)")
        fast_key = ("call", s, n, h0, hin, r)
        fast = self._io.cached(fast_key)
        if fast is not None:  # the same in-place rewrite as before (a later denoise step): plans are all cached
            ls, le, write_plan, ranges, view_plan = fast  # type: ignore[misc]
            self._io.write(write_plan, h0, key, value)
            self._last_view_ranges = ranges
            return self._finish_view(view_plan, h0, hin, ls, le)
        plan = self._plan(s, n)
        e = s + n
        pool = self.pool
        touched: list[RangeEntry[Segment]] = []
        if self._packed is not None:
            touched = self._index.overlapping(s, min(e, self._G))
            plan.unpack_entries = [x for x in touched if x.value.packed]
        if plan.new_tokens or plan.unpack_entries:
            need = self.layout.pages_for_tokens(plan.new_tokens) if plan.new_tokens else 0
            need += sum(self.layout.pages_for_tokens(x.end - x.start) - len(x.value.pages) for x in plan.unpack_entries)
            freed = sum(len(x.value.pages) for x in plan.free_entries)
            deficit = need - (pool.num_free_pages + freed)
            if deficit > 0 and self._packed is not None and self.pack_under_pressure:
                plan.pressure_entries = self._pressure_plan(deficit, plan, s, e)
            if deficit > 0 and not plan.pressure_entries:
                what = f"appending {plan.new_tokens} tokens at {self._G}" if plan.new_tokens else ""
                if plan.unpack_entries:
                    chunks = ", ".join(f"[{x.start}, {x.end})" for x in plan.unpack_entries)
                    what += ("; " if what else "") + f"unpacking packed chunk(s) {chunks} for the rewrite at {s}"
                hint = ""
                if self._packed is not None and not self.pack_under_pressure:
                    hint = "; pack_under_pressure=True would pack this layer's bf16 chunks early"
                raise pool.exhausted_error(
                    need,
                    f"{self.debug_name}: {what} ({freed} pages freed by this call's eviction count as free{hint})",
                )
            # Everything that can fail (quantize, dequantize: temporaries) is done; from here on nothing raises.
            # Unpacks that give pages back (packed form bigger than dense, e.g. tiny chunks) go first, so the
            # pages counted in `need` are free when each later unpack takes its own.
            order = sorted(
                plan.unpack_entries, key=lambda x: self.layout.pages_for_tokens(x.end - x.start) - len(x.value.pages)
            )
            unpacked = [(x, self._io.dequantize_segment(x)) for x in order]
            self._structure_changed()
            for x, quantized in plan.pressure_entries:
                self._store_packed(x, quantized)
            for x in plan.free_entries:
                self._index.remove(x)
                pool.free(x.value.pages, self.owner)
            for x, dense in unpacked:
                self._unpack(x, dense)
            if plan.new_tokens:
                self._index.insert(self._G, plan.global_end, self._new_dense_segment(plan.new_tokens))
            self._C, self._W = plan.cache_size, plan.window
            self._G, self._L, self._P, self._map = plan.global_end, plan.local_end, plan.pin_start, plan.slot_map
            self._structure_changed()
            if plan.new_tokens and self._packed is not None:
                self._apply_pack_policy(s, e)
            self._report_used()
            self._sync_cursors()
            if plan.new_tokens and hin != self._num_heads:
                # Heads this call does not write read as zeros (the dense cache would show stale rolled data).
                first_new = self._G - plan.new_tokens
                entry = self._index.find(first_new)
                assert entry is not None
                self._zero_tokens(entry, first_new, self._G)

        for x in touched:
            x.value.pack_failed = False  # new values: the policy may try again
            if s <= x.start and x.end <= e and hin == self._num_heads:
                x.value.lossy = False  # every row rewritten: exact values again
        write_plan: WritePlan = self._io.write_plan(self._index, s, e, h0, hin)
        self._io.write(write_plan, h0, key, value)

        ranges = view_slot_ranges(
            local_end=self._L,
            window=self._W,
            sink=self.effective_sink_tokens(),
            global_sink_tokens=self._global_sink,
            pin_start=self._P,
            pin_len=self._PL,
            local_start=plan.ls,
            recent_window_tokens=r,
        )
        self._last_view_ranges = ranges
        view_plan = self._view_plan(ranges, h0, hin)
        if not plan.new_tokens and not plan.unpack_entries:
            self._io.remember(fast_key, (plan.ls, plan.le, write_plan, ranges, view_plan))
        return self._finish_view(view_plan, h0, hin, plan.ls, plan.le)

    def _finish_view(self, view_plan: ViewPlan, h0: int, hin: int, ls: int, le: int):
        tokens = view_plan.tokens
        shape = (2, self.batch_size, tokens, hin, self.head_dim)
        if self.reuse_view_buffer:
            out = self.pool.view_buffer(2 * self.batch_size * tokens * hin * self.head_dim, self.dtype).view(shape)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._build_view(view_plan, h0, hin, out)
        return self._view_cls(out[0], out[1], ls, le, self._L, self._G)

    # ------------------------------------------------------------ other calls
    def pin_current_chunk(self, num_tokens: int) -> None:
        """Pin the last `num_tokens` filled slots as the sink (a scene cut, called after the chunk's clean pass): the
        pinned chunk starts `num_tokens` slots before the local end and is min(sink_tokens, num_tokens) long. No
        data moves. `num_tokens <= 0` or `sink_tokens == 0` unpins."""
        self._ensure_open("pin_current_chunk")
        n = _as_index("num_tokens", num_tokens, self.debug_name)
        if self._sink <= 0 or n <= 0:
            self._P, self._PL = -1, 0
        else:
            self._P, self._PL = self._L - n, min(self._sink, n)
        self._structure_changed()

    def reset_indices(self) -> None:
        """Empty the cache (a grown cache_size stays) and give every page back to the pool."""
        self._ensure_open("reset_indices")
        self._release_all()
        self._G = self._L = 0
        self._P, self._PL = -1, 0
        self._map = SlotMap()
        self._structure_changed()
        if self._use_int:
            self.global_end_index_int = self.local_end_index_int = 0
        else:
            self._g_tensor.zero_()
            self._l_tensor.zero_()

    def _release_all(self) -> None:
        for entry in self._index.clear():
            self.pool.free(entry.value.pages, self.owner)
        self.pool.set_used_bytes(self.owner, 0)

    def rewind_to(self, pos: int) -> None:
        """Drop every token at global position `pos` and later, so the next append starts at `pos` (no dense
        equivalent); their pages go back to the pool, and a pin at or after the new local end is cleared.

        Valid for `pos` equal to the tokens produced, for `pos` whose later tokens all sit in the rolling tail
        (after the sink slots), and for `pos` inside the sink while no roll has happened. Otherwise SequencingError
        naming the reachable positions (evicted history cannot return).
        """
        self._ensure_open("rewind_to")
        pos = _as_index("pos", pos, self.debug_name)
        G, L = self._G, self._L
        E = self.effective_sink_tokens()
        floor = self._map.tail_start(self._G) if G == L else max(self._map.tail_start(self._G), E)
        floor_g = G - (L - floor) if floor <= L else G
        if pos < 0:
            raise SequencingError(f"{self.debug_name}: rewind_to({pos}): position is negative (valid: {floor_g}..{G})")
        if pos > G:
            raise SequencingError(
                f"{self.debug_name}: rewind_to({pos}) is past the global end {G}; valid positions: {floor_g}..{G}"
            )
        if pos == G:
            return
        new_l = L - (G - pos)
        if new_l < floor:
            raise SequencingError(
                f"{self.debug_name}: rewind_to({pos}): tokens [{pos}, {floor_g}) are no longer in the rolling tail "
                f"(global end {G}, effective sink E={E}, current chunk starts at {self._current_chunk_start()}); "
                f"reachable positions: {floor_g}..{G}"
            )
        removed, straddler = self._index.truncate(pos)
        for entry in removed:
            self.pool.free(entry.value.pages, self.owner)
        new_map = self._map.truncated(new_l)
        if straddler is not None and not new_map.holds_any(straddler.start, straddler.end):
            # Its remaining tokens were evicted earlier: nothing of it is in a slot any more.
            self._index.remove(straddler)
            self.pool.free(straddler.value.pages, self.owner)
            straddler = None
        if straddler is not None:
            seg = straddler.value
            tokens = straddler.end - straddler.start
            if seg.packed:  # a truncated packed segment keeps its codebooks
                assert self._packed is not None
                keep = self._packed.token_pages(tokens)
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
        self._G, self._L = pos, new_l
        self._map = new_map
        if new_l < self._P + self._PL:
            self._P, self._PL = -1, 0
        self._structure_changed()
        self._report_used()
        self._sync_cursors()

    def close(self) -> None:
        """Give every page back; afterwards every call raises CacheClosedError. Idempotent."""
        if self._closed:
            return
        self._release_all()
        self._map = SlotMap()
        self._structure_changed()
        self._closed = True


def _release_owner(pool: BlockPool, owner: str) -> None:
    if pool.pages_of(owner):
        pool.release_owner(owner)


def make_layer_caches(num_layers: int, *, pool: BlockPool, **kwargs) -> list[PagedCausalKVCache]:
    """`num_layers` caches named `layer0`, `layer1`, ... (pool owners `layer0#k`, ...) sharing `pool`; kwargs as
    PagedCausalKVCache's."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise CacheConfigError(f"num_layers must be an int >= 1, got {num_layers!r}")
    for shared in ("global_end_index", "local_end_index", "name"):
        if kwargs.get(shared) is not None:
            raise CacheConfigError(
                f"make_layer_caches: {shared} would be shared by every layer; build caches one by one"
            )
    kwargs.pop("name", None)
    return [PagedCausalKVCache(pool=pool, name=f"layer{i}", **kwargs) for i in range(num_layers)]
