"""RangeIndex against a brute-force list model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedqvg import RangeIndex
from pagedqvg.allocator import RangeEntry


def test_basic_operations():
    idx: RangeIndex[str] = RangeIndex()
    idx.insert(0, 10, "a")
    idx.insert(10, 20, "b")
    idx.insert(30, 35, "c")
    assert [(e.start, e.end) for e in idx.overlapping(5, 31)] == [(0, 10), (10, 20), (30, 35)]
    assert [e.value for e in idx.overlapping(20, 30)] == []
    assert idx.find(10).value == "b" and idx.find(25) is None
    with pytest.raises(ValueError, match=r"overlaps \[10, 20\)"):
        idx.insert(15, 25, "x")
    with pytest.raises(ValueError, match=r"overlaps \[30, 35\)"):
        idx.insert(25, 31, "x")
    with pytest.raises(ValueError, match="empty"):
        idx.insert(40, 40, "x")
    assert idx.first().value == "a" and idx.last().value == "c"
    idx.remove(idx.first())
    with pytest.raises(KeyError, match=r"range \[0, 10\) is not in the index"):
        idx.remove(RangeEntry(0, 10, "a"))
    removed, shortened = idx.truncate(32)
    assert removed == [] and (shortened.start, shortened.end) == (30, 32)
    removed, shortened = idx.truncate(15)
    assert [e.value for e in removed] == ["c"] and (shortened.start, shortened.end) == (10, 15)
    assert [e.value for e in idx.clear()] == ["b"]
    assert len(idx) == 0 and idx.first() is None


ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 200), st.integers(1, 30)),
        st.tuples(st.just("query"), st.integers(0, 220), st.integers(0, 60)),
        st.tuples(st.just("remove"), st.integers(0, 220), st.just(0)),
        st.tuples(st.just("truncate"), st.integers(0, 220), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_index_matches_brute_force(program):
    idx: RangeIndex[int] = RangeIndex()
    model: list[tuple[int, int]] = []
    for op, a, b in program:
        if op == "insert":
            lo, hi = a, a + b
            clash = any(s < hi and lo < e for s, e in model)
            if clash:
                with pytest.raises(ValueError):
                    idx.insert(lo, hi, lo)
            else:
                idx.insert(lo, hi, lo)
                model.append((lo, hi))
        elif op == "query":
            got = [(e.start, e.end) for e in idx.overlapping(a, a + b)]
            assert got == sorted((s, e) for s, e in model if s < a + b and a < e and b > 0)  # [a, a) is empty
        elif op == "remove":  # the entry containing token a, found the way the cache finds it
            entry = idx.find(a)
            inside = [(s, e) for s, e in model if s <= a < e]
            assert (None if entry is None else (entry.start, entry.end)) == (inside[0] if inside else None)
            if entry is not None:
                idx.remove(entry)
                model.remove(inside[0])
        else:
            removed, short = idx.truncate(a)
            assert [(e.start, e.end) for e in removed] == sorted((s, e) for s, e in model if s >= a)
            straddle = [(s, e) for s, e in model if s < a < e]
            assert (short is None) == (not straddle)
            model = [(s, min(e, a)) for s, e in model if s < a]
        assert [(e.start, e.end) for e in idx] == sorted(model)
        assert len(idx) == len(model)
