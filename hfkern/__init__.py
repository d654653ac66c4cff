"""hfkern: horizontally fused training of B models on one GPU.

``hfkern.nn`` holds array modules (B models of a torch.nn module fused along a
leading array dim), ``hfkern.nn.functional`` array losses, ``hfkern.optim``
array optimizers; :func:`fuse` turns B unmodified torch models into one array
model. Every array tensor has the array dim B first. Kernels are
``torch.ops.hfkern.*`` ops whose implementation (torch / triton / cuda) is chosen
by :func:`set_backend` (process-wide, or ``HFKERN_BACKEND``) and
:func:`use_backend` (per thread / context).
"""

from . import _backend
from . import ops  # noqa: F401  (registers torch.ops.hfkern.*)

# After the ops registered: whether a backend is available depends on what
# registered with it. A bad HFKERN_BACKEND fails here, not at the first op.
_backend._select_from_environment()

from . import amp, nn, optim, utils  # noqa: E402, F401
from ._array import broadcast, is_shared  # noqa: E402
from ._backend import backend_info, get_backend, set_backend, use_backend  # noqa: E402
from .fusion import FusedModel, FuseError, fuse, unfuse  # noqa: E402
from .graphs import CapturedStep, capture_step  # noqa: E402
from .ops.topk import TopK, topk_capacity, topk_select  # noqa: E402
from .sweep import ArraySize, max_array_size  # noqa: E402  (hfkern.sweep's runner needs the sweep extra)
from . import plan  # noqa: E402, F401  (hfkern.plan(...) is hfkern.plan.plan(...))

__version__ = "0.1.0"

__all__ = [
    "broadcast",
    "is_shared",
    "fuse",
    "unfuse",
    "FusedModel",
    "FuseError",
    "capture_step",
    "CapturedStep",
    "set_backend",
    "get_backend",
    "use_backend",
    "backend_info",
    "TopK",
    "topk_select",
    "topk_capacity",
    "max_array_size",
    "ArraySize",
    "__version__",
]
