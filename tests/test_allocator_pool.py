"""BlockPool on tiny pools: exact page ids, counts and stats; a Hypothesis state machine over alloc/free."""

from __future__ import annotations

import pydoc

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedqvg import BlockPool, PageOwnershipError, PoolExhaustedError
from pagedqvg.allocator import PAGE_ALIGN_BYTES, available_memory_bytes
from pagedqvg.allocator.pool import debug_state, set_used_bytes


def test_fresh_pool_hands_out_lowest_ids_first_and_reuses_lifo():
    pool = BlockPool(capacity_bytes=4 * 256 + 100, page_bytes=256)
    assert pool.num_pages == 4
    assert pool.arena.numel() == 4 * 256
    assert pool.arena.data_ptr() % PAGE_ALIGN_BYTES == 0
    assert pool.alloc(2, "a") == [0, 1]
    assert pool.alloc(1, "b") == [2]
    pool.free([0, 1], "a")
    assert pool.alloc(2, "c") == [0, 1]  # freed pages come back in the same order
    s = pool.stats()
    assert (s.total_pages, s.used_pages, s.free_pages, s.held_bytes) == (4, 3, 1, 3 * 256)
    assert s.owner_pages == (("b", 1), ("c", 2))
    assert s.high_water_pages == 3
    pool.check()


def test_help_documents_the_constructor_and_hides_the_internal_interface():
    text = pydoc.render_doc(BlockPool, renderer=pydoc.plaintext)
    for needle in ("capacity_bytes:", "page_bytes:", "device:", "multiple of 256", "pages"):
        assert needle in text
    for internal in ("debug_state", "set_used_bytes", "exhausted_error"):
        assert internal not in text and not hasattr(BlockPool, internal)


def test_alloc_zero_and_all_or_nothing():
    pool = BlockPool(capacity_bytes=3 * 512, page_bytes=512)
    assert pool.alloc(0, "a") == []
    pool.alloc(2, "a")
    before = (pool.stats(), debug_state(pool))
    with pytest.raises(PoolExhaustedError) as err:
        pool.alloc(2, "b")
    msg = str(err.value)
    assert "asked for 2 pages" in msg and "only 1 of 3 pages are free" in msg and "a#" not in msg
    assert "a: 2 pages" in msg and "512 B" in msg
    assert isinstance(err.value, MemoryError)
    assert (pool.stats(), debug_state(pool)) == before


def test_used_bytes_and_waste():
    pool = BlockPool(capacity_bytes=4 * 256, page_bytes=256)
    pool.alloc(3, "a")
    set_used_bytes(pool, "a", 600)
    s = pool.stats()
    assert (s.held_bytes, s.used_bytes, s.waste_bytes) == (768, 600, 168)
    pool.free([0, 1, 2], "a")
    s = pool.stats()
    assert (s.held_bytes, s.used_bytes, s.waste_bytes, s.high_water_pages) == (0, 0, 0, 3)
    assert s.high_water_bytes == 768
    pool.check()


def test_reset_high_water_starts_a_new_peak_at_the_pages_held_now():
    pool = BlockPool(capacity_bytes=4 * 256, page_bytes=256)
    pages = pool.alloc(3, "a")
    pool.free(pages[1:], "a")
    assert pool.stats().high_water_pages == 3
    pool.reset_high_water()
    assert pool.stats().high_water_pages == 1
    pool.free(pool.alloc(2, "b"), "b")
    assert pool.stats().high_water_pages == 3


