"""The per-layer paged causal KV cache: the dense cache's contract (docs/SEMANTICS.md) over pool pages.

Data path: pool pages ← range index (global token ranges → segments) ← slot map (slots → global tokens) ← the
sequencing core (sequencing.py: roll, pin, rewind, view ranges) → this cache (commits plans to pages) →
cache_packing.py (`ChunkPacker`: memory pressure, the pack policy of policy.py, packing and unpacking) and
page_io.py (writes and view builds) → `CausalAttentionKVView`.

Every call is planned completely (new slot map, cursors, segments to free, pages to take) before anything changes,
so every error leaves the cache and the pool exactly as they were.
"""

from __future__ import annotations

import functools
import weakref

import torch

from pagedqvg.allocator import BlockPool, RangeEntry
from pagedqvg.attention.pages import attend_pages, check_query
from pagedqvg.cache.args import (
    RepeatedCall,
    check_device,
    check_kv,
    check_quant,
    cursor_tensors,
    dense_layout,
    layer_stores,
    recent_window,
    removed_keywords_error,
)
from pagedqvg.cache.fork import fork_cache, unshare_rows
from pagedqvg.cache.head_groups import update_and_attend_heads
from pagedqvg.cache.packing import ChunkPacker
from pagedqvg.cache.readout import CacheReadout, readout_method, readout_property
from pagedqvg.cache.sequencing import CacheSpec, CallPlan, Sequencer
from pagedqvg.cache.transaction import CallTransaction, holding_pool_lock
from pagedqvg.errors import CacheClosedError, CacheConfigError
from pagedqvg.quant import QuantConfig
from pagedqvg.store.page_io import PageIO, ViewPlan
from pagedqvg.store.segment import Segment
from pagedqvg.validation import SUPPORTED_DTYPES, as_index, check_int
from pagedqvg.view import CausalAttentionKVView

__all__ = ["PagedCausalKVCache", "make_layer_caches"]


_VIEW_CALL = "update_and_get_attention_kv"


