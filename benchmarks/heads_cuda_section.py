"""The `heads` section of bench_kernels_cuda.py (issue 29; docs/ATTENTION_MODES.md says what it settles): per
shape, SDPA over a prebuilt contiguous view (the baseline), mode `view` (`update_and_get_attention_kv` + the same
SDPA) and mode `heads` (`update_and_attend_heads`, groups of the cost model's size, 4, 10 and all heads), each with
ms per call, TFLOPS (`4·Tq·T·H·D / time`), the ratio to `view`, the transient peak (CUDA: max_memory_allocated
above the call's start) and `torch.equal` to view's output. On CUDA per SDPA backend (flash, cuDNN: the user's
kernel under `sdpa_kernel`), elsewhere SDPA's default.

Shapes: the heads of LingBot-World (40; 5 per rank at Ulysses degree 8), LongLive2 (24) and Self-Forcing (12) at
head_dim 128 and their tokens per frame, each as attention_cuda_section.py's cache: a 3-frame chunk of queries
over an 18-frame window + 3-frame sink; quant off and the recommended tiers (sink int4 / recent int4 / history
compact). `--tiny`: 4 heads of 32, 16-token frames, a 6-frame window.
Self-check: every `heads` output `torch.equal` to `view`'s (bit-identity on that backend and torch version: what an
allowlist entry `(backend, "cuda", torch version)` in integrations/sglang/head_groups.py needs).

The allowlist line (the default's mechanism, issue 29 item 4): on CUDA the section also times SDPA's own choice of
kernel (`sdpa`, what SGLang's TORCH_SDPA backend runs), and ends with the entry this run proves,
`("TORCH_SDPA", "cuda", "<torch major.minor>")`, printed only when at every shape, quantization and SDPA kernel
(flash, cuDNN, SDPA's choice) `heads` at the cost model's group is `torch.equal` to `view` and at most
`HEADS_DEFAULT_MARGIN` x view's time; otherwise the line names the first shape that fails. Other SGLang backends
(FA3 of sgl-kernel, Sage) are not timed here, so no entry for them comes from this run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from attention_cuda_section import _fill, _timed

from pagedqvg import QuantConfig
from pagedqvg.integrations.sglang.head_groups import HEADS_DEFAULT_MARGIN
from pagedqvg.layout.head_groups import choose_head_group

TIERS = QuantConfig.compact(sink_format="int4", recent_format="int4")
TINY_TIERS = QuantConfig.compact(centroids=8, block_size=32, sink_format="int4", recent_format="int4")
#: (name, heads, tokens per frame) of the full run.
SHAPES = (("lingbot-world", 40, 1560), ("lingbot-world/ulysses8", 5, 1560), ("longlive2", 24, 880),
          ("self-forcing", 12, 1560))  # fmt: skip


def _backends(device: torch.device):
    """`(label, context)` per SDPA backend timed: flash and cuDNN on CUDA, SDPA's default elsewhere."""
    if device.type != "cuda":
        return [("sdpa", contextlib.nullcontext)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return [("flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
            ("cudnn", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)), ("sdpa", contextlib.nullcontext)]  # fmt: skip


def _peak(fn, device: torch.device) -> int:
    """Bytes allocated above the start of one `fn()` call at its peak (CUDA), else 0 (not measured)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _shape_lines(name, heads, frame, quant, label, device, dtype, iters, tiny, failures: list[str]) -> bool:
    """The lines of one shape and quantization; appends to `failures` each (shape, backend) whose `heads` at the
    cost model's group is not `torch.equal` to `view` or over `HEADS_DEFAULT_MARGIN` x view's time."""
    d = 32 if tiny else 128
    c, start, gen = _fill(heads, d, frame, 18 if not tiny else 6, quant, dtype, device)
    chunk = 3 * frame  # _fill appends 3-frame chunks
    k, v, q = (torch.randn(1, chunk, heads, d, generator=gen, device=device, dtype=dtype) for _ in range(3))
    s = start - chunk
    view = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    T = view.k.shape[1]
    flops = 4 * chunk * T * heads * d
    kc, vc = view.k.contiguous(), view.v.contiguous()
    ok = True
    for backend, ctx in _backends(device):
        with ctx():

            def sdpa_only():
                return F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2))

            def view_mode():
                w = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
                return F.scaled_dot_product_attention(q.transpose(1, 2), w.k.transpose(1, 2), w.v.transpose(1, 2))

            t_base, t_view = _timed(sdpa_only, device, iters), _timed(view_mode, device, iters)
            want = view_mode().transpose(1, 2)
            p_view = _peak(view_mode, device)
            print(f"  {name:<22} {label:<5} {backend:<5} T={T:>6}  sdpa {t_base * 1e3:8.3f} ms "
                  f"{flops / t_base / 1e12:6.1f} TFLOPS | view {t_view * 1e3:8.3f} ms ({t_base / t_view:.2f}x sdpa) "
                  f"peak {p_view / 2**20:8.1f} MiB")  # fmt: skip
            best = choose_head_group(1, chunk, heads, d, dtype, T).group
            for g in sorted({best, min(4, heads), min(10, heads), heads} | ({1, 2} if tiny else set())):

                def heads_mode(g=g):
                    return c.update_and_attend_heads(q, key=k, value=v, current_chunk_start=s, head_group_size=g)

                t = _timed(heads_mode, device, iters)
                same = torch.equal(heads_mode(), want)
                ok &= same
                if g == best and (not same or t > HEADS_DEFAULT_MARGIN * t_view):
                    failures.append(f"{name} {label} {backend}: heads g={g} {t / t_view:.3f}x view, "
                                    f"{'equal' if same else 'DIFFERS'}")  # fmt: skip
                print(f"    heads g={g:<3}{'*' if g == best else ' '} {t * 1e3:8.3f} ms {flops / t / 1e12:6.1f} TFLOPS "
                      f"({t_view / t:.2f}x view) peak {_peak(heads_mode, device) / 2**20:8.1f} MiB  "
                      f"{'equal' if same else 'DIFFERS'}")  # fmt: skip
    return ok


def bench_heads(device: torch.device, dtype: torch.dtype, tiny: bool, iters: int) -> bool:
    """Print the lines of every shape, quantization and SDPA backend; True when every `heads` output equals
    `view`'s bit for bit (`*`: the cost model's group size)."""
    print("\nattention by head groups (update_and_attend_heads) vs view + SDPA vs SDPA on a prebuilt view")
    shapes = (("tiny", 4, 16),) if tiny else SHAPES
    quants = {"off": None, "tiers": TINY_TIERS if tiny else TIERS}
    ok = True
    failures: list[str] = []
    for name, heads, frame in shapes:
        for label, quant in quants.items():
            ok &= _shape_lines(name, heads, frame, quant, label, device, dtype, iters, tiny, failures)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(allowlist_line(device, failures, tiny))
    return ok


def allowlist_line(device: torch.device, failures: list[str], tiny: bool) -> str:
    """The `HEADS_DEFAULT_ALLOWLIST` entry this run proves (CUDA, full shapes, no failure), else why none."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    entry = f'("TORCH_SDPA", "{device.type}", "{version}")'
    if device.type != "cuda" or tiny:
        where = f"{device.type}{', --tiny' if tiny else ''}"
        return f"  allowlist: no entry from this run ({where}: only a full CUDA run proves one; the CPU entry's " \
               f"proof is bench_head_groups.py --per-head)"  # fmt: skip
    if failures:
        return f"  allowlist: no entry {entry}: {'; '.join(failures)} (margin {HEADS_DEFAULT_MARGIN}x)"
    return (f"  allowlist: add {entry} to HEADS_DEFAULT_ALLOWLIST (integrations/sglang/head_groups.py): heads at the "
            f"cost model's group torch.equal to view and within {HEADS_DEFAULT_MARGIN}x view's time at every shape, "
            f"quantization and SDPA kernel (flash, cudnn, sdpa's choice)")  # fmt: skip
