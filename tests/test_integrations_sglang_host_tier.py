"""Realtime sessions on the host tier (PAGEDQVG_HOST_BUDGET; pagedqvg.integrations.sglang.sessions / runtime):
stand-in realtime stages whose `forward` follows LingBot-World's realtime flow in SGLang 0.5.23 (the caches live in
the request's `RealtimeSession` state across chunk calls, new at block 0) on a pool that holds exactly two sessions'
planned peaks (sized from the planner's census):

- three (and four) realtime sessions called round-robin: each admission that does not fit swaps the least recently
  used idle session out to the host pool, each session comes back at its next chunk call (at its first cache call);
  every chunk's views `torch.equal` to the same sessions run one at a time on a big pool without a host tier (quant
  off and int2); counters >= 1 swap-out and swap-in; after every request device pages only of resident sessions,
  host pages only of swapped ones; after SGLang disposes them 0 on both pools, `check()` clean;
- without the variable the third session is refused, as before (behaviour unchanged);
- a request's sessions are busy for the request (never a victim of an admission inside it);
- bad PAGEDQVG_HOST_BUDGET values / host_budget_bytes arguments refused with a message naming the value, nothing
  changed.
The same through SGLang's real LingBot-World stage and RealtimeSession: tests/sglang_lingbot_host_tier.py (with
PAGEDQVG_SGLANG_SRC).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from pagedqvg import BlockPool, CacheConfigError, QuantConfig, SessionRefusedError
from pagedqvg.allocator.pool import debug_state
from pagedqvg.integrations.sglang import integration as integ
from pagedqvg.integrations.sglang import plugin
from pagedqvg.integrations.sglang import sessions as sess
from pagedqvg.integrations.sglang.plugin import PluginConfigError, settings_from_env
from pagedqvg.integrations.sglang.runtime import integration

PAGE = 4096
BLOCKS, HEADS, HEAD_DIM, PER_FRAME, FRAMES_PER_CHUNK, WINDOW_FRAMES, SINK_FRAMES = 2, 2, 16, 8, 2, 6, 1
STEPS = 3  # denoising passes, then the clean pass
CHUNKS = 5  # 10 frames through a 6-frame window: it rolls
INT2 = {"kv_cache_quant": "int2", "kv_cache_quant_centroids": "4", "kv_cache_quant_block_size": "16",
        "kv_cache_quant_iters": "1", "kv_cache_quant_keep_recent": "0"}  # fmt: skip


def _allocate_sglang(self, *, batch_size, kv_cache_size, num_attention_heads, attention_head_dim, dtype, device,
                     use_int_indices=False, sink_tokens=0, global_sink_tokens=0, attention_window_size=None,
                     allow_growth=False):  # fmt: skip
    raise AssertionError("the hook builds paged caches; SGLang's own allocation is not called")


class RealtimeStage:
    """LingBot-World's realtime stage as far as the hooks see it: the caches in `batch.session._states` (SGLang's
    `RealtimeSession`), allocated at block 0 or when absent, one chunk (denoise steps + clean pass) per call; each
    session's K/V seeded by its `seed` and the block, so sessions differ and a mixed-up page would show."""

    num_transformer_blocks = BLOCKS
    num_frames_per_block = FRAMES_PER_CHUNK
    num_token_per_frame = PER_FRAME
    _kv_quant_args = None

    def __init__(self) -> None:
        self.causal_kv_cache = self.crossattn_cache = self.causal_kv_cache_neg = self.crossattn_cache_neg = None

    def _allocate_causal_kv_cache(self, **kwargs):
        return integ.allocate_around(_allocate_sglang, self, **kwargs)

    def allocate(self):
        return self._allocate_causal_kv_cache(
            batch_size=1, kv_cache_size=WINDOW_FRAMES * PER_FRAME, num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM, dtype=torch.float32, device="cpu", use_int_indices=True,
            sink_tokens=SINK_FRAMES * PER_FRAME,
        )  # fmt: skip

    def forward(self, batch, server_args=None):
        state = batch.session._states.setdefault("causal", types.SimpleNamespace(kv_cache=None))
        if batch.block_idx == 0 or state.kv_cache is None:
            state.kv_cache = self.allocate()
        n, k = FRAMES_PER_CHUNK * PER_FRAME, batch.block_idx
        kv = torch.randn(2, 1, n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1000 * batch.seed + k))
        views = []
        for step in range(STEPS + 1):
            for cache in state.kv_cache:
                view = cache.update_and_get_attention_kv(key=kv[0] * (step + 1), value=kv[1] - step,
                                                         current_chunk_start=k * n)  # fmt: skip
                views.append(torch.stack([view.k, view.v]).clone())
        batch.views = views
        return batch


