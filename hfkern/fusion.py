"""Whole-model fusion: B unmodified ``torch.nn`` models as one array model.

:func:`fuse` takes B models of one architecture (or a factory and B) and
returns a :class:`FusedModel` that computes, for every b, what model b
computes, with the array dim B first on every input and output.

How: model 0's ``forward`` is captured as a ``torch.fx`` graph and rewritten op
by op; once per pattern of the arguments that are Python values (None, bools,
ints, strings) in a call (see below), in practice once or twice.

* **Leaf modules with an array version** (``nn.Conv2d``, ``nn.Linear``,
  ``nn.BatchNorm2d``, ``nn.TransformerEncoder``, ... every ``torch.nn`` class
  that an :class:`hfkern.nn.ArrayModule` names as its ``_torch_cls``) become
  that array module, built with ``from_modules`` from the B models' modules:
  parameters, buffers, ``requires_grad`` and per-model hyper-parameters (a
  dropout probability) carried over. The heavy work runs in array kernels.
  An attention mask reaches an array attention module in its explicit form,
  one per model (``[B, 1, L, S]``) or the same for every model
  (``[1, N*num_heads, L, S]``), so that B == N*num_heads is not ambiguous.
* **Element-wise leaf modules** (ReLU, GELU, Tanh, Identity, ...) stay the
  torch modules they are and run on the ``[B, ...]`` tensors directly.
* **A norm and its activation** become one call: a BatchNorm or LayerNorm
  leaf whose output's only user is a ReLU (``F.relu``, ``torch.relu``,
  ``Tensor.relu``, ``nn.ReLU``, in place or not) or an exact GELU
  (``F.gelu``, ``nn.GELU()``) runs as one array op with the activation fused,
  backward included (the graph shows a ``norm_relu``/``norm_gelu`` call and
  no activation node). Not where the norm output has another user, a hook
  could see it, or a grad-mode or autocast region starts or ends between the
  two; the models' own modules and state are unchanged by it.
* **A convolution and its batch norm** become one call too (``conv_norm``,
  with the norm's fused activation: ``conv_norm_relu``): a convolution leaf
  whose output only a BatchNorm leaf reads, under the same conditions, both in
  the same top-level block (what :func:`hfkern.plan` recomputes). On the
  torch path in eager mode a training step then runs both on the grouped view
  ``[N, B*C, *S]`` (torch's grouped convolution, its batch norm on the
  result, one array view at the end): the same kernels on the same memory as
  the two calls, without the array view between them and its autograd nodes.
  Elsewhere (eval, another backend, ``torch.compile``, hooks added since) the
  call makes the two calls.
* **Grouped regions**: between such calls, values stay in that grouped form. A
  call's output goes as ``[N, B*C, *S]`` to the next convolution + batch norm
  call and to the element-wise calls between them (activations, residual adds:
  ``grouped_*`` in ``fused.code``), which run on grouped values of one shape
  as they are; an array view (``array_of_grouped``) is made only for whatever
  else reads a value, and a norm or convolution output that an element-wise
  call combines with grouped values enters as its grouped view
  (``to_grouped``). A hook added since on a module inside a region sees arrays,
  and element-wise calls on grouped values of different shapes run on their
  array views (the arrays broadcast per model, the grouped forms would not).
* **Everything else** in the captured code (reshapes such as
  ``x.view(x.size(0), -1)``, ``torch.flatten(x, 1)``, concatenations, chunks,
  residual adds, functional calls, reductions over dims, parameters used
  directly) runs over the array dim with per-model semantics: common ops are
  translated to the same op on the array (dims shifted past B, shapes prefixed
  with B, lower-rank operands aligned; ``F.embedding`` runs on the array
  embedding op, which keeps ``padding_idx``, ``scale_grad_by_freq``, ``sparse``
  and ``max_norm`` per model where vmap's would not), and any other call runs under
  ``torch.vmap`` (``randomness="different"``: random ops draw independently per
  model; a call vmap cannot run raises :class:`FuseError` naming it and its
  line). Translations take torch's keyword spellings (``dim=`` or ``axis=``,
  ``chunks=``, ``shape=``, ``dims=``, ``other=``, ...); one they do not know runs
  under vmap. Some calls need more than their array op: ``masked_fill``/``fill_``
  with a per-model 0-d value (a scalar parameter, ``y.max()``) write each model's
  value (``torch.where``, ``copy_``); ``y[mask] = value`` with a boolean mask is a
  masked fill, per model; ``Tensor.detach_()`` detaches in place where the array
  allows, else every later reader reads a detached value; and
  ``torch.autograd.grad`` in forward (forces, gradient penalties) takes the
  gradients of the array outputs with respect to the array inputs, all models at
  once (they are independent), its ``grad_outputs`` per model.
  Shape queries (``x.size(0)``, ``x.shape``, ``x.dim()``) answer for
  one model. Other ``torch.nn`` leaf modules without an array version run under
  ``torch.vmap`` over their stacked parameters. ``x.view(shape)`` is a view of
  ``x`` as in torch wherever the forward writes in place through it, or into
  ``x`` while the view is in use: where the array's memory layout (chosen by the
  array ops) does not allow that view, ``x`` is given memory that does (a copy,
  read by everything after), or, where that could change what another tensor
  sharing its memory holds (the model's state, an input), the forward raises
  :class:`FuseError` naming the statement. Elsewhere such a view may be a copy.

Inputs are ``[B, *per-model shape]`` tensors, or one input shared by the B
models as :func:`hfkern.broadcast` (no copy; the first array layer uses the
cheaper shared math). Non-tensor arguments are passed as they are, every model
gets the same. Arguments that are None, a bool, an int, a string (or an enum
member, a dtype, a device, a tuple of these) are Python values in the captured
code, so ``if mask is None:``, ``if flag:``, ``if mode == "sum":`` and
``self.blocks[:depth]`` take what the call takes: the forward is captured for
each pattern of such values, as ``torch.compile`` specializes on ints (``fuse``
captures a call with forward's arguments at their defaults and one giving every
argument whose default is None; another pattern is captured at its first call,
and such a call that runs a module neither of those runs raises
:class:`FuseError`, as that module did not become an array module). A fused
model warns once it has captured more than 8 patterns: pass a value that changes
from call to call as a float or a tensor. Floats and other arguments are traced
values, one capture serving every value (a Python branch on a float argument
cannot be captured; a required argument is traced by ``fuse``'s own capture, so
forward may branch on a required int only once ``fuse`` has captured without
it: give it a default); a tensor made from them alone (``torch.arange(k)``) is
the same for every model, each model having its own copy. So is a tensor made
from such values and shape queries (``torch.zeros(x.size(0), 8)``), and one
converted to an array value's dtype and device (``torch.arange(n).type_as(x)``,
``.to(x)``): one tensor, until the forward writes array values into it in place
(``out[:, 1:7] = x``, ``.scatter_(1, idx, 1.0)``), which makes it each model's
own ``[B, ...]`` copy where it is made. Every output has B first: a tensor that
is not an array value is returned as each model's copy. Outputs are tensors in tuples, lists,
dicts, namedtuples and dataclasses (a dataclass, returned by forward or by a layer run per model,
is one instance of its class holding the B models' arrays); a layer run per model that returns
another object holding tensors raises :class:`FuseError`, as does a layer ``torch.vmap`` cannot
run (naming ``loop_modules``).

Configuration: the models must agree on every module's attributes (numbers, strings,
functions, enum members, config objects, partials, tensors in containers, compared by
value; floats as values: ``0.0`` and ``-0.0`` differ, NaN is NaN; names starting with
``_`` included, torch's own bookkeeping not) except the array modules' own configuration,
which they keep per model (a dropout probability each): attributes added to such a
layer (``self.fc.scale = s``) must agree too. A module of an array class that the
forward does not call (a dropout whose ``p`` it reads) is not an array module, so its
attributes must agree too. :class:`FuseError` names the attribute.

State: the fused model keeps model 0's module hierarchy, so ``state_dict()``
has exactly the original keys, each entry the B models' tensors stacked on a
new leading dim; :func:`unfuse` (or :meth:`FusedModel.extract_model`) gives back
torch models of the original class whose ``state_dict`` loads into the
originals. A whole fused model pickles (``torch.save``, ``copy.deepcopy``): its
rewritten graphs travel as lists of nodes and their code is compiled again on
load, and the factory given to :func:`fuse` travels where pickle can save it
(else :meth:`FusedModel.reset_model` of the loaded model asks for ``factory=``).
``train()``/``eval()`` work as usual: BatchNorm keeps running
statistics per model, dropout draws per model; every module starts in the mode it
has in the models. Code that reads a module's ``training`` in a ``forward`` (its
own, a submodule's, a layer's) is captured with every module in train mode, with
every module in eval mode, and, where neither serves, in the modes the modules have
when fused (a block that reads its own mode kept in eval mode in a model that
trains); each call runs the capture made for the modes of the modules whose mode
the forward read (others, a frozen backbone whose code reads no mode, may be in
any mode). Modes set after fusing that no capture serves are captured at the first call
in them, as a new pattern of arguments is.
A module registered under two names is one module under both; models that share a
parameter or buffer are refused. The fused model can be compiled with ``torch.compile``
(a pattern of Python-valued arguments first met while dynamo traces is captured
eagerly, a graph break: under ``fullgraph=True`` call the model once with it first).

Module hooks registered before fusing: forward hooks of modules whose code is
captured run in the captured call (model 0's, for every model: the models' must be
the same in code, closure values and partial arguments; one that returns None and
changes no tensor in place acts only through Python side effects, once at capture,
and is refused); hooks the fused
model could not call (backward hooks, forward hooks on the model itself or on a
module that becomes an array module, gradient hooks on parameters) raise
:class:`FuseError`; so does :meth:`FusedModel.load_model` for a model with them.
Recurrent torch modules, which ``torch.vmap`` cannot batch, run once per model.

What ``forward`` does besides computing its output is kept per model, and
fusing never changes the given models (:mod:`hfkern._capture` says how):
buffers updated in place or assigned (counters, running averages, momentum
encoders), tensor attributes assigned, grad-mode and autocast regions, and
random draws. What one captured graph cannot reproduce per model (Python
values changed from call to call, parameters, buffers or submodules made in forward
(``self.register_buffer(...)`` in forward included),
in-place writes to tensors that are neither parameters nor buffers) raises
:class:`FuseError` naming the statement and the module.

What cannot be captured: ``torch.fx`` runs ``forward`` on symbolic values, so
Python control flow on a tensor (``if x.sum() > 0:``, ``if x.size(1) > 3:``,
``for row in x:``), host reads (``.item()``, ``.tolist()``) and results whose size
depends on the values (``torch.nonzero``, ``torch.where(condition)``,
``torch.unique``, ``torch.masked_select``, ``F.one_hot`` without ``num_classes``;
boolean-mask indexing ``x[mask]`` when the fused forward runs) raise
:class:`FuseError`, naming the construct, the source line and the module.
Write such branches as tensor ops (``torch.where``), move them out of
``forward``, or name the module's class in ``fuse(..., vmap_modules=...)``
(the module runs under ``torch.vmap``: fine for branches on shapes) or
``loop_modules=...`` (the module runs once per model in a Python loop: any
code, at B times the launches).
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import enum
import importlib
import inspect
import itertools
import math
import operator
import os
import pickle
import sys
import threading
import types
import warnings
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import _broadcast_to_and_flatten, register_pytree_node, tree_flatten, tree_map, tree_unflatten

from . import _backend, _capture
from ._array import _dense_in, broadcast, check_B, fold_planes, is_shared
from ._capture import FuseError
from .nn._base import ArrayModule, _read_field, _submodule, _with_slot, _zero_slot_, seeded
from .nn.normalization import LayerNorm as _ArrayLayerNorm
from .nn.normalization import _BatchNorm as _ArrayBatchNorm
from .nn.conv import _ArrayConvNd
from .nn.embedding import check_indices as _check_indices
from .ops.embedding import array_embedding_renorm_, embedding as _array_embedding
from .ops.conv import GroupedConvCall
from ._array import array_of_grouped, fresh_array, fresh_grouped, to_grouped

__all__ = ["FuseError", "FusedModel", "fuse", "unfuse"]


# ---- which module becomes what --------------------------------------------------
# Modules that apply one element-wise function to their single input: the torch
# module itself is correct on a [B, ...] tensor.
_ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
    nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Hardshrink, nn.Softshrink,
)


def _array_classes() -> dict[type[nn.Module], type[ArrayModule]]:
    """torch class -> its hfkern array class, for every array module that names one."""
    found: dict[type[nn.Module], type[ArrayModule]] = {}
    pending = list(ArrayModule.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        torch_cls = cls.__dict__.get("_torch_cls")
        if isinstance(torch_cls, type) and torch_cls is not nn.Module:
            found[torch_cls] = cls
    return found


# ---- running ops per model on arrays ------------------------------------------------
class _Fallback(Exception):
    """A direct translation does not apply to these arguments: run the op under vmap."""


def _dim(d: Any, nd: int, extra: int = 0) -> int:
    """The array dim of a per-model dim ``d`` (of a per-model rank ``nd``; ``extra``: 1 where
    the op accepts one dim past the end, as unsqueeze and stack do)."""
    if isinstance(d, bool) or not isinstance(d, int):
        raise _Fallback
    n = nd + extra
    if not -n <= d < n or n == 0:
        raise _Fallback  # let the op itself report the bad dim under vmap
    return d % n + 1


def _dims(d: Any, nd: int) -> tuple[int, ...] | int:
    if isinstance(d, (tuple, list, torch.Size)):
        return tuple(_dim(x, nd) for x in d)
    return _dim(d, nd)


# Translations take torch's own keyword spellings (``dim`` and its alias ``axis``, ``chunks``,
# ``shape``, ``dims``, ...). One given twice, or a spelling they do not take, is a call they leave
# to torch.vmap (a TypeError from a translation's own signature does too), where the op reports
# what torch reports.
_UNSET = object()


def _either(dim: Any, axis: Any, default: Any = _UNSET) -> Any:
    """``dim``, or its alias ``axis`` (torch's NumPy spelling); ``default`` if neither is given."""
    if axis is _UNSET:
        if dim is _UNSET:
            if default is _UNSET:
                raise _Fallback  # a required dim missing: torch's own error under vmap
            return default
        return dim
    if dim is not _UNSET:
        raise _Fallback  # both spellings given
    return axis


def _all_dims(x: torch.Tensor) -> tuple[int, ...]:
    if x.dim() < 2:
        raise _Fallback  # a per-model scalar: sum(dim=()) would mean every dim
    return tuple(range(1, x.dim()))


def _shape(shape: tuple, named: Any = _UNSET) -> tuple:
    """A shape given as ``*shape`` or (``named``) by its keyword (``size=``, ``shape=``, ``dims=``)."""
    if named is not _UNSET:
        if shape:
            raise _Fallback
        shape = (named,)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise _Fallback  # view(dtype) and friends
    return shape


def _flatten(x, start_dim=0, end_dim=-1):
    nd = x.dim() - 1
    return x.flatten(_dim(start_dim, nd), _dim(end_dim, nd))


def _view(x, *shape, size=_UNSET):
    # A view torch allows on one model's contiguous tensor can fail on the array, whose layout
    # is the array ops' business (a linear on a shared input returns a [B, N, ...] view of
    # [N, B, ...] memory): reshape views where it can and copies otherwise (where the forward
    # writes through the view, the rewrite keeps it a view: _AliasingCall). Not a failed view
    # caught: torch.compile cannot trace that.
    return x.reshape(x.size(0), *_shape(shape, size))


def _reshape(x, *sizes, shape=_UNSET):
    return x.reshape(x.size(0), *_shape(sizes, shape))


def _transpose(x, dim0, dim1):
    nd = x.dim() - 1
    return x.transpose(_dim(dim0, nd), _dim(dim1, nd))


def _swapaxes(x, axis0, axis1):
    return _transpose(x, axis0, axis1)


def _permute(x, *order, dims=_UNSET):
    nd = x.dim() - 1
    return x.permute(0, *(_dim(d, nd) for d in _shape(order, dims)))


def _movedim(x, source, destination):
    nd = x.dim() - 1
    return torch.movedim(x, _dims(source, nd), _dims(destination, nd))


def _unsqueeze(x, dim=_UNSET, *, axis=_UNSET):
    if axis is not _UNSET or dim is _UNSET:
        dim = _either(dim, axis)
    return x.unsqueeze(_dim(dim, x.dim() - 1, extra=1))


def _squeeze(x, dim=None, *, axis=_UNSET):
    if axis is not _UNSET:
        dim = _either(_UNSET if dim is None else dim, axis)
    if dim is None:
        dims = tuple(i for i in range(1, x.dim()) if x.size(i) == 1)
        return x.squeeze(dims) if dims else x.view_as(x)
    return x.squeeze(_dims(dim, x.dim() - 1))


# Translations parametrized by the torch function they call are partials of module-level
# functions, which name that function, so that a fused model's graph pickles (torch.save).
def _reduce(name: str, x, dim=None, keepdim=False, *, axis=_UNSET, **kw):
    if axis is not _UNSET:
        dim = _either(_UNSET if dim is None else dim, axis)
    if dim is None:
        if keepdim:
            raise _Fallback
        dims = _all_dims(x)
    elif isinstance(dim, (tuple, list)) and not dim:
        dims = _all_dims(x)  # torch: an empty dim list reduces every dim (of one model's)
    else:
        dims = _dims(dim, x.dim() - 1)
    return getattr(torch, name)(x, dims, keepdim, **kw)


def _extremum(name: str, x, dim=None, keepdim=False, *, axis=_UNSET):
    if axis is not _UNSET:
        dim = _either(_UNSET if dim is None else dim, axis)
    if isinstance(dim, torch.Tensor):
        raise _Fallback  # torch.max(a, b): handled as element-wise by vmap
    if dim is None:
        return getattr(torch, "a" + name)(x, _all_dims(x))
    return getattr(torch, name)(x, _dim(dim, x.dim() - 1), keepdim)


def _argextremum(name: str, x, dim=None, keepdim=False, *, axis=_UNSET):
    if axis is not _UNSET:
        dim = _either(_UNSET if dim is None else dim, axis)
    if dim is None:
        if keepdim:
            raise _Fallback
        return getattr(torch, name)(x.reshape(x.size(0), -1), 1)
    return getattr(torch, name)(x, _dim(dim, x.dim() - 1), keepdim)


def _with_dim(name: str, x, dim=_UNSET, *args, axis=_UNSET, **kwargs):
    """Ops whose second argument is one dim: ``torch.<name>(x, dim, *rest)``."""
    if axis is not _UNSET or dim is _UNSET:
        dim = _either(dim, axis)
    return getattr(torch, name)(x, _dim(dim, x.dim() - 1), *args, **kwargs)


def _f_softmax(name: str, input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise _Fallback  # torch's implicit-dim rule depends on the rank
    return getattr(F, name)(input, dim=_dim(dim, input.dim() - 1), dtype=dtype)


def _chunk(x, chunks, dim=0, *, axis=_UNSET):
    if axis is not _UNSET:
        dim = _either(_UNSET if type(dim) is int and dim == 0 else dim, axis)
    return torch.chunk(x, chunks, _dim(dim, x.dim() - 1))


def _split(x, split_size_or_sections=_UNSET, dim=0, *, split_size=_UNSET):
    """``torch.split(x, split_size_or_sections, dim)`` and ``x.split(split_size, dim)``."""
    return torch.split(x, _either(split_size_or_sections, split_size), _dim(dim, x.dim() - 1))


def _split_like(name: str, x, size_or_sections, dim=0):
    """(What fused models pickled before ``_chunk`` and ``_split`` name.)"""
    return getattr(torch, name)(x, size_or_sections, _dim(dim, x.dim() - 1))


def _unbind(x, dim=0, *, axis=_UNSET):
    if axis is not _UNSET:
        dim = _either(_UNSET if type(dim) is int and dim == 0 else dim, axis)
    return torch.unbind(x, _dim(dim, x.dim() - 1))


def _narrow(x, dim=_UNSET, start=_UNSET, length=_UNSET, *, axis=_UNSET):
    if start is _UNSET or length is _UNSET:
        raise _Fallback
    return torch.narrow(x, _dim(_either(dim, axis), x.dim() - 1), start, length)


def _expand(x, *sizes, size=_UNSET):
    sizes = _shape(sizes, size)
    if len(sizes) != x.dim() - 1:
        raise _Fallback  # new leading dims would land before B
    return x.expand(x.size(0), *sizes)


def _cat(tensors, dim=0, *, axis=_UNSET):
    if not tensors:
        raise _Fallback
    if axis is not _UNSET:
        dim = _either(_UNSET if type(dim) is int and dim == 0 else dim, axis)
    return torch.cat(list(tensors), _dim(dim, tensors[0].dim() - 1))


def _stack(tensors, dim=0, *, axis=_UNSET):
    if not tensors:
        raise _Fallback
    if axis is not _UNSET:
        dim = _either(_UNSET if type(dim) is int and dim == 0 else dim, axis)
    return torch.stack(list(tensors), _dim(dim, tensors[0].dim() - 1, extra=1))


def _matmul(input, other):
    if not (isinstance(input, torch.Tensor) and isinstance(other, torch.Tensor)) or input.dim() < 3 \
            or other.dim() < 3 or input.dim() != other.dim():
        raise _Fallback  # per-model vectors and mixed ranks: vmap knows torch.matmul's rules
    return torch.matmul(input, other)


def _bmm(input, mat2):
    if not (isinstance(input, torch.Tensor) and isinstance(mat2, torch.Tensor)) or input.dim() != 4 \
            or mat2.dim() != 4:
        raise _Fallback  # not per-model 3-D: torch.bmm's own error, under vmap
    return torch.matmul(input, mat2)


# Translations of calls whose arrays may be in any argument, not only the first.
_ANY_ARGUMENT = (_matmul, _bmm)


def _folded(name: str, batched_rank: int, input, *args, **kwargs):
    """``F.<name>``, an op on ``[N, C, *s]`` that also takes an unbatched ``[C, *s]`` (pooling):
    a per-model batched input folds B into N; an unbatched one is a batched array input."""
    fn = getattr(F, name)
    nd = input.dim() - 1
    if nd == batched_rank - 1:
        return fn(input, *args, **kwargs)
    if nd != batched_rank:
        raise _Fallback
    folded, unfold = fold_planes(input)
    out = fn(folded, *args, **kwargs)
    return tuple(unfold(o) for o in out) if isinstance(out, tuple) else unfold(out)


def _interpolate(input, *args, **kwargs):
    """``F.interpolate``: per-model ``[N, C, L]``, ``[N, C, H, W]`` or ``[N, C, D, H, W]`` (it has no
    unbatched form; the rank says how many spatial dims), B folded into N."""
    if input.dim() - 1 not in (3, 4, 5):
        raise _Fallback  # torch's own error, per model under vmap
    folded, unfold = fold_planes(input)
    return unfold(F.interpolate(folded, *args, **kwargs))


class _Shared:
    """A tensor argument that is not an array value (the same for every model), as the translations
    in ``_SHARED_ARGUMENTS`` receive it: they need to know which of their tensors are per model."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor):
        self.value = value


def _marked_shared(dims: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every tensor argument that is not an array value as a :class:`_Shared`."""
    arg_dims, kwarg_dims = dims

    def mark(d, v):
        return _Shared(v) if d is None and isinstance(v, torch.Tensor) else v
    return (tuple(mark(d, v) for d, v in zip(arg_dims, args)),
            {k: mark(kwarg_dims.get(k), v) for k, v in kwargs.items()})


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _embedding_call(who: str, input, weight, padding_idx: int | None, max_norm, norm_type,
                    scale_grad_by_freq, sparse, torch_padding: bool):
    """``F.embedding`` (``torch_padding``: ``torch.embedding``'s padding_idx rule) for every model at
    once on hfkern's array embedding op: per model a ``[V, D]`` table (an array ``[B, V, D]``, or one
    table every model reads) and its indices. Under torch.vmap, the B lookups' backward applies
    ``padding_idx`` to the first model's table only, and a sparse gradient fails; the array op
    keeps each model's padding row, its own ``scale_grad_by_freq`` counts and a sparse ``[B, V, D]``
    gradient, and renormalizes each model's rows in place under ``max_norm`` as torch does."""
    shared_weight = isinstance(weight, _Shared)
    w = weight.value if shared_weight else weight
    x = input.value if isinstance(input, _Shared) else input
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or isinstance(input, _Shared) \
            and shared_weight:
        raise _Fallback
    if w.dim() != (2 if shared_weight else 3) or x.dtype not in (torch.int64, torch.int32) \
            or x.device != w.device or w.layout != torch.strided:
        raise _Fallback  # torch's own error, per model under vmap
    if not (padding_idx is None or isinstance(padding_idx, int) and not isinstance(padding_idx, bool)) \
            or not (max_norm is None or _number(max_norm)) or not _number(norm_type) \
            or not isinstance(scale_grad_by_freq, bool) or not isinstance(sparse, bool):
        raise _Fallback  # (traced values, or values torch refuses)
    V = w.size(-2)
    if padding_idx is None:
        padding_idx = -1
    elif torch_padding:  # aten: an index equal to padding_idx gets no gradient (none is negative or >= V)
        padding_idx = padding_idx if 0 <= padding_idx < V else -1
    elif not -V <= padding_idx < V:
        raise _Fallback  # F.embedding's assertion, per model under vmap
    elif padding_idx < 0:
        padding_idx += V
    B = w.size(0) if not shared_weight else x.size(0)
    grad = w.requires_grad and torch.is_grad_enabled()
    if shared_weight:
        # One table every model reads (a constant, or a tensor made in forward from no array value):
        # torch.vmap is right (sparse gradients included) but for scale_grad_by_freq, whose counts it
        # takes over all the models' indices together; that one runs on the table's broadcast view.
        if max_norm is not None:
            raise FuseError(
                f"fused forward: {who}(max_norm={max_norm}) renormalizes the rows each model looks up in "
                "place, per model; here the weight is one tensor shared by the models (neither a parameter "
                "nor a buffer, nor computed from one), which the fused model cannot hold per model. Make the "
                "table a parameter or buffer, or renormalize outside forward")
        if not (scale_grad_by_freq and grad) or sparse:
            raise _Fallback
        w = broadcast(w, B)
    elif is_shared(w):  # an input given as hfkern.broadcast(table, B)
        if max_norm is not None:
            raise FuseError(
                f"fused forward: {who}(max_norm={max_norm}) renormalizes each model's table in place, and "
                "the weight here is one table shared by the models (hfkern.broadcast): pass one table per "
                "model ([B, num_embeddings, embedding_dim])")
        if sparse and grad:
            raise FuseError(
                f"fused forward: {who}(sparse=True) on a weight shared by the models (hfkern.broadcast) "
                "that requires grad: its gradient would be the sum of the B models' sparse gradients, which "
                "torch cannot form through the broadcast. Pass one table per model, or sparse=False")
    if isinstance(input, _Shared):
        x = broadcast(x, B)
    idx = _check_indices(who, x, B, V, w)
    if max_norm is not None:
        with torch.no_grad():
            array_embedding_renorm_(w, idx, float(max_norm), float(norm_type))
    return _array_embedding(w, idx, padding_idx, scale_grad_by_freq, sparse)


def _f_embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                 sparse=False):
    """``F.embedding`` (:func:`_embedding_call`)."""
    return _embedding_call("F.embedding", input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                           sparse, torch_padding=False)


def _torch_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """``torch.embedding`` (:func:`_embedding_call`)."""
    return _embedding_call("torch.embedding", indices, weight, padding_idx, None, 2.0, scale_grad_by_freq,
                           sparse, torch_padding=True)


def _like_shape(other) -> torch.Size:
    """The per-model shape of ``other`` in ``x.view_as(other)`` and friends: an array's slice, or
    the shape of a tensor that is the same for every model (a :class:`_Shared`)."""
    if isinstance(other, _Shared):
        return other.value.shape
    if not isinstance(other, torch.Tensor):
        raise _Fallback
    return other.shape[1:]


def _as(translation: Callable, x, other):
    if not isinstance(x, torch.Tensor):
        raise _Fallback  # (a _Shared: a tensor of one model's shape; per model under vmap)
    return translation(x, _like_shape(other))


def _view_as(x, other):
    """``Tensor.view_as``: :func:`_view` to ``other``'s per-model shape."""
    return _as(_view, x, other)


def _reshape_as(x, other):
    """``Tensor.reshape_as``: :func:`_reshape` to ``other``'s per-model shape."""
    return _as(_reshape, x, other)


def _expand_as(x, other):
    """``Tensor.expand_as``: :func:`_expand` to ``other``'s per-model shape."""
    return _as(_expand, x, other)


# Translations that also take tensors that are not array values, each as a _Shared.
_SHARED_ARGUMENTS = (_f_embedding, _torch_embedding, _view_as, _reshape_as, _expand_as)
_ANY_ARGUMENT += _SHARED_ARGUMENTS  # (the table is the second argument of F.embedding)


def _getitem(x, index):
    if not isinstance(x, torch.Tensor):
        return x[index]  # a tuple or list of arrays, or a namedtuple
    index = index if isinstance(index, tuple) else (index,)
    for i in index:
        if not (i is None or i is Ellipsis or isinstance(i, slice)
                or (isinstance(i, int) and not isinstance(i, bool))):
            raise _Fallback  # tensor and bool indices index each model under vmap
        if isinstance(i, slice) and not all(
                v is None or (isinstance(v, int) and not isinstance(v, bool))
                for v in (i.start, i.stop, i.step)):
            raise _Fallback
    return x[(slice(None),) + index]


# Tensor attributes that are an array op on the array: each model's attribute, B first.
_ARRAY_ATTRIBUTES = {"data", "grad", "real", "imag", "mT", "mH"}


def _getattr(x, name, *default):
    if not isinstance(x, torch.Tensor):
        if type(x).__module__ == "torch.return_types" and name in getattr(type(x), "__match_args__", ()):
            return getattr(x, name)  # `x.max(1).values`: a field of arrays is an array
        raise _Fallback
    if name not in _ARRAY_ATTRIBUTES:
        raise _Fallback
    return getattr(x, name, *default)


# Functions and methods whose result for each model is the same op applied
# element by element: correct on whole arrays once the operands are aligned.
_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.pow, operator.neg, operator.pos, operator.abs, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.xor,
    operator.invert, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide,
    torch.true_divide, torch.pow, torch.neg, torch.abs, torch.exp, torch.expm1, torch.log,
    torch.log1p, torch.log2, torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.tanh,
    torch.sigmoid, torch.relu, torch.clamp, torch.clip, torch.where, torch.maximum, torch.minimum,
    torch.erf, torch.sign, torch.floor, torch.ceil, torch.round, torch.reciprocal, torch.square,
    torch.masked_fill, torch.logical_and, torch.logical_or, torch.logical_not, torch.isnan,
    torch.isfinite, torch.nan_to_num, torch.lerp, torch.addcmul, torch.addcdiv,
    F.relu, F.relu6, F.gelu, F.silu, F.mish, F.elu, F.selu, F.celu, F.leaky_relu, F.hardtanh,
    F.hardswish, F.hardsigmoid, F.sigmoid, F.tanh, F.softplus, F.softsign, F.logsigmoid,
    F.threshold, F.dropout, F.alpha_dropout,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "pow", "neg", "abs", "exp", "log", "log1p", "sqrt", "rsqrt",
    "sigmoid", "tanh", "relu", "clamp", "clamp_min", "clamp_max", "clip", "masked_fill", "float",
    "double", "half", "bfloat16", "to", "type_as", "detach", "clone", "contiguous", "sin", "cos",
    "erf", "sign", "floor", "ceil", "round", "reciprocal", "square", "lerp", "where", "maximum",
    "minimum", "logical_not", "isnan", "nan_to_num", "requires_grad_", "add_", "sub_", "mul_",
    "div_", "pow_", "neg_", "exp_", "sqrt_", "sigmoid_", "tanh_", "relu_", "clamp_", "clamp_min_",
    "clamp_max_", "masked_fill_", "zero_", "fill_", "lerp_", "addcmul", "addcdiv", "addcmul_",
    "addcdiv_", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__neg__",
}

