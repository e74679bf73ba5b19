"""Where the Triton kernel tests run, shared by the tests/test_kernels*.py files.

Importing this module before anything imports triton sets TRITON_INTERPRET=1 when there is no CUDA device (Triton
reads it when it decorates kernels), so the kernels run in Triton's interpreter on CPU tensors. If triton was
already imported in compiled mode and there is no GPU, `kernel_device` says why the in-process tests skip and
`rerun_interpreted` runs a test file again in a fresh interpreted process — kernels never pass silently.

Also the k-means contract checks every torch-vs-Triton comparison uses (`check_near_ties`, `check_means`,
`contract_checked_kmeans`): the two backends sum the same fp32 products in different orders (Triton's interpreter
uses numpy's BLAS, torch its own; both pick kernels by the CPU's instruction set), so their k-means results are
compared against the documented contract (kernels/kmeans.py), never bit for bit, unless the data make the arithmetic
exact.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from pagedqvg.kernels.kmeans import distance_error_bound, kmeans_assign_torch, kmeans_update_torch

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`

REPO = Path(__file__).resolve().parent.parent
INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.uint8: torch.uint8}


def kernel_device(import_error: str | None, kernel) -> tuple[torch.device | None, str]:
    """`(device, why)`: the device the kernel tests use, or None and the reason they skip."""
    from pagedqvg.kernels.triton_common import is_interpreted

    if import_error is not None:
        return None, f"the Triton kernels do not import: {import_error}"
    if is_interpreted(kernel):
        return torch.device("cpu"), ""  # the interpreter, on CPU tensors
    if CUDA:
        return torch.device("cuda"), ""  # compiled kernels on the GPU
    return None, (
        "triton was imported in compiled mode before TRITON_INTERPRET=1 could be set and there is no CUDA device; "
        "test_interpreter_in_subprocess runs these tests in a fresh process instead"
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of the same width (a view): NaN == NaN, -0.0 != 0.0."""
    return t.view(INT_OF[t.dtype])


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (every float class: normal, subnormal, ±0, ±inf, NaN with payloads)."""
    it = INT_OF[dtype]
    info = torch.iinfo(it)
    return torch.randint(info.min, info.max, tuple(shape), dtype=torch.int64, generator=gen).to(it).view(dtype)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the kernel switches, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDQVG_KERNELS")}
    env.update(extra)
    return env


def rerun_interpreted(test_file: str) -> None:
    """Run `test_file` with pytest in a fresh process with TRITON_INTERPRET=1; it must pass, and only this
    fallback itself may skip there."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
        cwd=REPO, env=clean_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    skipped = re.search(r"(\d+) skipped", summary)
    assert passed and int(passed.group(1)) > 0 and (not skipped or int(skipped.group(1)) <= 1), summary


