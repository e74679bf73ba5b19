"""Registers, spills and shared memory of every Triton kernel at sm_90, at the LingBot-World (also 20 heads per
Ulysses rank), LongLive2 and Self-Forcing layer shapes (tools/triton_report/resources.py): compiled in a fresh
compiled-mode process with the ptxas of the triton wheel (no GPU needed). Every kernel must compile (a compile
failure fails the test; only a missing triton skips it), no kernel may spill, and the chosen tile/warp configs are
pinned here so a change to them is deliberate. The table is printed (pytest -s) and quoted in the README.
"""

from __future__ import annotations

from helpers import compiled_mode_json  # skips only when triton is not installed

_SCRIPT = """
import json
from tools.triton_report import resources as triton_resources
rows = triton_resources.report(90)
print(triton_resources.format_table(rows))
print("JSON" + json.dumps(rows))
"""

_TILE = "BLOCK_R=4 HEADS_PER_BLOCK=8 BLOCK_D=128 warps=4"
#: The config every kernel runs with at head_dim 128 (the same at every model shape: tiles depend on head_dim and
#: the format only; heads, tokens and batch are runtime).
PINNED = {
    "page_write": _TILE,
    "page_fill": _TILE,
    "view_build": _TILE,
    "view_runs/dense": _TILE,
    "view_runs/int4": _TILE,
    "view_runs/int2": _TILE,
    "view_runs/compact": _TILE,
    "packed_dequant/int4": _TILE,
    "packed_dequant/int2": _TILE,
    "packed_dequant/compact": _TILE,
    "residual_pack/int4": "BLOCK_R=16 BLOCK_CB=64 BLOCK_NB=2 warps=4",
    "residual_pack/int2": "BLOCK_R=16 BLOCK_CB=32 BLOCK_NB=2 warps=4",
    "residual_pack/compact": "BLOCK_R=16 BLOCK_CB=32 BLOCK_NB=1 warps=8",
    "kmeans_assign": "BLOCK_D=128 BLOCK_S=64 BLOCK_K=64 BLOCK_DK=32 warps=8",
    "kmeans_update": "BLOCK_D=128 BLOCK_S=64 BLOCK_K=32 warps=8",
    "attention/index": "BLOCK_M=64 BLOCK_N=64 BLOCK_D=128 warps=8",
    "attention/dense": "BLOCK_M=64 BLOCK_N=64 BLOCK_D=128 warps=8",
    # Packed decode in registers: 32 key rows per block (compact spilled 756 B/thread at 64; 255 registers at 32).
    "attention/int4": "BLOCK_M=64 BLOCK_N=32 BLOCK_D=128 warps=8",
    "attention/int2": "BLOCK_M=64 BLOCK_N=32 BLOCK_D=128 warps=8",
    "attention/compact": "BLOCK_M=64 BLOCK_N=32 BLOCK_D=128 warps=8",
    # Split-KV pair (triton_attention_split.py, reported at triton_resources.REPORT_SPLITS ranges): the same blocks.
    "attention_split/index": "BLOCK_M=64 BLOCK_N=64 BLOCK_D=128 warps=8",
    "attention_split/dense": "BLOCK_M=64 BLOCK_N=64 BLOCK_D=128 warps=8",
    "attention_split/int4": "BLOCK_M=64 BLOCK_N=32 BLOCK_D=128 warps=8",
    "attention_split/int2": "BLOCK_M=64 BLOCK_N=32 BLOCK_D=128 warps=8",
    "attention_split/compact": "BLOCK_M=64 BLOCK_N=32 BLOCK_D=128 warps=8",
    "attention_merge": "BLOCK_M=64 BLOCK_D=128 warps=8",
}
SHAPES = ("lingbot-world", "lingbot-world/ulysses2", "longlive2", "self-forcing")
#: sm_90's shared memory per block (227 KiB) and registers per thread.
SM90_SHARED, SM90_REGS = 227 * 1024, 255


def test_every_kernel_compiles_for_sm90_without_spills_at_every_model_shape():
    rows = compiled_mode_json(_SCRIPT)
    got = {(r["shape"], r["kernel"]) for r in rows}
    assert got == {(s, k) for s in SHAPES for k in PINNED}, sorted(got)
    for r in rows:
        where = (r["shape"], r["kernel"], r)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, where
        assert 0 < r["registers"] <= SM90_REGS and r["shared"] <= SM90_SHARED, where
        assert r["config"] == PINNED[r["kernel"]], where
        assert r["grid"][0] <= 2**31 - 1 and all(n <= 65535 for n in r["grid"][1:]), where
    # The k-means assign kernel spilled ~12.5 KB of stores per thread before its dot product was split into
    # 32-channel slices at 8 warps; it must stay well clear of the register limit.
    assign = [r for r in rows if r["kernel"] == "kmeans_assign"]
    assert all(r["registers"] < 200 for r in assign), assign
