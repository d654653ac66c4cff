"""Top-k sparse gradient all-reduce with error feedback, as a DDP communication hook.

Use::

    state = TopKState(model, density=0.01, warmup_steps=100)       # flat exchange
    state = TopKState(model, nodes=node_groups(8), density=0.01)    # hierarchical
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, topk_hook)

What one bucket computes (W ranks, the bucket's flat gradient ``g_r`` on rank r,
its residual ``e_r``, ``S_k(x)`` the top-k selection of :func:`hfkern.ops.topk.topk_select`
written densely: x at the selected positions, 0 elsewhere):

* **flat**: every rank selects ``S_k(g_r + e_r)``, all-gathers the values and
  int32 indices (fixed-size buffers of ``topk_capacity(k)`` entries per row, so
  all ranks send equal sizes; padding entries hold value 0 at index 0 and add
  nothing), and scatter-adds them in rank order:
  ``result = (1 / W) * sum_r S_k(g_r + e_r)``; new residual
  ``e_r <- (g_r + e_r) - S_k(g_r + e_r)`` (the selected entries set to zero,
  the rest kept bit for bit).
* **hierarchical** (``nodes=``: N nodes of L ranks, :func:`~hfkern.distributed.node_groups`):
  a dense reduce-scatter inside each node gives local rank l the node's sum of
  shard l, ``h = shard_l(sum_{r in node} (g_r + e_r))``; local rank l selects
  ``S_{k_s}(h)`` with ``k_s`` from the density and the shard length, all-gathers
  it with the rank l of every other node, scatter-adds, and an all-gather inside
  the node assembles the shards:
  ``result = (1 / W) * concat_l sum_nodes S_{k_s}(shard_l of the node sum)``;
  the residual keeps ``h - S_{k_s}(h)`` at shard l's positions (zero elsewhere)
  and is added to this rank's gradient before the next intra-node reduce, so
  it enters the node sum exactly once.
  Flat and hierarchical modes agree (up to the order of the float additions)
  whenever nothing is left behind: when each rank's nonzeros fit in ``k`` and
  each node's nonzeros per shard fit in ``k_s``, both equal the dense mean.
* **dense**: ``g_r + e_r`` multiplied by ``1 / W`` and all-reduced, as DDP's
  own reduction does, and the residual is cleared (everything was sent).
  A bucket goes dense during the warm-up (``step < warmup_steps``) and, when
  ``fallback`` is on, whenever the sparse message would be larger than the
  dense one: ``W * R * cap * (itemsize + 4) > n * itemsize`` for the flat
  all-gather, ``N * R * cap_s * (itemsize + 4) > R * s * itemsize`` for the
  inter-node all-gather of a shard (``R`` rows, ``s`` the shard length). With no
  residual yet this is bit for bit DDP's own all-reduce.

A bucket is selected as rows listing its parameters in model order (DDP
orders a bucket's parameters by when their gradients became ready, and
rebuilds its buckets after the first iteration), so the selection does not
depend on that order. In hierarchical mode the hook waits for the intra-node
reduce-scatter before selecting (on NCCL the wait only orders the streams);
the inter-node exchange runs on while the backward pass goes on, and the
node's final all-gather is issued by the hook call of the next bucket (the
last bucket issues its own). Collectives go out only from hook calls, in
bucket order, never from a future's callback, because every rank must issue
the collectives of a group in the same order, with any number of buckets.

A complex parameter's gradient is its real view in the bucket (DDP reduces
complex gradients as real ones): it counts as ``2 * numel`` elements, real and
imaginary parts are selected apart, and its residual is kept in that layout
(:meth:`TopKState.state_dict` holds it as a complex tensor, like the parameter).
A bucket of parameters with no elements passes through (nothing is sent).
Sparse gradients (``nn.Embedding(sparse=True)``) are refused with a TypeError,
as DDP's own communication hooks do not take them either.

Arrays of models (``per_model=B``): every parameter is ``[B, ...]``, and model
b's part of a bucket is ``param[b]`` of each of the bucket's parameters, wherever
the parameter's strides put its elements there (DDP lays a gradient out with its
parameter's strides: a transposed or channels-last parameter's models are not
consecutive blocks). The bucket is gathered into a ``[B, m]`` view (an index map
built once per bucket from the strides) and each model's row is selected on its own (the ``[R, n]``
form of the selection), so a model with large gradients does not take the
others' share of the message: every model sends its own k.

Error feedback state is per bucket, one flat residual in the bucket's layout.
DDP rebuilds its buckets after the first iteration, and a restarted job starts
from the initial layout again, so residuals are also addressed per parameter
(its position in ``model.parameters()``): a bucket whose parameters changed
takes over their residual segments. Under ``find_unused_parameters=True`` a
parameter that no rank used in a step gets no gradient from DDP (it leaves
such a parameter's ``grad`` untouched), so what the exchange sent of its
residual in that step is lost. :meth:`TopKState.state_dict` holds the
residuals per parameter, the step and the seed; every rank saves and loads its
own (residuals differ between ranks).

The step counter advances after the last bucket of a backward pass
(``bucket.is_last()``), and a hook call changes the state (step, residuals,
statistics) only once its bucket's collective is issued: a call that raises
before leaves it as it was. The selection's seed of a bucket is a function of
``(seed, step, bucket index)``, so a restart reproduces the same selections
over the same buckets: a model whose gradients fit one bucket continues bit for
bit; with several, the first step after a restart selects over DDP's initial
layout where the uninterrupted run had the rebuilt one (what it did not send
stays in the residuals); later steps use the same buckets and seeds again, on
values that differ by that step.
"""