# Ops with dims or shapes in their arguments, and their array translation.
_TRANSLATED_METHODS: dict[str, Callable] = {
    "flatten": _flatten, "view": _view, "reshape": _reshape, "transpose": _transpose,
    "swapaxes": _swapaxes, "permute": _permute, "unsqueeze": _unsqueeze, "squeeze": _squeeze,
    "movedim": _movedim, "moveaxis": _movedim,
    **{name: partial(_reduce, name) for name in ("sum", "mean", "amax", "amin")},
    **{name: partial(_extremum, name) for name in ("max", "min")},
    **{name: partial(_argextremum, name) for name in ("argmax", "argmin")},
    **{name: partial(_with_dim, name) for name in ("softmax", "log_softmax", "cumsum", "cumprod")},
    "chunk": _chunk, "split": _split,
    "unbind": _unbind, "narrow": _narrow, "expand": _expand,
    "matmul": _matmul, "bmm": _bmm, "__matmul__": _matmul, "__getitem__": _getitem,
    "view_as": _view_as, "reshape_as": _reshape_as, "expand_as": _expand_as,
}
_TRANSLATED_FUNCTIONS: dict[Callable, Callable] = {
    torch.flatten: _flatten, torch.reshape: _reshape, torch.transpose: _transpose,
    torch.swapaxes: _swapaxes, torch.permute: _permute, torch.unsqueeze: _unsqueeze,
    torch.squeeze: _squeeze, torch.movedim: _movedim, torch.moveaxis: _movedim,
    **{getattr(torch, name): _TRANSLATED_METHODS[name] for name in (
        "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "softmax", "log_softmax",
        "cumsum", "cumprod", "chunk", "split")},
    F.softmax: partial(_f_softmax, "softmax"), F.log_softmax: partial(_f_softmax, "log_softmax"),
    torch.unbind: _unbind, torch.narrow: _narrow,
    torch.cat: _cat, torch.concat: _cat, torch.concatenate: _cat, torch.stack: _stack,
    torch.matmul: _matmul, torch.bmm: _bmm, operator.matmul: _matmul, operator.getitem: _getitem,
    builtins.getattr: _getattr,
    **{getattr(F, name): partial(_folded, name, rank) for name, rank in (
        ("adaptive_avg_pool1d", 3), ("adaptive_avg_pool2d", 4), ("adaptive_max_pool1d", 3),
        ("adaptive_max_pool2d", 4), ("avg_pool1d", 3), ("avg_pool2d", 4), ("max_pool1d", 3),
        ("max_pool2d", 4))},
    F.interpolate: _interpolate,
    F.embedding: _f_embedding, torch.embedding: _torch_embedding,
}

# Shape queries: their value is one model's, computed on model 0's slice.
_METADATA_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "element_size", "stride",
                     "is_contiguous", "is_floating_point", "is_complex", "get_device"}
_METADATA_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad"}


def _is_metadata(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op == "call_function":
        if node.target is builtins.getattr:
            return len(node.args) >= 2 and node.args[1] in _METADATA_ATTRIBUTES
        return node.target is builtins.len
    return False


def _in_dims(mark: Any, value: Any) -> Any:
    """vmap's in_dims for ``value``: 0 for every tensor of an array argument, None elsewhere."""
    if mark is True:
        return tree_map(_array_leaf_dim, value)
    if isinstance(mark, (list, tuple)) and isinstance(value, (list, tuple)) \
            and type(value) in (list, tuple) and len(mark) == len(value):
        dims = [_in_dims(m, v) for m, v in zip(mark, value)]
        return dims if isinstance(value, list) else tuple(dims)
    if isinstance(mark, dict) and isinstance(value, dict) and mark.keys() == value.keys():
        return {k: _in_dims(mark[k], value[k]) for k in value}
    return None


def _array_leaf_dim(v: Any) -> int | None:
    if isinstance(v, torch.Tensor):
        return 0
    if _is_dataclass_instance(v):
        # (torch.vmap takes a dataclass for one value, which it cannot slice per model)
        raise FuseError(
            f"fused forward: a {type(v).__name__} dataclass holding the B models' arrays (a layer's output) is "
            "passed to a call that the fused model runs per model, which cannot slice a dataclass per model; "
            "pass its fields (out.logits) instead")
    return None


def _tensors(dims: Any, value: Any, array: bool) -> list[torch.Tensor]:
    """The tensors of ``value`` that are (``array``) or are not array values, by their in_dims."""
    out: list[torch.Tensor] = []
    _collect_tensors(dims, value, array, out)
    return out


def _collect_tensors(d: Any, v: Any, array: bool, out: list[torch.Tensor]) -> None:
    # A module-level function, not a closure over ``out``: a recursive closure is a
    # reference cycle, which would keep the tensors it collected (activations) alive
    # until Python's cyclic garbage collector runs, well past the step.
    if d is None:
        if not array:
            out.extend(t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))
        return
    if isinstance(d, int):
        if array:
            out.append(v)
        return
    if isinstance(d, dict):
        for k in d:
            _collect_tensors(d[k], v[k], array, out)
    else:
        for dd, vv in zip(d, v):
            _collect_tensors(dd, vv, array, out)


_OUT = object()  # marks a tensor output among vmap's non-tensor outputs
_WALK = object()  # _ArrayCall._direct: the general path decides


# ---- dataclasses among the values: torch's pytree takes a dataclass instance for a leaf ----------
class _Identity:
    """A value compared by identity (a dataclass instance in a pytree context, whose own equality
    would compare tensors)."""

    def __init__(self, value: Any):
        self.value = value


class _Fields:
    """A dataclass instance's fields as a pytree node (:func:`_opened`)."""

    def __init__(self, template: Any, values: dict[str, Any]):
        self.template, self.values = template, values


with contextlib.suppress(ValueError):  # (registered already: this module reloaded)
    register_pytree_node(
        _Fields, lambda f: (list(f.values.values()), (_Identity(f.template), tuple(f.values))),
        lambda children, context: _Fields(context[0].value, dict(zip(context[1], children))),
        serialized_type_name="hfkern.fusion._Fields")


def _is_dataclass_instance(v: Any) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def _opened(value: Any) -> Any:
    """``value`` with every dataclass instance in it (at any depth of tuples, lists and dicts) as a
    :class:`_Fields` node, so that its tensors are leaves of torch's pytree (a forward or a layer
    returning a dataclass: its tensors are each model's, stacked as others are)."""
    def open_one(v: Any) -> Any:
        if not _is_dataclass_instance(v):
            return v
        return _Fields(v, {f.name: _opened(getattr(v, f.name)) for f in dataclasses.fields(v) if hasattr(v, f.name)})
    return tree_map(open_one, value, is_leaf=_is_dataclass_instance)


def _closed(value: Any) -> Any:
    """:func:`_opened`'s inverse: each :class:`_Fields` node as a dataclass instance of its class
    holding the node's values (made by the class's ``__init__``, as ``dataclasses.replace`` makes
    one; the fields ``__init__`` does not take are set after)."""
    def close_one(v: Any) -> Any:
        if not isinstance(v, _Fields):
            return v
        kinds = {f.name: f.init for f in dataclasses.fields(v.template)}
        values = {k: _closed(x) for k, x in v.values.items()}
        made = dataclasses.replace(v.template, **{k: x for k, x in values.items() if kinds.get(k)})
        for k, x in values.items():
            if not kinds.get(k):
                object.__setattr__(made, k, x)
        return made
    return tree_map(close_one, value, is_leaf=lambda v: isinstance(v, _Fields))


def _flat_fields(value: Any) -> tuple[list, Any, bool]:
    """``tree_flatten(value)`` with every dataclass instance in it opened (:func:`_opened`), and
    whether any was (for :func:`_unflat_fields`)."""
    leaves, spec = tree_flatten(value)
    if not any(_is_dataclass_instance(v) for v in leaves):
        return leaves, spec, False
    leaves, spec = tree_flatten(_opened(value))
    return leaves, spec, True


_PLAIN_LEAVES = (torch.Tensor, int, float, complex, bool, str, bytes, type(None), torch.Size, torch.dtype, torch.device,
                 torch.memory_format, torch.layout, enum.Enum)


def _check_per_model_leaves(leaves: list, what: Callable[[], str]) -> None:
    """Refuse a result (its flattened ``leaves``) that holds tensors in an object torch's pytree
    takes for one value (neither a container nor a dataclass): each model's tensors in it could not
    be stacked, so the fused forward would return model 0's, or tensors escaped from torch.vmap."""
    for v in leaves:
        if isinstance(v, _PLAIN_LEAVES):
            continue
        held = getattr(v, "__dict__", None)
        if isinstance(held, dict) and any(isinstance(t, torch.Tensor) for t in tree_flatten(list(held.values()))[0]):
            raise FuseError(
                f"fused forward: {what()} returns a {type(v).__name__} object holding tensors, which the fused model "
                "cannot hold per model (it is one Python object, not a container of the models' tensors). Return "
                "tensors in tuples, lists, dicts, namedtuples or dataclasses")


def _unflat_fields(leaves: list, spec: Any, opened: bool) -> Any:
    """:func:`_flat_fields`'s inverse."""
    value = tree_unflatten(leaves, spec)
    return _closed(value) if opened else value


def _vmap_call(fn: Callable, dims: tuple, args: tuple, kwargs: dict, loop: bool = False,
               who: Callable[[], str] | None = None) -> Any:
    """``fn`` applied to each model's slice of the array arguments, under torch.vmap (``loop``: in
    a loop over the models). ``who()``: what runs, for an error.

    Non-tensor outputs (shapes, flags) are returned as the per-model function
    produced them; random ops draw independently for each model.
    """
    layout: list = []

    def per_model(a, k):
        leaves, spec, opened = _flat_fields(fn(*a, **k))  # (a dataclass's tensors too)
        _check_per_model_leaves(leaves, who or (lambda: f"`{getattr(fn, '__qualname__', None) or fn}`, run per "
                                                        "model,"))
        layout[:] = [spec, [_OUT if isinstance(v, torch.Tensor) else v for v in leaves], opened]
        return tuple(v for v in leaves if isinstance(v, torch.Tensor))

    if loop or _cpu_autocast(args, kwargs):
        tensors = _looped(per_model, dims, args, kwargs)
    else:
        tensors = torch.vmap(per_model, in_dims=dims, randomness="different")(args, kwargs)
    spec, leaves, opened = layout
    it = iter(tensors)
    return _unflat_fields([next(it) if v is _OUT else v for v in leaves], spec, opened)


def _cpu_autocast(args: tuple, kwargs: dict) -> bool:
    """Whether a CPU autocast region is active for a call on CPU tensors: torch.vmap does not
    apply CPU autocast to the ops it batches (a linear stays float32 where each model's is
    bfloat16), so such calls run once per model instead."""
    if not torch.is_autocast_enabled("cpu"):
        return False
    return any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in tree_flatten((args, kwargs))[0])


def _looped(per_model: Callable, dims: Any, args: tuple, kwargs: dict) -> tuple:
    """``torch.vmap(per_model, in_dims=dims)((args, kwargs))`` as a loop over the models: each
    model's slices (views: in-place writes reach the arrays), the results stacked."""
    leaves, spec = tree_flatten((args, kwargs))
    flat_dims = _broadcast_to_and_flatten(dims, spec)
    B = next(v.size(d) for v, d in zip(leaves, flat_dims) if d is not None)
    outs, slices = [], []
    for b in range(B):
        mine = [v.select(d, b) if d is not None else v for v, d in zip(leaves, flat_dims)]
        slices.append(mine)
        a, k = tree_unflatten(mine, spec)
        outs.append(per_model(a, k))
    return tuple(_stacked_or_input(parts, slices, leaves, flat_dims) for parts in zip(*outs))


def _stacked_or_input(parts: Sequence[torch.Tensor], slices: list[list], leaves: list, dims: list) -> torch.Tensor:
    """The models' results ``parts`` as one array: the array argument itself where each model's
    result is its own slice of it (an in-place call returns its input), as torch returns the
    tensor it was given, else the results stacked (new memory)."""
    first = parts[0]
    for i, (v, d) in enumerate(zip(leaves, dims)):
        if d == 0 and slices[0][i] is first and all(p is s[i] for p, s in zip(parts, slices)):
            return v
    return torch.stack(parts)


def _vmap_refused(e: Exception) -> bool:
    """Whether an error comes from torch.vmap itself (no batching rule, a dynamic shape, ...)
    rather than from the op as torch runs it for one model."""
    message = str(e)
    return "vmap" in message or "atching rule" in message


def _aligned(dims: Any, value: Any, rank: int) -> Any:
    """``value`` with every array tensor of lower rank viewed as ``[B, 1, ..., 1, *s]`` of ``rank``
    dims, so torch's trailing-dim broadcasting pairs per-model dims as each model does."""
    if dims is None:
        return value
    if isinstance(dims, int):
        missing = rank - value.dim()
        return value[(slice(None),) + (None,) * missing] if missing else value
    if isinstance(dims, dict):
        return {k: _aligned(dims[k], value[k], rank) for k in value}
    out = [_aligned(d, v, rank) for d, v in zip(dims, value)]
    return out if isinstance(value, list) else tuple(out)


# ---- pickling (torch.save of a whole fused model) ------------------------------------------
class _Global:
    """A module-level callable pickled as its module and name. torch's ``boolean_dispatch``
    functions (``F.max_pool2d``, ``F.adaptive_max_pool2d``, ...) are module attributes whose
    qualified name pickle cannot look up."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)


def _to_pickle(value: Any) -> Any:
    """``value``, or a :class:`_Global` for a callable that its module holds under its
    ``__name__`` but whose ``__qualname__`` says otherwise."""
    name = getattr(value, "__name__", None)
    if isinstance(name, str) and callable(value) and getattr(value, "__qualname__", name) != name:
        module = sys.modules.get(getattr(value, "__module__", None) or "")
        if module is not None and getattr(module, name, None) is value:
            return _Global(module.__name__, name)
    return value


def _from_pickle(value: Any) -> Any:
    return value.resolve() if isinstance(value, _Global) else value


class _NodeRef:
    """A node named in the arguments of a pickled graph (:func:`graph_state`)."""

    def __init__(self, name: str):
        self.name = name


def graph_state(graph: fx.Graph) -> list[tuple]:
    """``graph`` as a flat list of its nodes. A ``torch.fx.Graph`` pickles as a linked list,
    one level of recursion per node, which exceeds Python's limit at a few hundred nodes."""
    def ref(node: fx.Node) -> _NodeRef:
        return _NodeRef(node.name)
    return [(n.op, n.name, _to_pickle(n.target), fx.node.map_arg(n.args, ref), fx.node.map_arg(n.kwargs, ref),
             n.type, n.meta) for n in graph.nodes]


