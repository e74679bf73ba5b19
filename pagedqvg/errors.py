"""Typed errors. Every error leaves the pool and the caches exactly as they were before the call."""

from __future__ import annotations


class PagedQVGError(Exception):
    """Base class of every error pagedqvg raises on purpose."""


class PoolExhaustedError(PagedQVGError, MemoryError):
    """The pool has fewer free pages than a request needs (the request changed nothing)."""


class SessionRefusedError(PoolExhaustedError):
    """`SessionManager.open` refused a session: its planned peak does not fit the pages not yet free or reserved
    (nothing was allocated). Attributes in pages: `needed_pages`, `available_pages`, `free_pages`,
    `reserved_pages`."""

    def __init__(
        self, message: str, *, needed_pages: int, available_pages: int, free_pages: int, reserved_pages: int
    ) -> None:
        super().__init__(message)
        self.needed_pages = needed_pages
        self.available_pages = available_pages
        self.free_pages = free_pages
        self.reserved_pages = reserved_pages


class PageOwnershipError(PagedQVGError, ValueError):
    """A page was freed twice, freed by an owner that does not hold it, or does not exist."""


class PoolInvariantError(PagedQVGError, AssertionError):
    """`BlockPool.check()` found a broken invariant (a bug in pagedqvg, never a user error)."""


class SequencingError(PagedQVGError, NotImplementedError):
    """A write or rewind the paged cache cannot honour (a gap, or tokens that are no longer retained)."""


class CacheConfigError(PagedQVGError, ValueError):
    """A cache configuration or call that cannot work (e.g. a chunk that would overwrite the sink)."""


class CacheClosedError(PagedQVGError, RuntimeError):
    """The cache was closed; its pages are back in the pool and it cannot be used any more."""


class PackingFailedWarning(RuntimeWarning):
    """Packing a chunk failed unexpectedly (e.g. the device ran out of memory for PRQ's temporaries) while the pack
    policy ran after a call's write was committed: the chunk stays bf16 (nothing of it changed), the call completes,
    and the policy tries again at the next advance."""


class IntegrationError(PagedQVGError, RuntimeError):
    """A framework integration (e.g. `pagedqvg.integrations.sglang.install`) cannot apply: the framework is not
    importable, or is not the version whose classes it replaces. Nothing was patched."""