import logging
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..ops.topk import topk_capacity, topk_select
from .groups import NodeGroups

__all__ = ["TopKState", "topk_hook"]

logger = logging.getLogger("hfkern")

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_INDEX_BYTES = 4  # int32 indices
_MODES = ("dense", "flat", "hierarchical")


def _select(x: torch.Tensor, k: int, exact: bool, seed: int):
    return topk_select(x, k, exact=exact, seed=seed)


def _capacity(k: int, exact: bool) -> int:
    return topk_capacity(k, exact)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=True)


def _check_density(value, where: str) -> float:
    """``value`` as a plain float in (0, 1]: any real number (int, float, numpy scalar, Fraction;
    not a bool), as :func:`k_for` takes it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: density must be a real number in (0, 1], got "
                        f"{type(value).__name__} {value!r}")
    d = float(value)
    if not (0.0 < d <= 1.0):  # also NaN
        raise ValueError(f"{where}: density must be in (0, 1], got {value!r}")
    return d


def _check_int(value, name: str, minimum: int) -> int:
    """``value`` as a plain int >= ``minimum``: any integral number (int, numpy integer; not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"TopKState: {name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"TopKState: {name} must be >= {minimum}, got {value}")
    return value


def _is_non_member(group) -> bool:
    """Whether ``group`` is torch's placeholder for a group this rank is not in (an int, -100)."""
    placeholder = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return placeholder is not None and type(group) is type(placeholder) and group == placeholder


def k_for(density: float, m: int) -> int:
    """Entries a row of length ``m`` sends at ``density``: ``round(density * m)``, in [1, m].

    ``density`` is a real number in (0, 1], ``m`` an int >= 0. An empty row (``m = 0``)
    sends nothing: 0 (:func:`topk_hook` passes a bucket of no elements through). Raises
    TypeError / ValueError naming what was expected and what came.
    """
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"k_for: expected density to be a real number in (0, 1], got "
                        f"{type(density).__name__} {density!r}")
    d = float(density)
    if not 0.0 < d <= 1.0:  # also NaN
        raise ValueError(f"k_for: expected density in (0, 1], got {density!r}")
    if isinstance(m, bool) or not isinstance(m, numbers.Integral):
        raise TypeError(f"k_for: expected m (the row length) to be an int >= 0, got {type(m).__name__} {m!r}")
    m = int(m)
    if m < 0:
        raise ValueError(f"k_for: expected m (the row length) to be an int >= 0, got {m}")
    if m == 0:
        return 0
    return max(1, min(m, round(d * m)))


