"""pagedqvg side by side with the designs it replaces (benchmarks/baselines.py), on the same data, in one process.

    python benchmarks/bench_vs_baselines.py [--quick] [--out benchmarks/results]

Prints Markdown tables and writes `<out>/vs_baselines.md` and `<out>/vs_baselines.json`. Times are medians of
repeated runs (noisy on shared machines: read the ratios, not the absolute numbers); bytes and allocation counts
are exact. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import DenseCache, SegmentListCache

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.planning.synthetic import video_kv

SHAPES = {
    # per-layer shapes of SEMANTICS.md with heads and tokens/frame scaled to a 2-core CPU
    "lingbot-like": dict(heads=4, head_dim=128, tpf=390, chunk_frames=3, sink_frames=3, window_frames=18),
    "longlive2-like": dict(heads=4, head_dim=128, tpf=220, chunk_frames=8, sink_frames=8, window_frames=32),
}
QUANTS = {"off": None, "int4": QuantConfig(bits=4), "int2": QuantConfig(bits=2)}


class AllocationCounter(TorchDispatchMode):
    """Counts tensors allocated by torch ops (new storages, not views) and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = set()
        for a in [*args, *kwargs.values()]:
            for t in a if isinstance(a, (list, tuple)) else [a]:
                if isinstance(t, torch.Tensor):
                    seen.add(t.untyped_storage().data_ptr())
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.count += 1
                self.bytes += t.untyped_storage().nbytes()
        return out


def peak_transient_bytes(fn) -> int:
    """Peak bytes of live tensors allocated during `fn()` (its result included), from the profiler's allocation
    and free events in time order (CPU; on CUDA use torch.cuda.max_memory_allocated)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    del result
    return peak


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def geometry(shape: dict) -> dict:
    tpf = shape["tpf"]
    chunk = shape["chunk_frames"] * tpf
    sink = shape["sink_frames"] * tpf
    cache_size = sink + shape["window_frames"] * tpf
    return dict(chunk=chunk, sink=sink, cache_size=cache_size)


def build(kind: str, shape: dict, quant, pool=None):
    g = geometry(shape)
    common = dict(batch_size=1, cache_size=g["cache_size"], num_heads=shape["heads"], head_dim=shape["head_dim"],
                  dtype=torch.bfloat16, device="cpu", sink_tokens=g["sink"], global_sink_tokens=g["sink"])
    if kind == "dense":
        return DenseCache(**common)
    if kind == "segment-list":
        return SegmentListCache(quant=quant, **common)
    return PagedCausalKVCache(pool=pool, quant=quant, **common)


def fill(cache, k, v, chunk: int, chunks: int) -> None:
    for c in range(chunks):
        s = c * chunk
        cache.update_and_get_attention_kv(key=k[:, s : s + chunk], value=v[:, s : s + chunk], current_chunk_start=s)


def bench_view(shape_name: str, quant_name: str, repeats: int) -> dict:
    shape, quant = SHAPES[shape_name], QUANTS[quant_name]
    g = geometry(shape)
    chunks = shape["window_frames"] // shape["chunk_frames"] + 3  # window full, rolled at least twice
    k, v = video_kv(chunks * shape["chunk_frames"], shape["tpf"], shape["heads"], shape["head_dim"], seed=0)
    pool = BlockPool(capacity_bytes=1 << 30, page_bytes=1 << 20)
    impls = {"pagedqvg": build("paged", shape, quant, pool), "segment-list": build("segment-list", shape, quant)}
    if quant is None:
        impls["dense"] = build("dense", shape, None)
    row = {"shape": shape_name, "quant": quant_name}
    s = (chunks - 1) * g["chunk"]
    key, value = k[:, s : s + g["chunk"]], v[:, s : s + g["chunk"]]
    for name, cache in impls.items():
        fill(cache, k, v, g["chunk"], chunks)

        def call(cache=cache):
            return cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=s)

        row[f"{name}_ms"] = median_time(call, repeats) * 1e3
        with AllocationCounter() as counter:
            out = call()
        view_k = out.k if hasattr(out, "k") else out[0]
        row[f"{name}_allocs"] = counter.count
        row[f"{name}_alloc_bytes"] = counter.bytes
        row[f"{name}_peak_bytes"] = peak_transient_bytes(call)
        row["view_bytes"] = 2 * view_k.numel() * view_k.element_size()
    return row


def sglang_qvg_bf16(shape: dict):
    """SGLang 0.5.23's `QVGPackedCausalKVCache` with quantization off (bf16 segments), or None when SGLang's sources
    are not importable (put the extracted wheel on PYTHONPATH, with `.ci` for its placeholder modules, as
    .ci/sglang_suite.sh does; bench_cpu_views.py's header)."""
    try:
        with contextlib.suppress(ImportError):
            import sglang_plugin  # noqa: F401  (.ci: placeholder modules for SGLang's heavy imports)
        from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
        from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import QVGPackedCausalKVCache
    except ImportError:
        return None
    g = geometry(shape)
    return QVGPackedCausalKVCache(batch_size=1, cache_size=g["cache_size"], num_heads=shape["heads"],
                                  head_dim=shape["head_dim"], dtype=torch.bfloat16, device=torch.device("cpu"),
                                  global_end_index=torch.zeros(1, dtype=torch.long),
                                  local_end_index=torch.zeros(1, dtype=torch.long), sink_tokens=g["sink"],
                                  quant_args=QVGKVQuantArgs())  # fmt: skip


def bench_host_overhead(repeats: int) -> dict:
    """Tiny tensors: what each call costs on the host (the repeated rewrite of the current chunk), pagedqvg beside
    the dense cache and SGLang's QVG cache (bf16; when importable) in one process; allocations per call counted by
    `AllocationCounter` (tensors on new storage)."""
    shape = dict(heads=2, head_dim=8, tpf=4, chunk_frames=1, sink_frames=1, window_frames=6)
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=4096)
    k, v = video_kv(12, 4, 2, 8, seed=1)
    caches = {"dense": build("dense", shape, None), "sglang-qvg": sglang_qvg_bf16(shape)}
    for name in ("pagedqvg", "pagedqvg-reuse-buffer"):
        caches[name] = build("paged", shape, None, pool)
        caches[name].reuse_view_buffer = name.endswith("buffer")
    row = {}
    for name, cache in caches.items():
        if cache is None:
            continue
        fill(cache, k, v, 4, 10)
        key, value = k[:, 36:40], v[:, 36:40]

        def call(cache=cache, key=key, value=value):
            return cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=36)

        call()
        with AllocationCounter() as counter:
            call()
        row[f"{name}_allocs"] = counter.count
    times: dict[str, list[float]] = {name: [] for name in caches if f"{name}_allocs" in row}
    for _ in range(repeats):  # rounds: every cache once per round, so machine noise hits them alike
        for name in times:
            cache = caches[name]
            times[name].append(median_time(lambda c=cache: [c.update_and_get_attention_kv(
                key=k[:, 36:40], value=v[:, 36:40], current_chunk_start=36) for _ in range(100)], 1) * 1e4)  # fmt: skip
    for name, ts in times.items():
        row[f"{name}_us"] = statistics.median(ts)
    return row