def compiled_mode_json(script: str, *args: str, **env: str) -> dict:
    """Run `script` (which prints `JSON{...}`) in a fresh compiled-mode process (TRITON_INTERPRET unset, FP fusion
    on as on a GPU, plus `env`) and return the JSON. Skips the calling test when the script fails inside Triton's
    internals (`triton_aot` uses some; a newer Triton may move them), fails it on any other error."""
    import json

    import pytest

    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=clean_env(TRITON_DEFAULT_FP_FUSION="1", **env),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0 and re.search(r"(ImportError|AttributeError|TypeError).*triton", proc.stderr[-2000:]):
        pytest.skip(f"this Triton version moved the internals the AOT check uses: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("JSON", 1)[1])


# ---------------------------------------------------------------------------------------------- k-means contract
def distance_margins(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(gap, bound)` float64 [H, S]: per token, the exact (fp64) distance of the second-nearest centroid minus the
    nearest's, and the sum of the two distances' fp32 error bounds (`kmeans.distance_error_bound`). Where
    `gap > bound`, every fp32 summation order picks the nearest centroid; with K = 1 the gap is +inf."""
    x64, c64 = x.double(), c.double()
    d64 = (c64 * c64).sum(-1)[:, None, :] - 2.0 * torch.bmm(x64, c64.transpose(1, 2))  # ||c||^2 - 2 x.c
    err = distance_error_bound(x, c)
    if c.shape[1] < 2:
        inf = torch.full(d64.shape[:2], float("inf"), dtype=torch.float64)
        return inf, err[..., 0]
    top2 = d64.topk(2, dim=-1, largest=False)
    gap = top2.values[..., 1] - top2.values[..., 0]
    bound = err.gather(2, top2.indices).sum(-1)
    return gap, bound


def check_near_ties(x: torch.Tensor, c: torch.Tensor, ids_a: torch.Tensor, ids_b: torch.Tensor) -> int:
    """The assignment contract (kernels/kmeans.py) between two results `ids_a`, `ids_b` [H, S] for x [H, S, D] and
    c [H, K, D]: both pick, for every token, a centroid within twice its fp32 error bound of the nearest (exact fp64
    distances), and where they differ the two chosen distances lie within the sum of their error bounds. Returns the
    number of differing ids."""
    x, c, ids_a, ids_b = x.cpu(), c.cpu(), ids_a.cpu(), ids_b.cpu()
    x64, c64 = x.double(), c.double()
    d64 = (c64 * c64).sum(-1)[:, None, :] - 2.0 * torch.bmm(x64, c64.transpose(1, 2))
    err = distance_error_bound(x, c)
    da, db = d64.gather(2, ids_a[..., None])[..., 0], d64.gather(2, ids_b[..., None])[..., 0]
    ea, eb = err.gather(2, ids_a[..., None])[..., 0], err.gather(2, ids_b[..., None])[..., 0]
    best = d64.min(-1).values
    assert bool((da - best <= 2 * ea + 1e-300).all()) and bool((db - best <= 2 * eb + 1e-300).all()), (
        "an id is not a nearest centroid within the fp32 error bound"
    )
    diff = ids_a != ids_b
    assert bool(((da - db).abs() <= ea + eb)[diff].all()), "ids differ beyond a rounding-level near-tie"
    return int(diff.sum())


def _cluster_means64(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-cluster means `[H, K, D]` of `values` `[H, S, D]` grouped by `ids` (empty clusters: 0) and the
    cluster sizes `[H, K, 1]`."""
    onehot = torch.zeros(*ids.shape, k, dtype=torch.float64, device=values.device).scatter_(2, ids[..., None], 1.0)
    counts = onehot.sum(1)[..., None]
    return torch.bmm(onehot.transpose(1, 2), values.double()) / counts.clamp(min=1.0), counts


def update_error_bound(x: torch.Tensor, ids: torch.Tensor, c_old: torch.Tensor) -> torch.Tensor:
    """Per (h, k, d) bound on |computed mean - exact mean| for any fp32 summation order (float64 [H, K, D]; the
    contract of kernels/kmeans.py): a sum of n terms is off by at most (n - 1) * 2^-24 * sum |x|, the division adds
    half an ulp."""
    mean_abs, counts = _cluster_means64(x.abs(), ids, c_old.shape[1])
    return (counts - 1).clamp(min=0) * 2.0**-24 * mean_abs + 2.0**-24 * mean_abs


def exact_means(x: torch.Tensor, ids: torch.Tensor, c_old: torch.Tensor) -> torch.Tensor:
    """Cluster means in float64 (empty clusters: c_old)."""
    means, counts = _cluster_means64(x, ids, c_old.shape[1])
    return torch.where(counts > 0, means, c_old.double())


def check_means(x: torch.Tensor, ids: torch.Tensor, c_old: torch.Tensor, *means: torch.Tensor) -> None:
    """The update contract: each of `means` [H, K, D] lies within `update_error_bound` of the exact (fp64)
    cluster means, and empty clusters keep `c_old` exactly."""
    x, ids, c_old = x.cpu(), ids.cpu(), c_old.cpu()
    exact, bound = exact_means(x, ids, c_old), update_error_bound(x, ids, c_old)
    empty = torch.ones(c_old.shape[:2], dtype=torch.bool).scatter_(1, ids, False)
    for m in means:
        m = m.cpu()
        assert bool(((m.double() - exact).abs() <= bound).all()), "cluster means beyond the fp32 summation bound"
        assert torch.equal(m[empty], c_old[empty]), "an empty cluster did not keep its centroid"


def contract_checked_kmeans(monkeypatch, target=None) -> dict[str, int]:
    """Make a torch-vs-Triton comparison of packing independent of the CPU: the k-means steps that `target`
    (default: `pagedqvg.packing`, the cache's pack path; any object gets `kmeans_assign` / `kmeans_update`
    attributes) calls become the torch references, and whenever the
    dispatch would pick Triton for the tensors, the Triton kernel runs too and its result is checked against the
    contract (`check_near_ties`, `check_means`) on the same inputs. Both runs then carry the same ids and centroids
    forward, so everything after k-means (residuals, packing, pages, views) must match bit for bit. Returns the
    counts of checked Triton calls (`{"assign": n, "update": n}`), for the test to assert the kernels ran.

    Why not compare whole k-means runs bit for bit: fp32 sums in another order differ in the last bits (a near-tie
    may pick the other centroid, a mean may round the other way), and which order each side uses depends on the
    BLAS and instruction set of the machine (numpy's OpenBLAS in the interpreter, torch's MKL, or the GPU)."""
    from pagedqvg.kernels import dispatch

    if target is None:
        from pagedqvg import packing as target
    counts = {"assign": 0, "update": 0}

    def assign(x, c):
        ref = kmeans_assign_torch(x.cpu(), c.cpu()).to(x.device)
        if dispatch.kernel_backend(x.device) == "triton":
            got = dispatch.kmeans_assign(x, c)
            check_near_ties(x, c, got, ref)
            counts["assign"] += 1
        return ref

    def update(x, ids, c_old):
        ref = kmeans_update_torch(x.cpu(), ids.cpu(), c_old.cpu()).to(x.device)
        if dispatch.kernel_backend(x.device) == "triton":
            got = dispatch.kmeans_update(x, ids, c_old)
            check_means(x, ids, c_old, got, ref)
            counts["update"] += 1
        return ref

    monkeypatch.setattr(target, "kmeans_assign", assign, raising=False)
    monkeypatch.setattr(target, "kmeans_update", update, raising=False)
    return counts
