"""pagedqvg/planning/presets.py: the model workloads, their CPU-sized minis, the GPU table and the lookups.

The token numbers are the published shapes (README "Presets"): checked here field by field so a typo in a preset
cannot silently move every plan; the lookups name the known values in their errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pagedqvg.planning.presets import (
    DEFAULT_PLAN_PRESET,
    DEFAULT_SIMULATE_PRESET,
    GPUS,
    MINI_TOKENS_PER_FRAME,
    PRESETS,
    Workload,
    get_gpu,
    get_preset,
    mini,
    quant_as_dict,
    shape_text,
)
from pagedqvg.quant import QuantConfig

# name: (layers, heads, head_dim, tokens/frame, chunk, sink, window frames, global sink, scene cut every)
SHAPES = {
    "lingbot-world": (40, 40, 128, 1560, 3, 3, 18, True, 0),
    "longlive2": (30, 24, 128, 880, 8, 8, 32, False, 10),
    "self-forcing": (30, 12, 128, 1560, 3, 3, 21, True, 0),
}


def test_full_size_presets_have_the_published_shapes():
    assert set(PRESETS) == set(SHAPES) | {f"{n}-mini" for n in SHAPES}
    for name, shape in SHAPES.items():
        w = PRESETS[name]
        assert w.name == name
        got = (w.layers, w.heads, w.head_dim, w.tokens_per_frame, w.chunk_frames, w.sink_frames, w.window_frames,
               w.global_sink, w.scene_cut_every)  # fmt: skip
        assert got == shape, name
        assert w.weights_bytes > 0 and w.weights_source and w.quant == QuantConfig() and w.page_bytes is None
        assert (w.batch_size, w.dtype, w.torch_dtype, w.ranks) == (1, "bf16", torch.bfloat16, 1)


def test_minis_keep_the_call_pattern_and_shrink_the_shape():
    for name in SHAPES:
        full, m = PRESETS[name], PRESETS[f"{name}-mini"]
        assert m == mini(full)
        small = (m.layers, m.heads, m.head_dim, m.tokens_per_frame, m.weights_bytes)
        assert small == (4, 4, 64, MINI_TOKENS_PER_FRAME, 0)
        same = [f.name for f in dataclasses.fields(Workload)
                if f.name not in ("name", "layers", "heads", "head_dim", "tokens_per_frame", "weights_bytes",
                                  "weights_source", "description")]  # fmt: skip
        assert [getattr(m, f) for f in same] == [getattr(full, f) for f in same]
    assert DEFAULT_SIMULATE_PRESET in PRESETS and DEFAULT_PLAN_PRESET in PRESETS


def test_lookups_and_their_errors():
    assert get_preset("longlive2") is PRESETS["longlive2"]
    with pytest.raises(ValueError, match=r"unknown preset 'lingbot'; known presets: lingbot-world, longlive2, "):
        get_preset("lingbot")
    assert get_gpu("h200") == ("H200", GPUS["H200"][0], GPUS["H200"][1])
    assert get_gpu("a100 80gb")[0] == get_gpu("A100-80GB")[0] == "A100-80GB"
    assert get_gpu("RTX 6000 Ada")[0] == "RTX6000-ADA"
    with pytest.raises(ValueError, match=r"--gpu 'A100' is not in the device table; known: H200, H100, .*--budget"):
        get_gpu("A100")  # ambiguous: 40 or 80 GB
    assert GPUS["H200"][0] == 143771 << 20


def test_replace_ignores_none_and_as_dict_is_json_ready():
    w = PRESETS["lingbot-world"]
    r = w.replace(chunks=7, page_bytes=None, quant=QuantConfig(bits=2))
    assert (r.chunks, r.page_bytes, r.quant.bits, w.chunks) == (7, None, 2, 20)
    d = json.loads(json.dumps(r.as_dict()))
    assert d["chunks"] == 7 and d["quant"] == quant_as_dict(QuantConfig(bits=2)) and d["quant"]["mode"] == "int2"
    assert set(d) == {f.name for f in dataclasses.fields(Workload)}
    q = quant_as_dict(QuantConfig.compact())
    assert q["mode"] == "compact"
    assert QuantConfig(**{k: v for k, v in q.items() if k != "mode"}) == QuantConfig.compact()
    assert w.replace(ulysses=2, tp=4).ranks == 8


def test_shape_text_follows_overrides():
    assert shape_text(PRESETS["lingbot-world"]) == "3-frame chunks, 3-frame global sink, 18-frame window"
    assert shape_text(PRESETS["longlive2"]) == "8-frame chunks, 8-frame sink re-pinned every 10 chunks, 32-frame window"
    w = PRESETS["self-forcing"].replace(sink_tokens=0, cache_size_tokens=4096)
    assert shape_text(w) == "3-frame chunks, no sink, cache 4096 tokens"
    w = PRESETS["longlive2"].replace(sink_tokens=100, global_sink_tokens=50)
    want = "8-frame chunks, 100-token sink, 50-token global sink re-pinned every 10 chunks, 32-frame window"
    assert shape_text(w) == want