def bench_resident(chunks: int) -> list[dict]:
    """Resident K/V bytes of one layer at the LingBot chunk size (4,680 tokens) over a run of `chunks` chunks, all
    three designs, exact. Heads are scaled from 40 to 2 and pages from 2 MiB to 128 KiB (bytes per head are those of
    the full-size layer; page rounding is not: full-size figures come from `pagedqvg plan`, tested against the pool)."""
    shape = dict(heads=2, head_dim=128, tpf=1560, chunk_frames=3, sink_frames=3, window_frames=18)
    g = geometry(shape)
    rows = []
    k, v = video_kv(chunks * 3, 1560, 2, 128, seed=2)
    for quant_name in ("int2", "int4"):
        quant = QUANTS[quant_name]
        pool = BlockPool(capacity_bytes=1 << 30, page_bytes=128 << 10)
        paged = build("paged", shape, quant, pool)
        seglist = build("segment-list", shape, quant)
        dense = build("dense", shape, None)
        peak = {"pagedqvg": 0, "segment-list": 0}
        for c in range(chunks):
            s = c * g["chunk"]
            for cache in (paged, seglist):
                cache.update_and_get_attention_kv(key=k[:, s : s + g["chunk"]], value=v[:, s : s + g["chunk"]],
                                                  current_chunk_start=s)
            peak["pagedqvg"] = max(peak["pagedqvg"], paged.resident_nbytes())
            peak["segment-list"] = max(peak["segment-list"], seglist.resident_nbytes())
        mb = paged.memory_breakdown()
        rows.append({
            "quant": quant_name, "chunks": chunks, "dense_bytes": dense.resident_nbytes(),
            "pagedqvg_bytes": paged.resident_nbytes(), "pagedqvg_peak_bytes": peak["pagedqvg"],
            "segment_list_bytes": seglist.resident_nbytes(), "segment_list_peak_bytes": peak["segment-list"],
            "pagedqvg_packed_bytes": mb["packed_bytes"], "pagedqvg_dense_bytes": mb["dense_bytes"],
            "packed_tokens": mb["packed_tokens"], "dense_tokens": mb["dense_tokens"],
            "bf16_token_bytes": 2 * shape["heads"] * shape["head_dim"] * 2,
        })
    return rows


