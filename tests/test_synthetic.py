"""Synthetic video K/V: shapes, determinism, structure (smoothness, outliers, RoPE), metrics."""

from __future__ import annotations

import math

import pytest
import torch

from pagedqvg.planning.synthetic import relative_error, snr_db, video_kv


def test_shapes_and_dtype() -> None:
    k, v = video_kv(3, 40, 2, 32, batch=2)
    assert k.shape == v.shape == (2, 3 * 40, 2, 32)
    assert k.dtype == v.dtype == torch.bfloat16
    k32, _ = video_kv(2, (4, 6), 1, 16, dtype=torch.float32)
    assert k32.shape == (1, 48, 1, 16) and k32.dtype == torch.float32
    assert torch.isfinite(k.float()).all() and torch.isfinite(v.float()).all()


def test_deterministic_for_seed() -> None:
    a = video_kv(2, 24, 2, 16, seed=5)
    b = video_kv(2, 24, 2, 16, seed=5)
    c = video_kv(2, 24, 2, 16, seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="head_dim=15"):
        video_kv(1, 4, 1, 15)
    with pytest.raises(ValueError, match="num_frames=0"):
        video_kv(0, 4, 1, 16)
    with pytest.raises(ValueError, match="tokens_per_frame=0"):
        video_kv(1, 0, 1, 16)


def test_video_like_structure() -> None:
    _, v = video_kv(3, (12, 16), 1, 64, seed=1, dtype=torch.float32)
    x = v[0, :, 0].reshape(3, 12, 16, 64)
    # spatially smooth: neighbouring tokens are much closer than random pairs
    neighbour = (x[:, :, 1:] - x[:, :, :-1]).pow(2).mean()
    shuffled = (x.reshape(-1, 64) - x.reshape(-1, 64)[torch.randperm(576)]).pow(2).mean()
    assert neighbour < 0.5 * shuffled
    # consecutive frames are similar but not identical (motion + per-frame noise)
    frame_diff = (x[1:] - x[:-1]).pow(2).mean()
    assert 0 < frame_diff < 0.5 * shuffled
    # a few large-magnitude channels
    ch = x.reshape(-1, 64).abs().mean(0)
    assert (ch > 4 * ch.median()).sum() >= 1


def test_rope_rotates_k_by_position() -> None:
    from pagedqvg.planning.synthetic import _rope3d

    F, gh, gw, D = 2, 3, 4, 12  # 6 pairs: 2 for frame, 2 for row, 2 for column
    x = torch.randn(1, F * gh * gw, 1, D)
    out = _rope3d(x, F, gh, gw)
    assert torch.allclose(out[0, 0], x[0, 0])  # position (0, 0, 0): identity
    pair_norm = lambda t: t[..., 0::2] ** 2 + t[..., 1::2] ** 2  # noqa: E731
    assert torch.allclose(pair_norm(out), pair_norm(x), rtol=1e-5, atol=1e-5)
    tok = gh * gw  # frame 1, row 0, column 0: only the frame pairs rotate, pair 0 by exactly 1 radian
    c, s = math.cos(1.0), math.sin(1.0)
    x0, x1 = x[0, tok, 0, 0], x[0, tok, 0, 1]
    assert torch.allclose(out[0, tok, 0, :2], torch.stack([x0 * c - x1 * s, x0 * s + x1 * c]), atol=1e-6)
    assert torch.allclose(out[0, tok, 0, 4:], x[0, tok, 0, 4:])
    # K from video_kv carries it: same seed, K differs between two positions with the same content statistics
    k, _ = video_kv(2, (4, 4), 1, 16, seed=2, dtype=torch.float32)
    assert torch.isfinite(k).all() and not torch.equal(k[0, 0], k[0, 16])


def test_metrics() -> None:
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0 and snr_db(ref, ref) == math.inf
    assert relative_error(ref, torch.zeros(2)) == pytest.approx(1.0)
    assert snr_db(ref, torch.zeros(2)) == pytest.approx(0.0)
    approx = ref + torch.tensor([0.5, 0.0])
    assert relative_error(ref, approx) == pytest.approx(0.1)
    assert snr_db(ref, approx) == pytest.approx(20.0)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.zeros(2), torch.ones(2)) == math.inf
    assert relative_error(ref.bfloat16(), ref) == 0.0
