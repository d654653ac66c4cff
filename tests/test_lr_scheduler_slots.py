"""Per-model epochs of the array LR schedulers: per-model ``last_epoch``, ``step(epoch)`` and
SequentialLR milestones, and ``reset_model``.

A sweep prunes a trial and refills its slot b with a new one, whose schedule
starts at epoch 0 while the other models go on. Model b's reference is
``torch.optim.lr_scheduler.<Same>`` on its own ``torch.optim.SGD`` (one dummy
parameter per param group) built with model b's arguments: with its own
``last_epoch`` at construction, and built anew (on a new optimizer with the
refilled trial's learning rate) at a reset. The models that were not reset are
compared bit for bit (``torch.equal``) with an array run without the reset.
"""

from __future__ import annotations

import copy
import io
import math
import types
import warnings
from bisect import bisect_right
from collections import Counter

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as T

from hfkern.optim import SGD
from hfkern.optim import lr_scheduler as H
from _sched import PM, _f0, _f1, _f2, _f3, _f4, _h, _m0, _m1, _m3, _m4, _m5, _t


class _SequentialLR(T.SequentialLR):
    """torch's SequentialLR as torch 2.13 builds it (pytorch#185872): with a milestone at 0 the
    scheduler in charge at epoch 0 takes the initial step. Torch 2.12 and earlier started the
    first one whatever the milestones, and hfkern's follows 2.13."""

    def __init__(self, optimizer, schedulers, milestones, last_epoch=-1):
        super().__init__(optimizer, schedulers, milestones, last_epoch)
        idx = bisect_right(self._milestones, 0)
        if idx > 0:
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"]
            self.recursive_undo(self._schedulers[0])
            self._schedulers[idx]._initial_step()
            self._last_lr = self._schedulers[idx].get_last_lr()