def markdown(results: dict, sections: tuple[str, ...] = ("view", "host", "resident")) -> str:
    lines = [f"Machine: {results['machine']}; torch {results['torch']}; {results['date']}", ""]
    if "view" in sections:
        lines += ["### View build per layer call (a rewrite of the current chunk, steady state)", "",
                  "| shape | quant | pagedqvg ms | segment list ms | ratio | dense ms | ratio vs dense | "
                  "tensor allocations per call (paged / seglist / dense) | peak transient bytes (paged / seglist) | "
                  "view bytes |",
                  "|---|---|---:|---:|---:|---:|---:|---|---|---:|"]
        for r in results["view"]:
            dense_ms = r.get("dense_ms")
            lines.append(
                f"| {r['shape']} | {r['quant']} | {r['pagedqvg_ms']:.2f} | {r['segment-list_ms']:.2f} | "
                f"{r['pagedqvg_ms'] / r['segment-list_ms']:.2f}x | "
                + (f"{dense_ms:.2f} | {r['pagedqvg_ms'] / dense_ms:.2f}x | " if dense_ms else "– | – | ")
                + f"{r['pagedqvg_allocs']} / {r['segment-list_allocs']} / {r.get('dense_allocs', '–')} | "
                f"{r['pagedqvg_peak_bytes']:,} / {r['segment-list_peak_bytes']:,} | {r['view_bytes']:,} |"
            )
    if "host" in sections:
        lines += ["", "### Host overhead per repeated call, tiny tensors (B=1, 2 heads, head_dim 8, 4-token chunks)",
                  "",
                  "| cache | µs per call | vs dense | tensor allocations per call |", "|---|---:|---:|---:|"]
        h = results["host"]
        for name in ("dense", "pagedqvg", "pagedqvg-reuse-buffer", "sglang-qvg"):
            label = {"pagedqvg-reuse-buffer": "pagedqvg (reuse_view_buffer)", "sglang-qvg": "SGLang QVG (bf16)"}.get(
                name, name)  # fmt: skip
            if f"{name}_us" not in h:
                lines.append(f"| {label} | – (not importable) | – | – |")
                continue
            lines.append(f"| {label} | {h[f'{name}_us']:.1f} | {h[f'{name}_us'] / h['dense_us']:.2f}x | "
                         f"{h[f'{name}_allocs']} |")  # fmt: skip
    if "resident" in sections:
        lines += ["", "### Resident K/V bytes of one layer, LingBot chunk size (4,680 tokens), after the run (exact)",
                  "",
                  "| quant | chunks | dense | pagedqvg | dense / pagedqvg | segment list | dense / segment list | "
                  "pagedqvg packed / bf16 bytes | packed / bf16 tokens | packed chunks vs bf16 |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
        for r in results["resident"]:
            lines.append(
                f"| {r['quant']} | {r['chunks']} | {r['dense_bytes']:,} | {r['pagedqvg_bytes']:,} | "
                f"{r['dense_bytes'] / r['pagedqvg_bytes']:.2f}x | {r['segment_list_bytes']:,} | "
                f"{r['dense_bytes'] / r['segment_list_bytes']:.2f}x | {r['pagedqvg_packed_bytes']:,} / "
                f"{r['pagedqvg_dense_bytes']:,} | {r['packed_tokens']:,} / {r['dense_tokens']:,} | "
                f"{r['packed_tokens'] * r['bf16_token_bytes'] / r['pagedqvg_packed_bytes']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and chunks (about a minute)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--host-only", action="store_true", help="only the host-overhead table (tiny tensors, seconds)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    repeats = 3 if args.quick else 7
    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": bench_host_overhead(repeats),
    }
    if args.host_only:
        print(markdown(results, sections=("host",)))
        return 0
    results["view"] = [bench_view(s, q, repeats) for s in SHAPES for q in QUANTS]
    results["resident"] = bench_resident(12 if args.quick else 60)
    table = markdown(results)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_baselines.md").write_text(table)
    (out / "vs_baselines.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'vs_baselines.md'} and {out / 'vs_baselines.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
