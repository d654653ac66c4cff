"""ArrayModule: the base of every hfkern.nn module.

An array module holds B models of its ``torch.nn`` namesake. Its ``state_dict``
has exactly the namesake's keys, each entry the B models' tensors stacked on a
new leading dim, which is what makes :meth:`ArrayModule.from_modules` and
:meth:`ArrayModule.to_modules` generic.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Iterable, Sequence

import torch
from torch import nn
from torch.nn import init

from .._array import check_B

__all__ = ["ArrayModule", "StateDictError"]


class StateDictError(RuntimeError, ValueError):
    """A state dict that :meth:`ArrayModule.load_state_dict` rejected before changing anything.

    A RuntimeError, as ``torch.nn.Module.load_state_dict`` raises, and a
    ValueError, as hfkern raises for every bad input.
    """


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
    # Configuration fields that may differ between the B models (dropout
    # probabilities): from_modules gathers differing values into a length-B
    # tuple, to_modules hands model b its entry b.
    _per_model_fields: ClassVar[tuple[str, ...]] = ()
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

        Parameters and buffers are copied (stacked on a new leading dim), each
        parameter keeps its ``requires_grad``; the train/eval mode is taken from
        the modules. Modules whose configurations differ raise ValueError naming
        the field, except the per-model hyper-parameters (``_per_model_fields``,
        e.g. a dropout probability), which become one value per model; modules
        that disagree on a parameter's ``requires_grad`` or on the mode raise
        ValueError too.
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
        configs = [cls._config_of(m) for m in modules]
        ref_cfg = dict(configs[0])
        ref_sd = modules[0].state_dict()
        ref_grad = {k: p.requires_grad for k, p in modules[0].named_parameters()}
        for i, (m, cfg) in enumerate(zip(modules[1:], configs[1:]), start=1):
            for field, value in configs[0].items():
                if cfg[field] != value and field not in cls._per_model_fields:
                    raise ValueError(
                        f"{name}.from_modules: field {field!r} differs: module 0 has {value!r}, "
                        f"module {i} has {cfg[field]!r}"
                    )
            if m.training != modules[0].training:
                raise ValueError(
                    f"{name}.from_modules: field 'training' differs: module 0 has "
                    f"{modules[0].training}, module {i} has {m.training}"
                )
            for key, p in m.named_parameters():
                if key in ref_grad and p.requires_grad != ref_grad[key]:
                    raise ValueError(
                        f"{name}.from_modules: field '{key}.requires_grad' differs: module 0 has "
                        f"{ref_grad[key]}, module {i} has {p.requires_grad} (parameter {key!r} is "
                        "trainable in some models and frozen in others)"
                    )
            for key, t in m.state_dict().items():
                ref = ref_sd[key]
                for attr in ("shape", "dtype", "device"):
                    if getattr(t, attr) != getattr(ref, attr):
                        raise ValueError(
                            f"{name}.from_modules: {attr} of {key!r} differs: module 0 has "
                            f"{getattr(ref, attr)}, module {i} has {getattr(t, attr)}"
                        )
        for field in cls._per_model_fields:
            values = tuple(cfg[field] for cfg in configs)
            if any(v != values[0] for v in values):
                ref_cfg[field] = values
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
        for key, p in array.named_parameters():
            p.requires_grad_(ref_grad[key])
        return array.train(modules[0].training)

    def to_modules(self) -> list[nn.Module]:
        """The B models as torch modules of the namesake class.

        Model b's ``state_dict()`` equals this array's entries at index b
        (copies, not views), its configuration is this array's with model b's
        value of every per-model hyper-parameter, its parameters have this
        array's ``requires_grad``; the modules share this array's train/eval mode.
        """
        if self.B is None:
            raise ValueError(
                f"{type(self).__name__}.to_modules: the array size is unknown; construct it with B=..."
            )
        config = self._config_of(self)
        state = self.state_dict()
        requires_grad = {k: p.requires_grad for k, p in self.named_parameters()}
        out = []
        for b in range(self.B):
            model_config = {
                k: (v[b] if k in self._per_model_fields and isinstance(v, tuple) else v)
                for k, v in config.items()
            }
            m = torch_module(self._torch_cls, **model_config, **self._factory_kwargs())
            with torch.no_grad():
                m.load_state_dict({k: v[b].clone() for k, v in state.items()})
            for k, p in m.named_parameters():
                p.requires_grad_(requires_grad[k])
            out.append(m.train(self.training))
        return out

    # ---- loading ----------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict``, all or nothing.

        Every entry is checked before anything is written: the keys (with
        ``strict``), that each value is a tensor, its shape ``[B, *per-model
        shape]`` (a different leading dim is reported as a different number of
        models), and that it can be copied (or, with ``assign``, assigned) into
        its parameter or buffer. A state dict that fails any check raises
        :class:`StateDictError` (a RuntimeError, as torch raises, listing every
        problem) and leaves the module exactly as it was. Returns torch's
        ``(missing_keys, unexpected_keys)`` named tuple.

        The checks see the state dict as given: load-state-dict pre-hooks
        registered on the module run only during the load itself.
        """
        if isinstance(state_dict, Mapping):
            missing, unexpected, errors = self._state_dict_problems(state_dict, strict, assign)
            if strict:
                if unexpected:
                    errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(
                        ", ".join(f'"{k}"' for k in unexpected)))
                if missing:
                    errors.insert(0, "Missing key(s) in state_dict: {}. ".format(
                        ", ".join(f'"{k}"' for k in missing)))
            if errors:
                raise StateDictError(
                    "Error(s) in loading state_dict for {}:\n\t{}".format(
                        type(self).__name__, "\n\t".join(errors))
                )
        return super().load_state_dict(state_dict, strict, assign)

    def _fill_legacy_entries(self, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        """Add, in place, entries that older checkpoints of this module lack (none by default).

        Called on a copy of the state dict both by the checks of
        :meth:`load_state_dict` and by the load itself, so both see the same keys.
        """

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        self._fill_legacy_entries(state_dict, prefix, local_metadata)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _state_dict_problems(
        self, state_dict: Mapping[str, Any], strict: bool, assign: bool
    ) -> tuple[list[str], list[str], list[str]]:
        """(missing keys, unexpected keys, errors) that loading ``state_dict`` would meet.

        Walks the modules as ``torch.nn.Module.load_state_dict`` does (every
        occurrence of a shared submodule, each with its own prefix and metadata)
        and applies the checks of torch's ``_load_from_state_dict`` without
        writing anything.
        """
        metadata = getattr(state_dict, "_metadata", None)
        sd = dict(state_dict)
        missing: list[str] = []
        unexpected: list[str] = []
        errors: list[str] = []
        extra_suffix = nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        for path, module in self.named_modules(remove_duplicate=False):
            prefix = path + "." if path else ""
            local_metadata = {} if metadata is None else dict(metadata.get(path, {}))
            if isinstance(module, ArrayModule):
                module._fill_legacy_entries(sd, prefix, local_metadata)
            local = {
                k: v for k, v in module._parameters.items() if v is not None
            }
            local.update({
                k: v for k, v in module._buffers.items()
                if v is not None and k not in module._non_persistent_buffers_set
            })
            B = module.B if isinstance(module, ArrayModule) else None
            for name, param in local.items():
                key = prefix + name
                if key not in sd:
                    if strict:
                        missing.append(key)
                    continue
                problem = _load_problem(key, param, sd[key], B, assign)
                if problem is not None:
                    errors.append(problem)
            extra_key = prefix + extra_suffix
            if type(module).set_extra_state is not nn.Module.set_extra_state:
                if extra_key not in sd and strict:
                    missing.append(extra_key)
            elif strict and extra_key in sd:
                unexpected.append(extra_key)
            if strict:
                for key in sd:
                    if key.startswith(prefix) and key != extra_key:
                        head = key[len(prefix):].split(".", 1)
                        known = module._modules if len(head) > 1 else local
                        if head[0] not in known:
                            unexpected.append(key)
        return missing, unexpected, errors


def _load_problem(key: str, param: torch.Tensor, value: Any, B: int | None, assign: bool) -> str | None:
    """Why ``value`` cannot be loaded into ``param`` (torch's rules), or None if it can."""
    if not torch.overrides.is_tensor_like(value):
        return (
            f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
            f"object from checkpoint but received {type(value)}"
        )
    if param.dim() == 0 and value.dim() == 1 and value.shape[0] == 1:
        value = value[0]  # torch's backward compatibility for 0-d entries
    if value.shape != param.shape:
        if (B is not None and param.dim() >= 1 and param.shape[0] == B
                and value.dim() == param.dim() and value.shape[1:] == param.shape[1:]):
            return (
                f"size mismatch for {key}: the checkpoint holds {value.shape[0]} models of shape "
                f"{list(param.shape[1:])}, this array has B={B}: expected shape {list(param.shape)}, "
                f"got {list(value.shape)}"
            )
        per_model = f" (B={B} models of {list(param.shape[1:])})" if B is not None else ""
        return (
            f"size mismatch for {key}: expected shape {list(param.shape)}{per_model}, "
            f"got {list(value.shape)} from the checkpoint"
        )
    if assign:
        if (isinstance(param, nn.Parameter) and param.requires_grad
                and not (value.is_floating_point() or value.is_complex())):
            return (
                f"cannot assign {key}: the parameter requires grad, which needs a floating point "
                f"or complex tensor, got dtype {value.dtype}"
            )
        return None
    ordinary = (type(value) in (torch.Tensor, nn.Parameter) and value.layout == torch.strided
                and not value.is_meta and not value.is_quantized)
    if ordinary or param.is_meta:
        return None  # a dense tensor with data copies into any dense tensor of the same shape
    try:
        # Anything else (meta, sparse, quantized, tensor-like) is copied once
        # into a scratch tensor: the only sure way to know torch's copy_ accepts it.
        with torch.no_grad():
            torch.empty_like(param).copy_(value)
    except Exception as ex:  # noqa: BLE001 - torch's loader reports any exception the same way
        return (
            f'While copying the parameter named "{key}", whose dimensions in the model are '
            f"{param.size()} and whose dimensions in the checkpoint are {value.size()}, "
            f"an exception occurred : {ex.args}."
        )
    return None


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


def reset_kaiming_uniform(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """torch's default init of Linear and the convolutions, drawn independently for each model.

    Without inputs (fan-in 0) the bias is zero, as Linear makes it (the
    convolutions leave it uninitialized there).
    """

    def reset(w, b):
        init.kaiming_uniform_(w, a=math.sqrt(5))
        if b is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(w)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(b, -bound, bound)

    stack_init([weight, bias], reset)
