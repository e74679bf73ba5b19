"""The packed PRQ byte format (pagedqvg/quant/format.py): byte counts and field offsets, the design numbers, bit
order of codes (2-bit, 4-bit, base-3 trits) and of whole token rows built by hand, round trips of token rows and
codebook rows, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedqvg.quant import FP8_DTYPE, PackedFormat, QuantConfig

INT2 = QuantConfig(bits=2)


@pytest.mark.parametrize(
    ("kwargs", "per_head", "layout"),
    [
        ({"bits": 2}, 35, {"codes": (0, 32), "scales": (32, 2), "zeros": (34, 0), "ids": (34, 1)}),
        ({"bits": 4}, 67, {"codes": (0, 64), "scales": (64, 2), "zeros": (66, 0), "ids": (66, 1)}),
        ({"bits": 2, "asymmetric": True}, 37, {"codes": (0, 32), "scales": (32, 2), "zeros": (34, 2), "ids": (36, 1)}),
        (
            {"bits": 4, "stages": 2, "block_size": 32},
            70,
            {"codes": (0, 64), "scales": (64, 4), "zeros": (68, 0), "ids": (68, 2)},
        ),
        ({"bits": 2, "pack_trits": True}, 29, {"codes": (0, 26), "scales": (26, 2), "zeros": (28, 0), "ids": (28, 1)}),
        (
            {"bits": 2, "pack_trits": True, "block_size": 16},
            35,
            {"codes": (0, 26), "scales": (26, 8), "zeros": (34, 0), "ids": (34, 1)},
        ),
    ],
)
def test_format_byte_counts(kwargs: dict, per_head: int, layout: dict) -> None:
    fmt = PackedFormat(head_dim=128, num_heads=40, cfg=QuantConfig(**kwargs))
    assert fmt.per_head_bytes == per_head
    assert fmt.layout() == layout
    assert fmt.token_row_bytes == 40 * per_head
    assert fmt.num_codebook_rows == 40 * fmt.cfg.stages
    assert fmt.codebook_row_bytes == 128 * 128 * 2
    assert fmt.segment_bytes(10) == 10 * 40 * per_head + fmt.num_codebook_rows * 32768


def test_format_design_numbers() -> None:
    fmt = PackedFormat(head_dim=128, num_heads=1, cfg=INT2)  # DESIGN.md: 35 B vs 256 B; 6.09x / 6.73x
    assert fmt.per_head_bytes == 35 and fmt.dense_token_row_bytes == 256
    assert fmt.compression_ratio(4680) == pytest.approx(6.09, abs=0.005)
    assert fmt.compression_ratio(10800) == pytest.approx(6.73, abs=0.005)
    f32 = PackedFormat(head_dim=128, num_heads=2, cfg=QuantConfig(bits=4, centroids=256), dtype=torch.float32)
    assert f32.codebook_row_bytes == 256 * 128 * 4


def test_format_rejects() -> None:
    with pytest.raises(ValueError, match="bits=None"):
        PackedFormat(128, 1, QuantConfig())
    with pytest.raises(ValueError, match="block_size=64 does not divide head_dim=96"):
        PackedFormat(96, 1, INT2)
    with pytest.raises(ValueError, match="num_heads=0"):
        PackedFormat(128, 0, INT2)
    with pytest.raises(ValueError, match="dtype"):
        PackedFormat(128, 1, INT2, dtype=torch.int8)


def _fmt(head_dim: int, heads: int = 1, **kw) -> PackedFormat:
    return PackedFormat(head_dim=head_dim, num_heads=heads, cfg=QuantConfig(**kw))


def test_bit_order_hand_computed() -> None:
    f2 = _fmt(8, bits=2, block_size=8)
    codes = torch.tensor([[0, 1, 2, 3, 3, 0, 0, 1]])
    assert f2.pack_codes(codes).tolist() == [[0b00011011, 0b11000001]]  # c0<<6 | c1<<4 | c2<<2 | c3
    f4 = _fmt(4, bits=4, block_size=4)
    assert f4.pack_codes(torch.tensor([1, 15, 10, 0])).tolist() == [0x1F, 0xA0]  # c0<<4 | c1
    ft = _fmt(7, bits=2, block_size=7, pack_trits=True)
    packed = ft.pack_codes(torch.tensor([1, 2, 0, 1, 2, 2, 1]))
    assert packed.tolist() == [81 + 54 + 0 + 3 + 2, 2 * 81 + 1 * 27]  # base 3, first code most significant, 0-padded
    assert ft.unpack_codes(packed).tolist() == [1, 2, 0, 1, 2, 2, 1]
    assert f2.unpack_codes(torch.tensor([[27, 193]], dtype=torch.uint8)).tolist() == codes.tolist()


def test_token_row_bytes_hand_built() -> None:
    # D=8, block 4, int4 symmetric, 2 stages, 2 heads: per head 4 code bytes + 2 scales + 2 ids = 8 bytes
    fmt = _fmt(8, heads=2, bits=4, block_size=4, stages=2)
    codes = torch.tensor([[[1, 2, 3, 4, 5, 6, 7, 8], [15, 0, 0, 15, 7, 7, 7, 7]]])
    scales = torch.tensor([[[1.0, 0.5], [2.0, 448.0]]])
    ids = torch.tensor([[[3, 200], [0, 255]]])
    rows = fmt.pack_token_rows(codes, scales, None, ids)
    assert rows.dtype == torch.uint8 and rows.shape == (1, 16)
    # fp8 e4m3fn: 1.0 = 0x38, 0.5 = 0x30, 2.0 = 0x40, 448 = 0x7E
    assert rows[0].tolist() == [0x12, 0x34, 0x56, 0x78, 0x38, 0x30, 3, 200, 0xF0, 0x0F, 0x77, 0x77, 0x40, 0x7E, 0, 255]
    f = fmt.unpack_token_rows(rows)
    assert torch.equal(f.codes, codes.to(torch.uint8)) and torch.equal(f.ids, ids.to(torch.uint8))
    assert torch.equal(f.scales, scales) and f.zeros is None


def test_asymmetric_rows_and_argument_checks() -> None:
    fmt = _fmt(4, bits=2, block_size=2, asymmetric=True)
    codes = torch.tensor([[[0, 1, 2, 3]]])
    scales = torch.tensor([[[0.25, 1.0]]]).to(FP8_DTYPE)
    zeros = torch.tensor([[[-1.0, 0.0]]])
    rows = fmt.pack_token_rows(codes, scales, zeros, torch.tensor([[[9]]]))
    assert rows[0].tolist() == [0b00011011, 0x28, 0x38, 0xB8, 0x00, 9]  # 0.25 = 0x28, -1.0 = 0xB8
    f = fmt.unpack_token_rows(rows)
    assert f.zeros is not None and f.zeros.tolist() == [[[-1.0, 0.0]]]
    with pytest.raises(ValueError, match="needs zeros"):
        fmt.pack_token_rows(codes, scales, None, torch.tensor([[[9]]]))
    with pytest.raises(ValueError, match="ids has shape"):
        fmt.pack_token_rows(codes, scales, zeros, torch.tensor([[9]]))
    with pytest.raises(ValueError, match="token rows must be uint8"):
        fmt.unpack_token_rows(torch.zeros(2, 7, dtype=torch.uint8))


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    asym=st.booleans(),
    trits=st.booleans(),
    blocks=st.integers(1, 3),
    block_size=st.sampled_from([4, 5, 8]),
    heads=st.integers(1, 3),
    stages=st.integers(1, 3),
    tokens=st.integers(0, 4),
    seed=st.integers(0, 2**31),
)
def test_pack_unpack_roundtrip(bits, asym, trits, blocks, block_size, heads, stages, tokens, seed) -> None:
    trits = trits and bits == 2 and not asym
    D = blocks * block_size
    if not trits and (D * bits) % 8:
        return
    fmt = PackedFormat(
        D, heads, QuantConfig(bits=bits, asymmetric=asym, pack_trits=trits, block_size=block_size, stages=stages)
    )
    g = torch.Generator().manual_seed(seed)
    levels = fmt.cfg.levels
    codes = torch.randint(levels, (tokens, heads, D), generator=g).to(torch.uint8)
    scales = torch.randint(0, 127, (tokens, heads, blocks), generator=g).to(torch.uint8).view(FP8_DTYPE)
    zeros = torch.randint(0, 255, (tokens, heads, blocks), generator=g).to(torch.uint8) if asym else None
    if zeros is not None:
        zeros[(zeros & 0x7F) == 0x7F] = 0  # no NaN patterns
        zeros = zeros.view(FP8_DTYPE)
    ids = torch.randint(256, (tokens, heads, stages), generator=g).to(torch.uint8)
    rows = fmt.pack_token_rows(codes, scales, zeros, ids)
    assert rows.shape == (tokens, fmt.token_row_bytes)
    f = fmt.unpack_token_rows(rows)
    assert torch.equal(f.codes, codes) and torch.equal(f.ids, ids)
    assert torch.equal(f.scales, scales.float())
    if zeros is not None:
        assert f.zeros is not None and torch.equal(f.zeros, zeros.float())


def test_codebook_rows_roundtrip() -> None:
    fmt = PackedFormat(16, 3, QuantConfig(bits=4, centroids=5, block_size=8, stages=2))
    cb = torch.randn(3, 2, 5, 16).bfloat16()
    rows = fmt.pack_codebooks(cb)
    assert rows.shape == (6, fmt.codebook_row_bytes) and rows.dtype == torch.uint8
    assert torch.equal(fmt.unpack_codebooks(rows), cb)
    assert torch.equal(rows[1].view(torch.bfloat16).reshape(5, 16), cb[0, 1])  # row = head * stages + stage
