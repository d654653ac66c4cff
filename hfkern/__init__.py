"""hfkern: horizontally fused training of B models on one GPU.

``hfkern.nn`` holds array modules (B models of a torch.nn module fused along a
leading array dim), ``hfkern.nn.functional`` array losses, ``hfkern.optim``
array optimizers; every array tensor has the array dim B first. Kernels are
``torch.ops.hfkern.*`` ops whose implementation (torch / triton / cuda) is chosen
by :func:`set_backend`.
"""

from . import ops  # noqa: F401  (registers torch.ops.hfkern.*)
from . import amp, nn, optim, utils  # noqa: F401
from ._array import broadcast, is_shared
from ._backend import backend_info, get_backend, set_backend, use_backend

__version__ = "0.1.0"

__all__ = [
    "broadcast",
    "is_shared",
    "set_backend",
    "get_backend",
    "use_backend",
    "backend_info",
    "__version__",
]
