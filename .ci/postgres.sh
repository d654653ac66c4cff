#!/usr/bin/env bash
# A throwaway local PostgreSQL server for the test suite (the PostgreSQL tests:
# tests/_postgres.py, tests/test_postgres_server.py and the sweep runner's).
#
# Sourced by .ci/run, which calls hfkern_pg_start before the tests and
# hfkern_pg_stop from its EXIT trap:
#
#   source .ci/postgres.sh
#   trap hfkern_pg_stop EXIT
#   hfkern_pg_start
#
# or run by hand, outside CI:
#
#   eval "$(.ci/postgres.sh start)"     # exports the variables below
#   .venv/bin/python -m pytest -q tests/test_postgres_server.py
#   .ci/postgres.sh stop                # uses HFKERN_TEST_POSTGRES_DIR
#
# hfkern_pg_start uses the Debian postgresql package's binaries (the newest of
# /usr/lib/postgresql/*/bin, else `pg_config --bindir`). Where there are none it
# prints one line saying the PostgreSQL tests will be skipped, exports nothing
# and succeeds. Otherwise it creates a data directory under a new `mktemp -d`
# directory (owned by the `postgres` user when run as root: initdb and postgres
# refuse to run as root), starts a server on a free port of 127.0.0.1 (trust
# authentication, fsync off), creates the database hfkern_test and exports
#
#   HFKERN_TEST_POSTGRES_URL  postgresql+psycopg2://hfkern@127.0.0.1:PORT/hfkern_test
#   HFKERN_REQUIRE_POSTGRES   1: the tests then fail, not skip, without the URL
#   HFKERN_TEST_POSTGRES_DIR  the temporary directory (what hfkern_pg_stop removes)
#
# If the package is there but the server cannot be started, it prints the
# server's log and returns 1: a CI failure, not a skip.
# A URL already set in HFKERN_TEST_POSTGRES_URL (a server of your own) is used
# as it is: nothing is started.
#
# Messages go to stderr (in start mode, stdout carries only the export lines).

HFKERN_PG_USER=hfkern
HFKERN_PG_DB=hfkern_test
_hfkern_pg_skipped=""

_hfkern_pg_say() { echo "PostgreSQL: $*" >&2; }

