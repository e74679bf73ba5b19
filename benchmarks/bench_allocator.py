"""Allocator micro-benchmarks: page alloc+free cost per page, and range-index insert/query/remove at 10,000 segments.

    python benchmarks/bench_allocator.py [--segments 10000]

Prints a Markdown table; times are medians of repeated runs (host time, shared machine: read them as orders of
magnitude). Baselines side by side in the same process: a plain Python list scanned linearly for the index, and
`torch.empty` per 4 KiB page and `torch.empty` once per 46-page segment for the pool (what a per-segment allocator
pays: one allocation per chunk, of any size).
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import time

import torch

from pagedqvg import BlockPool, RangeIndex


def timed(fn, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_pool(pages: int, batch: int) -> list[tuple[str, float]]:
    pool = BlockPool(capacity_bytes=pages * 4096, page_bytes=4096)

    def cycle_pool():
        held = [pool.alloc(batch, "o") for _ in range(pages // batch)]
        for p in held:
            pool.free(p, "o")

    def cycle_torch():
        held = [torch.empty(4096, dtype=torch.uint8) for _ in range(pages)]
        del held

    def cycle_torch_segments():
        held = [torch.empty(4096 * batch, dtype=torch.uint8) for _ in range(pages // batch)]
        del held

    n = (pages // batch) * batch
    return [
        (f"BlockPool alloc+free, {batch} pages per call (ns/page)", timed(cycle_pool) / n * 1e9),
        ("torch.empty per 4 KiB page, baseline (ns/page)", timed(cycle_torch) / pages * 1e9),
        (f"torch.empty per {batch}-page segment, baseline (ns/page)", timed(cycle_torch_segments) / n * 1e9),
    ]


def bench_index(segments: int) -> list[tuple[str, float]]:
    width = 100
    starts = list(range(0, segments * width, width))
    shuffled = starts[:]
    random.Random(0).shuffle(shuffled)
    queries = [random.Random(1).randrange(0, segments * width) for _ in range(1000)]

    def build() -> RangeIndex:
        idx: RangeIndex[int] = RangeIndex()
        for s in shuffled:
            idx.insert(s, s + width, s)
        return idx

    idx = build()
    insert = timed(build) / segments
    query = timed(lambda: [idx.overlapping(q, q + 3 * width) for q in queries]) / len(queries)

    def release_all():  # what the roll does: drop the oldest segment, one at a time
        local = build()
        while local:
            local.remove(local.first())

    release = (timed(release_all, 3) - insert * segments) / segments

    # Baseline: a sorted Python list of (start, end) scanned linearly for overlaps (what a segment list does).
    plain = sorted((s, s + width) for s in starts)
    linear = timed(lambda: [[r for r in plain if r[0] < q + 3 * width and q < r[1]] for q in queries[:50]]) / 50
    keys = [r[0] for r in plain]
    bisected = timed(lambda: [bisect.bisect_right(keys, q) for q in queries]) / len(queries)
    return [
        (f"RangeIndex insert, {segments:,} segments (µs/op)", insert * 1e6),
        (f"RangeIndex overlapping query, {segments:,} segments (µs/op)", query * 1e6),
        (f"RangeIndex remove of the oldest segment, one at a time (µs/op, {segments:,} segments)", release * 1e6),
        (f"baseline: linear scan of a list, {segments:,} segments (µs/query)", linear * 1e6),
        ("baseline: bare bisect on a list of starts (µs/query, no overlap logic)", bisected * 1e6),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=10_000)
    ap.add_argument("--pages", type=int, default=20_000)
    args = ap.parse_args(argv)
    rows = bench_pool(args.pages, 1)[:2] + bench_pool(args.pages, 46)[::2] + bench_index(args.segments)
    print("| operation | time |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value:,.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
