"""ArrayOptimizer: what every array optimizer shares.

An array optimizer updates B models at once. Every parameter is ``[B, ...]``
(model b is index b) and every numeric hyperparameter is per model. The base
class validates parameters and hyperparameters, keeps per-model state, handles
skipped models and the state dict, and calls the step op; a subclass names the
op's declaration (:class:`hfkern._optim_specs.OptimizerSpec`: the hyperparameter
rows, state lists and flags, from which the hyperparameter table, the state it
keeps and the op call are derived) and its torch-compatible constructor.

Hyperparameters of a group live in one ``[H, B]`` tensor on the parameters'
device (float64 for float64 parameters, float32 otherwise); ``group[name]`` is a
``[B]`` view of its row (``betas``: a pair of views), so writing new values into
it in place (``group["lr"].copy_(new_lrs)``) reaches the next step without a
host sync or any re-validation, and the op reads the whole tensor at once.
Assigning a new value (float, sequence, tensor or numpy array) to
``group[name]`` instead is validated at the next step.

The learning rates given (to the constructor, ``add_param_group``, assigned to
``group["lr"]``, or set with :meth:`ArrayOptimizer.set_hyperparameters`) are
also kept exactly, as ``[B]`` float64 on the host, beside their rounding in
``group["lr"]``: the learning-rate schedulers (:mod:`hfkern.optim.lr_scheduler`)
start from them, as torch's start from the Python floats given, while
``group["lr"]`` still holds their rounding (not after a value was written into
it in place).

:meth:`ArrayOptimizer.reset_state` and :meth:`ArrayOptimizer.set_hyperparameters`
restart one model (fresh state, new hyperparameters) while the others go on.

``load_state_dict`` validates the whole state (parameter groups, their
hyperparameters and flags, every state tensor's shape and dtype) before it
changes anything: a state that does not fit raises and leaves the optimizer as
it was.
"""

from __future__ import annotations

import numbers
import operator
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim import Optimizer

from .._array import hyper
from .._dtypes import FLOAT_DTYPES, acc_dtype
from .. import _backend, graphs
from .._optim_specs import OptimizerSpec
from ..ops import optim as ops

__all__ = ["ArrayOptimizer"]

Hyper = float | Sequence[float] | torch.Tensor


@dataclass(frozen=True)
class _Checked:
    """What validating a group established, and the values it was established for."""

    values: tuple[Any, ...]  # the group's hyperparameter and flag objects, compared by identity
    table: torch.Tensor  # [H + I, B]: the group's hyperparameters, the op's rows then the init ones
    hypers: torch.Tensor  # [H, B]: the op's rows of table
    nonzero: dict[str, bool]  # per row name (spec rows, init hypers): whether any model's value is non-zero


