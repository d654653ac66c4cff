"""Optimizer-step benchmark: one array optimizer step for B models against B torch optimizers.

The workload is a hyper-parameter sweep of B ResNet-18 (CIFAR-10) models: 62
parameter tensors, 11,173,962 parameters per model. Every case (optimizer, B)
times one optimizer step over the B models' parameters, with each model's own
learning rate, on random gradients (the same values at every step; new tensors
by default, ``--grads`` below):

* ``torch``, ``triton``, ``cuda``: ``hfkern.optim.Adam`` (``AdamW``, ``SGD``) on the
  ``[B, ...]`` array parameters under ``hfkern.use_backend(name)``.
* ``fused_per_model``: B ``torch.optim.Adam(fused=True)`` optimizers, one per
  model, stepped one after another (what a sweep runs without hfkern; the
  baseline of the speedup target).
* ``foreach_per_model``: the same with ``foreach=True``.
* ``fused_one_list``: one ``torch.optim.Adam(fused=True)`` over all B models'
  parameters as one list: one learning rate for every model (model 0's), so
  not a sweep, but the fewest launches torch needs for these bytes.
* ``loop``: a per-tensor Python loop over the array parameters, in-place
  tensor ops with the per-model learning rate as a ``[B, 1, ...]`` column (how
  earlier horizontally fused training code wrote its optimizers).

``--ops lars,lamb`` adds the layer-wise adaptive optimizers (``hfkern.optim.LARS``,
``LAMB``: a norm pass over every (tensor, model), then the update). torch.optim
has neither, so their baselines are the ``loop`` only (per-model norms with
``torch.linalg.vector_norm`` per tensor); they are not in the default ``--ops``.

Each implementation's first step (from the same parameters, gradients and
zero state) is checked against the torch backend's: ``rel_err`` = the largest
over models of ||delta - delta_ref|| / ||delta_ref||, where delta is the change
the step made to that model's parameters. The step is then timed (median).

Gradients (``--grads``): a training loop's optimizer sees new gradient tensors
at every step (``zero_grad()`` sets them to None, torch's default, and backward
allocates new ones), so anything an optimizer keys by the gradients' identity
or address is rebuilt at every step of training. By default (``fresh``) every
timed step therefore gets new gradient tensors at new addresses: the
gradients are views into one buffer, and each step takes the next of
``GRAD_PLACEMENTS`` placements shifted by ``GRAD_SHIFT`` elements (an address
comes back only every ``GRAD_PLACEMENTS`` steps; no copy, so no extra memory
traffic), assigned to every parameter's ``.grad`` (per model, for the per-model
baselines) as ``zero_grad()`` + backward would leave them; the assignment is
inside the timed step for every implementation alike. The first, checked step
uses the problem's own gradients. ``kept`` is the earlier condition: the same
gradient tensors at every step (what no training loop with
``zero_grad(set_to_none=True)`` sees). Under ``--timer cuda_graph`` one
captured call is replayed, so its gradients are the captured ones either way.

    python bench/bench_optim.py                       # CUDA: adam, sgd_momentum, adamw; B = 4, 16, 32
    python bench/bench_optim.py --ops adam --B 16
    python bench/bench_optim.py --time-budget 60       # start no case after 60 s
    python bench/bench_optim.py --grads kept          # the same gradient tensors at every step
    python bench/bench_optim.py --smoke               # tiny models on the CPU, seconds
    python bench/bench_optim.py --show results.json   # table and summary of a result file

Results go to ``<out>/<name>.csv`` and ``.json`` (columns of
bench/report.py; bench/README.md explains how bytes are counted); a table and
the summary (per optimizer and B: % of copy bandwidth, speedup over B fused
torch optimizers, against the targets) are printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):  # HERE first: the sibling modules below; ROOT: the in-tree hfkern
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import bandwidth  # noqa: E402
import bench_kernels  # noqa: E402  (environment and run helpers shared with the kernel benchmark)
import report  # noqa: E402

import hfkern  # noqa: E402
import hfkern.optim  # noqa: E402

# Cases run in this order, so a time budget cuts the tail: Adam (the target) first.
OPS = ("adam", "sgd_momentum", "adamw")
# The layer-wise adaptive optimizers: no torch.optim namesake, so no torch baseline but the loop.
TRUST_OPS = ("lars", "lamb")
B_VALUES = (16, 32, 4)
SMOKE_B_VALUES = (3,)
SMOKE_WIDTH = 4
IMPLS = ("torch", "triton", "cuda", "fused_per_model", "foreach_per_model", "fused_one_list", "loop")
BACKENDS = ("torch", "triton", "cuda")
GPU_BACKENDS = ("triton", "cuda")
REFERENCE = "torch"
BASELINE = "fused_per_model"

# fp32 bytes one step moves per parameter element: every tensor the step reads
# once and every tensor it writes once. Adam/AdamW: param read + write (8),
# grad read (4), exp_avg read + write (8), exp_avg_sq read + write (8). SGD with
# momentum: param read + write (8), grad read (4), momentum buffer read + write
# (8). Per-model step counts and hyperparameters (a few bytes per tensor) are
# left out.
# LARS and LAMB make two passes: LARS reads param and grad for the norms (8), then
# as SGD with momentum (20); LAMB updates its moments in the norm pass (param and
# grad read 8, moments read + write 16), then reads param, grad and moments and
# writes the param (20).
BYTES_PER_PARAM = {"adam": 28, "adamw": 28, "sgd_momentum": 20, "lars": 28, "lamb": 44}

# What the summary is printed against.
TARGET_FRAC_COPY_BW = 0.85
TARGET_SPEEDUP = 1.5

TORCH_NAMES = {"adam": "Adam", "adamw": "AdamW", "sgd_momentum": "SGD (momentum)", "lars": "LARS",
               "lamb": "LAMB"}

# Shared hyperparameters; only the learning rate differs between models.
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2  # AdamW
MOMENTUM = 0.9  # SGD, LARS
TRUST_COEFFICIENT = 1e-3  # LARS
LARS_EPS = 1e-8
LAMB_EPS = 1e-6
LR_RANGE = {"adam": (1e-4, 1e-2), "adamw": (1e-4, 1e-2), "sgd_momentum": (1e-3, 1e-1), "lars": (0.1, 10.0),
            "lamb": (1e-4, 1e-2)}

MODEL = "resnet18_cifar"

# --grads fresh: each timed step's gradients are views at the next of GRAD_PLACEMENTS
# placements in one buffer, GRAD_SHIFT elements apart (a multiple of 16 elements, so
# placements keep the 16-byte alignment of an allocation).
GRAD_CONDITIONS = ("fresh", "kept")
GRAD_PLACEMENTS = 32
GRAD_SHIFT = 64


# ---- the parameters -----------------------------------------------------------

def resnet18_cifar_shapes(width: int = 64, num_classes: int = 10) -> list[tuple[str, tuple[int, ...]]]:
    """(name, per-model shape) of every parameter of ResNet-18 for CIFAR-10, in
    ``model.parameters()`` order.

    The CIFAR variant: a 3x3 stride-1 stem conv without max pooling, four stages
    of two basic blocks (``width`` x 1, 2, 4, 8 channels; stages 2 to 4 start
    with stride 2 and a 1x1 conv + batch norm shortcut), global average pooling
    and a linear classifier. Convs have no bias; every batch norm has a weight
    and a bias. ``width=64`` is the standard network (62 tensors, 11,173,962
    parameters); smaller widths give the same structure with fewer parameters.
    """
    out: list[tuple[str, tuple[int, ...]]] = []

    def conv(name: str, c_out: int, c_in: int, k: int) -> None:
        out.append((f"{name}.weight", (c_out, c_in, k, k)))

    def bn(name: str, c: int) -> None:
        out.extend([(f"{name}.weight", (c,)), (f"{name}.bias", (c,))])

    conv("conv1", width, 3, 3)
    bn("bn1", width)
    c_in = width
    for stage, (mult, stride) in enumerate(((1, 1), (2, 2), (4, 2), (8, 2)), start=1):
        c = width * mult
        for block in range(2):
            s = stride if block == 0 else 1
            pre = f"layer{stage}.{block}"
            conv(f"{pre}.conv1", c, c_in, 3)
            bn(f"{pre}.bn1", c)
            conv(f"{pre}.conv2", c, c, 3)
            bn(f"{pre}.bn2", c)
            if s != 1 or c_in != c:
                conv(f"{pre}.shortcut.0", c, c_in, 1)
                bn(f"{pre}.shortcut.1", c)
            c_in = c
    out.extend([("linear.weight", (num_classes, 8 * width)), ("linear.bias", (num_classes,))])
    return out


def param_count(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) for _, s in shapes)


def step_bytes(op: str, n_params: int, B: int) -> int:
    """The least traffic one step of ``op`` over B models of ``n_params`` fp32 parameters needs."""
    return BYTES_PER_PARAM[op] * n_params * B


@dataclass
class Problem:
    """One case's data, shared by every implementation (never written by them).

    ``p0``, ``grads``: ``[B, *shape]`` per parameter; ``lr``: ``[B]`` float32.
    ``grad_sets``: the gradients of successive steps, each a list like ``grads``
    (``grad_sets[0]`` is ``grads``); one set: the same tensors at every step.
    """

    op: str
    B: int
    shapes: list[tuple[str, tuple[int, ...]]]
    p0: list[Tensor]
    grads: list[Tensor]
    lr: Tensor
    grad_sets: list[list[Tensor]] = field(default_factory=list)
    n_params: int = field(init=False)

    def __post_init__(self):
        self.n_params = param_count(self.shapes)
        if not self.grad_sets:
            self.grad_sets = [self.grads]


def make_problem(op: str, B: int, shapes, device: torch.device, seed: int = 0, placements: int = 1) -> Problem:
    """Random parameters (weights scaled by fan-in**-0.5, BN weights near 1) and
    gradients, never zeros; learning rates log-spaced over ``LR_RANGE[op]``.

    The gradients are views into one buffer with room for ``placements`` placements
    ``GRAD_SHIFT`` elements apart (``grad_sets``: new tensors at new addresses for each
    step, as a training loop's); the first placement holds the problem's gradients."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    p0, grads = [], []
    for name, s in shapes:
        p = torch.randn(B, *s, device=device, generator=gen)
        if len(s) > 1:
            p *= math.prod(s[1:]) ** -0.5
        elif name.endswith(".weight"):  # batch norm scales
            p = 1 + 0.1 * p
        else:
            p *= 0.1
        p0.append(p)
        # Unit-scale gradients keep SGD's first-step change well above the
        # rounding of the parameters it is measured against (the check below).
        grads.append(torch.randn(B, *s, device=device, generator=gen))
    lo, hi = LR_RANGE[op]
    lr = torch.logspace(math.log10(lo), math.log10(hi), B, device=device) if B > 1 else \
        torch.full((1,), lo, device=device)
    if placements <= 1:
        return Problem(op, B, shapes, p0, grads, lr)
    # Each tensor starts GRAD_SHIFT-aligned in the buffer, as an allocation would be aligned.
    starts, total = [], 0
    for g in grads:
        starts.append(total)
        total += -(-g.numel() // GRAD_SHIFT) * GRAD_SHIFT
    pool = torch.empty(total + (placements - 1) * GRAD_SHIFT, device=device).normal_(generator=gen)
    sets = [[pool[k * GRAD_SHIFT + at : k * GRAD_SHIFT + at + g.numel()].view(g.shape) for g, at in zip(grads, starts)]
            for k in range(placements)]
    for v, g in zip(sets[0], grads):
        v.copy_(g)
    return Problem(op, B, shapes, p0, sets[0], lr, grad_sets=sets)


def _next_grads(sets: list) -> Callable[[], object]:
    """The next element of ``sets`` at each call, from the first, round and round."""
    it = itertools.cycle(sets)
    return lambda: next(it)


# ---- implementations ---------------------------------------------------------

class Impl:
    """One way to step B models. :meth:`build` makes fresh copies of the problem's
    parameters and returns ``(step, params)``: the timed step and a function
    giving the current parameters as ``[B, ...]`` tensors."""

    name = "?"
    kind = "baseline"
    note: str | None = None

    def serves(self, op: str) -> bool:
        """Whether this implementation exists for ``op`` (torch.optim has no LARS or LAMB)."""
        return op not in TRUST_OPS

    def context(self):
        return contextlib.nullcontext()

    def build(self, prob: Problem) -> tuple[Callable[[], object], Callable[[], list[Tensor]]]:
        raise NotImplementedError

    def expected(self, ref_delta: list[Tensor], prob: Problem) -> list[Tensor]:
        """What this implementation's first-step parameter change should be, given
        the reference's (the same, unless it runs other hyperparameters)."""
        return ref_delta


def _leaf(t: Tensor, grad: Tensor) -> Tensor:
    p = t.clone().requires_grad_()
    p.grad = grad
    return p


class HfkernImpl(Impl):
    """hfkern's array optimizer on the ``[B, ...]`` parameters, under one backend."""

    kind = "backend"

    def __init__(self, backend: str):
        self.name = self.backend = backend

    def context(self):
        return hfkern.use_backend(self.backend)

    def serves(self, op):
        return True

    def build(self, prob):
        params = [_leaf(p, g) for p, g in zip(prob.p0, prob.grads)]
        opt = self._optimizer(prob, params)
        if len(prob.grad_sets) == 1:
            return opt.step, lambda: [p.detach() for p in params]
        grads = _next_grads(prob.grad_sets)

        def step():
            for p, g in zip(params, grads()):  # as zero_grad() + backward leave them
                p.grad = g
            opt.step()

        return step, lambda: [p.detach() for p in params]

    @staticmethod
    def _optimizer(prob, params):
        if prob.op == "lars":
            opt = hfkern.optim.LARS(params, lr=prob.lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                                    trust_coefficient=TRUST_COEFFICIENT, eps=LARS_EPS)
        elif prob.op == "lamb":
            opt = hfkern.optim.LAMB(params, lr=prob.lr, betas=BETAS, eps=LAMB_EPS, weight_decay=WEIGHT_DECAY)
        elif prob.op == "adam":
            opt = hfkern.optim.Adam(params, lr=prob.lr, betas=BETAS, eps=EPS)
        elif prob.op == "adamw":
            opt = hfkern.optim.AdamW(params, lr=prob.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        else:
            opt = hfkern.optim.SGD(params, lr=prob.lr, momentum=MOMENTUM)
        return opt


def _torch_optimizer(op: str, params, lr: float, **impl_kw):
    if op == "adam":
        return torch.optim.Adam(params, lr=lr, betas=BETAS, eps=EPS, **impl_kw)
    if op == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **impl_kw)
    return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM, **impl_kw)


def _per_model_params(prob: Problem) -> list[list[Tensor]]:
    """Model b's parameters as separate tensors (copies), its gradients as views
    of the problem's (one contiguous slice each)."""
    return [[_leaf(p[b], g[b]) for p, g in zip(prob.p0, prob.grads)] for b in range(prob.B)]


def _per_model_steps(prob: Problem, models: list[list[Tensor]], step: Callable[[], object]) -> Callable[[], object]:
    """``step``, after giving every model's parameters the next set of gradients (model
    b's slices of the problem's next ``grad_sets`` entry), when there are several."""
    if len(prob.grad_sets) == 1:
        return step
    flat = [p for m in models for p in m]
    # Model b's views of every set, made once: the timed step only assigns them.
    sets = _next_grads([[g[b] for b in range(prob.B) for g in gs] for gs in prob.grad_sets])

    def fresh_step():
        for p, g in zip(flat, sets()):
            p.grad = g
        return step()

    return fresh_step


def _stacked(models: list[list[Tensor]]) -> list[Tensor]:
    return [torch.stack([m[i].detach() for m in models]) for i in range(len(models[0]))]


class PerModelTorch(Impl):
    """B torch.optim optimizers, one per model with its own learning rate, stepped in turn."""

    def __init__(self, flavour: str):
        self.flavour = flavour  # "fused" or "foreach"
        self.name = f"{flavour}_per_model"

    def build(self, prob):
        models = _per_model_params(prob)
        lrs = prob.lr.tolist()
        opts = [_torch_optimizer(prob.op, m, lr, **{self.flavour: True}) for m, lr in zip(models, lrs)]

        def step():
            for o in opts:
                o.step()

        return _per_model_steps(prob, models, step), lambda: _stacked(models)


class OneListTorch(Impl):
    """One fused torch.optim optimizer over every model's parameters (one learning rate)."""

    name = "fused_one_list"
    note = "one lr (model 0's) for every model; checked against the reference rescaled to it"

    def build(self, prob):
        models = _per_model_params(prob)
        opt = _torch_optimizer(prob.op, [p for m in models for p in m], prob.lr[0].item(), fused=True)
        return _per_model_steps(prob, models, opt.step), lambda: _stacked(models)

    def expected(self, ref_delta, prob):
        # A first step from zero state changes the parameters in proportion to
        # lr (Adam, AdamW and SGD alike), so model b's reference change scaled
        # by lr_0 / lr_b is what lr_0 gives.
        scale = prob.lr[0] / prob.lr
        return [d * scale.view(-1, *([1] * (d.dim() - 1))) for d in ref_delta]


class LoopImpl(Impl):
    """A per-tensor Python loop of in-place tensor ops over the ``[B, ...]`` parameters.

    Per-model learning rates enter as ``[B, 1, ...]`` columns; the step count is
    one Python int for all models, so the bias corrections are host floats.
    """

    name = "loop"

    def serves(self, op):
        return True

    def build(self, prob):
        op, B = prob.op, prob.B
        if op in TRUST_OPS:
            return self._build_trust(prob)
        params = [p.clone() for p in prob.p0]
        grads = _next_grads(prob.grad_sets)  # a loop reads whichever tensors the step's gradients are
        lr_cols = [prob.lr.view(B, *([1] * (p.dim() - 1))) for p in params]
        bufs = [torch.zeros_like(p) for p in params]
        sqs = [torch.zeros_like(p) for p in params] if op != "sgd_momentum" else []
        count = [0]
        beta1, beta2 = BETAS

        @torch.no_grad()
        def adam_step():
            count[0] += 1
            t = count[0]
            bc1 = 1 - beta1**t
            bc2_sqrt = math.sqrt(1 - beta2**t)
            for p, g, m, v, lr in zip(params, grads(), bufs, sqs, lr_cols):
                if op == "adamw":
                    p.mul_(1 - lr * WEIGHT_DECAY)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / bc2_sqrt).add_(EPS)
                p.addcmul_(m / denom, lr, value=-1 / bc1)

        @torch.no_grad()
        def sgd_step():
            # From a zero buffer, the first step's buffer is the gradient, as in torch.
            for p, g, buf, lr in zip(params, grads(), bufs, lr_cols):
                buf.mul_(MOMENTUM).add_(g)
                p.addcmul_(buf, lr, value=-1)

        return (sgd_step if op == "sgd_momentum" else adam_step), lambda: params

    def _build_trust(self, prob):
        """LARS / LAMB as a loop over tensors; each tensor's per-model norms by vector_norm."""
        op, B = prob.op, prob.B
        params = [p.clone() for p in prob.p0]
        grads = _next_grads(prob.grad_sets)
        lr = prob.lr
        bufs = [torch.zeros_like(p) for p in params]
        sqs = [torch.zeros_like(p) for p in params] if op == "lamb" else []
        count = [0]
        beta1, beta2 = BETAS

        def col(x: Tensor, like: Tensor) -> Tensor:
            return x.view(B, *([1] * (like.dim() - 1)))

        def norms(x: Tensor) -> Tensor:
            return torch.linalg.vector_norm(x.reshape(B, -1), dim=1)

        @torch.no_grad()
        def lars_step():
            for p, g, buf in zip(params, grads(), bufs):
                wn, gn = norms(p), norms(g)
                local = TRUST_COEFFICIENT * wn / (gn + WEIGHT_DECAY * wn + LARS_EPS)
                local = torch.where((wn > 0) & (gn > 0), local, 1.0)
                buf.mul_(MOMENTUM).add_(col(lr * local, p) * (g + WEIGHT_DECAY * p))
                p.sub_(buf)

        @torch.no_grad()
        def lamb_step():
            count[0] += 1
            t = count[0]
            bc1 = 1 - beta1**t
            bc2_sqrt = math.sqrt(1 - beta2**t)
            for p, g, m, v in zip(params, grads(), bufs, sqs):
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                r = (m / bc1) / (v.sqrt() / bc2_sqrt + LAMB_EPS) + WEIGHT_DECAY * p
                wn, rn = norms(p), norms(r)
                ratio = torch.where((wn > 0) & (rn > 0), wn / rn, 1.0)
                p.sub_(col(lr * ratio, p) * r)

        return (lars_step if op == "lars" else lamb_step), lambda: params


