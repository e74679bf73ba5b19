"""QuantConfig: defaults, validation messages, describe(), from_dict with SGLang flag names."""

from __future__ import annotations

import dataclasses

import pytest

from pagedqvg.quant.config import QuantConfig


def test_defaults_match_sglang() -> None:
    cfg = QuantConfig()
    assert (cfg.bits, cfg.centroids, cfg.block_size, cfg.stages, cfg.kmeans_iters) == (None, 128, 64, 1, 2)
    assert (cfg.asymmetric, cfg.keep_recent_chunks, cfg.sink, cfg.sink_keep_chunks) == (False, 1, True, 0)
    assert cfg.seed == 1234 and cfg.pack_trits is False
    assert not cfg.enabled and cfg.mode == "off"
    assert QuantConfig(bits=2).enabled and QuantConfig(bits=4).mode == "int4"


def test_frozen_and_slots() -> None:
    cfg = QuantConfig(bits=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 2  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__")
    assert hash(cfg) == hash(QuantConfig(bits=4))


def test_qmax_and_levels() -> None:
    assert (QuantConfig(bits=2).qmax, QuantConfig(bits=2).levels) == (1, 3)
    assert (QuantConfig(bits=4).qmax, QuantConfig(bits=4).levels) == (7, 15)
    assert (QuantConfig(bits=2, asymmetric=True).qmax, QuantConfig(bits=2, asymmetric=True).levels) == (3, 4)
    assert (QuantConfig(bits=4, asymmetric=True).qmax, QuantConfig(bits=4, asymmetric=True).levels) == (15, 16)


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"bits": 3}, ["bits=3", "None", "2", "4"]),
        ({"bits": 8}, ["bits=8"]),
        ({"bits": True}, ["bits=True"]),
        ({"bits": 2.0}, ["bits=2.0"]),
        ({"centroids": 0}, ["centroids=0", "[1, 256]", "uint8"]),
        ({"centroids": 257}, ["centroids=257", "[1, 256]"]),
        ({"block_size": 0}, ["block_size=0", ">= 1"]),
        ({"stages": 0}, ["stages=0", ">= 1"]),
        ({"kmeans_iters": 0}, ["kmeans_iters=0", ">= 1"]),
        ({"keep_recent_chunks": -1}, ["keep_recent_chunks=-1", ">= 0"]),
        ({"sink_keep_chunks": -2}, ["sink_keep_chunks=-2", ">= 0"]),
        ({"seed": -1}, ["seed=-1"]),
        ({"asymmetric": 1}, ["asymmetric=1", "bool"]),
        ({"sink": "yes"}, ["sink='yes'", "bool"]),
        ({"bits": 4, "pack_trits": True}, ["pack_trits=True", "bits=4", "bits=2 with asymmetric=False"]),
        ({"bits": 2, "asymmetric": True, "pack_trits": True}, ["pack_trits", "asymmetric=True"]),
    ],
)
def test_validation_messages(kwargs: dict, needles: list[str]) -> None:
    with pytest.raises(ValueError) as exc:
        QuantConfig(**kwargs)
    for needle in needles:
        assert needle in str(exc.value), (needle, str(exc.value))


def test_validate_head_dim() -> None:
    cfg = QuantConfig(bits=2, block_size=48)
    with pytest.raises(ValueError, match=r"block_size=48 does not divide head_dim=128.*divisor of 128"):
        cfg.validate(head_dim=128)
    assert cfg.validate(head_dim=96) is cfg
    assert QuantConfig(bits=4).validate(head_dim=128) is not None
    with pytest.raises(ValueError, match="head_dim=6 at bits=2"):
        QuantConfig(bits=2, block_size=3).validate(head_dim=6)
    # trit packing has no whole-byte constraint
    QuantConfig(bits=2, block_size=3, pack_trits=True).validate(head_dim=6)
    with pytest.raises(ValueError, match="head_dim=0"):
        QuantConfig(bits=2).validate(head_dim=0)


def test_pack_trits_ignored_when_off() -> None:
    assert not QuantConfig(bits=None, pack_trits=True).enabled


def test_describe() -> None:
    assert "off" in QuantConfig().describe()
    text = QuantConfig(bits=2, stages=2, asymmetric=True, sink=False).describe()
    assert "int2" in text and "asym" in text and "2 stages" in text and "128 centroids" in text
    assert "sink kept dense" in text and "recent chunk(s) dense" in text and "\n" not in text and "bf16" not in text
    assert QuantConfig().describe() == "KV quantization off (dense cache)"
    assert "trit-packed" in QuantConfig(bits=2, pack_trits=True).describe()


def test_from_dict_sglang_names() -> None:
    cfg = QuantConfig.from_dict(
        {
            "kv_cache_quant": "int2",
            "kv_cache_quant_centroids": 64,
            "kv_cache_quant_block_size": 32,
            "kv_cache_quant_stages": 2,
            "kv_cache_quant_iters": 3,
            "kv_cache_quant_keep_recent": 2,
            "kv_cache_quant_sink_keep": 1,
            "kv_cache_quant_asymmetric": True,
            "kv_cache_quant_sink": False,
        }
    )
    assert cfg == QuantConfig(
        bits=2,
        centroids=64,
        block_size=32,
        stages=2,
        kmeans_iters=3,
        keep_recent_chunks=2,
        sink_keep_chunks=1,
        asymmetric=True,
        sink=False,
    )


def test_from_dict_dashes_and_strings() -> None:
    cfg = QuantConfig.from_dict(
        {
            "--kv-cache-quant": "INT4",
            "--kv-cache-quant-centroids": "256",
            "kv-cache-quant-asymmetric": "true",
            "--kv-cache-quant-sink": "0",
            "--kv-cache-quant-seed": "7",
        }
    )
    assert cfg == QuantConfig(bits=4, centroids=256, asymmetric=True, sink=False, seed=7)
    for mode in ("off", "none", "bf16"):
        assert QuantConfig.from_dict({"kv_cache_quant": mode}).bits is None
    assert QuantConfig.from_dict({"bits": 2, "pack_trits": "yes"}).pack_trits
    assert QuantConfig.from_dict({}) == QuantConfig()


def test_from_dict_errors() -> None:
    with pytest.raises(ValueError) as exc:
        QuantConfig.from_dict({"kv_cache_quant_centroid": 64})
    msg = str(exc.value)
    assert "kv_cache_quant_centroid" in msg and "kv_cache_quant_centroids" in msg and "kv_cache_quant_sink_keep" in msg
    with pytest.raises(ValueError, match=r"kv_cache_quant='int3'.*off, none, bf16, int4, int2"):
        QuantConfig.from_dict({"kv_cache_quant": "int3"})
    with pytest.raises(ValueError, match="not a boolean"):
        QuantConfig.from_dict({"kv_cache_quant_sink": "maybe"})
    with pytest.raises(ValueError, match="not an integer"):
        QuantConfig.from_dict({"kv_cache_quant_centroids": "many"})
    with pytest.raises(ValueError, match="given twice"):
        QuantConfig.from_dict({"kv_cache_quant": "int2", "bits": 2})
    with pytest.raises(ValueError, match=r"centroids=512"):
        QuantConfig.from_dict({"kv_cache_quant": "int2", "kv_cache_quant_centroids": 512})
