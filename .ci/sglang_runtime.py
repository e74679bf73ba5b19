"""pagedqvg's SGLang entry-point plugin through SGLang 0.5.23's real runtime, each case in a fresh interpreter
(driven by .ci/sglang_runtime.sh, which installs what this needs). Exits non-zero on the first failed case.

(a) the entry point is discovered from the installed distribution's metadata;
(d) SGLang's own load_plugins() / apply_plugin_hooks(): variables unset (inactive, says how to enable), PAGEDQVG=off,
    SGLANG_PLUGINS excluding pagedqvg (never imported), active (the stages' allocation hooked), every bad value
    (the process stops with the message; not swallowed by SGLang);
(b) DiffGenerator.from_pretrained(<tiny LongLive2 dir>) with pagedqvg active vs excluded: samples torch.equal,
    the worker's log shows pagedqvg's caches and pool, the launching process built no pagedqvg cache or pool;
(c) the same with PAGEDQVG_KV_CACHE_QUANT=int2 (2 centroids: chunks of 8 tokens pack): samples differ from the
    dense run by a relative error below REL_ERR_BOUND (measured 0.0078 on the decoded uint8 frames, 2026-12-01);
(e) attention modes (issue 29): PAGEDQVG_ATTENTION unset (the default; (b)'s paged run, groups of 1 head: 2 groups
    a call) chose mode heads for SGLang's TORCH_SDPA backend on CPU (its log lines, no fallback line) and ran it;
    PAGEDQVG_ATTENTION=view (no heads line) gives samples torch.equal to the default's and to SGLang's dense run;
    with int2, PAGEDQVG_ATTENTION=heads (groups of 1) and =view (both packed) torch.equal.
The load_plugins() probes run 3 at a time (each a fresh interpreter; most of their time is importing SGLang).

Usage: python .ci/sglang_runtime.py WORKDIR [plugins|generate|all]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: (c)'s bound on ||int2 - dense|| / ||dense|| over the decoded samples (measured value printed by the run).
REL_ERR_BOUND = 0.05

PROBE = """
import json, sys
from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins
load_plugins(); apply_plugin_hooks()
from sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising import CausalDMDDenoisingStage as S
fn = S._allocate_causal_kv_cache
print("PROBE " + json.dumps({"hooked": getattr(fn, "__wrapped__", None) is not None,
      "pagedqvg_imported": "pagedqvg" in sys.modules}))
