"""Tile tables for multi-tensor kernels (the optimizer steps of every GPU backend).

A multi-tensor kernel updates n tensors ``[B, *shape_i]`` of B models in one
launch. Parameters and state are dense with the array dim outermost in memory,
so model b's slice of tensor i is ``n_i = numel / B`` consecutive elements, and
every state list shares its parameter's element order. Every slice is cut into
tiles of at most ``chunk`` elements, one program (thread block) per tile.

What a kernel reads comes in two tables, split by how often it changes:

* The **tile table** (columns ``COL_*``, one int64 row per tile, built once and
  cached): the tensor's position i in the call, the model b, the tile's element
  offset ``b * n_i + start`` in the parameter and each state tensor, its offset
  in the gradient, its start within the slice and its length, the offset
  ``b * steps[i].stride(0)`` of its step count, and where the tiles of its
  (tensor, model) pair lie in the table (the first one's row and their number:
  the tiles of a pair are consecutive rows). It depends only on the tensors'
  shapes, dtypes and layouts, B, the chunk and which lists are present, never
  on an address, so a training loop that gets new gradient tensors at every
  step (``zero_grad()`` sets them to None) keeps its table.
* The **address table** (columns ``ADDR_*``, one int64 row per tensor, made at
  every step): the element offset of tensor i from the first tensor of its
  list (the parameters, the gradients, each state list: the first tensor of i's
  dtype group; the step counts: ``steps[0]``), and whether every access to
  tensor i may be a 16-byte vector. The kernel receives each list's first
  tensor as an ordinary typed pointer and addresses element k of a tile as
  ``base + addrs[i][list] + tiles[row][offset] + k``. The table costs one pass
  over the tensors on the host (O(n), not O(n x B)), is packed into one small
  host tensor and reaches the device with one non-blocking copy (from pinned
  memory, which torch's caching host allocator keeps until the copy is done),
  the way torch's fused optimizers and apex's ``multi_tensor_apply`` pass
  addresses per launch; a step whose tensors sit where the last step's did
  reuses the last copy.

A gradient laid out unlike its parameter (a channels-last conv weight's, one
that is not dense) is read where it lies: its tiles carry a row of the group's
**gather table** (``gather`` column, -1 for a gradient in its parameter's
layout): the (size, stride) of each of the gradient's dims in the parameter's
memory order, innermost first, at most ``MAX_GRAD_DIMS`` after merging the
dims that are contiguous in both (every dense conv weight fits), from which
the kernel computes each element's gradient offset. Only a gradient with more
dims than that is copied into its parameter's layout at each step.

A kernel that needs a reduction over a whole slice (the trust ratios of LARS
and LAMB) writes per-tile partials in a first pass, and each program of the
second pass sums its pair's partials in row order: deterministic, without
atomics. An aligned tensor's slices, tile offsets and lengths are multiples of
``LEN_ALIGN`` elements and every list's tensor and first tensor are 16-byte
aligned, so a kernel may use 16-byte vector accesses throughout its tiles.

The non-finite check reads the gradients alone, through a table of the same
kind (``NF_*`` tile columns, ``NF_ADDR_*`` address columns); a gradient whose
models do not each lie in one run of memory is checked through a copy.

A :class:`Planner` caches the tile tables by what they depend on (an LRU of
``MAX_CACHED``) and counts how many it has built (``builds``). The Triton
kernels (hfkern/triton/optim.py) and the CUDA kernels (csrc/optim/, whose
header declares the same columns) read the same tables; each backend has its
own planner, with its own chunk size.
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from ._dtypes import FLOAT_DTYPES
from .utils import _host_to_device as to_device

__all__ = ["Planner", "Plan", "Group", "CheckPlan", "model_major", "traced", "to_device"]

# Columns of a step tile row: the tensor's position in the call, the model, the
# tile's element offset in the parameter and each state tensor (b * n_i + start),
# its offset in the gradient (b * grads[i].stride(0), plus start where the gradient
# is laid out like its parameter), its start within the model's slice, its length,
# the offset of its step count from steps[i] (b * steps[i].stride(0)), its row in
# the gather table (-1: none), and the row of the first tile of its (tensor, model)
# pair and their number.
(COL_TENSOR, COL_MODEL, COL_OFFSET, COL_GRAD, COL_START, COL_LEN, COL_STEP, COL_GATHER, COL_FIRST, COL_TILES,
 COLS) = range(11)
# Columns of a step address row (one per tensor, per step): element offsets from
# the first tensor of the list in the tensor's dtype group (parameters, gradients,
# the three state lists), the step count's offset from steps[0], aligned.
ADDR_P, ADDR_G, ADDR_S0, ADDR_S1, ADDR_S2, ADDR_STEP, ADDR_ALIGNED, ADDR_COLS = range(8)
ADDR_STATES = (ADDR_S0, ADDR_S1, ADDR_S2)
N_STATES = len(ADDR_STATES)
# Columns of a non-finite check tile row: the tensor's position, the tile's element
# offset in the gradient, its partial index, its length; and of its address row:
# the gradient's offset from its dtype group's first gradient, aligned.
NF_TENSOR, NF_OFFSET, NF_PART, NF_LEN, NF_COLS = range(5)
NF_ADDR_G, NF_ADDR_ALIGNED, NF_ADDR_COLS = range(3)
# A gather row: (size, stride) of each of a gradient's dims in its parameter's memory
# order, innermost first, padded with (1, 0).
MAX_GRAD_DIMS = 4
GATHER_COLS = 2 * MAX_GRAD_DIMS

ALIGN_BYTES = 16
# Alignment of an aligned tile's length and offsets (elements): a 16-byte vector
# never straddles a tile's end, for every element size.
LEN_ALIGN = 16
# Tables kept per planner (LRU). A training step looks up one per parameter group (two
# for a trust-ratio optimizer's exclusion) and the non-finite check's: more groups than
# entries would rebuild every step, so the bound is well above common group counts.
MAX_CACHED = 64


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


def gather_dims(p: Tensor, g: Tensor) -> list[tuple[int, int]]:
    """(size, stride in ``g``) of each dim of one model's slice, in ``p``'s memory order
    (innermost first), merging neighbours that are contiguous in both: element j of
    ``p``'s slice is at ``sum(((j // prod(sizes before d)) % size_d) * stride_d)`` in
    ``g``'s slice."""
    dims = sorted(((ps, sz, gs) for ps, sz, gs in zip(p.stride()[1:], p.shape[1:], g.stride()[1:]) if sz != 1))
    out: list[list[int]] = []
    for _, size, stride in dims:  # p is dense: its next dim always continues the last
        if out and out[-1][1] * out[-1][0] == stride:
            out[-1][0] *= size
        else:
            out.append([size, stride])
    return [(s, st) for s, st in out] or [(1, 0)]


