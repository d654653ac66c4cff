"""Array modules: each holds B models of its ``torch.nn`` namesake, array dim first.

Element-wise activations (ReLU, GELU, Tanh, ...) need no array version: use the
plain ``torch.nn`` modules on array tensors.
"""

from . import functional
from ._base import ArrayModule, StateDictError, set_memory_format
from .activation import PReLU
from .attention import MultiheadAttention
from .conv import Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d
from .dropout import Dropout, Dropout1d, Dropout2d
from .embedding import Embedding
from .flatten import Flatten
from .linear import Linear
from .normalization import BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, RMSNorm
from .transformer import TransformerEncoder, TransformerEncoderLayer
from .pooling import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AvgPool1d,
    AvgPool2d,
    MaxPool1d,
    MaxPool2d,
)

__all__ = [
    "ArrayModule",
    "StateDictError",
    "set_memory_format",
    "functional",
    "Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d",
    "Linear",
    "Embedding",
    "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d",
    "Dropout", "Dropout1d", "Dropout2d",
    "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
    "Flatten",
    "PReLU",
    "MultiheadAttention", "TransformerEncoderLayer", "TransformerEncoder",
]
