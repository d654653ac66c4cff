"""Learning-rate schedulers for array optimizers: torch's schedules, one per model.

Each scheduler drives the ``[B]`` learning-rate tensors in an array optimizer's
``param_groups`` so that model b follows exactly the schedule that
``torch.optim.lr_scheduler.<Same>`` with model b's arguments gives model b
alone: the initial step in the constructor, ``initial_lr`` / ``base_lrs``, the
chained update of :meth:`LRScheduler.step` and the closed form of
``step(epoch)``. Every numeric argument may be per model: a number (all models
alike), a length-B sequence or a 1-D tensor of length B.

The schedule is computed on the host in float64, the arithmetic torch does with
Python floats, and written into the optimizer's tensors in place with one small
host-to-device copy per param group and step (from pinned memory, non-blocking,
on CUDA): stepping a scheduler never waits for the device. The host copy of a
group's learning rates is shared by every scheduler of the optimizer, so
schedulers chain as in torch; a learning rate changed outside the schedulers
(assigned anew, or edited in place) is noticed through the tensor's identity and
version counter and read back once.

Values a scheduler keeps itself (``base_lrs``, ``get_last_lr()``, and the
``initial_lr``, ``max_lr``, ``min_lr``, ``max_momentum``, ``base_momentum``
entries it adds to ``param_groups``) are ``[B]`` float64 CPU tensors.
"""

from __future__ import annotations

import math
import numbers
import operator
import types
import warnings
import weakref
from bisect import bisect_right
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch

from .._array import hyper

__all__ = [
    "LRScheduler",
    "StepLR",
    "MultiStepLR",
    "ExponentialLR",
    "CosineAnnealingLR",
    "LinearLR",
    "OneCycleLR",
    "LambdaLR",
    "SequentialLR",
    "ReduceLROnPlateau",
]

_F64 = torch.float64
_EPOCH_DEPRECATION_WARNING = getattr(
    _torch,
    "EPOCH_DEPRECATION_WARNING",
    "The epoch parameter in `scheduler.step()` is deprecated; the closed form is used when given.",
)


# ---- argument parsing ---------------------------------------------------
def _array_size(optimizer: object, who: str) -> int:
    """The array size B of ``optimizer``: its ``B`` attribute, else its parameters' leading dim."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{who}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    B = getattr(optimizer, "B", None)
    if isinstance(B, int) and not isinstance(B, bool) and B >= 1:
        return B
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.dim() >= 1:
                return p.size(0)
    raise ValueError(f"{who}: the optimizer has no [B, ...] parameter to take the array size B from")


def _floats(value: object, B: int, name: str) -> torch.Tensor:
    """A per-model non-negative argument as a fresh ``[B]`` float64 CPU tensor."""
    return hyper(value, B, name).clone()


def _read(value: object, B: int, name: str) -> torch.Tensor:
    """A per-model value stored in a param group, as ``[B]`` float64 on the host (never modify)."""
    if isinstance(value, torch.Tensor) and value.dtype == _F64 and value.device.type == "cpu" \
            and value.shape == (B,):
        return value
    return hyper(value, B, name)


def _ints(value: object, B: int, name: str, *, minimum: int) -> torch.Tensor:
    """A per-model integer argument (int, length-B sequence of ints, 1-D integer tensor) as ``[B]`` int64."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or integers (one per model), got a {value.dtype} tensor")
        t = value.detach().to(device="cpu", dtype=torch.int64).clone()
        if t.dim() == 0:
            t = t.expand(B).clone()
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        t = torch.full((B,), int(value), dtype=torch.int64)
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = []
        for v in value:
            if isinstance(v, bool):
                raise TypeError(f"{name} must hold ints (one per model), got {value!r}")
            try:
                items.append(operator.index(v))
            except TypeError:
                raise TypeError(f"{name} must hold ints (one per model), got {value!r}") from None
        t = torch.tensor(items, dtype=torch.int64)
    else:
        raise TypeError(
            f"{name} must be an int, a length-{B} sequence of ints or a 1-D integer tensor, "
            f"got {type(value).__name__} {value!r}"
        )
    if t.dim() != 1 or t.numel() != B:
        raise ValueError(f"{name} must have one value per model (length B={B}), got shape {list(t.shape)}")
    if (t < minimum).any():
        raise ValueError(f"{name} must be >= {minimum} for every model, got {t.tolist()}")
    return t


def _check_range(t: torch.Tensor, name: str, lo: float, hi: float, *, lo_open: bool = False,
                 hi_open: bool = False) -> None:
    bad = (t <= lo if lo_open else t < lo) | (t >= hi if hi_open else t > hi)
    if bad.any():
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(
            f"{name} must lie in {interval} for every model; models {bad.nonzero().flatten().tolist()} "
            f"have {t[bad].tolist()}"
        )


def _is_nested(value: object) -> bool:
    """True for a list/tuple with a sequence or 1-D tensor in it: one per-model value per param group."""
    return isinstance(value, (list, tuple)) and any(
        (isinstance(v, torch.Tensor) and v.dim() > 0)
        or (isinstance(v, Sequence) and not isinstance(v, (str, torch.Tensor)))
        for v in value
    )


