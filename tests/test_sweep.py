"""hfkern.sweep.Runner on tiny studies, in one process: every trial against the same trial trained
alone with plain torch (tests/_sweep_cases.py), pruning and refill, grouping, non-finite trials,
schedulers, reproducibility, and parity with Optuna's own loop for random search and Hyperband.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim import lr_scheduler as T

import hfkern
from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import hfkern.sweep as hs  # noqa: E402
import _sweep_cases as cases  # noqa: E402
from hfkern.optim import lr_scheduler as H  # noqa: E402
from hfkern.sweep._storage import COUNTED_ATTR, OUTCOME_ATTR, SEED_ATTR  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def new_study(direction="minimize", seed=0, pruner=None, **kw) -> optuna.Study:
    return optuna.create_study(direction=direction, sampler=optuna.samplers.RandomSampler(seed),
                               pruner=pruner or optuna.pruners.NopPruner(), **kw)


def states(study) -> dict[TrialState, int]:
    out: dict[TrialState, int] = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state] = out.get(t.state, 0) + 1
    return out


def check_alone(trial, rel=2e-4, **kw) -> None:
    want = cases.train_alone(trial.params, trial.user_attrs[SEED_ATTR], **kw)
    cases.assert_close_curves(cases.curve(trial), want[:len(trial.intermediate_values)], f"trial {trial.number}",
                              rel)


def test_pruned_slots_refill_and_every_trial_equals_its_run_alone():
    study = new_study(pruner=cases.PruneNumbers({0, 2, 4}))
    summary = cases.runner(study, B=3).run(n_trials=7)
    assert (summary.completed, summary.pruned, summary.failed) == (4, 3, 0)
    assert summary.arrays == 1  # trials 3..6 entered the first array's freed slots ...
    assert summary.compactions >= 1  # ... and its last trials trained in a smaller one
    assert states(study) == {TrialState.COMPLETE: 4, TrialState.PRUNED: 3}
    assert hs.counted_trials(study) == 7
    for t in study.trials:
        expected_reports = 1 if t.number in (0, 2, 4) else cases.EPOCHS
        assert len(t.intermediate_values) == expected_reports, t.number
        if t.state == TrialState.COMPLETE:
            assert t.value == t.intermediate_values[cases.EPOCHS]
        check_alone(t)  # refilled trials (3..6) too: fresh weights, state and batches of their own


def test_trials_are_grouped_by_non_fusible_values():
    study = new_study()
    for w in (3, 5, 3, 5, 3):  # interleaved: the runner must not put width 3 and 5 in one array
        study.enqueue_trial({"width": w})
    summary = cases.runner(study, space=cases.space_widths, B=2).run(n_trials=6)
    assert summary.completed == 6 and summary.arrays >= 2
    widths = [t.params["width"] for t in study.trials]
    assert set(widths) == {3, 5}
    for t in study.trials:
        check_alone(t)


def test_grouped_batch_size_and_optimizer_follow_the_trial():
    def space(trial):
        return {**cases.space(trial), "bs": trial.suggest_categorical("bs", [16, 32])}

    study = new_study()
    for bs in (16, 32, 16, 32):
        study.enqueue_trial({"bs": bs})
    cases.runner(study, space=space, batch_size=lambda p: p["bs"], B=2).run(n_trials=4)
    for t in study.trials:
        check_alone(t, batch_size=t.params["bs"])


def test_adam_with_per_trial_betas_equals_torch_adam():
    def space(trial):
        return {"lr": trial.suggest_float("lr", 1e-3, 3e-2, log=True), "beta1": trial.suggest_float("beta1", 0.5, 0.95),
                "beta2": trial.suggest_float("beta2", 0.9, 0.999)}

    def adam(p, parameters):
        return torch.optim.Adam(parameters, lr=p["lr"], betas=(p["beta1"], p["beta2"]))

    study = new_study(pruner=cases.PruneNumbers({1}))
    # torch.optim.Adam maps to hfkern.optim.Adam; its betas pair comes from beta1 and beta2.
    cases.runner(study, space=space, fusible=["lr", "beta1", "beta2"], optimizer=torch.optim.Adam,
                 B=2).run(n_trials=4)
    for t in study.trials:
        # Adam divides by the root of the second moment: float32 rounding in gradients near zero
        # moves those weights by up to lr, so the two curves agree less closely than SGD's.
        check_alone(t, rel=3e-3, optimizer=adam)


def test_per_trial_schedule_restarts_in_a_refilled_slot():
    def space(trial):
        return {**cases.space(trial), "gamma": trial.suggest_float("gamma", 0.3, 0.9)}

    study = new_study(pruner=cases.PruneNumbers({0, 2}))
    summary = cases.runner(study, space=space, fusible=["lr", "momentum", "gamma"], B=4,
                           scheduler=hfkern.optim.lr_scheduler.StepLR,
                           scheduler_kwargs=lambda p: {"step_size": 1, "gamma": p["gamma"]}).run(n_trials=6)
    assert summary.compactions >= 1  # schedules carried into the smaller array too
    for t in study.trials:
        gamma = t.params["gamma"]
        check_alone(t, scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma))


class Warmup(H.SequentialLR):
    """A SequentialLR in the form a sweep takes: a class built from the optimizer (and a trial's
    arguments, none here)."""

    _model_args = ()

    def __init__(self, optimizer):
        super().__init__(optimizer, [H.LinearLR(optimizer, start_factor=0.5, total_iters=1),
                                     H.ExponentialLR(optimizer, gamma=0.7)], milestones=[1])


class Chain(H.ChainedScheduler):
    """A ChainedScheduler in the same form."""

    _model_args = ()

    def __init__(self, optimizer):
        super().__init__([H.ConstantLR(optimizer, factor=0.5, total_iters=2), H.ExponentialLR(optimizer, gamma=0.7)],
                         optimizer)


def _ratio(p):
    """A per-trial factor in [0.3, 0.75]."""
    return 0.3 + p["momentum"] / 2


# Every scheduler of hfkern.optim.lr_scheduler a sweep takes (not ReduceLROnPlateau): the runner's
# class, scheduler_kwargs, and the torch scheduler of a trial trained alone (None: torch's namesake
# with the same arguments). The arguments differ between trials where the scheduler has any, and
# the learning rate of a schedule's third epoch (where the test below compacts) is not its first's.
SCHEDULERS = {
    "StepLR": (H.StepLR, lambda p: {"step_size": 1, "gamma": _ratio(p)}, None),
    "MultiStepLR": (H.MultiStepLR, lambda p: {"milestones": [1, 2] if p["momentum"] < 0.45 else [2],
                                              "gamma": _ratio(p)}, None),
    "ConstantLR": (H.ConstantLR, lambda p: {"factor": _ratio(p), "total_iters": 2}, None),
    "LinearLR": (H.LinearLR, lambda p: {"start_factor": _ratio(p), "total_iters": 2}, None),
    "ExponentialLR": (H.ExponentialLR, lambda p: {"gamma": _ratio(p)}, None),
    "PolynomialLR": (H.PolynomialLR, lambda p: {"total_iters": 3, "power": 1 + p["momentum"]}, None),
    "CosineAnnealingLR": (H.CosineAnnealingLR, lambda p: {"T_max": 3, "eta_min": p["lr"] / 10}, None),
    "CosineAnnealingWarmRestarts": (H.CosineAnnealingWarmRestarts,
                                    lambda p: {"T_0": 1, "T_mult": 2, "eta_min": p["lr"] / 10}, None),
    "CyclicLR": (H.CyclicLR, lambda p: {"base_lr": p["lr"] / 4, "max_lr": p["lr"], "step_size_up": 1,
                                        "step_size_down": 2}, None),
    "OneCycleLR": (H.OneCycleLR, lambda p: {"max_lr": 2 * p["lr"], "total_steps": 4}, None),
    "LambdaLR": (H.LambdaLR, lambda p: {"lr_lambda": lambda e, r=_ratio(p): r ** e}, None),
    "MultiplicativeLR": (H.MultiplicativeLR, lambda p: {"lr_lambda": lambda e, r=_ratio(p): r}, None),
    "SequentialLR": (Warmup, lambda p: {}, lambda p, opt: T.SequentialLR(
        opt, [T.LinearLR(opt, start_factor=0.5, total_iters=1), T.ExponentialLR(opt, gamma=0.7)], milestones=[1])),
    "ChainedScheduler": (Chain, lambda p: {}, lambda p, opt: T.ChainedScheduler(
        [T.ConstantLR(opt, factor=0.5, total_iters=2), T.ExponentialLR(opt, gamma=0.7)], opt)),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_compaction_carries_every_scheduler(name):
    """Trial 2 refills pruned trial 1's slot (1), and trains its last epoch alone in the array
    compacted around it: its learning rate, schedule and optimizer state carried over (the new
    scheduler's initial step must not overwrite them), and its curve is that of the trial alone."""
    cls, kwargs, alone = SCHEDULERS[name]
    alone = alone or (lambda p, opt: getattr(T, name)(opt, **kwargs(p)))
    study = new_study(pruner=cases.PruneNumbers({1}))
    summary = cases.runner(study, B=2, scheduler=cls, scheduler_kwargs=kwargs).run(n_trials=3)
    assert (summary.completed, summary.pruned, summary.compactions) == (2, 1, 1)
    for t in study.trials:
        check_alone(t, scheduler=lambda opt: alone(t.params, opt))


def test_arguments_a_trial_does_not_give_take_their_defaults():
    """A conditional search space: trial 0 has weight decay and its own StepLR gamma, the others
    neither. In one array each trial gets what its own optimizer and scheduler would (the defaults,
    weight_decay=0 and gamma=0.1, where it gives none), and trial 2, refilling trial 0's slot, none
    of trial 0's settings."""
    def space(trial):
        p = cases.space(trial)
        if p["lr"] < 0.02:
            p["weight_decay"] = trial.suggest_float("weight_decay", 0.05, 0.1)
        return p

    def sched_kwargs(p):
        return {"step_size": 1, **({"gamma": 0.5} if "weight_decay" in p else {})}

    def sgd(p, parameters):
        return torch.optim.SGD(parameters, lr=p["lr"], momentum=p["momentum"], weight_decay=p.get("weight_decay", 0))

    study = new_study(pruner=cases.PruneNumbers({0}))
    study.enqueue_trial({"lr": 0.01, "momentum": 0.5, "weight_decay": 0.1})
    study.enqueue_trial({"lr": 0.05, "momentum": 0.5})
    study.enqueue_trial({"lr": 0.04, "momentum": 0.3})
    cases.runner(study, space=space, fusible=["lr", "momentum", "weight_decay"], B=2, scheduler=H.StepLR,
                 scheduler_kwargs=sched_kwargs).run(n_trials=3)
    assert [sorted(t.params) for t in study.trials] == [["lr", "momentum", "weight_decay"]] + [["lr", "momentum"]] * 2
    for t in study.trials:
        gamma = sched_kwargs(t.params).get("gamma", 0.1)
        check_alone(t, optimizer=sgd, scheduler=lambda opt: T.StepLR(opt, 1, gamma))


@pytest.mark.parametrize("B", [1, 2])  # a refill, a new array
def test_an_argument_a_trial_does_not_give_without_default_is_an_error(B):
    study = new_study(pruner=cases.PruneNumbers({0}))
    study.enqueue_trial({"lr": 0.01})
    with pytest.raises(ValueError, match="'step_size' .*has no default to take: give it for every trial"):
        cases.runner(study, B=B, scheduler=H.StepLR,
                     scheduler_kwargs=lambda p: {"step_size": 1} if p["lr"] == 0.01 else {}).run(n_trials=2)


def test_a_refill_must_agree_on_one_per_array_arguments_it_does_not_give():
    """Trial 0 (pruned) has Nesterov momentum; trial 1, refilling its slot, gives no nesterov: its own
    optimizer would have none (the default), which its array cannot give it."""
    study = new_study(pruner=cases.PruneNumbers({0}))
    study.enqueue_trial({"lr": 0.005})
    study.enqueue_trial({"lr": 0.05})
    with pytest.raises(ValueError, match=r"'nesterov' is one value per array; trial 1 gives none \(default False\), "
                                         r"its array True"):
        cases.runner(study, optimizer_kwargs=lambda p: {"lr": p["lr"], "momentum": 0.9,
                                                        **({"nesterov": True} if p["lr"] < 0.01 else {})},
                     B=1).run(n_trials=2)
    # The refilling trial is failed (counted: the error is its result), not left running.
    assert [t.state for t in study.trials] == [TrialState.PRUNED, TrialState.FAIL]
    assert study.trials[1].user_attrs[OUTCOME_ATTR] == "error" and study.trials[1].user_attrs[COUNTED_ATTR]


def test_an_error_placing_a_refilled_trial_fails_it_and_the_held_trials():
    """Trial 2's model raises as it refills pruned trial 0's slot: run() raises it, and trial 2, with
    trial 1 still training, is failed (counted: the error is their result), none left running."""
    def model(params):
        if params["lr"] == 0.02:
            raise RuntimeError("the user's model factory fails")
        return cases.model(params)

    study = new_study(pruner=cases.PruneNumbers({0}))
    for lr in (0.01, 0.03, 0.02):
        study.enqueue_trial({"lr": lr, "momentum": 0.5})
    with pytest.raises(RuntimeError, match="the user's model factory fails"):
        cases.runner(study, model=model, B=2).run(n_trials=4)
    assert [t.state for t in study.trials] == [TrialState.PRUNED, TrialState.FAIL, TrialState.FAIL]
    for t in study.trials[1:]:
        assert t.user_attrs[OUTCOME_ATTR] == "error" and t.user_attrs[COUNTED_ATTR], t.number
    assert hs.counted_trials(study) == 3


@pytest.mark.parametrize("where", ["space", "sizing"])
def test_an_error_filling_a_new_array_fails_the_trials_it_took(where):
    """An error while a new array is filled (the user's space for its third trial, or the user's
    optimizer_kwargs as the runner sizes the array from its first) fails every trial taken for
    it (counted: the error is their result), none left running."""
    def space(trial):
        if where == "space" and trial.number == 2:
            raise ValueError("the user's space fails")
        return cases.space(trial)

    def optimizer_kwargs(p):
        if where == "sizing":
            raise ValueError("the user's optimizer_kwargs fails")
        return {"lr": p["lr"], "momentum": p["momentum"]}

    study = new_study()
    with pytest.raises(ValueError, match="the user's .* fails"):
        cases.runner(study, space=space, optimizer_kwargs=optimizer_kwargs,
                     B=3 if where == "space" else None).run(n_trials=6)
    assert len(study.trials) == (3 if where == "space" else 1)
    for t in study.trials:
        assert t.state == TrialState.FAIL and t.user_attrs[OUTCOME_ATTR] == "error", t.number
        assert t.user_attrs[COUNTED_ATTR]


def test_a_lone_beta_takes_the_optimizers_default_for_the_other():
    def space(trial):
        return {"lr": trial.suggest_float("lr", 1e-3, 3e-2, log=True), "beta1": trial.suggest_float("beta1", 0.5, 0.95)}

    def adam(p, parameters):
        return torch.optim.Adam(parameters, lr=p["lr"], betas=(p["beta1"], 0.999))

    study = new_study()
    runner = cases.runner(study, space=space, fusible=["lr", "beta1"], optimizer=hfkern.optim.Adam, B=2)
    assert runner._default_optimizer_kwargs({"lr": 0.01, "beta2": 0.95}) == {"lr": 0.01, "betas": (0.9, 0.95)}
    runner.run(n_trials=2)
    for t in study.trials:
        check_alone(t, rel=3e-3, optimizer=adam)  # as test_adam_with_per_trial_betas_equals_torch_adam


@pytest.mark.parametrize("on_nonfinite", ["fail", "prune"])
def test_a_nonfinite_trial_ends_without_disturbing_the_others(on_nonfinite):
    def space(trial):
        return {**cases.space(trial), "poison": trial.suggest_int("poison", 0, 1)}

    def loss(out, target, hp):  # the loss weight of a poisoned trial is NaN
        weight = torch.where(hp["poison"] > 0, torch.full_like(hp["poison"], math.nan), torch.ones_like(hp["poison"]))
        return hfkern.nn.functional.cross_entropy(out, target) * weight

    study = new_study()
    for poison in (0, 1, 0):
        study.enqueue_trial({"poison": poison})
    summary = cases.runner(study, space=space, fusible=["lr", "momentum", "poison"], loss=loss,
                           on_nonfinite=on_nonfinite, B=3).run(n_trials=3)
    bad = study.trials[1]
    if on_nonfinite == "fail":
        assert bad.state == TrialState.FAIL and summary.failed == 1
        assert bad.user_attrs[OUTCOME_ATTR] == "nonfinite" and bad.user_attrs[COUNTED_ATTR]
    else:
        assert bad.state == TrialState.PRUNED and summary.pruned == 1
    assert hs.counted_trials(study) == 3
    for t in (study.trials[0], study.trials[2]):
        assert t.state == TrialState.COMPLETE
        check_alone(t)


def test_fixed_sampler_seed_reproduces_the_study():
    def run():
        study = new_study(seed=11, pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
        cases.runner(study, B=3).run(n_trials=8)
        return [(t.params, t.state, t.value, t.intermediate_values) for t in study.trials]

    first = run()
    assert first == run()
    assert any(s == TrialState.PRUNED for _, s, _, _ in first)


def _optimize(objective_B, sampler_seed, pruner_fn, n_trials):
    """The same search by the runner with B = 1 and by Optuna's study.optimize over plain torch."""
    # One study name: HyperbandPruner assigns trials to brackets by a hash of it and the trial number.
    ours = new_study(seed=sampler_seed, pruner=pruner_fn(), study_name="parity")
    cases.runner(ours, B=objective_B).run(n_trials=n_trials)
    theirs = new_study(seed=sampler_seed, pruner=pruner_fn(), study_name="parity")

    def objective(trial):
        params = cases.space(trial)
        return cases.train_alone(params, trial.number, trial=trial)[-1]

    theirs.optimize(objective, n_trials=n_trials)
    return ours, theirs


@pytest.mark.parametrize("pruner", [
    pytest.param(lambda: optuna.pruners.NopPruner(), id="random-search"),
    pytest.param(lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=cases.EPOCHS,
                                                        reduction_factor=2), id="hyperband"),
    pytest.param(lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
                 id="successive-halving"),
])
def test_random_search_and_hyperband_as_optunas_own_loop(pruner):
    """HFTA's hfht offered random search and Hyperband; here they are Optuna's RandomSampler and
    pruners, and one trial at a time (B = 1) the runner makes the decisions study.optimize makes."""
    ours, theirs = _optimize(1, 3, pruner, 10)
    assert [t.params for t in ours.trials] == [t.params for t in theirs.trials]
    assert [t.state for t in ours.trials] == [t.state for t in theirs.trials]
    for a, b in zip(ours.trials, theirs.trials):
        cases.assert_close_curves(cases.curve(a), cases.curve(b), f"trial {a.number}")
    if not isinstance(ours.pruner, optuna.pruners.NopPruner):
        assert any(t.state == TrialState.PRUNED for t in ours.trials)


def test_hyperband_prunes_at_rungs_with_a_full_array():
    study = new_study(seed=5, pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=cases.EPOCHS,
                                                                    reduction_factor=2))
    summary = cases.runner(study, B=4).run(n_trials=12)
    assert summary.completed + summary.pruned == 12 and summary.pruned > 0
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    for t in study.trials:  # a pruned trial stopped at a report, each report once
        assert sorted(t.intermediate_values) == list(range(1, len(t.intermediate_values) + 1))


