"""Capturing a model's ``forward`` for :func:`hfkern.fuse`: torch.fx, and what fx alone misses.

``torch.fx`` records the tensor operations a ``forward`` applies to its
inputs and parameters. Run on a live model, it also *executes* everything
else: an in-place update of a buffer (``self.calls += 1``, an exponential
moving average under ``torch.no_grad()``) would change the traced model and
never reach the graph; ``with torch.no_grad():`` and the other grad-mode and
autocast regions are not recorded at all; ``torch.randn(3)`` is drawn once and
frozen as a constant. A fused model built from such a graph would silently
compute something else than its models. :func:`capture` closes those gaps:

* It traces a **copy** of the model, so nothing the forward does at capture
  time reaches the user's models.
* **Buffers are traced values** (like parameters; their shapes stay concrete):
  in-place updates of a buffer are recorded and run on the fused model's
  stacked buffer, so each model's running average or counter advances as it
  would under torch.
* **Assignments to module attributes** inside ``forward`` are recorded:
  ``self.buf = value`` for a buffer, or for a plain attribute holding a traced
  value (``self.last = h.detach()``), becomes an assignment on the fused model
  at run time (later reads in the same forward see the new value). A module
  attribute given a *Python* value that differs from the one it holds
  (``self.steps += 1`` on an int) cannot be reproduced per model and per call
  by a captured graph, and is refused (:class:`FuseError`, naming the module
  and the statement; register a buffer instead), as are new parameters or
  submodules made in ``forward``.
* **Mode regions** ``torch.no_grad``, ``torch.enable_grad``,
  ``torch.set_grad_enabled`` (as a context or a call), ``torch.inference_mode``
  and ``torch.autocast`` (and its device-specific subclasses), as contexts or
  decorators, are recorded where they are entered and left, and the fused
  forward enters and leaves them at the same points (``torch.set_grad_enabled(mode)``
  called as a function sets the mode and leaves it set, as torch's does).
* **The grad mode read in forward** (``torch.is_grad_enabled()`` in the model's
  code) is recorded as a read when the fused forward runs, where torch.fx would
  freeze the mode of the capture: ``prev = torch.is_grad_enabled(); ...;
  torch.set_grad_enabled(prev)`` restores the caller's mode. Python control flow
  on it (``if torch.is_grad_enabled():``) cannot be one graph for both modes and
  is refused (:class:`GradModeBranch`), unless the capture is for one grad mode
  (``capture(..., grad_mode=...)``: the read is then that Python value).
* **Train/eval mode changes in forward** (``self.bn.eval()``, ``module.train(mode)``,
  ``module.training = mode``) are recorded: the fused model's module (its array
  module, for a layer) changes mode at the same point, and keeps it after the
  call, as torch's does. A change of a module inside a layer called as a whole
  is refused, as is one that leaves the modules whose code is captured in
  different modes where forward's code depends on the mode (the fused model
  runs a forward captured with all of them in train mode, or all in eval mode).
* **Random draws without a traced argument** (``torch.randn(3)``,
  ``torch.rand(2, 5)``, ``torch.randint``, ``torch.randperm``, ``torch.normal``,
  ``torch.bernoulli``, ``torch.multinomial``, ``torch.poisson`` and the
  ``*_like`` forms) are recorded and drawn anew at every call, once per model.
  Drawing into a tensor in place (``torch.empty(3).normal_()``) on a tensor
  that is not a traced value is refused: write it as one of those calls.
* **Sizes from the input** in tensor factories (``torch.zeros(x.size(0), 8)``,
  ``torch.ones((n, d))``, ``torch.full``, ``torch.empty``, ``torch.eye``,
  ``torch.linspace`` and the random factories above) and ``len(x)`` are
  recorded as calls on the traced sizes (torch.fx alone takes a size only as a
  tensor factory's single argument, and no ``len`` at all).
* **Arguments that are Python constants** (None, a bool, an int, a string) in
  the call a graph is captured for can be passed to ``forward`` as those Python
  values (``concrete``), where torch.fx would trace every argument as a tensor
  (never None): ``if mask is None:`` then takes the branch such a call takes.
* **Custom autograd Functions** (``Fn.apply(x)`` in the model's code) are one call,
  not the ops their forward would be traced into, so that their own backward runs.
  A Function of torch's own that torch's code applies is traced through only where
  that is known to be right; a reentrant checkpoint
  (``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)``, whose Function runs
  ``fn`` under ``no_grad`` and recomputes it in backward) is captured as the call of ``fn``
  itself, its outputs connected to autograd as torch's Function connects them (where the
  grad mode is on and a tensor argument requires grad), with the same gradients and no
  recomputation (as a non-reentrant checkpoint is captured); any other is refused.
* **Random state**: ``torch.manual_seed``, ``torch.seed``, ``torch.initial_seed``,
  ``torch.get_rng_state``/``set_rng_state`` (and ``torch.cuda``'s) and
  ``torch.random.fork_rng`` in forward are refused: they would run once at capture,
  and the fused model's per-model random streams cannot reproduce a reseed per model.
  So is a ``torch.Generator`` passed to a call (one generator cannot draw each model's
  numbers), and any other object torch.fx would keep as a constant of the graph.
* **Modules that are not registered** (held in a plain list or dict, or set with
  ``object.__setattr__``) are refused by name, except a slice of a registered
  ``nn.Sequential`` (``self.blocks[1:](x)``), which is the call of its modules in order.
  Hooks registered on tensors in forward (``h.register_hook``) are refused.
* **Iterating over the pieces** of ``chunk(n)``, ``split([sizes])``, ``tensor_split(n)``
  (``for c in h.chunk(3, -1):``) gives that many pieces (a ``chunk`` that gives fewer
  for an input raises :class:`FuseError` there); a number of pieces that depends on the
  input's size (``split(size)``, ``unbind``) is refused.
* **Assignments to a traced tensor's attributes**: ``param.data = value`` on a
  parameter (reached as an attribute or through ``parameters()``) or a buffer is
  recorded; ``x.requires_grad = flag`` on a computed tensor or an input is
  ``requires_grad_(flag)``; anything else (``.data`` or ``.grad`` of a computed
  tensor, ``.requires_grad`` of a parameter) is refused, where fx would drop it.
* **Hooks** of modules whose code is traced run once, here: one that returns None
  and records no in-place write or assignment acts only through Python side
  effects, and is refused.
* **Tensor constants** (tensors made in ``forward`` from Python values, and
  tensor attributes that are neither parameters nor buffers) are returned
  with the graph; modifying one in place is refused (it is state: make it a
  buffer).
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import inspect
import linecache
import operator
import os
import re
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FuseError", "GradModeBranch", "Captured", "capture", "AssignState", "RandomDraw", "SetData",
           "SetMode", "open_regions", "changes_mode"]


class FuseError(ValueError):
    """A model that :func:`hfkern.fuse` cannot turn into an array model (the message says why and where)."""


# ---- where an error points ------------------------------------------------------------
def _library_file(filename: str) -> bool:
    roots = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    return os.path.abspath(filename).startswith(roots)


def _user_line(frames: list[traceback.FrameSummary]) -> str:
    """`` at file.py:12: `code` `` for the innermost frame of the user's code, or ''."""
    frames = [f for f in frames if not _library_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno}: `{f.line}`"


_LIBRARY_FILES: dict[str, bool] = {}


def _user_site(depth: int = 2) -> tuple[str, int] | None:
    """``(filename, lineno)`` of the innermost frame of the user's code calling this (past
    ``depth`` frames), or None: a frame walk, cheap enough for every captured node."""
    frame = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        library = _LIBRARY_FILES.get(filename)
        if library is None:
            library = _LIBRARY_FILES[filename] = _library_file(filename)
        if not library:
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


def site_line(site: tuple[str, int] | None) -> str:
    """`` at file.py:12: `code` `` for a :func:`_user_site`, or ''."""
    if not site:
        return ""
    code = linecache.getline(site[0], site[1]).strip()
    return f" at {os.path.basename(site[0])}:{site[1]}" + (f": `{code}`" if code else "")


def where(module: tuple[str, str] | None, root: nn.Module) -> str:
    if module is None or not module[0]:
        return f"in the model's own forward ({type(root).__name__})"
    return f"in module '{module[0]}' ({module[1]})"


def _construct(message: str) -> str:
    """What a tracing error means, in the user's terms."""
    if "cannot be iterated" in message:
        # (fx's message for this ends with a pointer to its docs on control flow)
        return ("iterating over a traced value (a `for` loop over a tensor, or unpacking one with `*`: "
                "torch.fx traces forward's own `*args` or `**kwargs` as one value, so `f(*args)` cannot be "
                "captured; name forward's arguments)")
    if "control flow" in message:
        return ("Python control flow on a traced value (an `if`/`while`/`and`/`assert` on a tensor value "
                "or shape, or on an argument of forward: an argument that is not a Python constant (None, "
                "a bool, an int, a string, ...) is a traced value, floats included)")
    if "len" in message:
        return "len() of a tensor"
    if "argument of type" in message:
        return ("an object that a captured graph cannot hold as a value (forward returns it or passes it to a "
                "call: return tensors in tuples, lists, dicts, namedtuples or dataclasses, and pass tensors and "
                "Python constants)")
    if "parameter is not a member" in message:
        return ("a parameter that is not registered in the model (held in a plain list or dict: use "
                "nn.ParameterList or nn.ParameterDict)")
    return "an operation torch.fx cannot capture"


