"""SlotMap (pagedqvg/cache/slot_map.py) against a brute-force model: a plain list whose item i is the global token slot
i
holds. Every operation of the map must give what the same operation on the list gives, and the map's runs must
stay the maximal decomposition of that list (slots contiguous from 0, adjacent runs never continuing each other)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedqvg.cache.slot_map import SlotMap


# ------------------------------------------------------------------------------------------------ the model
def runs_of(slots: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs `(slot_start, slot_end, global_start)` of a list of global tokens."""
    out: list[tuple[int, int, int]] = []
    for i, g in enumerate(slots):
        if out and slots[i - 1] + 1 == g:
            s0, _, g0 = out[-1]
            out[-1] = (s0, i + 1, g0)
        else:
            out.append((i, i + 1, g))
    return tuple(out)


def ranges_of(tokens: list[int]) -> list[tuple[int, int]]:
    """Maximal consecutive global ranges of `tokens`, in order."""
    return [(g0, g0 + s1 - s0) for s0, s1, g0 in runs_of(tokens)]


def tail_start_of(slots: list[int], global_end: int) -> int:
    """First slot of the run of consecutive tokens ending at `global_end - 1` in the last slot, else len(slots)."""
    if not slots or slots[-1] != global_end - 1:
        return len(slots)
    i = len(slots) - 1
    while i > 0 and slots[i - 1] == slots[i] - 1:
        i -= 1
    return i


def check_same(m: SlotMap, slots: list[int]) -> None:
    assert m.runs == runs_of(slots), (m.runs, slots)
    assert m.end == len(slots)
    assert m.global_ranges() == ranges_of(slots)
    # the invariants the runs keep on their own: contiguous slots from 0, non-empty, maximal
    s = 0
    for i, (s0, s1, g0) in enumerate(m.runs):
        assert s0 == s < s1
        if i:
            p0, p1, pg = m.runs[i - 1]
            assert pg + (p1 - p0) != g0, f"runs {m.runs[i - 1]} and {m.runs[i]} continue each other"
        s = s1


def from_list(slots: list[int]) -> SlotMap:
    m = SlotMap()
    for i, g in enumerate(slots):
        m = m.appended(i, 1, g)
    return m


# ------------------------------------------------------------------------------------------------ hand-checked
def test_empty_map():
    m = SlotMap()
    assert (m.runs, m.end, m.global_ranges(), m.tail_start(0), m.tail_start(5)) == ((), 0, [], 0, 0)
    assert m.to_global(0, 0) == [] and not m.holds_any(0, 100)
    assert m.truncated(0) == m and m.rolled(0, 0) == (m, [])


def test_a_rolling_cache_with_a_sink():
    """C = 8, sink 2: tokens 0..7 fill the slots, a chunk of 3 evicts slots [2, 5) (tokens 2..4), the tail moves
    down and the new tokens 8..10 are appended after it."""
    m = SlotMap().appended(0, 4, 0).appended(4, 4, 4)
    assert m.runs == ((0, 8, 0),)  # merged: the second chunk continues the first
    assert m.tail_start(8) == 0
    rolled, dropped = m.rolled(2, 3)
    assert dropped == [(2, 5)]
    assert rolled.runs == ((0, 2, 0), (2, 5, 5))
    m = rolled.appended(5, 3, 8)
    assert m.runs == ((0, 2, 0), (2, 8, 5))
    assert m.tail_start(11) == 2 and m.tail_start(10) == 8  # no run ends at global 10
    assert m.to_global(1, 4) == [(1, 2), (5, 7)]
    assert m.holds_any(1, 2) and not m.holds_any(2, 5) and m.holds_any(4, 6) and not m.holds_any(11, 20)
    assert m.truncated(3).runs == ((0, 2, 0), (2, 3, 5))
    assert m.truncated(2).runs == ((0, 2, 0),) and m.truncated(2).tail_start(11) == 2