def test_fusible_parameter_that_changes_the_model_is_an_error():
    study = new_study()
    study.enqueue_trial({"width": 3})
    study.enqueue_trial({"width": 5})
    with pytest.raises(ValueError, match=r"'width'.*declare it grouped|width.*grouped"):
        cases.runner(study, space=cases.space_widths, fusible=["lr", "momentum", "width"], B=2).run(n_trials=2)
    # The trials it held are failed (counted: the error is their result), none left running.
    assert all(t.state == TrialState.FAIL for t in study.trials)


def test_fusible_parameter_must_be_a_number():
    def space(trial):
        return {**cases.space(trial), "act": trial.suggest_categorical("act", ["relu", "gelu"])}

    study = new_study()
    with pytest.raises(TypeError, match="'act' is declared fusible.*not a number"):
        cases.runner(study, space=space, fusible=["lr", "momentum", "act"]).run(n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.FAIL]


def test_undeclared_parameter_is_an_error_when_grouped_is_given():
    study = new_study()
    with pytest.raises(ValueError, match="'width' is neither fusible"):
        cases.runner(study, space=cases.space_widths, grouped=["depth"]).run(n_trials=1)


def test_per_array_optimizer_argument_must_not_depend_on_a_fusible_parameter():
    study = new_study()
    study.enqueue_trial({"lr": 0.005})
    study.enqueue_trial({"lr": 0.05})
    with pytest.raises(ValueError, match="'nesterov' is one value per array"):
        cases.runner(study, optimizer_kwargs=lambda p: {"lr": p["lr"], "momentum": 0.9,
                                                        "nesterov": p["lr"] > 0.01}, B=4).run(n_trials=4)


