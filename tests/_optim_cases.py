"""Optimizer step cases shared by the backends' kernel tests (tests/triton, tests/cuda).

A ``Case`` holds the arguments of one ``hfkern::*_step_`` op (per-model
hyperparameters spread over the models, step counts that differ per tensor and
model, momentum buffers as mid-training, the other state as fresh), runs an
implementation on them and compares the written tensors with another run's.
"""

from __future__ import annotations

import math

import torch

from hfkern._dtypes import acc_dtype

# Per-model shapes: a [B] bias, a small odd matrix, a 16-multiple (aligned tiles) over
# several tiles, and an odd one over several tiles (interpreter tiles are 64 elements).
SHAPES = [(), (5, 3), (16, 9), (37, 11)]
NAMES = ["sgd", "adam", "adagrad", "adadelta", "rmsprop", "lars", "lamb"]
# Options that switch on every branch of each optimizer (for tests of one case per optimizer).
FULL_OPTS = {"sgd": dict(momentum=True, nesterov=True, wd=True), "adam": dict(amsgrad=True, wd=True),
             "adagrad": dict(wd=True), "adadelta": dict(wd=True),
             "rmsprop": dict(centered=True, momentum=True, wd=True),
             "lars": dict(momentum=True, wd=True, exclude_1d=True),
             "lamb": dict(bias_correction=True, wd=True, exclude_1d=True, bounds=True)}


def spread(lo, hi, B):
    return [lo + (hi - lo) * b / max(B - 1, 1) for b in range(B)]


