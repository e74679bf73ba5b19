"""CPU time per call of one LingBot-like layer: pagedqvg at 64 KiB and auto pages vs SGLang's QVG cache (bf16) and
the dense cache.

One layer of 8 heads x 128, bf16, batch 1, 1,560-token chunks, a 6-chunk cache and attention window with a 3-chunk
sink (every view is 6 chunks = 9,360 tokens once the window is full). Each cache first advances `--warm` chunks
(the window rolls); then, in rounds of one call per cache (so machine noise hits them alike), the table gives the
median wall time of:

- rewrite: the repeated in-place call of the current chunk (a later denoise step; pagedqvg reuses its cached plan);
- advance: the call that appends the next chunk (roll, eviction, write, view).

Rows: pagedqvg as it runs now at 64 KiB pages and at the page size `--page-bytes auto` picks for this layer
(`layout.choose_page_bytes`; writes and views through the torch references of the kernels with everything derivable
from a plan kept with it: one indexed copy per K/V half, one gather per view; an advance rebuilds the row index of the
new chunk only); at 64 KiB also with the per-page slice path it used before (a copy kept in this file,
`SlicePageIO`: one slice copy per page piece and a concatenation of page slices per view); the dense cache
(`benchmarks/baselines.py`'s `DenseCache`: one `[B, C, H, D]` buffer per K and V rolled in place, views by
`torch.cat` of slot ranges); SGLang 0.5.23's
`QVGPackedCausalKVCache` with quantization off (bf16 segments, its own `_reconstruct`), when SGLang's sources are
importable (see bench_sglang_memory.py / .ci/sglang_suite.sh), else `benchmarks/baselines.py`'s segment-list
baseline (the header says which). The script checks that every cache's last view is the same bits.

Each call returns a fresh ~19 MB view. By default glibc's malloc is set to keep freed memory (`steady_malloc`), so
the table compares copy paths; with `--glibc-malloc` it keeps its defaults, under which a fresh view may page-fault
its memory in again (~10 ms per call here), depending on the heap's history (SGLang's K and V as two 9.5 MB
tensors dodged it in our runs, pagedqvg's single `[2, ...]` tensor did not).

    PYTHONPATH=/tmp/sglang-src:.ci:benchmarks python benchmarks/bench_cpu_views.py --placeholders [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from pagedqvg import BlockPool, PagedCausalKVCache
from pagedqvg.layout.segments import choose_page_bytes, page_pieces, segment_kinds
from pagedqvg.store.page_io import PageIO, ViewPlan, WritePlan

HEADS, HEAD_DIM, CHUNK = 8, 128, 1560
CACHE_CHUNKS, SINK_CHUNKS = 6, 3
DTYPE = torch.bfloat16


class SlicePageIO(PageIO):
    """pagedqvg's torch path before views and writes went through the kernels' torch references (quant off only):
    writes as one slice copy per page piece, views as one concatenation of page slices per K/V half."""

    def _slices(self, index, global_ranges, h0: int, hin: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        tok = self.rows.view(self.rows.shape[0], 2, self.tpp, self.batch_size, self.num_heads, self.head_dim)
        out = []
        for g0, g1 in global_ranges:
            for entry in index.overlapping(g0, g1):
                lo, hi = max(g0, entry.start) - entry.start, min(g1, entry.end) - entry.start
                for page, a, b in page_pieces(entry.value.pages, self.tpp, lo, hi):
                    block = tok[page, :, a:b]
                    if hin != self.num_heads:
                        block = block[:, :, :, h0 : h0 + hin]
                    out.append((block[0], block[1], b - a))
        return out

    def write_plan(self, index, s, e, h0, hin):  # type: ignore[override]
        key = ("w", s, e, h0, hin)
        plan = self.cached(key)
        if plan is None:
            plan = self.remember(key, self._slices(index, [(s, e)], h0, hin))
        return plan

    def write(self, plan, h0, key, value):  # type: ignore[override]
        o = 0
        for k_dst, v_dst, m in plan:
            k_dst.copy_(key[:, o : o + m].transpose(0, 1))
            v_dst.copy_(value[:, o : o + m].transpose(0, 1))
            o += m

    def view_plan(self, index, spans, h0, hin):  # type: ignore[override]
        assert all(z == 0 for _, z in spans)
        key = ("v", h0, hin, tuple((tuple(g), z) for g, z in spans))
        plan = self.cached(key)
        if plan is None:
            parts = self._slices(index, [g for ranges, _ in spans for g in ranges], h0, hin)
            plan = self.remember(key, ViewPlan(sum(m for *_, m in parts), runs=parts))  # type: ignore[arg-type]
        return plan

    def build_view(self, plan, h0, hin, out):  # type: ignore[override]
        out_k, out_v = out[0].transpose(0, 1), out[1].transpose(0, 1)
        torch.cat([k for k, _, _ in plan.runs], 0, out=out_k)
        torch.cat([v for _, v, _ in plan.runs], 0, out=out_v)


assert WritePlan  # the plan type SlicePageIO's lists stand in for


def paged(page_bytes: int, slices: bool) -> PagedCausalKVCache:
    token_bytes = 2 * HEADS * HEAD_DIM * 2
    pool = BlockPool((CACHE_CHUNKS + 2) * CHUNK * token_bytes + 64 * page_bytes, page_bytes=page_bytes, device="cpu")
    cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=CACHE_CHUNKS * CHUNK, num_heads=HEADS,
                               head_dim=HEAD_DIM, dtype=DTYPE, device="cpu",
                               sink_tokens=SINK_CHUNKS * CHUNK)  # fmt: skip
    if slices:
        cache._io = SlicePageIO(pool, cache.layout, None)  # the benchmark's copy of the old path
    return cache


def sglang_qvg():
    """SGLang's QVG cache in bf16 mode, or None when SGLang's sources are not importable."""
    try:
        from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
        from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import QVGPackedCausalKVCache
    except ImportError:
        return None
    args = QVGKVQuantArgs()
    assert not args.enabled
    return QVGPackedCausalKVCache(batch_size=1, cache_size=CACHE_CHUNKS * CHUNK, num_heads=HEADS, head_dim=HEAD_DIM,
                                  dtype=DTYPE, device=torch.device("cpu"),
                                  global_end_index=torch.zeros(1, dtype=torch.long),
                                  local_end_index=torch.zeros(1, dtype=torch.long), sink_tokens=SINK_CHUNKS * CHUNK,
                                  attention_window_size=CACHE_CHUNKS * CHUNK, quant_args=args)  # fmt: skip


def dense_cache():
    from baselines import DenseCache  # benchmarks/baselines.py

    return DenseCache(batch_size=1, cache_size=CACHE_CHUNKS * CHUNK, num_heads=HEADS, head_dim=HEAD_DIM, dtype=DTYPE,
                      device="cpu", sink_tokens=SINK_CHUNKS * CHUNK)  # fmt: skip


def auto_page_bytes() -> int:
    """The page size `--page-bytes auto` picks for this layer's bf16 chunks (`layout.choose_page_bytes`)."""
    return choose_page_bytes(segment_kinds(1, HEADS, HEAD_DIM, DTYPE.itemsize, CHUNK)).page_bytes


