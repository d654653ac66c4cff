"""The sweep runner: an Optuna study's trials trained B at a time as fused arrays.

One :class:`Runner` process repeats: ask the study for trials, put up to B
trials whose *grouped* (non-fusible) hyper-parameters agree into one array
(:func:`hfkern.fuse` of the user's model, one array optimizer, one array
scheduler, each model with its own *fusible* hyper-parameters), train a round
(``report_every`` steps), evaluate every model, report each model's value to
its own trial, tell the finished and pruned trials, and refill their slots
with new trials through per-slot surgery (fresh weights, optimizer state and
schedule). A strategy of several arrays in flight (``Strategy.arrays``) keeps
that many arrays, of the same or of different groups, training together: their
rounds' steps are issued in turn, each array's on a CUDA stream of its own
(:class:`hfkern.plan._strategy.Streams`). Any number of runners share one
study through its storage (:func:`hfkern.sweep.storage`).

Why a trial's result does not depend on its array: its model is built from
its own parameters under its own seed, its optimizer and scheduler state is
its own row, and its batches follow its own step count
(:mod:`hfkern.sweep._data`). A fused array computes what B separate models
compute up to float32 rounding, so a trial trained in any slot of any array,
entering at any time, follows its trajectory trained alone. Random ops in the
training step (dropout) draw from the array's generator and are the
exception: their masks depend on the array.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import inspect
import logging
import math
import numbers
import os
import socket
import sys
import time
import types
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Container, Iterable, Sequence

import optuna
import torch
from optuna.trial import FrozenTrial, Trial, TrialState
from torch import nn
from torch.utils._pytree import tree_leaves

from .. import fusion
from .._array import broadcast
from ..nn._base import seeded
from ..graphs import capture_step
from ..nn.functional import cross_entropy
from ..optim import ArrayOptimizer
from . import _report, _storage
from ._data import BatchOrder
from ._storage import COUNTED_ATTR, OUTCOME_ATTR, RUNNER_ATTR, SEED_ATTR, counts

__all__ = ["Runner", "SweepSummary"]

_log = logging.getLogger("hfkern.sweep")
# 4: each array's given per-model optimizer and scheduler arguments (_Args.given); 3: each array's
# strategy and each group's (B, strategy); 2: a list of arrays in flight; 1: one array (1 and 2, still
# read, had one B and strategy for every group; 1 to 3, still read, no given arguments: _saved_given)
_CHECKPOINT_VERSION = 4
_MAX_B = 64  # the largest array the runner sizes itself; more trials per array rarely pay on one device
_DEVICE_FRACTION = 0.9  # memory_budget="device": this part of the device's free memory, as hfkern.plan takes
# A trial's seed is torch's seed of its model, and ``hp[seed_param]`` holds it exactly as an int64:
# seeds lie in [-2**63, 2**63) (torch.manual_seed's seeds from 2**63 on are those 2**64 lower).
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
# ``seed + trial.number`` is a trial's seed: ``seed`` leaves room for this many trial numbers.
_SEED_TRIALS = 2**32

Params = Mapping[str, Any]


@dataclasses.dataclass
class _Entry:
    """A trial the runner holds: waiting in its queue, or training in a slot."""

    trial: Trial
    params: dict[str, Any]
    seed: int
    key: tuple
    step: int = 0      # training steps done
    reported: int = 0  # rounds whose value the study already has


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What the grouped parameters decide for an array beyond its model."""

    batch_size: int
    steps_per_epoch: int
    total_steps: int     # a trial's training steps
    report_every: int    # steps per round
    optimizer_cls: type[ArrayOptimizer]
    order: BatchOrder


@dataclasses.dataclass
class _Args:
    """The constructor arguments of an array's optimizer (or scheduler) beyond each slot's values."""

    shared: dict[str, Any]  # the one-per-array arguments given
    given: set[str]         # the per-model arguments some slot's trial gave: every other is at its default
    defaults: Mapping[str, Any]  # what an argument a trial does not give takes
    # The per-model arguments whose default None a model takes while others give a value (the class
    # takes None per model: CyclicLR's step_size_down); any other None default is none (_given_or_default).
    none_ok: frozenset[str] = frozenset()


@dataclasses.dataclass
class _Array:
    """An array in flight: one fused model, its optimizer and scheduler, B slots."""

    key: tuple
    settings: _Settings
    model: fusion.FusedModel
    optimizer: ArrayOptimizer
    scheduler: Any
    slots: list[_Entry | None]
    optimizer_args: _Args
    scheduler_args: _Args
    hp: dict[str, torch.Tensor]        # fusible parameter -> [B] values (the loss may read them)
    bad: torch.Tensor                  # [B] bool: a non-finite loss this round
    idle: torch.Tensor                 # [B] bool: slots without a trial (the optimizer skips them, the scheduler
                                       # leaves their schedules: _step_scheduler)
    strategy: Any = None               # the hfkern.plan.Strategy it trains under (None: plain fusion)
    step: Callable = None              # the training step (Runner._step_fn)

    @property
    def B(self) -> int:
        return len(self.slots)

    def active(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is not None]


@dataclasses.dataclass(frozen=True)
class SweepSummary:
    """What one :meth:`Runner.run` call did."""

    completed: int  # trials this runner told complete
    pruned: int
    failed: int     # non-finite or, with on_nonfinite="prune", counted in pruned
    arrays: int     # arrays built
    B: int          # slots per array (the largest, where groups were sized apart)
    seconds: float  # wall time of the run
    compactions: int = 0  # arrays rebuilt smaller around their remaining trials
    in_flight: int = 1    # arrays trained together (the strategy's ``arrays``)

    def __str__(self) -> str:
        together = f", {self.in_flight} in flight" if self.in_flight > 1 else ""
        return (f"{self.completed} complete, {self.pruned} pruned, {self.failed} failed in {self.arrays} "
                f"array(s) of B = {self.B}{together} ({self.compactions} compacted), {self.seconds:.1f} s")


def _arrays_of(strategy: Any) -> int:
    """Arrays in flight under ``strategy`` (an hfkern.plan.Strategy or None: plain fusion, one)."""
    return 1 if strategy is None else strategy.arrays


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _hashable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, Mapping):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


def _optimizer_class(optimizer: Any) -> type[ArrayOptimizer]:
    """An array optimizer class from itself or its torch.optim namesake."""
    from .. import optim as hoptim

    if isinstance(optimizer, type) and issubclass(optimizer, ArrayOptimizer):
        return optimizer
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        array = getattr(hoptim, optimizer.__name__, None)
        if isinstance(array, type) and issubclass(array, ArrayOptimizer):
            return array
        raise ValueError(f"Runner: torch.optim.{optimizer.__name__} has no array namesake in hfkern.optim "
                         f"(available: {[n for n in hoptim.__all__ if n != 'ArrayOptimizer']})")
    raise TypeError(f"Runner: optimizer must be an hfkern.optim optimizer class or a torch.optim class with an "
                    f"hfkern.optim namesake, got {optimizer!r}")


def _select_models(state: Any, rows: torch.Tensor, B: int) -> Any:
    """An array optimizer's state dict for the models ``rows`` of its B: every tensor with B leading
    entries (parameter state, per-model hyper-parameters and the schedulers' entries in the param
    groups) indexed. Other values (flags, parameter ids) are kept. (A scheduler selects its own
    state: ``state_dict_of``.)"""
    if isinstance(state, torch.Tensor):
        return state[rows.to(state.device)].clone() if state.dim() > 0 and state.shape[0] == B else state
    if isinstance(state, dict):
        return {k: _select_models(v, rows, B) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_select_models(v, rows, B) for v in state)
    return state


def _trial_seed(value: Any, what: str, number: int) -> int:
    """A trial's seed from ``value`` (its seed parameter, or the runner's ``seed + number``): an
    integer in [-2**63, 2**63), torch's seed of its model that ``hp`` holds exactly (int64)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        seed = int(value)
    elif _is_number(value) and math.isfinite(value) and float(value).is_integer():
        seed = int(value)
    else:
        raise ValueError(f"Runner: trial {number}'s {what} must be an integer seed, got {value!r}")
    if not _SEED_MIN <= seed <= _SEED_MAX:
        same = f" ({seed - 2**64} is torch's same seed)" if _SEED_MAX < seed < 2**64 else ""
        raise ValueError(f"Runner: trial {number}'s {what} must be in [-2**63, 2**63) (torch's seed of its model, "
                         f"held exactly in hp as an int64), got {seed}{same}")
    return seed


_NO_DEFAULT = object()
# Not a trial's failure: the process is asked to stop (Ctrl-C, sys.exit); its trials stay as a kill leaves them.
_INTERRUPTS = (KeyboardInterrupt, SystemExit)


class _Refused(ValueError):
    """A strategy the runner refuses for a group's models (:meth:`Runner._check_strategy`): a
    configuration error, found before the group's trials train; not their failure."""


@functools.lru_cache(maxsize=None)
def _defaults(cls: type) -> Mapping[str, Any]:
    """The default of every constructor argument of ``cls`` that has one (read-only: cached)."""
    return types.MappingProxyType({name: p.default for name, p in inspect.signature(cls).parameters.items()
                                   if p.default is not inspect.Parameter.empty})


def _optimizer_defaults(cls: type[ArrayOptimizer]) -> dict[str, Any]:
    """The defaults of an array optimizer's arguments in a sweep: its own, but the runner's
    ``skip_nonfinite=True`` (a trial's non-finite step must not change its weights)."""
    return {**_defaults(cls), "skip_nonfinite": True}


def _given_or_default(kw: Mapping[str, Any], k: str, defaults: Mapping[str, Any], per_model: bool,
                      none_ok: Container[str] = ()) -> Any:
    """``kw[k]``, else the default of argument ``k`` (_NO_DEFAULT without one; a per-model argument
    whose default is None has none, None being no model's value, unless it is in ``none_ok``: one
    the class takes None for per model, such as CyclicLR's ``step_size_down``)."""
    if k in kw:
        return kw[k]
    default = defaults.get(k, _NO_DEFAULT)
    return _NO_DEFAULT if per_model and default is None and k not in none_ok else default


def _scheduler_none_ok(cls: type) -> frozenset[str]:
    """The per-model arguments of scheduler class ``cls`` that take None per model (a model's None
    among others' values, as its own scheduler takes None): CyclicLR's ``step_size_down`` (None: the
    model's ``step_size_up``). OneCycleLR's ``total_steps``, ``epochs`` and ``steps_per_epoch`` are
    resolved per trial instead (:func:`_trial_scheduler_kwargs`)."""
    from ..optim import lr_scheduler as hsched

    return frozenset({"step_size_down"}) if issubclass(cls, hsched.CyclicLR) else frozenset()


