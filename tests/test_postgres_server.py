"""The test PostgreSQL server (.ci/postgres.sh, tests/_postgres.py) works for what
the sweep runner needs: SQLAlchemy through psycopg2, and Optuna's RDB storage,
from this process and from others at once.

Skipped without HFKERN_TEST_POSTGRES_URL; failed instead under HFKERN_REQUIRE_POSTGRES=1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from _postgres import REQUIRE_ENV, fresh_database, postgres_db, postgres_url  # noqa: F401 (fixtures)


def _import(name: str):
    if os.environ.get(REQUIRE_ENV) == "1":
        return __import__(name)
    return pytest.importorskip(name, reason=f"{name} is not installed (the test extra)")


def test_sqlalchemy_round_trip(postgres_db):  # noqa: F811 (the fixture)
    sa = _import("sqlalchemy")
    engine = sa.create_engine(postgres_db)
    try:
        meta = sa.MetaData()
        t = sa.Table("runs", meta,
                     sa.Column("id", sa.Integer, primary_key=True),
                     sa.Column("name", sa.String(64), nullable=False),
                     sa.Column("loss", sa.Float))
        meta.create_all(engine)
        with engine.begin() as conn:
            conn.execute(t.insert(), [{"name": "a", "loss": 0.5}, {"name": "b", "loss": 0.25}])
        with engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.name, t.c.loss).order_by(t.c.name)).all()
            assert [tuple(r) for r in rows] == [("a", 0.5), ("b", 0.25)]
            assert conn.execute(sa.text("SELECT current_database()")).scalar() == sa.engine.make_url(postgres_db).database
    finally:
        engine.dispose()


def test_fresh_databases_are_separate_and_dropped():
    sa = _import("sqlalchemy")
    server = sa.create_engine(postgres_url(), poolclass=sa.pool.NullPool)

    def databases() -> set[str]:
        with server.connect() as conn:
            return set(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())

    try:
        with fresh_database() as a, fresh_database() as b:
            na, nb = (sa.engine.make_url(u).database for u in (a, b))
            assert na != nb and {na, nb} <= databases()
            # A connection left open (as a pool would) must not block the drop.
            leaked = sa.create_engine(a).connect()
            leaked.execute(sa.text("SELECT 1"))
        assert not ({na, nb} & databases())
    finally:
        server.dispose()


def test_optuna_study_ask_tell_delete(postgres_db):  # noqa: F811 (the fixture)
    optuna = _import("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = f"study-{uuid.uuid4().hex}"
    study = optuna.create_study(storage=postgres_db, study_name=name, direction="minimize")
    trial = study.ask()
    x = trial.suggest_float("x", -1.0, 1.0)
    study.tell(trial, x * x)

    # A second storage object sees it, as a second runner process would.
    again = optuna.load_study(study_name=name, storage=postgres_db)
    (done,) = again.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert done.params == {"x": x} and done.value == pytest.approx(x * x)
    assert name in optuna.get_all_study_names(storage=postgres_db)

    optuna.delete_study(study_name=name, storage=postgres_db)
    assert name not in optuna.get_all_study_names(storage=postgres_db)


_WORKER = textwrap.dedent("""
    import sys, optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    study = optuna.create_study(storage=url, study_name=name, load_if_exists=True)
    study.optimize(lambda t: (t.suggest_float("x", -2.0, 2.0) - 1.0) ** 2, n_trials=n)
""")


def test_two_processes_share_a_study(postgres_db):  # noqa: F811 (the fixture)
    optuna = _import("optuna")
    _import("psycopg2")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = f"shared-{uuid.uuid4().hex}"
    n = 4
    # Optuna's tables and the study are created here, before the workers start:
    # processes that create the tables of an empty database at the same time race
    # (CREATE TYPE studydirection: duplicate key; optuna/optuna#1092). The
    # workers' create_study(load_if_exists=True) then loads the study.
    optuna.create_study(storage=postgres_db, study_name=name)
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, postgres_db, name, str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out

    study = optuna.load_study(study_name=name, storage=postgres_db)
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 2 * n
    assert sorted(t.number for t in trials) == list(range(2 * n))
    optuna.delete_study(study_name=name, storage=postgres_db)
