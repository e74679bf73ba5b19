"""Where the Triton kernel tests run, shared by the tests/test_kernels*.py files.

Importing this module before anything imports triton sets TRITON_INTERPRET=1 when there is no CUDA device (Triton
reads it when it decorates kernels), so the kernels run in Triton's interpreter on CPU tensors. If triton was
already imported in compiled mode and there is no GPU, `kernel_device` says why the in-process tests skip and
`rerun_interpreted` runs a test file again in a fresh interpreted process — kernels never pass silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

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
