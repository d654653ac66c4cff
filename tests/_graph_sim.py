"""A CPU stand-in for a CUDA graph that replays what a capture recorded and nothing else.

tests/test_graphs.py's ``_SimulatedGraph`` replays a step by running its Python
again (host steps dropped): a value the step reads on the host at every call
(a module's mode, a dropout probability, which optimizer state exists) is read
anew at every replay, so a graph that a CUDA replay would run stale looks right
there. :class:`RecordedGraph` replays as a CUDA graph does:

* The capture runs the step once and records every ATen op it dispatches
  (forward, backward, optimizer), each with its tensor arguments and results
  frozen as views of the memory they had at the call (a CUDA graph holds
  addresses, shapes and strides). A host read of a device value
  (``.item()``, ``bool(t)``) raises, as it does under CUDA stream capture.
* A replay runs the recorded ops again, in order, on that memory, under
  ``no_grad``: in-place and ``out=`` ops write where they wrote, a new result
  is copied into the memory the recorded one had, a view is the view it was.
  No Python of the step runs: not its host steps (``capture_step`` runs them
  after the replay), not its reads of module attributes, not its optimizers'
  group checks. Random ops draw from the generator again, in the order the
  eager step draws, so a replay equals an eager step bit for bit.

Use :func:`recorded`, a context manager.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hfkern import graphs


def _frozen(v: Any) -> Any:
    """A strided tensor as a view of the memory it has now (its shape, strides and offset fixed,
    as a graph holds them even if the tensor is resized or given other memory later)."""
    if isinstance(v, torch.Tensor) and v.layout == torch.strided:
        return v.as_strided(v.shape, v.stride(), v.storage_offset())
    return v


def _returns_alias(func: Any) -> bool:
    """Whether ``func`` returns (a view of) one of its arguments: in place, ``out=`` or a view op."""
    return any(r.alias_info is not None for r in func._schema.returns)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(f"a host read of a device value ({func}) while a graph is captured")
        frozen_args, frozen_kwargs = tree_map(_frozen, args), tree_map(_frozen, kwargs)
        out = func(*args, **kwargs)
        self.ops.append((func, frozen_args, frozen_kwargs, tree_map(_frozen, out)))
        return out


class RecordedGraph:
    """A graph of the ATen ops one run of the step dispatched (see the module docstring)."""

    runs_at_capture = True  # the capture runs the step (on the CPU nothing else would)

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        recorder = _Recorder()
        with recorder:
            out = fn()
        self.ops = recorder.ops
        return out

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, recorded_out in self.ops:
                new = func(*args, **kwargs)
                if _returns_alias(func):
                    continue  # wrote into (or viewed) memory the recorded arguments hold
                for mine, theirs in zip(tree_flatten(recorded_out)[0], tree_flatten(new)[0]):
                    if isinstance(mine, torch.Tensor):
                        mine.copy_(theirs)
        self.replays += 1


@contextlib.contextmanager
def recorded() -> Iterator[list[RecordedGraph]]:
    """Make :func:`hfkern.capture_step` take CPU tensors for CUDA ones and capture into
    :class:`RecordedGraph` s (warm-up calls on the current stream); yields the list of the graphs
    made. Use the torch backend (``hfkern.use_backend("torch")``): an op of hfkern's own
    extension is no ATen op and would not be recorded."""
    made: list[RecordedGraph] = []

    def new_graph(self: graphs.CapturedStep) -> RecordedGraph:
        made.append(RecordedGraph())
        return made[-1]

    saved = graphs._on_cuda, graphs.CapturedStep.__dict__["_warmup_stream"], graphs.CapturedStep._new_graph
    graphs._on_cuda = lambda args, kwargs: True
    graphs.CapturedStep._warmup_stream = staticmethod(contextlib.nullcontext)
    graphs.CapturedStep._new_graph = new_graph
    try:
        yield made
    finally:
        graphs._on_cuda, graphs.CapturedStep._warmup_stream, graphs.CapturedStep._new_graph = saved
