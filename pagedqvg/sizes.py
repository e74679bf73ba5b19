"""Sizes in bytes, read one way by the CLI, the SGLang plugin and the Python API (the same strings accepted or refused).

Forms: a whole number of bytes (`4096`), or a number and a unit, case-insensitive: IEC `KiB MiB GiB TiB` (x1024),
SI `KB MB GB TB` (x1000), bare `K M G T` (x1024, as `ls -h` prints), `B`. A fraction is fine when the result is a whole
number of bytes (`1.5GiB`, `0.5K`); `0.3K` (307.2 bytes) is not.
"""

from __future__ import annotations

import re
from decimal import Decimal

from pagedqvg.errors import PagedQVGError

#: Bytes per unit (keys lower-case).
UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgt", start=1):
    UNITS[_letter] = 1 << (10 * _power)
    UNITS[f"{_letter}ib"] = 1 << (10 * _power)
    UNITS[f"{_letter}b"] = 10 ** (3 * _power)
#: The valid forms, for error messages.
SIZE_FORMS = (
    "a whole number of bytes (e.g. 25769803776) or a number with a unit: KiB, MiB, GiB, TiB (x1024), KB, MB, GB, TB "
    "(x1000), K, M, G, T (x1024) or B, e.g. 24GiB"
)
_SIZE_RE = re.compile(r"\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*([A-Za-z]*)\s*")


class SizeError(PagedQVGError, ValueError):
    """A size string that is malformed or out of range (the message names it, the value and the valid forms)."""


def parse_size(text: str, *, name: str = "size", minimum: int = 0, maximum: int | None = None) -> int:
    """Bytes of `text` (`24GiB`, `512 MB`, `2M`, `4096`), within `[minimum, maximum]`; `SizeError` naming `name`
    otherwise. O(len(text))."""
    if not isinstance(text, str):
        raise SizeError(f"{name}={text!r} is not a size string; valid: {SIZE_FORMS}")
    m = _SIZE_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS:
        raise SizeError(f"{name}={text!r} is not a size; valid: {SIZE_FORMS}")
    value = Decimal(m.group(1)) * UNITS[unit]  # exact: 1.1GB is 1,100,000,000 bytes, not a float's neighbour
    if value != value.to_integral_value():
        raise SizeError(f"{name}={text!r} is {value} bytes, not a whole number of bytes; valid: {SIZE_FORMS}")
    size = int(value)
    if size < minimum or (maximum is not None and size > maximum):
        valid = f">= {minimum} bytes" if maximum is None else f"{minimum}..{maximum} bytes"
        raise SizeError(f"{name}={text!r} is {size} bytes, out of range; valid: {valid}, as {SIZE_FORMS}")
    return size