_data_ptr = Tensor.data_ptr
_is_contiguous = Tensor.is_contiguous
_stride = Tensor.stride
_shape_dtype = operator.attrgetter("shape", "dtype")
_device = operator.attrgetter("device")


def layout(tensors: Sequence[Tensor]):
    """What a tile table depends on in the layout of ``tensors``: nothing more than their
    shapes where all are contiguous, else their strides (C-level calls: this runs at
    every step)."""
    if all(map(_is_contiguous, tensors)):
        return None
    return tuple(map(_stride, tensors))


def shapes_dtypes(tensors: Sequence[Tensor]) -> tuple:
    return tuple(map(_shape_dtype, tensors))


def remember(cache: collections.OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > MAX_CACHED:
        cache.popitem(last=False)


def traced(t: Tensor, backend: str) -> bool:
    """True under FakeTensorMode (nothing to launch); raises inside functionalization."""
    if isinstance(t, FunctionalTensor):
        raise RuntimeError(
            f"the {backend} optimizer kernels address their tensors through a device table, which a "
            "traced graph cannot follow; call the hfkern::*_step_ ops (opaque to torch.compile) instead"
        )
    return is_fake(t)


def _tiles(sizes: Tensor, B: int, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Every (tensor, model, chunk) tile of tensors whose model slices hold ``sizes``
    (``[m]``, each > 0) elements, model-major (model 0's tiles of every tensor first),
    each pair's tiles consecutive and in order: (tensor, model, start, length, first row
    of the pair), each ``[T]``. Vectorized: no Python loop over tensors or models."""
    if chunk % LEN_ALIGN:
        raise ValueError(f"expected a chunk that is a multiple of {LEN_ALIGN} elements, got {chunk}")
    nch = (sizes + chunk - 1) // chunk
    per_tensor = nch * B
    tensor = torch.repeat_interleave(torch.arange(sizes.numel()), per_tensor)
    block = torch.cumsum(per_tensor, 0) - per_tensor
    local = torch.arange(tensor.numel()) - block[tensor]
    model, c = local // nch[tensor], local % nch[tensor]
    order = torch.sort(model, stable=True).indices  # model-major, tensor order and chunk order kept
    tensor, model, c = tensor[order], model[order], c[order]
    start = c * chunk
    length = torch.clamp(sizes[tensor] - start, max=chunk)
    first = torch.arange(tensor.numel()) - c
    return tensor, model, start, length, first


class _Addresses:
    """How a call's per-tensor address table is made from its tensors' addresses.

    ``lists``: the lists a kernel addresses (positions in the call's argument order),
    each with the address column it fills, its element sizes (``[n]``), the position of
    its base tensor for each tensor (``[n]``), whether its alignment counts, and its
    name for error messages. ``valid`` (``[L, n]``, one row per list): the tensors that
    hold elements, whose addresses count; an empty tensor's offset is 0 (its data
    pointer may be anything and nothing reads it).
    """

    def __init__(self, n: int, n_cols: int, aligned_col: int, static_aligned: Tensor, valid: Tensor,
                 lists: list[tuple[int, int, Tensor, Tensor, bool, str]], backend: str):
        self.n, self.n_cols, self.aligned_col, self.backend = n, n_cols, aligned_col, backend
        self.static_aligned, self.valid = static_aligned, valid
        self.positions = [pos for pos, *_ in lists]
        self.cols = torch.tensor([col for _, col, *_ in lists], dtype=torch.int64)
        self.sizes = torch.stack([es for _, _, es, *_ in lists])  # [L, n]
        self.bases = torch.stack([base for *_, base, _, _ in lists])  # [L, n]
        self.vector = torch.tensor([vec for *_, vec, _ in lists])
        self.names = [name for *_, name in lists]
        self.last: tuple | None = None  # (stream, addresses, device table) of the last call

    def table(self, tensors: Sequence[Sequence[Tensor]], device: torch.device, keep: list | None) -> Tensor:
        """The device address table of ``tensors`` (the call's lists, in argument order);
        ``keep``: a list that holds what a CUDA graph being captured reads, or None."""
        ptrs = torch.tensor([list(map(_data_ptr, tensors[pos])) for pos in self.positions], dtype=torch.int64)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        last = self.last
        if last is not None and last[0] == stream and torch.equal(last[1], ptrs):
            if keep is not None:
                keep.append(last[2])
            return last[2]
        base = torch.gather(ptrs, 1, self.bases)
        diff = ptrs - base
        bad = (diff % self.sizes != 0) & self.valid
        if bad.any():
            k, i = (int(x) for x in bad.nonzero()[0])
            name = self.names[k]
            raise ValueError(
                f"{name}[{i}] is not aligned to its element size ({int(self.sizes[k, i])} bytes) relative to "
                f"the first {name} tensor of its dtype; the {self.backend} backend addresses tensors of one "
                "list from one base"
            )
        offs = torch.where(self.valid, diff // self.sizes, 0)
        vec = self.vector
        aligned = self.static_aligned & ((ptrs[vec] % ALIGN_BYTES == 0) & (base[vec] % ALIGN_BYTES == 0)).all(0)
        host = torch.zeros(self.n, self.n_cols, dtype=torch.int64)
        host[:, self.cols] = offs.t()
        host[:, self.aligned_col] = aligned
        if device.type != "cuda":
            self.last = (stream, ptrs, host)
            return host
        pinned = host.pin_memory()
        out = pinned.to(device, non_blocking=True)
        if keep is not None:
            # A CUDA graph replays this copy from the pinned buffer: both must outlive it, and
            # the device copy holds nothing until the first replay, so no eager call reuses it.
            keep.append((pinned, out))
            self.last = None
        else:
            self.last = (stream, ptrs, out)
        return out


@dataclass
class Group:
    index: list[int]  # positions of this dtype's parameters in the call's lists; [0] is the base
    tiles: Tensor  # [T, COLS] int64 on the device
    n_tiles: int
    dtype: torch.dtype
    gathers: Tensor | None = None  # [G, GATHER_COLS] int64 on the device, or None: no gradient gathered


@dataclass
class Plan:
    """A step's static tables (what the tile table depends on is in its cache key)."""

    groups: list[Group]
    step_offs: Tensor | None  # [n * B] int64 on the device: b * steps[i].stride(0) at i * B + b, or None
    n_steps: int  # n * B, or 0 without step counts
    addresses: _Addresses = field(repr=False)
    copied: list[int] = field(default_factory=list)  # gradients read through a copy in their parameter's layout


@dataclass
class CheckPlan:
    """The non-finite check's static tables."""

    groups: list[tuple[list[int], Tensor, int]]  # (positions, tiles on the device, n_tiles) per dtype
    partials: Tensor  # [B, Tm] int32 scratch flags on the device
    tm: int
    addresses: _Addresses = field(repr=False)
    copied: list[int] = field(default_factory=list)  # gradients checked through a dense copy


class Planner:
    """One backend's tile tables for step calls and non-finite checks, cached by what they
    depend on (shapes, dtypes, layouts, B, which lists are present), and the address
    table of each call.

    ``chunk(total_elements, device)`` gives the tile length (a multiple of
    ``LEN_ALIGN``); ``backend`` names the backend in error messages. ``builds``
    counts the tile tables built (a steady-state step builds none).
    """

    def __init__(self, backend: str, chunk: Callable[[int, torch.device], int]):
        self.backend = backend
        self.chunk = chunk
        self.plans: collections.OrderedDict = collections.OrderedDict()
        self.builds = 0
        # Host buffers (and their device copies) that a captured CUDA graph reads at replay.
        self._graph_buffers: list = []

    def _keep(self, plan, device: torch.device) -> list | None:
        """Where a call being captured into a CUDA graph keeps what the graph reads (its
        tables, which the LRU may drop later), or None outside a capture."""
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return None
        self._graph_buffers.append(plan)
        return self._graph_buffers

    # ---- step calls -----------------------------------------------------------

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
            g = grads[i]
            if g.shape != p.shape or g.dtype != p.dtype:
                raise ValueError(
                    f"expected grads[{i}] of shape {list(p.shape)} and dtype {p.dtype}, "
                    f"got {list(g.shape)} {g.dtype}"
                )

    def plan(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Sequence[Tensor]],
        names: Sequence[str], steps: Sequence[Tensor],
    ) -> tuple[Plan, Tensor, Sequence[Tensor]]:
        """The cached tables for tensors of these shapes, dtypes and layouts (built on
        first sight), this call's address table (``[n, ADDR_COLS]`` int64 on the device),
        and the gradients to address (``grads``, unless one needed a copy).

        ``states`` holds every state list of the kernel in its column order; an
        absent (empty) list is never read (its address column is 0).
        """
        device = params[0].device
        if set(map(_device, grads)) != {device}:
            bad = next(i for i, g in enumerate(grads) if g.device != device)
            raise ValueError(f"expected grads[{bad}] on {device}, got {grads[bad].device}")
        key = (device, shapes_dtypes(params), shapes_dtypes(grads), layout(params), layout(grads),
               tuple(layout(s) if s else "absent" for s in states), len(steps), layout(steps) if steps else None)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._build(params, grads, states, names, steps)
            remember(self.plans, key, plan)
        else:
            self.plans.move_to_end(key)
        if plan.copied:
            grads = list(grads)
            for i in plan.copied:
                grads[i] = torch.empty_like(params[i]).copy_(grads[i])
        lists = (params, grads, *states, steps)
        return plan, plan.addresses.table(lists, device, self._keep(plan, device)), grads

    def _build(self, params, grads, states, names, steps) -> Plan:
        present = [(n, s) for n, s in zip(names, states) if s]
        self._check_layouts(params, grads, [s for _, s in present], [n for n, _ in present])
        n = len(params)
        B = params[0].size(0)
        device = params[0].device
        if steps:
            for i, s in enumerate(steps):
                if s.shape != (B,) or s.dtype != torch.float32 or s.device != device:
                    raise ValueError(
                        f"expected steps[{i}] of shape [{B}] and dtype float32 on {device}, "
                        f"got {list(s.shape)} {s.dtype} on {s.device}"
                    )
        self.builds += 1
        sizes = torch.tensor([p.numel() // B if B else 0 for p in params], dtype=torch.int64)
        chunk = self.chunk(sum(p.numel() for p in params), device)
        # Each gradient is read in place: laid out like its parameter, or through a gather
        # row; only one with more dims than a gather row holds is copied.
        layouts, copied = [], []
        for i, (p, g) in enumerate(zip(params, grads)):
            if _order(g) == _order(p) and model_major(g):
                layouts.append(None)
                continue
            dims = gather_dims(p, g)
            if len(dims) > MAX_GRAD_DIMS:
                copied.append(i)
                layouts.append(None)
            else:
                layouts.append(dims)
        g_model_stride = torch.tensor(
            [p.numel() // B if layouts[i] is None or B == 1 else grads[i].stride(0) for i, p in enumerate(params)],
            dtype=torch.int64)
        step_stride = torch.tensor([s.stride(0) for s in steps] if steps else [0] * n, dtype=torch.int64)
        groups = []
        firsts = torch.zeros(n, dtype=torch.int64)
        for dtype in FLOAT_DTYPES:
            index = [i for i, p in enumerate(params) if p.dtype == dtype]
            if not index:
                continue
            firsts[index] = index[0]
            live = torch.tensor([i for i in index if sizes[i] > 0], dtype=torch.int64)
            gather_rows, gather_of = [], torch.full((n,), -1, dtype=torch.int64)
            for i in index:
                if layouts[i] is not None and sizes[i] > 0:
                    gather_of[i] = len(gather_rows)
                    dims = layouts[i] + [(1, 0)] * (MAX_GRAD_DIMS - len(layouts[i]))
                    gather_rows.append([v for d in dims for v in d])
            rows = torch.zeros(0, COLS, dtype=torch.int64)
            if live.numel():
                t, b, start, length, first = _tiles(sizes[live], B, chunk)
                i = live[t]
                gathered = gather_of[i] >= 0
                rows = torch.empty(t.numel(), COLS, dtype=torch.int64)
                rows[:, COL_TENSOR] = i
                rows[:, COL_MODEL] = b
                rows[:, COL_OFFSET] = b * sizes[i] + start
                rows[:, COL_GRAD] = b * g_model_stride[i] + torch.where(gathered, 0, start)
                rows[:, COL_START] = start
                rows[:, COL_LEN] = length
                rows[:, COL_STEP] = b * step_stride[i]
                rows[:, COL_GATHER] = gather_of[i]
                rows[:, COL_FIRST] = first
                rows[:, COL_TILES] = (sizes[i] + chunk - 1) // chunk
            gathers = to_device(torch.tensor(gather_rows, dtype=torch.int64), device) if gather_rows else None
            groups.append(Group(index, to_device(rows, device), rows.size(0), params[index[0]].dtype, gathers))
        step_offs = None
        if steps:
            step_offs = to_device((step_stride[:, None] * torch.arange(B)).reshape(-1), device)
        # An address row is aligned where the slices and tiles are multiples of LEN_ALIGN
        # elements, the gradient is read in its parameter's layout, and (at each step) every
        # vector list's tensor and base are 16-byte aligned.
        static_aligned = (sizes % LEN_ALIGN == 0) & (sizes > 0)
        static_aligned &= torch.tensor([lay is None for lay in layouts])
        zeros = torch.zeros(n, dtype=torch.int64)
        es_p = torch.tensor([p.element_size() for p in params], dtype=torch.int64)
        lists = [(0, ADDR_P, es_p, firsts, True, "params"), (1, ADDR_G, es_p, firsts, True, "grads")]
        for j, (name, s) in enumerate(zip(names, states)):
            if s:
                es = torch.tensor([t.element_size() for t in s], dtype=torch.int64)
                lists.append((2 + j, ADDR_STATES[j], es, firsts, True, name))
        # the tensors holding elements: the parameters' lists have an empty tensor where a
        # parameter is empty; an empty parameter's step counts ([B]) are counted all the same
        valid = (sizes > 0).expand(len(lists), n).clone()
        if steps:
            lists.append((2 + len(states), ADDR_STEP, torch.full((n,), 4, dtype=torch.int64), zeros, False, "steps"))
            valid = torch.cat([valid, torch.ones(1, n, dtype=torch.bool)])
        addresses = _Addresses(n, ADDR_COLS, ADDR_ALIGNED, static_aligned, valid, lists, self.backend)
        return Plan(groups, step_offs, len(steps) * B, addresses, copied)

    # ---- non-finite checks -------------------------------------------------------

    def check(self, grads: Sequence[Tensor]) -> tuple[CheckPlan, Tensor, Sequence[Tensor]]:
        """The non-finite check's cached tables for gradients of these shapes, dtypes and
        layouts, this call's address table (``[n, NF_ADDR_COLS]``) and the gradients to
        read (``grads``, unless one needed a dense copy)."""
        g0 = grads[0]
        device = g0.device
        key = ("check", device, shapes_dtypes(grads), layout(grads))
        plan = self.plans.get(key)
        if plan is None:
            plan = self._build_check(grads)
            remember(self.plans, key, plan)
        else:
            self.plans.move_to_end(key)
        if plan.copied:
            grads = list(grads)
            for i in plan.copied:
                grads[i] = grads[i].contiguous()
        return plan, plan.addresses.table((grads,), device, self._keep(plan, device)), grads

    def _build_check(self, grads: Sequence[Tensor]) -> CheckPlan:
        others = [g for g in grads if g.dtype not in FLOAT_DTYPES and g.numel()]
        if others:
            raise TypeError(f"expected floating-point gradients, got {others[0].dtype}")
        self.builds += 1
        g0 = grads[0]
        B, device, n = g0.size(0), g0.device, len(grads)
        sizes = torch.tensor([g.numel() // B if B else 0 for g in grads], dtype=torch.int64)
        # Read only, and any order of a model's elements serves: a model-major gradient is
        # read in place, any other through a dense copy.
        copied = [i for i, g in enumerate(grads) if not model_major(g)]
        chunk = self.chunk(sum(g.numel() for g in grads), device)
        nch = (sizes + chunk - 1) // chunk
        tm = int(nch.sum())
        firsts = torch.zeros(n, dtype=torch.int64)
        groups, col = [], 0
        for dtype in FLOAT_DTYPES:
            index = [i for i, g in enumerate(grads) if g.dtype == dtype and sizes[i] > 0]
            if not index:
                continue
            firsts[index] = index[0]
            live = torch.tensor(index, dtype=torch.int64)
            t, b, start, length, _ = _tiles(sizes[live], B, chunk)
            i = live[t]
            cols = col + torch.cumsum(nch[live], 0) - nch[live]  # each tensor's first partial column
            rows = torch.empty(t.numel(), NF_COLS, dtype=torch.int64)
            rows[:, NF_TENSOR] = i
            rows[:, NF_OFFSET] = b * sizes[i] + start
            rows[:, NF_PART] = b * tm + cols[t] + start // chunk
            rows[:, NF_LEN] = length
            col += int(nch[live].sum())
            groups.append((index, to_device(rows, device), rows.size(0)))
        valid = sizes > 0
        static_aligned = (sizes % LEN_ALIGN == 0) & valid
        es = torch.tensor([g.element_size() for g in grads], dtype=torch.int64)
        addresses = _Addresses(n, NF_ADDR_COLS, NF_ADDR_ALIGNED, static_aligned, valid[None],
                               [(0, NF_ADDR_G, es, firsts, True, "grads")], self.backend)
        partials = torch.zeros(max(1, B * tm), dtype=torch.int32, device=device)
        return CheckPlan(groups, partials, tm, addresses, copied)
