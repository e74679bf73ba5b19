"""Seeded synthetic video-like K/V for tests and benchmarks, and error metrics.

The generator mimics what a video DiT's attention sees per latent frame: a grid of patch tokens whose features are
smooth, low-frequency spatial fields that drift across frames (camera motion) plus a few moving blobs (objects),
with per-frame noise; each head projects those features to head_dim with its own fixed random matrices (one linear
part, one tanh part for extra rank), a few channels per head carry large magnitudes (the outlier channels real K/V
have), and K gets a 3-D RoPE rotation (frame, row, column), like Wan-style models.
"""

from __future__ import annotations

import math

import torch

_LATENT_CHANNELS = 24  # smooth latent fields per token
_NONLINEAR_CHANNELS = 16  # tanh features (extra rank)
_MODES = 4  # Fourier modes per latent channel
_BLOBS = 3  # moving objects
_LATENT_NOISE = 0.15  # per-frame noise on the latent fields
_TOKEN_NOISE = 0.05  # per-token noise in head space
_K_OUTLIERS, _V_OUTLIERS = 4, 2  # large-magnitude channels per head


def video_kv(
    num_frames: int,
    tokens_per_frame: int | tuple[int, int],
    num_heads: int,
    head_dim: int,
    *,
    batch: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic video K and V, each [batch, num_frames * tokens_per_frame, num_heads, head_dim] in `dtype` (CPU).

    Args:
        num_frames: latent frames (tokens are frame-major, then row-major over the grid).
        tokens_per_frame: h*w tokens per frame, or the grid (h, w); an int is split into the most square h x w.
        num_heads, head_dim: head count and channels (head_dim even, for RoPE).
        batch: independent videos.
        seed: everything is drawn from one CPU generator seeded with this; same arguments -> identical tensors.
        dtype: output dtype (values are computed in fp32). Typical magnitudes: ~1 per channel, outliers ~5-20.
    """
    if isinstance(tokens_per_frame, tuple):
        gh, gw = tokens_per_frame
    else:
        gh, gw = _grid(tokens_per_frame)
    for name, v in (
        ("num_frames", num_frames),
        ("grid h", gh),
        ("grid w", gw),
        ("num_heads", num_heads),
        ("batch", batch),
    ):
        if v < 1:
            raise ValueError(f"video_kv: {name}={v}; allowed: >= 1")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"video_kv: head_dim={head_dim}; allowed: an even int >= 2 (RoPE rotates pairs)")
    g = torch.Generator(device="cpu").manual_seed(seed)
    F, T, C = num_frames, gh * gw, _LATENT_CHANNELS
    t = torch.arange(F, dtype=torch.float32)[:, None, None]  # [F, 1, 1]
    yy = torch.arange(gh, dtype=torch.float32)[None, :, None] / gh  # [1, h, 1], in frame heights
    xx = torch.arange(gw, dtype=torch.float32)[None, None, :] / gw

    feats = torch.empty(batch, F, gh, gw, C)
    for b in range(batch):
        feats[b] = _latent_field(g, t, yy, xx)
    feats = feats.reshape(batch, F * T, C)

    k = _project(feats, num_heads, head_dim, g, outliers=_K_OUTLIERS, outlier_scale=8.0)
    v = _project(feats, num_heads, head_dim, g, outliers=_V_OUTLIERS, outlier_scale=4.0)
    k = _rope3d(k, F, gh, gw)
    return k.to(dtype), v.to(dtype)


def _latent_field(g: torch.Generator, t: torch.Tensor, yy: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
    """One video's latent features [F, h, w, C]: drifting plane waves, moving blobs and noise, drawn from `g` (the
    draw order is part of `video_kv`'s output: same seed, same tensors). `t`, `yy`, `xx` broadcast to [F, h, w]."""
    F, gh, gw, C = t.shape[0], yy.shape[1], xx.shape[2], _LATENT_CHANNELS
    # camera drift shared by all fields (frame heights/widths per frame) plus per-mode jitter
    cam = torch.randn(2, generator=g) * 0.04
    field = torch.zeros(F, gh, gw, C)
    for c in range(C):
        ky = torch.randint(-3, 4, (_MODES,), generator=g).float()
        kx = torch.randint(-3, 4, (_MODES,), generator=g).float()
        amp = torch.randn(_MODES, generator=g) / (1.0 + ky.abs() + kx.abs())
        phase = torch.rand(_MODES, generator=g) * 2 * math.pi
        vel = cam[:, None] + torch.randn(2, _MODES, generator=g) * 0.01
        for m in range(_MODES):
            arg = ky[m] * (yy - vel[0, m] * t) + kx[m] * (xx - vel[1, m] * t)
            field[..., c] += amp[m] * torch.cos(2 * math.pi * arg + phase[m])
    for _ in range(_BLOBS):
        start = torch.rand(2, generator=g)
        vel = torch.randn(2, generator=g) * 0.03
        sigma = 0.08 + 0.1 * torch.rand(1, generator=g)
        loading = torch.randn(C, generator=g) * 1.5
        cy, cx = start[0] + vel[0] * t, start[1] + vel[1] * t
        d2 = (yy - cy) ** 2 + (xx - cx) ** 2
        field += torch.exp(-d2 / (2 * sigma**2))[..., None] * loading
    field += torch.randn(F, gh, gw, C, generator=g) * _LATENT_NOISE
    return field


def _grid(n: int) -> tuple[int, int]:
    """Most square (h, w) with h * w == n, h <= w."""
    if n < 1:
        raise ValueError(f"video_kv: tokens_per_frame={n}; allowed: >= 1")
    h = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return h, n // h


def _project(
    feats: torch.Tensor, H: int, D: int, g: torch.Generator, *, outliers: int, outlier_scale: float
) -> torch.Tensor:
    """Per-head features -> [B, N, H, D]: linear + 0.5*tanh part, token noise, outlier channels (scaled and biased)."""
    B, N, C = feats.shape
    w_lin = torch.randn(H, C, D, generator=g) / math.sqrt(C)
    w_in = torch.randn(C, _NONLINEAR_CHANNELS, generator=g) / math.sqrt(C)
    w_out = torch.randn(H, _NONLINEAR_CHANNELS, D, generator=g) / math.sqrt(_NONLINEAR_CHANNELS)
    out = torch.einsum("bnc,hcd->bnhd", feats, w_lin)
    out += 0.5 * torch.einsum("bnc,hcd->bnhd", torch.tanh(2.0 * feats @ w_in), w_out)
    out += torch.randn(B, N, H, D, generator=g) * _TOKEN_NOISE
    n_out = min(outliers, D)
    for h in range(H):
        chans = torch.randperm(D, generator=g)[:n_out]
        gain = outlier_scale * (1.0 + torch.rand(n_out, generator=g))
        bias = outlier_scale * torch.randn(n_out, generator=g)
        out[:, :, h, chans] = out[:, :, h, chans] * gain + bias
    return out


def _rope3d(x: torch.Tensor, F: int, gh: int, gw: int, base: float = 10000.0) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) by angles of (frame, row, column); pairs split t/y/x like Wan's 3-D RoPE."""
    D = x.shape[-1]
    pairs = D // 2
    n_y = n_x = pairs // 3
    n_t = pairs - n_y - n_x
    pos_t = torch.arange(F, dtype=torch.float32).repeat_interleave(gh * gw)
    pos_y = torch.arange(gh, dtype=torch.float32).repeat_interleave(gw).repeat(F)
    pos_x = torch.arange(gw, dtype=torch.float32).repeat(F * gh)
    angles = []
    for pos, n in ((pos_t, n_t), (pos_y, n_y), (pos_x, n_x)):
        if n:
            inv = base ** (-torch.arange(n, dtype=torch.float32) / n)
            angles.append(pos[:, None] * inv[None, :])
    ang = torch.cat(angles, dim=1)[None, :, None, :]  # [1, N, 1, pairs]
    cos, sin = torch.cos(ang), torch.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def relative_error(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """||approx - ref||_F / ||ref||_F, in float64 (0 when both are zero; inf when only ref is zero)."""
    r, a = ref.double(), approx.double()
    num, den = torch.linalg.vector_norm(a - r).item(), torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def snr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio 10*log10(sum ref^2 / sum (approx - ref)^2) in dB (inf when exact)."""
    r, a = ref.double(), approx.double()
    sig, noise = (r * r).sum().item(), ((a - r) ** 2).sum().item()
    if noise == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / noise)
