"""The attention-from-pages section of bench_kernels_cuda.py (issue 21 item 4): ms per `update_and_attend` call on
the Triton backend (kernels/triton_attention.py, one launch) against the view path (`update_and_get_attention_kv`
+ SDPA on the view) and, when `flashinfer` imports, FlashInfer's paged prefill over the same rows as bf16 pages
(page size 16; the copy into its layout is not timed).

Shapes (LingBot-World): 40 heads, or 20 per Ulysses rank; head_dim 128; 1,560 tokens/frame; a 4,680-token chunk
(3 frames) of queries; windows of 18 and 96 frames plus a 3-frame sink; quant off / int2 / compact (packed parts
quantized for real by the cache as it fills). `--tiny`: 2 heads of 32, 16-token frames (interpreter smoke run).
Self-check per line: the kernel's error against fp64 attention over the view (first 64 query rows) within 1.5x
SDPA-on-view's error in the same dtype; FlashInfer's output within the same bound when it runs.

Split-KV (kernels/triton_attention_split.py): under each line, `update_and_attend` timed with the keys forced into
S = 1 (one launch), 2, 4, 8 ranges and the heuristic's pick (`*`; `attention_split.choose_splits` with this GPU's
SM count), for the full chunk's queries and for a short query (`SHORT_QUERY` rows: few query blocks, where the
heuristic splits), each with its speedup over S = 1 and the same self-check (every S must pass).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig

MODES = {"off": None, "int2": QuantConfig(bits=2), "compact": QuantConfig.compact()}
TINY_MODES = {"off": None, "int2": QuantConfig(bits=2, centroids=8, block_size=16),
              "compact": QuantConfig.compact(centroids=8, block_size=32)}  # fmt: skip


#: Key ranges timed against one launch (forced through `attention_split.set_forced_splits`).
SPLITS = (1, 2, 4, 8)
#: Query rows of the short-query split lines (4 query blocks of 64; 16 with --tiny).
SHORT_QUERY = 256


def _timed(fn, device: torch.device, iters: int) -> float:
    """Median seconds of `fn()` (CUDA events on CUDA, wall clock elsewhere), after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _flashinfer(q, k, v):
    """`(run, error text)`: a closure running FlashInfer's paged prefill over `k`, `v` `[1, T, H, D]` copied into
    16-token pages, or None and why it cannot run."""
    try:
        import flashinfer
    except Exception as exc:
        return None, f"flashinfer does not import ({type(exc).__name__})"
    try:
        T, H, D = k.shape[1], k.shape[2], k.shape[3]
        ps, dev = 16, q.device
        n = -(-T // ps)
        cache = torch.zeros(n, 2, ps, H, D, dtype=k.dtype, device=dev)
        cache[:, 0].view(-1, H, D)[:T] = k[0]
        cache[:, 1].view(-1, H, D)[:T] = v[0]
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        i32 = dict(dtype=torch.int32, device=dev)
        w.plan(torch.tensor([0, q.shape[1]], **i32), torch.tensor([0, n], **i32), torch.arange(n, **i32),
               torch.tensor([T - (n - 1) * ps], **i32), H, H, D, ps, causal=False)  # fmt: skip
        return (lambda: w.run(q[0], cache).unsqueeze(0)), ""
    except Exception as exc:  # an API of another version: reported, not a failure of this script
        return None, f"flashinfer failed: {type(exc).__name__}: {exc}"[:200]


def _fill(heads, d, frame, window, quant, dtype, device):
    """A cache of `window` frames + a 3-frame sink, filled chunk by chunk (3 frames) until the window rolls;
    returns the cache and the start of the next chunk."""
    chunk = 3 * frame
    pool = BlockPool(capacity_bytes=int(2.2 * 2 * (window + 6) * frame * heads * d * 2) + (64 << 20),
                     page_bytes=(2 << 20) if device.type == "cuda" else 16384, device=device)  # fmt: skip
    c = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=(window + 3) * frame, num_heads=heads, head_dim=d,
                           dtype=dtype, device=device, sink_tokens=chunk, global_sink_tokens=chunk, quant=quant,
                           name="bench")  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    start = 0
    for _ in range(window // 3 + 2):
        kv = torch.randn(2, 1, chunk, heads, d, generator=gen, device=device, dtype=dtype)
        c.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=start)
        start += chunk
    return c, start, gen


