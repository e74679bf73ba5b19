"""The page pool: one byte arena per pool, a free stack of page ids, exact accounting.

Every K/V byte of every layer lives in one `torch.uint8` arena of `num_pages * page_bytes` bytes, made once.
Pages are handed out and taken back in O(1) per page; a multi-page request is all-or-nothing. Every page is
either free or held by one or more owners (strings such as ``"layer3#7"``): `share` adds a holder (a forked cache),
`free` drops one, and a page goes back to the free list when its last holder lets go (refcounted pages, as vLLM's
blocks). Nothing here knows about attention.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

import pagedqvg.allocator.sharing as sharing
from pagedqvg.allocator.devices import available_memory_bytes, format_bytes, resolve_device
from pagedqvg.errors import PageOwnershipError, PoolExhaustedError, PoolInvariantError
from pagedqvg.validation import PAGE_ALIGN_BYTES, check_int, is_int, nearest_page_bytes

DEFAULT_PAGE_BYTES = 1 << 20  # 1 MiB
__all__ = ["DEFAULT_PAGE_BYTES", "BlockPool", "PoolStats", "available_memory_bytes", "format_bytes"]


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the pool's accounting. Bytes are exact; `waste_bytes = held_bytes - used_bytes`.

    `used_pages` and `held_bytes` count a shared page once; `owner_pages` and `used_bytes` (each owner's report)
    count it for every holder, so with shared pages `waste_bytes` may be negative: the bytes sharing saves."""

    total_pages: int
    used_pages: int
    free_pages: int
    page_bytes: int
    held_bytes: int  # used_pages * page_bytes
    used_bytes: int  # bytes the owners report they actually use inside their pages
    waste_bytes: int
    high_water_pages: int
    owner_pages: tuple[tuple[str, int], ...]  # sorted by owner name; a shared page counts for each holder
    shared_pages: int = 0  # pages with two or more holders (counted once in used_pages)
    owner_shared_pages: tuple[tuple[str, int], ...] = ()  # per owner: how many of its pages others hold too

    def exclusive_pages(self, owner: str) -> int:
        """Pages only `owner` holds (its pages minus its shared ones). O(owners)."""
        return dict(self.owner_pages).get(owner, 0) - dict(self.owner_shared_pages).get(owner, 0)

    @property
    def high_water_bytes(self) -> int:
        return self.high_water_pages * self.page_bytes


def _check_positive_int(name: str, value: object) -> int:
    return check_int(name, value, minimum=1, message="{name} must be > 0, got {value}")


#: One wording for a count argument of the pool's methods, e.g. 'alloc: n must be an int >= 0, got -1'.
_METHOD_INT = "{name} must be {allowed}, got {value!r}"


