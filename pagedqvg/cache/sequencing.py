"""The sequencing core: which global token each slot holds and how a call changes that (docs/SEMANTICS.md).

Tensor-free, shared by the cache (`cache.py`, which commits plans to pool pages) and the planner (`planner.py`,
which commits the same plans to a page counter), so the planner's accounting is the cache's by construction.

- `CacheSpec`: the geometry in slots (cache size, attention window, sink, global sink, growth), validated once.
- `SlotState`: the cursors (tokens produced `G`, slots filled `L`), the pinned run and the `SlotMap`.
- `Sequencer`: a spec, a state and the segment index (global token ranges -> segments of any type); it plans a
  write (`plan_write`, pure: every sequencing error is raised before anything changes), commits it (`release`,
  then `commit`), pins, rewinds, resets, and gives the view's slot ranges.

Units: tokens (= slots). Every method is O(runs + log(segments) + segments touched) unless it says otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from pagedqvg.allocator.range_index import RangeEntry, RangeIndex
from pagedqvg.cache.slot_map import SlotMap
from pagedqvg.errors import CacheConfigError, SequencingError
from pagedqvg.validation import check_int

V = TypeVar("V")


def effective_sink(sink_tokens: int, global_sink_tokens: int, pin_start: int, pin_len: int) -> int:
    """`E` of SEMANTICS.md, in slots: slots `[0, E)` never roll."""
    if pin_start >= 0 and pin_len > 0:
        return global_sink_tokens + pin_len if pin_start == global_sink_tokens else global_sink_tokens
    return max(global_sink_tokens, sink_tokens)


def released_segments(index: RangeIndex[V], new_map: SlotMap, dropped: list[tuple[int, int]]) -> list[RangeEntry[V]]:
    """Entries of `index` touched by the `dropped` global ranges of a roll that no slot of `new_map` holds any more
    (their pages go back to the pool), each once, in order. O(dropped x (log n + k) x runs)."""
    out: list[RangeEntry[V]] = []
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
    """The slot ranges of the view, in order (SEMANTICS.md step 5); `sink` is the effective sink `E`. Pure; O(1)."""
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


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A cache's geometry in slots (= tokens), validated by `create`. Growth and the SGLang setters replace it."""

    cache_size: int  # C: slots of the window
    window: int  # W: slots a view covers (>= 1; the constructor's 0/None means cache_size)
    sink_tokens: int = 0  # S: front slots that do not roll; also the most a pin takes
    global_sink_tokens: int = 0  # GS: the first tokens of the stream, kept for good
    allow_growth: bool = False  # grow C (to max(needed, 2 C)) instead of rolling

    @classmethod
    def create(
        cls,
        *,
        cache_size: object,
        attention_window_size: object = None,
        sink_tokens: object = 0,
        global_sink_tokens: object = 0,
        allow_growth: object = False,
    ) -> CacheSpec:
        """The spec of the constructor arguments (window None or 0: the whole cache); CacheConfigError naming a
        bad one."""
        size = check_int("cache_size", cache_size, minimum=1, error=CacheConfigError)
        sink = check_int("sink_tokens", sink_tokens, minimum=0, error=CacheConfigError)
        gsink = check_int("global_sink_tokens", global_sink_tokens, minimum=0, error=CacheConfigError)
        window = 0 if attention_window_size is None else attention_window_size
        window = check_int("attention_window_size", window, minimum=0, error=CacheConfigError)
        return cls(size, window if window > 0 else size, sink, gsink, bool(allow_growth))

    def with_(self, **changes: object) -> CacheSpec:
        """A copy with `changes` (fields of this class; the caller validated them)."""
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class SlotState:
    """Where the cache stands: tokens produced `global_end` (G), slots filled `local_end` (L), the pinned run
    `[pin_start, pin_start + pin_len)` (-1, 0: none) and which token each slot holds."""

    global_end: int = 0
    local_end: int = 0
    pin_start: int = -1
    pin_len: int = 0
    slot_map: SlotMap = field(default_factory=SlotMap)

    @property
    def pinned(self) -> bool:
        """Whether a run of slots is pinned."""
        return self.pin_start >= 0 and self.pin_len > 0

    def tail_start(self) -> int:
        """First slot of the rolling tail (consecutive tokens ending at `global_end`)."""
        return self.slot_map.tail_start(self.global_end)

    def oldest_rewritable(self) -> int:
        """The smallest global start a write may have now (tokens before it are not in the rolling tail)."""
        return self.global_end - (self.local_end - self.tail_start())


