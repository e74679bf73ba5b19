"""The single dispatch point between the cache and the kernels."""

from __future__ import annotations

import os

import torch

from .page_write import page_fill_torch, page_write_torch
from .view_build import view_build_torch

_VALID = ("auto", "torch", "triton")


def kernel_backend(device: torch.device) -> str:
    """'torch' or 'triton' for tensors on `device`, honouring the PAGEDQVG_KERNELS environment variable."""
    choice = os.environ.get("PAGEDQVG_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _VALID:
        raise ValueError(f"PAGEDQVG_KERNELS={choice!r} is not one of {_VALID}")
    if choice == "auto":
        return "torch"  # Triton kernels land with the kernels issue; until then every device uses torch.
    return choice


def page_write(rows, page_idx, slot_idx, head_start, key, value) -> None:
    """Scatter key/value into token rows (see page_write.py)."""
    page_write_torch(rows, page_idx, slot_idx, head_start, key, value)


def page_fill(rows, page_idx, slot_idx, fill: float = 0.0) -> None:
    """Fill every head of the addressed token rows."""
    page_fill_torch(rows, page_idx, slot_idx, fill)


def view_build(rows, page_idx, slot_idx, head_start, num_heads, out):
    """Gather visible token rows into `out` (see view_build.py)."""
    return view_build_torch(rows, page_idx, slot_idx, head_start, num_heads, out)
