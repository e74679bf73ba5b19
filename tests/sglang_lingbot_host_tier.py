"""SGLang 0.5.23's real `LingBotWorldCausalDMDDenoisingStage.forward` (tests/test_integrations_sglang_lingbot.py's
tiny random-weight transformer, CPU) with pagedqvg installed and a host tier: realtime sessions swapped out between
chunk calls and back.

- reference: SESSIONS `RealtimeSession`s, each run alone (its CHUNKS chunk calls, then `dispose()`) on a big pool
  without a host tier; the planner's census of one session (its admitted planned pages) and the pool's page;
- no host tier: a pool of exactly two planned peaks (`install(budget_bytes=2 x planned x page)`): the third
  session's first chunk call is refused (SessionRefusedError), the pool as before;
- host tier (`install(..., host_budget_bytes=...)`, what PAGEDQVG_HOST_BUDGET sets): the same pool, the SESSIONS
  sessions called round-robin (one shared stage, as SGLang's worker serves them): each admission or call that does
  not fit swaps out the least recently used idle session, each comes back at its next call; after each call the
  device pages in use vs the resident sessions' pages and the host pages vs the swapped sessions'; every chunk's
  latents torch.equal to the reference's; then `RealtimeSession.dispose()` of every session: pages on both pools.
Prints one JSON object. Usage: python tests/sglang_lingbot_host_tier.py SGLANG_SRC (as tests/sglang_lingbot_sessions.py;
SGLang's sgl-kernel CPU ops routed to torch by .ci/sglang_ci_cpu_ops). About a minute of imports, then a minute.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SESSIONS = 3


class Runner:
    """SGLang's LingBot stage (one instance, as a worker holds it) and each session's seeded inputs; `call` is one
    realtime chunk call (a `Req` with the session and its block index) through the stage's `forward`."""

    def __init__(self, lingbot, net) -> None:
        from sglang.multimodal_gen.configs.pipeline_configs.lingbot_world import LingBotWorldCausalDMDConfig
        from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
        from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world import (
            lingbot_world_causal_denoising as stages,
        )

        self.lingbot, self.pipeline = lingbot, LingBotWorldCausalDMDConfig()
        self.server_args = SimpleNamespace(pipeline_config=self.pipeline, kv_cache_quant_config=QVGKVQuantArgs(),
                                           disable_autocast=False, attention_backend_config=None)  # fmt: skip
        self.stage = stages.LingBotWorldCausalDMDDenoisingStage(net, self._scheduler())
        self.inputs = [self._inputs(1 + s) for s in range(SESSIONS)]
        self.schedulers = [self._scheduler() for _ in range(SESSIONS)]
        self.bound: dict[int, object] = {}

    def _scheduler(self):
        from sglang.multimodal_gen.runtime.models.schedulers.scheduling_self_forcing_flow_match import (
            SelfForcingFlowMatchScheduler,
        )

        return SelfForcingFlowMatchScheduler(num_inference_steps=1000, shift=self.pipeline.flow_shift, sigma_min=0.0,
                                             extra_one_step=True)  # fmt: skip

    def _inputs(self, seed: int):
        lingbot, hw = self.lingbot, self.lingbot.LATENT_HW
        gen = torch.Generator().manual_seed(seed)
        condition = torch.randn(1, 20, 2 * lingbot.CHUNKS, hw, hw, generator=gen)
        prompt = torch.randn(1, lingbot.ARCH["text_len"], lingbot.ARCH["text_dim"], generator=gen)
        latents = [torch.randn(1, 16, 2, hw, hw, generator=gen) for _ in range(lingbot.CHUNKS)]
        return condition, prompt, latents

    def call(self, s: int, sessions, block: int) -> torch.Tensor:
        """Chunk `block` of session `s`, bound to its `RealtimeSession` by id through `sessions` (SGLang's
        `RealtimeSessionCache`, as its GPU worker binds each chunk request: `attach(req)`); remembers the session
        object in `self.bound[s]`."""
        from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
        from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

        condition, prompt, latents = self.inputs[s]
        req = Req(sampling_params=SamplingParams(), realtime_session_id=f"session{s}", block_idx=block,
                  image_latent=condition, latents=latents[block].clone(), scheduler=self.schedulers[s],
                  timesteps=torch.tensor([1000, 750, 500, 250]), prompt_embeds=[prompt],
                  generator=torch.Generator().manual_seed(100 * s + block))  # fmt: skip
        sessions.attach(req)
        self.bound[s] = req.session
        return self.stage.forward(req, self.server_args).latents.clone()


def kept(session):
    """The pagedqvg session of the caches SGLang keeps in a RealtimeSession's state (None before its first call)."""
    from sglang.multimodal_gen.runtime.realtime.states import RealtimeCausalDiTState

    state = session.get_state(RealtimeCausalDiTState)
    return getattr(getattr(state, "kv_cache", None), "session", None)


def used(pool) -> int:
    return pool.num_pages - pool.num_free_pages


def session_cache(max_sessions: int):
    from sglang.multimodal_gen.runtime.realtime.session import RealtimeSessionCache

    return RealtimeSessionCache(max_sessions=max_sessions)


