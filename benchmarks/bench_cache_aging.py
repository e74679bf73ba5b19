"""Formats by age, measured through the real cache (issue 23 item 2): the error of history chunks that aged out of a
packed recent tier (repacked by the cache from their decoded values) against history chunks packed once from the
originals (the same history format with the recent tier kept bf16). Markdown table, no asserts.

    PYTHONPATH=$PWD python benchmarks/bench_cache_aging.py              # ~2 min on a busy 2-core CPU (2 heads)
    PYTHONPATH=$PWD python benchmarks/bench_cache_aging.py --heads 4

Data: `pagedqvg.planning.synthetic.video_kv` (as bench_prq.py / bench_tiers.py), 4 chunks of 3 latent frames of 30x52
(4,680 tokens, LingBot-World's chunk), head_dim 128, `--heads` heads, batch 1, bf16. Each setting runs two
`PagedCausalKVCache`s (sink tokens 0, keep_recent_chunks 1) over the 4 chunks: `aged` with the recent tier in
`recent_format` (chunks 0 and 1 are packed in it first, then repacked into the history's format when they leave the
tier), `once` with the recent tier bf16 (chunks 0 and 1 packed straight from the originals). The figures are the
relative errors ||x - x_hat|| / ||x|| of K and V over chunks 0 and 1 as the last view shows them.
benchmarks/bench_tiers.py measures the same choice with the codecs alone (4 history chunks, 4 heads).
"""

from __future__ import annotations

import argparse

import torch

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.planning.synthetic import relative_error, video_kv

CHUNK_FRAMES, GRID, HEAD_DIM, CHUNKS = 3, (30, 52), 128, 4


def history_rows(quant: QuantConfig, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Run one cache over the chunks; return the last view's K and V rows of chunks 0 and 1, and the formats."""
    n = CHUNK_FRAMES * GRID[0] * GRID[1]
    B, _, H, D = k.shape
    page = 1 << 16
    dense_chunk = 2 * n * B * H * D * k.element_size()
    pool = BlockPool(capacity_bytes=2 * CHUNKS * dense_chunk + 16 * page, page_bytes=page)
    cache = PagedCausalKVCache(pool=pool, batch_size=B, cache_size=CHUNKS * n, num_heads=H, head_dim=D,
                               dtype=k.dtype, device="cpu", quant=quant)  # fmt: skip
    for c in range(CHUNKS):
        view = cache.update_and_get_attention_kv(
            key=k[:, c * n : (c + 1) * n], value=v[:, c * n : (c + 1) * n], current_chunk_start=c * n
        )
    formats = [e.value.fmt if e.value.packed else "bf16" for e in cache._seq.index]
    out = view.k[:, : 2 * n].clone(), view.v[:, : 2 * n].clone(), formats
    cache.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    k, v = video_kv(CHUNKS * CHUNK_FRAMES, GRID, args.heads, HEAD_DIM, seed=args.seed)
    n = CHUNK_FRAMES * GRID[0] * GRID[1]
    ref_k, ref_v = k[:, : 2 * n], v[:, : 2 * n]
    print(f"history chunks 0-1 of {CHUNKS} x {n} tokens, {args.heads} heads x {HEAD_DIM}, seed {args.seed}\n")
    print("| recent -> history | formats (aged cache) | K aged | K once | K diff | V aged | V once | V diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for recent in ("int4", "fp8"):
        for hist in ("int2", "compact"):
            once_q = QuantConfig.from_dict({"kv_cache_quant": hist, "kv_cache_quant_sink": "false"})
            aged_q = QuantConfig.from_dict({"kv_cache_quant": hist, "kv_cache_quant_sink": "false",
                                            "kv_cache_quant_recent": recent})  # fmt: skip
            ak, av, formats = history_rows(aged_q, k, v)
            ok, ov, _ = history_rows(once_q, k, v)
            errs = [relative_error(ref_k, ak), relative_error(ref_k, ok), relative_error(ref_v, av),
                    relative_error(ref_v, ov)]  # fmt: skip
            print(
                f"| {recent} -> {hist} | {' / '.join(formats)} | {errs[0]:.4f} | {errs[1]:.4f} | "
                f"{100 * (errs[0] / errs[1] - 1):+.1f}% | {errs[2]:.4f} | {errs[3]:.4f} | "
                f"{100 * (errs[2] / errs[3] - 1):+.1f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