def _starts_the_scheduler_in_charge() -> bool:
    """Whether this torch's SequentialLR starts the scheduler in charge at epoch 0 (2.13 on)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    T.SequentialLR(opt, [T.ConstantLR(opt, factor=0.5), T.ExponentialLR(opt, gamma=0.9)], milestones=[0])
    return opt.param_groups[0]["lr"] == 1.0


if not _starts_the_scheduler_in_charge():
    T = types.SimpleNamespace(**{**vars(T), "SequentialLR": _SequentialLR})

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's step-order and epoch warnings

TOL = dict(rtol=1e-6, atol=1e-12)
GROUP_LRS = [[0.1, 0.05, 0.2, 0.07, 0.15], [0.01, 0.03, 0.002, 0.02, 0.005]]  # per param group, per model
NEW_LRS = [[0.3, 0.02], [0.06, 0.004]]  # the refilled trials' learning rates, per reset and param group
MOMENTUM = 0.5
METRICS = torch.cat([  # ReduceLROnPlateau's per-model metric streams
    (1.0 / (1.0 + torch.arange(40, dtype=torch.float64)))[:, None],
    0.5 + 0.001 * (torch.arange(40, dtype=torch.float64) % 3)[:, None],
    1.0 - 0.01 * torch.arange(40, dtype=torch.float64)[:, None]
    + 0.05 * torch.randn(40, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64),
], dim=1)


# ---- cases -------------------------------------------------------------------------------------
# name: (spec, model r's new arguments at a reset). A spec is (class name, kwargs) for one
# scheduler, ("SequentialLR", [specs], milestones) or ("ChainedScheduler", [specs]); PM values are
# per model. New arguments of a container: one dict (or None) per child, or a dict of reset_model's
# arguments (schedulers=..., milestones=...).
CASES = {
    "StepLR": (("StepLR", dict(step_size=PM([3, 5, 2, 4, 7]), gamma=PM([0.5, 0.9, 0.7, 0.3, 0.8]))),
               dict(step_size=2, gamma=0.6)),
    "MultiStepLR": (("MultiStepLR", dict(milestones=PM([[3, 9], [5, 5, 12], [2, 4], [7], [1, 6, 11]]), gamma=0.5)),
                    dict(milestones=[2, 3, 3, 8], gamma=0.4)),
    "ConstantLR": (("ConstantLR", dict(factor=PM([0.5, 0.25, 1 / 3, 0.8, 0.1]), total_iters=PM([4, 0, 6, 2, 9]))),
                   dict(factor=0.2, total_iters=3)),
    "LinearLR": (("LinearLR", dict(start_factor=PM([0.1, 0.5, 1.0, 0.3, 0.7]),
                                   end_factor=PM([1.0, 0.2, 0.0, 0.9, 0.5]), total_iters=PM([4, 10, 6, 3, 8]))),
                 dict(start_factor=0.25, total_iters=5)),
    "ExponentialLR": (("ExponentialLR", dict(gamma=PM([0.9, 0.95, 0.99, 0.8, 0.85], tensor=True))),
                      dict(gamma=0.7)),
    "PolynomialLR": (("PolynomialLR", dict(total_iters=PM([10, 6, 15, 4, 8]), power=PM([1.0, 2.0, 0.5, 3.0, 1.5]))),
                     dict(total_iters=5, power=2.5)),
    "CosineAnnealingLR": (("CosineAnnealingLR", dict(T_max=PM([10, 7, 15, 4, 6]),
                                                     eta_min=PM([0.0, 1e-3, 5e-4, 1e-4, 0.0]))),
                          dict(T_max=5, eta_min=1e-4)),
    "CosineAnnealingWarmRestarts": (("CosineAnnealingWarmRestarts", dict(
        T_0=PM([3, 5, 4, 2, 6]), T_mult=PM([1, 2, 3, 1, 2]), eta_min=PM([0.0, 1e-4, 1e-3, 0.0, 2e-4]))),
        dict(T_0=2, T_mult=2, eta_min=5e-4)),
    "CyclicLR": (("CyclicLR", dict(base_lr=PM([0.001, 0.002, 0.003, 0.004, 0.005]),
                                   max_lr=PM([0.1, 0.05, 0.2, 0.15, 0.08]), step_size_up=PM([4, 5, 3, 2, 6]),
                                   step_size_down=PM([3, 5, 2, 4, 1]), mode="triangular2",
                                   base_momentum=PM([0.8, 0.7, 0.85, 0.75, 0.8]))),
                 dict(base_lr=0.01, max_lr=[0.3, 0.2], step_size_up=2, step_size_down=5, max_momentum=0.95)),
    # a model's step_size_down None: its step_size_up, as torch's None is
    "CyclicLR_some_down_None": (("CyclicLR", dict(base_lr=0.01, max_lr=PM([0.1, 0.05, 0.2, 0.15, 0.08]),
                                                  step_size_up=PM([4, 5, 3, 2, 6]),
                                                  step_size_down=PM([3, None, 2, None, 1]), cycle_momentum=False)),
                                dict(step_size_up=3, step_size_down=None)),
    "OneCycleLR": (("OneCycleLR", dict(max_lr=PM([0.5, 1.0, 0.3, 0.8, 0.4]), total_steps=PM([40, 45, 50, 42, 48]),
                                       pct_start=PM([0.3, 0.25, 0.5, 0.2, 0.4]), three_phase=True)),
                   dict(max_lr=0.6, total_steps=30, pct_start=0.4, div_factor=10.0, base_momentum=0.8)),
    "LambdaLR": (("LambdaLR", dict(lr_lambda=PM([_f0, _f1, _f2, _f3, _f4]))), dict(lr_lambda=_f3)),
    "MultiplicativeLR": (("MultiplicativeLR", dict(lr_lambda=PM([_m0, _m1, _m3, _m4, _m5]))), dict(lr_lambda=_m4)),
    "SequentialLR": (("SequentialLR", [
        ("LinearLR", dict(start_factor=PM([0.1, 0.5, 0.3, 0.2, 0.7]), total_iters=PM([4, 3, 5, 2, 4]))),
        ("CosineAnnealingLR", dict(T_max=PM([10, 7, 15, 4, 6]), eta_min=PM([0.0, 1e-3, 5e-4, 1e-4, 0.0])))],
        [4]), [dict(total_iters=2), dict(T_max=9)]),
    "SequentialLR_per_model_milestones": (("SequentialLR", [
        ("LinearLR", dict(start_factor=PM([0.1, 0.5, 0.3, 0.2, 0.7]), total_iters=PM([4, 3, 5, 2, 4]))),
        ("ExponentialLR", dict(gamma=PM([0.9, 0.95, 0.97, 0.85, 0.99]))),
        ("CosineAnnealingLR", dict(T_max=PM([10, 7, 15, 4, 6]), eta_min=PM([0.0, 1e-3, 5e-4, 1e-4, 0.0])))],
        [PM([4, 2, 6, 0, 3]), PM([7, 9, 6, 5, 12], tensor=True)]),  # model 3 skips the warm-up; 2, the middle
        dict(schedulers=[dict(total_iters=2), None, dict(T_max=9)], milestones=[3, 8])),
    "ChainedScheduler": (("ChainedScheduler", [
        ("ConstantLR", dict(factor=PM([0.5, 0.25, 0.1, 0.8, 0.4]), total_iters=PM([4, 6, 3, 8, 2]))),
        ("ExponentialLR", dict(gamma=PM([0.9, 0.95, 0.97, 0.85, 0.99])))]), [None, dict(gamma=0.8)]),
    "ReduceLROnPlateau": (("ReduceLROnPlateau", dict(
        patience=PM([0, 2, 1, 3, 0]), cooldown=PM([0, 1, 2, 0, 1]), factor=PM([0.5, 0.1, 0.3, 0.7, 0.2]),
        threshold=PM([1e-4, 0.01, 0.05, 1e-3, 0.0]), min_lr=PM([0.0, 1e-3, 5e-3, 1e-4, 0.0]))),
        dict(patience=1, factor=0.4, min_lr=1e-3)),
}
LEAVES = [n for n, (spec, _) in CASES.items()
          if spec[0] not in ("SequentialLR", "ChainedScheduler", "ReduceLROnPlateau")]
CYCLED = ("CyclicLR", "OneCycleLR")  # they set the optimizer's momentum


def _reset_kwargs(new):
    """reset_model's keyword arguments for ``new`` (a container's list: schedulers=[...])."""
    return dict(schedulers=new) if isinstance(new, list) else new


def _build(module, opt, spec, *, B=None, b=None, over=None, last_epoch=None):
    """The scheduler of ``spec`` on ``opt``: the array one (``B``) or model b's torch one, whose
    arguments ``over`` replaces (a container's: one dict or None per child, or a dict with
    ``schedulers`` and ``milestones``)."""
    kind = spec[0]
    if kind in ("SequentialLR", "ChainedScheduler"):
        over = _reset_kwargs(over or {})
        overs = over.get("schedulers") or [None] * len(spec[1])
        epochs = {} if last_epoch is None or kind == "SequentialLR" else dict(last_epoch=last_epoch)
        children = [_build(module, opt, c, B=B, b=b, over=o, **epochs) for c, o in zip(spec[1], overs)]
        if kind == "ChainedScheduler":
            return module.ChainedScheduler(children, optimizer=opt)
        epochs = {} if last_epoch is None else dict(last_epoch=last_epoch)
        milestones = over.get("milestones")
        if milestones is None:
            milestones = _h(spec[2], B) if b is None else _t(spec[2], b)
        return module.SequentialLR(opt, children, milestones=milestones, **epochs)
    kwargs = {k: (_h(v, B) if b is None else _t(v, b)) for k, v in spec[1].items()}
    kwargs.update(over or {})
    if last_epoch is not None:
        kwargs["last_epoch"] = last_epoch
    return getattr(module, kind)(opt, **kwargs)


def _torch_opt(lrs):
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs],
                           momentum=MOMENTUM)


class Run:
    """An array SGD + scheduler and B torch SGDs + schedulers (model b's), stepped together."""

    def __init__(self, name, B, *, torch_refs=True, spec=None):
        self.name, self.B = name, B
        self.spec = CASES[name][0] if spec is None else spec
        self.params = [torch.nn.Parameter(torch.randn(B, 3)) for _ in GROUP_LRS]
        self.opt = SGD([{"params": [p], "lr": GROUP_LRS[g][:B]} for g, p in enumerate(self.params)],
                       momentum=MOMENTUM)
        self.sched = _build(H, self.opt, self.spec, B=B)
        self.refs = [_torch_opt([lrs[b] for lrs in GROUP_LRS]) for b in range(B)] if torch_refs else []
        self.ts = [_build(T, r, self.spec, b=b) for b, r in enumerate(self.refs)]
        self.i = 0

    def step(self, epochs=None, form="list"):
        """One step of the optimizers and schedulers; with ``epochs`` (one per model), the schedulers'
        ``step(epoch)``: the array one gets them in ``form``, model b's torch one ``epochs[b]``.
        Returns the number of epoch deprecation warnings of the array scheduler and of the torch ones."""
        self.opt.step()
        for r in self.refs:
            r.step()
        ours = () if epochs is None else (_epochs_as(epochs, form),)
        metrics = [METRICS[self.i, :self.B]] if self.name == "ReduceLROnPlateau" else []
        with warnings.catch_warnings(record=True) as caught_ours:
            warnings.simplefilter("always")
            self.sched.step(*metrics, *ours)
        with warnings.catch_warnings(record=True) as caught_theirs:
            warnings.simplefilter("always")
            for b, t in enumerate(self.ts):
                t.step(*[float(m[b]) for m in metrics], *(() if epochs is None else (epochs[b],)))
        self.i += 1
        return _deprecations(caught_ours), _deprecations(caught_theirs)

    def reset(self, r, lrs, new=None, torch_new=None):
        """Refill slot r: its learning rates set on the optimizer, then reset_model(r, **new); model r's
        torch reference is built anew on a new optimizer with those learning rates (and arguments
        ``torch_new``, default ``new``)."""
        with torch.no_grad():
            for group, lr in zip(self.opt.param_groups, lrs):
                group["lr"][r] = lr
        self.sched.reset_model(r, **_reset_kwargs(new or {}))
        if self.refs:
            self.refs[r] = _torch_opt(lrs)
            self.ts[r] = _build(T, self.refs[r], self.spec, b=r, over=new if torch_new is None else torch_new)

    def check(self, where):
        for g, group in enumerate(self.opt.param_groups):
            want = torch.tensor([float(r.param_groups[g]["lr"]) for r in self.refs], dtype=torch.float64)
            torch.testing.assert_close(group["lr"].double(), want, **TOL, msg=f"{where}: group {g} lr")
            torch.testing.assert_close(self.sched.get_last_lr()[g], want, **TOL, msg=f"{where}: group {g} last lr")
            momentum = torch.tensor([float(r.param_groups[g]["momentum"]) for r in self.refs], dtype=torch.float64)
            torch.testing.assert_close(group["momentum"].double(), momentum, **TOL, msg=f"{where}: group {g} momentum")
        if self.name == "ReduceLROnPlateau":
            for b, t in enumerate(self.ts):
                assert self.sched.best[b].item() == t.best, where
                assert self.sched.num_bad_epochs[b].item() == t.num_bad_epochs, where
                assert self.sched.cooldown_counter[b].item() == t.cooldown_counter, where


def _deprecations(caught):
    return sum(str(w.message) == T.EPOCH_DEPRECATION_WARNING for w in caught)


def _per_model(value, key, B):
    """A state entry with torch's int epoch (all models agree) as the per-model [B] tensor."""
    if key in ("last_epoch", "_step_count") and isinstance(value, int):
        return torch.full((B,), value, dtype=torch.int64)
    return value


def _assert_models_equal(a, b, models, B, where):
    """Two states (from state_dict) hold bit-identical values for ``models`` (and equal shared values)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_models_equal(_per_model(a[k], k, B), _per_model(b[k], k, B), models, B, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        if len(a) == B and all(isinstance(x, Counter) for x in a):  # MultiStepLR's milestones
            assert [a[m] for m in models] == [b[m] for m in models], where
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                _assert_models_equal(x, y, models, B, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        if a.shape == (B,):
            assert torch.equal(a[models], b[models]), f"{where}: {a[models]} != {b[models]}"
        else:
            assert torch.equal(a, b), where
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def _assert_others_untouched(run, twin, models, where):
    for g, (group, other) in enumerate(zip(run.opt.param_groups, twin.opt.param_groups)):
        for key in ("lr", "momentum", "initial_lr", "scheduled_lr"):
            if key in other:
                assert torch.equal(group[key][models], other[key][models]), f"{where}: group {g} {key}"
        assert torch.equal(run.sched.get_last_lr()[g][models], twin.sched.get_last_lr()[g][models]), where
    _assert_models_equal(run.sched.state_dict(), twin.sched.state_dict(), models, run.B, f"{where}: state")


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ---- per-model last_epoch at construction -----------------------------------------------------------
def _epochs_as(epochs, form):
    """Per-model epochs as a list, a tuple, a numpy array or a tensor (float64 where one is fractional)."""
    fractional = any(isinstance(e, float) for e in epochs)
    return {"list": list(epochs), "tuple": tuple(epochs),
            "numpy": np.array(epochs, dtype=np.float64 if fractional else np.int32),
            "tensor": torch.tensor(epochs, dtype=torch.float64 if fractional else torch.int64)}[form]


@pytest.mark.parametrize("B, form", [(5, "list"), (3, "numpy"), (1, "tensor")])
@pytest.mark.parametrize("name", [n for n in CASES if n != "ReduceLROnPlateau"])  # torch's takes no last_epoch
def test_per_model_last_epoch_matches_torch(name, B, form):
    """Built with one last_epoch per model (on an optimizer with initial_lr), model b follows torch's
    scheduler built with last_epoch[b]: its initial step, the first update (torch's one-off branch of
    CosineAnnealingLR), then the chained steps."""
    run = Run(name, B)
    for _ in range(4):
        run.step()
    epochs = [6, -1, 0, 11, 3][:B]
    run.sched = _build(H, run.opt, run.spec, B=B, last_epoch=_epochs_as(epochs, form))
    run.ts = [_build(T, r, run.spec, b=b, last_epoch=epochs[b]) for b, r in enumerate(run.refs)]
    run.check("after construction")
    if name in LEAVES:
        expected = torch.tensor(epochs) + 1
        assert torch.equal(run.sched.last_epochs, expected)
        if B == 1:
            assert run.sched.last_epoch == epochs[0] + 1
        else:
            assert torch.equal(run.sched.last_epoch, expected)
        run.sched._update_lr()
        for t in run.ts:
            t._update_lr()
        run.check("first update")
    for i in range(8):
        run.step()
        run.check(f"step {i + 1}")


def test_last_epoch_is_an_int_while_models_agree():
    opt = SGD([torch.nn.Parameter(torch.randn(3, 2))], lr=0.1)
    sched = H.StepLR(opt, step_size=2)
    assert sched.last_epoch == 0 and isinstance(sched.last_epoch, int)
    assert sched.state_dict()["last_epoch"] == 0
    sched.step()
    sched.reset_model(1)
    assert torch.equal(sched.last_epoch, torch.tensor([1, 0, 1]))
    assert torch.equal(sched.state_dict()["last_epoch"], torch.tensor([1, 0, 1]))
    sched.last_epoch.zero_()  # a copy: editing it changes nothing
    assert torch.equal(sched.last_epochs, torch.tensor([1, 0, 1]))
    sched.step()
    assert torch.equal(sched.last_epoch, torch.tensor([2, 1, 2]))
    sched.last_epoch = 5
    assert sched.last_epoch == 5 and torch.equal(sched.last_epochs, torch.full((3,), 5))
    # Every model's epoch in one, as torch's constructor resumes.
    opt.param_groups[0]["initial_lr"] = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    assert H.ExponentialLR(opt, gamma=0.9, last_epoch=[4, 4, 4]).last_epoch == 5


# ---- reset_model -------------------------------------------------------------------------------
def _reset_run(name, B, new, *, torch_refs=True):
    """A run with model B // 2 reset after 5 steps (``new``: its new arguments) and model 0 after 9
    (with B > 1), and a twin run without resets; yields after every step with the models never reset."""
    run, twin = Run(name, B, torch_refs=torch_refs), Run(name, B, torch_refs=False)
    resets = {5: (B // 2, NEW_LRS[0], new)}
    if B > 1:
        resets[9] = (0, NEW_LRS[1], None)
    kept = list(range(B))
    for i in range(18):
        if i in resets:
            r, lrs, kw = resets[i]
            run.reset(r, lrs, kw)
            kept = [m for m in kept if m != r]
            yield run, twin, kept, f"reset of model {r} before step {i + 1}"
        run.step()
        twin.step()
        yield run, twin, kept, f"step {i + 1}"


@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("name", list(CASES))
def test_reset_model_matches_new_torch_scheduler(name, B):
    for run, twin, kept, where in _reset_run(name, B, None):
        run.check(where)
        _assert_others_untouched(run, twin, kept, where)


@pytest.mark.parametrize("name", list(CASES))
def test_reset_model_with_new_arguments(name):
    new = CASES[name][1]
    for run, twin, kept, where in _reset_run(name, 3, new):
        run.check(where)
        _assert_others_untouched(run, twin, kept, where)


def _scale_a(x):
    return 1.0 / (1.0 + 0.1 * x)


def _scale_b(x):
    return 0.5 * (1 + math.cos(x))


@pytest.mark.parametrize("name, spec, new, torch_new", [
    ("OneCycleLR", CASES["OneCycleLR"][0], dict(epochs=3, steps_per_epoch=7),
     dict(total_steps=None, epochs=3, steps_per_epoch=7)),
    ("CyclicLR", ("CyclicLR", dict(base_lr=0.01, max_lr=PM([0.1, 0.2, 0.05]), step_size_up=PM([2, 3, 4]),
                                   scale_fn=PM([_scale_a, _scale_b, _scale_a]), scale_mode="iterations")),
     dict(scale_fn=_scale_a, step_size_up=3), None),
    ("LambdaLR", CASES["LambdaLR"][0], dict(lr_lambda=[_f4, _f1]), None),
    ("ReduceLROnPlateau", CASES["ReduceLROnPlateau"][0], dict(min_lr=[0.05, 1e-4], cooldown=2), None),
    ("ReduceLROnPlateau", CASES["ReduceLROnPlateau"][0], dict(min_lr=0.05, eps=1e-3), None),
])
def test_reset_model_argument_forms(name, spec, new, torch_new):
    """OneCycleLR's epochs and steps_per_epoch, a per-model scale_fn, and values per param group."""
    run = Run(name, 3, spec=spec)
    for _ in range(4):
        run.step()
    run.reset(1, NEW_LRS[0], new, torch_new)
    run.check("after the reset")
    if name == "ReduceLROnPlateau":  # one min_lr for every group is also the default for groups added later
        default = run.sched.default_min_lr
        assert default[1] == (0.05 if isinstance(new["min_lr"], float) else 1e-3) and default[0] == 0.0
    for i in range(8):
        run.step()
        run.check(f"step {i + 1}")


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_round_trip_across_reset(name):
    """Saved after a reset (models at different epochs) and loaded into a fresh optimizer and scheduler,
    the run goes on bit-identical to the uninterrupted one."""
    B, split = 3, 12
    straight = _reset_run(name, B, CASES[name][1], torch_refs=False)
    interrupted = _reset_run(name, B, CASES[name][1], torch_refs=False)
    for _ in range(split):  # both resets done: the models are at different epochs
        next(straight)
        run, *_ = next(interrupted)
    saved = _roundtrip({"opt": run.opt.state_dict(), "sched": run.sched.state_dict()})
    if name != "ChainedScheduler":
        assert isinstance(saved["sched"]["last_epoch"], torch.Tensor)
    if name in ("LambdaLR", "MultiplicativeLR"):  # the callables are not state: rebuild with model 1's new one
        spec = (run.spec[0], dict(lr_lambda=[*run.spec[1]["lr_lambda"].values[:B]]))
        spec[1]["lr_lambda"][1] = CASES[name][1]["lr_lambda"]
    else:
        spec = run.spec
    run.opt = SGD([{"params": [p], "lr": 1.0} for p in run.params], momentum=MOMENTUM)
    run.sched = _build(H, run.opt, spec, B=B)
    run.opt.load_state_dict(saved["opt"])
    run.sched.load_state_dict(saved["sched"])
    for (a, _, _, where), (b, _, _, _) in zip(straight, interrupted):
        _assert_others_untouched(b, a, list(range(B)), f"after load, {where}")


def _pick(v, models):
    """A spec (or argument) for the array of ``models`` of the original: per-model values selected."""
    if isinstance(v, PM):
        return PM([v.values[m] for m in models], tensor=v.tensor)
    if isinstance(v, dict):
        return {k: _pick(x, models) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_pick(x, models) for x in v)
    return v


def _optimizer_state_of(opt, models):
    """The optimizer's state dict for ``models`` (its param groups' [B] entries selected; no parameter
    state: the runs here step without gradients)."""
    rows = torch.tensor(models)

    def pick(v):
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == opt.B:
            return v[rows].clone()
        return tuple(pick(x) for x in v) if isinstance(v, tuple) else v

    state = opt.state_dict()
    assert not state["state"]
    return {"state": {}, "param_groups": [{k: pick(v) for k, v in g.items()} for g in state["param_groups"]]}


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_of_some_models_continues_them(name):
    """state_dict_of(models) loaded into a scheduler built for those models (after the optimizer it
    drives, on an optimizer given their param-group entries) continues them bit-identically: as a
    sweep rebuilds an array around its remaining models, here with models at different epochs."""
    run = Run(name, 5, torch_refs=False)
    for _ in range(4):
        run.step()
    run.reset(3, NEW_LRS[0])  # model 3 restarts: the models are at different epochs
    for _ in range(3):
        run.step()
    models = [3, 1, 4]
    params = [torch.nn.Parameter(torch.randn(len(models), 3)) for _ in GROUP_LRS]
    opt = SGD([{"params": [p], "lr": 1.0} for p in params], momentum=MOMENTUM)
    sched = _build(H, opt, _pick(run.spec, models), B=len(models))
    opt.load_state_dict(_optimizer_state_of(run.opt, models))
    sched.load_state_dict(run.sched.state_dict_of(models))
    for i in range(10):
        where = f"step {i + 1} after the selection"
        metrics = [METRICS[run.i, models]] if name == "ReduceLROnPlateau" else []
        run.step()
        opt.step()
        sched.step(*metrics)
        for g, (group, sub) in enumerate(zip(run.opt.param_groups, opt.param_groups)):
            for key in ("lr", "momentum"):
                assert torch.equal(sub[key], group[key][models]), f"{where}: group {g} {key}"
            assert torch.equal(sched.get_last_lr()[g], run.sched.get_last_lr()[g][models]), where
        _assert_models_equal(sched.state_dict(), run.sched.state_dict_of(models), list(range(len(models))),
                             len(models), f"{where}: state")


def test_state_dict_of_bad_models():
    run = Run("StepLR", 3, torch_refs=False)
    for bad, exc, match in [([], TypeError, "non-empty list of model indices"), (3, TypeError, "non-empty list"),
                            ([0, 3], ValueError, r"model index b in \[0, 3\), got 3"),
                            ([0.5], TypeError, "expected a model index"),
                            (torch.zeros(2, 1, dtype=torch.int64), ValueError, "1-D sequence")]:
        with pytest.raises(exc, match=match):
            run.sched.state_dict_of(bad)
    assert run.sched.state_dict_of(torch.tensor([2, 0]))["B"] == 2


def test_state_without_per_model_epochs_loads():
    """A state saved with torch's scalar last_epoch (and, for OneCycleLR, without the arguments reset_model
    keeps) still loads."""
    run = Run("OneCycleLR", 3, torch_refs=False)
    for _ in range(4):
        run.step()
    state = copy.deepcopy(run.sched.state_dict())
    assert state["last_epoch"] == 4 and state["_step_count"] == 5
    for key in ("pct_start", "div_factor", "final_div_factor"):
        del state[key]
    fresh = H.OneCycleLR(run.opt, max_lr=0.1, total_steps=50, pct_start=0.3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.last_epochs, torch.full((3,), 4)) and torch.equal(fresh._step_counts, torch.full((3,), 5))
    fresh.step()
    run.sched.step()
    assert torch.equal(fresh.get_last_lr()[0], run.sched.get_last_lr()[0])


@pytest.mark.parametrize("name", ["StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
                                  "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts"])
def test_step_epoch_sets_every_model(name):
    """step(epoch) (closed form) after a reset puts every model at that epoch, as torch's does."""
    run = Run(name, 3)
    for _ in range(4):
        run.step()
    run.reset(1, NEW_LRS[0])
    run.step()
    for epoch in [7, 2, 12]:
        run.sched.step(epoch)
        for t in run.ts:
            t.step(epoch)
        run.check(f"epoch {epoch}")
        assert run.sched.last_epoch == epoch


def test_reset_model_several_schedulers_through_chained():
    """Resetting a ChainedScheduler restarts its schedulers as building them anew on one optimizer
    would: the first one's initial step scales the learning rate the second one starts from."""
    B = 3
    run = Run("ChainedScheduler", B)
    for _ in range(3):
        run.step()
    run.reset(2, NEW_LRS[0])
    assert torch.equal(run.opt.param_groups[0]["initial_lr"][2], torch.tensor(NEW_LRS[0][0], dtype=torch.float64)
                       .float().double())
    for i in range(5):
        run.step()
        run.check(f"step {i + 1}")


# ---- errors ---------------------------------------------------------------------------------------
def _opt(B=3, groups=1):
    return SGD([{"params": [torch.nn.Parameter(torch.randn(B, 2))]} for _ in range(groups)], lr=0.1)


def _resumable(B=3):
    opt = _opt(B)
    opt.param_groups[0]["initial_lr"] = torch.full((B,), 0.1, dtype=torch.float64)
    return opt


@pytest.mark.parametrize("last_epoch, exc, match", [
    ([1, 2], ValueError, r"last_epoch must have one value per model \(length B=3\), got shape \[2\]"),
    ([1, -2, 3], ValueError, r"last_epoch must be >= -1 for every model, got \[1, -2, 3\]"),
    (-2, ValueError, "last_epoch must be >= -1"),
    ([1.0, 2.0, 3.0], TypeError, "last_epoch must hold ints"),
    ([1, True, 3], TypeError, "last_epoch must hold ints"),
    (torch.tensor([1.0, 2.0, 3.0]), TypeError, "last_epoch must be an int or integers"),
    (np.array([0.5, 1.0, 2.0]), TypeError, "last_epoch must be an int or integers"),
    (torch.ones(3, 1, dtype=torch.int64), ValueError, "last_epoch must have one value per model"),
    ("3", TypeError, "last_epoch must be an int, a length-3 sequence"),
    (2.0, TypeError, "last_epoch must be an int"),
])
def test_bad_last_epoch_rejected(last_epoch, exc, match):
    for name in ("StepLR", "OneCycleLR", "SequentialLR"):
        opt = _resumable()
        child = H.ExponentialLR(opt, 0.9)
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.param_groups[0].items()}
        with pytest.raises(exc, match=match):
            if name == "StepLR":
                H.StepLR(opt, step_size=2, last_epoch=last_epoch)
            elif name == "OneCycleLR":
                H.OneCycleLR(opt, max_lr=0.1, total_steps=10, last_epoch=last_epoch)
            else:
                H.SequentialLR(opt, [child], [], last_epoch=last_epoch)
        _assert_models_equal(dict(opt.param_groups[0]), before, [0, 1, 2], 3, name)


