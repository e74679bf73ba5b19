"""pagedqvg/view.py: the view record a cache call returns.

The cache builds it positionally (`view_cls(k, v, ls, le, L, G)`) and the SGLang integration substitutes SGLang's
own CausalAttentionKVView, so the field names AND their order are the contract (docs/SEMANTICS.md, "Return").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dense_reference import DenseReferenceCache, RefView

from pagedqvg import BlockPool, CausalAttentionKVView, PagedCausalKVCache

FIELDS = ("k", "v", "local_start_index", "local_end_index", "visible_local_end", "visible_global_end")


def test_fields_in_the_positional_order_sglang_uses():
    assert tuple(f.name for f in dataclasses.fields(CausalAttentionKVView)) == FIELDS
    k, v = torch.zeros(1, 2, 1, 4), torch.ones(1, 2, 1, 4)
    view = CausalAttentionKVView(k, v, 3, 5, 5, 9)
    assert view.k is k and view.v is v
    assert [getattr(view, f) for f in FIELDS[2:]] == [3, 5, 5, 9]


def test_slots_no_stray_attributes():
    view = CausalAttentionKVView(torch.zeros(1), torch.zeros(1), 0, 0, 0, 0)
    assert not hasattr(view, "__dict__")
    with pytest.raises(AttributeError):
        view.local_end = 3  # type: ignore[attr-defined]  # a misspelt field must not pass silently


def test_the_reference_view_has_the_same_fields():
    assert tuple(f.name for f in dataclasses.fields(RefView)) == FIELDS


@pytest.mark.parametrize("head_start", [None, 1])
def test_a_cache_call_returns_it_with_the_reference_values(head_start):
    """C = 6, sink 2, window 4: after 4 chunks of 3 tokens (a roll), the view's indices are the reference's and
    k / v are `[B, tokens, Hin, D]` in the cache dtype."""
    B, H, D = 2, 3, 4
    hin = H if head_start is None else 1
    kw = dict(batch_size=B, cache_size=6, num_heads=H, head_dim=D, sink_tokens=2, attention_window_size=4)
    cache = PagedCausalKVCache(pool=BlockPool(64 * 1024, page_bytes=1024), dtype=torch.bfloat16, device="cpu", **kw)
    ref = DenseReferenceCache(dtype=torch.bfloat16, **kw)
    g = torch.Generator().manual_seed(0)
    for s in range(0, 12, 3):
        k, v = (torch.randn(B, 3, hin, D, generator=g).to(torch.bfloat16) for _ in range(2))
        args = dict(key=k, value=v, current_chunk_start=s, cache_head_start=head_start)
        got, want = cache.update_and_get_attention_kv(**args), ref.update_and_get_attention_kv(**args)
        assert type(got) is CausalAttentionKVView
        assert [getattr(got, f) for f in FIELDS[2:]] == [getattr(want, f) for f in FIELDS[2:]]
        assert got.k.dtype == got.v.dtype == torch.bfloat16
        assert got.k.shape == got.v.shape == want.k.shape and got.k.shape[::2] == (B, hin)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert got.visible_global_end == 12 and got.visible_local_end == 6
