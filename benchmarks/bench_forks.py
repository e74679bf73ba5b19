"""Copy-on-write forks and the host tier on a LingBot-World-shaped session (reduced layers and heads), CPU.

    python benchmarks/bench_forks.py [--quick] [--layers 2] [--heads 4] [--chunks 4] [--repeats 5] [--json PATH]

The session: `get_preset("lingbot-world")` (1,560 tokens per frame, chunks of 3 frames, a 3-frame sink, an 18-frame
window, 4 denoise steps), head_dim 128, `--layers` layers of `--heads` heads (the full 40 x 40 does not fit a
small CPU machine), tiers `QuantConfig.compact(sink_format="int4", recent_format="int4")`, run for `--chunks`
chunks in the planner's call pattern (advance, denoise rewrites, clean pass). `--quick`: 1 layer, 2 heads, 256
tokens per frame, 3 chunks. Measured (nothing hard-coded):

1. `SessionManager.fork` at a chunk boundary: ms per layer (median of `--repeats` forks, each closed again), bytes
   copied (the arena compared byte for byte before/after, and `stats().used_pages` before/after: 0 expected); then
   the first advance of the parent and of the branch (pages copied by copy-on-write: 0 expected at a boundary);
   then a mid-chunk fork (after the advance) followed by a rewrite on the branch: pages copied, vs the pages of the
   shared current chunk.
2. 8 branches forked from one session, each diverging by one chunk, vs 8 independent sessions that ran the same
   calls: pool pages and bytes held (`pool.stats()`), the ratio, and the planner's peak for the independent case
   (`planned_session_pages`, the planner's replay; compared with the measured high water).
3. `swap_out` / `swap_in` of one session to a host `BlockPool` (device="cpu" too here: CPU-to-CPU copies, not a
   PCIe transfer): bytes moved and GB/s each way; views after the round trip must be `torch.equal` to before
   (exits non-zero otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

import pagedqvg.cache.paged_cache as paged_cache
from pagedqvg import BlockPool
from pagedqvg.planning.presets import get_preset
from pagedqvg.quant import QuantConfig
from pagedqvg.serving.sessions import SessionManager, SessionSpec, _current_chunk_pages, planned_session_pages

BRANCHES = 8
COPIES = {"pages": 0}


def _count_copies() -> None:
    """Count the pages copy-on-write copies (each copy drops this cache's hold on one shared page)."""
    inner = paged_cache.unshare_rows

    def counted(cache, lo, hi):
        before = cache.pool.shared_pages_of(cache.owner)
        out = inner(cache, lo, hi)
        COPIES["pages"] += before - cache.pool.shared_pages_of(cache.owner)
        return out

    paged_cache.unshare_rows = counted


def make_spec(layers: int, heads: int, tpf: int) -> SessionSpec:
    w = get_preset("lingbot-world")
    sink = w.sink_frames * tpf
    return SessionSpec(
        layers=layers, batch_size=1, cache_size=sink + w.window_frames * tpf, num_heads=heads, head_dim=w.head_dim,
        chunk_tokens=w.chunk_frames * tpf, sink_tokens=sink, global_sink_tokens=sink if w.global_sink else 0,
        denoise_steps=w.denoise_steps, quant=QuantConfig.compact(sink_format="int4", recent_format="int4"),
    )  # fmt: skip


def kv_of(spec: SessionSpec, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    shape = (1, spec.chunk_tokens, spec.num_heads, spec.head_dim)
    return torch.randn(shape, generator=g).to(torch.bfloat16), torch.randn(shape, generator=g).to(torch.bfloat16)


def call(session, spec: SessionSpec, k: int, steps: int | None = None) -> None:
    """Chunk `k`'s calls (or its first `steps` calls) on every cache of `session`."""
    key, value = kv_of(spec, k)
    for _ in range(spec.denoise_steps + 1 if steps is None else steps):
        for cache in (c for cs in session.caches for c in cs):
            cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=k * spec.chunk_tokens)


def views(session) -> list[torch.Tensor]:
    """Every cache's slots as read for a view (the cache's own readout; changes nothing), cloned."""
    return [c._read_slots("bench_forks").clone() for cs in session.caches for c in cs]


def fork_figures(spec: SessionSpec, chunks: int, repeats: int, page_bytes: int) -> dict[str, object]:
    pool = BlockPool(capacity_bytes=2 * planned_session_pages(spec, page_bytes) * page_bytes + (64 << 20),
                     page_bytes=page_bytes)  # fmt: skip
    mgr = SessionManager(pool)
    s = mgr.open(spec, name="parent")
    for k in range(chunks):
        call(s, spec, k)
    times = []
    for _ in range(repeats):
        arena, used = pool.arena.clone(), pool.stats().used_pages
        t0 = time.perf_counter()
        b = mgr.fork(s, name="branch")
        times.append((time.perf_counter() - t0) * 1e3 / spec.layers)
        changed = int((pool.arena != arena).sum())
        used_delta = pool.stats().used_pages - used
        shared = pool.stats().shared_pages
        b.close()
    b = mgr.fork(s, name="branch")
    COPIES["pages"] = 0
    call(s, spec, chunks, steps=1)
    parent_adv = COPIES["pages"]
    COPIES["pages"] = 0
    call(b, spec, chunks, steps=1)
    branch_adv = COPIES["pages"]
    b.close()
    mid = mgr.fork(s, name="mid")  # mid-chunk: after the advance, before the rewrites
    chunk_pages = _current_chunk_pages(mid.caches)
    COPIES["pages"] = 0
    call(mid, spec, chunks, steps=1)  # a rewrite of the shared current chunk
    mid_copied = COPIES["pages"]
    mid.close()
    s.close()
    pool.check()
    return dict(
        fork_ms_per_layer=round(statistics.median(times), 3), fork_repeats=repeats,
        fork_arena_bytes_changed=changed, fork_used_pages_delta=used_delta, fork_shared_pages=shared,
        first_advance_pages_copied_parent=parent_adv, first_advance_pages_copied_branch=branch_adv,
        mid_chunk_rewrite_pages_copied=mid_copied, mid_chunk_current_chunk_pages=chunk_pages,
    )  # fmt: skip


def branch_figures(spec: SessionSpec, chunks: int, page_bytes: int) -> dict[str, object]:
    planned = planned_session_pages(spec, page_bytes)
    pool = BlockPool(capacity_bytes=(BRANCHES + 1) * planned * page_bytes, page_bytes=page_bytes)
    mgr = SessionManager(pool)
    root = mgr.open(spec, name="root")
    for k in range(chunks):
        call(root, spec, k)
    branches = [mgr.fork(root, name=f"b{i}") for i in range(BRANCHES)]
    root.close()  # the branches hold the history
    for i, b in enumerate(branches):
        key_chunk = chunks  # each branch's own chunk (own data: seed by branch)
        key, value = kv_of(spec, 1000 + i)
        for _ in range(spec.denoise_steps + 1):
            for cache in (c for cs in b.caches for c in cs):
                cache.update_and_get_attention_kv(key=key, value=value,
                                                  current_chunk_start=key_chunk * spec.chunk_tokens)  # fmt: skip
    forked = pool.stats()
    for b in branches:
        b.close()
    pool.check()
    pool.reset_high_water()
    indep = []
    for i in range(BRANCHES):
        s = mgr.open(spec, name=f"s{i}")
        for k in range(chunks):
            call(s, spec, k)
        key, value = kv_of(spec, 1000 + i)
        for _ in range(spec.denoise_steps + 1):
            for cache in (c for cs in s.caches for c in cs):
                cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=chunks * spec.chunk_tokens)
        indep.append(s)
    alone = pool.stats()
    for s in indep:
        s.close()
    pool.check()
    planned_run = planned_session_pages(dataclasses.replace(spec, chunks=chunks + 1), page_bytes)
    return dict(
        branches=BRANCHES, forked_pages=forked.used_pages, forked_bytes=forked.held_bytes,
        forked_shared_pages=forked.shared_pages, independent_pages=alone.used_pages,
        independent_bytes=alone.held_bytes, independent_over_forked=round(alone.used_pages / forked.used_pages, 2),
        planned_pages_per_session=planned_run, planned_pages_independent=BRANCHES * planned_run,
        independent_high_water_pages=alone.high_water_pages,
    )  # fmt: skip


