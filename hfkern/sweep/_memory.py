"""The largest array size B whose training step fits in a device's free memory.

:func:`max_array_size` measures the peak memory of a training step of the fused
array (:func:`hfkern.fuse`) at a few small B, fits ``memory(B) = fixed +
per_model * B`` by least squares, and predicts the largest B whose step fits in
``memory_fraction`` of the device's free memory. On CUDA it then runs that B
(bisecting down on an out-of-memory error); on the CPU it reports the prediction.

What one measurement covers (a *window*): building the fused model of B models
(the B factory models alive while :func:`hfkern.fuse` copies them), the
optimizer, and two training steps: the second is the first in which the
gradients of one step, the optimizer state and the activations of the next are
alive together. The peak is of the bytes allocated inside the window, so memory
held before it (the example batch, other tensors) is not counted; it is not
free either, since free memory is read after the batch is on the device.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import numbers
import os
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .._array import broadcast
from ..fusion import fuse
from ..nn import functional as AF
from ..optim import Adam

__all__ = ["ArraySize", "default_step", "max_array_size", "measure_step_peak"]

# B = 1 is left out of the default sizes: a shared input at B = 1 is not a
# stride-0 view, so a first conv or linear layer takes the per-model path and
# B = 1's peak lies off the line through larger B (a small CNN on 8x8 images: 40%
# above it on the CPU, which tilts a fit on (1, 2, 4) 12% low in its slope and
# its prediction at B = 32 11% low; the fit on (2, 4, 8) predicts B = 32 exactly).
DEFAULT_SIZES = (2, 4, 8)

# A cgroup memory limit at or above this means "no limit" (cgroup v1 reports
# unlimited as the largest page-aligned int64).
_UNLIMITED = 1 << 60


@dataclasses.dataclass(frozen=True)
class ArraySize:
    """What :func:`max_array_size` found: the largest B, and the fit it came from.

    Attributes:
        B: the largest array size whose training step fits (0 if not even one
            model fits the budget).
        fixed_bytes: the fit's intercept: bytes of a step that do not grow with B
            (may be slightly negative: a least-squares intercept).
        per_model_bytes: the fit's slope: bytes each model adds to a step's peak.
        measured: the measured peak bytes of a step, by B.
        free_bytes: the device's free memory when measured.
        budget_bytes: ``memory_fraction * free_bytes``, what the step may use.
        device: the device measured.
        confirmed: True if a step at ``B`` ran on the device (CUDA); False for a
            prediction alone (CPU, or B = 0).
        predicted_B: the fit's largest B, before the ``max_B`` cap and the
            confirmation.
        max_B: the cap the search was given.
    """

    B: int
    fixed_bytes: float
    per_model_bytes: float
    measured: dict[int, int]
    free_bytes: int
    budget_bytes: float
    device: torch.device
    confirmed: bool
    predicted_B: int
    max_B: int

    @property
    def fits(self) -> bool:
        """Whether at least one model fits (``B >= 1``)."""
        return self.B >= 1

    def predict(self, B: int) -> float:
        """The fit's peak bytes of a step at array size ``B``: ``fixed + per_model * B``."""
        if isinstance(B, bool) or not isinstance(B, numbers.Real):
            raise TypeError(f"ArraySize.predict: expected a number of models B >= 0, got {type(B).__name__} {B!r}")
        if not B >= 0:
            raise ValueError(f"ArraySize.predict: expected B >= 0, got {B}")
        return self.fixed_bytes + self.per_model_bytes * B

    def __int__(self) -> int:
        return self.B

    def __str__(self) -> str:
        where = str(self.device)
        fit = f"{_format_bytes(self.fixed_bytes)} fixed + {_format_bytes(self.per_model_bytes)} per model"
        budget = (f"budget {_format_bytes(self.budget_bytes)} "
                  f"({self.budget_bytes / self.free_bytes:.2g} of {_format_bytes(self.free_bytes)} free)"
                  if self.free_bytes > 0 else f"budget 0 B of {_format_bytes(self.free_bytes)} free")
        if self.B == 0:
            why = ("out of memory down to B = 1" if self.predicted_B > 0 else "not one model fits the budget")
            return f"B = 0 ({why} on {where}): {fit}, {budget}"
        notes = []
        if self.predicted_B > self.max_B and self.B == self.max_B:
            notes.append(f"max_B; the budget allows {self.predicted_B}")
        elif self.confirmed and self.B < min(self.predicted_B, self.max_B):
            notes.append(f"predicted {min(self.predicted_B, self.max_B)} ran out of memory")
        notes.append(f"confirmed on {where}" if self.confirmed else f"predicted, not confirmed on {where}")
        return f"B = {self.B} ({'; '.join(notes)}): {fit}, {budget}"


