"""One rank's cache geometry (`Geometry`): a `Workload` resolved to tokens, slots and bytes, checked, and its
per-layer byte accounting (dense and packed layouts, views, attention scratch). Tensor-free; every method O(1).

`tiers.py`, `replay.py` and `planner.py` import it (it imports none of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedqvg.layout.attention_scratch import (
    ATTN_TILE_TOKENS,
    attention_scratch_bytes,
    packed_decode_bytes,
    triton_attend_bytes,
)
from pagedqvg.layout.head_groups import choose_head_group, heads_transient_bytes
from pagedqvg.layout.segments import (
    DenseTokenLayout,
    PackedSegmentLayout,
    PageChoice,
    choose_page_bytes,
    dtype_itemsize,
    segment_kinds,
)
from pagedqvg.planning.presets import Workload
from pagedqvg.quant.config import QuantConfig
from pagedqvg.quant.format import PackedFormat
from pagedqvg.quant.layouts import tier_layout
from pagedqvg.validation import PAGE_ALIGN_BYTES, check_int, nearest_page_bytes, page_bytes_at_least

#: Largest page size (bytes) a geometry accepts: 1 GiB (a page is one allocation unit of the pool; the auto choice
#: picks pages of KiB to a few MiB).
MAX_PAGE_BYTES = 1 << 30
#: The valid page sizes, as error messages and --help say them.
PAGE_BYTES_RANGE = f"a multiple of {PAGE_ALIGN_BYTES} B from {PAGE_ALIGN_BYTES} B to 1 GiB"
PAGE_BYTES_RULE = f"{PAGE_BYTES_RANGE} (or auto)"


@dataclass(frozen=True, slots=True)
class Geometry:
    """One layer's cache geometry in tokens (= slots) and bytes, resolved from a `Workload` and checked."""

    caches: int  # caches sharing the pool: layers * cache_sets * sessions
    cache_sets: int
    batch_size: int
    heads: int  # per rank: the workload's heads / (ulysses * tp)
    head_dim: int
    dtype: torch.dtype
    page_bytes: int
    tokens_per_frame: int
    chunk_tokens: int
    sink_tokens: int
    global_sink_tokens: int
    cache_size: int
    attention_window: int  # 0 means cache_size
    scene_cut_every: int
    denoise_steps: int
    quant: QuantConfig
    sessions: int = 1
    ranks: int = 1  # ulysses * tp: this geometry is one rank's caches
    page_choice: PageChoice | None = None  # set when the page size was chosen automatically
    attention: str = "view"  # "view" (a transient K/V view per call), "pages" (update_and_attend: tile scratch) or
    # "heads" (update_and_attend_heads: one group of heads' view at a time)
    head_group: int | None = None  # mode heads: heads per group (None: layout.head_groups.choose_head_group's)

    @classmethod
    def from_workload(cls, w: Workload, quant: QuantConfig | None = None) -> Geometry:
        """Resolve `w` (with `quant` instead of `w.quant` if given); ValueError naming the bad field otherwise."""
        check_workload(w)
        tpf = w.tokens_per_frame
        sink = w.sink_tokens if w.sink_tokens is not None else w.sink_frames * tpf
        gsink = w.global_sink_tokens if w.global_sink_tokens is not None else (sink if w.global_sink else 0)
        e0 = max(sink, gsink)
        cache_size = w.cache_size_tokens if w.cache_size_tokens is not None else e0 + w.window_frames * tpf
        quant = w.quant if quant is None else quant
        heads = w.heads // w.ranks
        choice = None
        page_bytes = w.page_bytes
        if page_bytes is None:
            fmt = PackedFormat(w.head_dim, heads, quant, w.torch_dtype) if quant.enabled else None
            kinds = segment_kinds(
                w.batch_size, heads, w.head_dim, dtype_itemsize(w.torch_dtype), w.chunk_frames * tpf, fmt
            )
            choice = choose_page_bytes(kinds)
            page_bytes = choice.page_bytes
        geom = cls(
            caches=w.layers * w.cache_sets * w.sessions,
            cache_sets=w.cache_sets,
            batch_size=w.batch_size,
            heads=heads,
            head_dim=w.head_dim,
            dtype=w.torch_dtype,
            page_bytes=page_bytes,
            tokens_per_frame=tpf,
            chunk_tokens=w.chunk_frames * tpf,
            sink_tokens=sink,
            global_sink_tokens=gsink,
            cache_size=cache_size,
            attention_window=w.attention_window_tokens or 0,
            scene_cut_every=w.scene_cut_every,
            denoise_steps=w.denoise_steps,
            quant=quant,
            sessions=w.sessions,
            ranks=w.ranks,
            page_choice=choice,
        )
        geom._check()
        return geom

    def _check(self) -> None:
        n, C, E = self.chunk_tokens, self.cache_size, self.effective_sink
        if C <= 0:
            raise ValueError(f"cache size must be > 0 tokens, got {C}")
        if n > C - E:
            raise ValueError(
                f"window smaller than a chunk: the cache holds {C} tokens, {E} of them sink, so the rolling window "
                f"is {C - E} tokens ({(C - E) / self.tokens_per_frame:g} frames) but one chunk is {n} tokens "
                f"({n // self.tokens_per_frame} frames); use --window-frames >= --chunk-frames"
            )
        if self.scene_cut_every and self.sink_tokens > 0:
            e_pin = self.global_sink_tokens + min(self.sink_tokens, n)
            if C - e_pin < n:
                raise ValueError(
                    f"a scene-cut pin makes the sink {e_pin} tokens, leaving {C - e_pin} tokens for a chunk of {n}; "
                    f"raise --window-frames or lower --global-sink-tokens"
                )
        if self.page_bytes % PAGE_ALIGN_BYTES:
            raise ValueError(
                f"--page-bytes must be {PAGE_BYTES_RANGE}, got {self.page_bytes}; nearest valid: "
                f"{nearest_page_bytes(self.page_bytes)} (or auto)"
            )
        packed = self.packed_layout()  # ValueError naming the quantization field
        # A page holds whole tokens: K and V rows of every batch element (layout.py).
        token_bytes = 2 * self.batch_size * self.dense.row_bytes
        need = token_bytes
        if packed is not None:
            need = max(need, 2 * self.batch_size * packed.token_row_bytes, packed.codebook_row_bytes)
        if self.dense.tokens_per_page < 1 or (
            packed is not None and (packed.tokens_per_page < 1 or packed.codebook_row_bytes > self.page_bytes)
        ):
            raise ValueError(
                f"page size {self.page_bytes} B is too small: one token ({token_bytes} B of K and V rows) or one "
                f"packed row must fit a page; use --page-bytes >= {page_bytes_at_least(need)}"
            )

    # ----------------------------------------------------------------------------------------- derived sizes
    @property
    def effective_sink(self) -> int:
        """`E` before any pin: `max(S, GS)` tokens."""
        return max(self.sink_tokens, self.global_sink_tokens)

    @property
    def window_tokens(self) -> int:
        """Rolling window `C - E` in tokens (includes the current chunk)."""
        return self.cache_size - self.effective_sink

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def dense(self) -> DenseTokenLayout:
        """Layout of bf16 (cache-dtype) segments."""
        return DenseTokenLayout(self.batch_size, self.heads, self.head_dim, self.dtype, self.page_bytes)

    def packed_format(self) -> PackedFormat | None:
        """The packed record format, or None when quantization is off."""
        if not self.quant.enabled:
            return None
        return PackedFormat(self.head_dim, self.heads, self.quant, self.dtype)

    def packed_layout(self) -> PackedSegmentLayout | None:
        """Layout of the history format's packed segments (the registry's, `quant/layouts.py`), or None when
        quantization is off."""
        if not self.quant.enabled:
            return None
        layout = tier_layout(
            self.quant, "history", self.batch_size, self.heads, self.head_dim, self.dtype, self.page_bytes
        )
        assert isinstance(layout, PackedSegmentLayout)  # the history's format is a PRQ one
        return layout
    def dense_cache_bytes(self) -> int:
        """Bytes of the dense reference cache's K and V buffers for one layer: `2 * B * C * H * D * itemsize`."""
        return 2 * self.batch_size * self.cache_size * self.heads * self.head_dim * self.itemsize

    def view_bytes(self, tokens: int) -> int:
        """Bytes of one call's K and V view of `tokens` tokens (all heads)."""
        return 2 * self.batch_size * tokens * self.heads * self.head_dim * self.itemsize

    def transient_bytes(self, view_tokens: int) -> int:
        """Bytes one layer's call needs outside the pool: its K/V view of `view_tokens` tokens (`attention="view"`),
        or `update_and_attend`'s scratch (`"pages"`, attention.py: `attention_scratch_bytes` for the chunk's query
        rows plus `packed_decode_bytes` when packed, independent of the window; or, when larger, the Triton path's
        output and split-KV partials, `triton_attend_bytes`, bounded whatever the window); or mode `"heads"`'s group
        view buffer, result and one group's output (`layout.head_groups.heads_transient_bytes`)."""
        if self.attention == "view":
            return self.view_bytes(view_tokens)
        if self.attention == "heads":
            args = (self.batch_size, self.chunk_tokens, self.heads, self.head_dim, self.dtype, view_tokens)
            return heads_transient_bytes(*args, self.heads_per_group())
        args = (self.batch_size, self.chunk_tokens, self.heads, self.head_dim, self.dtype)
        scratch = attention_scratch_bytes(*args)
        fmt = self.packed_format()
        if fmt is not None:
            scratch += packed_decode_bytes(self.batch_size, self.heads, self.head_dim, ATTN_TILE_TOKENS, fmt)
        return max(scratch, triton_attend_bytes(*args, view_tokens, packed=fmt is not None))

    def heads_per_group(self) -> int:
        """Mode heads' group size: `head_group` (clamped to the heads per rank), else the cost model's wave-efficient
        choice for the chunk's queries on an H200 (`choose_head_group`, no memory limit: independent of the window).
        """
        if self.head_group is not None:
            return min(self.head_group, self.heads)
        args = (self.batch_size, self.chunk_tokens, self.heads, self.head_dim, self.dtype, self.chunk_tokens)
        return choose_head_group(*args).group

    def cache_kwargs(self) -> dict[str, object]:
        """Keyword arguments of `PagedCausalKVCache` for this geometry (pool, device, quant and name excluded)."""
        return {
            "batch_size": self.batch_size,
            "cache_size": self.cache_size,
            "num_heads": self.heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "sink_tokens": self.sink_tokens,
            "attention_window_size": self.attention_window,
            "global_sink_tokens": self.global_sink_tokens,
        }

    def with_window_frames(self, frames: int) -> Geometry:
        """The same geometry with a rolling window of `frames` frames (cache size re-derived)."""
        return dataclasses.replace(self, cache_size=self.effective_sink + frames * self.tokens_per_frame)