def test_constructor_checks():
    study = new_study()
    with pytest.raises(ValueError, match="report_every \\(4\\) must divide"):
        cases.runner(study, report_every=4)
    with pytest.raises(ValueError, match="per-epoch scheduler needs reports at epoch ends"):
        cases.runner(study, report_every=3, **cases.SCHEDULER)
    with pytest.raises(ValueError, match="computed on valid"):
        cases.runner(study, valid=None)
    with pytest.raises(ValueError, match="batch_size 500 exceeds"):
        cases.runner(study, batch_size=500)
    with pytest.raises(ValueError, match="single-objective"):
        cases.runner(optuna.create_study(directions=["minimize", "minimize"]))
    with pytest.raises(TypeError, match="optimizer must be"):
        cases.runner(study, optimizer=3)
    with pytest.raises(ValueError, match="no array namesake"):
        cases.runner(study, optimizer=torch.optim.SparseAdam)
    with pytest.raises(ValueError, match="on_nonfinite"):
        cases.runner(study, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="both fusible and grouped"):
        cases.runner(study, grouped=["lr"])
    with pytest.raises(ValueError, match="n_trials must be a positive int"):
        cases.runner(study).run(n_trials=0)
    with pytest.raises(TypeError, match="ReduceLROnPlateau steps on a metric"):
        cases.runner(study, scheduler=H.ReduceLROnPlateau)
    assert not study.trials  # nothing was asked


