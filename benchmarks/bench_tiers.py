"""Formats by age (issue 23): attention-output error, K/V error and whole-cache bytes per tiered setting, and the
aging choice (repack a recent chunk from its decoded values, or quantize the original once). Markdown, no asserts.

    PYTHONPATH=$PWD python benchmarks/bench_tiers.py            # ~20 min on a busy 2-core CPU (4 heads)
    PYTHONPATH=$PWD python benchmarks/bench_tiers.py --json benchmarks/results/bench_tiers.json

Data (as `bench_prq.py --compact`): `pagedqvg.planning.synthetic.video_kv`, 4,680-token chunks (3 latent frames
of 30x52), head_dim 128, `--heads` heads. The window is LingBot-World's 18-frame one at steady state: 1 sink chunk,
4 history chunks, 1 recent chunk, the current chunk (bf16 in every setting): 7 chunks, 32,760 tokens,
5 or 6 of them packed.
Each chunk is encoded on its own in its tier's format (`QuantConfig.tier_quant`: PRQ int4/int2/compact; fp8 via
`quant/fp8.py`), as the cache packs chunks. Queries: 512 tokens (every 9th) of the current chunk's K.
Attention-output error = ||O - O_bf16|| / ||O_bf16|| of softmax(Q K^T / sqrt(d)) V over all queries and heads.
History chunks of a setting whose recent tier is packed were recent chunks first: `aged` repacks them from the
recent format's decoded values (what a cache holding only packed bytes can do), `once` quantizes the original.
Bytes: `pagedqvg.planning.tiers.tier_used_bytes` for the real LingBot-World preset (40 layers x 40 heads, 18-frame
window);
`GiB (once)` adds what `once` costs: each recent chunk's history encoding, made from the original while it is recent.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedqvg.planning.planner import Geometry
from pagedqvg.planning.presets import get_preset
from pagedqvg.planning.synthetic import relative_error, video_kv
from pagedqvg.planning.tiers import format_used_bytes, tier_used_bytes
from pagedqvg.quant import QuantConfig, prq_quantize
from pagedqvg.quant.fp8 import Fp8Format

CHUNK = 4680
GRID = (30, 52)
HEAD_DIM = 128
SINK, HISTORY, RECENT, CURRENT = 0, (1, 2, 3, 4), 5, 6  # chunk indices of the 7-chunk window

#: (label, config): the references (recent kept bf16) and tiered settings of issue 23.
SETTINGS: list[tuple[str, QuantConfig]] = [
    ("reference int4", QuantConfig(bits=4)),
    ("reference int2", QuantConfig(bits=2)),
    ("compact", QuantConfig.compact()),
    ("sink bf16 / recent int4 / history compact", QuantConfig.compact(sink=False, recent_format="int4")),
    ("sink int4 / recent int4 / history int2", QuantConfig(bits=2, sink_format="int4", recent_format="int4")),
    ("sink int4 / recent int4 / history compact", QuantConfig.compact(sink_format="int4", recent_format="int4")),
    ("sink int4 / recent fp8 / history int2", QuantConfig(bits=2, sink_format="int4", recent_format="fp8")),
    ("sink int4 / recent fp8 / history compact", QuantConfig.compact(sink_format="int4", recent_format="fp8")),
    ("sink int2 / recent int4 / history int2", QuantConfig(bits=2, recent_format="int4")),
    ("sink compact / recent int4 / history compact", QuantConfig.compact(recent_format="int4")),
    ("sink compact / recent fp8 / history compact", QuantConfig.compact(recent_format="fp8")),
    ("sink bf16 / recent fp8 / history compact", QuantConfig.compact(sink=False, recent_format="fp8")),
]


class Encoder:
    """Encode/decode chunks in a tier's format, memoized by (format key, chunk, K or V, source)."""

    def __init__(self, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.chunks = chunks
        self.memo: dict[tuple, torch.Tensor] = {}

    def encode(self, cfg: QuantConfig, tier: str, x: torch.Tensor) -> torch.Tensor:
        """x [S, H, D] bf16 -> its decoded values after storage in `tier`'s format of `cfg`."""
        name = cfg.tier_format(tier)
        if name == "bf16":
            return x
        if name == "fp8":
            f = Fp8Format(HEAD_DIM, x.shape[1])
            return f.dequantize(f.quantize(x), x.dtype)
        return prq_quantize(x, cfg.tier_quant(tier)).dequantize()

    def chunk(self, cfg: QuantConfig, tier: str, c: int, aged_from: str | None = None) -> tuple[torch.Tensor, ...]:
        """Chunk `c`'s (K, V) as `tier` stores it; `aged_from`: first stored in that tier and repacked from it."""
        out = []
        for kv in range(2):
            src = self.chunks[c][kv]
            key_src: tuple = ("orig",)
            if aged_from is not None and cfg.tier_format(aged_from) != "bf16":
                src = self.get(cfg, aged_from, c, kv, self.chunks[c][kv], ("orig",))
                key_src = (_format_key(cfg, aged_from),)
            out.append(self.get(cfg, tier, c, kv, src, key_src))
        return tuple(out)

    def get(self, cfg: QuantConfig, tier: str, c: int, kv: int, src: torch.Tensor, key_src: tuple) -> torch.Tensor:
        key = (_format_key(cfg, tier), c, kv, key_src)
        if key not in self.memo:
            self.memo[key] = self.encode(cfg, tier, src)
        return self.memo[key]


def _format_key(cfg: QuantConfig, tier: str) -> tuple:
    q = cfg.tier_quant(tier)
    return (cfg.tier_format(tier), None if q is None else (q.bits, q.block_size, q.pack_trits, q.fit_scales,
                                                           q.codebook_fp8, q.centroids, q.seed))


def window(enc: Encoder, cfg: QuantConfig, aging: str) -> list[tuple[torch.Tensor, ...]]:
    """The 7 chunks as the setting stores them; history chunks `aged` (repacked from the recent format) or `once`."""
    out = [enc.chunk(cfg, "sink", SINK)]
    for c in HISTORY:
        out.append(enc.chunk(cfg, "history", c, "recent" if aging == "aged" else None))
    out.append(enc.chunk(cfg, "recent", RECENT))
    out.append(enc.chunks[CURRENT])
    return out


def attention_error(ref: list, got: list, q: torch.Tensor) -> tuple[float, float, float]:
    """(attention-output rel. error, K rel. error, V rel. error) of window `got` against `ref`."""
    k, v, kd, vd = (torch.cat([c[i] for c in w]).float().transpose(0, 1) for w in (ref, got) for i in (0, 1))
    qh = q.float().transpose(0, 1)

    def attn(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return torch.softmax(qh @ kk.transpose(1, 2) / HEAD_DIM**0.5, dim=-1) @ vv

    return relative_error(attn(k, v), attn(kd, vd)), relative_error(k, kd), relative_error(v, vd)


def lingbot_bytes(cfg: QuantConfig) -> dict[str, float]:
    """GiB per role and in all, for the 40 caches of LingBot-World's 18-frame window."""
    geom = Geometry.from_workload(get_preset("lingbot-world").replace(quant=cfg))
    per = tier_used_bytes(geom)
    out = {role: b * geom.caches / 2**30 for role, b in per.items()}
    out["total"] = sum(per.values()) * geom.caches / 2**30
    out["dense_ratio"] = geom.dense_cache_bytes() / sum(per.values())
    # `once` needs each recent chunk's history encoding made while it is recent (from the original): kept beside it
    dual = cfg.recent_format not in ("bf16", cfg.tier_format("history"))
    extra = format_used_bytes(geom, "history", geom.chunk_tokens) * cfg.keep_recent_chunks if dual else 0
    out["total_once"] = out["total"] + extra * geom.caches / 2**30
    return out


def aging_table(enc: Encoder, ref: list) -> list[dict]:
    """K/V error of history chunks: repacked from the recent format's decoded values vs quantized once."""
    rows = []
    for recent in ("int4", "fp8"):
        for hist in ("int2", "compact"):
            base = QuantConfig.compact() if hist == "compact" else QuantConfig(bits=2)
            cfg = QuantConfig.from_dict({**{"kv_cache_quant": hist}, "kv_cache_quant_recent": recent})
            assert cfg.mode == base.mode
            errs = {}
            for aging in ("once", "aged"):
                ks = [enc.chunk(cfg, "history", c, "recent" if aging == "aged" else None) for c in HISTORY]
                kr = [ref[c] for c in HISTORY]
                errs[aging] = tuple(relative_error(torch.cat([r[i] for r in kr]), torch.cat([g[i] for g in ks]))
                                    for i in (0, 1))  # fmt: skip
            rows.append({"recent": recent, "history": hist, "once": errs["once"], "aged": errs["aged"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    k, v = video_kv(21, GRID, args.heads, HEAD_DIM, seed=args.seed)
    chunks = [(k[0, c * CHUNK : (c + 1) * CHUNK], v[0, c * CHUNK : (c + 1) * CHUNK]) for c in range(7)]
    q = k[0, CURRENT * CHUNK : (CURRENT + 1) * CHUNK : 9][:512]
    enc = Encoder(chunks)
    t0 = time.perf_counter()
    print("## Aging: history chunk K/V error, repacked from the recent tier's decoded values vs quantized once\n")
    print("| recent -> history | K once | K aged | V once | V aged |\n|---|---:|---:|---:|---:|")
    aging = aging_table(enc, chunks)
    for r in aging:
        print(f"| {r['recent']} -> {r['history']} | {r['once'][0]:.4f} | {r['aged'][0]:.4f} | {r['once'][1]:.4f} "
              f"| {r['aged'][1]:.4f} |", flush=True)  # fmt: skip
    print("\n## Settings: LingBot-World 18-frame window, 40 layers (GiB of rows, codebooks included) vs attention "
          "error\n")
    print("| setting | sink | history | recent | current | total GiB | vs dense | K rel err | V rel err "
          "| attn err (aged) | attn err (once) | GiB (once) |\n|---" + "|---:" * 11 + "|")  # fmt: skip
    results = []
    for label, cfg in SETTINGS:
        b = lingbot_bytes(cfg)
        ea, ek, ev = attention_error(chunks, window(enc, cfg, "aged"), q)
        eo = attention_error(chunks, window(enc, cfg, "once"), q)[0] if cfg.recent_format != "bf16" else ea
        results.append({"setting": label, "quant": cfg.describe(), "gib": b, "k_err": ek, "v_err": ev,
                        "attn_err_aged": ea, "attn_err_once": eo})  # fmt: skip
        print(f"| {label} | {b['sink']:.2f} | {b['history']:.2f} | {b['recent']:.2f} | {b['current']:.2f} "
              f"| {b['total']:.2f} | {b['dense_ratio']:.2f}x | {ek:.4f} | {ev:.4f} | {ea:.4f} | {eo:.4f} "
              f"| {b['total_once']:.2f} |",
              flush=True)  # fmt: skip
    print(f"\n{args.heads} heads, seed {args.seed}; {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"heads": args.heads, "seed": args.seed, "aging": aging, "settings": results}, fh, indent=1)


if __name__ == "__main__":
    main()
