"""Shared pages: the holder lists of pages with two or more holders (a forked cache shares its parent's pages).

The pool (`pool.BlockPool`) keeps `_shared` (page -> holders, first taker first; `_owner_of[page]` is the first) and
`_owner_shared` (per owner: how many of its pages others hold too). These helpers (module functions of the pool:
this module does not import it) change both; the caller holds the pool's lock and has validated the pages. Every
hold change of the journal's owner is journaled, so a cache call that raises leaves the holders as they were.
"""

from __future__ import annotations

from collections import Counter

from pagedqvg.errors import PageOwnershipError, PoolInvariantError
from pagedqvg.validation import is_int


def check_share(pool, pages, new_owner: str) -> None:
    """PageOwnershipError (naming the page and its holders) unless every page of `pages` is held, listed once and
    not held by `new_owner` yet; ValueError for a bad owner name. Changes nothing. O(len(pages)): one pass with
    the common case (ints, held once, by others) cheap; the slow path only names the first bad page."""
    if not isinstance(new_owner, str) or not new_owner:
        raise ValueError(f"share: new_owner must be a non-empty str, got {new_owner!r}")
    owner_of, shared, n = pool._owner_of, pool._shared, pool.num_pages
    ok = True
    for p in pages:
        if type(p) is not int or not 0 <= p < n or owner_of[p] is None or owner_of[p] == new_owner:
            ok = False
            break
        holders = shared.get(p)
        if holders is not None and new_owner in holders:
            ok = False
            break
    if ok and len(set(pages)) == len(pages):
        return
    seen: set[int] = set()
    for p in pages:
        if not is_int(p) or not 0 <= p < pool.num_pages:
            raise PageOwnershipError(
                f"share with {new_owner}: page {p!r} does not exist (valid ids 0..{pool.num_pages - 1})"
            )
        if p in seen:
            raise PageOwnershipError(f"share with {new_owner}: page {p} is listed twice")
        seen.add(p)
        holders = pool._shared.get(p) or ([pool._owner_of[p]] if pool._owner_of[p] else [])
        if not holders:
            raise PageOwnershipError(f"share with {new_owner}: page {p} is free (only a held page is shared)")
        if new_owner in holders:
            raise PageOwnershipError(f"share with {new_owner}: page {p} is already held by {new_owner}")


def add_holds(pool, pages: list[int], owner: str) -> None:
    """`owner` becomes a holder of held `pages` (validated; the caller holds the lock). Journaled. O(len(pages)),
    the per-owner counts updated once per first holder, not per page."""
    if not pages:
        return
    if pool._journal is not None and pool._journal[0] == owner:
        pool._journal[1].append(("share", list(pages), None))
    shared, owner_of = pool._shared, pool._owner_of
    firsts: dict[str, int] = {}
    for p in pages:
        holders = shared.get(p)
        if holders is None:
            first = owner_of[p]
            shared[p] = [first, owner]
            firsts[first] = firsts.get(first, 0) + 1
        else:
            holders.append(owner)
    owner_shared = pool._owner_shared
    for first, count in firsts.items():
        owner_shared[first] += count
    owner_shared[owner] += len(pages)
    pool._owner_pages[owner] += len(pages)


def drop_holds(pool, pages: list[int], owner: str) -> None:
    """Drop `owner`'s hold on shared `pages` (validated by the caller, which holds the lock); a page left with
    one holder is that holder's alone again. Journaled for `journal_rollback`. O(len(pages) x holders)."""
    if pool._journal is not None and pool._journal[0] == owner:
        pool._journal[1].append(("drop", list(pages), [list(pool._shared[p]) for p in pages]))
    for p in pages:
        holders = pool._shared[p]
        holders.remove(owner)
        pool._owner_shared[owner] -= 1
        pool._owner_of[p] = holders[0]
        if len(holders) == 1:
            del pool._shared[p]
            pool._owner_shared[holders[0]] -= 1
            if not pool._owner_shared[holders[0]]:
                del pool._owner_shared[holders[0]]
    if not pool._owner_shared.get(owner, 1):
        del pool._owner_shared[owner]


def restore_holds(pool, pages: list[int], lists: list[list[str]], owner: str) -> None:
    """Undo `drop_holds(pages, owner)`: each page gets back its holder list `lists[i]`, in its order."""
    for p, holders in zip(pages, lists, strict=True):
        if p not in pool._shared:  # it had become its one other holder's alone
            pool._owner_shared[pool._owner_of[p]] += 1
        pool._shared[p] = list(holders)
        pool._owner_of[p] = holders[0]
        pool._owner_shared[owner] += 1
    pool._owner_pages[owner] += len(pages)


def check_holders(pool, counts: Counter[str]) -> None:
    """The shared-page table against the owner table; adds the extra holders to `counts`. O(shared pages)."""
    shared: Counter[str] = Counter()
    for p, holders in pool._shared.items():
        if len(holders) < 2 or len(set(holders)) != len(holders):
            raise PoolInvariantError(f"page {p}: holder list {holders} (needs two or more distinct holders)")
        if pool._owner_of[p] != holders[0]:
            raise PoolInvariantError(f"page {p}: first holder {holders[0]}, owner table {pool._owner_of[p]}")
        counts.update(holders[1:])
        shared.update(holders)
    if shared != pool._owner_shared:
        raise PoolInvariantError(f"per-owner shared counts {dict(pool._owner_shared)} != holders {dict(shared)}")
