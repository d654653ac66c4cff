"""Event-driven simulation of a GPU cluster running a job trace under a scheduling policy.

The cluster has ``gpus`` devices, ``gpus_per_node`` per node. Jobs of a
:class:`~hfkern.elastic._trace.Trace` arrive at their arrival times, each with
an amount of *work* (efficiency-weighted samples). While a job holds an
allocation (``g`` devices, global batch size, ``B`` trials) it makes progress
at its goodput ``job.goodput(g, batch, B, nodes=ceil(g / gpus_per_node))``:
jobs are assumed packed on the fewest nodes; placement fragmentation is not
modelled, for any policy. A job finishes when its progress reaches its work.

Policies, side by side on the same trace:

``"fixed"``
    First come, first served with backfilling. A job runs at exactly its
    ``requested_gpus``, default batch size and default ``B``, from the moment
    enough devices are free until it finishes; it is never resized or
    preempted. ``backfill="easy"`` (default) is EASY backfilling: the oldest
    waiting job gets a reservation at the earliest time enough devices will be
    free (run times are known exactly here -- optimistic for this baseline),
    and younger jobs may start now if they fit and do not delay that
    reservation. ``"greedy"`` starts any waiting job that fits, in arrival
    order (large jobs can starve); ``"none"`` is strict FIFO.
``"gpu"``
    :class:`~hfkern.elastic._autoscaler.Autoscaler` with ``policy="gpu"``:
    device counts elastic, batch size and ``B`` fixed at the job's defaults.
``"hfkern"``
    The autoscaler with ``policy="hfkern"``: devices, batch size and ``B``
    elastic.

The autoscaler is told of every arrival (``submit``) and completion
(``finish``) and ticked every ``interval`` seconds; after each event the
simulator applies the autoscaler's ``allocations`` (its view of who runs with
what). A running job whose allocation changes (devices, batch size or ``B``),
and a preempted job that resumes, makes no progress for ``restart_cost``
seconds (checkpoint, stop, relaunch) while it holds its new devices; a job's
first start is free for every policy. Progress is kept across preemptions
(jobs checkpoint). By default the autoscaler is not told jobs' remaining times
(a real scheduler does not know them); ``oracle_remaining=True`` passes the
remaining seconds at the current allocation to ``tick``.

Events are processed in time order: completions, then arrivals, then the
tick; between events every quantity is constant or linear, so the simulation
is exact up to floating point (no time step).

Bookkeeping checks (:func:`check_result`, run at the end of every simulation
and stored in :attr:`SimResult.checks`) do not assert; they count what went
wrong so that tests and benchmarks can verify it is zero: jobs finished more
than once; events where allocated devices exceed capacity, both as the running
sum the simulator keeps and recomputed from the per-job allocation segments;
finished jobs whose work recomputed from their segments differs from their
work; allocations to unknown, not yet arrived or finished jobs; allocations
with zero goodput; allocations that break the policy (a "gpu" job off its
default batch size or ``B``, a "fixed" job off its request).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections import Counter
from typing import Iterable, Mapping, Sequence

import numpy as np

from hfkern.elastic._model import Job
from hfkern.elastic._optimizer import _OBJECTIVES
from hfkern.elastic._trace import Trace, TraceJob

__all__ = ["POLICIES", "Segment", "JobRecord", "SimResult", "simulate", "compare", "check_result"]

POLICIES = ("fixed", "gpu", "hfkern")
_BACKFILL = ("easy", "greedy", "none")
_REL_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of time in which a job held one allocation.

    The job made progress at ``goodput`` from ``max(start, productive_from)``
    to ``end`` (nothing before ``productive_from``: restarting).
    """

    start: float
    end: float
    gpus: int
    batch_size: int
    B: int
    goodput: float
    productive_from: float

    @property
    def productive_seconds(self) -> float:
        return max(0.0, self.end - max(self.start, self.productive_from))

    @property
    def work(self) -> float:
        return self.goodput * self.productive_seconds


