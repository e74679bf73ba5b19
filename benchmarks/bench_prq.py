"""PRQ accuracy / size / speed on synthetic video K/V. Prints Markdown tables (no asserts).

    python benchmarks/bench_prq.py            # full sweep, ~1 min on 2 CPU cores
    python benchmarks/bench_prq.py --quick    # centroids 128 only, 1 stage

Data: `pagedqvg.synthetic.video_kv`, 3 latent frames of a 30x52 token grid = one 4,680-token chunk (480p), head_dim
128, `--heads` heads (4 by default to keep CPU time modest; error and bytes per token-head do not depend on it).
Bytes are per token-head; the compression ratio vs bf16 includes the codebooks (centroids x 128 x 2 B per head and
stage) amortised over a segment of 4,680 or 10,800 tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedqvg.quant import PackedFormat, QuantConfig, prq_quantize
from pagedqvg.synthetic import relative_error, snr_db, video_kv

CHUNK = 4680
GRID = (30, 52)  # 1,560 tokens per latent frame, 3 frames per chunk
HEAD_DIM = 128


def _measure(cfg: QuantConfig, k: torch.Tensor, v: torch.Tensor, init: tuple | None = None) -> dict:
    """Quantize K and V (timed), dequantize, and compute errors."""
    out: dict = {"ms": 0.0}
    for name, x, cb in (("k", k, init[0] if init else None), ("v", v, init[1] if init else None)):
        t0 = time.perf_counter()
        seg = prq_quantize(x, cfg, init_centroids=cb)
        out["ms"] += (time.perf_counter() - t0) * 1000.0
        y = seg.dequantize()
        out[name] = (relative_error(x, y), snr_db(x, y))
        out[name + "_seg"] = seg
    return out


def _row(label: str, cfg: QuantConfig, heads: int, m: dict) -> str:
    fmt = PackedFormat(HEAD_DIM, heads, cfg)
    return (
        f"| {label} | {fmt.per_head_bytes} | {fmt.compression_ratio(4680):.2f}x | {fmt.compression_ratio(10800):.2f}x "
        f"| {m['k'][0]:.4f} | {m['k'][1]:.2f} | {m['v'][0]:.4f} | {m['v'][1]:.2f} | {m['ms']:.0f} |"
    )


def _label(cfg: QuantConfig) -> str:
    kind = "asym" if cfg.asymmetric else "sym"
    trits = " trits" if cfg.pack_trits else ""
    return f"{cfg.mode} {kind}{trits}, K={cfg.centroids}, {cfg.stages} st, blk {cfg.block_size}"


HEADER = (
    "| config | B/token-head | ratio @4,680 | ratio @10,800 | K rel err | K SNR dB | V rel err | V SNR dB "
    "| quantize ms (K+V) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="centroids 128 and 1 stage only")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t_start = time.perf_counter()
    k_all, v_all = video_kv(6, GRID, args.heads, HEAD_DIM, seed=args.seed)
    k, v = k_all[0, :CHUNK], v_all[0, :CHUNK]
    k2, v2 = k_all[0, CHUNK:], v_all[0, CHUNK:]
    print(
        f"PRQ on synthetic video K/V: {CHUNK} tokens x {args.heads} heads x {HEAD_DIM} ch, bf16, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n"
    )
    prq_quantize(k[:256], QuantConfig(bits=2))  # warm-up

    print("## Error vs bytes (bf16 = 256 B/token-head, 1.00x)\n")
    print(HEADER)
    centroids = (128,) if args.quick else (64, 128, 256)
    stages = (1,) if args.quick else (1, 2)
    results: dict = {}
    for bits in (2, 4):
        for asym in (False, True):
            for st in stages:
                for kk in centroids:
                    cfg = QuantConfig(bits=bits, asymmetric=asym, stages=st, centroids=kk)
                    m = _measure(cfg, k, v)
                    results[cfg] = m
                    print(_row(_label(cfg), cfg, args.heads, m), flush=True)

    print("\n## Beyond the reference: base-3 packing of symmetric int2 codes (`pack_trits`)\n")
    print(HEADER)
    ref = QuantConfig(bits=2)
    variants = [
        ("reference default: " + _label(ref), ref),
        ("trits, same codes (fewer bytes, equal error)", QuantConfig(bits=2, pack_trits=True)),
        ("trits, blk 32 (fewer bytes, less error)", QuantConfig(bits=2, pack_trits=True, block_size=32)),
        ("trits, blk 16 (equal bytes, less error)", QuantConfig(bits=2, pack_trits=True, block_size=16)),
    ]
    if not args.quick:
        variants.append(("reference, 2 stages", QuantConfig(bits=2, stages=2)))
        variants.append(("trits, 2 stages", QuantConfig(bits=2, pack_trits=True, stages=2)))
    ref_m = results.get(ref) or _measure(ref, k, v)
    for label, cfg in variants:
        m = ref_m if cfg == ref else _measure(cfg, k, v)
        print(_row(label, cfg, args.heads, m), flush=True)
    tri = _measure(QuantConfig(bits=2, pack_trits=True), k, v)
    same = all(torch.equal(ref_m[n + "_seg"].dequantize(), tri[n + "_seg"].dequantize()) for n in ("k", "v"))
    print(f"\ntrit-packed int2 dequantizes bit-identically to the reference: {same}")

    print("\n## Warm start (informational): chunk 2 initialised from chunk 1's codebooks, int2 sym K=128\n")
    print(HEADER)
    first = _measure(ref, k, v)
    cold = _measure(ref, k2, v2)
    warm = _measure(ref, k2, v2, init=(first["k_seg"].codebooks, first["v_seg"].codebooks))
    print(_row("chunk 2, seeded random init (reference)", ref, args.heads, cold))
    print(_row("chunk 2, warm start from chunk 1", ref, args.heads, warm))
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
