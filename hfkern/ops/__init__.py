"""hfkern ops: one module per op family, each registering torch.library ops in the
``hfkern`` namespace and their implementations with :mod:`hfkern._backend`."""

from . import conv  # noqa: F401
from . import embedding  # noqa: F401
from . import layer_norm  # noqa: F401
from . import optim  # noqa: F401
