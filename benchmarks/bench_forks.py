"""Copy-on-write forks and the host tier on LingBot-World's shape, CPU.

    python benchmarks/bench_forks.py [--quick] [--fork-layers 1] [--fork-heads 40] [--fork-tokens-per-frame 1560]
        [--layers 1] [--heads 2] [--tokens-per-frame 256] [--denoise-steps 1] [--repeats 3] [--json PATH]

The session: `get_preset("lingbot-world")` (1,560 tokens per frame, chunks of 3 frames, a 3-frame sink, an 18-frame
window, 4 denoise steps), head_dim 128, the recommended tiers `QuantConfig.compact(sink_format="int4",
recent_format="int4")`, run in the planner's call pattern (advance, denoise rewrites, clean pass) to its steady state
(the planner's warm-up: 7 chunks, aged chunks packed) before any fork. `--quick`: 64 tokens per frame, 2 heads.
Measured (nothing hard-coded):

1. At the full shape (40 heads x 128, 1,560 tokens per frame) for `--fork-layers` layers (all 40 do not fit this
   machine's CPU time; the fork is metadata only, so ms per layer is the figure): `SessionManager.fork` at a chunk
   boundary, ms per layer (median of `--repeats` forks, each closed again) and bytes copied (the arena compared byte
   for byte before/after, and `stats().used_pages` before/after: 0 expected); then the first advance of the parent
   and of the branch (pages copied by copy-on-write: 0 expected at a boundary); then a mid-chunk fork (after the
   advance) followed by a rewrite on the branch: pages copied, vs the pages of the shared current chunk.
2. 8 branches of one session (the session and 7 forks) each diverging by one chunk, vs 8 independent sessions, at
   `--layers` x `--heads`: the branches planned by the planner's replay with shared pages
   (pagedqvg/planning/branches.py) and measured through `SessionManager.fork` (pagedqvg/cli/fork_sim.py): pool
   pages after every call, the peak, shared and exclusive pages, planned == measured; the 8 independent sessions in
   step measured on real caches (planning/stagger.py with stagger 0) against the planner's census; then the full
   40-layer shape by the planner only.
3. `swap_out` / `swap_in` of one session to a host `BlockPool` (device="cpu" too here: CPU-to-CPU copies, not a
   PCIe transfer): bytes moved and GB/s each way; views after the round trip must be `torch.equal` to before.

Exits 1 if a fork copies a byte, a swapped view differs, or a planned figure differs from the measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
from figures import report_figures

import pagedqvg.cache.paged_cache as paged_cache
from pagedqvg import BlockPool
from pagedqvg.cli.fork_sim import measure_branches, measure_independent, session_spec
from pagedqvg.planning.branches import branches_report, default_history
from pagedqvg.planning.geometry import Geometry
from pagedqvg.planning.presets import RECOMMENDED_TIERS, get_preset
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


def make_geometry(layers: int, heads: int, tpf: int) -> Geometry:
    """LingBot-World's geometry at `layers` x `heads` x 128 and `tpf` tokens per frame, the recommended tiers, on the
    page size `layout.choose_page_bytes` picks for it."""
    w = get_preset("lingbot-world")
    w = dataclasses.replace(w, layers=layers, heads=heads, tokens_per_frame=tpf, quant=RECOMMENDED_TIERS[w.name])
    return Geometry.from_workload(w)


def make_spec(geom: Geometry, chunks: int | None = None) -> SessionSpec:
    return session_spec(geom, chunks)


def kv_of(spec: SessionSpec, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    shape = (1, spec.chunk_tokens, spec.num_heads, spec.head_dim)
    return torch.randn(shape, generator=g).to(torch.bfloat16), torch.randn(shape, generator=g).to(torch.bfloat16)


def call(session, spec: SessionSpec, k: int, steps: int | None = None, recent: int | None = None) -> None:
    """Chunk `k`'s calls (or its first `steps` calls) on every cache of `session` (`recent`: the views'
    `recent_window_tokens`, a read selection that changes no page)."""
    key, value = kv_of(spec, k)
    for _ in range(spec.denoise_steps + 1 if steps is None else steps):
        for cache in (c for cs in session.caches for c in cs):
            cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=k * spec.chunk_tokens,
                                              recent_window_tokens=recent)  # fmt: skip


def views(session) -> list[torch.Tensor]:
    """Every cache's slots as read for a view (the cache's own readout; changes nothing), cloned."""
    return [c._read_slots("bench_forks").clone() for cs in session.caches for c in cs]


def fork_figures(spec: SessionSpec, chunks: int, repeats: int, page_bytes: int) -> dict[str, object]:
    pool = BlockPool(capacity_bytes=2 * planned_session_pages(spec, page_bytes) * page_bytes + (64 << 20),
                     page_bytes=page_bytes)  # fmt: skip
    mgr = SessionManager(pool)
    s = mgr.open(spec, name="parent")
    # the history by advances only, each viewing the sink and the chunk (recent_window_tokens=0): a rewrite of the
    # current chunk takes no page and the view is a read selection, so the pages and segments at each chunk boundary
    # are the full pattern's, at a fraction of the CPU time (the packing of aged chunks runs as always)
    for k in range(chunks):
        call(s, spec, k, steps=1, recent=0)
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
    direct = []
    for _ in range(repeats):  # PagedCausalKVCache.fork itself, layer by layer (no admission)
        for c in (c for cs in s.caches for c in cs):
            t0 = time.perf_counter()
            f = c.fork(name="direct")
            direct.append((time.perf_counter() - t0) * 1e3)
            f.close()
    b = mgr.fork(s, name="branch")
    COPIES["pages"] = 0
    call(s, spec, chunks, steps=1, recent=0)
    parent_adv = COPIES["pages"]
    COPIES["pages"] = 0
    call(b, spec, chunks, steps=1, recent=0)
    branch_adv = COPIES["pages"]
    b.close()
    mid = mgr.fork(s, name="mid")  # mid-chunk: after the advance, before the rewrites
    chunk_pages = _current_chunk_pages(mid.caches)
    COPIES["pages"] = 0
    call(mid, spec, chunks, steps=1, recent=0)  # a rewrite of the shared current chunk
    mid_copied = COPIES["pages"]
    mid.close()
    s.close()
    pool.check()
    return dict(
        fork_ms_per_layer=round(statistics.median(times), 3), fork_repeats=repeats,
        cache_fork_ms_per_layer=round(statistics.median(direct), 3),
        fork_arena_bytes_changed=changed, fork_used_pages_delta=used_delta, fork_shared_pages=shared,
        first_advance_pages_copied_parent=parent_adv, first_advance_pages_copied_branch=branch_adv,
        mid_chunk_rewrite_pages_copied=mid_copied, mid_chunk_current_chunk_pages=chunk_pages,
    )  # fmt: skip


def branch_figures(geom: Geometry, full: Geometry) -> dict[str, object]:
    """8 branches vs 8 independent sessions: planned (planning/branches.py) == measured (SessionManager.fork) at
    `geom`, the independent sessions in step measured too; `full` (40 layers) by the planner only."""
    history = default_history(geom)
    doc = measure_branches(geom, BRANCHES, 1, history)
    end, ind = doc["end"], doc["independent"]
    alone = measure_independent(geom, BRANCHES, history + 1)
    ind_measured_end, measured_peak = alone["pages"], alone["high_water_pages"]
    ind_end, ind_peak = alone["planned_pages"], alone["planned_high_water_pages"]
    assert ind["pages"] == ind_end
    big = branches_report(full, BRANCHES, 1)
    return dict(
        branches=BRANCHES, branch_history_chunks=history, branch_history_pages=doc["history"]["pages"],
        branch_history_packed_pages=doc["history"]["packed_pages"],
        forked_pages=doc["measured_pages"], forked_planned_pages=end["pages"], forked_bytes=end["bytes"],
        forked_shared_pages=doc["measured_shared_pages"], forked_planned_shared_pages=end["shared_pages"],
        forked_exclusive_pages_per_branch=doc["measured_exclusive_pages"][0],
        forked_high_water_pages=doc["measured_high_water_pages"],
        forked_planned_high_water_pages=doc["high_water_pages"],
        forked_plan_mismatching_calls=doc["mismatches"], forked_plan_figures_equal=doc["figures_equal"],
        independent_pages=ind_measured_end, independent_planned_pages=ind_end,
        independent_bytes=ind_measured_end * geom.page_bytes,
        independent_high_water_pages=measured_peak, independent_planned_high_water_pages=ind_peak,
        independent_over_forked=round(ind_measured_end / doc["measured_pages"], 2),
        full_shape=f"lingbot-world, 40 layers x 40 heads x 128, {full.page_bytes:,} B pages (planner only)",
        full_history_pages=big["history"]["pages"], full_history_bytes=big["history"]["bytes"],
        full_forked_pages=big["end"]["pages"], full_forked_bytes=big["end"]["bytes"],
        full_shared_bytes=big["end"]["shared_bytes"], full_exclusive_bytes_per_branch=big["end"]["exclusive_bytes"][0],
        full_forked_high_water_bytes=big["high_water_bytes"], full_independent_bytes=big["independent"]["bytes"],
        full_independent_high_water_bytes=big["independent"]["high_water_bytes"],
        full_independent_over_forked=big["independent_over_branches"],
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


def run(args: argparse.Namespace) -> dict[str, object]:
    w = get_preset("lingbot-world")
    if args.quick:
        args.fork_heads, args.fork_tokens_per_frame, args.tokens_per_frame = 2, 64, 64
    full = make_geometry(args.fork_layers, args.fork_heads, args.fork_tokens_per_frame)  # the fork figures' shape
    small = dataclasses.replace(make_geometry(args.layers, args.heads, args.tokens_per_frame),
                                denoise_steps=args.denoise_steps)  # fmt: skip
    _count_copies()
    out: dict[str, object] = dict(
        fork_shape=f"lingbot-world, {args.fork_layers} layer(s) x {full.heads} heads x {full.head_dim}, "
        f"{args.fork_tokens_per_frame} tokens/frame, chunk {full.chunk_tokens} tokens, compact(sink int4, recent "
        f"int4), {full.page_bytes:,} B pages",
        shape=f"lingbot-world, {args.layers} layer(s) x {small.heads} heads x {small.head_dim}, "
        f"{args.tokens_per_frame} tokens/frame, {small.denoise_steps} denoise step(s), compact(sink int4, recent "
        f"int4), {small.page_bytes:,} B pages",
        quick=args.quick, threads=torch.get_num_threads(),
    )  # fmt: skip
    t0 = time.perf_counter()
    history = default_history(full)
    out["fork_after_chunks"] = history
    out.update(fork_figures(make_spec(full), history, args.repeats, full.page_bytes))
    out["fork_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"fork figures done in {out['fork_seconds']} s", file=sys.stderr, flush=True)
    # the pages do not depend on the denoise steps (a rewrite takes none): the plan at LingBot-World's 4 equals 1's
    four = branches_report(dataclasses.replace(small, denoise_steps=w.denoise_steps), BRANCHES, 1)
    one = branches_report(small, BRANCHES, 1)
    out["planned_pages_equal_at_4_denoise_steps"] = all(four[k] == one[k] for k in ("history", "end", "independent"))
    out.update(branch_figures(small, make_geometry(w.layers, w.heads, w.tokens_per_frame)))
    print(f"branch figures done in {round(time.perf_counter() - t0, 1)} s", file=sys.stderr, flush=True)
    out.update(swap_figures(make_spec(small), default_history(small), small.page_bytes))
    out["planned_equals_measured"] = bool(
        out["forked_plan_mismatching_calls"] == 0 and out["forked_plan_figures_equal"]
        and out["independent_pages"] == out["independent_planned_pages"]
        and out["independent_high_water_pages"] == out["independent_planned_high_water_pages"]
        and out["planned_pages_equal_at_4_denoise_steps"]
    )  # fmt: skip
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 heads and 64 tokens per frame everywhere (a smoke run)")
    ap.add_argument("--fork-layers", type=int, default=1, help="layers of the full-shape session the fork times")
    ap.add_argument("--fork-heads", type=int, default=40, help="heads of that session (LingBot-World's 40)")
    ap.add_argument("--fork-tokens-per-frame", type=int, default=1560, help="its tokens per frame (1,560)")
    ap.add_argument("--layers", type=int, default=1, help="layers of the branches-vs-sessions and swap runs")
    ap.add_argument("--heads", type=int, default=2, help="heads of those runs")
    ap.add_argument("--tokens-per-frame", type=int, default=256, help="tokens per frame of those runs")
    ap.add_argument("--denoise-steps", type=int, default=1, help="denoise steps of those runs (pages do not depend "
                    "on them: the plan at 4 is checked equal)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    out = run(args)
    report_figures(out, args.json)
    ok = out["views_equal_after_round_trip"] and out["fork_arena_bytes_changed"] == out["fork_used_pages_delta"] == 0
    if not ok or not out["planned_equals_measured"]:
        print(
            "FAILED: a fork copied bytes, views differ after the swap round trip, or plan != measured", file=sys.stderr
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