@pytest.mark.parametrize("form", ["lists", "numpy", "tensor"])
def test_sequential_milestone_forms(form):
    """SequentialLR's milestones: one list per milestone of every model's (or a [milestones, B] array or
    tensor); model b follows torch's SequentialLR with its own. A milestone every model shares is saved
    as torch's int."""
    name, B = "SequentialLR_per_model_milestones", 5
    spec = CASES[name][0]
    per_model = [m.values[:B] for m in spec[2]]
    milestones = {"lists": per_model, "numpy": np.array(per_model), "tensor": torch.tensor(per_model)}[form]
    run = Run(name, B)
    run.opt = SGD([{"params": [p], "lr": GROUP_LRS[g][:B]} for g, p in enumerate(run.params)], momentum=MOMENTUM)
    run.sched = _build(H, run.opt, spec, B=B, over=dict(milestones=milestones))
    run.check("after construction")
    assert [m.tolist() for m in run.sched.state_dict()["_milestones"]] == per_model
    for i in range(16):
        run.step()
        run.check(f"step {i + 1}")
    opt = _opt()
    shared = H.SequentialLR(opt, [H.ExponentialLR(opt, 0.9), H.ConstantLR(opt)], [[4, 4, 4]])
    assert shared.state_dict()["_milestones"] == [4]