@dataclasses.dataclass
class JobRecord:
    """What happened to one job. ``start`` is its first start, ``finish`` None if unfinished."""

    name: str
    archetype: str
    arrival: float
    requested_gpus: int
    work: float
    duration: float
    start: float | None = None
    finish: float | None = None
    finishes: int = 0
    work_done: float = 0.0
    restarts: int = 0
    preemptions: int = 0
    segments: list[Segment] = dataclasses.field(default_factory=list)

    @property
    def jct(self) -> float | None:
        """Job completion time: finish - arrival (None if unfinished)."""
        return None if self.finish is None else self.finish - self.arrival

    @property
    def gpu_seconds(self) -> float:
        return float(sum(s.gpus * (s.end - s.start) for s in self.segments))

    def to_dict(self, segments: bool = False) -> dict:
        d = dict(name=self.name, archetype=self.archetype, arrival=self.arrival,
                 requested_gpus=self.requested_gpus, work=self.work, duration=self.duration,
                 start=self.start, finish=self.finish, jct=self.jct, restarts=self.restarts,
                 preemptions=self.preemptions, gpu_seconds=self.gpu_seconds,
                 allocations=len(self.segments))
        if self.segments:
            last = self.segments[-1]
            d["last_allocation"] = dict(gpus=last.gpus, batch_size=last.batch_size, B=last.B)
            run = sum(s.end - s.start for s in self.segments)
            d["mean_gpus"] = self.gpu_seconds / run if run > 0 else 0.0
        if segments:
            d["segments"] = [dataclasses.asdict(s) for s in self.segments]
        return d