def graph_from_state(state: list[tuple]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def node_of(a: Any) -> Any:
        return env[a.name] if isinstance(a, _NodeRef) else a
    for op, name, target, args, kwargs, type_expr, meta in state:
        node = graph.create_node(op, _from_pickle(target), fx.node.map_aggregate(args, node_of),
                                 fx.node.map_aggregate(kwargs, node_of), name=name, type_expr=type_expr)
        node.meta.update(meta)
        env[name] = node
    return graph


def compiled_forward(graph: fx.Graph, filename: str) -> Callable:
    """The Python function of a fused forward's graph, called as ``forward(fused_model, *args)``;
    ``filename`` names its code in tracebacks."""
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102
    return namespace["forward"]


class _SavedFactory:
    """The factory given to :func:`fuse` while a fused model is pickled or deep-copied.

    Pickled where pickle can save it (a module-level function or class, a partial of one);
    otherwise (a lambda, a local function) the pickle holds a :class:`_LostFactory`, and
    ``reset_model`` on the loaded model asks for ``factory=``. ``copy.deepcopy`` keeps it as
    it is, as it keeps functions.
    """

    def __init__(self, fn: Callable[[], nn.Module]):
        self.fn = fn

    def __deepcopy__(self, memo: dict) -> "_SavedFactory":
        return self

    def __reduce__(self) -> tuple:
        try:
            pickle.dumps(self.fn)
        except (pickle.PicklingError, AttributeError, TypeError):
            return _LostFactory, (repr(self.fn),)
        return _SavedFactory, (self.fn,)


class _LostFactory:
    """Where a loaded fused model's factory was: pickle could not save the one given to fuse."""

    def __init__(self, description: str):
        self.description = description


class _CallsFunction(_capture.GraphTarget):
    """A graph target that calls ``self.fn``, pickled through :func:`_to_pickle`."""

    fn: Callable

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fn": _to_pickle(self.fn)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, fn=_from_pickle(state["fn"]))


class _ArrayCall(_CallsFunction):
    """A captured function or method call with array arguments, run per model.

    ``marks`` has the shape of the call's ``(args, kwargs)`` with True where an
    argument is an array value of the fused graph. Where the arguments so marked hold no
    tensor in a call (a Python value given to forward: ``torch.arange(k)``), the call is
    the same for every model and its tensors become array values of the B models' own
    copies (a random draw: B draws).
    """

    def __init__(self, fn: Callable, marks: Any, label: str, method: str | None, B: int):
        self.fn = fn
        self.marks = marks
        self.method = method
        self.B = B
        self._named(label)
        if method is not None:
            self.elementwise = method in _ELEMENTWISE_METHODS
            self.translate = _TRANSLATED_METHODS.get(method)
        else:
            self.elementwise = fn in _ELEMENTWISE_FUNCTIONS
            self.translate = _TRANSLATED_FUNCTIONS.get(fn)
        # Marks of one flag or constant per argument (`a + b`, `x.view(-1, 64)`, `x.max(2,
        # keepdim=True)`): __call__ reads such arguments directly (_direct) rather than walking
        # them as trees, the general path's per-call cost.
        arg_marks, kwarg_marks = marks if isinstance(marks, tuple) and len(marks) == 2 else (None, None)
        flat = (isinstance(arg_marks, tuple) and isinstance(kwarg_marks, dict)
                and all(_is_plain(m) for m in (*arg_marks, *kwarg_marks.values())))
        self._arity = (len(arg_marks), tuple(kwarg_marks)) if flat else None

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self.method is not None:
            return getattr(args[0], self.method)(*args[1:], **kwargs)
        return self.fn(*args, **kwargs)

    # Whether the call writes its first argument in place and takes other array values (set by the
    # rewrite): torch refuses a source that overlaps the written tensor in part.
    overlap = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.overlap:
            self._check_overlap(args, kwargs)
        try:  # (one frame: this runs for every call of the fused forward)
            if self._arity is not None and self._arity == (len(args), tuple(kwargs)):
                out = self._direct(args, kwargs)
                if out is not _WALK:
                    return out
            if self.fn is builtins.getattr and args and _is_dataclass_instance(args[0]):
                return getattr(*args)  # a field of a dataclass of arrays (a layer's output: _closed)
            dims = _in_dims(self.marks, (args, kwargs))
            arrays = _tensors(dims, (args, kwargs), True)
            if not arrays:
                return self._same_for_every_model(args, kwargs)  # its array arguments were shapes or flags
            others = _tensors(dims, (args, kwargs), False)
            if self.elementwise:
                rank = max(a.dim() for a in arrays)
                if all(o.dim() < rank for o in others):
                    if any(a.dim() != rank for a in arrays):
                        if self.method is not None and args[0].dim() != rank:
                            return self._vmap(dims, args, kwargs)  # in place into a lower-rank tensor
                        args, kwargs = _aligned(dims, (args, kwargs), rank)
                    return self._call(args, kwargs)
            elif self.translate is not None and (not others or self.translate in _SHARED_ARGUMENTS) and (
                    self.translate in _ANY_ARGUMENT or self._first_holds_arrays(dims)):
                try:
                    if others:  # (a translation in _SHARED_ARGUMENTS)
                        marked_args, marked_kwargs = _marked_shared(dims, args, kwargs)
                        return self.translate(*marked_args, **marked_kwargs)
                    return self.translate(*args, **kwargs)
                except (_Fallback, TypeError):  # (TypeError: a spelling the translation does not take)
                    pass
            return self._vmap(dims, args, kwargs)
        except RuntimeError as e:
            if "single memory location" not in str(e) or not _broadcast_written(args):
                raise
            raise self._shared_write_error() from e

    def _check_overlap(self, args: tuple, kwargs: dict) -> None:
        """torch's check that an in-place op's arguments do not overlap its written tensor in part
        (``x[1:].copy_(x[:-1])``), on model 0's slices: the array op runs on whole arrays, whose
        memory may be laid out so that torch's own check does not see it."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.dim():
            return
        arg_marks, kwarg_marks = self.marks
        others = [v for v, m in (*zip(args[1:], arg_marks[1:]), *((kwargs[k], kwarg_marks.get(k)) for k in kwargs))
                  if m is True and isinstance(v, torch.Tensor) and v is not x and v.dim()]
        for v in others:
            if v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and _partial_overlap(x[0], v[0]):
                raise FuseError(
                    f"fused forward: `{self._text()}`{_capture.site_line(self.site)} {self.module_text} writes into a "
                    "tensor that overlaps one of its arguments in part (some elements of the written tensor are "
                    "other elements of the argument), which torch refuses: 'unsupported operation: some elements of "
                    "the input tensor and the written-to tensor refer to a single memory location'. Clone the "
                    "argument first (`.clone()`)")

    def _shared_write_error(self) -> FuseError:
        site = _capture.site_line(getattr(self, "site", None))
        return FuseError(
            f"fused forward: `{self.method or getattr(self.fn, '__name__', self.fn)}`{site} "
            f"{getattr(self, 'module_text', '')} writes in place into a tensor that is one tensor for "
            "every model here: the forward's input given shared by the B models (hfkern.broadcast), or a "
            "view of it (a layer that returns its input, as dropout in evaluation does), cannot hold B "
            "models' values. Pass the input per model (x.expand(B, *x.shape).clone()), or write into a "
            "copy (x = x.clone())")

    def _direct(self, args: tuple, kwargs: dict) -> Any:
        """What the general path of ``__call__`` does with arguments that are array tensors
        (where marked) and plain values (:func:`_is_plain`) only, when all arrays have one
        rank (elementwise; a translated call whose arrays are the first argument, or any
        for a matmul); ``_WALK`` where the general path must decide."""
        if self.translate is _getitem and type(args[1]) is int and self.marks[0][0] is True \
                and isinstance(args[0], (tuple, list)):
            # An element of a tuple of arrays (`torch.max(x, 2)[0]`): the array it holds, as the
            # general path's translation gives it, without walking the tuple.
            out = args[0][args[1]]
            if type(out) is torch.Tensor:
                return out
        rank, first_only = None, True
        for i, (a, mark) in enumerate(zip(args, self.marks[0])):
            if type(a) is torch.Tensor:
                if mark is not True or (rank is not None and a.dim() != rank):
                    return _WALK  # a tensor that is not an array, or arrays of different ranks
                rank, first_only = a.dim(), first_only and i == 0
            elif not _is_plain(a):
                return _WALK
        for a in kwargs.values():
            if not _is_plain(a):  # a tensor among the keywords included
                return _WALK
        if rank is None:
            return self._same_for_every_model(args, kwargs)  # its array arguments were shapes or flags
        if self.elementwise:
            return self._call(args, kwargs)
        if self.translate is not None and (first_only or self.translate in _ANY_ARGUMENT):
            try:
                return self.translate(*args, **kwargs)
            except (_Fallback, TypeError):
                return self._vmap(_in_dims(self.marks, (args, kwargs)), args, kwargs)
        return _WALK

    def _same_for_every_model(self, args: tuple, kwargs: dict) -> Any:
        """The call made of Python values and tensors that are not array values (its array
        arguments held no tensor): every model's result, its tensors as array values."""
        if self.method is None and (self.fn in _capture.RANDOM_FUNCTIONS or self.fn in _capture.RANDOM_FUNCTIONALS
                                    and not kwargs.get("inplace")):
            return torch.stack([self._call(args, kwargs) for _ in range(self.B)])  # each model draws
        out = self._call(args, kwargs)
        # own copies, as each model makes its own tensor (it may be written in place)
        leaves, spec, opened = _flat_fields(out)
        copies = [_every_model(v, self.B, copy=True) if isinstance(v, torch.Tensor) else v for v in leaves]
        return _unflat_fields(copies, spec, opened)

    @staticmethod
    def _first_holds_arrays(dims: Any) -> bool:
        """Whether every array argument is in the first positional argument (x, or cat's list)."""
        arg_dims, kwarg_dims = dims
        rest = (arg_dims[1:], kwarg_dims)
        return bool(arg_dims) and arg_dims[0] is not None and not tree_flatten(rest)[0].count(0)

    def _vmap(self, dims: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return _vmap_call(lambda *a, **k: self._call(a, k), dims, args, kwargs,
                              who=lambda: f"`{self._text()}`{_capture.site_line(self.site)}, run per model,")
        except (RuntimeError, ValueError) as e:
            if isinstance(e, FuseError):
                raise
            if _vmap_refused(e):
                raise self._vmap_error(e, args, kwargs) from e
            if "stack expects each tensor to be equal size" in str(e) and self.fn is not torch.stack:
                # vmap's loop over the models (an op without a batching rule) made results of different sizes
                raise FuseError(
                    f"fused forward: `{self._text()}`{_capture.site_line(self.site)} {self.module_text} makes results "
                    "of different sizes for the B models: its result's size depends on the values, which differ "
                    "between the models, so the results are not one array. Write it with ops whose result has a "
                    "fixed size") from e
            raise

    # Where the call is in the model's code (set by the rewrite): for its errors.
    site: tuple[str, int] | None = None
    module_text: str = ""

    def _text(self) -> str:
        if self.fn is operator.getitem or self.method == "__getitem__":
            return "x[index]"
        if self.fn is operator.setitem or self.method == "__setitem__":
            return "x[index] = value"
        if self.method is not None:
            return f"Tensor.{self.method}"
        module = getattr(self.fn, "__module__", None) or ""
        name = getattr(self.fn, "__name__", repr(self.fn))
        return f"{'torch' if module.startswith('torch') else module}.{name}" if module else name

    def _vmap_error(self, e: Exception, args: tuple, kwargs: dict) -> FuseError:
        where = f"{_capture.site_line(self.site)} {self.module_text}".rstrip()
        if self._text().startswith("x[index]") and len(args) > 1 and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in tree_flatten(args[1])[0]):
            return FuseError(
                f"fused forward: boolean-mask indexing `{self._text().replace('index', 'mask')}`{where} selects "
                "as many elements as the mask holds True values: a size that depends on the values, which "
                "differ between the models, so the results are not one array "
                "(as torch.nonzero, torch.masked_select). Write it with ops of a fixed size: "
                "torch.where(mask, x, other), x.masked_fill(mask, value), (x * mask).sum()")
        return FuseError(
            f"fused forward: `{self._text()}`{where} runs under torch.vmap (for the B models at once), which "
            f"cannot run it: {str(e).strip().splitlines()[0]} Write it with other tensor ops, or name the "
            "class of the module whose forward makes this call in hfkern.fuse(..., loop_modules=(Cls,)) to "
            "run that module once per model")


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span without gaps or repeats (torch's
    ``is_non_overlapping_and_dense``), in any order of its dims."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _partial_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch's partial overlap of two tensors (``at::get_overlap_status``): both dense, their memory
    spans intersect, and they are not one span of the same strides; not decided otherwise."""
    if not a.numel() or not b.numel() or not (_dense(a) and _dense(b)):
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if a0 == b0 and a1 == b1:
        return a.stride() != b.stride()
    return a0 < b1 and b0 < a1


def _lifted(t: torch.Tensor, rank: int) -> torch.Tensor:
    """An array tensor ``[B, *s]`` viewed as ``[B, 1, ..., 1, *s]`` of ``rank`` dims."""
    missing = rank - t.dim()
    return t[(slice(None),) + (None,) * missing] if missing > 0 else t


class _FillCall(_ArrayCall):
    """``masked_fill``, ``masked_fill_``, ``torch.masked_fill`` or ``fill_`` whose value is an array
    value (a per-model 0-d tensor: a scalar parameter, ``y.max()``), which torch's op takes only as
    one 0-d tensor: each model's value as a column ``[B, 1, ..., 1]``, written with ``torch.where``
    (masked_fill, copied into the tensor in place) or ``copy_`` (fill_). Other arguments: as an
    :class:`_ArrayCall` (the rewrite makes this call only where the value is an array value)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._fill(args, kwargs)
        return super().__call__(*args, **kwargs) if out is _WALK else out

    def _fill(self, args: tuple, kwargs: dict) -> Any:
        names = ("input", "value") if self.method == "fill_" else ("input", "mask", "value")
        arg_marks, kwarg_marks = self.marks
        if len(args) > len(names):
            return _WALK
        values, marks = dict(zip(names, args)), dict(zip(names, arg_marks))
        for k, v in kwargs.items():
            if k not in names or k in values:
                return _WALK  # torch's own error, under vmap
            values[k], marks[k] = v, kwarg_marks.get(k)
        x, value = values.get("input"), values.get("value")
        if len(values) != len(names) or marks["value"] is not True or not isinstance(value, torch.Tensor) \
                or value.dim() != 1 or not isinstance(x, torch.Tensor):
            return _WALK  # (a per-model value that is not 0-d: torch's error, under vmap)
        x_array = marks["input"] is True
        if self.method == "fill_":
            return x.copy_(_lifted(value, x.dim())) if x_array else _WALK
        mask = values["mask"]
        if not isinstance(mask, torch.Tensor):
            return _WALK
        mask_array = marks["mask"] is True
        # arrays lifted to one rank past every other tensor's: the others broadcast per model
        rank = max((t.dim() if a else t.dim() + 1) for t, a in ((x, x_array), (mask, mask_array), (value, True)))
        filled = torch.where(_lifted(mask, rank) if mask_array else mask, _lifted(value, rank).to(x.dtype),
                             _lifted(x, rank) if x_array else x)
        if self.method == "masked_fill_":
            if not x_array or filled.shape != x.shape:
                return _WALK
            return x.copy_(filled)
        return filled


# Memory formats of one model's tensor and its rank: an array value has one more dim (B), which
# torch's own op refuses for them ("required rank 4 tensor to use channels_last format").
_PER_MODEL_FORMATS = {torch.channels_last: 4, torch.channels_last_3d: 5}
_FORMAT_FUNCTIONS = {torch.clone, torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
                     torch.rand_like, torch.randn_like, torch.randint_like}


def _memory_format_of(node: fx.Node) -> Any:
    """The channels-last memory format a captured call asks its result to have (``memory_format=``
    of ``contiguous``, ``to``, ``clone`` and the ``*_like`` factories), or None."""
    if not (node.op == "call_method" and node.target in ("contiguous", "to", "clone")
            or node.op == "call_function" and node.target in _FORMAT_FUNCTIONS):
        return None
    fmt = node.kwargs.get("memory_format")
    return fmt if isinstance(fmt, torch.memory_format) and fmt in _PER_MODEL_FORMATS else None


def _in_model_format(x: torch.Tensor, memory_format: torch.memory_format, copy: bool) -> torch.Tensor:
    """The array ``x`` (``[B, N, C, *S]``) with every model's slice in ``memory_format`` (``[B, N, *S, C]``
    memory): ``x`` itself where it is already (unless ``copy``), else a copy of its own."""
    _, N, C, *S = x.shape
    order = (0, 1, *range(3, x.dim()), 2)
    if not copy and _dense_in(x.shape, x.stride(), order):
        return x
    inner = [C]
    for n in reversed(S[1:]):
        inner.insert(0, inner[0] * n)
    strides = (N * math.prod(S) * C, math.prod(S) * C, 1, *inner)
    return x.new_empty_strided(tuple(x.shape), strides).copy_(x)


class _FormatCall(_ArrayCall):
    """A call that asks for a channels-last result (``x.contiguous(memory_format=torch.channels_last)``,
    ``.to(...)``, ``.clone(...)``, ``torch.zeros_like(...)``, ...) on an array value: torch's op takes
    only one model's rank for that format, so the call runs without it and every model's slice of
    the result gets the format's layout, as each model's tensor has it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fmt = kwargs.get("memory_format")
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and self.marks[0] and self.marks[0][0] is True
                and x.dim() == _PER_MODEL_FORMATS.get(fmt, -2) + 1):
            return super().__call__(*args, **kwargs)  # (one model's rank is not the format's: torch's error)
        rest = {k: v for k, v in kwargs.items() if k != "memory_format"}
        if self.method == "clone" or self.fn is torch.clone:
            return _in_model_format(x, fmt, copy=True)
        if self.method == "contiguous":
            return _in_model_format(x, fmt, copy=False)
        y = super().__call__(*args, **rest)
        return _in_model_format(y, fmt, copy=False) if isinstance(y, torch.Tensor) else y


class _MaskSetItem(_ArrayCall):
    """``x[index] = value`` where the index is or may be a tensor: with a boolean mask (``y[y < 0] = 0``,
    a masked fill), each model's elements where its mask holds are written in place (``masked_fill_``,
    or ``torch.where`` for a value per model); any other index as an :class:`_ArrayCall`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 3 and not kwargs:
            x, index, value = args
            x_mark, index_mark, value_mark = self.marks[0]
            if type(index) is tuple and len(index) == 1:
                index, index_mark = index[0], index_mark[0] if isinstance(index_mark, tuple) else index_mark
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool and isinstance(x, torch.Tensor) \
                    and x_mark is True \
                    and self._masked(x, index, index_mark is True, value, value_mark is True) is not _WALK:
                return None
        return super().__call__(*args, **kwargs)

    def _masked(self, x: torch.Tensor, mask: torch.Tensor, mask_array: bool, value: Any, value_array: bool) -> Any:
        shape = mask.shape[1:] if mask_array else mask.shape  # one model's mask
        rest = x.dim() - 1 - len(shape)  # x's dims past the mask's
        if rest < 0 or tuple(shape) != tuple(x.shape[1:1 + len(shape)]) or (mask_array and mask.size(0) != x.size(0)):
            return _WALK  # torch's own error
        mask = mask[(Ellipsis,) + (None,) * rest]
        if isinstance(value, (int, float, bool)) or isinstance(value, torch.Tensor) and not value_array \
                and value.dim() == 0:
            x.masked_fill_(mask, value)
            return None
        if not isinstance(value, torch.Tensor):
            return _WALK
        first = 1 if value_array else 0
        extra = value.dim() - first - rest  # the value's dims past one selected element's
        if extra > 0:
            if any(n != 1 for n in value.shape[first:first + extra]):
                raise FuseError(
                    f"fused forward: `x[mask] = value` with a value of one row per selected element"
                    f"{_capture.site_line(self.site)} {self.module_text}: how many elements each model's mask "
                    "selects depends on its values, which differ between the models. Write it with "
                    "torch.where(mask, value, x) on tensors of x's shape")
            value = value.reshape(*value.shape[:first], *value.shape[first + extra:])
        value = _lifted(value, x.dim()) if value_array else value
        x.copy_(torch.where(mask, value.to(x.dtype), x))
        return None


_GRAD_SIGNATURE = inspect.signature(torch.autograd.grad)


class _GradCall(_ArrayCall):
    """``torch.autograd.grad`` in forward (forces, gradient penalties): the models are independent,
    so the gradients of their outputs with respect to their inputs (array values) are the gradients
    of the array outputs, weighted per model by ``grad_outputs`` (ones for per-model scalars), with
    respect to the arrays, all models at once; ``create_graph`` and ``retain_graph`` as given."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = _GRAD_SIGNATURE.bind(*args, **kwargs).arguments  # (torch's TypeError)
        marks = _GRAD_SIGNATURE.bind(*self.marks[0], **self.marks[1]).arguments
        where = f"{_capture.site_line(self.site)} {self.module_text}"
        if given.get("is_grads_batched"):
            raise FuseError(f"fused forward: torch.autograd.grad(..., is_grads_batched=True){where} is not "
                            "supported: compute the batch of gradients one grad_outputs at a time")
        outputs = self._per_model("outputs", given["outputs"], marks["outputs"], where)
        inputs = self._per_model("inputs", given["inputs"], marks["inputs"], where)
        weights = given.get("grad_outputs")
        if weights is None or isinstance(weights, torch.Tensor):
            weights, weight_marks = [weights], [marks.get("grad_outputs")]
        else:
            weight_marks = marks["grad_outputs"]
            weight_marks = [weight_marks] * len(weights) if not isinstance(weight_marks, (tuple, list)) \
                else weight_marks
        if len(weights) == 1 and len(outputs) > 1 and weights[0] is None:
            weights, weight_marks = weights * len(outputs), weight_marks * len(outputs)
        if len(weights) != len(outputs):
            raise RuntimeError(f"grad requires one grad_output per output: got {len(weights)} grad_outputs "
                               f"and {len(outputs)} outputs")
        per_model = []
        for out, w, mark in zip(outputs, weights, weight_marks):
            if w is None:
                # a per-model scalar's implicit weight, one per model (torch's error for others)
                w = torch.ones_like(out) if out.requires_grad and out[0].numel() == 1 else None
            elif isinstance(w, torch.Tensor) and mark is not True:
                w = w.unsqueeze(0).expand(out.size(0), *w.shape)  # the same weights for every model
            per_model.append(w)
        rest = {k: given[k] for k in ("retain_graph", "create_graph", "only_inputs", "allow_unused",
                                      "materialize_grads") if k in given}
        return torch.autograd.grad(outputs, inputs, grad_outputs=per_model, **rest)

    @staticmethod
    def _per_model(name: str, value: Any, mark: Any, where: str) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            value, mark = [value], [mark]
        elif not isinstance(mark, (tuple, list)):
            mark = [mark] * len(value)
        if not all(isinstance(v, torch.Tensor) and m is True for v, m in zip(value, mark)):
            raise FuseError(
                f"fused forward: torch.autograd.grad{where} with {name} that are not the B models' own values "
                "(a tensor made in forward from no input, parameter or buffer is one tensor for every model, "
                "whose gradient would be the sum over the models): make it from the input or keep it in a "
                "buffer")
        return list(value)


def _detach_(x: torch.Tensor) -> torch.Tensor:
    """``Tensor.detach_()`` per model: in place where the array allows it, else (the array a view,
    as an array op's output may be where one model's tensor is not) a detached value, which the
    rewrite gives every later reader of the tensor."""
    if x._base is not None:  # (a view cannot be detached in place; no failure caught: torch.compile)
        return x.detach()
    return x.detach_()


class _ApplyLoop(_CallsFunction):
    """``Fn.apply(...)`` of a custom ``torch.autograd.Function`` with array arguments, once per model
    on its slices, the results stacked: each model runs the Function's own forward and backward.
    (torch.vmap would need the Function's own vmap rule, which few Functions define.)"""

    def __init__(self, fn: type, marks: Any, label: str):
        self.fn, self.marks = fn, marks
        self._named(label)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _vmap_call(self.fn.apply, _in_dims(self.marks, (args, kwargs)), args, kwargs, loop=True)


def _per_model_copies(value: Any, B: int) -> Any:
    """``value``, made of Python values and tensors that are not array values, with each tensor as
    the B models' own copies (``[B, *shape]``)."""
    if isinstance(value, torch.Tensor):
        return _every_model(value, B, copy=True)
    leaves, spec, opened = _flat_fields(value)
    if not any(isinstance(v, torch.Tensor) for v in leaves):
        return value  # (Python values as they are: a torch.Size stays one)
    return _unflat_fields([_every_model(v, B, copy=True) if isinstance(v, torch.Tensor) else v for v in leaves],
                      spec, opened)


class _Metadata(_CallsFunction):
    """A shape query on array values: the answer for one model (model 0's slice)."""

    def __init__(self, fn: Callable, marks: Any, label: str, method: str | None = None):
        self.fn, self.marks, self.method = fn, marks, method
        self._named(label)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dims = _in_dims(self.marks, (args, kwargs))

        def one(d, v):
            if d is None:
                return v
            if isinstance(d, int):
                return v.select(0, 0)
            if isinstance(d, dict):
                return {k: one(d[k], v[k]) for k in v}
            out = [one(dd, vv) for dd, vv in zip(d, v)]
            return out if isinstance(v, list) else tuple(out)

        args, kwargs = one(dims, (args, kwargs))
        if self.method is not None:
            return getattr(args[0], self.method)(*args[1:], **kwargs)
        return self.fn(*args, **kwargs)


@contextlib.contextmanager
def _reparametrized(template: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """``template`` with its parameters and buffers replaced by ``state``'s tensors for the body.

    Yields a dict that, once the body has run, holds the buffers the body rebound
    (``self.count = self.count + 1``): torch.func.functional_call would drop them.
    """
    slots = []
    for name, tensor in state.items():
        owner, attr = _parent(template, name)
        table = owner._parameters if attr in owner._parameters else owner._buffers
        slots.append((name, table, attr, table[attr], tensor))
        table[attr] = tensor
    rebound: dict[str, torch.Tensor] = {}
    try:
        yield rebound
        for name, table, attr, _, tensor in slots:
            if table[attr] is not tensor:
                rebound[name] = table[attr]
    finally:
        for _, table, attr, old, _ in slots:
            table[attr] = old


def _rebind(module: nn.Module, rebound: dict[str, torch.Tensor]) -> None:
    for name, value in rebound.items():
        owner, attr = _parent(module, name)
        owner._buffers[attr] = value


# Leaf modules that run in a loop over the models unless named in vmap_modules: torch.vmap has
# no batching rule for the recurrent modules' fused kernels (aten::lstm, aten::gru, ...).
_LOOPED_BY_DEFAULT = (nn.RNNBase, nn.RNNCellBase)


def _own_class(module: nn.Module) -> type:
    """The class a user names for ``module`` (a parametrized module's: its own class's)."""
    cls = type(module)
    return cls.__bases__[0] if torch.nn.utils.parametrize.is_parametrized(module) else cls


@contextlib.contextmanager
def _without_fastpath(*values: Any) -> Iterator[None]:
    """Under torch.vmap every tensor reads ``requires_grad == False``, so torch's attention layers
    (``nn.MultiheadAttention`` in ``nn.TransformerDecoderLayer``, ...) in eval mode would take their
    inference fast path, which has no backward, where a model alone trains through the slow path:
    the fast path is off for the call wherever autograd records it."""
    grad = torch.is_grad_enabled() and torch.backends.mha.get_fastpath_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(values)[0])
    if not grad:
        yield
        return
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


_TENSOR_REQUIRES_GRAD = torch._C.TensorBase.requires_grad


def _unwrapped_requires_grad(t: torch.Tensor) -> bool:
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return _TENSOR_REQUIRES_GRAD.__get__(t)


# `requires_grad` answered, for a tensor batched by torch.vmap, by the tensor it batches: the
# models' tensors, whose autograd records what each model's would.
_PER_MODEL_REQUIRES_GRAD = property(_unwrapped_requires_grad, _TENSOR_REQUIRES_GRAD.__set__)
_REQUIRES_GRAD_LOCK = threading.Lock()
_requires_grad_depth = 0
_OWN_REQUIRES_GRAD = vars(torch.Tensor).get("requires_grad")  # None: TensorBase's, inherited


@contextlib.contextmanager
def _requires_grad_per_model() -> Iterator[None]:
    """A module's code under torch.vmap reads ``x.requires_grad`` as each model alone would
    (``y * 2 if y.requires_grad else y``): torch.vmap's batched tensors read False whatever
    autograd records. ``torch.Tensor.requires_grad`` is that reading for the call (in eager mode;
    a compiler traces the call as it is)."""
    global _requires_grad_depth
    if torch.compiler.is_compiling():
        yield
        return
    with _REQUIRES_GRAD_LOCK:
        if not _requires_grad_depth:
            torch.Tensor.requires_grad = _PER_MODEL_REQUIRES_GRAD
        _requires_grad_depth += 1
    try:
        yield
    finally:
        with _REQUIRES_GRAD_LOCK:
            _requires_grad_depth -= 1
            if not _requires_grad_depth:
                if _OWN_REQUIRES_GRAD is None:
                    del torch.Tensor.requires_grad
                else:
                    torch.Tensor.requires_grad = _OWN_REQUIRES_GRAD


class ModuleVmapError(FuseError, RuntimeError):
    """A leaf module that the fused forward runs under torch.vmap and that torch.vmap cannot run (the
    message names ``loop_modules``): a :class:`FuseError`, as a functional call that vmap cannot run
    raises, and a RuntimeError, as this error was before."""


class _ModuleCall(_capture.GraphTarget):
    """A leaf module without an array version, run per model over its stacked parameters.

    ``strategy`` "vmap" runs the module's forward once under torch.vmap; "loop"
    runs it B times, model b with its own parameters, buffers and inputs, and
    stacks the outputs (any Python code, including data-dependent branches).
    Buffers updated in place land in the stacked buffers; buffers the forward
    rebinds are stacked and rebound. Python attributes the forward changes live
    on the module's code copy: one for the vmapped call (every model runs the
    same Python code once per call), one per model in the loop.
    """

    def __init__(self, template: nn.Module, marks: Any, strategy: str, label: str, B: int):
        self.template = template  # a meta-device copy: only its code and configuration are used
        self.templates = [template] + [copy.deepcopy(template) for _ in range(B - 1 if strategy == "loop" else 0)]
        self.marks = marks
        self.strategy = strategy
        self._named(label)

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        for template in self.templates:
            for mine, theirs in zip(template.modules(), module.modules()):
                mine.training = theirs.training  # the template's code reads the live modes
        state = dict(module.named_parameters(remove_duplicate=False))
        state.update(module.named_buffers(remove_duplicate=False))
        dims = _in_dims(self.marks, (args, kwargs))
        if self.strategy == "loop":
            return self._loop(module, state, dims, args, kwargs)

        def per_model(s, *a, **k):
            with _reparametrized(self.template, s) as rebound:
                out = self.template(*a, **k)
            return out, rebound

        state_dims = {k: 0 for k in state}
        arg_dims, kwarg_dims = dims
        try:
            with _without_fastpath(state, args, kwargs), _requires_grad_per_model():
                out, rebound = _vmap_call(per_model, ((state_dims, *arg_dims), kwarg_dims), (state, *args), kwargs,
                                          who=lambda: f"the {_module_class(self.template).__name__} module, run "
                                                      "per model under torch.vmap,")
        except RuntimeError as e:
            if "atching rule" not in str(e) and "vmap" not in str(e):
                raise
            cls = _own_class(self.template)
            raise ModuleVmapError(
                f"fused forward: the {_module_class(self.template).__name__} module runs under torch.vmap "
                f"(for the B models at once), which cannot run its code: {str(e).strip().splitlines()[0]} "
                f"Name its class in hfkern.fuse(..., loop_modules=({cls.__name__},)) to run it once per "
                "model") from e
        _rebind(module, rebound)
        return out

    def _loop(self, module: nn.Module, state: dict, dims: Any, args: tuple, kwargs: dict) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        flat_dims = _broadcast_to_and_flatten(dims, spec)
        outs, rebinds, slices = [], [], []
        for b, template in enumerate(self.templates):
            mine = [v[b] if d is not None else v for v, d in zip(leaves, flat_dims)]
            slices.append(mine)
            a, k = tree_unflatten(mine, spec)
            # Buffers are passed as views of model b's slice: in-place updates
            # (running statistics) land in the stacked buffer.
            with _reparametrized(template, {n: t[b] for n, t in state.items()}) as rebound:
                outs.append(template(*a, **k))
            rebinds.append(rebound)
        names = {n for r in rebinds for n in r}
        _rebind(module, {n: torch.stack([r.get(n, state[n][b]) for b, r in enumerate(rebinds)]) for n in names})
        flat = [_flat_fields(o) for o in outs]  # (a dataclass's tensors too)
        _, spec, opened = flat[0]
        _check_per_model_leaves(flat[0][0], lambda: f"the {_module_class(self.template).__name__} module, run once "
                                                    "per model (loop_modules),")
        stacked = [self._array_of(vs, slices, leaves, flat_dims) if isinstance(vs[0], torch.Tensor) else vs[0]
                   for vs in zip(*(f[0] for f in flat))]
        return _unflat_fields(stacked, spec, opened)

    # Whether the fused forward writes in place, after this call, into memory its result may share
    # with its inputs (set by the rewrite): a stacked copy of views of the inputs would lose that.
    aliased = False

    def _array_of(self, parts: Sequence[torch.Tensor], slices: list[list], leaves: list, dims: list) -> torch.Tensor:
        """The models' results as one array (:func:`_stacked_or_input`); where a later in-place write
        could tell, results that are other views of the inputs (which a stacked copy is not) raise."""
        array = _stacked_or_input(parts, slices, leaves, dims)
        if self.aliased and not any(array is v for v in leaves) and any(
                isinstance(x, torch.Tensor) and d is not None and _shares_memory(p, x)
                for p, mine in zip(parts, slices) for x, d in zip(mine, dims)):
            cls = _module_class(self.template)
            raise FuseError(
                f"fused forward: the {cls.__name__} module, run once per model (loop_modules), returns a view of "
                "its input (a slice, a reshape, a transpose), and the forward writes in place through that result "
                "or into the input later; the fused model stacks the B models' results into memory of its own, "
                "where those writes would not reach the other tensor. Return a tensor of its own (`.clone()`) "
                "or the input itself")
        return array


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return "missing" if value is None else type(value).__name__


def _share(value: Any, B: int) -> Any:
    """A tensor that is not an array value, as the B models' shared input of an array module."""
    return broadcast(value, B) if isinstance(value, torch.Tensor) else value


# Positional arguments of an array module that are its data (shared when they
# are not array values); other tensor arguments (masks) are passed as they are.
_DATA_ARGS: dict[str, tuple[int, ...]] = {"MultiheadAttention": (0, 1, 2)}

# Mask arguments of array modules: name -> (position, kind), and the name of the data argument (at
# position 0) whose rank says which mask ranks torch takes. Attention masks: torch's 3-D mask
# ``[N*num_heads, L, S]`` and B stacked ``[L, S]`` masks ``[B, L, S]`` look alike where
# B == N*num_heads, which the module refuses as ambiguous. The fused graph knows which one a mask is
# (an array value or not): the module gets the explicit 4-D spelling (_explicit_attn_mask). Key
# padding masks: their shared and per-model forms differ in rank. Both: a mask of a rank torch
# refuses (a 1-D attention mask, a 1-D key padding mask with batched inputs) is refused here, where
# one per model could otherwise pass for a shared mask of a valid rank (B stacked [S] masks read as
# one [L, S] mask where B == L, or as one [N, S] key padding mask where B == N).
_MASK_ARGS: dict[str, dict[str, tuple[int, str]]] = {
    "MultiheadAttention": {"key_padding_mask": (3, "key_padding"), "attn_mask": (5, "attn")},
    "TransformerEncoderLayer": {"src_mask": (1, "attn"), "src_key_padding_mask": (2, "key_padding")},
    "TransformerEncoder": {"mask": (1, "attn"), "src_key_padding_mask": (2, "key_padding")},
}
_DATA_NAMES = {"MultiheadAttention": "query", "TransformerEncoderLayer": "src", "TransformerEncoder": "src"}


class _ExplicitMask(_capture.GraphTarget):
    """A mask argument of an array attention module in the fused graph, checked as torch checks the
    models' masks and given in the form the module cannot misread (:func:`_explicit_attn_mask`).

    Called with the mask, whether it is an array value (one per model), and the module's data
    argument (query or src, ``[B, ...]`` in the fused graph) or None. A model's mask is the value
    without its leading B where it is one per model, the value itself where it is shared; its rank
    must be one torch takes with a model's data (query ``[L, N, E]`` or unbatched ``[L, E]``):
    attention masks 2-D or 3-D, key padding masks 2-D (batched) or 1-D (unbatched). Other ranks
    raise ValueError naming the mask, its shape per model and what torch takes (torch raises
    AssertionError there)."""

    def __init__(self, module: str, name: str, kind: str, data_name: str):
        self.module, self.name, self.kind, self.data_name = module, name, kind, data_name
        self._named(f"explicit_{name}")

    def __call__(self, mask: Any, per_model: bool, data: Any = None) -> Any:
        if not isinstance(mask, torch.Tensor):
            return mask
        model_shape = list(mask.shape[1:] if per_model else mask.shape)
        if isinstance(data, torch.Tensor) and data.dim() in (3, 4):
            batched = data.dim() == 4  # [B, L, N, E] or [B, L, E]: a model's query is 3-D or 2-D
            if self.kind == "attn":
                ranks, takes = (2, 3), "None, 2-D or 3-D"
            else:
                ranks, takes = ((2,), "None or 2-D [N, S]") if batched else ((1,), "None or 1-D [S]")
            if len(model_shape) not in ranks:
                given = (f"one {len(model_shape)}-D mask {model_shape} per model (an array value "
                         f"{list(mask.shape)})" if per_model else
                         f"a {len(model_shape)}-D mask {model_shape} shared by the models")
                raise ValueError(
                    f"{self.module} (fused): for {'batched' if batched else 'unbatched'} "
                    f"({data.dim() - 1}-D) {self.data_name} per model, torch expects each model's "
                    f"{self.name} to be {takes}, got {given}"
                )
        return _explicit_attn_mask(mask, per_model) if self.kind == "attn" else mask


def _explicit_attn_mask(mask: Any, per_model: bool) -> Any:
    """An attention mask as its unambiguous 4-D form for an array attention module: one per model
    (an array value), ``[B, L, S]`` -> ``[B, 1, L, S]`` (``[B, N*num_heads, L, S]`` is one already);
    the same for every model, ``[N*num_heads, L, S]`` -> ``[1, N*num_heads, L, S]``, and a rank torch
    does not accept (4-D) with a leading 1, so that the module refuses it as torch does rather than
    reading it as one mask per model. Other masks (``[L, S]``, None) as they are."""
    if not isinstance(mask, torch.Tensor):
        return mask
    if per_model:
        return mask.unsqueeze(1) if mask.dim() == 3 else mask
    return mask.unsqueeze(0) if mask.dim() in (3, 4) else mask


# ---- a norm and its activation as one call ---------------------------------------------
# A batch norm or layer norm leaf whose output goes only into a ReLU or an exact GELU
# runs as one array op with the activation fused (hfkern.ops: the activation's own
# pass over the tensor, forward and backward, disappears). Same semantics: the ops
# compute act(norm(x)) as the two calls do, up to the rounding of the norm output.

_NORM_CLASSES = (_ArrayBatchNorm, _ArrayLayerNorm)
_ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu}
_RELU_FUNCTIONS = (F.relu, torch.relu, torch.relu_)  # F.relu_ is torch.relu_
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