@pytest.mark.parametrize(
    ("pages", "owner", "needle"),
    [
        ([1], "a", "already free"),
        ([0], "b", "belongs to a"),
        ([0, 0], "a", "listed twice"),
        ([9], "a", "does not exist"),
        ([-1], "a", "does not exist"),
    ],
)
def test_bad_free_changes_nothing(pages, owner, needle):
    pool = BlockPool(capacity_bytes=4 * 256, page_bytes=256)
    pool.alloc(1, "a")
    before = (pool.stats(), debug_state(pool))
    with pytest.raises(PageOwnershipError, match=needle):
        pool.free(pages, owner)
    assert (pool.stats(), debug_state(pool)) == before
    pool.check()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"capacity_bytes": 0, "page_bytes": 256}, "capacity_bytes must be > 0, got 0"),
        ({"capacity_bytes": -5, "page_bytes": 256}, "got -5"),
        ({"capacity_bytes": 1024, "page_bytes": 0}, "page_bytes must be > 0"),
        ({"capacity_bytes": 1024, "page_bytes": 300}, "multiple of 256 .*got 300; nearest valid: 256"),
        ({"capacity_bytes": 1024, "page_bytes": True}, r"page_bytes must be an int, got True \(bool\)"),
        ({"capacity_bytes": 100, "page_bytes": 256}, "below one page"),
        ({"capacity_bytes": 1024.0, "page_bytes": 256}, "must be an int"),
        ({"capacity_bytes": 1024, "page_bytes": 256, "device": "tpu"}, "device"),
        ({"capacity_bytes": 1024, "page_bytes": 256, "device": "nonsense"}, "unknown device"),
    ],
)
def test_bad_constructor_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        BlockPool(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        BlockPool(capacity_bytes=1024, page_bytes=256, device="cuda")


def test_bad_alloc_arguments():
    pool = BlockPool(capacity_bytes=1024, page_bytes=256)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        pool.alloc(-1, "a")
    with pytest.raises(ValueError, match=r"alloc: n must be an int >= 0, got 1\.0"):
        pool.alloc(1.0, "a")
    with pytest.raises(ValueError, match="owner must be a non-empty str"):
        pool.alloc(1, "")


def test_pages_as_typed_views_share_the_arena():
    pool = BlockPool(capacity_bytes=2 * 256, page_bytes=256)
    bf = pool.pages_as(torch.bfloat16)
    assert bf.shape == (2, 128) and bf.dtype == torch.bfloat16
    f32 = pool.pages_as(torch.float32)
    assert f32.shape == (2, 64)
    f32[1, 0] = 1.0
    assert pool.arena[256:260].view(torch.float32).item() == 1.0
    assert pool.pages_as(torch.float32) is f32  # cached


def test_from_free_memory_fraction():
    pool = BlockPool.from_free_memory(1e-6, page_bytes=256)
    expected = int(available_memory_bytes("cpu") * 1e-6) // 256
    assert abs(pool.num_pages - expected) <= 2  # free memory moves a little between the two reads
    for bad in (0, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="fraction must be"):
            BlockPool.from_free_memory(bad)


def test_for_layers_picks_pages_for_the_segment_kinds():
    """`BlockPool.for_layers`: the page size `pagedqvg plan` picks (auto), holding whole tokens and codebook rows."""
    from pagedqvg import QuantConfig
    from pagedqvg.layout.segments import AUTO_PAGE_WASTE, choose_page_bytes, segment_kinds
    from pagedqvg.quant.format import PackedFormat

    pool = BlockPool.for_layers(64 << 20, num_heads=8, head_dim=64, chunk_tokens=1000)
    token = 2 * 8 * 64 * 2
    assert pool.page_bytes % PAGE_ALIGN_BYTES == 0 and pool.page_bytes >= token
    pages = -(-1000 // (pool.page_bytes // token))
    assert 1 - 1000 * token / (pages * pool.page_bytes) <= AUTO_PAGE_WASTE
    q = QuantConfig(bits=4)
    packed = BlockPool.for_layers(64 << 20, num_heads=8, head_dim=64, chunk_tokens=1000, quant=q)
    kinds = segment_kinds(1, 8, 64, 2, 1000, PackedFormat(64, 8, q))
    assert packed.page_bytes == choose_page_bytes(kinds).page_bytes
    assert packed.page_bytes >= q.centroids * 64 * 2  # a codebook row fits


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_heads": 0}, "num_heads"),
        ({"chunk_tokens": -1}, "chunk_tokens"),
        ({"page_bytes": "2MiB"}, "'auto' or an int"),
        ({"page_bytes": 1000}, "multiple of 256"),
    ],
)
def test_for_layers_bad_arguments(kwargs, needle):
    args = {"num_heads": 2, "head_dim": 16, "chunk_tokens": 8} | kwargs
    with pytest.raises(ValueError, match=needle):
        BlockPool.for_layers(1 << 20, **args)


