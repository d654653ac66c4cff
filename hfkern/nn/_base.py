"""ArrayModule: the base of every hfkern.nn module.

An array module holds B models of its ``torch.nn`` namesake. Its ``state_dict``
has exactly the namesake's keys, each entry the B models' tensors stacked on a
new leading dim, which is what makes :meth:`ArrayModule.from_modules`,
:meth:`ArrayModule.to_modules` and the per-model surgery
(:meth:`ArrayModule.load_model`, :meth:`ArrayModule.extract_model`,
:meth:`ArrayModule.reset_model`) generic.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn import init

from .._array import check_B, check_memory_format

__all__ = ["ArrayModule", "StateDictError", "set_memory_format"]


def set_memory_format(module: nn.Module, memory_format: torch.memory_format | None) -> nn.Module:
    """Keep the array images of every 2-D array conv in ``module`` in ``memory_format``.

    ``torch.channels_last`` stores each conv's images as ``[N, H, W, B, C]``
    memory (the grouped view ``[N, B*C, H, W]`` channels-last, which cuDNN's
    grouped convolutions read and write without conversions) and its weight to
    match; ``torch.contiguous_format`` as ``[N, B, C, H, W]``; None lets each
    conv choose by committed measurements (:mod:`hfkern._evidence`), keeping
    its input's memory otherwise. The models compute the same in every format,
    up to the rounding of the convolution algorithms. Works on any module tree
    (an ``nn.Sequential`` of array modules included); ``array_model.to(
    memory_format=...)`` calls it. Change formats before building the
    optimizer: state it already holds keeps the old strides. Returns ``module``.
    """
    check_memory_format("set_memory_format", memory_format, allow_none=True)
    for m in module.modules():
        setter = getattr(m, "_set_memory_format", None)
        if setter is not None:
            setter(memory_format)
    return module


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


def _holds_state(value: Any) -> bool:
    """Whether ``value`` is a torch module with parameters or buffers (a layer's activation given
    as ``nn.PReLU()``): one such module cannot serve B models, each of which has its own."""
    return (isinstance(value, nn.Module) and not isinstance(value, ArrayModule)
            and (next(value.parameters(), None) is not None or next(value.buffers(), None) is not None))


def _array_class(torch_cls: type) -> "type[ArrayModule] | None":
    """The hfkern.nn array class that holds B ``torch_cls`` models, or None where there is none."""
    pending = list(ArrayModule.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        # hfkern.nn's own classes only, not a subclass defined elsewhere (a fused model, a test's)
        if cls.__dict__.get("_torch_cls") is torch_cls and cls.__module__.startswith(__package__ + "."):
            return cls
    return None


def _array_child(module: "ArrayModule", field: str, value: Any) -> bool:
    """Whether the configuration field ``field`` of ``module`` is one of its own array submodules
    (a layer's activation given as ``hfkern.nn.PReLU(B=B)``). Such a field is not a setting the B
    models share: model b's value is that submodule's model b, and the submodule's class,
    configuration, parameters and buffers are checked, copied and extracted as the submodule's."""
    return isinstance(value, ArrayModule) and module._modules.get(field) is value


def _same_setting(a: Any, b: Any) -> bool:
    """Whether two configuration values agree. Stateless modules (a layer's activation given as
    ``nn.GELU()``) agree when they are of one class with equal settings; other values by ``==``.
    Modules with parameters or buffers never agree: their state is per model (see
    :meth:`ArrayModule.from_modules`, which makes them one array module)."""
    if isinstance(a, nn.Module) or isinstance(b, nn.Module):
        if a is b:
            return True
        if type(a) is not type(b) or any(True for _ in a.parameters()) or any(True for _ in a.buffers()) \
                or any(True for _ in b.parameters()) or any(True for _ in b.buffers()):
            return False

        def settings(m: nn.Module) -> dict:
            return {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}

        return settings(a) == settings(b) and a._modules.keys() == b._modules.keys() and all(
            _same_setting(x, y) for x, y in zip(a._modules.values(), b._modules.values()))
    return a == b


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module.get_submodule(path)``, or None where there is none."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def raise_model_error(who: str, input: torch.Tensor, model_call: Callable[[], Any],
                      error: BaseException | None = None) -> None:
    """Raise the error torch raises for one model's call, where an array module's kernel ran on a
    view of its input that the user never passed (the folded ``[B*N, C, H, W]`` of a pooling, the
    grouped ``[N, B*C, H, W]`` of a convolution) or returned what torch refuses.

    ``model_call()`` runs the namesake's computation on model 0's input ``input[0]`` (``input``: the
    array input as given), under no_grad. Where it raises a built-in exception (torch's
    RuntimeError, ...), one of the same type is raised with ``who`` and the shapes of ``input[0]``
    and ``input`` added to torch's message; an exception of a type of torch's own is raised as it
    is. Where it passes, ``error`` (the array kernel's error, if any) is raised; without one this
    returns. An out-of-memory ``error`` is raised as it is: it does not depend on the shapes.
    """
    if isinstance(error, torch.OutOfMemoryError):
        raise error
    try:
        with torch.no_grad():
            model_call()
    except Exception as ex:  # noqa: BLE001 - whatever torch raises for one model is the error
        kind = type(ex)
        if kind.__module__ != "builtins" or isinstance(ex, torch.OutOfMemoryError):
            raise
        raise kind(
            f"{who}: {ex} (torch's error for model 0's input of shape {list(input.shape[1:])}; "
            f"the array input has shape {list(input.shape)})"
        ) from ex
    if error is not None:
        raise error


