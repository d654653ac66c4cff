"""Study storage for many runner processes, and which trials count toward a budget.

Optuna keeps a study in a storage; its RDB storage (SQLAlchemy) lets any
number of processes, on one machine (SQLite) or many (PostgreSQL, MySQL), ask
and tell trials of one study. :func:`storage` builds one with what a fused
sweep needs: a heartbeat, so that the trials of a runner that died (SIGKILL,
a lost machine) are failed once their heartbeat is older than the grace
period instead of staying RUNNING forever, and a retry of such lost trials
with the same parameters and seed.

A trial *counts* toward a sweep's ``n_trials`` when it is complete, pruned,
running or waiting, or failed for a reason of its own (a non-finite loss, an
error in the user's code). A trial failed because its runner was lost does
not count: the sweep runs another one (its retry, where retries are on) in its
place, so that the study ends with the number of trials asked for.
"""

from __future__ import annotations

import copy
import datetime
import numbers
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

__all__ = ["storage", "counted_trials", "COUNTED_ATTR", "RUNNER_ATTR", "SEED_ATTR", "OUTCOME_ATTR"]

# User attributes the runner sets on its trials.
RUNNER_ATTR = "hfkern.runner"    # name of the runner that holds (or held) the trial
SEED_ATTR = "hfkern.seed"        # the seed its model was initialized with
# Why a trial ended other than complete: "nonfinite", "error", "lost" (its runner died: failed as
# stale by a runner, or by its own runner restarted without it; a stale trial failed by a client
# other than a runner, such as Optuna's own fail_stale_trials, has none).
OUTCOME_ATTR = "hfkern.outcome"
COUNTED_ATTR = "hfkern.counted"  # a failed trial that counts toward n_trials (its failure is its result)
# The attributes of one try of a trial: a retry of a lost trial inherits its user attributes (its
# seed: it trains the same model), but not these; it is a try of its own, held by whichever runner
# asks it.
TRY_ATTRS = (RUNNER_ATTR, OUTCOME_ATTR, COUNTED_ATTR)

_LIVE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
# Optuna 4.9 renamed the retry callback and its keyword; both spellings are served.
_RetryBase = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
_RETRY_KEYWORD = "heartbeat_stale_trial_callback"
if _RetryBase is None:
    _RetryBase, _RETRY_KEYWORD = optuna.storages.RetryFailedTrialCallback, "failed_trial_callback"


def without_try_attrs(trial: FrozenTrial) -> FrozenTrial:
    """A copy of ``trial`` without the user attributes of its try (:data:`TRY_ATTRS`)."""
    trial = copy.deepcopy(trial)
    for key in TRY_ATTRS:
        trial.user_attrs.pop(key, None)
    return trial


class RetryLostTrial(_RetryBase):
    """Optuna's retry of a lost trial (a WAITING copy with its parameters and user attributes, at
    most ``max_retry`` times), less the attributes of the lost try (:data:`TRY_ATTRS`): the retry
    does not name the dead runner, so that runner, restarted under its name, does not take another
    runner's retry for a trial of its own."""

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        super().__call__(study, without_try_attrs(trial))