class OneShotStage(RealtimeStage):
    """The base / LongLive2 flow: stage-held caches for one request of `chunks` chunks (no realtime session)."""

    def forward(self, batch, server_args=None):
        self.causal_kv_cache = self.allocate()
        n = FRAMES_PER_CHUNK * PER_FRAME
        for k in range(batch.chunks):
            kv = torch.randn(2, 1, n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(k))
            for cache in self.causal_kv_cache:
                cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=k * n)
        return batch


def chunk_call(stage, rt, seed: int, block: int):
    """One chunk call of realtime session `rt` through the forward hook (one request); the views it got."""
    batch = types.SimpleNamespace(session=rt, block_idx=block, seed=seed)
    return sess.forward_around(type(stage).forward, stage, batch, None).views


def new_session():
    return types.SimpleNamespace(_states={})


def dispose(rt) -> None:
    """SGLang's `RealtimeSession.dispose` (release, eviction): the state's dispose, hooked BEFORE."""
    sess.dispose_before(rt._states["causal"])
    rt._states.clear()


def used(pool: BlockPool) -> int:
    return pool.num_pages - pool.num_free_pages


def host_held(session) -> int:
    """Host pages a session's caches hold (a swapped-out one's; 0 when resident)."""
    host = session.manager.host_pool
    return sum(host.pages_of(c.owner) for cs in session.caches for c in cs)


def planned_pages(quant) -> int:
    """The planner's census of one realtime session's caches (its admitted peak in pages of PAGE bytes)."""
    big = BlockPool(capacity_bytes=400 * PAGE, page_bytes=PAGE)
    integration().configure(pool=big, quant=quant, quant_override=quant is not None)
    try:
        caches = RealtimeStage().allocate()
        spec = sess.session_spec(RealtimeStage(), caches, allow_growth=False)
        pages = caches.session.planned_pages
        assert pages == sess.manager_for(big).planned_pages(spec) > 0
        caches.session.close()
        return pages
    finally:
        integration().reset()


def quant_config(name):
    return None if name is None else QuantConfig.from_dict(INT2)


@pytest.fixture
def reset():
    yield
    integration().reset()


def one_at_a_time(quant, sessions: int) -> list[list[list[torch.Tensor]]]:
    """Each session's chunks run alone on a big pool without a host tier: views[session][chunk]."""
    pool = BlockPool(capacity_bytes=400 * PAGE, page_bytes=PAGE)
    integration().configure(pool=pool, quant=quant, quant_override=quant is not None)
    stage, out = RealtimeStage(), []
    try:
        for s in range(sessions):
            rt = new_session()
            out.append([chunk_call(stage, rt, s, k) for k in range(CHUNKS)])
            dispose(rt)
        assert used(pool) == 0
    finally:
        integration().reset()
    return out


