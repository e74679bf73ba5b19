"""The sequencing core (pagedqvg/cache/sequencing.py): spec validation, every transition against the dense reference
(slot contents, cursors, pin, view ranges), errors that leave the state unchanged, and segment release."""

from __future__ import annotations

import ast
import pathlib
import random

import pytest
import torch
from dense_reference import DenseReferenceCache

import pagedqvg
from pagedqvg.cache.sequencing import CacheSpec, Sequencer, SlotState, effective_sink, view_slot_ranges
from pagedqvg.cache.slot_map import SlotMap
from pagedqvg.errors import CacheConfigError, SequencingError


def snapshot(seq: Sequencer) -> tuple:
    return seq.spec, seq.state, [(e.start, e.end, e.value) for e in seq.index]


def write(seq: Sequencer, start: int, n: int, label: object = "seg") -> tuple:
    """Plan and commit a write (what the cache does around its page moves); returns (plan, released entries)."""
    plan = seq.plan_write(start, n, "t")
    released = seq.release(plan)
    seq.commit(plan, label if plan.new_tokens else None)
    return plan, released


# ------------------------------------------------------------------------------------------------ spec
def test_spec_resolves_the_window_and_keeps_the_fields() -> None:
    assert CacheSpec.create(cache_size=12) == CacheSpec(12, 12, 0, 0, False)
    assert CacheSpec.create(cache_size=12, attention_window_size=0).window == 12
    spec = CacheSpec.create(
        cache_size=12, attention_window_size=5, sink_tokens=2, global_sink_tokens=3, allow_growth=True
    )
    assert spec == CacheSpec(12, 5, 2, 3, True)
    assert spec.with_(sink_tokens=4) == CacheSpec(12, 5, 4, 3, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cache_size": 0}, "cache_size must be >= 1, got 0"),
        ({"cache_size": 4.0}, "cache_size must be an int, got 4.0 (float)"),
        ({"cache_size": True}, "cache_size must be an int, got True (bool)"),
        ({"cache_size": 4, "sink_tokens": -1}, "sink_tokens must be >= 0, got -1"),
        ({"cache_size": 4, "global_sink_tokens": -2}, "global_sink_tokens must be >= 0, got -2"),
        ({"cache_size": 4, "attention_window_size": -1}, "attention_window_size must be >= 0, got -1"),
        ({"cache_size": 4, "attention_window_size": "3"}, "attention_window_size must be an int, got '3' (str)"),
    ],
)
def test_spec_rejects_bad_values_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(CacheConfigError) as err:
        CacheSpec.create(**kwargs)
    assert str(err.value) == message


# ------------------------------------------------------------------------------------------------ transitions
def test_advance_roll_pin_and_release() -> None:
    seq: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=8, sink_tokens=2))
    plan, released = write(seq, 0, 4, "a")
    assert (plan.local_start, plan.local_end, plan.new_tokens, released) == (0, 4, 4, [])
    write(seq, 4, 4, "b")
    assert (seq.state.global_end, seq.state.local_end) == (8, 8)
    plan, released = write(seq, 8, 4, "c")  # rolls 4 slots after the sink: tokens [2, 6) leave
    assert (plan.local_start, plan.local_end) == (4, 8)
    assert released == []  # "a" still holds sink tokens 0, 1
    assert seq.state.slot_map.global_ranges() == [(0, 2), (6, 12)]
    plan, released = write(seq, 12, 4, "d")  # tokens [6, 10) leave: "b" is gone
    assert [(e.start, e.end, e.value) for e in released] == [(4, 8, "b")]
    assert [e.value for e in seq.index] == ["a", "c", "d"]
    seq.pin(4)
    assert (seq.state.pin_start, seq.state.pin_len, seq.effective_sink()) == (4, 2, 0)
    seq.pin(0)
    assert not seq.state.pinned


def test_growth_replaces_the_spec_and_a_whole_cache_window_grows_with_it() -> None:
    seq: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=4, allow_growth=True))
    write(seq, 0, 4)
    plan, _ = write(seq, 4, 3)
    assert plan.spec == CacheSpec(8, 8, 0, 0, True) == seq.spec
    narrow: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=4, attention_window_size=2, allow_growth=True))
    write(narrow, 0, 4)
    write(narrow, 4, 9)
    assert (narrow.spec.cache_size, narrow.spec.window) == (13, 2)