"""

DISCOVER = """
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="sglang.multimodal_gen.plugins") if e.name == "pagedqvg"]
import pagedqvg
print("DISCOVER", ep.value, ep.dist.name, ep.dist.version, pagedqvg.__file__)
"""

#: Item 3's bad values (negative, malformed, unknown unit, below one page, fraction outside (0, 1], unknown mode);
#: every other bad value is tested through register() in tests/test_integrations_sglang_plugin.py.
BAD_VALUES = [
    ({"PAGEDQVG_BUDGET": "-1GiB"}, "PAGEDQVG_BUDGET='-1GiB'"),
    ({"PAGEDQVG_BUDGET": "lots"}, "PAGEDQVG_BUDGET='lots'"),
    ({"PAGEDQVG_BUDGET": "24XiB"}, "PAGEDQVG_BUDGET='24XiB'"),
    ({"PAGEDQVG_BUDGET": "4KiB"}, "below one page"),
    ({"PAGEDQVG_MEMORY_FRACTION": "1.5"}, "PAGEDQVG_MEMORY_FRACTION='1.5'"),
    ({"PAGEDQVG_BUDGET": "64MiB", "PAGEDQVG_KV_CACHE_QUANT": "int3"}, "PAGEDQVG_KV_CACHE_QUANT='int3'"),
]


def run(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQVG", "SGLANG_PLUGINS"))}
    return subprocess.run(args, env={**base, **env}, capture_output=True, text=True, timeout=timeout)


def check(ok: bool, what: str, proc: subprocess.CompletedProcess | None = None) -> None:
    if not ok:
        if proc is not None:
            print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n")
        raise SystemExit(f"sglang_runtime: FAILED: {what}")
    print(f"sglang_runtime: ok: {what}", flush=True)


def probe(env: dict[str, str]) -> tuple[dict, subprocess.CompletedProcess]:
    proc = run([sys.executable, "-c", PROBE], env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    return (json.loads(line[0][6:]) if line else {}), proc


def plugin_cases() -> None:
    from concurrent.futures import ThreadPoolExecutor

    envs = [
        {},
        {"PAGEDQVG": "off", "PAGEDQVG_BUDGET": "64MiB"},
        {"PAGEDQVG_BUDGET": "64MiB", "SGLANG_PLUGINS": "ci_cpu_ops"},
        {"PAGEDQVG_BUDGET": "64MiB"},
        *(env for env, _ in BAD_VALUES),
    ]
    with ThreadPoolExecutor(3) as ex:
        discovered = ex.submit(run, [sys.executable, "-c", DISCOVER], {})
        probes = list(ex.map(probe, envs))
    proc = discovered.result()
    check(
        proc.returncode == 0 and "pagedqvg.integrations.sglang.plugin:register pagedqvg" in proc.stdout,
        f"(a) entry point discovered from the installed distribution: {proc.stdout.strip()}",
        proc,
    )
    (got, proc), *probes = probes
    check(
        got == {"hooked": False, "pagedqvg_imported": True}
        and "not active: no budget: set PAGEDQVG_BUDGET" in proc.stderr,
        "(d) variables unset: inactive, logs how to enable, nothing hooked",
        proc,
    )
    (got, proc), *probes = probes
    check(got.get("hooked") is False and "PAGEDQVG=off" in proc.stderr, "(d) PAGEDQVG=off: nothing hooked", proc)
    (got, proc), *probes = probes
    check(
        got == {"hooked": False, "pagedqvg_imported": False},
        "(d) SGLANG_PLUGINS without pagedqvg: skipped by SGLang, pagedqvg never imported, nothing hooked",
        proc,
    )
    (got, proc), *probes = probes
    check(got.get("hooked") is True and "pagedqvg: active" in proc.stderr, "(d) PAGEDQVG_BUDGET=64MiB: hooked", proc)
    for (env, fragment), (got, proc) in zip(BAD_VALUES, probes, strict=True):
        check(
            proc.returncode != 0 and not got and fragment in proc.stderr and "valid" in proc.stderr,
            f"(d) {env}: the process stops with the message ({fragment!r})",
            proc,
        )


def generate(work: str, name: str, env: dict[str, str]) -> tuple[dict, str]:
    out = f"{work}/{name}.pt"
    t0 = time.perf_counter()
    proc = run([sys.executable, f"{HERE}/sglang_generate.py", f"{work}/LongLive-2.0-5B-Diffusers", out], env, 900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("SGLANG_GENERATE ")]
    check(proc.returncode == 0 and bool(line), f"DiffGenerator run {name} ({time.perf_counter() - t0:.0f} s)", proc)
    report = json.loads(line[0][len("SGLANG_GENERATE ") :])
    print(f"sglang_runtime: {name}: {report}", flush=True)
    return report, proc.stdout + proc.stderr


def generate_cases(work: str) -> None:
    import torch

    if not os.path.isdir(f"{work}/LongLive-2.0-5B-Diffusers"):
        subprocess.run(
            [sys.executable, f"{HERE}/sglang_tiny_longlive2.py", f"{work}/LongLive-2.0-5B-Diffusers"], check=True
        )
    _, log = generate(work, "sglang", {"PAGEDQVG_BUDGET": "64MiB", "SGLANG_PLUGINS": "ci_cpu_ops"})
    check(
        "[pagedqvg]" not in log and "pagedqvg: active" not in log,
        "(b) excluded by SGLANG_PLUGINS: no pagedqvg line in any process's log",
    )
    # the default (PAGEDQVG_ATTENTION unset: mode auto) with groups of 1 head, so the groups really split the call
    paged, log = generate(work, "paged", {"PAGEDQVG_BUDGET": "64MiB", "PAGEDQVG_ATTENTION_HEAD_GROUPS": "1"})
    check("PagedCausalSelfAttentionKVCache caches; pool cpu:" in log, "(b) the worker's log shows pagedqvg's caches")
    check(
        DEFAULT_HEADS in log and f"{HEADS_GROUPS} 1 heads (calls of 2 heads: 2 groups)" in log and FALLBACK not in log,
        f"(e) PAGEDQVG_ATTENTION unset: the default chose mode heads for TORCH_SDPA on cpu and ran it by groups of 1: "
        f"{attention_lines(log)}",
    )
    done = re.findall(r"request done; pool cpu: (\d+) of \d+ pages in use; (\d+) open sessions", log)
    check(bool(done) and all(d == ("0", "0") for d in done), f"(b) pool pages in use after each request: {done}")
    check(paged["launcher"] == {"caches": 0, "pools": 0}, f"(b) launching process built no cache: {paged['launcher']}")
    a, b = torch.load(f"{work}/sglang.pt"), torch.load(f"{work}/paged.pt")
    check(torch.equal(a, b), f"(b) samples torch.equal with quantization off ({tuple(a.shape)})")
    _, log = generate(work, "view", {"PAGEDQVG_BUDGET": "64MiB", "PAGEDQVG_ATTENTION": "view"})
    check(
        "attention heads" not in log and "attention default" not in log,
        f"(e) PAGEDQVG_ATTENTION=view: no heads and no default line in the worker's log: {attention_lines(log)}",
    )
    view = torch.load(f"{work}/view.pt")
    check(
        torch.equal(view, a) and torch.equal(view, b),
        "(e) mode view's samples torch.equal to SGLang's dense run and to the default's (heads)",
    )
    env = {
        "PAGEDQVG_BUDGET": "64MiB",
        "PAGEDQVG_KV_CACHE_QUANT": "int2",
        "PAGEDQVG_KV_CACHE_QUANT_CENTROIDS": "2",
        "PAGEDQVG_KV_CACHE_QUANT_KEEP_RECENT": "0",
        "PAGEDQVG_KV_CACHE_QUANT_BLOCK_SIZE": "16",
    }
    _, log = generate(work, "int2", {**env, "PAGEDQVG_ATTENTION": "view"})
    check("PagedQVGPackedCausalKVCache caches" in log, "(c) the worker built packed caches")
    q = torch.load(f"{work}/int2.pt")
    rel = float((q.float() - a.float()).norm() / a.float().norm())
    check(0 < rel < REL_ERR_BOUND, f"(c) int2 samples differ from dense: relative error {rel:.4f} < {REL_ERR_BOUND}")
    heads_case(work, "int2-heads", env, q, "int2")


#: The worker's log lines of the attention modes (pagedqvg/integrations/sglang/head_groups.py).
DEFAULT_HEADS = "attention default (PAGEDQVG_ATTENTION unset): mode heads: backend TORCH_SDPA on cpu"
HEADS_GROUPS = "attention heads: SGLang's LocalAttention.forward (TORCH_SDPA) per group of"
FALLBACK = "running the call whole"


def attention_lines(log: str) -> list[str]:
    """The attention modes' distinct log lines (from 'pagedqvg: attention'), in order."""
    found = [line[line.index("pagedqvg: attention") :] for line in log.splitlines() if "pagedqvg: attention" in line]
    return list(dict.fromkeys(found))


def heads_case(work: str, name: str, env: dict[str, str], view, label: str) -> None:
    """(e): a PAGEDQVG_ATTENTION=heads run with `env`, groups of 1 head (the tiny model's 2 heads: 2 groups a call):
    its log shows every call by groups (no fallback), its samples torch.equal to `view` (mode view's, same env)."""
    import torch

    _, log = generate(work, name, {**env, "PAGEDQVG_ATTENTION": "heads", "PAGEDQVG_ATTENTION_HEAD_GROUPS": "1"})
    by_groups = f"{HEADS_GROUPS} 1 heads (calls of 2 heads: 2 groups)" in log
    check(
        by_groups and FALLBACK not in log and "attention default" not in log,
        f"(e) {label}, PAGEDQVG_ATTENTION=heads: calls by groups of 1 head, no fallback: {attention_lines(log)}",
    )
    check(
        torch.equal(torch.load(f"{work}/{name}.pt"), view),
        f"(e) {label}: mode heads' samples torch.equal to mode view's",
    )


if __name__ == "__main__":
    work, what = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "all")
    if what in ("plugins", "all"):
        plugin_cases()
    if what in ("generate", "all"):
        generate_cases(work)
