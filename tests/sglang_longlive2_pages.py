"""SGLang 0.5.23's real LongLive2 transformer (tiny, seeded random weights, bf16 and fp32, CPU) through a causal DMD
chunk loop (per chunk: denoising steps that rewrite the chunk's K/V, then a clean pass) over KV caches built by the real
`CausalDMDDenoisingStage._allocate_causal_kv_cache`: SGLang's dense cache, and pagedqvg installed with attention `view`
/ `pages` / `heads` (heads: 1 head per group, 2 groups a call), quantization off, int2 and compact (pages also with
16-token attention tiles, so that the window spans several and their log-sum-exp merge runs); for bf16 also SGLang's
dense cache with its attention computed in fp32 (the noise floor of bf16 rounding here). Prints one JSON object per
dtype: each run's relative L2 error of the final latents against the dense cache's run in that dtype, how many
self-attention calls attended from pages, for mode heads whether its final latents equal mode view's (torch.equal) and
how many calls took the per-group path, and for pagedqvg runs the allocation's session (sglang_sessions: the run is one
request scope): its planned pages, the pool's high water during the run, and the pages in use after the request (0: the
session closed at its end).

Usage: python tests/sglang_longlive2_pages.py SGLANG_SRC   (SGLANG_SRC: a folder holding SGLang 0.5.23's `sglang`
package, e.g. the wheel extracted without `sglang/__init__.py`, as .ci/sglang_suite.sh does; SGLang's heavy
third-party imports resolve to .ci/sglang_plugin.py's placeholders). About a minute of imports, then seconds.
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch
from torch import Tensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Model and loop: 2 layers x 2 heads x 64; 8x8 latents (16 tokens a frame), 2 frames a chunk, 6 chunks, a window of
#: 4 frames with a 1-frame sink (the cache rolls), 4 denoising steps and a clean pass per chunk.
HEADS, HEAD_DIM, LAYERS, CHANNELS, SIDE = 2, 64, 2, 4, 8
FRAMES_PER_CHUNK, CHUNKS, WINDOW_FRAMES, SINK_FRAMES = 2, 6, 4, 1
STEPS = (1000, 750, 500, 250)
TOKENS_PER_FRAME = (SIDE // 2) ** 2
#: Mode heads: 1 head per group, so that each self-attention call runs SGLang's forward over 2 groups (HEADS).
HEAD_GROUP = 1
INT2 = dict(
    enabled=True, bits=2, centroids=16, block_size=64, stages=1, kmeans_iters=2, asymmetric=False,
    keep_recent_chunks=1, sink=True, sink_keep_chunks=0,
)  # fmt: skip
#: compact (trits, fitted scales, fp8 codebooks) at this head_dim: one scale per 64 channels, 16 centroids.
COMPACT = dict(
    enabled=True, bits=2, centroids=16, block_size=64, stages=1, kmeans_iters=2, asymmetric=False, pack_trits=True,
    fit_scales=True, codebook_fp8=True, keep_recent_chunks=1, sink=True, sink_keep_chunks=0,
)  # fmt: skip


def _sglang(src: str) -> types.SimpleNamespace:
    sys.path[:0] = [src, os.path.join(REPO, ".ci")]
    import sglang_plugin  # noqa: F401  (placeholders for SGLang's unused third-party imports)

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    os.environ["WORLD_SIZE"] = "1"
    from sglang.multimodal_gen.configs.models.dits.longlive2 import LongLive2ArchConfig, LongLive2VideoConfig
    from sglang.multimodal_gen.runtime.distributed import parallel_state
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
    from sglang.multimodal_gen.runtime.models.dits.longlive2 import LongLive2Transformer3DModel
    from sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising import CausalDMDDenoisingStage
    from sglang.multimodal_gen.runtime.server_args import set_global_server_args
    from sglang.multimodal_gen.test.unit.conftest import _make_unit_server_args
    from sglang.multimodal_gen.test.unit.host_sync_guard import tiny_dit_runtime

    # SGLang's srt-side mirror of the TP group reads msgspec structs (a placeholder here); one process, no srt model.
    parallel_state._sync_srt_tp_group = lambda: None
    parallel_state.maybe_init_distributed_environment_and_model_parallel(tp_size=1, sp_size=1)
    set_global_server_args(_make_unit_server_args())
    from sglang.kernels.ops.diffusion.modulate import scale_shift_triton as modulate

    def scale_shift_torch(x, scale, shift, scale_constant=1.0, block_l=128, block_c=128):
        # SGLang's CPU branch calls sgl-kernel's fused op (no wheel here): its formula in torch
        scale = modulate.expand_scale_shift_cpu_param(scale, x)
        shift = modulate.expand_scale_shift_cpu_param(shift, x)
        return (x * (scale_constant + scale) + shift).to(x.dtype)

    for name, module in list(sys.modules.items()):  # every SGLang module that bound it
        if name.startswith("sglang.") and hasattr(module, "fuse_scale_shift_kernel"):
            module.fuse_scale_shift_kernel = scale_shift_torch
    return types.SimpleNamespace(
        Arch=LongLive2ArchConfig, Config=LongLive2VideoConfig, Model=LongLive2Transformer3DModel,
        Stage=CausalDMDDenoisingStage, forward_context=set_forward_context, runtime=tiny_dit_runtime,
    )  # fmt: skip


def build_model(sgl: types.SimpleNamespace, dtype: torch.dtype) -> torch.nn.Module:
    arch = sgl.Arch(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=CHANNELS, out_channels=CHANNELS,
        text_dim=16, freq_dim=16, ffn_dim=128, num_layers=LAYERS,
        local_attn_size=WINDOW_FRAMES, sink_size=SINK_FRAMES, num_frames_per_block=FRAMES_PER_CHUNK,
    )  # fmt: skip
    model = sgl.Model(sgl.Config(arch_config=arch), hf_config={})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # seeded weights (SGLang's layers may leave theirs uninitialized)
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise / p.shape[-1] ** 0.5 if p.dim() > 1 else 1 + 0.02 * noise)
    return model.to(dtype).eval()


def run_loop(sgl, model, caches, dtype: torch.dtype) -> torch.Tensor:
    """The causal DMD loop over `caches` (one per layer); returns the final latents `[1, C, frames, H, W]` (fp32)."""
    gen = torch.Generator().manual_seed(1)
    text = torch.randn(1, 5, 16, generator=gen).to(dtype)
    out = []
    batch = types.SimpleNamespace(enable_sequence_shard=False, enable_teacache=False, enable_spectrum=False, extra={})
    for chunk in range(CHUNKS):
        x = torch.randn(1, CHANNELS, FRAMES_PER_CHUNK, SIDE, SIDE, generator=gen).to(dtype)
        start_frame = chunk * FRAMES_PER_CHUNK
        for t in (*STEPS, 0):
            with sgl.forward_context(0, None, forward_batch=batch):
                pred = model(
                    hidden_states=x, encoder_hidden_states=text,
                    timestep=torch.full((1, FRAMES_PER_CHUNK), t, dtype=torch.long),
                    kv_cache=caches, crossattn_cache=[None] * LAYERS,
                    current_start=start_frame * TOKENS_PER_FRAME, start_frame=start_frame,
                )  # fmt: skip
            if t:
                x = (0.5 * x.float() + 0.5 * pred.float()).to(dtype)
        out.append(x.float())
    return torch.cat(out, dim=2)


def allocate(sgl, quant: dict | None, dtype: torch.dtype) -> list:
    if quant is not None and "pack_trits" in quant:  # pagedqvg-only fields: a QuantConfig (SGLang's flags lack them)
        from pagedqvg import QuantConfig

        quant_args = QuantConfig(**{k: v for k, v in quant.items() if k != "enabled"})
    else:
        quant_args = None if quant is None else types.SimpleNamespace(**quant)
    stage = types.SimpleNamespace(
        num_transformer_blocks=LAYERS, _kv_quant_args=quant_args,
        num_frames_per_block=FRAMES_PER_CHUNK, num_token_per_frame=TOKENS_PER_FRAME,
    )  # fmt: skip
    return sgl.Stage._allocate_causal_kv_cache(
        stage, batch_size=1, kv_cache_size=WINDOW_FRAMES * TOKENS_PER_FRAME, num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM, dtype=dtype, device="cpu", use_int_indices=True,
        sink_tokens=SINK_FRAMES * TOKENS_PER_FRAME,
    )  # fmt: skip


def run_installed(sgl, model, dense, dtype, mode: str, quant: dict | None, tile: int | None) -> tuple[dict, Tensor]:
    """One loop with pagedqvg installed (`mode`, `quant`; `tile`: attention tiles of that many tokens, so the
    window spans several and their log-sum-exp merge runs): its error against `dense`, how many self-attention
    calls attended from pages and, for mode `heads` (`HEAD_GROUP` heads per group), how many went through the
    per-group path (`attend_head_groups`) and how many group forwards SGLang's `LocalAttention` ran; and the final
    latents."""
    from pagedqvg.attention import pages as attention
    from pagedqvg.integrations.sglang import attention as sglang_attention
    from pagedqvg.integrations.sglang import head_groups
    from pagedqvg.integrations.sglang import integration as integ
    from pagedqvg.integrations.sglang import sessions as sglang_sessions

    integ.install(budget_bytes=64 << 20, attention=mode)
    group_before = head_groups.set_head_group_size(HEAD_GROUP)
    calls = {"pages": 0, "heads": 0, "head_groups": 0, "group_forwards": 0}
    original, tile_before = sglang_attention.PendingPages.attend, attention.ATTN_TILE_TOKENS
    heads_before, groups_before = sglang_attention.heads_attention, head_groups.attend_head_groups

    def counted(self, query, scale):
        calls["pages"] += 1
        return original(self, query, scale)

    def counted_heads(*args, **kwargs):  # every call of mode heads' wrapper (whole or by groups)
        calls["heads"] += 1
        return heads_before(*args, **kwargs)

    def counted_groups(io, plan, h0, query, attend, group, buffer):  # the per-group path, and its group forwards
        calls["head_groups"] += 1

        def each(q, k, v):
            calls["group_forwards"] += 1
            return attend(q, k, v)

        return groups_before(io, plan, h0, query, each, group, buffer)

    sglang_attention.PendingPages.attend = counted
    sglang_attention.heads_attention = counted_heads
    head_groups.attend_head_groups = counted_groups
    attention.ATTN_TILE_TOKENS = tile or tile_before
    try:
        with sglang_sessions.request_scope(None):  # one request, as the stage's forward hook makes it
            caches = allocate(sgl, quant, dtype)
            assert type(caches[0]).__module__ == integ.__name__, type(caches[0])
            pool = caches[0].pool
            pool.reset_high_water()
            got = run_loop(sgl, model, caches, dtype)
            session = {"planned_pages": caches.session.planned_pages, "high_water_pages": pool.stats().high_water_pages}
        session["pages_after_request"] = pool.num_pages - pool.num_free_pages
        session["closed"] = caches.session.closed
    finally:
        sglang_attention.PendingPages.attend = original
        sglang_attention.heads_attention = heads_before
        head_groups.attend_head_groups = groups_before
        attention.ATTN_TILE_TOKENS = tile_before
        head_groups.set_head_group_size(group_before)
        integ.uninstall()
    res = {"relative_l2": float((got - dense).norm() / dense.norm()), "attend_from_pages_calls": calls["pages"],
           "session": session}  # fmt: skip
    if mode == "heads":
        res.update(heads_calls=calls["heads"], head_group_calls=calls["head_groups"],
                   group_forwards=calls["group_forwards"], heads_per_group=HEAD_GROUP)  # fmt: skip
    return res, got


def run_fp32_attention(sgl, model, dense, dtype) -> dict:
    """The noise floor of bf16 here: SGLang's dense cache, its self-attention computed in fp32 (SDPA on upcast
    q / k / v, cast back): its error against `dense` (no pagedqvg)."""
    from sglang.multimodal_gen.runtime.layers.attention import layer

    original = layer.LocalAttention.forward

    def fp32(self, q, k, v, attn_mask=None):
        if attn_mask is not None:
            return original(self, q, k, v, attn_mask)
        q32, k32, v32 = (t.float().transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, scale=self.softmax_scale)
        return out.transpose(1, 2).to(q.dtype)

    layer.LocalAttention.forward = fp32
    try:
        got = run_loop(sgl, model, allocate(sgl, None, dtype), dtype)
    finally:
        layer.LocalAttention.forward = original
    return {"relative_l2": float((got - dense).norm() / dense.norm()), "attend_from_pages_calls": 0}


def main(src: str) -> dict:
    sgl = _sglang(src)
    results: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        out = results[str(dtype).removeprefix("torch.")] = {}
        with torch.no_grad(), sgl.runtime(dtype):
            model = build_model(sgl, dtype)
            dense = run_loop(sgl, model, allocate(sgl, None, dtype), dtype)  # SGLang's own cache (not installed)
            runs = [("view", "off", None, None), ("view", "int2", INT2, None), ("pages", "off", None, None),
                    ("pages", "int2", INT2, None), ("pages", "off-tile16", None, 16),
                    ("pages", "compact", COMPACT, None), ("heads", "off", None, None),
                    ("heads", "int2", INT2, None)]  # fmt: skip
            latents = {}
            for mode, name, quant, tile in runs:
                out[f"{mode}-{name}"], latents[f"{mode}-{name}"] = run_installed(
                    sgl, model, dense, dtype, mode, quant, tile
                )
            for name in ("off", "int2"):  # mode heads: the final latents bit for bit mode view's
                out[f"heads-{name}"]["equal_to_view"] = torch.equal(latents[f"heads-{name}"], latents[f"view-{name}"])
            if dtype != torch.float32:
                out["dense-fp32-attention"] = run_fp32_attention(sgl, model, dense, dtype)
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
