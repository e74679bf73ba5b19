"""Rollout error through SGLang 0.5.23's real LongLive2 stage (issue 23 item 4b): SGLang's LongLive2 transformer
(tiny, seeded random weights, CPU) runs a causal DMD chunk loop for `--chunks` chunks with scene cuts, over KV caches
built by the real `CausalDMDDenoisingStage._allocate_causal_kv_cache`: once with SGLang's own dense cache, once with
pagedqvg installed and quantization off (must equal it bit for bit), once per quantized setting. Prints, per setting,
the final latents' relative L2 error against SGLang's dense cache for every chunk; writes JSON and a plot. No asserts
(tests/test_bench_sglang_rollout.py runs the core at tiny size).

    PYTHONPATH=$PWD python benchmarks/bench_sglang_rollout.py SGLANG_SRC --json benchmarks/results/sglang_rollout.json \
        --plot benchmarks/results/sglang_rollout.png --pareto benchmarks/results/bench_tiers.json   # ~2.5 min

SGLANG_SRC: a folder holding SGLang 0.5.23's `sglang` package (the wheel extracted without `sglang/__init__.py`, as
.ci/sglang_suite.sh does); SGLang's heavy third-party imports resolve to .ci/sglang_plugin.py's placeholders, set up
as tests/sglang_longlive2_pages.py does (about a minute of imports).

The loop, as `LongLive2CausalDMDDenoisingStage` runs it with multi-shot prompts: per chunk, DMD steps t = 1000, 750,
500, 250 (each predicts x0 = x_t - sigma v, sigma = t / 1000, and re-noises it to the next step's sigma; every step
rewrites the chunk's K/V), then a clean pass at t = 0 that writes the chunk's context K/V. Every `--cut-every` chunks
a scene cut: a new prompt (text embedding), the shot's RoPE temporal offset (8 frames per shot, SGLang's default), and
after the chunk's clean pass `pin_current_chunk` on every layer's cache (as the stage's `_pin_current_chunk`): the cut
chunk becomes the pinned sink beside the global sink (LongLive2's `global_sink_tokens` = its sink). Geometry: 2 layers
x 2 heads x 128 channels, 16x16 latents (64 tokens a frame), 2-frame chunks (128 tokens), a 1-chunk sink, a 7-chunk
window (LingBot-World's 18-frame window in chunks: sink, 4 history, 1 recent, the current chunk), fp32 by default (in
bf16 the rounding of this tiny model puts a floor of ~4.4e-3 under every setting, half of int2's error; `--dtype
bfloat16` runs it). Settings: benchmarks/bench_tiers.py's, with `--centroids` centroids (default 4: 32 tokens a
centroid, as LingBot-World's 4,680-token chunks with 128 centroids have 37).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests"), os.path.join(REPO, "benchmarks")]
import sglang_longlive2_pages as harness  # noqa: E402  (SGLang's import setup, shared with the real-stage test)
from bench_tiers import SETTINGS as TIER_SETTINGS  # noqa: E402

from pagedqvg import CacheConfigError, QuantConfig  # noqa: E402

HEADS, HEAD_DIM, LAYERS, CHANNELS, SIDE = 2, 128, 2, 4, 16
FRAMES_PER_CHUNK, SINK_CHUNKS, WINDOW_CHUNKS = 2, 1, 7
TOKENS_PER_FRAME = (SIDE // 2) ** 2
STEPS = (1000, 750, 500, 250)
SHOT_ROPE_OFFSET = 8.0  # LongLive2's multi_shot_rope_offset default (frames per shot)


@dataclasses.dataclass(frozen=True)
class Loop:
    """One rollout's shape: chunks, a scene cut every `cut_every` chunks (0: none), the model's dtype, the seed."""

    chunks: int = 24
    cut_every: int = 8
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def is_cut(self, chunk: int) -> bool:
        return bool(self.cut_every) and chunk > 0 and chunk % self.cut_every == 0

    def shot(self, chunk: int) -> int:
        return chunk // self.cut_every if self.cut_every else 0


def settings(centroids: int, names: list[str] | None = None) -> list[tuple[str, QuantConfig]]:
    """bench_tiers.py's settings (same labels) with `centroids` centroids; `names`: only those (in that order)."""
    table = {label: dataclasses.replace(cfg, centroids=centroids) for label, cfg in TIER_SETTINGS}
    unknown = sorted(set(names or ()) - set(table))
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; known: {list(table)}")
    return [(n, table[n]) for n in names] if names else list(table.items())


