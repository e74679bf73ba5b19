"""pagedqvg/kernels/triton_common.py: the kernels' tile choice depends on the layer shape only (one compiled
specialization per layer, whatever the chunk or view length); every launch runs under its tensors' device
(`launch_on_device`, spied on here) and every grid is checked against CUDA's limits."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from helpers import triton_kernels  # sets TRITON_INTERPRET before triton is imported

from pagedqvg.kernels.triton_common import Tile, tile_for

_, _, DEVICE, WHY = triton_kernels("write.triton_page_write", "_page_write_kernel")


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


# ------------------------------------------------------------------------------------ launches: device and grid
def _zeros(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def _every_triton_call(tr) -> dict[str, Callable[[], object]]:
    """One call of every public Triton entry point on tiny zeroed CPU tensors (all-zero indices and run tables are
    valid: page 0, slot 0, empty runs), keyed by the op name its launch reports."""
    from pagedqvg.kernels.pack import triton_kmeans as tkm
    from pagedqvg.kernels.pack import triton_residual_pack as trp
    from pagedqvg.kernels.view import triton_dequant as tdq
    from pagedqvg.kernels.view import triton_view_build as tvb
    from pagedqvg.kernels.view import triton_view_runs as tvr
    from pagedqvg.kernels.write import triton_page_write as tpw
    from pagedqvg.quant import PackedFormat, QuantConfig

    h, d, n, bf = 2, 16, 3, torch.bfloat16
    rows = _zeros(4, 8, h, d, dtype=bf)
    idx = torch.zeros(2, 1, n, dtype=torch.int64)
    kv = _zeros(1, n, h, d, dtype=bf)
    out_t = _zeros(n, 2, 1, h, d, dtype=bf)
    fmt = PackedFormat(d, h, QuantConfig(bits=2, centroids=4, block_size=16), bf)
    tokens, cb, cbp = tr.packed_pages(fmt, page_bytes=4096, device=torch.device("cpu"), num_pages=2)
    gfmt = PackedFormat(d, 2 * h, fmt.cfg, bf)
    x, c = _zeros(2 * h, n, d), _zeros(2 * h, 4, d)
    ids = torch.zeros(2 * h, n, dtype=torch.int64)
    runs, pieces = torch.zeros(2, 6, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64)
    dest = torch.zeros(2, 8, gfmt.token_row_bytes, dtype=torch.uint8)
    stage_ids = torch.zeros(2 * h, n, 1, dtype=torch.uint8)
    return {
        "page_write": lambda: tpw.page_write_triton(rows, idx, idx, 0, kv, kv),
        "page_fill": lambda: tpw.page_fill_triton(rows, idx, idx, 0.0),
        "view_build": lambda: tvb.view_build_triton(rows, idx, idx, 0, h, _zeros(2, 1, n, h, d, dtype=bf)),
        "view_runs": lambda: tvr.view_runs_triton(rows, None, None, None, runs, 0, out_t, None),
        "packed_dequant": lambda: tdq.packed_dequant_triton(tokens, cb, pieces, cbp, 0, out_t, fmt),
        "residual_pack": lambda: trp.residual_pack_triton(x, stage_ids, dest, ids[0], ids[0], gfmt),
        "kmeans_assign": lambda: tkm.kmeans_assign_triton(x, c),
        "kmeans_update": lambda: tkm.kmeans_update_triton(x, ids, c),
    }


@pytest.mark.skipif(DEVICE is None, reason=WHY)
def test_every_triton_launch_runs_under_its_tensors_device(monkeypatch):
    """Every Triton entry point launches through `launch_on_device`, inside `device_guard(<its tensors' device>)`:
    the guard is spied on, each call must enter it exactly once with the device of its tensors, and the kernel must
    run while the guard is held."""
    from pagedqvg.kernels import triton_common
    from tools.triton_report import resources as triton_resources

    entered: list[tuple[torch.device, bool]] = []
    held = {"now": False}
    real_guard = triton_common.device_guard

    @contextlib.contextmanager
    def spy(device):
        with real_guard(device):
            held["now"] = True
            entered.append(device)
            try:
                yield
            finally:
                held["now"] = False

    monkeypatch.setattr(triton_common, "device_guard", spy)
    calls = _every_triton_call(triton_resources)
    assert set(calls) == {"page_write", "page_fill", "view_build", "view_runs", "packed_dequant", "residual_pack",
                          "kmeans_assign", "kmeans_update"}  # fmt: skip
    for op, call in calls.items():
        entered.clear()
        call()
        assert entered == [DEVICE], (op, entered)


def test_launch_enters_the_guard_of_the_tensors_cuda_device(monkeypatch):
    """A launch whose tensors live on cuda:1 runs inside `device_guard(cuda:1)` whatever device is current (fake
    tensors stand in for CUDA memory: no GPU needed); tensors on two devices are refused before any launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pagedqvg.kernels import triton_common

    log: list[object] = []
    real_guard = triton_common.device_guard

    @contextlib.contextmanager
    def spy(device):
        log.append(("enter", device))
        yield
        log.append(("exit", device))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: log.append(("launch", grid))

    monkeypatch.setattr(triton_common, "device_guard", spy)
    with FakeTensorMode():
        a = torch.empty(4, device="cuda:1")
        b = torch.empty(4, device="cuda:0")
    triton_common.launch_on_device("op", (Kernel(), (3, 2), (a, 7, a), {"X": 1}))
    cuda1 = torch.device("cuda", 1)
    assert log == [("enter", cuda1), ("launch", (3, 2)), ("exit", cuda1)]
    log.clear()
    with pytest.raises(ValueError, match=r"op: .*one device"):
        triton_common.launch_on_device("op", (Kernel(), (1,), (a, b), {}))
    assert log == []
    triton_common.launch_on_device("op", None)  # nothing to launch
    assert log == []
    assert isinstance(real_guard(torch.device("cpu")), contextlib.nullcontext)
    guard = real_guard(torch.device("cuda", 1))  # built, not entered (no GPU here)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_grid_limits_both_sides():
    """CUDA allows 2^31 - 1 programs on x and 65535 on y and z: at the limit the grid passes, one past it raises a
    GridLimitError (a ValueError and PagedQVGError) naming the op, the axis and both sizes, and nothing launches."""
    from pagedqvg.errors import PagedQVGError
    from pagedqvg.kernels.triton_common import GridLimitError, check_grid, launch_on_device

    check_grid("op", (2**31 - 1, 65535, 65535))
    for axis, grid in (("x", (2**31, 1, 1)), ("y", (1, 65536)), ("z", (1, 1, 65536))):
        with pytest.raises(GridLimitError, match=rf"op: grid axis {axis} needs \d+ programs, CUDA allows at most"):
            check_grid("op", grid)
    assert issubclass(GridLimitError, ValueError) and issubclass(GridLimitError, PagedQVGError)

    class Kernel:
        def __getitem__(self, grid):
            raise AssertionError("launched")

    with pytest.raises(GridLimitError, match="kmeans_assign: grid axis y needs 70000"):
        launch_on_device("kmeans_assign", (Kernel(), (1, 70000), (torch.zeros(1),), {}))


