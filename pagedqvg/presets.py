"""Model presets: the per-layer cache shapes and call patterns of the callers in shared/SEMANTICS.md.

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

Choices made for the presets (SEMANTICS.md gives shapes, not every knob):

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
  head_dim 64, 256 tokens per frame, 40 KiB pages), for `simulate` runs on a CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .quant.config import QuantConfig

#: Default page size of full-size presets (bytes).
FULL_PAGE_BYTES = 2 << 20
#: Default page size of the scaled-down `*-mini` presets (bytes).
MINI_PAGE_BYTES = 40 << 10
#: Tokens per latent frame of the `*-mini` presets (a 16 x 16 grid).
MINI_TOKENS_PER_FRAME = 256
#: The preset `pagedqvg simulate` runs when given no arguments.
DEFAULT_SIMULATE_PRESET = "lingbot-world-mini"
#: The preset `pagedqvg plan` uses when given no `--preset`.
DEFAULT_PLAN_PRESET = "lingbot-world"

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    page_bytes: int = FULL_PAGE_BYTES
    cache_sets: int = 1
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
        return DTYPES[self.dtype]

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
        description="LingBot-World (Wan 14B): 3-frame chunks, 3-frame global sink, 18-frame window",
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
        description="LongLive2 (Wan2.2 5B): 8-frame chunks, 8-frame sink re-pinned on scene cuts, 32-frame window",
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
        description="Self-Forcing (Wan 1.3B): 3-frame chunks, one-chunk global sink, 21-frame window",
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
        page_bytes=MINI_PAGE_BYTES,
        description=f"{preset.name} scaled down (4 layers x 4 heads x 64, {MINI_TOKENS_PER_FRAME} tokens/frame)",
    )


for _name in list(PRESETS):
    PRESETS[f"{_name}-mini"] = mini(PRESETS[_name])


def get_preset(name: str) -> Workload:
    """The preset called `name`; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