@pytest.mark.parametrize("quant_name", [None, "int2"])
@pytest.mark.parametrize("sessions", [3, 4])
def test_round_robin_realtime_sessions_swap_out_and_back_bit_equal(reset, quant_name, sessions):
    quant = quant_config(quant_name)
    need = planned_pages(quant)
    want = one_at_a_time(quant, sessions)
    pool = BlockPool(capacity_bytes=2 * need * PAGE, page_bytes=PAGE)  # exactly two planned peaks
    assert pool.num_pages == 2 * need
    integration().configure(pool=pool, quant=quant, quant_override=quant is not None,
                            host_budget_bytes=(sessions - 1) * need * PAGE)  # fmt: skip
    manager, host = sess.manager_for(pool), integration().host_pool_for(pool)
    assert manager.host_pool is host and host.device.type == "cpu" and host.page_bytes == PAGE
    stage, rts = RealtimeStage(), [new_session() for _ in range(sessions)]
    got: list[list] = [[] for _ in range(sessions)]
    for k in range(CHUNKS):
        for s, rt in enumerate(rts):
            got[s].append(chunk_call(stage, rt, s, k))
            lists = [r._states["causal"].kv_cache for r in rts if r._states]
            resident = [c.session for c in lists if not c.session.swapped]
            swapped = [c.session for c in lists if c.session.swapped]
            assert not lists[s].session.swapped, "the session just called is resident"
            assert used(pool) == sum(x.held_pages() for x in resident), "device: only resident realtime sessions"
            assert used(host) == sum(host_held(x) for x in swapped), "host: only swapped ones"
            assert sess.host_pages_in_use([pool]) == used(host) and sess.pages_in_use([pool]) == used(pool)
            assert len(resident) <= 2 and manager.open_sessions == len(lists)
            pool.check()
            host.check()
    for s in range(sessions):
        for k in range(CHUNKS):
            assert len(got[s][k]) == len(want[s][k])
            for a, b in zip(got[s][k], want[s][k], strict=True):
                assert torch.equal(a, b), f"session {s} chunk {k}"
    print(f"host tier: {sessions} realtime sessions on a pool of 2 x {need} pages: {manager.swapped_out_total} "
          f"swap-outs, {manager.swapped_in_total} swap-ins (quant {quant_name})")  # fmt: skip
    assert manager.swapped_out_total >= 1 and manager.swapped_in_total >= 1
    # every admission after the first two and every later call finds its session's room taken by the two resident
    # ones: exactly one victim (the least recently used) each time, every call after round 0 a swap-in
    assert manager.swapped_out_total == sessions * CHUNKS - 2 and manager.swapped_in_total == sessions * (CHUNKS - 1)
    swapped_now = [rt for rt in rts if rt._states["causal"].kv_cache.session.swapped]
    assert swapped_now, "a session is parked on the host at the end"
    dispose(swapped_now[0])  # a swapped session's disposal frees its host pages
    assert used(host) == sum(host_held(rt._states["causal"].kv_cache.session) for rt in swapped_now[1:])
    for rt in rts:
        if rt._states:
            dispose(rt)
    assert used(pool) == 0 and used(host) == 0 and manager.open_sessions == 0
    pool.check()
    host.check()


def two_session_pool(quant=None, host_sessions: int = 0) -> tuple[BlockPool, int]:
    """A pool of exactly two realtime sessions' planned peaks, configured; a host tier of `host_sessions` peaks."""
    need = planned_pages(quant)
    pool = BlockPool(capacity_bytes=2 * need * PAGE, page_bytes=PAGE)
    integration().configure(pool=pool, quant=quant, quant_override=quant is not None,
                            host_budget_bytes=host_sessions * need * PAGE)  # fmt: skip
    return pool, need


def test_without_a_host_tier_the_third_session_is_refused_as_before(reset):
    pool, need = two_session_pool()
    stage, rts = RealtimeStage(), [new_session() for _ in range(3)]
    chunk_call(stage, rts[0], 0, 0)
    chunk_call(stage, rts[1], 1, 0)
    manager = sess.manager_for(pool)
    assert manager.host_pool is None and integration().host_pool_for(pool) is None
    before = debug_state(pool), manager.open_sessions, manager.reserved_pages()
    with pytest.raises(SessionRefusedError) as info:
        chunk_call(stage, rts[2], 2, 0)
    assert info.value.needed_pages == need and info.value.available_pages == 0
    message = str(info.value)
    assert "RealtimeStage: KV caches of 2 blocks" in message and "set PAGEDQVG_HOST_BUDGET" in message, message
    assert (debug_state(pool), manager.open_sessions, manager.reserved_pages()) == before
    for rt in rts[:2]:
        dispose(rt)
    assert used(pool) == 0


