"""Registers, spills and shared memory of every Triton kernel at the target models' layer shapes, for sm_90, without
a GPU (Triton's frontend and LLVM, then `ptxas -v` from the triton wheel; see triton_aot.compile_resources).

Shapes: the LingBot-World, LongLive2 and Self-Forcing presets (pagedqvg/planning/presets.py; heads, head_dim 128, chunk
=
chunk_frames x tokens/frame, view = sink + window), LingBot-World also with its heads split over 2 Ulysses ranks
(20 heads per rank). Kernels: page write and fill, dense view build, mixed view build (no packed sources and each
PRQ format), packed dequant, residual pack (each format), k-means assign and update, attention from pages (one
launch; and the split-KV partials + merge pair at `REPORT_SPLITS` ranges). Formats: SGLang's int4 and
int2, and `QuantConfig.compact()`. Each launch is built by the kernel's own `*_launch` helper on meta tensors, so the
tile, warps and grid are exactly what a call at that shape would use; launches with the same kernel and
constexprs compile once.

Configs are chosen by shape where shapes differ: the row tile by head_dim and heads (`triton_common.tile_for`), the
k-means tiles and warps by head_dim (`triton_kmeans.kmeans_warps`), the residual pack's tokens per program by the
format's code bytes and blocks and its warps by `fit_scales` (`triton_residual_pack.pack_warps`). The presets all
have head_dim 128 and at least 8 heads, so each kernel gets one config (and one binary) at every model shape.

`python -m tools.triton_report --report` prints the table; tests/test_kernels_compile_resources.py asserts
0 spills for every row and pins the chosen configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedqvg.planning.presets import PRESETS
from pagedqvg.quant import PackedFormat, QuantConfig
from tools.triton_report.aot import META, compile_resources, meta_rows

#: Constexpr names that describe a launch's tile (the rest are layer/format constants).
_CONFIG_KEYS = (
    "BLOCK_M", "BLOCK_N", "BLOCK_R", "HEADS_PER_BLOCK", "BLOCK_D", "BLOCK_S", "BLOCK_K", "BLOCK_DK", "BLOCK_CB",
    "BLOCK_NB",
)
PAGE_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class LayerShape:
    """One layer of a model on one rank: `heads` of `head_dim`, `chunk` tokens per advance, `view` tokens read."""

    name: str
    heads: int
    head_dim: int
    chunk: int
    view: int


def model_shapes() -> tuple[LayerShape, ...]:
    """The report's shapes, from the presets (batch 1, bf16)."""
    out = []
    for preset, ranks in (("lingbot-world", 1), ("lingbot-world", 2), ("longlive2", 1), ("self-forcing", 1)):
        w = PRESETS[preset]
        tpf = w.tokens_per_frame
        name = preset if ranks == 1 else f"{preset}/ulysses{ranks}"
        view = (w.sink_frames + w.window_frames) * tpf
        out.append(LayerShape(name, w.heads // ranks, w.head_dim, w.chunk_frames * tpf, view))
    return tuple(out)


def formats() -> dict[str, QuantConfig]:
    """The PRQ formats the packed kernels are reported for."""
    return {"int4": QuantConfig(bits=4), "int2": QuantConfig(bits=2), "compact": QuantConfig.compact()}


def packed_pages(fmt: PackedFormat, batch: int = 1, page_bytes: int = PAGE_BYTES, device=META, num_pages: int = 64):
    """Zeroed (meta: no memory) packed token pages `[num_pages, tpp, 2, B, row_bytes]`, codebook pages
    `[num_pages, rows, K, D]` and a page list of 8 codebook pages, laid out as the cache lays them out."""
    tpp = page_bytes // (2 * batch * fmt.token_row_bytes)
    tokens = torch.zeros(num_pages, page_bytes, dtype=torch.uint8, device=device)
    tokens = tokens[:, : tpp * 2 * batch * fmt.token_row_bytes].view(num_pages, tpp, 2, batch, fmt.token_row_bytes)
    k, d = fmt.cfg.centroids, fmt.head_dim
    cb_dtype = torch.float8_e4m3fn if fmt.cfg.codebook_fp8 else fmt.dtype
    cb_elems = page_bytes // cb_dtype.itemsize
    rpp = cb_elems // (k * d)
    cb = torch.zeros(num_pages, cb_elems, dtype=cb_dtype, device=device)[:, : rpp * k * d].view(num_pages, rpp, k, d)
    return tokens, cb, torch.zeros(8, dtype=torch.int64, device=device)


def launches(shape: LayerShape) -> dict[str, tuple]:
    """`{kernel label: (kernel, grid, args, kwargs)}` at `shape` (every kernel, every format)."""
    from pagedqvg.kernels.pack.triton_kmeans import kmeans_assign_launch, kmeans_update_launch
    from pagedqvg.kernels.pack.triton_residual_pack import residual_pack_launch
    from pagedqvg.kernels.view.triton_dequant import packed_dequant_launch
    from pagedqvg.kernels.view.triton_view_runs import view_runs_launch
    from tools.triton_report import aot as triton_aot

    h, d, n, t = shape.heads, shape.head_dim, shape.chunk, shape.view
    rows = meta_rows(h, d, torch.bfloat16, PAGE_BYTES)
    out = {
        "page_write": triton_aot.write_launch(rows, 1, n, h),
        "page_fill": triton_aot.fill_launch(rows, 1, n),
        "view_build": triton_aot.view_launch(rows, 1, t, h),
    }
    runs = torch.empty(-(-t // n) + 2, 6, dtype=torch.int64, device=META)
    view_out = torch.empty(2, 1, t, h, d, dtype=torch.bfloat16, device=META).permute(2, 0, 1, 3, 4)
    dense_rows = rows[:, : rows.shape[1] // 2 * 2]
    out["view_runs/dense"] = view_runs_launch(dense_rows, None, None, None, runs, 0, view_out, None, max_run=n)
    g = 2 * h  # K and V heads folded (PRQ packs [S, 2 * B * H, D])
    x = torch.empty(g, n, d, device=META)
    for name, cfg in formats().items():
        fmt = PackedFormat(d, h, cfg, torch.bfloat16)
        tokens, cb, cbp = packed_pages(fmt)
        out[f"view_runs/{name}"] = view_runs_launch(dense_rows, tokens, cb, cbp, runs, 0, view_out, fmt, max_run=n)
        pieces = torch.empty(-(-n // tokens.shape[1]) + 1, 5, dtype=torch.int64, device=META)
        chunk_out = torch.empty(2, 1, n, h, d, dtype=torch.bfloat16, device=META).permute(2, 0, 1, 3, 4)
        out[f"packed_dequant/{name}"] = packed_dequant_launch(tokens, cb, pieces, cbp, 0, chunk_out, fmt)
        gfmt = PackedFormat(d, g, cfg, torch.bfloat16)
        dest = torch.empty(64, 128, gfmt.token_row_bytes, dtype=torch.uint8, device=META)
        idx = torch.empty(n, dtype=torch.int64, device=META)
        ids = torch.empty(g, n, cfg.stages, dtype=torch.uint8, device=META)
        out[f"residual_pack/{name}"] = residual_pack_launch(x, ids, dest, idx, idx, gfmt)
    out.update(attention_launches(shape, rows, dense_rows, runs))
    out.update(attention_split_launches(shape, rows, dense_rows, runs))
    k = QuantConfig(bits=2).centroids
    c = torch.empty(g, k, d, device=META)
    out["kmeans_assign"] = kmeans_assign_launch(x, c, torch.empty(g, n, dtype=torch.int64, device=META))
    out["kmeans_update"] = kmeans_update_launch(x, torch.empty(g, n, dtype=torch.int64, device=META), c,
                                                torch.empty_like(c))  # fmt: skip
    return out


def attention_launches(shape: LayerShape, rows, dense_rows, runs) -> dict[str, tuple]:
    """The attention-from-pages kernel (triton_attention.py) at `shape`: a chunk's queries over a dense view (row
    index), a run table without packed sources, and a run table of each format."""
    from pagedqvg.kernels.attention.triton_attention import attend_launch

    h, d, n, t = shape.heads, shape.head_dim, shape.chunk, shape.view
    q = torch.empty(1, n, h, d, dtype=torch.bfloat16, device=META)
    idx = torch.empty(2, 1, t, dtype=torch.int64, device=META)
    out = {"attention/index": attend_launch(q, rows, (idx, idx), None, None, None, 0, t, d**-0.5, q)}
    out["attention/dense"] = attend_launch(q, dense_rows, None, runs, None, None, 0, t, d**-0.5, q)
    for name, cfg in formats().items():
        fmt = PackedFormat(d, h, cfg, torch.bfloat16)
        packed = packed_pages(fmt)
        out[f"attention/{name}"] = attend_launch(q, dense_rows, None, runs, packed, fmt, 0, t, d**-0.5, q)
    return out


#: Key ranges of the split attention launches in the report (the heuristic picks 1 at the presets' full chunks; the
#: binaries do not depend on it: S is a grid axis and a runtime argument).
REPORT_SPLITS = 4


def attention_split_launches(shape: LayerShape, rows, dense_rows, runs) -> dict[str, tuple]:
    """The split-KV attention pair (triton_attention_split.py) at `shape` with `REPORT_SPLITS` ranges: the partials
    kernel over a row index, a run table without packed sources and one of each format, and the merge kernel."""
    from pagedqvg.kernels.attention.triton_attention_split import attend_split_launch

    h, d, n, t = shape.heads, shape.head_dim, shape.chunk, shape.view
    q = torch.empty(1, n, h, d, dtype=torch.bfloat16, device=META)
    idx = torch.empty(2, 1, t, dtype=torch.int64, device=META)
    s = REPORT_SPLITS
    partials, merge, _ = attend_split_launch(q, rows, (idx, idx), None, None, None, 0, t, d**-0.5, q, s)
    out = {"attention_split/index": partials, "attention_merge": merge}
    out["attention_split/dense"] = attend_split_launch(q, dense_rows, None, runs, None, None, 0, t, d**-0.5, q, s)[0]
    for name, cfg in formats().items():
        fmt = PackedFormat(d, h, cfg, torch.bfloat16)
        packed = packed_pages(fmt)
        launch = attend_split_launch(q, dense_rows, None, runs, packed, fmt, 0, t, d**-0.5, q, s)
        out[f"attention_split/{name}"] = launch[0]
    return out


def launch_config(launch) -> str:
    """The tile and warps of `launch`, e.g. `BLOCK_R=4 HEADS_PER_BLOCK=8 BLOCK_D=128 warps=4`."""
    kwargs = launch[3]
    parts = [f"{k}={kwargs[k]}" for k in _CONFIG_KEYS if k in kwargs]
    return " ".join([*parts, f"warps={kwargs.get('num_warps', 4)}"])


def _compile_key(launch) -> tuple:
    kernel, _grid, args, kwargs = launch
    dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    return (kernel.fn.__name__, dtypes, tuple(sorted((k, str(v)) for k, v in kwargs.items())))


def report(arch: int = 90, shapes: tuple[LayerShape, ...] | None = None) -> list[dict]:
    """One row per (shape, kernel): registers, spill stores/loads and stack (bytes per thread), shared memory
    (bytes per program), warps, config, grid. Each distinct compile runs once (~5-15 s each on a CPU core)."""
    cache: dict[tuple, dict] = {}
    rows = []
    for shape in shapes or model_shapes():
        for label, launch in launches(shape).items():
            key = _compile_key(launch)
            if key not in cache:
                cache[key] = compile_resources(launch, arch)
            rows.append({"shape": shape.name, "kernel": label, **cache[key], "config": launch_config(launch),
                         "grid": list(launch[1])})  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    """`rows` as a Markdown table, one line per kernel and resource set: registers, spill stores/loads (bytes per
    thread), shared memory (bytes per program), config, and the grid at each shape (`-`: other resources there,
    on their own line)."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    lines: dict[tuple, dict[str, str]] = {}
    for r in rows:
        key = (r["kernel"], r["registers"], r["spill_stores"], r["spill_loads"], r["shared"], r["config"])
        lines.setdefault(key, {})[r["shape"]] = " x ".join(map(str, r["grid"]))
    head = "| kernel | registers | spill st/ld (B) | shared (B) | config | " + " | ".join(
        f"grid {s}" for s in shapes) + " |"  # fmt: skip
    out = [head, "|---|---:|---:|---:|---|" + "---|" * len(shapes)]
    for (kernel, regs, st, ld, shared, config), grids in lines.items():
        cells = " | ".join(grids.get(s, "-") for s in shapes)
        out.append(f"| {kernel} | {regs} | {st}/{ld} | {shared} | {config} | {cells} |")
    return "\n".join(out)