@dataclass(frozen=True, slots=True)
class CallPlan(Generic[V]):
    """Everything one write of tokens `[start, end)` changes in the sequencing, computed before anything changes."""

    start: int  # global position of the chunk's first token
    end: int  # one past its last token
    local_start: int  # the chunk's first slot after the call
    local_end: int  # one past its last slot
    new_tokens: int  # appended tokens (0 for an in-place rewrite)
    spec: CacheSpec  # after the call (grown with allow_growth)
    state: SlotState  # after the call
    released: tuple[RangeEntry[V], ...] = ()  # segments the roll evicts completely, in order

    @property
    def appends(self) -> bool:
        """Whether the call appends tokens (an advance)."""
        return self.new_tokens > 0


@dataclass(frozen=True, slots=True)
class RewindPlan:
    """A validated `rewind_to(pos)`: the new cursors and slot map (nothing changed yet)."""

    pos: int  # new global end
    local_end: int  # new local end
    slot_map: SlotMap


class Sequencer(Generic[V]):
    """One layer's sequencing: its `spec`, its `state` and its segment `index` (global token ranges -> `V`).

    Plans are pure and raise every sequencing error before anything changes; `release`, `commit`, `pin`, `rewind`,
    `adopt` and `reset` change only this object (the caller moves pages). `name` arguments start error messages.
    """

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.state = SlotState()
        self.index: RangeIndex[V] = RangeIndex()

    # ------------------------------------------------------------ transactions (the cache's rollback)
    def save(self) -> tuple:
        """A copy of the spec, the state and the segment table (plus the segment objects by start) for `restore`.
        O(segments) copies."""
        originals = {e.start: e.value for e in self.index}
        return self.spec, copy.deepcopy(self.state), copy.deepcopy(self.index), originals

    def restore(self, saved: tuple) -> None:
        """Back to `saved` (`save()`): spec, state and table as they were, holding the same segment objects as
        before, their saved fields copied back in (callers keep references to them). O(segments)."""
        self.spec, self.state, self.index, originals = saved
        for entry in self.index:
            orig = originals.get(entry.start)
            if orig is not None:
                for name in type(orig).__slots__:
                    setattr(orig, name, getattr(entry.value, name))
                entry.value = orig

    # ------------------------------------------------------------ queries
    def effective_sink(self) -> int:
        """`E`: the number of front slots that never roll now (SEMANTICS.md, "Effective sink")."""
        st = self.state
        return effective_sink(self.spec.sink_tokens, self.spec.global_sink_tokens, st.pin_start, st.pin_len)

    def current_chunk_start(self) -> int:
        """Global start of the newest segment (0 when empty)."""
        last = self.index.last()
        return last.start if last is not None else 0

    def retained_tokens(self) -> Iterator[tuple[RangeEntry[V], int]]:
        """Every segment, in order, with how many of its tokens the slots still hold. O(segments x runs)."""
        live = self.state.slot_map.global_ranges()
        for entry in self.index:
            yield entry, sum(max(0, min(g1, entry.end) - max(g0, entry.start)) for g0, g1 in live)

    def view_ranges(self, local_start: int, recent_window_tokens: int | None) -> list[tuple[int, int]]:
        """The slot ranges of the view of a call whose chunk starts at slot `local_start` (state after the call)."""
        st = self.state
        return view_slot_ranges(
            local_end=st.local_end,
            window=self.spec.window,
            sink=self.effective_sink(),
            global_sink_tokens=self.spec.global_sink_tokens,
            pin_start=st.pin_start,
            pin_len=st.pin_len,
            local_start=local_start,
            recent_window_tokens=recent_window_tokens,
        )

    def sink_ranges(self) -> list[tuple[int, int]]:
        """Global ranges of the sink slots `[0, E)` and of the pinned run (their segments follow the sink policy)."""
        st = self.state
        ranges = st.slot_map.to_global(0, min(self.effective_sink(), st.local_end))
        if st.pinned:
            ranges += st.slot_map.to_global(st.pin_start, min(st.pin_start + st.pin_len, st.local_end))
        return ranges

    def sequencing_error(self, name: str, what: str, start: int, n: int) -> SequencingError:
        """The SequencingError of a write of `n` tokens at `start`, listing the valid starts."""
        floor, G = self.state.oldest_rewritable(), self.state.global_end
        return SequencingError(
            f"{name}: {what}: start={start}, {n} tokens, global end={G}, current chunk starts at "
            f"{self.current_chunk_start()}; valid starts are {floor}..{G} (a rewrite of retained tail "
            f"tokens [{floor}, {G}) or an append at {G})"
        )

    # ------------------------------------------------------------ writes
    def plan_write(self, start: int, n: int, name: str) -> CallPlan[V]:
        """Plan a write of `n >= 1` tokens at global `start` (pure). Raises ValueError (negative start),
        SequencingError (a gap, or a rewrite of tokens no longer in the rolling tail) or CacheConfigError (an
        advance that would roll onto the sink)."""
        st, spec = self.state, self.spec
        G, L = st.global_end, st.local_end
        e = start + n
        if start < 0:
            raise ValueError(f"{name}: current_chunk_start={start} is negative (valid: 0..{G})")
        if start > G:
            raise self.sequencing_error(name, f"gap: the chunk starts after the global end {G}", start, n)
        tail = st.tail_start()
        if e <= G:
            ls = start - (G - L)
            if ls < tail:
                raise self.sequencing_error(name, "rewrite of tokens that are no longer in the rolling tail", start, n)
            return CallPlan(start, e, ls, ls + n, 0, spec, st)
        a = e - G
        if spec.allow_growth and L + a > spec.cache_size:
            grown = max(L + a, 2 * spec.cache_size)
            spec = spec.with_(cache_size=grown, window=grown if spec.window == spec.cache_size else spec.window)
        if L + a <= spec.cache_size:
            le = L + a
            if le - n < tail:
                raise self.sequencing_error(name, "rewrite of tokens that are no longer in the rolling tail", start, n)
            new_map = st.slot_map.appended(le - a, a, G)
            return CallPlan(start, e, le - n, le, a, spec, replace(st, global_end=e, local_end=le, slot_map=new_map))
        return self._plan_roll(start, n, spec, name)

    def _plan_roll(self, start: int, n: int, spec: CacheSpec, name: str) -> CallPlan[V]:
        """An advance that rolls the window: `L + a - C` slots after the effective sink are dropped."""
        st = self.state
        G, L, C = st.global_end, st.local_end, spec.cache_size
        a = start + n - G
        E = self.effective_sink()
        if C - n < E:
            raise CacheConfigError(
                f"{name}: a chunk of n={n} tokens (start={start}, global end={G}) would roll onto the "
                f"sink: cache_size C={C}, effective sink E={E}, so a chunk may be at most C - E = {C - E} "
                f"tokens; raise cache_size, shrink the chunk or the sink"
            )
        if L - (G - start) < st.tail_start():
            raise self.sequencing_error(name, "rewrite of tokens that are no longer in the rolling tail", start, n)
        evict = L + a - C
        new_map, dropped = st.slot_map.rolled(E, evict)
        pin = st.pin_start - evict if st.pinned and st.pin_start >= E else st.pin_start
        # Segments whose every token left the slots go back to the pool in this call.
        released = tuple(released_segments(self.index, new_map, dropped))
        state = replace(st, global_end=start + n, local_end=C, pin_start=pin, slot_map=new_map.appended(C - a, a, G))
        return CallPlan(start, start + n, C - n, C, a, spec, state, released)

    def release(self, plan: CallPlan[V]) -> list[RangeEntry[V]]:
        """Drop `plan.released` from the index and return them (the caller gives their pages back)."""
        for entry in plan.released:
            self.index.remove(entry)
        return list(plan.released)

    def commit(self, plan: CallPlan[V], segment: V | None) -> RangeEntry[V] | None:
        """Make `plan` the state (after `release`); an advance stores `segment` for its new tokens and returns its
        index entry."""
        entry = None
        if plan.new_tokens:
            if segment is None:
                raise ValueError(f"commit: an advance of {plan.new_tokens} tokens needs a segment")
            entry = self.index.insert(self.state.global_end, plan.state.global_end, segment)
        self.spec, self.state = plan.spec, plan.state
        return entry

    # ------------------------------------------------------------ other transitions
    def pin(self, num_tokens: int) -> None:
        """Pin the last `num_tokens` filled slots (at most `sink_tokens` of them); `num_tokens <= 0` or no sink
        unpins."""
        if self.spec.sink_tokens <= 0 or num_tokens <= 0:
            self.unpin()
        else:
            L = self.state.local_end
            self.state = replace(self.state, pin_start=L - num_tokens, pin_len=min(self.spec.sink_tokens, num_tokens))

    def unpin(self) -> None:
        """Clear the pinned run."""
        self.state = replace(self.state, pin_start=-1, pin_len=0)

    def plan_rewind(self, pos: int, name: str) -> RewindPlan | None:
        """Validate `rewind_to(pos)` (pure): None when `pos` is the global end (nothing to do), else the plan.
        SequencingError naming the reachable positions otherwise."""
        st = self.state
        G, L = st.global_end, st.local_end
        E = self.effective_sink()
        floor = st.tail_start() if G == L else max(st.tail_start(), E)
        floor_g = G - (L - floor) if floor <= L else G
        if pos < 0:
            raise SequencingError(f"{name}: rewind_to({pos}): position is negative (valid: {floor_g}..{G})")
        if pos > G:
            raise SequencingError(
                f"{name}: rewind_to({pos}) is past the global end {G}; valid positions: {floor_g}..{G}"
            )
        if pos == G:
            return None
        new_l = L - (G - pos)
        if new_l < floor:
            raise SequencingError(
                f"{name}: rewind_to({pos}): tokens [{pos}, {floor_g}) are no longer in the rolling tail "
                f"(global end {G}, effective sink E={E}, current chunk starts at {self.current_chunk_start()}); "
                f"reachable positions: {floor_g}..{G}"
            )
        return RewindPlan(pos, new_l, st.slot_map.truncated(new_l))

    def rewind(self, plan: RewindPlan) -> tuple[list[RangeEntry[V]], RangeEntry[V] | None]:
        """Apply `plan`: returns the segments dropped whole (in order) and the one now ending at `plan.pos` that
        slots still hold (shortened in the index; the caller trims its pages), or None."""
        removed, straddler = self.index.truncate(plan.pos)
        if straddler is not None and not plan.slot_map.holds_any(straddler.start, straddler.end):
            # Its remaining tokens were evicted earlier: nothing of it is in a slot any more.
            self.index.remove(straddler)
            removed.append(straddler)
            straddler = None
        st = replace(self.state, global_end=plan.pos, local_end=plan.local_end, slot_map=plan.slot_map)
        if plan.local_end < st.pin_start + st.pin_len:
            st = replace(st, pin_start=-1, pin_len=0)
        self.state = st
        return removed, straddler

    def adopt(self, global_end: int, local_end: int, pin_start: int, pin_len: int, segment: V | None) -> None:
        """Start from non-zero cursors (the caller validated `0 <= local_end <= min(global_end, cache_size)`):
        slots `[0, local_end)` hold tokens `[global_end - local_end, global_end)`, stored in `segment`."""
        st = self.state
        if local_end:
            if segment is None:
                raise ValueError(f"adopt: {local_end} slots need a segment")
            self.index.insert(global_end - local_end, global_end, segment)
            st = replace(st, slot_map=SlotMap().appended(0, local_end, global_end - local_end))
        st = replace(st, global_end=global_end, local_end=local_end)
        if pin_start >= 0 and pin_len > 0:
            st = replace(st, pin_start=pin_start, pin_len=pin_len)
        self.state = st

    def reset(self) -> list[RangeEntry[V]]:
        """Empty: cursors 0, unpinned, every segment dropped (returned in order; a grown spec stays)."""
        self.state = SlotState()
        return self.index.clear()