def test_resuming_models_need_initial_lr():
    with pytest.raises(KeyError, match=r"initial_lr.*models \[1\]"):
        H.CosineAnnealingLR(_opt(), T_max=5, last_epoch=[-1, 3, -1])
    with pytest.raises(KeyError, match="max_lr"):
        H.OneCycleLR(_resumable(), max_lr=0.1, total_steps=10, last_epoch=[-1, 3, -1])
    H.CosineAnnealingLR(_opt(), T_max=5, last_epoch=[-1, -1, -1])  # every model starts: fine


@pytest.mark.parametrize("make, call, exc, match", [
    (lambda o: H.StepLR(o, step_size=2), dict(b=3), ValueError, r"expected a model index b in \[0, 3\), got 3"),
    (lambda o: H.StepLR(o, step_size=2), dict(b=-1), ValueError, "model index"),
    (lambda o: H.StepLR(o, step_size=2), dict(b=1.0), TypeError, "expected a model index b"),
    (lambda o: H.StepLR(o, step_size=2), dict(b=True), TypeError, "expected a model index b"),
    (lambda o: H.StepLR(o, step_size=2), dict(b=0, T_max=3), TypeError,
     r"unknown argument\(s\) \['T_max'\]; the per-model arguments of StepLR are \['step_size', 'gamma'\]"),
    (lambda o: H.StepLR(o, step_size=2), dict(b=0, step_size=0), ValueError,
     "model 0's step_size: step_size must be >= 1"),
    (lambda o: H.StepLR(o, step_size=2), dict(b=0, step_size=2.5), TypeError, "step_size"),
    (lambda o: H.StepLR(o, step_size=2), dict(b=1, step_size=[1, 2, 3]), TypeError,
     "step_size must be one value, model 1's"),
    (lambda o: H.CosineAnnealingLR(o, T_max=5), dict(b=2, eta_min=-1.0), ValueError, "eta_min must be >= 0"),
    (lambda o: H.LinearLR(o), dict(b=0, start_factor=0.0), ValueError, r"start_factor must lie in \(0.0, 1.0\]"),
    (lambda o: H.MultiStepLR(o, milestones=[2, 4]), dict(b=0, milestones=[[1], [2]]), TypeError, "milestones"),
    (lambda o: H.LambdaLR(o, lr_lambda=_f0), dict(b=0, lr_lambda=_f1), TypeError,
     "one lr_lambda shared by every model"),
    (lambda o: H.LambdaLR(o, lr_lambda=[_f0, _f1, _f2]), dict(b=0, lr_lambda=3), TypeError,
     "lr_lambda must be a callable"),
    (lambda o: H.CyclicLR(o, base_lr=0.01, max_lr=0.1, cycle_momentum=False), dict(b=0, step_size_down=3),
     TypeError, "step_size_down needs step_size_up"),
    (lambda o: H.CyclicLR(o, base_lr=0.01, max_lr=0.1, cycle_momentum=False), dict(b=0, max_momentum=0.9),
     TypeError, "does not cycle momentum"),
    (lambda o: H.CyclicLR(o, base_lr=0.01, max_lr=0.1, cycle_momentum=False), dict(b=0, mode="exp_range"),
     TypeError, "unknown argument"),
    (lambda o: H.OneCycleLR(o, max_lr=0.1, total_steps=10), dict(b=0, epochs=3), TypeError,
     "give total_steps, or epochs and steps_per_epoch"),
    (lambda o: H.OneCycleLR(o, max_lr=0.1, total_steps=10), dict(b=0, max_lr=[0.1, 0.2]), ValueError,
     r"one per param group \(1\), got 2 values"),
    (lambda o: H.ReduceLROnPlateau(o), dict(b=0, factor=1.0), ValueError, r"factor must lie in \[0.0, 1.0\)"),
    (lambda o: H.ReduceLROnPlateau(o), dict(b=0, mode="max"), TypeError, "unknown argument"),
    (lambda o: H.ChainedScheduler([H.ExponentialLR(o, 0.9)]), dict(b=0, schedulers=[None, None]), TypeError,
     r"one dict of model 0's arguments \(or None\) per scheduler \(1\)"),
    (lambda o: H.ChainedScheduler([H.ExponentialLR(o, 0.9)]), dict(b=0, gamma=0.5), TypeError, "unknown argument"),
    (lambda o: H.SequentialLR(o, [H.ExponentialLR(o, 0.9)], []), dict(b=0, schedulers=[dict(T_max=3)]),
     TypeError, r"ExponentialLR.reset_model: unknown argument\(s\) \['T_max'\]"),
    (lambda o: H.SequentialLR(o, [H.ExponentialLR(o, 0.9), H.ConstantLR(o)], [[2, 3, 4]]),
     dict(b=1, milestones=[[1, 2, 3]]), TypeError, r"milestones\[0\] must be one value, model 1's"),
    (lambda o: H.SequentialLR(o, [H.ExponentialLR(o, 0.9), H.ConstantLR(o)], [2]), dict(b=0, milestones=[1, 2]),
     ValueError, r"model 0's milestones: milestones: expected one milestone fewer than schedulers \(1\), got 2"),
    (lambda o: H.SequentialLR(o, [H.ExponentialLR(o, 0.9), H.ConstantLR(o)], [2]), dict(b=2, milestones=[1.5]),
     TypeError, r"model 2's milestones: milestones\[0\] must be an int"),
])
def test_bad_reset_model_arguments(make, call, exc, match):
    opt = _opt()
    sched = make(opt)
    before = copy.deepcopy(sched.state_dict())
    call = dict(call)
    b = call.pop("b")
    with pytest.raises(exc, match=match):
        sched.reset_model(b, **call)
    _assert_models_equal(sched.state_dict(), before, list(range(3)), 3, "after the failed reset")