REMEDY = (
    "Write the branch with tensor ops (torch.where), move it out of forward, or name the module's "
    "class in fuse(..., vmap_modules=(Cls,)) to run it under torch.vmap (branches on shapes) or "
    "loop_modules=(Cls,) to run it once per model (any code)."
)

# Calls that read a tensor's values on the host: never the same for B models.
_HOST_READS = {"item", "tolist", "numpy", "nonzero", "unique", "unique_consecutive", "argwhere",
               "masked_select", "__bool__", "__int__", "__float__", "__index__"}


# Functions whose result's size depends on a tensor's values, which differ between the B models.
_VALUE_SIZED = {torch.nonzero: "torch.nonzero", torch.argwhere: "torch.argwhere", torch.unique: "torch.unique",
                torch.unique_consecutive: "torch.unique_consecutive", torch.masked_select: "torch.masked_select"}


def _value_sized(node: fx.Node) -> str | None:
    """The construct a captured call is, where its result's size depends on a tensor's values
    (``torch.nonzero``, ``torch.where(condition)``, ``F.one_hot`` without ``num_classes``)."""
    if node.op != "call_function":
        return None
    try:
        name = _VALUE_SIZED.get(node.target)
    except TypeError:  # (an unhashable target)
        return None
    if name is not None:
        return f"`{name}`"
    if node.target is torch.where and len(node.args) + len(node.kwargs) == 1:
        return "`torch.where(condition)` with one argument (the indices where it holds, as torch.nonzero)"
    if node.target is torch.nn.functional.one_hot:
        classes = node.args[1] if len(node.args) > 1 else node.kwargs.get("num_classes", -1)
        if isinstance(classes, int) and classes < 0:
            return ("`F.one_hot` without `num_classes` (its number of classes is the largest index plus "
                    "one; give num_classes)")
    return None


# ---- what the graph records beyond fx's own nodes -----------------------------------------
class GraphTarget:
    """A callable object that a graph node calls: fx's code generation names it by these."""

    def _named(self, label: str) -> None:
        self.__name__ = self.__qualname__ = label
        self.__module__ = type(self).__module__


class AssignState(GraphTarget):
    """Graph target of ``module.<name> = value`` in forward (``kind``: "buffer" or "attribute").

    The rewrite of :func:`hfkern.fuse` turns it into the assignment on the fused
    model's module ``path``; it is never called as it is.
    """

    def __init__(self, path: str, name: str, kind: str):
        self.path, self.name, self.kind = path, name, kind
        self._named(f"assign_{kind}_{name}")

    def __call__(self, value: Any) -> None:
        raise RuntimeError("AssignState is a capture record; hfkern.fuse rewrites it")


class RandomDraw(GraphTarget):
    """Graph target of a random factory call without a traced argument (``torch.randn(3)``).

    The rewrite of :func:`hfkern.fuse` draws it once per model at every call.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self._named(f"draw_{getattr(fn, '__name__', 'random')}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


# Regions the captured forward has entered and not yet left, innermost last, so
# that FusedModel.forward can leave them when an error cuts the forward short.
_OPEN = threading.local()


def open_regions() -> list:
    stack = getattr(_OPEN, "stack", None)
    if stack is None:
        stack = _OPEN.stack = []
    return stack


class EnterRegion(GraphTarget):
    """Graph target: enter a fresh copy of a mode context (no_grad, inference_mode, autocast, ...)."""

    def __init__(self, template: Any):
        self.template = template  # as it was before its __enter__ at capture time
        self._named(f"enter_{type(template).__name__}")

    def __call__(self) -> Any:
        ctx = copy.copy(self.template)
        ctx.__enter__()
        open_regions().append(ctx)
        return ctx


def set_grad_enabled_call(mode: bool) -> Any:
    """Graph target of ``with torch.set_grad_enabled(mode):``: it sets the mode when made, as torch's
    does, and :func:`exit_region` restores the mode it found."""
    ctx = torch.set_grad_enabled(mode)
    open_regions().append(ctx)
    return ctx


def set_grad_mode(mode: bool) -> None:
    """Graph target of ``torch.set_grad_enabled(mode)`` called as a function (not a ``with``): it sets
    the mode and leaves it set, as torch's does (no region to leave: nothing kept per call)."""
    torch._C._set_grad_enabled(mode)


def grad_mode() -> bool:
    """Graph target of ``torch.is_grad_enabled()`` read in forward: the mode when the fused model runs
    it (``prev = torch.is_grad_enabled(); ...; torch.set_grad_enabled(prev)`` restores the caller's)."""
    return torch.is_grad_enabled()


class GradModeBranch(FuseError):
    """A forward's Python control flow on ``torch.is_grad_enabled()``: one captured graph takes one
    branch. (Captured per grad mode, ``capture(..., grad_mode=...)``, it is a Python value.)"""


# torch's own, for the fused forward's mode changes (the capture patches it while it runs).
_MODULE_TRAIN = nn.Module.train


class SetMode(GraphTarget):
    """Graph target of ``module.train(mode)`` / ``module.eval()`` (``recurse``: the module and its
    submodules, as torch's ``nn.Module.train``) or ``module.training = mode`` (the module alone) in
    forward: the fused model's module (its array module, for a layer) changes mode at that point."""

    def __init__(self, mode: bool, recurse: bool):
        self.mode, self.recurse = mode, recurse
        self._named(f"{'train' if mode else 'eval'}_mode" if recurse else f"set_training_{str(mode).lower()}")

    def __call__(self, module: nn.Module) -> None:
        if self.recurse:
            _MODULE_TRAIN(module, self.mode)  # (torch's base: an override of train() in forward is traced)
        else:
            module.training = self.mode


def exit_region(ctx: Any) -> None:
    """Graph target: leave a region entered by :class:`EnterRegion` or :func:`set_grad_enabled_call`."""
    stack = open_regions()
    if stack and stack[-1] is ctx:
        stack.pop()
    ctx.__exit__(None, None, None)


def changes_mode(node: fx.Node) -> bool:
    """Whether a captured node enters or leaves a grad-mode or autocast region: code on either
    side of it runs in different modes (a rewrite must not move work across it)."""
    t = node.target
    return isinstance(t, EnterRegion) or t is exit_region or t is set_grad_enabled_call or t is set_grad_mode


def leave_open_regions(depth: int) -> None:
    """Leave, innermost first, the regions entered past ``depth`` (a forward that raised)."""
    stack = open_regions()
    while len(stack) > depth:
        stack.pop().__exit__(None, None, None)


_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
                     "poisson", "rand_like", "randn_like", "randint_like")
# The factories themselves, taken before any capture patches them.
RANDOM_FUNCTIONS = frozenset(getattr(torch, name) for name in _RANDOM_FACTORIES)
# Factories whose sizes or values may be traced values (``x.size(0)``): called with one, they
# are recorded (torch's argument parser takes a traced value in no size list).
_SIZED_FACTORIES = ("zeros", "ones", "empty", "full", "eye", "linspace", "logspace", "arange", "empty_strided")
# Functionals that draw random numbers (most in training only): recorded as calls where forward
# gives them tensors that are not traced values (`F.dropout(torch.ones(4), 0.5, self.training)`,
# which fx would run once, at capture); the rewrite draws them per model.
_RANDOM_FUNCTIONALS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                       "rrelu", "gumbel_softmax")
RANDOM_FUNCTIONALS = frozenset(getattr(nn.functional, name) for name in _RANDOM_FUNCTIONALS)
_RANDOM_INPLACE = ("uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_",
                   "log_normal_", "geometric_")
_REGION_CLASSES = (torch.autograd.grad_mode.no_grad, torch.autograd.grad_mode.enable_grad,
                   torch.autograd.grad_mode.inference_mode, torch.amp.autocast_mode.autocast)


class _StateProxy(fx.Proxy):
    """A buffer (or a parameter from ``parameters()``) as a traced value whose metadata answers at
    capture: every model's shape, dtype and device are the same, and code that branches on them
    (``next(self.parameters()).device``) traced before buffers were traced values."""

    def __init__(self, node: fx.Node, tracer: fx.Tracer, value: torch.Tensor):
        super().__init__(node, tracer)
        object.__setattr__(self, "_value", value)

    shape = property(lambda self: self._value.shape)
    ndim = property(lambda self: self._value.ndim)
    dtype = property(lambda self: self._value.dtype)
    device = property(lambda self: self._value.device)
    is_cuda = property(lambda self: self._value.is_cuda)
    requires_grad = property(lambda self: self._value.requires_grad)

    def size(self, dim: int | None = None):
        return self._value.size() if dim is None else self._value.size(dim)

    def dim(self) -> int:
        return self._value.dim()

    def numel(self) -> int:
        return self._value.numel()

    def nelement(self) -> int:
        return self._value.nelement()

    def is_floating_point(self) -> bool:
        return self._value.is_floating_point()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "data":
            # `param.data = value` (a momentum encoder's update): the tensor keeps its identity.
            self.tracer.create_proxy("call_function", SetData(), (self, value), {})
            return
        if name in ("node", "tracer") or name.startswith("_"):
            return object.__setattr__(self, name, value)
        raise FuseError(f"forward assigns `.{name}` of parameter or buffer {self.node.target!r}; only "
                        "`.data` can be assigned in a captured forward")


class SetData(GraphTarget):
    """Graph target of ``tensor.data = value`` on a parameter or buffer (rewritten by hfkern.fuse)."""

    def __init__(self) -> None:
        self._named("set_data")

    def __call__(self, tensor: torch.Tensor, value: Any) -> None:
        tensor.data = value