@pytest.mark.skipif(DEVICE is None, reason=WHY)
def test_launch_geometry_at_and_past_the_limits():
    """The launch helpers' grids on meta tensors (no memory): packed_dequant folds its (kv, batch, head block)
    groups into axis x, so 2 * B * head_blocks = 81,920 > 65,535 still launches; view_runs without `max_run` over
    a view longer than 65,535 row blocks raises GridLimitError before launching, and fits with the cache's
    max_run."""
    from pagedqvg.kernels.triton_common import CUDA_GRID_MAX, GridLimitError, check_grid
    from pagedqvg.kernels.view.triton_dequant import packed_dequant_launch
    from pagedqvg.kernels.view.triton_view_runs import view_runs_launch
    from pagedqvg.quant import PackedFormat, QuantConfig
    from tools.triton_report import resources as tr

    meta = torch.device("meta")
    h, d, batch = 40, 128, 8192
    fmt = PackedFormat(d, h, QuantConfig(bits=2), torch.bfloat16)
    tokens, cb, cbp = tr.packed_pages(fmt, batch, page_bytes=1 << 30, num_pages=4)
    out_t = torch.empty(2, batch, 3, h, d, dtype=torch.bfloat16, device=meta).permute(2, 0, 1, 3, 4)
    pieces = torch.empty(3, 5, dtype=torch.int64, device=meta)
    _, grid, _, kwargs = packed_dequant_launch(tokens, cb, pieces, cbp, 0, out_t, fmt)
    groups = 2 * batch * (-(-h // kwargs["HEADS_PER_BLOCK"]))
    assert groups > CUDA_GRID_MAX[1] and grid == (3 * groups, 1)
    check_grid("packed_dequant", grid)

    rows = tr.meta_rows(h, d, torch.bfloat16, 1 << 20)
    rows = rows[:, : rows.shape[1] // 2 * 2]
    t = 4 * 65535 + 4  # 4 rows per program (the compiled tile at this shape): 65,536 row blocks
    view = torch.empty(2, 1, t, h, d, dtype=torch.bfloat16, device=meta).permute(2, 0, 1, 3, 4)
    runs = torch.empty(8, 6, dtype=torch.int64, device=meta)
    with pytest.raises(GridLimitError, match=r"view_runs grid .* exceeds CUDA's 65535"):
        view_runs_launch(rows, None, None, None, runs, 0, view, None, block_rows=4)
    _, grid, _, _ = view_runs_launch(rows, None, None, None, runs, 0, view, None, max_run=4 * 65535, block_rows=4)
    assert grid[1] == 65535
    check_grid("view_runs", grid)
