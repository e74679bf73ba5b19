"""pagedqvg.validation: the shared dtype list, int rule and page alignment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedqvg.validation import (
    DTYPES_BY_NAME,
    PAGE_ALIGN_BYTES,
    SUPPORTED_DTYPES,
    allowed_ints,
    as_index,
    check_int,
    is_int,
    nearest_page_bytes,
    page_bytes_at_least,
    page_bytes_floor,
)


def test_supported_dtypes_and_alignment():
    assert (torch.float32, torch.float16, torch.bfloat16) == SUPPORTED_DTYPES
    assert {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16} == DTYPES_BY_NAME
    assert PAGE_ALIGN_BYTES == 256


def test_is_int_refuses_bools_and_floats():
    assert is_int(0) and is_int(-3) and is_int(2**70)
    assert not is_int(True) and not is_int(1.0) and not is_int("1") and not is_int(None)


@pytest.mark.parametrize(
    ("kwargs", "value", "text"),
    [
        ({}, 1.5, "x must be an int, got 1.5 (float)"),
        ({"minimum": 0}, True, "x must be an int, got True (bool)"),
        ({"minimum": 1}, 0, "x must be >= 1, got 0"),
        ({"maximum": 3}, 4, "x must be <= 3, got 4"),
        ({"minimum": 1, "maximum": 3}, 4, "x must be in [1, 3], got 4"),
        ({"minimum": 1, "maximum": 3}, -1, "x must be in [1, 3], got -1"),
    ],
)
def test_check_int_default_messages(kwargs, value, text):
    with pytest.raises(ValueError) as info:
        check_int("x", value, **kwargs)
    assert str(info.value) == text


def test_check_int_returns_value_error_type_and_template():
    assert check_int("x", 5, minimum=5, maximum=5) == 5
    assert check_int("x", -7) == -7
    with pytest.raises(KeyError, match="x=0; allowed: an int in"):
        check_int("x", 0, minimum=1, maximum=9, error=KeyError, message="{name}={value!r}; allowed: {allowed}")
    one = "{name} must be {allowed}, got {value!r} ({type})"
    with pytest.raises(ValueError, match=r"^n must be an int >= 0, got 'a' \(str\)$"):
        check_int("n", "a", minimum=0, message=one, type_message=one)
    with pytest.raises(ValueError, match=r"^n must be an int, got 'a' \(str\)$"):
        check_int("n", "a", minimum=1, message="{name} must be > 0, got {value}")  # message: out of range only
    with pytest.raises(ValueError, match=r"^n must be > 0, got 0$"):
        check_int("n", 0, minimum=1, message="{name} must be > 0, got {value}")


def test_allowed_ints_wording():
    assert allowed_ints() == "an int"
    assert allowed_ints(1) == "an int >= 1"
    assert allowed_ints(maximum=8) == "an int <= 8"
    assert allowed_ints(1, 256) == "an int in [1, 256]"


def test_as_index_accepts_int_likes_and_refuses_the_rest():
    assert as_index("pos", 3, "c") == 3
    assert as_index("pos", np.int64(4), "c") == 4
    assert as_index("pos", torch.tensor([5]), "c") == 5
    for bad, text in (
        (True, "c: pos must be an int, got bool True"),
        (1.5, "c: pos must be an int, got 1.5 (float)"),
        (torch.tensor([1.0]), "c: pos must be an int, got a tensor of shape (1,)"),
        (torch.tensor([1, 2]), "c: pos must be an int, got a tensor of shape (2,)"),
    ):
        with pytest.raises(TypeError) as info:
            as_index("pos", bad, "c")
        assert str(info.value) == text


@pytest.mark.parametrize(
    ("nbytes", "up", "nearest", "floor"),
    [(1, 256, 256, 0), (256, 256, 256, 256), (257, 512, 256, 256), (300, 512, 256, 256), (400, 512, 512, 256)],
)
def test_page_byte_rounding(nbytes, up, nearest, floor):
    assert page_bytes_at_least(nbytes) == up
    assert nearest_page_bytes(nbytes) == nearest
    assert page_bytes_floor(nbytes) == floor