def test_rewrite_plans_change_nothing_and_keep_the_slots() -> None:
    seq: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=8))
    write(seq, 0, 6)
    before = snapshot(seq)
    plan = seq.plan_write(2, 4, "t")
    assert (plan.local_start, plan.local_end, plan.new_tokens, plan.state) == (2, 6, 0, seq.state)
    assert not plan.appends
    assert snapshot(seq) == before


@pytest.mark.parametrize(
    ("start", "n", "error", "needle"),
    [
        (-1, 2, ValueError, "t: current_chunk_start=-1 is negative (valid: 0..12)"),
        (13, 2, SequencingError, "t: gap: the chunk starts after the global end 12: start=13, 2 tokens"),
        (3, 2, SequencingError, "rewrite of tokens that are no longer in the rolling tail: start=3"),
        (12, 7, CacheConfigError, "a chunk of n=7 tokens (start=12, global end=12) would roll onto the sink"),
    ],
)
def test_write_errors_name_the_valid_starts_and_change_nothing(start: int, n: int, error: type, needle: str) -> None:
    seq: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=8, sink_tokens=2))
    for s in range(0, 12, 4):
        write(seq, s, 4)
    before = snapshot(seq)
    with pytest.raises(error) as err:
        seq.plan_write(start, n, "t")
    assert needle in str(err.value)
    if error is SequencingError:
        assert "valid starts are 6..12" in str(err.value)
        assert "current chunk starts at 8" in str(err.value)
    assert snapshot(seq) == before


def test_rewind_drops_segments_trims_the_straddler_and_unpins() -> None:
    seq: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=16, sink_tokens=4))
    for s, label in ((0, "a"), (4, "b"), (8, "c")):
        write(seq, s, 4, label)
    seq.pin(4)  # slots [8, 12)
    plan = seq.plan_rewind(6, "t")
    assert plan is not None and (plan.pos, plan.local_end) == (6, 6)
    removed, straddler = seq.rewind(plan)
    assert [e.value for e in removed] == ["c"]
    assert straddler is not None and (straddler.start, straddler.end, straddler.value) == (4, 6, "b")
    assert (seq.state.global_end, seq.state.local_end, seq.state.pinned) == (6, 6, False)
    assert seq.plan_rewind(6, "t") is None


@pytest.mark.parametrize(
    ("pos", "needle"),
    [
        (-1, "t: rewind_to(-1): position is negative (valid: 14..22)"),
        (23, "t: rewind_to(23) is past the global end 22; valid positions: 14..22"),
        (10, "t: rewind_to(10): tokens [10, 14) are no longer in the rolling tail (global end 22, effective sink E=2"),
    ],
)
def test_rewind_errors_change_nothing(pos: int, needle: str) -> None:
    seq: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=10, sink_tokens=2))
    for s in range(0, 20, 4):
        write(seq, s, 4)
    write(seq, 20, 2)
    before = snapshot(seq)
    with pytest.raises(SequencingError) as err:
        seq.plan_rewind(pos, "t")
    assert needle in str(err.value)
    assert snapshot(seq) == before


def test_adopt_and_reset() -> None:
    seq: Sequencer[str] = Sequencer(CacheSpec.create(cache_size=8, sink_tokens=2))
    seq.adopt(20, 5, 1, 2, "adopted")
    assert seq.state == SlotState(20, 5, 1, 2, SlotMap(((0, 5, 15),)))
    assert [(e.start, e.end) for e in seq.index] == [(15, 20)]
    write(seq, 20, 3)  # appends where the adopted tokens end
    grown = seq.spec
    assert [e.value for e in seq.reset()] == ["adopted", "seg"]
    assert (seq.state, len(seq.index), seq.spec) == (SlotState(), 0, grown)
    with pytest.raises(ValueError, match="needs a segment"):
        seq.commit(seq.plan_write(0, 2, "t"), None)