def build_model(sgl: types.SimpleNamespace, dtype: torch.dtype) -> torch.nn.Module:
    """SGLang's LongLive2 transformer at this benchmark's geometry, seeded weights (as the harness's)."""
    arch = sgl.Arch(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=CHANNELS, out_channels=CHANNELS,
        text_dim=16, freq_dim=16, ffn_dim=256, num_layers=LAYERS, local_attn_size=WINDOW_CHUNKS * FRAMES_PER_CHUNK,
        sink_size=SINK_CHUNKS * FRAMES_PER_CHUNK, num_frames_per_block=FRAMES_PER_CHUNK,
    )  # fmt: skip
    model = sgl.Model(sgl.Config(arch_config=arch), hf_config={})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise / p.shape[-1] ** 0.5 if p.dim() > 1 else 1 + 0.02 * noise)
    return model.to(dtype).eval()


def allocate(sgl: types.SimpleNamespace, quant: QuantConfig | None, dtype: torch.dtype) -> list:
    """The real stage's `_allocate_causal_kv_cache` (pagedqvg's when installed) with LongLive2's multi-shot policy:
    a 1-chunk sink that is also the global sink (a pinned cut chunk then joins it)."""
    stage = types.SimpleNamespace(num_transformer_blocks=LAYERS, _kv_quant_args=quant)
    sink = SINK_CHUNKS * FRAMES_PER_CHUNK * TOKENS_PER_FRAME
    return sgl.Stage._allocate_causal_kv_cache(
        stage, batch_size=1, kv_cache_size=WINDOW_CHUNKS * FRAMES_PER_CHUNK * TOKENS_PER_FRAME,
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, dtype=dtype, device="cpu", use_int_indices=True,
        sink_tokens=sink, global_sink_tokens=sink,
    )  # fmt: skip


def rollout(
    sgl: types.SimpleNamespace, model: torch.nn.Module, caches: list, loop: Loop, pins: list | None = None
) -> list[torch.Tensor]:
    """The DMD loop over `caches` (module doc); returns each chunk's final latents `[1, C, frames, H, W]` (fp32).
    The random draws are the same for every run, so runs differ only by their caches. `pins`: gets (chunk,
    pinned_start, pinned_len) of the first layer's cache after each chunk's clean pass (the pin, in slots)."""
    gen = torch.Generator().manual_seed(loop.seed + 1)
    shots = max(loop.shot(c) for c in range(loop.chunks)) + 1
    texts = [torch.randn(1, 5, 16, generator=gen).to(loop.dtype) for _ in range(shots)]
    batch = types.SimpleNamespace(enable_sequence_shard=False, enable_teacache=False, enable_spectrum=False, extra={})
    tokens = FRAMES_PER_CHUNK * TOKENS_PER_FRAME
    finals = []
    for chunk in range(loop.chunks):
        x = torch.randn(1, CHANNELS, FRAMES_PER_CHUNK, SIDE, SIDE, generator=gen)
        forward = _forward_of(sgl, model, caches, loop, chunk, batch, texts)
        for i, t in enumerate(STEPS):
            x0 = x - (t / 1000) * forward(x, t)
            if i + 1 < len(STEPS):
                nxt = STEPS[i + 1] / 1000
                x = (1 - nxt) * x0 + nxt * torch.randn(x0.shape, generator=gen)
        forward(x0, 0)  # the clean pass: the chunk's context K/V
        if loop.is_cut(chunk):
            for cache in caches:
                cache.pin_current_chunk(tokens)
        if pins is not None:
            pins.append((chunk, caches[0].pinned_start, caches[0].pinned_len))
        finals.append(x0.to(loop.dtype).float())
    return finals