def swap_figures(spec: SessionSpec, chunks: int, page_bytes: int) -> dict[str, object]:
    planned = planned_session_pages(spec, page_bytes)
    pool = BlockPool(capacity_bytes=planned * page_bytes, page_bytes=page_bytes)
    host = BlockPool(capacity_bytes=planned * page_bytes, page_bytes=page_bytes, device="cpu")
    mgr = SessionManager(pool, host_pool=host)
    s = mgr.open(spec)
    for k in range(chunks):
        call(s, spec, k)
    before = views(s)
    t0 = time.perf_counter()
    out_pages = mgr.swap_out(s)
    t1 = time.perf_counter()
    in_pages = mgr.swap_in(s)
    t2 = time.perf_counter()
    after = views(s)
    equal = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    s.close()
    pool.check()
    host.check()
    nbytes = out_pages * page_bytes
    return dict(
        swap_pages=out_pages, swap_bytes=nbytes, swap_out_s=round(t1 - t0, 4), swap_in_s=round(t2 - t1, 4),
        swap_out_GBps=round(nbytes / (t1 - t0) / 1e9, 2),
        swap_in_GBps=round(in_pages * page_bytes / (t2 - t1) / 1e9, 2),
        swap_copy="CPU-to-CPU (host pool and device pool both in host memory)", views_equal_after_round_trip=equal,
    )  # fmt: skip