class Case:
    """The arguments of one op for a fresh optimizer state, and their order."""

    def __init__(self, name, opts, B, shapes=SHAPES, dtype=torch.float32, params=None, device="cpu"):
        self.name, self.opts, self.B = name, opts, B
        self.params = params if params is not None else [
            torch.randn(B, *s, dtype=dtype, device=device) for s in shapes
        ]
        ps = self.params
        dev = ps[0].device

        def zeros():  # as the optimizers allocate state: the parameter's strides
            return [torch.zeros_like(p, dtype=acc_dtype(p.dtype)) for p in ps]

        def buffers():  # momentum buffers mid-training (a model without momentum must keep its own)
            return [0.1 * torch.randn_like(p, dtype=acc_dtype(p.dtype)) for p in ps]

        hdt = torch.float64 if all(p.dtype == torch.float64 for p in ps) else torch.float32
        s = lambda lo, hi: torch.tensor(spread(lo, hi, B), dtype=hdt, device=dev)  # noqa: E731
        wd = s(0.01, 0.05) if opts.get("wd") else torch.zeros(B, dtype=hdt, device=dev)
        # Counts differ per (tensor, model), and a model's first update (count 0) meets later ones.
        steps = [torch.tensor([float((i + b) % 3) for b in range(B)], device=dev) for i in range(len(ps))]
        if name == "sgd":
            momentum = s(0.5, 0.9)
            momentum[0] = 0.0  # no momentum: steps with its gradient, keeps its buffer and count
            self.hypers = torch.stack([s(0.05, 0.1), momentum, s(0.1, 0.3), wd])
            self.states = [buffers()] if opts["momentum"] else [[]]
            self.steps = steps if opts["momentum"] else []
        elif name == "adam":
            beta1 = s(0.8, 0.9)
            if opts.get("zero_beta1"):
                beta1[0] = 0.0
            self.hypers = torch.stack([s(0.01, 0.03), beta1, s(0.95, 0.999), s(1e-8, 1e-6), wd])
            self.states = [zeros(), zeros(), zeros() if opts["amsgrad"] else []]
            self.steps = steps
        elif name == "adagrad":
            self.hypers = torch.stack([s(0.05, 0.1), s(0.0, 0.1), wd, s(1e-10, 1e-6)])
            self.states = [[z + 0.1 * b for b, z in enumerate(zeros())]]  # initial_accumulator_value
            self.steps = steps
        elif name == "adadelta":
            self.hypers = torch.stack([s(0.5, 1.0), s(0.8, 0.95), s(1e-6, 1e-4), wd])
            self.states = [zeros(), zeros()]
            self.steps = steps
        elif name == "rmsprop":
            momentum = s(0.0, 0.9) if opts["momentum"] else torch.zeros(B, dtype=hdt, device=dev)
            self.hypers = torch.stack([s(0.001, 0.01), s(0.9, 0.99), s(1e-8, 1e-6), wd, momentum])
            self.states = [zeros(), zeros() if opts["centered"] else [],
                           buffers() if opts["momentum"] else []]
            self.steps = steps
        elif name == "lars":
            momentum = s(0.0, 0.9) if opts["momentum"] else torch.zeros(B, dtype=hdt, device=dev)
            self.hypers = torch.stack([s(0.5, 2.0), momentum, wd, s(1e-3, 2e-2), s(1e-8, 1e-6)])
            self.states = [buffers() if opts["momentum"] else []]
            self.steps = steps
        elif name == "lamb":
            bounded = opts.get("bounds")
            low = s(0.0, 0.5) if bounded else torch.zeros(B, dtype=hdt, device=dev)
            high = s(2.0, 20.0) if bounded else torch.full((B,), math.inf, dtype=hdt, device=dev)
            self.hypers = torch.stack([s(0.01, 0.03), s(0.8, 0.9), s(0.95, 0.999), s(1e-6, 1e-4), wd, low, high])
            self.states = [zeros(), zeros()]
            self.steps = steps
        else:
            raise AssertionError(name)

    def clone(self):
        other = Case.__new__(Case)
        other.name, other.opts, other.B, other.hypers = self.name, self.opts, self.B, self.hypers
        other.params = [p.clone() for p in self.params]
        other.states = [[t.clone() for t in lst] for lst in self.states]
        other.steps = [t.clone() for t in self.steps]
        return other

    def mutated(self):
        """Every tensor the op writes."""
        return self.params + [t for lst in self.states for t in lst] + self.steps

    def args(self, grads, skip):
        o, p, st = self.opts, self.params, self.states
        wd = bool(o.get("wd"))
        if self.name == "sgd":
            return (p, grads, st[0], self.steps, self.hypers, o.get("nesterov", False),
                    o.get("maximize", False), wd, skip)
        if self.name == "adam":
            return (p, grads, st[0], st[1], st[2], self.steps, self.hypers, o["amsgrad"],
                    o.get("maximize", False), o.get("decoupled", False), wd, skip)
        if self.name == "adagrad":
            return (p, grads, st[0], self.steps, self.hypers, o.get("maximize", False), wd, skip)
        if self.name == "adadelta":
            return (p, grads, st[0], st[1], self.steps, self.hypers, o.get("maximize", False), wd, skip)
        if self.name == "lars":
            return (p, grads, st[0], self.steps, self.hypers, o.get("exclude_1d", False), o.get("maximize", False),
                    wd, skip)
        if self.name == "lamb":
            return (p, grads, st[0], st[1], self.steps, self.hypers, o.get("bias_correction", False),
                    o.get("exclude_1d", False), o.get("maximize", False), wd, skip)
        return (p, grads, st[0], st[1], st[2], self.steps, self.hypers, o["centered"],
                o.get("maximize", False), wd, skip)

    def run(self, impl, grads, skip=None):
        getattr(impl, f"{self.name}_step_")(*self.args(grads, skip))

    def run_by_dtype(self, impl, grads, skip=None):
        """One call per parameter dtype (the tensors and models of a call are independent)."""
        for dtype in {p.dtype for p in self.params}:
            keep = [i for i, p in enumerate(self.params) if p.dtype == dtype]
            part = Case.__new__(Case)
            part.name, part.opts, part.B, part.hypers = self.name, self.opts, self.B, self.hypers
            if dtype == torch.float64:
                # The torch path's foreach lerp needs float64 weights for float64 state.
                part.hypers = self.hypers.double()
            part.params = [self.params[i] for i in keep]
            part.states = [[lst[i] for i in keep] if lst else [] for lst in self.states]
            part.steps = [self.steps[i] for i in keep] if self.steps else []
            part.run(impl, [grads[i] for i in keep], skip)


