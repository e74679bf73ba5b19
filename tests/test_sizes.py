"""pagedqvg.sizes: the one size parser of the CLI, the plugin and the Python API (same strings accepted or refused)."""

import pytest

from pagedqvg.errors import PagedQVGError
from pagedqvg.sizes import SizeError, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("24GiB", 24 << 30),
        ("24 gib", 24 << 30),
        ("512MiB", 512 << 20),
        ("2M", 2 << 20),
        ("2m", 2 << 20),
        ("1K", 1024),
        ("1T", 1 << 40),
        ("1.5GiB", 3 << 29),
        ("1.1GB", 1_100_000_000),
        ("1.5GB", 1_500_000_000),
        ("2MB", 2_000_000),
        ("3KB", 3000),
        ("0.5K", 512),
        ("7B", 7),
        (" 64KiB ", 64 << 10),
        (".5KiB", 512),
    ],
)
def test_accepted_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "24 GiBs", "24XB", "1e9", "24GiB24", "0x10", "--5", "nan", "inf"])
def test_malformed_sizes_name_the_value_and_the_forms(text):
    with pytest.raises(SizeError, match=r"budget=.* is not a size; valid: a whole number of bytes") as info:
        parse_size(text, name="budget")
    assert isinstance(info.value, PagedQVGError) and isinstance(info.value, ValueError)


def test_fractional_bytes_are_refused():
    with pytest.raises(SizeError, match=r"x='0.3K' is 307.2 bytes, not a whole number of bytes"):
        parse_size("0.3K", name="x")
    with pytest.raises(SizeError, match="not a whole number"):
        parse_size("1.5")


def test_range_is_checked_and_named():
    assert parse_size("1MiB", minimum=1 << 20) == 1 << 20
    with pytest.raises(SizeError, match=r"PAGEDQVG_BUDGET='512KiB' is 524288 bytes, out of range; valid: >= 1048576"):
        parse_size("512KiB", name="PAGEDQVG_BUDGET", minimum=1 << 20)
    with pytest.raises(SizeError, match=r"is 1099511627776 bytes, out of range; valid: 256\.\.67108864 bytes"):
        parse_size("1TiB", minimum=256, maximum=64 << 20)
    with pytest.raises(SizeError, match="out of range"):
        parse_size("-5GiB", minimum=1)


def test_non_strings_are_refused():
    with pytest.raises(SizeError, match="not a size string"):
        parse_size(4096)  # type: ignore[arg-type]
