"""Performance models of one elastic job: step time, statistical efficiency, goodput.

The allocator (``hfkern.elastic._optimizer``) decides how many devices, which global batch
size and how many trials ``B`` each job gets. To compare choices it needs, per job, a
prediction of

* how fast a step runs at ``gpus`` devices, global batch ``batch_size`` and ``B`` trials
  trained together as one hfkern array (:class:`ThroughputModel`), and
* how much each sample is worth for training progress at that batch size
  (:class:`Efficiency`): larger batches give more samples per second but, past the
  gradient noise scale, each sample helps less.

Their product is the job's *goodput* (Pollux, Qiao et al., OSDI 2021): useful samples per
second. :class:`Job` bundles both models with the job's allowed ranges.

The step-time model follows the shape of Pollux's throughput model: a data-parallel step is
local gradient computation (a fixed part plus a part linear in the samples each device
holds) and gradient synchronization (zero on one device; a fixed part plus a part growing
with the number of devices in a ring all-reduce, and an extra latency when the ring crosses
nodes); the two overlap partially, which a power mean with exponent ``gamma`` expresses:
``gamma = 1`` is no overlap (the times add), large ``gamma`` is perfect overlap (the step
takes the longer of the two). hfkern's addition is ``B``: ``B`` trials of one model trained
as an array make each device compute ``B`` times as many samples per step, while the
synchronization here is modelled as independent of ``B`` (fit the parameters at the ``B``
you run, or include several ``B`` in the profile, if the all-reduce volume matters).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterable, Sequence

import numpy as np

__all__ = ["ThroughputModel", "Efficiency", "Job"]


def _check_int(name: str, value, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _check_float(name: str, value, minimum: float | None = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name}: expected a number {'>' if strict else '>='} {minimum}, got {value}")
    return value


def _sizes(name: str, values) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of positive ints, got {type(values).__name__} {values!r}")
    out = tuple(_check_int(f"{name}[{i}]", v, 1) for i, v in enumerate(values))
    if not out:
        raise ValueError(f"{name}: expected at least one positive int, got an empty sequence")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{name}: expected strictly ascending values, got {out}")
    return out


@dataclasses.dataclass(frozen=True)
class ThroughputModel:
    """Seconds per optimizer step of a data-parallel job (Pollux's throughput model, with ``B``).

    With ``local = B * batch_size / gpus`` samples per device::

        T_grad = alpha_grad + beta_grad * local
        T_sync = 0                                                       if gpus == 1
               = alpha_sync + beta_sync * (gpus - 2) (+ alpha_net if nodes > 1) otherwise
        T_step = (T_grad ** gamma + T_sync ** gamma) ** (1 / gamma)

    ``T_grad`` is the forward and backward pass on one device; ``T_sync`` the all-reduce of the
    gradients, whose ring grows by a step per extra device (``beta_sync``) and which pays a
    larger latency (``alpha_net``) once it spans several nodes. ``gamma >= 1`` says how far
    the two overlap (backward computation of late layers runs while earlier gradients are
    reduced): 1 is sequential, larger values approach ``max(T_grad, T_sync)``.

    All coefficients are non-negative seconds; fit them from a short profile with :meth:`fit`.
    """

    alpha_grad: float
    beta_grad: float
    alpha_sync: float = 0.0
    beta_sync: float = 0.0
    alpha_net: float = 0.0
    gamma: float = 1.0

    def __post_init__(self):
        for f in ("alpha_grad", "beta_grad", "alpha_sync", "beta_sync", "alpha_net"):
            object.__setattr__(self, f, _check_float(f, getattr(self, f)))
        object.__setattr__(self, "gamma", _check_float("gamma", self.gamma, 1.0))
        if self.alpha_grad == 0.0 and self.beta_grad == 0.0:
            raise ValueError("ThroughputModel: expected alpha_grad or beta_grad > 0 (a step takes time), "
                             "got both 0")

    # -- scalar API -------------------------------------------------------------------------------
    def step_time(self, gpus: int, batch_size: int, B: int = 1, nodes: int = 1) -> float:
        """Predicted seconds per step at ``gpus`` devices on ``nodes`` nodes, global batch
        ``batch_size`` per trial and ``B`` trials."""
        gpus = _check_int("gpus", gpus, 1)
        batch_size = _check_int("batch_size", batch_size, 1)
        B = _check_int("B", B, 1)
        nodes = _check_int("nodes", nodes, 1)
        if nodes > gpus:
            raise ValueError(f"nodes: expected at most gpus={gpus} nodes, got {nodes}")
        return float(self.step_time_array(gpus, batch_size, B, nodes))

    def throughput(self, gpus: int, batch_size: int, B: int = 1, nodes: int = 1) -> float:
        """Model-samples per second: ``B * batch_size / step_time`` (each of the ``B`` trials
        advances ``batch_size`` samples per step)."""
        return B * batch_size / self.step_time(gpus, batch_size, B, nodes)

    # -- vectorized API (no validation; used by the allocator) ------------------------------------
    def step_time_array(self, gpus, batch_size, B, nodes):
        """:meth:`step_time` on numpy arrays that broadcast against each other (no checks:
        ``gpus >= 1`` everywhere is the caller's business)."""
        gpus = np.asarray(gpus, dtype=np.float64)
        local = np.asarray(B, dtype=np.float64) * np.asarray(batch_size, dtype=np.float64) / gpus
        t_grad = self.alpha_grad + self.beta_grad * local
        multi = gpus > 1
        t_sync = np.where(multi, self.alpha_sync + self.beta_sync * np.maximum(gpus - 2.0, 0.0), 0.0)
        t_sync = t_sync + np.where(multi & (np.asarray(nodes) > 1), self.alpha_net, 0.0)
        if self.gamma == 1.0:
            return t_grad + t_sync
        g = self.gamma
        return (t_grad ** g + t_sync ** g) ** (1.0 / g)

    # -- fitting ----------------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, int, int, float]], *,
            gamma_grid=(1, 1.5, 2, 3)) -> "ThroughputModel":
        """Fit the coefficients to measured steps.

        ``samples`` are ``(gpus, batch_size, B, nodes, seconds per step)``. For each ``gamma``
        of ``gamma_grid`` the five coefficients are fitted by least squares on relative errors
        (step times of a profile span orders of magnitude) under non-negativity: with
        ``gamma = 1`` the model is linear in them and non-negative least squares
        (``scipy.optimize.nnls``) solves it exactly; for ``gamma > 1`` that solution starts a
        bounded nonlinear least-squares refinement. The ``gamma`` with the smallest residual is
        kept.

        Coefficients the samples cannot determine are fixed at 0: ``alpha_sync`` without
        multi-device samples, ``beta_sync`` without samples at 3 or more devices,
        ``alpha_net`` without multi-node samples. ValueError if there are fewer samples than
        coefficients to determine, or the samples do not separate them (e.g. every sample has
        the same per-device batch).
        """
        from scipy.optimize import least_squares, nnls

        rows = []
        if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
            raise TypeError(f"samples: expected a sequence of (gpus, batch_size, B, nodes, seconds), "
                            f"got {type(samples).__name__}")
        for i, s in enumerate(samples):
            if not hasattr(s, "__len__") or len(s) != 5:
                raise ValueError(f"samples[{i}]: expected (gpus, batch_size, B, nodes, seconds), got {s!r}")
            g = _check_int(f"samples[{i}] gpus", s[0], 1)
            m = _check_int(f"samples[{i}] batch_size", s[1], 1)
            b = _check_int(f"samples[{i}] B", s[2], 1)
            n = _check_int(f"samples[{i}] nodes", s[3], 1)
            if n > g:
                raise ValueError(f"samples[{i}]: expected nodes <= gpus, got nodes={n}, gpus={g}")
            t = _check_float(f"samples[{i}] seconds", s[4], 0.0, strict=True)
            rows.append((g, m, b, n, t))
        if isinstance(gamma_grid, (str, bytes)) or not isinstance(gamma_grid, Iterable):
            raise TypeError(f"gamma_grid: expected a sequence of gammas >= 1, got {type(gamma_grid).__name__} "
                            f"{gamma_grid!r}")
        grid = tuple(_check_float("gamma_grid item", x, 1.0) for x in gamma_grid)
        if not grid:
            raise ValueError("gamma_grid: expected at least one gamma >= 1, got an empty sequence")
        if not rows:
            raise ValueError("samples: expected at least 2 measured steps, got 0")

        a = np.array(rows, dtype=np.float64)
        g, m, b, n, t = a.T
        local = b * m / g
        multi = (g > 1).astype(np.float64)
        cols = {"alpha_grad": np.ones_like(t), "beta_grad": local}
        if (g > 1).any():
            cols["alpha_sync"] = multi
        if (g > 2).any():
            cols["beta_sync"] = multi * np.maximum(g - 2.0, 0.0)
        if ((n > 1) & (g > 1)).any():
            cols["alpha_net"] = multi * (n > 1)
        names = list(cols)
        X = np.stack([cols[k] for k in names], axis=1)
        if len(rows) < len(names):
            raise ValueError(f"samples: expected at least {len(names)} measured steps to determine "
                             f"{', '.join(names)}, got {len(rows)}")
        if np.linalg.matrix_rank(X) < len(names):
            raise ValueError(f"samples: expected steps that separate {', '.join(names)} (different "
                             f"per-device batches, device counts and node counts), got {len(rows)} "
                             "steps that leave some of them undetermined")
        i_grad = [names.index("alpha_grad"), names.index("beta_grad")]
        i_sync = [names.index(k) for k in ("alpha_sync", "beta_sync", "alpha_net") if k in names]
        w = 1.0 / t                            # relative residuals
        x1, _ = nnls(X * w[:, None], np.ones_like(t))

        def predict(x, gamma):
            tg = X[:, i_grad] @ x[i_grad]
            ts = X[:, i_sync] @ x[i_sync] if i_sync else np.zeros_like(t)
            if gamma == 1.0:
                return tg + ts
            return (tg ** gamma + ts ** gamma) ** (1.0 / gamma)

        best = None
        for gamma in grid:
            if gamma == 1.0:
                x = x1
            else:
                def resid(x, gamma=gamma):
                    return predict(x, gamma) * w - 1.0
                starts = [x1, _staged_start(X, t, i_grad, i_sync, gamma, nnls, x1)]
                x, cost = None, math.inf
                for x0 in starts:
                    x0 = np.maximum(x0, 0.0) + 1e-12 * (np.abs(x0).max() + 1e-12)
                    r = least_squares(resid, x0, bounds=(0.0, np.inf), method="trf",
                                      x_scale="jac", xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=2000)
                    if r.cost < cost:
                        x, cost = r.x, r.cost
            pred = predict(x, gamma)
            if not (pred > 0).all():
                continue
            err = float(np.sum((pred * w - 1.0) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, gamma, x)
        if best is None:
            raise ValueError("samples: no gamma of gamma_grid gives positive step times for every sample")
        _, gamma, x = best
        params = {k: float(max(v, 0.0)) for k, v in zip(names, x)}
        if params["alpha_grad"] == 0.0 and params["beta_grad"] == 0.0:
            raise ValueError("samples: the fit puts no time in the gradient computation "
                             "(alpha_grad = beta_grad = 0); expected steps that grow with the per-device batch")
        return cls(gamma=float(gamma), **params)


def _staged_start(X, t, i_grad, i_sync, gamma, nnls, fallback):
    """A start for ``gamma > 1``: compute coefficients from single-device steps (where the
    step is pure computation), then synchronization coefficients from what the multi-device
    steps leave, ``T_sync = (T ** gamma - T_grad ** gamma) ** (1 / gamma)``."""
    if not i_sync:
        return fallback
    single = X[:, i_sync[0]] == 0          # the alpha_sync column: 0 on one device
    if single.sum() < 2 or np.linalg.matrix_rank(X[single][:, i_grad]) < 2:
        return fallback
    w = 1.0 / t[single]
    xg, _ = nnls(X[single][:, i_grad] * w[:, None], np.ones_like(w))
    multi = ~single
    tg = X[multi][:, i_grad] @ xg
    ts = np.maximum(t[multi] ** gamma - tg ** gamma, 0.0) ** (1.0 / gamma)
    xs, _ = nnls(X[multi][:, i_sync] / t[multi][:, None], ts / t[multi])
    x = np.array(fallback, dtype=np.float64)
    x[i_grad] = xg
    x[i_sync] = xs
    return x


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Statistical efficiency of a global batch ``M`` against a base batch ``M0``.

    ``E(M) = (phi + M0) / (phi + M)`` with ``phi`` the gradient noise scale (McCandlish et al.,
    "An Empirical Model of Large-Batch Training", 2018, as Pollux uses it): training with batch
    ``M`` needs ``1 / E(M)`` times as many samples as with ``M0`` to make the same progress.
    ``E(M0) = 1``; larger batches give less than 1 (close to 1 while ``M << phi``: the gradient
    is noisy and a larger batch averages the noise away almost for free; about
    ``(phi + M0) / M`` once ``M >> phi``, which is ``phi / M`` where ``M0 << phi``); a batch
    smaller than ``M0`` gives more than 1.
    """

    base_batch_size: int
    noise_scale: float

    def __post_init__(self):
        object.__setattr__(self, "base_batch_size", _check_int("base_batch_size", self.base_batch_size, 1))
        object.__setattr__(self, "noise_scale", _check_float("noise_scale", self.noise_scale))

    def __call__(self, batch_size) -> float:
        """``E(batch_size)``; also accepts a numpy array of batch sizes (returns an array).
        ValueError for a batch size that is not > 0."""
        if isinstance(batch_size, np.ndarray):
            b = batch_size.astype(np.float64)
            bad = ~(b > 0)          # also NaN
            if bad.any():
                raise ValueError(f"batch_size: expected batch sizes > 0, got {batch_size[bad].ravel()[:8].tolist()} "
                                 f"({int(bad.sum())} of {b.size})")
            return (self.noise_scale + self.base_batch_size) / (self.noise_scale + b)
        batch_size = _check_int("batch_size", batch_size, 1)
        return (self.noise_scale + self.base_batch_size) / (self.noise_scale + batch_size)


@dataclasses.dataclass(frozen=True)
class Job:
    """A job to allocate: one model trained alone, or an array of ``B`` trials trained together.

    ``batch_sizes`` are the global batch sizes (per trial) the job may run at and
    ``array_sizes`` the numbers of trials it may train at once (``(1,)``: a single training
    job); both are stored as ascending tuples. A running job gets ``min_gpus <= gpus <=
    max_gpus`` devices, never more devices than samples in its batch (each device gets at least
    one sample), and its busiest device holds ``B * ceil(batch_size / gpus)`` samples, which
    must not exceed ``max_local_batch`` (the memory limit) when that is given.

    ``default_batch_size`` (``batch_sizes[0]`` when not given) and ``default_B``
    (``max(array_sizes)`` when not given) are what policies that do not adapt batch size or
    array size use; ``requested_gpus`` (``min_gpus`` when not given) is what a fixed
    (non-elastic) scheduler gives the job. After construction all three are ints.
    """

    name: str
    model: ThroughputModel
    efficiency: Efficiency
    batch_sizes: tuple[int, ...]
    array_sizes: tuple[int, ...] = (1,)
    max_gpus: int | None = None
    min_gpus: int = 1
    max_local_batch: int | None = None
    default_batch_size: int | None = None
    default_B: int | None = None
    requested_gpus: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name: expected a non-empty str, got {type(self.name).__name__} {self.name!r}")
        if not isinstance(self.model, ThroughputModel):
            raise TypeError(f"model: expected a ThroughputModel, got {type(self.model).__name__}")
        if not isinstance(self.efficiency, Efficiency):
            raise TypeError(f"efficiency: expected an Efficiency, got {type(self.efficiency).__name__}")
        s = object.__setattr__
        s(self, "batch_sizes", _sizes("batch_sizes", self.batch_sizes))
        s(self, "array_sizes", _sizes("array_sizes", self.array_sizes))
        s(self, "min_gpus", _check_int("min_gpus", self.min_gpus, 1))
        if self.max_gpus is not None:
            s(self, "max_gpus", _check_int("max_gpus", self.max_gpus, 1))
            if self.max_gpus < self.min_gpus:
                raise ValueError(f"max_gpus: expected >= min_gpus={self.min_gpus}, got {self.max_gpus}")
        if self.min_gpus > self.batch_sizes[-1]:
            raise ValueError(f"min_gpus: expected at most the largest batch size {self.batch_sizes[-1]} "
                             f"(each device needs a sample), got {self.min_gpus}")
        if self.max_local_batch is not None:
            s(self, "max_local_batch", _check_int("max_local_batch", self.max_local_batch, 1))
        if self.default_batch_size is None:
            s(self, "default_batch_size", self.batch_sizes[0])
        else:
            s(self, "default_batch_size", _check_int("default_batch_size", self.default_batch_size, 1))
            if self.default_batch_size not in self.batch_sizes:
                raise ValueError(f"default_batch_size: expected one of batch_sizes {self.batch_sizes}, "
                                 f"got {self.default_batch_size}")
        if self.default_B is None:
            s(self, "default_B", self.array_sizes[-1])
        else:
            s(self, "default_B", _check_int("default_B", self.default_B, 1))
            if self.default_B not in self.array_sizes:
                raise ValueError(f"default_B: expected one of array_sizes {self.array_sizes}, got {self.default_B}")
        requested = self.min_gpus if self.requested_gpus is None else self.requested_gpus
        s(self, "requested_gpus", _check_int("requested_gpus", requested, 1))
        hi = self.max_gpus if self.max_gpus is not None else math.inf
        if not self.min_gpus <= self.requested_gpus <= hi:
            raise ValueError(f"requested_gpus: expected between min_gpus={self.min_gpus} and "
                             f"max_gpus={self.max_gpus}, got {self.requested_gpus}")
        if self.requested_gpus > self.batch_sizes[-1]:
            raise ValueError(f"requested_gpus: expected at most the largest batch size {self.batch_sizes[-1]} "
                             f"(each device needs a sample), got {self.requested_gpus}")

    def local_batch(self, gpus: int, batch_size: int, B: int = 1) -> int:
        """Samples on the busiest device: ``B * ceil(batch_size / gpus)``."""
        return B * -(-batch_size // gpus)

    def feasible(self, gpus, batch_size, B) -> bool:
        """Whether the job may run at ``gpus`` devices, global batch ``batch_size`` and ``B``
        trials: ``batch_size`` and ``B`` allowed, ``min_gpus <= gpus <= max_gpus``,
        ``gpus <= batch_size`` and the busiest device within ``max_local_batch``. ``gpus = 0``
        (not running) is not a running configuration: False."""
        gpus = _check_int("gpus", gpus, 0)
        batch_size = _check_int("batch_size", batch_size, 1)
        B = _check_int("B", B, 1)
        if gpus < self.min_gpus or (self.max_gpus is not None and gpus > self.max_gpus):
            return False
        if batch_size not in self.batch_sizes or B not in self.array_sizes or gpus > batch_size:
            return False
        return self.max_local_batch is None or self.local_batch(gpus, batch_size, B) <= self.max_local_batch

    def goodput(self, gpus: int, batch_size: int, B: int = 1, nodes: int = 1) -> float:
        """Useful model-samples per second (Pollux's goodput): ``throughput * E(batch_size)``,
        0 where :meth:`feasible` is False (including ``gpus = 0``)."""
        if not self.feasible(gpus, batch_size, B):
            return 0.0
        return self.model.throughput(gpus, batch_size, B, nodes) * self.efficiency(batch_size)
