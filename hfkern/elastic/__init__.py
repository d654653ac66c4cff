"""Elastic sweeps on a shared cluster: devices, batch sizes and array sizes allocated across jobs.

* **Models of a job** (:class:`ThroughputModel`, :class:`Efficiency`, :class:`Job`):
  step time as a function of devices, global batch size and the array size B
  (fitted from measured steps, :func:`profile`), and statistical efficiency,
  whose product is the job's goodput (useful samples per second).
* **The allocation optimizer** (:func:`allocate`): devices, batch size and B per
  job, maximizing the cluster's goodput (or the jobs' summed speedups) by
  dynamic programming over jobs and device counts; :func:`allocate_brute_force`
  checks it, :func:`place` assigns device ids on nodes.
* **The autoscaler** (:class:`Autoscaler`): re-solves at arrivals, completions
  and every ``interval`` seconds; a running job is rescaled only where the gain
  pays for its restart; learning rates follow :func:`scale_lr`.
* **Execution** (:class:`Executor`, :class:`TorchrunExecutor`, :class:`JobSpec`,
  :class:`Controller`): jobs run as ``torchrun`` groups with c10d rendezvous and
  checkpoint/resume at a new world size and batch size
  (``python -m hfkern.elastic.worker``); the controller carries out the
  autoscaler's decisions.
* **Simulation** (:func:`generate_trace`, :func:`simulate`, :func:`compare`): a
  seeded trace generator and an event-driven cluster simulator with the fixed,
  GPU-only elastic and hfkern policies side by side (``bench/elastic_sim.py``).
"""

from ._autoscaler import Autoscaler, Decision, scale_lr
from ._controller import Controller, profile
from ._executor import Executor, JobSpec, JobStatus, TorchrunExecutor
from ._model import Efficiency, Job, ThroughputModel
from ._optimizer import Allocation, Solution, allocate, allocate_brute_force, place
from ._simulator import SimResult, check_result, compare, simulate
from ._trace import Trace, TraceJob, generate_trace

__all__ = [
    "Allocation", "Autoscaler", "Controller", "Decision", "Efficiency", "Executor", "Job", "JobSpec", "JobStatus",
    "SimResult", "Solution", "ThroughputModel", "Trace", "TraceJob", "TorchrunExecutor", "allocate",
    "allocate_brute_force", "check_result", "compare", "generate_trace", "place", "profile", "scale_lr", "simulate",
]
