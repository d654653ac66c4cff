"""The sweep runner's fixes of the fifth round of defects:

3. a ``memory_budget`` that no plan fits is a configuration error, as a refused strategy is: no
   trial is counted as failed, and the error names ``Runner(memory_budget=...)`` and what the
   smallest plan needs;
4. after a resume, ``runner.plans``, ``runner.B`` and ``runner.strategy`` describe the same (first)
   group: a group planned first after the resume no longer takes ``runner.plans``;
6. arguments of a wrong type (``memory_budget="8GiB"``, ``B="2"``, ``B=2.0``, a bool) raise
   TypeError, as :func:`hfkern.plan` does; a right type with a bad value ValueError.

Planning profiles each group's model (tens of seconds on a busy 2-core machine): here
:func:`hfkern.plan` runs as it does in a sweep, but fits each architecture's cost model once per
module, from two array sizes (``plan_fast``); the runner's own planning code is unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hfkern
from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import _sweep_cases as cases  # noqa: E402
import hfkern.plan as hplan  # noqa: E402
import hfkern.sweep as hs  # noqa: E402
from hfkern.plan._plan import plan as real_plan  # noqa: E402
from hfkern.sweep._storage import COUNTED_ATTR, OUTCOME_ATTR, SEED_ATTR  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
torch.set_num_threads(1)

_COST_MODELS: dict[str, object] = {}  # a model's repr -> its fitted cost model (this module's)


@pytest.fixture
def plan_fast(monkeypatch):
    """hfkern.plan as the runner calls it, its cost model fitted once per architecture from B = 1, 2."""
    def plan(factory, example_batch, **kw):
        key = repr(factory())
        if key in _COST_MODELS:
            kw["cost_model"] = _COST_MODELS[key]
        else:
            kw.setdefault("profile_B", (1, 2))
        plans = real_plan(factory, example_batch, **kw)
        _COST_MODELS[key] = plans.cost_model
        return plans

    monkeypatch.setattr(hplan, "plan", plan)


def mlp(params) -> nn.Module:
    """A model cheap to profile; ``width`` (grouped) changes it."""
    w = int(params.get("width", 4))
    return nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.ReLU(), nn.Linear(w, 10))


def new_study(**kw) -> optuna.Study:
    return optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(0), **kw)


# ---- 3. a memory budget no plan fits ---------------------------------------------------------------

def test_3_a_memory_budget_no_plan_fits_counts_no_trial_and_names_what_the_smallest_plan_needs(tmp_path, plan_fast):
    study = new_study(storage=hs.storage(f"sqlite:///{tmp_path / 'sweep.db'}"))
    runner = cases.runner(study, model=mlp, B=None, memory_budget=100)
    with pytest.raises(ValueError, match=r"^Runner\(memory_budget=100\): no strategy fits 100 B .*the smallest "
                                         r"plan needs [\d.]+ (B|KiB|MiB) \(B=1 ") as err:
        runner.run(n_trials=2)
    assert type(err.value) is ValueError  # a plain ValueError, as a refused strategy's
    # Only the first trial was asked: failed uncounted and retried (same parameters and seed).
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.WAITING]
    first, retry = study.trials
    assert first.user_attrs[OUTCOME_ATTR] == "error" and not first.user_attrs.get(COUNTED_ATTR, False)
    assert hs.counted_trials(study) == 1  # the waiting retry only
    assert retry.params == first.params and retry.user_attrs[SEED_ATTR] == first.user_attrs[SEED_ATTR]
    assert runner.group_plans == {} and runner.B is None and not hasattr(runner, "plans")

    # The smallest plan's need, as PlanSet.best tells it for that budget.
    plans = hplan(lambda: mlp({}), (cases.data()[0][0][:cases.BATCH], cases.data()[0][1][:cases.BATCH]),
                  trials=2, steps=cases.EPOCHS * (cases.N_TRAIN // cases.BATCH), device="cpu",
                  B_values=range(1, 3), memory_budget=2**40)
    with pytest.raises(ValueError, match="no plan fits") as best_err:
        plans.best(100)
    need = str(best_err.value).split("the smallest needs ")[1].split(" (")[0]
    assert f"the smallest plan needs {need} " in str(err.value)

    # A budget that fits: the study ends with the 2 trials asked for, none used up by the error.
    runner = cases.runner(study, model=mlp, B=None, memory_budget=2**30)
    summary = runner.run(n_trials=2)
    assert summary.completed == 2 and hs.counted_trials(study) == 2
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert runner.plans.memory_budget == 2**30 and runner.plans.best().peak_memory <= 2**30


def test_3_a_device_budget_no_plan_fits_is_refused_alike_naming_what_the_device_offers(monkeypatch, plan_fast):
    import hfkern.sweep._memory as memory

    monkeypatch.setattr(memory, "_free_bytes", lambda device: 1000)  # 90% of it: 900 B
    study = new_study()
    with pytest.raises(ValueError, match=r"^Runner\(memory_budget='device'\): no strategy fits 900 B \(90% of the "
                                         r"free memory of cpu\) .*the smallest plan needs "):
        cases.runner(study, model=mlp, B=None, memory_budget="device").run(n_trials=2)
    assert len(study.trials) == 1 and hs.counted_trials(study) == 0


# ---- 4. runner.plans after a resume --------------------------------------------------------------------

class Killed(BaseException):
    """Stands for the process's death: raised by a metric, after the runner's checkpoint."""


def valid_loss(model) -> torch.Tensor:
    """The built-in "loss" metric, as a metric callable."""
    _, (xv, yv) = cases.data()
    return hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(xv, model.B)), yv).double()


def width_runner(study, ckpt, metric, **kw):
    return cases.runner(study, space=cases.space_widths, model=mlp, B=None, memory_budget=2**30, checkpoint=ckpt,
                        metric=metric, name="r", **kw)


def killed_in_the_first_group(tmp_path):
    """Trials of widths 3, 3, 5, 5; a runner killed at its second evaluation, while the width-3
    array trains: its checkpoint holds the width-3 group's size, the width-5 trials queued."""
    study = new_study()
    for w in (3, 3, 5, 5):
        study.enqueue_trial({"width": w})
    ckpt = tmp_path / "runner.pt"
    calls = []

    def metric_then_die(model, hp):
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        return valid_loss(model)

    runner = width_runner(study, ckpt, metric_then_die)
    runner._fail = lambda *a, **k: None  # a killed process tells nothing
    with pytest.raises(Killed):
        runner.run(n_trials=4)
    first = (("width", 3),)
    assert list(runner.group_plans) == [first] and runner.plans is runner.group_plans[first]
    assert list(torch.load(ckpt, weights_only=False)["sizes"]) == [first]
    return study, ckpt, runner


