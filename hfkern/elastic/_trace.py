"""Seeded synthetic job traces for the elastic-cluster simulator.

A trace is a list of jobs, each with an arrival time, a :class:`~hfkern.elastic._model.Job`
(throughput model, statistical efficiency, allowed batch sizes and array sizes,
requested GPU count) and an amount of *work*. Nothing is downloaded: the
generator draws every quantity from small parametric distributions whose shapes
follow what production deep-learning cluster studies published. All numbers
below are rounded, stylized approximations chosen by us, not values copied from
those papers; they are meant to have the right *relative* sizes (which jobs are
common, which are long, which scale well), not to reproduce any one cluster.

How a trace is drawn
--------------------
1. **Arrivals** form a Poisson process: inter-arrival times are exponential with
   rate ``rate`` jobs per second. Instead of a rate one may give a target
   *offered load* ``load`` (1.0 = the jobs' requested GPU-seconds arrive exactly
   as fast as a cluster of ``cluster_gpus`` can serve them). With
   ``load_basis="realized"`` (default) the rate is set from the jobs actually
   drawn, so that the trace's requested GPU-seconds divided by
   ``cluster_gpus`` times its arrival span equals ``load`` exactly
   (:meth:`Trace.offered_load`); with ``load_basis="expected"`` it is
   ``load * cluster_gpus / E[requested_gpus * duration]``, the expectation in
   closed form (:func:`expected_gpu_seconds`). The realized basis matters for
   traces of a few hundred jobs: a handful of rare 16-32 GPU jobs carries a
   third of the expected GPU time, so the realized load of one seeded trace can
   be far from the expected one.
2. **Requested GPUs** follow :data:`GPU_REQUEST_DIST`, our rounding of the
   distribution reported for Microsoft's Philly cluster (Jeon et al., "Analysis
   of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads",
   USENIX ATC 2019): most jobs ask for one GPU, a minority for 2-8, few for 16
   or more. Requests are capped at ``max_request`` (by default the cluster size).
3. **Workload archetype** is drawn conditionally on the request size class
   (:data:`ARCHETYPE_MIX`): one-GPU jobs are mostly small CNNs, hyper-parameter
   sweeps of small models and fine-tuning runs; large requests are mostly
   ResNet-50-like, BERT-like and language-model pre-training.
4. **Duration** -- the run time the job would have at its requested GPU count,
   its default batch size and default array size -- is log-normal, with a
   median that grows with the request size class (:data:`DURATION_MEDIAN_S`)
   and a log-standard deviation :data:`DURATION_SIGMA`, clipped to
   ``[min_duration, max_duration]``. Published traces (Philly; also Hu et al.,
   "Characterization and Prediction of Deep Learning Workloads in Large-Scale
   GPU Datacenters", SC 2021) show run times spanning minutes to days with
   medians of minutes to hours and a heavy tail; a log-normal with
   sigma = 1.5 gives a 90th percentile about 7x and a 99th percentile about 33x
   the median.
5. **Work** is ``duration * goodput(requested_gpus, default batch, default B)``:
   the amount of useful (efficiency-weighted) samples the job must process. A
   policy that runs the job faster than its request finishes it sooner.

Throughput models
-----------------
Each archetype's :class:`~hfkern.elastic._model.ThroughputModel` is set for a
V100-class GPU in mixed precision and an inter-node network of tens of Gb/s:
``beta_grad`` (seconds per sample per GPU) from commonly quoted training
throughputs (thousands of CIFAR images/s for a ResNet-18, about a thousand
ImageNet images/s for a ResNet-50, hundreds of 128-token sequences/s for
BERT-base, ten-odd 1024-token sequences/s for a GPT-2-medium-sized model);
``alpha_grad`` (per-step fixed cost: kernel launches, optimizer step, data
loading latency) from a few milliseconds for tiny models to tens of
milliseconds for large ones; ``alpha_sync``/``beta_sync``/``alpha_net`` from
the gradient size (parameters x 4 bytes) over NVLink/PCIe inside a node and over
the network across nodes. Each job's parameters are the archetype's multiplied
by log-normal factors (sigma 0.15 for compute, 0.2 for communication) so that
no two jobs are identical.

Statistical efficiency
----------------------
Each job's :class:`~hfkern.elastic._model.Efficiency` has base batch size = its
default batch size (the batch its learning rate was tuned for, as in Pollux)
and a gradient noise scale of the order McCandlish et al. ("An Empirical Model
of Large-Batch Training", 2018) measured for comparable tasks: about 10^3
samples for CIFAR-10-sized image tasks, several 10^3 for ImageNet, 10^3 for
BERT-style sequences, a few hundred 1024-token sequences for language models
early in training, and a few hundred for MNIST-sized tasks; multiplied per job
by a log-normal factor (sigma 0.5). The noise scale grows during real
training; one constant per job is a simplification.

Reproducibility
---------------
Two independent random streams are derived from ``seed``: one for the jobs
(request, archetype, duration, parameters) and one for the unit-rate arrival
process. The same seed at different loads therefore gives the *same jobs* with
arrival times scaled by ``1 / rate`` (common random numbers across loads).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterator, Mapping, Sequence

import numpy as np

from hfkern.elastic._model import Efficiency, Job, ThroughputModel

__all__ = [
    "Archetype",
    "ARCHETYPES",
    "ARCHETYPE_MIX",
    "GPU_REQUEST_DIST",
    "DURATION_MEDIAN_S",
    "DURATION_SIGMA",
    "TraceJob",
    "Trace",
    "generate_trace",
    "expected_gpu_seconds",
    "rate_for_load",
    "size_class",
]


@dataclasses.dataclass(frozen=True)
class Archetype:
    """A workload family: throughput model, memory limit, batch and array ranges.

    ``per_gpu_batch`` is the per-GPU batch a user would pick: a single training
    job requesting ``g`` GPUs gets default batch ``per_gpu_batch * g`` (clipped
    to the allowed range); a sweep (more than one allowed array size) keeps
    ``per_gpu_batch`` per trial and gets as default array size the largest
    allowed B that fits ``max_local_batch`` at ``g`` GPUs. ``batch_range`` bounds the allowed global
    batch sizes (powers of two inside it). ``noise_scale`` is the median
    gradient noise scale in samples.
    """

    name: str
    model: ThroughputModel
    per_gpu_batch: int
    batch_range: tuple[int, int]
    max_local_batch: int | None
    noise_scale: float
    array_sizes: tuple[int, ...] = (1,)
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.model, ThroughputModel):
            raise TypeError(f"Archetype.model: expected a ThroughputModel, got {type(self.model).__name__}")
        lo, hi = self.batch_range
        if not (1 <= lo <= hi):
            raise ValueError(f"Archetype.batch_range: expected 1 <= lo <= hi, got {self.batch_range}")
        if self.per_gpu_batch < 1:
            raise ValueError(f"Archetype.per_gpu_batch: expected >= 1, got {self.per_gpu_batch}")
        if self.noise_scale <= 0:
            raise ValueError(f"Archetype.noise_scale: expected > 0, got {self.noise_scale}")
        if not self.array_sizes or min(self.array_sizes) < 1:
            raise ValueError(f"Archetype.array_sizes: expected positive integers, got {self.array_sizes}")

    def batch_sizes(self) -> tuple[int, ...]:
        """Powers of two inside ``batch_range`` (ascending)."""
        lo, hi = self.batch_range
        out = []
        b = 1
        while b <= hi:
            if b >= lo:
                out.append(b)
            b *= 2
        return tuple(out)


# V100-class GPU, mixed precision; tens of Gb/s between nodes. Seconds.
ARCHETYPES: dict[str, Archetype] = {
    a.name: a
    for a in (
        Archetype(
            "small_cnn",
            ThroughputModel(alpha_grad=0.008, beta_grad=0.00012, alpha_sync=0.004, beta_sync=0.0004,
                            alpha_net=0.012, gamma=1.5),
            per_gpu_batch=128, batch_range=(32, 4096), max_local_batch=2048, noise_scale=1000.0,
            description="ResNet-18 on CIFAR-10-sized images (~11M parameters, ~8k images/s per GPU)"),
        Archetype(
            "resnet50",
            ThroughputModel(alpha_grad=0.02, beta_grad=0.0009, alpha_sync=0.015, beta_sync=0.002,
                            alpha_net=0.06, gamma=2.0),
            per_gpu_batch=64, batch_range=(32, 8192), max_local_batch=256, noise_scale=6000.0,
            description="ResNet-50 on ImageNet (~25M parameters, ~1.1k images/s per GPU)"),
        Archetype(
            "bert",
            ThroughputModel(alpha_grad=0.03, beta_grad=0.0025, alpha_sync=0.05, beta_sync=0.004,
                            alpha_net=0.2, gamma=1.5),
            per_gpu_batch=32, batch_range=(16, 8192), max_local_batch=64, noise_scale=1500.0,
            description="BERT-base, 128-token sequences (~110M parameters, ~400 sequences/s per GPU)"),
        Archetype(
            "lm",
            ThroughputModel(alpha_grad=0.05, beta_grad=0.07, alpha_sync=0.15, beta_sync=0.012,
                            alpha_net=0.6, gamma=1.5),
            per_gpu_batch=4, batch_range=(4, 1024), max_local_batch=8, noise_scale=400.0,
            description="GPT-2-medium-sized LM, 1024-token sequences (~350M parameters, ~14 sequences/s per GPU)"),
        Archetype(
            "sweep_mlp",
            ThroughputModel(alpha_grad=0.004, beta_grad=0.000004, alpha_sync=0.002, beta_sync=0.0002,
                            alpha_net=0.004, gamma=1.0),
            per_gpu_batch=128, batch_range=(16, 2048), max_local_batch=None, noise_scale=300.0,
            array_sizes=(1, 2, 4, 8, 16),
            description="sweep of B trials of an MLP on MNIST-sized data; launch-overhead bound, so"
                        " fusing trials (larger B) raises samples/s almost linearly"),
        Archetype(
            "sweep_cnn",
            ThroughputModel(alpha_grad=0.008, beta_grad=0.00012, alpha_sync=0.004, beta_sync=0.0004,
                            alpha_net=0.012, gamma=1.5),
            per_gpu_batch=128, batch_range=(32, 2048), max_local_batch=1024, noise_scale=1000.0,
            array_sizes=(1, 2, 4, 8, 16),
            description="sweep of B trials of a small CNN; memory-bound: B=16 at batch 128 needs 2 GPUs"),
    )
}

#: Requested GPU count -> probability. Our rounding of the Philly distribution
#: (Jeon et al., ATC'19): approximate, not the published numbers.
GPU_REQUEST_DIST: dict[int, float] = {1: 0.70, 2: 0.10, 4: 0.09, 8: 0.07, 16: 0.03, 32: 0.01}

#: Archetype mixture per request size class ("1", "2-4", "8", "16+").
ARCHETYPE_MIX: dict[str, dict[str, float]] = {
    "1": {"small_cnn": 0.30, "sweep_mlp": 0.20, "sweep_cnn": 0.10, "bert": 0.20, "resnet50": 0.15, "lm": 0.05},
    "2-4": {"resnet50": 0.30, "bert": 0.25, "lm": 0.15, "small_cnn": 0.10, "sweep_cnn": 0.20},
    "8": {"resnet50": 0.35, "bert": 0.30, "lm": 0.35},
    "16+": {"resnet50": 0.40, "bert": 0.20, "lm": 0.40},
}

#: Median duration (seconds, at the requested allocation) per size class.
DURATION_MEDIAN_S: dict[str, float] = {"1": 15 * 60.0, "2-4": 40 * 60.0, "8": 90 * 60.0, "16+": 180 * 60.0}
#: Log-standard deviation of the log-normal duration.
DURATION_SIGMA: float = 1.5

_COMPUTE_SIGMA = 0.15
_COMM_SIGMA = 0.2
_NOISE_SIGMA = 0.5


def size_class(gpus: int) -> str:
    """The request size class of ``gpus``: "1", "2-4", "8" or "16+"."""
    if isinstance(gpus, bool) or not isinstance(gpus, (int, np.integer)):
        raise TypeError(f"size_class: expected an int GPU count, got {type(gpus).__name__}")
    if gpus < 1:
        raise ValueError(f"size_class: expected a GPU count >= 1, got {gpus}")
    if gpus == 1:
        return "1"
    if gpus <= 4:
        return "2-4"
    if gpus <= 8:
        return "8"
    return "16+"


@dataclasses.dataclass(frozen=True)
class TraceJob:
    """One job of a trace: when it arrives, what it is and how much work it has.

    ``duration`` is its run time at ``job.requested_gpus``, its default batch
    size and default B (what the fixed policy gives it), and ``work`` =
    ``duration * job.goodput(requested_gpus, default batch, default B, nodes)``,
    in efficiency-weighted samples.
    """

    arrival: float
    job: Job
    work: float
    duration: float
    archetype: str

    @property
    def name(self) -> str:
        return self.job.name


@dataclasses.dataclass(frozen=True)
class Trace:
    """A generated trace: the jobs in arrival order plus how they were drawn."""

    jobs: tuple[TraceJob, ...]
    seed: int
    rate: float                 # jobs per second
    gpus_per_node: int
    params: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[TraceJob]:
        return iter(self.jobs)

    def __getitem__(self, i: int) -> TraceJob:
        return self.jobs[i]

    @property
    def span(self) -> float:
        """Time of the last arrival (seconds)."""
        return self.jobs[-1].arrival if self.jobs else 0.0

    def requested_gpu_seconds(self) -> float:
        """Sum over jobs of requested GPUs x duration."""
        return float(sum(tj.job.requested_gpus * tj.duration for tj in self.jobs))

    def offered_load(self, cluster_gpus: int) -> float:
        """Realized offered load: requested GPU-seconds / (cluster GPUs x arrival span)."""
        if cluster_gpus < 1:
            raise ValueError(f"offered_load: expected cluster_gpus >= 1, got {cluster_gpus}")
        if self.span <= 0:
            return float("inf") if self.jobs else 0.0
        return self.requested_gpu_seconds() / (cluster_gpus * self.span)

    def summary(self) -> dict:
        """Counts per archetype and per request size, duration quantiles (seconds)."""
        d = np.array([tj.duration for tj in self.jobs]) if self.jobs else np.zeros(0)
        arch: dict[str, int] = {}
        req: dict[int, int] = {}
        for tj in self.jobs:
            arch[tj.archetype] = arch.get(tj.archetype, 0) + 1
            req[tj.job.requested_gpus] = req.get(tj.job.requested_gpus, 0) + 1
        q = (lambda p: float(np.quantile(d, p))) if d.size else (lambda p: float("nan"))
        return dict(jobs=len(self.jobs), rate_per_hour=self.rate * 3600.0, span_s=self.span,
                    archetypes=dict(sorted(arch.items())), requested_gpus=dict(sorted(req.items())),
                    duration_s=dict(p10=q(0.1), median=q(0.5), mean=float(d.mean()) if d.size else float("nan"),
                                    p90=q(0.9), p99=q(0.99), max=float(d.max()) if d.size else float("nan")),
                    requested_gpu_hours=self.requested_gpu_seconds() / 3600.0)


def _check_dist(dist: Mapping, what: str) -> None:
    if not isinstance(dist, Mapping) or not dist:
        raise TypeError(f"{what}: expected a non-empty mapping, got {type(dist).__name__}")
    total = 0.0
    for k, p in dist.items():
        if isinstance(p, bool) or not isinstance(p, numbers.Real):
            raise TypeError(f"{what}: expected non-negative probabilities (real numbers), got {k!r}: "
                            f"{type(p).__name__} {p!r}")
        if not (math.isfinite(p) and p >= 0):
            raise ValueError(f"{what}: expected finite non-negative probabilities, got {k!r}: {p!r}")
        total += float(p)
    if not total > 0:
        raise ValueError(f"{what}: expected probabilities with a positive sum, got sum {total}")
    if not math.isfinite(total):
        raise ValueError(f"{what}: expected probabilities with a finite sum, got sum {total}")


def _check_int_arg(where: str, name: str, v, minimum: int = 1) -> int:
    """``v`` as a Python int (numpy integers accepted): TypeError if not an int, ValueError if below ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{where}: expected {name} an int >= {minimum}, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{where}: expected {name} an int >= {minimum}, got {v!r}")
    return int(v)


