"""LingBot-World through SGLang 0.5.23's real runtime on CPU (driven by .ci/sglang_lingbot.sh, which installs what this
needs): `DiffGenerator.from_pretrained(<tiny LingBot-World dir>)` (.ci/sglang_tiny_lingbot.py: image-to-video from a
first frame and camera actions; SGLang's launcher and its spawned worker), once with pagedqvg active and once excluded
(SGLANG_PLUGINS without it; active with a host tier, PAGEDQVG_HOST_BUDGET, which never swaps here: SGLang's
worker holds one realtime session), each run one launch doing, in order:

(o) one-shot: `generate(...)` with the first frame and camera actions (the image encoder, the VAE encode of the first
    frame, one causal chunk, the VAE decode): samples torch.equal across the two runs; the worker's log shows
    pagedqvg's caches and 0 pages in use after the request;
(r) realtime: one session of CHUNKS chunk calls as SGLang's realtime websocket endpoint makes them
    (`LingBotWorldRealtimeAdapter` over a `GenerateSession`: `on_init`, `prepare_next_request`, the request sent to the
    worker, `on_chunk_complete`; then `ReleaseRealtimeSessionReq`), sent through SGLang's own scheduler client to the
    real worker, whose `RealtimeSessionCache` keeps the session's state (its KV caches) across the calls: every chunk
    torch.equal across the two runs; with pagedqvg the pages stay in use between the calls (1 open session), the same
    count after each chunk once the window is full, and 0 after the release;
(i) interleaving: a second session's first chunk between two chunks of the first: SGLang's worker keeps one realtime
    session (`RealtimeSessionCache(max_sessions=1)`, gpu_worker.py), so the first session is evicted (pagedqvg: its
    pages return; 1 open session) and its next chunk is refused with SGLang's "Missing realtime session state".

Usage: python .ci/sglang_lingbot.py WORKDIR         (the driver; exits non-zero on the first failed check)
       python .ci/sglang_lingbot.py --run MODEL_DIR OUT_PREFIX   (one launch; prints SGLANG_LINGBOT {json})
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "lingbot-world-fast-diffusers"
#: Realtime chunks of one session: 2 latent frames each, a 4-frame window with 1 sink frame: the window rolls.
CHUNKS = 3
#: Camera actions per pixel frame (LingBot-World's keys: w/s forward/back, a/d sideways, i/k pitch, j/l yaw).
ACTIONS = [["w"], ["w", "l"], ["l"], ["i"], ["w"], ["a"], ["d"], ["k"], ["w", "j"]]
SIZE = 64


def _free_port() -> int:
    """An OS-chosen free port (SGLang's fixed defaults collide with other SGLang jobs on the same machine)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _first_frame(model_dir: str) -> str:
    return os.path.join(model_dir, "first_frame.png")


def one_shot(gen, model_dir: str):
    import torch

    result = gen.generate(
        sampling_params_kwargs=dict(
            prompt="a red car on the street at night",
            image_path=_first_frame(model_dir),
            height=SIZE,
            width=SIZE,
            num_frames=5,
            seed=7,
            actions=ACTIONS[:2],
            num_inference_steps=4,
            save_output=False,
            return_frames=True,
        )
    )
    if result is None:
        raise SystemExit("sglang_lingbot: DiffGenerator.generate returned None (the request failed; see the log)")
    return torch.as_tensor(result.samples if not isinstance(result, list) else result[0].samples)


def realtime_session(gen, model_dir: str, chunks: int):
    """A GenerateSession driven as SGLang's realtime websocket loop (`_generate_loop`) drives it, the requests sent
    through SGLang's synchronous scheduler client; returns the session and a function running its next chunk."""
    import asyncio

    from sglang.multimodal_gen.runtime.entrypoints.openai.protocol import RealtimeVideoGenerationsRequest
    from sglang.multimodal_gen.runtime.entrypoints.openai.realtime.generate_session import GenerateSession
    from sglang.multimodal_gen.runtime.entrypoints.openai.realtime.registry import get_realtime_model_adapter

    with open(_first_frame(model_dir), "rb") as f:
        first_frame = f.read()
    request = RealtimeVideoGenerationsRequest(
        type="init",
        prompt="a dog runs on the beach",
        first_frame=first_frame,
        size=f"{SIZE}x{SIZE}",
        max_chunks=chunks,
        seed=11,
        condition_inputs={"camera_actions": ACTIONS},
    )
    session = GenerateSession()
    adapter = get_realtime_model_adapter(gen.server_args)
    session.set_adapter(adapter)
    asyncio.run(adapter.on_init(session, request))
    session.set_request(request)

    def next_chunk():
        import torch

        chunk = session.new_chunk()
        batch = adapter.prepare_next_request(session, gen.server_args, chunk)
        out = gen._send_to_scheduler_and_wait_for_response([batch])
        if out.error:
            session.current_chunk = None
            return str(out.error)
        adapter.on_chunk_complete(session, out)
        # What the realtime endpoint sends: raw RGB frames (uint8 bytes, SIZE x SIZE x 3 each) in batches.
        frames = [f for frame_batch in out.raw_frame_batches or [] for f in frame_batch]
        if not frames:
            return f"chunk {chunk.index}: no frames in the worker's output"
        return torch.stack([torch.frombuffer(bytearray(f), dtype=torch.uint8).view(SIZE, SIZE, 3) for f in frames])

    return session, next_chunk


def release(session) -> dict:
    from sglang.multimodal_gen.runtime.entrypoints.control_requests import ReleaseRealtimeSessionReq
    from sglang.multimodal_gen.runtime.scheduler_client import sync_scheduler_client

    out = sync_scheduler_client.forward(ReleaseRealtimeSessionReq(session_id=session.id))
    session.dispose()
    return out.output


def run(model_dir: str, prefix: str) -> None:
    import torch
    from sglang.multimodal_gen.runtime.entrypoints.diffusion_generator import DiffGenerator
    from sglang.multimodal_gen.runtime.server_args.server_args import set_global_server_args

    t0 = time.perf_counter()
    gen = DiffGenerator.from_pretrained(
        model_path=model_dir,
        num_gpus=1,
        model_id=MODEL,
        dit_layerwise_offload=False,
        scheduler_port=_free_port(),
        master_port=_free_port(),
    )
    set_global_server_args(gen.server_args)  # as SGLang's HTTP server process has it (the realtime adapter reads it)
    t1 = time.perf_counter()
    report: dict = {"load_s": round(t1 - t0, 1)}
    try:
        samples = one_shot(gen, model_dir)
        torch.save(samples, f"{prefix}_oneshot.pt")
        report["oneshot_shape"] = list(samples.shape)
        print("SGLANG_LINGBOT_MARK oneshot done", file=sys.stderr, flush=True)
        t2 = time.perf_counter()
        session, next_chunk = realtime_session(gen, model_dir, CHUNKS)
        frames = []
        for i in range(CHUNKS):
            frames.append(next_chunk())
            if isinstance(frames[-1], str):
                raise SystemExit(f"sglang_lingbot: realtime chunk {i} failed: {frames[-1]}")
            print(f"SGLANG_LINGBOT_MARK realtime chunk {i} done", file=sys.stderr, flush=True)
        torch.save(frames, f"{prefix}_realtime.pt")
        report["realtime_shapes"] = [list(f.shape) for f in frames]
        report["release"] = release(session)
        print("SGLANG_LINGBOT_MARK realtime released", file=sys.stderr, flush=True)
        t3 = time.perf_counter()
        a, next_a = realtime_session(gen, model_dir, 2)
        b, next_b = realtime_session(gen, model_dir, 1)
        first = next_a()
        print("SGLANG_LINGBOT_MARK interleave a0 done", file=sys.stderr, flush=True)
        second = next_b()
        print("SGLANG_LINGBOT_MARK interleave b0 done", file=sys.stderr, flush=True)
        third = next_a()
        refused = isinstance(third, str) and "Missing realtime session state" in third
        report["interleave"] = {
            "a0_ok": not isinstance(first, str),
            "b0_ok": not isinstance(second, str),
            "a1": "refused: Missing realtime session state" if refused else str(third)[:200],
        }
        report["interleave_release"] = [release(b), release(a)]
        print("SGLANG_LINGBOT_MARK interleave released", file=sys.stderr, flush=True)
        final = one_shot(gen, model_dir)  # pagedqvg's line after it: the pool holds nothing once sessions are released
        report["final_equals_first"] = bool(torch.equal(final, samples))
        report.update(
            oneshot_s=round(t2 - t1, 1), realtime_s=round(t3 - t2, 1), interleave_s=round(time.perf_counter() - t3, 1)
        )
    finally:
        gen.shutdown()
    runtime = sys.modules.get("pagedqvg.integrations.sglang.runtime")
    pools = list(runtime.integration().pools.values()) if runtime is not None else []
    report["launcher"] = {"pools": len(pools), "caches": sum(p._owner_serial for p in pools)}
    print("SGLANG_LINGBOT " + json.dumps(report), flush=True)


# ----------------------------------------------------------------------------------------------------------- driver


def check(ok: bool, what: str, log: str | None = None) -> None:
    if not ok:
        if log is not None:
            print(log[-12000:])
        raise SystemExit(f"sglang_lingbot: FAILED: {what}")
    print(f"sglang_lingbot: ok: {what}", flush=True)


def launch(work: str, name: str, env: dict[str, str]) -> tuple[dict, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQVG", "SGLANG_PLUGINS"))}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--run", f"{work}/{MODEL}", f"{work}/{name}"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("SGLANG_LINGBOT ")]
    check(proc.returncode == 0 and bool(line), f"launch {name} ({time.perf_counter() - t0:.0f} s)", log)
    report = json.loads(line[0][len("SGLANG_LINGBOT ") :])
    print(f"sglang_lingbot: {name}: {report}", flush=True)
    return report, log


def _between(log: str, start: str, end: str) -> str:
    return log[log.index(start) : log.index(end)]


def done_lines(text: str) -> list[tuple[int, int]]:
    found = re.findall(r"request done; pool cpu: (\d+) of \d+ pages in use; (\d+) open sessions", text)
    return [(int(p), int(s)) for p, s in found]


def main(work: str) -> None:
    import torch

    if not os.path.isdir(f"{work}/{MODEL}"):
        subprocess.run([sys.executable, f"{HERE}/sglang_tiny_lingbot.py", f"{work}/{MODEL}"], check=True)
    dense, log = launch(work, "sglang", {"PAGEDQVG_BUDGET": "64MiB", "SGLANG_PLUGINS": "ci_cpu_ops"})
    check("[pagedqvg]" not in log and "pagedqvg: active" not in log, "excluded by SGLANG_PLUGINS: no pagedqvg line")
    paged, log = launch(work, "paged", {"PAGEDQVG_BUDGET": "64MiB", "PAGEDQVG_HOST_BUDGET": "64MiB"})
    check("host tier 67108864 bytes" in log, "pagedqvg active with a host tier (PAGEDQVG_HOST_BUDGET=64MiB)")
    check(paged["launcher"] == {"caches": 0, "pools": 0}, f"the launching process built no cache: {paged['launcher']}")
    check(
        "LingBotWorldCausalDMDDenoisingStage got 2 PagedCausalSelfAttentionKVCache caches" in log,
        "the worker's log shows pagedqvg's caches for SGLang's LingBot-World stage",
    )
    a, b = torch.load(f"{work}/sglang_oneshot.pt"), torch.load(f"{work}/paged_oneshot.pt")
    check(torch.equal(a, b), f"(o) one-shot samples torch.equal with quantization off ({tuple(a.shape)} {a.dtype})")
    oneshot = done_lines(log[: log.index("SGLANG_LINGBOT_MARK oneshot done")])
    check(oneshot == [(0, 0)], f"(o) pages in use / open sessions after the one-shot request: {oneshot}")
    fa, fb = torch.load(f"{work}/sglang_realtime.pt"), torch.load(f"{work}/paged_realtime.pt")
    equal = [torch.equal(x, y) for x, y in zip(fa, fb, strict=True)]
    check(len(equal) == CHUNKS and all(equal), f"(r) every chunk torch.equal ({CHUNKS} x {tuple(fa[0].shape)})")
    chunks = done_lines(_between(log, "SGLANG_LINGBOT_MARK oneshot done", "SGLANG_LINGBOT_MARK realtime released"))
    held = [p for p, _ in chunks]
    check(
        len(chunks) == CHUNKS and all(s == 1 for _, s in chunks) and all(p > 0 for p in held) and held[-1] == held[-2],
        f"(r) state kept across calls: pages / open sessions after each chunk {chunks}",
    )
    check(paged["release"]["released"] is True, f"(r) SGLang's worker released the session: {paged['release']}")
    # The release is not a pipeline request: the next request's line shows the pool without the released session.
    after = done_lines(_between(log, "SGLANG_LINGBOT_MARK realtime released", "SGLANG_LINGBOT_MARK interleave a0"))
    check(after == [(held[0], 1)], f"(r) released: the next session's chunk 0 alone holds {after} (chunk 0: {held[0]})")
    inter = paged["interleave"]
    check(
        inter["a0_ok"] and inter["b0_ok"] and inter["a1"] == "refused: Missing realtime session state",
        f"(i) SGLang's worker keeps one realtime session: the evicted one's next chunk refused: {inter}",
    )
    check(dense["interleave"] == inter, f"(i) the same without pagedqvg: {dense['interleave']}")
    b0 = done_lines(_between(log, "SGLANG_LINGBOT_MARK interleave a0 done", "SGLANG_LINGBOT_MARK interleave b0 done"))
    check(b0 == [(held[0], 1)], f"(i) the evicted session's pages returned: after b0 {b0} (a0 held {held[0]})")
    last = done_lines(log[log.index("SGLANG_LINGBOT_MARK interleave released") :])
    check(
        last == [(0, 0)] and paged["final_equals_first"] and dense["final_equals_first"],
        f"(i) all released: a last one-shot request leaves {last}, its samples equal the first's",
    )
    for name, report in (("sglang", dense), ("paged", paged)):
        print(
            f"sglang_lingbot: {name}: load {report['load_s']} s, one-shot {report['oneshot_s']} s, "
            f"{CHUNKS} realtime chunks {report['realtime_s']} s, interleave {report['interleave_s']} s"
        )


if __name__ == "__main__":
    if sys.argv[1] == "--run":
        run(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