def make_impls(names) -> list[Impl]:
    """The implementations named in ``names``, in ``IMPLS`` order (the reference first)."""
    out: list[Impl] = []
    for name in IMPLS:
        if name not in names:
            continue
        if name in BACKENDS:
            out.append(HfkernImpl(name))
        elif name == "fused_per_model":
            out.append(PerModelTorch("fused"))
        elif name == "foreach_per_model":
            out.append(PerModelTorch("foreach"))
        elif name == "fused_one_list":
            out.append(OneListTorch())
        else:
            out.append(LoopImpl())
    return out


def rel_err(outs: list[Tensor], refs: list[Tensor]) -> float:
    """max over models b of ||out_b - ref_b|| / ||ref_b||, each norm over all of
    model b's tensors (``[B, ...]`` lists; float64 sums).

    Per model, so that a model with a small learning rate is checked as closely
    as one with a large one. NaN anywhere gives NaN.
    """
    num = den = None
    for a, r in zip(outs, refs, strict=True):
        if a.shape != r.shape:
            raise ValueError(f"parameter shape {list(a.shape)} against reference {list(r.shape)}")
        d = (a.double() - r.double()).flatten(1).square().sum(1)
        n = r.double().flatten(1).square().sum(1)
        num, den = (d, n) if num is None else (num + d, den + n)
    if num is None:
        return 0.0
    ratio = torch.where(den > 0, num / den.clamp_min(1e-300), num).sqrt()
    return float(ratio.max()) if not ratio.isnan().any() else math.nan


