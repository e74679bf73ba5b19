"""Attention mode `view` against mode `heads` on CPU, in one process, at a reduced LingBot-World shape: time per
layer call (a repeated call: a denoise step rewriting the current chunk) and transient bytes (measured peak of the
tensors the call allocates, beside `layout.head_groups`' formula), per group size.

LingBot-World: 40 heads x 128, 1,560 tokens a latent frame, chunks of 3 frames, a 3-frame global sink and an
18-frame window (a 21-frame view). `--tokens-per-frame` shrinks the frame (default 130: 1/12 of the tokens, so one
call is ~20 GFLOP instead of ~2.7 TFLOP); heads and head_dim stay. Output: one line per mode, time as a ratio to
`view`'s in the same process (no absolute claim), and the outputs' equality (`torch.equal`).

`--per-head` (the allowlist's CPU proof, integrations/sglang/head_groups.HEADS_DEFAULT_ALLOWLIST): LingBot-World's
per-head shape at full size: 4,680 queries (a 3-frame chunk of 1,560-token frames) over 28,080 keys (a 3-frame sink
and a 15-frame window), head_dim 128, in fp32 and bf16, with `--heads` heads (default 2: attention is independent per
head, so a few heads stand for 40; the whole call's time is per-head work times heads). Mode `view`
(`update_and_get_attention_kv` + SDPA over all heads) against mode `heads` (`update_and_attend_heads`, groups of
`--group` heads, default 1: the most groups, the most per-group overhead), the same SDPA; the two calls alternate
`--reps` times (pairs, so drift of a shared CPU hits both) and the line gives the median of the pairs' ratios, their
range, in wall time and in CPU time (`time.process_time`: on a shared CPU the wall time also counts other
processes' turns; torch's OpenMP threads spin while they wait, so a thread left idle by the split still counts), and
the verdict against `HEADS_DEFAULT_MARGIN`, which is on the CPU time. Exits 1 if an output differs from view's or a
median CPU-time ratio is over the margin.

Usage: python benchmarks/bench_head_groups.py [--tokens-per-frame 130] [--dtype bf16] [--reps 3] [--groups 1,4,7,10,40]
       python benchmarks/bench_head_groups.py --per-head [--heads 2] [--group 1] [--reps 5] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pagedqvg import BlockPool, PagedCausalKVCache
from pagedqvg.layout.head_groups import (
    choose_head_group,
    heads_transient_bytes,
    view_transient_bytes,
    wave_efficiency,
)

SDPA = torch.nn.functional.scaled_dot_product_attention
HEADS, HEAD_DIM, CHUNK_FRAMES, SINK_FRAMES, WINDOW_FRAMES = 40, 128, 3, 3, 18
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages torch ops return while the block runs (views and in-place results not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n and key not in self._seen and key not in inputs:
                    self._seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n


def build(tpf: int, dtype: torch.dtype, heads: int = HEADS, sink_frames: int = SINK_FRAMES,
          window_frames: int = WINDOW_FRAMES):  # fmt: skip
    """A cache after the sink and a full window of chunks (the view spans sink + window), and the K/V/Q of them."""
    n = CHUNK_FRAMES * tpf
    sink, window = sink_frames * tpf, window_frames * tpf
    chunks = (sink + window) // n + 1
    view_bytes = 2 * (sink + window) * heads * HEAD_DIM * dtype.itemsize
    pool = BlockPool(capacity_bytes=int(view_bytes * 1.5) + (64 << 20), page_bytes=1 << 20)
    cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=sink + window, num_heads=heads, head_dim=HEAD_DIM,
                               dtype=dtype, device="cpu", sink_tokens=sink, global_sink_tokens=sink)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(1, chunks * n, heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(3))
    for c in range(chunks):
        cache.update_and_get_attention_kv(key=k[:, c * n : (c + 1) * n], value=v[:, c * n : (c + 1) * n],
                                          current_chunk_start=c * n)  # fmt: skip
    s = (chunks - 1) * n
    return cache, k[:, s : s + n], v[:, s : s + n], q[:, s : s + n], s


def timed(fn, reps: int):
    fn()  # plans the call
    with PeakBytes() as mem:
        out = fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best, mem.peak, out


def per_head(heads: int, group: int, reps: int, dtypes: list[str]) -> bool:
    """`--per-head`: view vs heads at LingBot-World's per-head shape, paired calls; True when every output equals
    view's and every median ratio is within `HEADS_DEFAULT_MARGIN`."""
    from pagedqvg.integrations.sglang.head_groups import HEADS_DEFAULT_MARGIN

    print(f"LingBot-World per-head shape: 4,680 queries x 28,080 keys x head_dim 128, {heads} heads (attention is "
          f"independent per head), mode heads in groups of {group}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {reps} pairs of calls, alternating order")  # fmt: skip
    return all([_per_head_line(name, heads, group, reps, HEADS_DEFAULT_MARGIN) for name in dtypes])


