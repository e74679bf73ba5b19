"""pagedqvg/kernels/rows.py: the token-row view of the arena and the row index of a dense segment.

`token_rows` must be a view whose element (page, row, head, d) is at the byte the layout documents, and
`segment_row_index` must address exactly the rows the layout rule gives (layout.py), which are the rows the cache
writes: a chunk written through the cache reads back, unchanged, at those rows.
"""

from __future__ import annotations

import pytest
import torch
from helpers import segment_entries
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedqvg import BlockPool, PagedCausalKVCache
from pagedqvg.kernels.rows import int64_on, segment_row_index, token_rows
from pagedqvg.layout.segments import DenseTokenLayout

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kv_batch(batch: int) -> torch.Tensor:
    """`[2, B, 1]`: kv * B + b."""
    return torch.arange(2 * batch, dtype=torch.int64).view(2, batch, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_rows_is_a_view_at_the_documented_bytes(dtype):
    pool = BlockPool(8 * 1024, page_bytes=1024)
    H, D, rpp = 3, 8, 5  # 5 rows of 3 x 8 elements per page (the tail of each page is not part of the view)
    rows = token_rows(pool, dtype, H, D, rpp)
    assert tuple(rows.shape) == (pool.num_pages, rpp, H, D) and rows.dtype == dtype
    assert rows.untyped_storage().data_ptr() == pool.arena.untyped_storage().data_ptr()
    item = dtype.itemsize
    raw = pool.arena.view(torch.uint8).view(pool.num_pages, 1024)
    for p, r, h, d in ((0, 0, 0, 0), (3, 4, 2, 7), (7, 2, 1, 3)):
        pool.arena.zero_()
        rows[p, r, h, d] = 1.0
        nonzero = raw.nonzero().tolist()
        byte = ((r * H + h) * D + d) * item
        assert nonzero and all(pp == p and byte <= b < byte + item for pp, b in nonzero), (p, r, h, d, nonzero)


@settings(max_examples=150, deadline=None)
@given(B=st.integers(1, 3), tpp=st.integers(1, 6), n_pages=st.integers(1, 5), data=st.data())
def test_segment_row_index_is_the_layout_rule(B, tpp, n_pages, data):
    pages = data.draw(st.permutations(range(20, 20 + n_pages)), label="pages")
    t0 = data.draw(st.integers(0, tpp * n_pages), label="t0")
    t1 = data.draw(st.integers(t0, tpp * n_pages), label="t1")
    page_idx, slot_idx = segment_row_index(torch.tensor(pages), 2 * B * tpp, t0, t1, kv_batch(B))
    assert page_idx.shape == slot_idx.shape == (2, B, t1 - t0)
    assert page_idx.dtype == slot_idx.dtype == torch.int64
    for kv in range(2):
        for b in range(B):
            for i, t in enumerate(range(t0, t1)):
                want = (pages[t // tpp], kv * tpp * B + (t % tpp) * B + b)
                assert (int(page_idx[kv, b, i]), int(slot_idx[kv, b, i])) == want
    # every addressed row is distinct and inside its page
    pairs = set(zip(page_idx.flatten().tolist(), slot_idx.flatten().tolist(), strict=True))
    assert len(pairs) == 2 * B * (t1 - t0) and all(0 <= s < 2 * B * tpp for _, s in pairs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [1, 2])
def test_the_cache_writes_the_rows_segment_row_index_addresses(B, dtype):
    """A dense chunk written through the cache reads back, bit for bit, from the rows the index names."""
    H, D, n = 2, 8, 11
    pool = BlockPool(64 * 1024, page_bytes=512)
    cache = PagedCausalKVCache(pool=pool, batch_size=B, cache_size=16, num_heads=H, head_dim=D, dtype=dtype,
                               device="cpu")  # fmt: skip
    g = torch.Generator().manual_seed(B)
    k, v = (torch.randn(B, n, H, D, generator=g).to(dtype) for _ in range(2))
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    (seg,) = segment_entries(cache)
    assert (seg.start, seg.end) == (0, n)
    lay = DenseTokenLayout(B, H, D, dtype, pool.page_bytes)
    assert len(seg.value.pages) == lay.pages_for_tokens(n) > 1  # the chunk spans several pages
    rows = token_rows(pool, dtype, H, D, lay.rows_per_page)
    page_idx, slot_idx = segment_row_index(torch.tensor(seg.value.pages), lay.rows_per_page, 0, n, kv_batch(B))
    got = rows[page_idx, slot_idx]  # [2, B, n, H, D]
    assert torch.equal(got[0].view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(got[1].view(torch.uint8), v.view(torch.uint8))
    # a sub-range addresses the same rows as the matching slice of the whole
    p2, s2 = segment_row_index(torch.tensor(seg.value.pages), lay.rows_per_page, 3, 9, kv_batch(B))
    assert torch.equal(p2, page_idx[..., 3:9]) and torch.equal(s2, slot_idx[..., 3:9])


def test_int64_on_cpu():
    t = int64_on([3, -1, 2**40], torch.device("cpu"))
    assert t.dtype == torch.int64 and t.device.type == "cpu" and t.tolist() == [3, -1, 2**40]
    assert int64_on([], "cpu").shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pinned-memory path)")
def test_int64_on_cuda_through_pinned_memory():
    t = int64_on(list(range(1000)), torch.device("cuda"))
    assert t.device.type == "cuda" and t.dtype == torch.int64
    assert t.cpu().tolist() == list(range(1000))  # the copy was ordered before this read on the stream
