"""A training strategy for an array model, and how it is applied.

A :class:`Strategy` fixes how one array of B models trains: the precision of
forward and loss, the micro-batches a batch is split into, which blocks
recompute their activations in backward, the memory layout of the images, and
the arrays in flight (:class:`InFlight` runs their steps together: on CUDA
each on a stream of its own).

Applying a strategy leaves the training code as it was:

* :func:`apply` changes the model in place: the blocks named in
  ``recompute`` recompute their forward in backward instead of keeping their
  activations, and the array convs take the strategy's memory format. Every
  model's losses and gradients stay what they were (to float32 rounding).
* :func:`make_step` returns the training step: ``step(x, y)`` runs forward,
  the per-model losses and backward over the micro-batches (under bf16
  autocast when asked) and the optimizer step, and returns the ``[B]`` losses.

Blocks are the top-level children of the array model that hold parameters
(:func:`blocks`): for an :func:`hfkern.fuse` model, the original model's own
submodules (``features``, ``layer1``, ``head``); for a hand-written array such
as an ``nn.Sequential`` of :mod:`hfkern.nn` modules, its entries.

Recomputation and state. A block's recomputation runs its forward a second
time, in backward. Forward also updates state (batch norm's running
statistics and counters, any buffer or tensor attribute the block changes,
the parameters without a gradient a momentum encoder writes); the
recomputation must neither update it a second time nor see it already
updated. So the state the forward writes (its buffers and parameters that do
not require grad, of the modules whose state the block's forwards in train or
eval mode wrote: the first step copies all of it and learns which) is copied
before its forward, the recomputation runs on those copies (it sees
exactly what the forward saw, and computes the same), and afterwards the
block gets them back as the forward left them. The rest (frozen weights) is
not copied: it is checked by its version, and a write to it (by a later
forward, by other code before the recomputation, or by the recomputation)
raises RuntimeError rather than recompute from other values; later forwards
then copy it. A parameter that requires grad cannot be swapped for a copy (its
gradient would go to the copy), so a block whose forward writes one in place
raises RuntimeError: leave it out of :attr:`Strategy.recompute`. Tensor and plain
Python attributes (numbers, strings, flags) the forward assigns are put back as
the forward found them for the recomputation, and as it left them after; one the
forward created (a lazy initialization's ``self.initialized = True``) is absent
for the recomputation, as it was for the forward. The recomputation runs in the
train/eval mode of its forward, whatever the block's mode is by backward.
Random draws (dropout) repeat the forward's masks:
``torch.utils.checkpoint`` restores the RNG state before the recomputation.

Recomputation and inputs. ``torch.utils.checkpoint`` keeps a recomputed block's
inputs for its recomputation, and backward refuses them if they were written in
place since. A block whose input is written in place, in the block (an
``nn.ReLU(inplace=True)`` first in it) or after it before backward (the model's
``h.mul_(0.5)`` on what the block read), cannot be recomputed, though the plain
model trains: :func:`apply` refuses such a block of a fused model where its
graph shows the write, a block that writes its input in its forward raises
RuntimeError at its first forward, and :func:`hfkern.plan.fit_cost_model` also
finds such blocks by one forward and leaves them out of every plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import numbers
import operator
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.utils.parametrize
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _capture
from .._capture import _version_of
from .._array import broadcast
from ..fusion import _VIEW_FUNCTIONS, _VIEW_METHOD_NAMES, FusedModel, MemoryGroups, _ArrayCall, compiled_forward, \
    graph_from_state, graph_state
from ..nn._base import ArrayModule, set_memory_format
from ..nn.dropout import _ArrayDropoutNd
from ..nn.flatten import Flatten as _ArrayFlatten
from ..nn.normalization import _BatchNorm as _ArrayBatchNorm

__all__ = ["Strategy", "Recompute", "blocks", "apply", "unapply", "applied", "make_step"]

PRECISIONS = ("fp32", "bf16")
# "auto": each array conv chooses by committed measurements (hfkern._evidence), as without a plan.
MEMORY_FORMATS = {"auto": None, "contiguous": torch.contiguous_format, "channels_last": torch.channels_last}

# Where apply() keeps the strategy it applied on the model. (A fused model keeps its own
# graphs, what unapply() and a later apply() start from, in _own_graphs.)
_APPLIED = "_hfkern_plan_strategy"


# ---- the strategy ------------------------------------------------------------------------
def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Strategy.{field}: expected an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"Strategy.{field}: expected an int >= 1, got {value}")
    return int(value)


def _choice(field: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"Strategy.{field}: expected one of {list(choices)}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"Strategy.{field}: expected one of {list(choices)}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How one array of B models trains.

    Attributes:
        B: the array size (models trained together), an int >= 1.
        precision: ``"fp32"``, or ``"bf16"``: forward and loss run under
            ``torch.autocast(device_type, dtype=torch.bfloat16)`` on the model's
            device type; parameters, gradients and optimizer state stay fp32.
        micro_batches: the batch of a step is split into this many nearly equal
            micro-batches whose gradients add up to the full batch's
            (see :func:`make_step` on batch norm).
        recompute: names of blocks (:func:`blocks`) that recompute their
            activations in backward instead of keeping them (a sequence of
            str, kept as a tuple in the given order).
        arrays: arrays trained at the same time on the device. :func:`apply` and
            :func:`make_step` act on one array; :class:`InFlight` runs the steps
            of ``arrays`` of them together.
        memory_format: ``"auto"`` (each array conv chooses by committed
            measurements, as without a plan), ``"contiguous"`` or
            ``"channels_last"``: the memory format of the array convs' images
            (:func:`hfkern.nn.set_memory_format`).

    Raises TypeError or ValueError, naming the field, for a value outside these.
    """

    B: int
    precision: str = "fp32"
    micro_batches: int = 1
    recompute: tuple[str, ...] = ()
    arrays: int = 1
    memory_format: str = "auto"

    def __post_init__(self) -> None:
        # Normalized in place (a frozen dataclass): numpy ints become ints, a list of names a tuple.
        object.__setattr__(self, "B", _positive_int("B", self.B))
        _choice("precision", self.precision, PRECISIONS)
        object.__setattr__(self, "micro_batches", _positive_int("micro_batches", self.micro_batches))
        object.__setattr__(self, "arrays", _positive_int("arrays", self.arrays))
        _choice("memory_format", self.memory_format, tuple(MEMORY_FORMATS))
        names = self.recompute
        # A single str is a sequence too: recompute="layer1" would name six blocks.
        if isinstance(names, str) or not isinstance(names, (tuple, list)):
            raise TypeError(f"Strategy.recompute: expected a tuple of block names (str), got "
                            f"{type(names).__name__} {names!r}")
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad:
            raise TypeError(f"Strategy.recompute: expected non-empty block names (str), got {bad!r} in {names!r}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"Strategy.recompute: expected each block once, got {repeated} more than once")
        object.__setattr__(self, "recompute", tuple(names))

    @property
    def label(self) -> str:
        """A short description for tables, e.g. ``"B=8 bf16 mb=2 rc=layer1,layer2 cl"``."""
        parts = [f"B={self.B}", self.precision]
        if self.micro_batches > 1:
            parts.append(f"mb={self.micro_batches}")
        if self.arrays > 1:
            parts.append(f"arrays={self.arrays}")
        if self.recompute:
            parts.append("rc=" + ",".join(self.recompute))
        if self.memory_format != "auto":
            parts.append("cl" if self.memory_format == "channels_last" else "nchw")
        return " ".join(parts)


# ---- blocks --------------------------------------------------------------------------------
def blocks(model: nn.Module) -> list[str]:
    """The blocks of an array model: the names of its top-level children that hold parameters.

    A block is what :attr:`Strategy.recompute` names. For an :func:`hfkern.fuse`
    model these are the original model's own submodules (``features``,
    ``layer1``, ``fc``); for a hand-written array (an ``nn.Sequential`` of
    :mod:`hfkern.nn` modules, or a module of one's own) its children (``"0"``,
    ``"1"``, ...). Children without parameters (activations, pooling, dropout)
    are not blocks: they run inside a neighbour's recomputation or not at all.
    In registration order, which is forward order for most models.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"blocks: expected a torch.nn.Module (an array model), got {type(model).__name__}")
    return [name for name, child in model.named_children() if next(child.parameters(), None) is not None]


def _array_size(model: nn.Module, who: str) -> int:
    """B of an array model: its own, or the one its hfkern.nn modules share."""
    if isinstance(model, ArrayModule) and model.B is not None:
        return model.B
    sizes = {m.B for m in model.modules() if isinstance(m, ArrayModule) and m.B is not None}
    if not sizes:
        raise TypeError(f"{who}: expected an array model (from hfkern.fuse, or built of hfkern.nn modules "
                        f"with B=...), got a {type(model).__name__} without array modules")
    if len(sizes) > 1:
        raise ValueError(f"{who}: expected the array modules of the model to share one B, got B in {sorted(sizes)}")
    return sizes.pop()


# ---- keeping a block's state through its recomputation ------------------------------------
# Per block and train/eval mode: the modules (paths within the block) whose state its forwards
# wrote. Only their state is copied before a later forward. Each call site of a block (a
# hand-written block, or one run of a fused block's nodes: a block run in several runs writes
# other state in each) copies all of it at its first forward in a mode, and learns from it.
_WRITERS: weakref.WeakKeyDictionary[nn.Module, dict[bool, set[str]]] = weakref.WeakKeyDictionary()
_LEARNED: weakref.WeakKeyDictionary[Any, set[bool]] = weakref.WeakKeyDictionary()  # call site -> its modes


class _Entry:
    """One state tensor (or Python attribute) of a block as a forward found it: where it lives
    (``table[key]``, of the module at ``path``), the value, a tensor's version, and a copy where
    one is kept."""

    __slots__ = ("copy", "key", "kind", "path", "table", "tensor", "version")

    def __init__(self, table: dict, key: str, path: str, kind: str, tensor: Any, copy: bool):
        self.table, self.key, self.path, self.kind, self.tensor = table, key, path, kind, tensor
        self.version = _version_of(tensor) if kind != "attribute" else None
        self.copy = _copied(tensor) if copy else None

    @property
    def name(self) -> str:
        return f"{self.path}.{self.key}" if self.path else self.key

    def changed(self) -> bool:
        """Written in place since (a version that moved; where the version misses a write, as a
        kernel writing through a pointer does, the copy differs from the tensor)."""
        version = _version_of(self.tensor)
        if version is None or version != self.version:
            return True
        return self.copy is not None and not torch.equal(self.copy, self.tensor)


def _copied(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return nn.Parameter(t.clone(), False) if isinstance(t, nn.Parameter) else t.clone()


# Python values a forward may assign to its module (``self.calls += 1``): held as found, put back
# for the recomputation, as tensor attributes are. nn.Module's own entries are left out.
_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None))
_MODULE_ENTRIES = frozenset(vars(nn.Module()))
_MISSING = object()  # where an attribute is not (deleted by a forward)


def _tracked(key: str, value: Any) -> bool:
    """An attribute of a module that a recomputation sees as its forward found it: a tensor or a
    plain Python value, not one of nn.Module's own entries (``training`` is put back on its own)."""
    return isinstance(value, torch.Tensor) or (isinstance(value, _PLAIN_VALUES) and key not in _MODULE_ENTRIES)


def _state_of(block: nn.Module, writers: set[str] | None) -> list[_Entry]:
    """The block's state a forward may write: its buffers and parameters that do not require grad
    (a teacher's weights), copied where their module is among ``writers`` (all, for None), and its
    tensor and plain Python attributes (a counter), held by reference: a forward assigns them
    (``self.last = h``, ``self.calls += 1``), it does not write into them (:func:`hfkern.fuse`
    refuses that for non-buffers). Attributes a forward creates (a lazy initialization's flag,
    ``self.initialized = True``) are those missing from :func:`_found_of`'s record."""
    entries = []
    for path, m in block.named_modules():
        copy = writers is None or path in writers
        for key, buf in m._buffers.items():
            if buf is not None:
                entries.append(_Entry(m._buffers, key, path, "buffer", buf, copy))
        for key, p in m._parameters.items():
            if p is not None and not p.requires_grad:  # a teacher's weights, written in place
                entries.append(_Entry(m._parameters, key, path, "parameter", p, copy))
        for key, value in vars(m).items():
            if _tracked(key, value):
                entries.append(_Entry(vars(m), key, path, "attribute", value, False))
    return entries


def _found_of(block: nn.Module) -> tuple[list[tuple[dict, frozenset]], list[tuple[nn.Module, bool]]]:
    """What a forward found besides the state :func:`_state_of` notes: each module's attribute
    names (a forward may add one: its recomputation runs without it, as the forward did) and
    each module's train/eval mode (the recomputation runs in it, whatever the mode is in backward)."""
    modules = [m for _, m in block.named_modules()]
    return [(vars(m), frozenset(vars(m))) for m in modules], [(m, m.training) for m in modules]


def _trained_parameters(block: nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    """``(name, parameter, version)`` of the block's parameters that require grad."""
    return [(name, p, p._version) for name, p in block.named_parameters() if p.requires_grad]


class _BlockState:
    """``context_fn`` of ``torch.utils.checkpoint`` for one call of one block.

    The forward context notes the block's state as it is before the forward and
    copies what the forward writes: the state of the modules whose state the
    block's forwards in this train/eval mode wrote (the first forward of each call
    site of the block copies all of it, and learns which). The recomputation
    context installs fresh copies of those for the recomputation (which updates
    them, not the block's), the tensors a forward replaced as they were before it,
    and puts back what the forward left when the recomputation ends, also when
    checkpoint stops it early. State no copy was kept of is checked by its
    version: written by the forward, by anything before the recomputation, or by
    the recomputation, it raises RuntimeError.
    """

    def __init__(self, block: nn.Module, site: Any, args: tuple = ()):
        self.block, self.site = block, site  # site: the call (a Recompute block, a fused block's run)
        self.args = args  # the call's positional arguments, until its forward begins
        self.mode = block.training  # of its forward
        self.before: list[_Entry] = []
        self.trained: list = []
        self.names: list[tuple[dict, frozenset]] = []  # each module's attribute names before the forward
        self.modes: list[tuple[nn.Module, bool]] = []  # each module's training flag in the forward

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return _BeforeForward(self), _DuringRecomputation(self)


def _unexpected_write(state: _BlockState, entries: list[_Entry], when: str) -> RuntimeError:
    """The error for state written where no copy of it was kept; later forwards of the block keep one."""
    block = state.block
    _WRITERS.setdefault(block, {}).setdefault(state.mode, set()).update(e.path for e in entries)
    names = ", ".join(f"{e.kind} {e.name!r}" for e in entries)
    what = {"forward": f"its forward wrote {names} in place, which its earlier forwards in "
                       f"{'train' if state.mode else 'eval'} mode did not write",
            "between": f"{names} was written in place between its forward and its recomputation (its forward "
                       f"does not write it)",
            "recomputation": f"its recomputation wrote {names} in place, which its forward did not write"}[when]
    return RuntimeError(
        f"hfkern.plan: a recomputed block ({type(block).__name__}): {what}, so no copy of it was kept for the "
        f"recomputation, which would not see the state the forward saw. Later forwards of the block keep a "
        f"copy of it; leave the block out of Strategy.recompute if this recurs")


class _BeforeForward:
    def __init__(self, state: _BlockState):
        self.state = state

    def __enter__(self) -> None:
        block, site = self.state.block, self.state.site
        self.state.mode = mode = block.training
        self.first = mode not in _LEARNED.get(site, ())  # the call site's first forward in this mode
        args, self.state.args = self.state.args, ()
        # The first forward checks that it leaves its inputs as it found them (what checkpoint keeps
        # of them must be as they were in backward); later forwards run the same code.
        self.inputs = [(t, _version_of(t)) for t in torch.utils._pytree.tree_leaves(args)
                       if isinstance(t, torch.Tensor)] if self.first else []
        self.state.before = _state_of(block, None if self.first else _WRITERS.get(block, {}).get(mode, set()))
        self.state.names, self.state.modes = _found_of(block)
        self.state.trained = _trained_parameters(block)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.inputs = []
            return
        # (in-place ops count in the version; a write through .data does not, and goes unseen)
        block = self.state.block
        written = [name for name, p, version in self.state.trained if p._version != version]
        self.state.trained = []
        if written:
            raise RuntimeError(
                f"hfkern.plan: a recomputed block ({type(block).__name__}) wrote its parameters {written} in place in "
                f"its forward; they require grad, so its recomputation in backward cannot run on copies "
                f"and would write them again: leave the block out of Strategy.recompute")
        inputs, self.inputs = self.inputs, []
        if any(_version_of(t) != version for t, version in inputs):
            site = self.state.site
            name = f"block {site.block!r}" if isinstance(site, _RecomputeSegment) else type(block).__name__
            raise RuntimeError(
                f"hfkern.plan: a recomputed block ({name}) wrote its input in place in its forward; "
                f"{_CHECKPOINT_KEEPS_INPUTS}: leave the block out of Strategy.recompute")
        state = [e for e in self.state.before if e.kind != "attribute"]
        if self.first:
            # The call site's first forward in this mode copied all the block's state and keeps it
            # for its recomputation (other runs of the block may write state it did not). Later
            # forwards copy the state of the modules it wrote (all of it: a kernel may write a
            # buffer without moving its version); the rest is kept by reference, its version checked.
            _WRITERS.setdefault(block, {}).setdefault(self.state.mode, set()).update(
                e.path for e in state if e.changed())
            _LEARNED.setdefault(self.state.site, set()).add(self.state.mode)
            return
        unseen = [e for e in state if e.copy is None and e.changed()]
        if unseen:
            raise _unexpected_write(self.state, unseen, "forward")


class _DuringRecomputation:
    # Entered once per recomputation: twice for a graph backpropagated twice (retain_graph=True),
    # which is why the copies are copied in, never handed over.
    def __init__(self, state: _BlockState):
        self.state = state
        self.after: list[tuple[dict, str, Any]] = []
        self.kept: list[_Entry] = []
        self.modes: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.after, self.kept, self.modes = [], [], []
        moved = [e for e in self.state.before if e.kind != "attribute" and e.copy is None and e.changed()]
        if moved:  # written since the forward (by other code): the recomputation would see it written
            raise _unexpected_write(self.state, moved, "between")
        with torch.no_grad():
            for e in self.state.before:
                current = e.table.get(e.key, _MISSING)
                if e.copy is not None:     # written by the forward: a fresh copy of it as it was
                    self.after.append((e.table, e.key, current))
                    e.table[e.key] = _copied(e.copy)
                    continue
                if e.kind != "attribute":  # not written: the tensor itself, checked after
                    self.kept.append(e)
                if current is not e.tensor:  # replaced (or deleted) by the forward: the one it found
                    self.after.append((e.table, e.key, current))
                    e.table[e.key] = e.tensor
        # Attributes the forward created (``self.initialized = True``): missing, as it found them.
        for table, names in self.state.names:
            for key in [k for k, v in table.items() if k not in names and _tracked(k, v)]:
                self.after.append((table, key, table.pop(key)))
        # The forward's train/eval modes (the mode may have changed since: an evaluation before backward).
        for m, mode in self.state.modes:
            if m.training != mode:
                self.modes.append((m, m.training))
                m.training = mode

    def __exit__(self, *exc: object) -> None:
        for m, mode in self.modes:
            m.training = mode
        self.modes = []
        for table, names in self.state.names:  # what the recomputation created goes (the forward's comes back)
            for key in [k for k, v in table.items() if k not in names and _tracked(k, v)]:
                del table[key]
        for table, key, value in self.after:
            if value is _MISSING:
                table.pop(key, None)
            else:
                table[key] = value
        self.after = []
        wrote = [e for e in self.kept if _version_of(e.tensor) != e.version]
        self.kept = []
        if wrote:
            raise _unexpected_write(self.state, wrote, "recomputation")


def _checkpoint_block(fn: Callable, block: nn.Module, site: Any, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)``, its activations recomputed in backward, ``block``'s state kept
    (``site``: the call, what the state its forward writes is learned for). The keyword
    arguments are bound to ``fn`` here: checkpoint would take those it has itself (``debug``,
    ``preserve_rng_state``, ...) as its own. The positional ones go through checkpoint, which
    finds the devices whose RNG state it keeps from their tensors."""
    if not torch.is_grad_enabled():  # nothing will be backpropagated: no need to snapshot or stash RNG
        return fn(*args, **kwargs)
    state = _BlockState(block, site, args)
    call = functools.partial(fn, **kwargs) if kwargs else fn
    return checkpoint(call, *args, use_reentrant=False, context_fn=state.contexts)


# Under torch.compile the call runs eagerly (a graph break): dynamo takes no context_fn but
# selective checkpointing's, and without the contexts a recomputation would update the
# block's buffers (batch norm's running statistics) a second time. torch.compiler.disable
# imports torch._dynamo (and Triton with it), so the wrapper is made where a recomputation is
# set up (apply, unpickling), not when hfkern is imported.
_EAGER_CHECKPOINT: Callable | None = None


def _prepare_checkpoint() -> None:
    global _EAGER_CHECKPOINT
    if _EAGER_CHECKPOINT is None:
        _EAGER_CHECKPOINT = torch.compiler.disable(_checkpoint_block)


def _checkpointed(fn: Callable, block: nn.Module, site: Any, args: tuple, kwargs: dict) -> Any:
    if _EAGER_CHECKPOINT is None:
        _prepare_checkpoint()
    return _EAGER_CHECKPOINT(fn, block, site, args, kwargs)


# ---- recomputation of a hand-written array's blocks: a class swap -------------------------
class Recompute(nn.Module):
    """A block that recomputes its activations in backward (see the module docstring).

    :func:`apply` does not wrap a block in a new module, which would add a
    level to every ``state_dict`` key and break code that reaches the block by
    its path: it gives the block itself a subclass of its own class and of
    ``Recompute`` (as ``torch.nn.utils.parametrize`` does). The block keeps its
    identity, parameters, buffers, hooks, ``state_dict`` keys, per-slot
    surgery and the name of its class; ``isinstance(block, Recompute)`` tells
    that it recomputes, and its ``forward`` runs the original one under
    ``torch.utils.checkpoint`` (its arguments as given: keywords go to the block,
    none to checkpoint). A class ``torch.nn.utils.parametrize`` gave the block stays
    on top of the swapped one, so parametrizations are added and removed before or
    after :func:`apply` and :func:`unapply` alike. Pickling (``torch.save``,
    ``copy.deepcopy``) goes through the original class's ``__getstate__`` and
    ``__setstate__``. Blocks of an :func:`hfkern.fuse` model are not
    swapped: their code lives in the fused model's captured graph (see :func:`apply`).
    """

    _recompute_base: type[nn.Module]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpointed(super().forward, self, self, args, kwargs)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (super().extra_repr(), "recompute")))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The swapped class is made at run time and cannot be pickled by name:
        # pickle (and deepcopy) rebuild it from the original class instead, with the state
        # the original class's own __getstate__ gives (and its __setstate__ takes).
        return _new_recompute, (self._recompute_base,), self.__getstate__()


_RECOMPUTE_CLASSES: dict[type, type] = {}


def _recompute_class(base: type[nn.Module]) -> type[nn.Module]:
    _prepare_checkpoint()
    cls = _RECOMPUTE_CLASSES.get(base)
    if cls is None:
        # The original's name, so that error messages (which name type(self)) read as before.
        cls = type(base.__name__, (Recompute, base),
                   {"_recompute_base": base, "__qualname__": base.__qualname__, "__module__": base.__module__})
        _RECOMPUTE_CLASSES[base] = cls
    return cls


def _new_recompute(base: type[nn.Module]) -> nn.Module:
    return object.__new__(_recompute_class(base))


_PARAMETRIZE_MODULE = torch.nn.utils.parametrize.__name__  # where its classes are made


def _parametrize_class(cls: type) -> bool:
    """A class ``torch.nn.utils.parametrize`` made for a module (``Parametrized<its class>``, one
    base, holding the parametrized tensors' properties): it stays on top of the block's class,
    so that removing the last parametrization (which sets the class to its base) keeps the
    recomputation, and removing the recomputation keeps the parametrization."""
    return (len(cls.__bases__) == 1 and cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}"
            and "__getstate__" in cls.__dict__ and cls.__module__ == _PARAMETRIZE_MODULE)


def _rebased(cls: type, base: type) -> type:
    """``cls`` (a parametrize class) made again on ``base``: its properties and methods kept."""
    body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (base,), body)


def _swap_in(block: nn.Module) -> None:
    cls = type(block)
    if _parametrize_class(cls):  # Parametrized<base>: Parametrized<Recompute of base>
        block.__class__ = _rebased(cls, _recompute_class(cls.__bases__[0]))
    else:
        block.__class__ = _recompute_class(cls)


def _swap_out(block: nn.Module) -> None:
    cls = type(block)
    if _parametrize_class(cls) and cls.__bases__[0] is _RECOMPUTE_CLASSES.get(block._recompute_base):
        block.__class__ = _rebased(cls, block._recompute_base)  # parametrized after apply()
    else:
        block.__class__ = block._recompute_base


# ---- recomputation of a fused model's blocks: segments of its captured graph ---------------
class _RecomputeSegment(_capture.GraphTarget):
    """Graph target: one run of a block's nodes of a fused forward, as a checkpointed call.

    Called with the fused model and the values the run reads; returns the tuple
    of the values the rest of the forward reads.
    """

    def __init__(self, graph: fx.Graph, block: str):
        graph.lint()
        _prepare_checkpoint()
        self.graph, self.block = graph, block
        self.fn = compiled_forward(graph, f"<hfkern.plan recompute {block}>")
        self._named(f"recompute_{block}")

    def __call__(self, fused: nn.Module, *inputs: Any) -> tuple:
        return _checkpointed(self.fn, fused.get_submodule(self.block), self, (fused, *inputs), {})

    # Pickled (torch.save of a fused model with a plan applied) as its graph's nodes.
    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "graph": graph_state(self.graph)}
        del state["fn"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, graph=graph_from_state(state["graph"]))
        _prepare_checkpoint()
        self.fn = compiled_forward(self.graph, f"<hfkern.plan recompute {self.block}>")


def _label(graph: fx.Graph) -> dict[fx.Node, str | None]:
    """The block each node of a fused forward runs for (None: the model's own code).

    The capture records the module whose code made each node; the nodes the
    fusion rewrite adds (a leaf's ``get_attr``, a shared input's view) have no
    record and belong to the block of their users when they all have one.
    """
    labels: dict[fx.Node, str | None] = {}
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "output"):
            labels[node] = None
        elif isinstance(node.target, _RecomputeSegment):  # a graph apply() made: its calls of a block
            labels[node] = node.target.block
        elif (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
              and isinstance(node.args[0].target, _RecomputeSegment)):
            labels[node] = node.args[0].target.block
        elif "hfkern_module" in node.meta:
            where = node.meta["hfkern_module"]
            labels[node] = where[0].split(".", 1)[0] if where and where[0] else None
        else:
            users = {labels[u] for u in node.users}
            labels[node] = users.pop() if len(users) == 1 else None
    return labels


def _runs(graph: fx.Graph, names: set[str]) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of consecutive nodes of one named block that compute something."""
    labels = _label(graph)
    runs: list[tuple[str, list[fx.Node]]] = []
    current: list[fx.Node] | None = None
    for node in graph.nodes:
        block = labels[node] if labels[node] in names else None
        if block is None:
            current = None
            continue
        if current is None or runs[-1][0] != block:
            current = []
            runs.append((block, current))
        current.append(node)
    return [(b, run) for b, run in runs if any(n.op != "get_attr" for n in run)]


def _check_regions(block: str, run: list[fx.Node]) -> None:
    """Refuse a run that enters a grad-mode or autocast region it does not leave (or the reverse):
    its recomputation would run in another mode than its forward."""
    members = set(run)
    for node in run:
        if not _capture.changes_mode(node):
            continue
        if node.target is _capture.exit_region:
            closed = all(a in members for a in node.all_input_nodes)
        else:
            exits = [u for u in node.users if u.target is _capture.exit_region]
            closed = bool(exits) and all(u in members for u in node.users)
        if not closed:
            raise ValueError(
                f"apply: block {block!r} of the fused forward enters or leaves a grad-mode or autocast "
                f"region ({node.name}) that does not end within it; its recomputation would run in "
                "another mode. Expected blocks whose regions begin and end inside them: recompute the "
                "block that holds the whole region, or not this one")


def _subgraph(run: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    """The nodes of ``run`` as a graph of their own: ``inputs`` in, the tuple of ``outputs`` out."""
    sub = fx.Graph()
    env = {i: sub.placeholder(i.name) for i in inputs}
    for n in run:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    return sub


def _with_recompute(graph: fx.Graph, names: set[str]) -> fx.Graph:
    """The fused forward with each run of a named block's nodes replaced by a checkpointed call."""
    runs = _runs(graph, names)
    for block, run in runs:
        _check_regions(block, run)
    starts = {run[0]: (block, run) for block, run in runs}
    inside = {n for _, run in runs for n in run}
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    owner = None
    for node in graph.nodes:
        if node in starts:
            block, run = starts[node]
            members = set(run)
            inputs = list(dict.fromkeys(i for n in run for i in n.all_input_nodes if i not in members))
            outputs = [n for n in run if any(u not in members for u in n.users)]
            target = _RecomputeSegment(_subgraph(run, inputs, outputs), block)
            if owner is None:
                owner = out.get_attr("_fused_self")
            call = out.call_function(target, (owner, *(env[i] for i in inputs)))
            for k, o in enumerate(outputs):
                env[o] = out.call_function(operator.getitem, (call, k))
        elif node not in inside:
            env[node] = out.node_copy(node, env.__getitem__)
    out.lint()
    return out


class _Mark(_capture.GraphTarget):
    """Graph target: ``fn(block, *args)``, where a run of a block's nodes begins or ends (the cost
    model's recorder: :func:`_marked`)."""

    def __init__(self, fn: Callable, block: str, where: str):
        self.fn, self.block = fn, block
        self._named(f"{where}_{block}")

    def __call__(self, *args: Any) -> None:
        self.fn(self.block, *args)


def _marked(graph: fx.Graph, names: set[str], enter: Callable, leave: Callable) -> fx.Graph:
    """The fused forward with ``enter(block, *inputs)`` called before each run of a named block's
    nodes (``inputs``: the values the run reads from outside it, what its recomputation keeps) and
    ``leave(block)`` after it: what :func:`hfkern.plan.fit_cost_model` measures a block by. The
    runs are those :func:`apply` checkpoints (of a graph it made, its checkpointed calls)."""
    runs = _runs(graph, names)
    starts = {run[0]: (block, run) for block, run in runs}
    ends = {run[-1]: block for block, run in runs}
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in starts:
            block, run = starts[node]
            members = set(run)
            inputs = list(dict.fromkeys(i for n in run for i in n.all_input_nodes if i not in members))
            out.call_function(_Mark(enter, block, "enter"), tuple(env[i] for i in inputs))
        env[node] = out.node_copy(node, env.__getitem__)
        if node in ends:
            out.call_function(_Mark(leave, ends[node], "leave"), ())
    out.lint()
    return out


_NOT_CALLED = ("the fused forward never runs it as code of its own (the model's forward uses its parameters "
               "directly), so there is nothing to recompute")


# ---- blocks whose inputs are written in place ---------------------------------------------
# torch.utils.checkpoint keeps a recomputed block's inputs for its recomputation and checks their
# versions when backward unpacks them: an input written in place inside the block (an
# nn.ReLU(inplace=True) first in it) or after it, before backward (the model's own `h.mul_(0.5)`
# on what the block read), makes backward raise "one of the variables needed for gradient
# computation has been modified by an inplace operation", where the plain model (which need not
# keep that input) trains. Such a block cannot be recomputed. apply() refuses it where the fused
# graph shows the write (_graph_written_inputs); fit_cost_model() also runs one forward comparing
# the versions of every block's inputs (_inputs_written), and leaves the blocks found out of the
# search. Nothing of this runs in a training step.
_CHECKPOINT_KEEPS_INPUTS = ("torch.utils.checkpoint keeps a recomputed block's inputs for its recomputation, and "
                            "backward would find this one modified (torch: 'one of the variables needed for "
                            "gradient computation has been modified by an inplace operation')")
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})
# Modules that may return their input itself (a view of it): a write through their result reaches it.
_RETURNS_INPUT = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd, _ArrayDropoutNd,
                  _ArrayFlatten)


def _inplace_name(name: Any) -> bool:
    """Whether a method or function of this name writes its first argument in place (``relu_``,
    ``mul_``, ``__setitem__``; not ``requires_grad_``)."""
    return isinstance(name, str) and (name in _INPLACE_DUNDERS or (
        name.endswith("_") and not name.endswith("__") and name != "requires_grad_"))


def _asks_inplace(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether a function call asks for ``inplace`` (``F.relu(x, inplace=True)``,
    ``F.dropout(x, p, True, True)``)."""
    if "inplace" in kwargs:
        flag = kwargs["inplace"]
        return isinstance(flag, fx.Node) or flag is True
    try:
        signature = _SIGNATURES[fn]
    except (KeyError, TypeError):  # (TypeError: an unhashable callable)
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature (a builtin)
            signature = None
        with contextlib.suppress(TypeError):
            _SIGNATURES[fn] = signature
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        flag = signature.bind(*args, **kwargs).arguments.get("inplace", False)
    except TypeError:  # not a call it takes
        return False
    return isinstance(flag, fx.Node) or flag is True


_SIGNATURES: dict[Callable, inspect.Signature | None] = {}


def _effects(node: fx.Node, model: nn.Module) -> tuple[list[fx.Node], list[fx.Node], str]:
    """What a node of a fused forward's graph does to the memory of others: (the nodes whose
    tensors it writes in place, the nodes its result may share memory with, how it is written
    in messages). Calls the fusion made of the model's own (an array op, a module of the
    fused model) are read as the calls they stand for; the fusion's other targets (a user
    module run under vmap, a custom autograd Function) are taken to write nothing, which the
    forward :func:`_inputs_written` runs checks."""
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op == "call_module":
        module = model.get_submodule(node.target)
        what = f"module {node.target!r} ({type(module).__name__}, inplace=True)"
        if getattr(module, "inplace", False) is True:
            return first, first, what
        return [], first if isinstance(module, _RETURNS_INPUT) else [], what
    method, fn = None, None
    if node.op == "call_method":
        method = node.target
    elif node.op == "call_function":
        if isinstance(node.target, _ArrayCall):  # the array op of a call of the model's code
            method, fn = node.target.method, node.target.fn
        elif not isinstance(node.target, _capture.GraphTarget):
            fn = node.target
    if method is not None:
        if _inplace_name(method):
            return first, first, f"`.{method}()`"
        return [], first if method in _VIEW_METHOD_NAMES else [], f"`.{method}()`"
    if fn is None:
        return [], [], ""
    name = getattr(fn, "__name__", None) or repr(fn)
    outs = [n for n in torch.utils._pytree.tree_leaves(node.kwargs.get("out")) if isinstance(n, fx.Node)]
    if fn in _capture._INPLACE_OPERATORS or _inplace_name(name) or _asks_inplace(fn, node.args, node.kwargs):
        flags = ", inplace=True" if _asks_inplace(fn, node.args, node.kwargs) else ""
        return first + outs, first + outs, f"`{name}(...{flags})`"
    if outs:
        return outs, outs, f"`{name}(..., out=...)`"
    return [], first if fn in _VIEW_FUNCTIONS else [], f"`{name}(...)`"


def _graph_written_inputs(graph: fx.Graph, model: nn.Module, names: set[str]) -> dict[str, str]:
    """The blocks (of ``names``) of a fused forward's graph that read a tensor which the graph
    writes in place (or a tensor sharing its memory: a view of it, its source), inside a run of
    the block or after the run, each with the reason. Writes before the run do not matter: the
    checkpoint keeps the input as the run finds it."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    groups = MemoryGroups()  # the nodes that may share memory
    find = groups.find
    writes = []
    for node in nodes:
        written, shared, what = _effects(node, model)
        for src in shared:
            groups.join(node, src)
        writes.extend((node, target, what) for target in written)
    if not writes:
        return {}
    labels = _label(graph)
    found: dict[str, str] = {}
    for block, run in _runs(graph, names):
        if block in found:
            continue
        members = set(run)
        inputs: dict[fx.Node, fx.Node] = {}  # memory (its group) -> the input read from it
        for n in run:
            for i in n.all_input_nodes:
                if i not in members:
                    inputs.setdefault(find(i), i)
        for node, target, what in writes:
            read = inputs.get(find(target))
            if read is None or order[node] < order[run[0]]:
                continue
            if labels[node] == block:
                where = "in the block's own forward"
            elif labels[node] is not None:
                where = f"after it ran, by block {labels[node]!r}"
            else:
                where = "after it ran, by the model's own forward code"
            found[block] = (f"its input ({read.name!r} in the fused model's code) is written in place ({what}) "
                            f"{where}; {_CHECKPOINT_KEEPS_INPUTS}")
            break
    return found


