"""Lost runners and their trials, in one process on a heartbeat storage: trials failed as stale
(as lost), their retries, runners restarted with and without a checkpoint, and runners whose trials
another runner failed.

Each test runs on an SQLite file and, where a server is set (tests/_postgres.py), on PostgreSQL.
A runner's death is the end of its heartbeats; instead of waiting out a grace period, the tests
age the heartbeats (:func:`age_heartbeats`), so every interleaving here is forced, not timed.
"""

from __future__ import annotations

import datetime
import logging
import warnings
from collections import Counter

import pytest

from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import _sweep_cases as cases  # noqa: E402
import hfkern  # noqa: E402
import hfkern.sweep as hs  # noqa: E402
from _postgres import postgres_db  # noqa: E402, F401  (fixture)
from hfkern.sweep._storage import COUNTED_ATTR, OUTCOME_ATTR, RUNNER_ATTR, SEED_ATTR  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
STUDY = "sweep"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sweep.db'}"
    return request.getfixturevalue("postgres_db")


def load(url: str, storage=None) -> optuna.Study:
    """The study as one runner process loads it (a storage of its own: nothing cached is shared)."""
    storage = storage or hs.storage(url, heartbeat_interval=1, grace_period=2)
    return optuna.load_study(study_name=STUDY, storage=storage, sampler=optuna.samplers.RandomSampler(0))


def create(url: str) -> optuna.Study:
    optuna.create_study(study_name=STUDY, storage=hs.storage(url))
    return load(url)


def held_by(study: optuna.Study, name: str, n: int) -> list[int]:
    """``n`` trials asked as runner ``name`` asks them (parameters, seed, a heartbeat), left RUNNING:
    the trials of a runner that dies now. Their numbers."""
    numbers = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        for _ in range(n):
            t = study.ask()
            cases.space(t)
            t.set_user_attr(RUNNER_ATTR, name)
            t.set_user_attr(SEED_ATTR, t.number)
            study._storage.record_heartbeat(t._trial_id)
            numbers.append(t.number)
    return numbers


def age_heartbeats(study: optuna.Study, numbers=None, seconds: float = 3600) -> None:
    """Move the last heartbeat of the trials ``numbers`` (default: all) ``seconds`` back: their
    runner has been gone that long, past any grace period."""
    import sqlalchemy.orm
    from optuna.storages._rdb import models

    backend = getattr(study._storage, "_backend", study._storage)
    ids = [t._trial_id for t in study.get_trials(deepcopy=False) if numbers is None or t.number in numbers]
    with sqlalchemy.orm.Session(backend.engine) as session:
        table = models.TrialHeartbeatModel
        for row in session.query(table).filter(table.trial_id.in_(ids)):
            row.heartbeat -= datetime.timedelta(seconds=seconds)
        session.commit()


def retries_of(study: optuna.Study) -> dict[int, list]:
    """The retries of each retried trial (number -> its retries)."""
    out: dict[int, list] = {}
    for t in study.get_trials():
        if "failed_trial" in t.system_attrs:
            out.setdefault(t.system_attrs["failed_trial"], []).append(t)
    return out


def check_alone(trial) -> None:
    want = cases.train_alone(trial.params, trial.user_attrs[SEED_ATTR])
    cases.assert_close_curves(cases.curve(trial), want[:len(trial.intermediate_values)], f"trial {trial.number}")


def test_a_trial_failed_as_stale_is_failed_as_lost(url):
    """A runner fails another runner's stale trials with the outcome "lost" (written with the
    failed state), not counted, and retries them."""
    study = create(url)
    lost = held_by(study, "dead", 2)
    age_heartbeats(study)
    cases.runner(load(url), name="live")._fail_stale()
    for t in study.get_trials():
        if t.number in lost:
            assert t.state == TrialState.FAIL and t.user_attrs[OUTCOME_ATTR] == "lost", t.number
            assert COUNTED_ATTR not in t.user_attrs
        else:
            assert t.state == TrialState.WAITING and t.system_attrs["failed_trial"] in lost
    assert hs.counted_trials(study) == 2  # the retries, not the lost trials


