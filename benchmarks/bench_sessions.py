"""Load benchmark: many sessions of random lifetimes and sizes on one pool, admitted by `SessionManager`.

    python benchmarks/bench_sessions.py [--sessions 10000] [--pool-pages 80] [--quant-share 0.0] [--seed 0]

Time runs in ticks. Each tick new sessions arrive (a random 0..4 of them, until `--sessions` have arrived); each
asks for admission with a random size (1..2 layers, 1 or 2 cache sets (CFG), a window of 2..5 chunks of
4..6 tokens plus 0 or 1 chunk of sink, 1 denoise step) and lifetime (1..6 chunks). A refused session retries the
next tick (it counts one refusal per refused try) and gives up after 5 ticks. Every live session runs one chunk per
tick in the planner's call pattern (advance, denoise rewrites, clean pass; each cache in turn); when its chunks are
done it is closed, except one in 10, which is dropped without close() and left to `SessionManager.reclaim()` (run
by the next `open`). `--quant-share` sessions use 2-bit PRQ packing.

Printed (and with --json written): sessions admitted / refused tries / given up / reclaimed, calls, calls per
second (host time on a shared machine), pool high water vs the largest sum of planned peaks of live sessions and
the pool size, PoolExhaustedError raised by admitted sessions' calls (must be 0), pages leaked after every session
ended (must be 0) and `pool.check()`.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from pagedqvg import BlockPool, PoolExhaustedError, QuantConfig
from pagedqvg.serving.sessions import SessionManager, SessionSpec

PAGE_BYTES = 1024
QUANT = QuantConfig(bits=2, centroids=4, block_size=8, kmeans_iters=1, keep_recent_chunks=1, sink=False)


def random_spec(rng: random.Random, quant_share: float) -> SessionSpec:
    chunk = rng.randint(4, 6)
    sink = rng.choice([0, chunk])
    return SessionSpec(
        layers=rng.randint(1, 2),
        cache_sets=rng.choice([1, 2]),
        batch_size=1,
        cache_size=sink + chunk * rng.randint(2, 5),
        num_heads=2,
        head_dim=16,
        chunk_tokens=chunk,
        sink_tokens=sink,
        denoise_steps=1,
        chunks=rng.randint(1, 6),
        quant=QUANT if rng.random() < quant_share else None,
        cache_kwargs=(("use_int_indices", True),),
    )


def run_chunk(session, spec: SessionSpec, k: int, kv: torch.Tensor) -> int:
    """Chunk `k` of the planner's call pattern on every cache of `session`; returns the calls made."""
    n = spec.chunk_tokens
    key, value = kv[0, :, :n], kv[1, :, :n]
    calls = 0
    for _step in range(spec.denoise_steps + 1):
        for cache in (c for cs in session.caches for c in cs):
            cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=k * n)
            calls += 1
    return calls


def run(sessions: int, pool_pages: int, quant_share: float, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    pool = BlockPool(capacity_bytes=pool_pages * PAGE_BYTES, page_bytes=PAGE_BYTES)
    manager = SessionManager(pool)
    kv = torch.randn(2, 1, 6, 2, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    waiting: list[tuple[SessionSpec, int]] = []  # (spec, ticks waited)
    live: list[list] = []  # [session, spec, next chunk]
    out = dict(arrived=0, admitted=0, refused_tries=0, gave_up=0, dropped=0, calls=0, exhausted_in_calls=0)
    plan_peak = 0
    t0 = time.perf_counter()
    while out["arrived"] < sessions or waiting or live:
        for _ in range(min(rng.randint(0, 4), sessions - out["arrived"])):
            waiting.append((random_spec(rng, quant_share), 0))
            out["arrived"] += 1
        still: list[tuple[SessionSpec, int]] = []
        for spec, waited in waiting:
            try:
                live.append([manager.open(spec), spec, 0])
                out["admitted"] += 1
            except PoolExhaustedError:
                out["refused_tries"] += 1
                if waited < 4:
                    still.append((spec, waited + 1))
                else:
                    out["gave_up"] += 1
        waiting = still
        plan_peak = max(plan_peak, sum(x[0].planned_pages for x in live))
        for item in list(live):
            session, spec, k = item
            try:
                out["calls"] += run_chunk(session, spec, k, kv)
            except PoolExhaustedError:
                out["exhausted_in_calls"] += 1
            item[2] += 1
            if item[2] == spec.chunks:
                live.remove(item)
                if rng.random() < 0.1:
                    out["dropped"] += 1  # no close(): the manager reclaims it
                else:
                    session.close()
            del session
    seconds = time.perf_counter() - t0
    manager.reclaim()
    pool.check()
    stats = pool.stats()
    out.update(
        reclaimed=manager.reclaimed,
        seconds=round(seconds, 1),
        calls_per_s=round(out["calls"] / seconds),
        pool_pages=pool.num_pages,
        high_water_pages=stats.high_water_pages,
        max_sum_of_live_plans=plan_peak,
        pages_leaked=stats.used_pages,
        open_sessions_left=manager.open_sessions,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--pool-pages", type=int, default=80)
    ap.add_argument("--quant-share", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    out = run(args.sessions, args.pool_pages, args.quant_share, args.seed)
    print("| figure | value |\n|---|---|")
    for k, v in out.items():
        print(f"| {k} | {v:,} |" if isinstance(v, int) else f"| {k} | {v} |")
    if args.json:
        with open(args.json, "w", encoding="ascii") as fh:
            json.dump(out, fh, indent=1)
    assert out["pages_leaked"] == 0 and out["exhausted_in_calls"] == 0 and out["open_sessions_left"] == 0


if __name__ == "__main__":
    main()