# ---- the run -----------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    op: str
    B: int

    def label(self) -> str:
        return f"{self.op} B={self.B}"


class Runner:
    """Runs the implementations of one case after another and makes their rows."""

    def __init__(self, device: torch.device, timer, ceilings: dict, env: dict, *, width: int = 64,
                 verbose: bool = False, grads: str = "fresh"):
        if grads not in GRAD_CONDITIONS:
            raise ValueError(f"expected grads in {GRAD_CONDITIONS}, got {grads!r}")
        self.grads = grads
        self.device = device
        self.timer = timer
        self.ceilings = ceilings
        self.env = env
        self.shapes = resnet18_cifar_shapes(width)
        self.n_params = param_count(self.shapes)
        self.verbose = verbose

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _check_context(self, after: str) -> None:
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize()
            torch.ones(1, device=self.device).add_(1).item()
        except Exception as e:  # noqa: BLE001
            raise bench_kernels.ContextLost(
                f"CUDA context unusable after {after}: {type(e).__name__}: {e}"
            ) from e

    def base_row(self, case: Case, impl: Impl) -> dict:
        row = dict.fromkeys(report.COLUMNS)
        row.update(self.env)
        row.update(
            op=case.op, model=MODEL, layer="all", B=case.B, dtype="fp32", direction="step",
            shape=f"{len(self.shapes)} tensors, {self.n_params} params per model",
            impl=impl.name, kind=impl.kind, bytes=step_bytes(case.op, self.n_params, case.B),
            rotate=1, note=impl.note,
        )
        return row

    def run_case(self, case: Case, impls: list[Impl]) -> list[dict]:
        prob = make_problem(case.op, case.B, self.shapes, self.device,
                            placements=GRAD_PLACEMENTS if self.grads == "fresh" else 1)
        ref: list[Tensor] | None = None
        rows = []
        for impl in impls:
            serves = getattr(impl, "serves", None)  # an implementation without it serves every op
            if serves is not None and not serves(case.op):
                continue
            row = self.base_row(case, impl)
            failed = False
            try:
                ms, delta = self._measure(impl, prob)
                if impl.name == REFERENCE:
                    ref = delta
                elif ref is not None:
                    row["rel_err"] = rel_err(delta, impl.expected(ref, prob))
                else:
                    row["note"] = "; ".join(filter(None, [row["note"], "not checked: no reference"]))
                del delta
            except bench_kernels.ContextLost:
                raise
            except Exception as e:  # noqa: BLE001  (an error row, and the run goes on)
                msg = f"{type(e).__name__}: {e}"
                row.update(status="error", error=msg[:500])
                if self.verbose:
                    traceback.print_exc()
                print(f"  {impl.name} failed on {case.label()}: {msg[:300]}", flush=True)
                failed = True
            if failed:
                # Outside the except block, so the failed call's tensors are gone
                # before the allocator's cache is emptied.
                if self.device.type == "cuda":
                    self._check_context(f"{impl.name} on {case.label()}: {row['error'][:200]}")
                    torch.cuda.empty_cache()
                rows.append(row)
                continue
            row.update(status="ok", ms=ms, gbps=row["bytes"] / (ms * 1e-3) / 1e9)
            copy = self.ceilings.get("copy_gbps")
            row["frac_copy_bw"] = row["gbps"] / copy if copy else None
            rows.append(row)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return rows

    def _measure(self, impl: Impl, prob: Problem) -> tuple[float, list[Tensor]]:
        """(median ms of one step, the first step's parameter change as ``[B, ...]`` tensors)."""
        with impl.context():
            step, params = impl.build(prob)
            # The first step allocates the state, compiles / autotunes, and is the
            # one checked; the timed steps follow from there.
            step()
            self.sync()
            delta = [p - p0 for p, p0 in zip(params(), prob.p0)]
            ms = self.timer(step)
            self.sync()
        return ms, delta