def test_a_trial_its_runner_finished_is_not_failed_as_stale(url, monkeypatch):
    """Between the look for stale trials and their failing, the live runner of a stale trial may
    tell it complete: it keeps its result (and gets no "lost" outcome, no retry)."""
    study = create(url)
    (number,) = held_by(study, "slow", 1)
    age_heartbeats(study)
    other = load(url)
    stale = other._storage._get_stale_trial_ids

    def stale_then_told(study_id):  # the slow runner tells its trial just after the look
        ids = stale(study_id)
        study.tell(number, 1.0)
        return ids

    monkeypatch.setattr(other._storage, "_get_stale_trial_ids", stale_then_told)
    cases.runner(other, name="live")._fail_stale()
    (t,) = study.get_trials()
    assert t.state == TrialState.COMPLETE and OUTCOME_ATTR not in t.user_attrs


def optuna_callback_storage(url: str):
    """An RDB storage built with Optuna's own retry callback (not hfkern.sweep.storage)."""
    retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    keyword = "heartbeat_stale_trial_callback"
    if retry is None:
        retry, keyword = optuna.storages.RetryFailedTrialCallback, "failed_trial_callback"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=2, **{keyword: retry(max_retry=2)})


@pytest.mark.parametrize("who", ["optuna's fail_stale_trials on hfkern's storage",
                                 "a runner on a storage with optuna's callback"])
def test_a_retry_does_not_inherit_the_attributes_of_the_lost_try(url, who):
    """A retry keeps the lost trial's parameters and seed, but not the runner bookkeeping of the
    lost try: it is no trial of the dead runner, and has no outcome."""
    study = create(url)
    lost = held_by(study, "dead", 2)
    age_heartbeats(study)
    if who.startswith("optuna"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(load(url))
    else:
        cases.runner(load(url, optuna_callback_storage(url)), name="live")._fail_stale()
    retries = retries_of(study)
    assert sorted(retries) == lost
    for n, (retry,) in retries.items():
        assert retry.state == TrialState.WAITING
        assert retry.params == study.trials[n].params and retry.user_attrs == {SEED_ATTR: n}


def test_a_restarted_runner_does_not_take_another_runners_retry_for_its_own(url):
    """Runner A dies; its trials are failed as stale and retried. Runner X asks a retry, and while
    its search space runs (the retry RUNNING, not yet named X's), A restarts under its name: A must
    not fail X's trial as one of its own lost trials."""
    study = create(url)
    lost = held_by(study, "A", 2)
    age_heartbeats(study)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    restarted = []

    def space(trial):
        if SEED_ATTR in trial.user_attrs and not restarted:  # a retry (a new trial gets its seed later)
            restarted.append(trial.number)
            cases.runner(load(url), name="A")._recover()  # the restarted runner A's first step
        return cases.space(trial)

    summary = cases.runner(study, B=2, name="X", space=space).run(n_trials=2)
    assert restarted and summary.completed == 2
    retries = retries_of(study)
    assert sorted(retries) == lost
    for (retry,) in retries.values():
        assert retry.state == TrialState.COMPLETE and retry.user_attrs[RUNNER_ATTR] == "X"
        check_alone(retry)


def test_a_runner_whose_trials_another_runner_failed_as_stale_drops_them_and_goes_on(url, caplog):
    """A runner's round outlasts the grace period (a pause), and another runner fails its two
    trials as stale and retries them. At its report the runner drops them (logged, not counted
    in its summary) and goes on: it runs the retries, and the study ends with its 4 trials."""
    study = create(url)
    calls = []

    def metric(model, hp):
        calls.append(1)
        if len(calls) == 1:  # the first round's report: the trials' heartbeats are past the grace period
            age_heartbeats(study)
            cases.runner(load(url), name="other")._fail_stale()
        _, (xv, yv) = cases.data()
        return hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(xv, model.B)), yv).double()

    with caplog.at_level(logging.WARNING, logger="hfkern.sweep"):
        summary = cases.runner(study, B=2, metric=metric, name="late").run(n_trials=4)
    assert (summary.completed, summary.pruned, summary.failed) == (4, 0, 0)
    assert caplog.text.count("was finished elsewhere") == 2
    trials = study.get_trials()
    assert [t.number for t in trials if t.state == TrialState.FAIL] == [0, 1]
    assert all(t.user_attrs[OUTCOME_ATTR] == "lost" for t in trials[:2])
    assert hs.counted_trials(study) == 4
    assert sorted(retries_of(study)) == [0, 1]
    for t in trials[2:]:
        assert t.state == TrialState.COMPLETE
        check_alone(t)


