"""hfkern::sgd_step_, adam_step_, lars_step_ and lamb_step_ on the CUDA kernels (csrc/optim/multi_tensor_step.cu).

Each launcher implements the hfkern op of the same name (hfkern/ops/optim.py
documents the arguments and the math; its torch implementation is the oracle
the kernels follow operation by operation). A step is the apex
``multi_tensor_apply`` pattern on hfkern's tile table (hfkern/_multi_tensor.py):
one launch increments the step counts of every (tensor, model) not skipped
(SGD's only where the model has momentum), then one launch per parameter dtype
updates every parameter of every model, one thread block per tile. The
kernels read each model's hyperparameters and step count from device memory,
so a step never synchronizes with the host. The tile table depends only on the
tensors' shapes, dtypes and layouts and is cached; the addresses of each call's
tensors (gradients are new tensors after every ``zero_grad()``) reach the
kernels in a small per-tensor address table, one pass over the tensors on the
host and one non-blocking copy, so a training loop's steady-state step is a
table lookup, that pass and two launches. A gradient laid out unlike its
parameter (channels-last) is read where it lies, through its gather row.

A trust-ratio step (LARS, LAMB) launches its norm pass before the update (per-tile
partial sums of squares into a scratch buffer, summed per (tensor, model) by
the update's threads in row order); the parameters that ``exclude_1d`` excludes
are launched apart, without it.

Served: float32, bfloat16 and float16 parameters with float32 state, every
option of the four ops (momentum, dampening, nesterov, weight decay, maximize;
Adam's amsgrad and AdamW's decoupled weight decay; LARS/LAMB's exclusion,
bias correction and norm bounds) and the skip mask. float64
parameters are refused (TypeError); the torch and triton backends serve them.

``emulated(op)`` runs the same launcher on CPU tensors through
``hfkern._C_emu``, the kernels built for the host grid emulator: that is how
the tests execute these kernels without a GPU.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .. import _backend, _multi_tensor as mt
from .._device import sm_count
from .._optim_specs import ADAM_SPEC, LAMB_SPEC, LARS_SPEC, SGD_SPEC, TRUST_RATIO_SPECS, OptimizerSpec, trust_subsets
from . import _ext

__all__ = ["sgd_step_", "adam_step_", "lars_step_", "lamb_step_", "emulated", "PARAM_DTYPES"]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_THREADS = 256  # threads per block on a GPU: 1024 elements per loop iteration
# Under the emulator every block is a group of host threads: small blocks and tiles,
# so that test tensors span several tiles and the vector loop several iterations.
_EMULATED_THREADS = 32
_EMULATED_CHUNK = 192


def _chunk(total: int, device: torch.device) -> int:
    """Elements per tile: about 64 tiles per SM, within [4096, 65536] (a power of two),
    so big arrays run many short waves and the last is cheap."""
    if device.type != "cuda":
        return _EMULATED_CHUNK
    per_tile = max(1, total // (sm_count(device) * 64))
    return min(65536, max(4096, 1 << (per_tile - 1).bit_length()))


_planner = mt.Planner("cuda", _chunk)


def _check(spec: OptimizerSpec, params: Sequence[Tensor], hypers: Tensor, skip: Tensor | None,
           device_type: str) -> None:
    """What the kernels need beyond the op's own checks (hfkern/ops/optim.py)."""
    for i, p in enumerate(params):
        if p.device.type != device_type:
            raise ValueError(f"hfkern::{spec.op} on the cuda backend: expected params[{i}] on a "
                             f"{device_type} device, got {p.device}")
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(
                f"hfkern::{spec.op} on the cuda backend takes float32, bfloat16 or float16 parameters, "
                f"got {p.dtype} at params[{i}]; the torch and triton backends serve float64"
            )
    device = params[0].device
    if hypers.dtype != torch.float32:  # the op allows float64 only with float64 parameters
        raise TypeError(f"hfkern::{spec.op} on the cuda backend: expected float32 hypers, got {hypers.dtype}")
    if hypers.device != device:
        raise ValueError(f"hfkern::{spec.op}: expected hypers on {device}, got {hypers.device}")
    if skip is not None and skip.device != device:
        raise ValueError(f"hfkern::{spec.op}: expected skip on {device}, got {skip.device}")


def _run(spec: OptimizerSpec, args: Sequence[Any], emulate: bool) -> None:
    """One step of ``spec``'s op; ``args`` in the op's argument order (``spec.args``)."""
    n = len(spec.states)
    params = args[0]
    if not params or mt.traced(params[0], "cuda"):
        return
    hypers, skip = args[3 + n], args[-1]
    _check(spec, params, hypers, skip, "cpu" if emulate else "cuda")
    if spec not in TRUST_RATIO_SPECS:
        return _launch(spec, args, emulate, trust=False)
    for sub, trust in trust_subsets(spec, args):
        _launch(spec, sub, emulate, trust=trust)


_LAUNCHERS = {"sgd": "sgd_step", "adam": "adam_step", "lars": "lars_step", "lamb": "lamb_step"}


