"""Tile tables for multi-tensor kernels (the optimizer steps of every GPU backend).

A multi-tensor kernel updates n tensors ``[B, *shape_i]`` of B models in one
launch. The tensors are dense with the array dim outermost in memory, so model
b's slice of tensor i is ``n_i = numel / B`` consecutive elements, and every
list (parameters, gradients, each state list) shares its parameter's element
order. Every slice is cut into tiles of at most ``chunk`` elements, and each
tile is one int64 row of a small device table (columns ``COL_*``): the element
offset of the tile's first element in the parameter, the gradient and each state
list, the offset of the step count ``steps[i][b]``, the model b, the tile's
length, whether the tile is 16-byte aligned in every list, and where the tiles
of its (tensor, model) pair lie in the table (the first one's row and their
number: the tiles of a pair are consecutive rows). A kernel that needs a
reduction over a whole slice (the trust ratios of LARS and LAMB) writes
per-tile partials in a first pass, and each program of the second pass sums
its pair's partials in row order: deterministic, without atomics. Offsets count
from the *first* tensor of each list, which the kernel receives as an ordinary
typed pointer, so every other tensor is plain pointer arithmetic from it. An
aligned tile's offsets and length are multiples of ``LEN_ALIGN`` elements, so
a kernel may use 16-byte vector accesses throughout it.

The table depends only on the tensors' addresses and layouts, so a
:class:`Planner` builds it once per distinct set of tensors and caches it (a
training loop hits the cache at every step). The Triton kernels
(hfkern/triton/optim.py) and the CUDA kernels (csrc/optim/, whose header
declares the same columns) read the same tables; each backend has its own
planner, with its own chunk size.
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from ._dtypes import FLOAT_DTYPES
from .utils import _host_to_device as to_device

__all__ = ["Planner", "Plan", "Group", "build_tiles", "model_major", "traced", "to_device"]

# Columns of a step tile row: element offsets in the parameter, the gradient and
# the three state lists, the step count's offset, the model, the length, aligned,
# the row of the first tile of the tile's (tensor, model) pair and their number.
(COL_P, COL_G, COL_S0, COL_S1, COL_S2, COL_STEP, COL_MODEL, COL_LEN, COL_ALIGNED, COL_FIRST, COL_TILES,
 COLS) = range(12)
OFFSET_COLS = (COL_P, COL_G, COL_S0, COL_S1, COL_S2)
N_STATES = len(OFFSET_COLS) - 2
# Columns of a non-finite check tile row: gradient offset, partial index, length, aligned.
NF_G, NF_PART, NF_LEN, NF_ALIGNED, NF_COLS = range(5)

ALIGN_BYTES = 16
# Alignment of an aligned tile's length and offsets (elements): a 16-byte vector
# never straddles a tile's end, for every element size.
LEN_ALIGN = 16
MAX_CACHED = 16


def model_major(t: Tensor) -> bool:
    """Dense, with each model's slice one contiguous run of memory."""
    if t.is_contiguous():
        return True
    B = t.size(0)
    if B > 1 and t.numel() and t.stride(0) != t.numel() // B:
        return False
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride()[1:], t.shape[1:]) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _order(t: Tensor) -> tuple[int, ...]:
    """The strides that fix the element order (those of dims longer than 1)."""
    return tuple(st for st, sz in zip(t.stride(), t.shape) if sz != 1)


_data_ptr = Tensor.data_ptr
_is_contiguous = Tensor.is_contiguous
_shape_dtype = operator.attrgetter("shape", "dtype")


def signature(tensors: Sequence[Tensor]):
    """What a tile table depends on in ``tensors``: addresses, and the layout where not
    contiguous (built from C-level calls: this runs at every step)."""
    ptrs = tuple(map(_data_ptr, tensors))
    if all(map(_is_contiguous, tensors)):
        return ptrs
    return ptrs, tuple(t.stride() for t in tensors)


def shapes_dtypes(tensors: Sequence[Tensor]) -> tuple:
    return tuple(map(_shape_dtype, tensors))


@dataclass
class Group:
    index: list[int]  # positions of this dtype's parameters in the call's lists; [0] is the base
    tiles: Tensor  # [T, COLS] int64 on the device
    n_tiles: int
    dtype: torch.dtype


