"""hfkern's op families as data: what the drivers need to know about each one.

Every non-underscore module of this package describes one op family with one
module-level ``FAMILY`` (a :class:`Family`); :func:`discover` imports them all.
The kernel benchmark (bench/bench_kernels.py, bench/profile_case.py), the
offline compile check (tests/triton/offline_compile.py) and the generic op
tests (tests/test_families.py) read these descriptors and list no family
themselves, so a new family is one new module here.

Benchmark protocol, shared by every family: ``make_data(shape, B, dtype,
device, grad)`` returns the canonical inputs (a dict with ``"B"``; with
``grad`` also the output gradients). An :class:`Impl` turns them into its own
inputs, runs the forward, and maps its outputs and gradients back to the
canonical ``[B, ...]`` form, so every implementation is checked against the
torch backend's result on the same inputs.

Suites: ``Family.shapes`` is the default suite; ``Family.suites`` holds named
ones beside it (``bench_kernels.py --suite NAME``), such as ``bytes``: the
published workloads' shapes in both array layouts (:data:`LAYOUTS`), norms
with a fused activation against the unfused pair, and the elementwise ops
around them, each row's bytes against the copy bandwidth.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import pkgutil
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

# The hfkern backends every family is benchmarked on; torch first, as it is the reference.
BACKENDS = ("torch", "triton")
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
# The named suites beside each family's default one, and what they are for.
SUITES = {
    "default": "each family's own suite (its `shapes`)",
    "bytes": "where the bytes go: the published workloads' shapes (bench/models) in both array "
             "layouts, a layout conversion's cost, norms with a fused activation against the "
             "unfused pair, ReLU / residual add / copy_ against the copy bandwidth",
}


def leaf(t):
    """``t`` as a leaf that requires grad (None stays None)."""
    # detach() keeps the strides, so an [N, B, ...]-memory input stays one as a leaf.
    return None if t is None else t.detach().requires_grad_()


class Impl:
    """One implementation of a benchmark case: an hfkern backend or a baseline."""

    name: str = ""
    kind: str = "baseline"
    backend: str | None = None  # the hfkern backend to select while it runs
    # False for a row that times something other than the op (a layout
    # conversion): nothing to check against the torch backend's result.
    computes_op: bool = True

    def timed(self, d: dict, direction: str) -> tuple[Callable, Callable] | None:
        """(the callable to time, a map of its result to canonical tensors) for
        an implementation that is not a forward with autograd; None for one that is."""
        return None

    def moved_bytes(self, op_bytes: int, d: dict, direction: str) -> int:
        """The least bytes this implementation moves in ``direction``: the op's
        (``op_bytes``, the family's count) unless it runs more than the op's
        passes (an unfused norm + activation, a layout conversion)."""
        return op_bytes

    def inputs(self, d: dict, grad: bool) -> tuple[tuple, list]:
        """(arguments of forward, the tensors to differentiate)."""
        raise NotImplementedError

    def forward(self, args: tuple) -> list:
        raise NotImplementedError

    def grad_outputs(self, d: dict) -> list:
        return [d["gy"]]

    def canon_out(self, outs: list) -> torch.Tensor:
        return outs[0]

    def canon_grads(self, grads: tuple) -> list:
        return list(grads)

    def context(self):
        if not self.backend:
            return contextlib.nullcontext()
        import hfkern  # only implementations that run an hfkern op need it

        return hfkern.use_backend(self.backend)


class Loop(Impl):
    """The ``loop`` baseline: B separate per-model calls on separate (contiguous)
    tensors; a subclass makes its inputs with :meth:`per_model`."""

    name = "loop"

    def __init__(self, shape):
        self.s = shape

    def per_model(self, d: dict, keys: Sequence[str], grad: bool) -> list[list]:
        """For each key, the B models' slices of ``d[key]`` (None stays None)."""
        self.B = d["B"]
        parts = [[None if d[k] is None else d[k][i].contiguous() for i in range(self.B)] for k in keys]
        return [[leaf(t) for t in p] for p in parts] if grad else parts

    def grad_outputs(self, d):
        return [d["gy"][i].contiguous() for i in range(d["B"])]

    def canon_out(self, outs):
        return torch.stack(outs)

    def canon_grads(self, grads):
        # grads holds B per-model gradients of each differentiated input in turn
        return [torch.stack(grads[i:i + self.B]) for i in range(0, len(grads), self.B)]


# ---- array activation layouts and activations --------------------------------------
#
# An array conv activation is a [B, N, C, *S] tensor (S: 1 or 2 spatial dims) in
# one of two memories:
#   "nchw": [N, B, C, *S], an array conv's own layout: the grouped view
#           [N, B*C, *S] is contiguous;
#   "nhwc": [N, *S, B, C], array channels-last: the grouped view is a
#           torch.channels_last tensor, the layout cuDNN's grouped convolutions
#           compute in (an NCHW array pays a conversion each way around them).
# Both are dense, so an op that reads and writes every element once moves the
# same bytes in either; the time is what differs.
LAYOUTS = ("nchw", "nhwc")


def other_layout(layout: str) -> str:
    return {"nchw": "nhwc", "nhwc": "nchw"}[layout]


def array_randn(B: int, N: int, C: int, spatial: Sequence[int], layout: str, *, dtype, device) -> torch.Tensor:
    """A random ``[B, N, C, *spatial]`` array activation in ``layout`` memory."""
    k = len(spatial)
    if layout == "nchw":
        return torch.randn(N, B, C, *spatial, dtype=dtype, device=device).transpose(0, 1)
    if layout == "nhwc":
        # memory [N, *S, B, C] -> view [B, N, C, *S]
        return torch.randn(N, *spatial, B, C, dtype=dtype, device=device).permute(k + 1, 0, k + 2, *range(1, k + 1))
    raise ValueError(f"expected a layout in {LAYOUTS}, got {layout!r}")


def grouped_view(x: torch.Tensor) -> torch.Tensor:
    """The ``[N, B*C, *S]`` view of a ``[B, N, C, *S]`` array activation in either layout
    (``view``, so a tensor in neither layout raises instead of being copied)."""
    B, N, C = x.shape[:3]
    return x.transpose(0, 1).view(N, B * C, *x.shape[3:])


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A ``[N, C, *S]`` tensor in NCHW (contiguous) or channels-last memory: for 4-D
    tensors ``.contiguous(memory_format=...)``; a 3-D one (a Conv1d's) has no torch
    memory format, so channels-last is ``[N, L, C]`` memory. A tensor already in
    ``layout`` comes back as it is."""
    if layout == "nchw":
        return t.contiguous()
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


# The activations a norm op can fuse, as the torch call the unfused pair runs after it.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,  # the exact erf form, as the fused ops compute it
}


def activation_bytes(n: int, elem: int, direction: str) -> int:
    """The least bytes a separate activation over ``n`` elements moves: forward reads
    its input and writes its output; backward reads the output gradient and the
    saved tensor (ReLU's output, GELU's input) and writes the input gradient."""
    per = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}[direction]
    return per * n * elem


def unfused_bytes(cost: Callable, s: Any, B: int, elem: int, n: int, direction: str) -> int:
    """The least bytes of a norm (the family's ``cost`` of shape ``s`` without its activation)
    followed by its activation over ``n`` elements as a separate pass."""
    fwd, bwd = cost(replace(s, activation="none"), B, elem)
    norm = {"fwd": fwd[0], "bwd": bwd[0], "fwd+bwd": fwd[0] + bwd[0]}[direction]
    return norm + activation_bytes(n, elem, direction)


class Activated:
    """A norm baseline that runs the shape's activation (``s.activation``) after its norm,
    as its own pass. A family's subclass names its ``cost`` (a staticmethod)."""

    s: Any
    cost: Callable

    def activate(self, y):
        act = self.s.activation
        return y if act == "none" else ACTIVATIONS[act](y)

    def moved_bytes(self, op_bytes, d, direction):
        if self.s.activation == "none":
            return op_bytes
        x = d["x"]
        return unfused_bytes(self.cost, self.s, d["B"], x.element_size(), x.numel(), direction)


class FusedNorm(Impl):
    """An hfkern backend of a norm family whose shapes carry a fused ``activation``:
    ``norm(args, activation)`` runs the op on ``(x, w, b, *d[k] for k in extra_inputs)``
    (x, w and b differentiated) and returns its output."""

    kind = "backend"
    extra_inputs: tuple[str, ...] = ()

    def __init__(self, s, backend: str):
        self.s = s
        self.name = self.backend = backend

    def norm(self, args: tuple, activation: str):
        raise NotImplementedError

    def inputs(self, d, grad):
        x, w, b = d["x"], d["w"], d["b"]
        if grad:
            x, w, b = leaf(x), leaf(w), leaf(b)
        return (x, w, b, *(d[k] for k in self.extra_inputs)), [x, w, b]

    def forward(self, args):
        return [self.norm(args, self.s.activation)]


class UnfusedNorm(Activated, FusedNorm):
    """The hfkern op with activation "none" under ``backend``, then the activation in torch
    (the baseline ``unfused_<backend>``; a family's subclass mixes it into its FusedNorm)."""

    kind = "baseline"

    def __init__(self, s, backend: str):
        super().__init__(s, backend)
        self.name = f"unfused_{backend}"

    def forward(self, args):
        return [self.activate(self.norm(args, "none"))]


def unfused_baselines(unfused: Callable[[Any, str], Impl]) -> dict[str, Callable]:
    """The ``unfused_<backend>`` baselines of a norm family, for every backend: rows only
    for shapes with an activation."""
    def make(backend):
        return lambda s: unfused(s, backend) if s.activation != "none" else None

    return {f"unfused_{backend}": make(backend) for backend in BACKENDS}


@functools.cache
def cuda_backend_available() -> bool:
    import hfkern

    return bool(hfkern.backend_info()["backends"]["cuda"]["available"])


def cuda_baseline(impl: Callable[[Any, str], Impl]) -> Callable[[Any], Impl | None]:
    """The ``cuda`` baseline of a family: ``impl(s, "cuda")``, the op under the cuda backend,
    where that backend is available. It serves CUDA tensors only, so the smoke shapes (run
    on the CPU, where the op would take the torch path) leave it out."""
    return lambda s: impl(s, "cuda") if s.model != "smoke" and cuda_backend_available() else None


class LayoutConversion(Impl):
    """Not the op: what converting its activations to the other array layout and back costs.

    A kernel that computes in the other layout converts the op's activation
    input on the way in and its output on the way out: ``fwd`` times ``x``
    (the case's layout to the other) and a ``y``-shaped tensor (the other back
    to the case's), ``bwd`` the same for ``gy`` and ``gx``, ``fwd+bwd`` all
    four; each a ``.contiguous(memory_format=...)`` of the grouped ``[N, B*C, *S]``
    view (:func:`to_layout`). Bytes: every converted tensor read and written once.
    """

    name = "convert"
    computes_op = False

    def __init__(self, layout: str, N: int, x_cs: tuple[int, ...], y_cs: tuple[int, ...]):
        self.layout, self.there = layout, other_layout(layout)
        self.N, self.x_cs, self.y_cs = N, tuple(x_cs), tuple(y_cs)  # (C, *S) per model

    @property
    def note(self) -> str:
        return f"{self.layout} -> {self.there} -> {self.layout} conversions, not the op (not checked)"

    def _numels(self, B: int, direction: str) -> list[int]:
        x, y = (B * self.N * math.prod(cs) for cs in (self.x_cs, self.y_cs))
        return {"fwd": [x, y], "bwd": [y, x], "fwd+bwd": [x, y, y, x]}[direction]

    def moved_bytes(self, op_bytes, d, direction):
        return 2 * d["x"].element_size() * sum(self._numels(d["B"], direction))

    def timed(self, d, direction):
        B, x = d["B"], d["x"]

        def there(cs):  # an output of a kernel that computed in the other layout
            return grouped_view(array_randn(B, self.N, cs[0], cs[1:], self.there, dtype=x.dtype, device=x.device))

        jobs = []
        if direction != "bwd":
            jobs += [(grouped_view(x), self.there), (there(self.y_cs), self.layout)]
        if direction != "fwd":
            jobs += [(grouped_view(d["gy"]), self.there), (there(self.x_cs), self.layout)]

        def fn():
            return [to_layout(t, layout) for t, layout in jobs]

        return fn, lambda result: []


@dataclass(frozen=True)
class Fastest:
    """A derived baseline: per case, the fastest of the named implementations'
    rows, renamed (its ``note`` says which won). Nothing runs for it."""

    of: tuple[str, ...]

    def row(self, name: str, rows: list[dict]) -> dict | None:
        mine = [r for r in rows if r["impl"] in self.of]
        if not mine:
            return None
        ok = [r for r in mine if r["status"] == "ok"]
        if ok:
            best = dict(min(ok, key=lambda r: r["ms"]))
            best["note"] = best["impl"] + (f"; {best['note']}" if best.get("note") else "")
        else:
            best = dict(mine[0])
            best["error"] = "; ".join(f"{r['impl']}: {r['error']}" for r in mine)[:500]
        best["impl"] = name
        return best


@dataclass(frozen=True)
class Suite:
    """A named shape suite beside a family's default one (``bench_kernels.py --suite NAME``)."""

    shapes: Sequence[Any]
    smoke_shapes: Sequence[Any] = ()
    # The directions of its --quick subset, headline first; the family's when empty.
    quick_directions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """One op family. Every field but ``name`` and ``summary`` may be left empty;
    a driver skips a family that lacks what it needs.

    Kernel benchmark (a family with ``shapes``):

    * ``shapes``: the suite, one per-model layer shape each; a shape has
      ``model``, ``layer``, ``quick`` (in the ``--quick`` subset) and
      ``describe()``. ``smoke_shapes``: tiny ones for ``--smoke`` on the CPU.
    * ``directions``: the directions benchmarked; ``quick_directions``: those
      the targets are stated in (the quick subset), headline first.
    * ``make_data(shape, B, dtype, device, grad) -> dict``: canonical inputs.
    * ``cost(shape, B, elem) -> ((fwd bytes, fwd FLOPs), (bwd bytes, bwd FLOPs))``:
      the least traffic (and work; FLOPs None where not counted) of each direction.
    * ``backend_impl(shape, backend) -> Impl``: the hfkern op under ``backend``.
    * ``baselines``: name -> ``factory(shape) -> Impl`` or :class:`Fastest`, in
      report order. A factory (and ``backend_impl``) returns None for a shape it
      does not apply to (the unfused pair of a norm without an activation).
    * ``suites``: named :class:`Suite` s beside the default one (:data:`SUITES`).
      A shape may carry ``directions``, the only ones it is benchmarked in.

    Offline compile check: ``compile_calls() -> Iterator[(label, call)]``, calls of
    the family's Triton launchers on small CPU tensors that together reach every
    kernel and code path (dtypes, layouts, flags); each call must launch a kernel.

    Op tests: ``samples(device) -> Iterator[(op name, args)]``, calls of the
    family's ``torch.ops.hfkern`` ops (by name, without the namespace) on fresh
    random float32 inputs: odd sizes, B = 1, non-contiguous inputs.
    """

    name: str
    summary: str
    shapes: Sequence[Any] = ()
    smoke_shapes: Sequence[Any] = ()
    directions: tuple[str, ...] = DIRECTIONS
    quick_directions: tuple[str, ...] = ()
    make_data: Callable[..., dict] | None = None
    cost: Callable[..., tuple] | None = None
    backend_impl: Callable[[Any, str], Impl] | None = None
    baselines: Mapping[str, Callable[[Any], Impl] | Fastest] = field(default_factory=dict)
    compile_calls: Callable[[], Iterator[tuple[str, Callable[[], Any]]]] | None = None
    samples: Callable[[torch.device | str], Iterator[tuple[str, tuple]]] | None = None
    suites: Mapping[str, Suite] = field(default_factory=dict)

    def suite(self, *, quick: bool = False, smoke: bool = False, name: str = "default") -> list:
        """The shapes of a run mode of suite ``name`` (none where the family lacks it)."""
        if name == "default":
            shapes, smoke_shapes = self.shapes, self.smoke_shapes
        elif name in self.suites:
            shapes, smoke_shapes = self.suites[name].shapes, self.suites[name].smoke_shapes
        else:
            return []
        if smoke:
            return list(smoke_shapes)
        return [s for s in shapes if s.quick] if quick else list(shapes)

    def quick_directions_of(self, name: str = "default") -> tuple[str, ...]:
        """The --quick directions of suite ``name``."""
        own = self.suites[name].quick_directions if name in self.suites else ()
        return own or self.quick_directions

    def impl_names(self) -> tuple[str, ...]:
        """The implementations that run, in report order."""
        backends = BACKENDS if self.backend_impl else ()
        return backends + tuple(n for n, b in self.baselines.items() if not isinstance(b, Fastest))

    def report_order(self) -> tuple[str, ...]:
        """Every implementation name a row can carry, derived ones included."""
        return (BACKENDS if self.backend_impl else ()) + tuple(self.baselines)

    def make_impls(self, shape, names) -> list[Impl]:
        """The implementations named in ``names`` that apply to ``shape``, torch first (the reference)."""
        out: list[Impl] = []
        for name in self.impl_names():
            if name in names:
                impl = self.backend_impl(shape, name) if name in BACKENDS else self.baselines[name](shape)
                if impl is not None:
                    out.append(impl)
        return out

    def derived_rows(self, rows: list[dict]) -> list[dict]:
        """The rows of the derived baselines, from the case's measured ``rows``."""
        derived = (b.row(n, rows) for n, b in self.baselines.items() if isinstance(b, Fastest))
        return [r for r in derived if r is not None]


def discover() -> dict[str, Family]:
    """{name: Family} of every family module of this package, by module name."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
        if family.name in found:
            raise ValueError(f"two families named {family.name!r} (module {info.name})")
        found[family.name] = family
    return found


def impl_order(families: Mapping[str, Family] | None = None) -> list[str]:
    """Every implementation name of the benchmarked families, backends first, in report order."""
    order: list[str] = list(BACKENDS)
    for family in (families or discover()).values():
        order += [n for n in family.report_order() if n not in order]
    return order