def test_a_requests_sessions_are_busy_for_the_request(reset):
    """Inside a chunk call of realtime session A (its request scope), an admission that needs room swaps out B,
    not A (the least recently used, but busy), and with nothing idle left is refused (nothing changed); after the
    call A is idle and swapped out for the next admission that needs its room."""
    pool = two_session_pool(host_sessions=2)[0]
    stage, a, b = RealtimeStage(), new_session(), new_session()
    chunk_call(stage, a, 0, 0)
    chunk_call(stage, b, 1, 0)
    manager = sess.manager_for(pool)
    session_a, session_b = (rt._states["causal"].kv_cache.session for rt in (a, b))
    with sess.request_scope(stage, types.SimpleNamespace(session=a)):  # A's next chunk call: A busy
        extra = RealtimeStage().allocate()  # admitted in this request: busy too
        assert session_b.swapped and not session_a.swapped and manager.swapped_out_total == 1
        before = debug_state(pool), debug_state(manager.host_pool), manager.open_sessions, manager.reserved_pages()
        with pytest.raises(SessionRefusedError) as info:
            RealtimeStage().allocate()
        message = str(info.value)
        assert "or PAGEDQVG_HOST_BUDGET" in message and "swap_when_full swapped 0 idle session(s)" in message, message
        assert (debug_state(pool), debug_state(manager.host_pool), manager.open_sessions,
                manager.reserved_pages()) == before  # fmt: skip
    assert extra.session.closed, "the request's own list closed at its end"
    later = [RealtimeStage().allocate() for _ in range(2)]  # outside a request A is idle: the second swaps it out
    assert session_a.swapped and manager.swapped_out_total == 2
    for caches in later:
        caches.session.close()
    for rt in (a, b):
        dispose(rt)
    assert used(pool) == 0 and used(manager.host_pool) == 0 and manager.open_sessions == 0


def test_a_one_shot_request_swaps_an_idle_realtime_session_out_and_it_comes_back(reset):
    want = one_at_a_time(None, 2)
    pool = two_session_pool(host_sessions=2)[0]
    stage, a, b = RealtimeStage(), new_session(), new_session()
    chunk_call(stage, a, 0, 0)
    chunk_call(stage, b, 1, 0)
    manager, host = sess.manager_for(pool), integration().host_pool_for(pool)
    one_shot = OneShotStage()
    batch = types.SimpleNamespace(session=None, chunks=CHUNKS)
    sess.forward_around(OneShotStage.forward, one_shot, batch, None)  # needs a session's room: A goes
    session_a, session_b = (rt._states["causal"].kv_cache.session for rt in (a, b))
    assert session_a.swapped and not session_b.swapped and one_shot.causal_kv_cache is None
    assert used(pool) == session_b.held_pages() and used(host) == host_held(session_a) > 0
    got = chunk_call(stage, a, 0, 1)  # back at its first cache call
    assert not session_a.swapped and manager.swapped_in_total == 1 and used(host) == 0
    assert all(torch.equal(x, y) for x, y in zip(got, want[0][1], strict=True))
    for rt in (a, b):
        dispose(rt)
    assert used(pool) == 0 and used(host) == 0


def test_a_restart_of_a_swapped_session_frees_its_host_pages(reset):
    pool = two_session_pool(host_sessions=2)[0]
    stage, rts = RealtimeStage(), [new_session() for _ in range(3)]
    for s, rt in enumerate(rts):
        chunk_call(stage, rt, s, 0)
        chunk_call(stage, rt, s, 1)
    manager, host = sess.manager_for(pool), integration().host_pool_for(pool)
    old = rts[0]._states["causal"].kv_cache.session
    assert old.swapped and used(host) == host_held(old) > 0
    del old
    chunk_call(stage, rts[0], 0, 0)  # block 0: new caches; the swapped list is dropped and reclaimed
    assert manager.reclaimed == 1 and used(host) == sum(host_held(rt._states["causal"].kv_cache.session) for rt in rts)
    for rt in rts:
        dispose(rt)
    assert used(pool) == 0 and used(host) == 0 and manager.open_sessions == 0
    pool.check()
    host.check()


