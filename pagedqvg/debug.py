"""The debug switch: argument checks that read tensor data (index range checks: reductions and a host-device sync per
kernel call) run only while it is on.

Off by default, so the repeated call (a later denoise step) makes no host-device synchronization and no allocation
beyond its view. On when the process starts with `PAGEDQVG_DEBUG=1` (`pagedqvg.env.debug`), read once, when this
module is imported: the switch is consulted on every kernel call, and a repeated call reads no environment variable.
`set_debug_checks` changes it at run time (the test suite turns it on in tests/conftest.py). Checks that read only
metadata (shapes, dtypes, devices) always run.
"""

from __future__ import annotations

from pagedqvg.env import debug as debug_from_env

__all__ = ["debug_checks", "set_debug_checks"]

_enabled = debug_from_env()


def debug_checks() -> bool:
    """Whether the data-reading argument checks run (index ranges of row indices, run tables, piece tables)."""
    return _enabled


def set_debug_checks(enabled: bool) -> bool:
    """Turn the data-reading argument checks on or off for the whole process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous
