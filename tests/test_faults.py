"""Faults outside packing: a call that raises has not happened.

Random programs (tests/test_threads.py's generator: advances, rewrites of current and older tokens, pins, rewinds,
resets, head slices, recent windows) run on a cache whose page writes, view builds, packed dequantization or pool
allocations fail at random (RuntimeError "illegal memory access", torch.OutOfMemoryError, MemoryError), beside a
twin on its own pool that sees only the calls that succeeded. After every failed call the faulted cache holds
exactly what the twin holds: cursors, pin, segments (ranges, page counts, kinds) and every slot's value (all heads,
`_read_slots`), its pages are exactly those its segments list, and `pool.check()` passes. The one documented
exception: a failed in-place rewrite that changes no structure (no new tokens, no packed chunk to unpack) may leave
each targeted row old or new (the write went part of the way); the test checks exactly that, then retries the call
(as a caller would) so both caches hold the new rows. Every successful call's view equals the twin's bit for bit.
Counts per site are printed.

The CPU runs the torch references of the kernels (the Triton launches of the same sites are CUDA-only); faults in
the pack policy itself (quantization after the write) are not injected here: the call completes with a
PackingFailedWarning and the chunk stays bf16 by design (tests/test_cache_fuzz_quant.py covers them).
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
import torch
from helpers import page_io as cache_page_io
from helpers import read_slots, segment_index
from test_threads import CACHES_PER_THREAD, PAGE_BYTES, kv, make_caches, random_program, run_call

import pagedqvg.store.packed_store as packing
import pagedqvg.store.page_io as page_io
from pagedqvg import BlockPool
from pagedqvg.allocator.pool import debug_state

LONG = os.environ.get("PAGEDQVG_FAULTS_PROFILE", "short") == "long"
PROGRAMS = 200 if LONG else 12
SITES = ("page_write", "view_build", "view_runs", "packed_dequant", "alloc")
FAULTS = (
    lambda site: RuntimeError(f"CUDA error: an illegal memory access was encountered (injected in {site})"),
    lambda site: torch.OutOfMemoryError(f"injected out of memory in {site}"),
    lambda site: MemoryError(f"injected in {site}"),
)
COUNTS: Counter[str] = Counter()


class Injector:
    """Raises at a site with probability `p` while `armed` (only the faulted cache's calls); packed dequantization
    (only a rewrite of a packed chunk unpacks) fails with probability 0.5 so that it fires in the short profile."""

    def __init__(self, rng: random.Random, p: float) -> None:
        self.rng, self.p, self.armed = rng, p, False

    def wrap(self, site: str, fn, p: float | None = None):
        p = self.p if p is None else p

        def faulty(*args, **kwargs):
            if self.armed and self.rng.random() < p:
                COUNTS[f"faults at {site}"] += 1
                raise self.rng.choice(FAULTS)(site)
            return fn(*args, **kwargs)

        return faulty


def state(cache) -> tuple:
    segs = [(e.start, e.end, len(e.value.pages), str(e.value.kind)) for e in segment_index(cache)]
    return (cache.global_end_index_int, cache.local_end_index_int, cache.pinned_range, segs)


def rows(cache) -> torch.Tensor:
    return read_slots(cache, "check")


def check_pages(cache, pool: BlockPool) -> None:
    listed = [p for e in segment_index(cache) for p in e.value.pages]
    assert len(set(listed)) == len(listed)
    owners = debug_state(pool)[1]
    assert all(owners[p] == cache.owner for p in listed), "a segment lists a page its cache does not own"
    assert pool.pages_of(cache.owner) == len(listed), "pages leaked (owned, listed by no segment)"
    pool.check()


def targets(cache, op: tuple) -> tuple[int, int] | None:
    """`(start, n)` of a rewrite op that reaches tokens already written (None for other ops)."""
    if op[0] != "rw":
        return None
    G = cache.global_end_index_int
    s = max(0, G - op[2])
    return (s, op[3]) if s < G else None


def old_or_new(cache, before: torch.Tensor, after: torch.Tensor, span: tuple[int, int], seed: int) -> None:
    """Every slot equals its value before the failed call, except slots holding a targeted token, which hold the
    old row or the call's new row (per slot)."""
    s, n = span
    k, v = kv(seed, n, cache.num_cache_heads)
    new = torch.stack([k, v])  # [2, B, n, H, D]
    assert before.shape == after.shape
    for j, g in enumerate(_slot_globals(cache)):
        a = after[:, :, j]
        ok = torch.equal(a, before[:, :, j]) or (s <= g < s + n and torch.equal(a, new[:, :, g - s]))
        assert ok, f"slot {j} (token {g}) changed by a failed call that targeted tokens [{s}, {s + n})"


def run_faulted_program(seed: int, quant: bool, inject: Injector) -> None:
    ops = random_program(seed, quant)
    pool_a = BlockPool(capacity_bytes=400 * PAGE_BYTES, page_bytes=PAGE_BYTES)
    pool_b = BlockPool(capacity_bytes=400 * PAGE_BYTES, page_bytes=PAGE_BYTES)
    pool_a.alloc = inject.wrap("alloc", pool_a.alloc)
    a, b = make_caches(pool_a, quant, "faulted"), make_caches(pool_b, quant, "twin")
    for i, op in enumerate(ops):
        ca, cb = a[op[1]], b[op[1]]
        before, rows_before = state(ca), rows(ca)
        call_seed = seed * 100_003 + i
        inject.armed = True
        try:
            got = run_call(ca, op, call_seed)
        except Exception as exc:
            got = ("err", type(exc).__name__)
            injected = "injected" in str(exc)
        finally:
            inject.armed = False
        COUNTS["calls"] += 1
        if got[0] == "err" and injected:
            COUNTS["failed calls"] += 1
            check_pages(ca, pool_a)
            assert state(ca) == before, f"call {i} {op}: failed but its structure changed"
            span = targets(ca, op)
            if span is not None:  # targeted rows may hold old or new values: retry (as a caller would)
                old_or_new(ca, rows_before, rows(ca), span, call_seed)
                run_call(ca, op, call_seed)
                run_call(cb, op, call_seed)
                COUNTS["failed rewrites retried"] += 1
            else:
                assert torch.equal(rows(ca), rows_before), f"call {i} {op}: failed but changed rows"
            assert torch.equal(rows(ca), rows(cb)), f"call {i} {op}: rows differ from the twin after the failure"
            continue
        try:
            want = run_call(cb, op, call_seed)
        except Exception as exc:  # a bad call of the random program: both must refuse it alike
            want = ("err", type(exc).__name__)
        assert _same(got, want), f"call {i} {op}: {got[:1]} vs twin {want[:1]}"
        assert state(ca) == state(cb)
        check_pages(ca, pool_a)
    for x in a + b:
        x.close()
    assert pool_a.stats().used_pages == 0 and pool_b.stats().used_pages == 0


def _slot_globals(cache) -> list[int]:
    """The global token of every filled slot, in slot order."""
    return [g for g0, g1 in cache.retained_token_ranges() for g in range(g0, g1)]


def _same(a: tuple, b: tuple) -> bool:
    if a[0] != b[0] or len(a) != len(b):
        return False
    if a[0] == "err" or len(a) == 1:
        return a == b
    return torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3] == b[3]


