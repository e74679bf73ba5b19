"""KV-cache bytes of SGLang 0.5.23's LingBot-World and LongLive2 causal stages: SGLang's dense allocation vs
pagedqvg's pool, through the real integration (quant off, int4, int2).

SGLang's stage objects (`LingBotWorldCausalDMDDenoisingStage`, `CausalDMDDenoisingStage`) are given the settings of
SGLang's own arch configs (`LingBotWorldArchConfig`, `LongLive2ArchConfig`: sink, chunk and window frames, heads,
head_dim, layers) and the tokens per latent frame of SEMANTICS.md (1,560 and 880); after
`pagedqvg.integrations.sglang.install()`, the stage's `_allocate_causal_kv_cache` builds the caches (quantization:
the stage's `_kv_quant_args = QVGKVQuantArgs(bits=...)`). The caches then get the stage's call pattern: per chunk
one advance and `--steps` rewrites per layer; LongLive2 pins the chunk at a scene cut every 10 chunks.

Dense bytes are SGLang's allocation (K and V `torch.zeros([B, cache_size, heads, head_dim])` per block, counted,
not allocated). pagedqvg bytes are the pool's held pages (whole pages) after the last chunk ("steady") and its
high-water mark ("peak"); `--layers N` runs N blocks (default 1) and scales to the model's layer count (every block
sees the same calls, and page counts depend on shapes only, so each block holds the same pages). The transient view
(one layer's attention window, outside the pool) is listed separately.

Needs SGLang's multimodal_gen importable, e.g. the wheel's sources as .ci/sglang_suite.sh extracts them, with the
placeholder modules of .ci/sglang_plugin.py for its heavy imports:
    PYTHONPATH=/tmp/sglang-src:.ci python benchmarks/bench_sglang_memory.py --placeholders
"""

from __future__ import annotations

import argparse
import time

import torch

GIB = 1 << 30
# Tokens per latent frame (SEMANTICS.md: LingBot-World 480p, LongLive2 as served).
TOKENS_PER_FRAME = {"lingbot-world": 1560, "longlive2": 880}
SCENE_CUT_EVERY = 10  # LongLive2: chunks between scene cuts (pin_current_chunk)


def stage_for(model: str, layers: int):
    """SGLang's stage for `model` with its arch config's cache settings; returns (stage, arch, model layers)."""
    if model == "lingbot-world":
        from sglang.multimodal_gen.configs.models.dits.lingbot_world import LingBotWorldArchConfig as Arch
        from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world import (
            lingbot_world_causal_denoising as mod,
        )

        cls = mod.LingBotWorldCausalDMDDenoisingStage
    else:
        from sglang.multimodal_gen.configs.models.dits.longlive2 import LongLive2ArchConfig as Arch
        from sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising import (
            CausalDMDDenoisingStage as cls,
        )
    arch = Arch()
    stage = cls.__new__(cls)
    stage.num_transformer_blocks = layers
    stage.local_attn_size = arch.local_attn_size
    stage.sink_size = arch.sink_size
    stage.num_frames_per_block = arch.num_frames_per_block
    stage.sliding_window_num_frames = arch.sliding_window_num_frames
    stage.num_token_per_frame = TOKENS_PER_FRAME[model]
    model_layers = getattr(arch, "num_layers", None) or {"lingbot-world": 40, "longlive2": 30}[model]
    return stage, arch, model_layers


