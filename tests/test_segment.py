"""pagedqvg/store/segment.py: a stored chunk (`Segment`) and its kind (`SegmentKind`, a StrEnum equal to its values)."""

from __future__ import annotations

import pytest
import torch
from helpers import segment_entries

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.store.segment import Segment, SegmentKind


def test_kinds_equal_their_strings():
    assert [k.value for k in SegmentKind] == ["dense", "packed"]
    assert SegmentKind.PACKED == "packed" and SegmentKind.DENSE == "dense"
    assert SegmentKind("packed") is SegmentKind.PACKED
    assert f"{SegmentKind.DENSE}" == "dense" and str(SegmentKind.PACKED) == "packed"  # as the view sources print
    with pytest.raises(ValueError):
        SegmentKind("bf16")  # dense segments are "dense" whatever the dtype


def test_segment_defaults_and_packed():
    s = Segment(pages=[3, 1])
    assert (s.kind, s.packed, s.n_token_pages, s.pack_failed, s.lossy, s.pages_t) == (
        SegmentKind.DENSE, False, 0, False, False, None)  # fmt: skip
    s.kind = SegmentKind.PACKED
    assert s.packed
    assert not hasattr(s, "__dict__")
    with pytest.raises(AttributeError):
        s.packd = True  # type: ignore[attr-defined]


def test_the_cache_stores_segment_records():
    """A quantized cache holds Segment records: packed ones with token pages first, dense ones with none."""
    q = QuantConfig(bits=2, centroids=2, block_size=8, keep_recent_chunks=0, sink=False)
    pool = BlockPool(128 * 1024, page_bytes=1024)
    cache = PagedCausalKVCache(pool=pool, batch_size=1, cache_size=8, num_heads=2, head_dim=8, dtype=torch.bfloat16,
                               device="cpu", quant=q)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for s in range(0, 6, 2):
        k, v = (torch.randn(1, 2, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2))
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    entries = segment_entries(cache)
    assert [(e.start, e.end) for e in entries] == [(0, 2), (2, 4), (4, 6)]
    assert all(type(e.value) is Segment and isinstance(e.value.kind, SegmentKind) for e in entries)
    assert [e.value.kind for e in entries] == ["packed", "packed", "dense"]  # the current chunk stays dense
    for e in entries[:2]:
        assert 0 < e.value.n_token_pages < len(e.value.pages)  # token pages, then codebook pages
    assert entries[2].value.n_token_pages == 0
    owned = sorted(p for e in entries for p in e.value.pages)
    assert len(set(owned)) == len(owned) == pool.pages_of(cache.owner)