class ApplyFunction(GraphTarget):
    """Graph target of ``Fn.apply(...)`` for a custom ``torch.autograd.Function`` called in forward:
    one call, so that the fused forward runs the Function itself (its own backward included)
    rather than the ops its forward was traced into."""

    def __init__(self, fn: type):
        self.fn = fn
        self._named(f"apply_{getattr(fn, '__name__', 'function')}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn.apply(*args, **kwargs)


def checkpoint_connects(*args: Any) -> bool:
    """Graph target: whether torch's reentrant checkpoint, a custom autograd Function, would connect
    its outputs to autograd for these arguments: the grad mode is on and a tensor argument requires
    grad (else its outputs, computed under no_grad, require no grad and nothing in it gets one)."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def checkpoint_output(value: Any, connected: bool) -> Any:
    """Graph target: an output of a reentrant checkpoint's function as torch's Function returns it:
    as it is where :func:`checkpoint_connects` holds, else (computed under no_grad) detached."""
    if connected:
        return value
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


class PieceCount(GraphTarget):
    """Graph target: the pieces of a ``chunk(n)`` that forward iterates over, captured as ``n``
    pieces; an input for which torch's ``chunk`` gives fewer (a size that ``n`` pieces of equal
    size cannot cover exactly) raises :class:`FuseError`, where the loop would run fewer times."""

    def __init__(self, n: int, call: str, site: tuple[str, int] | None):
        self.n, self.call, self.site = n, call, site
        self._named("check_pieces")

    def __call__(self, pieces: Any) -> Any:
        if len(pieces) != self.n:
            raise FuseError(
                f"fused forward: forward iterates over the pieces of `{self.call}`{site_line(self.site)}, captured "
                f"as {self.n} pieces, and this input gives {len(pieces)} (torch.chunk gives fewer pieces where "
                "the size does not allow that many of equal size): the captured loop runs a fixed number of "
                "times. Use tensor_split(n) (always n pieces) or an input size that chunk divides")
        return pieces


def _checkpoint_attribute(name: str) -> Any:
    """``torch.utils.checkpoint.<name>``, or None (where forward could not have called checkpoint: the
    module is not imported, or this torch has no such name)."""
    module = sys.modules.get("torch.utils.checkpoint")
    return getattr(module, name, None) if module is not None else None


# Functions of torch's own that torch's code applies in a forward and that are right traced through
# (their forward's ops, which the fused forward runs, have the gradients of their backward), by
# module and name: non-reentrant checkpointing's input saver, in torch versions that have one (it
# saves the inputs for the recomputation; its output is unused). torch.utils.checkpoint's
# CheckpointFunction (the reentrant variant) is captured as its function's call instead.
_TRACED_LIBRARY_FUNCTIONS = {("torch.utils.checkpoint", "_NoopSaveInputs")}

# Calls that read or change the random state (the fused model's draws are per model and per call).
_RNG_FUNCTIONS = ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state")
_CUDA_RNG_FUNCTIONS = ("manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
                       "get_rng_state_all", "set_rng_state", "set_rng_state_all")

# Pieces of a tensor that forward may iterate over: call -> (the count's argument, its keywords).
_PIECES = {"chunk": ("chunks",), "split": ("split_size", "split_size_or_sections"),
           "split_with_sizes": ("split_sizes",), "tensor_split": ("indices_or_sections", "sections", "indices",
                                                                  "tensor_indices_or_sections"),
           "hsplit": ("indices_or_sections", "sections", "indices"),
           "vsplit": ("indices_or_sections", "sections", "indices"),
           "dsplit": ("indices_or_sections", "sections", "indices"), "unbind": ()}
_PIECE_FUNCTIONS = {getattr(torch, name): name for name in _PIECES if hasattr(torch, name)}


def _piece_count(node: fx.Node) -> tuple[int | None, str, bool] | None:
    """For a node that splits a tensor into pieces (``x.chunk(3, -1)``): the number of pieces where
    the call fixes it (None where it depends on the input's size), the call's name, and whether an
    input could give fewer (``chunk``). None for any other node."""
    if node.op == "call_method" and node.target in _PIECES:
        name, rest = node.target, node.args[1:]
    elif node.op == "call_function" and _hashable(node.target) and node.target in _PIECE_FUNCTIONS:
        name, rest = _PIECE_FUNCTIONS[node.target], node.args[1:]
    else:
        return None
    keywords = _PIECES[name]
    given = rest[0] if rest else next((node.kwargs[k] for k in keywords if k in node.kwargs), None)
    if name == "unbind" or given is None or isinstance(given, bool):
        return None, name, False
    if isinstance(given, int):
        if name in ("split",):
            return None, name, False  # ceil(size / split_size) pieces
        return given, name, name == "chunk"
    if isinstance(given, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in given):
        return (len(given) if name in ("split", "split_with_sizes") else len(given) + 1), name, False
    return None, name, False


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# Tensor methods that register a hook on a tensor (refused in forward).
_TENSOR_HOOK_METHODS = ("register_hook", "register_post_accumulate_grad_hook")

# Tensor attributes that an assignment on a traced value (`h.data = v`) changes in torch, where
# fx alone would set a Python attribute on its proxy and drop the assignment.
_TENSOR_SETTERS = ("data", "requires_grad", "grad")


# ---- the tracer ----------------------------------------------------------------------------
class _Tracer(fx.Tracer):
    """fx's tracer with hfkern's leaves, traced buffers, and the records described above."""

    def __init__(self, leaf: Callable[[nn.Module], bool], stack_traces: bool = False,
                 settled: set[tuple[str, str]] | None = None, concrete: dict[str, Any] | None = None,
                 grad_mode: bool | None = None):
        super().__init__()
        # None: `torch.is_grad_enabled()` in forward is read when the fused model runs (a recorded
        # call; a branch on it is refused); a bool: the grad mode this capture is for, the read
        # then a Python value (the capture is right for calls in that mode only).
        self._grad_mode = grad_mode
        self._grad_reads: dict[fx.Node, bool] = {}  # recorded reads -> their value here
        self.reads_grad_mode = False
        self.mixed_modes: str | None = None  # why the forward's mode changes leave mixed modes
        # Arguments of forward traced as the Python values they have in the call being captured
        # (None, a bool, an int, a string, ...), not as traced values: their placeholders stay, unused.
        self._concrete = concrete or {}
        # Python attributes the first call assigned (``(path, name)``) when this traces a second
        # call from the state the first left; None for the first call.
        self._settled = settled
        self.python_assignments: list[tuple[str, str, Any]] = []
        self.record_stack_traces = stack_traces  # costly: only to point at a line in an error
        self._leaf = leaf
        self._modules_entered: list[tuple[str, str]] = []
        # > 0 while fx or a patched torch function runs its own code (fx setting constants
        # on the root, no_grad.__enter__ calling torch.set_grad_enabled): not the user's.
        self._internal = 0
        self._regions: dict[int, list[fx.Proxy]] = {}
        self._state_proxies: dict[str, fx.Proxy] = {}
        self._traced: set[int] = set()
        self.failed_in: tuple[str, str] | None = None
        # the graph's length where each non-reentrant checkpoint's function began, innermost last
        self._checkpointed: list[int] = []

    # -- fx hooks
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if type(m) in _INLINED_MODULES:
            return False
        return self._leaf(m) or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            path = self.path_of_module(m)
        except NameError:  # (fx's "module is not installed as a submodule")
            return self._unregistered_call(m, forward, args, kwargs)
        self._modules_entered.append((path, type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self._modules_entered[-1]  # the innermost module, for the error
            raise
        finally:
            self._modules_entered.pop()

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["hfkern_module"] = self._modules_entered[-1] if self._modules_entered else None
        if kind in ("call_function", "call_method"):
            # where the statement is, for an error of the fused forward about this call
            node.meta["hfkern_site"] = _user_site()
        if kind == "call_method" and target == "view":
            # where the statement is, for an error of the fused forward about this view
            node.meta["hfkern_line"] = _user_line(traceback.extract_stack()[:-1])
        return node

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        if self._concrete and concrete_args is None:
            code = inspect.unwrap(root_fn).__code__
            names = code.co_varnames[1 if is_module else 0:code.co_argcount + code.co_kwonlyargcount]
            first = 1 if is_module else 0  # (args[0] is the module itself)
            args = list(args)
            for i, name in enumerate(names):
                if name in self._concrete:
                    args[first + i] = self._concrete[name]
        return fn, args

    def create_arg(self, a: Any):
        if isinstance(a, torch.Generator):
            found = self._attribute_holding(a)
            label = f"held in attribute {found[1]!r}" if found is not None else "made in forward"
            self._refuse(f"forward passes a torch.Generator ({label}) to a call",
                         "the fused model draws each model's random numbers from a stream of its own, per "
                         "call, and one generator object cannot give each model the numbers its own "
                         "generator would (nor advance B of them). Draw without `generator=` (each model "
                         "then draws its own numbers at every call), or move the draw out of forward",
                         found[0] if found is not None else None)
        self._internal += 1
        try:
            return super().create_arg(a)
        finally:
            self._internal -= 1

    def create_proxy(self, kind, target, args, kwargs, *rest, **more):
        if kind == "call_method" and target in _TENSOR_HOOK_METHODS and not self._internal:
            self._refuse(f"forward registers a hook on a tensor it computes (`.{target}(...)`): tensor hooks "
                         "registered in forward are not supported",
                         "the fused model's tensors hold the B models' values as one [B, ...] array, which a "
                         "hook written for one model's tensor would see as one tensor (a norm of the gradient "
                         "would mix the models). Write the gradient change as a custom "
                         "torch.autograd.Function (Fn.apply(h): its backward runs once per model), or register "
                         "the hook on the fused model's tensors outside forward")
        return super().create_proxy(kind, target, args, kwargs, *rest, **more)

    def iter(self, obj: fx.Proxy):
        """``for c in h.chunk(3, -1):`` (fx iterates a proxy only to unpack it): the pieces of a split
        whose number the call fixes, as that many items; anything else is fx's refusal."""
        count = _piece_count(obj.node)
        if count is None:
            return super().iter(obj)
        n, name, fewer = count
        if n is None:
            how = ("`unbind` gives as many pieces as the dim has elements" if name == "unbind" else
                   f"`{name}` with a size gives as many pieces as that size fits into the dim")
            self._refuse(f"forward iterates over the pieces of `{name}`, whose number depends on the input's "
                         f"size ({how})", "a captured forward is one graph for every input size, so it cannot "
                         "loop over a number of pieces it does not know. Unpack a fixed number of pieces "
                         "(`a, b, c = h.split(2, -1)`), or split into a number of pieces the call fixes: "
                         "chunk(n), tensor_split(n), split([sizes])")
        if fewer:
            obj = self.create_proxy("call_function", PieceCount(n, f"{name}({n})", _user_site()), (obj,), {})
        return iter([obj[i] for i in range(n)])

    def _attribute_holding(self, value: Any) -> tuple[nn.Module, str] | None:
        """(module, label) of the traced model's attribute that holds ``value`` (directly or in a
        list, tuple or dict), or None."""
        with self._own_code():
            for path, module in self.root.named_modules():
                for attr, v in vars(module).items():
                    if attr in ("_parameters", "_buffers", "_modules"):
                        continue
                    if v is value or (isinstance(v, (list, tuple, dict)) and any(
                            x is value for x in tree_flatten(v)[0])):
                        return module, f"{path}.{attr}" if path else attr
        return None

    def _unregistered_call(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """A call of a module that is not a registered submodule of the model. One made in forward (a
        slice of a registered ``nn.Sequential``, ``self.blocks[1:](x)``, is a new Sequential of its
        modules; ``nn.Tanh()(h)``) or held outside the model, with no parameters or buffers but those
        of registered modules, is traced through, as torch runs it (its registered modules' calls,
        its code on traced values); one held in a plain list or dict or set past nn.Module's
        registration, or with state of its own, is refused by name."""
        found = self._attribute_holding(m)
        if found is None:
            with self._own_code():
                state = {id(t) for t in (*self.root.parameters(), *self.root.buffers())}
                own = [t for t in (*m.parameters(), *m.buffers()) if id(t) not in state]
            if not own:
                return forward(*args, **kwargs)  # (its hooks, if any, run as torch's)
            held = "made in forward, or held outside the model, with parameters or buffers of its own"
        else:
            holder = vars(found[0])[found[1].rpartition(".")[2]]
            held = (f"held in the plain {type(holder).__name__} attribute {found[1]!r}" if holder is not m else
                    f"set as attribute {found[1]!r} past nn.Module's registration (object.__setattr__)")
        self._refuse(f"forward calls a {type(m).__name__} module that is not registered as a submodule ({held})",
                     "the fused model holds the B models' registered submodules only. Use nn.ModuleList or "
                     "nn.ModuleDict for modules in a list or dict, and create modules with state in __init__ "
                     "(self.name = module)")

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict):
        if isinstance(attr_val, fx.Proxy):
            return attr_val  # a buffer or attribute this forward assigned a traced value
        with self._own_code():  # fx's and this lookup iterate named_*() unpatched
            if isinstance(attr_val, torch.Tensor) and not isinstance(attr_val, nn.Parameter):
                for name, buf in self.root.named_buffers():
                    if buf is attr_val:
                        return self._state_proxy(name, buf)
            return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _state_proxy(self, name: str, value: torch.Tensor) -> fx.Proxy:
        if name not in self._state_proxies:
            self._state_proxies[name] = self.create_proxy(
                "get_attr", name, (), {}, proxy_factory_fn=lambda n: _StateProxy(n, self, value))
        return self._state_proxies[name]

    def _named_state(self, module: nn.Module, original: Callable, args: tuple, kwargs: dict):
        """``named_parameters()``/``named_buffers()`` of a traced module, the tensors as traced values."""

        def bind(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
            return prefix, recurse, remove_duplicate

        prefix, recurse, remove_duplicate = bind(*args, **kwargs)
        path = self.path_of_module(module)
        for name, value in original(module, "", recurse, remove_duplicate):
            full = f"{path}.{name}" if path else name
            shown = f"{prefix}.{name}" if prefix else name
            yield shown, (value if isinstance(value, fx.Proxy) else self._state_proxy(full, value))

    def trace(self, root, concrete_args=None):
        self._traced = {id(m) for m in root.modules()}
        self._namespaces = _user_namespaces(root)
        self._parameter_names = {n for n, _ in root.named_parameters(remove_duplicate=False)}
        _guard_hooks(self, root)
        constants = [(label, t, _version_of(t)) for _, label, t in _plain_tensors(root)]
        with self._patched():
            graph = super().trace(root, concrete_args)
        for node in graph.nodes:
            # `torch.set_grad_enabled(mode)` as a call (no `with` leaves it): the mode stays set, as
            # torch's does, and no region is kept open past the call
            if node.target is set_grad_enabled_call and not any(u.target is exit_region for u in node.users):
                node.target = set_grad_mode
        self.mixed_modes = _check_mode_changes(graph, root)
        # A tensor attribute the forward writes in place without a traced operand (`self.const.mul_(2)`)
        # is written here, once, and never when the fused model runs.
        written = [label for label, t, version in constants if _version_of(t) != version]
        if written:
            raise FuseError(
                f"fuse: forward writes the tensor attribute(s) {written} (neither parameters nor buffers) in "
                "place; such a tensor is a constant of the captured forward, so the write would happen once, "
                "when the call is captured, not per model and per call: register it as a buffer "
                "(self.register_buffer) so that each model keeps its own")
        return graph

    # -- assignments to a traced tensor's attributes
    def _tensor_setattr(self, proxy: fx.Proxy, name: str, value: Any, original: Callable) -> None:
        if name not in _TENSOR_SETTERS or self._internal:
            return original(proxy, name, value)
        node = proxy.node
        if node.op == "get_attr" and node.target in self._parameter_names:
            if name == "data":  # `self.fc.weight.data = value`: as through parameters() (_StateProxy)
                self.create_proxy("call_function", SetData(), (proxy, value), {})
                return None
            self._refuse(f"forward assigns `.{name}` of parameter {node.target!r}",
                         "a captured forward does not change its parameters' autograd state per call; set "
                         f"`.{name}` before fusing, or on the fused model's parameters outside forward")
        if name == "requires_grad":  # what `requires_grad_()` does, which the fused forward runs
            self.create_proxy("call_method", "requires_grad_", (proxy, value), {})
            return None
        what = "the values" if name == "data" else "the gradient"
        self._refuse(f"forward assigns `.{name}` of a tensor computed in forward",
                     f"the fused model cannot replace {what} of one model's tensor behind autograd's back; "
                     "compute the new value as a tensor of its own (`h = h + (value - h).detach()` keeps "
                     "h's gradient path) or make the tensor a parameter or buffer")

    def _plain_tensor_setattr(self, tensor: torch.Tensor, name: str, value: Any, original: Callable) -> None:
        """An assignment to an attribute of a tensor that is not a traced value.

        ``self.const.data = value`` on a tensor attribute (neither a parameter nor a buffer, so
        a constant of the captured forward) would run once, here, and never in the fused
        forward: refused, as in-place writes to such a tensor are. Other tensors' (one made in
        forward from Python values, also a constant, changes the same way at every call) are
        assigned as usual.
        """
        if name == "data" and not self._internal:
            found = self._tensor_attribute(tensor)
            if found is not None:
                module, label = found
                self._refuse(f"forward assigns `.data` of the tensor attribute {label!r} (neither a parameter "
                             "nor a buffer)", "such a tensor is a constant of the captured forward, so the "
                             "assignment would run once, when the model is fused, not per model and per call; "
                             "register it as a buffer (self.register_buffer) so that each model keeps its own",
                             module)
        return original(tensor, name, value)

    def _tensor_attribute(self, tensor: torch.Tensor) -> tuple[nn.Module, str] | None:
        """(module, name) of the traced model's plain attribute that holds ``tensor`` (directly or
        in a list, tuple or dict), or None."""
        with self._own_code():
            return next(((module, label) for module, label, t in _plain_tensors(self.root) if t is tensor), None)

    # -- custom autograd Functions
    def _apply_function(self, fn: type, args: tuple, kwargs: dict, original: Callable) -> Any:
        if self._internal:
            return original(fn, *args, **kwargs)
        if fn is _checkpoint_attribute("CheckpointFunction") and fn is not None:
            # (its function may read traced values without a traced argument: always its call)
            return self._reentrant_checkpoint(args, kwargs)
        if not any(isinstance(v, fx.Proxy) for v in tree_flatten((args, kwargs))[0]):
            return original(fn, *args, **kwargs)
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename == __file__:
            caller = caller.f_back  # past the patch's own frames
        if caller is not None and _library_file(caller.f_code.co_filename):
            if (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) in _TRACED_LIBRARY_FUNCTIONS:
                return original(fn, *args, **kwargs)  # torch's own code: traced through, as fx does
            # Traced through, its forward's ops would run with the gradients autograd gives them, not
            # its backward's (a checkpoint's Function runs its function under no_grad: none at all).
            self._refuse(f"forward calls torch code that applies torch's own autograd Function "
                         f"`{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}`",
                         "a captured forward would run the ops of that Function's forward without its own "
                         "backward, which may give other gradients. Call it outside forward, or name the class "
                         "of the module whose forward calls it in fuse(..., loop_modules=(Cls,)) to run that "
                         "module once per model")
        try:
            return self.create_proxy("call_function", ApplyFunction(fn), args, kwargs)
        except FuseError:
            raise
        except Exception as e:  # noqa: BLE001 - an argument a graph cannot hold
            self._refuse(f"forward calls `{fn.__name__}.apply` with an argument the captured forward "
                         f"cannot hold ({type(e).__name__}: {e})",
                         "pass tensors and Python constants (numbers, strings, tuples of them) only")

    def _reentrant_checkpoint(self, args: tuple, kwargs: dict) -> Any:
        """``CheckpointFunction.apply(function, preserve_rng_state, *args)`` (``torch.utils.checkpoint.
        checkpoint(function, *args, use_reentrant=True)``): the call of ``function`` itself, whose
        gradients are those of torch's recomputation in backward (no recomputation: the activations
        are kept, as for a non-reentrant checkpoint's capture), its outputs connected to autograd as
        torch's Function connects them. Traced through, the Function's forward would run the function
        under ``no_grad``: nothing in it would get a gradient."""
        function, _preserve, *inputs = args
        if kwargs:  # (torch's checkpoint refuses keywords with use_reentrant=True)
            return function(*inputs, **kwargs)
        # torch's Function looks at its direct tensor arguments only
        tensors = tuple(v for v in inputs if isinstance(v, (fx.Proxy, torch.Tensor)))
        connected = self.create_proxy("call_function", checkpoint_connects, tensors, {})
        start = len(self.graph.nodes)
        outputs = function(*inputs)
        self._check_recomputed(list(self.graph.nodes)[start:], "use_reentrant=True")

        def output(v: Any, direct: bool) -> Any:
            # A Function returns a tensor or a tuple of them connected; anything else (a list of
            # tensors, an element of such a tuple that is no tensor) it returns as it is, computed
            # under no_grad: detached.
            if isinstance(v, fx.Proxy):
                return self.create_proxy("call_function", checkpoint_output, (v, connected if direct else False), {})
            if isinstance(v, torch.Tensor):
                return v if not direct else self.create_proxy("call_function", checkpoint_output,
                                                              (v, connected), {})
            return tree_map(lambda x: output(x, False) if isinstance(x, (fx.Proxy, torch.Tensor)) else x, v)

        if isinstance(outputs, tuple):
            return tuple(output(v, True) for v in outputs)  # (a Function returns a plain tuple)
        return output(outputs, True)

    def _checkpoint_enter(self, ctx: Any, original: Callable) -> Any:
        """A non-reentrant checkpoint's function begins (torch's ``_checkpoint_hook`` is entered
        around it, where torch will recompute it in backward)."""
        self._checkpointed.append(len(self.graph.nodes))
        return original(ctx)

    def _checkpoint_exit(self, ctx: Any, args: tuple, original: Callable) -> Any:
        start = self._checkpointed.pop() if self._checkpointed else None
        result = original(ctx, *args)
        if start is not None and (not args or args[0] is None):  # (not on the way out of an error)
            self._check_recomputed(list(self.graph.nodes)[start:], "use_reentrant=False")
        return result

    def _check_recomputed(self, nodes: list[fx.Node], variant: str) -> None:
        """Refuse a checkpointed function (recorded as ``nodes``) that updates state: torch runs it
        again in backward, updating the state a second time per training step, which the captured
        forward (its one call, no recomputation) would not."""
        what = None
        for n in nodes:
            if isinstance(n.target, AssignState):
                what = f"assigns {'.'.join(filter(None, (n.target.path, n.target.name)))!r}"
            elif isinstance(n.target, SetData):
                what = "assigns a parameter's or buffer's `.data`"
            elif _inplace(n) and n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr":
                what = f"writes {n.args[0].target!r} in place"
            elif n.op == "call_module":
                with self._own_code():
                    module = self.root.get_submodule(n.target)
                    stateful = module.training and any(True for _ in module.buffers())
                if stateful:
                    what = (f"runs module {n.target!r} ({type(module).__name__}) in training, which updates its "
                            "buffers (a batch norm's running statistics)")
            if what is not None:
                break
        if what is None:
            return
        self._refuse(f"forward runs a checkpoint (torch.utils.checkpoint, {variant}) whose function {what}",
                     "torch runs a checkpointed function again in backward (its recomputation), updating that "
                     "state a second time per training step, and the captured forward runs it once (it keeps the "
                     "activations: no recomputation). Checkpoint only code that updates no buffers (the layers "
                     "between the norms), or call it without the checkpoint")

    # -- refusals
    def _refuse(self, what: str, why: str, module: nn.Module | None = None, error: type = FuseError) -> None:
        line = _user_line(traceback.extract_stack()[:-2])
        here = ((self.path_of_module(module), type(module).__name__) if module is not None
                else (self._modules_entered[-1] if self._modules_entered else None))
        raise error(f"{what}{line} {where(here, self.root)}; {why}")

    # -- attribute assignments
    def _setattr(self, module: nn.Module, name: str, value: Any, original: Callable) -> None:
        if self._internal or id(module) not in self._traced:
            return original(module, name, value)
        if name == "training":  # `module.training = False`: this module's mode alone, as in torch
            self._set_mode(module, value, recurse=False)
            return original(module, name, value)
        traced = any(isinstance(v, fx.Proxy) for v in tree_flatten(value)[0])
        path = self.path_of_module(module)
        label = f"{path}.{name}" if path else name
        if name in module._parameters or isinstance(value, nn.Parameter):
            self._refuse(f"forward assigns parameter {label!r}", "a fused model's parameters are fixed "
                         "when it is made (compute the value from the parameter instead)", module)
        if name in module._modules or isinstance(value, nn.Module):
            self._refuse(f"forward assigns submodule {label!r}", "a fused model's modules are fixed when "
                         "it is made (create submodules in __init__)", module)
        if name in module._buffers:
            if not isinstance(value, (torch.Tensor, fx.Proxy)):
                self._refuse(f"forward assigns a {type(value).__name__} to buffer {label!r}",
                             "a buffer holds a tensor", module)
            self.create_proxy("call_function", AssignState(path, name, "buffer"), (value,), {})
            module._buffers[name] = value  # later reads in this forward see the new value
            return None
        if traced or isinstance(value, torch.Tensor):
            self.create_proxy("call_function", AssignState(path, name, "attribute"), (value,), {})
            object.__setattr__(module, name, value)
            return None
        old = module.__dict__.get(name, _MISSING)
        if self._settled is None:  # the first call: record what it sets
            if old is not _MISSING and type(old) is type(value) and _same(old, value):
                return original(module, name, value)  # rewriting what is there changes nothing
            self._record_python(path, name, label, value, module)
            self.python_assignments.append((path, name, value))
            return original(module, name, value)
        # A second call, from the state the first left: a value that changes again is state.
        if (path, name) in self._settled and type(old) is type(value) and _same(old, value):
            self._record_python(path, name, label, value, module)
            return original(module, name, value)
        self._refuse(
            f"forward assigns the Python value {value!r} to attribute {label!r}, which held "
            f"{'nothing' if old is _MISSING else repr(old)} after one call", "a captured forward sets the "
            "same values at every call, so it cannot update Python state per model and per call. Keep "
            f"such state in a buffer (self.register_buffer({name!r}, torch.tensor(...))), which each model "
            "updates as under torch", module)
        return None

    def _record_python(self, path: str, name: str, label: str, value: Any, module: nn.Module) -> None:
        try:
            self.create_proxy("call_function", AssignState(path, name, "attribute"), (value,), {})
        except Exception:  # noqa: BLE001 - a value a graph cannot hold as a constant
            self._refuse(f"forward assigns a {type(value).__name__} to attribute {label!r}",
                         "a captured forward holds only numbers, strings, dtypes, devices and "
                         "containers of them as constants", module)

    # -- mode regions
    @contextlib.contextmanager
    def _own_code(self) -> Iterator[None]:
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    def _enter(self, ctx: Any, original: Callable) -> Any:
        if self._internal:
            return original(ctx)
        template = copy.copy(ctx)
        with self._own_code():
            result = original(ctx)
        proxy = self.create_proxy("call_function", EnterRegion(template), (), {})
        self._regions.setdefault(id(ctx), []).append(proxy)
        return result

    def _exit(self, ctx: Any, args: tuple, original: Callable) -> Any:
        proxies = self._regions.get(id(ctx))
        if proxies and not self._internal:
            self.create_proxy("call_function", exit_region, (proxies.pop(),), {})
        with self._own_code():
            return original(ctx, *args)

    def _set_grad_enabled_init(self, ctx: Any, mode: bool, original: Callable) -> None:
        value = mode
        if isinstance(mode, fx.Proxy) and not self._internal:
            if mode.node not in self._grad_reads:
                self._refuse("forward calls `torch.set_grad_enabled` with a traced value",
                             "the grad mode is one Python value for every model; pass True or False, "
                             "or what `torch.is_grad_enabled()` read")
            value = self._grad_reads[mode.node]  # a mode read earlier: the fused model reads it anew
        with self._own_code():
            original(ctx, value)
        if self._internal:
            return
        # The mode is set when the object is made, as torch's is; __exit__ (the `with` form) restores.
        arg = mode if isinstance(mode, fx.Proxy) else bool(mode)
        proxy = self.create_proxy("call_function", set_grad_enabled_call, (arg,), {})
        self._regions.setdefault(id(ctx), []).append(proxy)

    # -- train/eval mode changes in forward
    def _train(self, module: nn.Module, mode: Any, original: Callable) -> Any:
        """``module.train(mode)`` / ``module.eval()`` in forward: recorded, so that the fused model's
        module (and its submodules) change mode where torch's do, at every call."""
        if self._internal or id(module) not in self._traced or not isinstance(mode, (bool, fx.Proxy)):
            return original(module, mode)  # (torch's own error for a mode that is not a bool)
        self._set_mode(module, mode, recurse=True)
        with self._own_code():  # its own setattr calls (an override's code before it is traced)
            return original(module, mode)

    def _set_mode(self, module: nn.Module, mode: Any, recurse: bool) -> None:
        if isinstance(mode, fx.Proxy):
            self._refuse("forward sets a module's train/eval mode to a traced value",
                         "a module's mode is one Python value for every model; set it to True or False",
                         module)
        if not isinstance(mode, bool):
            self._refuse(f"forward sets a module's `training` to a {type(mode).__name__}",
                         "a captured forward records a module's mode as True or False", module)
        path = self.path_of_module(module)
        with self._own_code():
            owner = self.create_proxy("get_attr", path or "_fused_self", (), {})
        self.create_proxy("call_function", SetMode(mode, recurse), (owner,), {})

    # -- grad mode read in forward
    def _is_grad_enabled(self, original: Callable) -> Any:
        value = original()
        if self._internal or _called_from_library():
            return value  # torch's own code (a grad-mode context saving the mode), fx's, hfkern's
        self.reads_grad_mode = True
        if self._grad_mode is not None:
            return value  # a capture for calls in this grad mode
        proxy = self.create_proxy("call_function", grad_mode, (), {})
        self._grad_reads[proxy.node] = value
        return proxy

    def to_bool(self, obj: fx.Proxy) -> bool:
        if self._grad_reads and _reads_any(obj.node, self._grad_reads):
            self._refuse(
                "forward branches on `torch.is_grad_enabled()` (Python control flow on the grad mode)",
                "the fused model runs one captured forward whatever the grad mode of the call (no_grad, "
                "inference_mode or not), so the branch taken at capture would run in every mode. Pass "
                "the mode as forward's own bool argument (a Python value, captured per value), branch "
                "on `self.training`, or name the module's class in fuse(..., loop_modules=(Cls,)) to "
                "run its code per call. (Used as a value, as in `prev = torch.is_grad_enabled(); ...; "
                "torch.set_grad_enabled(prev)`, the grad mode is read when the fused model runs.)",
                error=GradModeBranch)
        return super().to_bool(obj)

    # -- random draws
    def _draw(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if any(isinstance(v, fx.Proxy) for v in tree_flatten((args, kwargs))[0]):
            # recorded as the call itself (what fx records for a tensor argument; a traced size
            # it could not take), drawn per model by the rewrite
            return self.create_proxy("call_function", fn, args, kwargs)
        return self.create_proxy("call_function", RandomDraw(fn), args, kwargs)

    def _random_functional(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """A random functional (``F.dropout``) called in forward: recorded as the call to ``fn``
        (torch's own, not the patch that torch's dispatch on a traced value would name), also where
        no argument is a traced value, unless torch's own code calls it so (a layer's initialization)."""
        if not any(isinstance(v, fx.Proxy) for v in tree_flatten((args, kwargs))[0]):
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename == __file__:
                caller = caller.f_back  # past the patch's own frames
            if self._internal or caller is not None and _library_file(caller.f_code.co_filename):
                return fn(*args, **kwargs)
        return self.create_proxy("call_function", fn, args, kwargs)

    def _factory(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if any(isinstance(v, fx.Proxy) for v in tree_flatten((args, kwargs))[0]):
            return self.create_proxy("call_function", fn, args, kwargs)
        return fn(*args, **kwargs)

    def _len(self, value: Any, original: Callable) -> Any:
        if isinstance(value, fx.Proxy):
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename == __file__:
                caller = caller.f_back  # past the patch's own frames
            if caller is None or not _library_file(caller.f_code.co_filename):
                # the model's code (torch's own keeps fx's refusal); builtins.len is the patch
                # while it lasts: torch's own here
                return self.create_proxy("call_function", original, (value,), {})
        return original(value)

    def _draw_inplace(self, tensor: torch.Tensor, name: str, original: Callable, args: tuple, kwargs: dict):
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename == __file__:
            caller = caller.f_back  # past the patch's own frames
        if caller is not None and _library_file(caller.f_code.co_filename):
            return original(tensor, *args, **kwargs)  # torch's own code (a layer's initialization)
        self._refuse(f"forward draws random numbers in place into a tensor that is not a traced value "
                     f"(`.{name}()`)", "it would be drawn once at capture, not per model and per call; "
                     "write it as torch.rand/torch.randn/... or on a tensor made from the input")

    def _rng_call(self, name: str, original: Callable, args: tuple, kwargs: dict) -> Any:
        """A call that reads or sets the random state (``torch.manual_seed(7)``, ``fork_rng``) in
        forward: refused, where fx would run it once, at capture. torch's own code may read the
        state (a checkpoint stashing it), except ``fork_rng``'s, which the model's code entered."""
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename == __file__:
            caller = caller.f_back  # past the patch's own frames
        library = caller is not None and _library_file(caller.f_code.co_filename)
        if self._internal or (library and caller.f_code.co_name != "fork_rng"):
            return original(*args, **kwargs)
        what = "torch.random.fork_rng" if library else name
        self._refuse(f"forward calls `{what}`", "it reads or sets the random number generator's state, which a "
                     "captured forward would do once, when the model is fused, and the fused model draws each "
                     "model's random numbers from a stream of its own (per model and per call), which cannot "
                     "reproduce a reseed or a restored state per model. Seed before calling the model, outside "
                     "forward (random draws in forward are then per model and per call)")

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        tracer = self
        saved: list[tuple[Any, str, Any]] = []
        saved_globals: list[tuple[dict, str, Any]] = []

        thread = threading.get_ident()

        def patch(owner: Any, name: str, new: Any) -> None:
            own = name in vars(owner)  # else inherited: shadowed here, and the shadow deleted after
            saved.append((owner, name, vars(owner)[name] if own else _MISSING))
            original = getattr(owner, name, None)

            # The patches are process-wide while they last: other threads get torch's own.
            def dispatch(*args: Any, **kwargs: Any) -> Any:
                if original is not None and threading.get_ident() != thread:
                    return original(*args, **kwargs)
                return new(*args, **kwargs)

            setattr(owner, name, dispatch)

        # (inside the try: a patch that fails part of the way leaves none applied)
        try:
            setattr_orig = nn.Module.__setattr__
            patch(nn.Module, "__setattr__", lambda m, n, v: tracer._setattr(m, n, v, setattr_orig))
            for cls in _REGION_CLASSES:
                enter, exit_ = cls.__enter__, cls.__exit__
                patch(cls, "__enter__", lambda c, _o=enter: tracer._enter(c, _o))
                patch(cls, "__exit__", lambda c, *a, _o=exit_: tracer._exit(c, a, _o))
            train = nn.Module.train
            patch(nn.Module, "train", lambda m, mode=True, _o=train: tracer._train(m, mode, _o))
            is_grad_enabled = torch.is_grad_enabled
            patch(torch, "is_grad_enabled", lambda _o=is_grad_enabled: tracer._is_grad_enabled(_o))
            sge = torch.autograd.grad_mode.set_grad_enabled
            init, exit_ = sge.__init__, sge.__exit__
            patch(sge, "__init__", lambda c, mode, _o=init: tracer._set_grad_enabled_init(c, mode, _o))
            patch(sge, "__exit__", lambda c, *a, _o=exit_: tracer._exit(c, a, _o))
            # A custom autograd Function is one call (its own backward), not the ops of its forward.
            function = torch.autograd.function.Function
            apply = vars(function)["apply"].__func__
            saved.append((function, "apply", vars(function)["apply"]))

            def apply_function(cls, *a, **k):
                if threading.get_ident() != thread:
                    return apply(cls, *a, **k)
                return tracer._apply_function(cls, a, k, apply)

            function.apply = classmethod(apply_function)
            patch(fx.Proxy, "__setattr__", lambda p, n, v, _o=object.__setattr__: tracer._tensor_setattr(p, n, v, _o))
            # A real tensor's attribute assignments (a tensor attribute's `.data`), which fx does not see.
            patch(torch.Tensor, "__setattr__", lambda t, n, v, _o=torch.Tensor.__setattr__:
                  tracer._plain_tensor_setattr(t, n, v, _o))
            # fx's Proxy has no item assignment (`self.queue[:n] = keys`, `h[:, 0] = 0`): record it.
            patch(fx.Proxy, "__setitem__", lambda p, index, value: tracer.create_proxy(
                "call_function", operator.setitem, (p, index, value), {}))
            for kind in ("parameters", "buffers"):
                named = getattr(nn.Module, f"named_{kind}")

                def named_state(m, *a, _named=named, **k):
                    if id(m) not in tracer._traced or tracer._internal:
                        return _named(m, *a, **k)
                    return tracer._named_state(m, _named, a, k)

                patch(nn.Module, f"named_{kind}", named_state)
            # The recorded functions, by the function they stand for: patched where forward's code finds
            # them, as attributes (`torch.randn`, `F.dropout`) and as names its modules imported
            # (`from torch.nn.functional import dropout`, `from torch import randn`).
            # (by identity: a user's module-level value may be unhashable, or hash by its own code)
            recorded: dict[int, tuple[Callable, Callable]] = {}
            for name in _RANDOM_FACTORIES:
                fn = getattr(torch, name)
                recorded[id(fn)] = fn, lambda *a, _fn=fn, **k: tracer._draw(_fn, a, k)
                patch(torch, name, recorded[id(fn)][1])
            for name in _RANDOM_FUNCTIONALS:
                fn = getattr(nn.functional, name)
                recorded[id(fn)] = fn, lambda *a, _fn=fn, **k: tracer._random_functional(_fn, a, k)
                patch(nn.functional, name, recorded[id(fn)][1])
            for name in _SIZED_FACTORIES:
                fn = getattr(torch, name)
                recorded[id(fn)] = fn, lambda *a, _fn=fn, **k: tracer._factory(_fn, a, k)
                patch(torch, name, recorded[id(fn)][1])
            for namespace in getattr(self, "_namespaces", ()):
                for name, value in list(namespace.items()):
                    entry = recorded.get(id(value))
                    if entry is not None and entry[0] is value:
                        new = entry[1]
                        saved_globals.append((namespace, name, value))

                        def dispatch_global(*args: Any, _new=new, _original=value, **kwargs: Any) -> Any:
                            if threading.get_ident() != thread:
                                return _original(*args, **kwargs)
                            return _new(*args, **kwargs)

                        namespace[name] = dispatch_global
            patch(builtins, "len", lambda v, _o=builtins.len: tracer._len(v, _o))
            for name in _RANDOM_INPLACE:
                patch(torch.Tensor, name, lambda t, *a, _n=name, _o=getattr(torch.Tensor, name), **k:
                      tracer._draw_inplace(t, _n, _o, a, k))
            import torch.random as torch_random  # (torch.random, not torch's `random` attribute)
            for owner, prefix, names in ((torch, "torch", _RNG_FUNCTIONS), (torch_random, "torch.random", _RNG_FUNCTIONS),
                                         (torch_random, "torch.random", ("fork_rng",)),
                                         (getattr(torch, "cuda", None), "torch.cuda", _CUDA_RNG_FUNCTIONS)):
                for name in names:
                    fn = getattr(owner, name, None) if owner is not None else None
                    if callable(fn):
                        patch(owner, name, lambda *a, _fn=fn, _n=f"{prefix}.{name}", **k: tracer._rng_call(_n, _fn, a, k))
            hook = _checkpoint_attribute("_checkpoint_hook")  # (entered around a non-reentrant checkpoint's function)
            if isinstance(hook, type):
                enter, exit_ = hook.__enter__, hook.__exit__
                patch(hook, "__enter__", lambda c, _o=enter: tracer._checkpoint_enter(c, _o))
                patch(hook, "__exit__", lambda c, *a, _o=exit_: tracer._checkpoint_exit(c, a, _o))
            yield
        finally:
            for namespace, name, value in reversed(saved_globals):
                namespace[name] = value
            for owner, name, value in reversed(saved):
                if value is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, value)


_MISSING = object()


def _user_namespaces(root: nn.Module) -> list[dict]:
    """The global namespaces of the user's code that forward runs: of the Python modules that
    define the classes (and their bases) of ``root``'s modules, past torch's and hfkern's own."""
    out: dict[int, dict] = {}
    for m in root.modules():
        for cls in type(m).__mro__:
            if cls is nn.Module or cls is object:
                break
            module = sys.modules.get(cls.__module__)
            file = getattr(module, "__file__", None)
            if module is not None and not (file and _library_file(file)):
                out.setdefault(id(module.__dict__), module.__dict__)
    return list(out.values())


def _called_from_library() -> bool:
    """Whether the code calling a patched function (past this file's frames) is torch's or hfkern's."""
    caller = sys._getframe(1)
    while caller is not None and caller.f_code.co_filename == __file__:
        caller = caller.f_back
    return caller is not None and _library_file(caller.f_code.co_filename)


def _reads_any(node: fx.Node, sources: dict[fx.Node, Any]) -> bool:
    """Whether ``node``'s value is computed from any of ``sources``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in sources:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _check_mode_changes(graph: fx.Graph, root: nn.Module) -> str | None:
    """Refuse the train/eval mode changes (:class:`SetMode`) of a module inside a layer called as a
    whole (an array module has its own submodules), which the fused model cannot make as torch
    does. Returns why, where the changes leave the modules whose code is captured in different
    modes (then the fused model, which runs a forward captured with all of them in train mode or
    all in eval mode, can run it only if it is one forward for both: :func:`capture` checks), else None."""
    changes = [n for n in graph.nodes if isinstance(n.target, SetMode)]
    if not changes:
        return None
    leaves = {n.target for n in graph.nodes if n.op == "call_module"}

    def path(node: fx.Node) -> str:
        target = node.args[0].target
        return "" if target == "_fused_self" else target

    def refuse(node: fx.Node, what: str, why: str) -> str:
        call = (".train()" if node.target.mode else ".eval()") if node.target.recurse else \
            f".training = {node.target.mode}"
        message = (f"forward sets module {path(node) or '(the model)'!r} to "
                   f"{'train' if node.target.mode else 'eval'} mode (`{call}`)"
                   f"{site_line(node.meta.get('hfkern_site'))} {where(node.meta.get('hfkern_module'), root)}"
                   f"; {what}: {why}")
        if what.startswith("it is inside"):
            raise FuseError(message)
        return message

    for node in changes:
        inside = next((leaf for leaf in leaves if path(node).startswith(leaf + ".")), None)
        if inside is not None:
            refuse(node, f"it is inside module {inside!r}, which the fused model calls as a whole",
                   f"set the mode of module {inside!r} itself")
    modes: dict[bool, list[str]] = {}
    for p, module in root.named_modules():
        if p not in leaves and not any(p.startswith(leaf + ".") for leaf in leaves):
            modes.setdefault(module.training, []).append(p or "(the model)")
    if len(modes) < 2:
        return None
    node = next((n for n in changes if path(n) not in leaves), changes[-1])
    return refuse(node, f"that leaves the modules whose code is captured in different modes (train: "
                  f"{modes[True]}, eval: {modes[False]}), and forward runs other code in train mode than in "
                  "eval mode (it reads `self.training`)", "the fused model runs a forward captured with "
                  "all of them in train mode or all in eval mode. Set the mode of the layers themselves "
                  "(`self.block.bn.eval()`: a layer such as BatchNorm or Dropout reads its own mode when it "
                  "runs), or of the whole model")


def _plain_tensors(root: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of every tensor ``root``'s modules hold in plain attributes (directly
    or in a list, tuple or dict): neither parameters nor buffers, which are traced values."""
    for path, module in root.named_modules(remove_duplicate=False):
        for attr, v in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue  # modules are searched themselves
            for t in tree_flatten(v)[0]:
                if isinstance(t, torch.Tensor):
                    yield module, f"{path}.{attr}" if path else attr, t


def _version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version
        return None


class _GuardedHook:
    """A forward hook or pre-hook of a module whose code is captured, as it runs at capture: a hook
    that returns None and records no in-place write or assignment can act only through Python side
    effects (appending to a list, printing), which would happen once, on traced values, and never
    when the fused model runs."""

    def __init__(self, tracer: _Tracer, hook: Callable, path: str, module: nn.Module, kind: str):
        self.tracer, self.hook, self.path, self.module, self.kind = tracer, hook, path, module, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graph = self.tracer.graph
        before = len(graph.nodes)
        result = self.hook(*args, **kwargs)
        if result is None and not self.tracer._internal:
            made = len(graph.nodes) - before
            recorded = list(graph.nodes)[before:] if made > 0 else []
            if not any(_inplace(n) or isinstance(n.target, (AssignState, SetData, SetMode)) for n in recorded):
                name = getattr(self.hook, "__qualname__", None) or type(self.hook).__name__
                self.tracer._refuse(
                    f"the {self.kind} {name!r} on module {self.path!r} returns None and changes no tensor "
                    "in place", "it can only act through Python side effects (appending to a list, "
                    "printing), and the hooks of a module whose code is captured run once, on traced "
                    "values, when the model is fused, never when the fused model is called. Return the "
                    "value from forward, or register such a hook on the fused model itself, which runs it "
                    "at every call with the [B, ...] arrays", self.module)
        return result


def _guard_hooks(tracer: _Tracer, root: nn.Module) -> None:
    """Wrap the forward hooks and pre-hooks of ``root`` (the copy being traced) in :class:`_GuardedHook`."""
    for path, module in root.named_modules():
        for attr, kind in (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook")):
            hooks = module.__dict__.get(attr)
            for key, hook in list((hooks or {}).items()):
                hooks[key] = _GuardedHook(tracer, hook, path, module, kind)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality are not "the same"
        return False


# ---- capture ---------------------------------------------------------------------------------
@dataclass
class Captured:
    """A captured forward: the fx graph and the values of its constant ``get_attr`` targets."""

    graph: fx.Graph
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    # Whether forward's own code reads `torch.is_grad_enabled()` (recorded as a read when the fused
    # model runs; a capture for one grad mode, `capture(..., grad_mode=...)`, is right in that mode only).
    reads_grad_mode: bool = False


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.setitem}


def _inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__") \
            and node.target != "requires_grad_" or node.target == "__setitem__"
    return node.op == "call_function" and node.target in _INPLACE_OPERATORS


def capture(model: nn.Module, leaf: Callable[[nn.Module], bool], mode: bool,
            stack_traces: bool = False, concrete: dict[str, Any] | None = None,
            grad_mode: bool | None = None, check_modes: bool = True) -> Captured:
    """Capture ``model.forward`` in train (``mode`` True) or eval mode; the model is not touched.

    ``leaf(module)``: whether a submodule is called as a whole (not traced into).
    ``concrete``: arguments of forward (by name) that the captured call gives these Python
    values (None, bools): forward runs on the values themselves, so that ``if mask is None:``
    takes the branch such a call takes (torch.fx would trace them as tensors); the graph keeps
    their placeholders, unused, and is right only for calls that pass those values.
    ``grad_mode``: None, ``torch.is_grad_enabled()`` in forward is read when the captured
    forward runs, and a branch on it raises :class:`GradModeBranch` (a FuseError); True or
    False, forward runs in that grad mode and the read is that Python value (branches taken
    as such a call takes them), and the graph is right only for calls in that grad mode
    (``Captured.reads_grad_mode`` says whether forward read it).
    Raises :class:`FuseError` naming the construct, the source line and the module.
    """
    traced = copy.deepcopy(model).train(mode)
    stateful = {n for n, _ in traced.named_parameters(remove_duplicate=False)}
    stateful |= {n for n, _ in traced.named_buffers(remove_duplicate=False)}
    tracer, graph = _trace(traced, model, leaf, stack_traces, concrete=concrete, grad_mode=grad_mode)
    if tracer.python_assignments:
        # Python attributes set in forward: the captured forward sets the same values at every
        # call, which is right only if a second call, from the state the first left, sets those
        # values again and runs the same code.
        again = copy.deepcopy(model).train(mode)
        for path, name, value in tracer.python_assignments:
            object.__setattr__(again.get_submodule(path), name, value)
        settled = {(path, name) for path, name, _ in tracer.python_assignments}
        _, second = _trace(again, model, leaf, stack_traces, settled, concrete, grad_mode)
        if second.python_code("self").src != graph.python_code("self").src:
            names = sorted({".".join(filter(None, (p, n))) for p, n, _ in tracer.python_assignments})
            raise FuseError(
                f"fuse: cannot capture the model: its forward assigns the Python attributes {names} and "
                f"then runs other code on the next call {where(None, model)}; a captured forward runs "
                "one code at every call. Keep such state in buffers, or move it out of forward")
    constants: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target not in stateful and node.target != "_fused_self":
            value: Any = traced
            for atom in node.target.split("."):
                value = getattr(value, atom)
            if isinstance(value, torch.Tensor):
                constants[node.target] = value
            elif not isinstance(value, (nn.Module, fx.Proxy)):  # (a Proxy: a tensor attribute forward assigns)
                # An object torch.fx keeps as a constant of the graph (a torch.Generator, a
                # ScriptObject, ...: `_opaque_obj0`), which the fused model neither holds nor could
                # hold per model.
                names = [".".join(filter(None, (p, a))) for p, m in traced.named_modules()
                         for a, v in vars(m).items() if v is value]
                held = next((f"attribute {n!r}" for n in names if n != node.target),
                            f"attribute {names[0]!r}" if names and not names[0].startswith("_") else None)
                raise FuseError(
                    f"fuse: cannot capture the model: forward passes a {type(value).__name__} object "
                    f"({held or 'made in forward'}) to a call, which torch.fx keeps as the graph constant "
                    f"{node.target!r}{site_line(next((u.meta.get('hfkern_site') for u in node.users), None))} "
                    f"{where(node.meta.get('hfkern_module'), model)}; a fused forward holds "
                    "tensors and Python constants, not such objects (one object would serve every model). "
                    "Pass tensors and Python constants, or move the call out of forward")
    for node in graph.nodes:
        problem = None
        if node.op == "call_method" and node.target in _HOST_READS:
            problem = (f"`.{node.target}()` reads a tensor's values on the host", "the B models' values "
                       f"differ, so the result is not one Python value. {REMEDY}")
        elif node.op == "call_method" and node.target == "set_":
            problem = ("`.set_()` gives a tensor other memory", "the fused model keeps the B models' values in "
                       "memory laid out for the array ops, which a tensor of one model's cannot replace. "
                       "Assign the new tensor to the name instead (x = source)")
        elif (construct := _value_sized(node)) is not None:
            problem = (f"{construct} makes a tensor whose size depends on a tensor's values",
                       ("the B models' values differ, so their results differ in size and are not one "
                        "array. Write it with ops whose result has a fixed size (torch.where(condition, x, "
                        "y), masked_fill, a sum of a masked product), or move it out of forward"))
        elif (written := _written_constant(node, constants)) is not None:
            name, how = written
            problem = (f"forward modifies the tensor {name!r} in place ({how})",
                       "a tensor attribute that is neither a parameter nor a buffer is not per-model "
                       "state; register it as a buffer (self.register_buffer) so that each model keeps "
                       "its own" if not name.rpartition(".")[2].startswith("_tensor_constant") else
                       "a tensor made in forward from Python values is a constant of the captured "
                       "forward; make it from the input (x.new_tensor(...)) or keep it in a buffer")
        if problem is not None:
            if not stack_traces:  # trace again, recording where each op comes from
                return capture(model, leaf, mode, True, concrete, grad_mode, check_modes)
            raise FuseError(f"fuse: cannot capture the model: {problem[0]}{_source_line(node)} "
                            f"{where(node.meta.get('hfkern_module'), model)}; {problem[1]}")
    captured = Captured(graph, constants, tracer.reads_grad_mode)
    if check_modes and tracer.mixed_modes is not None:
        # `self.backbone.eval()` in forward leaves the fused model in mixed modes: right only where
        # forward is one code in both modes (a frozen backbone whose code reads no mode).
        other = capture(model, leaf, not mode, stack_traces, concrete, grad_mode, check_modes=False)
        if not _same_captured(captured, other):
            raise FuseError(f"fuse: cannot capture the model: {tracer.mixed_modes}")
    return captured


def _same_captured(a: Captured, b: Captured) -> bool:
    """Whether two captures are one forward (the same code and constants)."""
    return a.graph.python_code("self").src == b.graph.python_code("self").src \
        and a.constants.keys() == b.constants.keys() \
        and all(x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and bool(torch.equal(x, y))
                for x, y in ((a.constants[k], b.constants[k]) for k in a.constants))


# torch modules captured as their forward's one call (``input.flatten(start_dim, end_dim)``):
# the fused forward then treats them as torch treats that call (a write through the result
# reaches the input, as through a view).
_INLINED_MODULES = (nn.Flatten, nn.Unflatten)


def _written_constant(node: fx.Node, constants: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """(name, how) of a constant that ``node`` writes: in place (its first argument), or as an
    ``out=`` tensor (which torch also resizes: the B models' result would reshape the constant)."""
    def constant(n: Any) -> str | None:
        return n.target if isinstance(n, fx.Node) and n.op == "get_attr" and n.target in constants else None

    if _inplace(node) and node.args and (name := constant(node.args[0])) is not None:
        return name, f"`{node.target}`"
    if node.op in ("call_function", "call_method"):
        for n in tree_flatten(node.kwargs.get("out"))[0]:
            if (name := constant(n)) is not None:
                target = getattr(node.target, "__name__", node.target)
                return name, f"`{target}(..., out=...)`"
    return None


def _trace(traced: nn.Module, model: nn.Module, leaf: Callable[[nn.Module], bool], stack_traces: bool,
           settled: set[tuple[str, str]] | None = None, concrete: dict[str, Any] | None = None,
           grad_mode: bool | None = None) -> tuple[_Tracer, fx.Graph]:
    tracer = _Tracer(leaf, stack_traces, settled, concrete, grad_mode)
    try:
        with contextlib.nullcontext() if grad_mode is None else torch.set_grad_enabled(grad_mode):
            return tracer, tracer.trace(traced)
    except FuseError as e:
        raise type(e)(f"fuse: cannot capture the model: {e}") from None
    except Exception as e:  # noqa: BLE001 - every capture failure is reported the same way
        line = _user_line(traceback.extract_tb(e.__traceback__))
        raise FuseError(
            f"fuse: cannot capture the model: {_construct(str(e))}{line} "
            f"{where(tracer.failed_in, model)}. {REMEDY} (torch.fx: {type(e).__name__}: {e})"
        ) from e


def _source_line(node: fx.Node) -> str:
    """`` at file.py:12: `code` `` for the innermost frame of the user's code in the stack trace
    recorded for ``node`` (torch's and hfkern's own frames skipped, as :func:`_user_line` does), or ''."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    found = ""
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if match is None or _library_file(match.group(1)):
            continue
        code = lines[i + 1] if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        found = f" at {os.path.basename(match.group(1))}:{match.group(2)}" + (f": `{code}`" if code else "")
    if not found:
        found = site_line(node.meta.get("hfkern_site"))
    return found


_FRAME = re.compile(r'File "(.*)", line (\d+)')
