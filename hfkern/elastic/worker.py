"""One worker process of an elastic training job: ``python -m hfkern.elastic.worker JOB_DIR``.

:class:`hfkern.elastic._executor.TorchrunExecutor` starts this module under
``torch.distributed.run`` (torchrun), once per worker. It can also run on its
own (no torchrun environment: a single process, no process group), which is
how an uninterrupted reference run is made.

Files in ``JOB_DIR``
    ``spec.json``      the job (:class:`~hfkern.elastic._executor.JobSpec`), written once.
    ``launch.json``    this launch: generation, global batch size, learning
                       rate, device kind ("cpu" or "cuda").
    ``control.json``   written by the executor to ask the workers of one
                       generation to checkpoint and stop.
    ``log.jsonl``      one JSON line per optimizer step, written by rank 0.
    ``state.json``     how the last launch ended ("stopped" or "finished"),
                       with the step and sample counts at that point.
    ``checkpoint/latest.pt`` (or the spec's ``checkpoint_dir``) the checkpoint;
                       it records the job's identity (:data:`IDENTITY_FIELDS`:
                       name, model, data, loss, optimizer, seed, B), and a job
                       refuses to resume from another job's (ValueError).

Data order (the rule that makes a resume exact)
    The job reads one global stream of sample indices: epoch ``e`` of the
    stream is a permutation of the whole data set drawn from a generator
    seeded with ``(seed, e)``, and the epochs follow one another. Every
    optimizer step takes the next ``global batch`` indices of the stream
    (the last step of a job with ``total_samples`` takes only what is left).
    Rank ``r`` of ``W`` takes a contiguous slice of the step's indices: the
    batch split as evenly as possible, the first ``batch % W`` ranks taking
    one more. Each rank's loss is the *sum* of its samples' losses divided by
    the step's global batch, and gradients are all-reduced with SUM, so every
    step's gradient is the mean over the global batch, whatever ``W`` is.
    A checkpoint records how many samples of the stream were consumed; a
    resumed job -- at any world size and any batch size -- continues the
    stream from there, so no sample is skipped or repeated. At an unchanged
    batch size the resumed run computes what the uninterrupted run computes,
    up to float rounding of the partial sums, for models whose forward treats
    samples independently and draws no random numbers: BatchNorm statistics
    depend on the local batch, and dropout masks on the world size (see
    Randomness).

Parameters without a gradient
    A parameter that the step's global batch does not reach (a head the
    forward skips) gets no gradient, as in a single process: every rank's
    step all-reduce carries a flag per parameter (whether its backward gave
    it a gradient), only the parameters some rank flagged are all-reduced (a
    rank that did not reach one contributes zeros), and the others keep
    ``grad`` None on every rank, so the optimizer skips them (no weight
    decay, no momentum, no state). Gradients are set to None before each
    step (``zero_grad()``), so this holds step by step: a parameter reached
    in earlier steps but not in this one is skipped in this one.

Randomness
    The model is initialised after ``torch.manual_seed(seed)`` on every rank
    (so all ranks start equal, and stay equal since they apply the same
    reduced gradient). Before each step the torch generator is reseeded from
    ``(seed, step, rank)``: dropout draws are reproducible and a resume needs
    no saved generator state. The draws depend on the rank and on how the
    batch is split, so a model with dropout (or any other random layer)
    matches an uninterrupted run only at an unchanged world size as well as
    batch size; a rescale to another world size changes its masks (not the
    data order or the expected gradient), like BatchNorm's statistics.

Stopping
    Rank 0 looks for ``control.json`` (naming this launch's generation)
    before every step's reduction and contributes a flag to the step's
    all-reduce, so every rank learns of a stop request at the same step.
    All ranks finish that step, rank 0 writes the checkpoint (temporary file
    and ``os.replace``) and ``state.json``, and the processes exit with status
    0. The end of the job is handled the same way with state "finished".
    With ``checkpoint_every`` a checkpoint is also written every so many
    steps, so that a worker failure restarted by torchrun (``--max-restarts``)
    resumes from it; the log is then cut back to the checkpoint's step.

Log record (one per step): ``step`` (0-based), ``offset`` (stream position of
the step's first sample), ``samples`` (consumed after the step), ``batch``
(the step's global batch), ``world_size``, ``lr``, ``loss`` (mean loss over the
global batch, averaged over the B models of an array), ``losses`` (per model,
B > 1 only), ``index_sum`` (sum of the sample indices all ranks used, a check
on the data order), ``generation`` and ``time``.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["mlp", "load_dataset", "dataset_options", "num_classes", "stream_indices", "rank_slice",
           "main", "train"]


# ---- built-in model and data sets --------------------------------------------------

def mlp(in_features: int = 64, out_features: int = 10, hidden: int = 64, depth: int = 1) -> nn.Module:
    """A small multilayer perceptron (``depth`` hidden ReLU layers of width ``hidden``).

    The default shape fits scikit-learn's digits (64 features, 10 classes);
    refer to it in a job spec as ``"hfkern.elastic.worker:mlp"``.
    """
    for key, value in (("in_features", in_features), ("out_features", out_features),
                       ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mlp: expected {key} to be a positive int, got {value!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"mlp: expected depth to be an int >= 0, got {depth!r}")
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


DATASETS = ("digits", "classification", "regression")
DIGITS_CLASSES = 10
_DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {},
    "classification": {"n_samples": 1024, "n_features": 20, "n_classes": 4, "noise": 0.5},
    "regression": {"n_samples": 1024, "n_features": 20, "n_targets": 1, "noise": 0.1},
}


def dataset_options(name: str, **kwargs: Any) -> dict[str, Any]:
    """The options :func:`load_dataset` would use for ``name`` and ``kwargs`` (defaults filled in),
    checked without building the data set: ValueError / TypeError naming what was expected and
    what came (an unknown data set or option, a count that is not a positive int, a noise
    level that is not a finite number)."""
    if not isinstance(name, str) or name not in _DATASET_DEFAULTS:
        raise ValueError(f"load_dataset: expected one of {DATASETS}, got {name!r}")
    defaults = _DATASET_DEFAULTS[name]
    if name == "digits" and kwargs:
        raise ValueError(f"load_dataset: 'digits' takes no options, got {sorted(kwargs)}")
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise ValueError(f"load_dataset: {name!r} takes options {sorted(defaults)}, got {sorted(unknown)}")
    opts = {**defaults, **kwargs}
    for key in ("n_samples", "n_features", "n_classes", "n_targets"):
        if key in opts and (isinstance(opts[key], bool) or not isinstance(opts[key], int) or opts[key] < 1):
            raise ValueError(f"load_dataset: expected {key} to be a positive int, got {opts[key]!r}")
    if "noise" in opts:
        noise = opts["noise"]
        if isinstance(noise, bool) or not isinstance(noise, numbers.Real) or not math.isfinite(noise):
            raise TypeError(f"load_dataset: expected noise to be a finite number, got "
                            f"{type(noise).__name__} {noise!r}")
    return opts


def num_classes(name: str, **kwargs: Any) -> int | None:
    """Classes of a built-in data set's labels (None for real targets): 10 for ``"digits"``,
    ``n_classes`` (default 4) for ``"classification"``. The ``"mse"`` loss on class labels
    compares the model's outputs with one-hot targets of this width."""
    opts = dataset_options(name, **kwargs)
    if name == "digits":
        return DIGITS_CLASSES
    return opts.get("n_classes")