def _bad_at_zero(e):
    return -1.0 if e == 0 else 1.0


@pytest.mark.parametrize("case", ["lambda_factor", "sequential_second_child", "chained_second_child",
                                  "one_cycle_momentum"])
def test_failed_reset_changes_nothing(case):
    """A reset that raises late (after some of model b's state, or a first child, was restarted) leaves
    the schedulers and the optimizer as they were; the run then goes on as one without the attempt."""
    name, b, kwargs, exc = {
        "lambda_factor": ("LambdaLR", 1, dict(lr_lambda=_bad_at_zero), ValueError),
        "sequential_second_child": ("SequentialLR", 2, dict(schedulers=[dict(total_iters=2), dict(T_max=0)]),
                                    ValueError),
        "chained_second_child": ("ChainedScheduler", 0, dict(schedulers=[dict(factor=0.3), dict(gamma=-1.0)]),
                                 ValueError),
        "one_cycle_momentum": ("OneCycleLR", 1, dict(max_lr=0.3, base_momentum=[0.1, math.nan]), ValueError),
    }[case]
    B = 3
    run, twin = Run(name, B, torch_refs=False), Run(name, B, torch_refs=False)
    for _ in range(5):
        run.step()
        twin.step()
    with torch.no_grad():
        run.opt.param_groups[0]["lr"][b] = 0.5  # set, as for a refill, before the failing reset
        twin.opt.param_groups[0]["lr"][b] = 0.5
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in run.opt.param_groups])
    with pytest.raises(exc):
        run.sched.reset_model(b, **kwargs)
    for group, saved in zip(run.opt.param_groups, groups):
        assert group.keys() - {"params"} == saved.keys()
        for k, v in saved.items():
            _assert_models_equal(group[k], v, list(range(B)), B, f"param group {k}")
    everyone = list(range(B))
    _assert_others_untouched(run, twin, everyone, "after the failed reset")
    for i in range(6):
        run.step()
        twin.step()
        _assert_others_untouched(run, twin, everyone, f"step {i + 1} after the failed reset")