def test_report_every_steps_and_progress_output(capsys):
    study = new_study(direction="maximize")
    summary = cases.runner(study, metric="accuracy", report_every=3, progress=True, B=2).run(n_trials=3)
    assert summary.completed == 3
    for t in study.trials:  # two reports per epoch
        assert sorted(t.intermediate_values) == list(range(1, 2 * cases.EPOCHS + 1))
        assert 0.0 <= t.value <= 1.0
    out = capsys.readouterr().out
    assert "best 3 of 3 complete trials" in out and "momentum" in out
    table = hs.best_trials_table(study, top=2)
    assert table.row_count == 2


def test_each_run_call_summarizes_itself():
    study = new_study()
    runner = cases.runner(study, B=2)
    first, second = runner.run(n_trials=2), runner.run(n_trials=4)
    assert (first.completed, first.arrays) == (2, 1)
    assert (second.completed, second.arrays) == (2, 1)  # the trials of this call only
    assert len(study.trials) == 4


def test_without_B_the_runner_sizes_its_arrays_with_max_array_size():
    study = new_study()
    summary = cases.runner(study, B=None).run(n_trials=3)
    # This machine fits thousands of these models; B is capped by the trials asked for.
    assert summary.B == 3 and summary.completed == 3 and summary.arrays == 1