def _check_positive(where: str, name: str, v) -> float:
    """``v`` as a finite float > 0 (numpy numbers accepted): TypeError if not a real number,
    ValueError if not finite or not > 0."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}: expected {name} a number, got {type(v).__name__} {v!r}")
    v = float(v)
    if not 0 < v < math.inf:
        raise ValueError(f"{where}: expected a finite {name} > 0, got {v!r}")
    return v


def _check_durations(where: str, duration_scale, min_duration, max_duration) -> tuple[float, float, float]:
    """Checked ``(duration_scale, min_duration, max_duration)``: the first two finite and > 0, the
    last >= ``min_duration`` and possibly ``inf`` (no upper clip)."""
    for nm, v in (("min_duration", min_duration), ("max_duration", max_duration), ("duration_scale", duration_scale)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{where}: expected {nm} a number, got {type(v).__name__} {v!r}")
    if not (0 < min_duration <= max_duration) or not math.isfinite(min_duration):
        raise ValueError(f"{where}: expected 0 < min_duration <= max_duration with min_duration finite "
                         f"(max_duration may be inf), got {min_duration!r}, {max_duration!r}")
    duration_scale = _check_positive(where, "duration_scale", duration_scale)
    return duration_scale, float(min_duration), float(max_duration)


def _lognormal_clipped_mean(median: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for X log-normal with the given median and log-sigma."""
    mu = math.log(median)

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    if sigma == 0:
        return min(max(median, lo), hi)
    a = (math.log(lo) - mu) / sigma
    b = (math.log(hi) - mu) / sigma
    # E[X; lo < X < hi] = e^{mu + s^2/2} (Phi(b - s) - Phi(a - s))
    mid = math.exp(mu + sigma * sigma / 2.0) * (phi(b - sigma) - phi(a - sigma))
    # hi = inf (no upper clip): the clipped tail carries no mass (and inf * 0 would be NaN)
    top = 0.0 if hi == math.inf else hi * (1.0 - phi(b))
    return lo * phi(a) + mid + top