def run(quick: bool, layers: int, heads: int, chunks: int, repeats: int) -> dict[str, object]:
    w = get_preset("lingbot-world")
    tpf = 256 if quick else w.tokens_per_frame
    spec = make_spec(1 if quick else layers, 2 if quick else heads, tpf)
    chunks = 3 if quick else chunks
    page_bytes = BlockPool.for_layers(1 << 20, num_heads=spec.num_heads, head_dim=spec.head_dim,
                                      chunk_tokens=spec.chunk_tokens, quant=spec.quant).page_bytes  # fmt: skip
    _count_copies()
    out: dict[str, object] = dict(
        shape=f"lingbot-world, {spec.layers} layers x {spec.num_heads} heads x {spec.head_dim}, {tpf} tokens/frame, "
        f"chunk {spec.chunk_tokens} tokens, {chunks} chunks, compact(sink int4, recent int4)",
        quick=quick, page_bytes=page_bytes, threads=torch.get_num_threads(),
    )  # fmt: skip
    t0 = time.perf_counter()
    out.update(fork_figures(spec, chunks, repeats, page_bytes))
    out.update(branch_figures(spec, chunks, page_bytes))
    out.update(swap_figures(spec, chunks, page_bytes))
    out["planned_equals_measured_high_water"] = out["planned_pages_independent"] == out["independent_high_water_pages"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 layer, 2 heads, 256 tokens per frame, 3 chunks")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    out = run(args.quick, args.layers, args.heads, args.chunks, args.repeats)
    print("| figure | value |\n|---|---|")
    for k, v in out.items():
        print(f"| {k} | {v:,} |" if isinstance(v, int) and not isinstance(v, bool) else f"| {k} | {v} |")
    if args.json:
        with open(args.json, "w", encoding="ascii") as fh:
            json.dump(out, fh, indent=1)
    ok = out["views_equal_after_round_trip"] and out["fork_arena_bytes_changed"] == out["fork_used_pages_delta"] == 0
    if not ok:
        print("FAILED: views differ after the swap round trip, or a fork copied bytes", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
