"""Helpers shared by the test files (the one helper module; `dense_reference.py` is the oracle, kept apart).

- Drawn cache configurations: `cache_kwargs`, `make_kv`, `head_args`, the strategies `recent` / `seeds`, the exact
  dense page model (`tokens_per_page`, `pages_for`, `SegmentModel`) and error-kind matching (`same_error_kind`).
- Snapshots for "a bad call changes nothing": `cache_state`, `same`.
- The cache's internals, reached ONLY through the small functions below (`segment_entries`, `segment_at`,
  `segment_kind`, `cursor`, `packed_store`, `wrap_pressure_plan`, `sink_segment_starts`): when the cache's private
  state moves, these are the one place the tests adapt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from hypothesis import note as _hnote
from hypothesis import strategies as st

from pagedqvg import CacheConfigError, PagedCausalKVCache, SequencingError


# ------------------------------------------------------------------------------------------------ drawn configs
def note(msg: str) -> None:
    """hypothesis.note inside a test run; ignored in the deterministic replays."""
    with contextlib.suppress(Exception):  # outside of a Hypothesis test
        _hnote(msg)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def make_kv(cfg: dict, n: int, hin: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key and value `[B, n, hin, D]` of the config's dtype, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg["B"], n, hin, cfg["D"])
    k = torch.randn(shape, generator=g).to(cfg["dtype"])
    v = torch.randn(shape, generator=g).to(cfg["dtype"])
    return k, v


def error_kind(exc: BaseException | None) -> str | None:
    """"config" / "sequencing" / "value" / the type name: the kinds the cache and the reference must agree on."""
    if exc is None:
        return None
    if isinstance(exc, CacheConfigError):
        return "config"
    if isinstance(exc, SequencingError):
        return "sequencing"
    if isinstance(exc, ValueError):
        return "value"
    return type(exc).__name__


def same_error_kind(ref_exc: BaseException | None, got_exc: BaseException | None) -> bool:
    """The cache must raise what the reference raises: SequencingError / CacheConfigError exactly; for a plain
    ValueError of the reference any ValueError that is not one of the two specific kinds."""
    if got_exc is None:
        return False
    rk = error_kind(ref_exc)
    if rk == "value":
        return isinstance(got_exc, ValueError) and not isinstance(got_exc, (SequencingError, CacheConfigError))
    return rk == error_kind(got_exc)


def tokens_per_page(cfg: dict) -> int:
    """Whole tokens per page (pagedqvg/layout.py: a token's K and V rows of every batch element never straddle
    two pages): (page_bytes // row_bytes) // (2 * B), row_bytes = H * D * itemsize."""
    row_bytes = cfg["H"] * cfg["D"] * itemsize(cfg["dtype"])
    return (cfg["page_bytes"] // row_bytes) // (2 * cfg["B"])


def pages_for(cfg: dict, tokens: int) -> int:
    """Pages of one dense segment of `tokens` tokens."""
    return -(-tokens // tokens_per_page(cfg))


class SegmentModel:
    """Which segments (appended chunks) a layer must hold, derived from the reference only.

    One advance of `a` new tokens = one segment of ceil(a / tokens_per_page) pages. A segment is freed when none
    of its tokens is in slots [0, L). A rewind truncates the segment holding `pos` (its pages for the kept tokens
    remain) and drops every later one.
    """

    def __init__(self) -> None:
        self.segs: list[list[int]] = []  # [g0, g1) in order

    def clear(self) -> None:
        self.segs = []

    def advance(self, g0: int, g1: int) -> None:
        self.segs.append([g0, g1])

    def rewind(self, pos: int) -> None:
        kept = []
        for g0, g1 in self.segs:
            if g0 >= pos:
                continue
            kept.append([g0, min(g1, pos)])
        self.segs = kept

    def prune(self, ref: Any) -> None:
        live = set(ref.slot_global[: ref.L])
        self.segs = [s for s in self.segs if any(g in live for g in range(s[0], s[1]))]

    def pages(self, cfg: dict) -> int:
        return sum(pages_for(cfg, g1 - g0) for g0, g1 in self.segs)


def head_args(data: Any, H: int) -> tuple[int, int | None]:
    """(hin, cache_head_start) for one call: all heads (h0 None or 0) or a head slice."""
    if H == 1 or data.draw(st.booleans(), label="all_heads"):
        return H, data.draw(st.sampled_from([None, None, 0]), label="h0")
    hin = data.draw(st.integers(1, H - 1), label="hin")
    return hin, data.draw(st.integers(0, H - hin), label="h0")


recent = st.sampled_from([None, None, None, 0, 1, 2, 5, 100])
seeds = st.integers(0, 2**31 - 1)


def cache_kwargs(cfg: dict) -> dict:
    """The PagedCausalKVCache (and DenseReferenceCache) shape arguments of a drawn config."""
    return dict(
        batch_size=cfg["B"],
        cache_size=cfg["C"],
        num_heads=cfg["H"],
        head_dim=cfg["D"],
        sink_tokens=cfg["S"],
        attention_window_size=cfg["W"],
        global_sink_tokens=cfg["GS"],
        allow_growth=cfg["grow"],
    )


# ------------------------------------------------------------------------------------------------ snapshots
def cache_state(cache: PagedCausalKVCache) -> tuple:
    """Everything a bad call must leave unchanged: the cache's cursors, geometry, slot map, segments and bytes, and
    its pool's accounting and arena (compare two with `same`)."""
    pool = cache.pool
    G, L = cursor(cache)
    return (
        G,
        L,
        cache._C,
        cache._W,
        cache.pinned_range,
        cache._map,
        tuple(cache.segments()),
        cache.resident_nbytes(),
        cache.global_end_index.clone(),
        cache.local_end_index.clone(),
        cache.global_end_index_int,
        cache.local_end_index_int,
        pool.stats(),
        pool.debug_state(),
        pool.arena.clone(),
    )


def same(a: tuple, b: tuple) -> None:
    """Assert two snapshots are equal element by element (tensors with torch.equal)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


# ------------------------------------------------------------------------------------------------ cache internals
class SegmentEntry(NamedTuple):
    """One segment the cache holds: global tokens [start, end) and its Segment (`.kind`, `.packed`, `.pages`,
    `.n_token_pages`)."""

    start: int
    end: int
    value: Any


def segment_entries(cache: PagedCausalKVCache) -> list[SegmentEntry]:
    """The cache's segments in global order, with their Segment records."""
    return [SegmentEntry(e.start, e.end, e.value) for e in cache._index]


def segment_at(cache: PagedCausalKVCache, g: int) -> SegmentEntry | None:
    """The segment holding global token `g`, or None."""
    e = cache._index.find(g)
    return None if e is None else SegmentEntry(e.start, e.end, e.value)


def segment_kind(cache: PagedCausalKVCache, g: int) -> str:
    """"dense" or "packed": the kind of the segment holding global token `g` (which must be held)."""
    e = segment_at(cache, g)
    assert e is not None, f"no segment holds global token {g}"
    return e.value.kind


def cursor(cache: PagedCausalKVCache) -> tuple[int, int]:
    """(G, L): the global end (tokens written) and the local end (slots filled)."""
    return cache._G, cache._L


def packed_store(cache: PagedCausalKVCache) -> Any:
    """The cache's PackedStore (None with quantization off)."""
    return cache._packed


def wrap_pressure_plan(cache: PagedCausalKVCache, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the cache's pack-under-pressure planner by `wrap(planner)` (a spy)."""
    cache._pressure_plan = wrap(cache._pressure_plan)


def sink_segment_starts(cache: PagedCausalKVCache) -> Any:
    """Global starts of the segments holding sink or pinned slots (they follow the sink pack policy)."""
    return cache._sink_segment_starts()
