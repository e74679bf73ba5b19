"""Kernels, each beside its torch reference, and the one dispatch point the cache calls.

Dispatch: CUDA tensors use Triton when it is importable, CPU tensors use torch. `PAGEDQVG_KERNELS=torch` forces
the torch path everywhere; `PAGEDQVG_KERNELS=triton` forces Triton (on CPU tensors it needs `TRITON_INTERPRET=1`).
"""

from .dispatch import kernel_backend, page_fill, page_write, view_build

__all__ = ["kernel_backend", "page_fill", "page_write", "view_build"]
