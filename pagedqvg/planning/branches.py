"""Branches of one session: `plan --branches N --diverge-chunks K` (N copy-on-write branches of one session forked at
a chunk boundary, each then running K more chunks of its own), by the planner's replay with shared pages.

The pattern (`branch_pattern`): the root session runs `history` chunks in the planner's call pattern (per chunk, per
denoise step, each cache in turn; scene-cut pins after the clean pass); then N - 1 forks of it (`SessionManager.fork`:
every cache of every set, 0 pages taken); then chunks `history .. history + K - 1` run on the N branches in step
(per chunk, per denoise step, branch by branch, each branch's caches in turn: the order of sessions in step), the
root being branch 0.

The accounting (`BranchLayer`): the planner's `CountingLayer` (the cache's own sequencing and pack policy) whose
segments' pages are a `Block` held by one or more branches, as `BlockPool.share` holds pages: a fork holds every
block of its parent once more (no page taken), a release drops one hold and the block's pages go back when the last
holder lets go. Packing a shared chunk happens once, as cache/shared_packing.py does it: the first branch whose policy
packs (or ages) a chunk whose block another branch holds takes the packed pages and leaves a record (source block,
token range, format); another branch reaching that chunk adopts the packed block (one more hold, no page) while the
recording branch still holds that very packed segment, else it packs its own. A write into a shared dense block is a
copy-on-write the pattern never makes (a fork at a chunk boundary followed by advances): it raises ValueError.

Tests compare the accounting with real caches forked through `SessionManager.fork` call by call
(pagedqvg/cli/fork_sim.py). Complexity: O(calls) accounting steps, each O(log segments).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from pagedqvg.allocator import RangeEntry
from pagedqvg.cache.sequencing import Sequencer
from pagedqvg.errors import CacheConfigError
from pagedqvg.planning.geometry import Geometry, largest_fitting
from pagedqvg.planning.replay import CountedSegment, CountingLayer, PageCounter, is_scene_cut, replay_layer
from pagedqvg.quant.formats import format_rank
from pagedqvg.store.segment import SegmentKind
from pagedqvg.validation import check_int

__all__ = [
    "BranchCall",
    "BranchLayer",
    "account_branches",
    "branch_pattern",
    "branches_report",
    "check_branches",
    "default_history",
    "max_branches",
]

#: `max_branches` stops counting here.
MAX_BRANCHES = 4096


class Block:
    """Pages held together by one or more branches (one segment's pages; `holders` as `BlockPool.holders`)."""

    __slots__ = ("holders", "pages")

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.holders = 1


class BranchLayer(CountingLayer):
    """One layer of one branch: a `CountingLayer` whose segments hold shared `Block`s (`fork()` makes a branch).

    `records` (shared by every branch of the layer): `(source block, start, end, format) -> (packing branch, its
    packed segment)`, cache/shared_packing.py's table."""

    def __init__(self, geom: Geometry, counter: PageCounter, name: str, records: dict | None = None) -> None:
        super().__init__(geom, counter, name)
        self.records: dict[tuple, tuple[BranchLayer, CountedSegment]] = {} if records is None else records
        self.blocks: dict[int, Block] = {}  # id(segment value) -> its block (the segment objects stay alive here)
        self._values: dict[int, CountedSegment] = {}

    # ---------------------------------------------------------------- blocks
    def block_of(self, seg: CountedSegment) -> Block:
        return self.blocks[id(seg)]

    def _hold(self, seg: CountedSegment, block: Block) -> None:
        self.blocks[id(seg)] = block
        self._values[id(seg)] = seg
        self.pages[seg.kind] += seg.pages
        self.segments[seg.kind] += 1

    def _take(self, seg: CountedSegment) -> None:
        self.counter.alloc(seg.pages)
        self._hold(seg, Block(seg.pages))

    def _release(self, seg: CountedSegment) -> None:
        block = self.blocks.pop(id(seg))
        del self._values[id(seg)]
        self.pages[seg.kind] -= seg.pages
        self.segments[seg.kind] -= 1
        block.holders -= 1
        if block.holders == 0:
            self.counter.free(block.pages)

    def exclusive_pages(self) -> int:
        """Pages this branch holds that no other branch holds. O(segments)."""
        return sum(b.pages for b in self.blocks.values() if b.holders == 1)

    def shared_blocks(self) -> list[Block]:
        """Blocks this branch holds that another branch holds too. O(segments)."""
        return [b for b in self.blocks.values() if b.holders > 1]

    # ---------------------------------------------------------------- calls
    def write(self, start: int, n: int) -> int:
        """`CountingLayer.write`, after dropping the packing records of the segments written (their bytes change:
        `shared_packing.forget_written`); ValueError for a write into a block another branch holds (a copy-on-write
        this pattern never makes)."""
        for entry in self.seq.index.overlapping(start, start + n):
            block = self.block_of(entry.value)
            if block.holders > 1 and not entry.value.packed:
                raise ValueError(
                    f"{self.name}: a write of tokens [{start}, {start + n}) into a chunk another branch shares is a "
                    f"copy-on-write the branch plan does not model (fork at a chunk boundary, then advance)"
                )
            for key in [k for k in self.records if k[0] is block]:
                del self.records[key]
        return super().write(start, n)

    def _pack_tier(self, entry: RangeEntry[CountedSegment], fmt: str) -> None:
        """Formats by age, once per shared chunk: adopt the record of another branch's packing of this very chunk,
        else free the source hold and take `fmt`'s pages (recording them when another branch holds the source)."""
        assert self.tiers is not None
        if format_rank(fmt) <= self._coarsest:  # it can move no further
            del self._movable[entry.start]
        source = self.block_of(entry.value)
        key = (source, entry.start, entry.end, fmt)
        record = self.records.get(key)
        if record is not None:
            packer, seg = record
            found = packer.seq.index.find(entry.start)
            if found is None or (found.start, found.end) != (entry.start, entry.end) or found.value is not seg:
                del self.records[key]  # the packing branch changed that chunk since: stale
            elif packer is not self:
                self._release(entry.value)
                block = packer.block_of(seg)
                block.holders += 1
                entry.value = CountedSegment(SegmentKind.PACKED, seg.pages, fmt=fmt)
                self._hold(entry.value, block)
                return
        shared = source.holders > 1
        self._release(entry.value)
        pages = self.tiers[fmt].pages_for_tokens(entry.end - entry.start)
        entry.value = CountedSegment(SegmentKind.PACKED, pages, fmt=fmt)
        self._take(entry.value)
        if shared:
            self.records[key] = (self, entry.value)

    def fork(self, name: str) -> BranchLayer:
        """A branch holding every block of this one once more (no page taken), with its own segment table."""
        child = BranchLayer(self.geom, self.counter, name, self.records)
        seq: Sequencer[CountedSegment] = Sequencer(self.seq.spec)
        seq.state = copy.deepcopy(self.seq.state)
        child.seq = seq
        for entry in self.seq.index:
            clone = dataclasses.replace(entry.value)
            block = self.block_of(entry.value)
            block.holders += 1
            seq.index.insert(entry.start, entry.end, clone)
            new = seq.index.find(entry.start)
            assert new is not None
            child._order[entry.start] = new
            if entry.start in self._movable:
                child._movable[entry.start] = new
            child._hold(clone, block)
        return child

    def close(self) -> None:
        """Every hold of this branch dropped (`cache.close()`)."""
        for seg in list(self._values.values()):
            self._release(seg)


# ---------------------------------------------------------------------------------------------------- pattern
@dataclass(frozen=True, slots=True)
class BranchCall:
    """One call: the chunk, the step (0 advance .. denoise_steps clean, +1 pin; -1 the forks), the branch and
    the cache within the session (`set * layers + layer`), and op ("advance", "denoise", "clean", "pin", "fork")."""

    chunk: int
    step: int
    branch: int
    cache: int
    op: str


def check_branches(branches: object, diverge: object, history: object | None = None) -> None:
    """CacheConfigError naming the bad value: branches an int >= 1, diverge chunks an int >= 0, history (the
    chunks before the fork) None or an int >= 1. O(1)."""
    for name, value, low in (("--branches", branches, 1), ("--diverge-chunks", diverge, 0)):
        wording = "{name} must be an int >= {minimum} (%s), got {value!r}" % (
            "branches of one session, the session itself included" if low else "chunks each branch runs after the fork"
        )
        check_int(name, value, minimum=low, error=CacheConfigError, message=wording, type_message=wording)
    if history is not None:
        wording = "{name} must be an int >= {minimum} (chunks the session runs before the fork), got {value!r}"
        check_int("--fork-at-chunk", history, minimum=1, error=CacheConfigError, message=wording,
                  type_message=wording)  # fmt: skip


def default_history(geom: Geometry) -> int:
    """Chunks before the fork by default: the session's warm-up to its steady state (window full, aged chunks
    packed), `replay_layer(geom).steady_index + 1`. O(replay of one layer)."""
    return replay_layer(geom).steady_index + 1


def branch_pattern(geom: Geometry, branches: int, history: int, diverge: int) -> Iterator[BranchCall]:
    """The calls of the pattern (module docstring) for one session's geometry `geom`."""
    steps, caches = geom.denoise_steps, geom.caches

    def chunk(k: int, live: range) -> Iterator[BranchCall]:
        for step in range(steps + 1):
            op = "advance" if step == 0 else ("clean" if step == steps else "denoise")
            for j in live:
                for c in range(caches):
                    yield BranchCall(k, step, j, c, op)
        if is_scene_cut(k, geom.scene_cut_every):
            for j in live:
                for c in range(caches):
                    yield BranchCall(k, steps + 1, j, c, "pin")

    for k in range(history):
        yield from chunk(k, range(1))
    for j in range(1, branches):
        for c in range(caches):
            yield BranchCall(history, -1, j, c, "fork")
    for k in range(history, history + diverge):
        yield from chunk(k, range(branches))


@dataclass(slots=True)
class BranchAccount:
    """What `account_branches` counted: pool pages after every call, the peak, and the state at the fork and at
    the end (per branch: the pages it holds, and those it holds alone)."""

    used: list[int]
    high_water: int
    history_pages: int  # at the fork (the root's, every cache)
    history_bf16_pages: int
    history_packed_pages: int
    history_high_water: int  # pool peak before the fork (the root alone)
    shared_pages: int  # at the end: pages two or more branches hold (counted once)
    branch_pages: list[int]  # at the end, per branch: pages it holds (a shared page counts for each holder)
    exclusive_pages: list[int]  # at the end, per branch: pages it holds alone
    divergence_high_water: int  # pool peak from the fork on


def account_branches(
    geom: Geometry, branches: int, history: int, diverge: int, *, stop_above: int | None = None
) -> BranchAccount:
    """Pool pages of the pattern by the planner's accounting (no tensors). `geom`: one session's geometry.
    With `stop_above`, the replay stops as soon as the pool's peak passes that many pages (`max_branches`)."""
    check_branches(branches, diverge, history)
    counter = PageCounter()
    layers: dict[tuple[int, int], BranchLayer] = {}
    used: list[int] = []
    hist: tuple[int, int, int] | None = None
    history_high_water = 0
    for call in branch_pattern(geom, branches, history, diverge):
        if hist is None and (call.op == "fork" or call.chunk >= history):
            hist, history_high_water = _history(layers, counter), counter.high_water
            counter.high_water = counter.used  # the divergence's own peak from here on
        key = (call.branch, call.cache)
        if call.op == "fork":
            layers[key] = layers[(0, call.cache)].fork(f"branch{call.branch}.cache{call.cache}")
        else:
            layer = layers.get(key)
            if layer is None:
                layer = layers[key] = BranchLayer(geom, counter, f"branch{call.branch}.cache{call.cache}")
            if call.op == "advance":
                layer.advance()
            elif call.op == "pin":
                layer.pin()
            else:
                layer.rewrite()
        used.append(counter.used)
        if stop_above is not None and max(history_high_water, counter.high_water) > stop_above:
            break
    if hist is None:  # no fork and no divergence: the history is the whole run
        hist, history_high_water = _history(layers, counter), counter.high_water
    per_branch = [[layers[(j, c)] for c in range(geom.caches) if (j, c) in layers] for j in range(branches)]
    shared = {id(b): b.pages for x in layers.values() for b in x.shared_blocks()}
    return BranchAccount(
        used=used,
        high_water=max(history_high_water, counter.high_water),
        history_pages=hist[0],
        history_bf16_pages=hist[1],
        history_packed_pages=hist[2],
        history_high_water=history_high_water,
        shared_pages=sum(shared.values()),
        branch_pages=[sum(x.held_pages for x in ls) for ls in per_branch],
        exclusive_pages=[sum(x.exclusive_pages() for x in ls) for ls in per_branch],
        divergence_high_water=counter.high_water,
    )


def _history(layers: dict[tuple[int, int], BranchLayer], counter: PageCounter) -> tuple[int, int, int]:
    """(pages, bf16 pages, packed pages) the root holds now (the pool holds only the root's pages then)."""
    roots = [x for (j, _c), x in layers.items() if j == 0]
    return (
        counter.used,
        sum(x.pages[SegmentKind.DENSE] for x in roots),
        sum(x.pages[SegmentKind.PACKED] for x in roots),
    )


# ---------------------------------------------------------------------------------------------------- the report
def independent_sessions(geom: Geometry, sessions: int, chunks: int) -> tuple[int, int]:
    """`(pages at the end, pool high water)` of `sessions` unforked sessions of `geom` in step running `chunks`
    chunks each (the planner's census: `replay_layer(...).pool_high_water`). O(replay of one layer)."""
    census = replay_layer(geom, chunks)
    return sessions * geom.caches * census.after[-1], census.pool_high_water(sessions * geom.caches)


def max_branches(geom: Geometry, history: int, diverge: int, pool_pages: int, limit: int = MAX_BRANCHES) -> int:
    """Most branches (the session included, <= `limit`) whose pool peak fits `pool_pages` pages; 0 if not even
    the session alone. The peak grows with the branches, so a doubling search then bisection: O(log N) replays."""

    def fits(n: int) -> bool:
        return account_branches(geom, n, history, diverge, stop_above=pool_pages).high_water <= pool_pages

    return largest_fitting(fits, limit)


def branches_report(
    geom: Geometry, branches: int, diverge: int, history: int | None = None, *, pool_pages: int | None = None
) -> dict[str, object]:
    """JSON-ready plan of the branches (`geom`: one session's geometry): the shared history (held once), each
    branch's divergence, the pool's peak and pages at the end, vs `branches` independent sessions running the same
    chunks; with `pool_pages` (what a budget leaves for the pool) whether they fit and how many branches would.
    CacheConfigError for a bad count. O(calls of the pattern) + O(log N) replays with `pool_pages`."""
    check_branches(branches, diverge, history)
    history = default_history(geom) if history is None else history
    acc = account_branches(geom, branches, history, diverge)
    page = geom.page_bytes
    indep_end, indep_peak = independent_sessions(geom, branches, history + diverge)
    total = acc.used[-1] if acc.used else 0
    doc: dict[str, object] = {
        "branches": branches,
        "diverge_chunks": diverge,
        "history_chunks": history,
        "caches_per_session": geom.caches,
        "page_bytes": page,
        "order": "history on the session, forks at the chunk boundary, then the branches in step",
        "history": {
            "pages": acc.history_pages,
            "bytes": acc.history_pages * page,
            "bf16_pages": acc.history_bf16_pages,
            "packed_pages": acc.history_packed_pages,
            "high_water_pages": acc.history_high_water,
        },
        "end": {
            "pages": total,
            "bytes": total * page,
            "shared_pages": acc.shared_pages,
            "shared_bytes": acc.shared_pages * page,
            "branch_pages": acc.branch_pages,
            "exclusive_pages": acc.exclusive_pages,
            "exclusive_bytes": [p * page for p in acc.exclusive_pages],
        },
        "high_water_pages": acc.high_water,
        "high_water_bytes": acc.high_water * page,
        "divergence_high_water_pages": acc.divergence_high_water,
        "independent": {
            "sessions": branches,
            "pages": indep_end,
            "bytes": indep_end * page,
            "high_water_pages": indep_peak,
            "high_water_bytes": indep_peak * page,
        },
        "independent_over_branches": round(indep_end / total, 3) if total else None,
        "calls": len(acc.used),
    }
    if pool_pages is not None:
        doc["pool_pages"] = pool_pages
        doc["fits"] = acc.high_water <= pool_pages
        doc["max_branches"] = max_branches(geom, history, diverge, pool_pages)
        doc["max_branches_limit"] = MAX_BRANCHES
    return doc


def format_branches(doc: dict[str, object]) -> str:
    """The human lines of `branches_report` (and of its measured twin, `cli/fork_sim.py`)."""
    from pagedqvg.allocator import format_bytes

    h, e, ind = doc["history"], doc["end"], doc["independent"]
    assert isinstance(h, dict) and isinstance(e, dict) and isinstance(ind, dict)
    excl = e["exclusive_pages"]
    assert isinstance(excl, list)
    same = len(set(excl)) == 1
    lines = [
        f"branches: {doc['branches']} branch(es) of one session forked after chunk {doc['history_chunks']} "
        f"({doc['caches_per_session']} caches each), each running {doc['diverge_chunks']} more chunk(s), in step",
        f"  shared history  {h['pages']:,} pages ({format_bytes(int(h['bytes']))}) at the fork, held once: "
        f"{h['bf16_pages']:,} bf16 + {h['packed_pages']:,} packed/aged",
        f"  at the end      {e['pages']:,} pages ({format_bytes(int(e['bytes']))}): {e['shared_pages']:,} shared by "
        f"two or more branches ({format_bytes(int(e['shared_bytes']))}) + per branch alone "
        + (f"{excl[0]:,} pages ({format_bytes(int(excl[0]) * int(doc['page_bytes']))})" if same else f"{excl} pages"),
        f"  pool peak       {doc['high_water_pages']:,} pages ({format_bytes(int(doc['high_water_bytes']))}); "
        f"from the fork on {doc['divergence_high_water_pages']:,}",
        f"  vs {ind['sessions']} independent sessions: {ind['pages']:,} pages ({format_bytes(int(ind['bytes']))}) "
        f"at the end, peak {ind['high_water_pages']:,} pages: {doc['independent_over_branches']}x the branches",
    ]
    if "fits" in doc:
        lines.append(
            f"  budget          pool of {doc['pool_pages']:,} pages: {doc['branches']} branch(es) "
            f"{'fit' if doc['fits'] else 'do NOT fit'}; at most {doc['max_branches']:,} branch(es) fit"
            + (
                f" (searched up to {doc['max_branches_limit']:,})"
                if doc["max_branches"] == doc["max_branches_limit"]
                else ""
            )
        )
    if "mismatches" in doc:
        lines.append(
            f"  measured (real caches, SessionManager.fork): peak {doc['measured_high_water_pages']:,} pages, end "
            f"{doc['measured_pages']:,}, shared {doc['measured_shared_pages']:,}; plan == measured at every call: "
            + ("yes" if doc["mismatches"] == 0 and doc["figures_equal"] else f"NO ({doc['mismatch_text']})")
        )
    return "\n".join(lines)