def plan(ops, Bs) -> list[Case]:
    """Every (op, B), op-major: a time budget cuts the last optimizers, not the last B of each."""
    return [Case(op, B) for op in ops for B in Bs]


# ---- summary and table ---------------------------------------------------------

def _ok(rows):
    return [r for r in rows if r.get("status") == "ok" and r.get("ms")]


def summarize(rows: list[dict], ceilings: dict | None = None) -> dict:
    """Per op and B: the faster hfkern backend, its bandwidth and its speedup over every baseline.
    ``ceilings``: the copy bandwidth for rows without a fraction of their own.

    Returns ``{"cases": {"<op> B=<B>": {...}}, "max_rel_err": {...}, "rows", "ok", "errors",
    "error_impls", "targets"}``.
    """
    copy = (ceilings or {}).get("copy_gbps")
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in _ok(rows):
        by_case.setdefault((r["op"], r["B"]), {})[r["impl"]] = r
    order = {op: i for i, op in enumerate(OPS)}
    cases = {}
    for op, B in sorted(by_case, key=lambda k: (order.get(k[0], 9), k[0], k[1])):
        by_impl = by_case[(op, B)]
        backends = [by_impl[i] for i in BACKENDS if i in by_impl]
        entry: dict = {"op": op, "B": B, "best": None}
        if backends:
            best = min(backends, key=lambda r: r["ms"])
            frac = best.get("frac_copy_bw")
            # The floor at the ceiling of the row's own run (its fraction was taken against it):
            # rows of several result files each have their own.
            floor_ms = best["ms"] * frac if frac is not None else best["bytes"] / (copy * 1e9) * 1e3 if copy else None
            entry.update(best=best["impl"], ms=best["ms"], gbps=best["gbps"], frac_copy_bw=frac, floor_ms=floor_ms)
            entry["speedup"] = {i: r["ms"] / best["ms"] for i, r in by_impl.items() if i not in BACKENDS}
            entry["frac_target_met"] = (None if entry["frac_copy_bw"] is None
                                        else entry["frac_copy_bw"] >= TARGET_FRAC_COPY_BW)
            s = entry["speedup"].get(BASELINE)
            entry["speedup_target_met"] = None if s is None else s >= TARGET_SPEEDUP
        cases[f"{op} B={B}"] = entry
    errs: dict[str, float] = {}
    for r in rows:
        if r.get("rel_err") is not None:
            key = f"{r['op']}:{r['impl']}"
            errs[key] = max(errs.get(key, 0.0), r["rel_err"])
    errors = [r for r in rows if r.get("status") == "error"]
    return {
        "cases": cases,
        "max_rel_err": errs,
        "rows": len(rows),
        "ok": len(_ok(rows)),
        "errors": len(errors),
        "error_impls": sorted({f"{r['op']}:{r['impl']}" for r in errors}),
        "targets": {"frac_copy_bw": TARGET_FRAC_COPY_BW, "speedup_vs_fused_per_model": TARGET_SPEEDUP},
    }


