"""The sweep runner's fixes of the fourth round of defects:

1. the default ``optimizer_kwargs`` passes the parameters named as the optimizer's flags
   (``nesterov``, ``amsgrad``, ``centered``, ...), one per array;
2. an idle slot's schedule does not advance: a OneCycleLR of the trial's own length no longer
   raises once a finished slot stays idle, and a refilled slot starts its schedule afresh;
3. a ``KeyboardInterrupt`` or ``SystemExit`` leaves the held trials as a kill would (RUNNING,
   resumed from the checkpoint), not failed as counted errors;
4. per-model scheduler arguments whose default is None: OneCycleLR given ``total_steps`` by some
   trials and ``epochs`` with ``steps_per_epoch`` by others in one array (each trial's length
   resolved as torch's OneCycleLR resolves it), CyclicLR's ``step_size_down`` for some trials only;
5. a strategy the runner cannot train the models with (micro-batches on batch norm) is refused
   on the first trial's model, before more trials are asked, and fails no trial as counted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfkern
from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import _sweep_cases as cases  # noqa: E402
import hfkern.sweep as hs  # noqa: E402
from hfkern.optim import lr_scheduler as H  # noqa: E402
from hfkern.plan import Strategy  # noqa: E402
from hfkern.sweep import batch_indices  # noqa: E402
from hfkern.sweep._storage import COUNTED_ATTR, OUTCOME_ATTR, SEED_ATTR  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
torch.set_num_threads(1)

STEPS = cases.N_TRAIN // cases.BATCH  # steps per epoch


def new_study(pruner=None, **kw) -> optuna.Study:
    return optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(0),
                               pruner=pruner or optuna.pruners.NopPruner(), **kw)


def valid_loss(model, hp) -> torch.Tensor:
    """The built-in "loss" metric, as a metric callable."""
    _, (xv, yv) = cases.data()
    return hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(xv, model.B)), yv).double()


def alone(params: dict, seed: int, *, optimizer=cases.sgd, scheduler=None, interval: str = "epoch",
          epochs: int = cases.EPOCHS) -> list[float]:
    """cases.train_alone with the scheduler ``scheduler(params, opt)`` stepped every epoch or step."""
    (x, y), (xv, yv) = cases.data()
    torch.manual_seed(seed)
    m = cases.model(params)
    opt = optimizer(params, m.parameters())
    sched = scheduler(params, opt) if scheduler else None
    values = []
    for step in range(epochs * STEPS):
        idx = batch_indices(cases.N_TRAIN, cases.BATCH, step, 0)
        m.train()
        loss = F.cross_entropy(m(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched and (interval == "step" or (step + 1) % STEPS == 0):
            sched.step()
        if (step + 1) % STEPS == 0:
            m.eval()
            with torch.no_grad():
                values.append(F.cross_entropy(m(xv), yv).item())
    return values


def check_against_alone(study: optuna.Study, **kw) -> None:
    """Every complete or pruned trial's curve is its curve trained alone (a prefix where pruned)."""
    for t in study.trials:
        assert t.state in (TrialState.COMPLETE, TrialState.PRUNED), (t.number, t.state, t.user_attrs)
        want = alone(t.params, t.user_attrs[SEED_ATTR], **kw)
        got = cases.curve(t)
        if t.state == TrialState.PRUNED:
            want = want[:len(got)]
        cases.assert_close_curves(got, want, f"trial {t.number} {t.params}")


# ---- 1. optimizer flags in the search space ----------------------------------------------------------

