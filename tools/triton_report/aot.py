"""Ahead-of-time checks of the Triton kernels that need no GPU: specialization keys and PTX for a CUDA target.

Triton compiles one binary per *specialization key*: the constexpr values plus, for every other argument, its type
(i32/i64, pointer dtype) and, unless the kernel opts out with `do_not_specialize`, whether an int equals 1 or is a
multiple of 16. `specialization_key` computes that key exactly as `JITFunction.run` does, for the arguments the
launch helpers (`*_launch`) build, so a sweep over token counts shows whether a kernel would recompile per chunk,
segment or view length. `compile_ptx` compiles the same launch for a CUDA target with the ptxas shipped in the
triton wheel (no driver needed), which proves the kernel compiles and shows whether its accesses are vectorized.

These use Triton internals (`create_function_from_signature`, `JITFunction._pack_args`, `CUDABackend`); they are
checks, not part of any data path, and raise ImportError/AttributeError when a Triton version moves them. The
kernels must be real `JITFunction`s: run with TRITON_INTERPRET unset. Meta tensors stand in for data (no memory).

`python -m tools.triton_report.aot` prints a JSON report over the LingBot-World and LongLive2 layer shapes;
`--report` prints registers, spills and shared memory of every kernel at every model shape (triton_resources.py).
"""

from __future__ import annotations

import re

import torch

from pagedqvg.kernels.triton_common import Tile, tile_for
from pagedqvg.kernels.view.triton_view_build import view_build_launch
from pagedqvg.kernels.write.triton_page_write import page_fill_launch, page_write_launch

META = torch.device("meta")


def _mock(arg):
    """Tensors → triton MockTensor (dtype only; data_ptr 0, i.e. 16-byte aligned like every CUDA allocation)."""
    from triton.runtime.jit import MockTensor

    return MockTensor(arg.dtype) if isinstance(arg, torch.Tensor) else arg


def _target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def _bind(kernel, args, kwargs, arch: int):
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    if type(kernel).__name__ != "JITFunction":
        raise RuntimeError(f"{type(kernel).__name__} is not a compiled-mode kernel; unset TRITON_INTERPRET")
    backend = CUDABackend(_target(arch))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*map(_mock, args), **kwargs)
    return backend, bound, specialization, options


def specialization_key(launch, arch: int = 90) -> str:
    """The JIT cache key of `launch = (kernel, grid, args, kwargs)` minus options (which are fixed per kernel)."""
    kernel, _grid, args, kwargs = launch
    _, _, specialization, _ = _bind(kernel, args, kwargs, arch)
    return str(specialization)


def compile_kernel(launch, arch: int = 90):
    """`launch` compiled for `sm_{arch}` (CPU only: Triton's frontend, LLVM and the bundled ptxas), a Triton
    `CompiledKernel` (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.shared`). Any compile error propagates."""
    import triton
    from triton.compiler import ASTSource

    kernel, _grid, args, kwargs = launch
    backend, bound, specialization, options = _bind(kernel, args, kwargs, arch)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=_target(arch),
                          options=options.__dict__)  # fmt: skip


def compile_ptx(launch, arch: int = 90) -> str:
    """PTX of `launch` compiled for `sm_{arch}` (see `compile_kernel`)."""
    return compile_kernel(launch, arch).asm["ptx"]


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")


