"""Formats by age (issue 23): QuantConfig's sink / recent / history tiers, their parsing from SGLang flags and the
command line, and the typed errors of bad combinations."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import chunk_packer

from pagedqvg.allocator import BlockPool
from pagedqvg.cache.paged_cache import PagedCausalKVCache
from pagedqvg.cli.app import main
from pagedqvg.errors import CacheConfigError
from pagedqvg.integrations.sglang.integration import quant_config_from_sglang
from pagedqvg.quant import QuantConfig
from pagedqvg.quant.config import TIER_FORMATS


def tiers(q: QuantConfig) -> tuple[str, str, str]:
    return q.tier_format("sink"), q.tier_format("history"), q.tier_format("recent")


def test_defaults_are_unchanged():
    q = QuantConfig(bits=2)
    assert (q.sink_format, q.recent_format, q.tiered) == (None, "bf16", False)
    assert tiers(q) == ("int2", "int2", "bf16")
    assert tiers(QuantConfig(bits=4, sink=False)) == ("bf16", "int4", "bf16")
    assert tiers(QuantConfig()) == ("bf16", "bf16", "bf16")  # off: a dense cache has no packed tier
    q = QuantConfig(bits=2, seed=7)
    assert q.tier_quant("sink") is q and q.tier_quant("recent") is None


def test_tier_configs_take_the_historys_knobs_and_their_own_format():
    q = QuantConfig(bits=2, centroids=64, block_size=32, seed=9, sink_format="int4", recent_format="fp8")
    assert q.tiered and tiers(q) == ("int4", "int2", "fp8")
    sink = q.tier_quant("sink")
    assert (sink.bits, sink.centroids, sink.block_size, sink.seed, sink.mode) == (4, 64, 32, 9, "int4")
    assert q.tier_quant("recent") is None  # fp8 is quant/fp8.py's codec, not PRQ
    c = QuantConfig.compact(recent_format="int4", sink_format="compact")
    assert tiers(c) == ("compact", "compact", "int4") and c.tier_quant("sink") is c
    assert c.tier_quant("recent").mode == "int4" and not c.tier_quant("recent").pack_trits
    assert QuantConfig(bits=4, recent_format="fp8", sink_format="compact").tier_quant("sink").mode == "compact"
    assert "tiers: sink int4, recent fp8, history int2" in q.describe() and "in fp8" in q.describe()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"bits": 2, "recent_format": "fp9"}, ["recent_format='fp9'", "bf16, fp8, int4, int2, compact"]),
        ({"bits": 2, "sink_format": "int3"}, ["sink_format='int3'", "None, bf16"]),
        ({"bits": 2, "sink_format": "int4", "sink": False}, ["sink=False", "sink_format None/'bf16'"]),
        ({"bits": 2, "recent_format": "int4", "keep_recent_chunks": 0}, ["keep_recent_chunks=0", ">= 1"]),
        ({"bits": 4, "recent_format": "int2"}, ["coarser", "'int4'", "bf16, fp8, int4"]),
        ({"bits": 4, "recent_format": "compact"}, ["coarser", "'int4'"]),
    ],
)
def test_bad_combinations_are_typed_errors(kwargs, words):
    with pytest.raises(ValueError) as info:
        QuantConfig(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_head_dim_checks_cover_every_tier():
    with pytest.raises(ValueError, match=r"sink tier's format 'compact'.*divide head_dim=64"):
        QuantConfig(bits=2, sink_format="compact").validate(head_dim=64)
    with pytest.raises(ValueError, match=r"recent tier's format 'fp8'.*32 channels.*head_dim=48"):
        QuantConfig(bits=2, block_size=16, recent_format="fp8").validate(head_dim=48)
    assert QuantConfig(bits=2, recent_format="fp8", sink_format="int4").validate(head_dim=64)


def test_tier_formats_are_refused_when_quantization_is_off():
    q = QuantConfig(sink_format="bf16")  # the dense formats are what a dense cache has: allowed
    assert not q.tiered and tiers(q) == ("bf16", "bf16", "bf16")
    with pytest.raises(ValueError, match="unknown tier 'old'"):
        q.tier_format("old")
    for kwargs in (
        {"recent_format": "int4"},
        {"sink_format": "compact"},
        {"recent_format": "fp8", "sink_format": "int2"},
    ):
        with pytest.raises(
            CacheConfigError,
            match=r"QuantConfig\(bits=None\) with sink_format=.*quantization is off.*allowed: bits=2/4",
        ):
            QuantConfig(**kwargs)


def test_from_dict_reads_tier_formats():
    q = QuantConfig.from_dict(
        {"--kv-cache-quant": "int2", "--kv-cache-quant-sink": "INT4", "kv-cache-quant-recent": "fp8"}
    )
    assert (q.sink, q.sink_format, q.recent_format) == (True, "int4", "fp8")
    assert QuantConfig.from_dict({"kv_cache_quant": "int2", "kv_cache_quant_sink": "bf16"}).sink is False
    assert QuantConfig.from_dict({"kv_cache_quant": "int2", "kv_cache_quant_sink": "true"}).sink_format is None
    c = QuantConfig.from_dict({"kv_cache_quant": "compact", "kv_cache_quant_recent": "int4"})
    assert (c.mode, c.recent_format) == ("compact", "int4")
    # a dict of every field (as the CLI merges a preset's config) with the sink flag naming a format
    merged = {f.name: getattr(QuantConfig(bits=2), f.name) for f in dataclasses.fields(QuantConfig)}
    merged["sink"] = "compact"
    assert QuantConfig.from_dict(merged).sink_format == "compact"
    with pytest.raises(ValueError, match="sink format given twice"):
        QuantConfig.from_dict({"kv_cache_quant": "int2", "kv_cache_quant_sink": "int4", "sink_format": "fp8"})
    with pytest.raises(ValueError, match="coarser"):
        QuantConfig.from_dict({"kv_cache_quant": "int4", "kv_cache_quant_recent": "int2"})
    assert set(TIER_FORMATS) == {"bf16", "fp8", "int4", "int2", "compact"}


def test_sglang_mapping_carries_tiers():
    q = quant_config_from_sglang(
        {"kv_cache_quant": "int2", "kv_cache_quant_recent": "int4", "kv_cache_quant_sink": "fp8"}, head_dim=128
    )
    assert tiers(q) == ("fp8", "int2", "int4")
    with pytest.raises(CacheConfigError, match="coarser"):
        quant_config_from_sglang({"kv_cache_quant": "int4", "kv_cache_quant_recent": "int2"}, head_dim=128)

    class Args:  # SGLang's QVGKVQuantArgs fields, plus pagedqvg's tier formats
        bits, centroids, block_size, stages, kmeans_iters, asymmetric = 2, 128, 64, 1, 2, False
        keep_recent_chunks, sink, sink_keep_chunks = 1, True, 0
        recent_format = "fp8"

    assert tiers(quant_config_from_sglang(Args(), head_dim=128)) == ("int2", "int2", "fp8")


def test_cli_flags(capsys):
    code = main(
        [
            "plan",
            "--kv-cache-quant",
            "int2",
            "--kv-cache-quant-sink",
            "int4",
            "--kv-cache-quant-recent",
            "fp8",
            "--json",
        ]
    )
    out, _ = capsys.readouterr()
    q = json.loads(out)["workload"]["quant"]
    assert code == 0 and (q["sink_format"], q["recent_format"], q["sink"]) == ("int4", "fp8", True)
    code = main(["plan", "--kv-cache-quant", "int4", "--kv-cache-quant-recent", "int2"])
    _, err = capsys.readouterr()
    assert code == 2 and "coarser" in err
    code = main(["plan", "--kv-cache-quant", "off", "--kv-cache-quant-recent", "int4"])
    _, err = capsys.readouterr()
    assert code == 2 and "--kv-cache-quant-recent" in err and "off" in err


def test_the_cache_takes_tiered_configs():
    """The cache ages tiers (tests/test_cache_tiers.py); a tiered config builds a cache with a store per format."""
    pool = BlockPool(capacity_bytes=1 << 21, page_bytes=1 << 15)
    base = dict(pool=pool, batch_size=1, cache_size=64, num_heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu")
    cache = PagedCausalKVCache(quant=QuantConfig(bits=2, recent_format="int4"), **base)
    assert set(chunk_packer(cache).stores) == {"int2", "int4"}
    cache.close()
    PagedCausalKVCache(quant=QuantConfig(bits=2, sink_format="int2"), **base).close()  # the history's: not tiered
    assert pool.stats().used_pages == 0