_GLOBAL_HOOKS = tuple("_global" + h for h in _HOOKS)


def _hooked(module: nn.Module | None) -> bool:
    """Whether a call of ``module`` runs hooks (its own or global ones), which would see the
    norm's output or its gradient. (Asked per call: read from the dicts directly.)"""
    if module is None:
        return False
    own, registry = module.__dict__, vars(nn.modules.module)
    for h in _HOOKS:
        if own.get(h):
            return True
    for h in _GLOBAL_HOOKS:
        if registry.get(h):
            return True
    return False


def _activation_of(node: fx.Node, norm: fx.Node, model: nn.Module) -> str | None:
    """"relu" or "gelu" if ``node`` applies that activation (exact GELU) to ``norm`` and
    nothing else (F.relu, torch.relu, Tensor.relu, nn.ReLU, in place or not; F.gelu,
    nn.GELU), else None."""
    if not node.args or node.args[0] is not norm:
        return None
    rest, kwargs = node.args[1:], dict(node.kwargs)
    if any(isinstance(a, fx.Node) for a in (*rest, *kwargs.values())):
        return None
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS:
        extra = (1 if node.target is F.relu else 0)  # F.relu(input, inplace)
        return "relu" if len(rest) <= extra and set(kwargs) <= {"inplace"} else None
    if node.op == "call_function" and node.target is F.gelu:
        approximate = kwargs.get("approximate", rest[0] if rest else "none")
        return "gelu" if len(rest) <= 1 and set(kwargs) <= {"approximate"} and approximate == "none" else None
    if node.op == "call_method" and node.target in ("relu", "relu_"):
        return "relu" if not rest and not kwargs else None
    if node.op == "call_module" and not rest and not kwargs:
        module = model.get_submodule(node.target)
        if _hooked(module):
            return None
        if type(module) is nn.ReLU:
            return "relu"
        if type(module) is nn.GELU and module.approximate == "none":
            return "gelu"
    return None


def _norm_activations(graph: fx.Graph, model: nn.Module, leaves: dict[str, nn.Module],
                      array_classes: dict) -> dict[fx.Node, tuple[str, fx.Node]]:
    """norm node -> (activation, activation node) for every norm leaf call that can run
    with its activation fused: a BatchNorm/LayerNorm leaf called on one input, whose
    output's only user is a ReLU or exact GELU of it, in the same grad and autocast
    mode (no region entered or left between them), no hooks on either module."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    mode_changes = [order[n] for n in graph.nodes if _capture.changes_mode(n)]
    found = {}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in leaves:
            continue
        module = leaves[node.target]
        if not issubclass(array_classes.get(type(module), type(None)), _NORM_CLASSES):
            continue
        if len(node.args) != 1 or not isinstance(node.args[0], fx.Node) or node.kwargs or _hooked(module):
            continue
        if len(node.users) != 1:
            continue
        (user,) = node.users
        activation = _activation_of(user, node, model)
        if activation is None or any(order[node] < i < order[user] for i in mode_changes):
            continue
        found[node] = (activation, user)
    return found


class _NormActivation(_capture.GraphTarget):
    """A norm leaf and the activation on its output, as one call of the array norm with the
    activation fused. ``act_module``: the activation's module where the model calls one."""

    def __init__(self, activation: str):
        self.activation = activation
        self._named(f"norm_{activation}")

    def __call__(self, norm: nn.Module, x: torch.Tensor, act_module: nn.Module | None = None) -> Any:
        if norm.activation == "none" and not _hooked(norm) and not _hooked(act_module) \
                and self._kernel_serves(norm, x):
            return norm._normalize(x, self.activation)
        # Something observes the norm's output (hooks added since), the norm already has an
        # activation of its own, or the torch path serves it: the two calls, as the model
        # makes them.
        y = norm(x)
        return act_module(y) if act_module is not None else _ACTIVATION_FUNCTIONS[self.activation](y)

    @staticmethod
    def _kernel_serves(norm: nn.Module, x: torch.Tensor) -> bool:
        """Whether a kernel backend (not the torch path) would serve the norm. Only kernels
        save by the fusion: the torch path's fused backward recomputes z from x in several
        passes, where torch's own ReLU backward reads the saved output once (measured on the
        CPU: a fused ResNet-18 step spent 9 ms in that recomputation's ``where``)."""
        if torch.compiler.is_compiling():
            # The compiler fuses the pair itself, and the selection (a ContextVar) cannot be
            # traced: the fused op, which the compiled graph dispatches on the selected backend.
            return True
        op = "array_batch_norm" if isinstance(norm, _ArrayBatchNorm) else "array_layer_norm"
        return _backend.current(op, x.device, x.dtype) != "torch"


# ---- a convolution and the batch norm on its output as one call -----------------------
# On the torch path in eager mode, a convolution leaf whose output goes only into a batch
# norm leaf (in training) runs both on the grouped view [N, B*C, *S]: torch's grouped
# convolution, then torch's batch norm on its result, one array view made at the end.
# The same kernels on the same memory as the two calls: what is saved is the array view
# between them (its autograd nodes both ways) and a module call's checks.

def _conv_norms(graph: fx.Graph, leaves: dict[str, nn.Module], array_classes: dict) -> dict[fx.Node, fx.Node]:
    """batch-norm node -> convolution node for every batch-norm leaf called on one input, the
    output of a convolution leaf called on one input that nothing else reads, in the same
    grad and autocast mode, no hooks on either, both in the same top-level block (what
    :func:`hfkern.plan` recomputes is a top-level block)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    mode_changes = [order[n] for n in graph.nodes if _capture.changes_mode(n)]

    def single_call(node: fx.Node, base: type) -> bool:
        module = leaves.get(node.target) if node.op == "call_module" else None
        return (module is not None and issubclass(array_classes.get(type(module), type(None)), base)
                and len(node.args) == 1 and isinstance(node.args[0], fx.Node) and not node.kwargs
                and not _hooked(module))

    found = {}
    for node in graph.nodes:
        if not single_call(node, _ArrayBatchNorm):
            continue
        conv = node.args[0]
        if (single_call(conv, _ArrayConvNd) and len(conv.users) == 1
                and conv.target.split(".")[0] == node.target.split(".")[0]
                and not any(order[conv] < i < order[node] for i in mode_changes)):
            found[node] = conv
    return found


class _ConvNorm(_capture.GraphTarget):
    """A convolution leaf, the batch norm on its output and (``activation``, when the norm's
    output only goes into one) the activation on that, as one call: on the grouped view where
    the torch path serves both in eager mode, else the calls the model makes.

    ``grouped_in`` / ``grouped_out`` (set by :func:`_group_regions`): the input comes, and the
    output goes, in the array's grouped form ``[N, B*C, *S]`` (a value of a grouped region);
    the calls that run on arrays take the input's array view and give their output's grouped
    view."""

    grouped_in = False
    grouped_out = False

    def __init__(self, activation: str | None):
        self.activation = activation
        self._fused = "relu" if activation == "relu" else "none"  # what the norm's own op applies
        self._norm_activation = _NormActivation(activation) if activation else None
        self._named(f"conv_norm_{activation}" if activation else "conv_norm")
        # The metadata (_signature) of the last call that took the grouped path: a call of
        # the same metadata takes it again without the checks, which cost a few tens of
        # microseconds of host time per call, as much as the two torch calls themselves;
        # with the convolution that call decided on (GroupedConvCall), where it is one.
        self._served: tuple | None = None
        self._conv_call: GroupedConvCall | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a copy or a loaded model checks its first call
        return {**self.__dict__, "_served": None, "_conv_call": None}

    def __call__(self, conv: nn.Module, norm: nn.Module, x: torch.Tensor, act_module: nn.Module | None = None) -> Any:
        # something observes the calls (hooks added since): the calls themselves
        observed = _hooked(conv) or _hooked(norm) or _hooked(act_module) or norm.activation != "none"
        signature = None if observed else _signature(conv, norm, x)
        checked = signature is not None and signature == self._served
        call = self._conv_call if checked else None
        if call is not None:  # the same metadata as a call served before: a training loop's steady state
            yg = call(x, conv.weight, conv.bias, grouped=self.grouped_in)
            z = norm._normalize_grouped(yg, conv.B, call.fmt, self._fused, checked=True, grouped=self.grouped_out)
            return self._activated(z, act_module)
        if self.grouped_in:
            x = array_of_grouped(x, conv.B)
        y, grouped = self._calls(conv, norm, x, act_module, observed, signature, checked)
        if not self.grouped_out or grouped:
            return y
        # The calls' array as grouped: a tensor of its own where it is the norm's output with
        # no activation and no hooks (no backward node saves it), for in-place calls after it.
        return to_grouped(y) if observed or self.activation else fresh_grouped(y)

    def _calls(self, conv: nn.Module, norm: nn.Module, x: torch.Tensor, act_module: nn.Module | None,
               observed: bool, signature: tuple | None, checked: bool) -> tuple[Any, bool]:
        """The call on the array ``x``: on the grouped view where it is served (the output
        grouped with ``grouped_out``, as the steady state gives it: a recomputation saves
        what the forward saved), else the calls. Returns (output, whether it is grouped)."""
        if observed:
            y = conv(x)
        else:
            grouped = conv._grouped_output(x, checked=checked)
            if grouped is None:
                y = conv(x)
            else:
                yg, fmt = grouped
                z = norm._normalize_grouped(yg, conv.B, fmt, self._fused, checked=checked, grouped=self.grouped_out)
                if z is not None:
                    self._served = signature
                    self._conv_call = conv._grouped_call(x) if signature is not None else None
                    return self._activated(z, act_module), self.grouped_out
                y = fresh_array(yg, conv.B, fmt)  # what conv(x) gives on this path
        if self._norm_activation is None:
            return norm(y), False
        return self._norm_activation(norm, y, act_module), False

    def _activated(self, z: torch.Tensor, act_module: nn.Module | None) -> Any:
        """The norm's output ``z`` (its op applied ``self._fused``) after the activation."""
        if self.activation is None or self._fused == self.activation:
            return z
        return act_module(z) if act_module is not None else _ACTIVATION_FUNCTIONS[self.activation](z)


# ---- grouped regions ------------------------------------------------------------------
# Between the convolution + batch norm calls of a network like ResNet, values pass through
# activations and residual adds only. There they stay in the grouped form [N, B*C, *S] that
# the convolutions and norms compute in, rather than becoming array views [B, N, C, *S] after
# every call and grouped views again before the next one: two view ops each way per call and
# their autograd nodes. A value becomes its array view where anything else reads it.

# Elementwise calls that run on grouped values as they are, when all their tensor arguments are
# grouped values of one shape (then each element is the same model's, channel's and position's
# in all of them). Not: random draws (dropout: another order of the numbers than the arrays'),
# and methods whose result's memory layout a later call may rely on (contiguous, to).
_GROUPED_FUNCTIONS = _ELEMENTWISE_FUNCTIONS - {F.dropout, F.alpha_dropout}
_GROUPED_METHODS = _ELEMENTWISE_METHODS - {"contiguous", "to"}


class _GroupedCall(_capture.GraphTarget):
    """An elementwise call inside a grouped region: ``inner`` (an :class:`_ArrayCall`, or with
    ``module`` the module given as the first argument) on grouped values, where all of them
    have one shape (and the module runs no hooks); else on their array views, the result
    given as its grouped form."""

    def __init__(self, inner: Any, B: int, label: str, module: bool = False):
        self.inner, self.B, self.module = inner, B, module
        self._named(f"grouped_{label}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module:
            module, args = args[0], args[1:]
            if not _hooked(module) and _one_shape(args, kwargs):
                return module.forward(*args, **kwargs)
            fn = module
        else:
            if _one_shape(args, kwargs):
                return self.inner._call(args, kwargs)
            fn = self.inner
        B = self.B
        arrays = tree_map(lambda v: array_of_grouped(v, B) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        return to_grouped(fn(*arrays[0], **arrays[1]))


def _one_shape(args: tuple, kwargs: dict) -> bool:
    """Whether the tensors among ``args`` and ``kwargs`` (grouped values) all have one shape."""
    shape = None
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            if shape is None:
                shape = v.shape
            elif v.shape != shape:
                return False
        elif isinstance(v, (list, tuple, dict)):
            return False  # (not produced for grouped values: their tensors are direct arguments)
    return True


def _elementwise_node(node: fx.Node, model: nn.Module) -> bool:
    """Whether ``node`` of the rewritten graph is an elementwise call :class:`_GroupedCall` can
    run on grouped values: an elementwise module's call, or an elementwise function or method
    call, with tensors only as direct arguments."""
    direct = all(not isinstance(a, (list, tuple, dict)) for a in (*node.args, *node.kwargs.values()))
    if node.op == "call_module":
        module = model.get_submodule(node.target)
        return direct and type(module) in _ELEMENTWISE_MODULES
    if node.op != "call_function" or not isinstance(node.target, _ArrayCall):
        return False
    call = node.target
    known = call.method in _GROUPED_METHODS if call.method is not None else call.fn in _GROUPED_FUNCTIONS
    return direct and known


def _group_regions(graph: fx.Graph, model: nn.Module, B: int, array_classes: dict) -> None:
    """Rewrite ``graph`` (the fusion's, in place) so that values pass between convolution +
    batch norm calls (:class:`_ConvNorm`) and the elementwise calls between them in grouped
    form: each such call's output is grouped where a call that takes grouped values reads
    it, an elementwise call whose inputs are grouped runs on them (:class:`_GroupedCall`),
    and every other reader gets the array view. An elementwise call may also read the output
    of a norm or convolution leaf (a residual path's), which then gets a grouped view."""
    nodes = list(graph.nodes)

    def leaf_class(n: fx.Node) -> type:
        if n.op != "call_module":
            return type(None)
        return array_classes.get(type(model.get_submodule(n.target)), type(None))

    producers = {n for n in nodes if n.op == "call_function" and isinstance(n.target, _ConvNorm)
                 and n.target.activation in (None, "relu")}
    convertible = {n for n in nodes if (n.op == "call_function" and isinstance(n.target, _NormActivation))
                   or issubclass(leaf_class(n), (_ArrayConvNd, _ArrayBatchNorm))}
    elementwise = {n for n in nodes if _elementwise_node(n, model)}

    def reads_grouped(user: fx.Node, value: fx.Node) -> bool:
        return (user in grouped and user in elementwise) or (
            isinstance(user.target, _ConvNorm) and user.args[2] is value)

    # Every producer grouped at first; one whose value no grouped call reads is not; repeat.
    grouped = set(producers)
    while True:
        for n in nodes:
            if n in elementwise:
                inputs = n.all_input_nodes
                member = any(i in grouped for i in inputs) and all(i in grouped or i in convertible for i in inputs)
                (grouped.add if member else grouped.discard)(n)
        idle = {n for n in grouped & producers if not any(reads_grouped(u, n) for u in n.users)}
        if not idle:
            break
        grouped -= idle
    # The leaves' outputs that grouped elementwise calls read: their grouped views, for every
    # call that takes grouped values.
    for n in nodes:
        if n in convertible and any(u in grouped and u in elementwise for u in n.users):
            readers = [u for u in n.users if reads_grouped(u, n)]
            with graph.inserting_after(n):
                view = graph.call_function(to_grouped, (n,))
            view.meta.update(n.meta)
            for u in readers:
                u.replace_input_with(n, view)
            grouped.add(view)
    for n in nodes:
        if isinstance(n.target, _ConvNorm):
            n.target.grouped_in = n.args[2] in grouped
            n.target.grouped_out = n in grouped
    for n in list(graph.nodes):
        if n not in grouped:
            continue
        readers = [u for u in n.users if not reads_grouped(u, n)]
        if readers:  # the array view, for everything else that reads the value
            with graph.inserting_after(n):
                view = graph.call_function(array_of_grouped, (n, B))
            view.meta.update(n.meta)
            for u in readers:
                u.replace_input_with(n, view)
        if n in elementwise:
            if n.op == "call_module":
                with graph.inserting_before(n):
                    owner = graph.get_attr(n.target)
                    call = graph.call_function(_GroupedCall(None, B, n.target.replace(".", "_"), module=True),
                                               (owner, *n.args), dict(n.kwargs))
                call.meta.update(n.meta)
                owner.meta.update(n.meta)
                n.replace_all_uses_with(call)
                graph.erase_node(n)
            else:
                n.target = _GroupedCall(n.target, B, n.target.__name__)


_CONV_CONFIG = ("B", "in_channels", "out_channels", "stride", "padding", "dilation", "groups", "padding_mode",
                "output_padding", "_reversed_padding_repeated_twice", "memory_format")
_NORM_CONFIG = ("B", "num_features", "training", "track_running_stats", "momentum", "eps", "activation")


_UNSEEN = object()  # a module tensor the signature cannot read where it lies (a parametrization's)


def _meta(module_dict: dict, name: str) -> Any:
    """The metadata of a module's parameter or buffer ``name``, read from the module's dicts
    (no ``Module.__getattr__``); ``_UNSEEN`` where it is neither (a parametrized weight,
    computed at every access)."""
    for where in ("_parameters", "_buffers"):
        tensors = module_dict[where]
        if name in tensors:
            t = tensors[name]
            return None if t is None else (type(t), t.shape, t.dtype, t.device, t.layout)
    return _UNSEEN


def _signature(conv: nn.Module, norm: nn.Module, x: Any) -> tuple | None:
    """Everything whether :class:`_ConvNorm`'s grouped path serves a call depends on, and
    what its checks read: the input's metadata (strides included), both modules'
    configuration and their tensors' metadata, the backend selection and the autocast
    state; None where a call must be checked whatever came before (a compiler tracing
    it, an input that is not a tensor)."""
    if type(x) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    c, n = conv.__dict__, norm.__dict__
    tensors = (_meta(c, "weight"), _meta(c, "bias"), _meta(n, "weight"), _meta(n, "bias"),
               _meta(n, "running_mean"), _meta(n, "running_var"), _meta(n, "num_batches_tracked"))
    if _UNSEEN in tensors:
        return None
    return (x.shape, x.stride(), x.dtype, x.device, autocast, _backend.get_backend(), _backend._eager_paths,
            _backend.generation, type(conv), type(norm), *(c.get(k) for k in _CONV_CONFIG),
            *(n.get(k) for k in _NORM_CONFIG), *tensors)


# ---- the fused model -----------------------------------------------------------------
def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (root.get_submodule(head) if head else root), name


def _post_order(root: nn.Module) -> list[nn.Module]:
    """``root.modules()`` with every module after its submodules."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        out.append(module)

    visit(root)
    return out


def _put_everywhere(root: nn.Module, path: str, new: nn.Module) -> list[str]:
    """Put ``new`` where ``root`` has the module at ``path``, under every name that module has
    there (``self.seq = nn.Sequential(self.fc)`` registers one module twice); the names."""
    old = root.get_submodule(path)
    names = [p for p, m in root.named_modules(remove_duplicate=False) if m is old]
    for name in names:
        owner, attr = _parent(root, name)
        setattr(owner, attr, new)
    return names


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = list(model.named_parameters(remove_duplicate=False))
    out += list(model.named_buffers(remove_duplicate=False))
    return out


def _is_plain(v: Any) -> bool:
    if isinstance(v, (int, float, str, bool, type(None))):
        return True
    if isinstance(v, (tuple, list)):
        return all(_is_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, (int, str)) and _is_plain(x) for k, x in v.items())
    return False


def _config_attributes(module: nn.Module, added_only: bool = False) -> dict[str, Any]:
    """A module's own configuration values that forward may read (numbers, strings, functions,
    enum members, config objects, containers of them, ...): the captured code holds model 0's.
    Names starting with ``_`` included (``self._scale``), except the bookkeeping of torch's own
    classes (:func:`_torch_names`: hook tables, ``_reversed_padding_repeated_twice``, ...).
    ``added_only``: only attributes that torch's code for the module's class does not set (a
    layer that becomes an array module keeps its torch configuration per model, but not an
    attribute its user added, ``self.fc.scale = s``, which forward reads as model 0's).
    Not its tensors held directly, which are checked where forward reads or assigns them."""
    torch_names = _torch_names(type(module))
    return {k: v for k, v in vars(module).items()
            if k != "training" and not isinstance(v, torch.Tensor)
            and not (k in torch_names and (added_only or k.startswith("_")))}


_MODULE_NAMES = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping (hook tables, ...)
_torch_names_of: dict[type, frozenset[str]] = {}


def _torch_names(cls: type) -> frozenset[str]:
    """The attribute names torch's own code for ``cls`` uses: every name in the methods and class
    attributes of the classes in its MRO that torch defines (``nn.Linear``'s ``in_features``,
    ``_ConvNd``'s ``_reversed_padding_repeated_twice``, ``nn.Module``'s hook tables), as opposed
    to attributes a model's own code gives a module. Cached per class."""
    found = _torch_names_of.get(cls)
    if found is not None:
        return found
    names = set(_MODULE_NAMES)
    for c in cls.__mro__:
        module = getattr(c, "__module__", None) or ""
        if c is not object and (module == "torch" or module.startswith("torch.")):
            names |= _torch_class_names(c)
    if len(_torch_names_of) > 4096:  # (a parametrized module's class is made per module: keep it bounded)
        _torch_names_of.clear()
    found = _torch_names_of[cls] = frozenset(names)
    return found


_torch_class_names_of: dict[type, frozenset[str]] = {}


def _torch_class_names(c: type) -> frozenset[str]:
    """The names one torch class's own dict and code use (see :func:`_torch_names`)."""
    found = _torch_class_names_of.get(c)
    if found is None:
        names = set()
        for name, value in vars(c).items():
            names.add(name)
            for fn in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                       getattr(value, "fset", None), getattr(value, "fdel", None)):
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    names |= _code_names(code)
        if len(_torch_class_names_of) > 4096:
            _torch_class_names_of.clear()
        found = _torch_class_names_of[c] = frozenset(names)
    return found


def _code_names(code: types.CodeType) -> set[str]:
    """The attribute and global names a code object (and the code nested in it) uses, and its
    string constants that are identifiers (``setattr(self, "_name", ...)``)."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
        elif isinstance(c, str) and c.isidentifier():
            names.add(c)
    return names


def _registered(model: nn.Module) -> dict[int, str]:
    """``id`` -> name of every parameter, buffer and module registered in ``model``."""
    names = {id(t): n for n, t in reversed(_named_tensors(model))}
    names.update((id(m), p) for p, m in reversed(list(model.named_modules(remove_duplicate=False))))
    return names


def _same_value(a: Any, b: Any, names: tuple[dict[int, str], dict[int, str]] = ({}, {}),
                seen: set[tuple[int, int]] | None = None) -> bool:
    """Whether two models' values (of an attribute, or two hooks) are the same for code that reads
    them: functions by their code, defaults and closure values (two models' lambdas of one
    ``__init__`` are the same), partials by function, arguments and keywords, containers item by
    item, dataclasses, namespaces and other objects by their fields, tensors by their values,
    anything else by ``==``. A model's own parameters, buffers and modules (``names``: each model's
    :func:`_registered`) are the same where they are registered under the same name; other
    modules where they are of one class."""
    if a is b:
        return True
    seen = set() if seen is None else seen
    pair = (id(a), id(b))
    if pair in seen:
        return True  # a cycle: what it holds is compared where it was first met
    seen.add(pair)
    if type(a) is not type(b):
        return False
    same = lambda x, y: _same_value(x, y, names, seen)  # noqa: E731
    if id(a) in names[0] or id(b) in names[1]:
        return names[0].get(id(a)) == names[1].get(id(b))
    if isinstance(a, nn.Module):
        return _module_class(a) == _module_class(b)
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and (
            "meta" in (a.device.type, b.device.type) or _same_tensor_values(a, b.to(a.device)))
    if isinstance(a, float):
        return _same_float(a, b)
    if isinstance(a, complex):
        return _same_float(a.real, b.real) and _same_float(a.imag, b.imag)
    if isinstance(a, torch.Generator):  # each model's own, seeded alike
        return a.device == b.device and bool(torch.equal(a.get_state(), b.get_state()))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, partial):
        return same(a.func, b.func) and same(a.args, b.args) and same(a.keywords, b.keywords)
    if isinstance(a, types.MethodType):
        return same(a.__func__, b.__func__) and same(a.__self__, b.__self__)
    if isinstance(a, types.FunctionType):
        cells = lambda f: [_cell_value(c) for c in f.__closure__ or ()]  # noqa: E731
        return (a.__code__ == b.__code__ and a.__globals__ is b.__globals__
                and same(a.__defaults__, b.__defaults__) and same(a.__kwdefaults__, b.__kwdefaults__)
                and same(cells(a), cells(b)))
    if isinstance(a, (type, types.ModuleType)):
        return False
    if type(a).__module__ == "numpy" and hasattr(a, "shape") and getattr(a, "ndim", 0):
        return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())
    fields = _fields(a)
    if fields is not None and (dataclasses.is_dataclass(a) or isinstance(a, types.SimpleNamespace)
                               or type(a).__eq__ is object.__eq__):
        other = _fields(b)
        return other is not None and same(fields, other)
    try:
        result = a == b
        return bool(result) if not hasattr(result, "all") else bool(result.all())
    except Exception:  # noqa: BLE001 - an equality that cannot answer: compare the fields
        other = _fields(b)
        return fields is not None and other is not None and same(fields, other)


def _same_float(a: float, b: float) -> bool:
    """Two floats are the same value for code that reads them: 0.0 and -0.0 differ (``copysign``,
    ``1 / x``, ``atan2`` tell them apart), NaN is NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _same_tensor_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape, dtype and device hold the same values as
    :func:`_same_float` compares floats (signed zeros differ, NaN is NaN)."""
    if not (a.is_floating_point() or a.is_complex()) or a.layout != torch.strided:
        return bool(torch.equal(a, b))
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    if torch.equal(a, b) and bool(torch.equal(a.signbit(), b.signbit())):
        return True
    same = (a == b) & (a.signbit() == b.signbit())
    return bool((same | (a.isnan() & b.isnan())).all())


_EMPTY_CELL = object()


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return _EMPTY_CELL


def _fields(v: Any) -> dict[str, Any] | None:
    """An object's fields (its ``__dict__`` and ``__slots__``), or None where it has neither."""
    out = dict(vars(v)) if hasattr(v, "__dict__") else None
    slots = [n for cls in type(v).__mro__ for n in getattr(cls, "__slots__", ()) if isinstance(n, str)]
    if slots:
        out = out or {}
        for n in slots:
            if n not in ("__dict__", "__weakref__") and hasattr(v, n):
                out[n] = getattr(v, n)
    return out


