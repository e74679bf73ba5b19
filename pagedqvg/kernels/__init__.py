"""Kernels, each beside its torch reference, and the one dispatch point the cache calls (`kernels.dispatch`).

Dispatch: CUDA tensors use Triton when it is importable, CPU tensors use torch. `PAGEDQVG_KERNELS=torch` forces
the torch path everywhere; `PAGEDQVG_KERNELS=triton` forces Triton (on CPU tensors it needs `TRITON_INTERPRET=1`).

The package namespace holds only the backend queries; the dispatching kernels are imported from
`pagedqvg.kernels.dispatch` (e.g. `dispatch.page_write`), so `pagedqvg.kernels.<name>` is always the submodule
`<name>.py` (`page_write.py` holds the torch reference, `triton_page_write.py` the Triton kernel).
"""

from pagedqvg.kernels.dispatch import kernel_backend, triton_available

__all__ = ["kernel_backend", "triton_available"]
