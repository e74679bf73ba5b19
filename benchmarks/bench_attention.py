"""Attention of one LingBot-like layer on CPU: view + SDPA vs `update_and_attend` (attention straight from pages).

One layer of 8 heads x 128, bf16, batch 1, 1,560-token chunks, a 6-chunk cache and attention window with a 3-chunk
sink (every view is 6 chunks = 9,360 tokens once the window is full), quantization off / int2 (SGLang's reference
format: 128 centroids, block 64) / compact. For each mode two identical caches advance `--warm` chunks (the window
rolls, chunks get packed); then, in rounds (one call per path, so machine noise hits both alike), the repeated
in-place call of the current chunk (a later denoise step; 1,560 query rows) is timed:

- view + SDPA: `update_and_get_attention_kv`, then `torch.nn.functional.scaled_dot_product_attention` on the view;
- pages: `update_and_attend` (pagedqvg/attention/pages.py: tiles of 512 key rows, fp32 online softmax).

Peak transient bytes: the peak of bytes of tensors allocated by aten ops during one call and not given back
before it (tests/memory_count.py, a TorchDispatchMode; buffers a kernel allocates internally, e.g. SDPA's per-thread
scratch, are not seen), with the returned output counted. The script checks both outputs against fp64 attention over
the view (relative L2 error of each) and exits non-zero if update_and_attend's exceeds 1.5x SDPA's.

    PYTHONPATH=$PWD python benchmarks/bench_attention.py [--threads 1] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from memory_count import AllocatedBytes

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.attention.pages import ATTN_QUERY_TILE, ATTN_TILE_TOKENS

HEADS, HEAD_DIM, CHUNK = 8, 128, 1560
CACHE_CHUNKS, SINK_CHUNKS = 6, 3
DTYPE = torch.bfloat16
MODES = {"off": None, "int2": QuantConfig(bits=2), "compact": QuantConfig.compact()}


def make(quant: QuantConfig | None) -> PagedCausalKVCache:
    token_bytes = 2 * HEADS * HEAD_DIM * 2
    pool = BlockPool((CACHE_CHUNKS + 3) * CHUNK * token_bytes, page_bytes=2 << 20, device="cpu")
    return PagedCausalKVCache(pool=pool, batch_size=1, cache_size=CACHE_CHUNKS * CHUNK, num_heads=HEADS,
                              head_dim=HEAD_DIM, dtype=DTYPE, device="cpu", sink_tokens=SINK_CHUNKS * CHUNK,
                              quant=quant)  # fmt: skip


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def view_sdpa(cache, q, k, v, start):
    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
    return sdpa(q, view.k, view.v)


def pages(cache, q, k, v, start):
    return cache.update_and_attend(q, key=k, value=v, current_chunk_start=start)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    out = fn(*args)
    dt = time.perf_counter() - t0
    del out
    return dt


def peak_bytes(fn, *args) -> int:
    with AllocatedBytes() as m:
        out = fn(*args)
    del out
    return m.peak


def run_mode(mode: str, warm: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    chunks = [[torch.randn(1, CHUNK, HEADS, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(3)] for _ in range(warm)]
    a, b = make(MODES[mode]), make(MODES[mode])
    for i, (_, k, v) in enumerate(chunks):  # the same writes on both (views only: the window fills and rolls)
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * CHUNK)
        b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * CHUNK)
    start = (warm - 1) * CHUNK
    q = chunks[-1][0]
    view = a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
    ref = sdpa(q.double(), view.k.double(), view.v.double())
    errs = {}
    paths = (("view+sdpa", view_sdpa, a), ("pages", pages, b))
    for name, fn, cache in paths:
        out = fn(cache, q, k, v, start)  # also caches the repeated call's plans
        errs[name] = ((out.double() - ref).norm() / ref.norm()).item()
    times: dict[str, list[float]] = {"view+sdpa": [], "pages": []}
    for _ in range(reps):
        times["view+sdpa"].append(timed(view_sdpa, a, q, k, v, start))
        times["pages"].append(timed(pages, b, q, k, v, start))
    sources = [kind for *_, kind in a.last_view_sources()]
    return {
        "mode": mode,
        "view_tokens": view.k.shape[1],
        "view_sources": {kind: sources.count(kind) for kind in sorted(set(sources))},
        "view_bytes": 2 * view.k.numel() * view.k.element_size(),
        "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "peak_bytes": {name: peak_bytes(fn, cache, q, k, v, start) for name, fn, cache in paths},
        "rel_err_vs_fp64": errs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--warm", type=int, default=8, help="chunks appended before timing (default 8)")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("--modes", default="off,int2,compact", help="comma-separated subset of off,int2,compact")
    ap.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# LingBot-like layer: {HEADS} heads x {HEAD_DIM}, bf16, {CHUNK}-token chunks (= query rows), "
          f"{CACHE_CHUNKS}-chunk window, {SINK_CHUNKS}-chunk sink; torch {torch.__version__}, {args.threads} "
          f"thread(s); tiles {ATTN_TILE_TOKENS} key x {ATTN_QUERY_TILE} query rows; median of {args.reps}")  # fmt: skip
    print("| mode | view tokens | view+SDPA ms | pages ms | ratio | view+SDPA peak MiB | pages peak MiB | rel err "
          "view+SDPA | rel err pages |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    results, ok = [], True
    for mode in args.modes.split(","):
        r = run_mode(mode, args.warm, args.reps)
        results.append(r)
        ms, pk, err = r["ms"], r["peak_bytes"], r["rel_err_vs_fp64"]
        print(f"| {mode} | {r['view_tokens']} | {ms['view+sdpa']:.0f} | {ms['pages']:.0f} | "
              f"{ms['pages'] / ms['view+sdpa']:.2f}x | {pk['view+sdpa'] / 2**20:.1f} | {pk['pages'] / 2**20:.1f} | "
              f"{err['view+sdpa']:.2e} | {err['pages']:.2e} |", flush=True)  # fmt: skip
        ok &= err["pages"] <= 1.5 * err["view+sdpa"]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if not ok:
        sys.exit("update_and_attend's error exceeds 1.5x SDPA's")


if __name__ == "__main__":
    main()