def assert_same_state(got: Case, want: Case, *, rtol, atol, atol_per_magnitude=False):
    """``atol_per_magnitude`` scales ``atol`` by each tensor's largest magnitude
    (at least 1): where a state sums terms of opposite sign, an entry near zero
    keeps the absolute rounding of its largest terms (a momentum buffer of
    +-10-sized steps), and a GPU kernel that contracts a*b+c into one FMA rounds
    differently from torch's separate foreach ops."""
    for a, b in zip(got.mutated(), want.mutated()):
        scale = max(1.0, b.abs().max().item()) if atol_per_magnitude and b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale)


CASES = [
    ("sgd", dict(momentum=False)),
    ("sgd", dict(momentum=True, maximize=True, wd=True)),
    ("sgd", dict(momentum=True, nesterov=True, wd=True)),
    ("adam", dict(amsgrad=False)),
    ("adam", dict(amsgrad=True, wd=True)),
    ("adam", dict(amsgrad=True, maximize=True, decoupled=True, wd=True)),
    ("adam", dict(amsgrad=False, decoupled=True, wd=True, zero_beta1=True)),
    ("adagrad", dict()),
    ("adagrad", dict(maximize=True, wd=True)),
    ("adadelta", dict()),
    ("adadelta", dict(maximize=True, wd=True)),
    ("rmsprop", dict(centered=False, momentum=False)),
    ("rmsprop", dict(centered=True, momentum=False, wd=True)),
    ("rmsprop", dict(centered=False, momentum=True, maximize=True)),
    ("rmsprop", dict(centered=True, momentum=True, maximize=True, wd=True)),
    ("lars", dict(momentum=False)),
    ("lars", dict(momentum=True, wd=True, exclude_1d=True, maximize=True)),
    ("lamb", dict(bias_correction=True)),
    ("lamb", dict(bias_correction=True, wd=True, bounds=True)),
    ("lamb", dict(bias_correction=False, wd=True, exclude_1d=True, maximize=True)),
]


def case_id(case):
    name, opts = case
    return "-".join([name] + [k for k, v in opts.items() if v])


def check_masked_steps(want: Case, impl, ref, *, rtol=1e-5, atol=1e-6) -> None:
    """Three steps of ``impl`` on a copy of ``want`` against ``ref`` on ``want``: unmasked,
    then a mask whose skipped model has poisoned gradients (NaN, and -inf in the last
    tensor), then another mask. The skipped model stays bit-identical, the others follow
    ``ref``, the step counts match exactly and every parameter moved."""
    B = want.B
    got = want.clone()
    masks = [None, torch.tensor([True] + [False] * (B - 1)), torch.tensor([False] * (B - 1) + [True])]
    if B == 3:
        masks[1] = torch.tensor([False, True, False])
    start = [p.clone() for p in got.params]
    for step, skip in enumerate(masks):
        grads = [torch.randn_like(p) for p in want.params]
        if skip is not None:
            bad = int(skip.nonzero()[0])
            for g in grads:
                g[bad] = math.nan
            grads[-1][bad, 0, 1] = -math.inf
        before = [t.clone() for t in got.mutated()]
        want.run(ref, grads, skip)
        got.run(impl, grads, skip)
        assert_same_state(got, want, rtol=rtol, atol=atol)
        if skip is not None:
            for t, b in zip(got.mutated(), before):
                assert torch.equal(t[bad], b[bad]), (step, bad)
        assert all(torch.equal(t, u) for t, u in zip(got.steps, want.steps))
    assert all(not torch.equal(p, p0) for p, p0 in zip(got.params, start))


def check_empty_parameters(name: str, impl, ref) -> None:
    """Two steps of ``impl`` against ``ref`` with empty parameters between others: their step
    counts advance, as torch's do, and every other count once a step (an empty tensor's address
    offset was taken as 0, so the first parameter's count advanced twice and changed its bias
    corrections)."""
    want = Case(name, FULL_OPTS[name], 2, shapes=[(5, 3), (0,), (4,), (2, 0)])
    got = want.clone()
    for _ in range(2):
        grads = [torch.randn_like(p) for p in want.params]
        want.run(ref, grads)
        got.run(impl, grads)
        assert_same_state(got, want, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(t, u) for t, u in zip(got.steps, want.steps))