def load_dataset(name: str, seed: int = 0, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a built-in data set, all in memory.

    * ``"digits"``: scikit-learn's 8x8 digits (1797 samples, 64 features scaled
      to [0, 1], 10 classes); no keyword arguments.
    * ``"classification"``: Gaussian inputs ``[n_samples, n_features]``, labels
      the argmax of a random linear map plus noise over ``n_classes``
      (defaults 1024, 20, 4, noise 0.5). A small set need not hold every class.
    * ``"regression"``: Gaussian inputs, targets ``[n_samples, n_targets]`` a
      random linear map plus Gaussian noise (defaults 1024, 20, 1, noise 0.1).

    The synthetic sets are drawn from a generator seeded with ``seed``.
    :func:`dataset_options` checks the options without building the set.
    """
    opts = dataset_options(name, **kwargs)
    if name == "digits":
        table = _digits_table()
        x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
        y = torch.tensor(table[:, -1], dtype=torch.int64)
        return x, y
    outputs = opts["n_classes"] if name == "classification" else opts["n_targets"]
    g = torch.Generator().manual_seed(int(seed))
    x = torch.randn(opts["n_samples"], opts["n_features"], generator=g)
    w = torch.randn(opts["n_features"], outputs, generator=g) / math.sqrt(opts["n_features"])
    z = x @ w + float(opts["noise"]) * torch.randn(opts["n_samples"], outputs, generator=g)
    return (x, z.argmax(1)) if name == "classification" else (x, z)


def _digits_table() -> np.ndarray:
    """scikit-learn's digits as one ``[1797, 65]`` array (64 pixel values, then the label).

    Reads the compressed table that scikit-learn ships -- the data ``load_digits``
    returns -- without importing scikit-learn (which would cost each worker
    process half a second); falls back to ``load_digits`` where the file is
    not where it is expected.
    """
    import importlib.util

    found = importlib.util.find_spec("sklearn")
    if found is not None and found.origin:
        path = os.path.join(os.path.dirname(found.origin), "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            table = np.loadtxt(path, delimiter=",")
            if table.shape == (1797, 65):
                return table
    from sklearn.datasets import load_digits

    data = load_digits()
    return np.concatenate([data.data, data.target[:, None]], axis=1)


# ---- the data order -----------------------------------------------------------------

class _Stream:
    """Positions of the global sample stream -> data set indices (epoch permutations cached)."""

    def __init__(self, n: int, seed: int):
        self.n = n
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def epoch(self, e: int) -> np.ndarray:
        perm = self._perms.get(e)
        if perm is None:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            perm = np.random.default_rng([self.seed, e]).permutation(self.n)
            self._perms[e] = perm
        return perm

    def take(self, start: int, count: int) -> np.ndarray:
        parts = []
        pos, end = start, start + count
        while pos < end:
            e, i = divmod(pos, self.n)
            j = min(self.n, i + end - pos)
            parts.append(self.epoch(e)[i:j])
            pos += j - i
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def stream_indices(n: int, seed: int, start: int, count: int) -> np.ndarray:
    """Data set indices at positions ``start .. start + count - 1`` of the global stream.

    Epoch ``e`` (positions ``e*n .. (e+1)*n - 1``) is the permutation
    ``numpy.random.default_rng([seed, e]).permutation(n)``.
    """
    for key, value, low in (("n", n, 1), ("start", start, 0), ("count", count, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"stream_indices: expected {key} to be an int >= {low}, got {value!r}")
    return _Stream(int(n), int(seed)).take(int(start), int(count))


def rank_slice(batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(first, count)``: the part of a global batch that ``rank`` of ``world_size`` takes."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank_slice: expected 0 <= rank < world_size={world_size}, got rank {rank}")
    base, extra = divmod(batch, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


# ---- helpers ----------------------------------------------------------------------------

def _import_factory(path: str) -> Callable[..., nn.Module]:
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"worker: the model factory {path!r} is not callable ({type(obj).__name__})")
    return obj


def _write_json_atomic(path: str, obj: Any) -> None:
    text = json.dumps(obj)   # before any file is made: a value JSON cannot hold leaves nothing behind
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# The JobSpec fields that define what a job computes: a checkpoint written by a job with other
# values is another job's (the length, the learning rate's reference, the checkpoint settings and
# the step padding may change between launches of one job).
IDENTITY_FIELDS = ("name", "model", "model_kwargs", "dataset", "dataset_kwargs", "loss", "optimizer",
                   "optimizer_kwargs", "seed", "B")


def job_identity(spec) -> dict:
    """The fields of ``spec`` (a JobSpec) that :data:`IDENTITY_FIELDS` names, as JSON values;
    recorded in each checkpoint, and compared before a resume."""
    data = spec.to_dict()
    identity = {key: data[key] for key in IDENTITY_FIELDS}
    if identity["loss"] is None:   # the loss the data set picks: None and its name are one job
        identity["loss"] = "mse" if spec.dataset == "regression" else "cross_entropy"
    return identity


def _check_checkpoint_owner(ckpt: dict, identity: dict, path: str) -> None:
    recorded = ckpt.get("job")
    if recorded is None:
        return   # a checkpoint of an older version, without the record: B is still compared
    theirs = json.loads(recorded) if isinstance(recorded, str) else recorded
    differ = [key for key in IDENTITY_FIELDS if theirs.get(key) != identity[key]]
    if differ:
        what = ", ".join(f"{key}={theirs.get(key)!r} (this job: {identity[key]!r})" for key in differ)
        raise ValueError(f"worker: the checkpoint {path} belongs to another job ({what}); refusing to resume "
                         f"job {identity['name']!r} from it: give every job a checkpoint_dir of its own")


def _step_seed(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank, 0x5EED]).generate_state(1, np.uint64)[0] >> 1)


def optimizer_class(name: str) -> type:
    """The torch.optim class of a JobSpec's ``optimizer`` name ("sgd", "adam", "adamw")."""
    return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]


