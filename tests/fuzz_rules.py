"""The rules both cache state machines share (tests/test_cache_fuzz.py, tests/test_cache_fuzz_quant.py).

`write_order_rules(num_layers)` is a `RuleBasedStateMachine` base class with the write-order rules (appends,
rewrites of the current chunk / retained / any range, the caller's chunk pattern, pins, scene cuts, resets,
rewinds, invalid writes) over layers `0 .. num_layers - 1`. A machine provides the state (`cfg`, `pool`, `refs`,
`models`, `last_chunk`), `call_write(i, s, n, hin, h0, r, seed)` and `call_simple(i, name, *args)` (which run the
call on the reference and the cache(s) and compare), and tunes the rules by class attributes and hooks:

- `chunk_tokens(most, small)`: the strategy of a new chunk's length (default 1..most);
- `MAX_REWRITES`: in-place rewrites after each advance of `chunk_on_every_layer`;
- `SCENE_CUT_MORE` / `SCENE_CUT_REWRITES`: chunks after a scene-cut pin, and whether each gets a rewrite;
- `rewind_positions(layer)`, `rewind_started(layer, pos)`, `rewind_done(layer, pos, g)`: extra rewind targets and
  what a machine records around a rewind;
- `do_reset(i)`: what a reset clears besides the reference model.
"""

from __future__ import annotations

from helpers import head_args, recent, seeds
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

#: Growth never rolls; a machine resets a growing layer before it holds more segments than this.
MAX_LIVE_SEGMENTS_WITH_GROWTH = 24
INVALID_KINDS = ("gap", "negative_start", "zero", "too_large", "evicted", "negative_r", "no_h0")
#: Invalid writes the reference must refuse (the others are refused only in some states).
ALWAYS_INVALID = ("gap", "negative_start", "zero", "negative_r", "no_h0")


