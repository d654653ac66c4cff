"""Re-solve the allocation as jobs come and go, and decide which running jobs to rescale.

The :class:`Autoscaler` keeps the set of active jobs (running or queued) and calls
:func:`hfkern.elastic._optimizer.allocate` at every arrival, every completion and, on
:meth:`Autoscaler.tick`, once ``interval`` seconds have passed since the last solve. It returns
one :class:`Decision` per job whose allocation (devices, batch size, ``B``) changes; whoever
executes them (a simulator, or the elastic executor) checkpoints the job, stops it and relaunches
it at the new world size and batch size with the learning rate scaled by :func:`scale_lr`.

Restarts are not free: a rescaled job loses ``restart_cost`` seconds (checkpoint, stop,
rendezvous, reload). Over the time the new allocation is expected to last, ``horizon = min(horizon,
the job's remaining seconds if known)`` (``horizon``: how long an allocation typically stands
before the next change, 30 minutes by default), moving a running job from goodput ``go`` to ``gn``
pays off only if::

    (gn - go) * horizon > gn * restart_cost

(the samples gained over the horizon beat the samples the new allocation would have processed
during the restart). The optimizer applies this test inside its maximization: every
configuration of a running job other than its current one counts ``1 - restart_cost / horizon``
times its value, so for a job that could grow into idle devices the test above is exactly the
condition under which it does, and when jobs compete (one must shrink for another to start or
grow) the same trade is made for the cluster: the changed jobs' discounted values must beat
keeping them. Starting a queued job costs no restart and is taken whenever the optimizer gives
it devices. Policy ``"gpu"`` is the GPU-only elastic baseline (batch size and ``B`` stay at the
job's defaults); ``"hfkern"`` adapts devices, batch size and ``B``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from hfkern.elastic._model import Job
from hfkern.elastic._optimizer import Allocation, allocate

__all__ = ["Decision", "scale_lr", "Autoscaler"]

_LR_RULES = ("linear", "sqrt", "none")
_POLICIES = {"hfkern": ("elastic", "elastic"), "gpu": ("fixed", "fixed")}


@dataclasses.dataclass(frozen=True)
class Decision:
    """A change to one job: ``old`` (None if it was not running) to ``new`` (``gpus == 0``:
    stop it, it goes back to the queue). ``lr_scale`` multiplies the learning rate the job ran
    with at its last batch size (at its default batch size if it never ran); ``reason`` is what
    triggered the solve: ``"arrival"``, ``"completion"`` or ``"interval"``."""

    job: str
    old: Allocation | None
    new: Allocation
    lr_scale: float
    reason: str


def scale_lr(lr: float, old_batch: int, new_batch: int, rule: str = "sqrt") -> float:
    """The learning rate for batch size ``new_batch`` of a job that trained at ``lr`` with
    ``old_batch``.

    ``"linear"``: ``lr * new / old``, the linear scaling rule for SGD (Goyal et al., "Accurate,
    Large Minibatch SGD", 2017): k times the batch averages k times as many gradients, so a k
    times larger step keeps the progress per sample. ``"sqrt"``: ``lr * sqrt(new / old)``,
    square-root scaling (Hoffer et al., 2017; the usual choice for Adam-family optimizers,
    whose per-coordinate normalization already absorbs part of the gradient's scale): it keeps
    the variance of the update constant. ``"none"``: ``lr`` unchanged.
    """
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"lr: expected a finite number >= 0, got {type(lr).__name__} {lr!r}")
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr: expected a finite number >= 0, got {lr!r}")
    for name, b in (("old_batch", old_batch), ("new_batch", new_batch)):
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {type(b).__name__} {b!r}")
        if b < 1:
            raise ValueError(f"{name}: expected a positive batch size, got {b}")
    if rule == "linear":
        return float(lr) * new_batch / old_batch
    if rule == "sqrt":
        return float(lr) * math.sqrt(new_batch / old_batch)
    if rule == "none":
        return float(lr)
    raise ValueError(f"rule: expected one of {_LR_RULES}, got {rule!r}")


def _check_time(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a finite number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number of seconds, got {value!r}")
    return float(value)


class Autoscaler:
    """Allocation of ``gpus`` devices among arriving jobs, re-solved at arrival, completion and
    every ``interval`` seconds (see the module docstring for the restart test).

    ``allocations`` holds the current allocation of every running job (queued ones are left
    out); ``jobs`` every active job by name. Times (``now``) are seconds on any clock that does
    not go back.
    """

    def __init__(self, gpus: int, *, gpus_per_node: int | None = None, interval: float = 60.0,
                 restart_cost: float = 30.0, horizon: float = 1800.0, policy: str = "hfkern",
                 objective: str = "speedup", lr_rule: str = "sqrt"):
        if isinstance(gpus, bool) or not isinstance(gpus, numbers.Integral):
            raise TypeError(f"gpus: expected an int, got {type(gpus).__name__} {gpus!r}")
        if gpus < 1:
            raise ValueError(f"gpus: expected a positive number of devices, got {gpus}")
        interval = _check_time("interval", interval)
        if interval <= 0:
            raise ValueError(f"interval: expected seconds > 0, got {interval}")
        restart_cost = _check_time("restart_cost", restart_cost)
        if restart_cost < 0:
            raise ValueError(f"restart_cost: expected seconds >= 0, got {restart_cost}")
        horizon = _check_time("horizon", horizon)
        if horizon <= 0:
            raise ValueError(f"horizon: expected seconds > 0, got {horizon}")
        if policy not in _POLICIES:
            raise ValueError(f"policy: expected one of {tuple(_POLICIES)}, got {policy!r}")
        if lr_rule not in _LR_RULES:
            raise ValueError(f"lr_rule: expected one of {_LR_RULES}, got {lr_rule!r}")
        self.gpus = int(gpus)
        self.gpus_per_node = gpus_per_node
        self.interval = interval
        self.restart_cost = restart_cost
        self.horizon = horizon
        self.policy = policy
        self.objective = objective
        self.lr_rule = lr_rule
        self.jobs: dict[str, Job] = {}
        self.allocations: dict[str, Allocation] = {}
        self._remaining: dict[str, tuple[float, float]] = {}   # name -> (seconds left, as of when)
        self.last_solve: float | None = None
        self.solve_seconds: list[float] = []       # the optimizer's time per solve
        self._now: float | None = None
        self._last_batch: dict[str, int] = {}
        # fail early on a bad objective / gpus_per_node
        allocate([], self.gpus, gpus_per_node=gpus_per_node, objective=objective)

    # -- events -----------------------------------------------------------------------------------
    def submit(self, job: Job, now: float) -> list[Decision]:
        """A new job arrives; re-solve. ValueError if a job of that name is active. A call that
        raises changes nothing."""
        now = self._check_submit(job, now)
        saved = (self._now, self.last_solve)
        self._now = now
        self.jobs[job.name] = job
        try:
            return self._solve(now, "arrival")
        except BaseException:
            # the solve failed before changing allocations: take the job back out
            del self.jobs[job.name]
            self._now, self.last_solve = saved
            raise

    def _check_submit(self, job: Job, now: float) -> float:
        """The checks of :meth:`submit` without submitting: raises what ``submit(job, now)``
        would raise on its arguments, else returns ``now`` as seconds. Changes nothing."""
        if not isinstance(job, Job):
            raise TypeError(f"job: expected a Job, got {type(job).__name__}")
        now = self._checked_now(now)
        if job.name in self.jobs:
            raise ValueError(f"job: expected a name not already active, got {job.name!r} twice")
        return now

    def finish(self, name: str, now: float) -> list[Decision]:
        """Job ``name`` completed (its devices are free); re-solve. ValueError if it is not active."""
        if not isinstance(name, str):
            raise TypeError(f"name: expected an active job's name (a str), got {type(name).__name__} {name!r}")
        now = self._checked_now(now)
        if name not in self.jobs:
            raise ValueError(f"name: expected an active job (one of {sorted(self.jobs)}), got {name!r}")
        self._now = now
        del self.jobs[name]
        self.allocations.pop(name, None)
        self._remaining.pop(name, None)
        self._last_batch.pop(name, None)
        return self._solve(now, "completion")

    def tick(self, now: float, remaining: dict[str, float] | None = None) -> list[Decision]:
        """Time passes. ``remaining`` (name -> estimated seconds left; names of jobs that are
        not active are ignored) updates the restart horizons. Re-solves if ``interval`` seconds have passed since the
        last solve; otherwise returns ``[]``."""
        now = self._checked_now(now)
        left = {}
        if remaining is not None:
            if not isinstance(remaining, dict):
                raise TypeError(f"remaining: expected a dict of name -> seconds, got {type(remaining).__name__}")
            for k, v in remaining.items():
                if k not in self.jobs:          # finished or unknown: nothing to plan for
                    continue
                v = _check_time(f"remaining[{k!r}]", v)
                if v < 0:
                    raise ValueError(f"remaining[{k!r}]: expected seconds >= 0, got {v}")
                left[k] = (v, now)
        self._now = now  # (everything checked: a call that raises changes nothing)
        self._remaining.update(left)
        if self.last_solve is not None and now - self.last_solve < self.interval:
            return []
        return self._solve(now, "interval")

    # -- internals --------------------------------------------------------------------------------
    def _checked_now(self, now) -> float:
        """``now`` as seconds, checked to be finite and not before the last event's time."""
        now = _check_time("now", now)
        if self._now is not None and now < self._now:
            raise ValueError(f"now: expected a time >= the last event's {self._now}, got {now}")
        return now

    def restart_factor(self, name: str) -> float:
        """``max(0, 1 - restart_cost / h)`` for a running job, with ``h = min(horizon,
        remaining seconds if known)``: the share of a new allocation's value left after its
        restart. The remaining seconds last given to :meth:`tick` count down with time."""
        horizon = self.horizon
        if name in self._remaining:
            left, at = self._remaining[name]
            horizon = min(horizon, left - (self._now - at))
        if horizon <= 0:
            return 0.0
        return max(0.0, 1.0 - self.restart_cost / horizon)

    def _solve(self, now: float, reason: str) -> list[Decision]:
        self.last_solve = now
        if not self.jobs:
            return []
        batch, arrays = _POLICIES[self.policy]
        factors = {name: self.restart_factor(name) for name in self.allocations}
        sol = allocate(list(self.jobs.values()), self.gpus, gpus_per_node=self.gpus_per_node,
                       objective=self.objective, batch=batch, arrays=arrays,
                       current=dict(self.allocations), restart_factor=factors)
        self.solve_seconds.append(sol.seconds)
        decisions = []
        for name, new in sol.allocations.items():
            old = self.allocations.get(name)
            if old is None and new.gpus == 0:
                continue
            if old is not None and (old.gpus, old.batch_size, old.B) == (new.gpus, new.batch_size, new.B):
                continue
            if new.gpus == 0:
                lr = 1.0
            else:
                before = old.batch_size if old is not None else self._last_batch.get(
                    name, self.jobs[name].default_batch_size)
                lr = scale_lr(1.0, before, new.batch_size, self.lr_rule)
                self._last_batch[name] = new.batch_size
            decisions.append(Decision(name, old, new, lr, reason))
        self.allocations = {name: a for name, a in sol.allocations.items() if a.gpus > 0}
        used = sum(a.gpus for a in self.allocations.values())
        if used > self.gpus:        # the optimizer's contract; checked, never expected
            raise RuntimeError(f"allocation uses {used} devices, more than the {self.gpus} available")
        return decisions

    @property
    def queued(self) -> list[str]:
        """Active jobs without devices, in arrival order."""
        return [name for name in self.jobs if name not in self.allocations]
