"""Devices and their memory for the pool: which devices a pool may live on, how much memory is free there, and
bytes printed in binary units. O(1) each (one driver call or one read of /proc/meminfo)."""

from __future__ import annotations

import os

import torch


def format_bytes(n: int) -> str:
    """Human-readable bytes in binary units (``1.50 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` as a `torch.device` pagedqvg can hold a pool on (cpu, or an existing cuda index); ValueError naming
    the device and what is valid otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) exist")
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}: pagedqvg runs on 'cpu' or 'cuda'")
    return dev


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory of a device in bytes: `torch.cuda.mem_get_info` on CUDA, MemAvailable of the host on CPU."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