def _forward_of(sgl, model, caches: list, loop: Loop, chunk: int, batch, texts: list[torch.Tensor]):
    """forward(x, t): the transformer on chunk `chunk`'s latents at timestep t (its shot's prompt and RoPE offset),
    writing the chunk's K/V into `caches`; the prediction in fp32."""
    start_frame = chunk * FRAMES_PER_CHUNK
    shot = loop.shot(chunk)
    rope_frame = start_frame + shot * SHOT_ROPE_OFFSET if shot else start_frame

    def forward(x: torch.Tensor, t: int) -> torch.Tensor:
        with sgl.forward_context(0, None, forward_batch=batch):
            return model(
                hidden_states=x.to(loop.dtype), encoder_hidden_states=texts[shot],
                timestep=torch.full((1, FRAMES_PER_CHUNK), t, dtype=torch.long), kv_cache=caches,
                crossattn_cache=[None] * LAYERS, current_start=start_frame * TOKENS_PER_FRAME, start_frame=rope_frame,
            ).float()  # fmt: skip

    return forward


def run_setting(sgl, model, dense: list[torch.Tensor], loop: Loop, quant: QuantConfig | None) -> dict:
    """One rollout with pagedqvg installed (`quant`; None: quantization off): per-chunk relative L2 errors against
    `dense`, seconds, the pins, the first layer's retained tokens per format at the end (`memory_breakdown`);
    {'refused': message} when the cache refuses the setting (CacheConfigError)."""
    from pagedqvg.integrations.sglang import integration as integ

    integ.install(budget_bytes=256 << 20)
    t0 = time.perf_counter()
    try:
        caches = allocate(sgl, quant, loop.dtype)
        assert type(caches[0]).__module__ == integ.__name__, type(caches[0])
        pins: list = []
        got = rollout(sgl, model, caches, loop, pins)
    except CacheConfigError as exc:
        return {"refused": str(exc)}
    finally:
        integ.uninstall()
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, dense, strict=True)]
    tokens = {k: v for k, v in caches[0].memory_breakdown().items() if k.endswith("_tokens")}  # per format at the end
    return {"errors": errors, "seconds": round(time.perf_counter() - t0, 2), "pins": pins, "tokens_layer0": tokens}


def measure(src: str, loop: Loop, chosen: list[tuple[str, QuantConfig]], log=print) -> dict:
    """The benchmark's core: SGLang's dense run, pagedqvg quant off, then each setting in `chosen`. One intra-op
    thread: this tiny model's matmuls took 13 ms instead of 0.18 ms with 2 threads on the shared 2-core machine."""
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))  # the harness's fixed port may be taken by another run
    sgl = harness._sglang(src)
    runs: dict[str, dict] = {}
    with torch.no_grad(), sgl.runtime(loop.dtype):
        model = build_model(sgl, loop.dtype)
        t0 = time.perf_counter()
        pins: list = []
        dense = rollout(sgl, model, allocate(sgl, None, loop.dtype), loop, pins)  # SGLang's own cache
        norms = [round(float(x.norm() / x.numel() ** 0.5), 4) for x in dense]
        runs["SGLang dense cache"] = {"seconds": round(time.perf_counter() - t0, 2), "pins": pins, "rms": norms}
        log(f"SGLang dense cache: {len(dense)} chunks in {time.perf_counter() - t0:.1f} s; latents rms {norms}")
        for label, quant in [("pagedqvg quant off", None), *chosen]:
            runs[label] = run_setting(sgl, model, dense, loop, quant)
            log(_row(label, runs[label]))
    return {
        "loop": {**dataclasses.asdict(loop), "dtype": str(loop.dtype).removeprefix("torch.")},
        "geometry": dict(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, tokens_per_chunk=FRAMES_PER_CHUNK *
                         TOKENS_PER_FRAME, sink_chunks=SINK_CHUNKS, window_chunks=WINDOW_CHUNKS, steps=STEPS),
        "configs": {label: q.describe() for label, q in chosen},
        "runs": runs,
    }  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _row(label: str, run: dict) -> str:
    if "refused" in run:
        return f"| {label} | refused by the cache: {run['refused']} |"
    e = run["errors"]
    return (f"| {label} | max {max(e):.2e} | mean {sum(e) / len(e):.2e} | last {e[-1]:.2e} | {run['seconds']} s | "
            + " ".join(f"{x:.1e}" for x in e) + " |")  # fmt: skip


