"""The host tier under a realtime-style load: long-lived sessions, idle most of the time, called at random.

    python benchmarks/bench_host_tier.py [--sessions 10000] [--calls 2000] [--device-sessions 16] [--host-factor 2]
        [--layers 2] [--heads 1] [--tpf 2] [--seed 0] [--sample 8] [--transfer-mib 32] [--device cpu|cuda]
        [--json PATH]

Sessions of a small LingBot-World-like shape (`get_preset("lingbot-world")`'s frames: chunks of 3 frames, a
3-frame sink, an 18-frame window; `--tpf` tokens per frame, `--layers` layers of `--heads` heads x 128, bf16) on a
device pool of budget B = `--device-sessions` planned session peaks (`SessionManager.planned_pages`). Each session,
when opened, runs chunks until its window is full (a realtime session's first calls), then stays open for good.
A call is one chunk: `update_and_get_attention_kv` of the next chunk on every layer (real PagedCausalKVCache calls).

Two runs on the same seeded schedule (measured, nothing hard-coded):
1. plain admission (no host tier): `--sessions` opens, each refused once the device is full; then `--calls` calls
   on sessions picked at random among the open ones;
2. a host tier of `--host-factor` x B (`SessionManager(host_pool=..., swap_when_full=True)`): the same opens (an open
   that does not fit swaps idle sessions out, least recently used first) and calls (a call of a parked session
   brings it back, swapping another out).
Printed: sessions open in each run and their ratio (target >= 3 at a host tier of 2 x B), calls served, swap-outs and
swap-ins, mean and max swap-in wait (ms), swap GB/s (pages moved / seconds in page moves), leaked pages on both pools
after closing everything (0), `pool.check()`; and a sample of `--sample` sessions of run 2 driven by a never-swapped
twin (same calls on a pool of their own): every view `torch.equal`. Exits 1 if any check fails.

`--device cuda` (not yet run: no GPU here) puts the device pool on CUDA and the host pool in pinned memory, and adds a
transfer figure: one session of `--transfer-mib` MiB swapped out and in with `torch.cuda.synchronize()` around each,
GB/s each way against the PCIe Gen5 x16 reference peak of ~64 GB/s per direction. On CPU the same figure is a
CPU-to-CPU copy between two arenas.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from figures import report_figures

from pagedqvg import BlockPool
from pagedqvg.errors import SessionRefusedError
from pagedqvg.planning.presets import get_preset
from pagedqvg.quant import QuantConfig
from pagedqvg.serving.sessions import SessionManager, SessionSpec

PCIE_GEN5_X16_GBPS = 64.0  # per direction, the reference peak
RESULT = Path(__file__).resolve().parent / "results" / "host_tier.json"


def make_spec(layers: int, heads: int, tpf: int, quant: bool = False) -> SessionSpec:
    w = get_preset("lingbot-world")
    sink = w.sink_frames * tpf
    return SessionSpec(
        layers=layers, batch_size=1, cache_size=sink + w.window_frames * tpf, num_heads=heads, head_dim=w.head_dim,
        chunk_tokens=w.chunk_frames * tpf, sink_tokens=sink, global_sink_tokens=sink if w.global_sink else 0,
        denoise_steps=1, quant=QuantConfig.compact(sink_format="int4", recent_format="int4") if quant else None,
    )  # fmt: skip


def warm_chunks(spec: SessionSpec) -> int:
    """Chunks until the window is full (a realtime session's first calls)."""
    return -(-spec.cache_size // spec.chunk_tokens)


def chunk_kv(spec: SessionSpec, sid: int, k: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(sid * 100_003 + k)
    kv = torch.randn(2, 1, spec.chunk_tokens, spec.num_heads, spec.head_dim, generator=g).to(torch.bfloat16)
    return kv.to(device)


def call(session, spec: SessionSpec, sid: int, k: int, device: torch.device) -> None:
    """Chunk `k` of session `sid`: one advance on every layer."""
    kv = chunk_kv(spec, sid, k, device)
    for cache in (c for cs in session.caches for c in cs):
        cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=k * spec.chunk_tokens)


def views(session) -> list[torch.Tensor]:
    return [c._read_slots("bench").cpu() for cs in session.caches for c in cs]


def load(spec: SessionSpec, args, pool: BlockPool, host_pages: int, device: torch.device) -> dict[str, object]:
    """One run of the load (module docstring); `host_pages` 0: plain admission."""
    page = pool.page_bytes
    host = host_pages * page if host_pages else None
    mgr = SessionManager(pool, host_pool=host, swap_when_full=bool(host))
    rng = random.Random(args.seed)
    opened: list[tuple[int, object]] = []  # (schedule id, session)
    chunks: dict[int, int] = {}
    refused = 0
    t0 = time.perf_counter()
    for sid in range(args.sessions):
        try:
            s = mgr.open(spec, name=f"s{sid}")
        except SessionRefusedError:
            refused += 1
            continue
        for k in range(warm_chunks(spec)):
            call(s, spec, sid, k, device)
        chunks[sid] = warm_chunks(spec)
        opened.append((sid, s))
    t_open = time.perf_counter() - t0
    served = 0
    log: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for _ in range(args.calls):
        sid, s = opened[rng.randrange(len(opened))]
        call(s, spec, sid, chunks[sid], device)
        log.setdefault(sid, []).append(chunks[sid])
        chunks[sid] += 1
        served += 1
    t_calls = time.perf_counter() - t0
    out: dict[str, object] = dict(
        sessions_open=len(opened), open_refused=refused, calls_served=served, open_s=round(t_open, 2),
        calls_s=round(t_calls, 2), resident_at_end=len(mgr._lru),
    )  # fmt: skip
    if host:
        moved = (mgr.swapped_out_pages + mgr.swapped_in_pages) * page
        out.update(
            swapped_out=mgr.swapped_out_total, swapped_in=mgr.swapped_in_total,
            swap_in_wait_ms_mean=round(1e3 * mgr.swap_in_wait_s_total / max(1, mgr.swapped_in_total), 3),
            swap_in_wait_ms_max=round(1e3 * mgr.swap_in_wait_s_max, 3),
            swap_bytes=moved, swap_GBps=round(moved / max(mgr.swap_s_total, 1e-9) / 1e9, 3),
            host_pages=host_pages,
        )  # fmt: skip
        out["twin_sample"], out["twin_views_equal"] = twin_check(spec, args, opened, log, device)
    pool.check()
    if mgr.host_pool is not None:
        mgr.host_pool.check()
    mgr.close_all()
    out["leaked_device_pages"] = pool.stats().used_pages
    out["leaked_host_pages"] = mgr.host_pool.stats().used_pages if mgr.host_pool is not None else 0
    pool.check()
    return out


def twin_check(spec: SessionSpec, args, opened, log, device) -> tuple[int, bool]:
    """`--sample` sessions of the run (a seeded pick) against twins that received the same calls on a pool of their
    own and were never swapped: every view torch.equal (reading a parked session's views brings it back)."""
    rng = random.Random(args.seed + 1)
    sample = rng.sample(opened, min(args.sample, len(opened)))
    page = opened[0][1].manager.pool.page_bytes
    planned = opened[0][1].planned_pages
    twins = SessionManager(BlockPool(capacity_bytes=2 * planned * page, page_bytes=page, device=device))
    equal = True
    for sid, s in sample:
        t = twins.open(spec, name=f"twin{sid}")
        for k in range(warm_chunks(spec)):
            call(t, spec, sid, k, device)
        for k in log.get(sid, []):
            call(t, spec, sid, k, device)
        equal &= all(torch.equal(x, y) for x, y in zip(views(s), views(t), strict=True))
        t.close()
    return len(sample), equal


def transfer(spec: SessionSpec, args, device: torch.device) -> dict[str, object]:
    """One session of about `--transfer-mib` MiB (its own page size, as `BlockPool.for_layers` picks for its chunk)
    swapped out and in (synchronized): GB/s each way."""
    tpf = max(1, args.transfer_mib * (1 << 20) // (2 * 2 * spec.num_heads * spec.head_dim * 21 * spec.layers))
    big = make_spec(spec.layers, spec.num_heads, tpf, args.quant)
    page = BlockPool.for_layers(args.transfer_mib << 21, num_heads=big.num_heads, head_dim=big.head_dim,
                                chunk_tokens=big.chunk_tokens, quant=big.quant).page_bytes  # fmt: skip
    probe = BlockPool(capacity_bytes=page, page_bytes=page)
    need = SessionManager(probe).planned_pages(big)
    pool = BlockPool(capacity_bytes=need * page, page_bytes=page, device=device)
    mgr = SessionManager(pool, host_pool=need * page)
    s = mgr.open(big)
    for k in range(warm_chunks(big)):
        call(s, big, 0, k, device)
    before = views(s)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    pages = mgr.swap_out(s)
    sync()
    t1 = time.perf_counter()
    mgr.swap_in(s)
    sync()
    t2 = time.perf_counter()
    nbytes = pages * page
    equal = all(torch.equal(x, y) for x, y in zip(views(s), before, strict=True))
    mgr.close_all()
    out = dict(
        transfer_bytes=nbytes, transfer_page_bytes=page, transfer_out_GBps=round(nbytes / (t1 - t0) / 1e9, 3),
        transfer_in_GBps=round(nbytes / (t2 - t1) / 1e9, 3), transfer_views_equal=equal,
        host_pinned=mgr.host_pool.pinned,
    )  # fmt: skip
    if device.type == "cuda":
        out["pcie_gen5_x16_peak_GBps"] = PCIE_GEN5_X16_GBPS
        out["transfer_out_vs_peak"] = round(out["transfer_out_GBps"] / PCIE_GEN5_X16_GBPS, 3)
        out["transfer_in_vs_peak"] = round(out["transfer_in_GBps"] / PCIE_GEN5_X16_GBPS, 3)
    return out


def run(args) -> dict[str, object]:
    device = torch.device(args.device)
    spec = make_spec(args.layers, args.heads, args.tpf, args.quant)
    page = BlockPool.for_layers(1 << 20, num_heads=spec.num_heads, head_dim=spec.head_dim,
                                chunk_tokens=spec.chunk_tokens, quant=spec.quant).page_bytes  # fmt: skip
    planned = SessionManager(BlockPool(page, page)).planned_pages(spec)
    budget = args.device_sessions * planned
    out: dict[str, object] = dict(
        shape=f"lingbot-world frames, {spec.layers} layers x {spec.num_heads} heads x {spec.head_dim}, "
        f"{args.tpf} tokens/frame (chunk {spec.chunk_tokens}, window {spec.cache_size} tokens), "
        + ("compact(sink int4, recent int4)" if args.quant else "bf16"),
        device=str(device), page_bytes=page, planned_pages_per_session=planned, device_budget_pages=budget,
        host_factor=args.host_factor, sessions_requested=args.sessions, calls=args.calls, seed=args.seed,
        threads=torch.get_num_threads(),
    )  # fmt: skip
    t0 = time.perf_counter()
    plain = load(spec, args, BlockPool(budget * page, page, device=device), 0, device)
    tier = load(spec, args, BlockPool(budget * page, page, device=device), args.host_factor * budget, device)
    out.update({f"plain_{k}": v for k, v in plain.items()})
    out.update({f"tier_{k}": v for k, v in tier.items()})
    out["sessions_ratio"] = round(tier["sessions_open"] / max(1, plain["sessions_open"]), 3)
    out.update(transfer(spec, args, device))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=10_000, help="opens attempted (each refused once full)")
    ap.add_argument("--calls", type=int, default=2_000, help="calls at random on the open sessions")
    ap.add_argument("--device-sessions", type=int, default=16, help="device budget B in planned session peaks")
    ap.add_argument("--host-factor", type=int, default=2, help="host tier = this x B")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--tpf", type=int, default=2, help="tokens per frame")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=8, help="sessions checked against never-swapped twins")
    ap.add_argument("--transfer-mib", type=int, default=32)
    ap.add_argument("--quant", action="store_true", help="LingBot-World's recommended tiers (compact, int4 sink)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=str(RESULT), help="write the figures here ('' for none)")
    args = ap.parse_args()
    out = run(args)
    report_figures(out, args.json)
    ok = (
        out["tier_calls_served"] == out["plain_calls_served"] == args.calls
        and out["tier_twin_views_equal"] and out["transfer_views_equal"]
        and out["plain_leaked_device_pages"] == out["tier_leaked_device_pages"] == out["tier_leaked_host_pages"] == 0
    )  # fmt: skip
    print(f"sessions open: {out['tier_sessions_open']} with a host tier of {args.host_factor} x B vs "
          f"{out['plain_sessions_open']} without: {out['sessions_ratio']}x (target >= 3x)")  # fmt: skip
    if not ok:
        print("FAILED: a call not served, a view differs from its twin, or pages leaked", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