# ---- per-model step(epoch) ---------------------------------------------------------------------
# Successive step(epoch) calls, one epoch per model (HFTA's form). CosineAnnealingWarmRestarts takes
# fractional epochs too; SequentialLR and ChainedScheduler take none, as torch's.
STEP_EPOCHS = [[7, 2, 12, 0, 5], [3, 3, 9, 1, 14], [1, 11, 4, 6, 2]]
FRACTIONAL_EPOCHS = [[7.25, 2.5, 12.0, 0.75, 5.0], [3.5, 3, 9.125, 1.0, 14.9], [0.0, 11.5, 4.25, 6.0, 2.75]]
NO_EPOCH = [n for n, (spec, _) in CASES.items() if spec[0] in ("SequentialLR", "ChainedScheduler")]
WITH_EPOCH = [n for n in CASES if n not in NO_EPOCH]


@pytest.mark.parametrize("B, form", [(5, "list"), (5, "tuple"), (5, "numpy"), (5, "tensor"), (1, "tensor"),
                                     (1, "list")])
@pytest.mark.parametrize("name", WITH_EPOCH)
def test_per_model_step_epoch_matches_torch(name, B, form):
    """step(epoch) with one epoch per model: model b gets what torch's scheduler gives after
    step(epoch[b]) (the closed form, or the chained update at that epoch), with torch's deprecation
    warning (none for CosineAnnealingWarmRestarts, as torch's gives none); the chained steps after it
    go on from each model's epoch."""
    run = Run(name, B)
    for _ in range(3):
        run.step()
    for epochs in FRACTIONAL_EPOCHS if name == "CosineAnnealingWarmRestarts" else STEP_EPOCHS:
        epochs = epochs[:B]
        ours, theirs = run.step(epochs, form)
        assert theirs in (0, B)
        assert ours == (1 if theirs else 0), f"{ours} deprecation warnings, torch's schedulers gave {theirs}"
        run.check(f"step(epoch={epochs})")
        assert torch.equal(run.sched.last_epochs, torch.tensor([t.last_epoch for t in run.ts]))
        run.step()
        run.check(f"the step after step(epoch={epochs})")


