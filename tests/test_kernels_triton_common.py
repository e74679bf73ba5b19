"""pagedqvg/kernels/triton_common.py: the kernels' tile choice depends on the layer shape only (one compiled
specialization per layer, whatever the chunk or view length)."""

from __future__ import annotations

import pytest

from pagedqvg.kernels.triton_common import Tile, tile_for


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