class Killed(BaseException):
    """Stands for the process's death: raised by a metric, after the runner's checkpoint."""


def test_a_runner_restarted_after_the_grace_period_resumes_its_checkpoint(url, tmp_path):
    """A runner with a checkpoint is killed mid-array and started again after the grace period
    (no other runner looked meanwhile): its checkpointed trials are its own, resumed, not failed
    as stale and started over."""
    study = create(url)
    ckpt = tmp_path / "runner.pt"
    calls = []

    def metric_then_die(model, hp):
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        _, (xv, yv) = cases.data()
        return hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(xv, model.B)), yv).double()

    first = cases.runner(study, B=3, checkpoint=ckpt, metric=metric_then_die, name="r")
    first._fail = lambda *a, **k: None  # a killed process tells nothing
    with pytest.raises(Killed):
        first.run(n_trials=3)
    assert ckpt.exists() and [len(t.intermediate_values) for t in study.get_trials()] == [1, 1, 1]
    age_heartbeats(study)
    summary = cases.runner(load(url), B=3, checkpoint=ckpt, name="r").run(n_trials=3)
    assert summary.completed == 3
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3  # resumed: none failed, none retried
    for t in trials:
        check_alone(t)


def test_a_lost_trial_failed_as_stale_meanwhile_is_retried_once(url):
    """A restarted runner fails the trials it held and no longer holds (no checkpoint) as lost, and
    retries them; another runner that failed one as stale meanwhile has retried it already: it is
    retried once, and run once."""
    study = create(url)
    lost = held_by(study, "A", 2)
    runner = cases.runner(load(url), B=2, name="A")
    fail, raced = runner._fail, []

    def fail_after_another_runner(trial, outcome, counted):
        if outcome == "lost" and not raced:  # the grace period ends now, and another runner looks
            raced.append(trial.number)
            age_heartbeats(study)
            cases.runner(load(url), name="other")._fail_stale()
        return fail(trial, outcome, counted)

    runner._fail = fail_after_another_runner
    summary = runner.run(n_trials=2)
    assert raced and summary.completed == 2
    retries = retries_of(study)
    assert {n: len(r) for n, r in retries.items()} == dict.fromkeys(lost, 1)
    assert all(r.state == TrialState.COMPLETE for (r,) in retries.values())
    assert hs.counted_trials(study) == 2


def test_every_waiting_retry_runs_past_the_budget(url):
    """Two runners asking at once took the study one past N = 3: two trials complete, two held
    by a runner that dies. The survivor fails those as lost, and the budget has room for one
    trial more: both retries run all the same (a lost trial's retry takes its place). A trial
    enqueued after them is no retry: the budget decides it, and it stays waiting."""
    study = create(url)
    for _ in range(2):  # finished by live runners
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            t = study.ask()
        p = cases.space(t)
        t.set_user_attr(SEED_ATTR, t.number)
        study.tell(t, cases.train_alone(p, t.number)[-1])
    lost = held_by(study, "dead", 2)
    age_heartbeats(study)
    cases.runner(load(url), name="live")._fail_stale()
    study.enqueue_trial({"lr": 0.01, "momentum": 0.5})
    assert hs.counted_trials(study) == 5  # 2 complete, 2 retries and 1 enqueued waiting
    summary = cases.runner(study, B=2, name="X").run(n_trials=3)
    assert summary.completed == 2
    retries = retries_of(study)
    assert sorted(retries) == lost
    for (retry,) in retries.values():
        assert retry.state == TrialState.COMPLETE
        check_alone(retry)
    waiting = [t for t in study.get_trials() if t.state == TrialState.WAITING]
    assert [t.system_attrs["fixed_params"] for t in waiting] == [{"lr": 0.01, "momentum": 0.5}]
    assert Counter(t.state for t in study.get_trials()) == {TrialState.COMPLETE: 4, TrialState.FAIL: 2,
                                                            TrialState.WAITING: 1}