def _per_group(value: object, n_groups: int, B: int, name: str) -> list[torch.Tensor]:
    """An argument torch takes per param group: one per-model value for all groups, or a list of them.

    A flat list of numbers is per model (the hfkern convention); one value per
    param group is a list of per-model values, e.g. ``[[a0, a1, a2], 0.1]``.
    """
    if _is_nested(value):
        if len(value) != n_groups:
            raise ValueError(
                f"{name}: expected one per-model value per param group ({n_groups}), got {len(value)}"
            )
        return [_floats(v, B, f"{name}[{i}]") for i, v in enumerate(value)]
    t = _floats(value, B, name)
    return [t.clone() for _ in range(n_groups)]


def _milestones(value: object, B: int, name: str = "milestones") -> list[Counter]:
    """One shared list of epochs, or one list per model, as B Counters."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of ints, or one list per model, got {type(value).__name__}")
    value = list(value)

    def ints(seq: Iterable, where: str) -> list[int]:
        out = []
        for v in seq:
            if isinstance(v, bool):
                raise TypeError(f"{where} must hold ints, got {v!r}")
            try:
                out.append(operator.index(v))
            except TypeError:
                raise TypeError(f"{where} must hold ints, got {v!r}") from None
        return out

    nested = [isinstance(v, Iterable) and not isinstance(v, (str, bytes)) for v in value]
    if value and all(nested):
        if len(value) != B:
            raise ValueError(f"{name}: expected one list per model (B={B}), got {len(value)} lists")
        return [Counter(ints(v, f"{name}[{b}]")) for b, v in enumerate(value)]
    if any(nested):
        raise TypeError(f"{name} must be one list of ints or one list per model, not a mix: {value!r}")
    shared = ints(value, name)
    return [Counter(shared) for _ in range(B)]


# ---- the host copy of the learning rates ----------------------------------
class _HostLR:
    """A group's learning rates on the host, valid while ``source`` is unchanged."""

    __slots__ = ("group", "source", "version", "values")

    def __init__(self, group: dict, source: object, values: torch.Tensor):
        self.group = group  # held so that id(group) stays this group's
        self.source = source
        self.version = _version(source)
        self.values = values


_HOST_LRS: weakref.WeakKeyDictionary[Optimizer, dict[int, _HostLR]] = weakref.WeakKeyDictionary()


def _version(t: object) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _valid(entry: _HostLR | None, group: dict) -> bool:
    lr = group["lr"]
    return (
        entry is not None and entry.group is group and isinstance(lr, torch.Tensor)
        and entry.source is lr and entry.version == _version(lr)
    )


def _current_lr(optimizer: Optimizer, group: dict, B: int) -> torch.Tensor:
    """``group["lr"]`` as ``[B]`` float64 on the host; reads the device only after an outside change."""
    entries = _HOST_LRS.setdefault(optimizer, {})
    entry = entries.get(id(group))
    if _valid(entry, group):
        return entry.values
    values = hyper(group["lr"], B, "lr").clone()
    live = {id(g) for g in optimizer.param_groups}
    for k in [k for k in entries if k not in live]:
        del entries[k]
    entries[id(group)] = _HostLR(group, group["lr"], values)
    return values


