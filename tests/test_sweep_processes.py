"""Several sweep runner processes on one study, and runners killed with SIGKILL.

Each runner is a separate Python process (tests/_sweep_worker.py) on an RDB
storage: two on one SQLite file, two on a local PostgreSQL server (started by
.ci/run, tests/_postgres.py). The checks are the study's totals (every trial
counted once, none left running) and every trial's curve against the same
trial trained alone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import _sweep_cases as cases  # noqa: E402
import hfkern.sweep as hs  # noqa: E402
from _postgres import postgres_db  # noqa: E402, F401  (fixture)
from hfkern.sweep._storage import OUTCOME_ATTR, RUNNER_ATTR, SEED_ATTR  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sweep_worker.py")
TIMEOUT = 240


def create(url: str, name: str = "sweep") -> optuna.Study:
    # Created here, before the workers start: two processes creating Optuna's tables in
    # one empty database at once can collide (optuna/optuna#1092).
    return optuna.create_study(study_name=name, storage=hs.storage(url))


def spawn(url: str, n_trials: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, url, "sweep", str(n_trials), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out


def check_trials(study: optuna.Study, n_trials: int, alone: int | None = None) -> list:
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert n_trials <= hs.counted_trials(study) <= n_trials + 1  # two runners may ask the last one at once
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == hs.counted_trials(study)
    for t in complete[:alone]:
        assert sorted(t.intermediate_values) == list(range(1, cases.EPOCHS + 1)), t.number
        want = cases.train_alone(t.params, t.user_attrs[SEED_ATTR])
        cases.assert_close_curves(cases.curve(t), want, f"trial {t.number}")
    return trials


def two_runners(url: str) -> None:
    study = create(url)
    a = spawn(url, 8, "--name", "a", "--rounds-delay", "0.2")
    b = spawn(url, 8, "--name", "b", "--rounds-delay", "0.2")
    finish(a, b)
    trials = check_trials(study, 8, alone=3)
    assert {t.user_attrs[RUNNER_ATTR] for t in trials} == {"a", "b"}  # both took part


def test_two_runners_share_a_sqlite_study(tmp_path):
    two_runners(f"sqlite:///{tmp_path / 'sweep.db'}")


def test_two_runners_share_a_postgresql_study(postgres_db):  # noqa: F811
    two_runners(postgres_db)


def wait_for(predicate, what: str, proc: subprocess.Popen, limit: float = TIMEOUT) -> None:
    start = time.monotonic()
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the runner ended before {what}: {proc.communicate()[0]}")
        if time.monotonic() - start > limit:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def mid_array(study: optuna.Study) -> bool:
    """Some trial has reported and another is still running: a kill now interrupts an array."""
    trials = study.get_trials(deepcopy=False)
    return (any(1 <= len(t.intermediate_values) < cases.EPOCHS for t in trials if t.state == TrialState.RUNNING)
            and any(t.state == TrialState.RUNNING for t in trials))


def test_sigkill_then_restart_resumes_the_held_trials(tmp_path):
    url, ckpt = f"sqlite:///{tmp_path / 'sweep.db'}", str(tmp_path / "runner.pt")
    study = create(url)
    first = spawn(url, 5, "--checkpoint", ckpt, "--rounds-delay", "0.4")
    wait_for(lambda: os.path.exists(ckpt) and mid_array(study), "a checkpoint mid-array", first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    held = [t.number for t in study.get_trials() if t.state == TrialState.RUNNING]
    assert held
    finish(spawn(url, 5, "--checkpoint", ckpt))  # the same checkpoint: the same runner, resumed
    trials = check_trials(study, 5, alone=None)
    assert len(trials) == 5 and all(t.state == TrialState.COMPLETE for t in trials)  # resumed, none failed
    assert not os.path.exists(ckpt)  # removed once the runner holds nothing


def test_a_runner_that_never_returns_has_its_trials_retried_elsewhere(tmp_path):
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = create(url)
    beat = ("--heartbeat", "1", "--grace", "2")
    lost = spawn(url, 4, "--name", "lost", "--rounds-delay", "0.4", *beat)
    wait_for(lambda: mid_array(study), "a report mid-array", lost)
    lost.send_signal(signal.SIGKILL)
    lost.wait()
    held = {t.number: t for t in study.get_trials() if t.state == TrialState.RUNNING}
    assert held
    # Started at once, before the grace period ends: it finds the study's budget taken by the
    # lost runner's trials, waits on them, and runs their retries once they are stale.
    finish(spawn(url, 4, "--name", "other", *beat))
    trials = check_trials(study, 4, alone=None)
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert sorted(t.number for t in failed) == sorted(held)  # failed as stale, not counted ...
    retried = {t.system_attrs.get("failed_trial"): t for t in trials if t.state == TrialState.COMPLETE}
    for number, old in held.items():  # ... and run again with the same parameters and seed
        new = retried[number]
        assert new.params == old.params and new.user_attrs[SEED_ATTR] == old.user_attrs[SEED_ATTR]
        assert new.user_attrs[RUNNER_ATTR] == "other" and OUTCOME_ATTR not in new.user_attrs


def test_a_running_trial_without_a_heartbeat_is_not_waited_for(tmp_path, caplog):
    """A trial another client asked without a heartbeat (a plain study.ask(), on a storage without
    one) never becomes stale: a runner with nothing left to ask does not wait for it past the grace
    period, and names it in a warning. The runner runs in a thread, so that a wait that never ends
    fails the test instead of hanging it."""
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    optuna.create_study(study_name="sweep", storage=url).ask()
    study = optuna.load_study(study_name="sweep", storage=hs.storage(url, heartbeat_interval=1, grace_period=1),
                              sampler=optuna.samplers.RandomSampler(0))
    runner = cases.runner(study, B=2)
    outcome = {}

    def run():
        try:
            outcome["summary"] = runner.run(n_trials=3)  # the trial without a heartbeat counts: two more
        except BaseException as e:  # noqa: BLE001  (re-raised by the test)
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    with caplog.at_level(logging.WARNING, logger="hfkern.sweep"):
        thread.start()
        thread.join(timeout=60)
        if thread.is_alive():
            runner._stop_asking = True  # ends the wait at its next look
            thread.join(timeout=30)
            pytest.fail("the runner still waits for a running trial that records no heartbeat")
    if "error" in outcome:
        raise outcome["error"]
    assert outcome["summary"].completed == 2
    assert "trial 0 has been RUNNING since" in caplog.text and "without a heartbeat" in caplog.text
    assert [t.state for t in study.trials] == [TrialState.RUNNING, TrialState.COMPLETE, TrialState.COMPLETE]
