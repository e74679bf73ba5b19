"""The format registry (pagedqvg/quant/formats.py): one record per format, looked up by name.

- every format's bytes per segment from the registry (`quant/layouts.format_layout`) equal the layout classes' own
  arithmetic, hand-computed byte counts, and the cache's `memory_breakdown` for a real cache holding that format;
- the store class of each format is the one a real cache holds it in;
- lookup errors are typed and name the unknown value and the valid ones;
- rank order (the "no coarser than" rule of `QuantConfig` reads it);
- the QuantConfig a format packs with (`tier_quant`) is the registry's;
- the CLI's and the plugin's literal choices equal the registry's tuples.
"""

from __future__ import annotations

import pytest
import torch
from helpers import chunk_packer, sequencer

from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.errors import PagedQVGError
from pagedqvg.layout.segments import DenseTokenLayout, Fp8SegmentLayout, PackedSegmentLayout
from pagedqvg.quant.format import PackedFormat
from pagedqvg.quant.formats import (
    FORMATS,
    PRQ_MODE_NAMES,
    QUANT_MODE_NAMES,
    TIER_FORMAT_NAMES,
    UnknownFormatError,
    format_rank,
    get_format,
)
from pagedqvg.quant.fp8 import Fp8Format
from pagedqvg.quant.layouts import format_layout
from pagedqvg.store.tier_stores import STORE_CLASSES

B, H, D, N, PAGE = 1, 2, 128, 4, 4096  # batch, heads, head_dim (compact needs 128), tokens per chunk, page bytes
SMALL = dict(centroids=4, kmeans_iters=1)

#: A config whose cache holds each format (as the history's, or a tier's), with the tier that holds it.
HOLDING: dict[str, tuple[QuantConfig | None, str]] = {
    "bf16": (None, "history"),
    "fp8": (QuantConfig(bits=2, block_size=32, sink_format="fp8", **SMALL), "sink"),
    "int4": (QuantConfig(bits=2, block_size=32, recent_format="int4", **SMALL), "recent"),
    "int2": (QuantConfig(bits=2, block_size=32, recent_format="fp8", **SMALL), "history"),
    "compact": (QuantConfig.compact(recent_format="int4", **SMALL), "history"),
}

#: Hand-computed bytes of one segment of N tokens at B=1, H=2, D=128 (K and V: 2 * B * N token rows), codebooks incl.
#: bf16: 2*4*2*128*2. fp8: 128 values + 4 exponents per token-head. int4 (block 32, 4 centroids, 1 stage): 64 code
#: bytes + 4 scales + 1 id per token-head, codebooks 2*B*H rows of 4*128 bf16. int2: 32 + 4 + 1. compact: 26 trit
#: bytes + 1 scale + 1 id, fp8 codebooks of 4*128 bytes.
HAND_BYTES = {
    "bf16": 2 * B * N * H * D * 2,
    "fp8": 2 * B * N * H * (128 + 4),
    "int4": 2 * B * N * H * (64 + 4 + 1) + 2 * B * H * 4 * 128 * 2,
    "int2": 2 * B * N * H * (32 + 4 + 1) + 2 * B * H * 4 * 128 * 2,
    "compact": 2 * B * N * H * (26 + 1 + 1) + 2 * B * H * 4 * 128,
}


def _registry_layout(name: str):
    quant, tier = HOLDING[name]
    q = quant.tier_quant(tier) if quant is not None else None
    return format_layout(name, q, B, H, D, torch.bfloat16, PAGE)


def _class_layout(name: str):
    """The layout built by hand from the layout classes and byte codecs (not through the registry)."""
    quant, tier = HOLDING[name]
    if quant is None:
        return DenseTokenLayout(B, H, D, torch.bfloat16, PAGE)
    if name == "fp8":
        return Fp8SegmentLayout(B, Fp8Format(D, H).token_row_bytes, PAGE)
    q = quant.tier_quant(tier)
    return PackedSegmentLayout.from_format(B, PackedFormat(D, H, q, torch.bfloat16), PAGE)


def _cache(quant: QuantConfig | None) -> PagedCausalKVCache:
    pool = BlockPool(capacity_bytes=4 << 20, page_bytes=PAGE, device="cpu")
    return PagedCausalKVCache(
        pool=pool, device="cpu", quant=quant, batch_size=B, cache_size=8 * N, num_heads=H, head_dim=D,
        dtype=torch.bfloat16, sink_tokens=N,
    )  # fmt: skip


