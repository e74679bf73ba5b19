"""Shared pages in the BlockPool on tiny pools: exact page ids, holder lists and counts, journal rollback of hold
changes, typed errors for foreign and double releases, and a Hypothesis state machine over alloc/share/free."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from helpers import corrupt_holders
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedqvg import BlockPool, PageOwnershipError
from pagedqvg.allocator.pool import debug_state, set_used_bytes
from pagedqvg.errors import PoolInvariantError


def _pool(pages: int = 4) -> BlockPool:
    return BlockPool(capacity_bytes=pages * 256, page_bytes=256)


def test_a_shared_page_is_used_once_and_freed_by_its_last_holder():
    pool = _pool()
    assert pool.alloc(3, "a") == [0, 1, 2]
    pool.share([1, 2], "b")
    assert pool.holders(1) == ("a", "b") and pool.holders(0) == ("a",) and pool.holders(3) == ()
    s = pool.stats()
    assert (s.used_pages, s.free_pages, s.shared_pages) == (3, 1, 2)
    assert s.owner_pages == (("a", 3), ("b", 2))
    assert s.owner_shared_pages == (("a", 2), ("b", 2))
    assert (s.exclusive_pages("a"), s.exclusive_pages("b")) == (1, 0)
    assert pool.shared_pages_of("a") == 2 and pool.pages_of("b") == 2
    pool.check()
    pool.free([1], "a")  # a lets go of page 1: b keeps it, nothing goes back to the free list
    assert pool.holders(1) == ("b",) and pool.num_free_pages == 1
    assert debug_state(pool) == ((3,), ("a", "b", ("a", "b"), None))
    s = pool.stats()
    assert (s.shared_pages, s.owner_pages, s.owner_shared_pages) == (1, (("a", 2), ("b", 2)), (("a", 1), ("b", 1)))
    pool.check()
    pool.free([1, 2], "b")  # page 1: b was the last holder (freed); page 2: a keeps it
    assert pool.holders(1) == () and pool.holders(2) == ("a",)
    assert pool.num_free_pages == 2 and pool.alloc(1, "c") == [1]
    assert pool.stats().owner_pages == (("a", 2), ("c", 1)) and pool.stats().shared_pages == 0
    pool.check()


def test_three_holders_and_any_release_order():
    for order in (("a", "b", "c"), ("c", "b", "a"), ("b", "a", "c")):
        pool = _pool()
        pages = pool.alloc(2, "a")
        pool.share(pages, "b")
        pool.share(pages, "c")
        assert pool.holders(0) == ("a", "b", "c")
        assert pool.stats().owner_shared_pages == (("a", 2), ("b", 2), ("c", 2))
        for i, owner in enumerate(order):
            pool.free(pages, owner)
            pool.check()
            assert pool.num_free_pages == (2 if i < 2 else 4)
            assert pool.holders(0) == tuple(o for o in ("a", "b", "c") if o not in order[: i + 1])
        assert pool.stats().owner_pages == () and pool.stats().owner_shared_pages == ()


def test_foreign_double_and_bad_share_raise_typed_errors_and_change_nothing():
    pool = _pool()
    pool.alloc(2, "a")
    pool.share([0], "b")
    before = (pool.stats(), debug_state(pool))
    cases = [
        (lambda: pool.free([0], "c"), "free by c: page 0 is held by a, b, not by c"),
        (lambda: pool.free([1, 0, 0], "a"), "page 0 is listed twice"),
        (lambda: pool.free([1], "b"), "page 1 belongs to a, not to b"),
        (lambda: pool.free([3], "a"), "page 3 is already free (double free)"),
        (lambda: pool.share([0], "b"), "page 0 is already held by b"),
        (lambda: pool.share([1, 3], "b"), "page 3 is free"),
        (lambda: pool.share([1, 1], "c"), "page 1 is listed twice"),
        (lambda: pool.share([9], "c"), "page 9 does not exist (valid ids 0..3)"),
    ]
    for call, needle in cases:
        with pytest.raises(PageOwnershipError) as err:
            call()
        assert needle in str(err.value) and isinstance(err.value, ValueError)
        assert (pool.stats(), debug_state(pool)) == before
    with pytest.raises(ValueError, match="new_owner must be a non-empty str"):
        pool.share([0], "")
    pool.free([0], "b")
    with pytest.raises(PageOwnershipError, match="page 0 belongs to a, not to b"):  # b's release was its last
        pool.free([0], "b")


def test_release_owner_drops_every_hold_including_second_holds():
    pool = _pool()
    pool.alloc(2, "a")
    pool.alloc(1, "b")
    pool.share([0, 1], "b")
    assert pool.release_owner("b") == 3
    assert pool.holders(0) == ("a",) and pool.holders(2) == () and pool.num_free_pages == 2
    pool.check()
    pool.share([0], "c")
    pool.release_owner_later("a")
    assert pool.num_free_pages == 3 and pool.holders(0) == ("c",)
    pool.check()


def test_journal_rollback_restores_holder_lists_in_order_and_bytes_of_freed_pages():
    pool = _pool(6)
    pool.alloc(3, "a")
    pool.share([0, 1, 2], "b")
    pool.share([0], "c")
    pool.alloc(1, "b")  # page 3, b's alone
    pool.arena.view(6, 256)[3].fill_(7)
    before = (pool.stats(), debug_state(pool))
    with pool.lock:
        pool.journal_begin("b")
        pool.free([0, 1, 3], "b")  # drops two holds (page 1: b was its second of two), frees page 3
        assert pool.holders(1) == ("a",) and pool.holders(0) == ("a", "c")
        assert pool.alloc(2, "b") == [3, 4]
        pool.arena.view(6, 256)[3].fill_(0)
        pool.journal_rollback()
    after = pool.stats()
    assert after.high_water_pages == 5  # the peak of the rolled-back call stays recorded
    assert (replace(after, high_water_pages=4), debug_state(pool)) == before
    assert pool.holders(0) == ("a", "b", "c") and pool.holders(1) == ("a", "b")
    assert torch.all(pool.arena.view(6, 256)[3] == 7)
    pool.check()


def test_journal_rollback_of_share_and_drop_is_exact():
    pool = _pool(4)
    pool.alloc(2, "a")
    pool.share([0], "b")
    before = (pool.stats(), debug_state(pool))
    with pool.lock:
        pool.journal_begin("b")
        pool.free([0], "b")  # the last second holder: page 0 is a's alone for now
        pool.share([0, 1], "b")
        pool.free([1], "b")
        pool.journal_rollback()
    assert (pool.stats(), debug_state(pool)) == before
    pool.check()


def test_used_bytes_with_sharing_count_each_holders_report():
    pool = _pool(4)
    pool.alloc(2, "a")
    pool.share([0, 1], "b")
    set_used_bytes(pool, "a", 400)
    set_used_bytes(pool, "b", 300)
    s = pool.stats()
    assert (s.held_bytes, s.used_bytes, s.waste_bytes) == (512, 700, -188)
    pool.free([1], "b")
    assert pool.stats().used_bytes == 400 + 256  # b holds one page now: its report is capped at 256 B


def test_check_catches_a_corrupted_holder_table():
    pool = _pool()
    pool.alloc(2, "a")
    pool.share([0], "b")
    corrupt_holders(pool, 0, extra_holder="b")
    with pytest.raises(PoolInvariantError, match="holder list"):
        pool.check()
    corrupt_holders(pool, 0, undo=True)
    corrupt_holders(pool, 0, owner_shared=("a", 1))
    with pytest.raises(PoolInvariantError, match="shared counts"):
        pool.check()


def test_threads_share_and_free_under_the_lock():
    pool = _pool(64)
    base = pool.alloc(32, "base")
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            name = f"t{i}"
            for _ in range(50):
                pool.share(base, name)
                own = pool.alloc(1, name)
                pool.free(base + own, name)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pool.check()
    assert pool.stats().owner_pages == (("base", 32),) and pool.stats().shared_pages == 0


class SharingMachine(RuleBasedStateMachine):
    """alloc / share / free / release_owner against a model of holder sets."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = _pool(6)
        self.model: dict[int, list[str]] = {}

    @rule(owner=st.sampled_from("abc"), n=st.integers(0, 3))
    def alloc(self, owner, n):
        if n > 6 - len(self.model):
            return
        for p in self.pool.alloc(n, owner):
            assert p not in self.model
            self.model[p] = [owner]

    @precondition(lambda self: self.model)
    @rule(owner=st.sampled_from("abc"), data=st.data())
    def share(self, owner, data):
        candidates = sorted(p for p, h in self.model.items() if owner not in h)
        if not candidates:
            return
        pages = data.draw(st.lists(st.sampled_from(candidates), unique=True, min_size=1))
        self.pool.share(pages, owner)
        for p in pages:
            self.model[p].append(owner)

    @precondition(lambda self: self.model)
    @rule(owner=st.sampled_from("abc"), data=st.data())
    def free(self, owner, data):
        mine = sorted(p for p, h in self.model.items() if owner in h)
        if not mine:
            return
        pages = data.draw(st.lists(st.sampled_from(mine), unique=True, min_size=1))
        self.pool.free(pages, owner)
        for p in pages:
            self.model[p].remove(owner)
            if not self.model[p]:
                del self.model[p]

    @rule(owner=st.sampled_from("abc"))
    def release(self, owner):
        mine = [p for p, h in self.model.items() if owner in h]
        assert self.pool.release_owner(owner) == len(mine)
        for p in mine:
            self.model[p].remove(owner)
            if not self.model[p]:
                del self.model[p]

    @invariant()
    def agrees(self):
        self.pool.check()
        for p in range(6):
            assert self.pool.holders(p) == tuple(self.model.get(p, ()))
        s = self.pool.stats()
        assert s.used_pages == len(self.model)
        assert s.shared_pages == sum(len(h) > 1 for h in self.model.values())
        for owner in "abc":
            held = sum(owner in h for h in self.model.values())
            shared = sum(owner in h and len(h) > 1 for h in self.model.values())
            assert (self.pool.pages_of(owner), self.pool.shared_pages_of(owner)) == (held, shared)


TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
