"""One SGLang 0.5.23 `DiffGenerator.from_pretrained(<dir>)` run over the tiny LongLive2 directory, in this fresh
interpreter (the launching process); SGLang spawns its worker. Saves the samples and reports, as one JSON line on
stdout, the times and what pagedqvg built in this launching process: nothing (SGLang runs the entry point here too,
which registers the hooks, but the caches and the pool are built in the spawned worker only).

Usage: python .ci/sglang_generate.py MODEL_DIR OUT.pt
"""

from __future__ import annotations

import json
import sys
import time


def main(model_dir: str, out: str) -> None:
    import torch
    from sglang.multimodal_gen.runtime.entrypoints.diffusion_generator import DiffGenerator

    t0 = time.perf_counter()
    gen = DiffGenerator.from_pretrained(
        model_path=model_dir, num_gpus=1, model_id="LongLive-2.0-5B-Diffusers", dit_layerwise_offload=False
    )
    t1 = time.perf_counter()
    try:
        result = gen.generate(
            sampling_params_kwargs=dict(
                prompt="a red car on the beach at night",
                height=64,
                width=64,
                num_frames=21,
                seed=7,
                save_output=False,
                return_frames=True,
            )
        )
    finally:
        gen.shutdown()
    t2 = time.perf_counter()
    if result is None:
        raise SystemExit("sglang_generate: DiffGenerator.generate returned None (the request failed; see the log)")
    samples = result.samples if not isinstance(result, list) else result[0].samples
    samples = torch.as_tensor(samples)  # the decoded frames SGLang returns: uint8 [frames, height, width, 3]
    torch.save(samples, out)
    runtime = sys.modules.get("pagedqvg.integrations.sglang.runtime")
    pools = list(runtime.integration().pools.values()) if runtime is not None else []
    report = {
        "launcher": {"pools": len(pools), "caches": sum(p._owner_serial for p in pools)},
        "samples_shape": list(samples.shape),
        "load_s": round(t1 - t0, 1),
        "generate_s": round(t2 - t1, 1),
    }
    print("SGLANG_GENERATE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