def _capped_request_dist(dist: Mapping[int, float], max_request: int) -> dict[int, float]:
    out: dict[int, float] = {}
    total = float(sum(dist.values()))
    for g, p in dist.items():
        gg = min(int(g), max_request)
        out[gg] = out.get(gg, 0.0) + float(p) / total
    return out


def expected_gpu_seconds(*, max_request: int | None = None, gpu_request_dist: Mapping[int, float] | None = None,
                         duration_scale: float = 1.0, min_duration: float = 60.0,
                         max_duration: float = 2 * 86400.0) -> float:
    """E[requested_gpus x duration] of one job, in GPU-seconds (closed form).

    Uses the same distributions, cap and clipping as :func:`generate_trace`
    (``max_duration=inf``: no upper clip).
    """
    w = "expected_gpu_seconds"
    duration_scale, min_duration, max_duration = _check_durations(w, duration_scale, min_duration, max_duration)
    max_request = 1 << 30 if max_request is None else _check_int_arg(w, "max_request", max_request)
    req_dist = GPU_REQUEST_DIST if gpu_request_dist is None else gpu_request_dist
    _check_dist(req_dist, "gpu_request_dist")
    for g in req_dist:
        _check_request_key(g)
    dist = _capped_request_dist(req_dist, max_request)
    total = 0.0
    for g, p in dist.items():
        med = DURATION_MEDIAN_S[size_class(g)] * duration_scale
        total += p * g * _lognormal_clipped_mean(med, DURATION_SIGMA, min_duration, max_duration)
    return total


