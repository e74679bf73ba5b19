"""Triton kernels against their torch references, bit for bit, plus dispatch and compile-shape checks.

Where the kernels run: with no CUDA device, through Triton's interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when it decorates kernels (and its own library functions at `import triton`), so this module sets
it *before* anything imports triton. If triton was already imported in compiled mode by the time this module loads
(and there is no GPU), the in-process tests skip with that reason and `test_interpreter_in_subprocess` runs this
file again in a fresh interpreter process with TRITON_INTERPRET=1 — it never passes silently. On a CUDA machine
(TRITON_INTERPRET unset) the same comparisons run on CUDA tensors with compiled kernels.

Equality is bitwise: tensors are compared as integers of the same width with `torch.equal`, on random bit
patterns (NaNs with payloads, -0.0, subnormals, infinities included), and over the whole arena, so a kernel that
writes anywhere it should not fails too.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import (  # sets TRITON_INTERPRET
    bits,
    compiled_mode_json,
    kernel_device,
    random_bits,
    rerun_interpreted,
)

from pagedqvg import BlockPool, PagedCausalKVCache
from pagedqvg.kernels import dispatch
from pagedqvg.kernels.page_write import page_fill_torch, page_write_torch
from pagedqvg.kernels.triton_common import Tile, tile_for
from pagedqvg.kernels.view_build import view_build_torch

try:
    from pagedqvg.kernels import triton_page_write as tpw
    from pagedqvg.kernels import triton_view_build as tvb

    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the install
    tpw = tvb = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"

DEVICE, WHY = kernel_device(TRITON_ERROR, tvb and tvb._view_build_kernel)
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make_rows(num_pages: int, rpp: int, heads: int, d: int, dtype, gen, pad: int = 5):
    """An arena of random bits and its `[num_pages, rpp, H, D]` token-row view, laid out like rows.token_rows."""
    arena = random_bits((num_pages, rpp * heads * d + pad), dtype, gen)
    return arena, arena[:, : rpp * heads * d].view(num_pages, rpp, heads, d)


def make_kv(kind: str, batch: int, n: int, hin: int, d: int, dtype, gen, device="cpu") -> torch.Tensor:
    """A `[B, n, Hin, D]` tensor of random bits on `device` with the strides `kind` names."""

    def base(*shape):
        return random_bits(shape, dtype, gen).to(device)

    if kind == "contiguous":
        return base(batch, n, hin, d)
    if kind == "heads_major":  # [B, Hin, n, D] transposed
        return base(batch, hin, n, d).transpose(1, 2)
    if kind == "token_major":  # [n, B, Hin, D] permuted
        return base(n, batch, hin, d).permute(1, 0, 2, 3)
    if kind == "strided_d":  # every other channel: last stride 2
        return base(batch, n, hin, 2 * d)[..., ::2]
    if kind == "offset":  # odd storage offset: misaligned base pointer
        return base(batch * n * hin * d + 3)[3:].view(batch, n, hin, d)
    if kind == "expanded":  # stride 0 over the batch
        return base(1, n, hin, d).expand(batch, n, hin, d)
    raise AssertionError(kind)


def unique_rows(num_pages: int, rpp: int, batch: int, n: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[2, B, n]` row index with all rows distinct (a write target)."""
    flat = torch.randperm(num_pages * rpp, generator=gen)[: 2 * batch * n].view(2, batch, n)
    return flat // rpp, flat % rpp


