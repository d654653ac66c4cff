"""Fused hyper-parameter sweeps on Optuna: B trials of a study trained at a time as one array.

:class:`Runner` asks an Optuna study for trials, trains up to B of them at once
as one fused array (:func:`hfkern.fuse`), reports each model's value to its own
trial, prunes with the study's pruner, refills pruned and finished slots with
new trials, and tells the results. Many runner processes, on one machine or
many, share a study through :func:`storage` (SQLite, PostgreSQL); a runner
with a ``checkpoint`` resumes after a kill. :func:`max_array_size` predicts the
largest B that fits a device.

Optuna, SQLAlchemy and a PostgreSQL driver are an optional extra:
``pip install hfkern[sweep]``; :func:`max_array_size` works without them.
"""

from __future__ import annotations

from typing import Any

from ._memory import ArraySize, max_array_size

_NEEDS_OPTUNA = {
    "Runner": "_runner", "SweepSummary": "_runner",
    "storage": "_storage", "counted_trials": "_storage",
    "batch_indices": "_data",
    "best_trials_table": "_report", "print_best_trials": "_report",
}

__all__ = ["ArraySize", "max_array_size", *_NEEDS_OPTUNA]


def __getattr__(name: str) -> Any:
    # The runner's names import Optuna when first used, so that hfkern.sweep (and
    # max_array_size) import without the extra installed.
    module = _NEEDS_OPTUNA.get(name)
    if module is None:
        raise AttributeError(f"module 'hfkern.sweep' has no attribute {name!r}")
    try:
        import optuna  # noqa: F401
    except ImportError as err:
        raise ImportError(f"hfkern.sweep.{name} needs Optuna: pip install 'hfkern[sweep]'") from err
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