def _trial_scheduler_kwargs(cls: type, kw: Mapping[str, Any], number: int) -> dict[str, Any]:
    """A trial's scheduler arguments ``kw`` (its ``scheduler_kwargs(params)``) as the runner builds
    and refills an array's scheduler with them, each trial's schedule what its own scheduler gives:

    * OneCycleLR: a schedule's length is its ``total_steps`` where given (not None), else ``epochs *
      steps_per_epoch`` (positive ints), as torch's OneCycleLR takes them; every trial's is passed
      as ``total_steps``, so that trials giving either form share arrays (the scheduler takes one
      form for all its models).
    * CyclicLR: a trial giving ``step_size_down`` gives ``step_size_up`` too (its default where not
      given): a refill sets both, not a ``step_size_down`` the previous trial's ``step_size_up``
      would pair with.
    """
    from ..optim import lr_scheduler as hsched

    kw = dict(kw)
    if issubclass(cls, hsched.OneCycleLR):
        total = kw.pop("total_steps", None)
        epochs, per_epoch = kw.pop("epochs", None), kw.pop("steps_per_epoch", None)
        if total is None:
            if epochs is None or per_epoch is None:
                raise ValueError(f"Runner: scheduler_kwargs(params) gives {cls.__name__} neither total_steps nor "
                                 f"epochs and steps_per_epoch for trial {number}: define either, as its own "
                                 f"OneCycleLR needs")
            for name, v in (("epochs", epochs), ("steps_per_epoch", per_epoch)):
                if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                    raise ValueError(f"Runner: scheduler_kwargs(params) gives {cls.__name__} {name}={v!r} for "
                                     f"trial {number}: expected a positive int")
            total = int(epochs) * int(per_epoch)
        kw["total_steps"] = total
    elif issubclass(cls, hsched.CyclicLR) and "step_size_down" in kw and "step_size_up" not in kw:
        kw["step_size_up"] = _defaults(cls)["step_size_up"]
    return kw


def _scheduler_given(cls: type, given: set[str]) -> set[str]:
    """The per-model arguments ``given`` (a checkpoint's) as :func:`_trial_scheduler_kwargs` gives
    them: OneCycleLR's ``epochs`` and ``steps_per_epoch`` as ``total_steps``; CyclicLR's
    ``step_size_down`` with ``step_size_up``."""
    from ..optim import lr_scheduler as hsched

    given = set(given)
    if issubclass(cls, hsched.OneCycleLR) and given & {"epochs", "steps_per_epoch"}:
        given -= {"epochs", "steps_per_epoch"}
        given.add("total_steps")
    elif issubclass(cls, hsched.CyclicLR) and "step_size_down" in given:
        given.add("step_size_up")
    return given


