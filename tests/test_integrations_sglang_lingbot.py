"""LingBot-World in-process: a tiny random-weight `CausalLingBotWorldTransformer3DModel` (2 blocks x 2 heads x 16
channels, 16 tokens per 8x8 latent frame, 2 frames per chunk, window 4 frames, 1 sink frame) through SGLang
0.5.23's real `LingBotWorldCausalDMDDenoisingStage.forward`, one chunk per call over a `RealtimeSession` (as
SGLang's realtime server drives it), caches allocated by the stage's own `_allocate_causal_kv_cache`:

- SGLang's dense cache vs pagedqvg through `install()`, quantization off: every chunk's latents torch.equal;
- `--kv-cache-quant int2` (SGLang's `QVGKVQuantArgs`) and pagedqvg's compact mode through `install()`: the
  latents differ from the dense run by a relative error measured and bounded below.

Runs where SGLang 0.5.23 and its runtime dependencies are importable: .ci/sglang_runtime.sh (after its installs;
a single-process gloo group as SGLang's unit-test conftest sets up). Elsewhere it skips. Not in
.ci/sglang_suite.sh: with msgspec a placeholder there, SGLang's distributed init fails (`unknown parallel field(s)`,
sglang/srt/runtime_context.py:416). SGLang's sgl-kernel CPU ops are routed to torch by the test-only
.ci/sglang_ci_cpu_ops hooks (applied before the model is built: SGLang binds them then).
"""

from __future__ import annotations

import os
import socket
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising")

from pagedqvg import QuantConfig
from pagedqvg.integrations.sglang import integration as integ

CI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci")
#: Tiny LingBot-World: heads x head_dim, layers, ffn, text dim; latent frames of 8x8 (2x2 patches: 16 tokens).
ARCH = dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=36, out_channels=16, text_dim=32, freq_dim=256,
    ffn_dim=64, num_layers=2, num_frames_per_block=2, sink_size=1, sliding_window_num_frames=4, text_len=8,
)  # fmt: skip
LATENT_HW = 8
#: 5 chunks of 2 frames: 10 frames through a 4-frame window, so the window rolls (asserted below).
CHUNKS = 5
#: Bounds on ||quantized - dense|| / ||dense|| over all chunks' latents (measured values in the README).
INT2_BOUND = 0.05
COMPACT_BOUND = 0.05
#: int2 as SGLang's flags give it (`--kv-cache-quant int2 --kv-cache-quant-centroids 2 ...`; every chunk packs) and
#: pagedqvg's compact mode at this head_dim (block 16 instead of 128).
INT2 = dict(bits=2, centroids=2, block_size=16, keep_recent_chunks=0)
COMPACT = QuantConfig.compact(centroids=2, block_size=16, keep_recent_chunks=0)


def _free_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def model():
    """SGLang's single-process model-parallel group, its unit tests' global ServerArgs, its CPU-op hooks, and the
    seeded tiny transformer."""
    from sglang.multimodal_gen.configs.models.dits.lingbot_world import LingBotWorldVideoConfig
    from sglang.multimodal_gen.runtime.distributed.parallel_state import (
        maybe_init_distributed_environment_and_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.multimodal_gen.runtime.models.dits.lingbot_world import CausalLingBotWorldTransformer3DModel
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks
    from sglang.multimodal_gen.runtime.server_args import server_args as server_args_module
    from sglang.multimodal_gen.test.unit.conftest import _make_unit_server_args  # SGLang's unit-test ServerArgs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_args_module, "_global_server_args", _make_unit_server_args())
        if not model_parallel_is_initialized():
            for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(), RANK="0", LOCAL_RANK="0",
                                   WORLD_SIZE="1").items():  # fmt: skip
                mp.setenv(key, value)
            maybe_init_distributed_environment_and_model_parallel(tp_size=1, sp_size=1)
        if "ci_cpu_ops" not in {e.name for e in entry_points(group="sglang.multimodal_gen.plugins")}:
            mp.syspath_prepend(os.path.join(CI, "sglang_ci_cpu_ops"))  # not installed: register its hooks here
            import sglang_ci_cpu_ops

            sglang_ci_cpu_ops.register()
        apply_plugin_hooks()  # loads the installed plugins (SGLANG_PLUGINS selects them), applies every hook
        config = LingBotWorldVideoConfig()
        for key, value in ARCH.items():
            setattr(config.arch_config, key, value)
        config.arch_config.__post_init__()
        net = CausalLingBotWorldTransformer3DModel(config, {})
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)
        yield net