def _shown(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor ({_describe(v)})"
    text = repr(v)
    return text if len(text) <= 100 else text[:97] + "..."


class FusedModel(ArrayModule):
    """B torch models of one architecture fused into one array model (see :mod:`hfkern.fusion`).

    Made by :func:`fuse`. ``forward`` takes the original model's arguments with
    every tensor as ``[B, *per-model shape]`` (or shared via
    :func:`hfkern.broadcast`) and returns the original outputs with B first. A
    call whose None and bool arguments form a pattern not seen before captures
    the forward for it first (see :mod:`hfkern.fusion`).
    ``state_dict()`` has the original keys, each entry stacked over the B models.

    Per-slot surgery, what pruning and refilling trials needs:
    :meth:`load_model`, :meth:`extract_model`, :meth:`reset_model`.
    The captured, rewritten forward of a call with forward's arguments at their
    defaults is ``self.graph`` (a ``torch.fx.Graph``); ``self.code`` is its Python source.
    """

    _torch_cls = nn.Module  # any: the original class is kept in ``model_class``
    _warned_patterns = False  # (set once the many-patterns warning was given)

    def __init__(self) -> None:  # use hfkern.fuse
        super().__init__()

    # ---- forward ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        B = self.B
        for i, value in enumerate(tree_flatten((args, kwargs))[0]):
            if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.size(0) != B):
                raise ValueError(
                    f"{self.model_class.__name__} (fused, B={B}): expected every tensor input to have "
                    f"the array dim B={B} first ([B, *per-model shape], or hfkern.broadcast(x, {B}) for "
                    f"an input shared by the models), got shape {list(value.shape)} (tensor input {i})"
                )
        forward = self._forward_for(self._call_key(args, kwargs))
        regions = len(_capture.open_regions())
        try:
            return forward(self, *args, **kwargs)
        except BaseException:
            # A no_grad/autocast/... region the captured forward entered and did not leave.
            _capture.leave_open_regions(regions)
            raise

    @property
    def _fused_self(self) -> "FusedModel":
        """The model itself: the owner of assignments to the original model's own attributes."""
        return self

    def _call_key(self, args: tuple, kwargs: dict) -> tuple:
        """The Python values this call gives forward's named arguments (a graph is captured for
        each such pattern): per argument its :func:`_argument_key`."""
        names, positional, defaults = self._arguments
        key = []
        given = len(args)
        for i, name in enumerate(names):
            if i < positional and i < given:
                v = args[i]
            elif name in kwargs:
                v = kwargs[name]
            else:  # its default's key (a required argument left out: the call raises TypeError, as torch's)
                key.append(defaults[i])
                continue
            key.append(_argument_key(v))
        return tuple(key)

    def _forward_for(self, key: tuple) -> Callable:
        """The forward for a call of ``key`` (:meth:`_call_key`) in the modules' current modes."""
        forwards = self._forwards
        forward = forwards.get((None, key))
        if forward is not None:
            return forward
        moded = self._moded.get(key)
        if moded is None:
            if "torch._dynamo" in sys.modules:  # (maybe called from a frame dynamo runs)
                _capture_new_pattern_eagerly(self, key)
            else:
                self._capture_call(key)
            forward = self._forwards.get((None, key))
            if forward is not None:
                return forward
            moded = self._moded[key]
        forward = self._moded_forward(moded)
        if forward is not None:
            return forward
        # Modes set after fusing that no capture serves: captured in them now, once, as a new
        # pattern of arguments is (the captures of every module in train and in eval mode are
        # there already; one in the modules' modes is added).
        if "torch._dynamo" in sys.modules:
            _capture_new_pattern_eagerly(self, key)
        else:
            self._capture_call(key)
        moded = self._moded[key]
        forward = self._moded_forward(moded)
        if forward is not None:
            return forward
        raise ValueError(self._modes_error(moded))

    def _moded_forward(self, moded: list) -> Callable | None:
        """The forward of ``moded`` (one pattern's captures for some modes) that serves the modules'
        current modes, or None."""
        get = self.get_submodule
        for paths, modes, forward, _ in moded:
            for p, m in zip(paths, modes):
                if get(p).training != m:
                    break
            else:
                return forward
        return None

    def _modes_error(self, moded: list) -> str:
        def shown(paths: tuple, modes: tuple) -> str:
            return ", ".join(f"{p or '(the model)'} {'train' if m else 'eval'}" for p, m in zip(paths, modes))

        read = sorted({p for paths, *_ in moded for p in paths})
        now = shown(tuple(read), tuple(self.get_submodule(p).training for p in read))
        served = "; ".join(f"[{shown(paths, modes)}]" for paths, modes, *_ in moded)
        return (
            f"{self.model_class.__name__} (fused): its forward reads `self.training` of modules that are now "
            f"in different modes than any captured forward serves (now: {now}; captured: {served}), and a "
            "capture in these modes did not show which modules' modes its forward reads (a class's own "
            "`training` property). Call train() or eval() on the whole model, or set these modes on the "
            "models before fusing them.")

    def _capture_call(self, key: tuple) -> None:
        """Capture and rewrite forward for calls whose Python-valued arguments are ``key``'s (the
        first such call), from model 0 as the fused model holds it now."""
        names = self._arguments[0]
        pattern = _pattern(names, key)
        try:
            with torch.inference_mode(False):  # (constants made in a call under inference mode serve training)
                rewritten, constants, root_assigned = _capture_and_rewrite(
                    self.extract_model(0), self.B, self._opaque, key, self._arguments, fused=self)
        except FuseError as e:
            raise FuseError(
                f"{self.model_class.__name__} (fused): forward is captured for each pattern of the "
                f"arguments that are Python values (None, bools, ints, strings, ...), here for a call "
                f"with {pattern}: {e}") from e
        for name, value in constants.values():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_read_attributes",
                           getattr(self, "_read_attributes", frozenset()) | _read_attributes(constants))
        object.__setattr__(self, "_root_assigned", self._root_assigned | root_assigned)
        own = {**self._own_graphs, **rewritten}
        planned = self._graphs is not self._own_graphs
        object.__setattr__(self, "_own_graphs", own)
        if planned:  # hfkern.plan's recomputation, for the new graphs too
            from .plan._strategy import _fused_graphs, applied
            strategy = applied(self)
            self._run_graphs(_fused_graphs(self, strategy.recompute) if strategy is not None else own)
        else:
            self._run_graphs(own)
        patterns = {k for _, k in own}
        if len(patterns) > _MANY_PATTERNS and not self._warned_patterns:
            object.__setattr__(self, "_warned_patterns", True)
            varying = [n for i, n in enumerate(names)
                       if len({k[i] for k in patterns if i < len(k)}) > _MANY_PATTERNS // 2]
            warnings.warn(
                f"{self.model_class.__name__} (fused): forward has now been captured for {len(patterns)} "
                f"patterns of its Python-valued arguments (each capture traces and rewrites forward); "
                f"{'argument(s) ' + ', '.join(map(repr, varying)) + ' take' if varying else 'the calls give'} "
                f"many values. Pass a value that changes from call to call as a float or a tensor "
                f"(traced, one capture for all values).", UserWarning, stacklevel=6)

    def _run_graphs(self, graphs: dict[tuple, fx.Graph]) -> None:
        """Run ``graphs`` (as ``_own_graphs``: one per train/eval modes served, :func:`_mode_spec`,
        or None for all, and pattern of Python-valued arguments, keyed ``(modes, pattern)``) as the forward:
        ``_own_graphs`` (what :func:`fuse` made) or a transformation of them (hfkern.plan's
        recomputation)."""
        forwards = {mode: compiled_forward(g, f"<hfkern.fuse {self.model_class.__name__}>")
                    for mode, g in graphs.items()}
        # Per pattern, the forwards captured for some modes (:func:`_mode_spec`), each with the
        # modules whose mode it depends on (found in the fused model) and their modes.
        moded: dict[tuple, list] = {}
        for (spec, key), forward in forwards.items():
            if spec is None:
                continue
            if isinstance(spec, bool):  # (a model saved when a capture served all-train or all-eval)
                spec = tuple((p, spec) for p in getattr(self, "_mode_paths", ("",)))
            paths = tuple(self._mode_holder(p) for p, _ in spec)
            moded.setdefault(key, []).append((paths, tuple(m for _, m in spec), forward, (spec, key)))
        object.__setattr__(self, "_graphs", graphs)
        object.__setattr__(self, "_forwards", forwards)
        object.__setattr__(self, "_moded", moded)

    def _mode_holder(self, path: str) -> str:
        """The fused model's module that holds the mode of the original module at ``path``: that
        module, or where the array module it is inside keeps no such submodule, that array module."""
        while path:
            try:
                self.get_submodule(path)
                return path
            except AttributeError:
                path = path.rpartition(".")[0]
        return path

    @property
    def graph(self) -> fx.Graph:
        """The rewritten forward (for the current train/eval mode, and a call that leaves forward's
        arguments with their defaults) as a ``torch.fx.Graph``."""
        key = self._default_key
        graph = self._graphs.get((None, key))
        if graph is not None:
            return graph
        moded = self._moded[key]
        for paths, modes, _, graph_key in moded:  # the one the modules' modes now select
            if tuple(self.get_submodule(p).training for p in paths) == modes:
                return self._graphs[graph_key]
        for paths, modes, _, graph_key in moded:  # else the one of the whole model's mode
            if all(m == self.training for m in modes):
                return self._graphs[graph_key]
        return self._graphs[moded[0][3]]

    @property
    def code(self) -> str:
        """The Python source of :attr:`graph`."""
        return self.graph.python_code(root_module="self").src

    # ---- pickling ---------------------------------------------------------------------
    # torch.save(fused) / torch.load and copy.deepcopy: the rewritten graphs travel as flat
    # node lists and their Python forwards are compiled again; the factory given to fuse
    # travels where pickle can save it (_SavedFactory).
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_forwards"], state["_moded"]
        state["_graphs"] = {mode: graph_state(g) for mode, g in self._graphs.items()}
        state["_own_graphs"] = None if self._own_graphs is self._graphs else {
            mode: graph_state(g) for mode, g in self._own_graphs.items()}
        if state["_factory"] is not None and not isinstance(state["_factory"], _LostFactory):
            state["_factory"] = _SavedFactory(state["_factory"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        graphs = {mode: graph_from_state(g) for mode, g in state.pop("_graphs").items()}
        own = state["_own_graphs"]
        state["_own_graphs"] = graphs if own is None else {mode: graph_from_state(g) for mode, g in own.items()}
        if isinstance(state["_factory"], _SavedFactory):
            state["_factory"] = state["_factory"].fn
        super().__setstate__(state)
        self._run_graphs(graphs)

    # ---- conversion -----------------------------------------------------------------
    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> "FusedModel":
        """Same as :func:`fuse`."""
        return fuse(modules)

    def to_modules(self) -> list[nn.Module]:
        """Same as :func:`unfuse`: the B models as torch models of the original class."""
        return [self.extract_model(b) for b in range(self.B)]

    def extra_repr(self) -> str:
        return f"B={self.B}, model_class={self.model_class.__name__}"

    # ---- per-slot surgery --------------------------------------------------------------
    def extract_model(self, b: int) -> nn.Module:
        """Model b as a torch model of the original class (copies; same requires_grad and modes).

        Its tensors have the fused model's current dtypes and device (after
        ``fused.double()`` or ``.to(device)`` too), as the original model would after the same call.
        """
        b = self._check_slot(b, "extract_model")
        device = self._factory_kwargs().get("device", torch.device("cpu"))
        # Drawn in torch's default dtype, as a constructor draws, then given the fused model's
        # dtypes by reset_model (_follow_dtypes): what `torch.manual_seed(s); Net().double()` gives.
        model = copy.deepcopy(self._template).to(torch.get_default_dtype()).to_empty(device=device)
        with torch.no_grad():
            for path, name in self._stacked:
                owner, _ = _parent(model, path + "." + name if path else name)
                stacked = getattr(self.get_submodule(path), name)
                if isinstance(owner._parameters.get(name), nn.Parameter):
                    owner._parameters[name] = nn.Parameter(stacked[b].clone(), requires_grad=stacked.requires_grad)
                else:
                    owner._buffers[name] = stacked[b].clone()
            for path, name in self._attribute_state:
                object.__setattr__(model.get_submodule(path), name,
                                   getattr(self.get_submodule(path), name)[b].clone())
        for path in self._array_leaves:
            _put_everywhere(model, path, self.get_submodule(path).extract_model(b))
        self._retie(model)
        for path, module in model.named_modules():
            if path not in self._array_leaves_set and not any(path.startswith(p + ".") for p in self._array_leaves):
                module.training = self.get_submodule(path).training
        return model

    def _retie(self, model: nn.Module) -> None:
        for names in self._ties:
            first = model.get_parameter(names[0])
            for name in names[1:]:
                owner, attr = _parent(model, name)
                setattr(owner, attr, first)

    def _current_tensors(self) -> dict[str, torch.Tensor]:
        """The original model's parameter and buffer names -> model 0's tensor as the fused model holds
        it now (its dtype and device follow ``.to()``/``.double()``; the leaves' are their own)."""
        current = {}
        for key, t in _named_tensors(self._template):
            path, _, name = key.rpartition(".")
            try:
                value = getattr(self.get_submodule(path), name)
            except AttributeError:
                value = None
            # An array leaf may name its tensors otherwise: its own load checks its dtypes.
            current[key] = value[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else t
        return current

    def load_model(self, b: int, model: nn.Module) -> None:
        """Copy a torch model of the original class into slot b; the other slots are untouched.

        ``model`` must have the fused architecture as :func:`fuse` requires of
        its models (the same class, module tree, parameter and buffer names and
        shapes, configuration attributes, forward hooks of captured modules, the
        tensor attributes the captured forward reads; no hooks :func:`fuse` refuses:
        :class:`FuseError` otherwise, the one :func:`fuse` raises), with the
        fused model's current dtypes (after ``fused.double()``, a float64 model);
        it may be on any device. Every check runs before anything is written.
        """
        who = "load_model"
        b = self._check_slot(b, who)
        if type(model) is not self.model_class:
            raise TypeError(
                f"{who}: expected a {self.model_class.__name__} model, got {type(model).__name__}")
        problem = _architecture_problem(self._template, model, "the fused architecture", "the model",
                                        self._current_tensors(), self._array_paths)
        if problem is None:  # what fuse checks besides the architecture, as fuse checks it
            problem = _hooks_problem(model, self._template, "the fused architecture", "the model",
                                     _array_classes(), tuple(self._opaque), getattr(self, "_hook_refs", None))
        differing = set()
        state = {".".join(filter(None, pn)) for pn in self._attribute_state}
        read = getattr(self, "_read_attributes", frozenset())
        for path, module in self._template.named_modules() if problem is None else ():
            for attr, ref in vars(module).items():
                target = f"{path}.{attr}" if path else attr
                if not isinstance(ref, torch.Tensor) or target in state:
                    continue
                theirs = vars(model.get_submodule(path)).get(attr)
                if target in read:
                    problem = _tensor_attribute_problem(target, ref, theirs, "the fused models and the model")
                    if problem is not None:
                        break
                elif not (isinstance(theirs, torch.Tensor) and theirs.shape == ref.shape and theirs.dtype == ref.dtype
                          and _same_tensor_values(ref, theirs.to(ref.device))):
                    differing.add(target)  # read by no captured forward yet: refused if one reads it
            if problem is not None:
                break
        if problem is not None:
            raise FuseError(f"{who}: {problem}")
        got = dict(_named_tensors(model))
        loads = [self.get_submodule(path)._prepare_load(b, model.get_submodule(path), f"{who} ({path!r})")
                 for path in self._array_leaves]  # every layer checked before any is written
        # A layer's load validates its per-model values (a dropout's p) only as it sets them, after
        # the tensors before it were written: check them all here, so a refused one writes nothing.
        for path in self._array_leaves:
            _check_per_model_values(self.get_submodule(path), b, model.get_submodule(path), who, path)
        attributes = []
        for path, name in self._attribute_state:
            ours, theirs = getattr(self.get_submodule(path), name), getattr(model.get_submodule(path), name, None)
            if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape[1:] or theirs.dtype != ours.dtype:
                raise FuseError(f"{who}: tensor attribute {'.'.join(filter(None, (path, name)))!r} is "
                                f"{_describe(theirs)} in the model, the fused model holds "
                                f"{ours.dtype} {list(ours.shape[1:])}")
            attributes.append((ours, theirs))
        if differing - self._differing_attributes:
            object.__setattr__(self, "_differing_attributes", self._differing_attributes | differing)
        with torch.no_grad():
            for path, name in self._stacked:
                full = f"{path}.{name}" if path else name
                target = getattr(self.get_submodule(path), name)
                target[b].copy_(got[full])
                if isinstance(target, nn.Parameter) and target.grad is not None:
                    _zero_slot_(target, b)  # a new model has no gradient yet
            for ours, theirs in attributes:
                ours[b].copy_(theirs)
        for load in loads:
            load()

    def reset_model(self, b: int, seed: int | None = None, *,
                    factory: Callable[[], nn.Module] | None = None) -> None:
        """Slot b becomes a freshly initialized model; the other slots are untouched.

        The fresh model comes from ``factory`` (default: the one given to
        :func:`fuse`), called under ``torch.manual_seed(seed)`` in a forked RNG
        when ``seed`` is given (the global RNG is then untouched), else drawing
        from the global RNG as a new model would. Without a factory, a copy of
        the architecture with slot b's per-model values (the array layers' ones
        that may differ between the models: a dropout's ``p``) is re-initialized with each submodule's
        ``reset_parameters()``, a module's after its submodules' (as its constructor
        runs after theirs: ``MultiheadAttention`` zeroes its output projection's
        bias), which is what the constructors of torch's layers draw, in torch's
        default dtype and then converted to the fused model's dtypes, as
        ``Net().double()`` is made (a model whose
        ``__init__`` initializes differently, or clones layers as
        ``nn.TransformerEncoder`` does, needs its factory for an exact fresh
        model). A parameter registered under several names keeps the
        initialization of the module it is first registered in (``self.head.weight
        = self.embed.weight`` keeps the embedding's; a model tied the other way
        needs its factory). Parameters that no submodule initializes (a model's
        own ``nn.Parameter``, a parametrization's originals) need a factory, and
        ValueError says which. A model
        loaded from a pickle that could not hold the factory given to
        :func:`fuse` (a lambda) raises ValueError asking for ``factory=``.
        """
        b = self._check_slot(b, "reset_model")
        factory = factory or self._factory
        if isinstance(factory, _LostFactory):
            raise ValueError(
                f"reset_model: this model was loaded from a pickle (torch.save) that could not keep the "
                f"factory given to hfkern.fuse ({factory.description}: pickle saves module-level functions "
                "and classes, not lambdas or local functions); pass factory=")
        with seeded(seed, self._factory_kwargs().get("device"), "reset_model"):
            fresh = factory() if factory is not None else self._reinitialized(b)
        if isinstance(fresh, nn.Module):
            self._follow_dtypes(fresh)
        self.load_model(b, fresh)

    def _follow_dtypes(self, model: nn.Module) -> None:
        """Give ``model``'s floating-point tensors the fused model's current dtypes (in place), as
        ``.to(dtype)`` after :func:`fuse` gave the fused model's (leaves included)."""
        current = self._current_tensors()
        for prefix, module in model.named_modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    ref = current.get(f"{prefix}.{name}" if prefix else name)
                    if t is None or ref is None or t.dtype == ref.dtype:
                        continue
                    if (t.is_floating_point() and ref.is_floating_point()) or (t.is_complex() and ref.is_complex()):
                        if isinstance(t, nn.Parameter):
                            t.data = t.data.to(ref.dtype)
                        else:
                            table[name] = t.to(ref.dtype)

    def _reinitialized(self, b: int) -> nn.Module:
        """A copy of the architecture with slot b's configuration, every parameter and buffer
        re-initialized by its module's ``reset_parameters()`` (drawing from the current RNG)."""
        device = self._factory_kwargs().get("device", torch.device("cpu"))
        # Drawn in torch's default dtype, as a constructor draws, then given the fused model's
        # dtypes by reset_model (_follow_dtypes): what `torch.manual_seed(s); Net().double()` gives.
        model = copy.deepcopy(self._template).to(torch.get_default_dtype()).to_empty(device=device)
        # The template is model 0's: slot b keeps its own per-model values (a dropout's p in a
        # sweep over p), as an array module's reset_model keeps model b's configuration. They are
        # set on the template's modules rather than taken from the leaves' extract_model, whose
        # constructors would draw from the RNG this initialization draws from.
        for path in self._array_leaves:
            for sub_path, sub, field in self.get_submodule(path)._held_per_model_fields():
                value = getattr(sub, field)
                setattr(model.get_submodule(".".join(filter(None, (path, sub_path)))), field,
                        value[b] if isinstance(value, tuple) else value)
        self._retie(model)
        # A tensor registered under several names (an output head tied to the embedding) is
        # its first name's module's: torch's tying keeps that module's initialization.
        owner: dict[int, nn.Module] = {}
        for module in model.modules():
            for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
                owner.setdefault(id(t), module)
        tied = {id(model.get_parameter(names[0])) for names in self._ties}
        covered: set[int] = set()
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Submodules before their module, as a constructor builds them before its own
        # initialization (MultiheadAttention zeroes out_proj's bias after out_proj's own).
        for module in _post_order(model):
            # reset_parameters, or the private one of torch's MultiheadAttention
            reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
            if callable(reset):
                reset()
                # (a parametrized tensor's originals: reset_parameters writes the computed tensor)
                covered.update(id(t) for n, t in module.named_parameters() if "parametrizations." not in n)
                covered.update(id(t) for n, t in module.named_buffers() if "parametrizations." not in n)
                with torch.no_grad():
                    kept += [(t, t.clone()) for t in module.parameters(recurse=False)
                             if id(t) in tied and owner[id(t)] is module]
        with torch.no_grad():
            for t, value in kept:
                t.copy_(value)
        left = [n for n, t in _named_tensors(model) if id(t) not in covered]
        if left:
            raise ValueError(
                f"reset_model: {left} are not initialized by any submodule's reset_parameters(); "
                "pass factory= (or fuse a factory: hfkern.fuse(factory, B)) to make fresh models")
        return model


def _check_per_model_values(array: ArrayModule, b: int, module: nn.Module, who: str, path: str) -> None:
    """Raise what loading ``module`` into slot b of ``array`` would raise for a per-model value
    (a dropout probability torch took unchecked, ``drop.p = 1.5``), leaving ``array`` as it is.

    ``array._prepare_load(b, module, ...)`` must have passed (the counterparts exist). Each
    value goes through its field's own setter, the check the load runs, on a shallow stand-in
    of the module that holds it: the setters only validate and store the value, so the
    stand-in's store leaves the array untouched.
    """
    for sub_path, sub, field in array._held_per_model_fields():
        counterpart = _submodule(module, sub_path)
        new = _with_slot(getattr(sub, field), b, _read_field(counterpart, field), array.B)
        stand_in = object.__new__(type(sub))
        stand_in.__dict__.update(sub.__dict__)
        try:
            setattr(stand_in, field, new)
        except (TypeError, ValueError) as e:
            label = ".".join(filter(None, (path, sub_path, field)))
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"{who}: the model's {label!r} is refused for slot {b}: {e}") from e


# ---- fuse / unfuse ------------------------------------------------------------------------
def _architecture_problem(ref: nn.Module, model: nn.Module, ref_name: str, name: str,
                          ref_tensors: dict[str, torch.Tensor] | None = None,
                          array_paths: Iterable[str] | None = None) -> str | None:
    """How ``model`` differs from ``ref`` in what the captured forward depends on, or None.

    Module tree (classes), parameter and buffer names, shapes and dtypes, and the
    plain configuration attributes of every module (``_``-prefixed ones included), of the
    array leaves only those torch's class does not set (``array_paths``: every name of a
    module that becomes an array module, which holds per-model values of its configuration
    and checks them itself, and modules of an array class inside one; None, before capture
    has found them: every module of an array class).
    A module of an array class that the forward does not call (a dropout whose ``p`` it
    reads) stays model 0's module, so its configuration must be every model's.
    ``ref_tensors`` (name -> tensor, shapes and dtypes to compare with) defaults to ``ref``'s own.
    """
    array_classes = _array_classes()
    ref_modules = {p: _module_class(m) for p, m in ref.named_modules()}
    modules = {p: _module_class(m) for p, m in model.named_modules()}
    if modules != ref_modules:
        path = sorted(set(modules) ^ set(ref_modules)) or sorted(
            p for p in modules if modules[p] != ref_modules[p])
        p = path[0]
        got = modules[p].__name__ if p in modules else "nothing"
        want = ref_modules[p].__name__ if p in ref_modules else "nothing"
        return (f"{name}'s module tree differs from {ref_name}'s at {p or '(the model)'!r}: "
                f"{ref_name} has {want}, {name} has {got}")
    tensors = dict(_named_tensors(model))
    ref_tensors = dict(_named_tensors(ref)) if ref_tensors is None else ref_tensors
    if tensors.keys() != ref_tensors.keys():
        missing, extra = sorted(ref_tensors.keys() - tensors.keys()), sorted(tensors.keys() - ref_tensors.keys())
        return f"{name}'s parameters and buffers differ from {ref_name}'s: missing {missing}, unexpected {extra}"
    for key, t in tensors.items():
        r = ref_tensors[key]
        for attr, show in (("shape", lambda v: list(v)), ("dtype", str)):
            if getattr(t, attr) != getattr(r, attr):
                return (f"{attr} of {key!r} differs: {ref_name} has {show(getattr(r, attr))}, {name} has "
                        f"{show(getattr(t, attr))}")
    leaves = None if array_paths is None else tuple(array_paths)
    names = (_registered(ref), _registered(model))
    for path, sub in model.named_modules():
        # An array module keeps its torch configuration per model (and checks it); attributes
        # added to it (`self.fc.scale = s`) are read by forward as model 0's.
        added_only = type(sub) in array_classes and (
            leaves is None or any(path == p or path.startswith(p + ".") for p in leaves))
        ours = _config_attributes(ref.get_submodule(path), added_only)
        theirs = _config_attributes(sub, added_only)
        for k in sorted(ours.keys() | theirs.keys()):
            mine, other = ours.get(k, _MISSING), theirs.get(k, _MISSING)
            if mine is _MISSING or other is _MISSING or not _same_value(mine, other, names):
                show = lambda v: "no such attribute" if v is _MISSING else _shown(v)  # noqa: E731
                return (f"attribute {(path + '.' if path else '') + k!r} differs: {ref_name} has "
                        f"{show(ours.get(k, _MISSING))}, {name} has {show(theirs.get(k, _MISSING))}; the "
                        "forward code is captured from model 0, so its configuration must be every model's")
    return None


_MISSING = object()


class _ParametrizedClass(tuple):
    """The class of a module with ``torch.nn.utils.parametrize`` parametrizations, as
    :func:`_module_class` gives it: torch makes a new class for every such module (a subclass
    of the module's own), so two models' are never the same class."""

    @property
    def __name__(self) -> str:
        return f"parametrized {self[0].__name__}"


def _module_class(module: nn.Module) -> type | _ParametrizedClass:
    """A module's class for comparing architectures (a parametrized module's: its own class's)."""
    if torch.nn.utils.parametrize.is_parametrized(module):
        return _ParametrizedClass(type(module).__bases__)
    return type(module)


def _check_models(models: list[nn.Module]) -> None:
    first = models[0]
    cls = _module_class(first)
    _check_unshared(models)
    for i, m in enumerate(models[1:], start=1):
        if _module_class(m) != cls:
            raise TypeError(f"fuse: expected models of one class, got {cls.__name__} at index 0 and "
                            f"{type(m).__name__} at index {i}")
        problem = _architecture_problem(first, m, "model 0", f"model {i}")
        if problem is not None:
            raise FuseError(f"fuse: {problem}")
        ref_tensors = dict(_named_tensors(first))
        for key, t in _named_tensors(m):
            ref = ref_tensors[key]
            for attr in ("device", "requires_grad"):
                if getattr(t, attr) != getattr(ref, attr):
                    raise FuseError(f"fuse: {attr} of {key!r} differs: model 0 has {getattr(ref, attr)}, "
                                    f"model {i} has {getattr(t, attr)}")
        for path, sub in m.named_modules():
            if sub.training != first.get_submodule(path).training:
                raise FuseError(f"fuse: module {path or '(the model)'!r} is in training mode in one "
                                f"model and in eval mode in another (models 0 and {i})")


def _check_unshared(models: list[nn.Module]) -> None:
    """Refuse models that share a parameter or buffer (one submodule in two models, a model given
    twice): the fused model holds each model's tensors as its own slice, so what one model's
    training changes would no longer reach the other, as it does in torch."""
    owners: dict[Any, tuple[int, str]] = {}
    for i, model in enumerate(models):
        for name, t in _named_tensors(model):
            if t is None:
                continue
            keys = [id(t)]
            if t.device.type != "meta" and t.untyped_storage().nbytes():
                keys.append(("memory", t.device, t.untyped_storage().data_ptr()))
            for key in keys:
                j, theirs = owners.setdefault(key, (i, name))
                if j != i:
                    if model is models[j]:
                        what = f"models {j} and {i} are one model object (sharing every tensor: {name!r}, ...)"
                    else:
                        how = "the parameter or buffer" if key == keys[0] else "the memory of"
                        what = f"models {j} and {i} share {how} {theirs!r} (model {i}'s {name!r})"
                    raise FuseError(
                        f"fuse: {what}; a fused model holds each model's parameters and buffers as its own "
                        "copy, so training would update them apart where torch updates one tensor. Give each "
                        "model its own (copy.deepcopy(model))")


_HOOK_KINDS = {"_forward_pre_hooks": "forward pre-hooks", "_forward_hooks": "forward hooks",
               "_backward_pre_hooks": "backward pre-hooks", "_backward_hooks": "backward hooks"}
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")


# The forward pre-hooks of torch's deprecated reparametrizations (kept: the error names them)
# (torch.nn.utils.weight_norm is the function; its module holds the hook's class)
_LEGACY_HOOKS = (("weight_norm", importlib.import_module("torch.nn.utils.weight_norm").WeightNorm),
                 ("spectral_norm", importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm))


def _forward_hooks(module: nn.Module) -> list[tuple[str, Any]]:
    return [(k, h) for k in _FORWARD_HOOKS for h in getattr(module, k, {}).values()]


def _array_owner(model: nn.Module, path: str, array_classes: dict, opaque: tuple) -> str | None:
    """The module at ``path`` or above it that becomes an array module for the B models (a
    module of an array class not inside a vmap or loop module), or None."""
    parts = path.split(".") if path else []
    module = model
    for k, name in enumerate(parts):
        module = module.get_submodule(name)
        if isinstance(module, opaque):
            return None
        if type(module) in array_classes:
            return ".".join(parts[:k + 1])
    return None


def _check_hooks(models: list[nn.Module], array_classes: dict, opaque: tuple) -> None:
    """Refuse hooks the fused model would not run as the models do (:func:`_hooks_problem`)."""
    first = models[0]
    for i, model in enumerate(models):
        problem = _hooks_problem(model, first if i else None, "model 0", f"model {i}", array_classes, opaque)
        if problem is not None:
            raise FuseError(f"fuse: {problem}")


_TENSOR_HOOK_KINDS = (("_backward_hooks", "gradient hooks (Tensor.register_hook)"),
                      ("_post_accumulate_grad_hooks",
                       "post-accumulate-grad hooks (Tensor.register_post_accumulate_grad_hook)"))


def _hooks_problem(model: nn.Module, ref: nn.Module | None, ref_name: str, name: str, array_classes: dict,
                   opaque: tuple, ref_names: dict[int, str] | None = None) -> str | None:
    """What :func:`fuse` refuses of ``model``'s hooks (and :meth:`FusedModel.load_model`, the same),
    or None.

    Kept: forward hooks of the modules whose code is captured, or that run per model (vmap
    and loop modules): model 0's run for every model, like its forward code, so every model
    must have the same ones as ``ref`` (model 0, or the fused model's template of it; None:
    ``model`` is model 0). Refused: backward hooks (the captured forward has no module call
    for them to wrap), forward hooks on the model itself and on the modules that become
    one array module for the B models, or inside one (the fused forward calls neither the
    model's own ``__call__`` nor any model's module there), and gradient hooks on parameters
    and buffers (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``: the fused
    model holds the B models' tensors as one ``[B, ...]`` tensor, whose hooks are its own).
    ``ref_names``: more ``id -> name`` entries of ``ref``'s registered objects (model 0's
    own, which the template's hooks may still close over)."""
    names = None
    for path, module in model.named_modules():
        where = repr(path) if path else "the model itself"
        backward = [_HOOK_KINDS[k] for k in _HOOK_KINDS if k not in _FORWARD_HOOKS and getattr(module, k, None)]
        if backward:
            return (f"{name} has {' and '.join(backward)} on {where}, which a fused model cannot run "
                    "per model (its captured forward has no call of the module to wrap). Remove them before "
                    "fusing and register them on the fused model's modules, whose gradients are the B "
                    "models' [B, ...] arrays")
        hooks = _forward_hooks(module)
        kinds = " and ".join(_HOOK_KINDS[k] for k in _FORWARD_HOOKS if getattr(module, k, None))
        if hooks and not path:
            return (f"{name} has {kinds} on the model itself, which the fused model would not "
                    "call (its forward runs the model's forward code, not its __call__). Remove them "
                    "before fusing and register them on the fused model, where they see the [B, ...] arrays")
        owner = _array_owner(model, path, array_classes, opaque) if hooks else None
        if owner is not None:
            cls = type(model.get_submodule(owner))
            inside = "" if owner == path else f" inside {owner!r}"
            legacy = [f"torch.nn.utils.{name}'s" for name, hook in _LEGACY_HOOKS
                      if any(isinstance(h, hook) for h in module._forward_pre_hooks.values())]
            hint = (f" ({' and '.join(legacy)}: torch.nn.utils.parametrizations' versions, which fuse "
                    "supports, do the same)") if legacy else ""
            return (f"{name} has {kinds} on {where}{inside}{hint}, which the fused model would not "
                    f"call: the B models' {cls.__name__} modules at {owner!r} run as one array module "
                    f"(hfkern.nn's {array_classes[cls].__name__}). Remove them before fusing and register "
                    f"them on fused.get_submodule({owner!r}), where they see the [B, ...] arrays")
        if ref is not None and path:
            theirs = _forward_hooks(ref.get_submodule(path))
            if hooks or theirs:
                if names is None:
                    names = (_registered(model), {**_registered(ref), **(ref_names or {})})
                if not _same_value(hooks, theirs, names):
                    return (f"the forward hooks on {where} differ between {ref_name} and {name} (in their "
                            "code, or the values they close over or are given); the fused forward runs model "
                            "0's hooks (captured with its code) for every model, so the models must have the "
                            "same ones")
    for key, t in _named_tensors(model):
        kinds = [what for attr, what in _TENSOR_HOOK_KINDS if getattr(t, attr, None)]
        if kinds:
            what = "parameter" if isinstance(t, nn.Parameter) else "buffer"
            return (f"{name}'s {what} {key!r} has {' and '.join(kinds)}, which the fused model would not "
                    f"call: it holds the B models' {key!r} as one [B, ...] tensor, whose hooks are its own. "
                    f"Remove them before fusing and register them on fused.get_parameter({key!r}) (or "
                    "get_buffer), where they see the [B, ...] gradient")
    return None


def _hook_references(model: nn.Module) -> dict[int, str]:
    """``id -> name`` of ``model``'s registered objects (modules, parameters, buffers) that its
    forward hooks hold (in closures, defaults, partial arguments, bound methods, containers):
    a fused model's template deep-copies the hooks' tables but shares their functions, which
    still hold model 0's own objects, so :meth:`FusedModel.load_model` compares a model's hooks
    with them by these names (they stay alive as long as those functions)."""
    registered = _registered(model)
    found: dict[int, str] = {}
    seen: set[int] = set()

    def walk(v: Any, depth: int) -> None:
        if id(v) in seen or depth > 8:
            return
        seen.add(id(v))
        if id(v) in registered:
            found[id(v)] = registered[id(v)]
            return
        if isinstance(v, (nn.Module, torch.Tensor)):
            return
        if isinstance(v, (tuple, list, set, frozenset)):
            for x in v:
                walk(x, depth + 1)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x, depth + 1)
        elif isinstance(v, partial):
            for x in (v.func, v.args, v.keywords):
                walk(x, depth + 1)
        elif isinstance(v, types.MethodType):
            walk(v.__self__, depth + 1)
            walk(v.__func__, depth + 1)
        elif isinstance(v, types.FunctionType):
            for x in (v.__defaults__, v.__kwdefaults__, [_cell_value(c) for c in v.__closure__ or ()]):
                walk(x, depth + 1)
        elif dataclasses.is_dataclass(v) or isinstance(v, types.SimpleNamespace):
            walk(_fields(v), depth + 1)

    for module in model.modules():
        for _, hook in _forward_hooks(module):
            walk(hook, 0)
    return found


def fuse(models: Sequence[nn.Module] | Callable[[], nn.Module], B: int | None = None, *,
         vmap_modules: Iterable[type] = (), loop_modules: Iterable[type] = ()) -> FusedModel:
    """Fuse B torch models of one architecture into one :class:`FusedModel`.

    Args:
        models: B models of one class and configuration (different weights), or a
            factory (a callable returning a new model), called ``B`` times.
        B: the number of models to make with the factory (only with a factory).
        vmap_modules: module classes whose ``forward`` is not captured but run
            under ``torch.vmap`` over their stacked parameters (for code fx cannot
            trace, such as branches on shapes).
        loop_modules: module classes run once per model in a Python loop (any
            code, including branches on values).

    The models are not modified; their parameters and buffers are copied.
    Raises :class:`FuseError` (a ValueError) for a model that cannot be captured
    or models that differ in architecture, TypeError for wrong argument types.
    """
    factory = None
    if isinstance(models, nn.Module):
        raise TypeError("fuse: expected a sequence of B models or a factory and B, got one model "
                        f"({type(models).__name__}); pass [model_0, ..., model_B-1]")
    if callable(models) and not isinstance(models, (list, tuple)):
        if B is None:
            raise TypeError("fuse: with a factory, the number of models B is required: fuse(factory, B)")
        B = check_B(B)
        factory = models
        models = [factory() for _ in range(B)]
        for i, m in enumerate(models):
            if not isinstance(m, nn.Module):
                raise TypeError(f"fuse: the factory must return torch.nn.Module instances, got "
                                f"{type(m).__name__} (call {i})")
    else:
        if B is not None:
            raise TypeError("fuse: B is given by the number of models; pass B only with a factory")
        if not isinstance(models, Sequence) or isinstance(models, (str, bytes)):
            raise TypeError(f"fuse: expected a sequence of models or a factory, got {type(models).__name__}")
        models = list(models)
        if not models:
            raise ValueError("fuse: expected at least one model, got an empty sequence")
        for i, m in enumerate(models):
            if not isinstance(m, nn.Module):
                raise TypeError(f"fuse: expected torch.nn.Module models, got {type(m).__name__} at index {i}")
        B = len(models)
    opaque = {}
    for strategy, classes in (("vmap", vmap_modules), ("loop", loop_modules)):
        for c in classes:
            if not (isinstance(c, type) and issubclass(c, nn.Module)):
                raise TypeError(f"fuse: {strategy}_modules must hold torch.nn.Module classes, got {c!r}")
            opaque[c] = strategy
    root_cls = type(models[0])
    if isinstance(models[0], _LOOPED_BY_DEFAULT) and root_cls.__module__.startswith("torch."):
        # (its forward cannot be captured, and the model itself is no leaf to run per model)
        raise FuseError(
            f"fuse: the models are {root_cls.__name__} modules themselves: a recurrent torch module's forward "
            "cannot be captured (torch.vmap cannot batch it either), and the fused model runs such a module once "
            "per model only as a submodule. Wrap it in a module of your own (self.rnn = nn."
            f"{root_cls.__name__}(...) in __init__, `return self.rnn(x)` in forward) and fuse those")
    if root_cls in opaque:
        raise FuseError(f"fuse: the model's own class {root_cls.__name__} cannot be in "
                        f"{opaque[root_cls]}_modules; name its submodules' classes instead")
    _check_models(models)
    _check_hooks(models, _array_classes(), tuple(opaque))
    try:
        return _build(models, B, factory, opaque)
    except FuseError as e:
        array_class = _array_classes().get(root_cls)
        if array_class is None:
            if root_cls.__module__.startswith("torch.nn.") and "cannot capture the model" in str(e):
                raise FuseError(
                    f"fuse: the models are {root_cls.__name__} modules themselves, whose forward cannot be "
                    f"captured (the cause is chained below). Wrap it in a module of your own (self.layer = "
                    f"nn.{root_cls.__name__}(...) in __init__, `return self.layer(x)` in forward) and fuse "
                    "those: the fused model runs such a layer per model (under torch.vmap, or once per model "
                    f"with fuse(..., loop_modules=(nn.{root_cls.__name__},)))") from e
            raise
        # (a Linear's forward captures; a batch norm's or an attention's branches on values)
        raise FuseError(
            f"fuse: the models are {root_cls.__name__} modules themselves, whose forward cannot be "
            f"captured (the cause is chained below); their array version is hfkern.nn's "
            f"{array_class.__name__}: build it with "
            f"hfkern.nn.{array_class.__name__}.from_modules(models), or fuse models that hold a "
            f"{root_cls.__name__}") from e


def _capture_new_pattern(model: FusedModel, key: tuple) -> None:
    model._capture_call(key)


# Capturing a pattern of arguments first met under torch.compile runs Python that dynamo cannot
# trace (copies of model 0, torch.fx): it runs eagerly, between two graphs, with dynamo off for
# every frame it calls (torch 2.11 compiled them as frames of their own after a graph break).
# torch._disable_dynamo (torch.optim's zero_grad uses it) imports dynamo when first called, not
# with hfkern; torch.compiler.disable called while tracing was traced into by torch 2.11. Under
# fullgraph=True dynamo refuses the call, naming this function: call the model once first.
_capture_new_pattern_eagerly = torch._disable_dynamo(_capture_new_pattern)


# A fused model warns once when its forward has been captured for more patterns of Python-valued
# arguments than this (torch.compile's recompile limit is 8).
_MANY_PATTERNS = 8


class _Value:
    """A key entry for an argument given a Python value the graph is captured for (an int, a
    string, an enum member, a dtype, a tuple of them): equal to another only for values of the
    same types (``1 == True == 1.0`` in Python; three different calls here)."""

    __slots__ = ("value", "_typed")

    def __init__(self, value: Any, typed: tuple):
        self.value = value
        self._typed = typed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Value) and self._typed == other._typed

    def __hash__(self) -> int:
        return hash(self._typed)

    def __repr__(self) -> str:
        return repr(self.value)

    def __reduce__(self):
        return (_argument_key, (self.value,))


_CONSTANT_TYPES = (int, str, bytes, torch.dtype, torch.device, torch.memory_format, torch.layout, enum.Enum)


def _typed_constant(v: Any) -> tuple | None:
    """``v`` with its types, hashable, where ``v`` is a Python constant a graph is captured for
    (see :func:`_argument_key`); else None."""
    if v is None or isinstance(v, _CONSTANT_TYPES) and not isinstance(v, float):
        try:
            hash(v)
        except TypeError:
            return None
        return (type(v), v)
    if type(v) is tuple:
        items = tuple(_typed_constant(x) for x in v)
        return None if any(x is None for x in items) else (tuple, items)
    return None


def _argument_key(v: Any) -> Any:
    """An argument's entry in a call's key (:meth:`FusedModel._call_key`): None, True or False
    as they are; a :class:`_Value` for an int (an enum, a string, a dtype, a device, a tuple of
    such): the graph is captured for that value, which forward sees as it is; ``...`` for
    anything else (tensors, floats, lists: traced values of the captured graph)."""
    if v is None or v is True or v is False:
        return v
    typed = _typed_constant(v)
    return ... if typed is None else _Value(v, typed)


def _key_value(k: Any) -> Any:
    """The Python value a key entry (:func:`_argument_key`) gives forward: ``...`` for traced."""
    return k.value if isinstance(k, _Value) else k


def _pattern(names: Sequence[str], key: tuple) -> str:
    return ", ".join(f"{n}={v!r}" for n, v in zip(names, key) if v is not ...) or "no Python-valued argument"


def _forward_arguments(model: nn.Module) -> tuple[tuple[str, ...], int, tuple]:
    """The named arguments of the ``forward`` that torch.fx captures (positional ones, then
    keyword-only ones), how many are positional, and their defaults as a call's key has them
    (:func:`_argument_key`; ``...`` for a required argument)."""
    fn = inspect.unwrap(type(model).forward)
    code = getattr(fn, "__code__", None)
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        parameters = None
    if code is None or parameters is None or code.co_argcount < 1:
        return (), 0, ()
    names = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
    return names, code.co_argcount - 1, tuple(... if d is inspect.Parameter.empty else _argument_key(d)
                                              for d in (parameters[n].default if n in parameters else
                                                        inspect.Parameter.empty for n in names))


def _captured(model: nn.Module, array_classes: dict, opaque: dict[type, str], key: tuple,
              arguments: tuple) -> dict[tuple | None, _capture.Captured]:
    """``model``'s forward captured for calls whose Python-valued arguments are ``key``'s, keyed by
    the train/eval modes each capture serves (:func:`_mode_spec`: the modules whose ``training``
    forward read, with the values read). None: one capture serves every mode (forward reads no
    module's mode, or one module's and takes the same code in both). Else captured with every
    module in train mode and every module in eval mode, and where neither serves the modes
    ``model``'s modules have (a block that reads its own mode in eval in a model that trains),
    with those modes too."""
    opaque_types = tuple(opaque)
    leaf = lambda m: type(m) in array_classes or isinstance(m, opaque_types)  # noqa: E731
    concrete = {name: _key_value(v) for name, v in zip(arguments[0], key) if v is not ...}
    source = _capture_source(model)
    (train, train_reads), (evaluated, eval_reads) = (
        _watched_capture(source, leaf, mode, concrete) for mode in (True, False))
    seen = train_reads is not None and eval_reads is not None
    if _same_capture(train, evaluated) and (not seen or _either_mode(train_reads, eval_reads)):
        return {None: train}
    every = None
    if not seen or not (train_reads or eval_reads):
        # The graphs differ where no read of `.training` was seen (a class's own `training`
        # property, or the capture did not start from its copy's train()): every module whose
        # code is captured may have been read.
        called = {n.target for c in (train, evaluated) for n in c.graph.nodes if n.op == "call_module"}
        every = [p for p, _ in model.named_modules()
                 if not any(p == leaf_path or p.startswith(leaf_path + ".") for leaf_path in called)]
        train_reads, eval_reads = dict.fromkeys(every, True), dict.fromkeys(every, False)
    captured = {_mode_spec(train_reads): train, _mode_spec(eval_reads): evaluated}
    now = {p: m.training for p, m in model.named_modules(remove_duplicate=False)}
    if seen and not any(_serves(spec, now) for spec in captured):
        as_is, reads = _watched_capture(source, leaf, True, concrete, as_is=True)
        if reads is not None:
            captured.setdefault(_mode_spec({p: now[p] for p in every} if every is not None else reads), as_is)
    return captured


def _either_mode(train_reads: dict[str, Any], eval_reads: dict[str, Any]) -> bool:
    """Whether two captures that made the same graph, one with every module in train mode and
    one in eval mode, show that the graph is the same whatever the modes: forward read no
    module's mode, or one module's, in the two captures in both modes (a model whose own
    ``train()`` keeps a layer in eval mode reads that layer's mode only as eval)."""
    if not train_reads and not eval_reads:
        return True
    return len(train_reads) == len(eval_reads) == 1 and train_reads.keys() == eval_reads.keys() \
        and {*train_reads.values(), *eval_reads.values()} == {True, False}


def _mode_spec(reads: dict[str, Any]) -> tuple:
    """The modes a capture serves, as a graph's key holds them: ``((path, training), ...)`` of the
    modules whose ``training`` its forward read (sorted by path)."""
    return tuple(sorted(reads.items()))


def _serves(spec: tuple, modes: dict[str, Any]) -> bool:
    """Whether a capture of ``spec`` (:func:`_mode_spec`) is right for modules in ``modes``."""
    return all(p in modes and modes[p] == v for p, v in spec)


# ---- what a capture's forward does that its graph does not show -----------------------------
# Which modules' train/eval mode a forward reads decides which modes its capture serves. While
# _watched_capture runs, nn.Module's `training` is a property that records reads of the traced
# copy's modules (the value stays in each module's __dict__, as torch keeps it); torch.fx and
# hfkern patch torch's classes while they trace in the same way.
class _CaptureWatch:
    """One capture's record (:func:`_watched_capture`): the traced copy (``root``, from its
    ``train()``: :func:`_capture_root`), its modules' paths, the ``training`` values its forward
    read (path -> value; not of a module whose mode forward set before), and each module's
    registered parameters, buffers and submodules before the trace."""

    def __init__(self, as_is: bool):
        self.as_is = as_is  # keep the copy's modes as they are (else the capture's train(mode))
        self.root: nn.Module | None = None
        self.paths: dict[int, str] = {}
        self.reads: dict[str, Any] = {}
        self.written: set[int] = set()
        self.registered: dict[str, tuple[dict, dict, frozenset]] = {}

    def begin(self, root: nn.Module) -> None:
        self.root = root
        self.paths = {}
        for path, module in root.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(module), path)
        self.written = set()
        self.registered = {path: (dict(m._parameters), dict(m._buffers), frozenset(m._modules))
                           for path, m in root.named_modules()}


