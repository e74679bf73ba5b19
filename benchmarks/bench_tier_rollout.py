"""Rollout error of formats by age (issue 23 item 4b, the fallback): a tiny random-weight causal transformer rolls
out >= 20 chunks autoregressively with scene cuts, once with a dense bf16 cache and once per setting with the cache
contents stored as each tier's format would return them; per chunk, the final latents' relative error against the
dense rollout. Writes a plot and JSON. No asserts.

    PYTHONPATH=$PWD python benchmarks/bench_tier_rollout.py --plot benchmarks/results/tier_rollout.png \
        --json benchmarks/results/tier_rollout.json

NOT SGLang's LongLive2 stage: SGLang is not installed in this environment (`import sglang` fails), and the cache
refuses tiered configs until its aging lands (see README Status). What it is: 2 layers x 2 heads x 128 channels
(hidden 256), 512 tokens per chunk, `--chunks` chunks, 2 denoise steps + 1 clean pass per chunk (the clean pass
writes the chunk's K/V), LongLive2's window shape in chunks: 1 sink chunk, a 6-chunk rolling window (4 history, 1
recent, the current chunk), a scene cut every `--cut-every` chunks that makes the cut chunk the new sink (the old
sink leaves; in the cache the pinned chunk first rolls down to slot 0 - simplified here to an immediate swap).
Tier policy as `policy.tier_targets`: a completed chunk takes its role's format; a chunk leaving the recent tier is
repacked from its decoded values (`aged`, what the cache does); chunks only move to coarser formats.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pagedqvg.quant import QuantConfig, prq_quantize
from pagedqvg.quant.config import format_rank
from pagedqvg.quant.fp8 import Fp8Format

L, H, D, N = 2, 2, 128, 512
HIDDEN = H * D
WINDOW, KEEP_RECENT = 6, 1  # non-sink chunks in the window (current included), recent chunks

SETTINGS: list[tuple[str, QuantConfig]] = [
    ("reference int4", QuantConfig(bits=4)),
    ("reference int2", QuantConfig(bits=2)),
    ("compact", QuantConfig.compact()),
    ("sink int4 / recent int4 / history compact", QuantConfig.compact(sink_format="int4", recent_format="int4")),
    ("sink compact / recent int4 / history compact", QuantConfig.compact(recent_format="int4")),
]


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

    out = {"in": w(64, HIDDEN), "out": w(HIDDEN, 64) * 0.5}
    for i in range(L):
        out |= {f"q{i}": w(HIDDEN, HIDDEN), f"k{i}": w(HIDDEN, HIDDEN), f"v{i}": w(HIDDEN, HIDDEN),
                f"o{i}": w(HIDDEN, HIDDEN), f"m{i}": w(HIDDEN, 2 * HIDDEN), f"n{i}": w(2 * HIDDEN, HIDDEN)}  # fmt: skip
    return out


def encode(fmt: str, cfg: QuantConfig, tier: str, x: torch.Tensor) -> torch.Tensor:
    """[N, H, D] bf16 -> decoded after storage in `fmt` (the tier format of `tier` in `cfg`)."""
    if fmt == "bf16":
        return x
    if fmt == "fp8":
        f = Fp8Format(D, H)
        return f.dequantize(f.quantize(x), x.dtype)
    return prq_quantize(x, cfg.tier_quant(tier)).dequantize()


class TierCache:
    """Per layer, chunk id -> [format, K, V] (decoded values in bf16); the sink chunk id; tier policy on advance."""

    def __init__(self, cfg: QuantConfig | None) -> None:
        self.cfg = cfg
        self.chunks: list[dict[int, list]] = [{} for _ in range(L)]
        self.sink = 0

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.chunks[layer][c] for c in sorted(self.chunks[layer])]
        return torch.cat([i[1] for i in items]), torch.cat([i[2] for i in items])

    def write(self, layer: int, chunk: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.chunks[layer][chunk] = ["bf16", k, v]

    def advance(self, current: int) -> None:
        """Before chunk `current`: evict beyond the window, then age every completed chunk into its role's format."""
        for layer in range(L):
            store = self.chunks[layer]
            others = sorted(c for c in store if c != self.sink)
            for c in others[: max(0, len(others) - (WINDOW - 1))]:
                del store[c]
            if self.cfg is None:
                continue
            others = sorted(c for c in store if c != self.sink)
            recent = set(others[-KEEP_RECENT:])
            for c, item in store.items():
                tier = "sink" if c == self.sink else ("recent" if c in recent else "history")
                want = self.cfg.tier_format(tier)
                if format_rank(want) < format_rank(item[0]):
                    store[c] = [want, encode(want, self.cfg, tier, item[1]), encode(want, self.cfg, tier, item[2])]

    def cut(self, chunk: int) -> None:
        """Scene cut after `chunk`'s clean pass: it becomes the sink, the old sink leaves."""
        for layer in range(L):
            if self.sink != chunk:
                self.chunks[layer].pop(self.sink, None)
        self.sink = chunk