def plot(result: dict, path: str) -> None:
    """Error per chunk, one line per setting that has errors (log scale), scene cuts dotted. matplotlib probes the
    IPython module, which is one of SGLang's placeholders after a run here: it is hidden while plotting."""
    placeholder = sys.modules.pop("IPython", None)
    try:
        _plot(result, path)
    finally:
        if placeholder is not None:
            sys.modules["IPython"] = placeholder


def _plot(result: dict, path: str) -> None:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    loop = result["loop"]
    fig = Figure(figsize=(10, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    curves = {k: r["errors"] for k, r in result["runs"].items() if "errors" in r and max(r["errors"]) > 0}
    colors = [matplotlib.colormaps["tab20"](i % 20) for i in range(len(curves))]
    for (label, ys), color in zip(curves.items(), colors, strict=True):
        style = "-" if label.startswith(("reference", "compact")) else "--"
        ax.plot(range(1, len(ys)), ys[1:], style, marker=".", ms=3, lw=1, color=color, label=label)
    for c in range(loop["cut_every"], loop["chunks"], loop["cut_every"]) if loop["cut_every"] else []:
        ax.axvline(c, color="grey", lw=0.5, ls=":")
    title = f"SGLang 0.5.23 LongLive2 stage, tiny random weights, {loop['dtype']} (chunk 0: 0 for all; dotted: cuts)"
    ax.set(xlabel="chunk", ylabel="final latents rel. L2 error\nvs SGLang's dense cache", yscale="log", title=title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=72)


def pareto(result: dict, tiers: dict, target_gib: float = 7.6) -> str:
    """Markdown: per setting, bench_tiers.py's whole-cache GiB at LingBot-World's 18-frame window (40 layers) and
    attention-output error (aged), this rollout's max / mean error and the chunks at or below reference int2's, and
    whether issue 23's target holds (<= `target_gib`, attention error <= int2's, rollout <= int2's at every chunk)."""
    by_label = {s["setting"]: s for s in tiers["settings"]}
    runs = result["runs"]
    base_attn = by_label["reference int2"]["attn_err_aged"]
    base = runs.get("reference int2", {}).get("errors")
    head = "| setting | GiB (40 layers) | vs dense | attn err (a) | rollout max (b) | rollout mean (b) | <= int2 |"
    lines = [head + " target |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for label, t in by_label.items():
        run = runs.get(label, {})
        gib, attn = t["gib"]["total"], t["attn_err_aged"]
        if "errors" not in run or base is None:
            lines.append(f"| {label} | {gib:.2f} | {t['gib']['dense_ratio']:.2f}x | {attn:.4f} | - | - | - | - |")
            continue
        e = run["errors"]
        below = sum(a <= b for a, b in zip(e, base, strict=True))
        ok = gib <= target_gib and attn <= base_attn and below == len(e)
        lines.append(
            f"| {label} | {gib:.2f} | {t['gib']['dense_ratio']:.2f}x | {attn:.4f} | {max(e):.2e} | "
            f"{sum(e) / len(e):.2e} | {below} of {len(e)} | {'**holds**' if ok else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sglang_src")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--cut-every", type=int, default=8)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--centroids", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", nargs="*", help="labels of bench_tiers.py's settings (default: all)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--replot", metavar="JSON", help="no run: plot (--plot) / tabulate (--pareto) a JSON it wrote")
    ap.add_argument("--pareto", metavar="TIERS_JSON", help="print the Pareto table with bench_tiers.py's JSON")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as fh:
            result = json.load(fh)
    else:
        result = run_from_args(args)
    if args.plot:
        plot(result, args.plot)
    if args.pareto:
        with open(args.pareto) as fh:
            print(pareto(result, json.load(fh)))


def run_from_args(args: argparse.Namespace) -> dict:
    """The benchmark's run for the command line (written to --json when given)."""
    loop = Loop(args.chunks, args.cut_every, getattr(torch, args.dtype), args.seed)
    result = measure(args.sglang_src, loop, settings(args.centroids, args.settings))
    result["centroids"] = args.centroids
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