_WATCH = threading.local()
_WATCH_LOCK = threading.Lock()
_watchers = 0
_HFKERN_DIR = os.path.dirname(__file__) + os.sep  # (hfkern's own files, as their code objects name them)


def _read_training(module: nn.Module) -> Any:
    try:
        value = module.__dict__["training"]
    except KeyError:
        raise AttributeError("training") from None  # (nn.Module.__getattr__ says it, as without the watch)
    watch = getattr(_WATCH, "current", None)
    if watch is not None:
        path = watch.paths.get(id(module))
        # (hfkern's own reads, its capture checking the modes, are not the forward's)
        if path is not None and id(module) not in watch.written \
                and not sys._getframe(1).f_code.co_filename.startswith(_HFKERN_DIR):
            watch.reads.setdefault(path, value)
    return value


def _write_training(module: nn.Module, value: Any) -> None:
    module.__dict__["training"] = value
    watch = getattr(_WATCH, "current", None)
    if watch is not None and id(module) in watch.paths:
        watch.written.add(id(module))  # what forward reads after this is what it set


def _delete_training(module: nn.Module) -> None:
    del module.__dict__["training"]


_TRAINING = property(_read_training, _write_training, _delete_training)


@contextlib.contextmanager
def _watching(watch: _CaptureWatch) -> Iterator[None]:
    global _watchers
    with _WATCH_LOCK:
        if _watchers == 0 and "training" not in vars(nn.Module):
            nn.Module.training = _TRAINING
        _watchers += 1
    previous = getattr(_WATCH, "current", None)
    _WATCH.current = watch
    try:
        yield
    finally:
        _WATCH.current = previous
        with _WATCH_LOCK:
            _watchers -= 1
            if _watchers == 0 and vars(nn.Module).get("training") is _TRAINING:
                del nn.Module.training