def _met(flag) -> str:
    return "n/a" if flag is None else "met" if flag else "MISSED"


def summary_lines(summary: dict, meta: dict | None = None) -> list[str]:
    meta = meta or {}
    lines = []
    dev = meta.get("device")
    if dev:
        ceilings = meta.get("ceilings") or {}
        bw = ceilings.get("copy_gbps")
        text = f"{bw:.0f} GB/s" if bw else "not measured"
        if ceilings.get("per_file"):
            text = "per file, " + ", ".join(f"{f}: {c:.0f} GB/s" if c else f"{f}: not measured"
                                             for f, c in ceilings["per_file"].items())
        lines.append(f"device: {dev}; copy bandwidth ceiling: {text}")
    lines.append(f"targets: >= {100 * TARGET_FRAC_COPY_BW:.0f}% of copy bandwidth, >= {TARGET_SPEEDUP:.1f}x "
                 f"the B fused torch optimizers (one per model); hfkern = the faster of its backends")
    if not summary["cases"]:
        lines.append("  n/a (no case ran)")
    for key, c in summary["cases"].items():
        name = TORCH_NAMES.get(c["op"], c["op"])
        if c["best"] is None:
            lines.append(f"{key}: no hfkern backend ran")
            continue
        frac = c.get("frac_copy_bw")
        frac_text = "n/a" if frac is None else f"{100 * frac:.0f}%"
        floor = f", floor {c['floor_ms']:.3f} ms" if c.get("floor_ms") else ""
        sp = c["speedup"]
        base = sp.get(BASELINE)
        base_text = "n/a" if base is None else f"{base:.2f}x"
        lines.append(
            f"{key}: hfkern {c['best']} {c['ms']:.3f} ms, {c['gbps']:.0f} GB/s{floor}: "
            f"{frac_text} of copy bandwidth ({_met(c['frac_target_met'])}); "
            f"{base_text} vs B fused torch {name} ({_met(c['speedup_target_met'])})"
        )
        others = [(i, s) for i, s in sp.items() if i != BASELINE]
        if others:
            lines.append("    also " + ", ".join(f"{s:.2f}x vs {i}" for i, s in others))
    if summary["max_rel_err"]:
        lines.append("largest first-step relative error against the torch backend (max over models of ||d - d_ref|| / ||d_ref||):")
        lines.append("  " + ", ".join(f"{k} {e:.1e}" for k, e in sorted(summary["max_rel_err"].items())))
    lines.append(f"rows: {summary['rows']} ({summary['ok']} ok, {summary['errors']} errors"
                 + (f": {', '.join(summary['error_impls'])}" if summary["error_impls"] else "") + ")")
    if meta.get("skipped_cases"):
        why = meta.get("stopped") or meta.get("aborted") or "time budget or abort"
        lines.append(f"not run: {meta['skipped_cases']} of the planned cases ({why})")
    if meta.get("aborted"):
        lines.append(f"aborted: {meta['aborted']}")
    return lines