def _launch(spec: OptimizerSpec, args: Sequence[Any], emulate: bool, trust: bool) -> None:
    """The launches of one (checked) step; with ``trust`` a trust-ratio step's norm pass
    first, without it a trust-ratio step's parameters are excluded ones."""
    n = len(spec.states)
    params, grads = args[0], args[1]
    steps, hypers, skip = args[2 + n], args[3 + n], args[-1]
    flags = dict(zip(spec.flags, args[4 + n : -1]))
    ext = _ext.load(emulated=emulate)
    absent = mt.N_STATES - n
    states = [*args[2 : 2 + n], *([[]] * absent)]
    names = [*spec.state_args, *(["unused"] * absent)]
    plan, addrs, grads = _planner.plan(params, grads, states, names, steps)
    device = params[0].device
    if device.type == "cuda":
        ext.set_device(device.index if device.index is not None else torch.cuda.current_device())
    stream = _ext.stream(device)
    threads = _EMULATED_THREADS if emulate else _THREADS
    B = params[0].size(0)
    if skip is not None:
        skip = skip.contiguous()  # read as [B] bytes
    skip_ptr = skip.data_ptr() if skip is not None else 0
    if plan.step_offs is not None and plan.n_steps:
        # Counts that follow a row (SGD's: its updates with momentum) read each model's value.
        row = spec.row(spec.counted_by) if spec.counted_by else None
        counted_by = hypers.data_ptr() + row * hypers.stride(0) * hypers.element_size() if row is not None else 0
        ext.count_steps(steps[0].data_ptr(), addrs.data_ptr(), plan.step_offs.data_ptr(), plan.n_steps, B, skip_ptr,
                        threads, stream, counted_by=counted_by, counted_stride=hypers.stride(1))
    launch = getattr(ext, _LAUNCHERS[spec.name])
    for group in plan.groups:
        first = group.index[0]
        # the norm pass's two sums of squares per tile (float32: the backend's math dtype)
        partials = torch.empty(2 * group.n_tiles, dtype=torch.float32, device=device) if trust else None
        launch(
            tiles=group.tiles.data_ptr(), n_tiles=group.n_tiles, addrs=addrs.data_ptr(),
            gathers=group.gathers.data_ptr() if group.gathers is not None else 0,
            param_dtype=_ext.DTYPE_CODES[group.dtype],
            params=params[first].data_ptr(), grads=grads[first].data_ptr(),
            state0=states[0][first].data_ptr() if states[0] else 0,
            state1=states[1][first].data_ptr() if states[1] else 0,
            state2=states[2][first].data_ptr() if states[2] else 0,
            steps=steps[0].data_ptr() if steps else 0,  # every step count is an offset from steps[0]
            hypers=hypers.data_ptr(), hyper_row_stride=hypers.stride(0), hyper_model_stride=hypers.stride(1),
            skip=skip_ptr,
            maximize=bool(flags["maximize"]),
            # an excluded parameter of a trust-ratio step gets no weight decay
            has_weight_decay=bool(flags["has_weight_decay"]) and (trust or spec not in TRUST_RATIO_SPECS),
            decoupled_weight_decay=bool(flags.get("decoupled_weight_decay", False)),
            momentum=spec in (SGD_SPEC, LARS_SPEC) and bool(states[0]), nesterov=bool(flags.get("nesterov", False)),
            amsgrad=spec is ADAM_SPEC and bool(states[2]), threads=threads, stream=stream,
            partials=partials.data_ptr() if partials is not None else 0, trust=trust,
            bias_correction=bool(flags.get("bias_correction", False)),
        )


def _signature(spec: OptimizerSpec) -> inspect.Signature:
    return inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in spec.args]
    )


def _launcher(spec: OptimizerSpec, *, emulate: bool) -> Callable[..., None]:
    """``spec``'s op on the kernels: the op's arguments, in its order."""
    signature = _signature(spec)

    def launch(*args: Any, **kwargs: Any) -> None:
        _run(spec, signature.bind(*args, **kwargs).args if kwargs else args, emulate)

    launch.__name__ = launch.__qualname__ = spec.op
    where = "CPU tensors through the host grid emulator (hfkern._C_emu)" if emulate else "CUDA tensors"
    launch.__doc__ = f"hfkern::{spec.op} on {where} with the multi-tensor step kernel."
    launch.__signature__ = signature  # type: ignore[attr-defined]
    return launch


_SPECS = {spec.op: spec for spec in (SGD_SPEC, ADAM_SPEC, LARS_SPEC, LAMB_SPEC)}

# auto never picks these until a committed GPU benchmark shows them faster
# (no GPU has measured them yet); backend="cuda" selects them.
sgd_step_ = _backend.implements(SGD_SPEC.op, "cuda", device_types=("cuda",), auto=False)(
    _launcher(SGD_SPEC, emulate=False))
adam_step_ = _backend.implements(ADAM_SPEC.op, "cuda", device_types=("cuda",), auto=False)(
    _launcher(ADAM_SPEC, emulate=False))
lars_step_ = _backend.implements(LARS_SPEC.op, "cuda", device_types=("cuda",), auto=False)(
    _launcher(LARS_SPEC, emulate=False))
lamb_step_ = _backend.implements(LAMB_SPEC.op, "cuda", device_types=("cuda",), auto=False)(
    _launcher(LAMB_SPEC, emulate=False))


def emulated(op: str) -> Callable[..., None]:
    """The cuda launcher of ``op`` (``"sgd_step_"``, ``"adam_step_"``, ``"lars_step_"``, ``"lamb_step_"``) on CPU tensors,
    running the same kernel sources in the host grid emulator (hfkern._C_emu)."""
    if op not in _SPECS:
        raise ValueError(f"the cuda backend implements {sorted(_SPECS)}, got {op!r}")
    return _launcher(_SPECS[op], emulate=True)
