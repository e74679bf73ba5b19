"""The fork contract, fuzzed: after `fork()` each branch behaves exactly like a cache that received the same calls
without any fork.

A Hypothesis state machine drives up to 4 branches of one layer on one small pool: forks of any branch at any point
(mid-chunk, between two identical rewrites, after packing, with a pin), appends and rewrite-and-extends, repeated
rewrites (the `RepeatedCall` fast path in parent and child), head-sliced writes into shared pages, rewinds (into
shared packed chunks with quantization on), pins, resets, closes in random order, and a squeezed pool under which a
copy-on-write meets `PoolExhaustedError` and must leave every branch and the pool as they were.

Quantization off: every view is `torch.equal` to a `DenseReferenceCache` that received the branch's calls (a fork
deep-copies the reference). Quantization on (pressure packing off): every view and the exact memory breakdown equal
those of an unforked twin cache on another pool, rebuilt at the fork by replaying the parent's calls. After every step:
`pool.check()` and the leak check (each page's holders are exactly the live branches whose segments list it).

Profiles: PAGEDQVG_FUZZ_PROFILE=ci (default; about 30 s here), long (>= 1,000 programs).
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import torch
from dense_reference import DenseReferenceCache
from helpers import head_args, itemsize, make_kv, note, recent, same_error_kind, seeds, sequencer
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedqvg import BlockPool, PagedCausalKVCache, PoolExhaustedError
from pagedqvg.allocator.pool import debug_state
from pagedqvg.quant import QuantConfig

MAX_BRANCHES = 4
PROFILE = os.environ.get("PAGEDQVG_FUZZ_PROFILE", "ci")
EXAMPLES = {"ci": (100, 40), "long": (1000, 60), "interp": (5, 15)}.get(PROFILE, (100, 40))


@st.composite
def configs(draw, quant: bool):
    C = draw(st.integers(2, 12))
    S = min(C - 1, draw(st.sampled_from([0, 1, 2, C // 2])))
    GS = min(C - 1, draw(st.sampled_from([0, 0, 1, 2])))
    W = draw(st.sampled_from([None, None, C, "small"]))
    if W == "small":
        W = draw(st.integers(max(1, GS, S), C))
    H = draw(st.integers(1, 3))
    B = draw(st.integers(1, 2))
    q = None
    if quant:
        D, dtype = 8, draw(st.sampled_from([torch.bfloat16, torch.float32]))
        bits = draw(st.sampled_from([2, 4]))
        keep = draw(st.sampled_from([0, 0, 1, 2]))
        q = QuantConfig(
            bits=bits, centroids=draw(st.sampled_from([2, 3, 4])), block_size=draw(st.sampled_from([4, 8])),
            stages=draw(st.integers(1, 2)), kmeans_iters=1, keep_recent_chunks=keep,
            sink=draw(st.sampled_from([False, False, True])),
            seed=draw(st.integers(0, 2**16)),
            recent_format="int4" if bits == 2 and keep and draw(st.booleans()) else "bf16",
        )  # fmt: skip
    else:
        D, dtype = draw(st.integers(2, 8)), draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    row = 2 * B * H * D * itemsize(dtype)
    min_page = -(-max(row, (q.centroids * D * itemsize(dtype)) if q else 0) // 256) * 256
    page_bytes = draw(st.sampled_from([min_page, min_page + 256, max(1024, min_page)]))
    return dict(C=C, S=S, GS=GS, W=W, H=H, D=D, B=B, dtype=dtype, quant=q, page_bytes=page_bytes)


def kwargs_of(cfg):
    return dict(
        batch_size=cfg["B"], cache_size=cfg["C"], num_heads=cfg["H"], head_dim=cfg["D"], sink_tokens=cfg["S"],
        attention_window_size=cfg["W"], global_sink_tokens=cfg["GS"],
    )  # fmt: skip


class Branch:
    """One live branch: its cache, its twin (the dense reference, or an unforked cache), its calls, last chunk."""

    def __init__(self, cache, twin, log, last):
        self.cache, self.twin, self.log, self.last = cache, twin, log, last


class ForkMachine(RuleBasedStateMachine):
    QUANT = False

    @initialize(cfg=configs(quant=False), first=st.integers(0, 12), seed=seeds)
    def setup(self, cfg, first, seed):
        self.start(cfg, first, seed)

    def start(self, cfg, first, seed):
        note(f"config: {cfg}")
        self.cfg = cfg
        pages = MAX_BRANCHES * 3 * (cfg["C"] + 4) + 8
        self.pool = BlockPool(capacity_bytes=pages * cfg["page_bytes"], page_bytes=cfg["page_bytes"])
        self.twin_pool = BlockPool(capacity_bytes=pages * cfg["page_bytes"], page_bytes=cfg["page_bytes"])
        self.squeeze: list[int] = []
        self.branches: list[Branch] = []
        self.forks = 0
        self.branches.append(Branch(self.new_cache(self.pool), self.new_twin([]), [], None))
        most = max(1, cfg["C"] - max(cfg["S"], cfg["GS"]))
        for k, s in enumerate(range(0, first, most)):  # a history to fork (programs start with a fork of it)
            self.write(self.branches[0], s, min(most, first - s), cfg["H"], None, None, seed + k)

    def new_cache(self, pool):
        cfg = self.cfg
        return PagedCausalKVCache(pool=pool, dtype=cfg["dtype"], device="cpu", quant=cfg["quant"], **kwargs_of(cfg))

    def new_twin(self, log):
        """The unforked twin of a branch whose calls were `log`: a fresh dense reference / cache replaying them."""
        cfg = self.cfg
        twin = (
            DenseReferenceCache(dtype=cfg["dtype"], **kwargs_of(cfg))
            if not self.QUANT
            else self.new_cache(self.twin_pool)
        )
        for op in log:
            self.apply(twin, op)
        return twin

    def apply(self, target, op):
        kind, *args = op
        if kind == "w":
            k, v, s, h0, r = args
            if isinstance(target, DenseReferenceCache):
                return target.update_and_get_attention_kv(k, v, s, cache_head_start=h0, recent_window_tokens=r)
            return target.update_and_get_attention_kv(
                key=k, value=v, current_chunk_start=s, cache_head_start=h0, recent_window_tokens=r
            )
        return getattr(target, kind)(*args)

    # ---------------------------------------------------------------- checked calls
    def snapshot(self):
        segs = [
            [(e.start, e.end, tuple(e.value.pages), str(e.value.kind)) for e in sequencer(b.cache).index]
            for b in self.branches
        ]
        cursors = [(sequencer(b.cache).state, b.cache.cache_size) for b in self.branches]
        return self.pool.stats(), debug_state(self.pool), segs, cursors

    def call(self, b: Branch, op):
        """Run `op` on the twin and the branch; same outcome, same views; a refused call changes nothing."""
        self.record(b, op)
        note(f"branch {self.branches.index(b)}: {op[0]}{tuple(a for a in op[1:] if not torch.is_tensor(a))}")
        before = self.snapshot()
        twin_before = copy.deepcopy(b.twin) if self.squeeze and not self.QUANT else None
        try:
            tv, texc = self.apply(b.twin, op), None
        except Exception as exc:
            tv, texc = None, exc
        try:
            cv, cexc = self.apply(b.cache, op), None
        except Exception as exc:
            cv, cexc = None, exc
        if texc is not None:
            assert same_error_kind(texc, cexc), f"twin raised {texc!r}, the branch {cexc!r}"
            assert self.snapshot() == before, "a refused call changed a branch or the pool"
            return None
        if cexc is not None:
            assert isinstance(cexc, PoolExhaustedError) and self.squeeze, f"the branch raised {cexc!r}"
            event(
                "PoolExhaustedError on a squeezed pool, rolled back"
                + (" (copy-on-write)" if "copy-on-write" in str(cexc) else "")
            )
            assert self.snapshot() == before, "a call refused for room changed a branch or the pool"
            if twin_before is not None:
                b.twin = twin_before
            else:  # a quantized twin cannot be copied: rebuild it from the calls that happened
                b.twin.close()
                b.twin = self.new_twin(b.log)
            return None
        b.log.append(op)
        if op[0] == "w":
            assert (cv.local_start_index, cv.local_end_index, cv.visible_local_end, cv.visible_global_end) == (
                tv.local_start_index, tv.local_end_index, tv.visible_local_end, tv.visible_global_end,
            )  # fmt: skip
            assert torch.equal(cv.k, tv.k) and torch.equal(cv.v, tv.v), "a branch's view differs from its twin's"
        if self.QUANT:
            assert b.cache.memory_breakdown() == b.twin.memory_breakdown()
        return cv

    def record(self, b: Branch, op):
        """Hypothesis events: which shared-page situations a program reached."""
        if not self.pool.shared_pages_of(b.cache.owner):
            return
        shared = {p for e in sequencer(b.cache).index for p in e.value.pages if len(self.pool.holders(p)) > 1}
        if op[0] == "w":
            s, n = op[3], op[1].shape[1]
            hit = [e for e in sequencer(b.cache).index.overlapping(s, s + n) if set(e.value.pages) & shared]
            if hit:
                packed = any(e.value.packed for e in hit)
                event(f"write into a shared {'packed' if packed else 'dense'} segment")
                if op[1].shape[2] < self.cfg["H"]:
                    event("head-sliced write into a shared segment")
                if self.squeeze:
                    event("write into a shared segment on a squeezed pool")
        elif op[0] == "rewind_to" and op[1] < self.G(b):
            hit = [e for e in sequencer(b.cache).index.overlapping(op[1], self.G(b)) if set(e.value.pages) & shared]
            if any(e.value.packed for e in hit):
                event("rewind into a shared packed segment")
            elif hit:
                event("rewind into a shared dense segment")
        else:
            event(f"{op[0]} with shared pages")

    def write(self, b, s, n, hin, h0, r, seed):
        k, v = make_kv(self.cfg, n, hin, seed)
        out = self.call(b, ("w", k, v, s, h0, r))
        if out is not None and s + n > (b.last[1] if b.last else 0):
            b.last = (s, s + n)
        return out

    def G(self, b):
        return sequencer(b.cache).state.global_end

    def L(self, b):
        return sequencer(b.cache).state.local_end

    # ---------------------------------------------------------------- rules
    branch = st.integers(0, MAX_BRANCHES - 1)

    def pick(self, i):
        return self.branches[i % len(self.branches)]

    @precondition(lambda self: len(self.branches) < MAX_BRANCHES)
    @rule(i=branch)
    def fork(self, i):
        b = self.pick(i)
        self.forks += 1
        child = b.cache.fork(name=f"branch{self.forks}")
        assert child.pool is self.pool and child.owner != b.cache.owner
        twin = copy.deepcopy(b.twin) if not self.QUANT else self.new_twin(b.log)
        self.branches.append(Branch(child, twin, list(b.log), b.last))

    @rule(i=branch)
    def close(self, i):
        b = self.branches.pop(i % len(self.branches))
        mine = set(p for e in sequencer(b.cache).index for p in e.value.pages)
        others = set(p for o in self.branches for e in sequencer(o.cache).index for p in e.value.pages)
        free_before = self.pool.num_free_pages
        b.cache.close()
        assert self.pool.num_free_pages == free_before + len(mine - others)  # exactly the pages nobody else holds
        if self.QUANT:
            b.twin.close()
        if not self.branches:
            self.branches.append(Branch(self.new_cache(self.pool), self.new_twin([]), [], None))

    @rule(i=branch, data=st.data(), r=recent, seed=seeds)
    def append(self, i, data, r, seed):
        b = self.pick(i)
        most = max(1, self.cfg["C"] - max(self.cfg["S"], self.cfg["GS"]))
        n = data.draw(st.integers(1, most), label="n")
        back = min(data.draw(st.sampled_from([0, 0, 1, 3]), label="back"), self.G(b))
        hin, h0 = head_args(data, self.cfg["H"])
        self.write(b, self.G(b) - back, n + back, hin, h0, r, seed)

    @rule(i=branch, data=st.data(), r=recent, seed=seeds)
    def rewrite_retained(self, i, data, r, seed):
        """A rewrite of any retained range, often head-sliced: into pages another branch may share."""
        b = self.pick(i)
        G, L = self.G(b), self.L(b)
        if G == 0 or L == 0:
            return
        s = data.draw(st.integers(max(0, G - L), G - 1), label="s")
        n = data.draw(st.integers(1, G - s), label="n")
        hin, h0 = head_args(data, self.cfg["H"])
        self.write(b, s, n, hin, h0, r, seed)

    @rule(i=branch, data=st.data(), r=recent, seed=seeds, fork_between=st.booleans())
    def repeated_rewrites(self, i, data, r, seed, fork_between):
        """The denoise pattern: the current chunk rewritten twice with the same arguments (the second call takes the
        cached `RepeatedCall` plan), a fork between two identical rewrites, then the same rewrite on both."""
        b = self.pick(i)
        if b.last is None or b.last[1] > self.G(b):
            return
        s, e = b.last
        hin, h0 = head_args(data, self.cfg["H"])
        for k in range(2):
            self.write(b, s, e - s, hin, h0, r, seed + k)
        if fork_between and len(self.branches) < MAX_BRANCHES:
            self.fork(self.branches.index(b))
            event("fork between two identical rewrites")
            child = self.branches[-1]
            for k in range(2):
                self.write(child, s, e - s, hin, h0, r, seed + 2 + k)
                self.write(b, s, e - s, hin, h0, r, seed + 4 + k)

    @rule(i=branch, data=st.data(), seed=seeds, rewind=st.booleans())
    def touch_packed(self, i, data, seed, rewind):
        """Fork, then rewind into or rewrite (head-sliced or not) a retained packed chunk of one side."""
        b = self.pick(i)
        G, L = self.G(b), self.L(b)
        packed = [e for e in sequencer(b.cache).index if e.value.packed and e.start >= G - L]
        if not packed:
            return
        if len(self.branches) < MAX_BRANCHES:
            self.fork(self.branches.index(b))
            b = data.draw(st.sampled_from([b, self.branches[-1]]), label="side")
        e = data.draw(st.sampled_from(packed), label="chunk")
        pos = data.draw(st.integers(e.start, e.end - 1), label="pos")
        if rewind:
            self.call(b, ("rewind_to", pos))
            b.last = None
        else:
            hin, h0 = head_args(data, self.cfg["H"])
            self.write(b, pos, data.draw(st.integers(1, G - pos), label="n"), hin, h0, None, seed)

    @rule(i=branch, data=st.data(), r=recent, seed=seeds)
    def fork_and_diverge(self, i, data, r, seed):
        """Fork, then a retained rewrite on each side (copy-on-write of the pages they share)."""
        if len(self.branches) >= MAX_BRANCHES:
            return
        b = self.pick(i)
        self.fork(self.branches.index(b))
        for k, side in enumerate((b, self.branches[-1])):
            self.rewrite_retained(self.branches.index(side), data, r, seed + k)

    @rule(i=branch, data=st.data(), seed=seeds, same=st.booleans())
    def fork_and_advance_both(self, i, data, seed, same):
        """Fork, then an advance on each side (the same or other values): both policies pack the chunks they
        share, so the second adopts the first's packed segment ("packing happens once")."""
        if len(self.branches) >= MAX_BRANCHES:
            return
        b = self.pick(i)
        self.fork(self.branches.index(b))
        most = max(1, self.cfg["C"] - max(self.cfg["S"], self.cfg["GS"]))
        n = data.draw(st.integers(1, most), label="n")
        for k, side in enumerate((b, self.branches[-1])):
            self.write(side, self.G(side), n, self.cfg["H"], None, None, seed + (0 if same else k))
        if self.QUANT:
            index = sequencer(b.cache).index
            shared = [e for e in index if e.value.packed and len(self.pool.holders(e.value.pages[0])) > 1]
            if shared:
                event("a packed chunk shared by two branches after both advanced")

    @rule(i=branch, data=st.data(), kind=st.sampled_from(["pin", "rewind", "rewind", "reset"]))
    def other_call(self, i, data, kind):
        """A pin, a rewind or a reset (one rule, so that writes and forks make most of a program)."""
        getattr(self, kind)(i, data)

    def pin(self, i, data):
        b = self.pick(i)
        self.call(b, ("pin_current_chunk", data.draw(st.integers(0, self.L(b) + 1), label="pin")))

    def reset(self, i, data=None):
        b = self.pick(i)
        self.call(b, ("reset_indices",))
        assert self.G(b) == 0 and self.pool.pages_of(b.cache.owner) == 0
        b.last = None

    def rewind(self, i, data):
        b = self.pick(i)
        G = self.G(b)
        near = [p for p in (b.last[0] if b.last else 0, G - 1, G - 2, G - self.L(b), G) if p >= 0]
        pos = data.draw(st.one_of(st.sampled_from(near), st.integers(0, G)), label="pos")
        before = self.G(b)
        self.call(b, ("rewind_to", pos))
        if self.G(b) < before:
            b.last = None

    @rule(level=st.sampled_from([0, 0, 1, 2]))
    def squeeze_pool(self, level):
        """Take all but `level` free pages (or give them back): copies-on-write then meet a full pool. Not with
        quantization: the twin's pool is not squeezed, so the pack policy would defer packs in the branch only."""
        if self.QUANT:
            return
        if self.squeeze:
            self.pool.free(self.squeeze, "squeeze")
            self.squeeze = []
            return
        n = max(0, self.pool.num_free_pages - level)
        self.squeeze = self.pool.alloc(n, "squeeze")

    # ---------------------------------------------------------------- invariants
    @invariant()
    def no_leak(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        holders: dict[int, Counter] = {}
        for b in self.branches:
            pages = [p for e in sequencer(b.cache).index for p in e.value.pages]
            assert len(pages) == len(set(pages)), "a branch lists a page twice"
            assert self.pool.pages_of(b.cache.owner) == len(pages), "a branch holds pages its segments do not list"
            for p in pages:
                holders.setdefault(p, Counter())[b.cache.owner] += 1
        for p in self.squeeze:
            holders.setdefault(p, Counter())["squeeze"] += 1
        assert self.pool.stats().used_pages == len(holders), "a page is held by no live branch (leak)"
        for p, who in holders.items():
            assert set(self.pool.holders(p)) == set(who), (p, self.pool.holders(p), who)
        self.twin_pool.check()


class QuantForkMachine(ForkMachine):
    QUANT = True

    @initialize(cfg=configs(quant=True), first=st.integers(0, 12), seed=seeds)
    def setup(self, cfg, first, seed):
        self.start(cfg, first, seed)


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=EXAMPLES[0], stateful_step_count=EXAMPLES[1], deadline=None)
TestQuantForkMachine = QuantForkMachine.TestCase
TestQuantForkMachine.settings = settings(
    max_examples=max(1, EXAMPLES[0] * 2 // 3), stateful_step_count=EXAMPLES[1], deadline=None
)
