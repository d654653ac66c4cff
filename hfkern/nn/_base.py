"""ArrayModule: the base of every hfkern.nn module.

An array module holds B models of its ``torch.nn`` namesake. Its ``state_dict``
has exactly the namesake's keys, each entry the B models' tensors stacked on a
new leading dim, which is what makes :meth:`ArrayModule.from_modules` and
:meth:`ArrayModule.to_modules` generic.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Iterable, Sequence

import torch
from torch import nn

from .._array import check_B

__all__ = ["ArrayModule"]


def _read_field(module: nn.Module, field: str) -> Any:
    value = getattr(module, field)
    if field == "bias" and not isinstance(value, bool):
        return value is not None  # torch says bias=False by registering bias as None
    return tuple(value) if isinstance(value, list) else value


def torch_module(cls: type[nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``cls(*args, **kwargs)``, also where the installed torch lacks a ``bias`` argument.

    GroupNorm and BatchNorm take ``bias`` only in recent torch releases (torch 2.11
    has none). There the module is built without it and ``bias=False`` is expressed
    as torch itself expresses it, a ``bias`` parameter registered as None.
    """
    if "bias" in kwargs and "bias" not in inspect.signature(cls.__init__).parameters:
        bias = kwargs.pop("bias")
        module = cls(*args, **kwargs)
        if not bias:
            module.register_parameter("bias", None)
        return module
    return cls(*args, **kwargs)


class ArrayModule(nn.Module):
    """Base class: B models of ``_torch_cls`` fused along a leading array dim.

    Subclasses set ``_torch_cls`` (the namesake) and ``_config_fields`` (the
    namesake's constructor arguments, read back as attributes of the same name
    from either a torch module or an array module), and accept ``B`` keyword-only.
    """

    _torch_cls: ClassVar[type[nn.Module]]
    _config_fields: ClassVar[tuple[str, ...]] = ()
    B: int | None

    def _set_B(self, B: int | None, *, required: bool) -> None:
        if B is None and required:
            raise TypeError(f"{type(self).__name__}: the keyword argument B (array size) is required")
        self.B = None if B is None else check_B(B)

    # ---- configuration --------------------------------------------------
    @classmethod
    def _config_of(cls, module: nn.Module) -> dict[str, Any]:
        """The namesake constructor's keyword arguments that describe ``module``."""
        return {f: _read_field(module, f) for f in cls._config_fields}

    def extra_repr(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self._config_of(self).items())
        return f"B={self.B}" + (f", {cfg}" if cfg else "")

    def _factory_kwargs(self) -> dict[str, Any]:
        t = next(iter(self.parameters()), None)
        if t is None:
            t = next((b for b in self.buffers() if b.is_floating_point()), None)
        return {} if t is None else {"device": t.device, "dtype": t.dtype}

    # ---- conversion -----------------------------------------------------
    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> "ArrayModule":
        """Build an array of ``len(modules)`` models from torch modules.

        Parameters and buffers are copied (stacked on a new leading dim); the
        train/eval mode is taken from the modules, which must all agree. Modules
        whose configurations differ raise ValueError naming the field.
        """
        modules = list(modules)
        name = cls.__name__
        if not modules:
            raise ValueError(f"{name}.from_modules: expected at least one module, got an empty sequence")
        for i, m in enumerate(modules):
            if not isinstance(m, cls._torch_cls):
                raise TypeError(
                    f"{name}.from_modules: expected torch.nn.{cls._torch_cls.__name__} modules, "
                    f"got {type(m).__name__} at index {i}"
                )
        ref_cfg = cls._config_of(modules[0])
        ref_sd = modules[0].state_dict()
        for i, m in enumerate(modules[1:], start=1):
            cfg = cls._config_of(m)
            for field, value in ref_cfg.items():
                if cfg[field] != value:
                    raise ValueError(
                        f"{name}.from_modules: field {field!r} differs: module 0 has {value!r}, "
                        f"module {i} has {cfg[field]!r}"
                    )
            if m.training != modules[0].training:
                raise ValueError(
                    f"{name}.from_modules: field 'training' differs: module 0 has "
                    f"{modules[0].training}, module {i} has {m.training}"
                )
            for key, t in m.state_dict().items():
                ref = ref_sd[key]
                for attr in ("shape", "dtype", "device"):
                    if getattr(t, attr) != getattr(ref, attr):
                        raise ValueError(
                            f"{name}.from_modules: {attr} of {key!r} differs: module 0 has "
                            f"{getattr(ref, attr)}, module {i} has {getattr(t, attr)}"
                        )
        factory = {}
        first = next(iter(ref_sd.values()), None)
        floats = [t for t in ref_sd.values() if t.is_floating_point()]
        if first is not None:
            factory["device"] = first.device
        if floats:
            factory["dtype"] = floats[0].dtype
        array = cls(**ref_cfg, B=len(modules), **factory)
        with torch.no_grad():
            stacked = {
                key: torch.stack([m.state_dict()[key] for m in modules])
                for key in array.state_dict()
            }
        array.load_state_dict(stacked)
        return array.train(modules[0].training)

    def to_modules(self) -> list[nn.Module]:
        """The B models as torch modules of the namesake class.

        Model b's ``state_dict()`` equals this array's entries at index b
        (copies, not views); the modules share this array's train/eval mode.
        """
        if self.B is None:
            raise ValueError(
                f"{type(self).__name__}.to_modules: the array size is unknown; construct it with B=..."
            )
        config = self._config_of(self)
        state = self.state_dict()
        out = []
        for b in range(self.B):
            m = torch_module(self._torch_cls, **config, **self._factory_kwargs())
            with torch.no_grad():
                m.load_state_dict({k: v[b].clone() for k, v in state.items()})
            out.append(m.train(self.training))
        return out


def stack_init(params: Iterable[torch.Tensor], init_fn) -> None:
    """Run ``init_fn(*slices)`` on each model's slice of ``params``, under no_grad.

    Each model draws independently from the distribution torch's namesake uses,
    because ``init_fn`` is called with that model's per-model-shaped views (so
    fan-in and fan-out are the namesake's).
    """
    params = list(params)
    with torch.no_grad():
        for b in range(params[0].shape[0]):
            init_fn(*(p[b] if p is not None else None for p in params))