def baseline_segments():
    from baselines import SegmentListCache  # benchmarks/baselines.py

    return SegmentListCache(batch_size=1, cache_size=CACHE_CHUNKS * CHUNK, num_heads=HEADS, head_dim=HEAD_DIM,
                            dtype=DTYPE, device="cpu", sink_tokens=SINK_CHUNKS * CHUNK)  # fmt: skip


def steady_malloc() -> bool:
    """glibc: serve every allocation from the heap and never give it back (`mallopt` M_MMAP_THRESHOLD and
    M_TRIM_THRESHOLD at 1 GiB), so a view's fresh output tensor reuses the previous one's memory instead of
    page-faulting 19 MB in again; with glibc's defaults whether that happens depends on the heap's history (which
    sizes were freed last) and costs ~10 ms per call here, whichever cache makes the view. False if not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 1 << 30)) and bool(libc.mallopt(-1, 1 << 30))  # M_MMAP_THRESHOLD, M_TRIM_...
    except (OSError, AttributeError):
        return False


class Runner:
    """One cache and its calls: the same random chunk K/V (seeded) for every cache, so their views can be compared."""

    def __init__(self, cache) -> None:
        gen = torch.Generator().manual_seed(0)
        self.kv = [torch.randn(1, CHUNK, HEADS, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(2)]
        self.cache = cache
        self.chunks = 0
        self.view = None

    def call(self, start: int) -> float:
        """Seconds of one `update_and_get_attention_kv` at `start`. The previous view is dropped first, as a model
        drops one layer's view after its attention (the allocator can reuse its memory)."""
        self.view = None
        t0 = time.perf_counter()
        self.view = self.cache.update_and_get_attention_kv(key=self.kv[0], value=self.kv[1], current_chunk_start=start)
        return time.perf_counter() - t0

    def rewrite(self) -> float:
        return self.call((self.chunks - 1) * CHUNK)

    def advance(self) -> float:
        self.chunks += 1
        return self.call((self.chunks - 1) * CHUNK)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--placeholders", action="store_true", help="import .ci/sglang_plugin.py's placeholder modules")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--glibc-malloc",
        action="store_true",
        help="keep glibc's default malloc thresholds (default: heap only, never trimmed; see the header)",
    )
    ap.add_argument("--warm", type=int, default=8, help="chunks appended before timing (default 8)")
    ap.add_argument("--reps", type=int, default=15, help="timed rounds (default 15)")
    args = ap.parse_args()
    if args.placeholders:
        import sglang_plugin  # noqa: F401  (placeholder modules for SGLang's heavy imports)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.glibc_malloc:
        steady_malloc()
    ref = sglang_qvg()
    ref_name = "SGLang 0.5.23 QVGPackedCausalKVCache (bf16)"
    if ref is None:
        ref, ref_name = baseline_segments(), "segment-list baseline (benchmarks/baselines.py; SGLang not importable)"
    rows: list[tuple[str, Callable[[], object]]] = [(ref_name, lambda: ref), ("dense cache (baselines.DenseCache)",
                                                                                dense_cache)]  # fmt: skip
    auto = auto_page_bytes()
    for page_bytes, what in ((64 << 10, "64 KiB"), (auto, f"auto = {auto:,} B")):
        rows.append((f"pagedqvg {what} pages", lambda p=page_bytes: paged(p, False)))
    rows.append(("pagedqvg 64 KiB pages (old per-page slices)", lambda: paged(64 << 10, True)))
    runners = [(name, Runner(make())) for name, make in rows]
    for _ in range(args.warm):
        for _, r in runners:
            r.advance()
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in runners}
    for _ in range(args.reps):  # rounds: every cache once per round, so machine noise hits them alike
        for name, r in runners:
            times[name][0].append(r.rewrite())
        for name, r in runners:
            times[name][1].append(r.advance())
    def kv(view):  # a view object (pagedqvg, SGLang) or the dense baseline's (k, v) tuple
        return (view.k, view.v) if hasattr(view, "k") else view

    ref_k, ref_v = kv(runners[0][1].view)
    for name, r in runners[1:]:
        k, v = kv(r.view)
        if not (torch.equal(k, ref_k) and torch.equal(v, ref_v)):
            raise SystemExit(f"{name}: the last view differs from the reference's")
    print(f"One LingBot-like layer on CPU ({torch.get_num_threads()} torch threads): {HEADS} heads x {HEAD_DIM}, bf16, "
          f"{CHUNK}-token chunks, cache and window {CACHE_CHUNKS} chunks, sink {SINK_CHUNKS} chunks; median of "
          f"{args.reps} rounds (each: one call of every cache) after {args.warm} chunks; every last view equal; "
          f"malloc: {'glibc defaults' if args.glibc_malloc else 'heap only, no trim'}. "
          f"Reference: {ref_name}.")  # fmt: skip
    print("| cache | rewrite ms/call | vs reference | vs dense | advance ms/call | vs reference | vs dense |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {name: (statistics.median(rw) * 1e3, statistics.median(adv) * 1e3) for name, (rw, adv) in times.items()}
    base, dense = med[ref_name], med["dense cache (baselines.DenseCache)"]
    for name, (rw, adv) in med.items():
        print(f"| {name} | {rw:.2f} | {rw / base[0]:.2f}x | {rw / dense[0]:.2f}x | {adv:.2f} | {adv / base[1]:.2f}x | "
              f"{adv / dense[1]:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
