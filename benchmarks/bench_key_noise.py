"""The key-noise score correction (pagedqvg/attention/key_noise.py) on `benchmarks/bench_prq.py --compact`'s attention
setting.

    PYTHONPATH=$PWD python benchmarks/bench_key_noise.py     # ~1-2 min on 2 CPU cores

Data as bench_prq.py's Pareto table: `pagedqvg.planning.synthetic.video_kv` (seed 0, 4 heads x 128, 480p grid), a
window of 3 chunks of 4,680 tokens, each packed on its own; queries = 512 tokens (every 9th) of the 4th chunk's K. Two
windows: "packed only" (bench_prq.py's: the 3 packed chunks) and "+ dense chunk" (the 4th chunk's own K/V appended
unquantized, as the cache holds the current chunk: packed keys compete with dense ones). Attention in fp64,
softmax(q·kᵀ/sqrt(d))·v; error = ||O - O_ref|| / ||O_ref|| against the unquantized window, without and with the
correction (-s²/2 · Σ_b Δ_b²/12 · Σ_{d in b} q_d² on each packed key's score). Also printed: the packed keys'
measured error variance over the model's Δ²/12 (mean over all values). Prints a Markdown table; no asserts.
"""

from __future__ import annotations

import time

import torch

from pagedqvg.planning.synthetic import video_kv
from pagedqvg.quant import QuantConfig, prq_quantize

CHUNK, GRID, HEAD_DIM, HEADS = 4680, (30, 52), 128, 4
MODES = [
    ("int2 sym (reference int2: K=128, blk 64)", QuantConfig(bits=2)),
    ("int2 asym", QuantConfig(bits=2, asymmetric=True)),
    ("int4 sym", QuantConfig(bits=4)),
    ("int4 asym", QuantConfig(bits=4, asymmetric=True)),
    ("int2 trits, blk 64", QuantConfig(bits=2, pack_trits=True)),
    ("compact", QuantConfig.compact()),
]


def packed_chunk(cfg: QuantConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized `[S, H, D]` fp64, per-channel noise variance Δ²/12 `[S, H, D]` fp64) of one chunk."""
    seg = prq_quantize(x, cfg)
    scales = seg.fmt.unpack_token_rows(seg.token_rows).scales.double()  # [S, H, nb]
    var = (scales * scales / 12).repeat_interleave(cfg.block_size, -1)
    return seg.dequantize().double(), var


def attention(q, k, v, bias=None):
    """fp64 attention per head: q `[H, Q, D]`, k/v `[H, T, D]`, bias `[H, Q, T]` or None."""
    s = q @ k.transpose(1, 2) / HEAD_DIM**0.5
    if bias is not None:
        s = s + bias
    return torch.softmax(s, -1) @ v


def rel(a, b):
    return float((a - b).norm() / b.norm())


def measure(cfg: QuantConfig, window, dense, q) -> dict:
    ks, vs, kd, vd, var = [], [], [], [], []
    for k, v in window:
        (kq, kvar), (vq, _) = packed_chunk(cfg, k), packed_chunk(cfg, v)
        ks.append(k.double()), vs.append(v.double()), kd.append(kq), vd.append(vq), var.append(kvar)
    k, v, kq, vq, var = (torch.cat(t).transpose(0, 1) for t in (ks, vs, kd, vd, var))  # [H, T, D]
    qh = q.double().transpose(0, 1)  # [H, Q, D]
    s2 = 1.0 / HEAD_DIM
    bias = -0.5 * s2 * (qh * qh) @ var.transpose(1, 2)  # [H, Q, T]
    out = {"var_ratio": float(((k - kq) ** 2).mean() / var.mean())}
    dk, dv = (x.double().transpose(0, 1) for x in dense)
    zero = torch.zeros(bias.shape[0], bias.shape[1], dk.shape[1], dtype=bias.dtype)
    for name, (K, V, KQ, VQ, B) in {
        "packed": (k, v, kq, vq, bias),
        "mixed": (torch.cat([k, dk], 1), torch.cat([v, dv], 1), torch.cat([kq, dk], 1), torch.cat([vq, dv], 1),
                  torch.cat([bias, zero], 2)),
    }.items():  # fmt: skip
        ref = attention(qh, K, V)
        out[name] = (rel(attention(qh, KQ, VQ), ref), rel(attention(qh, KQ, VQ, B), ref))
    return out


def main() -> None:
    t0 = time.perf_counter()
    ka, va = video_kv(12, GRID, HEADS, HEAD_DIM, seed=0)
    window = [(ka[0, c * CHUNK : (c + 1) * CHUNK], va[0, c * CHUNK : (c + 1) * CHUNK]) for c in range(3)]
    dense = (ka[0, 3 * CHUNK : 4 * CHUNK], va[0, 3 * CHUNK : 4 * CHUNK])
    q = ka[0, 3 * CHUNK : 4 * CHUNK : 9][:512]
    print(f"Key-noise correction, bench_prq.py --compact's attention setting ({HEADS} heads x {HEAD_DIM}, 3 packed "
          f"chunks of {CHUNK}, 512 queries; fp64 attention; torch {torch.__version__})\n")  # fmt: skip
    print("| mode | measured Var(e) / (Δ²/12) | packed only: error off | on | on/off | + dense chunk: error off | on "
          "| on/off |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for label, cfg in MODES:
        m = measure(cfg, window, dense, q)
        (po, pn), (mo, mn) = m["packed"], m["mixed"]
        print(f"| {label} | {m['var_ratio']:.3f} | {po:.4e} | {pn:.4e} | {pn / po:.3f} | {mo:.4e} | {mn:.4e} "
              f"| {mn / mo:.3f} |", flush=True)  # fmt: skip
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