@dataclass
class Plan:
    groups: list[Group]
    step_offs: Tensor | None  # [n * B] int64 on the device, or None without step counts
    n_steps: int


def remember(cache: collections.OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > MAX_CACHED:
        cache.popitem(last=False)


def offsets(tensors: Sequence[Tensor], base: Tensor, name: str, backend: str) -> list[int]:
    """Element offsets of ``tensors`` from ``base``."""
    es = base.element_size()
    out = []
    for i, t in enumerate(tensors):
        diff = t.data_ptr() - base.data_ptr()
        if diff % es:
            raise ValueError(
                f"{name}[{i}] is not aligned to its element size ({es} bytes) relative to "
                f"{name}'s first tensor; the {backend} backend addresses tensors of one list from one base"
            )
        out.append(diff // es)
    return out


def build_tiles(
    lists: Sequence[Sequence[Tensor]], names: Sequence[str], steps: Sequence[Tensor] | None,
    B: int, chunk: int, part: tuple[int, int] | None = None, backend: str = "",
) -> Tensor:
    """Model-major CPU table of every (tensor, model, chunk) tile of the tensors in ``lists``
    (every list the same length, tensor i of every list the same shape and element order).

    Without ``part``: a step table (``COL_*``), ``lists`` the parameters, gradients
    and state lists in column order. With ``part`` = (Tm, first column): a
    non-finite check table (``NF_*``) of the one list, each tile with its partial index.
    """
    if chunk % LEN_ALIGN:
        raise ValueError(f"expected a chunk that is a multiple of {LEN_ALIGN} elements, got {chunk}")
    bases = [lst[0] for lst in lists]
    offs = [offsets(lst, base, name, backend) for lst, base, name in zip(lists, bases, names)]
    base_aligned = all(b.data_ptr() % ALIGN_BYTES == 0 for b in bases)
    step_offs = offsets(steps, steps[0], "steps", backend) if steps else None
    offset_cols = (NF_G,) if part else OFFSET_COLS
    n_cols = NF_COLS if part else COLS
    per_model: list[list[Tensor]] = [[] for _ in range(B)]
    col = part[1] if part else 0
    for i in range(len(lists[0])):
        n = lists[0][i].numel() // B if B else 0
        if n == 0:
            continue
        nch = -(-n // chunk)
        starts = torch.arange(nch, dtype=torch.int64) * chunk
        lens = torch.clamp(n - starts, max=chunk)
        aligned = int(
            base_aligned and n % LEN_ALIGN == 0
            and all(lst[i].data_ptr() % ALIGN_BYTES == 0 for lst in lists)
        )
        for b in range(B):
            rows = torch.zeros(nch, n_cols, dtype=torch.int64)
            for c, o in zip(offset_cols, offs):
                rows[:, c] = o[i] + b * n + starts
            if part is not None:
                rows[:, NF_PART] = b * part[0] + col + torch.arange(nch)
                rows[:, NF_LEN] = lens
                rows[:, NF_ALIGNED] = aligned
            else:
                if step_offs is not None:
                    rows[:, COL_STEP] = step_offs[i] + b * steps[i].stride(0)
                rows[:, COL_MODEL] = b
                rows[:, COL_LEN] = lens
                rows[:, COL_ALIGNED] = aligned
            per_model[b].append(rows)
        col += nch
    flat = [r for rows in per_model for r in rows]
    if part is None:
        first = 0
        for rows in flat:  # one (tensor, model) pair's consecutive tiles
            rows[:, COL_FIRST] = first
            rows[:, COL_TILES] = rows.size(0)
            first += rows.size(0)
    return torch.cat(flat) if flat else torch.zeros(0, n_cols, dtype=torch.int64)


def traced(t: Tensor, backend: str) -> bool:
    """True under FakeTensorMode (nothing to launch); raises inside functionalization."""
    if isinstance(t, FunctionalTensor):
        raise RuntimeError(
            f"the {backend} optimizer kernels address their tensors through a device table, which a "
            "traced graph cannot follow; call the hfkern::*_step_ ops (opaque to torch.compile) instead"
        )
    return is_fake(t)


class Planner:
    """One backend's tile tables for step calls, cached per set of tensors.

    ``chunk(total_elements, device)`` gives the tile length (a multiple of
    ``LEN_ALIGN``); ``backend`` names the backend in error messages.
    """

    def __init__(self, backend: str, chunk: Callable[[int, torch.device], int]):
        self.backend = backend
        self.chunk = chunk
        self.plans: collections.OrderedDict = collections.OrderedDict()

    def _check_layouts(self, params, grads, states, names) -> None:
        device = params[0].device
        for i, p in enumerate(params):
            if not model_major(p):
                raise ValueError(
                    f"the {self.backend} backend needs every parameter dense with each model's slice "
                    f"contiguous (array dim outermost in memory); params[{i}] of shape {list(p.shape)} "
                    f"has strides {list(p.stride())}"
                )
            for name, lst in zip(names, states):
                t = lst[i]
                if t.device != device:
                    raise ValueError(f"expected {name}[{i}] on {device}, got {t.device}")
                if t.shape != p.shape or _order(t) != _order(p) or not model_major(t):
                    raise ValueError(
                        f"the {self.backend} backend needs {name}[{i}] laid out like params[{i}] "
                        f"(shape {list(p.shape)}, strides {list(p.stride())}), got shape {list(t.shape)}, "
                        f"strides {list(t.stride())}"
                    )
            if grads[i].device != device:
                raise ValueError(f"expected grads[{i}] on {device}, got {grads[i].device}")

    @staticmethod
    def _conform_grads(params: Sequence[Tensor], grads: Sequence[Tensor]) -> list[Tensor]:
        """``grads``, with any gradient laid out unlike its parameter copied into the
        parameter's layout (read only, so a copy is exact)."""
        out = list(grads)
        for i, (p, g) in enumerate(zip(params, grads)):
            if g.shape != p.shape or g.dtype != p.dtype:
                raise ValueError(
                    f"expected grads[{i}] of shape {list(p.shape)} and dtype {p.dtype}, "
                    f"got {list(g.shape)} {g.dtype}"
                )
            if _order(g) != _order(p) or not model_major(g):
                out[i] = torch.empty_like(p).copy_(g)
        return out

    def plan(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Sequence[Tensor]],
        names: Sequence[str], steps: Sequence[Tensor],
    ) -> tuple[Plan, Sequence[Tensor]]:
        """The cached tile tables for these tensors (built on first sight), and the
        gradients to address (``grads``, unless one needed a copy into its parameter's layout).

        ``states`` holds every state list of the kernel in its column order; an
        absent (empty) list is addressed as ``params`` and never read.
        """
        key = (signature(params), signature(grads), tuple(map(signature, states)), signature(steps),
               shapes_dtypes(params), params[0].device)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan, grads
        present = [(n, s) for n, s in zip(names, states) if s]
        self._check_layouts(params, grads, [s for _, s in present], [n for n, _ in present])
        conformed = self._conform_grads(params, grads)
        B = params[0].size(0)
        device = params[0].device
        if steps:
            for i, s in enumerate(steps):
                if s.shape != (B,) or s.dtype != torch.float32 or s.device != device:
                    raise ValueError(
                        f"expected steps[{i}] of shape [{B}] and dtype float32 on {device}, "
                        f"got {list(s.shape)} {s.dtype} on {s.device}"
                    )
        chunk = self.chunk(sum(p.numel() for p in params), device)
        groups = []
        for dtype in FLOAT_DTYPES:
            index = [i for i, p in enumerate(params) if p.dtype == dtype]
            if not index:
                continue
            full = (params, conformed, *(s if s else params for s in states))
            lists = [[lst[i] for i in index] for lst in full]
            tiles = build_tiles(
                lists, ("params", "grads", *(n if s else "params" for n, s in zip(names, states))),
                [steps[i] for i in index] if steps else None, B, chunk, backend=self.backend,
            )
            groups.append(Group(index, to_device(tiles, device), tiles.size(0), dtype))
        step_offs = None
        if steps:
            base = offsets(steps, steps[0], "steps", self.backend)
            step_offs = torch.tensor(
                [o + b * s.stride(0) for o, s in zip(base, steps) for b in range(B)], dtype=torch.int64
            )
            step_offs = to_device(step_offs, device)
        plan = Plan(groups, step_offs, len(steps) * B)
        if all(c is g for c, g in zip(conformed, grads)):
            remember(self.plans, key, plan)
        return plan, conformed
