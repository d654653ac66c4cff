"""What every op family's launcher does alike: which extension runs it, on which device.

A family's launcher (``hfkern/cuda/<family>.py``) subclasses :class:`Launcher`,
states what its kernels need of the extension in :meth:`Launcher.require` and
keeps its own shapes, checks and launches. ``emulate=False`` runs ``hfkern._C``
on CUDA tensors, ``emulate=True`` runs ``hfkern._C_emu`` (the same kernel
sources in the host grid emulator) on CPU tensors.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import _backend
from .._dtypes import KERNEL_DTYPES
from . import _ext

__all__ = ["Launcher", "implements"]


class Launcher:
    """The kernels of one family on one device kind: ``hfkern._C`` on CUDA tensors,
    ``hfkern._C_emu`` on CPU ones. ``want``: the device type of the tensors it takes;
    ``where``: how its error messages name it."""

    # Whether check() holds integer operands (a counter such as num_batches_tracked)
    # to the kernel dtypes too.
    check_integer_dtypes = True

    def __init__(self, emulate: bool):
        self.emulate = emulate
        self.want = "cpu" if emulate else "cuda"
        self.where = "cuda backend (emulated)" if emulate else "cuda backend"

    def require(self, ext) -> None:
        """Raise RuntimeError when ``ext`` was built without what this family's kernels need."""

    def ext(self, device: torch.device):
        """The extension, checked (:meth:`require`), with ``device`` current for its launches."""
        ext = _ext.load(emulated=self.emulate)
        self.require(ext)
        if device.type == "cuda":
            ext.set_device(device.index if device.index is not None else torch.cuda.current_device())
        return ext

    def check_device(self, op: str, name: str, t: Tensor) -> None:
        """``t`` on this launcher's device type."""
        if t.device.type != self.want:
            raise ValueError(f"hfkern::{op} on the {self.where}: expected {name} on a {self.want} device, "
                             f"got {t.device}")

    def check(self, op: str, x: Tensor, **tensors: Tensor | None) -> None:
        """Device and dtypes of a data tensor ``x`` and the call's other tensors (the op has
        checked shapes); nothing invalid reaches a kernel."""
        self.check_device(op, "x", x)
        if x.dtype not in KERNEL_DTYPES:
            raise TypeError(f"hfkern::{op} on the {self.where}: expected x of dtype float32, float16 or bfloat16, "
                            f"got {x.dtype}; the torch backend serves it")
        for name, t in tensors.items():
            if t is None:
                continue
            if t.device != x.device:
                raise ValueError(f"hfkern::{op} on the {self.where}: expected {name} on {x.device}, got {t.device}")
            if (self.check_integer_dtypes or t.is_floating_point()) and t.dtype not in KERNEL_DTYPES:
                raise TypeError(f"hfkern::{op} on the {self.where}: expected {name} of dtype float32, float16 or "
                                f"bfloat16, got {t.dtype}")


def implements(op: str, dtypes: tuple[torch.dtype, ...] | None = KERNEL_DTYPES) -> Callable[[Callable], Callable]:
    """Registers a function as the ``cuda`` implementation of ``op`` for CUDA tensors (of
    ``dtypes``; None: every dtype). auto never picks it until a committed GPU result of a
    training step shows it faster than the other backends; set_backend("cuda") selects it."""
    return _backend.implements(op, "cuda", device_types=("cuda",), auto=False, dtypes=dtypes)