def _persistent_buffers(module: nn.Module) -> list[str]:
    """The names of ``module``'s persistent buffers (those its state dict holds)."""
    return [
        f"{path}.{k}" if path else k
        for path, m in module.named_modules()
        for k, v in m._buffers.items()
        if v is not None and k not in m._non_persistent_buffers_set
    ]


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device | str | None, who: str) -> Iterator[None]:
    """Run the body with torch's generators for ``device`` seeded by ``seed``, then restore them.

    With ``seed=None`` the body draws from the global RNG as usual. Otherwise it
    runs under ``torch.random.fork_rng`` with the CPU generator (and, for a CUDA
    ``device``, that device's) seeded, so a model built in it equals one built
    after ``torch.manual_seed(seed)`` while the global RNG is left as it was.
    Only those generators are seeded: ``torch.manual_seed`` would also queue
    seeds for CUDA devices that ``fork_rng`` does not restore.
    """
    if seed is None:
        yield
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{who}: seed must be an int or None, got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"{who}: seed must be in [-2**63, 2**64) as torch.manual_seed takes, got {seed}")
    device = torch.device(device if device is not None else "cpu")
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.random.default_generator.manual_seed(int(seed))
        if cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(int(seed))
        yield


def _with_slot(value: Any, b: int, new: Any, B: int) -> Any:
    """A per-model field ``value`` (one value, or a tuple of B) with model b's set to ``new``.

    One value when all B agree, as :meth:`ArrayModule.from_modules` stores it.
    """
    values = list(value) if isinstance(value, tuple) else [value] * B
    values[b] = new
    return values[0] if all(v == values[0] for v in values) else tuple(values)


def _zero_slot_(param: torch.Tensor, b: int) -> None:
    """Zero model b's part of ``param.grad`` (under no_grad)."""
    grad = param.grad
    if grad.is_sparse:
        grad = grad.coalesce()
        keep = grad.indices()[0] != b
        param.grad = torch.sparse_coo_tensor(
            grad.indices()[:, keep], grad.values()[keep], grad.shape, is_coalesced=True
        )
    else:
        grad[b].zero_()


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


