"""Array optimizers: one step updates B models, each with its own hyperparameters.

Parameters are ``[B, ...]`` (array dim first); every numeric hyperparameter is a
float, a length-B sequence, or a ``[B]`` tensor or numpy array. Model b's
trajectory is that of the torch.optim namesake run on model b alone. The update
math is in the ``hfkern::*_step_`` ops (:mod:`hfkern.ops.optim`).
"""

from . import lr_scheduler
from ._base import ArrayOptimizer
from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .lamb import LAMB
from .lars import LARS
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["ArrayOptimizer", "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop", "LARS", "LAMB",
           "lr_scheduler"]