def default_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> None:
    """One training step of a fused model of ``B = model.B`` models on a shared batch.

    ``batch`` is one model's batch: an inputs tensor ``[N, ...]``, or a pair
    ``(inputs [N, ...], targets)``. The inputs reach the B models as one
    :func:`hfkern.broadcast` view ``[B, N, ...]``. Per-model losses ``[B]``:
    :func:`hfkern.nn.functional.cross_entropy` for integer class targets
    ``[N, ...]``, :func:`~hfkern.nn.functional.mse_loss` for floating targets of
    the output's per-model shape, and without targets the mean square of the
    output (a stand-in loss: what the memory depends on is that the backward
    runs through the whole model). ``zero_grad()`` comes after the forward, so
    the forward of a step runs while the last step's gradients are alive: the
    larger peak of the two usual loop orders.
    """
    inputs, targets = (batch, None) if isinstance(batch, torch.Tensor) else batch
    out = model(broadcast(inputs, model.B))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"default_step: expected the model to return one [B, ...] tensor, got "
                        f"{type(out).__name__}; pass a step_fn for other outputs")
    if targets is None:
        losses = out.float().square().flatten(1).mean(1)
    elif targets.is_floating_point():
        losses = AF.mse_loss(out, targets)
    else:
        losses = AF.cross_entropy(out, targets)
    optimizer.zero_grad()
    losses.sum().backward()
    optimizer.step()


def _default_optimizer(params) -> torch.optim.Optimizer:
    return Adam(params, lr=1e-3)


# ---- argument checks ---------------------------------------------------------------------------

# What to pass instead of a torch.nn.Module, by argument: a module is callable, but
# calling it runs its forward, which is what none of the callables is.
_MODULE_HINTS = {
    "factory": "pass a callable that makes one, e.g. lambda: {cls}(...)",
    "step_fn": ("pass a function step_fn(model, optimizer, batch) that runs one training step of "
                "the fused model it is given (the models themselves come from factory)"),
    "optimizer": ("pass a function that makes the optimizer of the parameters it is given, "
                  "e.g. lambda params: hfkern.optim.SGD(params, lr=0.1)"),
}


def _check_callable(fn: str, name: str, value: object, what: str, optional: bool) -> None:
    if optional and value is None:
        return
    if isinstance(value, nn.Module):
        hint = _MODULE_HINTS.get(name, "").format(cls=type(value).__name__)
        raise TypeError(f"{fn}: {name} must be {what}, got a torch.nn.Module instance "
                        f"({type(value).__name__})" + (f"; {hint}" if hint else ""))
    if not callable(value):
        raise TypeError(f"{fn}: {name} must be {what}{' or None' if optional else ''}, "
                        f"got {type(value).__name__} {value!r}")


def _check_int(fn: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {value}")
    return value


def _check_sizes(fn: str, sizes: object) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"{fn}: sizes must be a sequence of at least two distinct ints >= 1, "
                        f"got {type(sizes).__name__} {sizes!r}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{fn}: sizes must hold ints >= 1, got {type(s).__name__} {s!r} in {sizes!r}")
        if s < 1:
            raise ValueError(f"{fn}: sizes must hold ints >= 1, got {s} in {sizes!r}")
    distinct = tuple(sorted(set(sizes)))
    if len(distinct) < 2:
        raise ValueError(f"{fn}: sizes must hold at least two distinct B to fit a line through, "
                         f"got {list(sizes)!r}")
    return distinct