@pytest.mark.parametrize("quant", [False, True], ids=["quant_off", "quant_on"])
def test_a_call_that_raises_has_not_happened(quant, monkeypatch):
    COUNTS.clear()
    inject = Injector(random.Random(11), p=0.08)
    monkeypatch.setattr(page_io, "page_write", inject.wrap("page_write", page_io.page_write))
    monkeypatch.setattr(page_io, "view_build", inject.wrap("view_build", page_io.view_build))
    monkeypatch.setattr(page_io, "view_runs", inject.wrap("view_runs", page_io.view_runs))
    monkeypatch.setattr(packing, "packed_dequant", inject.wrap("packed_dequant", packing.packed_dequant, 0.5))
    for seed in range(PROGRAMS if not quant else max(2, PROGRAMS // 3)):
        run_faulted_program(seed, quant, inject)
    print(f"\nfaults ({'quant on' if quant else 'quant off'}): {CACHES_PER_THREAD} caches/program: {dict(COUNTS)}")
    assert COUNTS["failed calls"] > 0
    sites = [s for s in SITES if s != "packed_dequant" or quant]
    assert all(COUNTS[f"faults at {s}"] > 0 for s in sites if s != "view_runs"), COUNTS  # view_runs: packed views



def test_a_rolled_back_call_keeps_the_segment_objects(monkeypatch):
    """A failed advance restores the very `Segment` objects the cache held before it (with their fields), not
    copies: anything that follows a segment by identity (plans kept per segment, the quantized fuzz machine's
    record of packed chunks) sees no change."""
    pool = BlockPool(capacity_bytes=64 * PAGE_BYTES, page_bytes=PAGE_BYTES, device="cpu")
    cache = make_caches(pool, False, "ident")[0]
    for chunk in range(2):
        k, v = kv(chunk, 4, cache.num_cache_heads)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4 * chunk)
    before = [(e.start, e.end, e.value, list(e.value.pages), e.value.kind) for e in segment_index(cache)]

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(cache_page_io(cache), "write", fail)
    k, v = kv(2, 4, cache.num_cache_heads)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=8)
    after = [(e.start, e.end, e.value, list(e.value.pages), e.value.kind) for e in segment_index(cache)]
    assert [x[:2] + x[3:] for x in after] == [x[:2] + x[3:] for x in before]
    assert all(a[2] is b[2] for a, b in zip(after, before, strict=True))
    pool.check()
