"""PRQ accuracy / size / speed on synthetic video K/V. Prints Markdown tables (no asserts).

    python benchmarks/bench_prq.py            # full sweep, ~1 min on 2 CPU cores
    python benchmarks/bench_prq.py --quick    # centroids 128 only, 1 stage
    python benchmarks/bench_prq.py --compact  # only the compact-mode sections (ideas, attention error, windows)

Data: `pagedqvg.planning.synthetic.video_kv`, 3 latent frames of a 30x52 token grid = one 4,680-token chunk (480p),
head_dim
128, `--heads` heads (4 by default to keep CPU time modest; error and bytes per token-head do not depend on it).
Bytes are per token-head; the compression ratio vs bf16 includes the codebooks (centroids x 128 x 2 B per head and
stage; 1 B per value with fp8 codebooks) amortised over a segment of 4,680 or 10,800 tokens.

Attention-output error: softmax(Q K^T / sqrt(d)) V over a window of 3 chunks (14,040 tokens; each chunk packed on
its own, as the cache packs chunks), queries = 512 tokens (every 9th) of the next chunk's K of the
same synthetic video (K and a query are projections of the same features with the same 3-D RoPE), per head;
error = ||O_packed - O_bf16|| / ||O_bf16|| over all queries and heads.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedqvg.planning.planner import Geometry, max_window_frames, min_window_frames, plan_geometry
from pagedqvg.planning.presets import get_preset
from pagedqvg.planning.synthetic import relative_error, snr_db, video_kv
from pagedqvg.quant import PackedFormat, QuantConfig, pack_residual_rows, prq_dequantize, prq_quantize
from pagedqvg.quant.prq import assign_nearest

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
    trits += " fit" if cfg.fit_scales else ""
    trits += " fp8-cb" if cfg.codebook_fp8 else ""
    return f"{cfg.mode} {kind}{trits}, K={cfg.centroids}, {cfg.stages} st, blk {cfg.block_size}"


HEADER = (
    "| config | B/token-head | ratio @4,680 | ratio @10,800 | K rel err | K SNR dB | V rel err | V SNR dB "
    "| quantize ms (K+V) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _bytes_incl_cb(cfg: QuantConfig, tokens: int = CHUNK) -> float:
    """Bytes per token-head with the codebooks amortised over a `tokens`-token segment."""
    fmt = PackedFormat(HEAD_DIM, 1, cfg)
    return fmt.per_head_bytes + cfg.stages * fmt.codebook_row_bytes / tokens


def _attention_error(cfg: QuantConfig, window: list, q: torch.Tensor) -> tuple[float, float, float]:
    """(attention-output rel. error, K rel. error, V rel. error) over a window of packed chunks; see the docstring."""
    ks, vs, kq, vq = [], [], [], []
    for k, v in window:
        ks.append(k)
        vs.append(v)
        kq.append(prq_quantize(k, cfg).dequantize())
        vq.append(prq_quantize(v, cfg).dequantize())
    k, v, kd, vd = (torch.cat(t).float().transpose(0, 1) for t in (ks, vs, kq, vq))  # [H, T, D]
    qh = q.float().transpose(0, 1)  # [H, Q, D]

    def attn(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return torch.softmax(qh @ kk.transpose(1, 2) / HEAD_DIM**0.5, dim=-1) @ vv

    ref = attn(k, v)
    return relative_error(ref, attn(kd, vd)), relative_error(k, kd), relative_error(v, vd)


def _shared_codebook_error(cfg: QuantConfig, x1: torch.Tensor, x2: torch.Tensor) -> float:
    """Simulation (not a cache mode): chunk 2 encoded with chunk 1's stored codebook (no k-means on chunk 2)."""
    first = prq_quantize(x1, cfg)
    cb = first.codebooks.float()  # [H, 1, K, D]
    r = x2.float().transpose(0, 1)
    ids = assign_nearest(r, cb[:, 0])
    resid = r - cb[torch.arange(r.shape[0])[:, None], 0, ids]
    rows = pack_residual_rows(resid, ids[..., None].to(torch.uint8), first.fmt)
    return relative_error(x2, prq_dequantize(rows, first.codebooks, first.fmt))


def _cross_head_error(cfg: QuantConfig, x: torch.Tensor) -> float:
    """Simulation: one codebook for all heads of a layer (heads folded into tokens for k-means)."""
    S, H, D = x.shape
    seg = prq_quantize(x.reshape(S * H, 1, D), cfg)
    return relative_error(x, seg.dequantize().reshape(S, H, D))