def test_effective_sink_and_view_ranges_examples() -> None:
    assert effective_sink(4, 2, -1, 0) == 4
    assert effective_sink(4, 2, 2, 3) == 5  # the pin sits right after the global sink
    assert effective_sink(4, 2, 6, 3) == 2
    kw = dict(window=6, global_sink_tokens=2, pin_start=-1, pin_len=0, local_start=8)
    assert view_slot_ranges(local_end=12, sink=2, recent_window_tokens=None, **kw) == [(0, 2), (8, 12)]
    assert view_slot_ranges(local_end=12, sink=2, recent_window_tokens=1, **kw) == [(0, 2), (7, 12)]
    assert view_slot_ranges(local_end=12, sink=2, recent_window_tokens=9, **kw) == [(0, 12)]


# ---------------------------------------------------------------------------------------------- vs the dense reference
def _ref_call(ref: DenseReferenceCache, start: int, n: int, r: int | None):
    key = torch.zeros(1, n, 1, 1)
    return ref.update_and_get_attention_kv(key, key.clone(), start, recent_window_tokens=r)


def _check_same(seq: Sequencer[int], ref: DenseReferenceCache) -> None:
    st = seq.state
    assert (st.global_end, st.local_end, st.pin_start, st.pin_len) == (ref.G, ref.L, ref.P, ref.PL)
    assert (seq.spec.cache_size, seq.spec.window, seq.effective_sink()) == (ref.C, ref.W, ref.E)
    held = [g for g0, g1 in st.slot_map.global_ranges() for g in range(g0, g1)]
    assert held == ref.retained_globals()
    # Every segment is still held by some slot, and every held token is in a segment.
    assert all(st.slot_map.holds_any(e.start, e.end) for e in seq.index)
    assert all(seq.index.find(g) is not None for g in held)


def _random_op(rng: random.Random, seq: Sequencer[int], ref: DenseReferenceCache, label: int) -> None:
    G = ref.G
    op = rng.random()
    if op < 0.1:
        n = rng.choice([0, 1, 2, 3, 5])
        ref.pin_current_chunk(n)
        seq.pin(n)
        return
    if op < 0.2:
        pos = rng.randint(-1, G + 1)
        before = snapshot(seq)
        try:
            ref.rewind_to(pos)
        except SequencingError:
            with pytest.raises(SequencingError):
                seq.plan_rewind(pos, "t")
            assert snapshot(seq) == before
            return
        plan = seq.plan_rewind(pos, "t")
        if plan is not None:
            seq.rewind(plan)
        return
    if op < 0.23:
        ref.reset_indices()
        seq.reset()
        return
    n = rng.randint(1, 6)
    start = rng.randint(max(-1, G - 8), G + 1)
    r = rng.choice([None, None, 0, 1, 4])
    before = snapshot(seq)
    try:
        view = _ref_call(ref, start, n, r)
    except (ValueError, SequencingError) as exc:  # CacheConfigError is a ValueError
        with pytest.raises(type(exc)):
            seq.plan_write(start, n, "t")
        assert snapshot(seq) == before
        return
    plan, released = write(seq, start, n, label)
    assert (plan.local_start, plan.local_end) == (view.local_start_index, view.local_end_index)
    assert all(not seq.state.slot_map.holds_any(e.start, e.end) for e in released)
    assert seq.view_ranges(plan.local_start, r) == ref._view_ranges(plan.local_start, r)


@pytest.mark.parametrize("seed", range(12))
def test_random_calls_follow_the_dense_reference(seed: int) -> None:
    rng = random.Random(seed)
    C = rng.randint(4, 14)
    geometry = dict(
        cache_size=C,
        sink_tokens=rng.choice([0, 1, 2, 3]),
        attention_window_size=rng.choice([None, 0, max(1, C - 3), C + 2]),
        global_sink_tokens=rng.choice([0, 0, 1, 2]),
        allow_growth=rng.random() < 0.25,
    )
    ref = DenseReferenceCache(batch_size=1, num_heads=1, head_dim=1, **geometry)
    seq: Sequencer[int] = Sequencer(CacheSpec.create(**geometry))
    for i in range(120):
        _random_op(rng, seq, ref, i)
        _check_same(seq, ref)


@pytest.mark.parametrize("module", ["sequencing", "policy"])
def test_core_modules_do_not_import_torch(module: str) -> None:
    path = pathlib.Path(pagedqvg.__file__).parent / "cache" / f"{module}.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported and "triton" not in imported