def forward(w: dict, x: torch.Tensor, t: float, cache: TierCache, chunk: int, write: bool) -> torch.Tensor:
    """One pass over chunk latents x [N, 64]: returns the velocity; with `write`, stores each layer's K/V."""
    h = x @ w["in"] + t
    for i in range(L):
        q, k, v = ((h @ w[f"{n}{i}"]).view(N, H, D).to(torch.bfloat16) for n in "qkv")
        if write:
            cache.write(i, chunk, k, v)
        if cache.chunks[i]:
            ck, cv = cache.kv(i)
            if not write:
                ck, cv = torch.cat([ck, k]), torch.cat([cv, v])
        else:
            ck, cv = k, v
        att = torch.softmax(q.float().transpose(0, 1) @ ck.float().permute(1, 2, 0) / math.sqrt(D), dim=-1)
        o = (att @ cv.float().transpose(0, 1)).transpose(0, 1).reshape(N, HIDDEN)
        h = h + o @ w[f"o{i}"]
        h = h + torch.relu(h @ w[f"m{i}"]) @ w[f"n{i}"]
        h = h / h.norm(dim=-1, keepdim=True) * math.sqrt(HIDDEN)
    return h @ w["out"]


def rollout(w: dict, cfg: QuantConfig | None, chunks: int, cut_every: int, seed: int) -> list[torch.Tensor]:
    cache = TierCache(cfg)
    g = torch.Generator().manual_seed(seed)
    noises = [torch.randn(N, 64, generator=g) for _ in range(chunks)]
    finals = []
    for c in range(chunks):
        cache.advance(c)
        x = noises[c]
        for t in (1.0, 0.5):
            x = x - 0.5 * forward(w, x, t, cache, c, write=False)
        forward(w, x, 0.0, cache, c, write=True)  # the clean pass writes the chunk's context
        finals.append(x)
        if cut_every and c > 0 and c % cut_every == 0:
            cache.cut(c)
    return finals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--cut-every", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot")
    ap.add_argument("--json")
    args = ap.parse_args()
    w = weights(args.seed)
    t0 = time.perf_counter()
    dense = rollout(w, None, args.chunks, args.cut_every, args.seed)
    curves = {}
    for label, cfg in SETTINGS:
        got = rollout(w, cfg, args.chunks, args.cut_every, args.seed)
        curves[label] = [float((a - b).norm() / b.norm()) for a, b in zip(got, dense, strict=True)]
        print(f"| {label} | max {max(curves[label]):.4f} | mean {sum(curves[label]) / args.chunks:.4f} | "
              + " ".join(f"{e:.4f}" for e in curves[label]) + " |", flush=True)  # fmt: skip
    print(f"\n{args.chunks} chunks, cut every {args.cut_every}, seed {args.seed}; {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"chunks": args.chunks, "cut_every": args.cut_every, "seed": args.seed, "curves": curves}, fh,
                      indent=1)  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5))
        for label, ys in curves.items():
            ax.plot(range(len(ys)), ys, marker=".", label=label)
        for c in range(args.cut_every, args.chunks, args.cut_every) if args.cut_every else []:
            ax.axvline(c, color="grey", lw=0.5, ls=":")
        ax.set(xlabel="chunk", ylabel="final latents rel. error vs dense cache", yscale="log",
               title="Tiny random-weight rollout (not SGLang's LongLive2 stage); dotted: scene cuts")  # fmt: skip
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