def reference(integ, runner, chunks: list[int]) -> tuple[list[list[torch.Tensor]], int, int]:
    """Each session alone on a big pool without a host tier: latents[session][chunk], planned pages, page bytes."""
    integ.install(budget_bytes=64 << 20)
    try:
        out, planned, sessions = [], 0, session_cache(SESSIONS)
        for s in range(SESSIONS):
            out.append([runner.call(s, sessions, k) for k in chunks])
            planned = max(planned, kept(runner.bound[s]).planned_pages)
            sessions.release(f"session{s}")  # SGLang's release_realtime_session
        pool = integ.shared_pool("cpu")
        assert used(pool) == 0
        return out, planned, pool.page_bytes
    finally:
        integ.uninstall()


def refused_without_host_tier(integ, runner, budget: int) -> tuple[bool, int, str]:
    """Two sessions admitted on the pool of two planned peaks, the third refused with the pool unchanged."""
    from pagedqvg import SessionRefusedError
    from pagedqvg.allocator.pool import debug_state

    integ.install(budget_bytes=budget)
    sessions = session_cache(SESSIONS)
    try:
        for s in range(2):
            runner.call(s, sessions, 0)
        pool = integ.shared_pool("cpu")
        before = debug_state(pool)
        try:
            runner.call(2, sessions, 0)
        except SessionRefusedError as exc:
            return debug_state(pool) == before, pool.num_pages, str(exc)
        return False, pool.num_pages, ""
    finally:
        for s in range(SESSIONS):
            sessions.release(f"session{s}")
        integ.uninstall()


def worker_default_evicts(integ, runner, budget: int) -> list[list[int]]:
    """SGLang's GPU worker binds sessions through RealtimeSessionCache(max_sessions=1) (gpu_worker.py:317): a second
    session evicts (disposes) the first. [device pages, host pages, open sessions] after each of two sessions'
    first chunk, then after the second's release."""
    integ.install(budget_bytes=budget, host_budget_bytes=budget)
    try:
        sessions, seen = session_cache(1), []
        for s in range(2):
            runner.call(s, sessions, 0)
            manager = sglang_manager(integ)
            seen.append([used(manager.pool), used(manager.host_pool), manager.open_sessions])
        sessions.release("session1")
        seen.append([used(manager.pool), used(manager.host_pool), manager.open_sessions])
        return seen
    finally:
        integ.uninstall()


def sglang_manager(integ):
    from pagedqvg.integrations.sglang import sessions as sglang_sessions

    return sglang_sessions.manager_for(integ.shared_pool("cpu"))


def main(src: str) -> dict:
    sys.path.insert(0, HERE)
    import sglang_lingbot_sessions

    lingbot, net = sglang_lingbot_sessions.setup(src)
    from pagedqvg.integrations.sglang import integration as integ

    chunks = list(range(lingbot.CHUNKS))
    with torch.no_grad():
        runner = Runner(lingbot, net)
        want, planned, page = reference(integ, runner, chunks)
        budget = 2 * planned * page
        refused, pool_pages, message = refused_without_host_tier(integ, runner, budget)
        evicted = worker_default_evicts(integ, runner, budget)
        # a host tier of two planned peaks: one parked session plus the swap-in room admissions keep free
        integ.install(budget_bytes=budget, host_budget_bytes=budget)
        try:
            sessions, equal, after = session_cache(SESSIONS), [], []
            runner.bound.clear()
            for k in chunks:
                for s in range(SESSIONS):
                    equal.append(torch.equal(runner.call(s, sessions, k), want[s][k]))
                    manager = sglang_manager(integ)  # the pool is made at the first allocation (the planner's page)
                    pool, host = manager.pool, manager.host_pool
                    open_ = [kept(runner.bound[x]) for x in sorted(runner.bound)]
                    resident = sum(x.held_pages() for x in open_ if not x.swapped)
                    parked = sum(host.pages_of(c.owner) for x in open_ if x.swapped for cs in x.caches for c in cs)
                    after.append([used(pool), resident, used(host), parked])
                    pool.check()
                    host.check()
            outs, ins = manager.swapped_out_total, manager.swapped_in_total
            swapped_at_end = [kept(runner.bound[s]).swapped for s in range(SESSIONS)]
            for s in range(SESSIONS):
                sessions.release(f"session{s}")  # SGLang releases them (a swapped one's host pages go back)
            after_release = [used(pool), used(host), manager.open_sessions]
        finally:
            integ.uninstall()
    return {
        "sessions": SESSIONS,
        "planned_pages": planned,
        "page_bytes": page,
        "pool_pages": pool_pages,
        "refused_without_host_tier": refused,
        "refusal": message,
        "calls": len(equal),
        "chunks_equal_one_at_a_time": equal,
        "swapped_out_total": outs,
        "swapped_in_total": ins,
        "swapped_at_end": swapped_at_end,
        "after_each_call": after,
        "after_release": after_release,
        "worker_default_max_sessions_1": evicted,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
