"""One session's shape and work (`SessionSpec`) and its planned peak in pages (`planned_session_pages`): the
planner's page census of one layer (`planner.replay_layer`) driven in the planner's call pattern. Used by
`SessionManager` (sessions.py) for admission. O(replay of one layer) per spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedqvg.errors import CacheConfigError
from pagedqvg.quant import QuantConfig
from pagedqvg.validation import check_int

__all__ = ["CacheFactory", "SessionSpec", "planned_session_pages"]

#: Builds one cache: `(pool, name, **cache_kwargs) -> cache` (default: `PagedCausalKVCache`).
CacheFactory = Callable[..., object]


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """One session's caches and the work it plans (tokens are slots; `chunks` None: it runs to steady state and
    beyond, so its peak is the steady-state peak)."""

    layers: int
    batch_size: int
    cache_size: int
    num_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: torch.dtype = torch.bfloat16
    cache_sets: int = 1  # e.g. 2 with classifier-free guidance (conditional and unconditional)
    sink_tokens: int = 0
    global_sink_tokens: int = 0
    attention_window_size: int = 0
    denoise_steps: int = 1
    chunks: int | None = None
    quant: QuantConfig | None = None
    #: extra PagedCausalKVCache arguments as (name, value) pairs, e.g. (("use_int_indices", True),); not the
    #: ones that change the page census (allow_growth)
    cache_kwargs: tuple[tuple[str, object], ...] = ()

    @property
    def caches(self) -> int:
        return self.layers * self.cache_sets

    def layer_kwargs(self) -> dict[str, object]:
        """The `PagedCausalKVCache` shape arguments of one layer (pool, device and name excluded)."""
        return dict(
            batch_size=self.batch_size,
            cache_size=self.cache_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            sink_tokens=self.sink_tokens,
            global_sink_tokens=self.global_sink_tokens,
            attention_window_size=self.attention_window_size or None,
            quant=self.quant,
            **dict(self.cache_kwargs),
        )


def _geometry(spec: SessionSpec, page_bytes: int):
    """The planner's `Geometry` of one layer of `spec` on pages of `page_bytes` bytes; CacheConfigError if invalid."""
    from pagedqvg.planning.planner import Geometry

    wording = "{name} must be an int >= 1, got {value!r}"
    for name in ("layers", "cache_sets", "chunk_tokens", "denoise_steps"):
        check_int(f"SessionSpec.{name}", getattr(spec, name), minimum=1, error=CacheConfigError,
                  message=wording, type_message=wording)  # fmt: skip
    if spec.chunks is not None:
        wording = "{name} must be None or an int >= 1, got {value!r}"
        check_int("SessionSpec.chunks", spec.chunks, minimum=1, error=CacheConfigError,
                  message=wording, type_message=wording)  # fmt: skip
    if "allow_growth" in dict(spec.cache_kwargs):
        raise CacheConfigError("SessionSpec.cache_kwargs: allow_growth has no planned peak; sessions need a fixed size")
    try:
        geom = Geometry(
            caches=spec.caches,
            cache_sets=spec.cache_sets,
            batch_size=spec.batch_size,
            heads=spec.num_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            page_bytes=page_bytes,
            tokens_per_frame=1,
            chunk_tokens=spec.chunk_tokens,
            sink_tokens=spec.sink_tokens,
            global_sink_tokens=spec.global_sink_tokens,
            cache_size=spec.cache_size,
            attention_window=spec.attention_window_size,
            scene_cut_every=0,
            denoise_steps=spec.denoise_steps,
            quant=spec.quant if spec.quant is not None else QuantConfig(),
        )
        geom._check()
    except ValueError as exc:
        raise CacheConfigError(f"SessionSpec: {exc}") from None
    return geom


def planned_session_pages(spec: SessionSpec, page_bytes: int) -> int:
    """Pool high-water pages of one session's caches run in the planner's call pattern for `spec.chunks` chunks
    (None: to steady state). O(replay of one layer)."""
    from pagedqvg.planning.planner import replay_chunks, replay_layer

    geom = _geometry(spec, page_bytes)
    steady = replay_chunks(geom)
    chunks = steady if spec.chunks is None else min(spec.chunks, steady)
    return replay_layer(geom, chunks).pool_high_water(spec.caches)
