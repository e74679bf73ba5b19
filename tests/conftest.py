import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The debug switch (pagedqvg/debug.py): the suite runs every data-reading argument check (index ranges), also in the
# subprocesses it starts; tests of the production path turn it off locally (tests/test_repeated_call.py).
os.environ["PAGEDQVG_DEBUG"] = "1"
import pagedqvg

pagedqvg.set_debug_checks(True)

# Hypothesis profiles for the state-machine fuzz (tests/test_cache_fuzz.py).
#   ci   (default): 140 examples x up to 50 steps; Hypothesis ends some programs early, measured ~42 steps per
#         example -> ~6,000 state-machine steps for the main machine (~25 s on 2 cores).
#   long: 1,200 examples x up to 200 steps, measured ~175 steps per example -> ~210,000 steps.
#         Select with PAGEDQVG_FUZZ_PROFILE=long.
settings.register_profile(
    "ci",
    max_examples=140,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=1200,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# interp: the reduced budget of .ci/triton_suite.sh, which reruns the cache suites through the Triton interpreter
#         (~10-30 ms per kernel call on 2 cores): 20 examples x 25 steps.
settings.register_profile(
    "interp",
    max_examples=20,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# scale: 10,000 programs (examples) x up to 50 steps for the main machine against the dense reference, 1,000 for the
#         quant machine (test_cache_fuzz_quant.EXAMPLES); every program ends with pool.check() and a leak check
#         (the machines' teardown). Select with PAGEDQVG_FUZZ_PROFILE=scale.
settings.register_profile(
    "scale",
    max_examples=10_000,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("PAGEDQVG_FUZZ_PROFILE", "ci"))


def pytest_report_header(config) -> list[str]:
    """The CPU kernels this run uses (float results of BLAS/vectorised code depend on them; see .ci/portability.sh)."""
    import torch

    forced = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")
              if k in os.environ]  # fmt: skip
    return [f"pagedqvg: torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
            + (f" ({', '.join(forced)})" if forced else "")]


@pytest.fixture
def production():
    """The debug switch off, as in a user's process (its index range checks read tensor data back to the host),
    restored afterwards: for tests of the production path (tests/test_repeated_call*.py)."""
    previous = pagedqvg.set_debug_checks(False)
    yield
    pagedqvg.set_debug_checks(previous)


@pytest.fixture
def debug_on():
    """The debug switch on for one test whatever the suite's setting (`set_debug_checks`, read at call time),
    restored afterwards: for tests of the data-reading index checks."""
    previous = pagedqvg.set_debug_checks(True)
    yield
    pagedqvg.set_debug_checks(previous)