def _make_optimizer(name: str, params, lr: float, kwargs: dict) -> torch.optim.Optimizer:
    return optimizer_class(name)(params, lr=lr, **kwargs)


def _truncate_log(path: str, before_step: int) -> None:
    """Keep the log's records of steps < ``before_step`` (after a resume from an older checkpoint)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if rec.get("step", before_step) < before_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


# ---- training -----------------------------------------------------------------------------

def train(job_dir: str) -> str:
    """Run (or resume) the job in ``job_dir`` until it finishes or is asked to stop.

    Uses the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``) when it is set, else runs as a single
    process. Returns ``"finished"`` or ``"stopped"``.
    """
    from hfkern.elastic._executor import JobSpec

    with open(os.path.join(job_dir, "spec.json")) as f:
        spec = JobSpec.from_dict(json.load(f))
    with open(os.path.join(job_dir, "launch.json")) as f:
        launch = json.load(f)
    generation = int(launch["generation"])
    batch_size = int(launch["batch_size"])
    lr = float(launch["lr"])
    device_kind = launch.get("device", "cpu")

    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist = None
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    try:
        return _train(job_dir, spec, generation, batch_size, lr, device, rank, world, dist)
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


def _train(job_dir, spec, generation, batch_size, lr, device, rank, world, dist) -> str:
    x_all, y_all = load_dataset(spec.dataset, spec.seed, **spec.dataset_kwargs)
    x_all, y_all = x_all.to(device), y_all.to(device)
    n_data = x_all.size(0)
    loss_name = spec.loss or ("mse" if spec.dataset == "regression" else "cross_entropy")
    if loss_name == "mse" and not y_all.is_floating_point():
        # class labels as one-hot targets over the data set's classes, whether or not the
        # data set holds every one of them
        classes = num_classes(spec.dataset, **spec.dataset_kwargs)
        y_all = F.one_hot(y_all, classes).to(x_all.dtype)

    factory = _import_factory(spec.model)
    torch.manual_seed(spec.seed)
    if spec.B == 1:
        model = factory(**spec.model_kwargs)
        if not isinstance(model, nn.Module):
            raise TypeError(f"worker: the model factory {spec.model!r} returned "
                            f"{type(model).__name__}, expected a torch.nn.Module")
    else:
        import hfkern

        model = hfkern.fuse(lambda: factory(**spec.model_kwargs), spec.B)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _make_optimizer(spec.optimizer, params, lr, dict(spec.optimizer_kwargs))

    # a relative checkpoint_dir is relative to the job directory (torchrun's workers run there)
    ckpt_dir = os.path.join(job_dir, spec.checkpoint_dir or "checkpoint")
    ckpt_path = os.path.join(ckpt_dir, "latest.pt")
    log_path = os.path.join(job_dir, "log.jsonl")
    control_path = os.path.join(job_dir, "control.json")
    step = samples = 0
    identity = job_identity(spec)
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)
        _check_checkpoint_owner(ckpt, identity, ckpt_path)
        if ckpt.get("B") != spec.B:
            raise ValueError(f"worker: the checkpoint holds an array of B={ckpt.get('B')} models, "
                             f"the job has B={spec.B}")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, samples = int(ckpt["step"]), int(ckpt["samples"])
    for group in optimizer.param_groups:
        group["lr"] = lr
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        _truncate_log(log_path, step)

    def checkpoint() -> None:
        if rank != 0:
            return
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "samples": samples, "B": spec.B, "generation": generation, "world_size": world,
                 "batch_size": batch_size, "lr": lr, "job": json.dumps(identity, sort_keys=True)}
        tmp = f"{ckpt_path}.tmp{os.getpid()}"
        try:
            torch.save(state, tmp)
            os.replace(tmp, ckpt_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def done() -> bool:
        return ((spec.total_steps is not None and step >= spec.total_steps)
                or (spec.total_samples is not None and samples >= spec.total_samples))

    def stop_requested() -> bool:
        if rank != 0 or not os.path.exists(control_path):
            return False
        try:
            with open(control_path) as f:
                req = json.load(f)
            return req.get("action") == "stop" and int(req.get("generation", -1)) == generation
        except (OSError, ValueError, TypeError, AttributeError):
            return False  # being replaced, or not a request of this launch

    launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
    stream = _Stream(n_data, spec.seed)
    log = open(log_path, "a") if rank == 0 else None
    outcome = "finished"
    try:
        while not done():
            if launcher is not None and os.getppid() != launcher:
                raise SystemExit("hfkern.elastic.worker: the launcher has gone; stopping without a checkpoint")
            t0 = time.perf_counter()
            batch = batch_size if spec.total_samples is None else min(batch_size, spec.total_samples - samples)
            idx = stream.take(samples, batch)
            first, count = rank_slice(batch, world, rank)
            local = torch.from_numpy(idx[first:first + count]).to(device)
            torch.manual_seed(_step_seed(spec.seed, step, rank))
            optimizer.zero_grad(set_to_none=True)
            if count:
                per_model = _loss_sums(model, x_all[local], y_all[local], loss_name, spec.B)
                (per_model.sum() / batch).backward()
                loss_sums = per_model.detach().to(torch.float64)
            else:
                loss_sums = torch.zeros(spec.B, dtype=torch.float64, device=device)
            head = [float(stop_requested()), float(count), float(local.sum())]
            if dist is None:
                stats = torch.cat([torch.tensor(head, dtype=torch.float64, device=device), loss_sums])
            else:
                # One flag per parameter: whether this rank's backward gave it a gradient. The
                # sum tells every rank which parameters the global batch reached.
                has_grad = [float(p.grad is not None) for p in params]
                stats = torch.cat([torch.tensor(head, dtype=torch.float64, device=device), loss_sums,
                                   torch.tensor(has_grad, dtype=torch.float64, device=device)])
                dist.all_reduce(stats)
                _reduce_gradients(params, (stats[3 + spec.B:] > 0).tolist(), dist)
            if int(stats[1]) != batch:
                raise RuntimeError(f"worker: the ranks used {int(stats[1])} samples at step {step}, expected {batch}")
            optimizer.step()
            losses = (stats[3:3 + spec.B] / batch).tolist()
            if log is not None:
                rec = {"step": step, "offset": samples, "samples": samples + batch, "batch": batch,
                       "world_size": world, "lr": lr, "loss": sum(losses) / len(losses),
                       "index_sum": int(stats[2]), "generation": generation, "time": time.time()}
                if spec.B > 1:
                    rec["losses"] = losses
                log.write(json.dumps(rec) + "\n")
                log.flush()
            step += 1
            samples += batch
            if spec.min_step_seconds > 0:
                time.sleep(max(0.0, spec.min_step_seconds - (time.perf_counter() - t0)))
            if stats[0] > 0 and not done():
                outcome = "stopped"
                break
            if spec.checkpoint_every and step % spec.checkpoint_every == 0 and not done():
                checkpoint()
        checkpoint()
        if rank == 0:
            _write_json_atomic(os.path.join(job_dir, "state.json"),
                               {"state": outcome, "step": step, "samples": samples, "generation": generation})
    finally:
        if log is not None:
            log.close()
    if dist is not None:
        dist.barrier()
    return outcome


def _reduce_gradients(params: list[nn.Parameter], reached: list[bool], dist) -> None:
    """Sum the gradients of the parameters the global batch ``reached`` over the ranks (one
    all-reduce); a rank whose local batch did not reach one of them contributes zeros. The
    others keep ``grad`` None on every rank, so the optimizer skips them, as it does in a
    single process (no weight decay, no momentum step, no state)."""
    used = [p for p, flag in zip(params, reached) if flag]
    if not used:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in used]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(used, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g)
        offset += g.numel()


def _loss_sums(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, B: int) -> torch.Tensor:
    """Per-model sums of the per-sample losses over a local batch: ``[B]``."""
    if B == 1:
        out = model(x)
        if loss == "cross_entropy":
            return F.cross_entropy(out, y, reduction="sum").reshape(1)
        _check_mse_shapes(out[0].numel() if out.dim() else 0, y, out.shape)
        return (out - y.view_as(out)).pow(2).mean(-1).sum().reshape(1)
    import hfkern
    from hfkern.nn import functional as AF

    out = model(hfkern.broadcast(x, B))
    if loss == "cross_entropy":
        return AF.cross_entropy(out, y, reduction="sum")
    _check_mse_shapes(out[0, 0].numel() if out.dim() > 1 else 0, y, out.shape)
    return (out - y.view(out.shape[1:])).pow(2).mean(-1).sum(-1)


def _check_mse_shapes(per_sample: int, y: torch.Tensor, shape) -> None:
    want = y[0].numel() if y.dim() and y.size(0) else per_sample
    if per_sample != want:
        raise ValueError(f"worker: loss 'mse' compares each sample's model output ({per_sample} values, "
                         f"output shape {tuple(shape)}) with its target ({want} values: one-hot over the "
                         f"data set's classes for class labels, n_targets for 'regression'); expected a "
                         f"model with {want} outputs")


def _die_with_launcher() -> None:
    """Under torchrun: end this worker if the launcher ends first.

    torchrun starts every worker in a session of its own, so a launcher killed
    outright (SIGKILL) would leave its workers running. On Linux the kernel is
    asked to SIGKILL this process when its parent exits (``PR_SET_PDEATHSIG``);
    the training loop also checks the parent between steps, everywhere.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))   # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m hfkern.elastic.worker JOB_DIR``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hfkern.elastic.worker JOB_DIR", file=sys.stderr)
        return 2
    if not os.path.isdir(argv[0]):
        print(f"hfkern.elastic.worker: no job directory {argv[0]!r}", file=sys.stderr)
        return 2
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_launcher()
    train(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