def storage(url: str, *, heartbeat_interval: int = 30, grace_period: int | None = None,
            retries: int = 2, engine_kwargs: dict[str, Any] | None = None) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage for a sweep shared by several runner processes.

    Args:
        url: an SQLAlchemy database URL: ``sqlite:///sweep.db`` (one machine),
            ``postgresql+psycopg2://user:password@host:5432/db`` (many).
        heartbeat_interval: seconds between a runner's heartbeats. The runner
            records one per held trial at every report, so the interval should
            exceed the time between two reports only as a margin: the grace
            period is what decides.
        grace_period: seconds after the last heartbeat at which a RUNNING
            trial is taken as lost (its runner died) and failed by the next
            runner that looks (default ``2 * heartbeat_interval``, as Optuna's).
            It must exceed the longest time between two reports of a live
            runner, or live trials are failed.
        retries: how many times a lost trial is retried with the same
            parameters and seed (Optuna's ``RetryHeartbeatStaleTrialCallback``,
            formerly ``RetryFailedTrialCallback``, less the runner's attributes
            of the lost try: :class:`RetryLostTrial`); 0 runs a new trial in
            its place instead.
        engine_kwargs: passed to SQLAlchemy's ``create_engine``; for SQLite the
            default waits up to 60 s for a lock held by another process.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"storage: expected an SQLAlchemy database URL such as 'sqlite:///sweep.db', got {url!r}")
    for name, value, lo in (("heartbeat_interval", heartbeat_interval, 1), ("retries", retries, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
            raise ValueError(f"storage: {name} must be an int >= {lo}, got {value!r}")
    if grace_period is not None and (isinstance(grace_period, bool) or not isinstance(grace_period, numbers.Integral)
                                     or grace_period < 1):
        raise ValueError(f"storage: grace_period must be a positive int or None, got {grace_period!r}")
    kwargs = dict(engine_kwargs or {})
    if url.startswith("sqlite") and not engine_kwargs:
        # Several processes write one SQLite file: wait for the lock instead of
        # failing with "database is locked".
        kwargs = {"connect_args": {"timeout": 60}}
    with warnings.catch_warnings():  # heartbeats and retries are "experimental" since Optuna 2.8
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        callback = {_RETRY_KEYWORD: RetryLostTrial(max_retry=retries)} if retries else {}
        return optuna.storages.RDBStorage(
            url, engine_kwargs=kwargs, heartbeat_interval=int(heartbeat_interval),
            grace_period=None if grace_period is None else int(grace_period), **callback)


def grace_period(storage: Any) -> float:
    """Seconds after its last heartbeat at which a RUNNING trial of ``storage`` is taken as lost
    (a heartbeat-enabled storage)."""
    backend = getattr(storage, "_backend", storage)  # the study's cache wraps the RDB storage
    grace = getattr(backend, "grace_period", None)
    return float(grace if grace is not None else 2 * storage.get_heartbeat_interval())


def retry_callback(storage: Any) -> Any:
    """The callback that retries ``storage``'s lost trials, or None."""
    return (getattr(storage, "get_heartbeat_stale_trial_callback", None)
            or getattr(storage, "get_failed_trial_callback", lambda: None))()


def retry(study: optuna.Study, trial: FrozenTrial) -> None:
    """Retry the lost ``trial`` as the storage retries a stale one, less the attributes of its try
    (:data:`TRY_ATTRS`, also where the storage's callback is Optuna's own); nothing without a
    retry callback."""
    callback = retry_callback(study._storage)
    if callback is not None:
        callback(study, without_try_attrs(trial))


def fail_stale_trials(study: optuna.Study) -> list[int]:
    """Fail the study's stale trials (RUNNING, heartbeat older than the grace period: their runner
    is lost) as Optuna's ``fail_stale_trials`` does, with ``OUTCOME_ATTR = "lost"``, and retry
    them (:func:`retry`); returns the ids of the trials failed here.

    On Optuna's RDB storage the outcome and the failed state are written in one transaction, on
    the trial's row locked, and only while it is RUNNING: a trial its runner finished meanwhile
    keeps its own result, and no reader sees a failed trial without its outcome. On another
    storage (or an Optuna whose RDB internals this code does not know), Optuna's
    ``fail_stale_trials`` fails them without an outcome.
    """
    storage = study._storage
    if not optuna.storages._heartbeat.is_heartbeat_enabled(storage):
        return []
    stale_ids = getattr(storage, "_get_stale_trial_ids", None)  # what Optuna's own reads
    fail = _fail_lost_rdb(storage) if stale_ids is not None else None
    if fail is None:
        with warnings.catch_warnings():  # experimental since Optuna 2.9, and what heartbeats are for
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        return []
    failed = [trial_id for trial_id in stale_ids(study._study_id) if fail(trial_id)]
    for trial_id in failed:
        retry(study, storage.get_trial(trial_id))
    return failed


def _fail_lost_rdb(storage: Any) -> Any:
    """``fail(trial_id) -> bool`` (:func:`fail_stale_trials`) for Optuna's RDB storage; None for
    another storage, or where Optuna's RDB internals are not those this code knows."""
    backend = getattr(storage, "_backend", storage)  # the study's cache wraps the RDB storage
    if not isinstance(backend, optuna.storages.RDBStorage):
        return None
    try:
        import sqlalchemy.exc
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        find, attr_model = models.TrialModel.find_or_raise_by_id, models.TrialUserAttributeModel
        set_attr = backend._set_trial_attr_without_commit
    except (ImportError, AttributeError):
        return None

    def fail(trial_id: int) -> bool:
        try:
            with _create_scoped_session(backend.scoped_session) as session:
                trial = find(trial_id, session, for_update=True)
                if trial.state != TrialState.RUNNING:  # finished meanwhile, by its runner or another
                    return False
                set_attr(session, attr_model, trial_id, OUTCOME_ATTR, "lost")
                trial.state = TrialState.FAIL
                trial.datetime_complete = datetime.datetime.now()
        except sqlalchemy.exc.IntegrityError:
            return False
        return True

    return fail


def with_heartbeat(storage: Any, trial_ids: list[int]) -> set[int] | None:
    """Which of ``trial_ids`` have a heartbeat in ``storage``; None where it cannot tell (a storage
    other than Optuna's RDB storage, or one whose tables this code does not know).

    A trial that never recorded a heartbeat (asked by a client that records none, such as a plain
    ``study.ask()``) is never failed as stale, however long its client is gone. Optuna has no call
    that tells such a trial: this reads its RDB storage's heartbeat table.
    """
    backend = getattr(storage, "_backend", storage)
    if not isinstance(backend, optuna.storages.RDBStorage):
        return None
    if not trial_ids:
        return set()
    try:
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        table = models.TrialHeartbeatModel
        with _create_scoped_session(backend.scoped_session) as session:
            return {row[0] for row in session.query(table.trial_id).filter(table.trial_id.in_(trial_ids)).all()}
    except (ImportError, AttributeError):  # another Optuna's internals
        return None


def counts(trial: FrozenTrial) -> bool:
    """Whether ``trial`` counts toward a sweep's ``n_trials`` (module docstring)."""
    if trial.state in _LIVE:
        return True
    return trial.state == TrialState.FAIL and bool(trial.user_attrs.get(COUNTED_ATTR, False))


def counted_trials(study: optuna.Study) -> int:
    """The number of the study's trials that count toward a sweep's ``n_trials``."""
    return sum(counts(t) for t in study.get_trials(deepcopy=False))