def rate_for_load(load: float, cluster_gpus: int, **kwargs) -> float:
    """Arrival rate (jobs/s) whose expected offered load on ``cluster_gpus`` is ``load``.

    ``kwargs`` are passed to :func:`expected_gpu_seconds`; ``max_request``
    defaults to ``cluster_gpus``.
    """
    load = _check_positive("rate_for_load", "load", load)
    cluster_gpus = _check_int_arg("rate_for_load", "cluster_gpus", cluster_gpus)
    kwargs.setdefault("max_request", cluster_gpus)
    return load * cluster_gpus / expected_gpu_seconds(**kwargs)


def _check_request_key(g) -> None:
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
        raise ValueError(f"gpu_request_dist: expected int GPU counts >= 1 as keys, got {g!r}")


def _pick(rng: np.random.Generator, dist: Mapping, keys: Sequence | None = None):
    keys = list(dist.keys()) if keys is None else list(keys)
    p = np.array([float(dist[k]) for k in keys])
    return keys[int(rng.choice(len(keys), p=p / p.sum()))]


def _make_job(name: str, arch: Archetype, gpus: int, rng: np.random.Generator, default_batch_mode: str) -> Job:
    m = arch.model
    c = np.exp(rng.normal(0.0, _COMPUTE_SIGMA, size=2))
    s = np.exp(rng.normal(0.0, _COMM_SIGMA, size=3))
    model = ThroughputModel(alpha_grad=m.alpha_grad * c[0], beta_grad=m.beta_grad * c[1],
                            alpha_sync=m.alpha_sync * s[0], beta_sync=m.beta_sync * s[1],
                            alpha_net=m.alpha_net * s[2], gamma=m.gamma)
    batch_sizes = arch.batch_sizes()
    # A single training job scales its batch with its devices; a sweep keeps each trial's batch
    # and uses more devices for more trials in flight.
    per_gpu = arch.per_gpu_batch
    if default_batch_mode == "memory" and arch.max_local_batch is not None and len(arch.array_sizes) == 1:
        per_gpu = arch.max_local_batch
    per_trial = arch.per_gpu_batch if len(arch.array_sizes) > 1 else per_gpu * gpus
    # The allowed batch size at or below it (a request of 24 GPUs scales to no power of two),
    # and a memory-bound archetype's must fit its request at B = 1.
    limit = per_trial if arch.max_local_batch is None else min(per_trial, arch.max_local_batch * gpus)
    default_batch = max([b for b in batch_sizes if b <= limit], default=batch_sizes[0])
    fits = [b for b in arch.array_sizes
            if arch.max_local_batch is None or b * default_batch <= arch.max_local_batch * gpus]
    default_B = max(fits) if fits else min(arch.array_sizes)
    noise = arch.noise_scale * float(np.exp(rng.normal(0.0, _NOISE_SIGMA)))
    return Job(name=name, model=model,
               efficiency=Efficiency(base_batch_size=int(default_batch), noise_scale=noise),
               batch_sizes=batch_sizes, array_sizes=tuple(arch.array_sizes),
               max_local_batch=arch.max_local_batch, default_batch_size=int(default_batch),
               default_B=int(default_B), requested_gpus=int(gpus))


