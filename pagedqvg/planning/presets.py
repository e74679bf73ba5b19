"""Model presets: the per-layer cache shapes and call patterns of the callers in docs/SEMANTICS.md.

A `Workload` is everything `pagedqvg plan` and `pagedqvg simulate` need: the model shape, the chunking, the sink and
window (in latent frames), the page size, the call pattern and the quantization settings. Every field can be
overridden from the command line.

Geometry of one layer's cache (frames are latent frames; `tpf` = tokens per frame; all sizes in tokens = slots):

- chunk `n = chunk_frames * tpf` (one advance appends one chunk; one chunk = one segment in the pool);
- sink `S = sink_frames * tpf` (`sink_tokens`), global sink `GS = S` when `global_sink` is true, else 0;
- cache size `C = max(S, GS) + window_frames * tpf`: the sink plus a rolling window of `window_frames` frames that
  *includes* the chunk being denoised, so `window_frames >= chunk_frames` (else the chunk would roll onto the sink);
- attention window `W = C` (0 in the cache), unless `attention_window_tokens` is set.

`sink_tokens`, `global_sink_tokens`, `cache_size_tokens` and `attention_window_tokens` override the derived values.

Choices made for the presets (docs/SEMANTICS.md gives shapes, not every knob):

- `lingbot-world` and `self-forcing`: the first frames are a permanent global sink, `S = GS = sink_frames * tpf`
  (effective sink `E = S`). Self-Forcing's sink is one 3-frame chunk.
- `longlive2`: `S = 8 frames`, `GS = 0`, a scene cut every `scene_cut_every` chunks calls
  `pin_current_chunk(n)` after the chunk's clean pass. Before the first cut `E = S` (the first chunk is the sink).
  A cut pins the current chunk (`P = L - n`, `PL = min(S, n)`); while it rolls down `E = GS = 0`, so the old sink
  is evicted; once it reaches slot `GS = 0` it is the new sink (`E = PL`). With a global sink (`GS = S`, flag
  `--global-sink-tokens`) the first frames would stay forever and the pin would add to them (`E = GS + PL`).
- Call pattern per chunk and layer: one advance (the first denoise step), `denoise_steps - 1` in-place rewrites of
  the same range, one clean context rewrite: `denoise_steps + 1` calls (5 for the default 4 steps).
- `cache_sets` (default 1): independent cache sets of `layers` caches each, e.g. 2 with classifier-free guidance.
- `*-mini` presets keep a preset's frame counts and call pattern with a tiny per-frame shape (4 layers, 4 heads,
  head_dim 64, 256 tokens per frame), for `simulate` runs on a CPU. Their compact mode (`--kv-cache-quant compact`)
  has one fitted scale per token-head (blocks of 64, as compact's 128-channel blocks are at head_dim 128).
- Every preset's own quantization is off (`QuantConfig()`, SGLang's defaults); `plan` lists off, int4, int2 and
  compact next to it (`planner.mode_quant`), each with the preset's keep-recent/sink/sink-keep/seed policy.
- `page_bytes` is None ("auto", the default): the planner picks the page size from the record sizes of the segment
  kinds in use (`layout.choose_page_bytes`).
- Deployment (`pagedqvg plan --gpu ...`): `ulysses` / `tp` ranks split the heads (each rank's caches hold
  `heads / (ulysses * tp)` heads of every token, as Ulysses sequence parallelism and tensor parallelism do);
  `sessions` concurrent sessions of `cache_sets` cache sets each share one pool.

Weights (`weights_bytes`, the default of `pagedqvg plan --weights`): an estimate of the **DiT weights only** on one
GPU, published parameter count x 2 bytes (bf16), from the model cards named in `weights_source`. Not included: the
text encoder (Wan's umT5-XXL encoder, about 5.7B parameters, often offloaded after encoding the prompt), the VAE
(Wan-VAE, about 0.13B parameters: small), activations and workspace (`--reserve`). With tensor parallelism the
weights are split across ranks (`weights / tp`); Ulysses ranks each hold all of them. LingBot-World is counted as
one 14B Wan DiT; if a deployment keeps both experts of Wan2.2 A14B resident (27B parameters), pass `--weights 54GB`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pagedqvg.quant.config import QuantConfig
from pagedqvg.validation import DTYPES_BY_NAME

#: Bytes per parameter of bf16 weights.
BF16_BYTES_PER_PARAM = 2
#: Tokens per latent frame of the `*-mini` presets (a 16 x 16 grid).
MINI_TOKENS_PER_FRAME = 256
#: The preset `pagedqvg simulate` runs when given no arguments.
DEFAULT_SIMULATE_PRESET = "lingbot-world-mini"
#: The preset `pagedqvg plan` uses when given no `--preset`.
DEFAULT_PLAN_PRESET = "lingbot-world"


@dataclass(frozen=True, slots=True)
class Workload:
    """One model's cache workload. Frame counts in latent frames, token counts in tokens, bytes in bytes."""

    name: str
    layers: int
    heads: int
    head_dim: int
    tokens_per_frame: int
    chunk_frames: int
    sink_frames: int
    window_frames: int
    global_sink: bool = True
    scene_cut_every: int = 0  # chunks between pins (0: never); chunk k is pinned when k > 0 and k % every == 0
    denoise_steps: int = 4
    batch_size: int = 1
    dtype: str = "bf16"
    page_bytes: int | None = None  # None: auto (layout.choose_page_bytes)
    cache_sets: int = 1
    sessions: int = 1  # concurrent sessions in one pool, `cache_sets` cache sets each
    ulysses: int = 1  # Ulysses sequence-parallel ranks (split heads)
    tp: int = 1  # tensor-parallel ranks (split heads and weights)
    weights_bytes: int = 0  # DiT weights on one GPU before tensor parallelism (see the module docstring)
    weights_source: str = ""
    chunks: int = 20  # chunks `simulate` runs
    sink_tokens: int | None = None
    global_sink_tokens: int | None = None
    cache_size_tokens: int | None = None
    attention_window_tokens: int | None = None
    quant: QuantConfig = field(default_factory=QuantConfig)
    description: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The cache dtype as a torch dtype."""
        return DTYPES_BY_NAME[self.dtype]

    @property
    def ranks(self) -> int:
        """Ranks the heads are split across: `ulysses * tp`."""
        return self.ulysses * self.tp

    def replace(self, **changes: object) -> Workload:
        """A copy with `changes` applied (None values are ignored, so unset CLI flags keep the preset's value)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields (quant as its own dict)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "quant"}
        out["quant"] = quant_as_dict(self.quant)
        return out


def quant_as_dict(cfg: QuantConfig) -> dict[str, object]:
    """A QuantConfig as JSON-ready fields plus its SGLang mode name."""
    out: dict[str, object] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    out["mode"] = cfg.mode
    return out


PRESETS: dict[str, Workload] = {
    "lingbot-world": Workload(
        name="lingbot-world",
        layers=40,
        heads=40,
        head_dim=128,
        tokens_per_frame=1560,
        chunk_frames=3,
        sink_frames=3,
        window_frames=18,
        global_sink=True,
        weights_bytes=14_000_000_000 * BF16_BYTES_PER_PARAM,
        weights_source="Wan 14B DiT: 14B parameters x 2 B (Wan2.1 model card; Wan paper arXiv:2503.20314)",
        description="LingBot-World (Wan 14B)",
    ),
    "longlive2": Workload(
        name="longlive2",
        layers=30,
        heads=24,
        head_dim=128,
        tokens_per_frame=880,
        chunk_frames=8,
        sink_frames=8,
        window_frames=32,
        global_sink=False,
        scene_cut_every=10,
        weights_bytes=5_000_000_000 * BF16_BYTES_PER_PARAM,
        weights_source="Wan2.2 TI2V-5B DiT, 5B parameters x 2 B (Wan2.2-TI2V-5B model card)",
        description="LongLive2 (Wan2.2 5B)",
    ),
    "self-forcing": Workload(
        name="self-forcing",
        layers=30,
        heads=12,
        head_dim=128,
        tokens_per_frame=1560,
        chunk_frames=3,
        sink_frames=3,
        window_frames=21,
        global_sink=True,
        weights_bytes=1_300_000_000 * BF16_BYTES_PER_PARAM,
        weights_source="Wan2.1 T2V-1.3B DiT, 1.3B parameters x 2 B (Wan2.1-T2V-1.3B model card)",
        description="Self-Forcing (Wan 1.3B)",
    ),
}


def mini(preset: Workload) -> Workload:
    """`preset` scaled down for CPU runs: same frames and call pattern, 4 layers x 4 heads x 64, 256 tokens/frame."""
    return dataclasses.replace(
        preset,
        name=f"{preset.name}-mini",
        layers=4,
        heads=4,
        head_dim=64,
        tokens_per_frame=MINI_TOKENS_PER_FRAME,
        weights_bytes=0,
        weights_source="none (a scaled-down preset without a model)",
        description=f"{preset.name} scaled down",
    )


for _name in list(PRESETS):
    PRESETS[f"{_name}-mini"] = mini(PRESETS[_name])


_MIB = 1 << 20
#: Devices `pagedqvg plan --gpu NAME` knows: name -> (total memory in bytes, description). Totals are what
#: `nvidia-smi` reports as total memory (MiB), a little under the marketed size; the KV budget is then
#: `total * --memory-fraction - weights / tp - --reserve`.
GPUS: dict[str, tuple[int, str]] = {
    "H200": (143771 * _MIB, "NVIDIA H200 141GB (HBM3e)"),
    "H100": (81559 * _MIB, "NVIDIA H100 80GB (SXM / PCIe)"),
    "H20": (97871 * _MIB, "NVIDIA H20 96GB"),
    "A100-80GB": (81920 * _MIB, "NVIDIA A100 80GB"),
    "A100-40GB": (40960 * _MIB, "NVIDIA A100 40GB"),
    "L40S": (46068 * _MIB, "NVIDIA L40S 48GB"),
    "RTX6000-ADA": (49140 * _MIB, "NVIDIA RTX 6000 Ada 48GB"),
    "RTX4090": (24564 * _MIB, "NVIDIA GeForce RTX 4090 24GB"),
    "L4": (23034 * _MIB, "NVIDIA L4 24GB"),
}
#: `--memory-fraction` when `--gpu` is given without it (vLLM's default `--gpu-memory-utilization`).
DEFAULT_GPU_MEMORY_FRACTION = 0.9


def _gpu_key(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def get_gpu(name: str) -> tuple[str, int, str]:
    """`(canonical name, total bytes, description)` of a `GPUS` entry (case, spaces and dashes ignored; `A100` is
    ambiguous). ValueError listing the known names otherwise."""
    wanted = _gpu_key(name)
    for key, (total, text) in GPUS.items():
        if _gpu_key(key) == wanted:
            return key, total, text
    raise ValueError(f"--gpu {name!r} is not in the device table; known: {', '.join(GPUS)} (or use --budget BYTES)")


def shape_text(w: Workload) -> str:
    """The workload's chunking, sink and window in words, from its own fields (so overrides show)."""
    sink = f"{w.sink_tokens}-token sink" if w.sink_tokens is not None else f"{w.sink_frames}-frame sink"
    if w.global_sink_tokens is not None:
        sink += f", {w.global_sink_tokens}-token global sink"
    elif w.global_sink and (w.sink_tokens or w.sink_frames):
        sink = sink.replace("sink", "global sink")
    if not (w.sink_tokens if w.sink_tokens is not None else w.sink_frames) and not w.global_sink_tokens:
        sink = "no sink"
    if w.scene_cut_every:
        sink += f" re-pinned every {w.scene_cut_every} chunks"
    window = (
        f"cache {w.cache_size_tokens} tokens" if w.cache_size_tokens is not None else f"{w.window_frames}-frame window"
    )
    return f"{w.chunk_frames}-frame chunks, {sink}, {window}"


def get_preset(name: str) -> Workload:
    """The preset called `name`; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


#: Formats by age recommended per full-size preset (issue 23; README "Formats by age", Pareto table): sink int4, the
#: recent chunk int4, the history compact. Why, at LingBot-World's 18-frame window (40 layers): 7.36 GiB (3.39x
#: dense; `pagedqvg plan`'s tier lines) vs 10.07 GiB for reference int2, with a lower attention-output error (0.0875
#: vs 0.0986, benchmarks/bench_tiers.py, the recent chunk repacked from its decoded int4 values) and, through SGLang's
#: real LongLive2 stage (benchmarks/bench_sglang_rollout.py: 24 chunks, scene cuts, tiny random weights, fp32), a
#: rollout error at or below int2's at every chunk (at most 0.54x; max 4.3e-3 vs 1.1e-2). The int4 sink is what
#: keeps the early chunks close (the sink's format sets chunk 1's error: 1.8e-3 vs compact's 5.1e-3 and int2's
#: 1.1e-2). The one smaller setting that also meets issue 23's target, sink compact / recent int4 / history compact
#: (6.79 GiB), has higher errors on both measures (0.0921; rollout mean 3.6e-3 vs 2.5e-3). LongLive2 and Self-Forcing
#: share the chunk structure (one sink chunk, keep_recent 1, head_dim 128). The presets' own quantization stays off
#: (SGLang's default); this is the setting to pass (`--kv-cache-quant compact --kv-cache-quant-sink int4
#: --kv-cache-quant-recent int4`, or the plugin's PAGEDQVG_KV_CACHE_QUANT* variables).
RECOMMENDED_TIERS: dict[str, QuantConfig] = {
    name: QuantConfig.compact(sink_format="int4", recent_format="int4")
    for name in ("lingbot-world", "longlive2", "self-forcing")
}