def _capture_root(self: nn.Module, mode: bool = True) -> nn.Module:
    """``train`` of the model :func:`_watched_capture` gives ``_capture.capture``, which calls it
    on its copy (``copy.deepcopy(model).train(mode)``; the bound method follows the copy): it
    puts the copy's modules in ``mode`` (or leaves them as they are) and starts watching it."""
    self.__dict__.pop("train", None)
    watch = getattr(_WATCH, "current", None)
    if watch is None or not watch.as_is:
        self.train(mode)
    if watch is not None:
        watch.begin(self)
    return self


def _capture_source(model: nn.Module) -> nn.Module:
    """``model`` for ``_capture.capture`` (which copies it and leaves it untouched): a shallow copy
    of its root (its submodules and tensors shared) whose ``train()`` is :func:`_capture_root`."""
    try:
        source = copy.copy(model)
    except Exception:  # noqa: BLE001 - a root that copy.copy refuses (a parametrized model): its modules copied
        memo: dict[int, Any] = {}
        for module in model.modules():
            for t in itertools.chain(module._parameters.values(), module._buffers.values(), vars(module).values()):
                if isinstance(t, torch.Tensor):
                    memo[id(t)] = t
        source = copy.deepcopy(model, memo)
    source.__dict__["train"] = types.MethodType(_capture_root, source)
    return source


def _watched_capture(source: nn.Module, leaf: Callable[[nn.Module], bool], mode: bool, concrete: dict,
                     as_is: bool = False) -> tuple[_capture.Captured, dict[str, Any] | None]:
    """``_capture.capture`` of ``source`` (:func:`_capture_source`) in ``mode`` (``as_is``: in the
    modes its modules have), and the modules whose ``training`` its forward read (None: unknown,
    the capture did not start from its copy's ``train()``). Refuses parameters, buffers and
    submodules registered in forward (``self.register_buffer(...)``), which the graph does not show."""
    watch = _CaptureWatch(as_is)
    with _watching(watch):
        captured = _capture.capture(source, leaf, mode, concrete=concrete)
    if watch.root is None:
        return captured, None
    problem = _registration_problem(watch, captured.graph)
    if problem is not None:
        raise FuseError(f"fuse: cannot capture the model: {problem}")
    return captured, watch.reads


def _registration_problem(watch: _CaptureWatch, graph: fx.Graph) -> str | None:
    """A parameter, buffer or submodule that the traced forward registered (``register_buffer``,
    ``register_parameter``, ``add_module``; assignments are recorded or refused by the capture
    itself), or None."""
    root = watch.root
    assigned = {(t.path, t.name) for node in graph.nodes
                if isinstance(t := node.target, _capture.AssignState) and t.kind == "buffer"}
    for path, (parameters, buffers, modules) in watch.registered.items():
        try:
            module = root.get_submodule(path)
        except AttributeError:
            continue
        here = _capture.where((path, type(module).__name__), root)
        fixed = ("a fused model's parameters, buffers and submodules are fixed when it is made (its "
                 "state_dict holds them from the start)")
        for kind, before, now, how in (("parameter", parameters, module._parameters, "register_parameter"),
                                       ("buffer", buffers, module._buffers, "register_buffer")):
            for name, value in now.items():
                label = f"{path}.{name}" if path else name
                if name not in before:
                    return (f"forward registers the new {kind} {label!r} (`{how}` in forward) {here}; {fixed}. "
                            f"Register it in __init__ (with its initial value) and assign it in forward "
                            f"(self.{name} = value)")
                if value is not before[name] and (kind == "parameter" or (path, name) not in assigned):
                    return (f"forward registers {kind} {label!r} again (`{how}` in forward) {here}, which the "
                            f"captured forward would not do per model and per call; assign it instead "
                            f"(self.{name} = value)")
        for name in module._modules:
            if name not in modules:
                label = f"{path}.{name}" if path else name
                return (f"forward registers the new submodule {label!r} (`add_module`/`register_module` in "
                        f"forward) {here}; {fixed}. Create submodules in __init__")
    return None


def _capture_and_rewrite(model: nn.Module, B: int, opaque: dict[type, str], key: tuple, arguments: tuple,
                         fused: FusedModel) -> tuple[dict, dict, frozenset]:
    """The rewritten graphs (keyed ``(mode, key)``) of ``fused``'s forward for calls whose None and
    bool arguments are ``key``'s, captured from ``model`` (model 0 of ``fused``): they must run
    on the fused model as :func:`fuse` made it, for a call it did not capture. Also returns
    the new constants (``target -> (name, value)``) and the model's own attributes they assign."""
    array_classes = _array_classes()
    captured = _captured(model, array_classes, opaque, key, arguments)
    # Modes captured before (a capture for modes set after fusing captures every module in train
    # and in eval mode again): those graphs and their constants stay as they are.
    captured = {mode: c for mode, c in captured.items() if (mode, key) not in fused._own_graphs}
    graphs = {mode: c.graph for mode, c in captured.items()}
    leaves = {node.target: model.get_submodule(node.target)
              for g in graphs.values() for node in g.nodes if node.op == "call_module"}
    for path, module in leaves.items():
        if type(module) in array_classes and path not in fused._array_leaves_set:
            raise FuseError(
                f"this call runs module {path!r} ({type(module).__name__}), which none of the calls fuse "
                "captured runs (forward's arguments at their defaults; every argument whose default is None "
                "given), so it did not become an array module of the fused model, and this call cannot run")
        if any(path.startswith(p + ".") for p in fused._array_paths):
            raise FuseError(f"this call runs module {path!r} ({type(module).__name__}), inside an array module "
                            "of the fused model, on its own")
    attribute_state = _attribute_state(graphs, [model])
    new = [".".join(filter(None, pn)) for pn in attribute_state if pn not in fused._attribute_state]
    if new:
        raise FuseError(f"this call assigns tensor attributes {new}, which the call captured by fuse does not; "
                        "the fused model holds no per-model state for them")
    state = {".".join(filter(None, pn)) for pn in fused._attribute_state}
    taken = sum(1 for k in vars(fused) if k.startswith("_hfkern_constant_"))
    constants: dict[tuple, tuple[str, torch.Tensor]] = {}
    for mode, c in captured.items():
        for target, value in c.constants.items():
            if target in state:
                continue
            if target in fused._differing_attributes:
                raise FuseError(
                    f"tensor attribute {target!r} (neither a parameter nor a buffer) differs between the models; "
                    "forward reads it as one value for every model. Register it as a buffer "
                    "(self.register_buffer) so that each model has its own")
            constants[(mode, target)] = (f"_hfkern_constant_{taken + len(constants)}", value)
    root_assigned = set()
    for g in graphs.values():
        for node in g.nodes:
            t = node.target
            if isinstance(t, _capture.AssignState) and not t.path and t.kind == "attribute" \
                    and t.name not in fused._root_assigned:
                if hasattr(fused, t.name):
                    raise FuseError(f"the model's forward assigns attribute {t.name!r}, a name the "
                                    "fused model uses itself; rename the attribute")
                root_assigned.add(t.name)
    for name in root_assigned:
        if name in vars(model) and not isinstance(vars(model)[name], torch.Tensor):
            object.__setattr__(fused, name, copy.deepcopy(vars(model)[name]))
    rewritten = {(mode, key): _rewrite(g, model, B, leaves, array_classes, opaque,
                                       {target: name for (m, target), (name, _) in constants.items() if m == mode},
                                       list(fused._attribute_state))
                 for mode, g in graphs.items()}
    return rewritten, constants, frozenset(root_assigned)


def _differing_attributes(models: list[nn.Module]) -> frozenset[str]:
    """The tensor attributes (neither parameters nor buffers) that differ between the models."""
    first, found = models[0], set()
    for path, module in first.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                for m in models[1:]:
                    theirs = vars(m.get_submodule(path)).get(name)
                    if not isinstance(theirs, torch.Tensor) or not _equal(theirs, value):
                        found.add(f"{path}.{name}" if path else name)
                        break
    return frozenset(found)


def _build(models: list[nn.Module], B: int, factory, opaque: dict[type, str]) -> FusedModel:
    first = models[0]
    array_classes = _array_classes()
    opaque = {c: s for c, s in opaque.items() if any(isinstance(m, c) for m in first.modules())}

    # Capture, from a copy of model 0, for a call that leaves forward's arguments at their
    # defaults, and for one that gives every argument whose default is None (so that the modules
    # such a call runs become array modules too); other calls capture when first made (as does
    # that one, where it cannot be captured: the error comes with such a call).
    arguments = _forward_arguments(first)
    key = arguments[2]
    captured = {(mode, key): c for mode, c in _captured(first, array_classes, opaque, key, arguments).items()}
    given = tuple(... if d is None else d for d in key)
    if given != key:
        try:
            captured.update({(mode, given): c for mode, c in
                             _captured(first, array_classes, opaque, given, arguments).items()})
        except FuseError:
            pass
    graphs = {k: c.graph for k, c in captured.items()}
    attribute_state = _attribute_state(graphs, models)
    constants = _constants(captured, models, attribute_state)

    fused = FusedModel()
    fused.B = B
    object.__setattr__(fused, "model_class", type(first))
    object.__setattr__(fused, "_factory", factory)
    object.__setattr__(fused, "_template", copy.deepcopy(first).to("meta"))

    # The hierarchy: model 0's, leaves replaced, every other tensor stacked.
    root = copy.deepcopy(first)
    leaves: dict[str, nn.Module] = {
        node.target: first.get_submodule(node.target)
        for g in graphs.values() for node in g.nodes if node.op == "call_module"
    }
    array_leaves = [p for p, m in leaves.items() if type(m) in array_classes]
    # every name of an array leaf (a module may be registered under several)
    array_paths = [p for p, m in first.named_modules(remove_duplicate=False)
                   if any(m is leaves[path] for path in array_leaves)]
    # The modules of an array class that do not become array modules (never called; read only, as
    # timm's attention reads its dropout's p) are model 0's in the fused model: they must agree.
    for i, m in enumerate(models[1:], start=1):
        problem = _architecture_problem(first, m, "model 0", f"model {i}", array_paths=array_paths)
        if problem is not None:
            raise FuseError(f"fuse: {problem}")
    for path in array_leaves:
        _put_everywhere(root, path, array_classes[type(leaves[path])].from_modules(
            [m.get_submodule(path) for m in models]))
    stacked: list[tuple[str, str]] = []
    in_array_leaf = lambda p: any(p == a or p.startswith(a + ".") for a in array_paths)  # noqa: E731
    with torch.no_grad():
        for path, module in first.named_modules():
            if in_array_leaf(path):
                continue
            target = root.get_submodule(path)
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                value = torch.stack([m.get_submodule(path)._parameters[name] for m in models])
                target._parameters[name] = nn.Parameter(value, requires_grad=p.requires_grad)
                stacked.append((path, name))
            for name, buf in list(module._buffers.items()):
                if buf is None:
                    continue
                target._buffers[name] = torch.stack([m.get_submodule(path)._buffers[name] for m in models])
                stacked.append((path, name))
    # Parameters tied in the model (an output head sharing the embedding) stay tied.
    ties: list[list[str]] = []
    by_id: dict[int, list[str]] = {}
    for name, p in first.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for names in by_id.values():
        if len(names) > 1:
            ties.append(names)
            head = root.get_parameter(names[0])
            for name in names[1:]:
                owner, attr = _parent(root, name)
                if owner.get_parameter(attr).shape != head.shape:
                    raise FuseError(f"fuse: tied parameters {names} have different array shapes")
                setattr(owner, attr, head)
    for name, child in root._modules.items():  # (named_children would skip a second name of a child)
        if child is not None:
            fused.add_module(name, child)
    for name, p in root._parameters.items():
        fused.register_parameter(name, p)
    for name, buf in root._buffers.items():
        fused.register_buffer(name, buf, persistent=name not in root._non_persistent_buffers_set)

    root_assigned = set()
    for g in graphs.values():
        for node in g.nodes:
            t = node.target
            if isinstance(t, _capture.AssignState) and not t.path and t.kind == "attribute":
                if t.name in root_assigned:
                    continue
                root_assigned.add(t.name)
                if hasattr(fused, t.name):
                    raise FuseError(f"fuse: the model's forward assigns attribute {t.name!r}, a name the "
                                    "fused model uses itself; rename the attribute")
                if t.name in vars(first) and not isinstance(vars(first)[t.name], torch.Tensor):
                    # The value before the first call, as each model has it (submodules are copies).
                    object.__setattr__(fused, t.name, copy.deepcopy(vars(first)[t.name]))
    for path, name in attribute_state:  # tensor attributes forward assigns: per-model state
        object.__setattr__(fused.get_submodule(path), name,
                           torch.stack([getattr(m.get_submodule(path), name) for m in models]))
    for name, value in constants.values():
        object.__setattr__(fused, name, value)
    object.__setattr__(fused, "_array_leaves", tuple(array_leaves))
    object.__setattr__(fused, "_array_leaves_set", frozenset(array_leaves))
    object.__setattr__(fused, "_array_paths", tuple(array_paths))
    object.__setattr__(fused, "_stacked", tuple(stacked))
    object.__setattr__(fused, "_attribute_state", tuple(attribute_state))
    object.__setattr__(fused, "_ties", ties)
    object.__setattr__(fused, "_arguments", arguments)
    object.__setattr__(fused, "_default_key", key)
    object.__setattr__(fused, "_opaque", opaque)
    object.__setattr__(fused, "_root_assigned", frozenset(root_assigned))
    object.__setattr__(fused, "_differing_attributes", _differing_attributes(models))
    rewritten = {k: _rewrite(g, first, B, leaves, array_classes, opaque,
                             {target: name for (m, target), (name, _) in constants.items() if m == k},
                             attribute_state)
                 for k, g in graphs.items()}
    object.__setattr__(fused, "_read_attributes", _read_attributes(constants))
    object.__setattr__(fused, "_hook_refs", _hook_references(first))
    object.__setattr__(fused, "_own_graphs", rewritten)
    fused._run_graphs(rewritten)
    # Each module in the mode it has in the models (a batch norm kept in eval mode in a model
    # that trains), the array modules' own submodules in their owner's.
    # (named_modules lists a module before its submodules: each ends in its own mode)
    for path, module in first.named_modules():
        fused.get_submodule(path).train(module.training)
    return fused


def _same_capture(a: _capture.Captured, b: _capture.Captured) -> bool:
    """Whether the train and eval captures are one forward (the same code and constants)."""
    return a.graph.python_code("self").src == b.graph.python_code("self").src \
        and a.constants.keys() == b.constants.keys() \
        and all(_equal(a.constants[k], b.constants[k]) for k in a.constants)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and _same_tensor_values(a, b)


def _attribute_state(graphs: dict, models: list[nn.Module]) -> list[tuple[str, str]]:
    """Tensor attributes (neither parameters nor buffers) that forward assigns: ``(path, name)``.

    They are state each model updates; the fused model holds them stacked, like buffers.
    """
    found = []
    for g in graphs.values():
        for node in g.nodes:
            t = node.target
            if isinstance(t, _capture.AssignState) and t.kind == "attribute" and (t.path, t.name) not in found:
                if isinstance(getattr(models[0].get_submodule(t.path), t.name, None), torch.Tensor):
                    found.append((t.path, t.name))
    for path, name in found:
        ref = getattr(models[0].get_submodule(path), name)
        for i, m in enumerate(models[1:], start=1):
            value = getattr(m.get_submodule(path), name, None)
            if not isinstance(value, torch.Tensor) or value.shape != ref.shape or value.dtype != ref.dtype:
                raise FuseError(f"fuse: tensor attribute {'.'.join(filter(None, (path, name)))!r} differs "
                                f"in shape or dtype between models 0 and {i}")
    return found


def _constants(captured: dict, models: list[nn.Module], attribute_state: list[tuple[str, str]]
               ) -> dict[tuple, tuple[str, torch.Tensor]]:
    """``(graph key, target) -> (name on the fused model, value)`` for every constant tensor of the graphs.

    A tensor attribute of the model (neither parameter nor buffer) that forward only reads is one
    value for every model, so the models must agree on it; tensors made in forward from Python
    values (fx's ``_tensor_constant``) are the same for every model by construction.
    """
    state = {".".join(filter(None, pn)) for pn in attribute_state}
    out = {}
    for mode, c in captured.items():
        for target, value in c.constants.items():
            if target in state:
                continue
            path, _, name = target.rpartition(".")
            if not name.startswith("_tensor_constant"):
                for i, m in enumerate(models[1:], start=1):
                    problem = _tensor_attribute_problem(target, value, getattr(m.get_submodule(path), name, None),
                                                        f"models 0 and {i}")
                    if problem is not None:
                        raise FuseError(f"fuse: {problem}")
            out[(mode, target)] = (f"_hfkern_constant_{len(out)}", value)
    return out


def _read_attributes(constants: dict[tuple, tuple[str, torch.Tensor]]) -> frozenset[str]:
    """The tensor attributes (neither parameters nor buffers) that captured forwards read as
    constants, of :func:`_constants`' (or a later capture's) entries."""
    return frozenset(target for _, target in constants if not target.rpartition(".")[2].startswith("_tensor_constant"))


def _tensor_attribute_problem(target: str, ref: torch.Tensor, theirs: Any, between: str) -> str | None:
    """Why a model whose tensor attribute ``target`` (neither a parameter nor a buffer, read by
    the captured forward as one constant) is ``theirs`` cannot be fused with one where it is
    ``ref`` (or loaded into such a fused model), or None. A model on another device compares
    its values (:meth:`FusedModel.load_model` takes models on any device)."""
    if isinstance(theirs, torch.Tensor) and theirs.shape == ref.shape and theirs.dtype == ref.dtype and (
            _same_tensor_values(ref, theirs.to(ref.device))):
        return None
    return (f"tensor attribute {target!r} (neither a parameter nor a buffer) differs between {between}; "
            "forward reads it as one value for every model. Register it as a buffer "
            "(self.register_buffer) so that each model has its own")


def _every_model(value: torch.Tensor, B: int, copy: bool) -> torch.Tensor:
    """A value every model shares as an array value (``[B, *value.shape]``); ``copy``: own memory
    (for state that may be updated in place), else a broadcast view."""
    value = value.unsqueeze(0).expand(B, *value.shape)
    return value.clone() if copy else value


class _Assign(_capture.GraphTarget):
    """``module.<name> = value`` of a captured forward, on the fused model's module.

    A value that is not an array value (a tensor made from Python values) is every
    model's: it is given the array dim (a copy for a buffer, which may be updated in place).
    """

    def __init__(self, name: str, kind: str, array: bool, B: int):
        self.name, self.kind, self.array, self.B = name, kind, array, B
        self._named(f"assign_{kind}_{name}")

    def __call__(self, owner: nn.Module, value: Any) -> None:
        if isinstance(value, torch.Tensor) and not self.array:
            value = _every_model(value, self.B, copy=self.kind == "buffer")
        if self.kind == "buffer":
            owner._buffers[self.name] = value  # what Module.__setattr__ does for a registered buffer
        else:
            object.__setattr__(owner, self.name, value)


class _SetData(_capture.GraphTarget):
    """``tensor.data = value`` of a captured forward, on a stacked parameter or buffer."""

    def __init__(self, array: bool, B: int):
        self.array, self.B = array, B
        self._named("per_model_set_data")

    def __call__(self, tensor: torch.Tensor, value: Any) -> None:
        if not self.array:
            value = _every_model(value, self.B, copy=True)
        tensor.data = value


class _Draw(_capture.GraphTarget):
    """A random factory call of a captured forward (``torch.randn(3)``), drawn once per model."""

    def __init__(self, fn: Callable, B: int):
        self.fn, self.B = fn, B
        self._named(f"per_model_{getattr(fn, '__name__', 'draw')}")

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.stack([self.fn(*args, **kwargs) for _ in range(self.B)])


# ---- views that in-place writes go through ---------------------------------------------------
# `x.view(shape)` is a view of x in torch, always (or an error). On the array it is one where the
# array's memory allows it; where the array ops laid it out otherwise (a linear on a shared input,
# a convolution's output: [B, N, ...] views of [N, B, ...] memory), _view makes a copy, which is
# the same value unless something writes in place through the view, or into its source while the
# view is read. For such a view the source is given memory where the view can alias it (its
# contiguous copy, which replaces the source for everything after): just before the view, where
# nothing made earlier that shares the source's memory is read after the view; else just after
# the source is made, where nothing it shares memory with is read after that. Where neither
# holds (the source is, or may share memory with, the model's state or an input), the view must
# alias as it is, else the fused forward raises FuseError naming the statement.

# Calls whose result never shares memory with their arguments.
_FRESH_FUNCTIONS = (
    (_ELEMENTWISE_FUNCTIONS - {F.dropout, F.alpha_dropout} - _capture._INPLACE_OPERATORS)
    | {getattr(torch, name) for name in (
        "cat", "concat", "concatenate", "stack", "matmul", "bmm", "mm", "baddbmm", "addmm", "einsum", "outer",
        "sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "norm", "var",
        "std", "softmax", "log_softmax", "cumsum", "cumprod", "clone", "gather", "index_select", "tril", "triu",
        "sort", "topk", "argsort", "flip", "roll", "repeat_interleave", "eq", "ne", "lt", "le", "gt", "ge")}
    | {getattr(F, name) for name in (
        "softmax", "log_softmax", "linear", "bilinear", "layer_norm", "group_norm", "batch_norm", "instance_norm",
        "normalize", "embedding", "scaled_dot_product_attention", "conv1d", "conv2d", "conv3d",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "pad", "interpolate", "avg_pool1d",
        "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "adaptive_avg_pool1d",
        "adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d", "one_hot", "cross_entropy",
        "nll_loss", "mse_loss", "l1_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits")}
    | {operator.matmul}
    | set(_capture.RANDOM_FUNCTIONS)
    | {getattr(torch, name) for name in _capture._SIZED_FACTORIES}
)
_FRESH_METHODS = (
    {m for m in _ELEMENTWISE_METHODS if not m.endswith("_")}
    - {"to", "float", "double", "half", "bfloat16", "type_as", "detach", "contiguous"}
) | {"sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "norm", "var", "std",
     "softmax", "log_softmax", "cumsum", "cumprod", "matmul", "bmm", "mm", "outer", "__matmul__", "clone",
     "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "repeat", "gather", "index_select", "tril",
     "triu", "sort", "topk", "argsort", "flip", "roll", "repeat_interleave", "eq", "ne", "lt", "le", "gt", "ge",
     "all", "any", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__pow__", "__rpow__",
     "__floordiv__", "__mod__", "__and__", "__or__", "__invert__"}
# Calls whose result may share memory with their first argument only.
_VIEW_FUNCTIONS = {torch.flatten, torch.reshape, torch.transpose, torch.swapaxes, torch.permute,
                   torch.unsqueeze, torch.squeeze, torch.narrow, torch.select, torch.unbind, torch.chunk,
                   torch.split, torch.tensor_split, torch.diagonal, torch.movedim, torch.t, torch.detach,
                   torch.unflatten, operator.getitem, builtins.getattr}


_SIGNATURES: dict[Callable, inspect.Signature | None] = {}


def _inplace_flag(node: fx.Node) -> bool:
    """Whether a function call asks for ``inplace`` (F.relu(x, inplace=True), F.dropout(x, p, True, True))."""
    if "inplace" in node.kwargs:
        flag = node.kwargs["inplace"]
        return isinstance(flag, fx.Node) or bool(flag)
    fn = node.target
    if not callable(fn) or isinstance(fn, _capture.GraphTarget):
        return False
    try:
        signature = _SIGNATURES[fn]
    except (KeyError, TypeError):
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature (a builtin)
            signature = None
        with contextlib.suppress(TypeError):  # (an unhashable callable)
            _SIGNATURES[fn] = signature
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:  # not a call this signature takes
        return False
    flag = bound.arguments.get("inplace", False)
    return isinstance(flag, fx.Node) or bool(flag)