def print_summary(rows: list[dict], meta: dict | None = None) -> dict:
    s = summarize(rows, (meta or {}).get("ceilings"))
    print("\n".join(["", "=== optimizer step summary ==="] + summary_lines(s, meta)))
    return s


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per (op, B): ms of every implementation ("err" for an error row), then
    the faster hfkern backend's GB/s, % of copy bandwidth and speedup over B fused torch."""
    seen = {r["impl"] for r in rows}
    impls = [i for i in IMPLS if i in seen] + sorted(seen - set(IMPLS))
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["op"], r["B"]), {})[r["impl"]] = r
    header = ["op", "B"] + [f"{i} ms" for i in impls] + ["hfkern GB/s", "of copy", f"vs {BASELINE}"]
    lines = []
    for (op, B), by_impl in cases.items():
        cells = [op, str(B)]
        for i in impls:
            r = by_impl.get(i)
            cells.append("" if r is None else "err" if r.get("status") != "ok" else f"{r['ms']:.3f}")
        ok = [by_impl[i] for i in BACKENDS if by_impl.get(i, {}).get("status") == "ok"]
        if not ok:
            cells += ["", "", ""]
        else:
            best = min(ok, key=lambda r: r["ms"])
            frac = best.get("frac_copy_bw")
            base = by_impl.get(BASELINE)
            gbps = best["gbps"]
            cells += [f"{gbps:.0f} {best['impl']}" if gbps >= 10 else f"{gbps:.2f} {best['impl']}", "" if frac is None else f"{100 * frac:.0f}%",
                      f"{base['ms'] / best['ms']:.2f}x" if base and base.get("status") == "ok" else ""]
        lines.append(cells)
    return header, lines


