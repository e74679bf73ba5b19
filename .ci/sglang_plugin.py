"""pytest plugin for .ci/sglang_suite.sh: run SGLang 0.5.23's own kv-cache unit tests, unmodified, against pagedqvg.

1. Placeholder modules (sglang_placeholders.py) for the third-party packages SGLang's import chain pulls in and the
   kv-cache tests never exercise (transformers, diffusers, PIL, ...), each only when it is not installed.
2. `pagedqvg.integrations.sglang.install()` before the test modules are imported, so every
   `CausalSelfAttentionKVCache` / `QVGPackedCausalKVCache` the tests build (directly or through the stages'
   `_allocate_causal_kv_cache`) is pagedqvg's, over one shared pool.

Set PAGEDQVG_SGLANG_INSTALL=0 to run the same tests against SGLang's own classes (the baseline).
"""

from __future__ import annotations

import os

from sglang_placeholders import stubbed_loaded

_patched: list[str] = []


def pytest_configure(config):
    if os.environ.get("PAGEDQVG_SGLANG_INSTALL", "1") != "0":
        from pagedqvg.integrations.sglang import integration as pagedqvg_sglang

        _patched.extend(pagedqvg_sglang.install(budget_bytes=int(os.environ.get("PAGEDQVG_SGLANG_BUDGET", 256 << 20))))


def pytest_report_header(config):
    if not _patched:
        return ["pagedqvg: NOT installed (SGLang's own classes)"]
    return ["pagedqvg.integrations.sglang.install() patched:", *("  " + p for p in _patched)]


def _paged_caches_built() -> int:
    from pagedqvg.integrations.sglang.runtime import integration

    return sum(pool._owner_serial for pool in integration().pools.values())


def pytest_sessionfinish(session, exitstatus):
    # Installed but no pagedqvg cache was built: the tests ran on SGLang's own classes; that must not pass.
    if _patched and session.testscollected and _paged_caches_built() == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    tops = sorted({name.split(".")[0] for name in stubbed_loaded})
    terminalreporter.write_line(f"placeholder modules used ({len(tops)}): {' '.join(tops)}")
    if _patched:
        terminalreporter.write_line(
            f"pagedqvg: install() patched {len(_patched)} bindings; {_paged_caches_built()} pagedqvg caches were "
            f"built in the shared pool(s)"
        )
    else:
        terminalreporter.write_line("pagedqvg: NOT installed (SGLang's own classes)")