def run(model: str, bits: int | None, layers: int, chunks: int, steps: int) -> dict:
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

    stage, arch, model_layers = stage_for(model, layers)
    stage._kv_quant_args = QVGKVQuantArgs(bits=bits)
    C = stage._get_causal_kv_cache_size()
    S = stage._get_causal_sink_tokens()
    H, D = arch.num_attention_heads, arch.attention_head_dim
    n = stage.num_frames_per_block * stage.num_token_per_frame
    caches = stage._allocate_causal_kv_cache(
        batch_size=1,
        kv_cache_size=C,
        num_attention_heads=H,
        attention_head_dim=D,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        sink_tokens=S,
        attention_window_size=stage._get_causal_attention_window_size(C),
    )
    kinds = {type(c).__name__ for c in caches}
    pool = caches[0].pool
    assert all(c.pool is pool for c in caches)
    pool.reset_high_water()
    base = pool.stats().used_pages
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    view_bytes = 0
    for chunk in range(chunks):
        k = torch.randn(1, n, H, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(1, n, H, D, generator=gen).to(torch.bfloat16)
        for _ in range(1 + steps):
            for cache in caches:
                view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=chunk * n)
                view_bytes = max(view_bytes, 2 * view.k.numel() * view.k.element_size())
                del view
        if model == "longlive2" and chunk > 0 and chunk % SCENE_CUT_EVERY == 0:
            for cache in caches:
                cache.pin_current_chunk(n)
    seconds = time.perf_counter() - t0
    st = pool.stats()
    scale = model_layers / layers
    out = {
        "model": model,
        "mode": {None: "off", 4: "int4", 2: "int2"}[bits],
        "classes": ",".join(sorted(kinds)),
        "C": C,
        "S": S,
        "H": H,
        "D": D,
        "n": n,
        "layers": model_layers,
        "dense": 2 * C * H * D * 2 * model_layers,
        "steady": (st.used_pages - base) * st.page_bytes * scale,
        "peak": (st.high_water_pages - base) * st.page_bytes * scale,
        "view": view_bytes,
        "seconds": seconds,
        "page_bytes": st.page_bytes,
    }
    for cache in caches:
        cache.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="lingbot-world,longlive2")
    ap.add_argument("--modes", default="off,int4,int2")
    ap.add_argument("--layers", type=int, default=1, help="blocks actually run (scaled to the model's layers)")
    ap.add_argument("--chunks", type=int, default=0, help="chunks per run (0: the window plus 2, and a scene cut)")
    ap.add_argument("--steps", type=int, default=4, help="rewrites per chunk after the advance (denoise + clean)")
    ap.add_argument("--budget-gib", type=float, default=8.0, help="the shared pool's size (install(budget_bytes))")
    ap.add_argument("--placeholders", action="store_true", help="import .ci/sglang_plugin.py's placeholder modules")
    args = ap.parse_args()
    if args.placeholders:
        import sglang_plugin  # noqa: F401  (placeholder modules for SGLang's heavy imports)
    from pagedqvg.integrations.sglang import integration as integ

    patched = integ.install(budget_bytes=int(args.budget_gib * GIB))
    print(f"install(): {len(patched)} bindings patched; pool {args.budget_gib} GiB, CPU, bf16")
    print(
        "| model (SGLang stage settings) | quant | SGLang dense (all layers) | pagedqvg pool steady | pool peak "
        "| dense / pool | transient view (one layer) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|", flush=True)
    rows = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            bits = {"off": None, "int4": 4, "int2": 2}[mode]
            stage, _, _ = stage_for(model, 1)
            window_chunks = -(-stage.sliding_window_num_frames // stage.num_frames_per_block)
            if stage.local_attn_size != -1:
                window_chunks = -(-stage.local_attn_size // stage.num_frames_per_block)
            chunks = args.chunks or max(window_chunks + 2, SCENE_CUT_EVERY + 2 if model == "longlive2" else 0)
            r = run(model, bits, args.layers, chunks, args.steps)
            rows.append(r)
            print(  # each row as soon as it is measured (a long run keeps what it has)
                f"| {r['model']}: {r['layers']} layers x {r['H']} heads x {r['D']}, C={r['C']:,}, S={r['S']:,}, "
                f"chunk {r['n']:,} | {r['mode']} | {r['dense'] / GIB:.2f} GiB | {r['steady'] / GIB:.2f} GiB "
                f"| {r['peak'] / GIB:.2f} GiB | {r['dense'] / r['steady']:.2f}x | {r['view'] / GIB:.2f} GiB |",
                flush=True,
            )
            print(
                f"    ({r['classes']}; {chunks} chunks x {1 + args.steps} calls x {args.layers} block(s) in "
                f"{r['seconds']:.1f} s)",
                flush=True,
            )
    print(f"\npages of {rows[0]['page_bytes']} B; {args.layers} block(s) run per row, scaled to all layers")


if __name__ == "__main__":
    main()