def test_4_a_runner_resumed_in_a_new_process_has_no_plans_of_another_group_than_B_and_strategy(tmp_path,
                                                                                                plan_fast):
    study, ckpt, killed = killed_in_the_first_group(tmp_path)
    again = width_runner(study, ckpt, lambda m, hp: valid_loss(m))
    assert again.run(n_trials=4).completed == 4
    first, second = (("width", 3),), (("width", 5),)
    # The first group's size comes from the checkpoint (not planned again); the width-5 group is planned
    # here, first in this process: it must not become runner.plans, which is the first group's.
    assert (again.B, again.strategy) == again._sizes[first] == killed._sizes[first]
    assert list(again.group_plans) == [second]
    assert not hasattr(again, "plans")
    for t in study.trials:
        assert t.state == TrialState.COMPLETE


def test_4_the_same_runner_run_again_after_its_death_keeps_the_first_groups_plans(tmp_path, plan_fast):
    study, ckpt, runner = killed_in_the_first_group(tmp_path)
    first, second = (("width", 3),), (("width", 5),)
    plans = runner.plans
    assert runner.run(n_trials=4).completed == 4  # resumed from its checkpoint, the metric no longer dies
    assert runner.plans is plans is runner.group_plans[first]
    assert (runner.B, runner.strategy) == runner._sizes[first] == (plans.best().B, plans.best().strategy)
    assert list(runner.group_plans) == [first, second]


# ---- 6. argument types ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["8GiB", "host", True, False, b"1", torch.tensor(1e9), [1e9]])
def test_6_a_memory_budget_of_a_wrong_type_is_a_type_error(bad):
    study = new_study()
    with pytest.raises(TypeError, match=r"Runner: memory_budget must be a number of bytes or 'device', got "
                                        + type(bad).__name__):
        cases.runner(study, B=None, memory_budget=bad)
    assert not study.trials


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("inf"), float("nan"), -float("inf")])
def test_6_a_memory_budget_of_a_bad_value_is_a_value_error(bad):
    with pytest.raises(ValueError, match="memory_budget must be a positive, finite number of bytes or 'device'"):
        cases.runner(new_study(), B=None, memory_budget=bad)


def test_6_a_memory_budget_of_a_number_type_or_device_is_taken():
    import numpy as np

    for ok in (2**30, 1.5e9, np.float64(1e9), np.int64(2**30), "device"):
        assert cases.runner(new_study(), B=None, memory_budget=ok).memory_budget is ok


@pytest.mark.parametrize("label", ["B", "epochs", "batch_size", "report_every", "checkpoint_every",
                                   "eval_batch_size"])
@pytest.mark.parametrize("bad", ["2", 2.0, True, 6.5, None])
def test_6_a_count_of_a_wrong_type_is_a_type_error_naming_it(label, bad):
    if bad is None and label in ("B", "report_every"):
        bad = "None"  # None is their default: a str instead
    study = new_study()
    with pytest.raises(TypeError, match=rf"^Runner: {label} must be a positive int, got {type(bad).__name__} "
                                        rf"{repr(bad).replace('.', '[.]')}$"):
        cases.runner(study, **{label: bad})
    assert not study.trials


@pytest.mark.parametrize("label", ["B", "epochs", "batch_size", "report_every", "checkpoint_every",
                                   "eval_batch_size"])
@pytest.mark.parametrize("bad", [0, -2])
def test_6_a_count_below_one_is_a_value_error(label, bad):
    with pytest.raises(ValueError, match=rf"^Runner: {label} must be a positive int, got {bad}$"):
        cases.runner(new_study(), **{label: bad})


def test_6_a_numpy_int_count_is_taken():
    import numpy as np

    runner = cases.runner(new_study(), B=np.int64(2), epochs=np.int32(1))
    assert runner.B == 2 and type(runner.B) is int and runner.epochs == 1 and type(runner.epochs) is int


def test_6_run_checks_n_trials_and_timeout_by_type_then_value_before_anything_changes():
    study = new_study()
    runner = cases.runner(study)
    for kw, exc in [(dict(n_trials="2"), TypeError), (dict(n_trials=2.0), TypeError), (dict(n_trials=True), TypeError),
                    (dict(n_trials=0), ValueError),
                    (dict(n_trials=2, timeout="10"), TypeError), (dict(n_trials=2, timeout=True), TypeError),
                    (dict(n_trials=2, timeout=0), ValueError), (dict(n_trials=2, timeout=math.nan), ValueError)]:
        with pytest.raises(exc, match="n_trials must be a positive int" if "timeout" not in kw else "timeout must be"):
            runner.run(**kw)
        assert runner._n_trials == 0 and not study.trials, kw
    assert runner.run(n_trials=1, timeout=math.inf).completed == 1
