"""The loop that joins the autoscaler's decisions to an executor, and profiling jobs for their models.

:class:`Controller` submits jobs to an :class:`~hfkern.elastic._autoscaler.Autoscaler`
and carries out its decisions through an :class:`~hfkern.elastic._executor.Executor`
(torchrun groups on this host, or another back end): it re-solves when a job
arrives, when the executor reports one finished (or failed), and every
``interval`` seconds, giving the autoscaler each running job's remaining seconds
as measured from its recent steps, so that a job about to end is not restarted.

:func:`profile` measures a job's step time at a few sizes by running it (short
runs of a copy of the job, each in its own directory) and returns the samples
that :meth:`~hfkern.elastic._model.ThroughputModel.fit` takes.
"""

from __future__ import annotations

import dataclasses
import secrets
import statistics
import time
from typing import Callable, Iterable, Sequence

from hfkern.elastic._autoscaler import Autoscaler, Decision
from hfkern.elastic._executor import Executor, JobSpec, JobStatus
from hfkern.elastic._model import Job
from hfkern.elastic._optimizer import Allocation

__all__ = ["Controller", "profile"]

_DONE = ("finished", "failed")


class Controller:
    """Runs jobs on a cluster: ``autoscaler`` decides, ``executor`` carries out.

    Each job is given twice: as the autoscaler's :class:`~hfkern.elastic._model.Job`
    (its performance model and allowed ranges) and as the executor's
    :class:`~hfkern.elastic._executor.JobSpec` (what to run), under one name.
    An executor that restarts a job at a fixed B needs the Job's ``array_sizes``
    to be ``(spec.B,)``, which :meth:`submit` checks.

    ``clock`` gives the autoscaler's time in seconds (monotonic by default).
    ``history`` lists every ``(time, Decision)`` carried out.
    """

    def __init__(self, autoscaler: Autoscaler, executor: Executor, *,
                 clock: Callable[[], float] = time.monotonic):
        if not isinstance(autoscaler, Autoscaler):
            raise TypeError(f"Controller: expected an hfkern.elastic Autoscaler, got {type(autoscaler).__name__}")
        if not isinstance(executor, Executor):
            raise TypeError(f"Controller: expected an hfkern.elastic Executor, got {type(executor).__name__}")
        self.autoscaler, self.executor, self.clock = autoscaler, executor, clock
        self.history: list[tuple[float, Decision]] = []
        self._specs: dict[str, JobSpec] = {}
        self._reported: set[str] = set()

    def submit(self, job: Job, spec: JobSpec) -> list[Decision]:
        """Make ``job`` known to the autoscaler and ``spec`` to the executor; carry out what follows."""
        if not isinstance(job, Job) or not isinstance(spec, JobSpec):
            raise TypeError(f"Controller.submit: expected (Job, JobSpec), got ({type(job).__name__}, "
                            f"{type(spec).__name__})")
        if job.name != spec.name:
            raise ValueError(f"Controller.submit: the Job and the JobSpec must have one name, got {job.name!r} "
                             f"and {spec.name!r}")
        if job.name in self._specs:
            raise ValueError(f"Controller.submit: a job named {job.name!r} was already submitted")
        if tuple(job.array_sizes) != (spec.B,):
            raise ValueError(f"Controller.submit: job {job.name!r} runs {spec.B} trials at a time (spec.B), so its "
                             f"Job.array_sizes must be ({spec.B},), got {tuple(job.array_sizes)}")
        # The learning rate of a launch is spec.lr scaled by the autoscaler from the Job's default
        # batch by its rule: the spec's lr must be that batch's, and its rule the autoscaler's.
        if spec.batch_size != job.default_batch_size:
            raise ValueError(f"Controller.submit: job {job.name!r}'s spec.lr is the learning rate at spec.batch_size="
                             f"{spec.batch_size}, and the autoscaler scales it from the Job's default_batch_size="
                             f"{job.default_batch_size}: make them one")
        if spec.lr_rule != self.autoscaler.lr_rule:
            raise ValueError(f"Controller.submit: job {job.name!r} has lr_rule={spec.lr_rule!r}, the autoscaler "
                             f"scales learning rates by {self.autoscaler.lr_rule!r}: make them one")
        # Every check before any state changes: the autoscaler's (its clock not going back, the name
        # not active there) too, so that a refused job is neither registered nor recorded.
        now = self.autoscaler._check_submit(job, self.clock())
        self.executor.register(spec)
        self._specs[job.name] = spec
        try:
            decisions = self.autoscaler.submit(job, now)
        except BaseException:
            del self._specs[job.name]
            raise
        return self._carry_out(decisions)

    def step(self) -> list[Decision]:
        """One round: report jobs that ended, re-solve when due, carry out the decisions."""
        decisions: list[Decision] = []
        statuses = self.executor.poll()
        for name in self._specs:
            st = statuses.get(name)
            if st is not None and st.state in _DONE and name not in self._reported:
                self._reported.add(name)
                decisions += self._carry_out(self.autoscaler.finish(name, self.clock()))
        remaining = {name: left for name in self.autoscaler.allocations
                     if (left := self.remaining_seconds(name)) is not None}
        decisions += self._carry_out(self.autoscaler.tick(self.clock(), remaining))
        return decisions

    def run(self, *, poll: float = 0.5, timeout: float | None = None) -> dict[str, JobStatus]:
        """:meth:`step` every ``poll`` seconds until every submitted job has finished or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.step()
            statuses = self.executor.poll()
            if all(statuses[n].state in _DONE for n in self._specs):
                return {n: statuses[n] for n in self._specs}
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Controller.run: jobs still running after {timeout} s: "
                                   f"{sorted(n for n in self._specs if statuses[n].state not in _DONE)}")
            time.sleep(poll)

    def remaining_seconds(self, name: str, *, window: int = 8) -> float | None:
        """A running job's seconds to its end at the pace of its last ``window`` steps at the
        current size (None before two such steps, or for a job without a step budget)."""
        spec = self._specs[name]
        st = self.executor.status(name)
        recent = [r for r in self.executor.log(name, last=window) if r.get("generation") == st.generation]
        if len(recent) < 2 or st.batch_size <= 0:
            return None
        per_step = (recent[-1]["time"] - recent[0]["time"]) / (len(recent) - 1)
        if spec.total_steps is not None:
            left = spec.total_steps - st.step
        else:
            left = -(-(spec.total_samples - st.samples) // st.batch_size)
        return max(left, 0) * per_step

    def _carry_out(self, decisions: Sequence[Decision]) -> list[Decision]:
        if decisions:
            now = self.clock()
            live = [d for d in decisions if d.job not in self._reported]
            self.executor.apply_all(live)
            self.history += [(now, d) for d in live]
        return list(decisions)


def profile(executor: Executor, spec: JobSpec, sizes: Iterable[tuple[int, int]], *, steps: int = 8,
            warmup: int = 2, timeout: float = 120.0) -> list[tuple[int, int, int, int, float]]:
    """Measure ``spec``'s step time at each ``(gpus, batch_size)`` of ``sizes``.

    Each size runs a copy of the job named ``{spec.name}-profile-{token}-{i}`` (a new
    token per call) for ``warmup + steps`` steps from scratch (its own directory and
    checkpoint: a second call measures again, never reads back the first's); the
    median time between its logged steps after the warm-up is its step time.
    Returns ``(gpus, batch_size, B, nodes, seconds)`` samples for
    :meth:`hfkern.elastic._model.ThroughputModel.fit` (one node: the executor's host).
    """
    sizes = list(sizes)
    if not sizes:
        raise ValueError("profile: expected at least one (gpus, batch_size) size, got none")
    if steps < 2 or warmup < 1:
        raise ValueError(f"profile: expected steps >= 2 and warmup >= 1, got steps={steps}, warmup={warmup}")
    for size in sizes:  # all checked before any runs
        if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in size):
            raise ValueError(f"profile: expected sizes as (gpus, batch_size) positive ints, got {size!r}")
    samples = []
    token = secrets.token_hex(4)
    for i, (gpus, batch) in enumerate(sizes):
        copy = dataclasses.replace(spec, name=f"{spec.name}-profile-{token}-{i}", total_steps=warmup + steps,
                                   total_samples=None, checkpoint_dir=None, min_step_seconds=0.0)
        executor.launch(copy, Allocation(gpus=gpus, batch_size=batch, B=spec.B, goodput=0.0))
        status = executor.wait(copy.name, timeout=timeout)
        if status.state != "finished":
            raise RuntimeError(f"profile: the run of {spec.name!r} at {gpus} workers, batch {batch} ended "
                               f"{status.state}: {status.message}")
        times = [r["time"] for r in executor.log(copy.name)][warmup - 1:]
        samples.append((gpus, batch, spec.B, 1, statistics.median(b - a for a, b in zip(times, times[1:]))))
    return samples

