"""pagedqvg/errors.py: the typed errors, each also the builtin its callers already catch, exported at the top level;
and the package raising them where documented (each raise leaves cache and pool unchanged: tests/test_cache_errors.py
and tests/test_allocator_pool.py check that by snapshot)."""

from __future__ import annotations

import warnings

import pytest
import torch

import pagedqvg
from pagedqvg import BlockPool, PagedCausalKVCache, make_layer_caches
from pagedqvg import errors as E

#: error -> the builtin it also is (what code written against SGLang's cache or plain Python catches)
BUILTIN = {
    E.PoolExhaustedError: MemoryError,
    E.SessionRefusedError: MemoryError,  # a PoolExhaustedError: SessionManager refused a session
    E.PageOwnershipError: ValueError,
    E.PoolInvariantError: AssertionError,
    E.SequencingError: NotImplementedError,
    E.CacheConfigError: ValueError,
    E.CacheClosedError: RuntimeError,
    E.IntegrationError: RuntimeError,
}


def test_every_error_is_a_pagedqvg_error_and_its_builtin():
    defined = {v for v in vars(E).values() if isinstance(v, type) and issubclass(v, Exception)}
    assert defined == {E.PagedQVGError, E.PackingFailedWarning, *BUILTIN}
    for err, builtin in BUILTIN.items():
        assert issubclass(err, E.PagedQVGError) and issubclass(err, builtin), err
    assert issubclass(E.PackingFailedWarning, RuntimeWarning)
    assert not issubclass(E.PackingFailedWarning, E.PagedQVGError)  # a warning, never raised


def test_sequencing_error_is_not_implemented_error():
    assert issubclass(E.SequencingError, NotImplementedError)
    assert issubclass(E.CacheConfigError, ValueError)
    assert issubclass(E.PoolExhaustedError, MemoryError)


def test_exported_at_the_top_level():
    for err in (E.PagedQVGError, E.PackingFailedWarning, *BUILTIN):
        assert getattr(pagedqvg, err.__name__) is err
        assert err.__name__ in pagedqvg.__all__


def cache(pool: BlockPool, **kw) -> PagedCausalKVCache:
    return PagedCausalKVCache(pool=pool, batch_size=1, cache_size=8, num_heads=2, head_dim=8, dtype=torch.float32,
                              device="cpu", **kw)  # fmt: skip


def kv(n: int) -> dict:
    return dict(key=torch.zeros(1, n, 2, 8), value=torch.zeros(1, n, 2, 8))


def test_raised_where_documented_and_caught_as_the_builtin():
    pool = BlockPool(8 * 1024, page_bytes=1024)
    c = cache(pool)
    c.update_and_get_attention_kv(**kv(2), current_chunk_start=0)
    with pytest.raises(NotImplementedError) as gap:  # a gap after the global end
        c.update_and_get_attention_kv(**kv(2), current_chunk_start=5)
    assert type(gap.value) is E.SequencingError
    with pytest.raises(ValueError) as bad:
        make_layer_caches(0, pool=pool)
    assert type(bad.value) is E.CacheConfigError
    with pytest.raises(MemoryError) as full:
        pool.alloc(pool.num_free_pages + 1, pool.new_owner("greedy"))
    assert type(full.value) is E.PoolExhaustedError
    with pytest.raises(ValueError) as owner:
        pool.free([0], pool.new_owner("not the owner"))
    assert type(owner.value) is E.PageOwnershipError
    c.close()
    with pytest.raises(RuntimeError) as closed:
        c.update_and_get_attention_kv(**kv(2), current_chunk_start=2)
    assert type(closed.value) is E.CacheClosedError


def test_the_packing_warning_is_a_warning_category():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("x", E.PackingFailedWarning, stacklevel=1)
    assert [w.category for w in seen] == [E.PackingFailedWarning]
