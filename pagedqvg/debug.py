"""The debug switch: argument checks that read tensor data (index range checks: reductions and a host-device sync per
kernel call) run only while it is on.

Off by default, so the repeated call (a later denoise step) makes no host-device synchronization and no allocation
beyond its view. On when the process starts with `PAGEDQVG_DEBUG=1` (or the older `PAGEDQVG_KERNEL_CHECKS=1`),
read once when pagedqvg is imported; `set_debug_checks` changes it at run time (the test suite turns it on in
tests/conftest.py). Checks that read only metadata (shapes, dtypes, devices) always run.
"""

from __future__ import annotations

import os

__all__ = ["debug_checks", "set_debug_checks"]

_enabled = os.environ.get("PAGEDQVG_DEBUG", "0") == "1" or os.environ.get("PAGEDQVG_KERNEL_CHECKS", "0") == "1"


def debug_checks() -> bool:
    """Whether the data-reading argument checks run (index ranges of row indices, run tables, piece tables)."""
    return _enabled


def set_debug_checks(enabled: bool) -> bool:
    """Turn the data-reading argument checks on or off for the whole process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous
