"""Allocate devices, batch sizes and array sizes to jobs on a shared cluster.

Problem. ``G`` devices (optionally ``gpus_per_node`` per node) and a set of jobs
(:class:`hfkern.elastic._model.Job`). Each job gets ``g`` devices (0: it waits in the queue), a
global batch size and a number of trials ``B``; the sum of ``g`` is at most ``G``. The
objective adds up one value per job:

* ``objective="goodput"``: the job's goodput in useful samples per second (throughput times
  statistical efficiency, as in Pollux). Raw goodputs of different models are in different
  units (a small MLP does far more samples per second than a transformer), so this sum favours
  the cheap models; it is what you want when every job is the same model.
* ``objective="speedup"`` (default): each job's goodput divided by its goodput at a reference
  allocation -- 1 device, its default batch size and default ``B`` (where that is not allowed,
  e.g. ``min_gpus > 1`` or memory, the best allowed configuration at the smallest device count
  that allows one). A job's value is then "how many times faster than on its own device", a
  unitless number that makes jobs of different sizes comparable, as Pollux's speedup does
  (with its fairness exponent at 1).

Algorithm. Because the objective is a sum over jobs and the only constraint that couples
jobs is the device budget, the problem splits in two:

1. per job and per device count ``g = 1..G``, the best (batch size, ``B``) -- a vectorized
   evaluation of the model over every job x ``g`` x batch size x ``B`` at once;
2. a knapsack over jobs: ``best[j][c]`` = the best value of jobs ``0..j`` with at most ``c``
   devices, ``best[j][c] = max_k best[j-1][c-k] + v_j[k]``, evaluated per job as one
   max-plus product in numpy (``G+1`` by the job's useful ``k``), with the maximizing ``k``
   kept to reconstruct the allocation. Device counts a job cannot use better than a smaller
   count (its value does not grow) are dropped before the product.

That is ``O(J * G^2)`` work in numpy with ``J`` Python iterations, a few milliseconds for 100
jobs on 64 devices.

Nodes. With ``gpus_per_node`` a job of ``g`` devices is modelled on ``ceil(g / gpus_per_node)``
nodes (packed) and pays its model's ``alpha_net`` when that is more than one. :func:`place`
assigns device ids packing each job on as few nodes as it can; when the devices left are
fragmented a job may span more nodes than the model assumed (the allocation stays within
capacity, but that job's goodput is overestimated).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import time
from typing import Sequence

import numpy as np

from hfkern.elastic._model import Job

__all__ = ["Allocation", "Solution", "allocate", "allocate_brute_force", "place", "reference_goodput"]

_OBJECTIVES = ("speedup", "goodput")
_MODES = ("elastic", "fixed")
_TIE = 1e-9          # relative bonus that keeps a job's current allocation among (near-)ties


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One job's share: ``gpus`` devices (0: not running), global ``batch_size`` per trial, ``B``
    trials, and the predicted goodput (useful model-samples per second; 0 when not running)."""

    gpus: int
    batch_size: int
    B: int
    goodput: float


@dataclasses.dataclass(frozen=True)
class Solution:
    """Every job's :class:`Allocation` by name (queued ones with ``gpus == 0``), the objective
    value and the solve time in seconds."""

    allocations: dict[str, Allocation]
    objective: float
    seconds: float

    @property
    def gpus_used(self) -> int:
        return sum(a.gpus for a in self.allocations.values())


# --------------------------------------------------------------------------------------------
# validation and shared pieces
# --------------------------------------------------------------------------------------------
def _check_args(jobs, gpus, gpus_per_node, objective, batch, arrays, current, restart_factor=None):
    if isinstance(gpus, bool) or not isinstance(gpus, numbers.Integral):
        raise TypeError(f"gpus: expected an int, got {type(gpus).__name__} {gpus!r}")
    if gpus < 1:
        raise ValueError(f"gpus: expected a positive number of devices, got {gpus}")
    if gpus_per_node is not None:
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, numbers.Integral):
            raise TypeError(f"gpus_per_node: expected an int or None, got {type(gpus_per_node).__name__}")
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node: expected a positive int, got {gpus_per_node}")
        if gpus % gpus_per_node:
            raise ValueError(f"gpus: expected a multiple of gpus_per_node={gpus_per_node}, got {gpus}")
    if objective not in _OBJECTIVES:
        raise ValueError(f"objective: expected one of {_OBJECTIVES}, got {objective!r}")
    if batch not in _MODES:
        raise ValueError(f"batch: expected one of {_MODES}, got {batch!r}")
    if arrays not in _MODES:
        raise ValueError(f"arrays: expected one of {_MODES}, got {arrays!r}")
    if isinstance(jobs, (str, bytes, Job)) or not hasattr(jobs, "__iter__"):
        raise TypeError(f"jobs: expected a sequence of Job, got {type(jobs).__name__}")
    jobs = list(jobs)
    seen = set()
    for i, j in enumerate(jobs):
        if not isinstance(j, Job):
            raise TypeError(f"jobs[{i}]: expected a Job, got {type(j).__name__}")
        if j.name in seen:
            raise ValueError(f"jobs: expected unique names, got {j.name!r} twice")
        seen.add(j.name)
    if current is not None:
        if not isinstance(current, dict):
            raise TypeError(f"current: expected a dict of name -> Allocation or None, got {type(current).__name__}")
        for k, a in current.items():
            if not isinstance(a, Allocation):
                raise TypeError(f"current[{k!r}]: expected an Allocation, got {type(a).__name__}")
    factors = {}
    if restart_factor is not None:
        if not isinstance(restart_factor, dict):
            raise TypeError(f"restart_factor: expected a dict of name -> float in [0, 1] or None, "
                            f"got {type(restart_factor).__name__}")
        for k, f in restart_factor.items():
            if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0.0 <= f <= 1.0:
                raise ValueError(f"restart_factor[{k!r}]: expected a number in [0, 1], got {f!r}")
            factors[k] = float(f)
    return int(gpus), jobs, dict(current or {}), factors


def _nodes(g: int, gpus_per_node: int | None) -> int:
    return 1 if gpus_per_node is None or g <= 0 else -(-g // gpus_per_node)


def _options(job: Job, batch: str, arrays: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    bs = job.batch_sizes if batch == "elastic" else (job.default_batch_size,)
    Bs = job.array_sizes if arrays == "elastic" else (job.default_B,)
    return bs, Bs


def _max_useful_gpus(job: Job) -> int:
    hi = job.batch_sizes[-1]
    return hi if job.max_gpus is None else min(hi, job.max_gpus)


def reference_goodput(job: Job, gpus_per_node: int | None = None) -> float:
    """The goodput that ``objective="speedup"`` divides by: the job at 1 device, its default
    batch size and default ``B``; where that is not allowed, the best allowed (batch size,
    ``B``) at the smallest device count that allows any. 0.0 if the job can never run."""
    if not isinstance(job, Job):
        raise TypeError(f"job: expected a Job, got {type(job).__name__}")
    return float(_reference_goodputs([job], gpus_per_node)[0])


def _reference_goodputs(jobs: list[Job], gpus_per_node: int | None) -> np.ndarray:
    """:func:`reference_goodput` of every job, the model evaluated in one vectorized pass."""
    owner, gs, bs, Bs = [], [], [], []
    for i, job in enumerate(jobs):
        if _first_feasible_gpus(job, job.default_batch_size, job.default_B) == 1:
            cands, g0 = [(job.default_batch_size, job.default_B)], 1
        else:
            firsts = {(b, B): _first_feasible_gpus(job, b, B) for b in job.batch_sizes for B in job.array_sizes}
            g0 = min((g for g in firsts.values() if g is not None), default=None)
            if g0 is None:
                continue
            cands = [bB for bB, g in firsts.items() if g == g0]       # allowed at g0
        for b, B in cands:
            owner.append(i)
            gs.append(g0)
            bs.append(b)
            Bs.append(B)
    out = np.zeros(len(jobs))
    if not owner:
        return out
    owner = np.array(owner)

    def per(attr):
        return np.array([attr(jobs[i]) for i in owner], dtype=np.float64)

    g = np.array(gs, dtype=np.float64)
    b = np.array(bs, dtype=np.float64)
    B = np.array(Bs, dtype=np.float64)
    nodes = np.ones_like(g) if gpus_per_node is None else np.ceil(g / gpus_per_node)
    t_grad = per(lambda j: j.model.alpha_grad) + per(lambda j: j.model.beta_grad) * (B * b / g)
    t_sync = np.where(g > 1, per(lambda j: j.model.alpha_sync) + per(lambda j: j.model.beta_sync) * (g - 2)
                      + np.where(nodes > 1, per(lambda j: j.model.alpha_net), 0.0), 0.0)
    gamma = per(lambda j: j.model.gamma)
    t_step = np.where(gamma == 1.0, t_grad + t_sync,
                      (t_grad ** gamma + t_sync ** gamma) ** (1.0 / gamma))
    phi = per(lambda j: j.efficiency.noise_scale)
    m0 = per(lambda j: j.efficiency.base_batch_size)
    good = B * b / t_step * ((phi + m0) / (phi + b))
    np.maximum.at(out, owner, good)
    return out


def _first_feasible_gpus(job: Job, b: int, B: int) -> int | None:
    """The smallest device count at which ``job`` may run batch ``b`` with ``B`` trials (memory
    falls as devices grow; each device needs a sample), or None."""
    g = job.min_gpus
    if job.max_local_batch is not None:
        per_trial = job.max_local_batch // B        # samples per device and trial that fit
        if per_trial == 0:
            return None
        g = max(g, -(-b // per_trial))              # ceil(b / g) <= per_trial
    hi = _max_useful_gpus(job)
    return g if g <= min(b, hi) else None


def _queued(job: Job) -> Allocation:
    return Allocation(0, job.default_batch_size, job.default_B, 0.0)


# --------------------------------------------------------------------------------------------
# the dynamic program
# --------------------------------------------------------------------------------------------
def _tables(jobs: list[Job], G: int, gpn: int | None, objective: str, batch: str, arrays: str,
            current: dict[str, Allocation], factors: dict[str, float]):
    """Per job and device count ``g = 0..G``: the best value, its goodput and the (batch, B)
    reaching it. Vectorized over jobs x g x batch sizes x B."""
    J = len(jobs)
    # jobs sorted by gamma, so that each gamma's rows are one slice (views, numpy's fast paths
    # for a scalar exponent); the results are put back in the callers' order at the end
    order = sorted(range(J), key=lambda i: jobs[i].model.gamma)
    jobs = [jobs[i] for i in order]
    opts = [_options(j, batch, arrays) for j in jobs]
    nb = max(len(o[0]) for o in opts)
    nB = max(len(o[1]) for o in opts)
    gmax = max(1, min(G, max(_max_useful_gpus(j) for j in jobs)))

    bs = np.ones((J, nb), dtype=np.int64)
    bmask = np.zeros((J, nb), dtype=bool)
    Bs = np.ones((J, nB), dtype=np.int64)
    Bmask = np.zeros((J, nB), dtype=bool)
    for i, (ob, oB) in enumerate(opts):
        bs[i, :len(ob)] = ob
        bmask[i, :len(ob)] = True
        Bs[i, :len(oB)] = oB
        Bmask[i, :len(oB)] = True

    def col(values, dtype=np.float64):
        return np.asarray(values, dtype=dtype).reshape(J, 1, 1, 1)

    ag = col([j.model.alpha_grad for j in jobs])
    bg = col([j.model.beta_grad for j in jobs])
    as_ = col([j.model.alpha_sync for j in jobs])
    bsy = col([j.model.beta_sync for j in jobs])
    an = col([j.model.alpha_net for j in jobs])
    phi = col([j.efficiency.noise_scale for j in jobs])
    m0 = col([j.efficiency.base_batch_size for j in jobs])
    lo = col([j.min_gpus for j in jobs], np.int64)
    hi = col([j.max_gpus if j.max_gpus is not None else G for j in jobs], np.int64)
    big = np.iinfo(np.int64).max // 4
    mlb = col([j.max_local_batch if j.max_local_batch is not None else big for j in jobs], np.int64)
    if objective == "speedup":
        ref = _reference_goodputs(jobs, gpn)
    else:
        ref = np.ones(J)

    g = np.arange(1, gmax + 1, dtype=np.int64).reshape(1, gmax, 1, 1)
    b = bs.reshape(J, 1, nb, 1)
    B = Bs.reshape(J, 1, 1, nB)
    gf = g.astype(np.float64)

    # feasibility: small pieces first, one full-size comparison
    ok_g = (g >= lo) & (g <= hi) & (ref > 0).reshape(J, 1, 1, 1)            # J x g
    ok_b = bmask.reshape(J, 1, nb, 1) & (g <= b) & ok_g                     # J x g x batch
    cap = np.where(Bmask.reshape(J, 1, 1, nB), mlb // B, -1)                # per-device samples per trial
    ok = (-(-b // g) <= cap) & ok_b                                         # J x g x batch x B

    # step time: the synchronization part depends on (job, g) only
    samples = (B * b).astype(np.float64)                                     # model-samples per step
    t_grad = ag + (bg * samples) * (1.0 / gf)
    nodes = np.ones_like(g) if gpn is None else -(-g // gpn)
    t_sync = np.where(g > 1, as_ + bsy * np.maximum(gf - 2.0, 0.0) + np.where(nodes > 1, an, 0.0), 0.0)
    gammas = np.array([j.model.gamma for j in jobs])
    t_step = np.empty_like(t_grad)
    start = 0
    for gamma in np.unique(gammas):
        stop = int(np.searchsorted(gammas, gamma, side="right"))
        tg, ts = t_grad[start:stop], t_sync[start:stop]
        if gamma == 1.0:
            np.add(tg, ts, out=t_step[start:stop])
        elif gamma == 2.0:
            np.hypot(tg, ts, out=t_step[start:stop])
        else:
            t_step[start:stop] = (tg ** gamma + ts ** gamma) ** (1.0 / gamma)
        start = stop

    # goodput = samples * E(batch) / t_step; value = goodput / reference
    work = samples * ((phi + m0) / (phi + b))                                # J x 1 x batch x B
    ref = np.where(ref > 0, ref, 1.0)         # jobs that can never run are masked out above
    value = np.divide(work / ref.reshape(J, 1, 1, 1), t_step)
    value[~ok] = -np.inf

    # a running job: other configurations discounted by its restart factor, its current one
    # kept among ties
    for i, j in enumerate(jobs):
        a = current.get(j.name)
        if a is None or a.gpus < 1:
            continue
        keep = None
        ob, oB = opts[i]
        if a.gpus <= gmax and a.batch_size in ob and a.B in oB:
            cell = (i, a.gpus - 1, ob.index(a.batch_size), oB.index(a.B))
            if np.isfinite(value[cell]):
                keep = value[cell]
        f = factors.get(j.name, 1.0)
        if f != 1.0:
            row = value[i]                  # a view
            row[np.isfinite(row)] *= f
        if keep is not None:
            value[cell] = keep * (1.0 + _TIE)

    flat = value.reshape(J, gmax, nb * nB)
    arg = flat.argmax(axis=2)
    bi, Bi = np.divmod(arg, nB)
    rows = np.arange(J)[:, None]
    v = np.full((J, G + 1), -np.inf)
    v[:, 0] = 0.0
    v[:, 1:gmax + 1] = np.take_along_axis(flat, arg[..., None], axis=2)[..., 0]
    gp = np.zeros((J, G + 1))
    chosen_t = np.take_along_axis(t_step.reshape(J, gmax, nb * nB), arg[..., None], axis=2)[..., 0]
    gp[:, 1:gmax + 1] = work.reshape(J, nb * nB)[rows, arg] / chosen_t
    bidx = np.zeros((J, G + 1), dtype=np.int64)
    Bidx = np.zeros((J, G + 1), dtype=np.int64)
    bidx[:, 1:gmax + 1], Bidx[:, 1:gmax + 1] = bi, Bi

    back = np.empty(J, dtype=np.int64)
    back[order] = np.arange(J)
    return ([opts[k] for k in back], v[back], gp[back], bidx[back], Bidx[back], ref[back])


def _knapsack(v: np.ndarray) -> list[int]:
    """Max-plus knapsack over the rows of ``v`` (``v[j, k]``: value of job ``j`` at ``k``
    devices, ``-inf`` where not allowed, ``v[j, 0] = 0``); returns the devices per job."""
    J, G1 = v.shape
    G = G1 - 1
    # a count k is worth considering only if it beats every smaller count
    prefix = np.maximum.accumulate(v, axis=1)
    useful = np.ones_like(v, dtype=bool)
    useful[:, 1:] = v[:, 1:] > prefix[:, :-1]
    c = np.arange(G1)
    dp = np.zeros(G1)                       # best value with at most c devices, no job yet
    pad = np.full(G1, -np.inf)
    choices = []
    for j in range(J):
        ks = np.flatnonzero(useful[j])      # ascending, starts with 0
        if len(ks) == 1:
            choices.append(None)
            continue
        ext = np.concatenate([pad, dp])
        cand = ext[c[:, None] - ks[None, :] + G1] + v[j, ks][None, :]
        a = cand.argmax(axis=1)
        dp = cand[c, a]
        choices.append(ks[a])
    out = [0] * J
    cap = G
    for j in range(J - 1, -1, -1):
        if choices[j] is None:
            continue
        k = int(choices[j][cap])
        out[j] = k
        cap -= k
    return out


def allocate(jobs: Sequence[Job], gpus: int, *, gpus_per_node: int | None = None,
             objective: str = "speedup", batch: str = "elastic", arrays: str = "elastic",
             current: dict[str, Allocation] | None = None,
             restart_factor: dict[str, float] | None = None) -> Solution:
    """Devices, batch size and ``B`` for every job, maximizing the cluster's objective.

    ``objective``: ``"speedup"`` (sum over jobs of goodput / reference goodput, see the module
    docstring) or ``"goodput"`` (sum of raw goodputs). ``batch="fixed"`` keeps every job at
    its ``default_batch_size`` and ``arrays="fixed"`` at its ``default_B`` (the GPU-only
    elastic baseline uses both); ``"elastic"`` lets the optimizer pick among the job's allowed
    values. ``current`` (name -> its allocation now, queued jobs may be left out) breaks ties:
    among options whose values are equal to a relative 1e-9, a job keeps what it has.

    ``restart_factor`` (name -> ``f`` in [0, 1]) charges a running job for a restart: every
    configuration other than its ``current`` one counts ``f`` times its value in the
    maximization. With ``f = 1 - restart_cost / horizon`` a lone job moves from goodput ``go``
    to ``gn`` only if ``gn * (horizon - restart_cost) > go * horizon``, i.e. if the goodput it
    gains over the horizon exceeds what the restart's lost seconds cost; with several jobs the
    same trade is made for the cluster as a whole (a job may shrink to let another start).
    ``Solution.objective`` is the allocation's undiscounted value.

    Jobs left with 0 devices are queued (:class:`Allocation` ``gpus == 0`` at their default
    batch size and ``B``). Exact for the model: the same optimum as
    :func:`allocate_brute_force`.
    """
    t0 = time.perf_counter()
    G, jobs, current, factors = _check_args(jobs, gpus, gpus_per_node, objective, batch, arrays, current,
                                            restart_factor)
    if not jobs:
        return Solution({}, 0.0, time.perf_counter() - t0)
    opts, v, gp, bi, Bi, ref = _tables(jobs, G, gpus_per_node, objective, batch, arrays, current, factors)
    counts = _knapsack(v)
    allocs = {}
    total = 0.0
    for i, (job, k) in enumerate(zip(jobs, counts)):
        if k == 0:
            allocs[job.name] = _queued(job)
            continue
        ob, oB = opts[i]
        a = Allocation(k, int(ob[bi[i, k]]), int(oB[Bi[i, k]]), float(gp[i, k]))
        allocs[job.name] = a
        total += float(gp[i, k]) / float(ref[i])
    return Solution(allocs, float(total), time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# brute force (tests)
# --------------------------------------------------------------------------------------------
def _brute_force(jobs, gpus, *, gpus_per_node=None, objective="speedup", batch="elastic",
                 arrays="elastic", current=None, restart_factor=None, limit=2_000_000, rtol=1e-9):
    """:func:`allocate_brute_force` that also returns how many assignments reach the optimum
    (within ``rtol``; device vectors times, per job, tied (batch size, B) choices) and the
    optimum of the maximized (restart-discounted) score."""
    t0 = time.perf_counter()
    G, jobs, current, factors = _check_args(jobs, gpus, gpus_per_node, objective, batch, arrays, current,
                                            restart_factor)
    if not jobs:
        return Solution({}, 0.0, time.perf_counter() - t0), 1, 0.0
    per_job = []          # per job: {g: (value, goodput, batch, B, n_tied)}
    for job in jobs:
        bs, Bs = _options(job, batch, arrays)
        ref = reference_goodput(job, gpus_per_node) if objective == "speedup" else 1.0
        cur = current.get(job.name)
        table = {0: (0.0, 0.0, job.default_batch_size, job.default_B, 1)}
        for g in range(1, G + 1):
            n = _nodes(g, gpus_per_node)
            cands = []
            for b in bs:
                for B in Bs:
                    gp = job.goodput(g, b, B, n)
                    if gp <= 0 or ref <= 0:
                        continue
                    val = gp / ref
                    running = cur is not None and cur.gpus > 0
                    if running and (cur.gpus, cur.batch_size, cur.B) == (g, b, B):
                        score = val * (1.0 + _TIE)
                    elif running:
                        score = val * factors.get(job.name, 1.0)
                    else:
                        score = val
                    cands.append((score, val, gp, b, B))
            if cands:
                top = max(c[0] for c in cands)
                best = next(c for c in cands if c[0] == top)
                ties = sum(1 for c in cands if c[0] >= top - rtol * abs(top))
                table[g] = (best[0], best[2], best[3], best[4], ties, best[1])
        per_job.append(table)
    n_assign = math.prod(len(t) for t in per_job)
    if n_assign > limit:
        raise ValueError(f"allocate_brute_force: expected a small instance (at most {limit} assignments), "
                         f"got {n_assign}")
    best, best_key, all_scores = None, None, []
    for combo in itertools.product(*[sorted(t) for t in per_job]):
        if sum(combo) > G:
            continue
        score = sum(t[g][0] for t, g in zip(per_job, combo))
        all_scores.append((score, combo))
        if best is None or score > best:
            best, best_key = score, combo
    n_opt = 0
    for score, combo in all_scores:
        if score >= best - rtol * max(abs(best), 1e-300):
            n_opt += math.prod(per_job[i][g][4] for i, g in enumerate(combo))
    allocs, total = {}, 0.0
    for job, t, g in zip(jobs, per_job, best_key):
        if g == 0:
            allocs[job.name] = _queued(job)
            continue
        _, gp, b, B, _, val = t[g]
        allocs[job.name] = Allocation(g, b, B, gp)
        total += val
    return Solution(allocs, float(total), time.perf_counter() - t0), n_opt, best


def allocate_brute_force(jobs: Sequence[Job], gpus: int, *, gpus_per_node: int | None = None,
                         objective: str = "speedup", batch: str = "elastic", arrays: str = "elastic",
                         current: dict[str, Allocation] | None = None,
                         restart_factor: dict[str, float] | None = None) -> Solution:
    """:func:`allocate` by enumeration: every job's best (batch size, ``B``) at each device count
    from scalar :meth:`Job.goodput` calls, then every vector of device counts within capacity.
    Exponential in the number of jobs; ValueError past two million assignments. For tests."""
    return _brute_force(jobs, gpus, gpus_per_node=gpus_per_node, objective=objective, batch=batch,
                        arrays=arrays, current=current, restart_factor=restart_factor)[0]


# --------------------------------------------------------------------------------------------
# placement
# --------------------------------------------------------------------------------------------
def place(solution: Solution, gpus: int, gpus_per_node: int) -> dict[str, list[int]]:
    """Device ids (``node * gpus_per_node + local index``) per job, every job of the solution
    included (``[]`` when queued).

    Jobs are packed on as few nodes as the free devices allow: first each job's whole nodes
    (``g // gpus_per_node`` empty nodes), then the remainders, largest first, each into the
    node with the fewest free devices that still holds it (best fit); a remainder no single
    node holds is split over the nodes with the most free devices.
    """
    if not isinstance(solution, Solution):
        raise TypeError(f"solution: expected a Solution, got {type(solution).__name__}")
    _check_args([], gpus, gpus_per_node, "speedup", "elastic", "elastic", None)
    if gpus_per_node is None:
        raise TypeError("gpus_per_node: expected an int, got None")
    for name, a in solution.allocations.items():
        g = getattr(a, "gpus", None)
        if isinstance(g, bool) or not isinstance(g, numbers.Integral):
            raise TypeError(f"solution: expected Allocation.gpus an int >= 0 for job {name!r}, "
                            f"got {type(g).__name__} {g!r}")
        if g < 0:
            raise ValueError(f"solution: expected Allocation.gpus an int >= 0 for job {name!r}, got {g!r}")
    used = solution.gpus_used
    if used > gpus:
        raise ValueError(f"solution: expected at most gpus={gpus} devices in use, got {used}")
    n_nodes = gpus // gpus_per_node
    free = [list(range(n * gpus_per_node, (n + 1) * gpus_per_node)) for n in range(n_nodes)]
    out: dict[str, list[int]] = {name: [] for name in solution.allocations}
    order = sorted((int(a.gpus), name) for name, a in solution.allocations.items() if a.gpus > 0)
    order.reverse()
    for g, name in order:
        for _ in range(g // gpus_per_node):
            n = next(i for i, f in enumerate(free) if len(f) == gpus_per_node)
            out[name].extend(free[n])
            free[n] = []
    rest = sorted(((g % gpus_per_node, name) for g, name in order if g % gpus_per_node), reverse=True)
    for r, name in rest:
        fits = [i for i, f in enumerate(free) if len(f) >= r]
        if fits:
            n = min(fits, key=lambda i: (len(free[i]), i))
            out[name].extend(free[n][:r])
            free[n] = free[n][r:]
            continue
        while r:
            n = max(range(n_nodes), key=lambda i: (len(free[i]), -i))
            take = min(r, len(free[n]))
            out[name].extend(free[n][:take])
            free[n] = free[n][take:]
            r -= take
    for name in out:
        out[name].sort()
    return out