def run_chunks(net, quant) -> tuple[list[torch.Tensor], list]:
    """CHUNKS realtime calls of SGLang's LingBot stage (fresh stage, one session, 4 DMD steps each); returns each
    chunk's latents and the session's per-block caches after the last chunk."""
    from sglang.multimodal_gen.configs.pipeline_configs.lingbot_world import LingBotWorldCausalDMDConfig
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.models.schedulers.scheduling_self_forcing_flow_match import (
        SelfForcingFlowMatchScheduler,
    )
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world import (
        lingbot_world_causal_denoising as lingbot,
    )
    from sglang.multimodal_gen.runtime.realtime.session import RealtimeSession
    from sglang.multimodal_gen.runtime.realtime.states import RealtimeCausalDiTState

    pipeline = LingBotWorldCausalDMDConfig()
    server_args = SimpleNamespace(pipeline_config=pipeline, kv_cache_quant_config=quant, disable_autocast=False,
                                  attention_backend_config=None)  # fmt: skip
    scheduler = SelfForcingFlowMatchScheduler(num_inference_steps=1000, shift=pipeline.flow_shift, sigma_min=0.0,
                                              extra_one_step=True)  # fmt: skip
    stage = lingbot.LingBotWorldCausalDMDDenoisingStage(net, scheduler)
    session = RealtimeSession()
    gen = torch.Generator().manual_seed(1)
    condition = torch.randn(1, 20, 2 * CHUNKS, LATENT_HW, LATENT_HW, generator=gen)
    prompt = torch.randn(1, ARCH["text_len"], ARCH["text_dim"], generator=gen)
    out = []
    for chunk in range(CHUNKS):
        req = Req(sampling_params=SamplingParams(), session=session, block_idx=chunk, image_latent=condition,
                  latents=torch.randn(1, 16, 2, LATENT_HW, LATENT_HW, generator=gen), scheduler=scheduler,
                  timesteps=torch.tensor([1000, 750, 500, 250]), prompt_embeds=[prompt],
                  generator=torch.Generator().manual_seed(100 + chunk))  # fmt: skip
        out.append(stage.forward(req, server_args).latents.clone())
    return out, session.get_state(RealtimeCausalDiTState).kv_cache


@pytest.fixture(scope="module")
def dense(model):
    """SGLang's own run (pagedqvg not installed): its dense `CausalSelfAttentionKVCache`s."""
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

    assert not integ.installed()
    latents, caches = run_chunks(model, QVGKVQuantArgs())
    assert type(caches[0]).__name__ == "CausalSelfAttentionKVCache" and len(caches) == ARCH["num_layers"]
    cache = caches[0]
    assert int(cache.global_end_index.item()) > cache.cache_size, "the window must roll"
    return latents


@pytest.fixture
def installed():
    integ.install(budget_bytes=64 << 20)
    try:
        yield
    finally:
        integ.uninstall()


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    a, b = torch.cat([x.float().flatten() for x in got]), torch.cat([x.float().flatten() for x in want])
    return float((a - b).norm() / b.norm())


def test_quant_off_every_chunk_equals_sglangs_dense_cache(model, dense, installed):
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

    latents, caches = run_chunks(model, QVGKVQuantArgs())
    assert all(type(c) is integ.PagedCausalSelfAttentionKVCache for c in caches) and len(caches) == ARCH["num_layers"]
    assert caches[0].global_end_index_int > caches[0].cache_size  # rolled through pagedqvg's window too
    for chunk, (got, want) in enumerate(zip(latents, dense, strict=True)):
        assert torch.equal(got, want), f"chunk {chunk}"


@pytest.mark.parametrize(
    "name, quant, bound",
    [("int2", "sglang-int2", INT2_BOUND), ("compact", COMPACT, COMPACT_BOUND)],
)
def test_quantized_latents_differ_from_dense_within_bound(model, dense, installed, name, quant, bound):
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

    quant = QVGKVQuantArgs(**INT2) if quant == "sglang-int2" else quant
    latents, caches = run_chunks(model, quant)
    assert all(type(c) is integ.PagedQVGPackedCausalKVCache for c in caches)
    rel = relative_error(latents, dense)
    print(f"LINGBOT {name}: relative error of {CHUNKS} chunks' latents vs SGLang's dense cache: {rel:.4f}",
          file=sys.stderr)  # fmt: skip
    assert 0 < rel < bound