def test_dropout_probability_and_seed_are_fusible():
    """Each slot's dropout probability is its trial's, also after a refill; a trial's seed
    parameter is its init seed (the same seed and parameters: the same model)."""
    def space(trial):
        return {**cases.space(trial), "dropout": trial.suggest_float("dropout", 0.0, 0.5),
                "seed": trial.suggest_int("seed", 0, 3)}

    seen = []

    def metric(model, hp):  # the built-in loss, and what each slot's dropout layer holds
        drop = next(m for m in model.modules() if type(m).__name__ == "Dropout")
        p = tuple(drop.p) if isinstance(drop.p, (tuple, list)) else (drop.p,) * model.B  # one float if all agree
        seen.append((p, hp["dropout"].tolist(), hp["seed"].tolist()))
        _, (xv, yv) = cases.data()
        return hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(xv, model.B)), yv)

    study = new_study(pruner=cases.PruneNumbers({0, 1}))
    study.enqueue_trial({"lr": 0.05, "momentum": 0.5, "dropout": 0.0, "seed": 3})
    study.enqueue_trial({"lr": 0.05, "momentum": 0.5, "dropout": 0.0, "seed": 3})
    cases.runner(study, space=space, fusible=["lr", "momentum", "dropout"], metric=metric, B=2).run(n_trials=5)
    for p, dropout, _ in seen:
        assert p == pytest.approx(tuple(dropout))
    assert [t.user_attrs[SEED_ATTR] for t in study.trials] == [t.params["seed"] for t in study.trials]
    assert study.trials[0].intermediate_values == study.trials[1].intermediate_values
    assert any(len(set(d)) > 1 for _, d, _ in seen)  # slots did differ


