"""The pack policy (pagedqvg/cache/policy.py): which segments pack after an advance, and in which order segments pack
early under pool pressure; checked on examples and against the rule written out as list slicing."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pagedqvg.allocator import RangeIndex
from pagedqvg.cache.policy import layer_pack_targets, pack_targets, pressure_candidates, sink_segment_starts
from pagedqvg.cache.sequencing import CacheSpec, Sequencer
from pagedqvg.quant import QuantConfig


@dataclass
class Seg:
    label: str
    packed: bool = False
    pack_failed: bool = False


def cfg(keep_recent: int = 1, sink: bool = True, sink_keep: int = 0) -> QuantConfig:
    return QuantConfig(bits=2, keep_recent_chunks=keep_recent, sink=sink, sink_keep_chunks=sink_keep)


def layer(chunks: int, n: int = 4, cache_size: int = 64, sink: int = 0, gsink: int = 0) -> Sequencer[Seg]:
    seq: Sequencer[Seg] = Sequencer(CacheSpec.create(cache_size=cache_size, sink_tokens=sink, global_sink_tokens=gsink))
    for c in range(chunks):
        plan = seq.plan_write(c * n, n, "t")
        seq.release(plan)
        seq.commit(plan, Seg(f"c{c}"))
    return seq


def labels(entries) -> list[str]:
    return [e.value.label for e in entries]


def test_non_sink_chunks_older_than_keep_recent_pack() -> None:
    seq = layer(6)
    current = (20, 24)
    assert labels(layer_pack_targets(cfg(keep_recent=1), seq, current)) == ["c0", "c1", "c2", "c3"]
    assert labels(layer_pack_targets(cfg(keep_recent=0), seq, current)) == ["c0", "c1", "c2", "c3", "c4"]
    assert labels(layer_pack_targets(cfg(keep_recent=5), seq, current)) == []


def test_sink_chunks_past_sink_keep_pack_after_the_others() -> None:
    seq = layer(6, sink=6, cache_size=16)  # sink slots [0, 6): chunks c0, c1; c2 rolled out; c5 is current
    assert [e.value.label for e in seq.index] == ["c0", "c1", "c3", "c4", "c5"]
    assert sink_segment_starts(seq) == {0, 4}
    current = (20, 24)
    assert labels(layer_pack_targets(cfg(keep_recent=1), seq, current)) == ["c3", "c0", "c1"]
    assert labels(layer_pack_targets(cfg(keep_recent=1, sink_keep=1), seq, current)) == ["c3", "c1"]
    assert labels(layer_pack_targets(cfg(keep_recent=1, sink=False), seq, current)) == ["c3"]


def test_pinned_chunk_follows_the_sink_rule() -> None:
    seq = layer(5, sink=4, gsink=4, cache_size=64)
    seq.pin(4)  # slots [16, 20): c4; the global sink keeps slots [0, 4): c0
    assert sink_segment_starts(seq) == {0, 16}
    plan = seq.plan_write(20, 4, "t")
    seq.commit(plan, Seg("c5"))
    assert sink_segment_starts(seq) == {0, 16}
    # non-sink c1..c3 keep the newest (c3); sink c0, c4 keep the first (c0); c5 is current
    assert labels(layer_pack_targets(cfg(keep_recent=1, sink_keep=1), seq, (20, 24))) == ["c1", "c2", "c4"]


def test_packed_failed_and_written_segments_stay() -> None:
    seq = layer(6)
    seq.index.find(0).value.packed = True
    seq.index.find(4).value.pack_failed = True
    assert labels(layer_pack_targets(cfg(keep_recent=0), seq, (14, 24))) == ["c2"]


def test_pressure_candidates_oldest_first_non_sink_before_sink() -> None:
    seq = layer(6, sink=6, cache_size=64)
    seq.index.find(8).value.packed = True
    sinks = sink_segment_starts(seq)
    got = pressure_candidates(seq.index, sinks, excluded={12}, keep=(20, 24))
    assert labels(got) == ["c4", "c0", "c1"]


def _rule_by_slicing(conf: QuantConfig, index: RangeIndex[Seg], sinks: set[int], keep: tuple[int, int]) -> list:
    """The rule as the cache first wrote it: others[:-keep_recent] + sink segments[sink_keep:], then filtered."""
    entries = list(index)
    current = entries[-1] if entries else None
    sink_entries = [e for e in entries if e.start in sinks and e is not current]
    others = [e for e in entries if e.start not in sinks and e is not current]
    targets = others[: max(0, len(others) - conf.keep_recent_chunks)]
    if conf.sink:
        targets += sink_entries[conf.sink_keep_chunks :]
    return [
        e for e in targets if not (e.value.packed or e.value.pack_failed or (e.start < keep[1] and keep[0] < e.end))
    ]


@pytest.mark.parametrize("seed", range(20))
def test_pack_targets_match_the_slicing_rule(seed: int) -> None:
    rng = random.Random(seed)
    index: RangeIndex[Seg] = RangeIndex()
    pos = 0
    for i in range(rng.randint(0, 12)):
        n = rng.randint(1, 5)
        index.insert(pos, pos + n, Seg(f"s{i}", packed=rng.random() < 0.3, pack_failed=rng.random() < 0.1))
        pos += n
    starts = [e.start for e in index]
    sinks = {s for s in starts if rng.random() < 0.3}
    keep = (max(0, pos - rng.randint(1, 8)), pos + rng.randint(0, 3))
    conf = cfg(keep_recent=rng.randint(0, 4), sink=rng.random() < 0.7, sink_keep=rng.randint(0, 3))
    entries = list(index)
    got = pack_targets(conf, sinks, reversed(entries), entries, keep)
    assert got == _rule_by_slicing(conf, index, sinks, keep)
    # Only unpacked candidates need to be passed (what the planner does).
    unpacked = [e for e in entries if not e.value.packed]
    assert pack_targets(conf, sinks, reversed(entries), unpacked, keep) == got
