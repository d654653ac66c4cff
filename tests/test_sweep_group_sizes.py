"""hfkern.sweep.Runner without B or strategy: each group of trials (its grouped parameters, its
model) is sized, or planned within a memory budget, for its own model, once; its arrays train
under its own B and strategy, arrays of groups train together only where both plan that many in
flight, and a resumed runner keeps every group's size. Every trial against its run alone."""

from __future__ import annotations

import pytest
import torch

import hfkern
from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import _sweep_cases as cases  # noqa: E402
from hfkern.sweep._runner import Runner  # noqa: E402
from optuna.trial import TrialState  # noqa: E402
from test_sweep import check_alone, new_study, resume, run_until_killed, watch_in_flight  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def sized(monkeypatch, sizes: dict) -> list[int]:
    """Runner._choose_B answers ``sizes[width]``: (B, strategy); returns the widths it was asked for."""
    asked = []

    def choose(self, entry):
        asked.append(entry.params["width"])
        return sizes[entry.params["width"]]

    monkeypatch.setattr(Runner, "_choose_B", choose)
    return asked


def record_arrays(runner) -> list[tuple]:
    """(width, B, strategy) of every array ``runner`` builds for new trials."""
    built, new_array = [], runner._new_array

    def recording(entries, B, strategy):
        built.append((entries[0].params["width"], B, strategy))
        return new_array(entries, B, strategy)

    runner._new_array = recording
    return built


def widths_of(key_rounds) -> list[list[int]]:
    return [[dict(key)["width"] for key in r] for r in key_rounds]


def test_each_group_trains_under_its_own_size_and_strategy(monkeypatch):
    # Width 3 recomputes its conv and batch norm in arrays of 2; width 5 trains plainly in arrays of 3.
    # (One size for every group, the first's, gave width 5 width 3's recomputation and B.)
    recompute = hfkern.plan.Strategy(B=2, recompute=("0", "1"))
    asked = sized(monkeypatch, {3: (2, recompute), 5: (3, None)})
    study = new_study()
    for w in (3, 5, 3, 5, 5, 3, 5):
        study.enqueue_trial({"width": w})
    runner = cases.runner(study, space=cases.space_widths, B=None)
    built = record_arrays(runner)
    summary = runner.run(n_trials=7)
    assert sorted(asked) == [3, 5]  # each group sized once
    assert {(w, s) for w, _, s in built} == {(3, recompute), (5, None)}
    assert max(B for w, B, _ in built if w == 3) == 2 and max(B for w, B, _ in built if w == 5) == 3
    assert (runner.B, runner.strategy) == (2, recompute)  # the first group's
    assert summary.B == 3 and summary.completed == 7 and summary.in_flight == 1
    assert set(runner._sizes) == {(("width", 3),), (("width", 5),)}
    for t in study.trials:
        check_alone(t)


def test_groups_train_together_only_where_both_plan_arrays_in_flight(monkeypatch):
    two, one = hfkern.plan.Strategy(B=2, arrays=2), hfkern.plan.Strategy(B=2, arrays=1)
    sized(monkeypatch, {3: (2, two), 5: (2, one)})
    study = new_study(pruner=cases.PruneNumbers({0}))
    for w in (3, 3, 3, 5, 3, 5, 5):
        study.enqueue_trial({"width": w})
    runner = cases.runner(study, space=cases.space_widths, B=None)
    watched = watch_in_flight(runner)
    summary = runner.run(n_trials=7)
    rounds = widths_of(watched)
    assert summary.completed == 6 and summary.pruned == 1 and summary.in_flight == 2
    assert [3, 3] in rounds  # width 3's arrays train two together ...
    assert [5] in rounds and all(r == [5] for r in rounds if 5 in r)  # ... width 5's (one in flight) alone
    for t in study.trials:
        check_alone(t)


def test_a_resumed_runner_keeps_each_groups_size_and_strategy(tmp_path, monkeypatch):
    ckpt = tmp_path / "runner.pt"
    study = new_study()
    recompute = hfkern.plan.Strategy(B=2, arrays=2, recompute=("0", "1"))
    plain = hfkern.plan.Strategy(B=2, arrays=2)
    sized(monkeypatch, {3: (2, recompute), 5: (2, plain)})
    for w in (3, 5, 3, 5):
        study.enqueue_trial({"width": w})
    # Dies in the second round's evaluations: the checkpoint of round 1 holds both groups' arrays.
    run_until_killed(study, ckpt, 4, evaluations=4, space=cases.space_widths)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["sizes"] == {(("width", 3),): (2, recompute), (("width", 5),): (2, plain)}
    assert sorted(a["strategy"].recompute for a in saved["arrays"]) == [(), ("0", "1")]

    def must_not_size(self, entry):
        raise AssertionError(f"group width={entry.params['width']} sized again")

    monkeypatch.setattr(Runner, "_choose_B", must_not_size)
    again = resume(study, ckpt, space=cases.space_widths)
    strategies = []
    resume_array = again._resume_array
    again._resume_array = lambda slots, saved, strategy: (strategies.append(strategy),
                                                           resume_array(slots, saved, strategy))[1]
    assert again.run(n_trials=4).completed == 4
    assert sorted(s.recompute for s in strategies) == [(), ("0", "1")]
    for t in study.trials:
        check_alone(t)


def test_a_checkpoint_of_the_earlier_format_resumes_with_one_size_for_every_group(tmp_path, monkeypatch):
    """Formats 1 and 2 held one B and strategy, chosen for the first group, for every group."""
    ckpt = tmp_path / "runner.pt"
    study = new_study()
    strategy = hfkern.plan.Strategy(B=2, arrays=2)
    sized(monkeypatch, {3: (2, strategy), 5: (2, strategy)})
    for w in (3, 5, 3, 5, 3):
        study.enqueue_trial({"width": w})
    run_until_killed(study, ckpt, 5, evaluations=4, space=cases.space_widths)
    saved = torch.load(ckpt, weights_only=False)
    saved["version"] = 2
    del saved["sizes"]
    for a in saved["arrays"]:
        del a["strategy"]
    torch.save(saved, ckpt)
    monkeypatch.setattr(Runner, "_choose_B", lambda self, entry: pytest.fail("a format 2 checkpoint is resized"))
    again = resume(study, ckpt, space=cases.space_widths)
    assert again.run(n_trials=5).completed == 5
    assert (again.B, again.strategy) == (2, strategy)
    for t in study.trials:
        assert t.state == TrialState.COMPLETE
        check_alone(t)


@pytest.mark.long
def test_a_memory_budget_plans_each_group_for_its_own_model():
    study = new_study()
    for w in (3, 5, 3, 5, 3):
        study.enqueue_trial({"width": w})
    budget = 64 * 2**20
    runner = cases.runner(study, space=cases.space_widths, B=None, memory_budget=budget)
    built = record_arrays(runner)
    summary = runner.run(n_trials=5)
    assert summary.completed == 5
    plans = {dict(key)["width"]: p for key, p in runner.group_plans.items()}
    assert sorted(plans) == [3, 5] and runner.plans is plans[3]  # the first group's, as runner.plans
    for w, B, strategy in built:
        best = plans[w].best()
        assert strategy == best.strategy and B <= best.B and best.peak_memory <= budget
    for t in study.trials:
        check_alone(t)