def print_table(rows: list[dict], title: str = "hfkern optimizer step, ResNet-18 (CIFAR) x B (median ms)") -> None:
    header, lines = table(rows)
    report.print_cells(title, header, lines, min_width=160)


# ---- command line ----------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    csv_list = bench_kernels._csv_list
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=csv_list(str, OPS + TRUST_OPS), default=list(OPS),
                   help=f"comma list of optimizers (default: all of %(default)s; also {list(TRUST_OPS)})")
    p.add_argument("--B", type=csv_list(int), default=None,
                   help="comma list of array sizes (default: 16,32,4; --smoke: 3)")
    p.add_argument("--impls", type=csv_list(str, IMPLS), default=None,
                   help=f"comma list of implementations (default: all; --smoke: all but triton and cuda): {list(IMPLS)}")
    p.add_argument("--width", type=int, default=None,
                   help="ResNet-18 base width (default 64, the standard network; --smoke: 4)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models on the CPU, perf_counter timing, torch backend only (seconds)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new case after this many seconds (the cases left are counted as skipped)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="results directory (default bench/results)")
    p.add_argument("--name", default=None, help="file stem of the results (default optim_<device>_<date>)")
    p.add_argument("--ceilings", default=None, metavar="JSON",
                   help="ceilings written by bench/bandwidth.py --out (default: measure the copy bandwidth now)")
    p.add_argument("--grads", choices=GRAD_CONDITIONS, default="fresh",
                   help="fresh (default): new gradient tensors at new addresses at every timed step, as a "
                        "training loop's zero_grad() + backward give; kept: the same tensors at every step")
    p.add_argument("--timer", choices=bandwidth.TIMERS, default="do_bench",
                   help="CUDA timer: do_bench (eager calls, launch overhead included) or "
                        "cuda_graph (replays of one captured call: the kernels' own time)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up per timing (ms)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="repetition time per timing (ms)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")
    p.add_argument("--list", action="store_true", help="print the planned cases and exit")
    p.add_argument("--verbose", action="store_true", help="print the traceback of every error row")
    p.add_argument("--show", nargs="+", metavar="FILE", default=None,
                   help="print the table and summary of result files (.json or .csv) and exit")
    args = p.parse_args(argv)
    if args.width is not None and args.width < 1:
        p.error(f"--width must be >= 1, got {args.width}")
    if args.B is not None and any(b < 1 for b in args.B):
        p.error(f"--B values must be >= 1, got {args.B}")
    if args.smoke:
        args.B = args.B or list(SMOKE_B_VALUES)
        args.impls = args.impls or [i for i in IMPLS if i not in GPU_BACKENDS]
        args.width = args.width or SMOKE_WIDTH
    else:
        args.B = args.B or list(B_VALUES)
        args.impls = args.impls or list(IMPLS)
        args.width = args.width or 64
    return args


def _ceilings(args, device, timer, env) -> dict:
    if args.ceilings:
        try:
            with open(args.ceilings) as f:
                c = json.load(f)
            if c.get("device") not in (None, env["device"]):
                print(f"warning: ceilings were measured on {c.get('device')}, not {env['device']}")
            return c
        except (OSError, ValueError) as e:
            print(f"could not read ceilings from {args.ceilings} ({e}); measuring the copy bandwidth")
    # Only the copy bandwidth is needed here; the matmul rates are the kernel benchmark's.
    c: dict = {"copy_gbps": None, "copy": None, "errors": {}}
    nbytes = 2**30 if device.type == "cuda" else 16 * 2**20
    try:
        c["copy"] = bandwidth.copy_bandwidth(device, timer, nbytes)
        c["copy_gbps"] = c["copy"]["gbps"]
    except Exception as e:  # noqa: BLE001  (a missing ceiling must not stop the benchmark)
        c["errors"]["copy"] = f"{type(e).__name__}: {e}"
    c["device"] = env["device"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return c


def show(paths: list[str], with_table: bool = True) -> int:
    meta, rows = report.merge(paths)
    per_file = {p["file"]: (p.get("ceilings") or {}).get("copy_gbps") for p in meta["parts"]}
    if len(set(per_file.values())) > 1:
        # Runs measured their own ceilings: no one of them stands for the others' rows.
        meta["ceilings"] = {"copy_gbps": None, "per_file": per_file}
    if with_table:
        print_table(rows)
    print_summary(rows, meta)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.show:
        return show(args.show, not args.no_table)
    cases = plan(args.ops, args.B)
    if args.list:
        for i, c in enumerate(cases):
            print(f"{i:4d} {c.label()}")
        return 0
    t_start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        timer = bandwidth.make_cuda_timer(args.timer, args.warmup_ms, args.rep_ms)
    else:
        # The first (checked) step is the warm-up.
        timer = bandwidth.CpuTimer(reps=3, max_seconds=0.5, warmup=0) if args.smoke else bandwidth.CpuTimer()
        if not args.smoke:
            print("warning: no CUDA device; timing on the CPU with perf_counter")
    torch.manual_seed(0)
    env = bench_kernels.environment(device)
    env["timer"] = timer.name
    ceilings = _ceilings(args, device, timer, env)

    stem = args.name or f"optim_{report.slug(env['device'].split(' (')[0])}_{env['date']}"
    if args.smoke and not args.name:
        stem = f"optim_smoke_{env['date']}"
    shapes = resnet18_cifar_shapes(args.width)
    meta = {
        "benchmark": "bench/bench_optim.py",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "date": env["date"],
        "device": env["device"],
        "versions": {k: env[k] for k in ("torch", "triton", "cudnn", "cuda", "hfkern")}
        | {"python": platform.python_version(), "git": bench_kernels._git_commit()},
        "ceilings": ceilings,
        "settings": {
            "timer": timer.name, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "smoke": args.smoke,
            "grads": args.grads, "grad_placements": GRAD_PLACEMENTS if args.grads == "fresh" else 1,
            "time_budget_s": args.time_budget, "model": MODEL, "width": args.width,
            "tensors_per_model": len(shapes), "params_per_model": param_count(shapes),
            # the ops run: earlier results, which hold the first three only, read alike
            "bytes_per_param": {op: BYTES_PER_PARAM[op] for op in args.ops},
            "lr_range": {op: LR_RANGE[op] for op in args.ops}, "betas": BETAS, "eps": EPS,
            "adamw_weight_decay": WEIGHT_DECAY, "sgd_momentum": MOMENTUM,
            **({"lars_trust_coefficient": TRUST_COEFFICIENT, "lars_eps": LARS_EPS, "lamb_eps": LAMB_EPS}
               if set(args.ops) & set(TRUST_OPS) else {}),
        },
        "targets": {"frac_copy_bw": TARGET_FRAC_COPY_BW, "speedup_vs_fused_per_model": TARGET_SPEEDUP},
        "backends": bench_kernels._backend_summary(),
        "planned_cases": len(cases),
        "skipped_cases": 0,
        "finished": False,
    }
    writer = report.RowWriter(args.out, stem, meta)
    writer.write_json(complete=False)
    bw = ceilings.get("copy_gbps")
    print(f"device: {env['device']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; "
          f"timer {timer.name}")
    print(f"copy bandwidth ceiling: {bw:.0f} GB/s" if bw else "copy bandwidth ceiling: not measured")
    print(f"{MODEL} width {args.width}: {len(shapes)} tensors, {param_count(shapes):,} parameters per model; "
          f"gradients {args.grads}; {len(cases)} cases; writing {writer.csv_path}", flush=True)

    runner = Runner(device, timer, ceilings, env, width=args.width, verbose=args.verbose, grads=args.grads)
    impls = make_impls(args.impls)
    report.run_cases(cases, lambda case: runner.run_case(case, impls), writer, meta, args.time_budget, t_start, device, '{:.3f}')
    if not args.no_table:
        print_table(writer.rows)
    meta["summary"] = print_summary(writer.rows, meta)
    writer.write_json(complete=True)
    print(f"wrote {writer.csv_path} and {writer.json_path} ({len(writer.rows)} rows)")
    return 0 if meta["finished"] else 3


if __name__ == "__main__":
    raise SystemExit(main())