def _check_fraction(fn: str, memory_fraction: object) -> float:
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, numbers.Real):
        raise TypeError(f"{fn}: memory_fraction must be a float in (0, 1], got "
                        f"{type(memory_fraction).__name__} {memory_fraction!r}")
    f = float(memory_fraction)
    if not 0.0 < f <= 1.0:  # also rejects nan
        raise ValueError(f"{fn}: memory_fraction must be in (0, 1], got {memory_fraction}")
    return f


def _check_device(fn: str, device: object) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{fn}: device must be a torch.device, a str or None, got {type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as e:  # torch's parse error of a device string
        raise ValueError(f"{fn}: expected a device such as 'cpu', 'cuda' or 'cuda:1', got {device!r} "
                         f"({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{fn}: expected an available device, got {device} and "
                             "torch.cuda.is_available() is False")
        # The memory statistics and the result name one device: an index, not "the current one".
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ValueError(f"{fn}: expected a 'cpu' or 'cuda' device, got {device}")
    return device


def _check_default_batch(fn: str, batch: object) -> None:
    if isinstance(batch, torch.Tensor):
        return
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return
    got = (f"{type(batch).__name__} of ({', '.join(type(t).__name__ for t in batch)})"
           if isinstance(batch, (tuple, list)) else type(batch).__name__)
    raise TypeError(f"{fn}: with the default step, example_batch must be an inputs tensor or an "
                    f"(inputs, targets) pair of tensors, got {got}; pass a step_fn for other batches")


def _check_no_profiler(fn: str, device: torch.device) -> None:
    """Refuse to measure CPU memory inside a profiling session (see :func:`_cpu_peak_bytes`)."""
    if device.type == "cpu" and _profiler_active():
        raise RuntimeError(
            f"{fn}: measures CPU memory with torch's profiler (torch.profiler.profile with "
            "profile_memory=True), and cannot run inside another profiling session: a nested "
            "session would stop the one already running, which would then record nothing; "
            "call it outside the profiler"
        )


def _profiler_active() -> bool:
    """Whether a torch profiler session is running: the Python profiler's process-wide flag
    (set by torch.profiler.profile and torch.autograd.profiler.profile, whichever thread
    entered it), or the autograd profiler's state in this thread (any other front end)."""
    from torch.autograd import profiler as autograd_profiler

    if getattr(autograd_profiler, "_is_profiler_enabled", False):
        return True
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else False


def _to_device(batch: Any, device: torch.device, keep_requires_grad: bool) -> Any:
    """The batch's tensors on ``device``, detached from the caller's: the steps backpropagate,
    and must not write gradients into the caller's tensors (nor build on their autograd
    history). ``keep_requires_grad``: a detached tensor that requires grad where the caller's
    does (a new leaf, for a custom step that differentiates with respect to its inputs);
    otherwise none does, so that the default step's shared input takes the shared path."""
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        with torch.inference_mode(False):
            moved = t.detach().to(device)
            if moved.is_inference():  # made under inference_mode: a normal tensor for autograd
                moved = moved.clone()
            if keep_requires_grad and t.requires_grad:
                moved.requires_grad_(True)
        return moved

    return tree_map(move, batch)


# ---- measuring ---------------------------------------------------------------------------------

def _release(device: torch.device) -> None:
    """Free what the last window left, so the next one starts from the same memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """The peak of the bytes allocated on the CPU by ``fn()`` and not yet freed.

    torch's CPU allocator keeps no statistics; the profiler records every
    allocation and free as a ``[memory]`` event (bytes, negative for a free).
    Reading the events goes through ``prof.profiler.kineto_results``, which is not
    a documented API: kept in this one function. Allocations of other threads in
    the process during ``fn()`` are counted too.
    """
    from torch.profiler import ProfilerActivity, profile

    # The callers refuse before any work (_check_no_profiler); this guards the session
    # already running against one started since.
    _check_no_profiler("max_array_size", torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]"]
    except AttributeError as e:
        raise RuntimeError(
            f"max_array_size: measuring CPU memory needs the profiler's memory events "
            f"(torch.profiler.profile(...).profiler.kineto_results.events()), which torch "
            f"{torch.__version__} does not provide ({e})"
        ) from e
    # A stable sort: an allocation and a free with one timestamp keep their recorded order.
    events.sort(key=lambda ev: ev[0])
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _cuda_peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """The peak of the bytes the caching allocator handed out on ``device`` during ``fn()``,
    above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.cuda.device(device):
        fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _run_window(factory: Callable[[], nn.Module], batch: Any, B: int, step_fn: Callable,
                make_optimizer: Callable, device: torch.device) -> None:
    """Build the fused model of B models and its optimizer on ``device``, and train two steps.

    Under the grad mode of training whatever the caller's is (``torch.no_grad``,
    ``torch.inference_mode``): a training step is what is measured. The caller's
    modes are back on return."""
    with torch.inference_mode(False), torch.enable_grad():
        model = fuse(factory, B).to(device)
        optimizer = make_optimizer(model.parameters())
        for _ in range(2):
            step_fn(model, optimizer, batch)


def _measure_window(factory: Callable[[], nn.Module], batch: Any, B: int, step_fn: Callable,
                    make_optimizer: Callable, device: torch.device) -> int:
    """The peak bytes of one window at array size B (``batch`` already on ``device``)."""
    _release(device)
    # The cyclic garbage of building the model (the B factory models, capture
    # leftovers) is freed whenever the collector happens to run; with it off in
    # the window, that garbage counts in full at every B, and the peak does not
    # depend on the collector's timing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else [],
                                   device_type=device.type):
            def run() -> None:
                _run_window(factory, batch, B, step_fn, make_optimizer, device)

            if device.type == "cuda":
                return _cuda_peak_bytes(run, device)
            return _cpu_peak_bytes(run)
    finally:
        if collecting:
            gc.enable()
        _release(device)


