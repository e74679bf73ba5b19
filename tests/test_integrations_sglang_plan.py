"""Plan == worker: the pool a worker builds at its first stage allocation is paged as `pagedqvg plan` pages the same
workload, and each request's admitted peak (its session's reservation) is the plan's pool pages, for the LongLive2
and LingBot-World presets (quantization off and compact). Stand-in stages with the presets' shapes and one layer (the
plan is computed for one layer too; the page choice does not depend on the layer count)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from pagedqvg import CacheConfigError, QuantConfig
from pagedqvg.cli.app import build_plan
from pagedqvg.integrations.sglang import allocation, plugin, sessions
from pagedqvg.integrations.sglang.runtime import PoolShape, integration
from pagedqvg.planning.presets import get_preset


@pytest.fixture
def state():
    integration().reset()
    yield integration()
    integration().reset()


def _setting(plan: dict) -> dict:
    return next(s for s in plan["settings"] if s["mode"] == plan["selected"])


def _stage(blocks: int, chunk_frames: int, tokens_per_frame: int):
    return types.SimpleNamespace(
        num_transformer_blocks=blocks, num_frames_per_block=chunk_frames, num_token_per_frame=tokens_per_frame
    )


def _allocate(stage, geometry: dict, w, **over):
    args = dict(
        batch_size=w.batch_size,
        kv_cache_size=geometry["cache_size_tokens"],
        num_attention_heads=geometry["heads_per_rank"],
        attention_head_dim=w.head_dim,
        dtype=w.torch_dtype,
        device="cpu",
        sink_tokens=geometry["sink_tokens"],
        global_sink_tokens=geometry["global_sink_tokens"],
    )
    return allocation.build_paged_caches(stage, **{**args, **over})


@pytest.mark.parametrize("quant", [QuantConfig(), QuantConfig.compact()], ids=["off", "compact"])
@pytest.mark.parametrize("preset", ["longlive2", "lingbot-world"])
def test_worker_page_and_admitted_peak_equal_pagedqvg_plan(state, preset, quant):
    w = get_preset(preset).replace(quant=quant)
    full = _setting(build_plan(w))  # the preset's plan (all layers): its page
    plan = build_plan(w.replace(layers=1))
    one, geometry = _setting(plan), plan["geometry"]
    assert one["page_bytes"] == full["page_bytes"]  # the planner's page does not depend on the layer count
    state.configure(budget_bytes=(one["pool_pages"] + 1) * one["page_bytes"], quant=quant, quant_override=True)
    with sessions.request_scope(None):
        caches = _allocate(_stage(1, w.chunk_frames, w.tokens_per_frame), geometry, w)
        pool = caches[0].pool
        assert pool.page_bytes == full["page_bytes"]  # plan == worker: the page
        assert caches.session.planned_pages == one["pool_pages"]  # plan == worker: the request's admitted peak
        assert pool.num_pages == one["pool_pages"] + 1
    assert pool.num_free_pages == pool.num_pages  # the request ended: every page back


def test_a_later_shape_shares_the_pool_and_its_waste_is_logged(state, caplog):
    """The first allocation's shapes choose the page; a later stage of other shapes shares the pool, and the
    plugin's log line reports that shape's page waste at the shared page (as `PoolShape.waste` computes it)."""
    w = get_preset("longlive2-mini")
    plan = build_plan(w.replace(layers=1))
    geometry = plan["geometry"]
    state.configure(budget_bytes=64 << 20)
    state.cache_listeners.append(plugin._announce_caches)
    with caplog.at_level(logging.INFO, logger="pagedqvg.sglang"), sessions.request_scope(None):
        first = _allocate(_stage(1, w.chunk_frames, w.tokens_per_frame), geometry, w)
        page = first[0].pool.page_bytes
        assert page == _setting(plan)["page_bytes"]
        tpf = w.tokens_per_frame  # a later stage: 1 head, 1-frame chunks, a 3-frame window, no sink
        later = _allocate(_stage(2, 1, tpf), geometry, w, num_attention_heads=1, kv_cache_size=3 * tpf,
                          sink_tokens=0, global_sink_tokens=0)  # fmt: skip
        assert later[0].pool is first[0].pool and page == later[0].pool.page_bytes
    shapes = list(state.pool_shapes["cpu"])
    assert len(shapes) == 2 and shapes[1].chunk_tokens == w.tokens_per_frame and shapes[1].num_heads == 1
    waste = shapes[1].waste(page)
    assert state.pool_shapes["cpu"][shapes[1]] == waste and 0 <= waste < 1
    line = f"pool cpu ({page} B pages): caches of {shapes[1].describe()} waste {waste:.2%} of their pages"
    assert line in caplog.text and f"in {first[0].pool.num_pages} pages of {page} bytes" in caplog.text


def test_a_later_shape_whose_records_do_not_fit_the_page_is_refused(state):
    """A record larger than the shared pool's page (here a packed shape's codebook row after a tiny dense shape
    chose a small page) is refused before any cache is built, naming both pages; the pool is unchanged."""
    state.configure(budget_bytes=1 << 20)
    dense = PoolShape(1, 4, 4, 1, torch.float32)
    pool = state.shared_pool("cpu", shape=dense)
    packed = PoolShape(1, 64, 4, 1, torch.float32, QuantConfig(bits=2, centroids=128).validate(head_dim=64))
    need = max(record for kind in packed.kinds() for record, _ in kind.regions)  # a 128 x 64 fp32 codebook row
    assert need == 128 * 64 * 4 > pool.page_bytes
    free = pool.num_free_pages
    wording = rf"at least {need} bytes .* pages of {pool.page_bytes} bytes \(chosen for 1x1"
    with pytest.raises(CacheConfigError, match=wording):
        state.shared_pool("cpu", shape=packed)
    assert pool.num_free_pages == free and list(state.pool_shapes["cpu"]) == [dense]