@pytest.mark.gpu
def test_gpu_sweep_with_and_without_step_capture():
    """On a GPU each step is one CUDA graph replay; refills write in place, so the graph is kept.
    Both runs equal each other and the trials trained alone (on the CPU) to float32 rounding."""
    curves = []
    for capture in (True, False):
        study = new_study(pruner=cases.PruneNumbers({0, 2}))
        cases.runner(study, device="cuda", capture=capture, B=3).run(n_trials=6)
        curves.append([cases.curve(t) for t in study.trials])
        for t in study.trials:
            check_alone(t, rel=1e-3)
    for a, b in zip(*curves):
        cases.assert_close_curves(a, b, "capture against eager", 1e-4)


def test_a_strategy_with_recomputation_leaves_every_trial_as_alone():
    study = new_study(pruner=cases.PruneNumbers({1}))
    strategy = hfkern.plan.Strategy(B=3, recompute=("0", "1"))  # the conv and its batch norm
    summary = cases.runner(study, B=None, strategy=strategy).run(n_trials=5)
    assert summary.B == 3 and summary.compactions >= 1
    for t in study.trials:
        check_alone(t)


@pytest.mark.long
def test_a_memory_budget_picks_the_fastest_plan_that_fits():
    study = new_study()
    runner = cases.runner(study, B=None, memory_budget=64 * 2**20)
    summary = runner.run(n_trials=4)
    chosen = runner.plans.best()
    assert summary.B == chosen.B <= 4 and chosen.peak_memory <= 64 * 2**20
    assert runner.strategy == chosen.strategy and summary.completed == 4
    for t in study.trials:
        check_alone(t)  # fp32 plans (the CPU's precision), recomputation only: results unchanged
    with pytest.raises(ValueError, match="memory_budget picks B and the strategy"):
        cases.runner(study, B=2, memory_budget=2**20)


