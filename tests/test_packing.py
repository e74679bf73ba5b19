"""pagedqvg/store/packed_store.py: PackedStore packs a dense K/V chunk into pool pages and dequantizes token ranges
back.

The oracle is the PRQ codec itself (pagedqvg/quant): `quantize` must give the token rows and codebooks of
`prq_quantize` over the B*H folded heads (bit for bit), and every range / head slice dequantized from the pages must
equal the same slice of `prq_dequantize` of those rows. Pages are handed out in a scrambled order and the arena
starts with random bytes, so a read from the wrong page or slot shows.
"""

from __future__ import annotations

import pytest
import torch

from pagedqvg import BlockPool, QuantConfig
from pagedqvg.quant import PackedFormat, prq_quantize
from pagedqvg.store.packed_store import PackedStore, QuantizedChunk

CFGS = {
    "int2-2st": QuantConfig(bits=2, centroids=4, block_size=8, stages=2),
    "int4-asym": QuantConfig(bits=4, centroids=3, block_size=4, asymmetric=True),
    "compact": QuantConfig.compact(centroids=5, block_size=16),
}
B, H, D, N = 2, 3, 16, 13


def setup(cfg: QuantConfig, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool(256 * 1024, page_bytes=1024)
    pool.arena.view(torch.uint8).copy_(torch.randint(0, 256, pool.arena.shape, generator=g, dtype=torch.uint8))
    store = PackedStore(pool, B, H, D, dtype, cfg)
    pages = pool.alloc(store.pages_for_tokens(N), pool.new_owner("test"))
    pages = [pages[i] for i in torch.randperm(len(pages), generator=g).tolist()]
    ntok = store.token_pages(N)
    dense = (torch.randn(2, N, B, H, D, generator=g) * 2).to(dtype)
    return pool, store, dense, pages[:ntok], pages[ntok:]


def reference(dense: torch.Tensor, cfg: QuantConfig) -> tuple[list, torch.Tensor]:
    """(prq_quantize segments of K and V over the B*H folded heads, their dequantization `[N, 2, B, H, D]`)."""
    segs = [prq_quantize(dense[kv].reshape(N, B * H, D), cfg) for kv in range(2)]
    full = torch.stack([s.dequantize().view(N, B, H, D) for s in segs], dim=1)
    return segs, full


@pytest.mark.parametrize("name", sorted(CFGS))
def test_quantize_is_the_prq_codec_and_changes_no_page(name):
    cfg = CFGS[name]
    pool, store, dense, _, _ = setup(cfg)
    before = pool.arena.clone()
    q = store.quantize(dense)
    assert isinstance(q, QuantizedChunk) and q.num_tokens == N
    assert torch.equal(pool.arena, before)  # staged only: nothing of the pool changed
    segs, _ = reference(dense, cfg)
    fmt_all = PackedFormat(D, 2 * B * H, cfg, dense.dtype)
    for kv in range(2):
        assert torch.equal(q.token_rows[:, kv], segs[kv].token_rows.view(N, B, -1))
    want_cb = fmt_all.pack_codebooks(torch.cat([s.codebooks for s in segs]))
    assert torch.equal(q.codebook_rows, want_cb)

@pytest.mark.parametrize("name", sorted(CFGS))
def test_quantize_inside_autocast_is_the_same_as_outside(name):
    """SGLang writes K/V inside `torch.autocast` (bf16): packing turns it off, so the rows are bit for bit those
    packed outside (k-means matmuls in float32), and compact's fp8 codebooks pack (autocast's `cat` refuses fp8)."""
    cfg = CFGS[name]
    _, store, dense, _, _ = setup(cfg)
    want = store.quantize(dense)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = store.quantize(dense)
    assert torch.equal(got.token_rows, want.token_rows) and torch.equal(got.codebook_rows, want.codebook_rows)


@pytest.mark.parametrize("name", sorted(CFGS))
def test_written_pages_dequantize_to_the_round_trip(name):
    cfg = CFGS[name]
    pool, store, dense, tok, cb = setup(cfg)
    segs, full = reference(dense, cfg)
    outside = torch.ones(pool.num_pages, dtype=torch.bool)
    outside[tok + cb] = False
    untouched = pool.arena.view(torch.uint8).view(pool.num_pages, -1)[outside].clone()
    store.write(tok, cb, store.quantize(dense))
    assert torch.equal(pool.arena.view(torch.uint8).view(pool.num_pages, -1)[outside], untouched)
    cbs = store.codebooks(cb)
    assert torch.equal(cbs.view(torch.uint8), torch.cat([s.codebooks for s in segs]).view(torch.uint8))
    for t0, t1, hs, heads in ((0, N, 0, H), (0, 1, 0, H), (4, 11, 1, 2), (N - 1, N, 2, 1), (3, 3, 0, H)):
        out = torch.full((t1 - t0, 2, B, heads, D), float("nan"), dtype=dense.dtype)
        store.dequantize_into(out, tok, cb, t0, t1, hs)
        want = full[t0:t1, :, :, hs : hs + heads]
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (t0, t1, hs, heads)


def test_several_runs_equal_one_call_per_run():
    cfg = CFGS["int2-2st"]
    _, store, dense, tok, cb = setup(cfg)
    store.write(tok, cb, store.quantize(dense))
    runs = [(0, tok, cb, 2, 7), (5, tok, cb, 0, 3), (8, tok, cb, 9, N)]
    out = torch.zeros(8 + N - 9, 2, B, 2, D, dtype=dense.dtype)
    store.dequantize_runs_into(out, runs, 1)
    for o, tp, cp, t0, t1 in runs:
        one = torch.zeros(t1 - t0, 2, B, 2, D, dtype=dense.dtype)
        store.dequantize_into(one, tp, cp, t0, t1, 1)
        assert torch.equal(out[o : o + t1 - t0], one)


def test_geometry_and_a_page_too_small():
    cfg = CFGS["int2-2st"]
    pool = BlockPool(64 * 1024, page_bytes=1024)
    store = PackedStore(pool, B, H, D, torch.bfloat16, cfg)
    fmt = PackedFormat(D, H, cfg, torch.bfloat16)
    assert store.tpp == 1024 // fmt.token_row_bytes // (2 * B)
    assert store.token_pages(N) == -(-N // store.tpp)
    cb_rows_per_page = 1024 // fmt.codebook_row_bytes
    assert store.pages_for_tokens(N) == store.token_pages(N) + -(-2 * B * H * cfg.stages // cb_rows_per_page)
    big = QuantConfig(bits=4, centroids=2, block_size=4)  # 100 heads x (16 code + 8 scale + 1 id) B per token row
    with pytest.raises(ValueError, match=r"a packed token \(16 rows of 2500 B\) does not fit a page of 1024 B; "
                                         r"use page_bytes >= 40192"):  # fmt: skip
        PackedStore(BlockPool(64 * 1024, page_bytes=1024), 8, 100, 32, torch.bfloat16, big)


def test_non_finite_values_are_refused_before_anything_is_written():
    cfg = CFGS["int2-2st"]
    pool, store, dense, _, _ = setup(cfg)
    dense[1, 5, 0, 2, 3] = float("inf")
    before = pool.arena.clone()
    with pytest.raises(ValueError):
        store.quantize(dense)
    assert torch.equal(pool.arena, before)
