"""Carrying out an autoscaler's decisions on real processes.

:class:`Executor` is the interface: an autoscaler (``hfkern.elastic._autoscaler``)
decides how many devices, which global batch size and which learning-rate
factor each job gets, and an executor makes running jobs match -- starting,
rescaling (checkpoint, stop, relaunch at the new size) and stopping them --
and reports their progress. :class:`TorchrunExecutor` is the local back end:
one ``torchrun`` elastic group (c10d rendezvous) per job on this machine,
each worker a process running :mod:`hfkern.elastic.worker`. :class:`JobSpec`
says what a job trains; it is all a worker needs besides the launch's size.

How a rescale is carried out (TorchrunExecutor)
    1. The executor writes ``control.json`` (naming the running generation)
       into the job's directory.
    2. Rank 0 of the running group sees it before its next step's all-reduce
       and adds a stop flag to that reduction, so every rank stops after the
       same step. Rank 0 writes the checkpoint (model, optimizer, step,
       samples consumed) to a temporary file, renames it into place, writes
       ``state.json`` ("stopped") and all workers exit with status 0.
    3. When torchrun has exited, the executor relaunches the job as a new
       generation (a new rendezvous id and port) with the new number of
       workers, the new global batch size and the learning rate multiplied by
       the decision's ``lr_scale``. The workers resume from the checkpoint
       and continue the job's sample stream where it stopped (the data-order
       rule in :mod:`hfkern.elastic.worker`).
    A stop is steps 1-2 without the relaunch. A job that reaches its end
    before it sees the request simply finishes; the pending rescale is
    dropped.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import numbers
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from typing import Any, Iterable, Mapping

from hfkern.elastic._autoscaler import scale_lr

__all__ = ["Executor", "JobSpec", "JobStatus", "TorchrunExecutor", "STATES", "check_model"]

LR_RULES = ("linear", "sqrt", "none")
_RECENT = 64   # step records an executor keeps of each job, for log(name, last=...)
OPTIMIZERS = ("sgd", "adam", "adamw")
LOSSES = ("cross_entropy", "mse")
DATASETS = ("digits", "classification", "regression")
STATES = ("pending", "running", "rescaling", "stopping", "stopped", "finished", "failed")
_ACTIVE = ("running", "rescaling", "stopping")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _int(where: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: expected {name} to be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{where}: expected {name} >= {minimum}, got {value}")
    return int(value)


def _positive_float(where: str, name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: expected {name} to be a number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where}: expected {name} to be a finite number {'>=' if allow_zero else '>'} 0, "
                         f"got {value}")
    return value


def _choice(where: str, name: str, value: Any, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{where}: expected {name} to be one of {options}, got {value!r}")
    return value


def _mapping(where: str, name: str, value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: expected {name} to be a mapping, got {type(value).__name__}")
    out = dict(value)
    for k in out:
        if not isinstance(k, str):
            raise TypeError(f"{where}: expected the keys of {name} to be str, got {k!r}")
    try:
        json.dumps(out)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: expected {name} to hold JSON values (it is written to the job "
                        f"directory), got {out!r}: {e}") from None
    return out


def _keyword_names(fn: Any, skip: tuple[str, ...] = ()) -> list[str] | None:
    """The keyword arguments ``fn`` takes (its signature's named parameters, less ``skip``), or
    None where it takes any (``**kwargs``) or has no signature to read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.name not in skip
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def _check_optimizer_kwargs(where: str, optimizer: str, kwargs: Mapping[str, Any]) -> None:
    """ValueError for an option the optimizer's class does not take (the worker passes
    ``optimizer_kwargs`` to it as keyword arguments, with ``params`` and ``lr``)."""
    from hfkern.elastic.worker import optimizer_class

    cls = optimizer_class(optimizer)
    names = _keyword_names(cls, skip=("self", "params", "lr"))
    if names is None:
        return
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise ValueError(f"{where}: expected optimizer_kwargs among the options of torch.optim.{cls.__name__} "
                         f"({optimizer!r}): {names}; got unknown {unknown}")


def _check_dataset_kwargs(where: str, dataset: str, kwargs: Mapping[str, Any]) -> None:
    """What :func:`hfkern.elastic.worker.load_dataset` would refuse, without building the data."""
    from hfkern.elastic.worker import dataset_options

    try:
        dataset_options(dataset, **kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: dataset_kwargs {dict(kwargs)!r} do not fit the data set {dataset!r}: "
                      f"{e}") from None


@contextlib.contextmanager
def _extra_sys_path(paths: Iterable[str]):
    added = [p for p in paths if p and p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            try:
                sys.path.remove(p)
            except ValueError:
                pass


def check_model(spec: JobSpec, *, paths: Iterable[str] = (), where: str = "JobSpec") -> None:
    """Import ``spec.model`` and bind ``spec.model_kwargs`` to its signature, as the worker will
    call it: ValueError for a factory that cannot be imported or an option it does not take,
    TypeError for one that is not callable or lacks a required argument. ``paths`` are extra
    import directories (the launches' ``PYTHONPATH``). Importing runs the factory's module in
    this process; executors call this at ``register`` (the worker would fail the same way)."""
    module_name, _, attr = spec.model.partition(":")
    with _extra_sys_path(paths):
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - any import failure would stop the worker too
            raise ValueError(f"{where}: expected model to be an importable factory 'module:function', "
                             f"got {spec.model!r}: importing {module_name!r} failed "
                             f"({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: expected model to be an importable factory 'module:function', "
                             f"got {spec.model!r}: {getattr(obj, '__name__', obj)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{where}: expected model {spec.model!r} to be callable (a factory of torch "
                        f"modules), got {type(obj).__name__}")
    names = _keyword_names(obj)
    if names is not None:
        unknown = sorted(set(spec.model_kwargs) - set(names))
        if unknown:
            raise ValueError(f"{where}: expected model_kwargs among the arguments of {spec.model}: {names}; "
                             f"got unknown {unknown}")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return   # no signature to read (a builtin): the call will tell
    try:
        sig.bind(**spec.model_kwargs)
    except TypeError as e:
        raise TypeError(f"{where}: model_kwargs {sorted(spec.model_kwargs)} do not fit {spec.model}{sig}: "
                        f"{e}") from None


# ---- what a job is ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A training job: what to train, on which data, for how long.

    Attributes:
        name: the job's name (letters, digits, ``_.-``; also its directory name).
        model: the model factory as an import path ``"package.module:function"``,
            called with ``model_kwargs``; e.g. ``"hfkern.elastic.worker:mlp"``.
        model_kwargs: keyword arguments of the factory (JSON values).
            :meth:`TorchrunExecutor.register` imports the factory and checks
            them against its signature (:func:`check_model`).
        dataset: a built-in data set: ``"digits"`` (scikit-learn's
            ``load_digits``), ``"classification"`` or ``"regression"`` (seeded
            synthetic tensors); ``dataset_kwargs`` are its options
            (:func:`hfkern.elastic.worker.load_dataset`), checked here.
        loss: ``"cross_entropy"`` or ``"mse"`` (on class labels: against one-hot
            targets over the data set's classes, 10 for ``"digits"`` and
            ``n_classes`` for ``"classification"``, so the model needs that
            many outputs); None picks by data set (``"mse"`` for ``"regression"``).
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` (torch.optim), with
            ``optimizer_kwargs`` (momentum, weight_decay, ...; checked here
            against the class's signature).
        lr: the learning rate at the reference global batch ``batch_size``.
        lr_rule: how the learning rate follows the global batch when the
            executor picks it (a launch at another batch size, a rescale
            without an explicit factor): ``"linear"``, ``"sqrt"`` or ``"none"``.
        batch_size: the reference global batch size.
        total_steps / total_samples: the job's length, exactly one of them.
            With ``total_samples`` the last step takes only what is left.
        seed: seeds the model initialisation, the data order and the
            synthetic data sets.
        checkpoint_dir: where checkpoints go (default: ``<job dir>/checkpoint``;
            a relative path is relative to the job directory). Every job
            needs its own: an executor refuses to register a second job with
            the same one, and a worker refuses to resume another job's
            checkpoint.
        checkpoint_every: also checkpoint every so many steps (None: only at
            stop requests and at the end).
        B: the array size. B > 1 trains B models of the factory (B calls of
            it, so B different initialisations) fused with :func:`hfkern.fuse`,
            all on the same batches, each with its own loss. B is fixed for the
            job's life: a rescale changes devices and batch size, not B.
        min_step_seconds: pad every step to at least this long (demonstrations
            and tests: it stands for a real model's step time and gives a
            controller time to act while the job runs).
    """

    name: str
    model: str = "hfkern.elastic.worker:mlp"
    model_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dataset: str = "digits"
    dataset_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    loss: str | None = None
    optimizer: str = "sgd"
    lr: float = 0.1
    optimizer_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lr_rule: str = "sqrt"
    batch_size: int = 32
    total_steps: int | None = None
    total_samples: int | None = None
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    B: int = 1
    min_step_seconds: float = 0.0

    def __post_init__(self) -> None:
        w = "JobSpec"
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"{w}: expected name to be letters, digits and '_.-' (a directory name), "
                             f"got {self.name!r}")
        if not isinstance(self.model, str) or not _FACTORY.match(self.model):
            raise ValueError(f"{w}: expected model to be an import path 'module:function', got {self.model!r}")
        set_ = object.__setattr__
        set_(self, "model_kwargs", _mapping(w, "model_kwargs", self.model_kwargs))
        set_(self, "dataset", _choice(w, "dataset", self.dataset, DATASETS))
        set_(self, "dataset_kwargs", _mapping(w, "dataset_kwargs", self.dataset_kwargs))
        _check_dataset_kwargs(w, self.dataset, self.dataset_kwargs)
        if self.loss is not None:
            _choice(w, "loss", self.loss, LOSSES)
        if self.dataset == "regression" and self.loss == "cross_entropy":
            raise ValueError(f"{w}: the 'regression' data set has real targets; expected loss 'mse' "
                             f"or None, got 'cross_entropy'")
        _choice(w, "optimizer", self.optimizer, OPTIMIZERS)
        set_(self, "optimizer_kwargs", _mapping(w, "optimizer_kwargs", self.optimizer_kwargs))
        if "lr" in self.optimizer_kwargs:
            raise ValueError(f"{w}: give the learning rate as lr, not in optimizer_kwargs")
        _check_optimizer_kwargs(w, self.optimizer, self.optimizer_kwargs)
        set_(self, "lr", _positive_float(w, "lr", self.lr))
        _choice(w, "lr_rule", self.lr_rule, LR_RULES)
        # The int fields are stored as ints (a numpy integer is taken, and converted: the spec is
        # written to the job directory as JSON).
        set_(self, "batch_size", _int(w, "batch_size", self.batch_size, 1))
        if (self.total_steps is None) == (self.total_samples is None):
            raise ValueError(f"{w}: expected exactly one of total_steps and total_samples, got "
                             f"total_steps={self.total_steps!r}, total_samples={self.total_samples!r}")
        if self.total_steps is not None:
            set_(self, "total_steps", _int(w, "total_steps", self.total_steps, 1))
        if self.total_samples is not None:
            set_(self, "total_samples", _int(w, "total_samples", self.total_samples, 1))
        set_(self, "seed", _int(w, "seed", self.seed, 0))
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)):
                raise TypeError(f"{w}: expected checkpoint_dir to be a path or None, "
                                f"got {type(self.checkpoint_dir).__name__}")
            set_(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
        if self.checkpoint_every is not None:
            set_(self, "checkpoint_every", _int(w, "checkpoint_every", self.checkpoint_every, 1))
        set_(self, "B", _int(w, "B", self.B, 1))
        set_(self, "min_step_seconds", _positive_float(w, "min_step_seconds", self.min_step_seconds,
                                                       allow_zero=True))

    def to_dict(self) -> dict:
        """The spec as JSON values (what ``spec.json`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "JobSpec":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        if not isinstance(data, Mapping):
            raise TypeError(f"JobSpec.from_dict: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"JobSpec.from_dict: expected keys among {sorted(known)}, got unknown {sorted(unknown)}")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """What an executor knows about one job.

    ``state`` is one of :data:`STATES`: "pending" (known, never started),
    "running", "rescaling" (asked to checkpoint and stop, to be relaunched at
    a new size; also while a relaunch waits for devices), "stopping" (asked
    to checkpoint and stop), "stopped" (checkpointed and not running:
    preempted), "finished", "failed". ``step`` and ``samples`` count the optimizer steps done and the
    samples consumed; ``loss`` is the last step's loss (None before the first);
    ``world_size`` and ``batch_size`` are those of the current (or last)
    launch, ``gpus`` the devices the allocation gave it (``world_size`` can be
    smaller where the executor caps processes), ``lr`` the launch's learning
    rate, ``generation`` the number of launches so far minus one.
    ``returncode`` and ``message`` describe how the last launch ended (a
    failure's message holds the end of its output); ``pid`` is the launcher's
    process id while it runs (for the torchrun back end also the process
    group id of the job's processes).
    """

    name: str
    state: str
    step: int = 0
    samples: int = 0
    world_size: int = 0
    gpus: int = 0
    batch_size: int = 0
    B: int = 1
    lr: float | None = None
    loss: float | None = None
    generation: int = -1
    returncode: int | None = None
    message: str = ""
    pid: int | None = None


def _check_allocation(where: str, allocation: Any) -> tuple[int, int, int | None]:
    """(gpus, batch_size, B or None) of an Allocation-like object."""
    for attr in ("gpus", "batch_size"):
        if not hasattr(allocation, attr):
            raise TypeError(f"{where}: expected an Allocation (with gpus, batch_size, B), got "
                            f"{type(allocation).__name__} without {attr!r}")
    gpus = _int(where, "allocation.gpus", allocation.gpus, 0)
    batch = _int(where, "allocation.batch_size", allocation.batch_size, 1)
    B = getattr(allocation, "B", None)
    if B is not None:
        B = _int(where, "allocation.B", B, 1)
    return gpus, batch, B


# ---- the interface --------------------------------------------------------------------------

class Executor(abc.ABC):
    """Runs jobs at the sizes an autoscaler decides.

    A back end implements :meth:`register`, :meth:`launch`, :meth:`rescale`,
    :meth:`stop`, :meth:`poll`, :meth:`shutdown` and :meth:`spec`; :meth:`apply` (one
    ``hfkern.elastic._autoscaler.Decision``), :meth:`apply_all` and
    :meth:`wait` are built on them. Decisions are read by attribute: ``job``
    (name), ``old`` (None for a job not running), ``new`` (``gpus``,
    ``batch_size``, ``B``; ``gpus == 0`` means stop) and ``lr_scale``.
    An executor is driven from one thread (its methods are not thread-safe).

    What other back ends would take:

    * Kubernetes: one pod per worker, created by the PyTorch training
      operator's elastic ``PyTorchJob`` (``elasticPolicy`` with
      ``minReplicas``/``maxReplicas`` and ``rdzvBackend`` c10d or etcd), each
      pod running ``torchrun --nnodes=min:max -m hfkern.elastic.worker`` on a
      job directory on shared storage (a ReadWriteMany volume, or an object
      store behind the same file names: ``spec.json``, ``launch.json``,
      ``control.json``, the checkpoint, the log). A controller applies a
      Decision as this back end does: write ``control.json``, wait until the
      job reports "stopped", rewrite ``launch.json`` (batch size, learning
      rate) and patch the replica count. Changing the replica count of a
      running job alone would also work -- the agents re-rendezvous and
      restart every worker, which resume from the latest checkpoint -- but
      loses the steps since that checkpoint unless the stop request comes
      first. ``poll`` reads pod phases and the log; devices are requested as
      ``nvidia.com/gpu`` resources and placed by the scheduler.
    * Ray: a placement group of ``gpus`` bundles per job and one actor per
      worker (or Ray Train's ``TorchTrainer`` with a scaling config);
      ``rescale`` = ask the actors to checkpoint (a method call instead of the
      control file), remove the placement group, create one of the new size
      and start new actors that resume from the checkpoint; ``poll`` gathers
      actor-reported progress; failures surface as actor deaths.

    Either way the worker's contract is unchanged: resume from the latest
    checkpoint, continue the sample stream from ``samples consumed``, scale
    the learning rate as the launch config says.
    """

    @abc.abstractmethod
    def launch(self, spec: JobSpec, allocation: Any, *, lr: float | None = None) -> JobStatus:
        """Start ``spec`` (or resume it, if it was stopped) at ``allocation``'s size.

        ``lr``: the learning rate of this launch; None follows the spec's
        ``lr_rule`` from the last launch's batch size and learning rate (from
        ``spec.batch_size`` and ``spec.lr`` for a first launch).
        """

    @abc.abstractmethod
    def rescale(self, name: str, gpus: int, batch_size: int, *, lr_scale: float | None = None,
                block: bool = True, timeout: float | None = None) -> JobStatus:
        """Checkpoint a running job and relaunch it with ``gpus`` workers at global batch ``batch_size``.

        The learning rate is multiplied by ``lr_scale`` (None: follow the
        spec's ``lr_rule`` from the current batch size).
        """

    @abc.abstractmethod
    def stop(self, name: str, *, block: bool = True, timeout: float | None = None) -> JobStatus:
        """Checkpoint a running job and stop it (it can be launched again later)."""

    @abc.abstractmethod
    def poll(self) -> dict[str, JobStatus]:
        """The status of every known job, by name (also advances pending rescales)."""

    @abc.abstractmethod
    def shutdown(self, *, checkpoint: bool = False, timeout: float = 30.0) -> None:
        """End every job's processes (after a checkpoint if ``checkpoint``)."""

    @abc.abstractmethod
    def register(self, spec: JobSpec) -> JobStatus:
        """Make a job known without starting it (a later Decision starts it)."""

    @abc.abstractmethod
    def log(self, name: str, last: int | None = None) -> list[dict]:
        """Job ``name``'s step records so far, oldest first (the ``last`` ones only, if given): at
        least ``step``, ``time`` (seconds since the epoch, when the step ended), ``world_size``,
        ``batch``, ``generation`` and ``loss``."""

    def status(self, name: str) -> JobStatus:
        """One job's status (see :meth:`poll`)."""
        statuses = self.poll()
        if name not in statuses:
            raise ValueError(f"{type(self).__name__}: expected a known job name, got {name!r} "
                             f"(known: {sorted(statuses)})")
        return statuses[name]

    def apply(self, decision: Any, *, block: bool = True, timeout: float | None = None) -> JobStatus:
        """Carry out one autoscaler Decision.

        ``new.gpus == 0``: stop the job (if running). Otherwise the job runs at
        the new size with its learning rate multiplied by ``lr_scale``: a
        running job is rescaled, a job not running (registered, or stopped
        earlier) is launched. As the autoscaler defines it, ``lr_scale`` is
        relative to the learning rate of the job's last launch, or -- for a
        job that never ran -- to the one at its default batch size, which
        here is ``spec.lr`` (so ``JobSpec.batch_size`` should be the
        autoscaler Job's default batch size). ``new.B`` must be the job's
        ``B``: an array's size is fixed for its life.
        """
        name, gpus, batch, B, lr_scale = self._read_decision(decision)
        current = self.status(name)
        spec = self.spec(name)
        self._check_array_size(f"{type(self).__name__}.apply", name, spec, gpus, B)
        if gpus == 0:
            if current.state in _ACTIVE:
                return self.stop(name, block=block, timeout=timeout)
            return current
        if current.state in _ACTIVE:
            return self.rescale(name, gpus, batch, lr_scale=lr_scale, block=block, timeout=timeout)
        if current.state in ("finished", "failed"):
            return current
        base = spec.lr if current.lr is None else current.lr
        return self.launch(spec, decision.new, lr=base * lr_scale)

    def apply_all(self, decisions: Iterable[Any], *, timeout: float | None = None) -> dict[str, JobStatus]:
        """Carry out one round of Decisions (an autoscaler's answer to one event).

        First every running job's stop or rescale request goes out at once
        (their checkpoints and restarts overlap); when all of them have
        stopped (and the rescaled ones relaunched), the jobs that were not
        running are started, on the devices the stopped ones gave back.

        Every decision is checked before any is carried out (a Decision's
        form, a known job, at most one decision per job, ``new.B`` the job's
        ``B``): a round with a bad decision raises and changes no job.
        """
        where = f"{type(self).__name__}.apply_all"
        decisions = list(decisions)
        read = [self._read_decision(d) for d in decisions]
        statuses = self.poll()
        seen: set[str] = set()
        for name, gpus, _, B, _ in read:
            if name not in statuses:
                raise ValueError(f"{where}: expected a known job name, got {name!r} (known: {sorted(statuses)})")
            if name in seen:
                raise ValueError(f"{where}: expected at most one decision per job in a round, got two or more "
                                 f"for {name!r}")
            seen.add(name)
            self._check_array_size(where, name, self.spec(name), gpus, B)
        first = [d for d in decisions if statuses[d.job].state in _ACTIVE]
        later = [d for d in decisions if statuses[d.job].state not in _ACTIVE]
        deadline = None if timeout is None else time.monotonic() + timeout
        for d in first:
            self.apply(d, block=False)
        names = [d.job for d in first]
        while True:
            statuses = self.poll()
            busy = [n for n in names if statuses[n].state in ("rescaling", "stopping")]
            if not busy:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{type(self).__name__}.apply_all: still stopping or rescaling "
                                   f"after {timeout} s: {busy}")
            time.sleep(0.05)
        for d in later:
            self.apply(d)
        return self.poll()

    def wait(self, name: str, timeout: float | None = None) -> JobStatus:
        """Block until ``name`` is finished, failed, stopped or pending; TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            statuses = self.poll()
            if name not in statuses:
                raise ValueError(f"{type(self).__name__}.wait: expected a known job name, got {name!r}")
            st = statuses[name]
            if st.state not in _ACTIVE:
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{type(self).__name__}.wait: job {name!r} still {st.state} after "
                                   f"{timeout} s (step {st.step})")
            time.sleep(0.05)

    @abc.abstractmethod
    def spec(self, name: str) -> JobSpec:
        """The registered spec of job ``name`` (ValueError if unknown)."""

    @staticmethod
    def _check_array_size(where: str, name: str, spec: JobSpec, gpus: int, B: int | None) -> None:
        if gpus > 0 and B is not None and B != spec.B:
            raise ValueError(f"{where}: job {name!r} trains an array of B={spec.B}; "
                             f"expected a decision with new.B == {spec.B}, got {B}")

    def _read_decision(self, decision: Any) -> tuple[str, int, int, int | None, float]:
        where = f"{type(self).__name__}.apply"
        for attr in ("job", "new", "lr_scale"):
            if not hasattr(decision, attr):
                raise TypeError(f"{where}: expected a Decision (job, old, new, lr_scale), got "
                                f"{type(decision).__name__} without {attr!r}")
        if not isinstance(decision.job, str):
            raise TypeError(f"{where}: expected decision.job to be a job name (str), got "
                            f"{type(decision.job).__name__}")
        gpus, batch, B = _check_allocation(where, decision.new)
        lr_scale = _positive_float(where, "decision.lr_scale", decision.lr_scale)
        return decision.job, gpus, batch, B, lr_scale

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# ---- the torchrun back end -------------------------------------------------------------------

def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group of ``proc`` (torchrun; it ends its workers), SIGKILL what remains."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    # Anything left in torchrun's group goes; workers (in their own sessions) end with torchrun.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass


def _kill_all(procs: dict) -> None:
    for proc in list(procs.values()):
        _kill_group(proc, 2.0)
    procs.clear()


class _Job:
    """The executor's book-keeping for one job."""

    def __init__(self, spec: JobSpec, directory: str):
        self.spec = spec
        self.dir = directory
        self.state = "pending"
        self.generation = -1
        self.proc: subprocess.Popen | None = None
        self.out = None
        self.gpus = 0
        self.nproc = 0
        self.batch_size = 0
        self.lr: float | None = None
        self.pending: tuple | None = None    # ("relaunch", gpus, batch, lr) or ("stop",)
        self.log_pos = 0
        self.last: dict | None = None
        self.recent: collections.deque = collections.deque(maxlen=_RECENT)   # the last step records
        self.returncode: int | None = None
        self.message = ""
        self.devices: list[int] = []
        self.ckpt_dir = _checkpoint_dir(spec, directory)


class TorchrunExecutor(Executor):
    """Each job an elastic ``torchrun`` group of worker processes on this machine.

    Args:
        workdir: jobs get directories ``workdir/<name>`` (spec, launch config,
            control file, checkpoint, ``log.jsonl``, torchrun's output per
            generation as ``torchrun.<generation>.log``).
        python: the interpreter that runs torchrun and the workers.
        nproc_cap: at most this many worker processes per job (None: as many
            as the allocation's GPUs). An allocation of more GPUs then runs on
            fewer processes at the same global batch -- the training is the
            same, only slower -- which lets a many-GPU plan run on a small
            machine. ``JobStatus.world_size`` reports the processes,
            ``JobStatus.gpus`` the allocation.
        rdzv_host: the address of the c10d rendezvous store, which each
            job's torchrun hosts on a free port of this address.
        device: "cpu" (default: each GPU of an allocation is one CPU worker
            process, Gloo), "cuda" (one device per local rank, NCCL; devices
            are taken from ``devices`` and handed to each launch through
            ``CUDA_VISIBLE_DEVICES``) or "auto" ("cuda" where available).
        devices: the CUDA device ids this executor may use (default: all).
        max_nodes: torchrun's ``--nnodes=1:max_nodes``. Above 1 the rendezvous
            waits ``rdzv_conf``'s ``last_call_timeout`` for more agents, which
            only other hosts' agents would fill.
        max_restarts: torchrun's ``--max-restarts``: a worker failure restarts
            the group, which resumes from the last checkpoint (see
            ``JobSpec.checkpoint_every``).
        threads_per_worker: ``OMP_NUM_THREADS`` of each worker.
        rdzv_conf: extra ``--rdzv-conf`` entries (e.g. ``{"join_timeout": 60}``).
        env: extra environment variables for the launches.

    Each torchrun is started in a session of its own. :meth:`shutdown` (also
    on ``with`` exit and at interpreter exit) sends SIGTERM to that process
    group -- torchrun passes it on to its workers, which it starts in
    sessions of their own -- and SIGKILL after a grace period; a worker whose
    launcher is gone ends too (it asks the kernel for a signal on its
    parent's death, and checks its parent between steps), so no worker is
    left behind.
    """

    def __init__(self, workdir: str | os.PathLike, *, python: str = sys.executable,
                 nproc_cap: int | None = None, rdzv_host: str = "127.0.0.1", device: str = "cpu",
                 devices: Iterable[int] | None = None, max_nodes: int = 1, max_restarts: int = 0,
                 threads_per_worker: int = 1, rdzv_conf: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None):
        w = "TorchrunExecutor"
        if not isinstance(workdir, (str, os.PathLike)):
            raise TypeError(f"{w}: expected workdir to be a path, got {type(workdir).__name__}")
        self.workdir = os.path.abspath(os.fspath(workdir))
        os.makedirs(self.workdir, exist_ok=True)
        if not isinstance(python, str) or not python:
            raise TypeError(f"{w}: expected python to be an interpreter path (str), got {python!r}")
        self.python = python
        self.nproc_cap = None if nproc_cap is None else _int(w, "nproc_cap", nproc_cap, 1)
        if not isinstance(rdzv_host, str) or not rdzv_host:
            raise TypeError(f"{w}: expected rdzv_host to be a host name or address, got {rdzv_host!r}")
        self.rdzv_host = rdzv_host
        device = _choice(w, "device", device, ("cpu", "cuda", "auto"))
        if device != "cpu":
            import torch

            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            elif not torch.cuda.is_available():
                raise ValueError(f"{w}: device='cuda' asked for, but torch sees no CUDA device")
        self.device = device
        if device == "cuda":
            import torch

            pool = list(range(torch.cuda.device_count())) if devices is None else list(devices)
            self._free_devices = [_int(w, "a device id", d, 0) for d in pool]
        else:
            self._free_devices = []
        self.max_nodes = _int(w, "max_nodes", max_nodes, 1)
        self.max_restarts = _int(w, "max_restarts", max_restarts, 0)
        self.threads_per_worker = _int(w, "threads_per_worker", threads_per_worker, 1)
        self.rdzv_conf = _mapping(w, "rdzv_conf", rdzv_conf or {})
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self._jobs: dict[str, _Job] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    # -- book-keeping ----------------------------------------------------------------------
    def spec(self, name: str) -> JobSpec:
        return self._job(name).spec

    def _job(self, name: str) -> _Job:
        if name not in self._jobs:
            raise ValueError(f"TorchrunExecutor: expected a known job name, got {name!r} "
                             f"(known: {sorted(self._jobs)}); register or launch its JobSpec first")
        return self._jobs[name]

    def job_dir(self, name: str) -> str:
        """The directory of job ``name``."""
        return self._job(name).dir

    def register(self, spec: JobSpec) -> JobStatus:
        """Make a job known (its directory and ``spec.json``) without starting it.

        Checks first, and writes nothing when a check fails: the model factory
        is imported and ``model_kwargs`` bound to its signature
        (:func:`check_model`; with this executor's interpreter only, and the
        launches' ``PYTHONPATH`` from ``env`` added), and no other registered
        job may use the same checkpoint directory (ValueError).
        """
        w = "TorchrunExecutor.register"
        if not isinstance(spec, JobSpec):
            raise TypeError(f"{w}: expected a JobSpec, got {type(spec).__name__}")
        if spec.name in self._jobs:
            if self._jobs[spec.name].spec != spec:
                raise ValueError(f"{w}: a different job named {spec.name!r} is already known")
            return self._status(self._jobs[spec.name])
        directory = os.path.join(self.workdir, spec.name)
        ckpt_dir = _checkpoint_dir(spec, directory)
        for other in self._jobs.values():
            if other.ckpt_dir == ckpt_dir:
                raise ValueError(f"{w}: job {spec.name!r} would keep its checkpoints in {ckpt_dir}, which job "
                                 f"{other.spec.name!r} already uses; expected a checkpoint_dir of its own "
                                 f"(a job resumes from the checkpoint it finds there)")
        if os.path.abspath(self.python) == os.path.abspath(sys.executable):
            paths = self.env.get("PYTHONPATH", "").split(os.pathsep)
            check_model(spec, paths=[p for p in paths if p], where=w)
        wanted = json.loads(json.dumps(spec.to_dict()))   # as spec.json holds it (tuples as lists)
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        try:
            spec_path = os.path.join(directory, "spec.json")
            if os.path.exists(spec_path):
                with open(spec_path) as f:
                    old = json.load(f)
                if old != wanted:
                    raise ValueError(f"{w}: {directory} holds another job's spec; expected {wanted}, found {old}")
            else:
                _write_json(spec_path, wanted)
        except BaseException:
            if created:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)   # only if empty: nothing of another run is removed
            raise
        job = _Job(spec, directory)
        self._jobs[spec.name] = job
        return self._status(job)

    # -- starting and stopping ---------------------------------------------------------------
    def launch(self, spec: JobSpec, allocation: Any, *, lr: float | None = None) -> JobStatus:
        w = "TorchrunExecutor.launch"
        if not isinstance(spec, JobSpec):
            raise TypeError(f"{w}: expected a JobSpec, got {type(spec).__name__}")
        gpus, batch, B = _check_allocation(w, allocation)
        if lr is not None:
            lr = _positive_float(w, "lr", lr)
        if gpus == 0:
            raise ValueError(f"{w}: expected an allocation of at least 1 GPU, got gpus=0")
        if B is not None and B != spec.B:
            raise ValueError(f"{w}: job {spec.name!r} has B={spec.B}; expected allocation.B == {spec.B}, got {B}")
        self.register(spec)
        job = self._jobs[spec.name]
        self._advance(job)
        if job.state in _ACTIVE:
            raise ValueError(f"{w}: job {spec.name!r} is {job.state}; expected a pending or stopped job "
                             f"(use rescale or apply for a running one)")
        if job.state in ("finished", "failed"):
            raise ValueError(f"{w}: job {spec.name!r} has {job.state}; it cannot be launched again")
        if lr is None and job.lr is None:
            lr = scale_lr(spec.lr, spec.batch_size, batch, spec.lr_rule)
        elif lr is None:
            lr = scale_lr(job.lr, job.batch_size, batch, spec.lr_rule)
        self._start(job, gpus, batch, lr)
        return self._status(job)

    def rescale(self, name: str, gpus: int, batch_size: int, *, lr_scale: float | None = None,
                block: bool = True, timeout: float | None = None) -> JobStatus:
        w = "TorchrunExecutor.rescale"
        job = self._job(name)
        gpus = _int(w, "gpus", gpus, 1)
        batch_size = _int(w, "batch_size", batch_size, 1)
        if lr_scale is not None:
            lr_scale = _positive_float(w, "lr_scale", lr_scale)
        self._advance(job)
        if job.state not in _ACTIVE:
            raise ValueError(f"{w}: expected a running job, but {name!r} is {job.state}")
        if job.pending is not None and job.pending[0] == "relaunch":
            _, _, base_batch, base_lr = job.pending   # a second request before the first landed
        else:
            base_batch, base_lr = job.batch_size, job.lr
        lr = base_lr * lr_scale if lr_scale is not None else scale_lr(base_lr, base_batch, batch_size,
                                                                        job.spec.lr_rule)
        nproc = self._nproc(gpus)
        if job.pending is None and nproc == job.nproc and batch_size == job.batch_size and lr == job.lr:
            job.gpus = gpus   # nothing the workers would notice: no restart
            return self._status(job)
        job.pending = ("relaunch", gpus, batch_size, lr)
        self._request_stop(job)
        if block:
            self._await(job, timeout, w)
        return self._status(job)

    def stop(self, name: str, *, block: bool = True, timeout: float | None = None) -> JobStatus:
        job = self._job(name)
        self._advance(job)
        if job.state not in _ACTIVE:
            return self._status(job)
        if job.proc is None:   # checkpointed already, its relaunch waiting for devices: drop it
            job.pending, job.state = None, "stopped"
            return self._status(job)
        job.pending = ("stop",)
        self._request_stop(job)
        if block:
            self._await(job, timeout, "TorchrunExecutor.stop")
        return self._status(job)

    def poll(self) -> dict[str, JobStatus]:
        for job in self._jobs.values():
            self._advance(job)
        return {name: self._status(job) for name, job in self._jobs.items()}

    def status(self, name: str) -> JobStatus:
        job = self._job(name)
        self._advance(job)
        return self._status(job)

    def log(self, name: str, last: int | None = None) -> list[dict]:
        """Every step record of job ``name``'s ``log.jsonl`` so far (complete lines); with ``last``
        (at most the records the executor keeps while it follows the log), those from memory."""
        job = self._job(name)
        if last is not None:
            if isinstance(last, bool) or not isinstance(last, int) or not 0 < last <= _RECENT:
                raise ValueError(f"{type(self).__name__}.log: expected last as an int in 1..{_RECENT} or None, "
                                 f"got {last!r}")
            self._read_log(job)
            return list(job.recent)[-last:]
        path = os.path.join(job.dir, "log.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    def shutdown(self, *, checkpoint: bool = False, timeout: float = 30.0) -> None:
        if checkpoint:
            for job in self._jobs.values():
                if job.proc is not None and job.proc.poll() is None:
                    job.pending = ("stop",)
                    self._request_stop(job)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(
                    j.proc is not None and j.proc.poll() is None for j in self._jobs.values()):
                time.sleep(0.05)
        for job in self._jobs.values():
            if job.proc is not None:
                if job.proc.poll() is None:
                    _kill_group(job.proc, 5.0)
                    job.message = "killed by shutdown"
                self._collect(job, job.proc)
            if job.pending is not None:   # checkpointed, its relaunch not started: it stays stopped
                job.pending, job.state = None, "stopped"
        _kill_all(self._procs)

    # -- internals ------------------------------------------------------------------------
    def _nproc(self, gpus: int) -> int:
        return gpus if self.nproc_cap is None else min(gpus, self.nproc_cap)

    def _request_stop(self, job: _Job) -> None:
        if job.proc is not None:
            _write_json(os.path.join(job.dir, "control.json"), {"action": "stop", "generation": job.generation})
        job.state = "rescaling" if job.pending[0] == "relaunch" else "stopping"

    def _await(self, job: _Job, timeout: float | None, where: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()   # every job: one that exits may free the devices this one waits for
            if job.pending is None:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{where}: job {job.spec.name!r} has not stopped after {timeout} s")
            time.sleep(0.05)

    def _start(self, job: _Job, gpus: int, batch: int, lr: float) -> None:
        nproc = self._nproc(gpus)
        env = dict(os.environ)
        env.update(self.env)
        env["OMP_NUM_THREADS"] = str(self.threads_per_worker)
        devices: list[int] = []
        if self.device == "cuda":
            if len(self._free_devices) < nproc:
                raise RuntimeError(f"TorchrunExecutor: job {job.spec.name!r} needs {nproc} CUDA devices, "
                                   f"{len(self._free_devices)} are free")
            devices, self._free_devices = self._free_devices[:nproc], self._free_devices[nproc:]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        # The workers import hfkern from wherever this process does.
        import hfkern

        root = os.path.dirname(os.path.dirname(os.path.abspath(hfkern.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)

        job.generation += 1
        for stale in ("control.json", "state.json"):
            try:
                os.remove(os.path.join(job.dir, stale))
            except FileNotFoundError:
                pass
        _write_json(os.path.join(job.dir, "launch.json"),
                    {"generation": job.generation, "gpus": gpus, "world_size": nproc, "batch_size": batch,
                     "lr": lr, "device": self.device})
        port = _free_port(self.rdzv_host)
        cmd = [self.python, "-m", "torch.distributed.run",
               f"--nnodes=1:{self.max_nodes}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_host}:{port}",
               f"--rdzv-id={job.spec.name}-{job.generation}", f"--max-restarts={self.max_restarts}"]
        if self.rdzv_conf:
            cmd.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in self.rdzv_conf.items()))
        cmd += ["-m", "hfkern.elastic.worker", job.dir]
        out = open(os.path.join(job.dir, f"torchrun.{job.generation}.log"), "wb")
        try:
            proc = subprocess.Popen(cmd, env=env, cwd=job.dir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            out.close()
            self._free_devices.extend(devices)
            raise
        job.proc, job.out, job.devices = proc, out, devices
        self._procs[job.spec.name] = proc
        job.gpus, job.nproc, job.batch_size, job.lr = gpus, nproc, batch, lr
        job.pending, job.returncode, job.message = None, None, ""
        job.state = "running"

    def _read_log(self, job: _Job) -> None:
        path = os.path.join(job.dir, "log.jsonl")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < job.log_pos:
                    job.log_pos = 0      # cut back after a restart from a checkpoint
                    job.recent.clear()
                f.seek(job.log_pos)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        job.log_pos += end + 1
        for line in data[:end].splitlines():
            try:
                job.last = json.loads(line)
            except ValueError:
                continue
            job.recent.append(job.last)

    def _advance(self, job: _Job) -> None:
        """Bring ``job``'s state up to date; relaunch a job whose stop for a rescale has completed."""
        self._read_log(job)
        proc = job.proc
        if proc is None:
            self._relaunch(job)
            return
        if proc.poll() is not None:
            self._collect(job, proc)
            self._relaunch(job)

    def _relaunch(self, job: _Job) -> None:
        """Start the new generation of a rescaled job once it has stopped and its devices are free."""
        if job.proc is not None or job.pending is None or job.pending[0] != "relaunch":
            return
        _, gpus, batch, lr = job.pending
        if self.device == "cuda" and len(self._free_devices) < self._nproc(gpus):
            return   # still "rescaling": other jobs' stops give the devices back
        try:
            self._start(job, gpus, batch, lr)
        except (OSError, RuntimeError) as e:
            job.pending = None
            job.state, job.message = "stopped", f"checkpointed, but the relaunch failed: {e}"

    def _collect(self, job: _Job, proc: subprocess.Popen) -> None:
        """torchrun has exited: reap it (and anything left in its group), read how the launch ended."""
        _kill_group(proc, 1.0)
        self._procs.pop(job.spec.name, None)
        job.proc = None
        if job.out is not None:
            job.out.close()
            job.out = None
        self._free_devices.extend(job.devices)
        job.devices = []
        job.returncode = proc.returncode
        self._read_log(job)
        outcome = None
        try:
            with open(os.path.join(job.dir, "state.json")) as f:
                st = json.load(f)
            if st.get("generation") == job.generation:
                outcome = st.get("state")
        except (OSError, ValueError):
            pass
        if proc.returncode != 0 or outcome not in ("stopped", "finished"):
            job.pending = None
            job.state = "failed"
            job.message = job.message or self._tail(job)
        elif outcome == "finished":
            job.pending = None    # it reached its end before it saw the request
            job.state = "finished"
        elif job.pending is not None and job.pending[0] == "relaunch":
            job.state = "rescaling"
        else:
            job.pending = None
            job.state = "stopped"

    def _tail(self, job: _Job, chars: int = 2000) -> str:
        path = os.path.join(job.dir, f"torchrun.{job.generation}.log")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - chars))
                text = f.read().decode(errors="replace")
        except OSError:
            text = ""
        return f"torchrun exited with status {job.returncode}; last output:\n{text}"

    def _status(self, job: _Job) -> JobStatus:
        last = job.last or {}
        return JobStatus(
            name=job.spec.name, state=job.state,
            step=int(last["step"]) + 1 if "step" in last else 0,
            samples=int(last.get("samples", 0)), world_size=job.nproc, gpus=job.gpus,
            batch_size=job.batch_size, B=job.spec.B, lr=job.lr, loss=last.get("loss"),
            generation=job.generation, returncode=job.returncode, message=job.message,
            pid=None if job.proc is None else job.proc.pid)


def _checkpoint_dir(spec: JobSpec, directory: str) -> str:
    """Where the workers of ``spec`` in job directory ``directory`` keep their checkpoint (a
    relative ``checkpoint_dir`` is relative to the job directory), as a real path."""
    return os.path.realpath(os.path.join(directory, spec.checkpoint_dir or "checkpoint"))


def _write_json(path: str, obj: Any) -> None:
    from hfkern.elastic.worker import _write_json_atomic

    _write_json_atomic(path, obj)
