"""A cache call as a transaction over the pool: the pool's lock, its journal and the sequencer's saved state.

`CallTransaction` is the cache's collaborator for "a call that raises has not happened" (docs/SEMANTICS.md): a call
runs through `run(fn)`; when `fn` starts changing pages (an advance, or a rewrite that unpacks) it calls
`begin(on_restored)`,
which enters one `with BlockPool.transaction(owner)` (the lock taken, the journal begun; on exit the journal kept,
on an exception rolled back; the lock released in every case — in one place, the pool's context manager) around a
saved copy of the sequencer (`Sequencer.save`). On an exception the pool rolls back first, then the sequencer is
restored and `on_restored` runs (the cache drops its plans and republishes its cursors). `holding_pool_lock` is the
decorator of cache methods that hold the lock for one method's check-then-act steps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from pagedqvg.allocator import BlockPool
    from pagedqvg.cache.sequencing import Sequencer

__all__ = ["CallTransaction", "holding_pool_lock"]

T = TypeVar("T")


class CallTransaction:
    """The transaction of one cache's calls (see the module docstring).

    Args:
        pool, owner: the cache's pool and its owner id there (the journal records this owner's page moves).
        seq: the cache's sequencer (saved at `begin`, restored on a rollback).
    Holds no reference to the cache (`begin` takes its callback), so a cache is freed as soon as it is dropped.
    Cost of a begun transaction: copies of the sequencer's state and segment table and of the freed pages' bytes.
    """

    def __init__(self, *, pool: BlockPool, owner: str, seq: Sequencer) -> None:
        self.pool = pool
        self.owner = owner
        self.seq = seq
        self.stack: contextlib.ExitStack | None = None  # the running call's exit stack

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()`; a transaction it begins ends when it returns, or rolls back if it raises (the exception
        propagates): the call happens whole or not at all."""
        with contextlib.ExitStack() as stack:
            self.stack = stack
            try:
                return fn()
            finally:
                self.stack = None

    def begin(self, on_restored: Callable[[], None]) -> None:
        """From here to the end of the running `run`: the pool's lock held, this owner's page moves journaled;
        `on_restored()` runs after a rollback restored the sequencer."""
        if self.stack is None:
            raise RuntimeError("CallTransaction.begin() outside run()")
        self.stack.enter_context(self._transaction(on_restored))

    @contextlib.contextmanager
    def _transaction(self, on_restored: Callable[[], None]) -> Iterator[None]:
        saved = self.seq.save()
        try:
            with self.pool.transaction(self.owner):
                yield
        except BaseException:
            self.seq.restore(saved)
            on_restored()
            raise


def holding_pool_lock(method):
    """Run a cache method holding its pool's lock (`self.pool.lock`): its check-then-act steps on the pool (free
    pages counted, then pages freed and taken; packing) are atomic with respect to other threads driving other
    caches of the pool."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.pool.lock:
            return method(self, *args, **kwargs)

    return wrapper