def _cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup may still grow by (v2, then v1), or None without a limit.

    A container's MemAvailable is the host's; its limit is the cgroup's. Page cache
    counts in the cgroup's usage but is reclaimed under pressure, so the inactive
    file pages are taken off the usage (what ``docker stats`` calls the working set).
    """
    for limit_path, usage_path, stat_path, inactive_key in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
         "inactive_file"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
         "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= _UNLIMITED:
                return None
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        inactive = 0
        try:
            with open(stat_path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
                        break
        except (OSError, ValueError):
            pass
        return max(int(raw) - max(usage - inactive, 0), 0)
    return None


def _free_bytes(device: torch.device) -> int:
    """The memory free for new allocations on ``device``, in bytes."""
    if device.type == "cuda":
        # What the caching allocator holds unused is free to this process but not to
        # the driver; empty_cache hands it back so that mem_get_info counts it.
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024  # the file's unit is kB
                    break
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError) as e:
            raise RuntimeError("max_array_size: cannot read the free CPU memory: no MemAvailable in "
                               f"/proc/meminfo and no os.sysconf('SC_AVPHYS_PAGES') ({e})") from e
    headroom = _cgroup_headroom()
    return free if headroom is None else min(free, headroom)


def _fit_line(points: dict[int, int]) -> tuple[float, float]:
    """Least-squares ``(fixed, per_model)`` of ``peak = fixed + per_model * B`` over ``points``."""
    n = len(points)
    mean_B = sum(points) / n
    mean_peak = sum(points.values()) / n
    sxx = sum((B - mean_B) ** 2 for B in points)
    sxy = sum((B - mean_B) * (peak - mean_peak) for B, peak in points.items())
    per_model = sxy / sxx
    return mean_peak - per_model * mean_B, per_model


def _largest_that_runs(runs: Callable[[int], bool], B: int, known_good: int) -> int:
    """The largest B' <= B for which ``runs(B')`` is True, given that ``known_good`` runs
    (0: none known) and that whatever runs at some B runs at every smaller B."""
    if runs(B):
        return B
    lo, hi = known_good, B  # lo runs (or is 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---- public ------------------------------------------------------------------------------------

def measure_step_peak(factory: Callable[[], nn.Module], example_batch: Any, B: int,
                      step_fn: Callable | None = None, device: torch.device | str | None = None,
                      optimizer: Callable | None = None) -> int:
    """The peak bytes a training step of B fused models allocates on ``device``.

    Measures one window (see :mod:`hfkern.sweep._memory`): building
    ``hfkern.fuse(factory, B)`` on ``device``, ``optimizer(params)`` and two calls
    of ``step_fn(model, optimizer, batch)``. The arguments are those of
    :func:`max_array_size`. On CUDA: the caching allocator's peak above what was
    allocated before; on the CPU: the peak of the bytes the profiler saw allocated
    and not yet freed. The global random state is left as it was.
    """
    fn = "measure_step_peak"
    _check_callable(fn, "factory", factory, "a callable returning one torch.nn.Module", optional=False)
    _check_callable(fn, "step_fn", step_fn, "a callable step_fn(model, optimizer, batch)", optional=True)
    _check_callable(fn, "optimizer", optimizer, "a callable optimizer(params) -> torch.optim.Optimizer",
                    optional=True)
    B = _check_int(fn, "B", B, 1)
    device = _check_device(fn, device)
    if step_fn is None:
        _check_default_batch(fn, example_batch)
    _check_no_profiler(fn, device)
    batch = _to_device(example_batch, device, keep_requires_grad=step_fn is not None)
    return _measure_window(factory, batch, B, step_fn or default_step, optimizer or _default_optimizer, device)


def max_array_size(factory: Callable[[], nn.Module], example_batch: Any, step_fn: Callable | None = None,
                   device: torch.device | str | None = None, memory_fraction: float = 0.9, *,
                   optimizer: Callable | None = None, sizes: Sequence[int] = DEFAULT_SIZES,
                   max_B: int = 4096) -> ArraySize:
    """The largest number B of models whose fused training step fits on ``device``.

    Measures the peak memory of a step (:func:`measure_step_peak`) at each B in
    ``sizes``, fits ``peak(B) = fixed + per_model * B`` by least squares, and
    predicts the largest ``B <= max_B`` with ``peak(B) <= memory_fraction * free``,
    ``free`` being the device's free memory (CUDA: ``torch.cuda.mem_get_info``;
    CPU: ``MemAvailable``, or a memory cgroup's headroom where smaller). On CUDA the
    prediction is confirmed by running a step at B, bisecting down on an
    out-of-memory error; on the CPU it is reported without running it.

    Args:
        factory: a callable returning one new ``torch.nn.Module`` (one model); the
            array is ``hfkern.fuse(factory, B)``.
        example_batch: one batch as one model sees it: an inputs tensor
            ``[N, ...]`` or a pair ``(inputs [N, ...], targets [N, ...])`` for the
            default step (see :func:`default_step`); anything ``step_fn`` takes
            otherwise. Its tensors are moved to ``device`` once, before free memory
            is read, detached: the steps never write gradients into the caller's
            tensors (for a custom ``step_fn``, a tensor that requires grad is
            passed as a new leaf that does too).
        step_fn: ``step_fn(model, optimizer, batch)``, one full training step of
            the fused ``model`` (its ``model.B`` models); default
            :func:`default_step`.
        device: where to measure; default CUDA if available, else the CPU.
        memory_fraction: the part of the free memory a step may use, in (0, 1]:
            the margin for what the measurement does not see (fragmentation of the
            caching allocator, the data loader, other processes).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``, called once per
            measured B; default ``hfkern.optim.Adam(params, lr=1e-3)``.
        sizes: the B measured, at least two distinct (default (2, 4, 8); see
            ``DEFAULT_SIZES`` on why not B = 1). The smallest is also run once
            first, unmeasured, so that one-time allocations (library workspaces,
            caches) land outside the fit.
        max_B: the largest B returned.

    Returns:
        An :class:`ArraySize`; ``int()`` of it is B. B = 0 when not even one model
        fits (a legitimate answer, not an error).

    The steps run with gradients enabled, also when called under
    ``torch.no_grad()`` or ``torch.inference_mode()`` (the caller's modes are back
    on return).

    Raises TypeError / ValueError for invalid arguments (before any work),
    RuntimeError, before any work, when called on the CPU inside a profiling
    session (the CPU measurement runs torch's profiler, and a nested session
    would end the running one), RuntimeError when the measured peak does not grow
    with B (nothing to extrapolate), and the device's out-of-memory error, with a
    note, when a measured size itself does not fit.
    """
    fn = "max_array_size"
    _check_callable(fn, "factory", factory, "a callable returning one torch.nn.Module", optional=False)
    _check_callable(fn, "step_fn", step_fn, "a callable step_fn(model, optimizer, batch)", optional=True)
    _check_callable(fn, "optimizer", optimizer, "a callable optimizer(params) -> torch.optim.Optimizer",
                    optional=True)
    memory_fraction = _check_fraction(fn, memory_fraction)
    sizes = _check_sizes(fn, sizes)
    max_B = _check_int(fn, "max_B", max_B, 1)
    device = _check_device(fn, device)
    if step_fn is None:
        _check_default_batch(fn, example_batch)
    _check_no_profiler(fn, device)
    batch = _to_device(example_batch, device, keep_requires_grad=step_fn is not None)
    step_fn = step_fn or default_step
    make_optimizer = optimizer or _default_optimizer

    def window(B: int) -> int:
        return _measure_window(factory, batch, B, step_fn, make_optimizer, device)

    measured: dict[int, int] = {}
    for i, B in enumerate((sizes[0],) + sizes):
        try:
            peak = window(B)
        except torch.cuda.OutOfMemoryError as e:
            e.add_note(f"{fn}: measuring a step at B = {B} (sizes {list(sizes)}) ran out of memory on "
                       f"{device}; pass smaller sizes")
            raise
        if i > 0:  # the first run is the warm-up
            measured[B] = int(peak)
    fixed, per_model = _fit_line(measured)
    if not per_model > 0:
        raise RuntimeError(
            f"{fn}: the measured peak memory does not grow with B on {device} "
            f"(peak bytes by B: {measured}), so there is no per-model cost to extrapolate; "
            "check that the model, its optimizer and the step allocate on that device"
        )
    free = _free_bytes(device)
    budget = memory_fraction * free
    predicted = max(math.floor((budget - fixed) / per_model), 0)
    B = min(predicted, max_B)
    confirmed = False
    if device.type == "cuda" and B > 0:
        def runs(b: int) -> bool:
            try:
                window(b)
                ok = True
            except torch.cuda.OutOfMemoryError:
                ok = False
            # Again after the except: until it ended, the error's traceback held the
            # failed window's frames and their tensors.
            _release(device)
            return ok

        B = _largest_that_runs(runs, B, known_good=max((s for s in sizes if s < B), default=0))
        confirmed = B > 0
    return ArraySize(B=B, fixed_bytes=fixed, per_model_bytes=per_model, measured=measured,
                     free_bytes=free, budget_bytes=budget, device=device, confirmed=confirmed,
                     predicted_B=predicted, max_B=max_B)


def _format_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    size, unit = abs(n), 0
    while size >= 1024 and unit < len(units) - 1:
        size /= 1024
        unit += 1
    sign = "-" if n < 0 else ""
    return f"{sign}{size:.0f} B" if unit == 0 else f"{sign}{size:.1f} {units[unit]}"