@pytest.mark.parametrize("name", ["StepLR", "MultiStepLR", "ExponentialLR", "ReduceLROnPlateau"])
def test_negative_step_epochs_like_torch_and_round_trip(name):
    """torch's step(epoch) takes any int (its closed forms go below epoch 0): so does the per-model
    form, and the state it leaves saves and loads."""
    B, epochs = 3, [-3, 2, -1]
    run = Run(name, B)
    run.step()
    run.step(epochs, "tensor")
    run.check(f"step(epoch={epochs})")
    saved = _roundtrip({"opt": run.opt.state_dict(), "sched": run.sched.state_dict()})
    assert torch.equal(saved["sched"]["last_epoch"], torch.tensor(epochs))
    run.opt = SGD([{"params": [p], "lr": 1.0} for p in run.params], momentum=MOMENTUM)
    run.sched = _build(H, run.opt, run.spec, B=B)
    run.opt.load_state_dict(saved["opt"])
    run.sched.load_state_dict(saved["sched"])
    for i in range(5):
        run.step()
        run.check(f"step {i + 1} after the load")


_BAD_INT_EPOCHS = [
    ([1, 2], ValueError, r"\.step: epoch must have one value per model \(length B=3\), got shape \[2\]"),
    ((1, 2, 3, 4), ValueError, r"\.step: epoch must have one value per model \(length B=3\), got shape \[4\]"),
    (np.array([1, 2]), ValueError, r"\.step: epoch must have one value per model"),
    (torch.ones(3, 1, dtype=torch.int64), ValueError, r"\.step: epoch must have one value per model"),
    ([1.0, 2.0, 3.0], TypeError, r"\.step: epoch must hold ints"),
    ([1, True, 3], TypeError, r"\.step: epoch must hold ints"),
    (torch.tensor([1.0, 2.0, 3.0]), TypeError, r"\.step: epoch must be an int or integers .*float32 tensor"),
    (np.array([0.5, 1.0, 2.0]), TypeError, r"\.step: epoch must be an int or integers .*float64 numpy array"),
    (2.5, TypeError, r"\.step: epoch must be an int, a length-3 sequence of ints .*got float 2.5"),
    ("3", TypeError, r"\.step: epoch must be an int"),
]
_BAD_FRACTIONAL_EPOCHS = [
    ([1.0, 2.0], ValueError, r"\.step: epoch must have one value per model \(length B=3\), got shape \[2\]"),
    (np.array([1.5, 2.0, 3.0, 4.0]), ValueError, r"\.step: epoch must have one value per model"),
    ([1.0, -0.5, 2.0], ValueError, r"\.step: epoch must be >= 0 for every model, got \[1.0, -0.5, 2.0\]"),
    (-1, ValueError, r"\.step: epoch must be >= 0"),
    (torch.tensor([0.5, math.nan, 1.0]), ValueError, r"\.step: epoch must not be NaN"),
    ([math.inf, 1.0, 2.0], ValueError, r"\.step: epoch must be finite for every model"),
    (torch.tensor([True, False, True]), TypeError, r"\.step: epoch must hold real numbers"),
    ([1.0, "2", 3.0], TypeError, r"\.step: epoch must be a float or a length-3 sequence"),
    ("3", TypeError, r"\.step: epoch must be a float"),
]


