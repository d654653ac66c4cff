"""Array optimizers: one step updates B models, each with its own hyperparameters.

Parameters are ``[B, ...]`` (array dim first); every numeric hyperparameter is a
float, a length-B sequence or a ``[B]`` tensor.
"""

from .sgd import SGD

__all__ = ["SGD"]
