"""What "a call that raises has not happened" costs: CPU time per call with the transaction machinery vs the same
calls with it bypassed, side by side in one process.

An advance (new tokens) or a rewrite that unpacks a packed chunk runs as a transaction (`PagedCausalKVCache.
_begin_transaction`): the pool's lock held across the call, deep copies of the sequencer's state and segment table,
and the pool's journal of the cache's allocations and frees with a copy of every freed page's bytes (a rolling advance
frees the evicted chunk's pages, so their bytes are copied). A pure in-place rewrite (a later denoise step) is not a
transaction. The bypassed twin is the same cache with `_begin_transaction` replaced by a no-op (no lock hold, no
copies, no journal: what the call cost before transactions, minus nothing else); both caches see the same calls and
their views are checked bit-equal. Beside the whole call, the transaction's own work is timed inside it: the begin
(lock, copies of the sequencer's state and segment table) plus the pool's frees with the journal open (each freed
page's bytes copied), vs the bypassed cache's frees alone: a direct figure less exposed to machine noise than the
difference of two call times. The in-place rewrite (no transaction) is the control row: its ratio is the noise.

Layer: LingBot-like, 8 heads x 128, bf16, batch 1, chunks of `--chunk` tokens, a 6-chunk cache with a 3-chunk sink,
64 KiB pages (the window rolls every advance after warm-up). Quant off: advance, in-place rewrite. Quant on (int2,
`keep_recent_chunks=1`): advance (packs the chunk leaving the recent set), in-place rewrite, and a rewrite of the
chunk before the previous one (packed by then), which unpacks it. In rounds of one call per cache (noise hits both
alike, the order alternating); medians of `--rounds` rounds after `--warm` warm-up chunks. glibc's malloc is set to
keep freed memory (bench_cpu_views.steady_malloc) so that fresh view tensors do not page-fault in again
(`--glibc-malloc`: defaults).

    PYTHONPATH=. python benchmarks/bench_transactions.py [--rounds 30] [--chunk 1560] [--quant off,int2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_cpu_views import steady_malloc

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig

HEADS, HEAD_DIM, CACHE_CHUNKS, SINK_CHUNKS, PAGE = 8, 128, 6, 3, 64 << 10
INT2 = QuantConfig(bits=2, centroids=16, block_size=128, kmeans_iters=2, keep_recent_chunks=1, sink=False)


def make(chunk: int, quant: QuantConfig | None, bypass: bool) -> PagedCausalKVCache:
    tokens = CACHE_CHUNKS * chunk
    pool = BlockPool(capacity_bytes=(2 * tokens * HEADS * HEAD_DIM * 2) * 3 + 64 * PAGE, page_bytes=PAGE)
    cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=tokens, num_heads=HEADS, head_dim=HEAD_DIM,
                               dtype=torch.bfloat16, device="cpu", sink_tokens=SINK_CHUNKS * chunk, quant=quant,
                               name="bypassed" if bypass else "transactional")  # fmt: skip
    if bypass:
        cache._begin_transaction = lambda: None  # the calls as they ran before transactions
    # The transaction's own work, timed inside the call: the begin (lock, state and segment copies) and the pool's
    # frees (with the journal open: a copy of each freed page's bytes; bypassed: the frees alone).
    cache.meter = Meter()
    cache._begin_transaction = cache.meter.wrap(cache._begin_transaction)
    pool._free_pages = cache.meter.wrap(pool._free_pages)
    return cache


class Meter:
    """Seconds spent in the wrapped functions since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def kv(seed: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, chunk, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    return x[0], x[1]


def call(cache, chunk: int, k: int, seed: int):
    key, value = kv(seed, chunk)
    cache.meter.seconds = 0.0
    t0 = time.perf_counter()
    view = cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=k * chunk)
    return time.perf_counter() - t0, view, cache.meter.seconds


def run(chunk: int, quant: QuantConfig | None, rounds: int, warm: int) -> dict[str, tuple[float, ...]]:
    """Median seconds per call kind: (transactional, bypassed, begin + frees transactional, frees bypassed)."""
    caches = [make(chunk, quant, False), make(chunk, quant, True)]
    times: dict[str, list[list[float]]] = {}
    for k in range(warm + rounds):
        steps = [("advance", k, 1000 * k), ("rewrite in place", k, 1000 * k + 1)]
        if quant is not None and k >= 2:  # chunk k - 2: packed once it left the recent chunk (from the 6th chunk on)
            steps.append(("rewrite of a packed chunk (unpacks)", k - 2, 1000 * k + 2))
        for kind, target, seed in steps:
            views = []
            for cache in caches if k % 2 else caches[::-1]:
                dt, view, work = call(cache, chunk, target, seed)
                views.append(view)
                if k >= warm:
                    bypassed = cache.debug_name == "bypassed"
                    times.setdefault(kind, [[], [], [], []])[bypassed].append(dt)
                    times[kind][2 + bypassed].append(work)
            assert torch.equal(views[0].k, views[1].k) and torch.equal(views[0].v, views[1].v), (kind, k)
    for cache in caches:
        cache.close()
    return {kind: tuple(statistics.median(x) for x in t) for kind, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1560)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quant", default="off,int2", help="comma list of off, int2")
    ap.add_argument("--glibc-malloc", action="store_true", help="keep glibc's malloc defaults (see bench_cpu_views)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steady = False if args.glibc_malloc else steady_malloc()
    out = {}
    print(f"transaction cost: 8 heads x 128 bf16, chunk {args.chunk} tokens, cache {CACHE_CHUNKS} chunks "
          f"(sink {SINK_CHUNKS}), 64 KiB pages, {args.rounds} rounds (medians, ms per call); steady malloc: "
          f"{steady}")  # fmt: skip
    print(f"{'quant':<6} {'call':<38} {'transactional':>14} {'bypassed':>10} {'ratio':>7}   in-call work: "
          f"begin + frees (journal) / frees (bypassed)")  # fmt: skip
    for name in args.quant.split(","):
        quant = {"off": None, "int2": INT2}[name]
        for kind, (t, b, wt, wb) in run(args.chunk, quant, args.rounds, args.warm).items():
            print(f"{name:<6} {kind:<38} {t * 1e3:>14.2f} {b * 1e3:>10.2f} {t / b:>6.2f}x   {wt * 1e3:.2f} / "
                  f"{wb * 1e3:.2f} ms")  # fmt: skip
            out[f"{name}: {kind}"] = {"chunk": args.chunk, "transactional_ms": t * 1e3, "bypassed_ms": b * 1e3,
                                      "ratio": t / b, "begin_and_frees_ms": wt * 1e3,
                                      "frees_bypassed_ms": wb * 1e3}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "steady_malloc": steady, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
