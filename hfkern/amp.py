"""Gradient scaling for B models: ``torch.amp.GradScaler`` with one scale per model.

:class:`GradScaler` keeps a ``[B]`` scale and a ``[B]`` growth tracker. Model b's
loss is multiplied by its own scale, its gradients are unscaled by it and
checked for inf/NaN on their own, an overflow skips model b's optimizer step
only (through the array optimizers' ``step(skip=...)``), and each model's scale
backs off or grows by its own history: every model sees exactly what a
``torch.amp.GradScaler`` of its own would do for it alone.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
import warnings
from collections import abc, defaultdict
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from . import graphs
from ._array import check_B, hyper
from .ops import optim as ops
from .utils import _host_to_device

__all__ = ["GradScaler"]


def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _check_factor(name: str, value: Any, *, above: float, below: float = math.inf) -> float:
    """A finite float strictly between ``above`` and ``below`` (a Python or numpy number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"GradScaler: {name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (above < value < below) or not math.isfinite(value):
        expected = f"> {above}" if below == math.inf else f"in ({above}, {below})"
        raise ValueError(f"GradScaler: {name} must be finite and {expected}, got {value}")
    return value


_INT32_MAX = torch.iinfo(torch.int32).max


def _check_interval(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"GradScaler: growth_interval must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"GradScaler: growth_interval must be >= 1, got {value}")
    if value > _INT32_MAX:
        raise ValueError(f"GradScaler: growth_interval must fit int32 (<= {_INT32_MAX}), got {value}")
    return int(value)


def _on_device(values: Tensor, device: torch.device) -> Tensor:
    """``values`` (a host tensor) on ``device``: a fill when every model has the same value,
    which needs no copy from the host."""
    first = values[0].item()
    if bool((values == first).all()):
        return torch.full(values.shape, first, dtype=values.dtype, device=device)
    return _host_to_device(values, device)


class GradScaler:
    """``torch.amp.GradScaler`` for B models at once: one scale and growth tracker per model.

    Args:
        device: the device type the scaler serves (``"cuda"`` or ``"cpu"``); with
            ``"cuda"`` and no CUDA available, the scaler warns and disables itself,
            as torch's does.
        init_scale: each model's initial scale (finite, > 0): a float, a length-B
            sequence, or a ``[B]`` tensor or numpy array.
        growth_factor: (> 1) a model's scale is multiplied by it after
            ``growth_interval`` consecutive steps of that model without inf/NaN.
        backoff_factor: (in (0, 1)) a model's scale is multiplied by it after a
            step where that model's gradients held inf/NaN.
        growth_interval: (int >= 1) see ``growth_factor``.

        The factors and the interval may also be numpy scalars.
        enabled: False makes every method a no-op (``step`` just steps).
        B: the number of models (keyword-only).

    Use it as torch's, with a ``[B]`` loss (one per model)::

        scaler = hfkern.amp.GradScaler("cuda", B=B)
        losses = loss_fn(model(x), y)            # [B]
        scaler.scale(losses).sum().backward()    # model b's gradients scaled by scale[b]
        scaler.unscale_(optimizer)               # optional, e.g. before hfkern.utils.clip_grad_norm_
        scaler.step(optimizer)                   # optimizer.step(skip=found_inf): [B] bool
        scaler.update()

    The optimizer must take ``step(..., skip=mask)`` like the ``hfkern.optim``
    optimizers. ``scale``, ``unscale_``, ``step`` and ``update`` never read a
    device value on the host.

    Per-model reset: :meth:`reset_model` ``(b, init_scale=None)`` starts model b
    over (its scale back to its initial scale, its growth tracker at 0), as a
    new scaler would for a model replaced in a sweep; the other models keep theirs.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float | Sequence[float] | Tensor = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        B: int,
    ) -> None:
        self.B = check_B(B)
        try:
            self._device = torch.device(device).type
        except (RuntimeError, TypeError):
            raise ValueError(
                f"GradScaler: device must be a device type such as 'cuda' or 'cpu', got {device!r}"
            ) from None
        if not isinstance(enabled, bool):
            raise TypeError(f"GradScaler: enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
        self._enabled = enabled
        self._init_scale = self._scale_values(init_scale, "init_scale")
        # Each model's initial scale, kept for reset_model (``_init_scale`` follows loaded states).
        self._initial_scale = self._init_scale.clone()
        self._growth_factor = _check_factor("growth_factor", growth_factor, above=1.0)
        self._backoff_factor = _check_factor("backoff_factor", backoff_factor, above=0.0, below=1.0)
        self._growth_interval = _check_interval(growth_interval)
        self._init_growth_tracker = torch.zeros(self.B, dtype=torch.int32)
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        # Created at the first scale(), on the device of what it scales (as torch's).
        self._scale: Tensor | None = None  # [B] float32
        self._growth_tracker: Tensor | None = None  # [B] int32
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)

    # ---- validation -----------------------------------------------------------
    def _scale_values(self, value: Any, name: str, models: Sequence[int] | None = None) -> Tensor:
        """float32 CPU values of a per-model scale (rounded as torch fills its float32 scale).

        One per model (``[B]``), or one per entry of ``models`` (the indices the
        values belong to, named in the error). A scale of 0 or inf is rejected
        too: unscaling by it turns every gradient into NaN or 0, and backing off
        or growing never leaves it.
        """
        models = list(range(self.B)) if models is None else list(models)
        try:
            t = hyper(value, len(models), name).to(torch.float32)
        except (TypeError, ValueError) as e:
            raise type(e)(f"GradScaler: {e}") from None
        bad = (t == 0) | ~torch.isfinite(t)
        if bad.any():
            raise ValueError(
                f"GradScaler: {name} must be finite and > 0 for every model (in float32); models "
                f"{[models[i] for i in bad.nonzero().flatten().tolist()]} have {t[bad].tolist()}"
            )
        return t

    def _tracker_values(self, value: Any) -> Tensor:
        np = sys.modules.get("numpy")  # a numpy value exists only once numpy is imported
        if np is not None and isinstance(value, np.ndarray):
            if value.dtype.kind not in "iu":
                raise ValueError(f"GradScaler: _growth_tracker must hold ints >= 0, got a {value.dtype} array")
            value = torch.from_numpy(value.astype(np.int64))
        if isinstance(value, Tensor):
            t = value.detach().to("cpu")
            t = t.expand(self.B) if t.dim() == 0 else t
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            t = torch.full((self.B,), int(value))
        elif isinstance(value, Sequence) and not isinstance(value, str):
            if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
                raise ValueError(f"GradScaler: _growth_tracker must hold ints >= 0, got {value!r}")
            t = torch.tensor([int(v) for v in value], dtype=torch.int64)
        else:
            raise TypeError(
                f"GradScaler: _growth_tracker must be an int, a length-B sequence or a [B] tensor, "
                f"got {type(value).__name__}"
            )
        if t.dim() != 1 or t.numel() != self.B:
            raise ValueError(
                f"GradScaler: _growth_tracker must have one value per model (length B={self.B}), "
                f"got shape {list(t.shape)}"
            )
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or (t < 0).any() \
                or (t > _INT32_MAX).any():
            raise ValueError(f"GradScaler: _growth_tracker must hold ints >= 0 that fit int32, got {t.tolist()}")
        return t.to(torch.int32)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Tensor, Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"GradScaler: attempted {funcname} before any scale(). This may indicate your script "
                f"did not use scaler.scale(losses or outputs) earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        self._scale = _on_device(self._init_scale, device)
        self._growth_tracker = _on_device(self._init_growth_tracker, device)

    # ---- scale ------------------------------------------------------------------
    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Tensor | Iterable[Tensor]:
        """Multiply model b's outputs by ``scale[b]``.

        ``outputs``: a tensor whose leading dim is B (typically the ``[B]`` losses)
        or an iterable (list, tuple, nested) of such tensors; returns the same
        structure, scaled. Disabled: returns ``outputs`` unchanged.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return self._scale_one(outputs)

        def apply_scale(val):
            if isinstance(val, Tensor):
                return self._scale_one(val)
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
                scaled = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(scaled)
                return scaled
            raise ValueError(
                f"GradScaler: outputs must be a Tensor or an iterable of Tensors, got {type(val).__name__}"
            )

        return apply_scale(outputs)

    def _scale_one(self, t: Tensor) -> Tensor:
        if t.dim() == 0 or t.size(0) != self.B:
            raise ValueError(
                f"GradScaler: expected outputs with leading (array) dim B={self.B} (e.g. [B] losses), "
                f"got shape {list(t.shape)}"
            )
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(t.device)
        scale = self._scale.to(device=t.device, non_blocking=True).view((self.B,) + (1,) * (t.dim() - 1))
        if t.dtype in (torch.float16, torch.bfloat16):
            # torch multiplies by its float32 scale in float32 and rounds the product once.
            return (t.float() * scale).to(t.dtype)
        if t.is_floating_point() or t.is_complex():
            return t * scale.to(t.dtype)
        return t * scale

    # ---- unscale -------------------------------------------------------------------
    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor) -> dict[torch.device, Tensor]:
        per_device: dict[torch.device, list[Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype == torch.float16:
                    raise ValueError("GradScaler: attempting to unscale FP16 gradients.")
                if grad.is_sparse:
                    raise RuntimeError("GradScaler: sparse gradients are not supported for array parameters")
                if grad.dim() == 0 or grad.size(0) != self.B:
                    raise ValueError(
                        f"GradScaler: expected gradients of shape [B={self.B}, ...], got "
                        f"{list(grad.shape)} (parameter {i} of a group)"
                    )
                per_device[grad.device].append(grad)
        found_inf_per_device = {}
        with torch.no_grad():
            for device, grads in per_device.items():
                # Checked before unscaling, as torch does: a finite gradient times a large
                # inverse scale must not count as an overflow.
                found_inf_per_device[device] = ops.nonfinite_models(grads)
                inv = inv_scale.to(device, non_blocking=True)
                shapes: dict[int, Tensor] = {}
                for g in grads:
                    if g.dim() not in shapes:
                        shapes[g.dim()] = inv.view((self.B,) + (1,) * (g.dim() - 1))
                    g.mul_(shapes[g.dim()])
        return found_inf_per_device

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide model b's slice of every gradient of ``optimizer`` by ``scale[b]``, in place.

        Records which models had an inf/NaN gradient (``[B]`` bool per device).
        Optional, for working on unscaled gradients before :meth:`step` (e.g.
        :func:`hfkern.utils.clip_grad_norm_`); at most once per optimizer between
        two :meth:`update` calls, and not after :meth:`step`.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # torch takes the reciprocal in float64: float32 division can be imprecise under some compile options.
        if self._scale.device.type == "mps":
            inv_scale = self._scale.reciprocal()
        else:
            inv_scale = self._scale.double().reciprocal().float()
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale)
        optimizer_state["stage"] = OptState.UNSCALED
        capture = graphs.capturing()
        if capture is not None:  # see _restore_record
            optimizer_state["capture"] = capture
            graphs.before_replay(self._expect_record, id(optimizer), OptState.READY, None)
            graphs.after_replay(self._restore_record, id(optimizer), OptState.UNSCALED,
                                optimizer_state["found_inf_per_device"], capture)

    # ---- step ------------------------------------------------------------------------
    def _check_optimizer(self, optimizer: Any) -> None:
        step = getattr(optimizer, "step", None)
        if step is None or not hasattr(optimizer, "param_groups"):
            raise TypeError(f"GradScaler: expected an optimizer, got {type(optimizer).__name__}")
        try:
            takes_skip = "skip" in inspect.signature(step).parameters
        except (TypeError, ValueError):
            takes_skip = False
        if not takes_skip:
            raise TypeError(
                f"GradScaler: {type(optimizer).__name__}.step must accept skip= (a [B] bool tensor of "
                f"models to leave untouched), as the hfkern.optim optimizers do"
            )
        opt_B = getattr(optimizer, "B", None)
        if opt_B is not None and opt_B != self.B:
            raise ValueError(f"GradScaler: the scaler has B={self.B} models but the optimizer has B={opt_B}")

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale ``optimizer``'s gradients (unless :meth:`unscale_` did) and step every model without inf/NaN.

        Calls ``optimizer.step(*args, skip=found_inf, **kwargs)``: a model whose
        gradients held inf/NaN is not updated, the others are. A ``skip`` passed
        here is combined with it. Returns what ``optimizer.step`` returns.
        Closures are not supported (as with torch's scaler).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_optimizer(optimizer)
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        user_skip = kwargs.pop("skip", None)
        if user_skip is not None:  # checked before unscale_ divides the gradients
            if not isinstance(user_skip, Tensor) or user_skip.dtype != torch.bool or user_skip.shape != (self.B,):
                got = (f"a tensor of shape {list(user_skip.shape)} and dtype {user_skip.dtype}"
                       if isinstance(user_skip, Tensor) else type(user_skip).__name__)
                error = ValueError if isinstance(user_skip, Tensor) and user_skip.dtype == torch.bool else TypeError
                raise error(f"GradScaler.step: skip must be a [B]=[{self.B}] bool tensor, got {got}")
        capture = graphs.capturing()
        if capture is not None and optimizer_state["stage"] is OptState.UNSCALED:
            made = optimizer_state.get("capture")
            if made is None:
                raise RuntimeError(
                    "GradScaler.step: called while capture_step captures a step, after an unscale_() of this "
                    "optimizer that ran outside the captured step (eagerly): every replay would read the inf "
                    "checks of that one call. Call scaler.unscale_(optimizer) inside the captured step (or "
                    "leave it to step()), or both outside it."
                )
            if made is not capture:  # another captured step's unscale_: its replay must come first
                graphs.before_replay(self._expect_record, id(optimizer), OptState.UNSCALED,
                                     optimizer_state["found_inf_per_device"])
        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        found = list(optimizer_state["found_inf_per_device"].values())
        if not found:
            raise RuntimeError("No inf checks were recorded for this optimizer.")
        skip = found[0]
        for f in found[1:]:
            skip = skip | f.to(skip.device, non_blocking=True)
        if user_skip is not None:
            skip = skip | user_skip.to(skip.device, non_blocking=True)
        retval = optimizer.step(*args, skip=skip, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        if capture is not None:
            graphs.after_replay(self._restore_record, id(optimizer), OptState.STEPPED,
                                optimizer_state["found_inf_per_device"], optimizer_state.get("capture"))
        return retval

    # ---- under capture_step ------------------------------------------------------------
    # unscale_(), step() and update() keep host records (each optimizer's stage since the last
    # update() and its inf checks, the [B] bool tensors that step() and update() read) that a replay
    # of a captured step, running no Python, would not write. So, while a step is captured, each
    # of them has the record it leaves written again after every replay (the inf checks are the
    # tensors made in the capture, which every replay writes), and the stage it found checked
    # before every replay: update() may then run after the captured step as well as in it, and
    # unscale_() in it with step() after it.
    def _restore_record(self, key: int, stage: OptState, found: dict, capture: object) -> None:
        """After a replay: optimizer ``key``'s record as the captured unscale_() or step() left it."""
        self._per_optimizer_states[key] = {"stage": stage, "found_inf_per_device": found, "capture": capture}

    def _reset_records(self) -> None:
        """After a replay: the records as the captured update() left them."""
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _expect_record(self, key: int, stage: OptState, found: dict | None) -> None:
        """Before a replay: optimizer ``key``'s record must be the one the captured unscale_() or
        step() found (where an eager call would raise, or read other inf checks, the replay must
        not run)."""
        record = self._per_optimizer_states.get(key)
        now = OptState.READY if record is None else record["stage"]
        if now is stage and (found is None or record["found_inf_per_device"] is found):
            return
        if stage is OptState.READY:
            done = "step()" if now is OptState.STEPPED else "unscale_()"
            raise RuntimeError(
                f"GradScaler: a captured step that calls unscale_() or step() is replayed after {done} has "
                f"already been called on this optimizer since the last update() (an eager call raises "
                f"there too); call scaler.update() after every step, inside the captured step or after it"
            )
        raise RuntimeError(
            "GradScaler: a captured step whose step() reads the inf checks of another captured step's "
            "unscale_() is replayed without that graph's unscale_() before it since the last update() (an "
            "eager call of that step, another graph of it, or none: the replay would read other inf checks)"
        )

    # ---- update ----------------------------------------------------------------------
    def update(self, new_scale: float | Sequence[float] | Tensor | None = None) -> None:
        """Update each model's scale for the next iteration.

        A model with inf/NaN gradients in any optimizer this iteration has its
        scale multiplied by ``backoff_factor`` and its tracker reset; every other
        model counts one more good step, and at ``growth_interval`` of them its
        scale is multiplied by ``growth_factor`` (unless that overflows float32)
        and its tracker reset. ``new_scale`` (a float, a length-B sequence or
        numpy array, finite and > 0; or a tensor of B or 1 elements on the
        scaler's device type, used as given) sets the scales instead. Call once per iteration, after every :meth:`step`.
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        graphs.note_optimizer(self)  # a captured step re-captures when the factors change
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                if (new_scale.device.type != self._device or new_scale.numel() not in (1, self.B)
                        or new_scale.dim() > 1 or new_scale.requires_grad):
                    raise ValueError(
                        f"GradScaler: new_scale must be a float, a length-B sequence or a [B] (or "
                        f"1-element) tensor on {self._device} without requires_grad, got a tensor of "
                        f"shape {list(new_scale.shape)} on {new_scale.device} "
                        f"(requires_grad={new_scale.requires_grad})"
                    )
                scale.copy_(new_scale.reshape(-1))
            elif isinstance(new_scale, numbers.Real) and not isinstance(new_scale, bool):
                scale.fill_(float(self._scale_values(new_scale, "new_scale")[0]))
            else:
                scale.copy_(_host_to_device(self._scale_values(new_scale, "new_scale"), scale.device))
        else:
            found_infs = [
                found_inf.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if not found_infs:
                raise RuntimeError("No inf checks were recorded prior to update.")
            found_inf = found_infs[0]
            for f in found_infs[1:]:
                found_inf = found_inf | f
            self._update_scale_(scale, growth_tracker, found_inf)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        graphs.after_replay(self._reset_records)  # (while a step is captured: see _restore_record)

    def _update_scale_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        """torch's ``_amp_update_scale_`` for each model at once (it takes one model only)."""
        # float32 scale times a float64 factor, rounded back once, as torch's kernel does.
        wide = scale.double() if scale.device.type != "mps" else scale
        backed_off = (wide * self._backoff_factor).float()
        grown = (wide * self._growth_factor).float()
        successful = growth_tracker + 1
        at_interval = successful == self._growth_interval
        new_scale = torch.where(
            found_inf, backed_off, torch.where(at_interval & torch.isfinite(grown), grown, scale)
        )
        new_tracker = torch.where(found_inf | at_interval, torch.zeros_like(successful), successful)
        scale.copy_(new_scale)
        growth_tracker.copy_(new_tracker)

    def _graph_structure(self) -> tuple:
        """What a captured step (:func:`hfkern.capture_step`) that updates this scaler is specific
        to: the factors and the interval (host values the update computes with) and the device
        tensors it writes (new ones after unpickling)."""
        return (self._growth_factor, self._backoff_factor, self._growth_interval, id(self._scale),
                id(self._growth_tracker))

    # ---- queries and settings ------------------------------------------------------
    def _get_scale_async(self) -> Tensor | None:
        """The ``[B]`` scale tensor on its device (None before the first :meth:`scale`)."""
        return self._scale

    def get_scale(self) -> Tensor:
        """``[B]`` float32 CPU tensor: each model's current scale (ones when disabled).

        Reads the scale on the host (a device sync).
        """
        if not self._enabled:
            return torch.ones(self.B)
        if self._scale is None:
            return self._init_scale.clone()
        return self._scale.detach().to("cpu", copy=True)

    def _get_growth_tracker(self) -> Tensor:
        """``[B]`` int32 CPU tensor: each model's count of consecutive good steps."""
        if not self._enabled:
            return torch.zeros(self.B, dtype=torch.int32)
        if self._growth_tracker is None:
            return self._init_growth_tracker.clone()
        return self._growth_tracker.detach().to("cpu", copy=True)

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = _check_factor("growth_factor", new_factor, above=1.0)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = _check_factor("backoff_factor", new_factor, above=0.0, below=1.0)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = _check_interval(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def reset_model(self, b: int, init_scale: float | None = None) -> None:
        """Start model b over: its scale back to its initial scale (or ``init_scale``), its growth tracker 0.

        ``init_scale``: one number (finite and > 0 in float32), which also
        becomes model b's initial scale for later resets; None uses model b's
        initial scale (the constructor's, or the last one given here). The other
        models' scales and trackers are untouched. Works before the first
        :meth:`scale` too; :meth:`state_dict` shows the new values. Call it at
        the start of an iteration or after :meth:`update` (not between
        :meth:`unscale_`/:meth:`step` and :meth:`update`, where model b's
        gradients are scaled by its old scale). No device value is read. A
        disabled scaler only checks the arguments.
        """
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"GradScaler.reset_model: expected a model index b (an int in [0, {self.B})), "
                            f"got {type(b).__name__} {b!r}")
        if not 0 <= b < self.B:
            raise ValueError(f"GradScaler.reset_model: expected a model index b in [0, {self.B}), got {b}")
        b = int(b)
        initial = self._initial_scale.clone()
        if init_scale is not None:
            # A 0-d tensor or numpy value counts as one number; a sequence does not.
            if isinstance(init_scale, (str, bytes, abc.Sequence)) or getattr(init_scale, "ndim", 0) != 0:
                raise TypeError(
                    f"GradScaler.reset_model: init_scale must be one number for model {b}, got {init_scale!r}"
                )
            initial[b] = self._scale_values(init_scale, f"init_scale of model {b}", models=[b])[0]
        if not self._enabled:
            return
        if any(state["stage"] is not OptState.READY for state in self._per_optimizer_states.values()):
            raise RuntimeError(
                "GradScaler.reset_model: called between unscale_()/step() and update(); model b's "
                "gradients of this iteration were scaled by its old scale. Call it after update()."
            )
        self._initial_scale = initial
        value = float(initial[b])
        if self._scale is None:
            # Not on a device yet: the values the first scale() starts from.
            init, tracker = self._init_scale.clone(), self._init_growth_tracker.clone()
            init[b], tracker[b] = value, 0
            self._init_scale, self._init_growth_tracker = init, tracker
        else:
            self._scale[b].fill_(value)
            self._growth_tracker[b].fill_(0)

    # ---- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's keys with per-model entries stacked: ``scale`` ``[B]`` float32 and
        ``_growth_tracker`` ``[B]`` int32 (CPU tensors), ``growth_factor``,
        ``backoff_factor``, ``growth_interval``. Empty when disabled. Reads the
        device values (a sync); call it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; ``scale`` and ``_growth_tracker`` may also be one
        value for every model (the format of ``torch.amp.GradScaler.state_dict``).

        Every entry is validated before anything changes (a bad one raises a
        ValueError or TypeError and leaves the scaler as it was): ``scale`` finite
        and > 0, ``_growth_tracker`` ints in [0, 2**31), the factors and the
        interval as in the constructor. No-op when disabled."""
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"GradScaler: expected a state dict (a dict), got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(f"GradScaler: state_dict is missing {missing}; expected keys {list(keys)}")
        # Everything is validated before anything is changed.
        scale = self._scale_values(state_dict["scale"], "scale")
        tracker = self._tracker_values(state_dict["_growth_tracker"])
        growth_factor = _check_factor("growth_factor", state_dict["growth_factor"], above=1.0)
        backoff_factor = _check_factor("backoff_factor", state_dict["backoff_factor"], above=0.0, below=1.0)
        growth_interval = _check_interval(state_dict["growth_interval"])
        self._init_scale = scale
        self._init_growth_tracker = tracker
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval
        if self._scale is not None:
            self._scale.copy_(_host_to_device(scale, self._scale.device))
        if self._growth_tracker is not None:
            self._growth_tracker.copy_(_host_to_device(tracker, self._growth_tracker.device))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise RuntimeError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, "
                    "or at the end after scaler.update()."
                )
            # The device tensors are recreated at the next scale(), on that call's device.
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_initial_scale" not in self.__dict__:  # pickled before reset_model existed
            self._initial_scale = self._init_scale.clone()