def _locked(method):
    """Run a pool method holding the pool's lock, after giving back the pages of owners queued by
    `release_owner_later` (so a finalizer never frees inside another pool operation)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            if self._deferred:
                self._drain_deferred()
            return method(self, *args, **kwargs)

    return wrapper


class BlockPool:
    """A fixed set of equal pages carved from one arena tensor, shared by every layer's cache.

    Args:
        capacity_bytes: bytes of K/V the pool may hold (an int > 0, at least one page). The pool has
            `capacity_bytes // page_bytes` pages; the remainder (< one page) is not allocated.
        page_bytes: bytes per page (an int > 0, a multiple of 256; default 1 MiB). Every page starts on a
            256-byte boundary. `BlockPool.for_layers` picks the size `pagedqvg plan` would for a cache shape.
        device: where the arena lives, `"cpu"`, `"cuda"` or `"cuda:N"` (default `"cpu"`).
        pin_memory: a page-locked host arena (device "cpu" only; needs CUDA): the host tier of a CUDA pool
            (serving/host_tier.py `host_pool_for`) copies to and from it asynchronously (default False).

    The arena (`capacity_bytes // page_bytes * page_bytes` bytes of `uint8`) is allocated once, here; ValueError
    (naming the value and the valid range) for a bad argument, before anything is allocated.

    Threads: every state change and every read of the shared tables holds `lock` (a re-entrant lock). Caches
    hold it across each check-then-act sequence (an advance's page check, frees and allocations; packing), so
    different threads may drive different caches of one pool. One cache is driven by one thread at a time, and
    `view_buffer` (a single scratch buffer) is not for threads: use `reuse_view_buffer=False` with threads.
    Finalizers (caches collected without `close()`) only queue their owner (`release_owner_later`); the pages go
    back at the next pool operation, under the lock.

    Complexity: `alloc(n)` and `free(pages)` are O(n); `stats()` is O(owners); `check()` is O(num_pages).
    """

    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        _check_positive_int("capacity_bytes", capacity_bytes)
        _check_positive_int("page_bytes", page_bytes)
        if page_bytes % PAGE_ALIGN_BYTES:
            raise ValueError(
                f"page_bytes must be a multiple of {PAGE_ALIGN_BYTES} (pages are {PAGE_ALIGN_BYTES}-byte aligned), "
                f"got {page_bytes}; nearest valid: {nearest_page_bytes(page_bytes)}"
            )
        if capacity_bytes < page_bytes:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} is below one page of page_bytes={page_bytes}; "
                f"give at least {page_bytes} bytes or use smaller pages"
            )
        self.device = resolve_device(device)
        if pin_memory is not False and (pin_memory is not True or self.device.type != "cpu"):
            raise ValueError(f"pin_memory=True is for a host arena (device='cpu'), got {pin_memory!r} on {self.device}")
        self.pinned = pin_memory  # page-locked host memory: asynchronous copies to and from CUDA (serving/host_tier.py)
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        total = self.num_pages * page_bytes
        # Over-allocate by one alignment unit so page 0 starts on a 256-byte boundary on any allocator.
        raw = torch.empty(total + PAGE_ALIGN_BYTES, dtype=torch.uint8, device=self.device, pin_memory=pin_memory)
        offset = (-raw.data_ptr()) % PAGE_ALIGN_BYTES
        self.arena: torch.Tensor = raw[offset : offset + total]
        # Free stack: pop() hands out the lowest ids first on a fresh pool.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._owner_of: list[str | None] = [None] * self.num_pages
        self._owner_pages: Counter[str] = Counter()
        self._owner_used: dict[str, int] = {}
        self._high_water = 0
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._owner_serial = 0
        self._view_buffer: torch.Tensor | None = None
        self._view_buffer_last: tuple[int, torch.dtype, torch.Tensor] | None = None
        self._view_buffer_streams: set = set()  # CUDA streams recorded on the buffer (record_stream)
        #: Held by every method that reads or changes the page tables, and by caches across check-then-act calls.
        self.lock = threading.RLock()
        self._deferred: deque[str] = deque()  # owners whose pages go back at the next pool operation
        self._journal: tuple[str, list] | None = None  # (owner, records) while a cache call may still roll back
        # Pages with two or more holders: page -> holders in the order they took it (`_owner_of[p]` is the first).
        self._shared: dict[int, list[str]] = {}
        self._owner_shared: Counter[str] = Counter()  # per owner: pages it holds that others hold too

    @classmethod
    def from_free_memory(
        cls,
        fraction: float,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        device: torch.device | str = "cpu",
    ) -> BlockPool:
        """Size the pool to `fraction` (0, 1] of the device's free memory (like vLLM's gpu_memory_utilization)."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
        free = available_memory_bytes(device)
        return cls(capacity_bytes=int(free * fraction), page_bytes=page_bytes, device=device)

    @classmethod
    def for_layers(
        cls,
        capacity_bytes: int,
        *,
        num_heads: int,
        head_dim: int,
        chunk_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
        batch_size: int = 1,
        quant=None,
        page_bytes: int | str = "auto",
        device: torch.device | str = "cpu",
    ) -> BlockPool:
        """A pool of `capacity_bytes` bytes for caches of this shape (`num_heads` heads of `head_dim` channels per
        cache, chunks of `chunk_tokens` tokens, `quant` a `QuantConfig` or None), with the page size `pagedqvg plan`
        picks for it (`page_bytes="auto"`: `layout.choose_page_bytes` over the segment kinds in use: dense chunks and,
        with quantization on, packed chunks with their codebooks), or `page_bytes` bytes if an int is given.
        ValueError for a bad shape or quantization setting (nothing is allocated)."""
        if page_bytes == "auto":
            from pagedqvg.layout.segments import choose_page_bytes, segment_kinds
            from pagedqvg.quant.format import PackedFormat

            for name, value in (
                ("num_heads", num_heads),
                ("head_dim", head_dim),
                ("chunk_tokens", chunk_tokens),
                ("batch_size", batch_size),
            ):
                _check_positive_int(name, value)
            fmt = None
            if quant is not None and quant.enabled:
                fmt = PackedFormat(head_dim, num_heads, quant, dtype)
            kinds = segment_kinds(batch_size, num_heads, head_dim, dtype.itemsize, chunk_tokens, fmt)
            page_bytes = choose_page_bytes(kinds).page_bytes
        elif isinstance(page_bytes, str):
            raise ValueError(f"page_bytes must be 'auto' or an int number of bytes, got {page_bytes!r}")
        return cls(capacity_bytes=capacity_bytes, page_bytes=page_bytes, device=device)

    # ---------------------------------------------------------------- views
    def pages_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The arena as `[num_pages, page_bytes // itemsize]` of `dtype` (a view; no copy). O(1), cached."""
        view = self._typed.get(dtype)
        if view is None:
            itemsize = dtype.itemsize
            if self.page_bytes % itemsize:
                raise ValueError(f"page_bytes={self.page_bytes} is not a multiple of {dtype}'s {itemsize} bytes")
            view = self.arena.view(dtype).view(self.num_pages, self.page_bytes // itemsize)
            self._typed[dtype] = view
        return view

    def view_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable 1-D scratch tensor of `numel` elements, shared by every cache of this pool.

        Valid until the next call that asks for it; it grows (never shrinks) and lives outside the page budget.

        CUDA streams: the buffer is `record_stream`-ed on every stream that asks for it, so when it grows its old
        memory is not handed to another allocation before the work queued on those streams is done. The contents
        follow stream order only: a view is valid until the next `view_buffer` call, so a caller that builds views
        on one stream and the next on another must make the second stream wait for the readers of the first view
        (`stream.wait_stream`, or an event), as with any tensor reused across streams; one stream needs nothing.
        """
        if self.device.type == "cuda":
            self._record_view_stream()
        last = self._view_buffer_last
        if last is not None and last[0] == numel and last[1] == dtype:
            return last[2]
        nbytes = numel * dtype.itemsize
        buf = self._view_buffer
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            self._view_buffer = buf
            self._view_buffer_streams = set()
            self._record_view_stream()
        typed = buf[:nbytes].view(dtype)
        self._view_buffer_last = (numel, dtype, typed)
        return typed

    def _record_view_stream(self) -> None:
        """`record_stream` the view buffer on the current CUDA stream, once per (buffer, stream)."""
        buf = self._view_buffer
        if buf is None or buf.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(buf.device)
        if stream not in self._view_buffer_streams:
            self._view_buffer_streams.add(stream)
            buf.record_stream(stream)

    # ------------------------------------------------------------ ownership
    @_locked
    def new_owner(self, label: str) -> str:
        """A fresh owner name `label#k`, unique within this pool."""
        self._owner_serial += 1
        return f"{label}#{self._owner_serial}"

    @property
    def num_free_pages(self) -> int:
        """Free pages now (after queued finalizer releases). O(1)."""
        with self.lock:
            if self._deferred:
                self._drain_deferred()
            return len(self._free)

    @_locked
    def pages_of(self, owner: str) -> int:
        """Pages held by `owner`. O(1)."""
        return self._owner_pages.get(owner, 0)

    @_locked
    def alloc(self, n: int, owner: str) -> list[int]:
        """Take `n` pages for `owner`, all or nothing. O(n). Raises PoolExhaustedError (pool unchanged)."""
        check_int("alloc: n", n, minimum=0, message=_METHOD_INT, type_message=_METHOD_INT)
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"alloc: owner must be a non-empty str, got {owner!r}")
        if n > len(self._free):
            raise exhausted_error(self, n, f"alloc for {owner}")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        if self._journal is not None and self._journal[0] == owner:
            self._journal[1].append(("alloc", list(pages), None))
        owner_of = self._owner_of
        for p in pages:
            owner_of[p] = owner
        self._owner_pages[owner] += n
        used = self.num_pages - len(self._free)
        if used > self._high_water:
            self._high_water = used
        return pages

    @_locked
    def free(self, pages: list[int] | tuple[int, ...], owner: str) -> None:
        """Give `pages` of `owner` back. O(n). A free, foreign, duplicate or unknown page: PageOwnershipError,
        and nothing is freed."""
        self._free_pages(pages, owner)

    def _free_pages(self, pages: list[int] | tuple[int, ...], owner: str) -> None:
        """`free`'s body (the caller holds the lock)."""
        owner_of = self._owner_of
        seen: set[int] = set()
        for p in pages:
            if not is_int(p) or not 0 <= p < self.num_pages:
                raise PageOwnershipError(
                    f"free by {owner}: page {p!r} does not exist (valid ids 0..{self.num_pages - 1})"
                )
            if p in seen:
                raise PageOwnershipError(f"free by {owner}: page {p} is listed twice")
            seen.add(p)
            holder = owner_of[p]
            if holder is None:
                raise PageOwnershipError(f"free by {owner}: page {p} is already free (double free)")
            holders = self._shared.get(p)
            if holders is not None and owner not in holders:
                raise PageOwnershipError(f"free by {owner}: page {p} is held by {', '.join(holders)}, not by {owner}")
            if holders is None and holder != owner:
                raise PageOwnershipError(f"free by {owner}: page {p} belongs to {holder}, not to {owner}")
        shared = [p for p in pages if p in self._shared] if self._shared else []
        if shared:  # holds dropped, the pages stay with their other holders (bytes untouched)
            sharing.drop_holds(self, shared, owner)
            dropped = set(shared)
            pages = [p for p in pages if p not in dropped]
        if pages and self._journal is not None and self._journal[0] == owner:
            index = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
            data = torch.index_select(self._page_words(), 0, index)  # a copy of the pages' bytes
            self._journal[1].append(("free", list(pages), data))
        for p in reversed(pages):
            owner_of[p] = None
            self._free.append(p)
        self._forget_pages(owner, len(pages) + len(shared))

    def _forget_pages(self, owner: str, count: int) -> None:
        """`owner` holds `count` fewer pages (the caller holds the lock): its counts and used bytes follow."""
        if count:
            left = self._owner_pages[owner] - count
            if left > 0:
                self._owner_pages[owner] = left
                if self._owner_used.get(owner, 0) > left * self.page_bytes:  # the owner reports again later
                    self._owner_used[owner] = left * self.page_bytes
            else:
                del self._owner_pages[owner]
                self._owner_used.pop(owner, None)

    @_locked
    def share(self, pages: list[int] | tuple[int, ...], new_owner: str) -> None:
        """Make `new_owner` one more holder of `pages` (each held now, by others): no byte moves, the pages stay
        used once, and each goes back to the free list only when its last holder frees it. All or nothing: a page
        that is free, unknown, listed twice or already held by `new_owner` raises PageOwnershipError naming it and
        its holders, and nothing changes. O(len(pages) x holders)."""
        sharing.check_share(self, pages, new_owner)
        sharing.add_holds(self, list(pages), new_owner)

    @_locked
    def holders(self, page: int) -> tuple[str, ...]:
        """The owners holding `page`, first taker first (empty when free). O(holders)."""
        holders = self._shared.get(page)
        if holders is not None:
            return tuple(holders)
        first = self._owner_of[page]
        return () if first is None else (first,)

    @_locked
    def shared_pages_of(self, owner: str) -> int:
        """Pages `owner` holds that some other owner holds too. O(1)."""
        return self._owner_shared.get(owner, 0)

    @_locked
    def freeable(self, pages: list[int] | tuple[int, ...]) -> int:
        """How many of (held) `pages` go back to the free list when their holder frees them: those no one else
        holds. O(len(pages)); O(1) while no page is shared."""
        if not self._shared:
            return len(pages)
        return sum(1 for p in pages if p not in self._shared)

    @_locked
    def release_owner(self, owner: str) -> int:
        """Give back every page `owner` holds (e.g. a cache collected without `close()`). O(num_pages).
        Returns the number of pages freed."""
        return self._release_owner(owner)

    def _release_owner(self, owner: str) -> int:
        """`release_owner`'s body (the caller holds the lock)."""
        pages = [p for p, holder in enumerate(self._owner_of) if holder == owner]
        if self._owner_shared.get(owner):
            pages += [p for p, holders in self._shared.items() if owner in holders[1:]]
        self._owner_used.pop(owner, None)
        self._free_pages(pages, owner)
        return len(pages)

    # ------------------------------------------------------------ journal (a cache call that raises has not happened)
    def journal_begin(self, owner: str) -> None:
        """Record `owner`'s allocations and frees (with a copy of each freed page's bytes, transient, outside the
        page budget) until `journal_end`, so that `journal_rollback` can undo them. The caller holds `lock` from here
        to the end or the rollback (no other owner can take a page freed meanwhile). O(1)."""
        if self._journal is not None:
            raise PoolInvariantError(f"journal of {self._journal[0]} still open when {owner} begins one")
        self._journal = (owner, [])

    def journal_end(self) -> None:
        """Keep everything since `journal_begin` (drop the record and the byte copies). O(1)."""
        self._journal = None

    def journal_rollback(self) -> None:
        """Undo every allocation, free and hold change of the journal's owner since `journal_begin`, newest first:
        pages it took go back to the free list, pages it gave back are its own again with their bytes restored,
        holds it dropped on shared pages are taken again and holds it added (`share`) dropped. O(pages moved +
        free pages)."""
        assert self._journal is not None
        owner, records = self._journal
        self._journal = None
        rows = self._page_words()
        for kind, pages, data in reversed(records):
            if kind == "alloc" or kind == "share":
                self._free_pages(pages, owner)
                continue
            if kind == "drop":  # the pages stayed held by the others (the caller held the lock): hold them again
                sharing.restore_holds(self, pages, data, owner)
                continue
            back = set(pages)
            self._free = [p for p in self._free if p not in back]
            for p in pages:
                self._owner_of[p] = owner
            self._owner_pages[owner] += len(pages)
            rows.index_copy_(0, torch.tensor(pages, dtype=torch.int64, device=self.device), data)

    # ------------------------------------------------------------ transaction (lock + journal in one place)
    @contextlib.contextmanager
    def transaction(self, owner: str) -> Iterator[None]:
        """`with pool.transaction(owner):` — take `lock`, journal `owner`'s allocations and frees (`journal_begin`);
        on normal exit keep them (`journal_end`), on an exception undo them (`journal_rollback`: pages taken go back,
        pages freed return with their bytes) and re-raise; `lock` is released in every case. A cache runs a call that
        changes pages inside one, so the call either happens whole or not at all, and no other thread takes a page
        it freed meanwhile. Not re-entrant per pool (PoolInvariantError while another journal is open). O(1) plus
        the rollback's O(pages moved + free pages)."""
        with self.lock:
            if self._deferred:
                self._drain_deferred()
            self.journal_begin(owner)
            try:
                yield
            except BaseException:
                self.journal_rollback()
                raise
            self.journal_end()

    def _page_words(self) -> torch.Tensor:
        """The arena as `[num_pages, page_bytes / 8]` int64 words (pages are multiples of 256 bytes): the journal
        copies and restores whole pages through it (CPU, 98 pages of 64 KiB: ~0.5 ms vs ~40 ms as uint8 rows[index]
        and 0.2-4 s as uint8 index_select, measured in benchmarks/bench_transactions.py's layer)."""
        return self.arena.view(self.num_pages, self.page_bytes).view(torch.int64)

    def release_owner_later(self, owner: str) -> None:
        """Queue `owner`'s pages to go back at the next pool operation (for finalizers and garbage collection,
        which may run inside another pool operation, on any thread). Takes no lock; O(1)."""
        self._deferred.append(owner)

    def _drain_deferred(self) -> None:
        """Give back the pages of every queued owner (caller holds the lock). O(num_pages) per queued owner."""
        while self._deferred:
            owner = self._deferred.popleft()
            if self._owner_pages.get(owner, 0):
                self._release_owner(owner)

    # ------------------------------------------------------------ accounting
    @_locked
    def stats(self) -> PoolStats:
        """Exact accounting snapshot. O(owners)."""
        used_pages = self.num_pages - len(self._free)
        held = used_pages * self.page_bytes
        used_bytes = sum(self._owner_used.values())
        return PoolStats(
            total_pages=self.num_pages,
            used_pages=used_pages,
            free_pages=len(self._free),
            page_bytes=self.page_bytes,
            held_bytes=held,
            used_bytes=used_bytes,
            waste_bytes=held - used_bytes,
            high_water_pages=self._high_water,
            owner_pages=tuple(sorted(self._owner_pages.items())),
            shared_pages=len(self._shared),
            owner_shared_pages=tuple(sorted(self._owner_shared.items())),
        )

    @_locked
    def reset_high_water(self) -> None:
        """Start a new high-water mark at the pages held now (to measure the peak of one phase, e.g. a benchmark's
        generation loop after the caches are set up). O(1)."""
        self._high_water = self.num_pages - len(self._free)

    @_locked
    def check(self) -> None:
        """Verify every invariant; raise PoolInvariantError naming the first broken one. O(num_pages)."""
        free = self._free
        if len(set(free)) != len(free):
            dup = [p for p, c in Counter(free).items() if c > 1]
            raise PoolInvariantError(f"free list holds duplicates: {dup[:10]}")
        for p in free:
            if not 0 <= p < self.num_pages:
                raise PoolInvariantError(f"free list holds page {p} outside 0..{self.num_pages - 1}")
            if self._owner_of[p] is not None:
                raise PoolInvariantError(f"page {p} is on the free list but owned by {self._owner_of[p]}")
        counts = Counter(o for o in self._owner_of if o is not None)
        if len(free) + sum(counts.values()) != self.num_pages:
            raise PoolInvariantError(
                f"{len(free)} free + {sum(counts.values())} owned != {self.num_pages} pages (a page is lost)"
            )
        sharing.check_holders(self, counts)
        if counts != self._owner_pages:
            raise PoolInvariantError(f"per-owner counts {dict(self._owner_pages)} != owner table {dict(counts)}")
        for owner, used in self._owner_used.items():
            if used > counts.get(owner, 0) * self.page_bytes:
                raise PoolInvariantError(f"{owner} reports {used} B used but holds {counts.get(owner, 0)} pages")
        if self._high_water < self.num_pages - len(free):
            raise PoolInvariantError("high-water mark below current use")

    def __repr__(self) -> str:
        return (
            f"BlockPool({self.num_pages} pages x {self.page_bytes} B = {format_bytes(self.num_pages * self.page_bytes)}"
            f" on {self.device}, {len(self._free)} free)"
        )