def _written_in_graphs(model: FusedModel, names: Sequence[str]) -> dict[str, str]:
    """:func:`_graph_written_inputs` over the fused model's own graphs (each mode's), in block order."""
    found: dict[str, str] = {}
    for graph in model._own_graphs.values():
        for block, why in _graph_written_inputs(graph, model, set(names)).items():
            found.setdefault(block, why)
    return {n: found[n] for n in names if n in found}


def _inputs_written(model: nn.Module, args: tuple) -> dict[str, str]:
    """The blocks of a fused model whose inputs one forward writes in place, in the block or after
    it (by the model's code or a later block), each with the reason. Runs ``model(*args)`` once,
    with grad enabled, in the model's train/eval mode, its graphs marked where each run of a
    block's nodes begins and ends (:func:`_marked`); the versions of each run's input tensors are
    compared at its start, at its end, and at the end of the forward. This is the check
    torch.utils.checkpoint makes in backward (the versions of what it keeps), made before
    anything recomputes. Not a fused model: ``{}``."""
    if not isinstance(model, FusedModel):
        return {}
    names = blocks(model)
    if not names:
        return {}
    runs: list[list] = []  # [block, [(tensor, version at its start)], versions at its end or None]

    def enter(block: str, *values: Any) -> None:
        tensors = [t for t in torch.utils._pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
        runs.append([block, [(t, _version_of(t)) for t in tensors], None])

    def leave(block: str) -> None:
        if runs and runs[-1][0] == block and runs[-1][2] is None:
            runs[-1][2] = [_version_of(t) for t, _ in runs[-1][1]]

    graphs = model._graphs
    marked = {mode: _marked(g, set(names), enter, leave) for mode, g in graphs.items()}
    model._run_graphs(marked)
    try:
        with torch.enable_grad():
            model(*args)
    finally:
        if model._graphs is marked:  # (a capture of a new call pattern may have replaced them)
            model._run_graphs(graphs)
    found: dict[str, str] = {}
    for block, entered, left in runs:
        if block in found:
            continue
        if left is not None and any(v != w for (_, v), w in zip(entered, left)):
            found[block] = "its forward writes its input in place; " + _CHECKPOINT_KEEPS_INPUTS
        elif any(_version_of(t) != v for t, v in entered):
            found[block] = ("its input is written in place after it ran (by the model's forward code or a later "
                            "block), before backward; " + _CHECKPOINT_KEEPS_INPUTS)
    runs.clear()
    return {n: found[n] for n in names if n in found}


def _not_recomputable(model: nn.Module) -> dict[str, str]:
    """The blocks of an array model that :func:`apply` cannot recompute, each with the reason: of
    a fused model, the blocks its forward never runs as code of their own and those whose input
    its graph writes in place (in the block or after it); of another, its containers."""
    names = blocks(model)
    if isinstance(model, FusedModel):
        called = {block for g in model._own_graphs.values() for block, _ in _runs(g, set(names))}
        written = _written_in_graphs(model, [n for n in names if n in called])
        return {n: _NOT_CALLED if n not in called else written[n] for n in names if n not in called or n in written}
    children = dict(model.named_children())
    return {n: f"it is a {type(children[n]).__name__} (a container whose entries the model calls itself)"
            for n in names if type(children[n]).forward is nn.Module.forward}


def _fused_graphs(model: FusedModel, names: tuple[str, ...]) -> dict:
    """The fused forward's graphs (per train/eval mode) with ``names`` recomputed; raises
    before any change."""
    graphs = model._own_graphs
    if not names:
        return graphs
    wanted = set(names)
    called = {block for g in graphs.values() for block, _ in _runs(g, wanted)}
    missing = [n for n in names if n not in called]
    if missing:
        raise ValueError(
            f"apply: expected blocks that the fused forward calls, got {missing}: their parameters are "
            "used by the model's own forward code, not by a call of the block, so there is nothing "
            "to recompute")
    written = _written_in_graphs(model, names)
    if written:
        raise ValueError(
            f"apply: expected blocks whose inputs stay as they were until backward, got {list(written)}: "
            + "; ".join(f"block {n!r}: {why}" for n, why in written.items())
            + ". Leave such a block out of Strategy.recompute (or make its code and the code after it write "
            "into a copy, e.g. nn.ReLU(inplace=False))")
    return {mode: _with_recompute(g, wanted) for mode, g in graphs.items()}


# ---- apply / unapply -----------------------------------------------------------------------
def applied(model: nn.Module) -> Strategy | None:
    """The strategy :func:`apply` last applied to ``model`` (None: none, or :func:`unapply` since)."""
    return getattr(model, _APPLIED, None)


def apply(model: nn.Module, strategy: Strategy) -> nn.Module:
    """Apply ``strategy`` to an array model, in place; returns ``model``.

    * The blocks named in ``strategy.recompute`` recompute their activations in
      backward (``torch.utils.checkpoint``, non-reentrant); every model's
      outputs, losses and gradients are unchanged (to float32 rounding), batch
      norm's running statistics and every buffer end as after one forward, and
      dropout draws the forward's masks again. Of an :func:`hfkern.fuse` model,
      the fused forward is recompiled with each stretch of a block's code run
      as one checkpointed call (``model.code`` shows them); the modules, the
      ``state_dict`` and the per-slot surgery are untouched. Of any other array
      model, each named child becomes a :class:`Recompute` of its own class
      (same object, same ``state_dict`` keys); it recomputes when it is called
      as a module.
    * The array convs take ``strategy.memory_format``
      (:func:`hfkern.nn.set_memory_format`). Apply before building the
      optimizer: optimizer state made earlier keeps the old strides.

    Applying again replaces the recomputed set (the blocks of the new strategy
    recompute, no others); :func:`unapply` removes it. Precision and
    micro-batches are the step's business (:func:`make_step`).

    Raises TypeError for a model that is not an array model, ValueError for a
    ``strategy.B`` other than the model's, for names that are not blocks (the
    message lists the blocks), and for blocks that cannot be recomputed (of a
    fused model: a block its forward never calls, one whose grad-mode or
    autocast region does not end within it, and one whose input the fused
    graph writes in place, in the block or after it: the checkpoint keeps its
    inputs for backward); all before the model changes. A block whose forward
    writes its input in place in a way the graph does not show (a custom
    autograd Function, a hand-written array's block) raises RuntimeError at its
    first forward.
    """
    if not isinstance(strategy, Strategy):
        raise TypeError(f"apply: expected a hfkern.plan Strategy, got {type(strategy).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply: expected a torch.nn.Module (an array model), got {type(model).__name__}")
    B = _array_size(model, "apply")
    if strategy.B != B:
        raise ValueError(f"apply: expected a strategy for the model's B={B}, got B={strategy.B}")
    valid = blocks(model)
    unknown = [n for n in strategy.recompute if n not in valid]
    if unknown:
        raise ValueError(f"apply: expected block names among {valid}, got {unknown}")
    if isinstance(model, FusedModel):
        model._run_graphs(_fused_graphs(model, strategy.recompute))  # may raise: nothing changed yet
    else:
        children = dict(model.named_children())
        for name in strategy.recompute:
            block = children[name]
            if type(block).forward is nn.Module.forward:
                raise ValueError(
                    f"apply: expected blocks that are called as modules, got {name!r}, a "
                    f"{type(block).__name__} (a container whose entries the model calls itself): "
                    "recompute the model's own blocks or fuse it")
        for block in children.values():
            if isinstance(block, Recompute):
                _swap_out(block)
        for name in strategy.recompute:
            _swap_in(children[name])
    set_memory_format(model, MEMORY_FORMATS[strategy.memory_format])
    object.__setattr__(model, _APPLIED, strategy)
    return model


def unapply(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`'s recomputation (no block recomputes); returns ``model``.

    The memory format stays as applied (set another with
    :func:`hfkern.nn.set_memory_format`). A model never applied is returned as it is.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unapply: expected a torch.nn.Module (an array model), got {type(model).__name__}")
    if isinstance(model, FusedModel) and model._graphs is not model._own_graphs:
        model._run_graphs(model._own_graphs)
    for block in model.children():
        if isinstance(block, Recompute):
            _swap_out(block)
    if hasattr(model, _APPLIED):
        delattr(model, _APPLIED)
    return model


# ---- the training step ---------------------------------------------------------------------
_BATCH_NORMS = (_ArrayBatchNorm, nn.modules.batchnorm._BatchNorm)


def _model_side(strategy: Strategy) -> tuple:
    """What :func:`apply` does to the model (the rest is the step's)."""
    return strategy.B, frozenset(strategy.recompute), strategy.memory_format


def _capturing() -> bool:
    """A CUDA graph capture is under way: nothing may wait for the device (no host checks)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _known_mean(loss_fn: Callable, B: int, shared: bool) -> Callable | str | None:
    """For :func:`hfkern.nn.functional.cross_entropy` or ``nll_loss`` (itself, or a
    ``functools.partial`` of it with keyword arguments only): the denominator of its mean over a
    chunk's targets (what :func:`make_step`'s ``loss_denominator`` gives), computed as it
    computes it: the summed class weights of the targets not ignored, their count without
    weights; the element count for class-probability targets. ``"sum"`` where it sums
    (``reduction='sum'``), None for any other loss (whose mean is not known)."""
    from ..nn import functional as AF

    func, kw = loss_fn, {}
    if isinstance(loss_fn, functools.partial) and not loss_fn.args:
        func, kw = loss_fn.func, dict(loss_fn.keywords)
    if func is not AF.cross_entropy and func is not AF.nll_loss:
        return None
    reduction, weight, ignore_index = kw.get("reduction", "mean"), kw.get("weight"), kw.get("ignore_index", -100)
    if reduction == "sum":
        return "sum"
    if reduction != "mean" or not isinstance(ignore_index, int) or not (
            weight is None or isinstance(weight, torch.Tensor) and weight.dim() in (1, 2)):
        return None  # the loss refuses these itself

    def denominator(y: torch.Tensor) -> Any:
        if y.is_floating_point():  # class probabilities: the mean is over the elements
            return y.numel() // (1 if shared else max(y.size(0), 1))
        valid = y != ignore_index
        if weight is None:
            counted = valid
        else:
            t = y.long().masked_fill(~valid, 0)
            w = weight.to(y.device)
            if w.dim() == 1:
                counted = w[t] * valid
            elif shared:  # [B, C] weights of one shared target: [B, N, ...]
                counted = w[:, t] * valid
            else:
                counted = w.gather(1, t.reshape(t.size(0), -1)).view(t.shape) * valid
        per_model = not shared or counted.dim() == y.dim() + 1
        return counted.flatten(1).sum(1) if per_model else counted.sum()

    return denominator


def _counts(who: str, value: Any, B: int, k: int) -> torch.Tensor:
    """A ``loss_denominator`` result as a float tensor, ``[]`` or ``[B]``; TypeError/ValueError
    for another."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{who}: expected loss_denominator to return a number or a tensor ([] or [B={B}]), got "
                        f"{type(value).__name__} for micro-batch {k}")
    if isinstance(value, torch.Tensor):
        if value.shape not in ((), (B,)) or value.is_complex():
            raise ValueError(f"{who}: expected loss_denominator to return a real number or a [] or [B={B}] "
                             f"tensor, got a {value.dtype} tensor of shape {list(value.shape)} for micro-batch {k}")
        return value.detach().to(torch.float64 if value.device.type != "mps" else torch.float32)
    return torch.tensor(float(value), dtype=torch.float64)


def make_step(model: nn.Module, optimizer: Any, strategy: Strategy, loss_fn: Callable, *,
              shared: bool = True, allow_batch_statistics: bool = False,
              loss_denominator: Callable | None = None) -> Callable:
    """The training step of ``model`` under ``strategy``: ``step(x, y, **step_kwargs) -> losses [B]``
    (``step_kwargs`` go to ``optimizer.step``, e.g. an hfkern optimizer's ``skip`` mask).

    ``step`` zeroes the gradients, splits the batch into
    ``strategy.micro_batches`` nearly equal chunks (sizes differing by at most
    one), and for each chunk runs ``loss_fn(model(x_chunk), y_chunk)`` (the
    ``[B]`` per-model mean losses, e.g. :func:`hfkern.nn.functional.cross_entropy`)
    under ``torch.autocast(device_type, dtype=torch.bfloat16)`` when
    ``strategy.precision`` is ``"bf16"``, and backward of the chunk's losses
    weighted by its share of the batch's denominator (below), so that the
    gradients are those of the full batch's mean loss; then
    ``optimizer.step()``. It returns the full batch's per-model losses (the
    weighted sum of the chunks', in float32 or the losses' dtype if wider,
    detached), ``[B]``.

    Micro-batches and the mean. A chunk's mean loss weighs ``d_k / D``: what
    its mean divides by (``d_k``) over what the full batch's divides by
    (``D``, the sum of them), which gives the full batch's mean exactly. By
    default ``d_k`` is the chunk's number of samples: right for a mean in
    which every sample counts the same (``mse_loss`` and ``l1_loss``
    without ``weight``, ``binary_cross_entropy_with_logits``,
    ``cross_entropy`` without class weights or ignored targets), and not for
    others: ``cross_entropy`` with ``ignore_index`` targets or class
    ``weight`` divides by the summed weights of the targets it does not
    ignore, and a weighted ``mse_loss`` by its summed weights, so a chunk
    with more padding would count as much as one with less. For such a loss, pass
    ``loss_denominator``. :func:`hfkern.nn.functional.cross_entropy` and
    ``nll_loss`` given as ``loss_fn`` themselves (or as a ``functools.partial``
    with keyword arguments: ``partial(cross_entropy, weight=w,
    ignore_index=0)``) are recognized and weighted by their own denominator.
    For any other ``loss_fn`` (a wrapper, a lambda) with
    ``micro_batches > 1``, a batch whose targets are integers with negative
    entries (ignored targets: ``ignore_index=-100``) is refused with
    ValueError unless ``loss_denominator`` is given (the check reads the
    targets: a device sync per step for CUDA targets; under CUDA graph
    capture nothing is checked); class weights, or an ``ignore_index`` that is
    not negative, inside a wrapper cannot be seen: pass ``loss_denominator``
    for them.

    Args:
        model: an array model that :func:`apply` gave this strategy (same B,
            recomputed blocks and memory format).
        optimizer: its optimizer (``zero_grad()`` and ``step()``), e.g. an
            :mod:`hfkern.optim` optimizer.
        strategy: the strategy.
        loss_fn: ``loss_fn(output, target) -> [B]`` per-model mean losses.
        shared: True: ``x`` ``[N, ...]`` and ``y`` ``[N, ...]`` are one batch
            every model trains on (``step`` passes ``hfkern.broadcast(x, B)``);
            False: ``x`` ``[B, N, ...]`` and ``y`` ``[B, N, ...]`` hold each
            model's own batch (an :func:`hfkern.broadcast` view is fine).
        allow_batch_statistics: micro-batching equals the full batch only for
            models without layers that mix the samples of a batch: batch norm
            normalizes each micro-batch by its own statistics (and updates its
            running statistics once per micro-batch). ``make_step`` refuses
            ``micro_batches > 1`` on a model with batch norm unless this is True.
            Dropout draws its masks per micro-batch: the same distribution, not
            the same numbers as one full-batch step.
        loss_denominator: ``loss_denominator(y_chunk)``: what ``loss_fn``'s mean
            over the chunk's targets divides by, a number or a tensor, ``[]``
            (for every model) or ``[B]`` (per model), e.g. ``lambda y: (y !=
            -100).sum()`` for padded targets (``shared=False``: ``lambda y: (y
            != -100).flatten(1).sum(1)``). Called on every chunk before the
            step changes anything; a chunk it counts nothing in (for every
            model) is skipped, and ValueError is raised for a negative or
            non-finite count, for a chunk that counts nothing for some models
            only (their mean loss would be 0/0, NaN in their gradients, where
            the full batch's is not) and for a batch that counts nothing for a
            model. Its values are read on the host (a device sync for device
            tensors; under CUDA graph capture nothing is checked nor skipped).
            Used only where ``micro_batches > 1``.

    Raises TypeError/ValueError for arguments outside these (ValueError for
    ``micro_batches > 1`` with a recognized loss given ``reduction='sum'``:
    the chunks' weights are for means); ``step`` raises ValueError for a batch
    of other shapes, with fewer than ``micro_batches`` samples, or refused as
    above, before it changes anything.
    """
    if not isinstance(strategy, Strategy):
        raise TypeError(f"make_step: expected a hfkern.plan Strategy, got {type(strategy).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_step: expected a torch.nn.Module (an array model), got {type(model).__name__}")
    if not (callable(getattr(optimizer, "zero_grad", None)) and callable(getattr(optimizer, "step", None))):
        raise TypeError(f"make_step: expected an optimizer (with zero_grad() and step()), got "
                        f"{type(optimizer).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"make_step: expected loss_fn to be callable, got {type(loss_fn).__name__}")
    for name, flag in (("shared", shared), ("allow_batch_statistics", allow_batch_statistics)):
        if not isinstance(flag, bool):
            raise TypeError(f"make_step: expected {name} to be a bool, got {type(flag).__name__} {flag!r}")
    if loss_denominator is not None and not callable(loss_denominator):
        raise TypeError(f"make_step: expected loss_denominator to be callable or None, got "
                        f"{type(loss_denominator).__name__}")
    done = applied(model)
    if done is None or _model_side(done) != _model_side(strategy):
        raise ValueError(
            f"make_step: expected a model that apply() gave this strategy's B, recomputed blocks and "
            f"memory format ({strategy.label!r}), got a model with "
            f"{'no strategy applied' if done is None else repr(done.label)}: call apply(model, strategy) "
            "before building the optimizer")
    m = strategy.micro_batches
    if m > 1 and not allow_batch_statistics:
        norms = [name for name, mod in model.named_modules() if isinstance(mod, _BATCH_NORMS)]
        if norms:
            raise ValueError(
                f"make_step: micro_batches={m} on a model with batch norm ({', '.join(norms)}) normalizes "
                "each micro-batch by its own statistics, not the full batch's; expected micro_batches=1 "
                "or allow_batch_statistics=True to accept that")
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError("make_step: expected a model with parameters, got none")
    device_type = param.device.type
    if strategy.precision == "bf16" and not torch.amp.is_autocast_available(device_type):
        raise ValueError(f"make_step: precision 'bf16' needs autocast on the model's device type, "
                         f"got {device_type!r}, where torch has none")
    B = strategy.B
    dim = 0 if shared else 1  # the batch dim of x and y
    known = (loss_denominator or _known_mean(loss_fn, B, shared)) if m > 1 else None
    if known == "sum":
        raise ValueError(f"make_step: micro_batches={m} weighs each micro-batch's per-model mean loss; expected "
                         f"a loss_fn returning means, got {getattr(loss_fn, 'func', loss_fn).__name__} with "
                         "reduction='sum'")
    denominator = known  # None: the chunks' sample counts

    def autocast() -> contextlib.AbstractContextManager:
        if strategy.precision == "bf16":
            return torch.autocast(device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def weights(y: torch.Tensor, ys: tuple, N: int) -> list:
        """Each chunk's weight (a float, a [B] tensor, or None: skipped), before anything changes."""
        if denominator is None:
            if (not (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool) and not _capturing()
                    and bool((y < 0).any())):
                raise ValueError(
                    f"step: micro_batches={m} weighs each micro-batch's mean loss by its share of the samples, "
                    "the full batch's mean only where every sample counts the same; expected targets a mean over "
                    "samples takes, got integer targets with negative entries (ignored targets: ignore_index), "
                    "whose mean divides by the targets not ignored. Pass make_step(..., loss_denominator=...) "
                    "(e.g. lambda y: (y != -100).sum()), or loss_fn=hfkern.nn.functional.cross_entropy itself")
            return [yk.size(dim) / N for yk in ys]
        counts = [_counts("step", denominator(yk), B, k) for k, yk in enumerate(ys)]
        per_model = any(c.dim() == 1 for c in counts)
        table = torch.stack([c.to(counts[0].device).expand(B) for c in counts])  # [m, B]
        if _capturing():  # no host checks: device weights
            return list(table / table.sum(0))
        table = table.cpu()
        if not bool(torch.isfinite(table).all()) or bool((table < 0).any()):
            raise ValueError(f"step: expected loss_denominator to count finite, non-negative amounts, got "
                             f"{table.tolist()} (per micro-batch, per model)")
        total = table.sum(0)
        empty = (total == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"step: loss_denominator counts nothing in the batch for models {empty}: their mean "
                             "loss is 0/0; expected a batch with targets the loss counts")
        out = []
        for k, row in enumerate(table):
            zero = (row == 0).nonzero().flatten().tolist()
            if len(zero) == B:
                out.append(None)  # nothing counted: its mean is 0/0 and its weight 0
            elif zero:
                raise ValueError(
                    f"step: micro-batch {k} of {m} holds nothing loss_denominator counts for models {zero} (and "
                    "something for others): their mean loss over it is 0/0, NaN in their gradients, where the "
                    "full batch's is not; expected fewer micro_batches or batches with counted targets in "
                    "every micro-batch")
            else:
                w = row / total
                out.append(w if per_model else float(w[0]))
        return out

    def step(x: torch.Tensor, y: torch.Tensor, **step_kwargs: Any) -> torch.Tensor:
        for name, t in (("x", x), ("y", y)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"step: expected {name} to be a torch.Tensor, got {type(t).__name__}")
        if shared:
            if x.dim() < 1 or y.dim() < 1 or y.size(0) != x.size(0):
                raise ValueError(f"step: expected x [N, ...] and y [N, ...] shared by the models (shared=True), "
                                 f"got x {list(x.shape)} and y {list(y.shape)}")
        elif x.dim() < 2 or y.dim() < 2 or x.size(0) != B or tuple(y.shape[:2]) != tuple(x.shape[:2]):
            raise ValueError(f"step: expected x [B={B}, N, ...] and y [B={B}, N, ...] per model (shared=False), "
                             f"got x {list(x.shape)} and y {list(y.shape)}")
        N = x.size(dim)
        if N < m:
            raise ValueError(f"step: expected a batch of at least micro_batches={m} samples, got N={N}")
        xs, ys = torch.tensor_split(x, m, dim), torch.tensor_split(y, m, dim)
        shares = weights(y, ys, N) if m > 1 else [1.0]
        optimizer.zero_grad()
        total = None
        for xk, yk, share in zip(xs, ys, shares):
            if share is None:
                continue
            with autocast():
                out = model(broadcast(xk, B) if shared else xk)
                losses = loss_fn(out, yk)
            if not (isinstance(losses, torch.Tensor) and losses.shape == (B,)):
                raise ValueError(f"step: expected loss_fn to return the [B] = [{B}] per-model losses, got "
                                 f"{type(losses).__name__} {list(getattr(losses, 'shape', []))}")
            # float32 at least (bf16 losses under autocast); float64 models' stay float64
            losses = losses.to(torch.promote_types(losses.dtype, torch.float32))
            if isinstance(share, torch.Tensor):
                share = share.to(losses.device, losses.dtype)
            # Chunk k's mean loss weighted by d_k / D: the gradients sum to the full batch mean's.
            (losses * share).sum().backward()
            part = losses.detach() * share
            total = part if total is None else total + part
        optimizer.step(**step_kwargs)
        return total

    return step


class Streams:
    """One CUDA stream per array in flight, forked from and joined to the current stream.

    ``fork()`` makes every stream wait for the work queued so far on the
    current stream; work issued under ``on(i)`` then runs on stream ``i``,
    free to overlap the other streams' work; ``join()`` makes the current
    stream wait for all of them, so what they produced is ready to use as
    after plain calls. Between a fork and its join the streams share nothing:
    a tensor one of them writes is not read by another. On a device other
    than CUDA (or for one array) there are no streams: ``on(i)`` does nothing
    and the work runs one after another, as issued.
    """

    def __init__(self, n: int, device: torch.device | str | None):
        device = torch.device(device) if device is not None else None
        self.n = n
        self.cuda = device is not None and device.type == "cuda" and n > 1
        self._streams = [torch.cuda.Stream(device) for _ in range(n)] if self.cuda else []
        self._current = None

    def __len__(self) -> int:
        return self.n

    def fork(self) -> None:
        if self.cuda:
            self._current = torch.cuda.current_stream(self._streams[0].device)
            for stream in self._streams:
                stream.wait_stream(self._current)

    def on(self, i: int) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._streams[i]) if self.cuda else contextlib.nullcontext()

    def record(self, i: int, *tensors: Any) -> None:
        """``tensors``, made on the current stream, are read on stream ``i``: not reused before it is done."""
        if self.cuda:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self._streams[i])

    def join(self, *outputs: Any) -> None:
        """The current stream waits for every stream; ``outputs`` (made on them) are then read on it."""
        if self.cuda:
            for stream in self._streams:
                self._current.wait_stream(stream)
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self._current)


class InFlight:
    """Training steps of several arrays run together: ``InFlight(steps)(x, y) -> [losses of each]``.

    ``steps``: one training step per array (:func:`make_step`'s, or any
    ``step(x, y, **kw) -> losses``), as many as :attr:`Strategy.arrays`. Called
    with one batch ``(x, y)`` every array trains on, or with ``batches=[(x, y),
    ...]`` one per array; keyword arguments go to every step.

    On CUDA each array's step is issued on a stream of its own
    (:class:`Streams`), so that the device overlaps one array's small kernels
    with another's (what two jobs on one GPU get from its scheduler); each
    stream first waits for the work queued so far on the current stream (the
    batch), and the current stream waits for all of them before the call
    returns, so the results are ready to use as after plain calls. Elsewhere
    the steps run one after another. The arrays share nothing, so each one's
    losses and parameters are those of its own step run alone.
    """

    def __init__(self, steps: Any, device: torch.device | str | None = None):
        steps = list(steps) if not callable(steps) else None
        if not steps or not all(callable(s) for s in steps):
            raise TypeError("InFlight: expected a non-empty sequence of step callables (one per array)")
        self.steps = steps
        self.device = torch.device(device) if device is not None else None
        self._streams: Streams | None = None

    def __call__(self, x: Any = None, y: Any = None, *, batches: Any = None, **step_kwargs: Any) -> list:
        if batches is None:
            if x is None or y is None:
                raise TypeError("InFlight: expected (x, y) shared by the arrays or batches=[(x, y), ...]")
            batches = [(x, y)] * len(self.steps)
        else:
            if x is not None or y is not None:
                raise TypeError("InFlight: expected either (x, y) or batches=, got both")
            batches = list(batches)
            if len(batches) != len(self.steps):
                raise ValueError(f"InFlight: expected one batch per array ({len(self.steps)}), "
                                 f"got {len(batches)}")
        if self._streams is None:
            device = self.device if self.device is not None else getattr(batches[0][0], "device", None)
            self._streams = Streams(len(self.steps), device)
        streams = self._streams
        streams.fork()
        out = []
        for i, (step, (bx, by)) in enumerate(zip(self.steps, batches)):
            streams.record(i, bx, by)
            with streams.on(i):
                out.append(step(bx, by, **step_kwargs))
        streams.join(*out)
        return out