def test_1_a_nesterov_parameter_reaches_the_optimizer_and_trains_as_torch_sgd_with_nesterov():
    def space(trial):
        return {"lr": trial.suggest_float("lr", 0.01, 0.1, log=True),
                "momentum": trial.suggest_float("momentum", 0.5, 0.9),
                "nesterov": trial.suggest_categorical("nesterov", [True, False])}

    study = new_study()
    for nesterov in (True, False, True, False):
        study.enqueue_trial({"nesterov": nesterov})
    runner = cases.runner(study, space=space, B=2, fusible=["lr", "momentum"])
    assert runner._default_optimizer_kwargs({"lr": 0.1, "momentum": 0.9, "nesterov": True}) == \
        {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    summary = runner.run(n_trials=4)
    assert summary.completed == 4
    assert sorted(t.params["nesterov"] for t in study.trials) == [False, False, True, True]

    def sgd(p, params):
        return torch.optim.SGD(params, lr=p["lr"], momentum=p["momentum"], nesterov=p["nesterov"])

    check_against_alone(study, optimizer=sgd)


@pytest.mark.parametrize("optimizer,flag", [(hfkern.optim.Adam, "amsgrad"), (hfkern.optim.RMSprop, "centered"),
                                            (hfkern.optim.SGD, "maximize")])
def test_1_the_default_optimizer_kwargs_pass_every_flag_of_the_optimizer(optimizer, flag):
    runner = cases.runner(new_study(), optimizer=optimizer)
    assert runner._default_optimizer_kwargs({"lr": 0.01, flag: True, "width": 3}) == {"lr": 0.01, flag: True}
    assert runner._default_optimizer_kwargs({"lr": 0.01}) == {"lr": 0.01}


# ---- 2. idle slots' schedules ------------------------------------------------------------------------

@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_2_onecycle_of_the_trials_own_length_with_a_slot_left_idle_trains_every_trial_as_alone(interval):
    # Trial 0 is pruned at report 1 (trial 3 refills its slot, starting its schedule afresh); trials 1
    # and 2 finish at report 3 while trial 3 trains on: one slot takes trial 4, the other stays idle
    # (2 of 3 slots busy: no compaction), its OneCycleLR at its total_steps.
    total = cases.EPOCHS * (STEPS if interval == "step" else 1)
    study = new_study(cases.PruneNumbers({0}))
    summary = cases.runner(study, B=3, scheduler=H.OneCycleLR, scheduler_interval=interval,
                           scheduler_kwargs=lambda p: {"max_lr": p["lr"], "total_steps": total}).run(n_trials=5)
    assert (summary.completed, summary.pruned, summary.failed) == (4, 1, 0)
    check_against_alone(study, interval=interval, scheduler=lambda p, opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=p["lr"], total_steps=total))


def test_2_an_idle_slot_keeps_its_schedule_and_the_active_slots_step():
    study = new_study()
    runner = cases.runner(study, B=3, scheduler=H.OneCycleLR,
                          scheduler_kwargs=lambda p: {"max_lr": p["lr"], "total_steps": cases.EPOCHS})
    runner._n_trials = 2
    a = runner._start_array()  # two trials, B = 2: both slots busy
    assert a.B == 2
    runner._free(a, 1)
    before = a.scheduler.last_epochs.clone()
    runner._step_scheduler(a, a.active())
    assert a.scheduler.last_epochs.tolist() == [before[0] + 1, before[1]]


# ---- 3. interrupted in-process -----------------------------------------------------------------------

def interrupting_metric(exc: type[BaseException], at: int):
    calls = [0]

    def metric(model, hp):
        calls[0] += 1
        if calls[0] == at:
            raise exc("stop")
        return valid_loss(model, hp)

    return metric


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_3_an_interrupted_runner_leaves_its_trials_running_and_a_restart_resumes_them(tmp_path, exc):
    ckpt = tmp_path / "runner.pt"
    study = new_study()
    kw = dict(B=3, checkpoint=ckpt, checkpoint_every=1, epochs=4)
    with pytest.raises(exc):
        cases.runner(study, metric=interrupting_metric(exc, 3), **kw).run(n_trials=5)  # at report 3
    assert ckpt.exists()
    assert [t.state for t in study.trials] == [TrialState.RUNNING] * 3
    assert [len(t.intermediate_values) for t in study.trials] == [2, 2, 2]
    assert not any(OUTCOME_ATTR in t.user_attrs or COUNTED_ATTR in t.user_attrs for t in study.trials)

    summary = cases.runner(study, metric=valid_loss, **kw).run(n_trials=5)
    assert summary.completed == 5
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 5
    assert hs.counted_trials(study) == 5
    check_against_alone(study, epochs=4)


def test_3_the_same_runner_run_again_after_an_interrupt_resumes_from_its_checkpoint(tmp_path):
    study = new_study()
    calls = [0]

    def metric(model, hp):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return valid_loss(model, hp)

    runner = cases.runner(study, B=3, metric=metric, checkpoint=tmp_path / "r.pt")
    with pytest.raises(KeyboardInterrupt):
        runner.run(n_trials=3)
    assert runner._held() == []
    summary = runner.run(n_trials=3)
    assert summary.completed == 3 and [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    check_against_alone(study)


def test_3_an_interrupt_while_a_trial_is_asked_fails_it_as_lost_uncounted():
    study = new_study()

    def space(trial):
        if trial.number == 1:
            raise KeyboardInterrupt
        return cases.space(trial)

    runner = cases.runner(study, space=space, B=3)
    with pytest.raises(KeyboardInterrupt):
        runner.run(n_trials=3)
    assert [t.state for t in study.trials] == [TrialState.RUNNING, TrialState.FAIL]
    assert study.trials[1].user_attrs[OUTCOME_ATTR] == "lost" and hs.counted_trials(study) == 1
    # A runner of the same name (this process, no checkpoint) fails the trial it no longer holds as lost.
    summary = cases.runner(study, B=3).run(n_trials=3)
    assert summary.completed == 3 and hs.counted_trials(study) == 3
    assert study.trials[0].user_attrs[OUTCOME_ATTR] == "lost"


# ---- 4. per-model arguments whose default is None ----------------------------------------------------

def one_cycle_kwargs(p):
    """total_steps for some trials, epochs and steps_per_epoch (another length) for others."""
    if p["momentum"] < 0.45:
        return {"max_lr": p["lr"], "total_steps": cases.EPOCHS}
    return {"max_lr": p["lr"], "epochs": cases.EPOCHS + 2, "steps_per_epoch": 1}


def test_4_onecycle_given_total_steps_by_some_trials_and_epochs_by_others_shares_an_array():
    study = new_study(cases.PruneNumbers({0}))
    for momentum in (0.2, 0.8, 0.3, 0.7):  # trial 3 (epochs) refills trial 0's slot (total_steps)
        study.enqueue_trial({"momentum": momentum})
    summary = cases.runner(study, B=3, scheduler=H.OneCycleLR, scheduler_kwargs=one_cycle_kwargs).run(n_trials=4)
    assert (summary.completed, summary.pruned, summary.arrays) == (3, 1, 1)
    check_against_alone(study, scheduler=lambda p, opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, **one_cycle_kwargs(p)))