def _is_array_tensor(t: object, B: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == B and t.is_floating_point()


def _copy_into(dst: torch.Tensor, values: torch.Tensor) -> None:
    """Write host ``values`` into ``dst`` in place, without making the host wait for the device."""
    src = values.to(dst.dtype)
    with torch.no_grad():
        if dst.device.type == "cuda":
            # A pageable source makes copy_ synchronize the stream; a pinned one
            # is copied asynchronously, and the caching host allocator keeps
            # the buffer alive until the copy has run.
            dst.copy_(src.pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)


def _set_lr(optimizer: Optimizer, group: dict, values: torch.Tensor, B: int) -> None:
    """Set the group's learning rates to the ``[B]`` float64 host ``values``."""
    entries = _HOST_LRS.setdefault(optimizer, {})
    entry = entries.get(id(group))
    lr = group["lr"]
    if _is_array_tensor(lr, B):
        if not (_valid(entry, group) and torch.equal(entry.values, values)):
            _copy_into(lr, values)
    else:
        # Not (yet) a [B] tensor, e.g. a float the user assigned: hand the
        # optimizer a new value, which it validates and stores at its next step.
        lr = values.clone()
        group["lr"] = lr
    entries[id(group)] = _HostLR(group, lr, values)


def _set_value(group: dict, key: str, values: torch.Tensor, B: int) -> None:
    """Set a per-model hyperparameter other than lr (momentum), in place where it is a [B] tensor."""
    if _is_array_tensor(group[key], B):
        _copy_into(group[key], values)
    else:
        group[key] = values.clone()


def _set_beta1(group: dict, values: torch.Tensor, B: int) -> None:
    betas = group["betas"]
    if _is_array_tensor(betas[0], B):
        _copy_into(betas[0], values)
    else:
        group["betas"] = (values.clone(), *betas[1:])


# ---- schedulers -----------------------------------------------------------
class LRScheduler(_torch.LRScheduler):
    """Base class of the array schedulers: torch's ``LRScheduler`` with ``[B]`` learning rates.

    Subclasses set their per-model arguments, then call ``super().__init__``,
    which records ``initial_lr`` (``[B]`` float64 CPU) in every param group that
    has none, sets ``base_lrs`` from it and takes the initial step.
    :meth:`get_lr` returns one ``[B]`` float64 CPU tensor per param group.
    """

    _is_initial: bool = False

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        self.B = _array_size(optimizer, type(self).__name__)
        self.optimizer = optimizer
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"last_epoch must be an int >= -1, got {last_epoch!r}")
        if last_epoch == -1:
            for group in optimizer.param_groups:
                if "initial_lr" not in group:
                    group["initial_lr"] = _current_lr(optimizer, group, self.B).clone()
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(
                        f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a "
                        "scheduler with last_epoch >= 0"
                    )
        self.base_lrs: list[torch.Tensor] = [
            _read(group["initial_lr"], self.B, f"param_groups[{i}]['initial_lr']").clone()
            for i, group in enumerate(optimizer.param_groups)
        ]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def _lrs(self) -> list[torch.Tensor]:
        """The optimizer's current learning rates, one ``[B]`` float64 host tensor per group."""
        return [_current_lr(self.optimizer, g, self.B) for g in self.optimizer.param_groups]

    def get_lr(self) -> list[torch.Tensor]:
        """The learning rates for the current ``last_epoch``: one ``[B]`` float64 tensor per group."""
        raise NotImplementedError

    def get_last_lr(self) -> list[torch.Tensor]:
        """The learning rates the last step set: one ``[B]`` float64 CPU tensor per param group."""
        return self._last_lr

    def step(self, epoch: int | None = None) -> None:
        """Advance every model's schedule by one step (call after ``optimizer.step()``).

        ``epoch`` (deprecated, as in torch) jumps to that epoch with the closed
        form where the scheduler has one.
        """
        self._step_count += 1
        if epoch is not None:
            warnings.warn(_EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=2)
        self._update_lr(epoch)

    def _update_lr(self, epoch: int | None = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed_form = getattr(self, "_get_closed_form_lr", None)
            values = closed_form() if closed_form is not None else self.get_lr()
        groups = self.optimizer.param_groups
        if len(values) != len(groups):
            raise ValueError(
                f"{type(self).__name__}: computed {len(values)} learning rates for "
                f"{len(groups)} param groups (was a group added after the scheduler?)"
            )
        for group, v in zip(groups, values):
            _set_lr(self.optimizer, group, v, self.B)
        self._last_lr = [v.clone() for v in self._lrs()]

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` of a scheduler with the same B."""
        _check_state_B(self, state_dict)
        self.__dict__.update(state_dict)


def _check_state_B(scheduler: Any, state_dict: dict[str, Any]) -> None:
    B = state_dict.get("B", scheduler.B)
    if B != scheduler.B:
        raise ValueError(
            f"{type(scheduler).__name__}.load_state_dict: the state is of an array of B={B} models, "
            f"this scheduler's optimizer has B={scheduler.B}"
        )


class StepLR(LRScheduler):
    """Decay each model's learning rate by ``gamma`` every ``step_size`` epochs.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        step_size: period of decay, int >= 1, per model.
        gamma: multiplicative decay, per model. Default 0.1.
        last_epoch: index of the last epoch; -1 starts the schedule.
    """

    def __init__(self, optimizer: Optimizer, step_size: int | Sequence[int] | torch.Tensor,
                 gamma: float | Sequence[float] | torch.Tensor = 0.1, last_epoch: int = -1) -> None:
        B = _array_size(optimizer, "StepLR")
        self.step_size = _ints(step_size, B, "step_size", minimum=1)
        self.gamma = _floats(gamma, B, "gamma")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[torch.Tensor]:
        lrs = self._lrs()
        e = self.last_epoch
        if e == 0:
            return lrs
        decay = torch.remainder(torch.full_like(self.step_size, e), self.step_size) == 0
        return [torch.where(decay, lr * self.gamma, lr) for lr in lrs]

    def _get_closed_form_lr(self) -> list[torch.Tensor]:
        n = torch.div(torch.full_like(self.step_size, self.last_epoch), self.step_size, rounding_mode="floor")
        return [base * self.gamma ** n for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """Decay each model's learning rate by ``gamma`` at each of its milestones.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        milestones: one list of epochs for every model, or one list per model
            (B lists, of any lengths). An epoch listed n times decays by gamma**n.
        gamma: multiplicative decay, per model. Default 0.1.
        last_epoch: index of the last epoch; -1 starts the schedule.
    """

    def __init__(self, optimizer: Optimizer, milestones: Iterable[int] | Sequence[Iterable[int]],
                 gamma: float | Sequence[float] | torch.Tensor = 0.1, last_epoch: int = -1) -> None:
        B = _array_size(optimizer, "MultiStepLR")
        self.milestones = _milestones(milestones, B)
        self.gamma = _floats(gamma, B, "gamma")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[torch.Tensor]:
        lrs = self._lrs()
        counts = torch.tensor([m[self.last_epoch] for m in self.milestones], dtype=_F64)
        return [torch.where(counts > 0, lr * self.gamma ** counts, lr) for lr in lrs]

    def _get_closed_form_lr(self) -> list[torch.Tensor]:
        n = torch.tensor(
            [bisect_right(sorted(m.elements()), self.last_epoch) for m in self.milestones], dtype=_F64
        )
        return [base * self.gamma ** n for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """Decay each model's learning rate by ``gamma`` (per model) every epoch."""

    def __init__(self, optimizer: Optimizer, gamma: float | Sequence[float] | torch.Tensor,
                 last_epoch: int = -1) -> None:
        B = _array_size(optimizer, "ExponentialLR")
        self.gamma = _floats(gamma, B, "gamma")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[torch.Tensor]:
        lrs = self._lrs()
        if self._is_initial:
            return lrs
        return [lr * self.gamma for lr in lrs]

    def _get_closed_form_lr(self) -> list[torch.Tensor]:
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing of each model's learning rate from its base to ``eta_min`` over ``T_max`` epochs.

    Chained (recursive) update as in torch, which keeps following the cosine
    past ``T_max`` (back up to the base lr at ``2 * T_max``).

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        T_max: half period in epochs, int >= 1, per model.
        eta_min: minimum learning rate, per model. Default 0.
        last_epoch: index of the last epoch; -1 starts the schedule.
    """

    def __init__(self, optimizer: Optimizer, T_max: int | Sequence[int] | torch.Tensor,
                 eta_min: float | Sequence[float] | torch.Tensor = 0.0, last_epoch: int = -1) -> None:
        B = _array_size(optimizer, "CosineAnnealingLR")
        self.T_max = _ints(T_max, B, "T_max", minimum=1)
        self.eta_min = _floats(eta_min, B, "eta_min")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[torch.Tensor]:
        lrs = self._lrs()
        if self._is_initial:
            return lrs
        e, eta, T = self.last_epoch, self.eta_min, self.T_max.to(_F64)
        if self._step_count == 1 and e > 0:
            cos = torch.cos(e * math.pi / T)
            return [eta + (base - eta) * (1 + cos) / 2 for base in self.base_lrs]
        # At the bottom of the cosine the ratio below is 0/0; torch steps up by the closed-form increment.
        bottom = torch.remainder(e - 1 - self.T_max, 2 * self.T_max) == 0
        rise = (1 - torch.cos(math.pi / T))
        ratio = (1 + torch.cos(math.pi * e / T)) / (1 + torch.cos(math.pi * (e - 1) / T))
        return [
            torch.where(bottom, lr + (base - eta) * rise / 2, ratio * (lr - eta) + eta)
            for lr, base in zip(lrs, self.base_lrs, strict=True)
        ]

    def _get_closed_form_lr(self) -> list[torch.Tensor]:
        cos = torch.cos(math.pi * self.last_epoch / self.T_max.to(_F64))
        return [self.eta_min + (base - self.eta_min) * (1 + cos) / 2 for base in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale each model's learning rate by a factor moving linearly from ``start_factor`` to ``end_factor``.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        start_factor: factor at epoch 0, in (0, 1], per model. Default 1/3.
        end_factor: factor from ``total_iters`` on, in [0, 1], per model. Default 1.
        total_iters: epochs of the ramp, int >= 1, per model. Default 5.
        last_epoch: index of the last epoch; -1 starts the schedule.
    """

    def __init__(self, optimizer: Optimizer, start_factor: float | Sequence[float] | torch.Tensor = 1.0 / 3,
                 end_factor: float | Sequence[float] | torch.Tensor = 1.0,
                 total_iters: int | Sequence[int] | torch.Tensor = 5, last_epoch: int = -1) -> None:
        B = _array_size(optimizer, "LinearLR")
        self.start_factor = _floats(start_factor, B, "start_factor")
        _check_range(self.start_factor, "start_factor", 0.0, 1.0, lo_open=True)
        self.end_factor = _floats(end_factor, B, "end_factor")
        _check_range(self.end_factor, "end_factor", 0.0, 1.0)
        self.total_iters = _ints(total_iters, B, "total_iters", minimum=1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[torch.Tensor]:
        lrs = self._lrs()
        e = self.last_epoch
        if e == 0:
            return [lr * self.start_factor for lr in lrs]
        if self._is_initial:
            return lrs
        s, t = self.start_factor, self.end_factor
        factor = 1.0 + (t - s) / (self.total_iters.to(_F64) * s + (e - 1) * (t - s))
        ramping = self.total_iters >= e
        return [torch.where(ramping, lr * factor, lr) for lr in lrs]

    def _get_closed_form_lr(self) -> list[torch.Tensor]:
        s, t, n = self.start_factor, self.end_factor, self.total_iters
        done = torch.clamp(n, max=self.last_epoch).to(_F64)
        return [base * (s + (t - s) * done / n.to(_F64)) for base in self.base_lrs]


class LambdaLR(LRScheduler):
    """Each model's learning rate is its initial lr times ``lr_lambda(epoch)``.

    ``lr_lambda`` is one of:

    - a callable shared by all models and groups; it returns a number, or one
      factor per model (a length-B sequence or ``[B]`` tensor);
    - a list of B callables, one per model (every group);
    - one entry per param group, each a callable or a list of B callables
      (recognized by a list inside the list, e.g. ``[[f0, f1, f2], g]``).

    As in torch, ``state_dict`` saves the ``__dict__`` of callable objects but
    not plain functions or lambdas.
    """

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable | Sequence, last_epoch: int = -1) -> None:
        B = _array_size(optimizer, "LambdaLR")
        self.lr_lambdas = _lambdas(lr_lambda, len(optimizer.param_groups), B)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[torch.Tensor]:
        return [
            base * _lambda_factors(fns, self.last_epoch, self.B)
            for fns, base in zip(self.lr_lambdas, self.base_lrs, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}

        def saved(fn: Callable) -> dict | None:
            return None if isinstance(fn, types.FunctionType) else fn.__dict__.copy()

        state["lr_lambdas"] = [
            [saved(f) for f in fns] if isinstance(fns, list) else saved(fns) for fns in self.lr_lambdas
        ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_state_B(self, state_dict)
        lr_lambdas = state_dict.pop("lr_lambdas")
        try:
            self.__dict__.update(state_dict)
        finally:
            state_dict["lr_lambdas"] = lr_lambdas
        for fns, saved in zip(self.lr_lambdas, lr_lambdas, strict=True):
            if isinstance(fns, list):
                for fn, s in zip(fns, saved, strict=True):
                    if s is not None:
                        fn.__dict__.update(s)
            elif saved is not None:
                fns.__dict__.update(saved)


def _lambdas(lr_lambda: object, n_groups: int, B: int) -> list[Callable | list[Callable]]:
    def per_model(value: object, name: str) -> Callable | list[Callable]:
        if callable(value):
            return value
        if isinstance(value, (list, tuple)):
            if len(value) != B:
                raise ValueError(f"{name}: expected one callable per model (B={B}), got {len(value)}")
            for f in value:
                if not callable(f):
                    raise TypeError(f"{name}: expected callables, got {type(f).__name__}")
            return list(value)
        raise TypeError(
            f"{name}: expected a callable or a list of B={B} callables, got {type(value).__name__}"
        )

    if callable(lr_lambda):
        return [lr_lambda] * n_groups
    if not isinstance(lr_lambda, (list, tuple)):
        raise TypeError(f"lr_lambda: expected a callable or a list, got {type(lr_lambda).__name__}")
    if any(isinstance(f, (list, tuple)) for f in lr_lambda):
        if len(lr_lambda) != n_groups:
            raise ValueError(
                f"lr_lambda: expected one entry per param group ({n_groups}), got {len(lr_lambda)}"
            )
        return [per_model(f, f"lr_lambda[{i}]") for i, f in enumerate(lr_lambda)]
    fns = per_model(list(lr_lambda), "lr_lambda")
    return [fns] * n_groups


def _lambda_factors(fns: Callable | list[Callable], epoch: int, B: int) -> torch.Tensor:
    if isinstance(fns, list):
        return torch.tensor([float(f(epoch)) for f in fns], dtype=_F64)
    out = fns(epoch)
    if isinstance(out, torch.Tensor):
        t = out.detach().to(device="cpu", dtype=_F64)
        t = t.expand(B) if t.dim() == 0 else t
    elif isinstance(out, numbers.Real):
        return torch.full((B,), float(out), dtype=_F64)
    else:
        t = torch.tensor([float(v) for v in out], dtype=_F64)
    if t.shape != (B,):
        raise ValueError(f"lr_lambda: expected a number or B={B} factors, got shape {list(t.shape)}")
    return t


class OneCycleLR(LRScheduler):
    """The 1cycle policy per model: warm up to ``max_lr``, then anneal far below the start.

    Every numeric argument may be per model, so models may differ in
    ``total_steps`` too; stepping past any model's ``total_steps`` raises, as
    torch does for that model. ``max_lr``, ``base_momentum`` and
    ``max_momentum`` may also be given per param group as a list of per-model
    values (e.g. ``[[0.1, 0.2, 0.3], 0.05]``). With ``cycle_momentum`` the
    optimizer's ``momentum`` (or ``betas[0]``) is cycled inversely, written in
    place like the learning rate (a second small copy per group and step); the
    constructor sets it anew, so the optimizer re-validates it at its next step.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        max_lr: float | Sequence | torch.Tensor,
        total_steps: int | Sequence[int] | torch.Tensor | None = None,
        epochs: int | Sequence[int] | torch.Tensor | None = None,
        steps_per_epoch: int | Sequence[int] | torch.Tensor | None = None,
        pct_start: float | Sequence[float] | torch.Tensor = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence | torch.Tensor = 0.85,
        max_momentum: float | Sequence | torch.Tensor = 0.95,
        div_factor: float | Sequence[float] | torch.Tensor = 25.0,
        final_div_factor: float | Sequence[float] | torch.Tensor = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        B = _array_size(optimizer, "OneCycleLR")
        self.optimizer = optimizer
        if total_steps is not None:
            self.total_steps = _ints(total_steps, B, "total_steps", minimum=1)
        elif epochs is not None and steps_per_epoch is not None:
            epochs = _ints(epochs, B, "epochs", minimum=1)
            self.total_steps = epochs * _ints(steps_per_epoch, B, "steps_per_epoch", minimum=1)
        else:
            raise ValueError("OneCycleLR: define either total_steps or (epochs and steps_per_epoch)")
        pct = _floats(pct_start, B, "pct_start")
        _check_range(pct, "pct_start", 0.0, 1.0)
        total = self.total_steps.to(_F64)
        if not isinstance(three_phase, bool):
            raise TypeError(f"three_phase must be a bool, got {type(three_phase).__name__}")
        if three_phase:
            self._schedule_phases = [
                dict(end_step=pct * total - 1, start_lr="initial_lr", end_lr="max_lr",
                     start_momentum="max_momentum", end_momentum="base_momentum"),
                dict(end_step=2 * pct * total - 2, start_lr="max_lr", end_lr="initial_lr",
                     start_momentum="base_momentum", end_momentum="max_momentum"),
                dict(end_step=total - 1, start_lr="initial_lr", end_lr="min_lr",
                     start_momentum="max_momentum", end_momentum="max_momentum"),
            ]
        else:
            self._schedule_phases = [
                dict(end_step=pct * total - 1, start_lr="initial_lr", end_lr="max_lr",
                     start_momentum="max_momentum", end_momentum="base_momentum"),
                dict(end_step=total - 1, start_lr="max_lr", end_lr="min_lr",
                     start_momentum="base_momentum", end_momentum="max_momentum"),
            ]
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self._anneal_func_type = anneal_strategy

        groups = optimizer.param_groups
        max_lrs = _per_group(max_lr, len(groups), B, "max_lr")
        div = _floats(div_factor, B, "div_factor")
        _check_range(div, "div_factor", 0.0, math.inf, lo_open=True)
        final_div = _floats(final_div_factor, B, "final_div_factor")
        _check_range(final_div, "final_div_factor", 0.0, math.inf, lo_open=True)
        if last_epoch == -1:
            for group, m in zip(groups, max_lrs):
                group["initial_lr"] = m / div
                group["max_lr"] = m
                group["min_lr"] = group["initial_lr"] / final_div

        if not isinstance(cycle_momentum, bool):
            raise TypeError(f"cycle_momentum must be a bool, got {type(cycle_momentum).__name__}")
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
                raise ValueError(
                    "OneCycleLR: the optimizer must have momentum or betas to use cycle_momentum"
                )
            self.use_beta1 = "betas" in optimizer.defaults
            max_ms = _per_group(max_momentum, len(groups), B, "max_momentum")
            base_ms = _per_group(base_momentum, len(groups), B, "base_momentum")
            if last_epoch == -1:
                for group, m, b in zip(groups, max_ms, base_ms):
                    # A new object (not an in-place write): the optimizer re-validates it,
                    # which matters when it had every model's momentum at zero.
                    if self.use_beta1:
                        group["betas"] = (m.clone(), *group["betas"][1:])
                    else:
                        group["momentum"] = m.clone()
                    group["max_momentum"] = m
                    group["base_momentum"] = b
        super().__init__(optimizer, last_epoch)

    def _anneal(self, start: torch.Tensor, end: torch.Tensor, pct: torch.Tensor) -> torch.Tensor:
        if self._anneal_func_type == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self) -> list[torch.Tensor]:
        """The learning rates at ``last_epoch``; also sets the cycled momentum, as torch does."""
        step = self.last_epoch
        over = self.total_steps < step
        if over.any():
            raise ValueError(
                f"OneCycleLR: tried to step {step} times; models {over.nonzero().flatten().tolist()} "
                f"have total_steps {self.total_steps[over].tolist()}"
            )
        B = self.B
        # Which phase each model is in, and how far through it.
        chosen = torch.zeros(B, dtype=torch.bool)
        start = torch.zeros(B, dtype=_F64)
        picks = []
        last = len(self._schedule_phases) - 1
        for i, phase in enumerate(self._schedule_phases):
            end = phase["end_step"]
            sel = ~chosen & ((step <= end) if i < last else torch.ones(B, dtype=torch.bool))
            width = end - start
            empty = sel & (width == 0)
            if empty.any():
                raise ZeroDivisionError(
                    f"OneCycleLR: phase {i} of models {empty.nonzero().flatten().tolist()} has no steps "
                    "(pct_start * total_steps gives a phase of length 0)"
                )
            picks.append((sel, (step - start) / width, phase))
            chosen |= sel
            start = end

        lrs = []
        for g, group in enumerate(self.optimizer.param_groups):
            def value(key: str) -> torch.Tensor:
                return _read(group[key], B, f"param_groups[{g}]['{key}']")

            lr = torch.zeros(B, dtype=_F64)
            momentum = torch.zeros(B, dtype=_F64)
            for sel, pct, phase in picks:
                if not sel.any():
                    continue
                lr = torch.where(sel, self._anneal(value(phase["start_lr"]), value(phase["end_lr"]), pct), lr)
                if self.cycle_momentum:
                    m = self._anneal(value(phase["start_momentum"]), value(phase["end_momentum"]), pct)
                    momentum = torch.where(sel, m, momentum)
            lrs.append(lr)
            if self.cycle_momentum:
                if self.use_beta1:
                    _set_beta1(group, momentum, B)
                else:
                    _set_value(group, "momentum", momentum, B)
        return lrs


class SequentialLR(LRScheduler):
    """Run hfkern schedulers one after another, switching at shared ``milestones`` (e.g. warm-up, then decay).

    Args:
        optimizer: the optimizer every scheduler in ``schedulers`` drives.
        schedulers: hfkern schedulers (not :class:`ReduceLROnPlateau`).
        milestones: ``len(schedulers) - 1`` epochs (ints, the same for every
            model) at which the next scheduler takes over, restarting at its
            epoch 0.
        last_epoch: index of the last epoch; -1 starts the schedule.
    """

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1) -> None:
        self.B = _array_size(optimizer, "SequentialLR")
        schedulers = list(schedulers)
        if len(schedulers) < 1:
            raise ValueError("SequentialLR expects at least one scheduler, got none")
        for i, s in enumerate(schedulers):
            if isinstance(s, _torch.ReduceLROnPlateau):
                raise ValueError(
                    "SequentialLR does not support ReduceLROnPlateau (its step needs metrics); "
                    f"got one at index {i}"
                )
            if not isinstance(s, LRScheduler):
                raise TypeError(
                    "SequentialLR expects hfkern.optim.lr_scheduler schedulers, "
                    f"got {type(s).__name__} at index {i}"
                )
            if s.optimizer is not optimizer:
                raise ValueError(
                    f"SequentialLR expects every scheduler to drive its optimizer; the one at index {i} "
                    f"({type(s).__name__}) drives another"
                )
        milestones = list(milestones)
        for m in milestones:
            if isinstance(m, bool) or not isinstance(m, int):
                raise TypeError(
                    f"SequentialLR: milestones must be ints (shared by all models), got {milestones!r}"
                )
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(
                "SequentialLR expects one milestone fewer than schedulers, got "
                f"{len(schedulers)} schedulers and {len(milestones)} milestones"
            )
        self._schedulers = schedulers
        self._milestones = milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer

        for i, group in enumerate(optimizer.param_groups):
            initial = _read(group["initial_lr"], self.B, f"param_groups[{i}]['initial_lr']")
            _set_lr(optimizer, group, initial, self.B)
        # Each scheduler took its initial step when it was built; only the first to run keeps one.
        self.recursive_undo()
        idx = bisect_right(self._milestones, 0)
        self._schedulers[idx]._initial_step()
        self._last_lr = self._schedulers[idx].get_last_lr()

    def recursive_undo(self, sched: LRScheduler | None = None) -> None:
        """Undo the initial step the schedulers (and nested ones) took when built."""
        scheds = self if sched is None else sched
        if hasattr(scheds, "_schedulers"):
            for s in scheds._schedulers:
                self.recursive_undo(s)
        elif hasattr(scheds, "last_epoch"):
            scheds.last_epoch -= 1

    def step(self) -> None:  # type: ignore[override]
        """Step the scheduler in charge at the next epoch; at a milestone, restart the next one."""
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_state_B(self, state_dict)
        schedulers = state_dict.pop("_schedulers")
        try:
            self.__dict__.update(state_dict)
        finally:
            state_dict["_schedulers"] = schedulers
        for s, saved in zip(self._schedulers, schedulers, strict=True):
            s.load_state_dict(saved)


class ReduceLROnPlateau(_torch.ReduceLROnPlateau):
    """Reduce each model's learning rate when its own metric stops improving.

    ``step(metrics)`` takes one metric per model (a length-B sequence or a
    ``[B]`` tensor, read to the host). Every model keeps its own best value,
    bad-epoch count and cooldown, with torch's rules.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        mode: ``'min'`` or ``'max'`` (all models).
        factor: ``new_lr = lr * factor``, in [0, 1), per model. Default 0.1.
        patience: bad epochs tolerated before a reduction, int >= 0, per model. Default 10.
        threshold: least significant change, per model. Default 1e-4.
        threshold_mode: ``'rel'`` or ``'abs'`` (all models).
        cooldown: epochs of rest after a reduction, int >= 0, per model. Default 0.
        min_lr: lower bound, per model; or per param group as a list of
            per-model values (e.g. ``[[0.0, 1e-4, 1e-3], 1e-5]``). Default 0.
        eps: reductions smaller than this are skipped, per model. Default 1e-8.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        mode: str = "min",
        factor: float | Sequence[float] | torch.Tensor = 0.1,
        patience: int | Sequence[int] | torch.Tensor = 10,
        threshold: float | Sequence[float] | torch.Tensor = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int | Sequence[int] | torch.Tensor = 0,
        min_lr: float | Sequence | torch.Tensor = 0,
        eps: float | Sequence[float] | torch.Tensor = 1e-8,
    ) -> None:
        B = self.B = _array_size(optimizer, "ReduceLROnPlateau")
        self.factor = _floats(factor, B, "factor")
        _check_range(self.factor, "factor", 0.0, 1.0, hi_open=True)
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.min_lrs = _per_group(min_lr, len(groups), B, "min_lr")
        self.default_min_lr = None if _is_nested(min_lr) else self.min_lrs[0].clone()
        self.patience = _ints(patience, B, "patience", minimum=0)
        self.cooldown = _ints(cooldown, B, "cooldown", minimum=0)
        self.eps = _floats(eps, B, "eps")
        self.last_epoch = 0
        self._last_lr = [_current_lr(optimizer, g, B).clone() for g in groups]
        self._init_is_better(mode=mode, threshold=threshold, threshold_mode=threshold_mode)
        self._reset()

    def _reset(self) -> None:
        """Forget every model's best value, bad epochs and cooldown."""
        self.best = torch.full((self.B,), self.mode_worse, dtype=_F64)
        self.cooldown_counter = torch.zeros(self.B, dtype=torch.int64)
        self.num_bad_epochs = torch.zeros(self.B, dtype=torch.int64)

    def _metrics(self, metrics: object) -> torch.Tensor:
        B = self.B
        if isinstance(metrics, torch.Tensor):
            t = metrics.detach().to(device="cpu", dtype=_F64)
            if t.dim() > 1 or t.numel() != B:
                raise ValueError(
                    f"ReduceLROnPlateau.step: expected metrics of shape [B={B}] (one per model), "
                    f"got shape {list(t.shape)}"
                )
            return t.reshape(B)
        if isinstance(metrics, numbers.Real) and not isinstance(metrics, bool):
            if B != 1:
                raise ValueError(
                    f"ReduceLROnPlateau.step: expected one metric per model (B={B}), got the single "
                    f"number {metrics!r}"
                )
            return torch.tensor([float(metrics)], dtype=_F64)
        if isinstance(metrics, Sequence) and not isinstance(metrics, str):
            if len(metrics) != B:
                raise ValueError(
                    f"ReduceLROnPlateau.step: expected one metric per model (B={B}), got {len(metrics)}"
                )
            return torch.tensor([float(m) for m in metrics], dtype=_F64)
        raise TypeError(
            f"ReduceLROnPlateau.step: expected metrics as a [B] tensor or a length-B sequence, "
            f"got {type(metrics).__name__}"
        )

    def step(  # type: ignore[override]
        self, metrics: Sequence[float] | torch.Tensor, epoch: int | None = None
    ) -> None:
        """Record one epoch's metrics, ``[B]`` (one per model), and reduce where a plateau is reached."""
        current = self._metrics(metrics)
        if epoch is None:
            epoch = self.last_epoch + 1
        else:
            warnings.warn(_EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=2)
        self.last_epoch = epoch

        better = self._is_better(current, self.best)
        self.best = torch.where(better, current, self.best)
        self.num_bad_epochs = torch.where(better, 0, self.num_bad_epochs + 1)

        cooling = self.in_cooldown
        self.cooldown_counter = torch.where(cooling, self.cooldown_counter - 1, self.cooldown_counter)
        # Bad epochs during a cooldown do not count.
        self.num_bad_epochs = torch.where(cooling, 0, self.num_bad_epochs)

        reduce = self.num_bad_epochs > self.patience
        if reduce.any():
            self._reduce_lr(epoch, reduce)
        self.cooldown_counter = torch.where(reduce, self.cooldown, self.cooldown_counter)
        self.num_bad_epochs = torch.where(reduce, 0, self.num_bad_epochs)
        self._last_lr = [_current_lr(self.optimizer, g, self.B).clone() for g in self.optimizer.param_groups]

    def _reduce_lr(self, epoch: int, models: torch.Tensor | None = None) -> None:
        B = self.B
        groups = self.optimizer.param_groups
        if len(groups) != len(self.min_lrs):
            if self.default_min_lr is None:
                raise RuntimeError(
                    f"ReduceLROnPlateau: the optimizer has {len(groups)} param groups but min_lr was given "
                    f"for {len(self.min_lrs)}; set the scheduler's min_lrs to one [B] tensor per group"
                )
            self.min_lrs = [self.default_min_lr.clone() for _ in groups]
        if models is None:
            models = torch.ones(B, dtype=torch.bool)
        for group, min_lr in zip(groups, self.min_lrs):
            old = _current_lr(self.optimizer, group, B)
            new = torch.maximum(old * self.factor, min_lr)
            change = models & (old - new > self.eps)
            if change.any():
                _set_lr(self.optimizer, group, torch.where(change, new, old), B)

    @property
    def in_cooldown(self) -> torch.Tensor:
        """``[B]`` bool: the models still cooling down after a reduction."""
        return self.cooldown_counter > 0

    def _is_better(self, a: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        if self.mode == "min" and self.threshold_mode == "rel":
            return a < best * (1.0 - self.threshold)
        if self.mode == "min" and self.threshold_mode == "abs":
            return a < best - self.threshold
        if self.mode == "max" and self.threshold_mode == "rel":
            return a > best * (self.threshold + 1.0)
        return a > best + self.threshold

    def _init_is_better(self, mode: str, threshold: object, threshold_mode: str) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        self.mode_worse = math.inf if mode == "min" else -math.inf
        self.mode = mode
        self.threshold = _floats(threshold, self.B, "threshold")
        self.threshold_mode = threshold_mode

    def get_last_lr(self) -> list[torch.Tensor]:
        """The current learning rates: one ``[B]`` float64 CPU tensor per param group."""
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` of a scheduler with the same B."""
        _check_state_B(self, state_dict)
        self.__dict__.update(state_dict)
        self._init_is_better(mode=self.mode, threshold=self.threshold, threshold_mode=self.threshold_mode)