def test_roll_across_a_pinned_run():
    """Sink [0, 2) -> tokens 0, 1; pinned slots [2, 4) -> tokens 20, 21; tail [4, 8) -> 30..33. Rolling 3 slots
    after the sink drops the pinned run and the first tail token, in slot order."""
    m = SlotMap(((0, 2, 0), (2, 4, 20), (4, 8, 30)))
    rolled, dropped = m.rolled(2, 3)
    assert dropped == [(20, 22), (30, 31)]
    assert rolled.runs == ((0, 2, 0), (2, 5, 31))


def test_operations_return_new_maps():
    m = SlotMap().appended(0, 3, 10)
    before = m.runs
    m.appended(3, 2, 13)
    m.rolled(1, 1)
    m.truncated(1)
    assert m.runs == before
    with pytest.raises(AttributeError):
        m.runs = ()  # type: ignore[misc]


def test_append_that_does_not_continue_starts_a_run():
    m = SlotMap().appended(0, 2, 0).appended(2, 2, 5).appended(4, 1, 7)
    assert m.runs == ((0, 2, 0), (2, 5, 5))
    assert m.appended(5, 0, 100) == m  # an empty append changes nothing


# ------------------------------------------------------------------------------------------------ against the model
@st.composite
def programs(draw):
    """A random sequence of operations with valid arguments for the map at that point."""
    n = draw(st.integers(1, 25))
    ops = []
    end, last = 0, -1
    for _ in range(n):
        kind = draw(st.sampled_from(["append", "append", "append", "roll", "truncate"]))
        if kind == "append":
            count = draw(st.integers(0, 6))
            g = draw(st.one_of(st.just(last + 1), st.integers(last + 1, last + 5), st.integers(0, 60)))
            ops.append(("append", count, g))
            end += count
            if count:
                last = g + count - 1
        elif kind == "roll":
            sink = draw(st.integers(0, end))
            evict = draw(st.integers(0, end - sink))
            ops.append(("roll", sink, evict))
            end -= evict
        else:
            new_end = draw(st.integers(0, end))
            ops.append(("truncate", new_end))
            end = new_end
    return ops


@settings(max_examples=200, deadline=None)
@given(ops=programs(), data=st.data())
def test_operations_match_a_list_of_slots(ops, data):
    m, slots = SlotMap(), []
    for op in ops:
        if op[0] == "append":
            _, count, g = op
            m = m.appended(len(slots), count, g)
            slots = slots + list(range(g, g + count))
        elif op[0] == "roll":
            _, sink, evict = op
            m, dropped = m.rolled(sink, evict)
            gone = slots[sink : sink + evict]
            slots = slots[:sink] + slots[sink + evict :]
            assert [g for g0, g1 in dropped for g in range(g0, g1)] == gone
            assert all(g1 > g0 for g0, g1 in dropped)
        else:
            m = m.truncated(op[1])
            slots = slots[: op[1]]
        check_same(m, slots)
        # queries at this point
        a = data.draw(st.integers(0, len(slots)), label="a")
        b = data.draw(st.integers(a, len(slots)), label="b")
        got = m.to_global(a, b)
        assert [g for g0, g1 in got for g in range(g0, g1)] == slots[a:b]
        assert got == ranges_of(slots[a:b])  # runs are maximal, so their pieces are too
        # non-empty ranges only: for an empty [g, g) inside a run holds_any answers True (its callers pass segments)
        g0 = data.draw(st.integers(0, 70), label="g0")
        g1 = data.draw(st.integers(g0 + 1, 75), label="g1")
        assert m.holds_any(g0, g1) == any(g0 <= g < g1 for g in slots)
        ge = data.draw(st.sampled_from([slots[-1] + 1 if slots else 0, 0, 10, 61]), label="global_end")
        assert m.tail_start(ge) == tail_start_of(slots, ge)


@settings(max_examples=200, deadline=None)
@given(slots=st.lists(st.integers(0, 30), max_size=20))
def test_appending_single_slots_gives_the_maximal_runs(slots):
    check_same(from_list(slots), slots)
