"""Kernel bandwidth on a CUDA GPU: Triton view build / page write / page fill against the torch reference path.

    python benchmarks/bench_kernels_cuda.py                       # H200 defaults (--peak-gbps 4800)
    python benchmarks/bench_kernels_cuda.py --json out.json --iters 50
    python benchmarks/bench_kernels_cuda.py --device cpu --tiny   # smoke test of this script without a GPU
                                                                  # (Triton interpreter; timings meaningless)

Per-layer shapes (one layer's cache; bf16; batch 1 unless --batch):
- LingBot-World: H=40, D=128, 1,560 tokens/frame, view = 18-frame window + 3-frame sink = 32,760 tokens.
- LongLive2: H=24, D=128, 880 tokens/frame, view = 32 + 8 frames = 35,200 tokens.
Segments are 3-frame chunks (one segment per appended chunk, as the cache stores them) on pool pages of
--page-bytes; the view's row index is built exactly as the cache builds it (kernels/rows.py).

Packed (PRQ) parts, per shape: the same view with every segment PRQ-packed (--quant, default int2 with 128
centroids, block 64, 1 stage; one chunk quantized for real and its bytes replicated into every segment's scrambled
pages), dequantized segment by segment from pool pages: `packed_view_build` = the Triton kernel (one launch per
segment: K, V and all pieces) against the torch path of PackedStore (prq_dequantize per page piece), bytes = packed
token rows + codebooks read + the view written. `mixed_view_build` = the view a quantized cache returns: the
first (sink) and the newest segment dense, every other segment packed, built by the mixed view kernel in ONE launch
(K, V, dense copies and packed dequantization from one run table, kernels/triton_view_runs.py) against its torch
reference; bytes = dense rows read and written + packed rows and codebooks read + packed rows written.
`prq_pack_chunk` = packing one chunk the way the cache does (PackedStore.quantize + write into scrambled pages:
k-means stages, the residual block-quantized into staged rows, copied into the pages) with the Triton steps against
the same calls on the torch path (ms per chunk; quality checked, bytes compared: near-ties may differ).
`kmeans_assign` = one k-means assignment of a chunk
(S = chunk tokens, B*H heads, K centroids, fp32) against prq's torch `assign_nearest`; it is compute-bound, its line
also gives TFLOP/s (2*S*K*D per head); ids may differ only on rounding-level near-ties, which are verified in fp64.

Bytes counted: a copy kernel reads and writes every element once, so bytes = 2 x (elements x itemsize), plus the
row index it reads (16 B per token row). GB/s = bytes / median time (1 GB = 1e9 B); "% peak" is against
--peak-gbps (4800 GB/s = H200 HBM3e). Every Triton result is checked against torch before it is timed (bit for bit;
prq_pack_chunk: error within 2% of torch's).
It also checks that views of several lengths reuse one compiled kernel per layer shape, that no compiled binary
spills registers (Triton's `n_spills` as loaded by the driver; the AOT table in the README says 0 for every kernel at
sm_90), and, with two or more GPUs, that a pool on another GPU than the current one launches on its own GPU.

Exit status: 0 when every check passed, 1 when a result differs, 2 when the requested device is unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch

from pagedqvg.validation import DTYPES_BY_NAME


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    head_dim: int
    tokens_per_frame: int
    window_frames: int
    sink_frames: int
    chunk_frames: int = 3

    @property
    def view_tokens(self) -> int:
        return (self.window_frames + self.sink_frames) * self.tokens_per_frame

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.tokens_per_frame


SHAPES = (
    Shape("lingbot-world", 40, 128, 1560, 18, 3),
    Shape("longlive2", 24, 128, 880, 32, 8),
)
TINY = (
    Shape("tiny-a", 5, 16, 12, 4, 1),
    Shape("tiny-b", 3, 24, 7, 3, 2, chunk_frames=2),
)
#: --quant: QuantConfig keyword arguments (centroids and block size are set from the shape and --centroids).
QUANTS = {
    "int2": {"bits": 2},
    "int2-trits": {"bits": 2, "pack_trits": True},
    "int4": {"bits": 4},
    "int4-asym": {"bits": 4, "asymmetric": True},
    "int2-2stages": {"bits": 2, "stages": 2},
}


@dataclass
class Row:
    shape: str
    kernel: str
    backend: str
    tokens: int
    bytes: int
    median_us: float
    gbps: float
    pct_peak: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test through the interpreter)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (for --device cpu smoke runs)")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak in GB/s (default 4800 = H200)")
    p.add_argument("--dtype", choices=sorted(DTYPES_BY_NAME), default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--page-bytes", type=int, default=None, help="pool page size (default 1 MiB; 2 KiB with --tiny)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-rows", type=int, default=None, help="override the Triton tile's rows (power of two)")
    p.add_argument("--block-cols", type=int, default=None, help="override the Triton tile's columns (power of two)")
    p.add_argument("--models", default=None, help="comma-separated subset of shape names")
    p.add_argument("--quant", choices=sorted(QUANTS), default="int2", help="PRQ format of the packed parts")
    p.add_argument("--centroids", type=int, default=None, help="k-means centroids (default 128; 8 with --tiny)")
    p.add_argument("--no-packed", action="store_true", help="skip the packed view build and k-means parts")
    p.add_argument("--no-attention", action="store_true", help="skip the attention-from-pages section")
    p.add_argument("--no-heads", action="store_true", help="skip the attention-by-head-groups section")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(
                "bench_kernels_cuda: CUDA is not available (torch.cuda.is_available() is False); this benchmark needs "
                "a CUDA GPU. For a smoke test of the script itself: --device cpu --tiny",
                file=sys.stderr,
            )
            return 2
    elif device.type == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("bench_kernels_cuda: --device cpu needs TRITON_INTERPRET=1 before triton imports", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors run in the interpreter
    else:
        print(f"bench_kernels_cuda: unsupported --device {args.device} (cuda or cpu)", file=sys.stderr)
        return 2

    # The kernels are imported only in bench_shape: TRITON_INTERPRET must be settled before triton decorates them.
    dtype = DTYPES_BY_NAME[args.dtype]
    shapes = TINY if args.tiny else SHAPES
    if args.models:
        wanted = set(args.models.split(","))
        shapes = tuple(s for s in shapes if s.name in wanted)
        if not shapes:
            print(f"bench_kernels_cuda: no shape named in --models {args.models}", file=sys.stderr)
            return 2
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}; peak {args.peak_gbps:.0f} GB/s; dtype {args.dtype}")
    else:
        print("device: cpu through the Triton interpreter (smoke test: timings are not bandwidth)")

    rows_out: list[Row] = []
    ok = True
    for shape in shapes:
        rows, shape_ok = bench_shape(shape, args, device, dtype)
        rows_out.extend(rows)
        ok &= shape_ok
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if not args.no_attention:  # attention from pages (benchmarks/attention_cuda_section.py)
        from attention_cuda_section import bench_attention

        ok &= bench_attention(device, dtype, args.tiny, args.iters if device.type == "cuda" else 1)
    if not args.no_heads:  # attention by head groups, mode heads (benchmarks/heads_cuda_section.py)
        from heads_cuda_section import bench_heads

        ok &= bench_heads(device, dtype, args.tiny, args.iters if device.type == "cuda" else 1)

    if device.type == "cuda":
        ok &= check_spills(device)
        ok &= check_other_device(dtype)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": str(device), "peak_gbps": args.peak_gbps, "dtype": args.dtype, "ok": ok,
                 "results": [asdict(r) for r in rows_out]},
                f, indent=1,
            )  # fmt: skip
    print("\nall checks passed (bit-identical to torch; prq_pack_chunk: error within 2%)" if ok
          else "\nMISMATCH or RECOMPILE: see above")  # fmt: skip
    return 0 if ok else 1


def bench_shape(shape: Shape, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """Every kernel at one layer shape, Triton against torch; returns (rows, all bit-identical and no recompile)."""
    from pagedqvg.kernels.view.triton_view_build import _view_build_kernel, view_build_triton
    from pagedqvg.kernels.view.view_build import view_build_torch
    from pagedqvg.kernels.write.page_write import page_fill_torch, page_write_torch
    from pagedqvg.kernels.write.triton_page_write import _page_write_kernel, page_fill_triton, page_write_triton

    tile_kw = {"block_rows": args.block_rows, "block_cols": args.block_cols}
    page_bytes = args.page_bytes if args.page_bytes is not None else (2048 if args.tiny else 1 << 20)
    setup = Setup(shape, args.batch, dtype, page_bytes, device)
    B, T, n, H, D = args.batch, shape.view_tokens, shape.chunk_tokens, shape.heads, shape.head_dim
    itemsize = setup.rows.element_size()
    rows_rp = setup.rows
    print(
        f"\n{shape.name}: H={H} D={D} view {T} tokens ({shape.window_frames}+{shape.sink_frames} frames), "
        f"chunk {n} tokens, {setup.num_segments} segments, {setup.rows_per_page} rows/page, "
        f"{setup.pool.num_pages} pages of {page_bytes} B"
    )
    results: list[Row] = []
    ok = True

    def compare(kernel: str, tokens: int, nbytes: int, torch_fn, triton_fn, same: bool) -> None:
        nonlocal ok
        ok &= same
        pair = [
            _measure(shape.name, kernel, "torch", tokens, nbytes, torch_fn, args, device),
            _measure(shape.name, kernel, "triton", tokens, nbytes, triton_fn, args, device),
        ]
        _report(pair, same)
        results.extend(pair)

    # ---- view build (all heads, then a head slice: strided source rows), K and V in one launch
    pidx, sidx = setup.view_index()
    hin = max(1, H // 2)
    for h0, heads in ((0, H), (1 if hin < H else 0, hin)):
        out_t = torch.empty(2, B, T, heads, D, dtype=dtype, device=device)
        out_r = torch.empty_like(out_t)
        view_build_torch(rows_rp, pidx, sidx, h0, heads, out_r)
        view_build_triton(rows_rp, pidx, sidx, h0, heads, out_t, **tile_kw)
        same = _bits_equal(out_t, out_r)
        nbytes = 2 * out_t.numel() * itemsize + 2 * pidx.numel() * 8
        label = "view_build" if heads == H else f"view_build[heads {h0}+{heads}]"
        compare(
            label, T, nbytes,
            partial(view_build_torch, rows_rp, pidx, sidx, h0, heads, out_r),
            partial(view_build_triton, rows_rp, pidx, sidx, h0, heads, out_t, **tile_kw),
            same,
        )  # fmt: skip
        del out_t, out_r

    # ---- page write of one chunk: contiguous key/value, and key/value sliced out of a fused qkv [B, n, 3, H, D]
    wp, ws = setup.chunk_index()
    gen = torch.Generator(device="cpu").manual_seed(0)
    key = torch.randn(B, n, H, D, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(B, n, H, D, generator=gen).to(device=device, dtype=dtype)
    qkv = torch.randn(B, n, 3, H, D, generator=gen).to(device=device, dtype=dtype)
    for label, k, v in (("page_write", key, value), ("page_write[fused qkv]", qkv[:, :, 1], qkv[:, :, 2])):
        page_write_torch(rows_rp, wp, ws, 0, k, v)
        expect = rows_rp[wp, ws].clone()
        rows_rp[wp, ws] = 0
        page_write_triton(rows_rp, wp, ws, 0, k, v, **tile_kw)
        same = _bits_equal(rows_rp[wp, ws], expect)
        nbytes = 2 * 2 * k.numel() * itemsize + 2 * wp.numel() * 8
        compare(
            label, n, nbytes,
            partial(page_write_torch, rows_rp, wp, ws, 0, k, v),
            partial(page_write_triton, rows_rp, wp, ws, 0, k, v, **tile_kw),
            same,
        )  # fmt: skip

    # ---- page fill of one chunk (head-sliced appends zero the new rows first); writes only
    page_fill_torch(rows_rp, wp, ws, 0.5)
    expect = rows_rp[wp, ws].clone()
    rows_rp[wp, ws] = 0
    page_fill_triton(rows_rp, wp, ws, 0.5, **tile_kw)
    same = _bits_equal(rows_rp[wp, ws], expect)
    nbytes = 2 * B * n * H * D * itemsize + 2 * wp.numel() * 8
    compare(
        "page_fill", n, nbytes,
        partial(page_fill_torch, rows_rp, wp, ws, 0.0),
        partial(page_fill_triton, rows_rp, wp, ws, 0.0, **tile_kw),
        same,
    )  # fmt: skip

    # ---- packed (PRQ) view build and k-means assignment
    packed = None
    if not args.no_packed:
        packed = PackedSetup(shape, args, device, dtype, setup.seg_tokens)
        prow, pok = bench_packed(shape, args, device, dtype, packed)
        results.extend(prow)
        ok &= pok
        mixed = MixedView(setup, packed, args.batch)
        mrow, mok = bench_mixed(shape, args, device, mixed)
        results.extend(mrow)
        ok &= mok
        krow, kok = bench_kmeans(shape, args, device)
        results.extend(krow)
        ok &= kok
        qrow, qok = bench_prq_quantize(shape, args, device, dtype, page_bytes)
        results.extend(qrow)
        ok &= qok

    # ---- one compile per layer shape: views and chunks of other lengths reuse the compiled kernels
    if device.type == "cuda":

        def other_lengths() -> None:
            for t in (1, 17, shape.tokens_per_frame, T - 1):
                out = torch.empty(2, B, t, H, D, dtype=dtype, device=device)
                view_build_triton(rows_rp, pidx[:, :, :t], sidx[:, :, :t], 0, H, out, **tile_kw)
            for m in (1, 17, n - 1):
                page_write_triton(rows_rp, wp[:, :, :m], ws[:, :, :m], 0, key[:, :m], value[:, :m], **tile_kw)

        ok &= _no_recompile("view_build, page_write", "lengths", (_view_build_kernel, _page_write_kernel),
                            other_lengths, device)  # fmt: skip
        if packed is not None:
            from pagedqvg.kernels.view.triton_dequant import _packed_dequant_kernel
            from pagedqvg.kernels.view.triton_view_runs import _view_runs_kernel

            def other_ranges() -> None:
                for t0, t1 in ((0, 1), (3, 20), (1, packed.seg_tokens[0] - 1)):
                    packed.run_segment(0, t0, t1, triton=True)

            def other_views() -> None:
                for t in (1, 17, mixed.tokens // 2):
                    mixed.run(t, triton=True, tile_kw=tile_kw)

            ok &= _no_recompile("packed_dequant", "ranges", (_packed_dequant_kernel,), other_ranges, device)
            ok &= _no_recompile("view_runs", "view lengths", (_view_runs_kernel,), other_views, device)
    return results, ok


class PackedSetup:
    """The view's segments PRQ-packed in a pool of their own (pages scrambled), and the view they dequantize into."""

    def __init__(self, shape: Shape, args, device: torch.device, dtype: torch.dtype, seg_tokens: list[int]):
        from pagedqvg import BlockPool
        from pagedqvg.kernels.view.dequant import piece_table
        from pagedqvg.layout.segments import PackedSegmentLayout
        from pagedqvg.quant import PackedFormat, QuantConfig, prq_quantize
        from pagedqvg.store.packed_store import PackedStore

        B, H, D = args.batch, shape.heads, shape.head_dim
        centroids = args.centroids or (8 if args.tiny else 128)
        block = 64 if D % 64 == 0 else 8
        self.cfg = QuantConfig(centroids=centroids, block_size=block, **QUANTS[args.quant])
        page_bytes = args.page_bytes if args.page_bytes is not None else (2048 if args.tiny else 1 << 20)
        self.piece_table = piece_table
        self.seg_tokens = seg_tokens
        self.device = device
        # Quantize one chunk for real (K and V), then replicate its bytes into every segment.
        n = max(seg_tokens)
        gen = torch.Generator(device="cpu").manual_seed(2)
        dense = torch.randn(2, n, B * H, D, generator=gen).to(device=device, dtype=dtype)
        tok, cbs = [], []
        for kv in range(2):
            seg = prq_quantize(dense[kv], self.cfg)
            tok.append(seg.token_rows.view(n, B, -1))
            cbs.append(seg.codebooks.reshape(B * H * self.cfg.stages, centroids, D))
        tok_rows, cb_rows = torch.stack(tok, dim=1), torch.cat(cbs)  # [n, 2, B, row], [2*B*H*stages, K, D]
        fmt = PackedFormat(head_dim=D, num_heads=H, cfg=self.cfg, dtype=dtype)
        layout = PackedSegmentLayout.from_format(B, fmt, page_bytes)
        pages = sum(layout.pages_for_tokens(m) for m in seg_tokens)
        self.pool = BlockPool(pages * page_bytes, page_bytes=page_bytes, device=device)
        self.store = st = PackedStore(self.pool, B, H, D, dtype, self.cfg)
        owner = self.pool.new_owner("bench-packed")
        all_pages = self.pool.alloc(self.pool.num_pages, owner)
        order = torch.randperm(len(all_pages), generator=torch.Generator().manual_seed(3)).tolist()
        all_pages = [all_pages[i] for i in order]
        self.segments = []  # (token pages, codebook pages, codebook pages tensor)
        i = 0
        for m in seg_tokens:
            k, ntok = st.pages_for_tokens(m), st.token_pages(m)
            tp, cp = all_pages[i : i + ntok], all_pages[i + ntok : i + k]
            i += k
            for page, first, count, o, _ in piece_table(tp, st.tpp, 0, m):
                st.token_view[page, first : first + count].copy_(tok_rows[o : o + count])
            for r in range(cb_rows.shape[0]):
                st.codebook_rows[cp[r // st.cb_rpp], r % st.cb_rpp].copy_(cb_rows[r])
            self.segments.append((tp, cp, torch.tensor(cp, dtype=torch.int64, device=device)))
        self.pieces = [self._pieces(j, 0, m) for j, m in enumerate(seg_tokens)]
        T = sum(seg_tokens)
        self.out = torch.empty(2, B, T, H, D, dtype=dtype, device=device)
        self.out_ref = torch.empty_like(self.out)
        self.nbytes = (
            T * 2 * B * fmt.token_row_bytes
            + len(seg_tokens) * cb_rows.numel() * cb_rows.element_size()
            + self.out.numel() * self.out.element_size()
        )

    def _pieces(self, j: int, t0: int, t1: int) -> torch.Tensor:
        table = self.piece_table(self.segments[j][0], self.store.tpp, t0, t1)
        return torch.tensor(table, dtype=torch.int64, device=self.device).view(-1, 5)

    def run_segment(self, j: int, t0: int, t1: int, *, triton: bool) -> None:
        from pagedqvg.kernels.view.dequant import packed_dequant_torch
        from pagedqvg.kernels.view.triton_dequant import packed_dequant_triton

        o = sum(self.seg_tokens[:j])
        out = (self.out if triton else self.out_ref)[:, :, o : o + t1 - t0].permute(2, 0, 1, 3, 4)
        fn = packed_dequant_triton if triton else packed_dequant_torch
        st = self.store
        fn(st.token_view, st.codebook_rows, self._pieces(j, t0, t1), self.segments[j][2], 0, out, st.fmt)

    def view(self, *, triton: bool, tile_kw: dict) -> None:
        """All segments of the view, one launch each (pieces precomputed: the kernel's cost only)."""
        from pagedqvg.kernels.view.dequant import packed_dequant_torch
        from pagedqvg.kernels.view.triton_dequant import packed_dequant_triton

        st, o = self.store, 0
        target = self.out if triton else self.out_ref
        for j, m in enumerate(self.seg_tokens):
            out = target[:, :, o : o + m].permute(2, 0, 1, 3, 4)
            args = (st.token_view, st.codebook_rows, self.pieces[j], self.segments[j][2], 0, out, st.fmt)
            if triton:
                packed_dequant_triton(*args, **tile_kw)
            else:
                packed_dequant_torch(*args)
            o += m


def bench_packed(shape: Shape, args, device: torch.device, dtype: torch.dtype, ps: PackedSetup):
    """Packed view build: Triton (one launch per segment) against the torch path; bit-identical check first."""
    tile_kw = {"block_rows": args.block_rows, "block_cols": args.block_cols}
    print(
        f"  packed {args.quant} ({ps.cfg.centroids} centroids, block {ps.cfg.block_size}, {ps.cfg.stages} stage(s)): "
        f"{ps.store.fmt.token_row_bytes} B token rows, {ps.store.tpp} tokens/page"
    )
    ps.view(triton=False, tile_kw=tile_kw)
    ps.view(triton=True, tile_kw=tile_kw)
    same = _bits_equal(ps.out, ps.out_ref)
    T = sum(ps.seg_tokens)
    pair = [
        _measure(shape.name, "packed_view_build", "torch", T, ps.nbytes, partial(ps.view, triton=False,
                 tile_kw=tile_kw), args, device),
        _measure(shape.name, "packed_view_build", "triton", T, ps.nbytes, partial(ps.view, triton=True,
                 tile_kw=tile_kw), args, device),
    ]  # fmt: skip
    _report(pair, same)
    return pair, same


class MixedView:
    """A quantized cache's view over the benchmark's segments: the first (sink) and the newest segment dense (rows of
    `setup`), the others PRQ-packed (pages of `ps`), as one run table (kernels/view_runs.py) built once, as the
    cache builds it once per view plan (runs at most the dense tokens per page long)."""

    def __init__(self, setup: Setup, ps: PackedSetup, batch: int):
        from pagedqvg.kernels.view.view_runs import dense_runs, packed_runs

        st = ps.store
        self.setup, self.store = setup, st
        self.max_run = setup.rows_per_page // (2 * batch)  # dense tokens per page
        n_seg = len(ps.seg_tokens)
        runs, cbs, o = [], [], 0
        itemsize = setup.rows.element_size()
        self.nbytes = 0
        row_elems = setup.rows.shape[2] * setup.rows.shape[3]
        for j, m in enumerate(ps.seg_tokens):
            if j in (0, n_seg - 1):
                runs += dense_runs(setup.segments[j][0].tolist(), self.max_run, 0, m, o, self.max_run)
                self.nbytes += 2 * (2 * batch * m * row_elems * itemsize)
            else:
                tp, cp, _ = ps.segments[j]
                runs += packed_runs(tp, st.tpp, 0, m, o, len(cbs), self.max_run)
                cbs += cp
                self.nbytes += m * 2 * batch * st.fmt.token_row_bytes + 2 * batch * m * row_elems * itemsize
                self.nbytes += st.num_cb_rows * st.codebook_view.shape[2]
            o += m
        device = setup.rows.device
        self.runs = torch.tensor(runs, dtype=torch.int64, device=device).view(-1, 6)
        self.cb_pages = torch.tensor(cbs, dtype=torch.int64, device=device)
        self.tokens = o
        self.out = torch.empty(2, batch, o, *setup.rows.shape[2:], dtype=setup.rows.dtype, device=device)
        self.out_ref = torch.empty_like(self.out)

    def run(self, t: int | None = None, *, triton: bool, tile_kw: dict) -> None:
        """The whole view (or the runs of its first `t` rows, into a `t`-row view: other view lengths)."""
        from pagedqvg.kernels.view.triton_view_runs import view_runs_triton
        from pagedqvg.kernels.view.view_runs import view_runs_torch

        st, runs, out = self.store, self.runs, self.out if triton else self.out_ref
        if t is not None:  # the runs of output rows [0, t), the last one cut short
            runs = runs[runs[:, 4] < t].clone()
            runs[:, 3] = torch.minimum(runs[:, 3], t - runs[:, 4])
            out = out[:, :, :t]
        args = (self.setup.rows, st.token_view, st.codebook_rows, self.cb_pages, runs, 0, out.permute(2, 0, 1, 3, 4),
                st.fmt, self.max_run)  # fmt: skip
        if triton:
            view_runs_triton(*args, **tile_kw)
        else:
            view_runs_torch(*args)


def bench_mixed(shape: Shape, args, device: torch.device, mv: MixedView):
    """Mixed view build: the whole quantized view in one Triton launch against the torch reference."""
    tile_kw = {"block_rows": args.block_rows, "block_cols": args.block_cols}
    print(f"  mixed view: {mv.runs.shape[0]} runs (dense + packed), at most {mv.max_run} tokens each, one launch")
    mv.run(triton=False, tile_kw=tile_kw)
    mv.run(triton=True, tile_kw=tile_kw)
    same = _bits_equal(mv.out, mv.out_ref)
    pair = [
        _measure(shape.name, "mixed_view_build", "torch", mv.tokens, mv.nbytes,
                 partial(mv.run, triton=False, tile_kw=tile_kw), args, device),
        _measure(shape.name, "mixed_view_build", "triton", mv.tokens, mv.nbytes,
                 partial(mv.run, triton=True, tile_kw=tile_kw), args, device),
    ]  # fmt: skip
    _report(pair, same)
    return pair, same


def bench_kmeans(shape: Shape, args, device: torch.device):
    """One k-means assignment of a chunk (fp32, B*H heads) against prq's torch `assign_nearest`; near-ties verified."""
    from pagedqvg.kernels.pack.kmeans import distance_error_bound, kmeans_assign_torch
    from pagedqvg.kernels.pack.triton_kmeans import kmeans_assign_triton

    heads, S, D = args.batch * shape.heads, shape.chunk_tokens, shape.head_dim
    K = args.centroids or (8 if args.tiny else 128)
    gen = torch.Generator(device="cpu").manual_seed(4)
    x = torch.randn(heads, S, D, generator=gen).to(device)
    x = x / (2 * x.abs().amax())
    c = x[:, torch.randint(S, (K,), generator=gen).to(device)].contiguous()
    ref = kmeans_assign_torch(x, c)
    got = kmeans_assign_triton(x, c)
    diff = got != ref
    n_diff = int(diff.sum())
    ok = True
    if n_diff:  # differing ids must be rounding-level near-ties (checked in fp64, a head at a time)
        for h in diff.any(dim=1).nonzero().flatten().tolist():
            xh, ch = x[h : h + 1], c[h : h + 1]
            d64 = (ch.double() ** 2).sum(-1)[:, None, :] - 2.0 * torch.bmm(xh.double(), ch.double().transpose(1, 2))
            err = distance_error_bound(xh, ch)
            a, b = got[h : h + 1, :, None], ref[h : h + 1, :, None]
            gap = (d64.gather(2, a) - d64.gather(2, b)).abs()
            ok &= bool((gap <= err.gather(2, a) + err.gather(2, b)).all())
    nbytes = (x.numel() + c.numel()) * 4 + got.numel() * 8
    pair = [
        _measure(shape.name, "kmeans_assign", "torch", S, nbytes, partial(kmeans_assign_torch, x, c), args, device),
        _measure(shape.name, "kmeans_assign", "triton", S, nbytes, partial(kmeans_assign_triton, x, c), args, device),
    ]
    for r in pair:
        print(
            f"  {r.kernel:<28} {r.backend:<6} {heads} heads x {S} tok x {K} centroids: {r.median_us:>10.1f} us "
            f"{2 * heads * S * K * D / (r.median_us * 1e-6) / 1e12:>7.2f} TFLOP/s"
        )
    speed = pair[0].median_us / pair[1].median_us if pair[1].median_us > 0 else float("nan")
    print(
        f"  {'':<28} triton/torch speedup {speed:.2f}x; ids differing: {n_diff} of {got.numel()} "
        f"({'none' if not n_diff else 'all rounding-level near-ties' if ok else 'NOT near-ties: MISMATCH'})"
    )
    return pair, ok


def bench_prq_quantize(shape: Shape, args, device: torch.device, dtype: torch.dtype, page_bytes: int):
    """Packing one chunk as the cache does (PackedStore.quantize + write: k-means stages, the final residual
    block-quantized into staged rows, the rows copied into scrambled pool pages) with the Triton steps (k-means
    assign/update kernels, residual pack) against the same calls on the torch path, on synthetic video K/V.

    ids may differ on rounding-level near-ties (then everything downstream of that token may differ), so the check
    is on quality, not bytes: the share of identical token-record bytes is reported, and the Triton pack's relative
    L2 error (dequantized from its pages) must be within 2% of the torch pack's."""
    from pagedqvg import BlockPool
    from pagedqvg.layout.segments import PackedSegmentLayout
    from pagedqvg.planning.synthetic import relative_error, video_kv
    from pagedqvg.quant import PackedFormat, QuantConfig
    from pagedqvg.store.packed_store import PackedStore

    B, H, D, n = args.batch, shape.heads, shape.head_dim, shape.chunk_tokens
    K = args.centroids or (8 if args.tiny else 128)
    cfg = QuantConfig(centroids=K, block_size=64 if D % 64 == 0 else 8, **QUANTS[args.quant])
    k, v = video_kv(shape.chunk_frames, shape.tokens_per_frame, H, D, batch=B, seed=5, dtype=dtype)
    dense = torch.stack([k, v]).transpose(1, 2).contiguous().to(device)  # [2, n, B, H, D], as the cache reads it
    layout = PackedSegmentLayout.from_format(B, PackedFormat(head_dim=D, num_heads=H, cfg=cfg, dtype=dtype), page_bytes)
    pool = BlockPool(layout.pages_for_tokens(n) * page_bytes, page_bytes=page_bytes, device=device)
    store = PackedStore(pool, B, H, D, dtype, cfg)
    pages = pool.alloc(pool.num_pages, pool.new_owner("bench-prq"))
    pages = [pages[i] for i in torch.randperm(len(pages), generator=torch.Generator().manual_seed(6)).tolist()]
    ntok = store.token_pages(n)
    saved = os.environ.get("PAGEDQVG_KERNELS")

    def pack(backend: str) -> None:
        os.environ["PAGEDQVG_KERNELS"] = backend
        store.write(pages[:ntok], pages[ntok:], store.quantize(dense))

    def unpacked() -> tuple[torch.Tensor, torch.Tensor, float]:
        out = torch.empty(n, 2, B, H, D, dtype=dtype, device=device)
        store.dequantize_into(out, pages[:ntok], pages[ntok:], 0, n, 0)
        rows = torch.cat([store.token_view[p, : min(store.tpp, n - i * store.tpp)] for i, p in enumerate(pages[:ntok])])
        return rows, out, relative_error(dense.transpose(0, 1).float(), out.float())

    try:
        pack("torch")
        rows_ref, _, err_ref = unpacked()
        pack("triton")
        rows_tri, _, err_tri = unpacked()
        same_bytes = float((rows_ref == rows_tri).float().mean())
        ok = err_tri <= err_ref * 1.02 + 1e-6
        nbytes = dense.numel() * dense.element_size() + n * 2 * B * store.fmt.token_row_bytes
        pair = [
            _measure(shape.name, "prq_pack_chunk", backend, n, nbytes, partial(pack, backend), args, device)
            for backend in ("torch", "triton")
        ]
    finally:
        if saved is None:
            os.environ.pop("PAGEDQVG_KERNELS", None)
        else:
            os.environ["PAGEDQVG_KERNELS"] = saved
    for r in pair:
        print(f"  {r.kernel:<28} {r.backend:<6} {n} tok x {2 * B * H} heads (K+V), {K} centroids, {args.quant}: "
              f"{r.median_us / 1e3:>9.2f} ms per chunk")  # fmt: skip
    speed = pair[0].median_us / pair[1].median_us if pair[1].median_us > 0 else float("nan")
    print(
        f"  {'':<28} triton/torch speedup {speed:.2f}x; rel L2 error torch {err_ref:.4f} / triton {err_tri:.4f} "
        f"({'ok' if ok else 'WORSE: MISMATCH'}); identical token-record bytes {same_bytes:.2%}"
    )
    return pair, ok


class Setup:
    """One layer's pages in a real BlockPool: the visible segments of one view plus one chunk being written."""

    def __init__(self, shape: Shape, batch: int, dtype: torch.dtype, page_bytes: int, device: torch.device):
        from pagedqvg import BlockPool
        from pagedqvg.kernels.rows import segment_row_index, token_rows
        from pagedqvg.layout.segments import DenseTokenLayout

        self._segment_row_index = segment_row_index
        layout = DenseTokenLayout(batch, shape.heads, shape.head_dim, dtype, page_bytes)
        self.rows_per_page = layout.rows_per_page
        n, T = shape.chunk_tokens, shape.view_tokens
        self.seg_tokens = [min(n, T - s) for s in range(0, T, n)]  # visible segments, oldest first
        self.num_segments = len(self.seg_tokens)
        pages = sum(layout.pages_for_tokens(m) for m in self.seg_tokens) + layout.pages_for_tokens(n)
        self.pool = BlockPool(pages * page_bytes, page_bytes=page_bytes, device=device)
        owner = self.pool.new_owner("bench")
        # Take pages in a scrambled order, as a pool that has evicted and reused pages for a while hands them out.
        all_pages = self.pool.alloc(self.pool.num_pages, owner)
        order = torch.randperm(len(all_pages), generator=torch.Generator().manual_seed(1)).tolist()
        all_pages = [all_pages[i] for i in order]
        self.rows = token_rows(self.pool, dtype, shape.heads, shape.head_dim, self.rows_per_page)
        self.rows.view(torch.int16 if dtype != torch.float32 else torch.int32).random_()
        b = torch.arange(batch, dtype=torch.int64, device=device)
        kv = torch.arange(2, dtype=torch.int64, device=device)
        self.kv_batch = (kv[:, None] * batch + b[None, :])[:, :, None]
        self.segments = []
        i = 0
        for m in [*self.seg_tokens, n]:
            k = layout.pages_for_tokens(m)
            self.segments.append((torch.tensor(all_pages[i : i + k], dtype=torch.int64, device=device), m))
            i += k

    def view_index(self):
        parts = [self._segment_row_index(p, self.rows_per_page, 0, m, self.kv_batch) for p, m in self.segments[:-1]]
        return torch.cat([p for p, _ in parts], dim=2), torch.cat([s for _, s in parts], dim=2)

    def chunk_index(self):
        p, m = self.segments[-1]
        return self._segment_row_index(p, self.rows_per_page, 0, m, self.kv_batch)


def check_spills(device: torch.device) -> bool:
    """Registers and spills of every Triton binary this run compiled, as the driver loaded them (Triton's
    `n_regs`/`n_spills`); the AOT table (`python -m tools.triton_report --report`) says 0 spills for every
    kernel at sm_90, so a spill here means the GPU's toolchain disagrees. True when none spills."""
    from pagedqvg.kernels.attention import triton_attention, triton_attention_split
    from pagedqvg.kernels.pack import triton_kmeans, triton_residual_pack
    from pagedqvg.kernels.view import triton_dequant, triton_view_build, triton_view_runs
    from pagedqvg.kernels.write import triton_page_write

    ok, seen = True, 0
    for mod in (triton_page_write, triton_view_build, triton_view_runs, triton_dequant, triton_kmeans,
                triton_residual_pack, triton_attention, triton_attention_split):  # fmt: skip
        for name in dir(mod):
            kernel = getattr(mod, name)
            caches = getattr(kernel, "device_caches", None)
            if not name.startswith("_") or not name.endswith("_kernel") or caches is None:
                continue
            index = device.index if device.index is not None else torch.cuda.current_device()
            for compiled in caches[index][0].values():
                compiled._init_handles()
                seen += 1
                spills = compiled.n_spills
                print(f"  {name}: {compiled.n_regs} registers, {spills} spills, {compiled.metadata.shared} B shared"
                      + ("  SPILLS" if spills else ""))  # fmt: skip
                ok &= spills == 0
    print(f"compiled binaries checked for spills: {seen}" + ("" if ok else "  SPILLS FOUND"))
    return ok


def check_other_device(dtype: torch.dtype) -> bool:
    """With two or more GPUs: a pool on the last GPU while GPU 0 is current; the Triton page write and view build
    must run on the pool's GPU (results equal the torch path's bit for bit) and leave GPU 0 current. True when it
    passed or there is one GPU (skipped, said so)."""
    from pagedqvg import BlockPool
    from pagedqvg.kernels.write.page_write import page_write_torch
    from pagedqvg.kernels.write.triton_page_write import page_write_triton

    if torch.cuda.device_count() < 2:
        print("other-device launch check: skipped (one GPU)")
        return True
    other = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(0)
    pool = BlockPool(capacity_bytes=1 << 22, page_bytes=1 << 16, device=other)
    rows_a = pool.pages_as(dtype)[:8].view(8, -1, 4, 64)
    rows_b = rows_a.clone()
    gen = torch.Generator(device=other).manual_seed(0)
    kv = torch.randn(2, 1, 16, 4, 64, generator=gen, device=other).to(dtype)
    flat = torch.randperm(8 * rows_a.shape[1], generator=gen, device=other)[:32].view(2, 1, 16)
    page_idx, slot_idx = flat // rows_a.shape[1], flat % rows_a.shape[1]
    page_write_triton(rows_a, page_idx, slot_idx, 0, kv[0], kv[1])
    page_write_torch(rows_b, page_idx, slot_idx, 0, kv[0], kv[1])
    torch.cuda.synchronize(other)
    ok = _bits_equal(rows_a, rows_b) and torch.cuda.current_device() == 0
    print(f"other-device launch check ({other} while cuda:0 current): {'ok' if ok else 'FAILED'}")
    return ok


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(it), b.contiguous().view(it)))


