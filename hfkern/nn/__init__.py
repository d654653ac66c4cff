"""Array modules: each holds B models of its ``torch.nn`` namesake, array dim first.

Element-wise activations (ReLU, GELU, Tanh, ...) need no array version: use the
plain ``torch.nn`` modules on array tensors.
"""

from ._base import ArrayModule
from .conv import Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d
from .embedding import Embedding
from .linear import Linear

__all__ = [
    "ArrayModule",
    "Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d",
    "Linear",
    "Embedding",
]