def ptxas_resources(ptx: str, arch: int = 90) -> dict[str, int]:
    """Registers per thread, spill stores/loads and stack frame (bytes per thread) of the one kernel in `ptx`, from
    `ptxas -v` run exactly as Triton runs it for `sm_{arch}` (its bundled ptxas, `-lineinfo --regAllocOptLevel=2`).
    Raises RuntimeError when ptxas fails or its report cannot be parsed."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.cubin")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    used, spill, stack = _PTXAS_USED.search(log), _PTXAS_SPILL.search(log), _PTXAS_STACK.search(log)
    if proc.returncode != 0 or not (used and spill and stack):
        raise RuntimeError(f"ptxas -v failed (rc {proc.returncode}): {log[-2000:]}")
    return {"registers": int(used.group(1)), "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2)),
            "stack": int(stack.group(1))}  # fmt: skip


def compile_resources(launch, arch: int = 90) -> dict:
    """Registers, spills (ptxas -v), shared memory (bytes, Triton's metadata) and warps of `launch` at `sm_{arch}`."""
    compiled = compile_kernel(launch, arch)
    out = ptxas_resources(compiled.asm["ptx"], arch)
    out["shared"] = int(compiled.metadata.shared)
    out["num_warps"] = int(compiled.metadata.num_warps)
    return out


def ptx_access_counts(ptx: str) -> dict[str, int]:
    """Global loads/stores in `ptx` by width: 'v4' (16 B for 32-bit lanes) / 'v2' / 'scalar'."""
    counts = {}
    for op in ("ld", "st"):
        found = re.findall(rf"\b{op}\.global(?:\.[a-z]+)*?(\.v[24])?\.[bfsu]\d+", ptx)
        counts[f"{op}.v4"] = sum(1 for v in found if v == ".v4")
        counts[f"{op}.v2"] = sum(1 for v in found if v == ".v2")
        counts[f"{op}.scalar"] = sum(1 for v in found if not v)
    return counts


# ------------------------------------------------------------------ launches on meta tensors
def meta_rows(num_heads: int, head_dim: int, dtype: torch.dtype, page_bytes: int, num_pages: int = 64):
    """A `[num_pages, rows_per_page, H, D]` token-row view of a meta arena laid out like rows.token_rows."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    page_elems = page_bytes // itemsize
    rpp = page_elems // (num_heads * head_dim)
    arena = torch.empty(num_pages, page_elems, dtype=dtype, device=META)
    return arena[:, : rpp * num_heads * head_dim].view(num_pages, rpp, num_heads, head_dim)


def write_launch(rows, batch: int, tokens: int, hin: int, head_start: int = 0, tile: Tile | None = None):
    d = rows.shape[3]
    idx = torch.empty(2, batch, tokens, dtype=torch.int64, device=META)
    key = torch.empty(batch, tokens, hin, d, dtype=rows.dtype, device=META)
    kw = {} if tile is None else {"block_rows": tile.block_r, "block_cols": tile.block_c}
    return page_write_launch(rows, idx, idx, head_start, key, key, **kw)


def fill_launch(rows, batch: int, tokens: int, tile: Tile | None = None):
    idx = torch.empty(2, batch, tokens, dtype=torch.int64, device=META)
    kw = {} if tile is None else {"block_rows": tile.block_r, "block_cols": tile.block_c}
    return page_fill_launch(rows, idx, idx, 0.0, **kw)


def view_launch(rows, batch: int, tokens: int, hin: int, head_start: int = 0, tile: Tile | None = None):
    d = rows.shape[3]
    idx = torch.empty(2, batch, tokens, dtype=torch.int64, device=META)
    out = torch.empty(2, batch, tokens, hin, d, dtype=rows.dtype, device=META)
    kw = {} if tile is None else {"block_rows": tile.block_r, "block_cols": tile.block_c}
    return view_build_launch(rows, idx, idx, head_start, hin, out, **kw)


#: Per-layer shapes of the target models: (name, heads, head_dim, tokens/frame, window frames, sink frames).
MODEL_SHAPES = (
    ("lingbot-world", 40, 128, 1560, 18, 3),
    ("longlive2", 24, 128, 880, 32, 8),
)


def report(arch: int = 90, compile_kernels: bool = True, page_bytes: int = 2 << 20) -> dict:
    """Distinct specialization keys per kernel and layer shape over a sweep of token counts, and PTX access widths."""
    out: dict = {"arch": arch, "shapes": {}}
    for name, heads, d, per_frame, window, sink in MODEL_SHAPES:
        rows = meta_rows(heads, d, torch.bfloat16, page_bytes)
        counts = sorted({1, 2, 3, 15, 16, 17, per_frame, 3 * per_frame, (window + sink) * per_frame})
        entry: dict = {"tile": str(tile_for(d, heads)), "token_counts": counts}
        makers = {
            "page_write": lambda n, rows=rows, heads=heads: write_launch(rows, 1, n, heads),
            "page_write_head_slice": lambda n, rows=rows, heads=heads: write_launch(rows, 1, n, heads // 2, 3),
            "page_fill": lambda n, rows=rows: fill_launch(rows, 1, n),
            "view_build": lambda n, rows=rows, heads=heads: view_launch(rows, 1, n, heads),
            "view_build_batch2": lambda n, rows=rows, heads=heads: view_launch(rows, 2, n, heads),
        }
        for kname, make in makers.items():
            keys = {specialization_key(make(n), arch) for n in counts}
            entry[kname] = {"distinct_keys": len(keys)}
            if compile_kernels and kname in ("page_write", "page_fill", "view_build"):
                entry[kname]["ptx"] = ptx_access_counts(compile_ptx(make(counts[-1]), arch))
        out["shapes"][name] = entry
    return out


def triton_version() -> str:
    import triton

    return triton.__version__