def _no_recompile(label: str, what: str, kernels: tuple, run, device: torch.device) -> bool:
    """Run `run` (calls of other sizes) and check that `kernels` hold as many compiled binaries as before; prints
    the counts. True when nothing recompiled (or this Triton hides its cache)."""
    before = tuple(_compiled(k, device) for k in kernels)
    run()
    torch.cuda.synchronize(device)
    after = tuple(_compiled(k, device) for k in kernels)
    recompiled = before != after and None not in before
    print(f"  compiled kernels ({label}) before/after other {what}: {before} -> {after}"
          + ("  RECOMPILED" if recompiled else "  ok"))  # fmt: skip
    return not recompiled


def _compiled(kernel, device: torch.device):
    """How many binaries Triton holds for `kernel` on `device` (None if this Triton hides it)."""
    try:
        return len(kernel.device_caches[device.index if device.index is not None else torch.cuda.current_device()][0])
    except Exception:
        return None


def _measure(shape: str, kernel: str, backend: str, tokens: int, nbytes: int, fn, args, device) -> Row:
    cuda = device.type == "cuda"
    iters = args.iters if cuda else min(args.iters, 2)
    for _ in range(args.warmup if cuda else 1):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    gbps = nbytes / med / 1e9
    return Row(shape, kernel, backend, tokens, nbytes, med * 1e6, gbps, 100.0 * gbps / args.peak_gbps)


def _report(pair: list[Row], same: bool) -> None:
    torch_row, triton_row = pair
    for r in pair:
        print(
            f"  {r.kernel:<28} {r.backend:<6} {r.tokens:>6} tok {r.bytes / 1e6:>9.1f} MB {r.median_us:>10.1f} us "
            f"{r.gbps:>8.1f} GB/s {r.pct_peak:>5.1f}% peak"
        )
    speed = torch_row.median_us / triton_row.median_us if triton_row.median_us > 0 else float("nan")
    print(f"  {'':<28} triton/torch speedup {speed:.2f}x; bit-identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    raise SystemExit(main())