def compact_sections(args: argparse.Namespace, k: torch.Tensor, v: torch.Tensor, k2, v2) -> None:
    """The compact mode: ideas measured, Pareto table with attention-output error, LingBot-World windows."""
    ref = QuantConfig(bits=2)
    compact = QuantConfig.compact()
    print(
        "\n## Compact mode: the ideas, each measured (bytes incl. codebooks at 4,680 tokens; target >= 8x, K <= ref, "
        "V <= ref)\n"
    )
    print("| idea | B/token-head incl. codebooks | ratio @4,680 | K rel err | V rel err | kept? |\n"
          "|---|---:|---:|---:|---:|---|")  # fmt: skip
    ideas = [
        ("reference int2 (bits 2, K=128, blk 64, 1 st, 2 it, sym)", ref, None),
        ("trits, blk 64", QuantConfig(bits=2, pack_trits=True), None),
        ("trits, blk 16", QuantConfig(bits=2, pack_trits=True, block_size=16), None),
        ("trits + fitted scales, blk 64", QuantConfig(bits=2, pack_trits=True, fit_scales=True), None),
        ("trits + fp8 codebooks, blk 64", QuantConfig(bits=2, pack_trits=True, codebook_fp8=True), None),
        (
            "trits + fp8 codebooks, blk 128 (no fit)",
            QuantConfig(bits=2, pack_trits=True, codebook_fp8=True, block_size=128),
            None,
        ),
        ("trits + fit, blk 128, 64 centroids bf16", QuantConfig.compact(centroids=64, codebook_fp8=False), None),
        (
            "trits + fit, blk 128, 64 centroids bf16, 8 iters",
            QuantConfig.compact(centroids=64, codebook_fp8=False, kmeans_iters=8),
            None,
        ),
        (
            "trits + fit, blk 64, 32 centroids bf16",
            QuantConfig.compact(centroids=32, codebook_fp8=False, block_size=64),
            None,
        ),
        (
            "trits + fit, blk 32, 16 centroids bf16",
            QuantConfig.compact(centroids=16, codebook_fp8=False, block_size=32),
            None,
        ),
        ("**compact** = trits + fit + fp8 codebooks, blk 128, K=128", compact, None),
        ("compact, 4 k-means iters", QuantConfig.compact(kmeans_iters=4), None),
        ("compact, 256 centroids", QuantConfig.compact(centroids=256), None),
        ("compact, 64 centroids", QuantConfig.compact(centroids=64), None),
        ("compact, codebook shared with the previous chunk (sim., refresh every 2nd chunk)", compact, "chunks"),
        (f"compact, one codebook for all {args.heads} heads (sim.)", compact, "heads"),
    ]
    ref_err = None
    for label, cfg, sim in ideas:
        if sim is None:
            m = _measure(cfg, k, v)
            ek, ev = m["k"][0], m["v"][0]
            b = _bytes_incl_cb(cfg)
        elif sim == "chunks":  # chunk 2 reuses chunk 1's codebook: two chunks per codebook
            ek, ev = _shared_codebook_error(cfg, k, k2), _shared_codebook_error(cfg, v, v2)
            b = _bytes_incl_cb(cfg, 2 * CHUNK)
        else:
            ek, ev = _cross_head_error(cfg, k), _cross_head_error(cfg, v)
            fmt = PackedFormat(HEAD_DIM, 1, cfg)
            b = fmt.per_head_bytes + fmt.codebook_row_bytes / (CHUNK * args.heads)
        if ref_err is None:
            ref_err = (ek, ev)
        ok = 256 / b >= 8.0 and ek <= ref_err[0] and ev <= ref_err[1]
        print(f"| {label} | {b:.2f} | {256 / b:.2f}x | {ek:.4f} | {ev:.4f} | {'meets target' if ok else '-'} |",
              flush=True)  # fmt: skip
    print("\n6-bit ids (64 centroids) would save 0.25 B/token-head (arithmetic; ids are 1 byte in every format).")

    print("\n## Pareto table: bytes, ratio, K/V error and attention-output error (window of 3 packed chunks)\n")
    frames = 12  # 4 chunks: 3 packed in the window, queries from the 4th
    ka, va = video_kv(frames, GRID, args.heads, HEAD_DIM, seed=args.seed)
    window = [(ka[0, c * CHUNK : (c + 1) * CHUNK], va[0, c * CHUNK : (c + 1) * CHUNK]) for c in range(3)]
    q = ka[0, 3 * CHUNK : 4 * CHUNK : 9][:512]
    print("| mode | B/token-head (record) | B/token-head incl. codebooks @4,680 | ratio @4,680 | ratio @10,800 "
          "| K rel err | V rel err | attention-output rel err |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    modes = [
        ("int4 (bits 4, K=128, blk 64)", QuantConfig(bits=4)),
        ("int2 reference", ref),
        ("int2 trits, blk 64", QuantConfig(bits=2, pack_trits=True)),
        ("int2 trits, blk 16", QuantConfig(bits=2, pack_trits=True, block_size=16)),
        ("compact", compact),
    ]
    for label, cfg in modes:
        fmt = PackedFormat(HEAD_DIM, 1, cfg)
        ea, ek, ev = _attention_error(cfg, window, q)
        print(f"| {label} | {fmt.per_head_bytes} | {_bytes_incl_cb(cfg):.2f} | {fmt.compression_ratio(4680):.2f}x "
              f"| {fmt.compression_ratio(10800):.2f}x | {ek:.4f} | {ev:.4f} | {ea:.4f} |", flush=True)  # fmt: skip

    print(
        "\n## Largest LingBot-World window in 24 GiB (planner, exact page accounting; pagedqvg plan --budget 24GiB)\n"
    )
    print("| mode | page bytes | window frames | budget used |\n|---|---:|---:|---:|")
    w = get_preset("lingbot-world")
    for label, cfg in [("bf16", QuantConfig()), *modes]:
        geom = Geometry.from_workload(w.replace(quant=cfg))
        lo = min_window_frames(geom, w.chunk_frames)
        f = max_window_frames(geom, 24 << 30, lo)
        used = plan_geometry(geom.with_window_frames(f), replay=False).budget_bytes if f is not None else 0
        print(f"| {label} | {geom.page_bytes:,} | {f} | {used / 2**30:.2f} GiB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="centroids 128 and 1 stage only")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compact", action="store_true", help="only the compact-mode sections")
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
    if args.compact:
        compact_sections(args, k, v, k2, v2)
        print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
        return

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
    compact_sections(args, k, v, k2, v2)
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