def _per_head_line(name: str, heads: int, group: int, reps: int, margin: float) -> bool:
    dtype = DTYPES[name]
    cache, k, v, q, s = build(1560, dtype, heads, sink_frames=3, window_frames=15)

    def view_mode():
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
        return SDPA(q.transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2)).transpose(1, 2)

    def heads_mode():
        return cache.update_and_attend_heads(q, key=k, value=v, current_chunk_start=s, head_group_size=group)

    want, got = view_mode(), heads_mode()  # also plans both calls
    T = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s).k.shape[1]
    same = torch.equal(got, want)
    wall: dict[str, list[float]] = {"view": [], "heads": []}
    cpu: dict[str, list[float]] = {"view": [], "heads": []}
    for i in range(reps):
        for mode, fn in (("view", view_mode), ("heads", heads_mode))[:: 1 if i % 2 == 0 else -1]:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
    flops = 4 * q.shape[1] * T * heads * HEAD_DIM
    tv = statistics.median(wall["view"])
    print(f"  {name:<5} T={T:,}: view {tv:7.3f} s wall ({flops / tv / 1e9:5.1f} GFLOP/s), heads g={group} "
          f"{statistics.median(wall['heads']):7.3f} s wall; equal {same}")  # fmt: skip
    ok = same
    for label, t in (("wall time", wall), ("CPU time (this process's threads)", cpu)):
        ratios = [h / w for h, w in zip(t["heads"], t["view"], strict=True)]
        med = statistics.median(ratios)
        ok &= t is wall or med <= margin  # the verdict: CPU time (wall time counts other processes' turns too)
        print(f"        heads/view {label}: median {med:.3f}x, pairs {min(ratios):.3f}-{max(ratios):.3f} "
              f"({' '.join(f'{r:.3f}' for r in ratios)}); margin {margin}x: {'within' if med <= margin else 'OVER'}",
              flush=True)  # fmt: skip
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens-per-frame", type=int, default=130)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--groups", default="1,4,7,10,40")
    ap.add_argument("--per-head", action="store_true", help="LingBot-World's per-head shape, view vs heads (paired)")
    ap.add_argument("--heads", type=int, default=2, help="--per-head: heads of the cache (default 2)")
    ap.add_argument("--group", type=int, default=1, help="--per-head: heads per group of mode heads (default 1)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="--per-head: comma-separated dtypes (default fp32,bf16)")
    args = ap.parse_args()
    if args.per_head:
        sys.exit(0 if per_head(args.heads, args.group, args.reps, args.dtypes.split(",")) else 1)
    dtype = DTYPES[args.dtype]
    cache, k, v, q, s = build(args.tokens_per_frame, dtype)
    Tq = k.shape[1]

    def view_mode():
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
        return SDPA(q.transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2)).transpose(1, 2)

    base, peak, want = timed(view_mode, args.reps)
    T = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s).k.shape[1]
    flops = 4 * Tq * T * HEADS * HEAD_DIM
    print(f"shape: 1 x {Tq} queries x {T} keys x {HEADS} heads x {HEAD_DIM} ({args.dtype}); {flops / 1e9:.1f} GFLOP "
          f"a call; torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'mode':<14}{'time':>10}{'vs view':>9}{'transient':>14}{'formula':>14}{'equal':>7}{'H200 waves*':>13}")
    formula = view_transient_bytes(1, Tq, HEADS, HEAD_DIM, dtype, T)
    print(f"{'view':<14}{base * 1e3:>8.1f}ms{1.0:>8.2f}x{peak:>14,}{formula:>14,}{'-':>7}{'-':>13}")
    full = choose_head_group(1, 4680, HEADS, HEAD_DIM, dtype, 21 * 1560)
    for g in [int(x) for x in args.groups.split(",")]:

        def heads_mode(g=g):
            return cache.update_and_attend_heads(q, key=k, value=v, current_chunk_start=s, head_group_size=g)

        t, peak, got = timed(heads_mode, args.reps)
        formula = heads_transient_bytes(1, Tq, HEADS, HEAD_DIM, dtype, T, g)
        eff = wave_efficiency(1, 4680, HEADS, g)
        print(f"{f'heads g={g}':<14}{t * 1e3:>8.1f}ms{t / base:>8.2f}x{peak:>14,}{formula:>14,}"
              f"{torch.equal(got, want)!s:>7}{eff:>12.1%}")  # fmt: skip
    print(
        f"* wave efficiency of the group size at LingBot-World's full chunk (4,680 queries) on 132 SMs; the cost "
        f"model picks {full.group} heads per group ({full.wave_efficiency:.1%}). Transient: measured peak bytes of "
        f"the call's tensors (SDPA's own workspace included when it returns it), formula: layout.head_groups."
    )


if __name__ == "__main__":
    main()