# The directory holding initdb, pg_ctl, postgres and createdb, or nothing.
_hfkern_pg_bindir() {
    local d best="" best_v=-1 v
    for d in /usr/lib/postgresql/*/bin; do
        [[ -x $d/initdb && -x $d/pg_ctl && -x $d/postgres ]] || continue
        v=${d#/usr/lib/postgresql/}; v=${v%/bin}
        [[ $v =~ ^[0-9]+$ ]] || continue
        if (( v > best_v )); then best=$d; best_v=$v; fi
    done
    if [[ -z $best ]] && command -v pg_config >/dev/null 2>&1; then
        d=$(pg_config --bindir 2>/dev/null) || d=""
        [[ -n $d && -x $d/initdb && -x $d/pg_ctl && -x $d/postgres ]] && best=$d
    fi
    [[ -n $best ]] && echo "$best"
    return 0
}

# Runs a command as the server's owner: `postgres` when we are root, else us.
# From the data directory's parent, which that user can enter (the caller's
# working directory may be one it cannot).
_hfkern_pg_as_owner() {
    if (( EUID == 0 )); then
        if command -v runuser >/dev/null 2>&1; then
            (cd "$HFKERN_TEST_POSTGRES_DIR" && runuser -u postgres -- "$@")
        else
            local q; printf -v q '%q ' "$@"
            (cd "$HFKERN_TEST_POSTGRES_DIR" && su postgres -s /bin/sh -c "$q")
        fi
    else
        (cd "$HFKERN_TEST_POSTGRES_DIR" && "$@")
    fi
}

_hfkern_pg_free_port() {
    local py
    for py in python3 python; do
        if command -v "$py" >/dev/null 2>&1; then
            "$py" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()'
            return
        fi
    done
    return 1
}

hfkern_pg_start() {
    local base bindir dir port version attempt started=""
    if [[ -n ${HFKERN_TEST_POSTGRES_URL:-} ]]; then
        _hfkern_pg_say "using HFKERN_TEST_POSTGRES_URL from the environment; no server started"
        export HFKERN_REQUIRE_POSTGRES=1
        return 0
    fi
    bindir=$(_hfkern_pg_bindir)
    if [[ -z $bindir ]]; then
        _hfkern_pg_skipped=1
        _hfkern_pg_say "package not installed (no /usr/lib/postgresql/*/bin, no pg_config);" \
            "the PostgreSQL sweep tests will be skipped"
        return 0
    fi
    if (( EUID == 0 )) && ! id postgres >/dev/null 2>&1; then
        _hfkern_pg_say "running as root but there is no 'postgres' user to run the server as" \
            "(initdb and postgres refuse to run as root)"
        return 1
    fi
    # The server's Unix socket path (DIR/sock/.s.PGSQL.PORT) must fit in 107 bytes.
    base=${TMPDIR:-/tmp}
    (( ${#base} <= 60 )) || base=/tmp
    dir=$(mktemp -d "$base/hfkern-pg.XXXXXXXX") || return 1
    export HFKERN_TEST_POSTGRES_DIR=$dir
    _HFKERN_PG_BINDIR=$bindir
    mkdir "$dir/sock"
    if (( EUID == 0 )); then
        chown -R postgres: "$dir"
        if ! runuser -u postgres -- test -w "$dir" 2>/dev/null; then
            _hfkern_pg_say "the postgres user cannot write to $dir (set TMPDIR to a directory it can reach)"
            hfkern_pg_stop; return 1
        fi
    fi
    if ! _hfkern_pg_as_owner "$bindir/initdb" -D "$dir/data" -U "$HFKERN_PG_USER" -A trust \
            --no-sync --no-locale -E UTF8 >"$dir/initdb.log" 2>&1; then
        _hfkern_pg_say "initdb failed:"
        cat "$dir/initdb.log" >&2
        hfkern_pg_stop; return 1
    fi
    # The port is free when chosen but could be taken before the server binds it:
    # try again with another one if that is why the start failed.
    for attempt in 1 2 3; do
        rm -f "$dir/server.log"
        port=$(_hfkern_pg_free_port) || { _hfkern_pg_say "no python3 to pick a free port"; hfkern_pg_stop; return 1; }
        if _hfkern_pg_as_owner "$bindir/pg_ctl" start -w -t 60 -D "$dir/data" -l "$dir/server.log" \
                -o "-c listen_addresses=127.0.0.1 -p $port -k '$dir/sock' -c fsync=off -c full_page_writes=off" \
                >"$dir/pg_ctl.log" 2>&1; then
            started=1; break
        fi
        grep -qi "could not bind\|address already in use" "$dir/server.log" 2>/dev/null || break
        _hfkern_pg_say "port $port was taken; trying another"
    done
    if [[ -z $started ]]; then
        _hfkern_pg_say "the server did not start (pg_ctl, then the server log):"
        cat "$dir/pg_ctl.log" "$dir/server.log" >&2 2>/dev/null || true
        hfkern_pg_stop; return 1
    fi
    if ! "$bindir/createdb" -h 127.0.0.1 -p "$port" -U "$HFKERN_PG_USER" "$HFKERN_PG_DB" >"$dir/createdb.log" 2>&1; then
        _hfkern_pg_say "createdb failed (createdb, then the server log):"
        cat "$dir/createdb.log" "$dir/server.log" >&2 2>/dev/null || true
        hfkern_pg_stop; return 1
    fi
    version=$("$bindir/postgres" --version 2>/dev/null) || version="$bindir/postgres"
    export HFKERN_TEST_POSTGRES_URL="postgresql+psycopg2://$HFKERN_PG_USER@127.0.0.1:$port/$HFKERN_PG_DB"
    export HFKERN_REQUIRE_POSTGRES=1
    _hfkern_pg_say "server up: $version on 127.0.0.1:$port, data in $dir;" \
        "HFKERN_TEST_POSTGRES_URL=$HFKERN_TEST_POSTGRES_URL"
}

# Stops the server hfkern_pg_start started and removes its directory. Never
# fails (it runs from an EXIT trap, which must keep the tests' exit status).
hfkern_pg_stop() {
    local dir=${HFKERN_TEST_POSTGRES_DIR:-} bindir=${_HFKERN_PG_BINDIR:-} pid
    if [[ -n $_hfkern_pg_skipped ]]; then
        _hfkern_pg_say "package not installed; the PostgreSQL sweep tests were skipped"
    fi
    [[ -n $dir && -d $dir ]] || return 0
    [[ -n $bindir ]] || bindir=$(_hfkern_pg_bindir)
    if [[ -f $dir/data/postmaster.pid ]]; then
        if ! _hfkern_pg_as_owner "$bindir/pg_ctl" stop -w -t 30 -m fast -D "$dir/data" >/dev/null 2>&1; then
            pid=$(head -n 1 "$dir/data/postmaster.pid" 2>/dev/null) || pid=""
            if [[ $pid =~ ^[0-9]+$ ]]; then
                _hfkern_pg_say "pg_ctl stop failed; killing the server (pid $pid)"
                kill -QUIT "$pid" 2>/dev/null || true
                sleep 1
            fi
        fi
        _hfkern_pg_say "server stopped"
    fi
    rm -rf "$dir" || true
    unset HFKERN_TEST_POSTGRES_DIR HFKERN_TEST_POSTGRES_URL HFKERN_REQUIRE_POSTGRES
    return 0
}

# Run as a script: start prints the export lines for eval; stop tears down.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    case ${1:-} in
        start)
            hfkern_pg_start
            for v in HFKERN_TEST_POSTGRES_URL HFKERN_REQUIRE_POSTGRES HFKERN_TEST_POSTGRES_DIR; do
                [[ -n ${!v:-} ]] && printf 'export %s=%q\n' "$v" "${!v}"
            done
            exit 0
            ;;
        stop)
            hfkern_pg_stop
            ;;
        *)
            echo "usage: $0 start|stop   (start prints export lines: eval \"\$($0 start)\")" >&2
            exit 2
            ;;
    esac
fi