@pytest.mark.parametrize("name", WITH_EPOCH)
def test_bad_step_epoch_rejected_before_any_change(name):
    """A per-model epoch of the wrong length or type (or, for CosineAnnealingWarmRestarts, negative,
    NaN or infinite, which torch refuses) raises, naming what was expected and received, and changes
    neither the scheduler nor the optimizer (nor gives the deprecation warning)."""
    B = 3
    run = Run(name, B, torch_refs=False)
    for _ in range(3):
        run.step()
    metrics = [METRICS[run.i, :B]] if name == "ReduceLROnPlateau" else []
    before = copy.deepcopy(run.sched.state_dict())
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in run.opt.param_groups])
    bad = _BAD_FRACTIONAL_EPOCHS if name == "CosineAnnealingWarmRestarts" else _BAD_INT_EPOCHS
    for epoch, exc, match in bad:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(exc, match=f"{CASES[name][0][0]}{match}"):  # the class's name
                run.sched.step(*metrics, epoch)
        assert _deprecations(caught) == 0, epoch
        _assert_models_equal(run.sched.state_dict(), before, list(range(B)), B, f"epoch {epoch!r}")
        for group, saved in zip(run.opt.param_groups, groups):
            for k, v in saved.items():
                _assert_models_equal(group[k], v, list(range(B)), B, f"epoch {epoch!r}: param group {k}")


@pytest.mark.parametrize("name", NO_EPOCH)
def test_containers_take_no_epoch_as_torch(name):
    """SequentialLR and ChainedScheduler step without an epoch, as torch's (whose step() takes none)."""
    run = Run(name, 3)
    for epoch in (4, [4, 5, 6]):
        with pytest.raises(TypeError):
            run.sched.step(epoch)
        with pytest.raises(TypeError):
            run.ts[0].step(4)
    run.step()
    run.check("a step after the refused ones")


# ---- CUDA: a reset, then steps without a host sync ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["SequentialLR", "CyclicLR", "OneCycleLR", "ReduceLROnPlateau"])
def test_reset_on_cuda_matches_cpu_and_steps_without_sync(name):
    B = 3

    def make(device):
        params = [torch.nn.Parameter(torch.randn(B, 3, device=device)) for _ in GROUP_LRS]
        opt = SGD([{"params": [p], "lr": GROUP_LRS[g][:B]} for g, p in enumerate(params)], momentum=MOMENTUM)
        sched = _build(H, opt, CASES[name][0], B=B)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()  # the optimizer's [B] hyperparameter rows now live on the device
        return opt, sched

    def step(sched, i):
        if name == "ReduceLROnPlateau":
            sched.step(METRICS[i, :B])
        else:
            sched.step()

    (opt, sched), (twin_opt, twin) = make("cuda"), make("cpu")
    for i in range(4):
        step(sched, i)
        step(twin, i)
    for o, s in ((opt, sched), (twin_opt, twin)):
        with torch.no_grad():
            for group, lr in zip(o.param_groups, NEW_LRS[0]):
                group["lr"][1] = lr
        s.reset_model(1, **_reset_kwargs(CASES[name][1]))
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for i in range(4, 12):
            step(sched, i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i in range(4, 12):
        step(twin, i)
    for group, other in zip(opt.param_groups, twin_opt.param_groups):
        for key in ("lr", "momentum"):
            assert torch.equal(group[key].cpu(), other[key].cpu()), key
