"""Tiling shared by the Triton kernels (pure Python; importing this does not import triton).

Every kernel tiles token rows the same way: a program owns `BLOCK_R` rows of one of K/V and `HEADS_PER_BLOCK`
consecutive heads of those rows, i.e. a `[BLOCK_R, HEADS_PER_BLOCK * BLOCK_D]` tile whose column `c` is head
`c // BLOCK_D`, channel `c % BLOCK_D` (`BLOCK_D = next_pow2(head_dim)`, masked to `head_dim`). With the usual
layouts (`head_dim` a multiple of 16, heads contiguous) each tile row is one contiguous run of bytes in the source
and in the destination, which is what a copy kernel wants for 16-byte vector accesses.

Every launch goes through `launch_on_device` (one place): it checks the grid against CUDA's limits
(`check_grid`, a `GridLimitError` naming the op, the axis and the sizes) and launches under `device_guard(device)`
of the tensors' CUDA device, so a pool on `cuda:1` launches on `cuda:1` (and on that device's current stream)
whatever device is current.

Only layer shapes are compile-time constants (`HEAD_DIM`, the block sizes derived from it); token counts, batch,
head slices and the rows of the view are runtime arguments the kernels do not specialize on, so one layer shape is
one compile whatever the chunk, segment and window lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedqvg.errors import PagedQVGError

#: Elements per tile (rows x columns). 4096 bf16 = 8 KiB per program: 32 elements (four 16 B vectors) per thread
#: at 4 warps. Tune with benchmarks/bench_kernels_cuda.py (--block-rows/--block-cols).
TILE_ELEMS = 4096
#: Elements per tile in Triton's interpreter, where each program costs milliseconds of Python whatever its size:
#: big tiles, few programs.
TILE_ELEMS_INTERPRETED = 1 << 14
#: Columns (elements of one token row) per tile at most; HEADS_PER_BLOCK = min(BLOCK_C // BLOCK_D, next_pow2(H)).
BLOCK_C = 1024
NUM_WARPS = 4


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass(frozen=True, slots=True)
class Tile:
    """Block sizes of one layer shape (all compile-time constants of the kernels)."""

    block_r: int  # token rows per program
    block_d: int  # next_pow2(head_dim)
    heads_per_block: int  # heads per program

    @property
    def block_c(self) -> int:
        return self.heads_per_block * self.block_d


def tile_for(
    head_dim: int,
    num_heads: int,
    block_rows: int | None = None,
    block_cols: int | None = None,
    *,
    interpreted: bool = False,
) -> Tile:
    """The tile of a layer with `num_heads` heads of `head_dim` (the cache's shape, not a call's head slice).

    `block_rows`/`block_cols` override the defaults (tests, tuning); powers of two.
    """
    block_d = next_pow2(head_dim)
    if block_cols is not None:
        cols = max(block_d, next_pow2(block_cols))
    else:
        cols = max(block_d, min(BLOCK_C, block_d * next_pow2(num_heads)))
    heads_per_block = cols // block_d
    tile_elems = TILE_ELEMS_INTERPRETED if interpreted else TILE_ELEMS
    rows = block_rows if block_rows is not None else max(1, tile_elems // cols)
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"block_rows must be a power of two >= 1, got {rows}")
    return Tile(rows, block_d, heads_per_block)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` (a decorated Triton kernel) runs in Triton's CPU interpreter (`TRITON_INTERPRET=1`)."""
    return type(kernel).__name__ == "InterpretedFunction"


#: CUDA's grid limits per axis (x, y, z): programs.
CUDA_GRID_MAX = (2**31 - 1, 65535, 65535)


class GridLimitError(PagedQVGError, ValueError):
    """A kernel launch would need more programs on a grid axis than CUDA allows (nothing was launched)."""


def check_grid(op: str, grid: Sequence[int]) -> None:
    """Raise `GridLimitError` when an axis of `grid` exceeds `CUDA_GRID_MAX` (x <= 2^31 - 1, y and z <= 65535)."""
    for axis, (n, limit) in enumerate(zip(grid, CUDA_GRID_MAX, strict=False)):
        if n > limit:
            raise GridLimitError(
                f"{op}: grid axis {'xyz'[axis]} needs {n} programs, CUDA allows at most {limit} "
                f"(grid {tuple(grid)}); split the call (fewer tokens, runs or heads per launch)"
            )


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` for a CUDA device (Triton launches on the current device and its current
    stream), a no-op for any other device (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launch_device(op: str, args: Sequence[object]) -> torch.device:
    """The device of the tensors among `args`; they must all be on one device (else ValueError naming them)."""
    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    if len(devices) != 1:
        raise ValueError(f"{op}: the kernel's tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


def launch_on_device(op: str, launch: tuple | None) -> None:
    """Run `launch = (kernel, grid, args, kwargs)` (None: nothing to do): grid checked (`check_grid`), then the
    kernel launched under `device_guard` of its tensors' device. O(len(args)) host work, no device sync."""
    if launch is None:
        return
    kernel, grid, args, kwargs = launch
    check_grid(op, grid)
    with device_guard(launch_device(op, args)):
        kernel[grid](*args, **kwargs)