def write_order_rules(num_layers: int) -> type[RuleBasedStateMachine]:
    """The shared rules over `num_layers` layers, as a base class (one per layer count: rule strategies are fixed
    when the class is made)."""
    layers = st.integers(0, num_layers - 1)

    class WriteOrderRules(RuleBasedStateMachine):
        NUM_LAYERS = num_layers
        MAX_REWRITES = 4
        SCENE_CUT_MORE = 6
        SCENE_CUT_REWRITES = True

        # ------------------------------------------------------------ hooks and helpers
        def max_new_tokens(self) -> int:
            raise NotImplementedError

        def chunk_tokens(self, most: int, small: bool = False):
            return st.integers(1, max(1, most // 4)) if small else st.integers(1, most)

        def max_append(self, i):
            ref = self.refs[i]
            return max(1, min(self.max_new_tokens(), ref.C - ref.E))

        def growth_guard(self, i):
            if self.cfg["grow"] and len(self.models[i].segs) >= MAX_LIVE_SEGMENTS_WITH_GROWTH - 1:
                self.do_reset(i)

        def do_reset(self, i):
            self.call_simple(i, "reset_indices")
            self.models[i].clear()
            self.last_chunk[i] = None

        def rewind_positions(self, layer) -> list[int]:
            return []

        def rewind_started(self, layer, pos) -> None:
            pass

        def rewind_done(self, layer, pos, g) -> None:
            pass

        def append_chunk(self, layer, data, r, seed, small=False):
            """An append, or a rewrite-and-extend starting up to 3 tokens back."""
            self.growth_guard(layer)
            ref = self.refs[layer]
            a = data.draw(self.chunk_tokens(self.max_append(layer), small), label="a")
            back = min(data.draw(st.sampled_from([0, 0, 0, 1, 2, 3]), label="back"), ref.G)
            hin, h0 = head_args(data, self.cfg["H"])
            self.call_write(layer, ref.G - back, a + back, hin, h0, r, seed)

        # ------------------------------------------------------------ rules: normal operation
        @rule(layer=layers, data=st.data(), r=recent, seed=seeds)
        def append(self, layer, data, r, seed):
            self.append_chunk(layer, data, r, seed)

        @rule(layer=layers, data=st.data(), r=recent, seed=seeds)
        def rewrite_current_chunk(self, layer, data, r, seed):
            last = self.last_chunk[layer]
            if last is None or last[1] > self.refs[layer].G:
                return
            hin, h0 = head_args(data, self.cfg["H"])
            self.call_write(layer, last[0], last[1] - last[0], hin, h0, r, seed)

        @rule(layer=layers, data=st.data(), r=recent, seed=seeds)
        def rewrite_retained(self, layer, data, r, seed):
            ref = self.refs[layer]
            if ref.G == 0 or ref.L == 0:  # nothing retained (e.g. a rewind emptied the rolling tail)
                return
            s = data.draw(st.integers(max(0, ref.G - ref.L), ref.G - 1), label="s")
            n = data.draw(st.integers(1, ref.G - s), label="n")
            hin, h0 = head_args(data, self.cfg["H"])
            self.call_write(layer, s, n, hin, h0, r, seed)

        @rule(layer=layers, data=st.data(), r=recent, seed=seeds)
        def rewrite_anywhere(self, layer, data, r, seed):
            """Any start in [0, G] and any length up to C + 2: evicted, sink, rewrite-and-extend, too large."""
            self.growth_guard(layer)
            ref = self.refs[layer]
            s = data.draw(st.integers(0, ref.G), label="s")
            # at most max_new_tokens new tokens (growth would otherwise double C without bound)
            n = data.draw(st.integers(1, min(ref.C + 2, ref.G - s + self.max_new_tokens())), label="n")
            hin, h0 = head_args(data, self.cfg["H"])
            self.call_write(layer, s, n, hin, h0, r, seed)

        @rule(data=st.data(), r=recent, seed=seeds)
        def chunk_on_every_layer(self, data, r, seed):
            """The caller pattern: per layer one advance, then 1..MAX_REWRITES in-place rewrites of the same range."""
            steps = data.draw(st.integers(1, self.MAX_REWRITES), label="rewrites")
            most = min(self.max_append(i) for i in range(num_layers))
            a = data.draw(self.chunk_tokens(most), label="a")
            for i in range(num_layers):
                self.growth_guard(i)
                s = self.refs[i].G
                for k in range(steps + 1):
                    self.call_write(i, s, a, self.cfg["H"], None, r, seed + k)

        @rule(layer=layers, data=st.data())
        def pin(self, layer, data):
            n = data.draw(st.integers(0, self.refs[layer].L), label="pin_n")
            self.call_simple(layer, "pin_current_chunk", n)

        @rule(layer=layers, data=st.data(), r=recent, seed=seeds)
        def scene_cut(self, layer, data, r, seed):
            """A chunk, a rewrite, a pin of that chunk (scene cut), then more chunks so the pinned chunk scrolls."""
            self.growth_guard(layer)
            a = data.draw(self.chunk_tokens(self.max_append(layer)), label="a")
            s = self.refs[layer].G
            self.call_write(layer, s, a, self.cfg["H"], None, r, seed)
            self.call_write(layer, s, a, self.cfg["H"], None, r, seed + 1)
            pin_n = data.draw(st.sampled_from([a, a, max(0, a - 1), a + 1]), label="n")
            self.call_simple(layer, "pin_current_chunk", pin_n)
            for k in range(data.draw(st.integers(1, self.SCENE_CUT_MORE), label="more")):
                self.growth_guard(layer)
                b = data.draw(self.chunk_tokens(self.max_append(layer)), label="b")
                s = self.refs[layer].G
                if not self.SCENE_CUT_REWRITES:
                    self.call_write(layer, s, b, self.cfg["H"], None, r, seed + 2 + k)
                    continue
                self.call_write(layer, s, b, self.cfg["H"], None, r, seed + 2 + 2 * k)
                self.call_write(layer, s, b, self.cfg["H"], None, data.draw(recent, label="r2"), seed + 3 + 2 * k)

        @rule(layer=layers)
        def reset(self, layer):
            self.do_reset(layer)

        @rule(layer=layers, data=st.data())
        def rewind(self, layer, data):
            ref = self.refs[layer]
            # boundaries matter most: the oldest rewindable position (tail start, or 0 before a roll), its
            # neighbours, the current chunk's start, G, G + 1 (and the machine's own); plus any position in [0, G + 1]
            floor = 0 if ref.G == ref.L else ref.G - (ref.L - ref.E)
            last = self.last_chunk[layer][0] if self.last_chunk[layer] else 0
            near = (floor - 1, floor, floor + 1, last, ref.G - 1, ref.G, ref.G + 1, *self.rewind_positions(layer))
            special = [p for p in near if p >= 0]
            pos = data.draw(st.one_of(st.sampled_from(special), st.integers(0, ref.G + 1)), label="pos")
            g = ref.G
            self.rewind_started(layer, pos)
            if self.call_simple(layer, "rewind_to", pos):
                if pos < g:
                    self.models[layer].rewind(pos)
                    self.last_chunk[layer] = None
                self.models[layer].prune(ref)
                self.rewind_done(layer, pos, g)

        @rule()
        def reset_all(self):
            for i in range(num_layers):
                self.do_reset(i)
            stats = self.pool.stats()
            assert stats.used_pages == 0 and stats.free_pages == stats.total_pages == self.pool.num_pages, stats
            assert stats.owner_pages == (), stats

        # ------------------------------------------------------------ rules: invalid calls
        @rule(layer=layers, data=st.data(), seed=seeds)
        def invalid_write(self, layer, data, seed):
            ref = self.refs[layer]
            H = self.cfg["H"]
            kind = data.draw(st.sampled_from(INVALID_KINDS), label="kind")
            r = None
            hin = H
            if kind == "gap":
                s, n = ref.G + data.draw(st.integers(1, 3), label="gap"), data.draw(st.integers(1, 3), label="n")
            elif kind == "negative_start":
                s, n = -data.draw(st.integers(1, 3), label="neg"), data.draw(st.integers(1, 3), label="n")
            elif kind == "zero":
                s, n = data.draw(st.integers(0, ref.G), label="s"), 0
            elif kind == "too_large":
                if self.cfg["grow"]:
                    return  # growth makes any chunk fit
                s = ref.G - data.draw(st.integers(0, min(ref.G, 2)), label="back")
                n = (ref.G - s) + ref.C - ref.E + data.draw(st.integers(1, 3), label="extra")
            elif kind == "evicted":
                if ref.G == ref.L:
                    return
                s = data.draw(st.integers(0, ref.G - ref.L - 1), label="s")
                n = data.draw(st.integers(1, ref.G - s), label="n")
            elif kind == "negative_r":
                s, n, r = ref.G, 1, -data.draw(st.integers(1, 3), label="r")
            else:  # no_h0: a head slice without cache_head_start
                if H == 1:
                    return
                s, n, hin = ref.G, 1, data.draw(st.integers(1, H - 1), label="hin")
            g, l_ = ref.G, ref.L
            rv = self.call_write(layer, s, n, hin, None, r, seed)
            if kind in ALWAYS_INVALID:
                assert rv is None and (g, l_) == (ref.G, ref.L), f"reference accepted an invalid {kind} write"

    return WriteOrderRules