def test_4_onecycle_total_steps_wins_over_epochs_as_in_torch_and_neither_is_refused():
    from hfkern.sweep._runner import _trial_scheduler_kwargs

    both = {"max_lr": 0.1, "total_steps": 7, "epochs": 2, "steps_per_epoch": 2}
    assert _trial_scheduler_kwargs(H.OneCycleLR, both, 0) == {"max_lr": 0.1, "total_steps": 7}
    assert _trial_scheduler_kwargs(H.OneCycleLR, {"max_lr": 0.1, "total_steps": None, "epochs": 2,
                                                  "steps_per_epoch": 3}, 0) == {"max_lr": 0.1, "total_steps": 6}
    with pytest.raises(ValueError, match="neither total_steps nor"):
        _trial_scheduler_kwargs(H.OneCycleLR, {"max_lr": 0.1, "epochs": 2}, 5)
    with pytest.raises(ValueError, match="positive int"):
        _trial_scheduler_kwargs(H.OneCycleLR, {"max_lr": 0.1, "epochs": 0, "steps_per_epoch": 3}, 5)


def test_4_cyclic_step_size_down_given_by_some_trials_only_takes_each_trials_step_size_up():
    def kw(p):
        out = {"base_lr": p["lr"] / 10, "max_lr": p["lr"], "step_size_up": 2}
        if p["momentum"] > 0.45:
            out["step_size_down"] = 5
        return out

    study = new_study(cases.PruneNumbers({0}))
    for momentum in (0.8, 0.2, 0.3, 0.1):  # trial 3 (no step_size_down) refills trial 0's slot
        study.enqueue_trial({"momentum": momentum})
    summary = cases.runner(study, B=3, scheduler=H.CyclicLR, scheduler_kwargs=kw,
                           scheduler_interval="step").run(n_trials=4)
    assert (summary.completed, summary.pruned) == (3, 1)
    check_against_alone(study, interval="step",
                        scheduler=lambda p, opt: torch.optim.lr_scheduler.CyclicLR(opt, **kw(p)))


# ---- 5. a strategy refused before trials are used up -------------------------------------------------

def test_5_micro_batches_on_batch_norm_is_refused_on_the_first_trial_and_counts_no_trial(tmp_path):
    study = new_study(storage=hs.storage(f"sqlite:///{tmp_path / 'sweep.db'}"))
    with pytest.raises(ValueError, match="batch norm"):
        cases.runner(study, strategy=Strategy(B=3, micro_batches=2)).run(n_trials=5)
    # Only the first trial was asked, failed uncounted and retried (same parameters and seed).
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.WAITING]
    first, retry = study.trials
    assert not first.user_attrs.get(COUNTED_ATTR, False)  # only the waiting retry counts
    assert hs.counted_trials(study) == 1
    assert retry.params == first.params and retry.user_attrs[SEED_ATTR] == first.user_attrs[SEED_ATTR]

    summary = cases.runner(study, strategy=Strategy(B=3)).run(n_trials=3)
    assert summary.completed == 3 and hs.counted_trials(study) == 3
    assert study.trials[1].state == TrialState.COMPLETE and study.trials[1].params == first.params


def test_5_more_micro_batches_than_samples_is_refused_before_training():
    def model(p):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    study = new_study()
    with pytest.raises(ValueError, match="exceeds the batch size"):
        cases.runner(study, model=model, strategy=Strategy(B=2, micro_batches=cases.BATCH + 1)).run(n_trials=4)
    assert len(study.trials) == 1 and hs.counted_trials(study) == 0