def _real_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` in a DDP bucket: a complex parameter is its real view (2 per element)."""
    return p.numel() * (2 if p.is_complex() else 1)


@dataclass
class _BucketPlan:
    """What a bucket looks like, computed once per (bucket index, parameters)."""

    keys: tuple[int, ...]        # parameter positions in model.parameters()
    numels: tuple[int, ...]
    n: int                       # elements in the bucket
    rows: int                    # R: models (per_model) or 1
    m: int                       # elements per row
    perm: torch.Tensor | None    # [R * m] int64: bucket position of each row-major element (rows
                                 # list parameters in model order); None: identity
    shard_pos: dict              # L -> TopKState._shard's answer for nodes of L ranks


@dataclass
class BucketStats:
    """The last decision for one bucket: ``mode`` (dense / flat / hierarchical),
    ``density``, ``k`` per row (per shard row in hierarchical mode), ``capacity`` per
    row, ``rows`` and ``payload_bytes`` this rank handed to collectives for it."""

    mode: str
    density: float
    k: int
    capacity: int
    rows: int
    payload_bytes: int


class TopKState:
    """State of :func:`topk_hook`: configuration, step counter and residuals.

    Args:
        model: the module DDP wraps (or the DDP module itself); its parameter
            order names the residuals in :meth:`state_dict`.
        process_group: the data-parallel group, a ``torch.distributed.ProcessGroup``
            this rank is in (None: the world); the placeholder ``new_group`` returns
            to other ranks raises a ValueError.
        density: fraction of each row (each model's part of a bucket, or the
            whole bucket) that is sent, a real number in (0, 1] (as :func:`k_for`
            takes it: int, float, numpy scalar, Fraction; stored as a float).
            Default 0.01 unless ``density_schedule`` is given. The int arguments
            (``warmup_steps``, ``seed``, ``per_model``, schedule steps) take any
            integral number (numpy integers too), not bools.
        density_schedule: instead of ``density``: a callable ``step -> density``,
            or a list of ``(step, density)`` pairs with increasing steps, the first
            at step 0; the density at step t is the last pair's with ``step <= t``.
        warmup_steps: the first ``warmup_steps`` steps all-reduce densely.
        nodes: :class:`~hfkern.distributed.NodeGroups` of ``process_group``: the
            hierarchical exchange (dense inside a node, sparse between nodes).
            None: the flat exchange.
        exact: select with ``torch.topk`` semantics (k entries exactly) instead of
            the approximate threshold selection (between k and 1.25k entries).
        seed: base seed of the approximate selection.
        per_model: B for an array of B models (every parameter ``[B, ...]``):
            each model's part of a bucket is selected on its own. None: one row.
        fallback: go dense when the sparse message would be larger (see the
            module docstring). False forces the sparse exchange after warm-up
            (used to test it at density 1).

    Construction is collective: after its own checks, every rank of the process
    group all-gathers (one ``all_gather_object``) the settings that decide the
    messages' sizes and modes -- ``density`` or ``density_schedule`` (a
    callable only as "a callable"), ``warmup_steps``, ``exact``, ``fallback``,
    ``per_model``, the ``nodes`` split -- and the parameters' shapes, dtypes
    and ``requires_grad``, and raises a ValueError on every rank that names the
    first that differs and each rank's value (ranks of the process group): a
    mismatch would otherwise make the ranks' collectives differ (Gloo aborts
    the process, NCCL hangs). ``seed`` may differ (it changes a rank's own
    selection, not the message sizes). :meth:`load_state_dict` checks the
    restored step the same way.
    """

    def __init__(
        self,
        model: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        density: float | None = None,
        density_schedule: Callable[[int], float] | Sequence[tuple[int, float]] | None = None,
        warmup_steps: int = 0,
        nodes: NodeGroups | None = None,
        exact: bool = False,
        seed: int = 0,
        per_model: int | None = None,
        fallback: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"TopKState: model must be a torch.nn.Module, got {type(model).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TopKState: torch.distributed is not initialized; "
                               "call torch.distributed.init_process_group first")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            if _is_non_member(process_group):
                raise ValueError(f"TopKState: this rank ({dist.get_rank()} of the world) is not in the process "
                                 f"group: torch.distributed.new_group returns the placeholder "
                                 f"GroupMember.NON_GROUP_MEMBER ({process_group!r}) to ranks outside the group; "
                                 f"expected a ProcessGroup this rank belongs to (build the TopKState on its "
                                 f"members only)")
            raise TypeError(f"TopKState: expected process_group to be a torch.distributed.ProcessGroup or "
                            f"None, got {type(process_group).__name__} {process_group!r}")
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)

        if density is not None and density_schedule is not None:
            raise ValueError("TopKState: give density or density_schedule, not both")
        self._schedule_fn: Callable[[int], float] | None = None
        self._schedule: list[tuple[int, float]] | None = None
        if density_schedule is None:
            self.density = _check_density(0.01 if density is None else density, "TopKState")
        elif callable(density_schedule):
            self.density = None
            self._schedule_fn = density_schedule
        else:
            if isinstance(density_schedule, (str, bytes)) or not isinstance(density_schedule, Iterable):
                raise TypeError(f"TopKState: density_schedule must be a callable of the step or (step, "
                                f"density) pairs, got {type(density_schedule).__name__} {density_schedule!r}")
            pairs = list(density_schedule)
            if not pairs:
                raise ValueError("TopKState: density_schedule is empty; expected (step, density) pairs")
            checked = []
            for i, pair in enumerate(pairs):
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise TypeError(f"TopKState: density_schedule[{i}] must be a (step, density) pair, got {pair!r}")
                step = _check_int(pair[0], f"density_schedule[{i}] step", 0)
                if checked and step <= checked[-1][0]:
                    raise ValueError(f"TopKState: density_schedule steps must increase; entry {i} has step "
                                     f"{step} after {checked[-1][0]}")
                checked.append((step, _check_density(pair[1], f"TopKState: density_schedule[{i}]")))
            if checked[0][0] != 0:
                raise ValueError(f"TopKState: density_schedule must start at step 0, got {checked[0][0]}")
            self.density = None
            self._schedule = checked
        self.warmup_steps = _check_int(warmup_steps, "warmup_steps", 0)
        self.seed = _check_int(seed, "seed", 0)
        if not isinstance(exact, bool):
            raise TypeError(f"TopKState: exact must be a bool, got {type(exact).__name__}")
        if not isinstance(fallback, bool):
            raise TypeError(f"TopKState: fallback must be a bool, got {type(fallback).__name__}")
        self.exact, self.fallback = exact, fallback

        if nodes is not None:
            if not isinstance(nodes, NodeGroups):
                raise TypeError(f"TopKState: nodes must be NodeGroups (from node_groups), "
                                f"got {type(nodes).__name__}")
            pg_ranks = tuple(dist.get_process_group_ranks(self.process_group))
            if nodes.ranks != pg_ranks:
                raise ValueError(f"TopKState: nodes split the ranks {nodes.ranks}, but the process "
                                 f"group holds {pg_ranks}")
        self.nodes = nodes

        named = list(model.named_parameters())
        params = [p for _, p in named]
        self._keys = {id(p): i for i, p in enumerate(params)}
        self._names = [name for name, _ in named]
        # Elements in the buckets and residuals (a complex parameter counts as its real view);
        # the parameters' own element counts and dtypes are what state_dict() holds.
        self._numels = [_real_numel(p) for p in params]
        self._param_numels = [p.numel() for p in params]
        self._dtypes = [p.dtype for p in params]
        if per_model is not None:
            per_model = _check_int(per_model, "per_model", 1)
            for i, p in enumerate(params):
                if p.requires_grad and (p.dim() == 0 or p.size(0) != per_model):
                    raise ValueError(f"TopKState: per_model={per_model} needs every parameter shaped "
                                     f"[{per_model}, ...]; parameter {i} has shape {tuple(p.shape)}")
        self.per_model = per_model

        self.step = 0
        self._plans: dict[int, _BucketPlan] = {}
        # bucket index -> (parameter keys, numels, flat residual in the bucket's layout)
        self._residuals: dict[int, tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] = {}
        # parameter key -> flat residual segment not yet claimed by a bucket
        self._loose: dict[int, torch.Tensor] = {}
        self._last_mode: dict[int, str] = {}
        self.bucket_stats: dict[int, BucketStats] = {}
        self.payload_bytes = 0  # total over the run, this rank
        # Hierarchical buckets of the current backward pass whose final
        # intra-node all-gather is not issued yet, in bucket order (see
        # _hierarchical); the next hook call issues them before its own.
        self._pending: list[Callable[[], None]] = []

        # Every rank must agree on what sets the sizes and kinds of the messages (a mismatch
        # would make the ranks' collectives differ: Gloo aborts the process, NCCL hangs).
        mine = self._agreed_settings(params)
        _check_agreement(self.process_group, "TopKState", mine,
                         "every rank of the process group must build its TopKState with the same settings "
                         "and an identical model")

    def _agreed_settings(self, params: list[torch.Tensor]) -> dict:
        """What must be equal on every rank: the settings that decide each bucket's mode and
        message sizes, and the parameters' shapes and dtypes (the buckets' layouts)."""
        if self._schedule_fn is not None:
            schedule = "a callable"  # not comparable across processes; what it returns is the user's
        else:
            schedule = self._schedule
        nodes = None if self.nodes is None else {"node_size": self.nodes.node_size,
                                                 "num_nodes": self.nodes.num_nodes}
        return {"density": self.density, "density_schedule": schedule, "warmup_steps": self.warmup_steps,
                "exact": self.exact, "fallback": self.fallback, "per_model": self.per_model, "nodes": nodes,
                "parameters": [(tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for p in params]}

    # ---- schedule --------------------------------------------------------------------------
    def density_at(self, step: int) -> float:
        """The density the schedule gives at ``step``."""
        if self._schedule_fn is not None:
            return _check_density(self._schedule_fn(step), f"TopKState: density_schedule({step})")
        if self._schedule is not None:
            d = self._schedule[0][1]
            for s, v in self._schedule:
                if s > step:
                    break
                d = v
            return d
        return self.density

    def seed_for(self, step: int, bucket_index: int) -> int:
        """The selection seed of one bucket at one step (a restart reproduces it)."""
        return (self.seed * 0x9E3779B1 + step * 1_000_003 + bucket_index) % (2 ** 31 - 1)

    # ---- bucket layout and residuals -------------------------------------------------------
    def _plan(self, index: int, params: list[torch.Tensor], buffer: torch.Tensor) -> _BucketPlan:
        try:
            keys = tuple(self._keys[id(p)] for p in params)
        except KeyError:
            raise ValueError("topk_hook: a bucket holds a parameter that is not among the model's "
                             "parameters; pass TopKState the module that DDP wraps") from None
        plan = self._plans.get(index)
        if plan is not None and plan.keys == keys and plan.n == buffer.numel():
            return plan
        # A complex parameter's gradient is its real view in the bucket (DDP reduces complex
        # gradients as real ones): 2 elements per entry, real and imaginary parts selected apart.
        numels = tuple(_real_numel(p) for p in params)
        n = buffer.numel()
        if sum(numels) != n:
            raise ValueError(f"topk_hook: bucket {index} holds {n} elements but its parameters hold "
                             f"{sum(numels)} (complex ones counted as their real views); expected a "
                             f"dense, unpadded bucket")
        if n >= 2 ** 31:
            raise ValueError(f"topk_hook: bucket {index} has {n} elements; int32 indices need fewer "
                             f"than 2**31 (lower bucket_cap_mb)")
        # Rows list the parameters in model order, whatever order DDP put them in
        # the bucket (it reorders them when it rebuilds its buckets after the
        # first iteration), so a bucket's selection does not depend on it.
        offsets = [0]
        for numel in numels[:-1]:
            offsets.append(offsets[-1] + numel)
        order = sorted(range(len(params)), key=lambda i: keys[i])
        rows = 1 if self.per_model is None else self.per_model
        m = n // rows
        perm = torch.empty(rows, m, dtype=torch.int64)
        col = 0
        for i in order:
            p, numel = params[i], numels[i]
            if rows > 1 and (p.dim() == 0 or p.size(0) != rows):
                raise ValueError(f"topk_hook: per_model={rows} needs every parameter shaped "
                                 f"[{rows}, ...]; parameter {keys[i]} has shape {tuple(p.shape)}")
            mp = numel // rows
            perm[:, col:col + mp] = _bucket_positions(p).view(rows, mp) + offsets[i]
            col += mp
        perm = perm.view(-1)
        perm = None if torch.equal(perm, torch.arange(n)) else perm.to(buffer.device)
        plan = _BucketPlan(keys=keys, numels=numels, n=n, rows=rows, m=m, perm=perm, shard_pos={})
        self._plans[index] = plan
        return plan

    def _shard(self, plan: _BucketPlan, device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(s, bucket positions of this rank's shard, their indices in the flat [R * s]
        shard); columns past the row's end (padding) are left out."""
        L, l = self.nodes.node_size, self.nodes.local_rank
        if L not in plan.shard_pos:
            s = -(-plan.m // L)
            cols = torch.arange(l * s, (l + 1) * s, dtype=torch.int64)
            valid = (cols < plan.m).expand(plan.rows, s)
            flat = torch.arange(plan.rows, dtype=torch.int64)[:, None] * plan.m + cols.clamp(max=plan.m - 1)
            pos = flat if plan.perm is None else plan.perm.cpu()[flat]
            where = torch.arange(plan.rows * s, dtype=torch.int64).view(plan.rows, s)
            plan.shard_pos[L] = (s, pos[valid].to(device), where[valid].to(device))
        return plan.shard_pos[L]

    def _residual(self, index: int, plan: _BucketPlan, like: torch.Tensor, create: bool):
        """``(residual, take)``: this bucket's flat residual ([n], bucket layout), with the
        segments of its parameters taken over from other layouts (None while there is none and
        not ``create``), and a function that records the take-over. Nothing changes before
        ``take()`` is called, so a hook call that raises first leaves the state as it was."""
        entry = self._residuals.get(index)
        if entry is not None and entry[0] == plan.keys:
            return entry[2], _nothing
        # The layout changed (DDP rebuilt its buckets, or the state was loaded):
        # release every stored bucket that holds one of these parameters, or this
        # index. None of them was touched in this step (buckets already handled
        # in this step have the new layout, whose parameters are disjoint from
        # this bucket's), so nothing in flight is affected.
        mine = set(plan.keys)
        released = [j for j, (keys, _, _) in self._residuals.items() if j == index or mine.intersection(keys)]
        found = {key: self._loose[key] for key in plan.keys if key in self._loose}
        for j in released:
            keys, numels, t = self._residuals[j]
            found.update((key, seg) for key, seg in zip(keys, t.split(list(numels))) if key in mine)
        res = None
        if create or found:
            res = torch.zeros(plan.n, dtype=like.dtype, device=like.device)
            off = 0
            for key, numel in zip(plan.keys, plan.numels):
                seg = found.get(key)
                if seg is not None:
                    if seg.numel() != numel:
                        raise ValueError(f"TopKState: residual of parameter {key} has {seg.numel()} "
                                         f"elements, the parameter {numel}")
                    res[off:off + numel].copy_(seg)
                off += numel

        def take():
            for j in released:
                keys, numels, t = self._residuals.pop(j)
                for key, seg in zip(keys, t.split(list(numels))):
                    self._loose[key] = seg
            if res is not None:
                for key in plan.keys:
                    self._loose.pop(key, None)
                self._residuals[index] = (plan.keys, plan.numels, res)

        return res, take

    def _param_name(self, key) -> str:
        return "a parameter not in the model" if key is None else f"parameter {key} ({self._names[key]!r})"

    # ---- decisions ------------------------------------------------------------------------
    def _decide(self, step: int, plan: _BucketPlan, itemsize: int) -> tuple[str, float, int, int]:
        """(mode, density, k per row, capacity per row) of one bucket at ``step``."""
        density = self.density_at(step)
        if plan.m == 0:  # nothing to send (topk_hook passes the bucket through)
            return "dense", density, 0, 0
        if step < self.warmup_steps:
            return "dense", density, plan.m, plan.m
        if self.nodes is None:
            k = k_for(density, plan.m)
            cap = _capacity(k, self.exact)
            sparse = self.world_size * plan.rows * cap * (itemsize + _INDEX_BYTES)
            dense = plan.n * itemsize
            mode = "flat"
        else:
            s = -(-plan.m // self.nodes.node_size)
            k = k_for(density, s)
            cap = _capacity(k, self.exact)
            sparse = self.nodes.num_nodes * plan.rows * cap * (itemsize + _INDEX_BYTES)
            dense = plan.rows * s * itemsize
            mode = "hierarchical"
        if self.fallback and sparse > dense:
            return "dense", density, k, cap
        return mode, density, k, cap

    def _issue_pending(self) -> None:
        while self._pending:
            self._pending.pop(0)()

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step, seed and this rank's residuals per parameter (copies, 1-D, in the parameter's
        element count and dtype: a complex parameter's as a complex tensor); what a restart needs."""
        segs = dict(self._loose)
        for keys, numels, t in self._residuals.values():
            segs.update(zip(keys, t.split(list(numels))))
        residuals = {}
        for key, seg in segs.items():
            seg = seg.clone()
            residuals[key] = torch.view_as_complex(seg.view(-1, 2)) if self._dtypes[key].is_complex else seg
        return {"step": self.step, "seed": self.seed, "world_size": self.world_size, "rank": self.rank,
                "hierarchical": self.nodes is not None, "per_model": self.per_model,
                "residuals": residuals}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` of this rank; the configuration must match. Raises
        TypeError / ValueError, and changes nothing, when the state does not fit.

        Collective once this rank's checks pass: the ranks all-gather the restored step
        (it decides every bucket's mode), and a ValueError on every rank names each rank's
        step where they differ; every rank of the process group must call it."""
        if not isinstance(state, dict):
            raise TypeError(f"TopKState.load_state_dict: expected a dict (from state_dict()), "
                            f"got {type(state).__name__}")
        for name, mine in (("world_size", self.world_size), ("rank", self.rank),
                           ("hierarchical", self.nodes is not None), ("per_model", self.per_model)):
            if state.get(name) != mine:
                raise ValueError(f"TopKState.load_state_dict: the state was saved with {name}="
                                 f"{state.get(name)!r}, this state has {mine!r}")
        # Everything is checked before anything is assigned.
        step = _check_int(state.get("step"), "load_state_dict: step", 0)
        seed = _check_int(state.get("seed"), "load_state_dict: seed", 0)
        residuals = state.get("residuals")
        if not isinstance(residuals, dict):
            raise TypeError(f"TopKState.load_state_dict: residuals must be a dict of parameter position -> "
                            f"tensor, got {type(residuals).__name__}")
        n_params = len(self._keys)
        for key, t in residuals.items():
            if not (isinstance(key, int) and not isinstance(key, bool) and 0 <= key < n_params):
                raise ValueError(f"TopKState.load_state_dict: residual key {key!r} is not a parameter "
                                 f"position in [0, {n_params})")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != self._param_numels[key]:
                what = f"a {t.dim()}-D tensor of {t.numel()} elements" if isinstance(t, torch.Tensor) \
                    else type(t).__name__
                raise ValueError(f"TopKState.load_state_dict: the residual of parameter {key} must be a 1-D "
                                 f"tensor of its {self._param_numels[key]} elements, got {what}")
            if t.dtype != self._dtypes[key]:
                raise ValueError(f"TopKState.load_state_dict: expected the residual of parameter {key} in "
                                 f"the parameter's dtype {self._dtypes[key]}, got {t.dtype}")
        # The step decides every bucket's mode (warm-up, schedule): ranks restored to different
        # steps would send messages of different sizes. One collective; everything else here is
        # per rank.
        _check_agreement(self.process_group, "TopKState.load_state_dict", {"step": step},
                         "every rank must load a state saved at the same step (the ranks' own "
                         "state_dict() of one checkpoint)")
        self.step, self.seed = step, seed
        self._residuals.clear()
        # Kept in the buckets' layout: a complex parameter's residual as its real view.
        self._loose = {key: _as_real_flat(t.detach().clone(memory_format=torch.contiguous_format))
                       for key, t in residuals.items()}


def _nothing() -> None:
    pass


def _check_agreement(group, where: str, mine: dict, hint: str) -> None:
    """All-gather ``mine`` over ``group`` (one collective) and raise ValueError on every rank,
    naming the first setting that differs and each rank's value, when the ranks disagree."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    for key in mine:
        values = [g.get(key) for g in gathered]
        if all(v == values[0] for v in values):
            continue
        if key == "parameters":
            counts = [len(v) for v in values]
            if len(set(counts)) > 1:
                what = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
                raise ValueError(f"{where}: the ranks disagree on the number of parameters ({what}); {hint}")
            i = next(i for i in range(counts[0]) if any(v[i] != values[0][i] for v in values))
            what = ", ".join(f"rank {r}: shape {v[i][0]} {v[i][1]}{'' if v[i][2] else ' (no grad)'}"
                             for r, v in enumerate(values))
            raise ValueError(f"{where}: the ranks disagree on parameter {i} ({what}); {hint}")
        what = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise ValueError(f"{where}: the ranks disagree on {key} ({what}); {hint}")


def _as_real_flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor in the bucket layout: a complex one as its real view."""
    return torch.view_as_real(t).reshape(-1) if t.is_complex() else t


def _pack(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One uint8 message of values then int32 indices (one collective instead of two)."""
    return torch.cat([values.reshape(-1).view(torch.uint8), indices.reshape(-1).view(torch.uint8)])


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in new contiguous memory (offset 0)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _bucket_positions(p: torch.Tensor) -> torch.Tensor:
    """Where each element of ``p`` (in row-major order, ``[p.numel()]``) sits in its segment of a
    DDP bucket: DDP lays a dense, non-overlapping parameter's gradient out with the parameter's
    strides (a transposed or channels-last parameter's model rows are not consecutive there),
    any other one contiguously. A complex parameter is its real view there (``[2 * p.numel()]``)."""
    if p.is_complex():
        p = torch.view_as_real(p.detach())
    if p.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    dims = sorted((d for d in range(p.dim()) if p.size(d) > 1), key=lambda d: p.stride(d))
    expected, dense = 1, True
    for d in dims:
        dense &= p.stride(d) == expected
        expected *= p.size(d)
    if not dense:
        return torch.arange(p.numel(), dtype=torch.int64)
    pos = torch.zeros(p.shape, dtype=torch.int64)
    for d in dims:
        shape = [1] * p.dim()
        shape[d] = p.size(d)
        pos += (torch.arange(p.size(d), dtype=torch.int64) * p.stride(d)).view(shape)
    return pos.reshape(-1)


def _scatter_add(gathered: torch.Tensor, ranks: int, entries: int, dtype, length: int) -> torch.Tensor:
    """Sum of ``ranks`` packed messages of ``entries`` (value, index) pairs into ``[length]``.

    One ``index_add_`` per rank, in rank order: within one rank's message the
    indices are distinct except for zero-valued padding, so each call is
    order-independent (also with atomics on a GPU), and every rank computes the
    same bits, which keeps the replicas identical.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    msg = gathered.view(ranks, -1)
    # Copies into buffers of their own, aligned for the dtypes: with one message, the slices are
    # "contiguous" already (a size-1 dim), and .contiguous() would keep their offset and row
    # stride, which need not be multiples of the item sizes.
    vals = _fresh(msg[:, :entries * itemsize]).view(dtype)
    idx = _fresh(msg[:, entries * itemsize:]).view(torch.int32).long()
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    total = torch.zeros(length, dtype=acc_dtype, device=gathered.device)
    for r in range(ranks):
        total.index_add_(0, idx[r], vals[r].to(acc_dtype))
    return total


def _selected_mask(flat_idx: torch.Tensor, count: torch.Tensor, cap: int, length: int) -> torch.Tensor:
    """[length] bool: which row-major positions the selection kept (padding excluded,
    without reading ``count`` on the host)."""
    valid = (torch.arange(cap, device=count.device)[None, :] < count.reshape(-1, 1)).to(torch.int32)
    hits = torch.zeros(length, dtype=torch.int32, device=flat_idx.device)
    hits.index_add_(0, flat_idx.reshape(-1).long(), valid.reshape(-1))
    return hits > 0


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the top-k sparse mean of the bucket over ``state.process_group``.

    Register with ``ddp.register_comm_hook(state, topk_hook)``. Returns a future
    of the bucket's averaged gradient ``[n]`` (the bucket's own buffer, written in
    place), as torch's ``allreduce_hook`` does. What is computed: see the module
    docstring of :mod:`hfkern.distributed.topk`.

    Raises TypeError for a sparse gradient or a bucket dtype it does not take, ValueError
    for a bucket that does not match the model's parameters, before anything in ``state``
    changes. A bucket of no elements is passed through (nothing is sent).

    In hierarchical mode the future of a bucket that is not the last one
    (``bucket.is_last()``) completes only after the hook has been called for the
    next bucket, which issues its last collective; DDP calls the hook for every
    bucket, in index order, before it waits on any of the futures.
    """
    # Every collective is issued here, on the thread that calls the hook, never
    # from a future's callback: Gloo and NCCL match collectives on a group by
    # the order they were issued in, and a callback runs when a collective
    # completes, which differs between ranks. Earlier buckets' deferred
    # collectives go first, so every rank issues one sequence per group (they
    # belong to earlier calls, and go out even if this bucket is refused below).
    state._issue_pending()

    buf = bucket.buffer()
    index = bucket.index()
    params = list(bucket.parameters())
    if buf.layout != torch.strided:
        who = ", ".join(state._param_name(state._keys.get(id(p))) for p in params)
        raise TypeError(f"topk_hook: bucket {index} ({who}): expected a dense gradient, got a sparse one "
                        f"({buf.layout}); the hook does not support sparse gradients (nn.Embedding / "
                        f"nn.EmbeddingBag with sparse=True), as DDP's own communication hooks do not")
    if buf.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"topk_hook: bucket dtype must be one of {_FLOAT_DTYPES}, got {buf.dtype}")
    plan = state._plan(index, params, buf)
    step = state.step
    mode, density, k, cap = state._decide(step, plan, buf.element_size())
    last = bucket.is_last()

    def commit(stats: BucketStats, take: Callable[[], None]) -> None:
        """Records this call in the state, once its collective is issued: nothing before
        can have changed it, so a call that raises leaves the state as it was."""
        take()
        state.bucket_stats[index] = stats
        state.payload_bytes += stats.payload_bytes
        if last:
            state.step += 1
        if state._last_mode.get(index) != mode:
            logger.debug("topk_hook: bucket %d (%d elements) goes %s at step %d (density %g)",
                         index, plan.n, mode, step, density)
            state._last_mode[index] = mode

    if plan.n == 0:  # parameters of no elements: nothing to send, on any rank
        _, take = state._residual(index, plan, buf, create=False)
        commit(BucketStats(mode, density, k, cap, plan.rows, 0), take)
        fut = _future_like(buf)
        fut.set_result(buf)
        return fut

    if mode == "dense":
        res, take = state._residual(index, plan, buf, create=False)
        if res is not None:
            buf.add_(res)
        nbytes = buf.numel() * buf.element_size()
        # DDP's own pre-division, bit for bit: a multiplication by the float reciprocal (a
        # division rounds differently where the world size is not a power of two)
        buf.mul_(1.0 / state.world_size)
        work = dist.all_reduce(buf, group=state.process_group, async_op=True)
        if res is not None:
            res.zero_()  # everything was sent
        commit(BucketStats(mode, density, k, cap, plan.rows, nbytes), take)
        return work.get_future().then(lambda fut: fut.value()[0])

    res, take = state._residual(index, plan, buf, create=True)
    buf.add_(res)
    seed = state.seed_for(step, index)
    if mode == "flat":
        return _flat(state, plan, buf, res, k, cap, seed, density, commit, take)
    return _hierarchical(state, plan, buf, res, k, cap, seed, density, last, commit, take)