def test_view_buffer_is_reused_and_grows():
    pool = BlockPool(capacity_bytes=1024, page_bytes=256)
    a = pool.view_buffer(10, torch.float32)
    b = pool.view_buffer(5, torch.bfloat16)
    assert a.data_ptr() == b.data_ptr()
    c = pool.view_buffer(10_000, torch.float32)
    assert c.numel() == 10_000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (streams)")
def test_view_buffer_is_recorded_on_every_stream_that_uses_it(monkeypatch):
    """On CUDA the scratch buffer is `record_stream`-ed once per (buffer, stream) that asks for it, so growing it
    never frees memory a kernel on another stream may still read."""
    recorded = []
    real = torch.Tensor.record_stream
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: (recorded.append((t.data_ptr(), s)), real(t, s)))
    pool = BlockPool(capacity_bytes=1 << 20, page_bytes=1 << 16, device="cuda")
    a = pool.view_buffer(10, torch.float32)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        pool.view_buffer(10, torch.float32)
        pool.view_buffer(10, torch.float32)
    assert [s for _, s in recorded] == [torch.cuda.current_stream(), side]
    assert all(p == a.data_ptr() for p, _ in recorded)


class PoolMachine(RuleBasedStateMachine):
    """Random alloc/free/double-free/foreign-free/over-budget with several owners; a model tracks ownership."""

    OWNERS = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(capacity_bytes=12 * 256, page_bytes=256)
        self.held: dict[str, list[int]] = {o: [] for o in self.OWNERS}
        self.high = 0

    def _snapshot(self):
        return self.pool.stats(), debug_state(self.pool)

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 14))
    def alloc(self, owner, n):
        free = self.pool.num_free_pages
        before = self._snapshot()
        if n > free:
            with pytest.raises(PoolExhaustedError):
                self.pool.alloc(n, owner)
            assert self._snapshot() == before
            return
        pages = self.pool.alloc(n, owner)
        assert len(pages) == len(set(pages)) == n
        for o in self.OWNERS:
            assert not set(pages) & set(self.held[o])
        self.held[owner].extend(pages)
        self.high = max(self.high, sum(len(v) for v in self.held.values()))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free_some(self, data):
        owner = data.draw(st.sampled_from([o for o in self.OWNERS if self.held[o]]))
        pages = data.draw(st.lists(st.sampled_from(self.held[owner]), unique=True, min_size=1))
        set_used_bytes(self.pool, owner, 0)  # an owner lowers its reported use before it gives pages back
        self.pool.free(pages, owner)
        self.held[owner] = [p for p in self.held[owner] if p not in pages]

    @rule(data=st.data())
    def bad_free(self, data):
        all_held = {p: o for o, ps in self.held.items() for p in ps}
        page = data.draw(st.integers(0, self.pool.num_pages - 1))
        owner = data.draw(st.sampled_from(self.OWNERS))
        # a duplicate in one call when the owner holds the page; otherwise a double free or a foreign free
        pages = [page, page] if all_held.get(page) == owner else [page]
        before = self._snapshot()
        with pytest.raises(PageOwnershipError):
            self.pool.free(pages, owner)
        assert self._snapshot() == before

    @rule(owner=st.sampled_from(OWNERS), used=st.integers(0, 4096))
    def report_used(self, owner, used):
        set_used_bytes(self.pool, owner, min(used, len(self.held[owner]) * 256))

    @invariant()
    def consistent(self):
        self.pool.check()
        s = self.pool.stats()
        assert s.used_pages == sum(len(v) for v in self.held.values())
        assert dict(s.owner_pages) == {o: len(v) for o, v in self.held.items() if v}
        assert s.high_water_pages == self.high
        assert s.waste_bytes == s.held_bytes - s.used_bytes >= 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_used_bytes_must_fit_the_owners_pages_and_shrink_with_a_partial_free():
    pool = BlockPool(capacity_bytes=4 * 256, page_bytes=256)
    pool.alloc(2, "a")
    with pytest.raises(ValueError, match="reports 600 B used but holds 512 B"):
        set_used_bytes(pool, "a", 600)
    with pytest.raises(ValueError, match="int >= 0"):
        set_used_bytes(pool, "a", 1.5)
    set_used_bytes(pool, "a", 500)
    pool.free([1], "a")
    assert pool.stats().used_bytes == 256 and pool.stats().waste_bytes == 0
    assert pool.release_owner("a") == 1 and pool.stats().used_pages == 0
    pool.check()