@dataclasses.dataclass
class SimResult:
    """Everything a simulation produced.

    ``timeline`` holds, after every event, ``(time, allocated GPUs, running
    jobs, waiting jobs)``; each row's state lasts until the next row's time.
    ``checks`` is :func:`check_result`'s dictionary (all counts 0 and
    ``ok`` True on a correct run).
    """

    policy: str
    gpus: int
    gpus_per_node: int
    horizon: float | None
    end_time: float
    jobs: dict[str, JobRecord]
    timeline: list[tuple[float, int, int, int]]
    params: dict
    solver_seconds: float = 0.0
    wall_seconds: float = 0.0
    decisions: Counter = dataclasses.field(default_factory=Counter)
    events: int = 0
    checks: dict = dataclasses.field(default_factory=dict)
    _internal: dict = dataclasses.field(default_factory=dict, repr=False)

    def completed(self, by: float | None = None) -> list[JobRecord]:
        """Jobs finished at or before ``by`` (default: the end of the simulation)."""
        return [r for r in self.jobs.values() if r.finish is not None and (by is None or r.finish <= by)]

    def allocated_gpu_seconds(self, until: float | None = None, productive: bool = False) -> float:
        """GPU-seconds held (or, ``productive=True``, held outside restarts) in ``[0, until]``."""
        t_end = self.end_time if until is None else min(until, self.end_time)
        total = 0.0
        for r in self.jobs.values():
            for s in r.segments:
                lo = max(s.start, s.productive_from) if productive else s.start
                hi = min(s.end, t_end)
                if hi > lo:
                    total += s.gpus * (hi - lo)
        return total

    def metrics(self, by: float | None = None) -> dict:
        """Summary numbers over ``[0, by]`` (default: the whole simulation).

        ``completed``: jobs finished by then; ``makespan``: the last finish if
        every job finished by then, else None; ``jct_*`` over the finished
        jobs (seconds); ``jct_censored_mean``: mean over jobs arrived by then,
        an unfinished job counting ``by - arrival`` (a lower bound that does not
        reward finishing fewer jobs); ``wait_mean``: first start minus arrival
        over started jobs; ``utilization``: allocated GPU-seconds / (gpus x
        time), ``productive_utilization`` the same without restart time.
        """
        t_end = self.end_time if by is None else min(by, self.end_time)
        done = self.completed(t_end)
        jct = np.array([r.jct for r in done], dtype=np.float64)
        arrived = [r for r in self.jobs.values() if r.arrival <= t_end]
        censored = np.array([(min(r.finish, t_end) if r.finish is not None else t_end) - r.arrival
                             for r in arrived], dtype=np.float64)
        started = [r.start - r.arrival for r in self.jobs.values() if r.start is not None and r.start <= t_end]
        all_done = len(done) == len(self.jobs)
        cap = self.gpus * t_end
        nan = float("nan")
        return dict(
            policy=self.policy, until=t_end, jobs=len(self.jobs), arrived=len(arrived), completed=len(done),
            makespan=max((r.finish for r in done), default=0.0) if all_done else None,
            jct_mean=float(jct.mean()) if jct.size else nan,
            jct_median=float(np.median(jct)) if jct.size else nan,
            jct_p99=float(np.quantile(jct, 0.99)) if jct.size else nan,
            jct_censored_mean=float(censored.mean()) if censored.size else nan,
            wait_mean=float(np.mean(started)) if started else nan,
            utilization=self.allocated_gpu_seconds(t_end) / cap if cap > 0 else nan,
            productive_utilization=self.allocated_gpu_seconds(t_end, productive=True) / cap if cap > 0 else nan,
            restarts=sum(r.restarts for r in self.jobs.values()),
            preemptions=sum(r.preemptions for r in self.jobs.values()),
        )

    def utilization_series(self, bin_seconds: float, until: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Allocated fraction of the cluster averaged over bins of ``bin_seconds``.

        Returns ``(bin_start_times, utilization)`` from the timeline (exact
        time-weighted averages per bin).
        """
        if not bin_seconds > 0:
            raise ValueError(f"utilization_series: expected bin_seconds > 0, got {bin_seconds!r}")
        t_end = self.end_time if until is None else min(until, self.end_time)
        nb = max(1, int(math.ceil(t_end / bin_seconds)))
        area = np.zeros(nb)
        rows = self.timeline
        for i, (t0, alloc, _, _) in enumerate(rows):
            t1 = rows[i + 1][0] if i + 1 < len(rows) else t_end
            t0, t1 = max(t0, 0.0), min(t1, t_end)
            if t1 <= t0 or alloc == 0:
                continue
            b0, b1 = int(t0 // bin_seconds), min(int(math.ceil(t1 / bin_seconds)), nb)
            for b in range(b0, b1):
                lo, hi = max(t0, b * bin_seconds), min(t1, (b + 1) * bin_seconds)
                if hi > lo:
                    area[b] += alloc * (hi - lo)
        widths = np.minimum(np.arange(1, nb + 1) * bin_seconds, t_end) - np.arange(nb) * bin_seconds
        return np.arange(nb) * bin_seconds, area / (self.gpus * np.maximum(widths, 1e-300))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _check_pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"simulate: expected {name} an int, got {type(v).__name__} {v!r}")
    if v < 1:
        raise ValueError(f"simulate: expected {name} >= 1, got {v}")
    return int(v)


def _check_nonneg(name: str, v, strict: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"simulate: expected {name} a real number, got {type(v).__name__} {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0 or (strict and v == 0):
        raise ValueError(f"simulate: expected {name} a finite number {'>' if strict else '>='} 0, got {v}")
    return v


def _trace_jobs(trace) -> list[TraceJob]:
    if isinstance(trace, Trace):
        items = list(trace.jobs)
    elif isinstance(trace, (str, bytes)) or not isinstance(trace, Iterable):
        raise TypeError(f"simulate: expected a Trace or a sequence of TraceJob, got {type(trace).__name__}")
    else:
        items = list(trace)
    names = set()
    for i, tj in enumerate(items):
        if not isinstance(tj, TraceJob):
            raise TypeError(f"simulate: expected trace[{i}] a TraceJob, got {type(tj).__name__}")
        if not isinstance(tj.job, Job):
            raise TypeError(f"simulate: expected trace[{i}].job a Job, got {type(tj.job).__name__}")
        if tj.name in names:
            raise ValueError(f"simulate: expected unique job names, got {tj.name!r} twice")
        names.add(tj.name)
        for field in ("arrival", "work", "duration"):
            v = getattr(tj, field)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"simulate: expected trace[{i}].{field} a real number, got {type(v).__name__} {v!r}")
        if not isinstance(tj.archetype, str):
            raise TypeError(f"simulate: expected trace[{i}].archetype a str, got {type(tj.archetype).__name__} "
                            f"{tj.archetype!r}")
        if not (math.isfinite(tj.arrival) and tj.arrival >= 0):
            raise ValueError(f"simulate: expected trace[{i}].arrival finite and >= 0, got {tj.arrival!r}")
        if not (math.isfinite(tj.work) and tj.work > 0):
            raise ValueError(f"simulate: expected trace[{i}].work finite and > 0, got {tj.work!r}")
    return sorted(items, key=lambda tj: tj.arrival)   # stable: ties keep trace order


# --------------------------------------------------------------------------------------------
# the simulation
# --------------------------------------------------------------------------------------------
class _Run:
    __slots__ = ("gpus", "batch_size", "B", "goodput", "since", "productive_from")

    def __init__(self, gpus, batch_size, B, goodput, since, productive_from):
        self.gpus, self.batch_size, self.B = gpus, batch_size, B
        self.goodput, self.since, self.productive_from = goodput, since, productive_from


class _Sim:
    def __init__(self, items: list[TraceJob], policy: str, gpus: int, gpn: int, interval: float,
                 restart_cost: float, horizon: float | None, backfill: str, oracle_remaining: bool,
                 scaler):
        self.items = items
        self.by_name = {tj.name: tj for tj in items}
        self.policy, self.G, self.gpn = policy, gpus, gpn
        self.interval, self.restart_cost, self.horizon = interval, restart_cost, horizon
        self.backfill, self.oracle_remaining, self.scaler = backfill, oracle_remaining, scaler
        self.records = {tj.name: JobRecord(tj.name, tj.archetype, tj.arrival, tj.job.requested_gpus,
                                           tj.work, tj.duration) for tj in items}
        self.remaining = {tj.name: tj.work for tj in items}
        self.running: dict[str, _Run] = {}
        self.waiting: list[str] = []          # arrival order
        self.active: set[str] = set()         # arrived, unfinished
        self.t = 0.0
        self.timeline: list[tuple[float, int, int, int]] = []
        self.decisions: Counter = Counter()
        self.solver_seconds = 0.0
        self.events = 0
        self.issues: Counter = Counter()
        self.max_allocated = 0
        self.idle_ticks = 0

    # -- state changes ---------------------------------------------------------------------------
    def nodes(self, g: int) -> int:
        return -(-g // self.gpn)

    def advance(self, t_new: float) -> None:
        for name, r in self.running.items():
            lo = max(self.t, r.productive_from)
            if t_new > lo:
                self.remaining[name] -= r.goodput * (t_new - lo)
        self.t = t_new

    def _close(self, name: str) -> None:
        r = self.running.pop(name)
        self.records[name].segments.append(
            Segment(r.since, self.t, r.gpus, r.batch_size, r.B, r.goodput, r.productive_from))

    def start(self, name: str, gpus: int, batch_size: int, B: int) -> None:
        job = self.by_name[name].job
        rec = self.records[name]
        gp = job.goodput(gpus, batch_size, B, self.nodes(gpus))
        if not gp > 0:
            self.issues["zero_goodput_allocations"] += 1
        if name in self.running:                       # rescale
            self._close(name)
        else:                                          # first start or resume after preemption
            self.waiting.remove(name)
        if rec.segments:
            rec.restarts += 1
            cost = self.restart_cost
        else:
            rec.start = self.t
            cost = 0.0
        self.running[name] = _Run(gpus, batch_size, B, gp, self.t, self.t + cost)

    def stop(self, name: str) -> None:
        self._close(name)
        self.records[name].preemptions += 1
        self.waiting.append(name)
        self.waiting.sort(key=lambda n: (self.by_name[n].arrival, n))

    def finish(self, name: str) -> None:
        rec = self.records[name]
        rec.finishes += 1
        if rec.finishes > 1:
            return
        rec.work_done = rec.work - self.remaining[name]
        self.remaining[name] = 0.0
        self._close(name)
        rec.finish = self.t
        self.active.discard(name)

    def predicted_finish(self, name: str) -> float:
        r = self.running[name]
        if not r.goodput > 0:
            return math.inf
        return max(self.t, r.productive_from) + max(self.remaining[name], 0.0) / r.goodput

    def record(self) -> None:
        alloc = sum(r.gpus for r in self.running.values())
        self.max_allocated = max(self.max_allocated, alloc)
        if alloc > self.G:
            self.issues["capacity_exceeded_events"] += 1
        if self.timeline and self.timeline[-1][0] == self.t:
            self.timeline[-1] = (self.t, alloc, len(self.running), len(self.waiting))
        else:
            self.timeline.append((self.t, alloc, len(self.running), len(self.waiting)))

    # -- policies --------------------------------------------------------------------------------
    def schedule_fixed(self) -> None:
        free = self.G - sum(r.gpus for r in self.running.values())
        while self.waiting:
            head = self.by_name[self.waiting[0]].job
            if head.requested_gpus > free:
                break
            self.start(self.waiting[0], head.requested_gpus, head.default_batch_size, head.default_B)
            free -= head.requested_gpus
        if not self.waiting or self.backfill == "none":
            return
        need = self.by_name[self.waiting[0]].job.requested_gpus
        if self.backfill == "greedy":
            shadow, extra = -math.inf, math.inf
        else:   # EASY: reservation for the head at the earliest time enough devices are free
            ends = sorted((self.predicted_finish(n), r.gpus) for n, r in self.running.items())
            avail, shadow, extra = free, math.inf, 0
            for t_end, g in ends:
                avail += g
                if avail >= need:
                    shadow, extra = t_end, avail - need
                    break
        for name in list(self.waiting[1:]):
            job = self.by_name[name].job
            g = job.requested_gpus
            if g > free:
                continue
            tj = self.by_name[name]
            ends_before = self.t + tj.duration <= shadow
            if ends_before or g <= extra:
                self.start(name, g, job.default_batch_size, job.default_B)
                free -= g
                if not ends_before:
                    extra -= g

    def apply_scaler(self) -> None:
        allocs = self.scaler.allocations
        wanted = {}
        for name, a in allocs.items():
            if a.gpus <= 0:
                continue
            if name not in self.active:
                self.issues["unknown_allocations"] += 1
                continue
            wanted[name] = a
            if self.policy == "gpu":
                job = self.by_name[name].job
                if a.batch_size != job.default_batch_size or a.B != job.default_B:
                    self.issues["policy_violations"] += 1
        for name in [n for n in self.running if n not in wanted]:
            self.stop(name)
        for name, a in wanted.items():
            r = self.running.get(name)
            if r is not None and (r.gpus, r.batch_size, r.B) == (a.gpus, a.batch_size, a.B):
                continue
            self.start(name, int(a.gpus), int(a.batch_size), int(a.B))

    def call(self, fn, *args) -> None:
        t0 = time.perf_counter()
        out = fn(*args)
        self.solver_seconds += time.perf_counter() - t0
        for d in out or ():
            self.decisions[getattr(d, "reason", "?")] += 1

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> float:
        items, n = self.items, len(self.items)
        ai = 0
        elastic = self.scaler is not None
        next_tick = self.interval
        self.record()
        while True:
            t_arr = items[ai].arrival if ai < n else math.inf
            pf = {name: self.predicted_finish(name) for name in self.running}
            t_done = min(pf.values(), default=math.inf)
            busy = bool(self.running or self.waiting)
            if elastic and busy:
                while next_tick <= self.t:
                    next_tick += self.interval
                t_tick = next_tick
            else:
                t_tick = math.inf
            t_next = min(t_arr, t_done, t_tick)
            if t_next == math.inf:
                if self.waiting and not self.running and ai >= n:
                    self.issues["stalled_jobs"] = len(self.waiting)
                break
            if self.idle_ticks > 2:
                # waiting jobs, nothing running, nothing to come, and ticks do not start them
                self.issues["stalled_jobs"] = len(self.waiting)
                break
            if self.horizon is not None and t_next > self.horizon:
                self.advance(self.horizon)
                break
            self.advance(t_next)
            self.events += 1
            eps = _REL_TOL * max(1.0, abs(t_next))
            done = [name for name, t in pf.items() if t <= t_next + eps]
            for name in sorted(done, key=lambda m: (pf[m], m)):
                self.finish(name)
            arrived = []
            while ai < n and items[ai].arrival <= t_next:
                tj = items[ai]
                self.active.add(tj.name)
                self.waiting.append(tj.name)
                arrived.append(tj)
                ai += 1
            if elastic:
                for name in sorted(done, key=lambda m: (pf[m], m)):
                    self.call(self.scaler.finish, name, self.t)
                for tj in arrived:
                    self.call(self.scaler.submit, tj.job, self.t)
                if t_tick <= t_next:
                    rem = None
                    if self.oracle_remaining:
                        rem = {m: self.predicted_finish(m) - self.t for m in self.running}
                    self.call(self.scaler.tick, self.t, rem)
                    next_tick += self.interval
                self.apply_scaler()
                self.idle_ticks = self.idle_ticks + 1 if (not self.running and ai >= n) else 0
            else:
                self.schedule_fixed()
            self.record()
        end = self.t
        for name in list(self.running):
            self._close(name)
        return end


def _make_scaler(policy: str, gpus: int, gpn: int, interval: float, restart_cost: float, objective: str,
                 autoscaler_kwargs: Mapping | None):
    """The autoscaler of an elastic ``policy``; for ``"fixed"`` (which runs none) one is still
    built, then dropped, so that its arguments are checked alike under every policy."""
    from hfkern.elastic._autoscaler import Autoscaler

    kw = dict(gpus_per_node=gpn, interval=interval, restart_cost=restart_cost,
              policy="hfkern" if policy == "fixed" else policy, objective=objective)
    # ("policy" in autoscaler_kwargs, checked to be ``policy`` itself, is left out)
    kw.update({k: v for k, v in (autoscaler_kwargs or {}).items() if k != "policy"})
    scaler = Autoscaler(gpus, **kw)
    return None if policy == "fixed" else scaler


def _check_autoscaler_kwargs(policy: str, autoscaler_kwargs) -> dict:
    if autoscaler_kwargs is None:
        return {}
    if not isinstance(autoscaler_kwargs, Mapping):
        raise TypeError(f"simulate: expected autoscaler_kwargs a mapping of Autoscaler keyword arguments or None, "
                        f"got {type(autoscaler_kwargs).__name__} {autoscaler_kwargs!r}")
    for k in autoscaler_kwargs:
        if not isinstance(k, str):
            raise TypeError(f"simulate: expected autoscaler_kwargs keys str (Autoscaler keyword arguments), "
                            f"got {type(k).__name__} {k!r}")
    if "policy" in autoscaler_kwargs and autoscaler_kwargs["policy"] != policy:
        raise ValueError(f"simulate: expected autoscaler_kwargs without 'policy' (it is set by simulate's own "
                         f"policy argument, {policy!r}), got policy={autoscaler_kwargs['policy']!r}")
    return dict(autoscaler_kwargs)


def simulate(trace: Trace | Sequence[TraceJob], policy: str, *, gpus: int, gpus_per_node: int = 8,
             interval: float = 60.0, restart_cost: float = 30.0, horizon: float | None = None,
             objective: str = "speedup", backfill: str = "easy", oracle_remaining: bool = False,
             autoscaler_kwargs: Mapping | None = None) -> SimResult:
    """Run ``trace`` on a cluster of ``gpus`` devices under ``policy``.

    ``policy`` is one of :data:`POLICIES` (see the module docstring).
    ``interval``: seconds between autoscaler ticks; ``restart_cost``: seconds
    without progress after a rescale or resume. ``horizon``: stop at this
    time (None: run until every job finished). ``objective`` is passed to the
    autoscaler (``"speedup"`` or ``"goodput"``); ``backfill`` applies to the
    fixed policy. ``autoscaler_kwargs`` override the autoscaler's keyword
    arguments (e.g. ``lr_rule``; not ``policy``, which is this function's
    own argument); they and ``objective`` are checked under every policy.

    ValueError if a job requests more devices than the cluster has under the
    fixed policy (it could never start), or ``gpus`` is not a multiple of
    ``gpus_per_node``.
    """
    wall0 = time.perf_counter()
    if policy not in POLICIES:
        raise ValueError(f"simulate: expected policy one of {POLICIES}, got {policy!r}")
    G = _check_pos_int("gpus", gpus)
    gpn = _check_pos_int("gpus_per_node", gpus_per_node)
    if G % gpn:
        raise ValueError(f"simulate: expected gpus a multiple of gpus_per_node={gpn}, got {G}")
    interval = _check_nonneg("interval", interval, strict=True)
    restart_cost = _check_nonneg("restart_cost", restart_cost)
    if horizon is not None:
        horizon = _check_nonneg("horizon", horizon)
    if backfill not in _BACKFILL:
        raise ValueError(f"simulate: expected backfill one of {_BACKFILL}, got {backfill!r}")
    if not isinstance(oracle_remaining, bool):
        raise TypeError(f"simulate: expected oracle_remaining a bool, got {type(oracle_remaining).__name__}")
    if not isinstance(objective, str) or objective not in _OBJECTIVES:
        raise ValueError(f"simulate: expected objective one of {_OBJECTIVES}, got {objective!r}")
    autoscaler_kwargs = _check_autoscaler_kwargs(policy, autoscaler_kwargs)
    items = _trace_jobs(trace)
    if policy == "fixed":
        for tj in items:
            j = tj.job
            if j.requested_gpus > G:
                raise ValueError(f"simulate: job {tj.name!r} requests {j.requested_gpus} GPUs; expected at most "
                                 f"the cluster's {G} under the fixed policy")
            if not j.goodput(j.requested_gpus, j.default_batch_size, j.default_B, -(-j.requested_gpus // gpn)) > 0:
                raise ValueError(f"simulate: job {tj.name!r} cannot run at its request ({j.requested_gpus} GPUs, "
                                 f"batch {j.default_batch_size}, B {j.default_B}); expected a feasible request")
    scaler = _make_scaler(policy, G, gpn, interval, restart_cost, objective, autoscaler_kwargs)
    sim = _Sim(items, policy, G, gpn, interval, restart_cost, horizon, backfill, oracle_remaining, scaler)
    end = sim.run()
    params = dict(policy=policy, gpus=G, gpus_per_node=gpn, interval=interval, restart_cost=restart_cost,
                  horizon=horizon, objective=objective, backfill=backfill, oracle_remaining=oracle_remaining,
                  autoscaler_kwargs=autoscaler_kwargs)
    res = SimResult(policy=policy, gpus=G, gpus_per_node=gpn, horizon=horizon, end_time=end, jobs=sim.records,
                    timeline=sim.timeline, params=params, solver_seconds=sim.solver_seconds,
                    decisions=sim.decisions, events=sim.events,
                    _internal=dict(issues=dict(sim.issues), max_allocated=sim.max_allocated))
    res.checks = check_result(res, items)
    res.wall_seconds = time.perf_counter() - wall0
    return res


def check_result(result: SimResult, trace: Trace | Sequence[TraceJob] | None = None, *,
                 rtol: float = 1e-6) -> dict:
    """The bookkeeping checks of a simulation (see the module docstring).

    Recomputes what it can from the per-job segments, independently of the
    simulator's running state: capacity at every segment boundary, and each
    finished job's work from its segments (``sum(goodput * productive
    seconds)``) against the trace's work (relative tolerance ``rtol``); with a
    trace also each segment's goodput from the job's model. Returns a dict of
    counts and ``ok`` (True when every count is 0).
    """
    if not isinstance(result, SimResult):
        raise TypeError(f"check_result: expected a SimResult, got {type(result).__name__}")
    issues = dict(result._internal.get("issues", {}))
    out = {k: int(issues.get(k, 0)) for k in ("capacity_exceeded_events", "unknown_allocations",
                                              "zero_goodput_allocations", "policy_violations", "stalled_jobs")}
    out["finished_more_than_once"] = sum(1 for r in result.jobs.values() if r.finishes > 1)
    out["finished_without_time"] = sum(1 for r in result.jobs.values() if (r.finishes > 0) != (r.finish is not None))
    # capacity from segments: +gpus at start, -gpus at end; ends before starts at equal times
    deltas = []
    for r in result.jobs.values():
        for s in r.segments:
            if s.end > s.start:
                deltas.append((s.start, 1, s.gpus))
                deltas.append((s.end, 0, -s.gpus))
    deltas.sort()
    level, peak, over = 0, 0, 0
    for _, _, d in deltas:
        level += d
        peak = max(peak, level)
        if level > result.gpus:
            over += 1
    out["capacity_exceeded_segments"] = over
    out["max_allocated"] = max(peak, int(result._internal.get("max_allocated", 0)))
    items = None if trace is None else {tj.name: tj for tj in _trace_jobs(trace)}
    bad_work, worst, bad_gp, overlap, early = 0, 0.0, 0, 0, 0
    for r in result.jobs.values():
        segs = r.segments
        for a, b in zip(segs, segs[1:]):
            if b.start < a.end - _REL_TOL * max(1.0, a.end):
                overlap += 1
        if segs and segs[0].start < r.arrival - _REL_TOL * max(1.0, r.arrival):
            early += 1
        if items is not None and r.name in items:
            job = items[r.name].job
            for s in segs:
                want = job.goodput(s.gpus, s.batch_size, s.B, -(-s.gpus // result.gpus_per_node))
                if abs(want - s.goodput) > rtol * max(abs(want), 1e-300):
                    bad_gp += 1
        if r.finish is None:
            continue
        w = sum(s.work for s in segs)
        err = abs(w - r.work) / r.work
        worst = max(worst, err)
        if err > rtol:
            bad_work += 1
    out["work_mismatches"] = bad_work
    out["work_max_rel_error"] = worst
    out["goodput_mismatches"] = bad_gp
    out["overlapping_segments"] = overlap
    out["started_before_arrival"] = early
    out["ok"] = all(v == 0 for k, v in out.items() if k not in ("max_allocated", "work_max_rel_error"))
    return out


def compare(trace: Trace | Sequence[TraceJob], policies: Sequence[str] = POLICIES, **kwargs) -> dict[str, SimResult]:
    """:func:`simulate` the same trace under each of ``policies`` (same keyword arguments)."""
    if isinstance(policies, str):
        raise TypeError("compare: expected a sequence of policy names, got a str")
    policies = list(policies)
    for p in policies:      # every name checked before anything runs
        if not isinstance(p, str) or p not in POLICIES:
            raise ValueError(f"compare: expected policies among {POLICIES}, got {p!r}")
    return {p: simulate(trace, p, **kwargs) for p in policies}