def _fill(cache: PagedCausalKVCache, chunks: int) -> None:
    g = torch.Generator().manual_seed(7)
    for i in range(chunks):
        k, v = (torch.randn(B, N, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)


def test_the_registry_names_every_format_once_in_rank_order() -> None:
    assert TIER_FORMAT_NAMES == ("bf16", "fp8", "int4", "int2", "compact")
    assert PRQ_MODE_NAMES == ("int4", "int2", "compact")
    assert QUANT_MODE_NAMES == ("off", "int4", "int2", "compact")
    assert [f.name for f in FORMATS] == list(TIER_FORMAT_NAMES)
    ranks = [format_rank(n) for n in TIER_FORMAT_NAMES]
    assert ranks == [4, 3, 2, 1, 1] and ranks == sorted(ranks, reverse=True)
    assert {f.name: f.layout for f in FORMATS} == {
        "bf16": DenseTokenLayout, "fp8": Fp8SegmentLayout, "int4": PackedSegmentLayout,
        "int2": PackedSegmentLayout, "compact": PackedSegmentLayout,
    }  # fmt: skip
    assert [f.name for f in FORMATS if f.kernels == ("torch reference",)] == ["fp8"]  # no Triton kernel for fp8
    assert {f.name: f.channel_block for f in FORMATS} == {"bf16": 0, "fp8": 32, "int4": 0, "int2": 0, "compact": 0}
    assert Fp8Format(64, 1).num_blocks == 64 // get_format("fp8").channel_block


@pytest.mark.parametrize("name", TIER_FORMAT_NAMES)
def test_bytes_per_segment_from_the_registry_equal_the_layouts_and_the_cache(name: str) -> None:
    layout = _registry_layout(name)
    assert type(layout) is get_format(name).layout
    for tokens in (1, N, 3 * N):
        assert layout.used_bytes_for_tokens(tokens) == _class_layout(name).used_bytes_for_tokens(tokens)
        assert layout.pages_for_tokens(tokens) == _class_layout(name).pages_for_tokens(tokens)
    assert layout.used_bytes_for_tokens(N) == HAND_BYTES[name]
    quant, _tier = HOLDING[name]
    cache = _cache(quant)
    _fill(cache, 6)
    mb = cache.memory_breakdown()
    segs = [e for e in sequencer(cache).index if (e.value.fmt if e.value.packed else "bf16") == name]
    assert segs and all(e.end - e.start == N for e in segs)
    if quant is None:  # a dense cache: every retained token in bf16
        assert mb["used_bytes"] == mb["dense_tokens"] // N * HAND_BYTES["bf16"] and mb["packed_tokens"] == 0
    else:
        assert mb[f"{name}_tokens"] == len(segs) * N
        assert mb[f"{name}_bytes"] == len(segs) * HAND_BYTES[name]
        assert mb[f"{name}_pages"] == len(segs) * layout.pages_for_tokens(N)
        assert isinstance(chunk_packer(cache).stores[name], STORE_CLASSES[get_format(name).codec])
        assert type(chunk_packer(cache).stores[name]).__name__ == get_format(name).store
    cache.close()


def test_unknown_names_raise_a_typed_error_naming_the_valid_ones() -> None:
    for bad in ("int3", "BF16", "", None):
        with pytest.raises(UnknownFormatError) as err:
            get_format(bad)  # type: ignore[arg-type]
        assert isinstance(err.value, ValueError) and isinstance(err.value, PagedQVGError)
        assert repr(bad) in str(err.value)
        assert all(n in str(err.value) for n in TIER_FORMAT_NAMES)
    with pytest.raises(UnknownFormatError, match="'fp4'"):
        format_rank("fp4")
    with pytest.raises(UnknownFormatError, match="'int8'"):
        format_layout("int8", None, B, H, D, torch.bfloat16, PAGE)
    with pytest.raises(ValueError, match="packs with a QuantConfig"):
        format_layout("int2", None, B, H, D, torch.bfloat16, PAGE)


def test_no_coarser_than_reads_the_registry_ranks() -> None:
    for history in PRQ_MODE_NAMES:
        base = QuantConfig.compact(**SMALL) if history == "compact" else QuantConfig(bits=get_format(history).bits)
        for recent in TIER_FORMAT_NAMES:
            kw = dict(keep_recent_chunks=1, recent_format=recent)
            if format_rank(recent) >= format_rank(history):
                assert QuantConfig(**{**_fields(base), **kw}).recent_format == recent
            else:
                finer = ", ".join(f for f in TIER_FORMAT_NAMES if format_rank(f) >= format_rank(history))
                with pytest.raises(ValueError, match=f"coarser than the history's '{history}'.*allowed: {finer}$"):
                    QuantConfig(**{**_fields(base), **kw})


def _fields(q: QuantConfig) -> dict:
    return {f: getattr(q, f) for f in q.__dataclass_fields__}


def test_tier_quant_is_the_registry_record() -> None:
    q = QuantConfig(bits=4, centroids=16, block_size=32, stages=2, kmeans_iters=3, seed=9, recent_format="fp8",
                    sink_format="compact")  # fmt: skip
    assert q.tier_quant("history") is q and q.tier_quant("recent") is None
    assert q.tier_quant("sink") == QuantConfig.compact(centroids=16, kmeans_iters=3, seed=9)
    q2 = QuantConfig(bits=2, centroids=16, block_size=32, stages=2, kmeans_iters=3, asymmetric=True, seed=9,
                     recent_format="int4")  # fmt: skip
    assert q2.tier_quant("recent") == QuantConfig(
        bits=4, centroids=16, block_size=32, stages=2, kmeans_iters=3, asymmetric=True, seed=9
    )
    assert QuantConfig().tier_quant("history") is None  # quantization off: every tier dense
    compact = QuantConfig.compact()
    assert all(getattr(compact, k) == v for k, v in get_format("compact").quant_fixed)
    assert compact.mode == "compact" and QuantConfig(bits=2, pack_trits=True).mode == "int2"  # trits: an int2 option


def test_cli_and_plugin_choices_equal_the_registry() -> None:
    from pagedqvg.cli.args import QUANT_FLAGS
    from pagedqvg.integrations.sglang.plugin import _TIER_FORMS, ENV_QUANT_RECENT, ENV_QUANT_SINK

    choices = {flag: kw.get("choices") for flag, _help, kw in QUANT_FLAGS}
    assert tuple(choices["--kv-cache-quant"]) == QUANT_MODE_NAMES
    assert tuple(choices["--kv-cache-quant-recent"]) == TIER_FORMAT_NAMES
    for variable in (ENV_QUANT_SINK, ENV_QUANT_RECENT):
        text = _TIER_FORMS[variable]
        positions = [text.index(n) for n in TIER_FORMAT_NAMES]
        assert positions == sorted(positions), (variable, text)  # every format, in registry order