# ---------------------------------------------------------------- the variable and the arguments
BAD = [
    ("-1GiB", "below one page"),
    ("512KiB", "below one page"),
    ("lots", "is not a size"),
    ("24XiB", "is not a size"),
    ("1.5", "whole number of bytes"),
    ("", "is not a size"),
]


@pytest.mark.parametrize(("raw", "fragment"), BAD)
def test_bad_host_budget_values_are_refused_naming_the_value(raw, fragment):
    with pytest.raises(PluginConfigError) as info:
        settings_from_env({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_HOST_BUDGET": raw})
    message = str(info.value)
    assert f"PAGEDQVG_HOST_BUDGET={raw!r}" in message and fragment in message and "valid" in message, message


@pytest.mark.parametrize("env", [{}, {"PAGEDQVG": "on"}, {"PAGEDQVG_KV_CACHE_QUANT": "int2"}])
def test_a_host_budget_without_a_device_budget_is_refused(env):
    with pytest.raises(PluginConfigError) as info:
        settings_from_env({**env, "PAGEDQVG_HOST_BUDGET": "8GiB"})
    message = str(info.value)
    assert "PAGEDQVG_HOST_BUDGET='8GiB'" in message, message
    assert "neither PAGEDQVG_BUDGET nor PAGEDQVG_MEMORY_FRACTION" in message, message


def test_register_stops_the_process_on_a_bad_host_budget(monkeypatch):
    for key in [k for k in os.environ if k.startswith("PAGEDQVG")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PAGEDQVG_BUDGET", "1GiB")
    monkeypatch.setenv("PAGEDQVG_HOST_BUDGET", "-3G")
    with pytest.raises(SystemExit) as info:
        plugin.register()
    assert str(info.value).startswith("pagedqvg: PAGEDQVG_HOST_BUDGET='-3G'")


@pytest.mark.parametrize(("raw", "size"), [("0", None), ("0GiB", None), ("48GiB", 48 << 30), ("1048576", 1 << 20)])
def test_host_budget_values(raw, size):
    s = settings_from_env({"PAGEDQVG_BUDGET": "24GiB", "PAGEDQVG_HOST_BUDGET": raw})
    assert s.active and s.host_budget_bytes == size
    assert ("host tier 51539607552 bytes" in s.describe()) == (size == 48 << 30)
    assert ("host tier" in s.describe()) == (size is not None)  # without one the line is as before
    fraction = settings_from_env({"PAGEDQVG_MEMORY_FRACTION": "0.5", "PAGEDQVG_HOST_BUDGET": raw})
    assert fraction.active and fraction.host_budget_bytes == size
    assert settings_from_env({"PAGEDQVG_BUDGET": "24GiB"}).host_budget_bytes is None  # unset: none
    assert not settings_from_env({"PAGEDQVG_HOST_BUDGET": "0"}).active  # 0 asks for nothing


@pytest.mark.parametrize("value", [-1, 1.5, "1GiB", True])
def test_bad_host_budget_arguments(reset, value):
    with pytest.raises(CacheConfigError, match=rf"host_budget_bytes must be None or an int >= 0.*got {value!r}"):
        integ.configure(budget_bytes=1 << 30, host_budget_bytes=value)
    assert integration().host_budget_bytes is None


def test_a_host_budget_below_one_page_is_refused_before_any_cache_is_built(reset):
    pool = BlockPool(capacity_bytes=64 * PAGE, page_bytes=PAGE)
    integration().configure(pool=pool, host_budget_bytes=PAGE - 256)
    before = debug_state(pool)
    with pytest.raises(CacheConfigError) as info:
        RealtimeStage().allocate()
    message = str(info.value)
    assert f"host_budget_bytes={PAGE - 256}" in message and f"at least {PAGE} bytes" in message, message
    assert debug_state(pool) == before and integration().pools == {} and integration().host_pools == {}


def test_the_plugin_configures_and_logs_the_host_tier(monkeypatch, caplog):
    """register() with PAGEDQVG_HOST_BUDGET: the startup line gives the host tier's size; the worker's first
    allocation makes the pool and its CPU host pool (same page) and logs both; each request's line gives the host
    pages in use and the swap counts."""
    import logging

    from pagedqvg.integrations.sglang.versions import CURRENT, targets_for

    for key in [k for k in os.environ if k.startswith("PAGEDQVG")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PAGEDQVG_BUDGET", "2MiB")
    monkeypatch.setenv("PAGEDQVG_HOST_BUDGET", "4MiB")
    monkeypatch.setattr(plugin, "_check_sglang_version", lambda: targets_for(CURRENT))
    name = "sglang.multimodal_gen.runtime.platforms.plugins"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules[name].HookType = types.SimpleNamespace(AROUND="around", BEFORE="before")
    sys.modules[name].plugin_hook = lambda target, kind: lambda fn: fn
    monkeypatch.setattr(integration(), "request_listeners", [])
    monkeypatch.setattr(integration(), "cache_listeners", [])
    try:
        with caplog.at_level(logging.INFO, logger="pagedqvg.sglang"):
            plugin.register()
            assert integration().host_budget_bytes == 4 << 20 and integration().budget_bytes == 2 << 20
            assert f"budget {2 << 20} bytes, host tier {4 << 20} bytes (PAGEDQVG_HOST_BUDGET" in caplog.text
            rt = new_session()
            chunk_call(RealtimeStage(), rt, 0, 0)
        pool = integration().shared_pool("cpu")
        host = integration().host_pool_for(pool)
        assert sess.manager_for(pool).host_pool is host and host.page_bytes == pool.page_bytes
        assert host.num_pages == (4 << 20) // pool.page_bytes and host.device.type == "cpu" and not host.pinned
        assert f"host tier cpu: {host.num_pages * host.page_bytes} bytes in {host.num_pages} pages" in caplog.text
        assert f"host tier 0 of {host.num_pages} pages in use (swapped-out sessions); 0 swap-outs" in caplog.text
        dispose(rt)
        assert used(pool) == 0 and used(host) == 0
    finally:
        integration().reset()


@pytest.mark.skipif(not os.environ.get("PAGEDQVG_SGLANG_SRC"), reason="PAGEDQVG_SGLANG_SRC (SGLang source) unset")
def test_real_lingbot_realtime_sessions_on_the_host_tier():
    """tests/sglang_lingbot_host_tier.py: SGLang's LingBot-World stage, three RealtimeSessions (bound by id through
    SGLang's RealtimeSessionCache) called round-robin on a pool that holds two (sized from the planner's census), a
    host tier: every chunk torch.equal to the sessions run one at a time on a big pool, 0 pages on both tiers after
    SGLang releases them; without the host tier the third is refused; with the worker's max_sessions=1 the second
    session evicts the first (its pages back)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), *sys.path])}
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "sglang_lingbot_host_tier.py"), os.environ["PAGEDQVG_SGLANG_SRC"]],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    assert res["pool_pages"] == 2 * res["planned_pages"] and res["sessions"] >= 3
    assert res["refused_without_host_tier"], "the pool holds two: the third is refused without a host tier"
    assert all(res["chunks_equal_one_at_a_time"]) and len(res["chunks_equal_one_at_a_time"]) == res["calls"]
    assert res["swapped_out_total"] >= 1 and res["swapped_in_total"] >= 1
    assert all(device == resident and host == parked for device, resident, host, parked in res["after_each_call"])
    assert max(device for device, _, _, _ in res["after_each_call"]) <= res["pool_pages"]
    assert any(res["swapped_at_end"]) and max(host for _, _, host, _ in res["after_each_call"]) > 0
    assert res["after_release"] == [0, 0, 0]
    # SGLang's worker binds sessions through RealtimeSessionCache(max_sessions=1): the second evicts the first
    first, second, released = res["worker_default_max_sessions_1"]
    assert first[2] == second[2] == 1 and first[1] == second[1] == 0 and released == [0, 0, 0]