def bench_attention(device: torch.device, dtype: torch.dtype, tiny: bool, iters: int) -> bool:
    """Print one line per (heads, window, mode); True when every self-check passed."""
    heads_list, d, frame, windows, modes = ((2,), 32, 16, (3, 6), TINY_MODES) if tiny else \
        ((40, 20), 128, 1560, (18, 96), MODES)  # fmt: skip
    if device.type == "cpu":
        os.environ["PAGEDQVG_KERNELS"] = "triton"  # the kernel through the interpreter (auto picks torch on CPU)
    print("\nattention from pages (update_and_attend, Triton) vs view + SDPA vs FlashInfer paged prefill")
    ok = True
    for heads in heads_list:
        for window in windows:
            for mode, quant in modes.items():
                c, start, gen = _fill(heads, d, frame, window, quant, dtype, device)
                chunk = 3 * frame
                k, v, q = (torch.randn(1, chunk, heads, d, generator=gen, device=device, dtype=dtype) for _ in range(3))
                s = start - chunk  # rewrite the newest chunk: the repeated call of a denoising step

                def attend(k=k, v=v, q=q, s=s, c=c):
                    return c.update_and_attend(q, key=k, value=v, current_chunk_start=s)

                def view_sdpa(k=k, v=v, q=q, s=s, c=c):
                    view = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
                    return _sdpa(q, view.k, view.v)

                t_ours, t_view = _timed(attend, device, iters), _timed(view_sdpa, device, iters)
                out = attend()
                view = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
                m = 64
                ref = _sdpa(q[:, :m].double(), view.k.double(), view.v.double())
                e_sdpa = (_sdpa(q[:, :m], view.k, view.v).double() - ref).norm().item()
                e_ours = (out[:, :m].double() - ref).norm().item()
                good = e_ours <= 1.5 * e_sdpa
                fi, why = _flashinfer(q, view.k, view.v)
                fi_text = why
                if fi is not None:
                    t_fi = _timed(fi, device, iters)
                    e_fi = (fi()[:, :m].double() - ref).norm().item()
                    fi_text = f"flashinfer {t_fi * 1e3:8.3f} ms (ours/fi {t_ours / t_fi:.2f}x, error {e_fi:.3g})"
                print(f"  H={heads:<3} window={window:>3} fr {mode:<8} T={view.k.shape[1]:>7} "
                      f"ours {t_ours * 1e3:8.3f} ms  view+SDPA {t_view * 1e3:8.3f} ms ({t_view / t_ours:.2f}x)  "
                      f"error {e_ours:.3g} vs SDPA {e_sdpa:.3g} {'ok' if good else 'OVER 1.5x'}; {fi_text}")
                ok &= good
                ok &= _split_lines(c, q, k, v, s, view, mode != "off", iters, 16 if tiny else SHORT_QUERY)
                del c, view
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return ok


def _split_lines(c, q, k, v, s, view, packed: bool, iters: int, short: int) -> bool:
    """Time `update_and_attend` at each forced S of `SPLITS` and the heuristic's pick, for the full query `q` and
    its first `short` rows; each output checked against fp64 over `view` (first 64 query rows) within 1.5x
    SDPA-on-view's error. One printed line per query length; True when every check passed."""
    from pagedqvg.kernels.attention import attention_split as asp
    from pagedqvg.kernels.attention.triton_attention import BLOCK_M, BLOCK_N, BLOCK_N_PACKED

    device, (_, T, heads, _) = q.device, view.k.shape
    ok, m = True, 64
    try:
        for label, qq in (("chunk", q), (f"{short} queries", q[:, :short])):
            ref = _sdpa(qq[:, :m].double(), view.k.double(), view.v.double())
            e_sdpa = (_sdpa(qq[:, :m], view.k, view.v).double() - ref).norm().item()
            auto = asp.choose_splits(-(-qq.shape[1] // BLOCK_M), heads, T, asp.sm_count(device),
                                     BLOCK_N_PACKED if packed else BLOCK_N)  # fmt: skip
            parts, base = [], None
            for n in sorted({*SPLITS, auto}):
                asp.set_forced_splits(n)

                def call(qq=qq):
                    return c.update_and_attend(qq, key=k, value=v, current_chunk_start=s)

                t = _timed(call, device, iters)
                base = t if n == 1 else base
                good = (call()[:, :m].double() - ref).norm().item() <= 1.5 * e_sdpa
                ok &= good
                parts.append(f"S={n}{'*' if n == auto else ''} {t * 1e3:.3f} ms ({base / t:.2f}x)"
                             + ("" if good else " OVER 1.5x"))  # fmt: skip
            print(f"      split-KV, {label}: " + "; ".join(parts))
    finally:
        asp.set_forced_splits(None)
    return ok
