"""The input rules every module shares: which dtypes a cache holds, what counts as an int argument, and the
page-size alignment (pages are multiples of `PAGE_ALIGN_BYTES` bytes).

Each rule is written once here; modules choose only the error type and, where their messages are part of the
documented behaviour, the message wording (`check_int`'s message templates).
"""

from __future__ import annotations

import operator

import torch

#: The dtypes a cache (dense rows, packed segments' codebooks and dequantized views) can hold, by the short name the
#: CLI, the presets and the benchmarks use (`--dtype bf16`).
DTYPES_BY_NAME: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: The same dtypes as a tuple (fp32, fp16, bf16), for membership checks and error messages.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(DTYPES_BY_NAME.values())

#: Pages are multiples of this many bytes, and page 0 of a pool starts on a multiple of it (bytes).
PAGE_ALIGN_BYTES: int = 256


def is_int(value: object) -> bool:
    """Whether `value` is a Python int (subclasses too) and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def allowed_ints(minimum: int | None = None, maximum: int | None = None) -> str:
    """The allowed range in words: 'an int', 'an int >= 1', 'an int <= 8' or 'an int in [1, 256]'."""
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def check_int(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[Exception] = ValueError,
    message: str | None = None,
    type_message: str | None = None,
) -> int:
    """`value` if it is an int (not a bool) in `[minimum, maximum]` (either bound may be None), else `error`.

    Messages are `str.format` templates with the fields name, value, type (the value's type name), minimum, maximum
    and allowed (`allowed_ints(minimum, maximum)`). `type_message` is used for a non-int (default: '{name} must be an
    int, got {value!r} ({type})'), `message` for an int out of range (default: '{name} must be >= {minimum}, got
    {value}', or '<= {maximum}', 'in [{minimum}, {maximum}]'). Pass the same template twice for one wording.
    """
    ok_type = is_int(value)
    if ok_type and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):  # type: ignore[operator]
        return value  # type: ignore[return-value]
    if not ok_type:
        template = type_message or "{name} must be an int, got {value!r} ({type})"
    elif message is not None:
        template = message
    elif minimum is not None and maximum is not None:
        template = "{name} must be in [{minimum}, {maximum}], got {value}"
    elif minimum is not None and value < minimum:  # type: ignore[operator]
        template = "{name} must be >= {minimum}, got {value}"
    else:
        template = "{name} must be <= {maximum}, got {value}"
    fields = {"minimum": minimum, "maximum": maximum, "allowed": allowed_ints(minimum, maximum)}
    raise error(template.format(name=name, value=value, type=type(value).__name__, **fields))


def as_index(name: str, value: object, context: str) -> int:
    """An int-like call argument as int: Python ints, numpy ints (anything with `__index__`) and one-element integer
    tensors; bools, floats and other tensors raise TypeError naming `context` (e.g. the cache's debug name)."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        raise TypeError(f"{context}: {name} must be an int, got bool {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{context}: {name} must be an int, got a tensor of shape {tuple(value.shape)}")
        return int(value.item())
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{context}: {name} must be an int, got {value!r} ({type(value).__name__})") from None


def page_bytes_at_least(nbytes: int) -> int:
    """The smallest page size (bytes, a multiple of `PAGE_ALIGN_BYTES`, at least one unit) holding `nbytes` bytes."""
    return max(PAGE_ALIGN_BYTES, -(-nbytes // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES)


def nearest_page_bytes(nbytes: int) -> int:
    """The page size (bytes, a multiple of `PAGE_ALIGN_BYTES`, at least one unit) nearest to `nbytes`: what an
    error suggests for a misaligned size."""
    return max(PAGE_ALIGN_BYTES, round(nbytes / PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES)


def page_bytes_floor(nbytes: int) -> int:
    """The largest multiple of `PAGE_ALIGN_BYTES` (bytes) not above `nbytes` (0 below one unit)."""
    return nbytes // PAGE_ALIGN_BYTES * PAGE_ALIGN_BYTES
