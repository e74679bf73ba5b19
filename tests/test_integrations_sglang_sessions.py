"""Every SGLang allocation's caches are one SessionManager session (pagedqvg.integrations.sglang.sessions), driven
through the hooks' code paths by stand-in stages whose `forward` follows SGLang 0.5.23's control flow:

- the base / LongLive2 stage: caches kept on the stage (`causal_kv_cache`, with CFG also `causal_kv_cache_neg`),
  allocated when None, else reset; after each request (returned or raised) the pool holds 0 pages, every session
  is closed, and the stage allocates (and is admitted) afresh at the next request;
- LingBot-World's realtime path: the caches live in the request's `RealtimeSession` state across chunk calls, stay
  open between calls, and are closed when SGLang disposes the state (release, eviction) or replaces them (block 0);
- admission: a list whose planned peak does not fit is refused with SessionRefusedError naming the stage and the
  pages, before any token is written, pool and sessions exactly as before (snapshot); bad allocation arguments
  raise CacheConfigError and change nothing; measured high water <= planned pages.
The same machinery through SGLang's real LongLive2 model and allocation: tests/sglang_longlive2_pages.py; through
SGLang's real LingBot-World stage forward and RealtimeSession: tests/sglang_lingbot_sessions.py (both with
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

from pagedqvg import BlockPool, CacheClosedError, CacheConfigError, QuantConfig, SessionRefusedError
from pagedqvg.allocator.pool import debug_state
from pagedqvg.integrations.sglang import integration as integ
from pagedqvg.integrations.sglang import sessions as sess
from pagedqvg.integrations.sglang.runtime import integration

PAGE = 4096
BLOCKS, HEADS, HEAD_DIM, PER_FRAME, FRAMES_PER_CHUNK, WINDOW_FRAMES, SINK_FRAMES = 2, 2, 16, 8, 2, 6, 1
STEPS = 3  # denoising passes, then the clean pass


def _allocate_sglang(self, *, batch_size, kv_cache_size, num_attention_heads, attention_head_dim, dtype, device,
                     use_int_indices=False, sink_tokens=0, global_sink_tokens=0, attention_window_size=None,
                     allow_growth=False):  # fmt: skip
    raise AssertionError("the hook builds paged caches; SGLang's own allocation is not called")


class Stage:
    """SGLang's causal stage as far as the hooks see it: blocks, chunk geometry, the cache attributes, and a forward
    that allocates when the stage holds no caches (else resets them), or keeps them in a realtime session state."""

    num_transformer_blocks = BLOCKS
    num_frames_per_block = FRAMES_PER_CHUNK
    num_token_per_frame = PER_FRAME
    _kv_quant_args = None

    def __init__(self, fail_at_chunk: int | None = None) -> None:
        self.causal_kv_cache = self.crossattn_cache = self.causal_kv_cache_neg = self.crossattn_cache_neg = None
        self.fail_at_chunk = fail_at_chunk

    def _allocate_causal_kv_cache(self, **kwargs):
        return integ.allocate_around(_allocate_sglang, self, **kwargs)

    def allocate(self, batch=1):
        return self._allocate_causal_kv_cache(
            batch_size=batch, kv_cache_size=WINDOW_FRAMES * PER_FRAME, num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM, dtype=torch.float32, device="cpu", use_int_indices=True,
            sink_tokens=SINK_FRAMES * PER_FRAME,
        )  # fmt: skip

    def run(self, caches_sets, chunks, first_chunk=0):
        n = FRAMES_PER_CHUNK * PER_FRAME
        for k in range(first_chunk, first_chunk + chunks):
            if k == self.fail_at_chunk:
                raise RuntimeError(f"injected failure at chunk {k}")
            kv = torch.randn(2, 1, n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(k))
            for _ in range(STEPS + 1):
                for caches in caches_sets:
                    for cache in caches:
                        cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=k * n)

    def forward(self, batch, server_args=None):
        """The base / LongLive2 flow: stage-held caches (and negative ones with CFG), allocated or reset."""
        if self.causal_kv_cache is None:
            self.causal_kv_cache, self.crossattn_cache = self.allocate(), ["cross"] * BLOCKS
        else:
            for cache in self.causal_kv_cache:
                cache.reset_indices()
        sets = [self.causal_kv_cache]
        if batch.cfg:
            if self.causal_kv_cache_neg is None:
                self.causal_kv_cache_neg, self.crossattn_cache_neg = self.allocate(), ["cross"] * BLOCKS
            sets.append(self.causal_kv_cache_neg)
        self.run(sets, batch.chunks)
        return batch

    def realtime_forward(self, batch, server_args=None):
        """LingBot-World's realtime flow: the caches in the session's state, new at block 0, one chunk a call."""
        state = batch.session._states.setdefault("causal", types.SimpleNamespace(kv_cache=None))
        if batch.block_idx == 0 or state.kv_cache is None:
            state.kv_cache = self.allocate()
        self.run([state.kv_cache], 1, first_chunk=batch.block_idx)
        return batch


def request(stage, method="forward", **batch):
    batch = types.SimpleNamespace(**({"cfg": False, "chunks": 5, "session": None} | batch))
    return sess.forward_around(getattr(type(stage), method), stage, batch, None)


@pytest.fixture
def pool():
    pool = BlockPool(capacity_bytes=400 * PAGE, page_bytes=PAGE)
    integration().configure(pool=pool)
    yield pool
    integration().reset()


def used(pool: BlockPool) -> int:
    return pool.num_pages - pool.num_free_pages


@pytest.mark.parametrize("quant", [None, "int2"])
@pytest.mark.parametrize("cfg", [False, True], ids=["one_set", "cfg"])
def test_each_request_ends_with_every_page_back(pool, cfg, quant):
    if quant:
        quant = QuantConfig.from_dict({"kv_cache_quant": "int2", "kv_cache_quant_centroids": "4",
                                       "kv_cache_quant_block_size": "16", "kv_cache_quant_iters": "1"})  # fmt: skip
        integration().configure(pool=pool, quant=quant, quant_override=True)
    stage = Stage()
    manager = sess.manager_for(pool)
    peaks = []
    for _ in range(3):
        pool.reset_high_water()
        request(stage, cfg=cfg)
        assert used(pool) == 0 and manager.open_sessions == 0, "every page back after the request"
        assert stage.causal_kv_cache is None and stage.causal_kv_cache_neg is None and stage.crossattn_cache is None
        peaks.append(pool.stats().high_water_pages)
    planned = manager.planned_pages(sess.session_spec(stage, stage.allocate(), allow_growth=False))
    print(f"sessions: peak {peaks} pages per request, planned {planned} per cache list (cfg={cfg}, quant={quant})")
    assert peaks[0] > 0 and peaks == peaks[:1] * 3, "the same request, the same peak"
    assert peaks[0] <= planned * (2 if cfg else 1), "measured peak within the admitted plan"
    pool.check()


def test_a_raising_request_also_gives_every_page_back(pool):
    stage = Stage(fail_at_chunk=2)
    with pytest.raises(RuntimeError, match="injected failure at chunk 2"):
        request(stage, cfg=True)
    assert used(pool) == 0 and sess.manager_for(pool).open_sessions == 0 and stage.causal_kv_cache is None
    stage.fail_at_chunk = None
    request(stage)  # the next request allocates afresh and works
    assert used(pool) == 0
    pool.check()


def test_closed_caches_held_elsewhere_refuse_calls(pool):
    stage = Stage()
    kept = []
    original = Stage.run

    def keep(self, sets, chunks, first_chunk=0):
        kept.append(sets[0][0])
        return original(self, sets, chunks, first_chunk)

    stage.run = types.MethodType(keep, stage)
    request(stage)
    with pytest.raises(CacheClosedError, match="after close"):
        zeros = torch.zeros(1, 16, HEADS, HEAD_DIM)
        kept[0].update_and_get_attention_kv(key=zeros, value=zeros, current_chunk_start=0)


def test_realtime_session_keeps_its_caches_across_calls_until_disposed(pool):
    stage = Stage()
    manager = sess.manager_for(pool)
    rt = types.SimpleNamespace(_states={})
    for block in range(4):
        request(stage, "realtime_forward", session=rt, block_idx=block)
        caches = rt._states["causal"].kv_cache
        assert isinstance(caches, sess.SessionCaches) and not caches.session.closed
        assert used(pool) > 0 and manager.open_sessions == 1, "SGLang keeps them for the next chunk"
    held, owners = used(pool), [c.owner for c in caches]
    del caches
    request(stage, "realtime_forward", session=rt, block_idx=0)  # a restart: new caches, the old list dropped
    assert manager.reclaimed == 1 and manager.open_sessions == 1 and used(pool) < held
    assert all(pool.pages_of(owner) == 0 for owner in owners)
    sess.dispose_before(rt._states["causal"])  # SGLang releases the session
    assert used(pool) == 0 and manager.open_sessions == 0
    request(stage, "realtime_forward", session=types.SimpleNamespace(_states={}), block_idx=0)
    pool.check()


def test_admission_refused_before_any_token_names_stage_and_pages(pool):
    stage = Stage()
    manager = sess.manager_for(pool)
    spec = sess.session_spec(stage, stage.allocate(), allow_growth=False)
    need = manager.planned_pages(spec)
    sessions = []
    while manager.available_pages() >= need:  # realtime sessions reserving their planned peaks
        rt = types.SimpleNamespace(_states={})
        request(stage, "realtime_forward", session=rt, block_idx=0)
        sessions.append(rt)
    before = debug_state(pool), manager.open_sessions, manager.reserved_pages()
    with pytest.raises(SessionRefusedError) as info:
        request(stage)
    err = info.value
    assert err.needed_pages == need and err.available_pages < need and err.free_pages == pool.num_free_pages
    message = str(err)
    for fragment in ("Stage: KV caches of 2 blocks", f"need {need} pages of {PAGE} B", "PAGEDQVG_BUDGET",
                     f"of {pool.num_pages} free", "reserved by open sessions"):  # fmt: skip
        assert fragment in message, (fragment, message)
    assert (debug_state(pool), manager.open_sessions, manager.reserved_pages()) == before
    sess.dispose_before(sessions[0]._states["causal"])
    request(stage)  # admitted once a realtime session is released
    assert manager.open_sessions == len(sessions) - 1
    pool.check()


def test_bad_allocation_arguments_change_nothing(pool):
    stage = Stage()
    manager = sess.manager_for(pool)
    before = debug_state(pool), manager.open_sessions
    with pytest.raises(CacheConfigError, match=r"Stage._allocate_causal_kv_cache: kv_cache_size must be an int >= 1"):
        stage._allocate_causal_kv_cache(batch_size=1, kv_cache_size=-4, num_attention_heads=HEADS,
                                        attention_head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")  # fmt: skip
    with pytest.raises(CacheConfigError, match=r"dtype torch.int32 is not supported"):
        stage._allocate_causal_kv_cache(batch_size=1, kv_cache_size=32, num_attention_heads=HEADS,
                                        attention_head_dim=HEAD_DIM, dtype=torch.int32, device="cpu")  # fmt: skip
    stage.num_transformer_blocks = 0
    with pytest.raises(CacheConfigError, match=r"num_transformer_blocks must be an int >= 1, got 0"):
        stage.allocate()
    assert (debug_state(pool), manager.open_sessions) == before


def test_a_list_dropped_outside_a_request_is_reclaimed_at_the_next_admission(pool):
    stage = Stage()
    manager = sess.manager_for(pool)
    caches = stage.allocate()
    stage.run([caches], 2)
    assert manager.open_sessions == 1 and used(pool) > 0
    del caches  # SGLang dropped the list: the session is abandoned
    stage.allocate()  # the next admission reclaims it first
    assert manager.reclaimed == 1 and used(pool) == 0


@pytest.mark.skipif(not os.environ.get("PAGEDQVG_SGLANG_SRC"), reason="PAGEDQVG_SGLANG_SRC (SGLang source) unset")
def test_real_lingbot_stage_keeps_realtime_caches_and_frees_the_rest():
    """tests/sglang_lingbot_sessions.py: SGLang's LingBot-World stage, 5 realtime chunk calls on one RealtimeSession
    (torch.equal to SGLang's dense cache), a restart at block 0, RealtimeSession.dispose(), 2 one-shot calls."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), *sys.path])}
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "sglang_lingbot_sessions.py"), os.environ["PAGEDQVG_SGLANG_SRC"]],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    assert all(res["latents_equal_dense"]) and res["restart_equals_first_chunk"]
    realtime = res["realtime_pages_and_open_sessions_after_each_call"]
    assert all(pages > 0 and opened == 1 for pages, opened in realtime), "SGLang keeps them across calls"
    assert res["reclaimed_at_restart"] == 1 and res["after_restart"] == [realtime[0][0], 1]
    assert res["after_dispose"] == [0, 0] and res["one_shot_after_each_call"] == [[0, 0], [0, 0]]