def any_rows(num_pages: int, rpp: int, batch: int, t: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[2, B, T]` row index drawn with replacement (a gather may read a row twice)."""
    flat = torch.randint(0, num_pages * rpp, (2, batch, t), generator=gen)
    return flat // rpp, flat % rpp


def to_dev(*ts):
    return tuple(t.to(DEVICE) for t in ts)


# ---------------------------------------------------------------------------------------------- page write
# (B, n, H, Hin, head_start, D, rows_per_page, num_pages, kv layout, tile override (block_rows, block_cols))
WRITE_CASES = [
    (1, 1, 1, 1, 0, 16, 1, 2, "contiguous", None),  # one-token segment, one row per page
    (1, 5, 3, 3, 0, 16, 3, 5, "contiguous", None),  # rows not a multiple of the block; rpp not a power of two
    (2, 7, 4, 2, 1, 24, 5, 7, "heads_major", None),  # batch 2, head slice, D not a power of two
    (3, 6, 5, 3, 2, 16, 7, 6, "token_major", (2, 16)),  # one head per program, 2-row blocks
    (2, 9, 3, 2, 0, 8, 5, 9, "strided_d", (4, 8)),
    (2, 4, 6, 5, 1, 16, 3, 8, "offset", (1, 32)),
    (2, 3, 2, 2, 0, 32, 3, 5, "expanded", None),
]


def _write_id(case):
    b, n, h, hin, h0, d, rpp, _p, kind, tile = case
    return f"B{b}-n{n}-H{h}-heads{h0}+{hin}-D{d}-rpp{rpp}-{kind}" + (f"-tile{tile[0]}x{tile[1]}" if tile else "")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WRITE_CASES, ids=_write_id)
def test_page_write_matches_torch(case, dtype):
    b, n, h, hin, h0, d, rpp, num_pages, kind, tile = case
    gen = torch.Generator().manual_seed(zlib.crc32(_write_id(case).encode()))
    arena, _ = make_rows(num_pages, rpp, h, d, dtype, gen)
    key = make_kv(kind, b, n, hin, d, dtype, gen, DEVICE)
    value = make_kv(kind, b, n, hin, d, dtype, gen, DEVICE)
    pidx, sidx = unique_rows(num_pages, rpp, b, n, gen)

    ref_arena = arena.clone()
    ref_rows = ref_arena[:, : rpp * h * d].view(num_pages, rpp, h, d)
    page_write_torch(ref_rows, pidx, sidx, h0, key.cpu(), value.cpu())

    arena_d = arena.to(DEVICE)
    rows_d = arena_d[:, : rpp * h * d].view(num_pages, rpp, h, d)
    pidx_d, sidx_d = to_dev(pidx, sidx)
    kw = {} if tile is None else {"block_rows": tile[0], "block_cols": tile[1]}
    tpw.page_write_triton(rows_d, pidx_d, sidx_d, h0, key, value, **kw)
    assert torch.equal(bits(arena_d.cpu()), bits(ref_arena))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fill", [0.0, -0.0, 1.0 / 3.0, float("nan")], ids=["0", "-0", "third", "nan"])
def test_page_fill_matches_torch(dtype, fill):
    gen = torch.Generator().manual_seed(7)
    num_pages, rpp, h, d, b, n = 6, 5, 3, 24, 2, 7
    arena, _ = make_rows(num_pages, rpp, h, d, dtype, gen)
    pidx, sidx = unique_rows(num_pages, rpp, b, n, gen)
    ref_arena = arena.clone()
    page_fill_torch(ref_arena[:, : rpp * h * d].view(num_pages, rpp, h, d), pidx, sidx, fill)
    arena_d = arena.to(DEVICE)
    pidx_d, sidx_d = to_dev(pidx, sidx)
    tpw.page_fill_triton(arena_d[:, : rpp * h * d].view(num_pages, rpp, h, d), pidx_d, sidx_d, fill, block_rows=4,
                         block_cols=32)  # fmt: skip
    assert torch.equal(bits(arena_d.cpu()), bits(ref_arena))


@needs_kernels
def test_empty_calls_touch_nothing():
    gen = torch.Generator().manual_seed(3)
    arena, _ = make_rows(2, 3, 2, 16, torch.bfloat16, gen)
    arena_d = arena.to(DEVICE)
    rows = arena_d[:, : 3 * 2 * 16].view(2, 3, 2, 16)
    empty = torch.empty(2, 1, 0, dtype=torch.int64, device=DEVICE)
    kv = torch.empty(1, 0, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    tpw.page_write_triton(rows, empty, empty, 0, kv, kv)
    tpw.page_fill_triton(rows, empty, empty, 1.0)
    out = torch.empty(2, 1, 0, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    assert tvb.view_build_triton(rows, empty, empty, 0, 2, out) is out
    assert torch.equal(bits(arena_d.cpu()), bits(arena))


# ---------------------------------------------------------------------------------------------- view build
# (B, T, H, Hin, head_start, D, rows_per_page, num_pages, tile override, non-contiguous index)
VIEW_CASES = [
    (1, 1, 1, 1, 0, 16, 1, 3, None, False),  # one-token view
    (1, 6, 3, 3, 0, 16, 3, 4, None, False),
    (2, 11, 4, 2, 1, 24, 5, 5, None, True),  # batch 2, head slice, D not a power of two, strided index
    (3, 9, 5, 3, 2, 16, 7, 4, (2, 16), False),  # one head per program
    (2, 17, 3, 1, 2, 8, 3, 7, (4, 8), False),
]


def _view_id(case):
    b, t, h, hin, h0, d, rpp, _p, tile, strided = case
    return (
        f"B{b}-T{t}-H{h}-heads{h0}+{hin}-D{d}-rpp{rpp}"
        + (f"-tile{tile[0]}x{tile[1]}" if tile else "")
        + ("-strided_index" if strided else "")
    )


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", VIEW_CASES, ids=_view_id)
def test_view_build_matches_torch(case, dtype):
    b, t, h, hin, h0, d, rpp, num_pages, tile, strided = case
    gen = torch.Generator().manual_seed(zlib.crc32(_view_id(case).encode()))
    arena, rows = make_rows(num_pages, rpp, h, d, dtype, gen)
    pidx, sidx = any_rows(num_pages, rpp, b, t, gen)
    if strided:
        pidx = pidx.transpose(1, 2).contiguous().transpose(1, 2)
        sidx = sidx.transpose(1, 2).contiguous().transpose(1, 2)
    ref = random_bits((2, b, t, hin, d), dtype, gen)
    out = ref.clone()
    view_build_torch(rows, pidx, sidx, h0, hin, ref)

    arena_d = arena.to(DEVICE)
    rows_d = arena_d[:, : rpp * h * d].view(num_pages, rpp, h, d)
    pidx_d, sidx_d = (pidx, sidx) if DEVICE.type == "cpu" else to_dev(pidx, sidx)
    out_d = out.to(DEVICE)
    kw = {} if tile is None else {"block_rows": tile[0], "block_cols": tile[1]}
    assert tvb.view_build_triton(rows_d, pidx_d, sidx_d, h0, hin, out_d, **kw) is out_d
    assert torch.equal(bits(out_d.cpu()), bits(ref))
    assert torch.equal(bits(arena_d.cpu()), bits(arena))  # the source is untouched


# ---------------------------------------------------------------------------------------------- via the cache
def _scenario(cache: PagedCausalKVCache, hin: int, head_start: int | None, dtype, gen) -> list[torch.Tensor]:
    """Appends that roll past a sink, rewrites of the current chunk, a pin, a rewind; every view's K and V."""
    views = []

    def step(start: int, n: int, **kw):
        k = random_bits((cache.batch_size, n, hin, cache.head_dim), dtype, gen).to(cache.device)
        v = random_bits((cache.batch_size, n, hin, cache.head_dim), dtype, gen).to(cache.device)
        view = cache.update_and_get_attention_kv(
            key=k, value=v, current_chunk_start=start, cache_head_start=head_start, **kw
        )
        views.extend([view.k.cpu(), view.v.cpu()])

    step(0, 3)
    step(0, 3)  # denoise step: rewrite of the current chunk
    step(3, 3)
    step(6, 3)  # rolls (C = 8, sink 2)
    cache.pin_current_chunk(3)
    step(9, 1)  # one-token chunk
    step(10, 3, recent_window_tokens=2)
    cache.rewind_to(11)
    step(11, 2)
    return views


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads", ["all", "slice"])
def test_cache_views_identical_with_triton_and_torch(monkeypatch, dtype, heads):
    h, hin, h0 = 3, (3 if heads == "all" else 2), (None if heads == "all" else 1)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", backend)
        assert dispatch.kernel_backend(DEVICE) == backend
        pool = BlockPool(16 * 1024, page_bytes=1024, device=DEVICE)
        cache = PagedCausalKVCache(pool=pool, batch_size=2, cache_size=8, num_heads=h, head_dim=16, dtype=dtype,
                                   device=DEVICE, sink_tokens=2)  # fmt: skip
        results[backend] = _scenario(cache, hin, h0, dtype, torch.Generator().manual_seed(11))
    assert len(results["torch"]) == len(results["triton"])
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------------------------------------- dispatch
def test_kernel_backend_choices(monkeypatch):
    monkeypatch.delenv("PAGEDQVG_KERNELS", raising=False)
    assert dispatch.kernel_backend(torch.device("cpu")) == "torch"
    assert dispatch.kernel_backend("cpu") == "torch"
    if dispatch.triton_available():
        assert dispatch.kernel_backend(torch.device("cuda")) == "triton"
    else:  # auto: CUDA tensors fall back to torch, with a warning naming the import error (once per process)
        dispatch._warn_fallback.cache_clear()
        with pytest.warns(RuntimeWarning, match=r"Triton kernels unavailable \(.+\); CUDA tensors use the slower"):
            assert dispatch.kernel_backend(torch.device("cuda")) == "torch"
    for forced in ("torch", "triton"):
        monkeypatch.setenv("PAGEDQVG_KERNELS", forced.upper())
        assert dispatch.kernel_backend(torch.device("cpu")) == forced
        assert dispatch.kernel_backend(torch.device("cuda")) == forced
    monkeypatch.setenv("PAGEDQVG_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGEDQVG_KERNELS"):
        dispatch.kernel_backend(torch.device("cpu"))


def test_torch_backend_never_touches_triton(monkeypatch):
    """With PAGEDQVG_KERNELS=torch the torch references run (no interpreter needed)."""
    monkeypatch.setenv("PAGEDQVG_KERNELS", "torch")
    gen = torch.Generator().manual_seed(5)
    _, rows = make_rows(3, 3, 2, 16, torch.float16, gen)
    pidx, sidx = unique_rows(3, 3, 1, 2, gen)
    key = random_bits((1, 2, 2, 16), torch.float16, gen)
    dispatch.page_write(rows, pidx, sidx, 0, key, key)
    out = torch.empty(2, 1, 2, 2, 16, dtype=torch.float16)
    dispatch.view_build(rows, pidx, sidx, 0, 2, out)
    assert torch.equal(bits(out[0]), bits(key)) and torch.equal(bits(out[1]), bits(key))


def test_tile_depends_on_the_layer_shape_only():
    t = tile_for(128, 40)
    assert (t.block_d, t.heads_per_block, t.block_r) == (128, 8, 4)  # 4 x 1024 elements = 8 KiB of bf16
    assert tile_for(128, 24) == t
    assert tile_for(32, 2) == Tile(64, 32, 2)  # small layers: no columns for heads that do not exist
    assert tile_for(24, 3).block_d == 32 and tile_for(200, 1).heads_per_block == 1
    assert tile_for(128, 40, interpreted=True).block_r == 16  # few, big programs in the interpreter
    assert tile_for(16, 5, 2, 16) == Tile(2, 16, 1)
    with pytest.raises(ValueError):
        tile_for(128, 40, block_rows=3)


# ---------------------------------------------------------------------------------------------- subprocess checks
_AOT_SCRIPT = r"""
import json, sys, torch
from pagedqvg.kernels import dispatch, triton_aot, triton_view_build
from pagedqvg.kernels.triton_common import is_interpreted
result = {"interpreted": is_interpreted(triton_view_build._view_build_kernel)}
try:
    rows = torch.zeros(2, 1, 1, 8)
    idx = torch.zeros(2, 1, 1, dtype=torch.int64)
    dispatch.view_build(rows, idx, idx, 0, 1, torch.empty(2, 1, 1, 1, 8))
    result["cpu_forced_triton"] = "no error"
except RuntimeError as exc:
    result["cpu_forced_triton"] = str(exc)
params = {}
for name in ("_page_write_kernel", "_page_fill_kernel", "_view_build_kernel"):
    mod = triton_view_build if name == "_view_build_kernel" else __import__(
        "pagedqvg.kernels.triton_page_write", fromlist=["x"])
    k = getattr(mod, name)
    params[name] = {"constexpr": [p.name for p in k.params if p.is_constexpr],
                    "not_specialized": [p.name for p in k.params if p.do_not_specialize]}
result["params"] = params
try:
    result["report"] = triton_aot.report(arch=90, compile_kernels=len(sys.argv) > 1 and sys.argv[1] == "compile")
except (ImportError, AttributeError, TypeError) as exc:
    result["report_error"] = f"{type(exc).__name__}: {exc}"
print("JSON" + json.dumps(result))
"""


@pytest.mark.skipif(TRITON_ERROR is not None, reason=f"triton does not import: {TRITON_ERROR}")
def test_compiled_mode_one_specialization_per_layer_shape_and_ptx():
    """In compiled mode (fresh process, TRITON_INTERPRET unset): only layer shapes are constexpr, the JIT key is the
    same for every chunk/view length at the LingBot-World and LongLive2 shapes, the kernels compile for sm_90 (no GPU
    needed) with 16-byte vector loads/stores, and forcing Triton on CPU tensors says how to fix it."""
    result = compiled_mode_json(_AOT_SCRIPT, "compile", PAGEDQVG_KERNELS="triton")
    assert result["interpreted"] is False
    assert "TRITON_INTERPRET=1" in result["cpu_forced_triton"]
    layer = {"HEAD_DIM", "BLOCK_R", "BLOCK_D", "HEADS_PER_BLOCK"}
    for name, p in result["params"].items():
        assert set(p["constexpr"]) == layer, name
        assert "num_rows" in p["not_specialized"], name
    for name in ("_page_write_kernel", "_view_build_kernel"):
        assert {"n_tokens", "head_start", "num_heads_in"} <= set(result["params"][name]["not_specialized"])
    if "report_error" in result:
        pytest.skip(f"this Triton version moved the internals the AOT check uses: {result['report_error']}")
    for shape, entry in result["report"]["shapes"].items():
        for kname, k in entry.items():
            if isinstance(k, dict):
                assert k["distinct_keys"] == 1, (shape, kname, entry["token_counts"])
                if "ptx" in k:
                    assert k["ptx"]["st.v4"] > 0 and k["ptx"]["st.scalar"] == 0, (shape, kname, k["ptx"])
                    if kname != "page_fill":
                        assert k["ptx"]["ld.v4"] > 0, (shape, kname, k["ptx"])


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
