"""Helpers shared by the test files (the one helper module; `dense_reference.py` is the oracle, kept apart).

Importing this module before anything imports triton sets TRITON_INTERPRET=1 when there is no CUDA device (Triton
reads it when it decorates kernels), so the Triton kernel tests run in Triton's interpreter on CPU tensors.

- Drawn cache configurations: `cache_kwargs`, `make_kv`, `head_args`, the strategies `recent` / `seeds`, the exact
  dense page model (`tokens_per_page`, `pages_for`, `SegmentModel`) and error-kind matching (`same_error_kind`).
- Snapshots for "a bad call changes nothing": `cache_state`, `same`.
- The cache's and the pool's internals, reached ONLY through the small functions below (`segment_entries`,
  `segment_at`, `segment_kind`, `cursor`, `packed_store`, `tier_store`, `set_view_run_cap`, `wrap_pressure_plan`,
  `sink_segment_starts`, `cache_state`, `page_io`, `segment_index`, `sequencer_spec`, `chunk_packer`,
  `cached_plans`, `newest_view_plan`, `read_slots`, `sequencer`, `free_page_ids`, `corrupt_holders`,
  `deferred_owners`, `owner_pages_now`): when the private state moves, these are the one place the tests adapt
  (tests/test_private_access.py checks no other test file reads a private attribute of a pagedqvg object).
- Where the Triton kernel tests run: `kernel_device` says why in-process kernel tests skip when triton was already
  imported in compiled mode without a GPU, and `rerun_interpreted` runs a test file again in a fresh interpreted
  process (kernels never pass silently); `compiled_mode_json` runs a compiled-mode check in a subprocess; bit
  patterns (`bits`, `random_bits`).
- The k-means contract every torch-vs-Triton comparison uses (`check_near_ties`, `check_means`,
  `contract_checked_kmeans`): the two backends sum the same fp32 products in different orders (Triton's interpreter
  uses numpy's BLAS, torch its own; both pick kernels by the CPU's instruction set), so their k-means results are
  compared against the documented contract (kernels/kmeans.py), never bit for bit, unless the data make the
  arithmetic exact.
- Token-row arenas of random bits for the dense kernels (`make_rows`) and row indices into them (`unique_rows`
  for writes, `any_rows` for gathers).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from hypothesis import note as _hnote
from hypothesis import strategies as st

from pagedqvg import CacheConfigError, PagedCausalKVCache, SequencingError
from pagedqvg.allocator.pool import debug_state
from pagedqvg.cache import policy
from pagedqvg.kernels.pack.kmeans import distance_error_bound, kmeans_assign_torch, kmeans_update_torch

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`


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
    """The kind the cache and the reference must agree on: "config", "sequencing", "value" or the type name."""
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
    """Whole tokens per page (pagedqvg/layout/segments.py: a token's K and V rows of every batch element never straddle
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
        cache._seq.spec,
        cache._seq.state,
        cache.pinned_range,
        tuple(cache.segments()),
        cache.resident_nbytes(),
        cache.global_end_index.clone(),
        cache.local_end_index.clone(),
        cache.global_end_index_int,
        cache.local_end_index_int,
        pool.stats(),
        debug_state(pool),
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
    return [SegmentEntry(e.start, e.end, e.value) for e in cache._seq.index]


def segment_at(cache: PagedCausalKVCache, g: int) -> SegmentEntry | None:
    """The segment holding global token `g`, or None."""
    e = cache._seq.index.find(g)
    return None if e is None else SegmentEntry(e.start, e.end, e.value)


def segment_kind(cache: PagedCausalKVCache, g: int) -> str:
    """The kind ("dense" or "packed") of the segment holding global token `g` (which must be held)."""
    e = segment_at(cache, g)
    assert e is not None, f"no segment holds global token {g}"
    return e.value.kind


def cursor(cache: PagedCausalKVCache) -> tuple[int, int]:
    """(G, L): the global end (tokens written) and the local end (slots filled)."""
    return cache._seq.state.global_end, cache._seq.state.local_end


def packed_store(cache: PagedCausalKVCache) -> Any:
    """The cache's PackedStore (None with quantization off)."""
    return cache._packed


def tier_store(cache: PagedCausalKVCache, fmt: str) -> Any:
    """The cache's store of tier format `fmt` (pagedqvg/store/tier_stores.py)."""
    return cache._packer.stores[fmt]


def set_view_run_cap(cache: PagedCausalKVCache, run_cap: int | None) -> None:
    """Cap the rows per run of the cache's mixed-view tables (None: no cap), as a test of run splitting needs."""
    cache._io.run_cap = run_cap


def wrap_pressure_plan(cache: PagedCausalKVCache, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the cache's pack-under-pressure planner by `wrap(planner)` (a spy)."""
    cache._packer.pressure_plan = wrap(cache._packer.pressure_plan)


def sink_segment_starts(cache: PagedCausalKVCache) -> Any:
    """Global starts of the segments holding sink or pinned slots (they follow the sink pack policy)."""
    return policy.sink_segment_starts(cache._seq)


def page_io(cache: PagedCausalKVCache) -> Any:
    """The cache's `PageIO` (its pages' rows, plan cache and kernel backend)."""
    return cache._io


def segment_index(cache: PagedCausalKVCache) -> Any:
    """The cache's segment index (`RangeIndex` of global token ranges -> `Segment`), iterated in order."""
    return cache._seq.index


def sequencer_spec(cache: PagedCausalKVCache) -> Any:
    """The cache's `CacheSpec` (geometry in slots)."""
    return cache._seq.spec


def chunk_packer(cache: PagedCausalKVCache) -> Any:
    """The cache's `ChunkPacker` (its tier stores, pressure deferrals)."""
    return cache._packer


def cached_plans(io: Any) -> dict:
    """The plan cache of a `PageIO` (key -> plan), oldest entry first."""
    return io._plans


def newest_view_plan(cache: PagedCausalKVCache) -> Any:
    """The plan of the cache's newest view (the newest "v" entry of its plan cache)."""
    return [p for key, p in cache._io._plans.items() if key[0] == "v"][-1]


def read_slots(cache: PagedCausalKVCache, what: str) -> torch.Tensor:
    """Every head of the filled slots `[2, B, L, H, D]` (the subclass helper `_read_slots`)."""
    return cache._read_slots(what)


def sequencer(cache: PagedCausalKVCache) -> Any:
    """The cache's `Sequencer` (spec, cursors, pin, slot map, segment index)."""
    return cache._seq


def free_page_ids(pool: Any) -> list[int]:
    """The pool's free page ids (its free stack)."""
    return list(pool._free)


def corrupt_holders(pool: Any, page: int, extra_holder: str | None = None, owner_shared: tuple[str, int] | None = None,
                    undo: bool = False) -> None:  # fmt: skip
    """For `check()` tests: append `extra_holder` to `page`'s holder list (or pop it with `undo`), or add
    `owner_shared[1]` to `owner_shared[0]`'s shared-page count."""
    if extra_holder is not None:
        pool._shared[page].append(extra_holder)
    if undo:
        pool._shared[page].pop()
    if owner_shared is not None:
        pool._owner_shared[owner_shared[0]] += owner_shared[1]


def deferred_owners(pool: Any) -> int:
    """Owners queued by finalizers, whose pages go back at the pool's next operation."""
    return len(pool._deferred)


def owner_pages_now(pool: Any, owner: str) -> int:
    """Pages `owner` holds, read without a pool operation (`pages_of` would first give queued owners' pages back)."""
    return pool._owner_pages[owner]


# ------------------------------------------------------------------------------------------------ Triton kernel tests
REPO = Path(__file__).resolve().parent.parent
INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.uint8: torch.uint8}


def triton_kernels(module: str, kernel: str) -> tuple[object | None, str | None, torch.device | None, str]:
    """`(module, import_error, device, why)` for a kernel test file: imports `pagedqvg.kernels.<module>` (None and
    the error text when triton does not import) and says where `<module>.<kernel>` runs (`kernel_device`)."""
    import importlib

    try:
        mod = importlib.import_module(f"pagedqvg.kernels.{module}")
    except Exception as exc:  # pragma: no cover - depends on the install
        error = f"{type(exc).__name__}: {exc}"
        return (None, error, *kernel_device(error, None))
    return (mod, None, *kernel_device(None, getattr(mod, kernel)))


def kernel_device(import_error: str | None, kernel) -> tuple[torch.device | None, str]:
    """`(device, why)`: the device the kernel tests use, or None and the reason they skip."""
    from pagedqvg.kernels.triton_common import is_interpreted

    if import_error is not None:
        return None, f"the Triton kernels do not import: {import_error}"
    if is_interpreted(kernel):
        return torch.device("cpu"), ""  # the interpreter, on CPU tensors
    if CUDA:
        return torch.device("cuda"), ""  # compiled kernels on the GPU
    return None, (
        "triton was imported in compiled mode before TRITON_INTERPRET=1 could be set and there is no CUDA device; "
        "test_interpreter_in_subprocess runs these tests in a fresh process instead"
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of the same width (a view): NaN == NaN, -0.0 != 0.0."""
    return t.view(INT_OF[t.dtype])


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (every float class: normal, subnormal, ±0, ±inf, NaN with payloads)."""
    it = INT_OF[dtype]
    info = torch.iinfo(it)
    return torch.randint(info.min, info.max, tuple(shape), dtype=torch.int64, generator=gen).to(it).view(dtype)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the kernel switches, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDQVG_KERNELS")}
    env.update(extra)
    return env


def rerun_interpreted(test_file: str) -> None:
    """Run `test_file` with pytest in a fresh process with TRITON_INTERPRET=1; it must pass, and only this
    fallback itself may skip there."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
        cwd=REPO, env=clean_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    skipped = re.search(r"(\d+) skipped", summary)
    assert passed and int(passed.group(1)) > 0 and (not skipped or int(skipped.group(1)) <= 1), summary


def compiled_mode_json(script: str, *args: str, **env: str) -> dict:
    """Run `script` (which prints `JSON{...}`) in a fresh compiled-mode process (TRITON_INTERPRET unset, FP fusion
    on as on a GPU, plus `env`) and return the JSON. Skips the calling test only when triton is not installed; any
    failure of the script fails it (a Triton upgrade that moves the internals `triton_aot` uses, or breaks a
    kernel's compilation, must not pass silently)."""
    import importlib.util
    import json

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=clean_env(TRITON_DEFAULT_FP_FUSION="1", **env),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("JSON", 1)[1])


# ---------------------------------------------------------------------------------------------- k-means contract
def distance_margins(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(gap, bound)` float64 [H, S]: per token, the exact (fp64) distance of the second-nearest centroid minus the
    nearest's, and the sum of the two distances' fp32 error bounds (`kmeans.distance_error_bound`). Where
    `gap > bound`, every fp32 summation order picks the nearest centroid; with K = 1 the gap is +inf."""
    x64, c64 = x.double(), c.double()
    d64 = (c64 * c64).sum(-1)[:, None, :] - 2.0 * torch.bmm(x64, c64.transpose(1, 2))  # ||c||^2 - 2 x.c
    err = distance_error_bound(x, c)
    if c.shape[1] < 2:
        inf = torch.full(d64.shape[:2], float("inf"), dtype=torch.float64)
        return inf, err[..., 0]
    top2 = d64.topk(2, dim=-1, largest=False)
    gap = top2.values[..., 1] - top2.values[..., 0]
    bound = err.gather(2, top2.indices).sum(-1)
    return gap, bound


def check_near_ties(x: torch.Tensor, c: torch.Tensor, ids_a: torch.Tensor, ids_b: torch.Tensor) -> int:
    """The assignment contract (kernels/kmeans.py) between two results `ids_a`, `ids_b` [H, S] for x [H, S, D] and
    c [H, K, D]: both pick, for every token, a centroid within twice its fp32 error bound of the nearest (exact fp64
    distances), and where they differ the two chosen distances lie within the sum of their error bounds. Returns the
    number of differing ids."""
    x, c, ids_a, ids_b = x.cpu(), c.cpu(), ids_a.cpu(), ids_b.cpu()
    x64, c64 = x.double(), c.double()
    d64 = (c64 * c64).sum(-1)[:, None, :] - 2.0 * torch.bmm(x64, c64.transpose(1, 2))
    err = distance_error_bound(x, c)
    da, db = d64.gather(2, ids_a[..., None])[..., 0], d64.gather(2, ids_b[..., None])[..., 0]
    ea, eb = err.gather(2, ids_a[..., None])[..., 0], err.gather(2, ids_b[..., None])[..., 0]
    best = d64.min(-1).values
    assert bool((da - best <= 2 * ea + 1e-300).all()) and bool((db - best <= 2 * eb + 1e-300).all()), (
        "an id is not a nearest centroid within the fp32 error bound"
    )
    diff = ids_a != ids_b
    assert bool(((da - db).abs() <= ea + eb)[diff].all()), "ids differ beyond a rounding-level near-tie"
    return int(diff.sum())


def _cluster_means64(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-cluster means `[H, K, D]` of `values` `[H, S, D]` grouped by `ids` (empty clusters: 0) and the
    cluster sizes `[H, K, 1]`."""
    onehot = torch.zeros(*ids.shape, k, dtype=torch.float64, device=values.device).scatter_(2, ids[..., None], 1.0)
    counts = onehot.sum(1)[..., None]
    return torch.bmm(onehot.transpose(1, 2), values.double()) / counts.clamp(min=1.0), counts


def update_error_bound(x: torch.Tensor, ids: torch.Tensor, c_old: torch.Tensor) -> torch.Tensor:
    """Per (h, k, d) bound on |computed mean - exact mean| for any fp32 summation order (float64 [H, K, D]; the
    contract of kernels/kmeans.py): a sum of n terms is off by at most (n - 1) * 2^-24 * sum |x|, the division adds
    half an ulp."""
    mean_abs, counts = _cluster_means64(x.abs(), ids, c_old.shape[1])
    return (counts - 1).clamp(min=0) * 2.0**-24 * mean_abs + 2.0**-24 * mean_abs


def exact_means(x: torch.Tensor, ids: torch.Tensor, c_old: torch.Tensor) -> torch.Tensor:
    """Cluster means in float64 (empty clusters: c_old)."""
    means, counts = _cluster_means64(x, ids, c_old.shape[1])
    return torch.where(counts > 0, means, c_old.double())


def check_means(x: torch.Tensor, ids: torch.Tensor, c_old: torch.Tensor, *means: torch.Tensor) -> None:
    """The update contract: each of `means` [H, K, D] lies within `update_error_bound` of the exact (fp64)
    cluster means, and empty clusters keep `c_old` exactly."""
    x, ids, c_old = x.cpu(), ids.cpu(), c_old.cpu()
    exact, bound = exact_means(x, ids, c_old), update_error_bound(x, ids, c_old)
    empty = torch.ones(c_old.shape[:2], dtype=torch.bool).scatter_(1, ids, False)
    for m in means:
        m = m.cpu()
        assert bool(((m.double() - exact).abs() <= bound).all()), "cluster means beyond the fp32 summation bound"
        assert torch.equal(m[empty], c_old[empty]), "an empty cluster did not keep its centroid"


def contract_checked_kmeans(monkeypatch, target=None) -> dict[str, int]:
    """Make a torch-vs-Triton comparison of packing independent of the CPU: the k-means steps that `target`
    (default: `pagedqvg.store.packed_store`, the cache's pack path; any object gets `kmeans_assign` / `kmeans_update`
    attributes) calls become the torch references, and whenever the
    dispatch would pick Triton for the tensors, the Triton kernel runs too and its result is checked against the
    contract (`check_near_ties`, `check_means`) on the same inputs. Both runs then carry the same ids and centroids
    forward, so everything after k-means (residuals, packing, pages, views) must match bit for bit. Returns the
    counts of checked Triton calls (`{"assign": n, "update": n}`), for the test to assert the kernels ran.

    Why not compare whole k-means runs bit for bit: fp32 sums in another order differ in the last bits (a near-tie
    may pick the other centroid, a mean may round the other way), and which order each side uses depends on the
    BLAS and instruction set of the machine (numpy's OpenBLAS in the interpreter, torch's MKL, or the GPU)."""
    from pagedqvg.kernels import dispatch

    if target is None:
        from pagedqvg.store import packed_store as target
    counts = {"assign": 0, "update": 0}

    def assign(x, c):
        ref = kmeans_assign_torch(x.cpu(), c.cpu()).to(x.device)
        if dispatch.kernel_backend(x.device) == "triton":
            got = dispatch.kmeans_assign(x, c)
            check_near_ties(x, c, got, ref)
            counts["assign"] += 1
        return ref

    def update(x, ids, c_old):
        ref = kmeans_update_torch(x.cpu(), ids.cpu(), c_old.cpu()).to(x.device)
        if dispatch.kernel_backend(x.device) == "triton":
            got = dispatch.kmeans_update(x, ids, c_old)
            check_means(x, ids, c_old, got, ref)
            counts["update"] += 1
        return ref

    monkeypatch.setattr(target, "kmeans_assign", assign, raising=False)
    monkeypatch.setattr(target, "kmeans_update", update, raising=False)
    return counts


# ------------------------------------------------------------------------------------------------ token-row arenas
def make_rows(
    num_pages: int, rpp: int, heads: int, d: int, dtype: torch.dtype, gen: torch.Generator, pad: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """An arena of random bits and its `[num_pages, rpp, H, D]` token-row view, laid out like rows.token_rows."""
    arena = random_bits((num_pages, rpp * heads * d + pad), dtype, gen)
    return arena, arena[:, : rpp * heads * d].view(num_pages, rpp, heads, d)


def unique_rows(
    num_pages: int, rpp: int, batch: int, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[2, B, n]` row index with all rows distinct (a write target)."""
    flat = torch.randperm(num_pages * rpp, generator=gen)[: 2 * batch * n].view(2, batch, n)
    return flat // rpp, flat % rpp


def any_rows(
    num_pages: int, rpp: int, batch: int, t: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[2, B, T]` row index drawn with replacement (a gather may read a row twice)."""
    flat = torch.randint(0, num_pages * rpp, (2, batch, t), generator=gen)
    return flat // rpp, flat % rpp