@contextlib.contextmanager
def keeping_rng(device: Any = None) -> Iterator[None]:
    """Build modules whose random initial values are all overwritten (from the models' state):
    torch's random generators (the CPU's and, for a CUDA ``device``, that device's) are as
    they were afterwards, so that fusing or extracting models draws nothing that later
    dropout masks or initializations would have drawn."""
    devices = []
    if device is not None and torch.device(device).type == "cuda":
        index = torch.device(device).index
        devices = [index if index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        yield


class ArrayModule(nn.Module):
    """Base class: B models of ``_torch_cls`` fused along a leading array dim.

    Subclasses set ``_torch_cls`` (the namesake) and ``_config_fields`` (the
    namesake's constructor arguments, read back as attributes of the same name
    from either a torch module or an array module), and accept ``B`` keyword-only.

    Per-model surgery (a sweep replacing one trial while the others train on):

    * :meth:`load_model` ``(b, module)`` copies a torch module of the namesake
      class into slot b (parameters and buffers, written in place: the
      parameters stay the same objects, so an optimizer holding them goes on
      working); the other slots are untouched.
    * :meth:`extract_model` ``(b)`` returns model b as a torch module (copies);
      :meth:`to_modules` is it for every b.
    * :meth:`reset_model` ``(b, seed=None)`` makes slot b a freshly initialized
      model, exactly the torch module ``torch.manual_seed(seed)`` followed by
      the namesake's constructor would give.

    They are generic: driven by the parameters and buffers (by name, through
    submodules), ``_config_of`` and ``_per_model_fields``. A per-model field
    named like a child module (TransformerEncoderLayer's ``dropout``) is held
    by the children, which take their torch counterparts' values.
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

    def to(self, *args, **kwargs):
        """``torch.nn.Module.to``, where ``memory_format`` lays out the array images
        (:func:`set_memory_format`) instead of converting 4-D and 5-D parameters
        (an array conv's weights are 5-D stacks of 4-D ones)."""
        if "memory_format" in kwargs:
            memory_format = kwargs.pop("memory_format")
            if memory_format is not torch.preserve_format:
                set_memory_format(self, check_memory_format(f"{type(self).__name__}.to", memory_format))
        return super().to(*args, **kwargs) if args or kwargs else self

    # ---- configuration --------------------------------------------------
    @classmethod
    def _config_of(cls, module: nn.Module) -> dict[str, Any]:
        """The namesake constructor's keyword arguments that describe ``module``."""
        return {f: _read_field(module, f) for f in cls._config_fields}

    @classmethod
    def _comparable_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` (:meth:`_config_of`) in the form in which two models' configurations are
        compared (:meth:`from_modules`, :meth:`load_model`): subclasses map the spellings torch
        reads alike (a pool's ``kernel_size=2`` and ``(2, 2)``) to one value. ``config`` itself
        by default."""
        return config

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
        parameter keeps its ``requires_grad``; the train/eval mode of the array
        and of each of its submodules is taken from the modules. Modules whose
        configurations differ raise ValueError naming the field, except the
        per-model hyper-parameters (``_per_model_fields``, e.g. a dropout
        probability), which become one value per model (a tuple of B values
        where they differ, else the one value). Spellings of a setting that torch
        reads alike agree (a pool's ``kernel_size=2`` and ``(2, 2)``); the array
        keeps module 0's. Modules that disagree on a parameter's
        ``requires_grad``, on a submodule's mode or on their state dict keys
        raise ValueError too, as do modules holding what the array cannot (a
        parametrized weight, an extra persistent buffer).
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
        # Fields holding a module with parameters or buffers (a layer's nn.PReLU activation) become
        # one array module of the B models' modules, below; here they need only be of one class.
        stateful = [f for f, v in configs[0].items() if _holds_state(v) and f not in cls._per_model_fields]
        comparable = [cls._comparable_config(cfg) for cfg in configs]
        for i, (m, cfg) in enumerate(zip(modules[1:], configs[1:]), start=1):
            for field, value in configs[0].items():
                same = (type(cfg[field]) is type(value) if field in stateful
                        else _same_setting(comparable[i][field], comparable[0][field]))
                if not same and field not in cls._per_model_fields:
                    raise ValueError(
                        f"{name}.from_modules: field {field!r} differs: module 0 has {value!r}, "
                        f"module {i} has {cfg[field]!r}"
                    )
            for path, sub in modules[0].named_modules():
                other = _submodule(m, path)
                if other is not None and other.training != sub.training:
                    field = f"{path}.training" if path else "training"
                    raise ValueError(
                        f"{name}.from_modules: field {field!r} differs: module 0 has "
                        f"{sub.training}, module {i} has {other.training}"
                    )
            keys, ref_keys = set(m.state_dict()), set(ref_sd)
            if keys != ref_keys:
                raise ValueError(
                    f"{name}.from_modules: the state dict keys differ: module 0 has {sorted(ref_keys)}, "
                    f"module {i} has {sorted(keys)}"
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
        for field in stateful:
            ref_cfg[field] = cls._array_field(field, [cfg[field] for cfg in configs])
        factory = {}
        first = next(iter(ref_sd.values()), None)
        floats = [t for t in ref_sd.values() if t.is_floating_point()]
        if first is not None:
            factory["device"] = first.device
        if floats:
            factory["dtype"] = floats[0].dtype
        with keeping_rng(factory.get("device")):  # (its initial values are the models' state below)
            array = cls(**ref_cfg, B=len(modules), **factory)
        # The models hold what the array holds (a parametrized weight, an extra buffer: no).
        array._slot_pairs(modules[0], f"{name}.from_modules", check_dtype=False)
        with torch.no_grad():
            stacked = {
                key: torch.stack([m.state_dict()[key] for m in modules])
                for key in array.state_dict()
            }
        array.load_state_dict(stacked)
        # The submodules' own per-model fields (a layer's dropouts, its attention's dropout: the
        # constructor gave them all the layer's one value).
        for path, sub, field in array._held_per_model_fields():
            values = [_submodule(m, path) for m in modules]
            if all(v is not None and hasattr(v, field) for v in values):
                values = [_read_field(v, field) for v in values]
                value = values[0] if all(v == values[0] for v in values) else tuple(values)
                if value != getattr(sub, field):
                    setattr(sub, field, value)
        for key, p in array.named_parameters():
            p.requires_grad_(ref_grad[key])
        array.train(modules[0].training)
        for path, sub in array.named_modules():  # each submodule keeps its mode, as in the models
            counterpart = _submodule(modules[0], path)
            if counterpart is not None:
                sub.training = counterpart.training
        return array

    @classmethod
    def _array_field(cls, field: str, values: list[nn.Module]) -> "ArrayModule":
        """The configuration field ``field`` of B models, each a module with parameters or buffers
        (of one class), as one array module built by its ``from_modules`` (model b's state at b).

        Raises TypeError where hfkern.nn has no array version of that class: the array module
        would otherwise share model 0's module (and state) among the B models.
        """
        name, kind = cls.__name__, type(values[0])
        array_cls = _array_class(kind)
        if array_cls is None:
            raise TypeError(
                f"{name}.from_modules: field {field!r} holds a {kind.__module__}.{kind.__qualname__} "
                "with parameters or buffers, one per model, and hfkern.nn has no array version of it "
                f"to hold them; expected {field} to be a function, a module without parameters or "
                "buffers, or a module hfkern.nn has an array version of, such as torch.nn.PReLU"
            )
        try:
            return array_cls.from_modules(values)
        except (TypeError, ValueError) as ex:
            raise type(ex)(f"{name}.from_modules: in {field!r}: {ex}") from ex

    def to_modules(self) -> list[nn.Module]:
        """The B models as torch modules of the namesake class: ``extract_model(b)`` for every b.

        Model b's ``state_dict()`` equals this array's entries at index b
        (copies, not views), its configuration is this array's with model b's
        value of every per-model hyper-parameter, its parameters have this
        array's ``requires_grad``; the modules share this array's train/eval mode.
        """
        self._check_sized("to_modules")
        return [self._extract(b) for b in range(self.B)]

    # ---- per-model surgery ------------------------------------------------
    def extract_model(self, b: int) -> nn.Module:
        """Model b as a torch module of the namesake class.

        Its parameters and buffers are copies of this array's entries at index b
        (non-persistent buffers too, where the array holds them); its
        configuration is this array's with model b's value of every per-model
        field; its parameters have this array's ``requires_grad`` and its
        modules this array's train/eval modes.
        """
        return self._extract(self._check_slot(b, "extract_model"))

    def _extract(self, b: int) -> nn.Module:
        factory = self._factory_kwargs()
        with keeping_rng(factory.get("device")):  # (its initial values are model b's state below)
            module = torch_module(self._torch_cls, **self._model_config(b, fresh=False), **factory)
        pairs = self._slot_pairs(module, f"{type(self).__name__}.extract_model", check_dtype=False)
        with torch.no_grad():
            for ours, theirs in pairs:
                theirs.copy_(ours[b])
        for path, sub, field in self._held_per_model_fields():
            value = getattr(sub, field)
            setattr(module.get_submodule(path), field, value[b] if isinstance(value, tuple) else value)
        requires_grad = {k: p.requires_grad for k, p in self.named_parameters()}
        for k, p in module.named_parameters():
            p.requires_grad_(requires_grad[k])
        module.train(self.training)
        for path, sub in self.named_modules():
            counterpart = _submodule(module, path)
            if counterpart is not None:
                counterpart.training = sub.training
        return module

    def load_model(self, b: int, module: nn.Module) -> None:
        """Copy the torch module ``module`` into slot b; the other slots are untouched.

        ``module`` must be a ``_torch_cls`` (the namesake) with this array's
        configuration (or a spelling of it that torch reads alike, as
        :meth:`from_modules` compares), except the per-model fields
        (``_per_model_fields``, e.g. a dropout probability), which become model
        b's values. Its parameters and buffers (and the non-persistent buffers
        this array holds) are copied
        into index b of this array's, written in place under no_grad: every
        parameter stays the same object, so an optimizer holding it goes on
        working (reset its state for model b with
        :meth:`hfkern.optim.ArrayOptimizer.reset_state`). A gradient the array
        holds is zeroed at index b, as a new model has none. ``requires_grad``
        and the train/eval mode stay this array's.

        Everything is checked before anything is written: ``b`` (an int in
        ``[0, B)``), the class (TypeError), the configuration, the names, shapes
        (``[B, *s]`` here, ``s`` there) and dtypes of the parameters and buffers
        (ValueError / TypeError naming expected and received); a per-model value
        the array rejects leaves it as it was.
        """
        self._prepare_load(self._check_slot(b, "load_model"), module, f"{type(self).__name__}.load_model")()

    def _prepare_load(self, b: int, module: nn.Module, who: str) -> Callable[[], None]:
        """Check that ``module`` can be loaded into slot b; return the function that loads it.

        Every check runs here, so a caller loading several modules (a fused
        model's layers) can check them all before writing any.
        """
        for path, sub in self.named_modules():
            if not isinstance(sub, ArrayModule):
                continue  # the module itself and nested array modules (a container's layers)
            counterpart = module if not path else _submodule(module, path)
            if not isinstance(counterpart, sub._torch_cls):
                where = f" {path!r} to be" if path else ""
                raise TypeError(f"{who}: expected{where} a torch.nn.{sub._torch_cls.__name__}, "
                                f"got {type(counterpart).__name__}")
            mine, given = sub._config_of(sub), sub._config_of(counterpart)
            mine_key, given_key = sub._comparable_config(mine), sub._comparable_config(given)
            for field, value in mine.items():
                if field in sub._per_model_fields:
                    continue
                if _array_child(sub, field, value):
                    # checked as its own path (a later one of this loop); here only its class
                    same = isinstance(given[field], value._torch_cls)
                else:
                    same = _same_setting(given_key[field], mine_key[field])
                if not same:
                    where = f" of {path!r}" if path else ""
                    raise ValueError(f"{who}: field {field!r}{where} differs: the array has "
                                     f"{value!r}, the module has {given[field]!r}")
        pairs = self._slot_pairs(module, who, check_dtype=True)
        updates = []
        for path, sub, field in self._held_per_model_fields():
            counterpart = _submodule(module, path)
            if counterpart is None or not hasattr(counterpart, field):
                raise ValueError(f"{who}: the module has no {'.'.join(filter(None, (path, field)))!r}")
            old = getattr(sub, field)
            new = _with_slot(old, b, _read_field(counterpart, field), self.B)
            if new != old:
                updates.append((sub, field, old, new))

        def load() -> None:
            # The fields' own setters validate them; one that refuses undoes the others.
            done = []
            try:
                for sub, field, old, new in updates:
                    setattr(sub, field, new)
                    done.append((sub, field, old))
            except BaseException:
                for sub, field, old in reversed(done):
                    setattr(sub, field, old)
                raise
            with torch.no_grad():
                for ours_t, theirs_t in pairs:
                    ours_t[b].copy_(theirs_t)
                    grad = ours_t.grad if isinstance(ours_t, nn.Parameter) else None
                    if grad is not None:
                        _zero_slot_(ours_t, b)

        return load

    def reset_model(self, b: int, seed: int | None = None) -> None:
        """Make slot b a freshly initialized model; the other slots are untouched.

        Builds the namesake with model b's configuration (on this array's device
        and dtype) and :meth:`load_model` s it. Its initialization draws from
        torch's global RNG; with ``seed`` it runs under
        ``torch.random.fork_rng`` with the generator of the array's device seeded
        by ``seed``, so the global RNG is left as it was and slot b equals
        (``torch.equal``) the module that ``torch.manual_seed(seed)`` followed by
        the same constructor gives.
        """
        b = self._check_slot(b, "reset_model")
        with seeded(seed, self._factory_kwargs().get("device"), f"{type(self).__name__}.reset_model"):
            fresh = self._fresh_module(b)
        self.load_model(b, fresh)

    def _fresh_module(self, b: int) -> nn.Module:
        """A newly initialized torch module with model b's configuration (containers override it)."""
        return torch_module(self._torch_cls, **self._model_config(b, fresh=True), **self._factory_kwargs())

    # ---- surgery helpers -------------------------------------------------------
    def _check_sized(self, who: str) -> int:
        if self.B is None:
            raise ValueError(
                f"{type(self).__name__}.{who}: the array size is unknown; construct it with B=..."
            )
        return self.B

    def _check_slot(self, b: Any, who: str) -> int:
        B = self._check_sized(who)
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(
                f"{type(self).__name__}.{who}: expected a model index b (an int in [0, {B})), "
                f"got {type(b).__name__} {b!r}"
            )
        if not 0 <= b < B:
            raise ValueError(f"{type(self).__name__}.{who}: expected a model index b in [0, {B}), got {b}")
        return int(b)

    def _model_config(self, b: int, *, fresh: bool) -> dict[str, Any]:
        """The namesake constructor's keyword arguments for model b.

        A field holding an array module (a layer's ``hfkern.nn.PReLU`` activation) gives model
        b's torch module: newly initialized with ``fresh`` (as a new model would be built),
        otherwise extracted (model b's state; the caller copies it again with its own).
        """
        def value(k: str, v: Any) -> Any:
            if k in self._per_model_fields and isinstance(v, tuple):
                return v[b]
            if isinstance(v, ArrayModule):
                return v._fresh_module(b) if fresh else v._extract(b)
            return copy.deepcopy(v) if isinstance(v, nn.Module) else v  # a model of its own

        return {k: value(k, v) for k, v in self._config_of(self).items()}

    def _held_per_model_fields(self) -> Iterable[tuple[str, "ArrayModule", str]]:
        """``(path, array module, field)`` for every per-model field stored by a module of this tree.

        A field named like one of the module's children is not stored there but
        derived from the child (whose own fields are listed).
        """
        for path, sub in self.named_modules():
            if isinstance(sub, ArrayModule):
                for field in sub._per_model_fields:
                    if field not in sub._modules:
                        yield path, sub, field

    def _slot_pairs(
        self, module: nn.Module, who: str, *, check_dtype: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(array tensor [B, *s], module tensor [*s])`` for every parameter and buffer this array holds.

        Raises unless ``module`` has the same parameters, every buffer this array
        holds, no persistent buffer this array lacks, each of the per-model shape
        (and, with ``check_dtype``, dtype).
        """
        ours_p, theirs_p = dict(self.named_parameters()), dict(module.named_parameters())
        if set(ours_p) != set(theirs_p):
            raise ValueError(
                f"{who}: expected a module with the parameters {sorted(ours_p)}, got one with "
                f"{sorted(theirs_p)}"
            )
        ours_b, theirs_b = dict(self.named_buffers()), dict(module.named_buffers())
        missing = [k for k in ours_b if k not in theirs_b]
        extra = [k for k in _persistent_buffers(module) if k not in ours_b]
        if missing or extra:
            raise ValueError(
                f"{who}: expected a module with the buffers {sorted(ours_b)}, got one with "
                f"{sorted(theirs_b)}"
            )
        pairs = []
        for name, ours in [*ours_p.items(), *ours_b.items()]:
            theirs = theirs_p[name] if name in ours_p else theirs_b[name]
            if tuple(theirs.shape) != tuple(ours.shape[1:]):
                raise ValueError(
                    f"{who}: shape of {name!r}: expected {list(ours.shape[1:])} (one model of the "
                    f"array's {list(ours.shape)}), got {list(theirs.shape)}"
                )
            if check_dtype and theirs.dtype != ours.dtype:
                raise TypeError(f"{who}: dtype of {name!r}: expected {ours.dtype}, got {theirs.dtype}")
            pairs.append((ours, theirs))
        return pairs

    # ---- loading ----------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict``, all or nothing.

        Every entry is checked before anything is written: the keys (with
        ``strict``), that each value is a tensor, its shape ``[B, *per-model
        shape]`` (a different leading dim is reported as a different number of
        models), and that it can be copied (or, with ``assign``, assigned) into
        its parameter or buffer. A state dict that fails any check raises
        :class:`StateDictError` (a RuntimeError, as torch raises, listing every
        problem) and leaves the module exactly as it was. A value overlapping the
        module's own memory (a transposed view of a weight) loads the values it
        holds. Returns torch's ``(missing_keys, unexpected_keys)`` named tuple.

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
            if not assign:
                state_dict = self._unaliased(state_dict)
        return super().load_state_dict(state_dict, strict, assign)

    def _unaliased(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state_dict`` with a copy of every value that overlaps this module's own memory other
        than as the very tensor it is written into (a transposed view of a weight): torch's
        ``copy_`` refuses those, and would after the entries before it were written."""
        own: dict[int, list[torch.Tensor]] = {}
        for t in [*self.parameters(), *self.buffers()]:
            if t.layout == torch.strided and not t.is_meta:
                own.setdefault(t.untyped_storage().data_ptr(), []).append(t)

        def overlaps(v: Any) -> bool:
            if not (type(v) in (torch.Tensor, nn.Parameter) and v.layout == torch.strided) or v.is_meta:
                return False
            return any(not (t.data_ptr() == v.data_ptr() and t.shape == v.shape and t.stride() == v.stride())
                       for t in own.get(v.untyped_storage().data_ptr(), ()))

        if not any(overlaps(v) for v in state_dict.values()):
            return state_dict
        copied = OrderedDict((k, v.clone() if overlaps(v) else v) for k, v in state_dict.items())
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            copied._metadata = metadata
        return copied

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
            elif isinstance(module, nn.modules.batchnorm._NormBase):
                # A torch norm (in a fused model) keeps its count where an older checkpoint has
                # none, as its own loader does (num_batches_tracked came with version 2).
                version = local_metadata.get("version")
                key = prefix + "num_batches_tracked"
                if (version is None or version < 2) and module.track_running_stats and key not in sd:
                    sd[key] = module.num_batches_tracked
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
