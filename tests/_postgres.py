"""The local PostgreSQL server of the PostgreSQL tests (the sweep runner's RDB storage).

``.ci/run`` starts a throwaway server from the Debian ``postgresql`` package
(``.ci/postgres.sh``) and exports its URL in ``HFKERN_TEST_POSTGRES_URL``
(``postgresql+psycopg2://hfkern@127.0.0.1:PORT/hfkern_test``, trust
authentication) and ``HFKERN_REQUIRE_POSTGRES=1``. By hand::

    eval "$(.ci/postgres.sh start)"
    .venv/bin/python -m pytest -q tests/test_postgres_server.py
    .ci/postgres.sh stop

Any server the user can create databases on will do: set the URL yourself.

- :func:`postgres_url` is that URL; without it the test is skipped, or fails
  where ``HFKERN_REQUIRE_POSTGRES=1`` (CI, where the package was found).
- :func:`fresh_database` creates a database of its own for one test and drops
  it afterwards, so that tests (and their studies) share no state.
- :func:`postgres_db` is the fixture of the two: import it into a test module
  (``from _postgres import postgres_db``) and take ``postgres_db`` as an
  argument to get a fresh database's URL.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator

import pytest

URL_ENV = "HFKERN_TEST_POSTGRES_URL"
REQUIRE_ENV = "HFKERN_REQUIRE_POSTGRES"


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def postgres_url() -> str:
    """The server's URL (SQLAlchemy form), else skip the test (fail under HFKERN_REQUIRE_POSTGRES=1)."""
    url = os.environ.get(URL_ENV, "").strip()
    if url:
        return url
    why = (f"no PostgreSQL server: {URL_ENV} is not set (.ci/run starts one from the Debian "
           f"postgresql package; by hand: eval \"$(.ci/postgres.sh start)\", later .ci/postgres.sh stop)")
    if _required():
        pytest.fail(f"{why}, but {REQUIRE_ENV}=1", pytrace=False)
    pytest.skip(why)


def _sqlalchemy():
    if _required():
        import sqlalchemy
        return sqlalchemy
    return pytest.importorskip("sqlalchemy", reason="sqlalchemy is not installed (the test extra)")


@contextlib.contextmanager
def fresh_database(url: str | None = None, prefix: str = "hfkern_t") -> Iterator[str]:
    """Create a uniquely named database on ``url``'s server (default :func:`postgres_url`)
    and yield its URL; drop it afterwards, closing any connections still open to it."""
    sa = _sqlalchemy()
    base = sa.engine.make_url(url or postgres_url())
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:12]}".lower()
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            yield base.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                # FORCE (PostgreSQL 13+) ends the connections that pools of the
                # test or its subprocesses still hold, which would block the drop.
                force = " WITH (FORCE)" if conn.dialect.server_version_info >= (13,) else ""
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"{force}'))
    finally:
        admin.dispose()


@pytest.fixture
def postgres_db() -> Iterator[str]:
    """The URL of a database of this test's own on the test server (see :func:`fresh_database`)."""
    with fresh_database() as url:
        yield url
