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
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

# The hfkern backends every family is benchmarked on; torch first, as it is the reference.
BACKENDS = ("torch", "triton")
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")


def leaf(t):
    """``t`` as a leaf that requires grad (None stays None)."""
    # detach() keeps the strides, so an [N, B, ...]-memory input stays one as a leaf.
    return None if t is None else t.detach().requires_grad_()


class Impl:
    """One implementation of a benchmark case: an hfkern backend or a baseline."""

    name: str = ""
    kind: str = "baseline"
    backend: str | None = None  # the hfkern backend to select while it runs

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
      report order.

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

    def suite(self, *, quick: bool = False, smoke: bool = False) -> list:
        """The shapes of a run mode."""
        if smoke:
            return list(self.smoke_shapes)
        return [s for s in self.shapes if s.quick] if quick else list(self.shapes)

    def impl_names(self) -> tuple[str, ...]:
        """The implementations that run, in report order."""
        backends = BACKENDS if self.backend_impl else ()
        return backends + tuple(n for n, b in self.baselines.items() if not isinstance(b, Fastest))

    def report_order(self) -> tuple[str, ...]:
        """Every implementation name a row can carry, derived ones included."""
        return (BACKENDS if self.backend_impl else ()) + tuple(self.baselines)

    def make_impls(self, shape, names) -> list[Impl]:
        """The implementations named in ``names``, torch first (the reference)."""
        out: list[Impl] = []
        for name in self.impl_names():
            if name in names:
                out.append(self.backend_impl(shape, name) if name in BACKENDS else self.baselines[name](shape))
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