class _Shielded:
    """Carries a loaded state tensor past torch's load_state_dict, which would cast it
    to the parameter's dtype (lossy for float32 state of bfloat16 parameters)."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor):
        self.value = value


def _stored(group: dict[str, Any], row: str, spec: OptimizerSpec) -> Any:
    """The stored value of hyperparameter row ``row`` in ``group`` (an entry of a pair for ``beta1``)."""
    for key, pair in spec.pairs:
        if row in pair:
            return group[key][pair.index(row)]
    return group[row]


def _validate_loaded(optimizer: "ArrayOptimizer", state_dict: Any) -> dict[str, Any]:
    # A pre-hook, so that it sees the state dict the user's own pre-hooks produced.
    return optimizer._validated_state_dict(state_dict)


def _place_state(optimizer: "ArrayOptimizer") -> None:
    optimizer._place_loaded_state()


# torch's implementation options. hfkern has one implementation (see ArrayOptimizer),
# so these only say which values describe it; the optimizers take the ones their
# torch namesakes take.
_FOREACH_FUSED = ("foreach", "fused")
_NOT_IMPLEMENTED = {"differentiable": "autograd through the optimizer step"}
_COMPAT_DEFAULTS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}

# The param-group entry by which a learning-rate scheduler that sets the learning rate itself,
# irrespective of the optimizer's (OneCycleLR, CyclicLR), says that the group's ``initial_lr`` is
# an endpoint of its schedule (its value: the scheduler's class name); see set_hyperparameters.
_INITIAL_LR_OWNER = "initial_lr_owner"

# The param-group entry in which the learning-rate schedulers keep a group's exact learning rates
# (``[B]`` float64 CPU; see ArrayOptimizer._exact_lr).
_LR_RECORD = "scheduled_lr"


def _rounded_dtype(value: Any) -> torch.dtype | None:
    """The floating dtype below float64 that a given hyperparameter value is held in (a float32
    tensor or numpy array: the rounding of some exact value, e.g. a stored or saved learning
    rate), or None where the value is what the user gave (Python numbers, float64, integers)."""
    dtype = None
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
    else:
        np = sys.modules.get("numpy")
        if np is not None and isinstance(value, (np.ndarray, np.generic)):
            dtype = getattr(torch, value.dtype.name, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype != torch.float64:
        return dtype
    return None


def _is_lr_record(t: Any, B: int | None) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.shape == (B,)
            and t.device.type == "cpu")


_data_ptr = torch.Tensor.data_ptr
_dtype_and_requires_grad = operator.attrgetter("dtype", "requires_grad")
_dtype_of, _shape_of, _device_of = (operator.attrgetter(a) for a in ("dtype", "shape", "device"))
_NONE_TYPE = type(None)


def _state_memory(state: dict) -> tuple:
    """The addresses of the tensors of an optimizer's ``state`` (for
    :meth:`ArrayOptimizer._graph_structure`). It runs before every graph replay, so it loops in
    C and hashes no parameter (a tensor's ``__hash__`` is Python)."""
    try:
        return tuple(map(_data_ptr, chain.from_iterable(map(dict.values, state.values()))))
    except TypeError:  # an entry that is not a dict of tensors (the state of no parameter, kept as loaded)
        return tuple(v.data_ptr() if isinstance(v, torch.Tensor) else id(v)
                     for entries in state.values()
                     for v in (entries.values() if isinstance(entries, dict) else (entries,)))


def _dynamo_tracing() -> bool:
    """Whether dynamo is tracing a step: also true in the methods it runs eagerly while it
    traces (``_init_group``), where ``torch.compiler.is_compiling()`` is false before torch 2.13."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


class ArrayOptimizer(Optimizer):
    """Base of the array optimizers: ``torch.optim.Optimizer`` over ``[B, ...]`` parameters.

    Subclasses set ``_spec`` (their op's declaration), from which the per-model
    hyperparameters (``_hypers``, in row order; ``betas`` is a pair and takes two
    rows), the bool options (``_flags``), the state kept and the op call derive;
    ``_init_hypers`` (per-model values used only to initialize state) and
    ``_compat`` (torch's implementation keywords) are their own. ``_check_values``
    adds checks beyond "one finite non-negative value per model".

    ``step(closure=None, *, skip=None)``: ``skip`` is an optional ``[B]`` bool
    tensor on the parameters' device; a model marked True is not updated at all
    (its parameters, state and step counts stay bit-identical). With
    ``skip_nonfinite=True`` the optimizer also skips every model with an inf or
    NaN in any gradient. ``last_skipped`` (None before the first step) is the
    ``[B]`` bool tensor of the models the last step did not update: one tensor
    per optimizer, which every step writes in place (eager, compiled, or
    replayed by :func:`hfkern.capture_step`, whichever of its graphs replays),
    so that it is right after any of them; ``.clone()`` it to keep one step's
    mask. Neither reads a device value on the host.

    Parameters of bfloat16/float16 keep float32 state; their update is computed in
    float32 and rounded into the parameter once.

    Under ``torch.compile`` (``torch.compile(opt.step, fullgraph=True)`` or a
    compiled training step) the step traces to its op calls; see
    :meth:`_init_group` for what makes it trace again. One difference from an
    eager step: a value the step rejects (a hyperparameter, or a ``skip`` mask
    of another dtype, shape or type) raises while dynamo traces, as dynamo's
    own error type (``InternalTorchDynamoError``, or ``Unsupported: Observed
    exception`` under ``fullgraph=True``) with the message kept in its
    context. (``last_skipped`` is the same tensor in both: dynamo drops
    attribute assignments of an optimizer in a compiled step, and every step
    writes it in place.)

    torch's implementation keywords are accepted where the torch namesake takes
    them, so that training scripts port unchanged; they select nothing, because
    hfkern has one implementation: every step of a param group is one
    ``hfkern::<name>_step_`` op over all its parameters and all B models, the
    kernel behind it chosen by the backend registry (:func:`hfkern.set_backend`).
    Where the torch backend serves the step outside ``torch.compile``, the
    optimizer calls its implementation directly, with the op's checks, rather
    than through the dispatcher (the same results, less host time per step;
    :func:`hfkern._backend.dispatched_ops` restores the op call).

    * ``foreach``: None (default) or True. The op takes every parameter's
      tensors at once, as torch's multi-tensor (foreach) implementation does.
      False (torch's per-parameter loop) raises a ValueError.
    * ``fused``: None (default) or True. One op updates every parameter, as
      torch's fused implementation does (on CUDA the Triton backend runs the
      whole update in fused kernels; the torch backend composes it of
      multi-tensor ops). False raises a ValueError.
    * ``capturable``: False (default) or True. The step is always what torch
      calls capturable: its step counts live on the parameters' device and it
      reads no device value on the host, so CUDA graphs capture it
      (:func:`hfkern.capture_step`) with either value. ``torch.compile`` sets
      it to True on the CUDA param groups of an optimizer whose step it
      compiles first, as it does for torch's optimizers.
    * ``differentiable``: False (default); True raises a NotImplementedError.

    They are stored in ``defaults`` and every param group, as torch stores them.

    Editing a stored hyperparameter in place cannot switch on work that every
    model of the group had off when it was validated (weight decay; momentum
    of SGD, RMSprop and LARS): the step leaves it out. Assign a new value
    instead, or use :meth:`set_hyperparameters`.

    State that torch keeps only for a non-zero value (the momentum buffers of
    SGD, RMSprop and LARS) is kept for every model of a group in which any
    model has it on, and a model whose value is 0 leaves its slice as it was.
    A value switched on for a model therefore continues as torch's optimizer
    with the same change would: SGD's buffer starts from the model's next
    gradient; RMSprop's and LARS's from zeros (torch's RMSprop raises a
    KeyError there: zeros are what its first step would have created); a value
    switched off and on again resumes from the buffer it left. A bool option
    switched on for a group (``amsgrad``, ``centered``) starts its state from
    zeros likewise, where torch raises a KeyError.

    Per-model surgery (a sweep replacing model b while the others train on):
    :meth:`reset_state` ``(b)`` gives model b the state of a new optimizer, and
    :meth:`set_hyperparameters` ``(b, *, group=None, **values)`` sets model b's
    hyperparameters (validated as the constructor validates them, written in
    place, the group re-validated); the other models' state and values stay
    bit-identical. With the parameters of slot b reset too
    (:meth:`hfkern.nn.ArrayModule.reset_model`), model b then trains exactly as
    a new model with a new ``torch.optim`` optimizer would.
    """

    _spec: OptimizerSpec
    _init_hypers: tuple[str, ...] = ()
    _compat: tuple[str, ...] = ()  # the implementation keywords the torch namesake takes
    # Derived from _spec: the hyperparameter arguments, the bool options and every
    # per-parameter state entry the optimizer may keep.
    _hypers: tuple[str, ...] = ()
    _flags: tuple[str, ...] = ()
    _state_names: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("_spec")
        if spec is not None:
            cls._hypers = spec.group_keys
            cls._flags = tuple(f for f in spec.flags if spec.value_flag(f) is None)
            cls._state_names = ("step", *(key for _, key, _ in spec.states))

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        skip_nonfinite: bool = False,
    ):
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(
                f"{type(self).__name__}: skip_nonfinite must be a bool, got "
                f"{type(skip_nonfinite).__name__} {skip_nonfinite!r}"
            )
        for k in self._compat:
            defaults.setdefault(k, _COMPAT_DEFAULTS[k])
        self.B: int | None = None
        self.skip_nonfinite = skip_nonfinite
        self.last_skipped: torch.Tensor | None = None
        self._skipped_out: torch.Tensor | None = None  # last_skipped's tensor: see _init_group
        self._device: torch.device | None = None
        self._checked: dict[int, tuple[dict, _Checked]] = {}
        # Per group (by id, with the group): the exact learning rates given (see _exact_lr).
        self._given_lr: dict[int, tuple[dict, torch.Tensor]] = {}
        self._opt_called = False  # whether a step ran (set by _init_group)
        super().__init__(params, defaults)

    # ---- subclass interface ----------------------------------------------
    def _check_values(self, group: dict[str, Any], per_model: dict[str, torch.Tensor]) -> None:
        """Extra checks on the validated ``[B]`` float64 CPU values (keys: row names)."""

    def _init_state(self, key: str, p: torch.Tensor, group: dict[str, Any], state: dict) -> torch.Tensor:
        """A new state entry: ``step`` is ``[B]`` float32 zeros, anything else zeros like ``p``."""
        if key == "step":
            return torch.zeros(p.size(0), dtype=torch.float32, device=p.device)
        return torch.zeros_like(p, dtype=acc_dtype(p.dtype), memory_format=torch.preserve_format)

    # ---- the op ---------------------------------------------------------------
    def _holds(self, when: str, group: dict[str, Any], checked: _Checked) -> bool:
        """Whether a state list with condition ``when`` (see OptimizerSpec) is kept for ``group``."""
        if not when:
            return True
        return group[when] if when in self._spec.flags else checked.nonzero[when]

    def _state_keys(self, group: dict[str, Any], checked: _Checked) -> tuple[str, ...]:
        """The state a parameter of ``group`` needs before the next step."""
        spec = self._spec
        keys = ("step",) if self._holds(spec.steps_when, group, checked) else ()
        return keys + tuple(key for _, key, when in spec.states if self._holds(when, group, checked))

    def _step_args(
        self,
        kept: tuple[str, ...],
        flags: tuple[bool, ...],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        hypers: torch.Tensor,
        states: list[torch.Tensor],
        skip: torch.Tensor | None,
    ) -> tuple:
        """The op's arguments for one group's parameters that have gradients: ``states`` holds
        their state tensors key by key in the order of ``kept`` (as :meth:`_init_group` gathers them)."""
        spec = self._spec
        n = len(params)
        by_key = {key: states[i * n:(i + 1) * n] for i, key in enumerate(kept)}
        lists = [by_key.get(key, []) for _, key, _ in spec.states]
        return (params, grads, *lists, by_key.get("step", []), hypers, *flags, skip)

    def _update(self, args: tuple) -> None:
        """Call the op on one group's arguments (:meth:`_step_args`)."""
        spec = self._spec
        # The torch implementation's in-place ops bump the version counters themselves, which
        # the op does for a kernel backend's writes (autograd's check for saved tensors).
        if _backend.eager_torch(spec.op, args[0][0].device):
            ops.run_step(spec, *args)
        else:
            getattr(ops, spec.op)(*args)

    # ---- validation -------------------------------------------------------
    def _label(self, row: str) -> str:
        """How the optimizer's arguments name hyperparameter row ``row`` (``betas[0]`` for ``beta1``)."""
        for key, pair in self._spec.pairs:
            if row in pair:
                return f"{key}[{pair.index(row)}]"
        return row

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of ``[B, ...]`` parameters, with optional per-group hyperparameters."""
        B, device = self.B, self._device
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            self.B, self._device = B, device
            raise

    def _check_params(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for i, p in enumerate(group["params"]):
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(
                    f"{name}: expected floating-point parameters (float32, float64, bfloat16 or "
                    f"float16), got {p.dtype} at index {i}"
                )
            if p.dim() == 0:
                raise ValueError(
                    f"{name}: expected array parameters of shape [B, ...], got a 0-d tensor at index {i}"
                )
            if any(stride == 0 and size > 1 for size, stride in zip(p.shape, p.stride())):
                raise ValueError(
                    f"{name}: expected parameters in dense memory (each is updated in place: no element "
                    f"stored twice), got shape {list(p.shape)} with strides {list(p.stride())} at index {i} "
                    "(an expanded tensor; pass a copy, e.g. .clone())"
                )
            if self.B is None:
                self.B, self._device = p.size(0), p.device
            if p.size(0) != self.B:
                raise ValueError(
                    f"{name}: every parameter must have the same leading (array) dim B={self.B}, "
                    f"got shape {list(p.shape)} at index {i}"
                )
            if p.device != self._device:
                raise ValueError(
                    f"{name}: every parameter must be on one device, got {self._device} and "
                    f"{p.device} (index {i})"
                )

    def _hyper(self, value: Any, name: str) -> torch.Tensor:
        try:
            return hyper(value, self.B, name)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{type(self).__name__}: {e}") from None

    def _require_below(
        self, per_model: dict[str, torch.Tensor], name: str, bound: float, *, inclusive: bool = False
    ) -> None:
        t = per_model[name]
        bad = t > bound if inclusive else t >= bound
        if bad.any():
            relation = "<=" if inclusive else "<"
            raise ValueError(
                f"{type(self).__name__}: {self._label(name)} must be {relation} {bound} for every model, "
                f"got {t.tolist()}"
            )

    def _check_compat(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for k in self._compat:
            value = group[k]
            if k in _FOREACH_FUSED:
                if value is None or value is True:
                    continue
                if value is False:
                    raise ValueError(
                        f"{name}: {k}=False asks for an implementation hfkern does not have: every step is "
                        f"one hfkern op over all parameters and models; pass {k}=None or {k}=True"
                    )
                raise TypeError(f"{name}: {k} must be None or a bool, got {type(value).__name__} {value!r}")
            if not isinstance(value, bool):
                raise TypeError(f"{name}: {k} must be a bool, got {type(value).__name__} {value!r}")
            if value and k in _NOT_IMPLEMENTED:
                raise NotImplementedError(
                    f"{name}: {k}=True ({_NOT_IMPLEMENTED[k]}) is not implemented for array optimizers; "
                    f"pass {k}=False"
                )

    def _validate_group(self, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Check ``group`` without changing it; returns its ``[B]`` float64 CPU values by row name."""
        name = type(self).__name__
        if not group["params"]:
            raise ValueError(f"{name}: a parameter group has no parameters")
        self._check_params(group)
        for k in self._flags:
            if not isinstance(group[k], bool):
                raise TypeError(f"{name}: {k} must be a bool, got {type(group[k]).__name__} {group[k]!r}")
        self._check_compat(group)
        np = sys.modules.get("numpy")  # a numpy pair exists only once numpy is imported
        per_model: dict[str, torch.Tensor] = {}
        for k in self._hypers + self._init_hypers:
            rows = self._spec.pair(k)
            if rows:
                pair = group[k]
                is_pair = isinstance(pair, (tuple, list)) or (
                    isinstance(pair, torch.Tensor) and pair.dim() >= 1
                ) or (np is not None and isinstance(pair, np.ndarray) and pair.ndim >= 1)
                if not is_pair or len(pair) != 2:
                    raise ValueError(
                        f"{name}: {k} must be a pair, each entry a float, a length-B sequence or a "
                        f"[B] tensor or array, got {pair!r}"
                    )
                for j, row in enumerate(rows):
                    per_model[row] = self._hyper(pair[j], f"{k}[{j}]")
            else:
                per_model[k] = self._hyper(group[k], k)
        self._check_values(group, per_model)
        return per_model

    def _check_group(self, group: dict[str, Any]) -> _Checked:
        """Validate ``group`` (once per set of values) and store its hyperparameters on the device."""
        keys = self._hypers + self._init_hypers + self._flags + self._compat
        values = tuple(group[k] for k in keys)
        cached = self._checked.get(id(group))
        if cached is not None and cached[0] is group and all(
            a is b for a, b in zip(cached[1].values, values)
        ):
            return cached[1]
        per_model = self._validate_group(group)
        dtype = (
            torch.float64 if all(p.dtype == torch.float64 for p in group["params"]) else torch.float32
        )
        # The op's rows first, in its order; the values that only initialize state after them.
        rows = self._spec.rows + self._init_hypers
        table = torch.stack([per_model[r] for r in rows]).to(device=self._device, dtype=dtype)
        if "lr" in per_model:
            self._record_lr(group, per_model["lr"])
        return self._store(group, table, {k: bool((v != 0).any()) for k, v in per_model.items()})

    def _exact_lr(self, group: dict[str, Any]) -> torch.Tensor | None:
        """The exact learning rates (``[B]`` float64 CPU) of which ``group["lr"]`` holds the
        rounding (float32 for float32 parameters), or None where none is known.

        They are the ones a learning-rate scheduler last set (``group["scheduled_lr"]``, which
        the optimizer's state dict saves), else the ones given to the optimizer: kept whenever
        a group's ``lr`` is validated (the constructor, ``add_param_group``, a value assigned
        to ``group["lr"]``, ``load_state_dict``) and by :meth:`set_hyperparameters`. Like the
        stored values, they are per model and may be stale: a reader uses a model's exact
        value only while ``group["lr"]`` still holds its rounding (not after a new value was
        written into ``group["lr"]`` in place). The schedulers start from them, as torch's
        start from the Python floats given."""
        record = group.get(_LR_RECORD)
        if _is_lr_record(record, self.B):
            return record
        entry = self.__dict__.get("_given_lr", {}).get(id(group))
        if entry is not None and entry[0] is group and _is_lr_record(entry[1], self.B):
            return entry[1]
        return None

    def _record_lr(self, group: dict[str, Any], given: torch.Tensor) -> None:
        """Keep the exact learning rates of ``group`` (``given``: its validated ``[B]`` float64 CPU
        values) before ``group["lr"]`` becomes their rounding in the stored table (see
        :meth:`_exact_lr`). A value held in a lower precision (the stored float32 view,
        revalidated for another entry; a loaded or copied float32 tensor) keeps the exact value
        of every model whose rounding it is; a value given in float64 (a Python number) is exact."""
        values = given.clone()
        old = self._exact_lr(group)
        rounded = _rounded_dtype(group["lr"])
        if rounded is not None and old is not None:
            values = torch.where(old.to(rounded).to(torch.float64) == values, old, values)
        if _is_lr_record(group.get(_LR_RECORD), self.B):
            group[_LR_RECORD] = values  # a scheduler's record follows what was given
        records = self.__dict__.setdefault("_given_lr", {})
        live = {id(g) for g in self.param_groups}
        for k in [k for k in records if k not in live]:
            del records[k]
        records[id(group)] = (group, values)

    def _store(self, group: dict[str, Any], table: torch.Tensor, nonzero: dict[str, bool]) -> _Checked:
        """Make ``group``'s hyperparameters ``[B]`` views of the rows of ``table`` (validated
        values, on the device) and record them as checked. The views are new objects, and a
        compiled step guards on their identity (:meth:`_init_group` marks them): storing
        anew is what makes it trace again, for new values and for work switched on or off."""
        stored = dict(zip(self._spec.rows + self._init_hypers, table.unbind(0)))
        for k in self._hypers + self._init_hypers:
            pair = self._spec.pair(k)
            group[k] = tuple(stored[r] for r in pair) if pair else stored[k]
        keys = self._hypers + self._init_hypers + self._flags + self._compat
        checked = _Checked(
            values=tuple(group[k] for k in keys),
            table=table,
            hypers=table[: len(self._spec.rows)],
            nonzero=nonzero,
        )
        self._checked[id(group)] = (group, checked)
        return checked

    def _graph_structure(self) -> tuple:
        """What a captured step (:func:`hfkern.capture_step`) is specific to: each group's
        parameters (the objects, their memory, dtype and ``requires_grad``), their state tensors'
        memory (a graph holds the addresses: ``module.half()`` or ``.data = ...`` gives a
        parameter new memory, ``state.clear()`` or ``load_state_dict`` new state), its
        hyperparameter and flag objects (a value assigned anew is validated and stored in a new
        tensor at the next eager step) and the optional work its values switch on (weight decay,
        momentum). Values written in place into the stored tensors are not in it."""
        keys = self._hypers + self._init_hypers + self._flags + self._compat
        out = [_state_memory(self.state)]
        for group in self.param_groups:
            params = group["params"]
            cached = self._checked.get(id(group))
            nonzero = tuple(sorted(cached[1].nonzero.items())) if cached is not None else None
            out.append((tuple(map(id, params)), tuple(map(_data_ptr, params)),
                        tuple(map(_dtype_and_requires_grad, params)),
                        tuple(map(id, map(group.__getitem__, keys))), nonzero))
        return tuple(out)

    def _check_skip(self, skip: Any) -> None:
        name = type(self).__name__
        if not isinstance(skip, torch.Tensor):
            raise TypeError(f"{name}: skip must be a [B] bool tensor or None, got {type(skip).__name__}")
        if skip.dtype != torch.bool:
            raise TypeError(f"{name}: skip must be a bool tensor, got dtype {skip.dtype}")
        if skip.shape != (self.B,):
            raise ValueError(f"{name}: skip must have shape [B]=[{self.B}], got {list(skip.shape)}")
        if skip.device != self._device:
            raise ValueError(
                f"{name}: skip must be on the parameters' device {self._device}, got {skip.device}"
            )

    # ---- step ---------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        *,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One step of every model not skipped; ``closure`` re-evaluates and returns the loss (e.g. ``[B]``).

        ``skip``: optional ``[B]`` bool tensor on the parameters' device, True for
        the models to leave untouched this step.
        """
        if skip is not None:
            self._check_skip(skip)
        if not torch.compiler.is_compiling():
            graphs.note_optimizer(self)  # a captured step re-captures when the parameter groups change
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        hypers: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        skipped: list[torch.Tensor] = []
        layout = self._init_group(params, grads, hypers, states, skipped)
        mask = skip
        if self.skip_nonfinite and grads:
            bad = ops.nonfinite_models(grads)
            mask = bad if skip is None else skip | bad
        calls = []
        i = j = 0
        for table, (n, kept, flags) in zip(hypers, layout):
            if n:
                m = n * len(kept)
                calls.append(self._step_args(kept, flags, params[i:i + n], grads[i:i + n], table,
                                             states[j:j + m], mask))
                i, j = i + n, j + m
        # Each call checks its own arguments before it writes anything; a later group's are checked
        # before the first group steps too, so that a step that raises changes no model. (A traced
        # step's ops check their arguments at the trace, where nothing is written yet.)
        if len(calls) > 1 and not _dynamo_tracing():
            for args in calls[1:]:
                ops.check_step(self._spec, *args)
        for args in calls:
            self._update(args)
        # Every step writes one tensor in place: a replay of a captured step (which runs no
        # Python, and may be one of several graphs) writes the tensor its capture wrote, and
        # dynamo drops an optimizer's attribute assignments in a compiled step
        # (pytorch/pytorch#171590).
        if mask is None:
            skipped[0].zero_()
        else:
            skipped[0].copy_(mask)
        return loss

    def _init_group(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        hypers: list[torch.Tensor],
        states: list[torch.Tensor],
        skipped: list[torch.Tensor],
    ) -> tuple[tuple[int, tuple[str, ...], tuple[bool, ...]], ...]:
        """Validate every param group, then gather the step's work into the (empty) lists:
        the parameters with gradients and their gradients, group by group; each group's
        ``[H, B]`` hyperparameter table; their state tensors (created where missing),
        group by group and in each group key by key. Returns, per group, its number of
        parameters with gradients, its state keys and the op's bool options. A bad value
        in any group raises before any state is created or any model changes.

        Under ``torch.compile`` dynamo runs this method eagerly while tracing, as it runs
        the ``_init_group`` of torch's optimizers, and guards on what it read (the groups'
        values, the state, which parameters have gradients): the traced step is the op
        calls alone, and a value assigned anew to a group (a float, a new tensor: the
        stored ones are guarded by identity) makes the next call trace again, and so
        validate it. The step reads ``param_groups`` only here, so that dynamo guards on
        the groups as validation leaves them. ``skipped`` gets the tensor a step writes
        its mask of skipped models into, which is ``last_skipped`` (made here at the first
        step, eager or traced; made anew only if the parameters' B or device changed).
        """
        name = type(self).__name__
        checked = []
        for group in self.param_groups:
            checked.append(self._check_group(group))
            if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                raise RuntimeError(f"{name}: sparse gradients are not supported for array parameters")
        spec = self._spec
        layout = []
        for group, c in zip(self.param_groups, checked):
            flags = tuple(c.nonzero[row] if (row := spec.value_flag(f)) else group[f] for f in spec.flags)
            with_grad = [p for p in group["params"] if p.grad is not None]
            kept = self._state_keys(group, c) if with_grad else ()
            params += with_grad
            grads += [p.grad for p in with_grad]
            hypers.append(c.hypers)
            states += self._states(with_grad, group, kept)
            layout.append((len(with_grad), kept, flags))
        if _dynamo_tracing():
            for group in self.param_groups:
                for k in self._hypers + self._init_hypers:
                    for t in group[k] if self._spec.pair(k) else (group[k],):
                        torch._dynamo.mark_static_address(t, guard=True)  # guarded by identity
        out = self._skipped_out
        if out is None or out.shape != (self.B,) or out.device != self._device:
            # Made at the first step (again only if the parameters' B or device changed): every
            # later step, eager, compiled or replayed by capture_step, writes this tensor.
            out = self._skipped_out = torch.zeros(self.B, dtype=torch.bool, device=self._device)
        self.last_skipped = out
        skipped.append(out)
        self._opt_called = True  # (what torch's schedulers read: a scheduler stepped first warns)
        return tuple(layout)

    def _states(self, params: list[torch.Tensor], group: dict[str, Any], keys: tuple[str, ...]) -> list[torch.Tensor]:
        """The state tensors of ``params`` key by key (``keys``), created where missing and checked
        against their parameters (:meth:`_state_of`). A steady-state step finds every entry made
        and fitting: that case is a few list operations in C, no Python per parameter."""
        if not keys:
            return []
        per_param = list(map(self.state.__getitem__, params))
        try:
            lists = [list(map(operator.itemgetter(key), per_param)) for key in keys]
        except KeyError:  # state to create
            lists = None
        if lists is not None:
            flat = list(chain.from_iterable(lists))
            checked = next((values for key, values in zip(keys, lists) if key != "step"), None)
            if _NONE_TYPE not in set(map(type, flat)) and (checked is None or (
                    list(map(_dtype_of, checked)) == [acc_dtype(d) for d in map(_dtype_of, params)]
                    and list(map(_shape_of, checked)) == list(map(_shape_of, params))
                    and list(map(_device_of, checked)) == list(map(_device_of, params)))):
                return flat
        per_param = [self._state_of(p, group, keys) for p in params]
        return [state[key] for key in keys for state in per_param]

    def _state_of(self, p: torch.Tensor, group: dict[str, Any], keys: tuple[str, ...]) -> dict:
        """``p``'s state with ``keys``, created where missing, and checked against ``p`` before
        any group's update, so that a step is never applied half."""
        state = self.state[p]
        checked = False
        for key in keys:
            value = state.get(key)
            if value is None:
                state[key] = self._init_state(key, p, group, state)
            elif not checked and key != "step":
                # One entry per parameter is compared (a step's host time counts): a parameter's
                # entries are made, loaded and refit together.
                checked = True
                if value.dtype is not acc_dtype(p.dtype) or value.device != p.device or value.shape != p.shape:
                    self._refit_state(p, state)
        return state

    def _refit_state(self, p: torch.Tensor, state: dict) -> None:
        """Follow a parameter that changed dtype or device after its state was made
        (``module.double()``, ``module.to(device)``), as a loaded state does; a parameter
        replaced by one of another shape raises."""
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape != ((p.size(0),) if key == "step" else p.shape):
                raise ValueError(
                    f"{type(self).__name__}: state {key!r} of shape {list(value.shape)} does not fit its parameter "
                    f"of shape {list(p.shape)} (was the parameter replaced after the optimizer's first step?); "
                    f"build the optimizer again or load a state that fits"
                )
            dtype = torch.float32 if key == "step" else acc_dtype(p.dtype)
            state[key] = value.to(device=p.device, dtype=dtype)

    # ---- per-model surgery ------------------------------------------------------
    def _check_model(self, b: Any, who: str) -> int:
        name = f"{type(self).__name__}.{who}"
        if self.B is None:
            raise ValueError(f"{name}: the optimizer has no parameters, so no models")
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(
                f"{name}: expected a model index b (an int in [0, {self.B})), got {type(b).__name__} {b!r}"
            )
        if not 0 <= b < self.B:
            raise ValueError(f"{name}: expected a model index b in [0, {self.B}), got {b}")
        return int(b)

    @torch.no_grad()
    def reset_state(self, b: int) -> None:
        """Give model b the state a new optimizer has before its first step; other models keep theirs.

        For every parameter with state, model b's entries (step counts, moments,
        momentum buffers, ``max_exp_avg_sq``, Adagrad's ``sum``...) are written in
        place to their initial values: zero counts and moments, ``sum`` at model
        b's ``initial_accumulator_value`` (so set that first, with
        :meth:`set_hyperparameters`, when it changes). State not created yet is
        created at the next step as for every model. The other models' state is
        untouched (bit-identical). Raises before anything changes for a bad ``b``
        or a group value the next step would reject.
        """
        b = self._check_model(b, "reset_state")
        work = []
        for group in self.param_groups:
            checked = self._check_group(group)
            keys = self._state_keys(group, checked)
            work += [(p, group, keys) for p in group["params"] if self.state.get(p)]
        for p, group, keys in work:
            # Entries the next step would add to a started state (an SGD step count
            # missing from an older checkpoint) are added first, so that model b's
            # is reset with the rest.
            state = self._state_of(p, group, keys)
            for key, value in state.items():
                if key in self._state_names and isinstance(value, torch.Tensor):
                    value[b].copy_(self._init_state(key, p, group, {})[b])

    def set_hyperparameters(self, b: int, *, group: int | None = None, **values: Any) -> None:
        """Set model b's hyperparameters in every param group (or only in ``param_groups[group]``).

        ``values``: per-model hyperparameters by their argument names (those of
        the optimizer's spec, e.g. ``lr``, ``momentum``, ``weight_decay``, ``eps``,
        ``betas`` as a pair, and values that initialize state, such as Adagrad's
        ``initial_accumulator_value``), each one number for model b. The bool
        options (``nesterov``, ``amsgrad``...) apply to every model and are not
        set here. The new values are validated as the constructor validates
        them, together with the rest of the group (e.g. Nesterov momentum needs
        a momentum for every model); an unknown name raises TypeError listing
        the valid ones, a bad value TypeError or ValueError, and nothing is
        written then.

        The values are written in place into the ``[B]`` hyperparameter rows
        (the other models' values and the memory are kept), and the group is
        re-validated, so that a value switches on work that every model had
        off (weight decay, momentum); where it does, or switches work off, the
        group's ``[B]`` rows become new tensor objects viewing the same memory,
        so that a compiled step traces again and a captured one re-captures. A momentum switched on for
        model b continues as torch's optimizer would after the same change (see
        the class docstring: SGD's buffer starts from the next gradient unless
        model b had one before); call :meth:`reset_state` too for a new model's
        state. The records of exact learning rates are kept consistent: model
        b's entry of the optimizer's record of the learning rates given, and of
        ``scheduled_lr`` (where a scheduler recorded it), becomes its new ``lr``
        (the Python value given, not its float32 rounding), and so does its entry
        of ``initial_lr``, the start of its new schedule, unless a scheduler
        that sets the learning rate itself, irrespective of the optimizer's,
        owns that entry: ``OneCycleLR`` and ``CyclicLR`` mark their groups with
        ``group["initial_lr_owner"]`` (their class name), and there
        ``initial_lr`` stays the schedule's own endpoint (``OneCycleLR``'s
        ``max_lr / div_factor``, which its every step reads; ``CyclicLR``'s
        ``base_lr``) while the new ``lr`` holds until the scheduler's next step
        overwrites it, as it would with torch's schedulers.
        """
        name = f"{type(self).__name__}.set_hyperparameters"
        b = self._check_model(b, "set_hyperparameters")
        valid = self._hypers + self._init_hypers
        unknown = [k for k in values if k not in valid]
        if unknown:
            shared = [k for k in unknown if k in self._flags + self._compat]
            note = (f"; {shared} apply to every model of a group: assign group[...] instead"
                    if shared else "")
            raise TypeError(
                f"{name}: unknown hyperparameter(s) {unknown}; {type(self).__name__} takes {list(valid)} "
                f"per model{note}"
            )
        if group is None:
            groups = list(self.param_groups)
        else:
            if isinstance(group, bool) or not isinstance(group, numbers.Integral):
                raise TypeError(f"{name}: group must be a param group index or None, got {type(group).__name__}")
            if not 0 <= group < len(self.param_groups):
                raise ValueError(
                    f"{name}: group must be in [0, {len(self.param_groups)}) (the param groups), got {group}"
                )
            groups = [self.param_groups[group]]
        # Model b's new value of each row, validated as the constructor validates.
        new_rows: dict[str, float] = {}
        for k, value in values.items():
            pair = self._spec.pair(k)
            if pair:
                np = sys.modules.get("numpy")
                one_d = isinstance(value, torch.Tensor) or (np is not None and isinstance(value, np.ndarray))
                is_pair = isinstance(value, (tuple, list)) or (one_d and value.ndim == 1)
                if not is_pair or len(value) != 2:
                    raise ValueError(f"{name}: {k} must be a pair of numbers for model {b}, got {value!r}")
                for j, row in enumerate(pair):
                    new_rows[row] = self._one_value(value[j], f"{k}[{j}]", b, name)
            else:
                new_rows[k] = self._one_value(value, k, b, name)
        plans = []
        for g in groups:
            checked = self._check_group(g)
            candidate = dict(g)
            rows = {
                r: self._hyper(_stored(g, r, self._spec), r).clone()
                for r in self._spec.rows + self._init_hypers
            }
            for row, v in new_rows.items():
                rows[row][b] = v
            for k in valid:
                pair = self._spec.pair(k)
                candidate[k] = tuple(rows[r] for r in pair) if pair else rows[k]
            plans.append((g, checked, self._validate_group(candidate)))
        # Everything is valid: write.
        for g, checked, per_model in plans:
            with torch.no_grad():
                for row in new_rows:
                    _stored(g, row, self._spec)[b].fill_(float(per_model[row][b]))
            # Re-validated: which work some model needs (weight decay, momentum) follows
            # the new values. Where that changes, the group gets new views of the same
            # memory, so that a compiled step traces again (a captured one re-captures).
            nonzero = {k: bool((v != 0).any()) for k, v in per_model.items()}
            if nonzero != checked.nonzero:
                self._store(g, checked.table, nonzero)
            if "lr" in new_rows:
                # The exact learning rates (the optimizer's record of those given, the schedulers'
                # of those set) are used only while they round to group["lr"]: model b's entry
                # follows, so the others keep theirs.
                given_lr = self.__dict__.setdefault("_given_lr", {})
                entry = given_lr.get(id(g))
                if entry is not None and entry[0] is g and _is_lr_record(entry[1], self.B):
                    given = entry[1].clone()
                    given[b] = float(per_model["lr"][b])
                    given_lr[id(g)] = (g, given)
                # initial_lr follows too, unless a scheduler owns it as a schedule endpoint.
                records = (_LR_RECORD,) if g.get(_INITIAL_LR_OWNER) else (_LR_RECORD, "initial_lr")
                for record in records:
                    old = g.get(record)
                    if isinstance(old, torch.Tensor) and old.shape == (self.B,) and old.is_floating_point():
                        new = old.clone()
                        new[b] = float(per_model["lr"][b])
                        g[record] = new

    def _one_value(self, value: Any, label: str, b: int, who: str) -> float:
        """One model's value of a hyperparameter, checked as the constructor checks values."""
        np = sys.modules.get("numpy")
        if isinstance(value, torch.Tensor) or (np is not None and isinstance(value, np.ndarray)):
            if value.ndim > 1 or (value.ndim == 1 and len(value) != 1):
                raise TypeError(
                    f"{who}: {label} must be one number for model {b}, got shape {list(value.shape)}"
                )
            value = value.reshape(())
        elif isinstance(value, (list, tuple)):
            raise TypeError(f"{who}: {label} must be one number for model {b}, got {value!r}")
        try:
            return float(hyper(value, 1, label)[0])
        except TypeError:
            raise TypeError(
                f"{who}: {label} must be one real number for model {b}, got {type(value).__name__} {value!r}"
            ) from None
        except ValueError:
            # A real number the constructor rejects: said of model b's one value,
            # not of the B-vector the constructor would have made of it.
            number = float(value)
            problem = "must not be NaN" if number != number else "must be >= 0"
            raise ValueError(f"{who}: {label} {problem} for model {b}, got {number}") from None

    # ---- state dict ---------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or change nothing.

        Everything is validated before anything changes: the number of param
        groups and of their parameters, every group's hyperparameters and flags
        (as at construction), and every state entry (a known name, a tensor of
        the parameter's shape, ``[B]`` for ``step``, of a real dtype). A state
        that does not fit raises a ValueError or TypeError naming what was
        expected and what came, and the optimizer stays as it was. State
        tensors are copied to the parameters' device in the state dtype
        (float32 for bfloat16/float16 parameters); hyperparameters are stored
        on the parameters' device. torch's implementation keywords missing
        from an older state take their defaults.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{type(self).__name__}.load_state_dict: expected a dict with 'state' and 'param_groups', "
                f"got {type(state_dict).__name__}"
            )
        self.__dict__.setdefault("_given_lr", {})
        kept = {k: self.__dict__[k] for k in ("state", "param_groups", "_checked", "_given_lr", "B", "_device")}
        # The exact learning rates given to this optimizer, group by group: a loaded group's
        # float32 learning rates that are their rounding go on from them (see _place_loaded_state).
        self._lr_before_load = [self._exact_lr(g) for g in self.param_groups]
        # Appended pre-hook: runs after the user's; prepended post-hook: before the user's.
        pre = self.register_load_state_dict_pre_hook(_validate_loaded)
        post = self.register_load_state_dict_post_hook(_place_state, prepend=True)
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            # Only a user's hook can fail once the state is validated; it must not
            # leave half a state behind either.
            self.__dict__.update(kept)
            raise
        finally:
            pre.remove()
            post.remove()
            self.__dict__.pop("_lr_before_load", None)

    def _validated_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """``state_dict``, checked against this optimizer, with its parameter state converted and shielded.

        Raises before the optimizer changes; what it returns loads without error.
        """
        name = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{name}: expected a dict with 'state' and 'param_groups', got {type(state_dict).__name__}")
        missing = [k for k in ("state", "param_groups") if k not in state_dict]
        if missing:
            raise ValueError(f"{name}: the state dict has no {missing} entry; expected 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(saved_groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in saved_groups):
            raise TypeError(f"{name}: expected 'param_groups' to be a list of dicts, got {saved_groups!r}")
        if not isinstance(saved_state, Mapping):
            raise TypeError(f"{name}: expected 'state' to be a dict, got {type(saved_state).__name__}")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{name}: the state has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        required = self._hypers + self._init_hypers + self._flags
        groups, id_map = [], {}
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            ids = saved.get("params")
            if not isinstance(ids, (list, tuple)) or len(ids) != len(group["params"]):
                got = len(ids) if isinstance(ids, (list, tuple)) else repr(ids)
                raise ValueError(
                    f"{name}: param_groups[{i}] of the state has {got} parameters, this optimizer's has "
                    f"{len(group['params'])}"
                )
            absent = [k for k in required if k not in saved]
            if absent:
                raise ValueError(
                    f"{name}: param_groups[{i}] of the state has no {absent} (expected the entries "
                    f"{list(required)} of {type(self).__name__}; is it another optimizer's state?)"
                )
            groups.append({**{k: _COMPAT_DEFAULTS[k] for k in self._compat}, **saved})
            id_map.update(zip(ids, group["params"]))
        # Entries every started state holds: the next step would make a missing one from zeros
        # beside the others' history (a step count of 0 beside moments of many steps). Entries kept
        # only where a value switches them on (momentum buffers, amsgrad's maximum, SGD's step
        # counts) may be missing: switched on since the last step, they start at the next one.
        spec = self._spec
        complete = ("step",) * (not spec.steps_when) + tuple(key for _, key, when in spec.states if not when)
        state = {}
        for key, entries in saved_state.items():
            p = id_map.get(key)
            if p is None:  # state of no parameter: kept as saved, as torch keeps it
                state[key] = entries
                continue
            if not isinstance(entries, Mapping):
                raise TypeError(
                    f"{name}: the state of parameter {key!r} must be a dict of tensors, got {type(entries).__name__}"
                )
            state[key] = {k: _Shielded(self._loaded_state_tensor(p, k, v, key)) for k, v in entries.items()}
            missing = [k for k in complete if k not in entries]
            if entries and missing:
                raise ValueError(
                    f"{name}: the state of parameter {key!r} has {sorted(entries)} but not {missing}; a "
                    f"started {type(self).__name__} state holds {list(complete)} (is it a partial state?)"
                )
        for group, loaded in zip(self.param_groups, groups):
            self._validate_group({**loaded, "params": group["params"]})
        return {**state_dict, "param_groups": groups, "state": state}

    def _loaded_state_tensor(self, p: torch.Tensor, key: str, value: Any, param_id: Any) -> torch.Tensor:
        """A saved state entry checked against its parameter, as a new tensor on its device and in its dtype."""
        name = f"{type(self).__name__}.load_state_dict"
        if key not in self._state_names:
            raise ValueError(
                f"{name}: unknown state entry {key!r} for parameter {param_id!r}; "
                f"{type(self).__name__} keeps {list(self._state_names)}"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name}: state entry {key!r} of parameter {param_id!r} must be a tensor, got {type(value).__name__}"
            )
        if value.dtype == torch.bool or value.is_complex() or (not value.is_floating_point() and key != "step"):
            raise TypeError(
                f"{name}: state entry {key!r} of parameter {param_id!r} must be a floating-point tensor, "
                f"got {value.dtype}"
            )
        expected = (p.size(0),) if key == "step" else tuple(p.shape)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"{type(self).__name__}: loaded state {key!r} of shape {list(value.shape)} does not fit a "
                f"parameter of shape {list(p.shape)} (expected {list(expected)})"
            )
        dtype = torch.float32 if key == "step" else acc_dtype(p.dtype)
        return value.to(device=p.device, dtype=dtype, copy=True)

    def _place_loaded_state(self) -> None:
        for state in self.state.values():
            if isinstance(state, dict):
                for key, value in state.items():
                    if isinstance(value, _Shielded):
                        state[key] = value.value
        self._checked = {}
        for group in self.param_groups:
            # The schedulers' record of exact learning rates is a host record: a checkpoint loaded
            # with torch.load(map_location="cuda") brings it on the device, where the schedulers
            # would not read it (a resume would go on from the float32 rounding).
            record = group.get(_LR_RECORD)
            if (isinstance(record, torch.Tensor) and record.dtype == torch.float64 and record.shape == (self.B,)
                    and record.device.type != "cpu"):
                group[_LR_RECORD] = record.cpu()
        # The loaded groups are new dicts. Their exact learning rates are those a scheduler saved
        # (scheduled_lr), else those given to this optimizer, for the models whose loaded learning
        # rate is their rounding (_record_lr); else the loaded values.
        self._given_lr = {}
        for group, exact in zip(self.param_groups, self.__dict__.get("_lr_before_load") or ()):
            if exact is not None:
                self._given_lr[id(group)] = (group, exact)
        for group in self.param_groups:
            self._check_group(group)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(B=self.B, skip_nonfinite=self.skip_nonfinite, _device=self._device,
                     _given_lr=list(self.__dict__.get("_given_lr", {}).values()))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("B", None)
        self.__dict__.setdefault("skip_nonfinite", False)
        self.__dict__.setdefault("_device", None)
        self.__dict__.setdefault("last_skipped", None)
        self.__dict__.setdefault("_skipped_out", None)
        self.__dict__.setdefault("_checked", {})
        # Keyed by the id of a group, which a copy (deepcopy, pickle) has anew.
        given = self.__dict__.get("_given_lr")
        self._given_lr = {id(g): (g, v) for g, v in given} if isinstance(given, list) else {}
        for group in self.param_groups:  # pickled before the implementation keywords existed
            for k in self._compat:
                group.setdefault(k, _COMPAT_DEFAULTS[k])
