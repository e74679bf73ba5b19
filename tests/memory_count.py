"""Count the bytes of tensors allocated by aten ops while a block runs (peak and live), on any device.

`AllocatedBytes` is a TorchDispatchMode: every op's outputs whose storage it has not seen are counted when they
appear and uncounted when their storage is freed (a weakref finalizer on the storage). Views share their base's
storage and count once. Tensors created before the block do not count; tensors a kernel allocates internally
without returning them (e.g. a BLAS workspace) are not seen."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocatedBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self.log: list[tuple[str, int]] = []  # (op, bytes) of every counted allocation, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in self._seen or key in inputs:  # a view, an in-place or out= result: nothing new
                continue
            self.log.append((str(func), n))
            self._seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n
