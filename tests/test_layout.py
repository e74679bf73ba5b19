"""pagedqvg/layout/segments.py: where rows sit in pages, checked against brute-force placements, and the page-size
choice
against an exhaustive search. The planner's page counting (`segment_kinds`) must agree with the layouts the cache
allocates by (`DenseTokenLayout`, `PackedSegmentLayout`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedqvg.layout.segments import (
    AUTO_PAGE_MAX_BYTES,
    AUTO_PAGE_WASTE,
    DenseTokenLayout,
    PackedSegmentLayout,
    RowRegion,
    SegmentShape,
    choose_page_bytes,
    dtype_itemsize,
    page_pieces,
    segment_kinds,
)
from pagedqvg.quant import PackedFormat, QuantConfig

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def greedy_pages(record_bytes: int, records: int, page_bytes: int) -> int:
    """Pages used by placing `records` records one by one, opening a new page when the next does not fit whole."""
    pages, room = 0, 0
    for _ in range(records):
        if room < record_bytes:
            pages, room = pages + 1, page_bytes
            assert room >= record_bytes
        room -= record_bytes
    return pages


# ------------------------------------------------------------------------------------------------ row regions
@settings(max_examples=200, deadline=None)
@given(row=st.integers(1, 3000), pages=st.integers(1, 16), rows=st.integers(0, 60))
def test_row_region_against_greedy_placement(row, pages, rows):
    page = max(row, pages * 256)
    r = RowRegion(row, page)
    assert r.rows_per_page == max(k for k in range(page + 1) if k * row <= page)
    assert r.pages_for_rows(rows) == greedy_pages(row, rows, page)


def test_row_region_errors_name_the_values():
    with pytest.raises(ValueError, match=r"row_bytes must be > 0, got 0"):
        RowRegion(0, 1024)
    with pytest.raises(ValueError, match=r"one row of 1100 B does not fit a page of 1024 B; use page_bytes >= 1280"):
        RowRegion(1100, 1024)


def test_dtype_itemsize():
    assert [dtype_itemsize(d) for d in (*DTYPES, torch.uint8, torch.int64)] == [4, 2, 2, 1, 8]


# ------------------------------------------------------------------------------------------------ dense tokens
@settings(max_examples=150, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 4), D=st.integers(1, 16), dtype=st.sampled_from(DTYPES),
       units=st.integers(1, 12), tokens=st.integers(0, 40))  # fmt: skip
def test_dense_layout_against_a_byte_placement(B, H, D, dtype, units, tokens):
    """Every (token, K/V, batch) row placed by the documented rule fits its page, no two rows overlap, a token's
    rows never straddle pages, and the counts agree with the placement."""
    row_bytes = H * D * dtype.itemsize
    page = max(units * 256, -(-2 * B * row_bytes // 256) * 256)  # at least one whole token
    lay = DenseTokenLayout(B, H, D, dtype, page)
    assert lay.row_bytes == row_bytes and lay.itemsize == dtype.itemsize
    tpp = lay.tokens_per_page
    assert tpp == max(k for k in range(page + 1) if k * 2 * B * row_bytes <= page)
    assert lay.rows_per_page == 2 * B * tpp
    used: dict[int, set[int]] = {}
    for t in range(tokens):
        page_of_token = set()
        for kv in range(2):
            for b in range(B):
                p, slot = t // tpp, kv * tpp * B + (t % tpp) * B + b
                assert 0 <= slot < lay.rows_per_page and (slot + 1) * row_bytes <= page
                assert slot not in used.setdefault(p, set()), (t, kv, b)
                used[p].add(slot)
                page_of_token.add(p)
        assert len(page_of_token) == 1
    assert lay.pages_for_tokens(tokens) == len(used)
    assert lay.rows_for_tokens(tokens) == sum(len(s) for s in used.values()) == 2 * B * tokens
    assert lay.used_bytes_for_tokens(tokens) == 2 * B * tokens * row_bytes


def test_dense_layout_too_small_a_page_holds_no_token():
    lay = DenseTokenLayout(2, 4, 64, torch.bfloat16, 2048)  # a token: 2 x 2 rows of 512 B = 2 KiB
    assert lay.tokens_per_page == 1
    assert DenseTokenLayout(2, 4, 64, torch.float32, 2048).tokens_per_page == 0


# ------------------------------------------------------------------------------------------------ packed segments
QUANTS = [
    QuantConfig(bits=2, centroids=4, block_size=8),
    QuantConfig(bits=4, centroids=3, block_size=4, stages=2, asymmetric=True),
    QuantConfig.compact(centroids=5, block_size=8),
]


@pytest.mark.parametrize("cfg", QUANTS, ids=["int2", "int4-asym-2st", "compact"])
@pytest.mark.parametrize("B", [1, 2])
def test_packed_layout_against_the_format_and_a_placement(cfg, B):
    H, D, page = 3, 16, 1024
    fmt = PackedFormat(D, H, cfg, torch.bfloat16)
    lay = PackedSegmentLayout.from_format(B, fmt, page)
    assert (lay.token_row_bytes, lay.codebook_row_bytes, lay.codebook_rows) == (
        fmt.token_row_bytes, fmt.codebook_row_bytes, H * cfg.stages)  # fmt: skip
    tpp = lay.tokens_per_page
    assert tpp == max(k for k in range(page + 1) if k * 2 * B * fmt.token_row_bytes <= page)
    for n in (0, 1, tpp, tpp + 1, 5 * tpp + 3):
        assert lay.token_pages(n) == greedy_pages(2 * B * fmt.token_row_bytes, n, page)
        assert lay.codebook_pages() == greedy_pages(fmt.codebook_row_bytes, 2 * B * H * cfg.stages, page)
        assert lay.pages_for_tokens(n) == lay.token_pages(n) + lay.codebook_pages()
        # one batch element: the bytes of K and V, each one `segment_bytes` of the format
        if B == 1:
            assert lay.used_bytes_for_tokens(n) == 2 * fmt.segment_bytes(n)
        cb_bytes = H * cfg.stages * fmt.codebook_row_bytes
        assert lay.used_bytes_for_tokens(n) == 2 * B * (n * fmt.token_row_bytes + cb_bytes)
    assert lay.codebook_region == RowRegion(fmt.codebook_row_bytes, page)


def test_packed_layout_codebook_row_larger_than_a_page():
    fmt = PackedFormat(128, 1, QuantConfig(bits=2), torch.bfloat16)  # 128 centroids x 128 x 2 B = 32 KiB rows
    lay = PackedSegmentLayout.from_format(1, fmt, 16384)
    with pytest.raises(ValueError, match=r"one row of 32768 B does not fit a page of 16384 B; use page_bytes >= 32768"):
        lay.codebook_region  # noqa: B018


# ------------------------------------------------------------------------------------------------ page pieces
@settings(max_examples=200, deadline=None)
@given(tpp=st.integers(1, 7), n_pages=st.integers(1, 6), data=st.data())
def test_page_pieces_against_token_by_token(tpp, n_pages, data):
    pages = data.draw(st.permutations(range(100, 100 + n_pages)), label="pages")
    t0 = data.draw(st.integers(0, tpp * n_pages), label="t0")
    t1 = data.draw(st.integers(t0, tpp * n_pages), label="t1")
    got = page_pieces(pages, tpp, t0, t1)
    per_token = [(pages[t // tpp], t % tpp) for t in range(t0, t1)]
    assert [(p, s) for p, a, b in got for s in range(a, b)] == per_token
    assert all(b > a for _, a, b in got)
    assert len({p for p, _, _ in got}) == len(got)  # one piece per page touched
    assert len(got) == len({t // tpp for t in range(t0, t1)})


# ------------------------------------------------------------------------------------------------ segment kinds
@settings(max_examples=100, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 4), dtype=st.sampled_from(DTYPES), chunk=st.integers(1, 300),
       cfg=st.sampled_from(QUANTS), page=st.integers(1, 64).map(lambda u: u * 256))  # fmt: skip
def test_segment_kinds_count_the_pages_the_layouts_allocate(B, H, dtype, chunk, cfg, page):
    D = 16
    fmt = PackedFormat(D, H, cfg, dtype)
    dense, packed = segment_kinds(B, H, D, dtype.itemsize, chunk, fmt)
    assert (dense.name, packed.name) == ("bf16", "packed")  # "bf16" for every dtype: a pagedqvg.plan/2 JSON key
    assert segment_kinds(B, H, D, dtype.itemsize, chunk) == (dense,)
    dl = DenseTokenLayout(B, H, D, dtype, page)
    assert dense.used_bytes == dl.used_bytes_for_tokens(chunk)
    assert dense.pages(page) == (dl.pages_for_tokens(chunk) if dl.tokens_per_page else 0)
    pl = PackedSegmentLayout.from_format(B, fmt, page)
    assert packed.used_bytes == pl.used_bytes_for_tokens(chunk)
    fits = pl.tokens_per_page > 0 and fmt.codebook_row_bytes <= page
    assert packed.pages(page) == (pl.pages_for_tokens(chunk) if fits else 0)
    for kind in (dense, packed):
        pages = kind.pages(page)
        want = 1.0 if pages == 0 else 1.0 - kind.used_bytes / (pages * page)
        assert kind.waste(page) == pytest.approx(want, abs=0) and 0.0 <= kind.waste(page) <= 1.0


# ------------------------------------------------------------------------------------------------ page size
def exhaustive_choice(kinds, target, max_page):
    """The documented rule by exhaustive search over every multiple of 256 B."""
    lo = max(256, -(-max(r for k in kinds for r, _ in k.regions) // 256) * 256)
    hi = max(lo, max_page // 256 * 256)
    cands = range(lo, hi + 1, 256)
    meeting = [p for p in cands if max(k.waste(p) for k in kinds) <= target]
    if meeting:
        return max(meeting)
    used = sum(k.used_bytes for k in kinds)
    pooled = {p: 1.0 - used / (p * sum(k.pages(p) for k in kinds)) for p in cands}
    best = min(pooled.values())
    return max(p for p in cands if pooled[p] == best)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 8), chunk=st.integers(1, 2000), quant=st.booleans(),
       target=st.sampled_from([0.0, 0.001, AUTO_PAGE_WASTE, 0.05]), max_units=st.integers(1, 200))  # fmt: skip
def test_choose_page_bytes_is_the_exhaustive_choice(B, H, chunk, quant, target, max_units):
    fmt = PackedFormat(32, H, QUANTS[0], torch.bfloat16) if quant else None
    kinds = segment_kinds(B, H, 32, 2, chunk, fmt)
    got = choose_page_bytes(kinds, target=target, max_page_bytes=max_units * 256)
    assert got.page_bytes == exhaustive_choice(kinds, target, max_units * 256)
    assert got.waste == tuple((k.name, k.waste(got.page_bytes)) for k in kinds)
    assert got.met == (got.worst <= target) and got.worst == max(w for _, w in got.waste) and got.target == target


def test_choose_page_bytes_defaults_on_a_lingbot_like_layer():
    """8 heads x 128, bf16, 4,680-token chunks, int2: the defaults pick a page within the 4 MiB cap that meets the
    0.5% target for both kinds."""
    fmt = PackedFormat(128, 8, QuantConfig(bits=2), torch.bfloat16)
    kinds = segment_kinds(1, 8, 128, 2, 4680, fmt)
    got = choose_page_bytes(kinds)
    assert got.met and got.target == AUTO_PAGE_WASTE and got.page_bytes <= AUTO_PAGE_MAX_BYTES
    assert got.page_bytes % 256 == 0
    assert all(k.waste(got.page_bytes) <= AUTO_PAGE_WASTE for k in kinds)


def test_segment_shape_that_does_not_fit():
    s = SegmentShape("x", ((1000, 3),))
    assert s.pages(768) == 0 and s.waste(768) == 1.0
    assert s.pages(1024) == 3 and s.waste(1024) == pytest.approx(1 - 3000 / 3072)
    assert s.pages(2048) == 2 and s.used_bytes == 3000
