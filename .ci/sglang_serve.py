"""pagedqvg's SGLang plugin under SGLang 0.5.23's real `sglang serve` on CPU (driven by .ci/sglang_serve.sh, which
installs what this needs). Three servers, each `sglang serve --model-path <tiny LongLive2 dir>` (the venv's console
script: SGLang's CLI, launcher, FastAPI app under uvicorn and its spawned scheduler worker), started at once, used one
after the other. Requests go to SGLang's synchronous `POST /rollout/generate` (`rollout: false`: the decoded frames
as a float32 [3, frames, height, width] tensor in the msgpack reply; a request whose worker raised is an HTTP 500
whose `detail` is the worker's error text) and, for one refusal, to the OpenAI-compatible `POST /v1/videos` (a job:
the refusal is the job's `error.message`). Exits non-zero on the first failed check.

(1) dense, fresh (`SGLANG_PLUGINS=ci_cpu_ops`: pagedqvg excluded; `--warmup-mode off`): REQUEST's frames = the
    reference.
(2) dense, with `sglang serve`'s own start-up warmup (its default `--warmup-mode server`, SGLang's warmup shape for
    the model, 960x928 x 29 frames): SGLang's stage keeps the warmup request's caches and reuses them for REQUEST
    (its reuse check compares only the block count and the global sink), so REQUEST's frames differ from the
    reference.
(3) pagedqvg on (PAGEDQVG_BUDGET), the same start-up warmup: REQUEST's frames equal the reference (torch.equal);
    then CLIENTS concurrent clients (threads), one of them asking for a BIG request whose caches do not fit the
    budget: each is served (frames) or refused with an HTTP 500 carrying pagedqvg's SessionRefusedError message,
    and the server stays up (a later REQUEST is served, frames equal the reference). SGLang's scheduler runs one
    request at a time in its one worker (`batching_max_size` 1), shown from the worker's log: its denoising stage
    never starts before the previous one finished; so refusal comes from the BIG request, not from concurrency.
    Every request (warmup included) leaves 0 pages in use and 0 open sessions (the worker's "request done" lines).

Usage: python .ci/sglang_serve.py WORKDIR
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SGLANG = os.path.join(os.path.dirname(sys.executable), "sglang")  # the console script pip installed
#: The request compared across servers (64x64, 21 frames asked, 29 decoded; seed fixed; CPU generator).
REQUEST = {"prompt": "a red car on the beach at night", "seed": 7, "width": 64, "height": 64, "num_frames": 21}
#: Too large for BUDGET: 2048x2048 is 4,096 tokens a frame (16x VAE, 2x2 patches), a 4-frame window of 16,384 slots
#: per layer; refused at allocation, before any token is written (its text encoding and latents are cheap).
BIG = {**REQUEST, "width": 2048, "height": 2048, "seed": 11}
#: The pool per worker: 9 pages of the 223,744 B the planner chooses for the first allocation, SGLang's start-up
#: warmup (960x928, 29 frames: 3,480 slots per layer, 6 pages at its planned peak); holds REQUEST's, not BIG's.
BUDGET = "2MiB"
#: `sglang serve`'s own start-up warmup, as it runs by default (`--warmup-mode server`, SGLang's shape for the model:
#: 960x928, 29 frames, 2 of 4 steps; 100-110 s of the run on the shared 2-core machine).
WARMUP_ARGS: list[str] = []
CLIENTS = [REQUEST, {**REQUEST, "seed": 8}, BIG, {**REQUEST, "seed": 9}]
READY_S = 600


def check(ok: bool, what: str, log: str | None = None) -> None:
    if not ok:
        if log is not None:
            print(log[-12000:])
        raise SystemExit(f"sglang_serve: FAILED: {what}")
    print(f"sglang_serve: ok: {what}", flush=True)


def free_ports(index: int) -> tuple[int, int, int]:
    """(http, scheduler, master) ports for server `index`, from a range of its own (SGLang takes the HTTP port + 1
    for its broker and settles the others upward from what it is given), so servers starting at once never race."""
    for base in range(20000 + 2000 * index, 60000, 6000):
        ports = (base, base + 1, base + 10, base + 20)
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base, base + 10, base + 20
    raise SystemExit("sglang_serve: no free port range")


class Server:
    """One `sglang serve` process group (the CLI, its worker), its output in WORKDIR/NAME.log."""

    def __init__(self, work: str, index: int, name: str, env: dict[str, str], args: list[str], model: str) -> None:
        self.name, self.log_path = name, f"{work}/{name}.log"
        self.port, scheduler, master = free_ports(index)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQVG", "SGLANG_PLUGINS"))}
        cmd = [SGLANG, "serve", "--model-path", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--scheduler-port", str(scheduler), "--master-port", str(master), *args]  # fmt: skip
        print(f"sglang_serve: {name}: {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}", flush=True)
        self.t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env={**base, **env}, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self) -> float:
        import requests

        deadline = time.perf_counter() + READY_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                check(False, f"{self.name}: sglang serve exited ({self.proc.returncode}) before ready", self.log())
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    ready = time.perf_counter() - self.t0
                    print(f"sglang_serve: {self.name}: healthy after {ready:.0f} s", flush=True)
                    return ready
            except requests.RequestException:
                pass
            time.sleep(1)
        check(False, f"{self.name}: not healthy within {READY_S} s", self.log())
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def generate(server: Server, body: dict) -> tuple[int, object, float]:
    """POST /rollout/generate: (200, frames tensor) or (status, the error detail text), and the seconds it took."""
    import msgspec
    import requests
    from safetensors.torch import load

    t0 = time.perf_counter()
    payload = {**body, "rollout": False, "generator_device": "cpu"}
    r = requests.post(f"{server.url}/rollout/generate", json=payload, timeout=900)
    took = time.perf_counter() - t0
    if r.status_code != 200:
        try:
            return r.status_code, str(r.json().get("detail")), took
        except ValueError:
            return r.status_code, r.text, took
    (reply,) = msgspec.msgpack.decode(r.content)
    return 200, load(reply["generated_output"]["data"])["t"], took


def served(server: Server, body: dict, what: str):
    status, out, took = generate(server, body)
    check(status == 200, f"{server.name}: {what} served in {took:.1f} s (HTTP {status})", None if status == 200 else
          f"{out}\n{server.log()}")  # fmt: skip
    return out


def refusal_text(detail: str) -> bool:
    return bool(re.search(r"need \d+ pages of \d+ B at their planned peak, but only \d+ are available", detail)) and (
        "raise PAGEDQVG_BUDGET" in detail
    )


def video_job_refused(server: Server, body: dict) -> str:
    """SGLang's OpenAI-compatible `POST /v1/videos` for BIG: the job fails; its error carries pagedqvg's message."""
    import requests

    r = requests.post(f"{server.url}/v1/videos", json={**body, "generator_device": "cpu"}, timeout=60)
    check(
        r.status_code == 200, f"{server.name}: POST /v1/videos accepted the job (HTTP {r.status_code}: {r.text[:200]})"
    )
    job_id = r.json()["id"]
    deadline = time.perf_counter() + 300
    while time.perf_counter() < deadline:
        job = requests.get(f"{server.url}/v1/videos/{job_id}", timeout=30).json()
        if job.get("status") in ("completed", "failed"):
            return json.dumps(job.get("error"))
        time.sleep(0.5)
    return "timed out"


def request_done_lines(log: str) -> list[tuple[str, str, str]]:
    return re.findall(r"request done; pool cpu: (\d+) of (\d+) pages in use; (\d+) open sessions", log)


def serialized(log: str) -> bool:
    """The worker's denoising stage never starts while another run of it is in progress."""
    running = 0
    for m in re.finditer(r"\[LongLive2CausalDenoisingStage\] (started|finished|Error during execution)", log):
        running += 1 if m.group(1) == "started" else -1
        if running not in (0, 1):
            return False
    return True