@pytest.mark.long
def test_a_device_budget_plans_within_what_the_device_offers():
    """memory_budget="device": hfkern.plan's own budget (90% of the device's free memory)."""
    study = new_study()
    runner = cases.runner(study, B=None, memory_budget="device")
    summary = runner.run(n_trials=3)
    plans = runner.plans
    chosen = plans.best()
    assert plans.memory_budget > 0 and chosen.peak_memory <= plans.memory_budget
    assert runner.strategy == chosen.strategy and summary.B == chosen.B and summary.completed == 3
    for t in study.trials:
        check_alone(t)
    for bad in (-1, 0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="memory_budget must be a positive, finite number of bytes or 'device'"):
            cases.runner(study, B=None, memory_budget=bad)
    for bad in ("host", True):  # a wrong type, as hfkern.plan's memory_budget
        with pytest.raises(TypeError, match="memory_budget must be a number of bytes or 'device'"):
            cases.runner(study, B=None, memory_budget=bad)
    with pytest.raises(ValueError, match="memory_budget picks B and the strategy"):
        cases.runner(study, B=2, memory_budget="device")


def watch_in_flight(runner) -> list[list[tuple]]:
    """Record the groups (width) of the arrays that train together in each of ``runner``'s rounds."""
    rounds, train_round = [], runner._train_round

    def recording():
        rounds.append([a.key for a in runner._arrays])
        train_round()

    runner._train_round = recording
    return rounds


def test_two_arrays_in_flight_leave_every_trial_as_alone():
    """Two arrays train together (one after the other on the CPU, a CUDA stream each on a GPU):
    arrays of different groups side by side, pruned slots refilled, arrays compacted, and every
    trial as trained alone."""
    study = new_study(pruner=cases.PruneNumbers({0, 3}))
    for w in (3, 5, 3, 3, 5, 5, 3):
        study.enqueue_trial({"width": w})
    runner = cases.runner(study, space=cases.space_widths, B=None, strategy=hfkern.plan.Strategy(B=2, arrays=2))
    rounds = watch_in_flight(runner)
    summary = runner.run(n_trials=7)
    assert (summary.completed, summary.pruned, summary.in_flight, summary.B) == (5, 2, 2, 2)
    assert "2 in flight" in str(summary)
    assert max(len(r) for r in rounds) == 2  # two arrays trained together ...
    assert any(len(set(r)) == 2 for r in rounds)  # ... of the two widths side by side
    assert summary.compactions >= 1
    for t in study.trials:
        check_alone(t)


class Killed(BaseException):
    """Stands for the process's death: raised by a metric, after the runner's checkpoint."""


def hs_loss(model) -> torch.Tensor:
    """The built-in "loss" metric, as a metric callable."""
    _, (xv, yv) = cases.data()
    return hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(xv, model.B)), yv).double()