def _rows(plan: _BucketPlan, flat: torch.Tensor) -> torch.Tensor:
    """[R, m] row-major view (per-model gather) of a bucket-layout ``[n]`` tensor."""
    return (flat if plan.perm is None else flat[plan.perm]).view(plan.rows, plan.m)


def _unrows(plan: _BucketPlan, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write row-major ``[R * m]`` into the bucket-layout ``out``."""
    if plan.perm is None:
        return out.copy_(rows.reshape(-1))
    return out.index_copy_(0, plan.perm, rows.reshape(-1).to(out.dtype))


def _flat(state, plan, buf, res, k, cap, seed, density, commit, take):
    R, m = plan.rows, plan.m
    acc = _rows(plan, buf)
    sel = _select(acc, k, state.exact, seed)
    base = torch.arange(R, device=buf.device, dtype=torch.int64)[:, None] * m
    flat_idx = (sel.indices.long() + base).to(torch.int32)
    kept = _selected_mask(flat_idx, sel.count, cap, R * m).view(R, m)
    left = torch.where(kept, torch.zeros_like(acc), acc)

    packed = _pack(sel.values, flat_idx)
    W = state.world_size
    gathered = torch.empty(W * packed.numel(), dtype=torch.uint8, device=buf.device)
    work = _all_gather(gathered, packed, state.process_group)
    _unrows(plan, left, res)  # what was not sent
    commit(BucketStats("flat", density, k, cap, R, packed.numel()), take)

    def finish(fut):  # local work only: no collective from a callback (see topk_hook)
        fut.value()  # raises if the all-gather failed (its buffer holds no messages)
        total = _scatter_add(gathered, W, R * cap, buf.dtype, R * m)
        total.div_(W)
        return _unrows(plan, total, buf)

    return work.get_future().then(finish)


def _future_like(t: torch.Tensor) -> torch.futures.Future:
    """An empty future whose value will be on ``t``'s device (a CUDA future
    synchronizes streams for whoever waits on it)."""
    return torch.futures.Future(devices=[t.device]) if t.is_cuda else torch.futures.Future()


def _hierarchical(state, plan, buf, res, k, cap, seed, density, last, commit, take):
    nodes: NodeGroups = state.nodes
    L, N = nodes.node_size, nodes.num_nodes
    R, m = plan.rows, plan.m
    s, shard_pos, shard_where = state._shard(plan, buf.device)
    acc = _rows(plan, buf)
    padded = torch.zeros(R, L * s, dtype=buf.dtype, device=buf.device)
    padded[:, :m] = acc
    chunks = padded.view(R, L, s).transpose(0, 1).contiguous()      # [L, R, s]: chunk l to local rank l
    shard = torch.empty(R * s, dtype=buf.dtype, device=buf.device)  # flat: Gloo checks dim 0
    # Payload this rank hands to the three collectives (known before they run).
    itemsize = buf.element_size()
    payload = L * R * s * itemsize + R * cap * (itemsize + _INDEX_BYTES) + R * s * itemsize
    # The selection needs the node's sum: wait for the reduce-scatter here. On
    # NCCL, wait() only orders the streams (the host goes on); Gloo's
    # reduce-scatter has no future to chain on.
    _reduce_scatter(shard, chunks.view(-1), nodes.intra).wait()
    shard_rows = shard.view(R, s)
    sel = _select(shard_rows, k, state.exact, seed)
    base = torch.arange(R, device=buf.device, dtype=torch.int64)[:, None] * s
    flat_idx = (sel.indices.long() + base).to(torch.int32)
    kept = _selected_mask(flat_idx, sel.count, cap, R * s).view(R, s)
    left = torch.where(kept, torch.zeros_like(shard_rows), shard_rows)
    packed = _pack(sel.values, flat_idx)
    gathered = torch.empty(N * packed.numel(), dtype=torch.uint8, device=buf.device)
    work = _all_gather(gathered, packed, nodes.inter)
    # The residual lives at this rank's shard positions only; the rest of the
    # node's error was sent or is held by the other local ranks.
    res.zero_()
    res.index_copy_(0, shard_pos, left.view(-1)[shard_where])
    commit(BucketStats("hierarchical", density, k, cap, R, payload), take)
    full = torch.empty(L * R * s, dtype=buf.dtype, device=buf.device)
    out = _future_like(buf)

    def assemble(fut):
        try:
            fut.value()  # raises if the all-gather failed
            rows = full.view(L, R, s).transpose(0, 1).reshape(R, L * s)[:, :m]
            rows = rows.to(torch.float32 if buf.dtype in (torch.float16, torch.bfloat16) else buf.dtype)
            out.set_result(_unrows(plan, rows / state.world_size, buf))
        except Exception as e:  # noqa: BLE001 - whoever waits on ``out`` sees it, not a hang
            out.set_exception(e)

    def gather_node():
        try:
            work.wait()
            total = _scatter_add(gathered, N, R * cap, buf.dtype, R * s).to(buf.dtype)
            node_work = _all_gather(full, total, nodes.intra)
        except Exception as e:
            out.set_exception(e)
            raise
        node_work.get_future().then(assemble)

    # The node's all-gather of the summed shards needs the inter-node exchange's
    # result, but it is issued on the intra-node group, where the next bucket's
    # reduce-scatter goes too, so it may not go out from a callback (see
    # topk_hook). Waiting for the exchange here would hold up the backward pass
    # (on Gloo the host, on NCCL the compute stream) for every bucket; instead
    # the next bucket's hook call issues it, before its own reduce-scatter, so
    # the exchange overlaps the backward computation between the two hook
    # calls. The last bucket has no next call: it issues its own now.
    if last:
        gather_node()
    else:
        state._pending.append(gather_node)
    return out