class Runner:
    """Run an Optuna study's trials B at a time as fused arrays.

    Args:
        study: an ``optuna.Study`` (single objective). Share it between
            processes through an RDB storage (:func:`hfkern.sweep.storage`).
        space: ``space(trial) -> dict``: suggests a trial's hyper-parameters
            (``trial.suggest_float(...)``...) and returns them by name (it may
            add fixed values).
        model: ``model(params) -> torch.nn.Module``: one plain torch model for a
            trial's parameters. It is called under ``torch.manual_seed`` of the
            trial's seed, so its initialization is the trial's.
        fusible: names of the parameters that may differ between the models of
            one array: optimizer and scheduler hyper-parameters, dropout
            probabilities, loss weights, the init seed (``seed_param`` always
            is). Their values must be numbers. Trials whose other parameters
            (widths, depth, optimizer flags) differ train in different arrays.
        grouped: names of the parameters that decide the array (default: every
            parameter not in ``fusible``). When given, a parameter in neither
            list raises ValueError.
        train: ``(inputs, targets)``: the training set as two tensors with the
            samples in dim 0 (moved to ``device`` once).
        batch_size: samples per step and model.
        epochs: training epochs per trial (``len(train) // batch_size`` steps each).
        optimizer: an :mod:`hfkern.optim` optimizer class (or its ``torch.optim``
            namesake, e.g. ``torch.optim.Adam``).
        optimizer_kwargs: ``optimizer_kwargs(params) -> dict`` of the optimizer's
            arguments for one trial (``{"lr": p["lr"], "betas": (p["b1"], 0.999)}``);
            default: the parameters named as the optimizer's per-model
            hyper-parameters (``lr``, ``momentum``, ``weight_decay``, ``eps``, a
            ``betas`` pair from ``beta1`` and ``beta2``, either of which alone
            takes the optimizer's default for the other...), and the parameters
            named as its flags (``nesterov``, ``amsgrad``, ``centered``...:
            grouped parameters, since their values are bools). Per-model
            hyper-parameters may differ in an array; other arguments (``nesterov``,
            ``amsgrad``) are one per array and must agree (ValueError). An
            argument a trial does not give takes the optimizer's default for it
            (``skip_nonfinite``: True), as its own optimizer would: trials of a
            conditional search space (``weight_decay`` for some) share arrays,
            and a slot refilled with such a trial keeps none of the previous
            trial's settings. ValueError where such an argument has no default.
        scheduler: an :mod:`hfkern.optim.lr_scheduler` class or None; not
            ``ReduceLROnPlateau`` (TypeError: it steps on a metric, not by epochs
            or steps).
        scheduler_kwargs: ``scheduler_kwargs(params) -> dict`` of its arguments
            for one trial; the scheduler's per-model arguments may differ, and
            one a trial does not give takes its default (as ``optimizer_kwargs``;
            CyclicLR's ``step_size_down``: None, the trial's ``step_size_up``).
            OneCycleLR's length may be ``total_steps`` for some trials and
            ``epochs`` with ``steps_per_epoch`` for others: each trial's is
            resolved as torch's OneCycleLR resolves it (``total_steps`` where
            given). An idle slot's schedule stands still (it is not stepped)
            until a trial refills the slot and starts its schedule afresh.
        scheduler_interval: ``"epoch"`` (step it after every epoch) or ``"step"``.
        loss: ``loss(output, target, hp) -> [B]`` per-model losses of a step;
            ``output`` is the array's ``[B, N, ...]`` output, ``target`` ``[N, ...]``
            (one batch for all models) or ``[B, N, ...]``, ``hp`` maps every
            fusible parameter to its ``[B]`` float32 values on the device (loss
            weights; NaN for a trial that does not give it), and ``seed_param``
            to each trial's seed, exactly, as ``[B]`` int64 values. Default:
            per-model mean cross entropy.
        loss_denominator: under a strategy of several micro-batches (given, or
            picked with ``memory_budget``), ``loss_denominator(target_chunk)``:
            what ``loss``'s mean over a micro-batch's targets divides by, a
            number or a ``[B]`` tensor (:func:`hfkern.plan.make_step`'s
            ``loss_denominator``), so that the micro-batches' weighted means make
            the full batch's: needed for a mean that is not over samples (class
            weights, ignored targets). Default: each micro-batch weighs by its
            samples (the default ``loss``'s mean); integer targets with
            negative entries (ignored targets) are then refused at the step.
        metric: the value reported to each trial: ``"accuracy"`` or ``"loss"``
            (on ``valid``, per-model mean cross entropy), or
            ``metric(model, hp) -> [B]`` (the fused model in eval mode, under
            ``torch.no_grad``). Default: accuracy for a study that maximizes,
            loss for one that minimizes.
        valid: ``(inputs, targets)`` for the built-in metrics.
        report_every: training steps between two reports (default: one epoch).
            A trial is evaluated, reported, and may be pruned every
            ``report_every`` steps; report ``r`` (1, 2, ...) is Optuna's step.
        B: trials per array (default: :func:`hfkern.max_array_size` of the
            first trial's model, measuring a training step with ``loss`` as
            the trials train, capped at 64 and at ``n_trials``; on a GPU it is
            confirmed by a step).
        device: where the arrays train, a ``"cpu"`` or ``"cuda"`` device
            (default: CUDA if available, else CPU).
        seed: a trial's init seed is its ``seed_param`` value when it has one,
            else ``seed + trial.number``. Seeds are torch's, held exactly in
            ``hp``: a ``seed_param`` value must be an integer in [-2**63, 2**63),
            and ``seed`` in [-2**63, 2**63 - 2**32] (room for 2**32 trials).
        seed_param: the parameter that holds a trial's init seed (fusible).
        data_seed: seed of the training batches' order (the same for every trial).
        on_nonfinite: ``"fail"`` (tell the trial failed) or ``"prune"``, for a
            trial whose loss or value becomes NaN or infinite; its array goes on.
        checkpoint: a file (a str or ``os.PathLike`` path) the runner saves
            its arrays and held trials to (at every ``checkpoint_every``-th
            report). A runner started again with
            the same checkpoint resumes the trials it held, also after their
            heartbeat expired (those another runner failed as lost meanwhile
            are retried instead); without it, a killed runner's trials are
            failed once their heartbeat expires (:func:`hfkern.sweep.storage`)
            and retried.
        checkpoint_every: reports between two checkpoints.
        name: the runner's name in its trials' user attributes (default: host
            and checkpoint path, or host and process id without a checkpoint).
        progress: (a bool) show a progress bar while running and the best trials at the end.
        eval_batch_size: samples per forward pass of the built-in metrics.
        capture: on a CUDA device, replay each training step as one CUDA graph
            (:func:`hfkern.capture_step`: a fused step is host-bound without
            it); the step then must not synchronize (a custom ``loss`` must not
            call ``.item()``). No effect on CPU.
        strategy: an :class:`hfkern.plan.Strategy` (or a ``Plan`` of
            :func:`hfkern.plan`) every array trains under: its blocks
            recomputed, bf16 autocast, micro-batches, layout, and its
            ``arrays`` in flight (that many arrays train together, on a CUDA
            stream each; one after another elsewhere); its ``B`` is the
            runner's ``B`` unless ``B`` is given. Recomputation and arrays in
            flight leave each trial's results unchanged; bf16 and
            micro-batches (models without batch norm only) change them as they
            would alone. Each group's strategy is checked on its first trial's
            model before more trials are asked: one that cannot train it
            (micro-batches on batch norm, unknown recomputed blocks, more
            micro-batches than samples) raises ValueError in :meth:`run`
            without counting any trial as failed.
        memory_budget: bytes a device offers the sweep, or ``"device"``: what
            ``device`` offers (90% of its free memory, as
            :func:`hfkern.max_array_size` reads it). With ``B`` and ``strategy``
            not given, :func:`hfkern.plan` picks, for each group of trials
            (their grouped parameters: their model) when its first array
            starts, the fastest strategy whose predicted peak fits (profiling
            that array's first trial's model), B up to 64 and ``n_trials``,
            one or two arrays in flight on CUDA: a user says only which
            trials to run. Arrays of two groups train together only where
            both groups' strategies plan that many arrays in flight.
            ``runner.plans`` is then the Pareto set the first group chose
            from, ``runner.group_plans`` each group's (keyed by the group's
            sorted ``(name, value)`` pairs). Without it (and without ``B``),
            each group's B is the largest array of its model that fits, with
            no other strategy. A budget that no strategy fits (not even one
            model at B = 1) raises ValueError in :meth:`run`, naming the
            budget and what the smallest plan needs, without counting any
            trial as failed (as a refused ``strategy``). A runner resumed
            from its checkpoint keeps each group's B and strategy without
            planning again; the checkpoint holds no Pareto sets, so
            ``runner.group_plans`` holds only the groups this runner planned,
            and ``runner.plans`` is set only where this runner planned the
            first group (else it is absent: ``hasattr(runner, "plans")`` is
            False), so that ``runner.plans``, ``runner.B`` and
            ``runner.strategy`` always describe the first group.

    The counts (``batch_size``, ``epochs``, ``report_every``, ``B``,
    ``checkpoint_every``, ``eval_batch_size``, and :meth:`run`'s ``n_trials``)
    must be ints: another type (a bool, a float such as ``2.0``, a str) raises
    TypeError, an int below 1 ValueError. ``memory_budget`` raises TypeError
    where it is neither a number nor ``"device"`` (``"8GiB"``, a bool), as
    :func:`hfkern.plan` does, and ValueError where not positive or not finite.
    """

    def __init__(
        self,
        study: optuna.Study,
        space: Callable[[Trial], Params],
        model: Callable[[Params], nn.Module],
        *,
        fusible: Iterable[str],
        train: tuple[torch.Tensor, torch.Tensor],
        batch_size: int,
        epochs: int,
        optimizer: type,
        optimizer_kwargs: Callable[[Params], Params] | None = None,
        grouped: Iterable[str] | None = None,
        scheduler: type | None = None,
        scheduler_kwargs: Callable[[Params], Params] | None = None,
        scheduler_interval: str = "epoch",
        loss: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor] | None = None,
        loss_denominator: Callable[[torch.Tensor], Any] | None = None,
        metric: str | Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
        valid: tuple[torch.Tensor, torch.Tensor] | None = None,
        report_every: int | None = None,
        B: int | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        seed_param: str = "seed",
        data_seed: int = 0,
        on_nonfinite: str = "fail",
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int = 1,
        name: str | None = None,
        progress: bool = True,
        eval_batch_size: int = 1024,
        capture: bool = True,
        strategy: Any = None,
        memory_budget: float | str | None = None,
    ):
        who = "Runner"
        if not isinstance(study, optuna.Study):
            raise TypeError(f"{who}: study must be an optuna.Study, got {type(study).__name__}")
        if len(study.directions) != 1:
            raise ValueError(f"{who}: expected a single-objective study, got {len(study.directions)} directions")
        for label, fn in (("space", space), ("model", model)):
            if not callable(fn):
                raise TypeError(f"{who}: {label} must be callable, got {type(fn).__name__}")
        for label, fn in (("optimizer_kwargs", optimizer_kwargs), ("scheduler_kwargs", scheduler_kwargs),
                          ("loss", loss), ("loss_denominator", loss_denominator)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{who}: {label} must be callable or None, got {type(fn).__name__}")
        if not isinstance(seed_param, str):
            raise TypeError(f"{who}: seed_param must be a parameter name (str), got {type(seed_param).__name__} "
                            f"{seed_param!r}")
        for label, value in (("seed", seed), ("data_seed", data_seed)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{who}: {label} must be an int, got {type(value).__name__} {value!r}")
        if not _SEED_MIN <= seed <= _SEED_MAX + 1 - _SEED_TRIALS:
            raise ValueError(f"{who}: seed must be in [-2**63, 2**63 - 2**32], got {seed}: trial n's seed is "
                             f"seed + n, torch's seed of its model, held exactly in hp as an int64, so it must "
                             f"stay in [-2**63, 2**63) for trial numbers up to 2**32")
        if checkpoint is not None:
            if not isinstance(checkpoint, (str, os.PathLike)) or not isinstance(os.fspath(checkpoint), str):
                raise TypeError(f"{who}: checkpoint must be a file path (a str or os.PathLike of a str) or None, "
                                f"got {type(checkpoint).__name__} {checkpoint!r}")
            if not os.fspath(checkpoint):
                raise ValueError(f"{who}: checkpoint must be a file path or None, got an empty path {checkpoint!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{who}: name must be a str or None, got {type(name).__name__} {name!r}")
        for label, value in (("progress", progress), ("capture", capture)):
            if not isinstance(value, bool):
                raise TypeError(f"{who}: {label} must be a bool, got {type(value).__name__} {value!r}")
        # The counts and the budget, before anything is built (TypeError for a wrong type, ValueError
        # for a bad value).
        for label, value, given in (("batch_size", batch_size, not callable(batch_size)), ("epochs", epochs, True),
                                    ("report_every", report_every, report_every is not None),
                                    ("B", B, B is not None), ("checkpoint_every", checkpoint_every, True),
                                    ("eval_batch_size", eval_batch_size, True)):
            if given:
                self._positive(value, label)
        if memory_budget is not None:
            self._check_memory_budget(memory_budget)
        self.study = study
        self._space, self._model_factory = space, model
        self.fusible = self._names(fusible, "fusible") | {seed_param}
        self.grouped = None if grouped is None else self._names(grouped, "grouped")
        if self.grouped is not None and self.grouped & self.fusible:
            raise ValueError(f"{who}: parameters {sorted(self.grouped & self.fusible)} are both fusible and grouped")
        if not callable(optimizer):
            raise TypeError(f"{who}: optimizer must be an optimizer class or optimizer(params) -> class, got "
                            f"{optimizer!r}")
        self._optimizer = optimizer
        self._optimizer_kwargs = optimizer_kwargs or self._default_optimizer_kwargs
        if scheduler is not None and not (isinstance(scheduler, type) and hasattr(scheduler, "reset_model")):
            raise TypeError(f"{who}: scheduler must be an hfkern.optim.lr_scheduler class or None, got {scheduler!r}")
        if isinstance(scheduler, type) and issubclass(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(f"{who}: scheduler {scheduler.__name__} steps on a metric (step(metrics)), and the "
                            f"runner steps its scheduler every epoch or step without one; pass a scheduler "
                            f"of epochs or steps (StepLR, CosineAnnealingLR, OneCycleLR, ...)")
        self._scheduler_cls = scheduler
        self._scheduler_kwargs = scheduler_kwargs or (lambda params: {})
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"{who}: scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        self.scheduler_interval = scheduler_interval
        self._loss = loss or (lambda out, target, hp: cross_entropy(out, target))
        self._loss_denominator = loss_denominator

        try:
            self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        except (RuntimeError, TypeError) as err:
            raise TypeError(f"{who}: device must be a torch.device or a device string, got {device!r}") from err
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{who}: device must be a 'cpu' or 'cuda' device (where the runner trains, sizes and "
                             f"plans its arrays), got {self.device}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{who}: device {device!r} asked for, but CUDA is not available")
        if self.device.type == "cuda" and self.device.index is not None and self.device.index >= torch.cuda.device_count():
            raise ValueError(f"{who}: device {self.device} asked for, but CUDA has {torch.cuda.device_count()} "
                             f"device(s): expected an index in [0, {torch.cuda.device_count()})")
        self._train = self._pair(train, "train")
        self._valid = None if valid is None else self._pair(valid, "valid")
        if not callable(batch_size):
            self._positive(batch_size, "batch_size")
        self._batch_size = batch_size
        self.epochs = self._positive(epochs, "epochs")
        self._report_every = None if report_every is None else self._positive(report_every, "report_every")
        self._data_seed = int(data_seed)
        self._settings: dict[tuple, _Settings] = {}
        if not callable(batch_size) and isinstance(optimizer, type):
            self._settings_for({})  # the settings' errors now, not at the first array
        maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        metric = metric if metric is not None else ("accuracy" if maximize else "loss")
        if isinstance(metric, str):
            if metric not in ("accuracy", "loss"):
                raise ValueError(f"{who}: metric must be 'accuracy', 'loss' or a callable, got {metric!r}")
            if self._valid is None:
                raise ValueError(f"{who}: metric {metric!r} is computed on valid=(inputs, targets); none given")
        elif not callable(metric):
            raise TypeError(f"{who}: metric must be 'accuracy', 'loss' or a callable, got {type(metric).__name__}")
        self.metric = metric
        self.B = None if B is None else self._positive(B, "B")
        self.seed, self.seed_param = int(seed), seed_param
        if on_nonfinite not in ("fail", "prune"):
            raise ValueError(f"{who}: on_nonfinite must be 'fail' or 'prune', got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        self.checkpoint_every = self._positive(checkpoint_every, "checkpoint_every")
        host = socket.gethostname()
        self.name = name if name is not None else (
            f"{host}:{os.path.abspath(self.checkpoint)}" if self.checkpoint else f"{host}:{os.getpid()}")
        self.progress = progress
        self.eval_batch_size = self._positive(eval_batch_size, "eval_batch_size")
        self.capture = capture
        from ..plan import Plan, Strategy

        if strategy is not None:
            if isinstance(strategy, Plan):
                strategy = strategy.strategy
            if not isinstance(strategy, Strategy):
                raise TypeError(f"{who}: strategy must be an hfkern.plan.Strategy or Plan, got "
                                f"{type(strategy).__name__}")
            if self.B is None:
                self.B = strategy.B
        if memory_budget is not None:  # (its type and value checked above)
            if B is not None or strategy is not None:
                raise ValueError(f"{who}: memory_budget picks B and the strategy; pass it without B and strategy")
        self.strategy = strategy
        self.memory_budget = memory_budget
        # B and strategy not given: each group (key) is sized for its own model, once.
        self._sized_per_group = B is None and strategy is None
        self._sizes: dict[tuple, tuple[int, Strategy | None]] = {}
        self.group_plans: dict[tuple, Any] = {}  # a memory budget's Pareto set per group

        self._arrays: list[_Array] = []  # in flight: at most the strategy's ``arrays``
        self._streams = None             # Streams of the arrays in flight (made at the first round)
        self._queue: list[_Entry] = []
        self._stop_asking = False
        self._n_trials = 0
        self._rounds = 0
        self._tally = {"completed": 0, "pruned": 0, "failed": 0, "arrays": 0, "compactions": 0}
        self._not_awaited: set[int] = set()  # running trials without a heartbeat, warned of (_awaited)
        self._strategies_checked: set[tuple] = set()  # (group key, strategy) pairs that train (_check_strategy)

    # ---- argument checks -------------------------------------------------------------
    @staticmethod
    def _names(names: Iterable[str], label: str) -> set[str]:
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise TypeError(f"Runner: {label} must be a collection of parameter names, got {names!r}")
        names = set(names)
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"Runner: {label} must hold parameter names (str), got {bad}")
        return names

    @staticmethod
    def _positive(value: Any, label: str, who: str = "Runner") -> int:
        """``value`` as a positive int: TypeError for what is not an int (a bool, a float such as 2.0,
        a str such as "2"), ValueError for an int below 1."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{who}: {label} must be a positive int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{who}: {label} must be a positive int, got {value!r}")
        return int(value)

    @staticmethod
    def _check_memory_budget(memory_budget: Any) -> None:
        """``memory_budget`` (not None) as :func:`hfkern.plan` checks it: TypeError for what is neither
        a number of bytes nor ``"device"`` (another str such as "8GiB", a bool), ValueError for a
        number not positive or not finite."""
        if isinstance(memory_budget, str) and memory_budget == "device":
            return
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real):
            raise TypeError(f"Runner: memory_budget must be a number of bytes or 'device', got "
                            f"{type(memory_budget).__name__} {memory_budget!r}")
        if not 0 < memory_budget < math.inf:
            raise ValueError(f"Runner: memory_budget must be a positive, finite number of bytes or 'device', got "
                             f"{memory_budget!r}")

    def _pair(self, data: Any, label: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data)):
            raise TypeError(f"Runner: {label} must be (inputs, targets), two tensors, got {type(data).__name__}")
        x, y = data
        if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(f"Runner: {label}'s inputs and targets must have the samples in dim 0, got shapes "
                             f"{list(x.shape)} and {list(y.shape)}")
        return x.to(self.device), y.to(self.device)

    def _settings_for(self, params: Params) -> _Settings:
        """The batch size, round length and optimizer class of a trial with ``params``."""
        who = "Runner"
        bs = self._batch_size(params) if callable(self._batch_size) else self._batch_size
        if isinstance(bs, bool) or not isinstance(bs, numbers.Integral) or bs < 1:
            raise ValueError(f"{who}: batch_size(params) must return a positive int, got {bs!r}")
        opt = self._optimizer if isinstance(self._optimizer, type) else self._optimizer(params)
        cls = _optimizer_class(opt)
        cached = self._settings.get((int(bs), cls))
        if cached is not None:
            return cached
        n = self._train[0].shape[0]
        if bs > n:
            raise ValueError(f"{who}: batch_size {bs} exceeds the {n} training samples")
        spe = n // int(bs)
        total = self.epochs * spe
        every = self._report_every or spe
        if total % every:
            raise ValueError(f"{who}: report_every ({every}) must divide a trial's {total} steps ({self.epochs} "
                             f"epochs of {spe} at batch size {bs})")
        if self._scheduler_cls is not None and self.scheduler_interval == "epoch" and every % spe:
            raise ValueError(f"{who}: a per-epoch scheduler needs reports at epoch ends (every trial enters its "
                             f"array at a report), so report_every must be a multiple of {spe} steps (an epoch "
                             f"at batch size {bs}), got {every}; or use scheduler_interval='step'")
        settings = _Settings(int(bs), spe, total, every, cls, BatchOrder(n, int(bs), self._data_seed, self.device))
        self._settings[(int(bs), cls)] = settings
        return settings

    def _default_optimizer_kwargs(self, params: Params) -> dict[str, Any]:
        """The parameters named as the optimizer's per-model arguments; a pair (``betas``) from its
        two halves (``beta1``, ``beta2``), a half not given taking the optimizer's default; and the
        parameters named as its flags (``nesterov``, ``amsgrad``, ``centered``, ...: one value per
        array, which the trials of an array share: :meth:`_split_kwargs` and :meth:`_slot_kwargs`
        refuse an array whose trials differ in one)."""
        cls = self._settings_for(params).optimizer_cls
        out = {key: params[key] for key in cls._flags if key in params}
        for key in cls._hypers + cls._init_hypers:
            rows = cls._spec.pair(key)
            if rows is None:
                if key in params:
                    out[key] = params[key]
            elif any(r in params for r in rows):
                default = _defaults(cls).get(key)
                missing = [r for r in rows if r not in params]
                if missing and default is None:
                    raise ValueError(f"Runner: parameters {[r for r in rows if r in params]} give part of "
                                     f"{cls.__name__}'s {key!r}, which has no default for {missing}: give "
                                     f"{list(rows)}")
                out[key] = tuple(params[r] if r in params else default[j] for j, r in enumerate(rows))
        return out

    # ---- trials ----------------------------------------------------------------------
    def _budget_left(self) -> int:
        if self._stop_asking:
            return 0
        # Waiting trials (enqueued, or retries of lost ones) are run by whoever asks next, so
        # they count once asked.
        return self._n_trials - sum(counts(t) and t.state != TrialState.WAITING
                                    for t in self.study.get_trials(deepcopy=False))

    def _next_trial(self) -> Trial | None:
        """A new trial from the study while the budget lasts (``study.ask()``: a waiting trial
        first), else a waiting retry of a lost trial (:meth:`_take_retry`); None when neither."""
        if self._budget_left() > 0:
            with warnings.catch_warnings():
                # "Heartbeat of storage is supposed to be used with Study.optimize": this runner
                # records the heartbeats itself (_beat).
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                return self.study.ask()
        return None if self._stop_asking else self._take_retry()

    def _take_retry(self) -> Trial | None:
        """A retry of a lost trial waiting in the study, taken (RUNNING) by this runner, or None.

        Retries are run whatever the budget: a lost trial does not count, so its retry runs in
        its place, and the budget has room for it unless the study was taken past ``n_trials``
        (two runners asking at once): a runner that dies holding k trials then leaves k retries
        and a budget of fewer, and the others would leave the rest WAITING. A retry is taken as
        ``study.ask()`` takes a waiting trial (the first to set it RUNNING has it), but only a
        retry: a trial enqueued past the budget stays waiting.
        """
        storage = self.study._storage
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            if "failed_trial" not in t.system_attrs:  # Optuna's mark of a retry
                continue
            try:
                if not storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    continue  # taken by another runner
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
            return Trial(self.study, t._trial_id)
        return None

    def _ask(self) -> _Entry | None:
        """The next trial (:meth:`_next_trial`), its parameters drawn and checked; None when there
        is none to run."""
        trial = self._next_trial()
        if trial is None:
            return None
        try:
            params = self._space(trial)
            if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
                raise TypeError(f"Runner: space(trial) must return a dict of parameters by name, got "
                                f"{type(params).__name__}")
            params = dict(params)
            for k, v in params.items():
                if k in self.fusible and not _is_number(v):
                    raise TypeError(f"Runner: parameter {k!r} is declared fusible, but its value {v!r} is not a "
                                    f"number: a fusible value becomes one entry of a [B] tensor; declare {k!r} "
                                    f"grouped (trials with different values then train in different arrays)")
                if self.grouped is not None and k not in self.fusible and k not in self.grouped:
                    raise ValueError(f"Runner: parameter {k!r} is neither fusible {sorted(self.fusible)} nor "
                                     f"grouped {sorted(self.grouped)}; declare it")
            if self.seed_param in params:
                seed = _trial_seed(params[self.seed_param], f"seed parameter {self.seed_param!r}", trial.number)
            elif SEED_ATTR in trial.user_attrs:  # a retry of a lost trial keeps its seed
                seed = _trial_seed(trial.user_attrs[SEED_ATTR], "seed", trial.number)
            else:
                seed = _trial_seed(self.seed + trial.number, "seed (the runner's seed + its number)", trial.number)
            trial.set_user_attr(RUNNER_ATTR, self.name)
            trial.set_user_attr(SEED_ATTR, seed)
            # At once: a trial with no heartbeat is never taken as stale, and this
            # runner may die before its next report.
            self._beat([trial])
        except _INTERRUPTS:
            # Not held yet, so no restart resumes it: lost, as a kill's would be, and retried.
            if self._fail(trial, "lost", counted=False):
                _storage.retry(self.study, self.study._storage.get_trial(trial._trial_id))
            raise
        except BaseException:
            self._fail(trial, "error", counted=True)
            raise
        key = tuple(sorted((k, _hashable(v)) for k, v in params.items() if k not in self.fusible))
        return _Entry(trial, params, seed, key)

    def _fail(self, trial: Trial, outcome: str, counted: bool) -> bool:
        """Tell ``trial`` failed with ``outcome``; False (logged) where it was finished elsewhere."""
        try:
            trial.set_user_attr(OUTCOME_ATTR, outcome)
            if counted:
                trial.set_user_attr(COUNTED_ATTR, True)
            self.study.tell(trial, state=TrialState.FAIL)
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError) as err:
            self._finished_elsewhere(trial, err)
            return False
        return True

    def _tell(self, entry: _Entry, **kwargs: Any) -> bool:
        """Tell ``entry``'s trial finished; False (logged) where it was finished elsewhere."""
        try:
            self.study.tell(entry.trial, **kwargs)
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError) as err:
            self._finished_elsewhere(entry.trial, err)
            return False
        return True

    @staticmethod
    def _finished_elsewhere(trial: Trial, err: BaseException) -> None:
        _log.warning("trial %d was finished elsewhere, failed as lost by another runner (this runner's heartbeats "
                     "lapsed past the grace period); dropped, not counted here, its retry runs in its place: %s",
                     trial.number, err)

    @property
    def in_flight(self) -> int:
        """Arrays trained together, at most: the strategy's ``arrays`` (1 without a strategy); where
        each group is planned apart, the most any group's strategy has."""
        if self._sized_per_group:
            return max((_arrays_of(s) for _, s in self._sizes.values()), default=1)
        return _arrays_of(self.strategy)

    def _held(self) -> list[_Entry]:
        return [s for a in self._arrays for s in a.slots if s is not None] + self._queue

    # ---- arrays ----------------------------------------------------------------------
    def _build_model(self, entry: _Entry) -> nn.Module:
        with seeded(entry.seed, "cpu", "Runner"):
            m = self._model_factory(entry.params)
        if not isinstance(m, nn.Module):
            raise TypeError(f"Runner: model(params) must return a torch.nn.Module, got {type(m).__name__}")
        return m

    def _fusible_differences(self, a: _Entry, b: _Entry) -> str:
        diff = [f"{k}={a.params.get(k)!r} vs {b.params.get(k)!r}" for k in sorted(self.fusible)
                if a.params.get(k) != b.params.get(k) and k != self.seed_param]
        return ", ".join(diff) or "only their seeds"

    @staticmethod
    def _split_kwargs(per_slot: list[dict[str, Any]], per_model: Sequence[str], defaults: Mapping[str, Any],
                      what: str, entries: list[_Entry],
                      none_ok: frozenset[str] = frozenset()) -> tuple[dict[str, list], _Args]:
        """Per-slot keyword dicts -> (per-model lists, the array's _Args).

        An argument some trials give and others do not takes its default (``defaults``) for the
        others, as each trial's own constructor call would: a conditional search space may leave
        ``weight_decay`` out of some trials. ValueError where such an argument has no default, and
        where a one-per-array argument differs between the trials.
        """
        stacked, shared = {}, {}
        for k in sorted(set().union(*per_slot)):
            values = [_given_or_default(kw, k, defaults, k in per_model, none_ok) for kw in per_slot]
            missing = [e for v, e in zip(values, entries) if v is _NO_DEFAULT]
            if missing:
                giver = next(e for kw, e in zip(per_slot, entries) if k in kw)
                raise ValueError(f"Runner: {what}(params) gives {k!r} for trial {giver.trial.number} but not for "
                                 f"trial {missing[0].trial.number}, and {k!r} has no default to take: give it "
                                 f"for every trial")
            if k in per_model:
                stacked[k] = values
                continue
            for v, e in zip(values, entries):
                if _hashable(v) != _hashable(values[0]):
                    raise ValueError(
                        f"Runner: {what} argument {k!r} is one value per array, but trial {e.trial.number} "
                        f"has {v!r} and trial {entries[0].trial.number} {values[0]!r}: derive it from "
                        f"grouped parameters only")
            shared[k] = values[0]
        return stacked, _Args(shared, set(stacked), defaults, none_ok)

    @staticmethod
    def _slot_kwargs(kw: Mapping[str, Any], per_model: Sequence[str], args: _Args, what: str,
                     entry: _Entry) -> dict[str, Any]:
        """The per-model arguments of a slot that trial ``entry`` (its arguments ``kw``) refills in an
        array whose optimizer (or scheduler) was built with ``args``: what ``kw`` gives, and the
        default of every per-model argument the array's trials gave and ``kw`` does not, so that
        no setting of the slot's previous trial stays; checked as a new array checks them."""
        def shown(given: Mapping[str, Any], k: str) -> str:
            if k in given:
                return repr(given[k])
            default = args.defaults.get(k, _NO_DEFAULT)
            return "none" if default is _NO_DEFAULT else f"none (default {default!r})"

        for k in sorted((set(kw) | set(args.shared)) - set(per_model)):
            mine = _given_or_default(kw, k, args.defaults, False)
            theirs = _given_or_default(args.shared, k, args.defaults, False)
            if mine is _NO_DEFAULT or theirs is _NO_DEFAULT or _hashable(mine) != _hashable(theirs):
                raise ValueError(f"Runner: {what} argument {k!r} is one value per array; trial "
                                 f"{entry.trial.number} gives {shown(kw, k)}, its array {shown(args.shared, k)}: "
                                 f"derive it from grouped parameters only")
        out = {}
        for k in sorted((set(kw) & set(per_model)) | args.given):
            out[k] = _given_or_default(kw, k, args.defaults, True, args.none_ok)
            if out[k] is _NO_DEFAULT:
                raise ValueError(f"Runner: {what}(params) gives no {k!r} for trial {entry.trial.number}, the "
                                 f"trials of its array do, and {k!r} has no default to take: give it for every "
                                 f"trial")
        return out

    def _optimizer_for(self, model: nn.Module, entries: list[_Entry],
                       settings: _Settings) -> tuple[ArrayOptimizer, _Args]:
        cls = settings.optimizer_cls
        per_slot = [dict(self._optimizer_kwargs(e.params)) for e in entries]
        stacked, args = self._split_kwargs(per_slot, cls._hypers + cls._init_hypers, _optimizer_defaults(cls),
                                           "optimizer_kwargs", entries)
        kwargs = dict(args.shared)
        for k, values in stacked.items():
            rows = cls._spec.pair(k)
            if rows is not None:  # a pair of per-model values: (values of beta1, values of beta2)
                bad = [v for v in values if not (isinstance(v, (tuple, list)) and len(v) == 2)]
                if bad:
                    raise ValueError(f"Runner: optimizer argument {k!r} must be a pair per trial, got {bad[0]!r}")
                kwargs[k] = ([v[0] for v in values], [v[1] for v in values])
            else:
                kwargs[k] = values
        kwargs.setdefault("skip_nonfinite", args.defaults["skip_nonfinite"])
        return cls(model.parameters(), **kwargs), args

    def _scheduler_for(self, optimizer: ArrayOptimizer, entries: list[_Entry]) -> tuple[Any, _Args]:
        if self._scheduler_cls is None:
            return None, _Args({}, set(), {})
        cls = self._scheduler_cls
        per_slot = [self._trial_scheduler_kwargs(e) for e in entries]
        stacked, args = self._split_kwargs(per_slot, cls._model_args, _defaults(cls), "scheduler_kwargs", entries,
                                           _scheduler_none_ok(cls))
        return cls(optimizer, **args.shared, **stacked), args

    def _trial_scheduler_kwargs(self, entry: _Entry) -> dict[str, Any]:
        """``scheduler_kwargs(params)`` of trial ``entry`` as the array's scheduler takes them
        (:func:`_trial_scheduler_kwargs`)."""
        return _trial_scheduler_kwargs(self._scheduler_cls, self._scheduler_kwargs(entry.params), entry.trial.number)

    def _new_array(self, entries: list[_Entry], B: int, strategy: Any) -> _Array:
        """An array of B slots; ``entries`` fill the first ones, the rest are idle (copies of the first)."""
        models = [self._build_model(e) for e in entries]
        models += [copy.deepcopy(models[0]) for _ in range(B - len(entries))]
        try:
            model = fusion.fuse(models)
        except fusion.FuseError as err:
            differ = sorted(k for k in self.fusible - {self.seed_param}
                            if len({_hashable(e.params.get(k)) for e in entries}) > 1)
            raise ValueError(
                f"Runner: the models of trials {[e.trial.number for e in entries]} (same grouped parameters) "
                f"differ in architecture; fusible parameters that differ between them: {differ}; a parameter "
                f"declared fusible changes the model, declare it grouped: {err}") from err
        model.to(self.device)
        self._apply_strategy(model, B, strategy)
        return self._assemble(model, list(entries) + [None] * (B - len(entries)), strategy)

    def _assemble(self, model: fusion.FusedModel, slots: list[_Entry | None], strategy: Any,
                  saved: dict[str, Any] | None = None) -> _Array:
        """The array of ``model`` (built, on the device, ``strategy`` applied) with trials in ``slots`` (None:
        idle; idle slots take the first trial's hyper-parameters): its optimizer and scheduler, with
        the ``saved`` state of both loaded when given (a checkpoint's, or a compacted array's), and
        the ``hp`` the loss reads (:meth:`_hp_values`)."""
        kept = [e for e in slots if e is not None]
        padded = [e if e is not None else kept[0] for e in slots]
        settings = self._settings_of(kept)
        optimizer, optimizer_args = self._optimizer_for(model, padded, settings)
        # Built before the saved state is loaded: a scheduler's constructor takes its initial step,
        # which writes the learning rates (LinearLR scales them) and would overwrite the loaded ones.
        scheduler, scheduler_args = self._scheduler_for(optimizer, padded)
        if saved is not None:
            optimizer.load_state_dict(saved["optimizer"])
            if scheduler is not None:
                scheduler.load_state_dict(saved["scheduler"])
            # The loaded rows hold the arguments every trial the array had gave, also trials that
            # have left it (idle slots): a refill resets those to their defaults (_slot_kwargs).
            cls = settings.optimizer_cls
            optimizer_args.given |= self._saved_given(saved, "optimizer", cls._hypers + cls._init_hypers,
                                                      optimizer_args.defaults)
            if scheduler is not None:
                given = self._saved_given(saved, "scheduler", type(scheduler)._model_args, scheduler_args.defaults,
                                          scheduler_args.none_ok)
                scheduler_args.given |= _scheduler_given(type(scheduler), given)
        hp = self._hp_tensors([self._hp_values(e) for e in padded], self.device)
        return self._finish_array(_Array(kept[0].key, settings, model, optimizer, scheduler, slots, optimizer_args,
                                         scheduler_args, hp, torch.zeros(len(slots), dtype=torch.bool,
                                                                         device=self.device),
                                         torch.tensor([e is None for e in slots], device=self.device),
                                         strategy))

    @staticmethod
    def _saved_given(saved: Mapping[str, Any], what: str, per_model: Sequence[str],
                     defaults: Mapping[str, Any], none_ok: frozenset[str] = frozenset()) -> set[str]:
        """The per-model arguments of the ``saved`` optimizer (``what``: "optimizer") or scheduler
        that some trial of its array gave. A checkpoint before format 4 does not say: there, every
        per-model argument its state holds that has a default to take counts as given (a refill
        then sets the default where its trial gives none, which is what its own optimizer would
        take; an argument without a default was given by every trial that trained with it)."""
        given = saved.get(f"{what}_given")
        if given is not None:
            return set(given)
        state = saved.get(what)
        if not isinstance(state, Mapping):
            return set()
        if what == "optimizer":
            present = {k for group in state.get("param_groups", ()) if isinstance(group, Mapping) for k in group}
        else:
            present = set(state)
        return {k for k in per_model
                if k in present and _given_or_default({}, k, defaults, True, none_ok) is not _NO_DEFAULT}

    def _finish_array(self, a: _Array) -> _Array:
        a.model.train()
        a.step = self._step_fn(a)
        self._tally["arrays"] += 1
        return a

    def _hp_values(self, entry: _Entry) -> dict[str, float | int]:
        """What the loss and metric read of ``entry`` in ``hp``: every fusible parameter's value,
        NaN where the trial does not give it (a conditional space), the trial's seed (an int) for
        ``seed_param`` (given or not): the same keys in every array, whichever trial opened it."""
        values: dict[str, float | int] = {k: float(entry.params.get(k, math.nan)) for k in self.fusible}
        values[self.seed_param] = int(entry.seed)
        return values

    def _hp_tensors(self, values: list[Mapping[str, float | int]], device: torch.device) -> dict[str, torch.Tensor]:
        """``hp`` of slots with ``values`` (:meth:`_hp_values`): ``[B]`` float32 values of each fusible
        parameter, and the seeds as ``[B]`` int64 (exact: a float32 rounds seeds above 2**24)."""
        return {k: torch.tensor([v[k] for v in values], device=device,
                                dtype=torch.int64 if k == self.seed_param else torch.float32)
                for k in sorted(self.fusible)}

    def _settings_of(self, entries: list[_Entry]) -> _Settings:
        """The one settings of an array's trials; ValueError where a fusible parameter changes them."""
        settings = self._settings_for(entries[0].params)
        for e in entries[1:]:
            other = self._settings_for(e.params)
            if other is not settings:
                raise ValueError(
                    f"Runner: trials {entries[0].trial.number} and {e.trial.number} have the same grouped "
                    f"parameters but batch sizes {settings.batch_size} and {other.batch_size}, optimizers "
                    f"{settings.optimizer_cls.__name__} and {other.optimizer_cls.__name__}: derive batch_size "
                    f"and optimizer from grouped parameters only ({self._fusible_differences(entries[0], e)})")
        return settings

    def _place(self, a: _Array, b: int, entry: _Entry) -> None:
        """Slot b of array ``a`` starts ``entry``: fresh model, optimizer state and schedule."""
        ref = next((s for s in a.slots if s is not None), None)
        if self._settings_for(entry.params) is not a.settings:
            raise ValueError(f"Runner: trial {entry.trial.number} has its array's grouped parameters but another "
                             f"batch size or optimizer: derive batch_size and optimizer from grouped parameters "
                             f"only" + ("" if ref is None else f" ({self._fusible_differences(entry, ref)})"))
        # The trial's arguments, checked before the slot changes.
        cls = a.settings.optimizer_cls
        opt_kw = self._slot_kwargs(self._optimizer_kwargs(entry.params), cls._hypers + cls._init_hypers,
                                   a.optimizer_args, "optimizer_kwargs", entry)
        sched_kw = {}
        if a.scheduler is not None:
            sched_kw = self._slot_kwargs(self._trial_scheduler_kwargs(entry), type(a.scheduler)._model_args,
                                         a.scheduler_args, "scheduler_kwargs", entry)
        try:
            a.model.reset_model(b, entry.seed, factory=lambda: self._model_factory(entry.params))
        except fusion.FuseError as err:
            raise ValueError(f"Runner: trial {entry.trial.number}'s model does not fit its array (fusible "
                             f"parameters differ: {self._fusible_differences(entry, ref or entry)}); a parameter declared "
                             f"fusible changes the model, declare it grouped: {err}") from err
        a.optimizer.set_hyperparameters(b, **opt_kw)
        a.optimizer.reset_state(b)
        a.optimizer_args.given |= set(opt_kw)
        if a.scheduler is not None:
            a.scheduler.reset_model(b, **sched_kw)
            a.scheduler_args.given |= set(sched_kw)
        with torch.no_grad():
            values = self._hp_values(entry)
            for k, t in a.hp.items():
                t[b] = values[k]
        a.bad[b] = False
        a.idle[b] = False
        entry.step, entry.reported = 0, 0
        a.slots[b] = entry

    # ---- filling ---------------------------------------------------------------------
    def _take_queued(self, key: tuple) -> _Entry | None:
        for i, e in enumerate(self._queue):
            if e.key == key:
                return self._queue.pop(i)
        return None

    def _ask_for(self, key: tuple) -> tuple[bool, _Entry | None]:
        """Ask one trial (:meth:`_ask`): ``(True, trial)`` if it belongs to ``key``'s array,
        ``(True, None)`` if it went to the queue (another group's), ``(False, None)`` when there is
        none to run."""
        entry = self._ask()
        if entry is None:
            return False, None
        if entry.key == key:
            return True, entry
        self._queue.append(entry)
        return True, None

    def _start_array(self) -> _Array | None:
        """Build the next array from the queue and new trials; None when nothing is left to run,
        or when the next group's array cannot train together with those in flight yet.

        The trials it takes stay held whatever raises (the user's ``space``, ``model``, their
        checks): they go back to the front of the queue, and :meth:`run` fails them."""
        if not self._queue:
            entry = self._ask()
            if entry is None:
                return None
            self._queue.append(entry)
        key = self._queue[0].key
        entries = []
        try:
            entries.append(self._take_queued(key))
            size, strategy = self._size_of(entries[0])
            self._check_strategy(entries[0], strategy)  # before more trials are asked for it
            # Arrays train together only as many as every one's strategy plans in flight (each
            # group's plan fits its memory with that many of its own arrays): else this group's
            # array waits until those in flight have drained.
            if self._arrays and len(self._arrays) >= min([_arrays_of(strategy)]
                                                         + [_arrays_of(a.strategy) for a in self._arrays]):
                self._queue[:0] = entries
                return None
            while len(entries) < size and (e := self._take_queued(key)) is not None:
                entries.append(e)
            while len(entries) < size and len(self._queue) < 2 * size:
                asked, e = self._ask_for(key)
                if not asked:
                    break
                if e is not None:
                    entries.append(e)
            while len(entries) < size and (e := self._take_queued(key)) is not None:
                entries.append(e)
            B = min(size, len(entries) + max(self._budget_left(), 0))
            return self._new_array(entries, B, strategy)
        except BaseException:
            self._queue[:0] = entries  # still held: run() fails them
            raise

    def _check_strategy(self, entry: _Entry, strategy: Any) -> None:
        """Check once per group and strategy that ``strategy`` trains the group's models (``entry``'s
        model, the first of its group): :func:`hfkern.plan.apply` and :func:`hfkern.plan.make_step` on
        an array of that model alone, and a batch that holds the micro-batches. A strategy refused
        raises :class:`_Refused` (a ValueError; :meth:`run` fails the held trials uncounted); an
        error of the user's ``model`` is the trial's own."""
        if strategy is None or (entry.key, strategy) in self._strategies_checked:
            return
        from ..plan import apply, make_step

        model = fusion.fuse([self._build_model(entry)])
        model.to(self.device)
        one = dataclasses.replace(strategy, B=1)
        bs = self._settings_for(entry.params).batch_size
        unused = types.SimpleNamespace(zero_grad=lambda *args, **kwargs: None, step=lambda *args, **kwargs: None)
        try:
            if strategy.micro_batches > bs:
                raise ValueError(f"micro_batches={strategy.micro_batches} exceeds the batch size {bs}: expected "
                                 f"at most one micro-batch per sample")
            apply(model, one)
            make_step(model, unused, one, lambda out, y: self._loss(out, y, {}), shared=True,
                      loss_denominator=self._loss_denominator)
        except (TypeError, ValueError) as err:
            group = ", ".join(f"{k}={entry.params[k]!r}" for k, _ in entry.key)
            raise _Refused(f"Runner: strategy {strategy.label!r} cannot train the models "
                           f"{f'of group {group} ' if group else ''}(checked on trial {entry.trial.number}'s "
                           f"model, before more trials were asked): {err}") from err
        self._strategies_checked.add((entry.key, strategy))

    def _refill(self, a: _Array) -> None:
        """Fill the idle slots of ``a`` with queued trials of its group, else new ones. A trial
        whose placing raises (its ``model``, its arguments' checks) stays held: it goes back to the
        front of the queue, and :meth:`run` fails it."""
        for b in range(a.B):
            if a.slots[b] is not None:
                continue
            entry = self._take_queued(a.key)
            if entry is None:
                if self._queue:  # other arrays wait: let this one drain instead of growing the queue
                    break
                _, entry = self._ask_for(a.key)
                if entry is None:  # none to run, or queued for another group
                    break
            try:
                self._place(a, b, entry)
            except BaseException:
                self._queue.insert(0, entry)
                raise

    def _compact_if_draining(self, a: _Array) -> _Array:
        """Rebuild the array around its trials when refilling left half of its slots or more idle.

        Idle slots cost what busy ones cost (their models compute and are
        skipped), and an array drains at the end of a sweep (or before another
        group's array): its last trials would otherwise train in an array of B.
        The rebuilt array carries every trial's weights, buffers, optimizer
        and scheduler state over, so their trajectories do not change.
        Returns the array to train on (``a`` itself when kept).
        """
        active = a.active()
        if not active or len(active) > a.B // 2:
            return a
        model = fusion.fuse([a.model.extract_model(b) for b in active])
        model.to(self.device)
        self._apply_strategy(model, len(active), a.strategy)
        # The remaining trials' optimizer and scheduler state, loaded as a checkpoint's is. (Their
        # non-finite flags need no carrying: the round's report has just cleared them.)
        saved = {"optimizer": _select_models(a.optimizer.state_dict(), torch.tensor(active), a.B),
                 "scheduler": None if a.scheduler is None else a.scheduler.state_dict_of(active),
                 "optimizer_given": sorted(a.optimizer_args.given),
                 "scheduler_given": sorted(a.scheduler_args.given)}
        smaller = self._assemble(model, [a.slots[b] for b in active], a.strategy, saved)
        self._tally["arrays"] -= 1  # the same trials' array, smaller
        self._tally["compactions"] += 1
        return smaller

    def _size_of(self, entry: _Entry) -> tuple[int, Any]:
        """(B, strategy) of the arrays of ``entry``'s group: those given, or those chosen for the
        group's model (:meth:`_choose_B`) when its first array starts."""
        if not self._sized_per_group:
            return self.B, self.strategy
        if entry.key not in self._sizes:
            self._sizes[entry.key] = self._choose_B(entry)
            if self.B is None:  # the first group's, as runner.B, runner.strategy and runner.plans
                self.B, self.strategy = self._sizes[entry.key]
                if entry.key in self.group_plans:
                    self.plans = self.group_plans[entry.key]
        return self._sizes[entry.key]

    def _choose_B(self, entry: _Entry) -> tuple[int, Any]:
        """(B, strategy) for the model of ``entry``'s group: planned within ``memory_budget``, else the
        largest array that fits (no strategy)."""
        from ._memory import max_array_size

        if self.memory_budget is not None:
            return self._plan(entry)

        kw = self._optimizer_kwargs(entry.params)
        settings = self._settings_for(entry.params)
        cls, bs = settings.optimizer_cls, settings.batch_size
        values = self._hp_values(entry)

        def step(model: fusion.FusedModel, optimizer: ArrayOptimizer, batch: tuple) -> None:
            # A training step as the trials train (_step_fn): the runner's loss, with the first
            # trial's fusible values in every slot, on one batch shared by the B models.
            x, y = batch
            out = model(broadcast(x, model.B))
            losses = self._check_losses(self._loss(out, y, self._hp_tensors([values] * model.B, x.device)),
                                        model.B)
            optimizer.zero_grad()
            losses.sum().backward()
            optimizer.step()

        x, y = self._train
        estimate = max_array_size(lambda: self._build_model(entry), (x[:bs], y[:bs]), step,
                                  device=self.device, optimizer=lambda params: cls(params, **kw),
                                  max_B=min(_MAX_B, self._n_trials))
        B = max(1, estimate.B)
        _log.info("%sB = %d from %s", self._group_label(entry), B, estimate)
        if self.progress:
            _report.note(f"hfkern.sweep: {self._group_label(entry)}B = {B} ({estimate})")
        return B, None

    def _group_label(self, entry: _Entry) -> str:
        """``"group width=5: "`` where trials have grouped parameters, else nothing."""
        group = ", ".join(f"{k}={entry.params[k]!r}" for k, _ in entry.key)
        return f"group {group}: " if group else ""

    def _plan(self, entry: _Entry) -> tuple[int, Any]:
        """The fastest strategy within ``memory_budget`` for the model of ``entry``'s group
        (:func:`hfkern.plan`). A budget no strategy fits is a configuration error, not the trial's
        failure: it raises :class:`_Refused` (:meth:`run` fails the held trials uncounted), naming
        the budget and what the smallest plan needs."""
        from .. import plan as hplan
        from ._memory import _format_bytes, _free_bytes

        # What plan() would take for "device" (90% of the free memory), read before the profiling as
        # plan() reads it. plan() is given no bound, so that the smallest plan is known where none fits.
        device_budget = isinstance(self.memory_budget, str)  # "device"
        budget = _DEVICE_FRACTION * _free_bytes(self.device) if device_budget else float(self.memory_budget)
        settings = self._settings_for(entry.params)
        kw = self._optimizer_kwargs(entry.params)
        cls, bs = settings.optimizer_cls, settings.batch_size
        values = self._hp_values(entry)

        def loss(out, y):  # the runner's loss with the first trial's fusible values in every slot
            first = tree_leaves(out)[0]  # the output, or its first tensor (a model returning a tuple)
            return self._loss(out, y, self._hp_tensors([values] * first.shape[0], first.device))

        x, y = self._train
        plans = hplan(lambda: self._build_model(entry), (x[:bs], y[:bs]), trials=self._n_trials,
                      steps=settings.total_steps, device=self.device, optimizer=lambda params: cls(params, **kw),
                      loss_fn=loss, B_values=range(1, min(_MAX_B, self._n_trials) + 1),
                      memory_budget=sys.float_info.max)
        every = plans.unbounded_front or plans.front
        fitting = [p for p in every if p.peak_memory <= budget]
        if not fitting:
            least = min(every, key=lambda p: p.peak_memory)
            have, need = _format_bytes(budget), _format_bytes(least.peak_memory)
            if have == need:  # rounded alike: the exact counts tell them apart
                have, need = f"{have} ({int(budget)} bytes)", f"{need} ({int(least.peak_memory)} bytes)"
            if device_budget:
                have = f"{have} ({_DEVICE_FRACTION:.0%} of the free memory of {self.device})"
            group = ", ".join(f"{k}={entry.params[k]!r}" for k, _ in entry.key)
            raise _Refused(f"Runner(memory_budget={self.memory_budget!r}): no strategy fits {have} for "
                           f"the models {f'of group {group} ' if group else ''}(planned on trial "
                           f"{entry.trial.number}'s model, before more trials were asked); the smallest plan "
                           f"needs {need} ({least.strategy.label}): give a larger memory_budget (or B and a "
                           f"strategy of your own instead)")
        # The set plan() returns for the budget: the plans within it in front, all in unbounded_front.
        plans = dataclasses.replace(plans, front=[p for p in plans.front if p.peak_memory <= budget],
                                    memory_budget=budget, unbounded_front=list(every))
        chosen = plans.best()
        self.group_plans[entry.key] = plans  # runner.plans: the first group's (_size_of)
        _log.info("%splan: %s", self._group_label(entry), chosen.strategy.label)
        if self.progress:
            _report.note(f"hfkern.sweep: {self._group_label(entry)}{chosen.strategy.label} (predicted "
                         f"{chosen.step_time * 1e3:.1f} ms a step, {chosen.peak_memory / 2**20:.1f} MiB of "
                         f"{plans.memory_budget / 2**20:.1f} MiB)")
        return chosen.B, chosen.strategy

    # ---- training --------------------------------------------------------------------
    def _train_round(self) -> None:
        """Every array in flight trains its round (``report_every`` steps); their steps are
        issued in turn, each array's on its own stream (:class:`~hfkern.plan._strategy.Streams`)."""
        from ..plan._strategy import Streams

        arrays = self._arrays
        if self._streams is None or len(self._streams) < len(arrays):
            self._streams = Streams(max(len(arrays), self.in_flight), self.device)
        streams = self._streams
        # A permutation made on one array's stream must not be read on another's: the round's
        # epochs are made on the current stream, before the fork.
        for a in arrays:
            steps = [a.slots[b].step for b in a.active()]
            a.settings.order.prepare(min(steps), max(steps) + a.settings.report_every - 1)
        streams.fork()
        for i in range(max(a.settings.report_every for a in arrays)):
            for j, a in enumerate(arrays):
                if i < a.settings.report_every:
                    with streams.on(j):
                        self._train_step(a)
        streams.join()

    def _train_step(self, a: _Array) -> None:
        order = a.settings.order
        active = a.active()
        steps = [a.slots[b].step for b in active]
        x_all, y_all = self._train
        if len(set(steps)) == 1:  # one batch for every model: read once, as a broadcast input
            idx = order.rows(steps[:1])[0]
        else:  # each model its own batch: [B, batch_size, ...] (idle slots take the first's)
            idx = order.rows([a.slots[b].step if a.slots[b] is not None else steps[0] for b in range(a.B)])
        losses = a.step(x_all[idx], y_all[idx], a.idle)
        a.bad |= ~torch.isfinite(losses)
        for b in active:
            a.slots[b].step += 1
        if a.scheduler is not None and (self.scheduler_interval == "step"
                                        or a.slots[active[0]].step % a.settings.steps_per_epoch == 0):
            self._step_scheduler(a, active)

    @staticmethod
    def _step_scheduler(a: _Array, active: list[int]) -> None:
        """Step the schedules of the slots with a trial; an idle slot's stays where its last trial
        left it, as that trial's own scheduler would after its last step (a OneCycleLR stepped past
        its ``total_steps`` raises), until a refill restarts it (:meth:`_place`)."""
        if len(active) == a.B:
            a.scheduler.step()
        else:
            a.scheduler._step_models(torch.tensor([s is not None for s in a.slots]))

    @staticmethod
    def _apply_strategy(model: nn.Module, B: int, strategy: Any) -> None:
        if strategy is not None:
            from ..plan import apply

            apply(model, dataclasses.replace(strategy, B=B))

    def _step_fn(self, a: _Array) -> Callable:
        """One training step of array ``a`` (forward, per-model losses, backward, optimizer), replayed
        as one CUDA graph with ``capture`` on a CUDA device. Everything the step reads that changes
        (surgery, hyper-parameters, the idle mask, schedules) is written in place, so a refill
        needs no new capture."""
        shared_dims = self._train[0].dim()
        if a.strategy is not None:
            from ..plan import make_step

            strategy = dataclasses.replace(a.strategy, B=a.B)
            loss = lambda out, y: self._loss(out, y, a.hp)  # noqa: E731
            steps = {shared: make_step(a.model, a.optimizer, strategy, loss, shared=shared,
                                       loss_denominator=self._loss_denominator) for shared in (True, False)}

            def step(x: torch.Tensor, y: torch.Tensor, idle: torch.Tensor) -> torch.Tensor:
                return steps[x.dim() == shared_dims](x, y, skip=idle)

            if not self.capture:
                return step
            bs = a.settings.batch_size
            return capture_step(step, self._train[0][:bs], self._train[1][:bs], a.idle)

        def step(x: torch.Tensor, y: torch.Tensor, idle: torch.Tensor) -> torch.Tensor:
            out = a.model(broadcast(x, a.B) if x.dim() == shared_dims else x)
            losses = self._check_losses(self._loss(out, y, a.hp), a.B)
            a.optimizer.zero_grad()
            losses.sum().backward()
            a.optimizer.step(skip=idle)
            return losses.detach()

        if not self.capture:
            return step
        bs = a.settings.batch_size
        return capture_step(step, self._train[0][:bs], self._train[1][:bs], a.idle)

    @staticmethod
    def _check_losses(losses: Any, B: int) -> torch.Tensor:
        if not (isinstance(losses, torch.Tensor) and losses.shape == (B,)):
            raise ValueError(f"Runner: loss(output, target, hp) must return the [B] = [{B}] per-model "
                             f"losses, got {type(losses).__name__} {list(getattr(losses, 'shape', []))}")
        return losses

    @torch.no_grad()
    def _evaluate(self, a: _Array) -> list[float]:
        a.model.eval()
        try:
            if callable(self.metric):
                values = self.metric(a.model, a.hp)
                if not (isinstance(values, torch.Tensor) and values.shape == (a.B,)):
                    raise ValueError(f"Runner: metric(model, hp) must return [B] = [{a.B}] values, got "
                                     f"{type(values).__name__} {list(getattr(values, 'shape', []))}")
                return values.double().tolist()
            x_all, y_all = self._valid
            total = torch.zeros(a.B, dtype=torch.float64, device=self.device)
            for i in range(0, x_all.shape[0], self.eval_batch_size):
                x, y = x_all[i:i + self.eval_batch_size], y_all[i:i + self.eval_batch_size]
                out = a.model(broadcast(x, a.B))
                if self.metric == "accuracy":
                    total += (out.argmax(-1) == y).sum(-1).double()
                else:
                    total += cross_entropy(out.float(), y, reduction="sum").double()
            return (total / x_all.shape[0]).tolist()
        finally:
            a.model.train()

    def _end_round(self, a: _Array) -> None:
        values = self._evaluate(a)
        bad = a.bad.tolist()
        a.bad.zero_()
        for b in a.active():
            entry, v = a.slots[b], values[b]
            r = entry.step // a.settings.report_every
            if bad[b] or not math.isfinite(v):
                # Counted where told here (not where another runner failed it as lost meanwhile).
                if self.on_nonfinite == "prune":
                    if self._tell(entry, state=TrialState.PRUNED):
                        self._tally["pruned"] += 1
                elif self._fail(entry.trial, "nonfinite", counted=True):
                    self._tally["failed"] += 1
                self._free(a, b)
                continue
            try:
                if r > entry.reported:  # a resumed trial repeats reports the study already has
                    entry.trial.report(v, r)
                    entry.reported = r
                # As Optuna's own loop (report, then ask the pruner) does, also at the last report.
                prune = entry.trial.should_prune()
            except optuna.exceptions.UpdateFinishedTrialError as err:
                self._finished_elsewhere(entry.trial, err)  # its retry runs in its place
                self._free(a, b)
                continue
            if prune:
                if self._tell(entry, state=TrialState.PRUNED):
                    self._tally["pruned"] += 1
                self._free(a, b)
            elif entry.step >= a.settings.total_steps:
                if self._tell(entry, values=v):
                    self._tally["completed"] += 1
                self._free(a, b)

    @staticmethod
    def _free(a: _Array, b: int) -> None:
        a.slots[b] = None
        a.idle[b] = True

    def _beat(self, trials: list[Trial]) -> None:
        self._beat_ids([t._trial_id for t in trials])

    def _beat_ids(self, trial_ids: Iterable[int]) -> None:
        storage = self.study._storage
        if optuna.storages._heartbeat.is_heartbeat_enabled(storage):
            for trial_id in trial_ids:
                storage.record_heartbeat(trial_id)

    # ---- the loop --------------------------------------------------------------------
    def run(self, n_trials: int, timeout: float | None = None) -> SweepSummary:
        """Run until the study holds ``n_trials`` trials that count (every runner's; see
        :func:`hfkern.sweep.counted_trials`) and this runner's trials are finished.

        Several runners given the same ``n_trials`` share the work; two that
        ask at the same moment may take the study one or two trials past it.
        On a storage with heartbeats (:func:`hfkern.sweep.storage`), a runner
        with nothing left to ask waits while other runners' trials run: if one
        of those runners dies, its trials are failed as lost after the grace
        period, retried, and run here, so the study still ends with
        ``n_trials``. A waiting retry of a lost trial is always run, whatever
        the budget (a study taken past ``n_trials`` stays as far past it). A
        trial of this runner's that another runner failed as lost meanwhile
        (this runner's heartbeats lapsed) is dropped at its next report and
        not counted in the summary. A
        running trial without a heartbeat (asked by a client that records
        none) would never be failed so: it is not waited for once it is older
        than the grace period, and a warning names it.
        Samplers given one seed in several processes propose the same
        parameters: seed them differently per process (or not at all).
        ``timeout`` (seconds): no new trial is asked after it; held trials
        finish. On an exception (the user's ``space``, ``model`` or their
        checks included), the held trials, the one being placed among them,
        are told failed (``"error"``, counted) and it is raised again. Two
        exceptions are not the trials' own: a ``KeyboardInterrupt`` or
        ``SystemExit`` leaves the held trials as a kill would (RUNNING: a
        runner started again with the same ``checkpoint``, or this one run
        again, resumes them from its last checkpoint; else they are failed
        as lost once their heartbeat expires, and retried; a trial being
        asked is failed as lost), and a strategy the runner refuses for a
        group's models (micro-batches on a model with batch norm, ...), checked
        on the group's first trial before more are asked, fails the held
        trials uncounted (``"error"``, retried where the storage retries lost
        trials); both are raised again. The summary counts this call's work
        only.
        """
        n_trials = self._positive(n_trials, "n_trials", "Runner.run")
        if timeout is not None:
            if not _is_number(timeout):
                raise TypeError(f"Runner.run: timeout must be a number of seconds or None, got "
                                f"{type(timeout).__name__} {timeout!r}")
            if not timeout > 0:
                raise ValueError(f"Runner.run: timeout must be a positive number of seconds or None, got "
                                 f"{timeout!r}")
        self._n_trials = n_trials
        start = time.monotonic()
        self._stop_asking = False
        self._tally = dict.fromkeys(self._tally, 0)  # the summary is this call's
        bar = _report.Progress(self.study, self._n_trials, enabled=self.progress)
        try:
            self._recover()
            while True:
                self._arrays = [a for a in self._arrays if a.active()]
                # Up to the strategy's arrays in flight (read again: planning may set it).
                while len(self._arrays) < self.in_flight and (a := self._start_array()) is not None:
                    self._arrays.append(a)
                if not self._arrays:
                    if self._stop_asking or not self._wait_for_others():
                        break
                    continue
                self._train_round()
                for a in self._arrays:
                    self._end_round(a)
                if timeout is not None and time.monotonic() - start > timeout:
                    self._stop_asking = True
                for i, a in enumerate(self._arrays):
                    self._refill(a)
                    self._arrays[i] = self._compact_if_draining(a)
                self._beat([e.trial for e in self._held()])
                self._fail_stale()  # trials of runners that died since: failed, retried, not counted
                self._rounds += 1
                if self.checkpoint and self._rounds % self.checkpoint_every == 0:
                    self._save()
                self._forget_old_epochs()
                bar.update(running=len(self._held()))
        except _INTERRUPTS:
            # Left as a kill leaves them: RUNNING, resumed from the checkpoint by a runner started
            # again with it (this one too: run() again), else failed as lost once their heartbeat
            # expires (or by this runner's name at its next start), and retried.
            self._arrays, self._queue = [], []
            raise
        except _Refused as err:
            # Refused before they trained: the held trials are not counted, and retried (same
            # parameters and seed) where the storage retries lost trials.
            for e in self._held():
                if self._fail(e.trial, "error", counted=False):
                    _storage.retry(self.study, self.study._storage.get_trial(e.trial._trial_id))
            self._arrays, self._queue = [], []
            raise ValueError(*err.args) from err.__cause__  # a plain ValueError, as the user's to fix
        except BaseException:
            for e in self._held():
                self._fail(e.trial, "error", counted=True)
            self._arrays, self._queue = [], []
            raise
        finally:
            bar.close()
        if self.checkpoint and os.path.exists(self.checkpoint):
            os.remove(self.checkpoint)  # nothing held: a restart has nothing to resume
        if self.progress:
            _report.print_best_trials(self.study)
        return SweepSummary(self._tally["completed"], self._tally["pruned"], self._tally["failed"],
                            self._tally["arrays"], self._largest_B(), time.monotonic() - start,
                            self._tally["compactions"], self.in_flight)

    def _largest_B(self) -> int:
        """The summary's B: the given one, or the largest any group was sized to (0: none yet)."""
        if self._sized_per_group:
            return max((B for B, _ in self._sizes.values()), default=0)
        return self.B or 0

    def _forget_old_epochs(self) -> None:
        """Drop the batch orders' permutations of epochs no held trial trains again (arrays of one
        batch size and optimizer share an order)."""
        for settings in {id(a.settings): a.settings for a in self._arrays}.values():
            epochs = [a.slots[b].step // settings.steps_per_epoch
                      for a in self._arrays if a.settings is settings for b in a.active()]
            if epochs:
                settings.order.forget_before(min(epochs))

    # ---- checkpoint and resume ---------------------------------------------------------
    def _save(self) -> None:
        def entry(e: _Entry) -> dict[str, Any]:
            return {"trial_id": e.trial._trial_id, "params": e.params, "seed": e.seed, "step": e.step,
                    "reported": e.reported}

        state = {
            "version": _CHECKPOINT_VERSION, "study": self.study.study_name, "runner": self.name, "B": self.B,
            "strategy": self.strategy,  # given, or the first group's
            "sizes": self._sizes if self._sized_per_group else None,  # each group's (B, strategy), chosen once
            "queue": [entry(e) for e in self._queue],
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "arrays": [{
                "slots": [None if s is None else entry(s) for s in a.slots], "strategy": a.strategy,
                "model": a.model.state_dict(), "optimizer": a.optimizer.state_dict(),
                "scheduler": None if a.scheduler is None else a.scheduler.state_dict(),
                # The per-model arguments some trial of the array gave (also trials that have left it:
                # their rows stay until a refill sets the default, _slot_kwargs).
                "optimizer_given": sorted(a.optimizer_args.given),
                "scheduler_given": sorted(a.scheduler_args.given),
            } for a in self._arrays],
        }
        # Written whole, then renamed over the old one: a kill mid-write leaves the previous checkpoint.
        tmp = f"{self.checkpoint}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint)

    def _entry_from(self, saved: dict[str, Any]) -> _Entry | None:
        """The held trial ``saved`` if it is still RUNNING in the study (another runner may have failed it)."""
        frozen = self.study._storage.get_trial(saved["trial_id"])
        if frozen.state != TrialState.RUNNING:
            return None
        params = saved["params"]
        key = tuple(sorted((k, _hashable(v)) for k, v in params.items() if k not in self.fusible))
        reported = max(frozen.intermediate_values, default=0)
        return _Entry(Trial(self.study, saved["trial_id"]), params, saved["seed"], key, saved["step"], reported)

    def _wait_for_others(self) -> bool:
        """With nothing left to ask: while other runners' trials run, wait a heartbeat and look
        again, so that the trials of a runner that dies now are failed, retried and run here.
        False when no running trial is worth waiting for (:meth:`_awaited`), or the storage has
        no heartbeat."""
        storage = self.study._storage
        if not optuna.storages._heartbeat.is_heartbeat_enabled(storage):
            return False
        if not self._awaited(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
            return False
        time.sleep(min(storage.get_heartbeat_interval(), 5))
        self._fail_stale()
        return True

    def _awaited(self, running: list[FrozenTrial]) -> list[FrozenTrial]:
        """The running trials worth waiting for: those with a heartbeat (if their runner dies, they
        are failed as stale after the grace period, and retried), and those started less than a
        grace period ago (their first heartbeat may be on its way). A trial running longer without
        one never becomes stale (its client records no heartbeat: a plain ``study.ask()``), so
        waiting for it would never end; it is named in a warning, once, and not waited for."""
        storage = self.study._storage
        beating = _storage.with_heartbeat(storage, [t._trial_id for t in running])
        grace = datetime.timedelta(seconds=_storage.grace_period(storage))
        now = datetime.datetime.now()  # Optuna's start times are the local time of the asking client
        awaited = []
        for t in running:
            # Where the storage cannot tell: the trials of hfkern runners, which beat from their ask on.
            beats = RUNNER_ATTR in t.user_attrs if beating is None else t._trial_id in beating
            if beats or t.datetime_start is None or now - t.datetime_start < grace:
                awaited.append(t)
            elif t.number not in self._not_awaited:
                self._not_awaited.add(t.number)
                _log.warning("trial %d has been RUNNING since %s without a heartbeat: its client records none, "
                             "so it is never failed as stale; not waiting for it (tell it failed if its client "
                             "is gone)", t.number, t.datetime_start)
        return awaited

    def _fail_stale(self) -> None:
        """Fail the stale trials of runners that died as lost, and retry them
        (:func:`hfkern.sweep._storage.fail_stale_trials`)."""
        _storage.fail_stale_trials(self.study)

    def _recover(self) -> None:
        """Resume what the checkpoint holds; fail this runner's trials it does not hold; fail stale trials.

        The checkpoint's trials still RUNNING get a heartbeat before stale trials are failed: a
        runner started again after the grace period resumes them (they are its own, not lost)."""
        state = None
        if self.checkpoint and os.path.exists(self.checkpoint) and not self._arrays and not self._queue:
            # The checkpoint is this runner's own file; it holds optimizer and scheduler
            # state with Python objects (a LambdaLR's functions), so it is loaded whole.
            state = torch.load(self.checkpoint, map_location=self.device, weights_only=False)
            if state.get("version") not in (1, 2, 3, _CHECKPOINT_VERSION) or state.get("study") != self.study.study_name:
                raise ValueError(f"Runner: checkpoint {self.checkpoint!r} belongs to study {state.get('study')!r} "
                                 f"(format {state.get('version')}), not to {self.study.study_name!r}")
            arrays = state["arrays"] if "arrays" in state else [a for a in (state["array"],) if a is not None]
            saved_ids = [s["trial_id"] for s in state["queue"]]
            saved_ids += [s["trial_id"] for saved in arrays for s in saved["slots"] if s is not None]
            storage = self.study._storage
            self._beat_ids(i for i in saved_ids if storage.get_trial(i).state == TrialState.RUNNING)
        self._fail_stale()
        held: set[int] = {e.trial._trial_id for e in self._held()}
        if state is not None:
            if self._sized_per_group:  # the sizes chosen before stay (given ones stay as given)
                self.B, self.strategy = state["B"], state.get("strategy")
                if state.get("sizes") is not None:
                    self._sizes.update(state["sizes"])
                elif self.B is not None:  # formats 1 and 2: one B and strategy for every group
                    self._sized_per_group = False
                # runner.plans with runner.B and runner.strategy: the first group's (the checkpoint's first
                # sized), where this runner planned it; the checkpoint holds no Pareto sets.
                first = next(iter(state.get("sizes") or ()), None)
                if first is not None and first in self.group_plans:
                    self.plans = self.group_plans[first]
                elif hasattr(self, "plans"):
                    del self.plans
            self._queue = [e for e in map(self._entry_from, state["queue"]) if e is not None]
            for saved in arrays:
                slots = [None if s is None else self._entry_from(s) for s in saved["slots"]]
                if any(s is not None for s in slots):
                    try:
                        strategy = saved["strategy"] if "strategy" in saved else self.strategy
                        self._arrays.append(self._resume_array(slots, saved, strategy))
                    except BaseException:  # the user's model, its checks: still held, run() fails them
                        self._queue[:0] = [e for e in slots if e is not None]
                        raise
            torch.set_rng_state(state["rng"].cpu())
            if state["cuda_rng"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)
            held = {e.trial._trial_id for e in self._held()}
        lost = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.user_attrs.get(RUNNER_ATTR) == self.name and t._trial_id not in held]
        for t in lost:
            # Retried as Optuna retries a stale trial, once: only where this runner failed it (another
            # runner may have failed it as stale meanwhile, and retried it).
            if self._fail(Trial(self.study, t._trial_id), "lost", counted=False):
                _storage.retry(self.study, self.study._storage.get_trial(t._trial_id))

    def _resume_array(self, slots: list[_Entry | None], saved: dict[str, Any], strategy: Any) -> _Array:
        """Rebuild the checkpointed array with the trials still running; the others' slots become idle."""
        kept = [s for s in slots if s is not None]
        B = len(slots)
        # Built as the array was (slot i from its trial), then its saved state is loaded over it.
        padded = [s if s is not None else kept[0] for s in slots]
        models = [self._build_model(e) for e in padded]
        model = fusion.fuse(models)
        model.to(self.device)
        self._apply_strategy(model, B, strategy)
        model.load_state_dict(saved["model"])
        return self._assemble(model, slots, strategy, saved)