def run_until_killed(study, ckpt, n_trials: int, evaluations: int, **kw):
    """A runner named "r" with checkpoint ``ckpt`` whose process dies at its ``evaluations``-th
    evaluation of an array (telling the study nothing); returns it."""
    calls = []

    def metric_then_die(model, hp):
        calls.append(1)
        if len(calls) == evaluations:
            raise Killed
        return hs_loss(model)

    runner = cases.runner(study, B=None, checkpoint=ckpt, metric=metric_then_die, name="r", **kw)
    runner._fail = lambda *a, **k: None  # a killed process tells nothing
    with pytest.raises(Killed):
        runner.run(n_trials=n_trials)
    assert ckpt.exists()
    return runner


def resume(study, ckpt, **kw):
    """The runner of :func:`run_until_killed` started again with the same checkpoint."""
    return cases.runner(study, B=None, checkpoint=ckpt, metric=lambda m, hp: hs_loss(m), name="r", **kw)


def test_a_checkpoint_of_two_arrays_in_flight_resumes_both(tmp_path):
    ckpt = tmp_path / "runner.pt"
    study = new_study()
    strategy = hfkern.plan.Strategy(B=2, arrays=2)
    # Dies at the second array's second evaluation: the checkpoint of round 1 holds both arrays.
    run_until_killed(study, ckpt, 4, evaluations=4, strategy=strategy)
    saved = torch.load(ckpt, weights_only=False)
    assert len(saved["arrays"]) == 2 and saved["strategy"] == strategy
    running = [t.number for t in study.trials if t.state == TrialState.RUNNING]
    # Killed in the second round's evaluations: the first array had reported it, the second not.
    assert len(running) == 4 and sorted(len(t.intermediate_values) for t in study.trials) == [1, 1, 2, 2]
    again = resume(study, ckpt, strategy=strategy)
    rounds_again = watch_in_flight(again)
    summary = again.run(n_trials=4)
    assert summary.completed == 4 and len(rounds_again[0]) == 2  # both arrays resumed, together
    assert not ckpt.exists()
    for t in study.trials:
        check_alone(t)


def test_an_error_resuming_a_checkpointed_array_fails_its_trials(tmp_path):
    """The user's model raises as a restarted runner rebuilds its checkpointed array: run() raises
    it, and the array's trials are failed (counted: the error is their result), none left running."""
    ckpt = tmp_path / "runner.pt"
    study = new_study()
    run_until_killed(study, ckpt, 2, evaluations=2, strategy=hfkern.plan.Strategy(B=2))
    assert [t.state for t in study.trials] == [TrialState.RUNNING] * 2

    def model(params):
        raise RuntimeError("the user's model factory fails")

    with pytest.raises(RuntimeError, match="the user's model factory fails"):
        resume(study, ckpt, model=model, strategy=hfkern.plan.Strategy(B=2)).run(n_trials=2)
    for t in study.trials:
        assert t.state == TrialState.FAIL and t.user_attrs[OUTCOME_ATTR] == "error", t.number
        assert t.user_attrs[COUNTED_ATTR]


@pytest.mark.long
def test_a_resumed_runner_keeps_the_strategy_its_memory_budget_planned(tmp_path):
    ckpt = tmp_path / "runner.pt"
    study = new_study()
    first = run_until_killed(study, ckpt, 3, evaluations=2, memory_budget=64 * 2**20)
    again = resume(study, ckpt, memory_budget=64 * 2**20)
    assert again.run(n_trials=3).completed == 3
    assert again.strategy == first.strategy and not hasattr(again, "plans")  # restored, not planned again
    for t in study.trials:
        check_alone(t)


@pytest.mark.gpu
def test_gpu_two_arrays_in_flight_on_streams_with_and_without_capture():
    """On a GPU the two arrays' steps run on two CUDA streams (each a graph replay with capture):
    every trial equals itself trained alone on the CPU, with and without capture."""
    for capture in (True, False):
        study = new_study(pruner=cases.PruneNumbers({1}))
        for w in (3, 5, 3, 5, 3):
            study.enqueue_trial({"width": w})
        runner = cases.runner(study, space=cases.space_widths, device="cuda", capture=capture, B=None,
                              strategy=hfkern.plan.Strategy(B=2, arrays=2))
        rounds = watch_in_flight(runner)
        runner.run(n_trials=5)
        assert max(len(r) for r in rounds) == 2
        for t in study.trials:
            check_alone(t, rel=1e-3)
