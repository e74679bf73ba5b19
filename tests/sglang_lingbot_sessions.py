"""SGLang 0.5.23's real `LingBotWorldCausalDMDDenoisingStage.forward` (tests/test_integrations_sglang_lingbot.py's
tiny random-weight transformer, CPU) with pagedqvg installed: what the pool holds around each request.

- realtime: 5 chunk calls over one `RealtimeSession` (SGLang keeps the caches in the session's state across calls):
  after each call the pages in use and the open sessions (1: kept), every chunk's latents torch.equal to SGLang's
  dense cache; then a restart at block 0 on the same session (new caches; the old list dropped: reclaimed), then
  SGLang's `RealtimeSession.dispose()` (release / eviction): pages after it;
- one-shot: 2 calls without a realtime session (SGLang disposes the state at the end of the call): pages after each.
Prints one JSON object. Usage: python tests/sglang_lingbot_sessions.py SGLANG_SRC (as tests/sglang_longlive2_pages.py;
SGLang's sgl-kernel CPU ops routed to torch by .ci/sglang_ci_cpu_ops). About a minute of imports, then seconds.
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def setup(src: str):
    sys.path.insert(0, HERE)
    import sglang_longlive2_pages as harness

    harness._sglang(src)  # SGLang's import path, placeholders, one-process model-parallel group
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), ".ci", "sglang_ci_cpu_ops"))
    import sglang_ci_cpu_ops
    import test_integrations_sglang_lingbot as lingbot
    from sglang.multimodal_gen.configs.models.dits.lingbot_world import LingBotWorldVideoConfig
    from sglang.multimodal_gen.runtime.models.dits.lingbot_world import CausalLingBotWorldTransformer3DModel
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks

    sglang_ci_cpu_ops.register()
    apply_plugin_hooks()
    config = LingBotWorldVideoConfig()
    for key, value in lingbot.ARCH.items():
        setattr(config.arch_config, key, value)
    config.arch_config.__post_init__()
    net = CausalLingBotWorldTransformer3DModel(config, {})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)
    return lingbot, net


def calls(lingbot, net, blocks: list[int], session, observe) -> list[torch.Tensor]:
    """SGLang's LingBot stage called once per entry of `blocks` (its block_idx), as lingbot.run_chunks does;
    `observe()` after each call."""
    from types import SimpleNamespace

    from sglang.multimodal_gen.configs.pipeline_configs.lingbot_world import LingBotWorldCausalDMDConfig
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.models.schedulers.scheduling_self_forcing_flow_match import (
        SelfForcingFlowMatchScheduler,
    )
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world import (
        lingbot_world_causal_denoising as stages,
    )

    pipeline = LingBotWorldCausalDMDConfig()
    server_args = SimpleNamespace(pipeline_config=pipeline, kv_cache_quant_config=QVGKVQuantArgs(),
                                  disable_autocast=False, attention_backend_config=None)  # fmt: skip
    scheduler = SelfForcingFlowMatchScheduler(num_inference_steps=1000, shift=pipeline.flow_shift, sigma_min=0.0,
                                              extra_one_step=True)  # fmt: skip
    stage = stages.LingBotWorldCausalDMDDenoisingStage(net, scheduler)
    hw, gen = lingbot.LATENT_HW, torch.Generator().manual_seed(1)
    condition = torch.randn(1, 20, 2 * lingbot.CHUNKS, hw, hw, generator=gen)
    prompt = torch.randn(1, lingbot.ARCH["text_len"], lingbot.ARCH["text_dim"], generator=gen)
    out = []
    for i, block in enumerate(blocks):
        req = Req(sampling_params=SamplingParams(), session=session, block_idx=block, image_latent=condition,
                  latents=torch.randn(1, 16, 2, hw, hw, generator=gen), scheduler=scheduler,
                  timesteps=torch.tensor([1000, 750, 500, 250]), prompt_embeds=[prompt],
                  generator=torch.Generator().manual_seed(100 + i))  # fmt: skip
        out.append(stage.forward(req, server_args).latents.clone())
        observe()
    return out


def main(src: str) -> dict:
    lingbot, net = setup(src)
    from sglang.multimodal_gen.runtime.realtime.session import RealtimeSession

    from pagedqvg.integrations.sglang import integration as integ
    from pagedqvg.integrations.sglang import sessions as sglang_sessions

    chunks = list(range(lingbot.CHUNKS))
    with torch.no_grad():
        dense = calls(lingbot, net, chunks, RealtimeSession(), lambda: None)  # SGLang's own caches
        integ.install(budget_bytes=64 << 20)
        try:
            seen: list[list[int]] = []

            def observe():
                pool = integ.shared_pool("cpu")
                manager = sglang_sessions.manager_for(pool)
                seen.append([pool.num_pages - pool.num_free_pages, manager.open_sessions])

            session = RealtimeSession()
            paged = calls(lingbot, net, chunks, session, observe)
            restart = calls(lingbot, net, [0], session, observe)
            reclaimed = sglang_sessions.manager_for(integ.shared_pool("cpu")).reclaimed
            session.dispose()  # SGLang releases the realtime session
            observe()
            calls(lingbot, net, [0, 0], None, observe)
        finally:
            integ.uninstall()
    return {
        "latents_equal_dense": [torch.equal(a, b) for a, b in zip(paged, dense, strict=True)],
        "restart_equals_first_chunk": torch.equal(restart[0], paged[0]),
        "realtime_pages_and_open_sessions_after_each_call": seen[: len(chunks)],
        "after_restart": seen[len(chunks)],
        "reclaimed_at_restart": reclaimed,
        "after_dispose": seen[len(chunks) + 1],
        "one_shot_after_each_call": seen[len(chunks) + 2 :],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