def generate_trace(num_jobs: int, *, seed: int = 0, rate: float | None = None, load: float | None = None,
                   cluster_gpus: int = 64, gpus_per_node: int = 8, max_request: int | None = None,
                   duration_scale: float = 1.0, min_duration: float = 60.0, max_duration: float = 2 * 86400.0,
                   gpu_request_dist: Mapping[int, float] | None = None,
                   archetype_mix: Mapping[str, Mapping[str, float]] | None = None,
                   archetypes: Mapping[str, Archetype] | None = None,
                   load_basis: str = "realized", default_batch: str = "typical") -> Trace:
    """Draw a trace of ``num_jobs`` jobs (see the module docstring for the model).

    Exactly one of ``rate`` (jobs per second) and ``load`` (target offered load
    on ``cluster_gpus`` GPUs) must be given. ``max_request`` caps requested
    GPUs (default: ``cluster_gpus``). ``duration_scale`` multiplies every
    median duration (to shrink a trace for tests); durations are clipped to
    ``[min_duration, max_duration]`` (``max_duration=math.inf``: no upper clip).
    ``gpus_per_node`` sets how
    many nodes a request spans when its work is computed. Jobs are named
    ``"<archetype>-<index>"`` with a zero-padded index in arrival order.
    ``load_basis`` ("realized" or "expected") says how ``load`` sets the rate.
    ``default_batch``: ``"typical"`` gives single training jobs a default batch
    of ``per_gpu_batch`` per requested GPU; ``"memory"`` gives them the largest
    per-GPU batch that fits (``max_local_batch``), as users who fill the GPU
    memory do -- then a job with fixed batch size cannot run on fewer devices
    than it requested, which is the case least favourable to GPU-only
    elasticity.
    """
    if isinstance(num_jobs, bool) or not isinstance(num_jobs, (int, np.integer)):
        raise TypeError(f"generate_trace: expected num_jobs an int, got {type(num_jobs).__name__}")
    if num_jobs < 0:
        raise ValueError(f"generate_trace: expected num_jobs >= 0, got {num_jobs}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"generate_trace: expected seed a non-negative int, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"generate_trace: expected seed a non-negative int, got {seed!r}")
    if (rate is None) == (load is None):
        raise ValueError(f"generate_trace: expected exactly one of rate and load, got rate={rate!r}, load={load!r}")
    if rate is not None:
        rate = _check_positive("generate_trace", "rate", rate)
    else:
        load = _check_positive("generate_trace", "load", load)
    cluster_gpus = _check_int_arg("generate_trace", "cluster_gpus", cluster_gpus)
    gpus_per_node = _check_int_arg("generate_trace", "gpus_per_node", gpus_per_node)
    max_request = cluster_gpus if max_request is None else _check_int_arg("generate_trace", "max_request", max_request)
    duration_scale, min_duration, max_duration = _check_durations("generate_trace", duration_scale, min_duration,
                                                                  max_duration)
    req_dist = GPU_REQUEST_DIST if gpu_request_dist is None else gpu_request_dist
    _check_dist(req_dist, "gpu_request_dist")
    for g in req_dist:
        _check_request_key(g)
    mix = ARCHETYPE_MIX if archetype_mix is None else archetype_mix
    archs = ARCHETYPES if archetypes is None else archetypes
    for cls_name, dist in mix.items():
        _check_dist(dist, f"archetype_mix[{cls_name!r}]")
        for a in dist:
            if a not in archs:
                raise ValueError(f"archetype_mix[{cls_name!r}]: expected archetypes among {sorted(archs)}, got {a!r}")
    if default_batch not in ("typical", "memory"):
        raise ValueError(f"generate_trace: expected default_batch 'typical' or 'memory', got {default_batch!r}")
    if load_basis not in ("realized", "expected"):
        raise ValueError(f"generate_trace: expected load_basis 'realized' or 'expected', got {load_basis!r}")
    if rate is None:
        rate = rate_for_load(load, cluster_gpus, max_request=max_request, gpu_request_dist=req_dist,
                             duration_scale=duration_scale, min_duration=min_duration, max_duration=max_duration)

    job_rng = np.random.default_rng([int(seed), 0])
    arr_rng = np.random.default_rng([int(seed), 1])
    unit_arrivals = np.cumsum(arr_rng.exponential(1.0, size=num_jobs))   # a unit-rate Poisson process
    capped = _capped_request_dist(req_dist, max_request)
    width = max(4, len(str(max(num_jobs - 1, 0))))
    jobs = []
    for i in range(num_jobs):
        gpus = int(_pick(job_rng, capped))
        cls_name = size_class(gpus)
        if cls_name not in mix:
            raise ValueError(f"archetype_mix: expected an entry for size class {cls_name!r}, got {sorted(mix)}")
        arch = archs[_pick(job_rng, mix[cls_name])]
        med = DURATION_MEDIAN_S[cls_name] * duration_scale
        duration = float(np.clip(med * math.exp(DURATION_SIGMA * job_rng.normal()), min_duration, max_duration))
        job = _make_job(f"{arch.name}-{i:0{width}d}", arch, gpus, job_rng, default_batch)
        nodes = -(-gpus // gpus_per_node)
        gp = job.goodput(gpus, job.default_batch_size, job.default_B, nodes)
        if not gp > 0:
            raise ValueError(f"generate_trace: archetype {arch.name!r} is infeasible at its request of {gpus} GPUs "
                             f"(batch {job.default_batch_size}, B {job.default_B}); got goodput {gp!r}")
        jobs.append((job, duration * gp, duration, arch.name))
    if load is not None and load_basis == "realized" and num_jobs > 0:
        gpu_seconds = sum(j.requested_gpus * d for j, _, d, _ in jobs)
        rate = load * cluster_gpus * float(unit_arrivals[-1]) / gpu_seconds
    arrivals = unit_arrivals / rate
    jobs = [TraceJob(arrival=float(a), job=j, work=w, duration=d, archetype=n)
            for a, (j, w, d, n) in zip(arrivals, jobs)]
    params = dict(num_jobs=int(num_jobs), load=load, load_basis=load_basis, default_batch=default_batch,
                  rate_per_s=rate, cluster_gpus=cluster_gpus,
                  gpus_per_node=gpus_per_node, max_request=max_request, duration_scale=duration_scale,
                  min_duration=min_duration, max_duration=max_duration,
                  gpu_request_dist={int(k): float(v) for k, v in req_dist.items()})
    return Trace(jobs=tuple(jobs), seed=int(seed), rate=rate, gpus_per_node=gpus_per_node, params=params)
