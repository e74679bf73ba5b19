"""The page write and page fill Triton kernels against their torch references, bit for bit, plus the compile-shape
checks of the dense kernels (page write, page fill, view build: one AOT report).

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
    make_rows,
    random_bits,
    rerun_interpreted,
    triton_kernels,
    unique_rows,
)

from pagedqvg.kernels.write.page_write import page_fill_torch, page_write_torch

tpw, TRITON_ERROR, DEVICE, WHY = triton_kernels("write.triton_page_write", "_page_write_kernel")
tvb = triton_kernels("view.triton_view_build", "_view_build_kernel")[0]
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


# ---------------------------------------------------------------------------------------------- subprocess checks
_AOT_SCRIPT = r"""
import json, sys, torch
from pagedqvg.kernels import dispatch
from pagedqvg.kernels.view import triton_view_build
from tools.triton_report import aot as triton_aot
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
        "pagedqvg.kernels.write.triton_page_write", fromlist=["x"])
    k = getattr(mod, name)
    params[name] = {"constexpr": [p.name for p in k.params if p.is_constexpr],
                    "not_specialized": [p.name for p in k.params if p.do_not_specialize]}
result["params"] = params
result["report"] = triton_aot.report(arch=90, compile_kernels=len(sys.argv) > 1 and sys.argv[1] == "compile")
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
