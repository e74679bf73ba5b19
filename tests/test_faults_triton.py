"""Faults at the Triton launch sites: a call that raises has not happened (tests/test_faults.py's invariants).

tests/test_faults.py injects faults into the kernels' torch paths. Here the caches run on the Triton kernels
(`PAGEDQVG_KERNELS=triton`) in Triton's CPU interpreter (`TRITON_INTERPRET=1`, set before triton is imported: run
by .ci/triton_suite.sh, skipped elsewhere), and the faults are injected where every Triton kernel is launched
(`launch_on_device` as each kernel module binds it, keyed by the launch's op): page writes (`page_write`, and the
fill of never-written slots `page_fill`), view builds (`view_build`), view runs (`view_runs`) and packed
dequantization (`packed_dequant`). Half of the faults raise before the kernel runs (a launch that fails), half after
it ran (an illegal memory access reported at the next synchronization, after the kernel wrote part or all of its
output). The same random programs as test_faults.py run beside a twin on its own pool that sees only the
successful calls; after every failed call: cursors, pin, segments and every slot's value equal the twin's (a failed
in-place rewrite: each targeted row old or new, then retried), the cache owns exactly the pages its segments list,
`pool.check()` passes; every later view equals the twin's bit for bit. Counts per site are printed.

Not injected: the PRQ pack kernels (`kmeans_assign`, `kmeans_update`, `residual_pack`): they run in the pack policy
after the call's write, where a failure is absorbed by design (a PackingFailedWarning, the chunk stays bf16;
tests/test_cache_fuzz_quant.py), so a twin that packed would differ on purpose. Tiny shapes and few programs: the
interpreter costs ~10-30 ms per launch (PAGEDQVG_FAULTS_PROFILE=long: 5x the programs).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_faults import COUNTS, FAULTS, Injector, run_faulted_program

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("PAGEDQVG_KERNELS") == "triton"
pytestmark = pytest.mark.skipif(
    not INTERPRETED,
    reason="needs TRITON_INTERPRET=1 and PAGEDQVG_KERNELS=triton at process start (.ci/triton_suite.sh)",
)
LONG = os.environ.get("PAGEDQVG_FAULTS_PROFILE", "short") == "long"
PROGRAMS = {False: 15 if LONG else 3, True: 10 if LONG else 2}
#: The kernel modules and the launch ops injected; each module binds `launch_on_device` at import.
MODULES = ("write.triton_page_write", "view.triton_view_build", "view.triton_view_runs", "view.triton_dequant")
SITES = ("page_write", "page_fill", "view_build", "view_runs", "packed_dequant")


class LaunchFaults:
    """`launch_on_device(op, launch)` that raises at injected ops with probability `p` while the injector is armed
    (packed dequantization, reached only by a rewrite of a packed chunk, with 0.5), before or after the kernel."""

    def __init__(self, inject: Injector, real, p: float) -> None:
        self.inject, self.real, self.p = inject, real, p
        self.launches: dict[str, int] = {}

    def __call__(self, op: str, launch) -> None:
        inject, rng = self.inject, self.inject.rng
        if launch is not None:
            self.launches[op] = self.launches.get(op, 0) + 1
        p = 0.5 if op == "packed_dequant" else self.p
        if launch is None or op not in SITES or not inject.armed or rng.random() >= p:
            return self.real(op, launch)
        after = rng.random() < 0.5
        COUNTS[f"faults at triton {op} ({'after' if after else 'before'} the kernel)"] += 1
        if after:
            self.real(op, launch)
        raise rng.choice(FAULTS)(f"triton {op}")


@pytest.mark.parametrize("quant", [False, True], ids=["quant_off", "quant_on"])
def test_a_call_that_raises_at_a_triton_launch_has_not_happened(quant, monkeypatch):
    import importlib

    from pagedqvg.kernels import dispatch, triton_common

    assert dispatch.kernel_backend(torch.device("cpu")) == "triton"
    COUNTS.clear()
    inject = Injector(random.Random(23), p=0.08)
    faults = LaunchFaults(inject, triton_common.launch_on_device, 0.08)
    for name in MODULES:
        module = importlib.import_module(f"pagedqvg.kernels.{name}")
        monkeypatch.setattr(module, "launch_on_device", faults)
    for seed in range(PROGRAMS[quant]):
        run_faulted_program(seed, quant, inject)
    print(f"\ntriton faults ({'quant on' if quant else 'quant off'}): {dict(COUNTS)}; launches: {faults.launches}")
    assert COUNTS["failed calls"] > 0
    hit = {site for site in SITES for key in COUNTS if key.startswith(f"faults at triton {site} ")}
    want = {"page_write", "view_build"} | ({"packed_dequant"} if quant else set())
    assert want <= hit, (want - hit, dict(COUNTS))
    assert all(faults.launches.get(op, 0) > 0 for op in want), faults.launches