# ---------------------------------------------------------------------------------------------------- internal
# The interface between the pool and the caches (and the tests' snapshots): module functions, not BlockPool methods,
# so the pool's public surface (`help(BlockPool)`) is what a user of the library calls.


def exhausted_error(pool: BlockPool, requested: int, context: str = "") -> PoolExhaustedError:
    """The error an over-budget request of `requested` pages gets (names sizes and the biggest holders)."""
    with pool.lock:  # the owner table may change on other threads
        return _exhausted_error(pool, requested, context)


def _exhausted_error(pool: BlockPool, requested: int, context: str) -> PoolExhaustedError:
    top = ", ".join(f"{o}: {n} pages" for o, n in pool._owner_pages.most_common(3)) or "none"
    prefix = f"{context}: " if context else ""
    free, page = len(pool._free), pool.page_bytes
    return PoolExhaustedError(
        f"{prefix}asked for {requested} pages of {page} B ({format_bytes(requested * page)}), "
        f"but only {free} of {pool.num_pages} pages are free "
        f"({format_bytes(free * page)} of {format_bytes(pool.num_pages * page)}); "
        f"largest holders: {top}. Give the pool more capacity_bytes, shrink the attention window, "
        f"or turn on quantization."
    )


def set_used_bytes(pool: BlockPool, owner: str, nbytes: int) -> None:
    """Record how many bytes of its pages `owner` really uses (for the waste figure). O(1)."""
    with pool.lock:
        _set_used_bytes(pool, owner, nbytes)


def used_bytes_of(pool: BlockPool, owner: str) -> int:
    """Bytes of `owner`'s pages it reported as used (`set_used_bytes`; 0 if none). O(1)."""
    with pool.lock:
        return pool._owner_used.get(owner, 0)


def _set_used_bytes(pool: BlockPool, owner: str, nbytes: int) -> None:
    check_int("set_used_bytes: nbytes", nbytes, minimum=0, message=_METHOD_INT, type_message=_METHOD_INT)
    held = pool._owner_pages.get(owner, 0) * pool.page_bytes
    if nbytes > held:
        raise ValueError(f"set_used_bytes: {owner} reports {nbytes} B used but holds {held} B of pages")
    if nbytes:
        pool._owner_used[owner] = nbytes
    else:
        pool._owner_used.pop(owner, None)


def debug_state(pool: BlockPool) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    """The free stack and the owner table (a shared page's entry: the tuple of its holders), for snapshot
    comparisons in tests."""
    with pool.lock:
        owners: list = list(pool._owner_of)
        for p, holders in pool._shared.items():
            owners[p] = tuple(holders)
        return tuple(pool._free), tuple(owners)