def _module_of(node: fx.Node, model: nn.Module) -> nn.Module:
    return model.get_submodule(node.target)


def _alias_sources(node: fx.Node, model: nn.Module, array_classes: dict) -> list[fx.Node]:
    """The nodes whose tensors ``node``'s result may share memory with (conservatively: every
    input of a call not known to return new tensors or views of its first argument)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return []
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op == "call_module":
        module = _module_of(node, model)
        aliasing = isinstance(module, (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)) \
            or getattr(module, "inplace", False) is True
        if type(module) in array_classes or type(module).__module__.startswith("torch.nn.modules."):
            return first if aliasing else []
        return list(node.all_input_nodes)  # a module of the user's (run under vmap or in a loop)
    if isinstance(node.target, (_capture.AssignState, _capture.SetData)):
        # the model's state holds the value's memory from here on (`param.data = value`: the
        # parameter's, which the value then shares)
        return [a for a in node.args if isinstance(a, fx.Node)]
    if isinstance(node.target, _capture.RandomDraw) or _is_metadata(node):
        return []
    if node.op == "call_method":
        name = node.target
        if name in _FRESH_METHODS:
            return []
        if name.endswith("_") and not name.endswith("__") or name in _VIEW_METHOD_NAMES:
            return first
    else:
        fn = node.target
        if fn in _FRESH_FUNCTIONS and not (fn in _ELEMENTWISE_FUNCTIONS and _inplace_flag(node)):
            return []
        if fn in _VIEW_FUNCTIONS or fn in _capture._INPLACE_OPERATORS \
                or getattr(fn, "__name__", "").endswith("_") or _inplace_flag(node):
            return first
    return [n for n in node.all_input_nodes if not _is_metadata(n)]


_VIEW_METHOD_NAMES = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "swapaxes", "swapdims", "t",
    "permute", "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "select", "unbind", "chunk", "split",
    "tensor_split", "split_with_sizes", "__getitem__", "diagonal", "as_strided", "unfold", "movedim",
    "moveaxis", "detach", "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16",
    "int", "long", "bool", "requires_grad_", "__iadd__", "__isub__", "__imul__", "__itruediv__"}


def _written(node: fx.Node, model: nn.Module, array_classes: dict) -> list[fx.Node]:
    """The nodes whose tensors ``node`` may write in place (conservatively: every input of a
    module without an array version that is not an element-wise one)."""
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op == "call_method":
        name = node.target
        if (name.endswith("_") and not name.endswith("__") and name != "requires_grad_") \
                or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
            return first
        return []
    if node.op == "call_function":
        fn = node.target
        if isinstance(fn, _capture.SetData):
            return first
        if isinstance(fn, _capture.GraphTarget):
            return []
        out = node.kwargs.get("out")
        outs = [n for n in tree_flatten(out)[0] if isinstance(n, fx.Node)]
        if fn in _capture._INPLACE_OPERATORS or getattr(fn, "__name__", "").endswith("_") \
                or (not _is_metadata(node) and _inplace_flag(node)):
            return first + outs
        return outs
    if node.op == "call_module":
        module = _module_of(node, model)
        if type(module) in array_classes or type(module).__module__.startswith("torch.nn.modules."):
            return first if getattr(module, "inplace", False) is True else []
        return list(node.all_input_nodes)  # a module of the user's (run under vmap or in a loop)
    return []


# Calls that torch makes views of their (contiguous) source (``contiguous``: the source itself),
# and that the array may have to copy:
# a model's tensor is contiguous where the array's per-model slice need not be (a linear on a
# shared input returns a [B, N, ...] view of [N, B, ...] memory).
_RESHAPING_METHODS = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "contiguous"}
_RESHAPING_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten}


# Views that may be non-contiguous in torch (a reshape of one copies).
_STRIDED_VIEW_METHODS = {"transpose", "swapaxes", "swapdims", "t", "permute", "expand", "expand_as", "narrow",
                         "select", "unbind", "chunk", "split", "tensor_split", "split_with_sizes", "__getitem__",
                         "diagonal", "as_strided", "unfold", "movedim", "moveaxis", "mT", "T"}
_STRIDED_VIEW_FUNCTIONS = {torch.transpose, torch.swapaxes, torch.permute, torch.narrow, torch.select, torch.unbind,
                           torch.chunk, torch.split, torch.tensor_split, torch.diagonal, torch.movedim, torch.t,
                           operator.getitem}


def _strided_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _STRIDED_VIEW_METHODS
    if node.op == "call_function":
        return node.target in _STRIDED_VIEW_FUNCTIONS or (node.target is builtins.getattr
                                                          and node.args[1:2] in (("mT",), ("T",)))
    return False


def _reshaping(node: fx.Node) -> bool:
    if not (node.args and isinstance(node.args[0], fx.Node)) or _memory_format_of(node) is not None:
        return False  # (a channels-last `contiguous` is its source or a copy: _FormatCall)
    return ((node.op == "call_method" and node.target in _RESHAPING_METHODS)
            or (node.op == "call_function" and node.target in _RESHAPING_FUNCTIONS))


def _alias_groups(graph: fx.Graph, model: nn.Module, array_classes: dict
                  ) -> tuple[dict[fx.Node, int], Callable[[fx.Node], fx.Node], list[tuple[int, fx.Node]]]:
    """(each node's position, ``find``: a node's group of nodes that may share memory (its
    root), the in-place writes as (position, group written))."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    parent: dict[fx.Node, fx.Node] = {}  # union-find of the nodes that may share memory

    def find(n: fx.Node) -> fx.Node:
        root = n
        while root in parent:
            root = parent[root]
        while n is not root:
            parent[n], n = root, parent[n]
        return root

    for node in nodes:
        for src in _alias_sources(node, model, array_classes):
            a, b = find(node), find(src)
            if a is not b:
                parent[a] = b
    writes = [(order[w], find(t)) for w in nodes for t in _written(w, model, array_classes)]
    return order, find, writes


def _written_after(graph: fx.Graph, model: nn.Module, array_classes: dict) -> set[fx.Node]:
    """The nodes whose memory (or memory they may share) is written in place after they are made."""
    order, find, writes = _alias_groups(graph, model, array_classes)
    last: dict[fx.Node, int] = {}
    for at, group in writes:
        last[group] = max(last.get(group, -1), at)
    return {n for n in graph.nodes if last.get(find(n), -1) > order[n]}


def _broadcast_written(args: tuple) -> bool:
    """Whether an in-place call's first argument is one tensor broadcast to the B models."""
    x = args[0] if args else None
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) > 1 and x.stride(0) == 0


def _may_broadcast(module: nn.Module) -> bool:
    """Whether a layer may return one tensor broadcast to the B models (on a shared input): one
    without state (a pooling, a norm without affine parameters, an evaluation dropout), and not
    an in-place one (which returns its input)."""
    return (next(module.parameters(), None) is None and next(module.buffers(), None) is None
            and getattr(module, "inplace", False) is not True)


def _own_memory(x: Any) -> Any:
    """A layer's result that the forward writes into: its own memory where it is one tensor
    broadcast to the B models (a pooling or an evaluation dropout of a shared input), as each
    model's layer returns a tensor of its own."""
    if isinstance(x, torch.Tensor) and x.dim() and x.size(0) > 1 and x.stride(0) == 0:
        return x.contiguous()
    return x


def _aliasing_views(graph: fx.Graph, model: nn.Module, array_classes: dict) -> dict[fx.Node, str | None]:
    """Reshaping calls (``x.view(...)``, ``reshape``, ``flatten``, ...) that must alias their
    source: something writes in place, after the call, into a tensor that may share its memory
    (the result, its source, a view of either), and a tensor made before the call that shares it
    is read after it (else which of them the write reaches is not seen). The value says where
    the source may be given new memory for the view (None: nowhere): "view", just before the
    call (nothing made before it that shares the source's memory is read after it; the source
    itself excepted, whose later readers read the new memory), or "source", just after the
    source is made (nothing made before the source that shares its memory is read after that);
    never where one of them is the model's state or an input.

    ``view`` always aliases in torch; ``reshape`` and ``flatten`` alias a contiguous tensor
    and copy another: where the source is itself a view (a transpose, a slice), which torch may
    hold non-contiguous, it is not given new memory (None), so the call aliases where the
    array's memory allows and raises a FuseError otherwise."""
    nodes = list(graph.nodes)
    views = [n for n in nodes if _reshaping(n)]
    if not views:
        return {}
    order, find, writes = _alias_groups(graph, model, array_classes)
    found = {}
    for view in views:
        group = find(view)
        if not any(at > order[view] and g is group for at, g in writes):
            continue
        source = view.args[0]
        members = [n for n in nodes if find(n) is group]

        def read_after(at: int, but: fx.Node | None = None) -> bool:
            """Whether a tensor made before ``at`` that shares memory (``but`` excepted) is read
            after it (or kept by the model's state: an assignment in forward)."""
            return any((isinstance(n.target, _capture.AssignState) or any(order[u] >= at for u in n.users))
                       for n in members if order[n] < at and n is not but)

        if not any(n.op in ("placeholder", "get_attr") or isinstance(n.target, _capture.AssignState)
                   or any(order[u] > order[view] for u in n.users) for n in members if order[n] < order[view]):
            continue  # a copy is not seen: nothing made before the call is read after it, or kept
        if any(n.op in ("placeholder", "get_attr") for n in members):
            found[view] = None
        elif view.target not in ("view", "view_as") and _strided_view(source):
            found[view] = None  # a strided view's reshape: torch's copies where the view is not contiguous
        elif not read_after(order[view], source):
            found[view] = "view"
        elif not read_after(order[source] + 1, source):
            found[view] = "source"
        else:
            found[view] = None
    return found


def _shares_memory(y: Any, x: torch.Tensor) -> bool:
    return isinstance(y, torch.Tensor) and y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _contiguous(x):
    """``x`` in array memory where every view of its models' contiguous tensors is a view of it."""
    return x.contiguous()


class _AliasableSource(_ArrayCall):
    """Called as a reshaping call of the fused graph (``view``, ``reshape``, ...), returns its
    source: itself where the call is a view of it, else its contiguous copy (in which every
    reshaping of a model's values is a view)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0]
        try:
            y = super().__call__(*args, **kwargs)
        except RuntimeError:
            return x.contiguous()
        return x if _shares_memory(y, x) else x.contiguous()


class _AliasingCall(_ArrayCall):
    """A reshaping call (``view``, ``reshape``, ``flatten``, ...) that in-place writes go through
    (:func:`_aliasing_views`): its result must be a view of its source, or FuseError. ``where``:
    the user's line and module, for the message."""

    where = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(*args, **kwargs)
        if isinstance(args[0], torch.Tensor) and not _shares_memory(out, args[0]):
            shown = ", ".join([*("tensor" if isinstance(a, torch.Tensor) else str(a) for a in args[1:]),
                               *(f"{k}={v}" for k, v in kwargs.items())])
            call = f".{self.method}({shown})" if self.method else \
                f"torch.{getattr(self.fn, '__name__', 'reshape')}(x{', ' if shown else ''}{shown})"
            raise FuseError(
                f"fused forward: `{call}`{self.where} cannot be a view of its source in the fused model's "
                "memory, where the B models' values are laid out for the array ops, and the forward writes in "
                "place through the result or into its source while both are in use, so a copy would lose "
                "those writes. Write the update into the tensor itself rather than through a view, or give the "
                "tensor contiguous memory where it is made (`.contiguous()`)")
        return out


def _rewrite(graph: fx.Graph, model: nn.Module, B: int, leaves: dict[str, nn.Module],
             array_classes: dict, opaque: dict[type, str], constants: dict[str, str],
             attribute_state: list[tuple[str, str]]) -> fx.Graph:
    """The captured graph with every call made per model over the array dim.

    ``constants``: the graph's constant get_attr targets -> their names on the fused model.

    A tensor that is not an array value (``torch.zeros(x.size(0), 8)``: the same for every model)
    but that the forward writes in place with array values (``out[:, 1:7] = x``, ``.scatter_(1,
    idx, 1.0)``) is made each model's own where it is made (``[B, ...]`` copies), so the writes
    land per model: a rewrite finds such tensors, and the graph is rewritten again with them.
    """
    promoted: set[fx.Node] = set()
    while True:
        out, wanted = _rewrite_pass(graph, model, B, leaves, array_classes, opaque, constants, attribute_state,
                                    promoted)
        if wanted <= promoted:
            return out
        promoted |= wanted


def _fresh_sources(graph: fx.Graph, model: nn.Module, array_classes: dict) -> Callable[[fx.Node], list[fx.Node]]:
    """``sources(node)``: the nodes of ``graph`` that make new memory (a factory's, an arithmetic
    result's) which ``node``'s tensor may share (:func:`_alias_sources`, conservatively)."""
    groups = MemoryGroups()
    fresh = []
    for node in graph.nodes:
        sources = _alias_sources(node, model, array_classes)
        if not sources and node.op in ("call_function", "call_method") and not _is_metadata(node) \
                and not isinstance(node.target, _capture.GraphTarget):
            fresh.append(node)
        for src in sources:
            groups.join(node, src)
    return lambda node: [n for n in fresh if groups.find(n) is groups.find(node)]


class MemoryGroups:
    """The nodes of a graph whose tensors may share memory, as groups (union-find): ``join(a, b)``
    puts two in one group, ``find(n)`` gives the node that stands for ``n``'s group."""

    def __init__(self) -> None:
        self._parent: dict[fx.Node, fx.Node] = {}

    def find(self, n: fx.Node) -> fx.Node:
        while n in self._parent:
            n = self._parent[n]
        return n

    def join(self, a: fx.Node, b: fx.Node) -> None:
        a, b = self.find(a), self.find(b)
        if a is not b:
            self._parent[a] = b


def _rewrite_pass(graph: fx.Graph, model: nn.Module, B: int, leaves: dict[str, nn.Module],
                  array_classes: dict, opaque: dict[type, str], constants: dict[str, str],
                  attribute_state: list[tuple[str, str]], promoted: set[fx.Node]
                  ) -> tuple[fx.Graph, set[fx.Node]]:
    """One rewrite of :func:`_rewrite`, the nodes ``promoted`` made every model's own; also returns
    the nodes to promote for writes with array values into tensors that are not array values."""
    wanted: set[fx.Node] = set()
    sources_of = None
    params = {n for n, _ in _named_tensors(model)} | {".".join(filter(None, pn)) for pn in attribute_state}
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    array: dict[fx.Node, bool] = {}
    norm_activations = _norm_activations(graph, model, leaves, array_classes)
    fused_into = {act: norm for norm, (_, act) in norm_activations.items()}
    conv_norms = _conv_norms(graph, leaves, array_classes)
    convs_in_norms = set(conv_norms.values())
    aliasing = _aliasing_views(graph, model, array_classes)
    written_after = _written_after(graph, model, array_classes)
    sources = {view.args[0] for view, where in aliasing.items() if where == "source"}
    made = None  # the node made last
    for node in graph.nodes:
        if made in sources and env.get(made) is not None and array[made]:
            # in memory where views can alias it, for everything that reads it
            env[made] = out.call_function(_contiguous, (env[made],))
            env[made].meta.update(made.meta)
        made = node
        if node in fused_into:  # the activation ran in its norm's call: its value is that call's
            env[node], array[node] = env[fused_into[node]], array[fused_into[node]]
            continue
        if node in convs_in_norms:  # runs in its batch norm's call, which alone reads its value
            env[node], array[node] = None, True
            continue
        if aliasing.get(node) == "view" and array[node.args[0]]:
            # The source in memory the view can alias, for the view and all that reads it after.
            source = node.args[0]
            probe = _AliasableSource(node.target if node.op == "call_function" else None,
                                     fx.node.map_arg((tuple(node.args), dict(node.kwargs)), lambda n: array[n]),
                                     f"aliasable_{node.name}", node.target if node.op == "call_method" else None, B)
            env[source] = out.call_function(probe, fx.node.map_arg(tuple(node.args), lambda n: env[n]),
                                            fx.node.map_arg(node.kwargs, lambda n: env[n]))
            env[source].meta.update(node.meta)
        marks = fx.node.map_arg((tuple(node.args), dict(node.kwargs)), lambda n: array[n])
        any_array = any(array[n] for n in node.all_input_nodes)
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.op == "placeholder":
            env[node] = out.node_copy(node, lambda n: env[n])
            array[node] = True
        elif node.op == "get_attr":
            if node.target in constants:
                env[node] = out.get_attr(constants[node.target])
            else:
                env[node] = out.node_copy(node, lambda n: env[n])
            array[node] = node.target in params
        elif node.op == "output":
            # every output with B first: a value that is not an array value as each model's copy
            env[node] = out.output(fx.node.map_arg(node.args[0], lambda n: env[n] if array[n] else
                                                   out.call_function(_per_model_copies, (env[n], B))),
                                   type_expr=node.type)
        elif node.op == "call_module":
            module = leaves.get(node.target, model.get_submodule(node.target))
            cls = type(module)
            has_state = any(True for _ in _named_tensors(module))
            array[node] = any_array or has_state
            if cls in array_classes:
                data = _DATA_ARGS.get(array_classes[cls].__name__, (0,))
                if node in conv_norms:
                    conv = conv_norms[node]
                    data, args = (0,), (env[conv.args[0]],)  # the convolution's input (one data arg)
                    array[node] = True
                    node_args = conv.args
                else:
                    node_args = node.args
                shared = [i for i, a in enumerate(args)
                          if i in data and isinstance(a, fx.Node) and not array[node_args[i]]]
                args = tuple(out.call_function(_share, (a, B)) if i in shared else a for i, a in enumerate(args))
                if shared:
                    # the array module returns [B, ...] for an input it was given shared (a layer without
                    # state on a tensor made from constants: `self.pool(torch.ones(1, 1, 8, 8))`), each
                    # model's own draw where it is random (dropout)
                    array[node] = True
                array_name = array_classes[cls].__name__
                for name, (i, kind) in _MASK_ARGS.get(array_name, {}).items():
                    given = node_args[i] if i < len(node_args) else node.kwargs.get(name)
                    if not isinstance(given, fx.Node):
                        continue
                    # the data argument, [B, ...] (positional ones are shared above)
                    data_name = _DATA_NAMES[array_name]
                    data_value = args[0] if node_args else kwargs.get(data_name)
                    given_data = node_args[0] if node_args else node.kwargs.get(data_name)
                    if not (isinstance(given_data, fx.Node) and (node_args or array[given_data])):
                        data_value = None
                    check = _ExplicitMask(array_name, name, kind, data_name)
                    mask = out.call_function(check, (env[given], array[given], data_value))
                    if i < len(node_args):
                        args = (*args[:i], mask, *args[i + 1:])
                    else:
                        kwargs = {**kwargs, name: mask}
                if node in conv_norms:
                    activation, act = norm_activations.get(node, (None, None))
                    act_module = (out.get_attr(act.target),) if act is not None and act.op == "call_module" else ()
                    env[node] = out.call_function(_ConvNorm(activation), (
                        out.get_attr(conv_norms[node].target), out.get_attr(node.target), *args, *act_module))
                elif node in norm_activations:
                    activation, act = norm_activations[node]
                    act_module = (out.get_attr(act.target),) if act.op == "call_module" else ()
                    env[node] = out.call_function(
                        _NormActivation(activation), (out.get_attr(node.target), *args, *act_module))
                else:
                    env[node] = out.call_module(node.target, args, kwargs)
            elif isinstance(module, _ELEMENTWISE_MODULES) and type(module) in _ELEMENTWISE_MODULES:
                env[node] = out.call_module(node.target, args, kwargs)
            elif not array[node]:
                env[node] = out.call_module(node.target, args, kwargs)
            else:
                strategy = opaque.get(cls) or next(
                    (s for c, s in opaque.items() if isinstance(module, c)),
                    "loop" if isinstance(module, _LOOPED_BY_DEFAULT) else "vmap")
                template = copy.deepcopy(module).to("meta")
                call = _ModuleCall(template, marks, strategy, f"per_model_{cls.__name__}", B)
                call.aliased = node in written_after
                owner = out.get_attr(node.target)
                env[node] = out.call_function(call, (owner, *args), kwargs)
        elif isinstance(node.target, _capture.AssignState):
            t = node.target
            owner = out.get_attr(t.path or "_fused_self")
            value = node.args[0]
            is_array = isinstance(value, fx.Node) and array[value]
            env[node] = out.call_function(_Assign(t.name, t.kind, is_array, B), (owner, args[0]))
            array[node] = False
        elif isinstance(node.target, _capture.SetData):
            value = node.args[1]
            is_array = isinstance(value, fx.Node) and array[value]
            env[node] = out.call_function(_SetData(is_array, B), args)
            array[node] = False
        elif isinstance(node.target, _capture.RandomDraw):
            env[node] = out.call_function(_Draw(node.target.fn, B), args, kwargs)
            array[node] = True
        elif node.target is _capture.checkpoint_connects:
            # whether a reentrant checkpoint connects its outputs: read on the arrays (every model's
            # tensor requires grad where the array does), one Python value
            env[node] = out.call_function(node.target, args, kwargs)
            array[node] = False
        elif node.target is _capture.checkpoint_output or isinstance(node.target, _capture.PieceCount):
            # its first argument as it is (or detached; or checked): an array value where that is one
            env[node] = out.call_function(node.target, args, kwargs)
            array[node] = isinstance(node.args[0], fx.Node) and array[node.args[0]]
        elif node.op == "call_function" and isinstance(node.target, type) and dataclasses.is_dataclass(node.target):
            # A dataclass made in forward (fx records its constructor, the fields as keywords): made
            # of the fields' values, every tensor in it with B first, as every output has (a value
            # that is not an array value as each model's copy)
            fields = fx.node.map_arg(node.kwargs, lambda n: env[n] if array[n] else out.call_function(
                _per_model_copies, (env[n], B)))
            env[node] = out.call_function(node.target, args, fields)
            array[node] = True
        else:  # call_function, call_method
            if not any_array:
                first = node.args[0] if node.args else None
                random_functional = node.op == "call_function" and node.target in _capture.RANDOM_FUNCTIONALS
                if node.op == "call_function" and (node.target in _capture.RANDOM_FUNCTIONS
                                                   or random_functional and not _inplace_flag(node)):
                    # A draw whose arguments are shapes or other values every model shares
                    # (`F.dropout(torch.ones(4), 0.5, self.training)`): each model still draws its own numbers.
                    env[node] = out.call_function(_Draw(node.target, B), args, kwargs)
                    array[node] = True
                    continue
                if (random_functional or node.op == "call_method" and node.target in _capture._RANDOM_INPLACE) \
                        and isinstance(first, fx.Node):
                    # A draw in place into a tensor every model shares (`torch.empty(x.size(0), 4).normal_()`):
                    # the tensor must be each model's own from where it is made, each drawn per model.
                    if sources_of is None:
                        sources_of = _fresh_sources(graph, model, array_classes)
                    wanted.update(n for n in sources_of(first) if not array.get(n, True))
                env[node] = out.node_copy(node, lambda n: env[n])
                array[node] = False
                if node in promoted:  # written in place with array values later: each model's own
                    env[node] = out.call_function(_per_model_copies, (env[node], B))
                    env[node].meta.update(node.meta)
                    array[node] = True
                continue
            method = node.target if node.op == "call_method" else None
            fn = None if method else node.target
            label = method or getattr(fn, "__name__", "call")
            first = node.args[0] if node.args else None
            if _capture._inplace(node) and not (isinstance(first, fx.Node) and array[first]) \
                    and isinstance(first, fx.Node):
                # An in-place write of array values into a tensor that is not an array value: the
                # tensor it writes must be each model's own from where it is made.
                if sources_of is None:
                    sources_of = _fresh_sources(graph, model, array_classes)
                wanted.update(n for n in sources_of(first) if not array.get(n, True))
            if _is_metadata(node) or method in ("to", "type_as") and not (isinstance(first, fx.Node) and array[first]):
                # A shape query, or `torch.arange(n).type_as(x)`: x gives a dtype and device only,
                # and the result is one tensor for every model, as its source is.
                env[node] = out.call_function(_Metadata(fn, marks, f"one_model_{label}", method),
                                              args, kwargs)
                array[node] = False
            elif isinstance(fn, _capture.ApplyFunction):
                env[node] = out.call_function(_ApplyLoop(fn.fn, marks, f"per_model_{fn.__name__}"), args, kwargs)
                array[node] = True
            elif method == "detach_" or fn is torch.detach_:
                env[node] = out.call_function(_detach_, args, kwargs)
                array[node] = True
                if isinstance(first, fx.Node):  # every later reader of the tensor reads it detached
                    env[first] = env[node]
            else:
                cls = _ArrayCall
                if method in ("masked_fill", "masked_fill_", "fill_") or fn is torch.masked_fill:
                    value = node.args[-1] if len(node.args) == (2 if method == "fill_" else 3) else \
                        node.kwargs.get("value")
                    if isinstance(value, fx.Node) and array[value]:
                        cls = _FillCall  # a value per model (0-d): not a value torch's op takes
                elif fn is operator.setitem and len(node.args) == 3 and any(
                        isinstance(i, fx.Node) for i in tree_flatten(node.args[1])[0]):
                    cls = _MaskSetItem
                elif fn is torch.autograd.grad:
                    cls = _GradCall
                elif _memory_format_of(node) is not None:
                    cls = _FormatCall
                elif node in aliasing:  # a reshaping call that in-place writes go through: a view, or an error
                    cls = _AliasingCall
                call = cls(fn, marks, f"per_model_{label}", method, B)
                if _capture._inplace(node) and fn is not operator.setitem and method != "__setitem__" and any(
                        array[n] for n in node.all_input_nodes if n is not first):
                    call.overlap = True
                call.site = node.meta.get("hfkern_site")
                call.module_text = _capture.where(node.meta.get("hfkern_module"), model)
                if node in aliasing:
                    line = node.meta.get("hfkern_line") or _capture._source_line(node)
                    call.where = f"{line} {call.module_text}"
                env[node] = out.call_function(call, args, kwargs)
                array[node] = True
        if node.op == "call_module" and node in written_after and array.get(node) and env.get(node) is not None \
                and _may_broadcast(leaves.get(node.target) or model.get_submodule(node.target)):
            # a layer's result broadcast from a shared input, written into: its own memory
            env[node] = out.call_function(_own_memory, (env[node],))
        if node.op != "output":
            env[node].meta.update(node.meta)
    _group_regions(out, model, B, array_classes)
    out.lint()
    return out, wanted


def unfuse(array: FusedModel) -> list[nn.Module]:
    """The B models of a fused model as torch models of the original class.

    Model b's ``state_dict()`` equals the fused entries at index b (copies) and
    loads into the original model; requires_grad and train/eval modes are kept.
    """
    if not isinstance(array, FusedModel):
        raise TypeError(f"unfuse: expected a FusedModel (from hfkern.fuse), got {type(array).__name__}")
    return array.to_modules()