#: The command-line flag of each Workload field (errors name the flag a user types).
FIELD_FLAGS: dict[str, str] = {
    "cache_size_tokens": "--cache-size",
    "attention_window_tokens": "--attention-window",
}


def flag_of(name: str) -> str:
    """The `pagedqvg` flag that sets Workload field `name` (`head_dim` -> `--head-dim`)."""
    return FIELD_FLAGS.get(name, "--" + name.replace("_", "-"))


def valid_rank_counts(heads: int) -> list[int]:
    """Rank counts (ulysses x tp) that split `heads` heads evenly: the divisors of `heads`."""
    return [d for d in range(1, heads + 1) if heads % d == 0]


#: `check_workload`'s messages (`validation.check_int` templates).
_POSITIVE = "{name} must be a positive integer, got {value!r}"
_NON_NEGATIVE = "{name} must be an integer >= 0, got {value!r}"
_PAGE_BYTES = "{name} must be a positive size or auto, got {value!r}"
_SIZE = "{name} must be a size >= 0, got {value!r}"


def check_workload(w: Workload) -> None:
    """ValueError naming the flag of the first field of `w` that is out of range (sizes must be positive)."""
    positive = (
        "layers",
        "heads",
        "head_dim",
        "tokens_per_frame",
        "chunk_frames",
        "window_frames",
        "denoise_steps",
        "batch_size",
        "cache_sets",
        "chunks",
        "sessions",
        "ulysses",
        "tp",
    )
    for name in positive:
        check_int(flag_of(name), getattr(w, name), minimum=1, message=_POSITIVE, type_message=_POSITIVE)
    if w.page_bytes is not None:
        check_int("--page-bytes", w.page_bytes, minimum=1, message=_PAGE_BYTES, type_message=_PAGE_BYTES)
        if w.page_bytes > MAX_PAGE_BYTES:
            raise ValueError(
                f"--page-bytes {w.page_bytes:,} B is out of range: {PAGE_BYTES_RULE}; e.g. --page-bytes 2MiB"
            )
    check_int("--weights", w.weights_bytes, minimum=0, message=_SIZE, type_message=_SIZE)
    for name in (
        "sink_frames",
        "scene_cut_every",
        "sink_tokens",
        "global_sink_tokens",
        "cache_size_tokens",
        "attention_window_tokens",
    ):
        value = getattr(w, name)
        if value is not None:
            check_int(flag_of(name), value, minimum=0, message=_NON_NEGATIVE, type_message=_NON_NEGATIVE)
    if w.dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"--dtype must be bf16, fp16 or fp32, got {w.dtype!r}")
    if w.heads % w.ranks:
        ranks = f"--ulysses {w.ulysses} x --tp {w.tp} = {w.ranks} ranks"
        raise ValueError(
            f"--heads {w.heads} cannot be split evenly across {ranks}; valid rank counts (ulysses x tp) for "
            f"{w.heads} heads: {', '.join(map(str, valid_rank_counts(w.heads)))}"
        )
    if w.window_frames < w.chunk_frames and w.cache_size_tokens is None:
        raise ValueError(
            f"window smaller than a chunk: --window-frames {w.window_frames} < --chunk-frames {w.chunk_frames} "
            f"(the window includes the chunk being denoised)"
        )


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, `limit`] with `fits(n)`, for a `fits` that holds up to some n and not beyond (the
    pages grow with n); 0 if not even 1 fits. A doubling search, then bisection: O(log limit) calls of `fits`."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