def main(work: str) -> None:
    model = f"{work}/LongLive-2.0-5B-Diffusers"
    if not os.path.isdir(model):
        subprocess.run([sys.executable, f"{HERE}/sglang_tiny_longlive2.py", model], check=True, capture_output=True)
    dense = {"SGLANG_PLUGINS": "ci_cpu_ops"}
    times: dict[str, float] = {}
    t_all = time.perf_counter()
    # The three servers start at once (their imports and model loads are mostly one core each); requests go to one
    # server at a time, and each server stops once its cases are done.
    servers = [
        Server(work, 0, "dense-fresh", dense, ["--warmup-mode", "off"], model),
        Server(work, 1, "dense-warmup", dense, WARMUP_ARGS, model),
        Server(work, 2, "paged-warmup", {"PAGEDQVG_BUDGET": BUDGET}, WARMUP_ARGS, model),
    ]
    try:
        cases(servers, times)
    finally:
        for s in servers:
            s.stop()
    times["total"] = time.perf_counter() - t_all
    print("SGLANG_SERVE " + json.dumps({k: round(v, 1) for k, v in times.items()}), flush=True)


def cases(servers: list[Server], times: dict[str, float]) -> None:
    import torch

    # (1) dense, fresh, no warmup: the reference frames
    s = servers[0]
    times["dense-fresh ready"] = s.wait_ready()
    ref = served(s, REQUEST, "64x64 request (the reference)")
    s.stop()
    log = s.log()
    check("[pagedqvg]" not in log and "pagedqvg: active" not in log, "dense-fresh: no pagedqvg line in any process")

    # (2) dense with sglang serve's start-up warmup: the warmup's caches are reused for the 64x64 request
    s = servers[1]
    times["dense-warmup ready"] = s.wait_ready()
    warm = served(s, REQUEST, "64x64 request after the warmup")
    s.stop()
    log = s.log()
    shape = re.findall(r"server warmup req \(([^)]*)\)", log)
    check(bool(shape), f"dense-warmup: SGLang ran its start-up warmup: {shape[-1] if shape else None}", log)
    diff = float((warm - ref).abs().max())
    check(warm.shape == ref.shape and not torch.equal(warm, ref),
          f"dense-warmup: frames differ from the fresh server's (max |diff| {diff:.4f} on [0, 1] pixels)")  # fmt: skip

    # (3) pagedqvg on, the same warmup; then concurrent clients, one too large for the budget
    s = servers[2]
    times["paged-warmup ready"] = s.wait_ready()
    log = s.log()
    check("PagedCausalSelfAttentionKVCache caches; pool cpu:" in log and len(request_done_lines(log)) >= 1,
          "paged-warmup: the warmup ran on pagedqvg's caches and ended as a request")  # fmt: skip
    first = served(s, REQUEST, "64x64 request after the warmup")
    check(torch.equal(first, ref), f"paged-warmup: frames torch.equal to the fresh dense server's {tuple(ref.shape)}")

    results: list = [None] * len(CLIENTS)
    barrier = threading.Barrier(len(CLIENTS))

    def client(i: int) -> None:
        barrier.wait()
        results[i] = generate(s, CLIENTS[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(CLIENTS))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times["concurrent clients"] = time.perf_counter() - t0
    for body, (status, out, took) in zip(CLIENTS, results, strict=True):
        what = f"{body['width']}x{body['height']} seed {body['seed']}"
        if body is BIG:
            check(status == 500 and refusal_text(out),
                  f"paged-warmup: concurrent {what}: refused, HTTP {status}: {out[:400]}", s.log())  # fmt: skip
        else:
            check(status == 200, f"paged-warmup: concurrent {what}: served in {took:.1f} s", f"{out}\n{s.log()}")
    check(torch.equal(results[0][1], ref), "paged-warmup: the concurrent 64x64 seed 7 frames equal the reference")
    job_error = video_job_refused(s, BIG)
    check(refusal_text(job_error), f"paged-warmup: POST /v1/videos {BIG['width']}x{BIG['height']}: the job "
          f"failed with pagedqvg's message: {job_error[:300]}")  # fmt: skip
    last = served(s, REQUEST, "a later 64x64 request (the server stayed up)")
    check(torch.equal(last, ref), "paged-warmup: its frames equal the reference")
    s.stop()
    log = s.log()
    done = request_done_lines(log)
    runs = len(re.findall(r"\[LongLive2CausalDenoisingStage\] started", log))
    # SGLang logs no stage lines for its warmup request; pagedqvg's line ends it too
    check(len(done) == runs + 1 and all(d[0] == "0" and d[2] == "0" for d in done),
          f"paged-warmup: {runs} denoising runs (served, refused) and the warmup, each 'request done' with 0 pages in "
          f"use and 0 open sessions: {sorted(set(done))}", log)  # fmt: skip
    check(serialized(log), "paged-warmup: SGLang's worker ran the denoising stage of one request at a time")
    refusals = log.count("SessionRefusedError")
    check(refusals >= 2, f"paged-warmup: the worker's log names SessionRefusedError ({refusals} lines)")


if __name__ == "__main__":
    main(sys.argv[1])
