"""hfkern ops: one module per op family, each defining its torch.library ops in
the ``hfkern`` namespace (schemas, fakes, autograd) and their torch
implementations. Every family module here is imported, so a new family is a new
module and nothing else; backends register themselves (see :mod:`hfkern._backend`)."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