def _session_call(method):
    """A call of a cache whose `_tier` is set (a session of a SessionManager with a host tier, serving/sessions.py)
    runs inside `_tier.call(cache)`: back from host memory first if swapped out, busy (never swapped) while it
    runs, its session's last use renewed. O(1) more per call."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._tier is None:
            return method(self, *args, **kwargs)
        with self._tier.call(self):
            return method(self, *args, **kwargs)

    return call


def _ensure_open(self, what: str) -> None:
    """`PagedCausalKVCache._ensure_open`: a parked cache of a session (swapped out to a host tier) comes back first
    (SessionRefusedError if it cannot); CacheClosedError after `close()` or while parked outside a session."""
    if isinstance(self._closed, str) and self._tier is not None:
        self._tier.resume(self)
    if self._closed:  # True, or a str: why it is out of service (serving/host_tier.py's swap-out)
        why = "after close(); its pages are back in the pool — make a new cache"
        raise CacheClosedError(f"{self.debug_name}: {what} " + (self._closed if self._closed is not True else why))


class PagedCausalKVCache:
    """One layer's causal K/V cache whose bytes live in pages of a shared `BlockPool`.

    The contract of SGLang's dense `CausalSelfAttentionKVCache` (written out in docs/SEMANTICS.md): a window of
    `cache_size` slots over the tokens produced so far, a sink at its front that never rolls, and a view per call.
    With quantization off every view equals the dense cache's bit for bit. A repeated call (a denoise step
    rewriting the current chunk) reuses its cached plan: one `page_write` for the write and one `view_build` /
    `view_runs` call for the view (the kernels' torch references on CPU, Triton launches on CUDA). An advance also
    runs the eviction and pack policy (O(segments x runs)). For SGLang's own constructor signatures use
    `pagedqvg.integrations.sglang`.

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
        global_end_index, local_end_index: 1-element int64 tensors (at 0), two different ones (default: new).
        quant: a `QuantConfig` to pack completed chunks with PRQ (2 or 4 bits); None or bits=None: exact bf16.
        name: this layer's label (the pool owner's prefix, the first word of every error; default "layer").
        reuse_view_buffer: build every view into one per-pool scratch buffer instead of a fresh tensor (a repeated
            call of a view of dense rows then allocates nothing; without it exactly its view); such a view is valid
            only until the next call on any cache of the pool (default False).
        pack_under_pressure: with quantization, when an advance does not fit the pool, pack this layer's bf16
            chunks early (oldest first) if that frees enough pages, instead of raising PoolExhaustedError
            (default False).

    Attributes:
        pool, batch_size, head_dim, dtype, device (the pool's), quant, reuse_view_buffer, pack_under_pressure: as given.
        debug_name: `name`; owner: this layer's owner id in the pool.
        layout: the page layout of bf16 rows (`pagedqvg.layout.segments.DenseTokenLayout`).
        pack_skipped: chunks the pack policy left unpacked (non-finite values, or packing failed).
        global_end_index_int, local_end_index_int: the host cursors (None unless `use_int_indices`): tokens
            produced so far, and slots filled.

    Raises:
        CacheConfigError: a bad argument (naming it and the valid values); nothing is allocated.
    """

    # ------------------------------------------------------------ extension points (for subclasses)
    # A subclass (pagedqvg.integrations.sglang) overrides only the hooks and attributes of this section and calls
    # only its helpers (plus the public API); every other underscore name is private and may change.

    #: Attribute: the class of returned views (fields in `CausalAttentionKVView`'s order).
    _view_cls: type = CausalAttentionKVView
    #: Attribute: `(K, V)` value of rows no call wrote (heads a head-sliced advance did not write, adopted slots).
    _unwritten_fill: tuple[float, float] = (0.0, 0.0)
    _tier = None  # set by a SessionManager with a host tier: `call(cache)` and `resume(cache)`; `_session_call`

    def _before_call(self, what: str) -> None:
        """Hook: runs first in `update_and_get_attention_kv`, `pin_current_chunk` and `_read_slots` (`what` names
        the call), before the closed check; raise to refuse the call (nothing has changed). Default: nothing."""

    def _on_cursors_changed(self, global_end: int, local_end: int) -> None:
        """Hook: the cursors moved (an advance or a rewind; not `reset_indices`): publish them. Default: the host
        ints with `use_int_indices`, else the cursor tensors (one `fill_` each)."""
        if self._use_int:
            self.global_end_index_int, self.local_end_index_int = global_end, local_end
        else:
            self._g_tensor.fill_(global_end)
            self._l_tensor.fill_(local_end)

    def _set_spec(self, **changes: object) -> None:
        """Helper: set `sink_tokens`, `window` or `allow_growth` (checked by the caller) from the next call on."""
        self._seq.spec = self._seq.spec.with_(**changes)
        self._structure_changed()

    def _unpin(self, what: str) -> None:
        """Helper: clear the pin (no data moves); CacheClosedError (naming `what`) after `close()`."""
        self._ensure_open(what)
        self._seq.unpin()
        self._structure_changed()

    def _read_slots(self, what: str) -> torch.Tensor:
        """Helper: a new `[2, B, L, H, D]` tensor of every head of the filled slots `[0, L)`. Runs
        `_before_call(what)` and the closed check first; the last view's record stays. O(L) copies."""
        self._before_call(what)
        self._ensure_open(what)
        B, H, D = self.batch_size, self._num_heads, self.head_dim
        num_slots = self._seq.state.local_end
        if num_slots == 0:
            return torch.empty(2, B, 0, H, D, dtype=self.dtype, device=self.device)
        plan = self._io.view_plan(self._seq.index, self._readout.view_spans([(0, num_slots)]), 0, H)
        out = torch.empty(2, B, plan.tokens, H, D, dtype=self.dtype, device=self.device)
        self._io.build_view(plan, 0, H, out)
        return out

    @holding_pool_lock
    def _adopt(self, global_end: int, local_end: int, pin_start: int, pin_len: int) -> None:
        """Helper: start an empty cache at cursors `(global_end, local_end)` (checked by the caller: 0 <= local_end
        <= min(global_end, cache_size), pin inside `[0, local_end)`): slots `[0, local_end)` hold tokens `[global_end
        - local_end, global_end)`, never written (`_unwritten_fill`), in pool pages like any chunk. The cursor forms
        are the caller's. PoolExhaustedError (nothing changed) if they do not fit."""
        seg = Segment(self.pool.alloc(self.layout.pages_for_tokens(local_end), self.owner)) if local_end else None
        self._seq.adopt(global_end, local_end, pin_start, pin_len, seg)
        if local_end:
            entry = self._seq.index.find(global_end - local_end)
            assert entry is not None
            self._zero_tokens(entry, global_end - local_end, global_end)
        self._structure_changed()
        self._packer.report_used()

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
        self.batch_size = check_int("batch_size", batch_size, minimum=1, error=CacheConfigError)
        spec = CacheSpec.create(
            cache_size=cache_size,
            attention_window_size=attention_window_size,
            sink_tokens=sink_tokens,
            global_sink_tokens=global_sink_tokens,
            allow_growth=allow_growth,
        )
        self._num_heads = check_int("num_heads", num_heads, minimum=1, error=CacheConfigError)
        self.head_dim = check_int("head_dim", head_dim, minimum=1, error=CacheConfigError)
        if dtype not in SUPPORTED_DTYPES:
            raise CacheConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        check_device(device, pool)
        check_quant(quant, self.head_dim)
        self.pool = pool
        self.device = pool.device
        self.dtype = dtype
        self.quant = quant
        self.debug_name = name
        self.owner = pool.new_owner(name)
        self.reuse_view_buffer = bool(reuse_view_buffer)
        self.layout = dense_layout(pool, self.batch_size, self._num_heads, self.head_dim, dtype)
        self._packed, stores = layer_stores(pool, self.layout, quant)  # the history's store; every tier format's
        # The token rows of this layer in the pool, every move of them, and the cached write/view plans.
        self._io = PageIO(pool, self.layout, self._packed, stores)
        # Geometry, cursors, pin, slot map and segments: every sequencing rule lives in the core.
        self._seq: Sequencer[Segment] = Sequencer(spec)
        # Memory pressure and packing (the pack policy, packing and unpacking segments).
        self._packer = ChunkPacker(
            pool=pool, owner=self.owner, layout=self.layout, io=self._io, seq=self._seq, store=self._packed,
            quant=quant if self._packed is not None else None, pack_under_pressure=pack_under_pressure, stores=stores,
        )
        self._g_tensor, self._l_tensor = cursor_tensors(global_end_index, local_end_index, self.device)
        # Every read-only figure (geometry, cursors, pin, segments, memory, the last view's sources): answered here.
        self._readout = CacheReadout(pool=pool, owner=self.owner, seq=self._seq, packer=self._packer, io=self._io,
                                     num_heads=self._num_heads, cursors=(self._g_tensor, self._l_tensor))  # fmt: skip
        self._use_int = bool(use_int_indices)
        self._closed = False
        # A call that raises has not happened: the pool's transaction around the sequencer's saved state.
        self._txn = CallTransaction(pool=pool, owner=self.owner, seq=self._seq)
        # A cache collected without close() still gives its pages back.
        self._finalizer = weakref.finalize(self, _release_owner, pool, self.owner)
        self.global_end_index_int: int | None = 0 if self._use_int else None
        self.local_end_index_int: int | None = 0 if self._use_int else None

    # ------------------------------------------------------------ read-only state (readout.CacheReadout)
    pack_under_pressure = readout_property("_readout", "pack_under_pressure", settable=True)
    pack_skipped = readout_property("_readout", "pack_skipped")
    num_cache_heads = readout_property("_readout", "num_cache_heads")
    cache_size = readout_property("_readout", "cache_size")
    attention_window_size = readout_property("_readout", "attention_window_size")
    sink_tokens = readout_property("_readout", "sink_tokens")
    global_sink_tokens = readout_property("_readout", "global_sink_tokens")
    allow_growth = readout_property("_readout", "allow_growth")
    pinned_range = readout_property("_readout", "pinned_range")
    effective_sink_tokens = readout_method("_readout", "effective_sink_tokens")
    can_direct_current_attention = readout_method("_readout", "can_direct_current_attention")
    resident_nbytes = readout_method("_readout", "resident_nbytes")
    retained_token_ranges = readout_method("_readout", "retained_token_ranges")
    segments = readout_method("_readout", "segments")
    memory_breakdown = readout_method("_readout", "memory_breakdown")
    last_view_sources = readout_method("_readout", "last_view_sources")
    global_end_index = readout_property("_readout", "global_end_index")
    local_end_index = readout_property("_readout", "local_end_index")

    @property
    def closed(self) -> bool:
        """True after `close()`: the pages are back in the pool and every call raises CacheClosedError (a session
        swapped out to a host pool is not closed: its calls raise CacheClosedError naming the swap until swap_in)."""
        return self._closed is True

    def __repr__(self) -> str:
        return self._readout.describe(self.debug_name)

    # ------------------------------------------------------------ checks
    _ensure_open = _ensure_open  # CacheClosedError after close(); a swapped-out session's cache comes back first

    # ------------------------------------------------------------ pages and views (page_io.PageIO)
    def _structure_changed(self) -> None:
        """Pages, segments, slots or the pin changed: every cached plan is stale."""
        self._io.invalidate()
        self._readout.last_view_ranges = []

    def _zero_tokens(self, entry: RangeEntry[Segment], lo: int, hi: int) -> None:
        """Every head of global tokens `[lo, hi)` of a dense segment := `_unwritten_fill` (K, V)."""
        kf, vf = self._unwritten_fill
        self._io.fill_tokens(entry, lo, hi, kf, vf)

    # ------------------------------------------------------------ the call
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
                reuses the cached plan of the previous one (no planning, one write and one view call).
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
        own, grad = self.debug_name, torch.is_grad_enabled()
        if debug_name is not None and debug_name != own:
            self.debug_name = f"{debug_name} ({own})"  # every error of this call names the caller's label
        torch.set_grad_enabled(False)  # writes into the pool must not join an autograd graph
        try:
            return self._update(key, value, current_chunk_start, cache_head_start, recent_window_tokens)
        finally:
            self.debug_name = own
            torch.set_grad_enabled(grad)

    @torch.no_grad()
    def update_and_attend(
        self,
        query: torch.Tensor,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        softmax_scale: float | None = None,
        debug_name: str | None = None,
        **removed: object,
    ) -> torch.Tensor:
        """Write one chunk's K/V exactly as `update_and_get_attention_kv` does and return attention over the rows its
        view would hold, without building the view (attention.py: tiles decoded from pages, online softmax in fp32;
        on the Triton backend one launch of kernels/triton_attention.py).

        Args:
            query: `[batch, query tokens, heads, head_dim]`, the cache dtype and device, `key`'s heads.
            softmax_scale: None: `head_dim ** -0.5`; else a finite float. No mask: every query row attends to every
                row of the view; never-written rows are keys of score 0 and value 0 (as SDPA over the view).
            key_noise_correction: removed (measured not to help: docs/NUMBERS.md#key-noise-correction); passing
                it raises TypeError, as does any other unknown keyword.
            The rest: as `update_and_get_attention_kv`.

        Returns:
            `softmax(query·kᵀ·scale)·v`, `[batch, query tokens, heads, head_dim]` in the query's dtype.

        Raises: as `update_and_get_attention_kv`, plus TypeError / ValueError for a bad query or scale; all before
        anything changes. Transient memory: `attention.attention_scratch_bytes` (independent of the window).
        """
        if removed:
            raise removed_keywords_error(removed)
        own = self.debug_name
        if debug_name is not None and debug_name != own:
            self.debug_name = f"{debug_name} ({own})"  # every error of this call names the caller's label
        try:
            what = "update_and_attend"
            self._before_call(what)
            self._ensure_open(what)
            shape = (self.batch_size, self._num_heads, self.head_dim)
            check_kv(self.debug_name, key, value, cache_head_start, shape, self.dtype, self.device)
            scale = check_query(query, key, softmax_scale, self.debug_name)

            def write_and_attend():
                plan, h0, _, _, _ = self._write_and_plan(
                    key, value, current_chunk_start, cache_head_start, recent_window_tokens, what
                )
                return attend_pages(self._io, plan, h0, query, scale)

            return self._transactional(write_and_attend)
        finally:
            self.debug_name = own

    #: Attention mode `heads` (cache/head_groups.py): the write, then attention by head groups of the view.
    update_and_attend_heads = update_and_attend_heads

    def _update(self, key, value, current_chunk_start, cache_head_start, recent_window_tokens):
        return self._transactional(
            lambda: self._finish_view(
                *self._write_and_plan(key, value, current_chunk_start, cache_head_start, recent_window_tokens)
            )
        )

    def _write_and_plan(
        self, key, value, current_chunk_start, cache_head_start, recent_window_tokens, what: str = _VIEW_CALL
    ):
        """The write of one call (`what`) and the plan of its view: `(view plan, h0, hin, local start, local end)`."""
        self._before_call(what)
        self._ensure_open(what)
        name = self.debug_name
        shape = (self.batch_size, self._num_heads, self.head_dim)
        n, hin, h0 = check_kv(name, key, value, cache_head_start, shape, self.dtype, self.device)
        s = as_index("current_chunk_start", current_chunk_start, name)
        r = recent_window(name, recent_window_tokens)
        fast_key = ("call", s, n, h0, hin, r)
        fast = self._io.cached(fast_key)
        if isinstance(fast, RepeatedCall) and not unshare_rows(self, s, s + n):  # the same in-place rewrite again
            self._io.write(fast.write_plan, h0, key, value)
            self._readout.last_view_ranges = fast.ranges
            return fast.view_plan, h0, hin, fast.local_start, fast.local_end
        plan = self._seq.plan_write(s, n, self.debug_name)
        touched: list[RangeEntry[Segment]] = []
        if self._packed is not None:
            touched = self._seq.index.overlapping(s, min(plan.end, self._seq.state.global_end))
        unpack = [x for x in touched if x.value.packed]
        structural = bool(plan.new_tokens or unpack)
        if structural:  # the caller's `_transactional` ends or rolls back the transaction that starts here
            self._begin_transaction()
            self._commit(plan, unpack, hin)
            self._rewritten(touched, s, plan.end, hin)
        unshare_rows(self, s, plan.end)  # copy-on-write of pages a fork shares (cache/fork.py)
        write_plan = self._io.write_plan(self._seq.index, s, plan.end, h0, hin)
        self._io.write(write_plan, h0, key, value)
        if not structural:  # a failed in-place write leaves the flags (the targeted rows may be old or new)
            self._rewritten(touched, s, plan.end, hin)
        ranges = self._seq.view_ranges(plan.local_start, r)
        self._readout.last_view_ranges = ranges
        view_plan = self._io.view_plan(self._seq.index, self._readout.view_spans(ranges), h0, hin)
        if not plan.new_tokens and not unpack:
            self._io.remember(fast_key, RepeatedCall(plan.local_start, plan.local_end, write_plan, ranges, view_plan))
        return view_plan, h0, hin, plan.local_start, plan.local_end

    def _rewritten(self, touched: list[RangeEntry[Segment]], s: int, end: int, hin: int) -> None:
        """Flags of the segments a write reached: the policy may pack them again; fully rewritten ones are exact."""
        for x in touched:
            x.value.pack_failed = False  # new values: the policy may try again
            if s <= x.start and x.end <= end and hin == self._num_heads:
                x.value.lossy = False  # every row rewritten: exact values again

    # ------------------------------------------------------------ a call that raises has not happened
    def _transactional(self, run):
        """Helper: `run()` as one call (`CallTransaction.run`): whole, or rolled back if it raises."""
        return self._txn.run(run)

    def _begin_transaction(self) -> None:
        """From here to the end of the running call (`self._txn.run`): the pool's lock held, page moves journaled."""
        self._txn.begin(self._restored)

    def _restored(self) -> None:
        """After a rollback (`CallTransaction`): plans dropped, the pool told the bytes used, cursors republished."""
        self._structure_changed()
        self._packer.report_used()
        self._on_cursors_changed(self._seq.state.global_end, self._seq.state.local_end)

    @holding_pool_lock
    def _commit(self, plan: CallPlan[Segment], unpack: list[RangeEntry[Segment]], hin: int) -> None:
        """Commit `plan` to pages: pressure packs, released segments back to the pool, packed chunks the write
        touches unpacked, the new tokens' segment, then the pack policy. Raises PoolExhaustedError (nothing changed)
        when the pages do not fit."""
        packer = self._packer
        pressure = packer.fit(plan, unpack, self.debug_name)
        # Everything that can fail (quantize, dequantize: temporaries) is done; from here on nothing raises.
        unpacked = packer.dequantize_for_unpack(unpack)
        self._structure_changed()
        for x, quantized in pressure:
            packer.store_packed(x, quantized)
        for x in self._seq.release(plan):
            self.pool.free(x.value.pages, self.owner)
        for x, dense in unpacked:
            packer.unpack(x, dense)
        new = packer.new_dense_segment(plan.new_tokens) if plan.new_tokens else None
        entry = self._seq.commit(plan, new)
        self._structure_changed()
        if entry is not None and packer.apply_policy(plan.start, plan.end, self.debug_name):
            self._structure_changed()
        self._packer.report_used()
        self._on_cursors_changed(self._seq.state.global_end, self._seq.state.local_end)
        if entry is not None and hin != self._num_heads:
            # Heads this call does not write read as zeros (the dense cache would show stale rolled data).
            self._zero_tokens(entry, entry.start, entry.end)

    def _finish_view(self, view_plan: ViewPlan, h0: int, hin: int, ls: int, le: int):
        tokens = view_plan.tokens
        shape = (2, self.batch_size, tokens, hin, self.head_dim)
        if self.reuse_view_buffer:
            out = self.pool.view_buffer(2 * self.batch_size * tokens * hin * self.head_dim, self.dtype).view(shape)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._io.build_view(view_plan, h0, hin, out)
        st = self._seq.state
        return self._view_cls(out[0], out[1], ls, le, st.local_end, st.global_end)

    # ------------------------------------------------------------ other calls
    def pin_current_chunk(self, num_tokens: int) -> None:
        """Pin the last `num_tokens` filled slots as the sink (a scene cut, called after the chunk's clean pass): the
        pinned chunk starts `num_tokens` slots before the local end and is min(sink_tokens, num_tokens) long. No
        data moves. `num_tokens <= 0` or `sink_tokens == 0` unpins."""
        self._before_call("pin_current_chunk")
        self._ensure_open("pin_current_chunk")
        self._seq.pin(as_index("num_tokens", num_tokens, self.debug_name))
        self._structure_changed()

    @holding_pool_lock
    def reset_indices(self) -> None:
        """Empty the cache (a grown cache_size stays) and give every page back to the pool."""
        self._ensure_open("reset_indices")
        self._packer.release_all()
        self._structure_changed()
        if self._use_int:
            self.global_end_index_int = self.local_end_index_int = 0
        else:
            self._g_tensor.zero_()
            self._l_tensor.zero_()

    @holding_pool_lock
    def rewind_to(self, pos: int) -> None:
        """Drop every token at global position `pos` and later, so the next append starts at `pos` (no dense
        equivalent); their pages go back to the pool, and a pin at or after the new local end is cleared.

        Valid for `pos` equal to the tokens produced, for `pos` whose later tokens all sit in the rolling tail
        (after the sink slots), and for `pos` inside the sink while no roll has happened. Otherwise SequencingError
        naming the reachable positions (evicted history cannot return).
        """
        self._ensure_open("rewind_to")
        plan = self._seq.plan_rewind(as_index("pos", pos, self.debug_name), self.debug_name)
        if plan is None:
            return
        removed, straddler = self._seq.rewind(plan)
        for entry in removed:
            self.pool.free(entry.value.pages, self.owner)
        if straddler is not None:
            self._packer.trim_pages(straddler)
            straddler.value.pack_failed = False  # its non-finite rows may be gone: the policy may try again
        self._structure_changed()
        self._packer.report_used()
        self._on_cursors_changed(self._seq.state.global_end, self._seq.state.local_end)

    fork = fork_cache  # fork(name=None): a copy-on-write branch sharing every page (cache/fork.py)

    @holding_pool_lock
    def close(self) -> None:
        """Give every page back; afterwards every call raises CacheClosedError. Idempotent."""
        if self._closed:
            return
        self._packer.release_all()
        self._structure_changed()
        self._closed = True


#: Every call of a session's cache runs through its `_tier` gate (`_session_call`; subclasses' overrides reach it
#: through `super()`).
for _name in ("_unpin", "_read_slots", "update_and_get_attention_kv", "update_and_attend", "update_and_attend_heads",
              "pin_current_chunk", "reset_indices", "rewind_to", "fork"):  # fmt: skip
    setattr(PagedCausalKVCache, _name, _session_call(getattr(PagedCausalKVCache, _name)))


def _release_owner(pool: BlockPool, owner: str) -> None:
    """The finalizer of a cache collected without close(): garbage collection may run inside another pool
    operation (or on another thread), so the pages are only queued; the pool gives them back at its next
    operation, under its lock."""
    pool.release_owner_later(owner)


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
