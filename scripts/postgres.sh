#!/usr/bin/env bash
# A throwaway PostgreSQL for tests and benchmarks: one cluster under .cache/postgres, listening
# on 127.0.0.1 only, trust auth (loopback, disposable data), database "tokenway".
#
#   scripts/postgres.sh start   # install Debian's postgresql if missing, init, start; prints the DSN
#   scripts/postgres.sh url     # prints the DSN
#   scripts/postgres.sh stop
#
# Idempotent. Port: $TOKENWAY_PG_PORT (default 5440); directory: $TOKENWAY_PG_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${TOKENWAY_PG_PORT:-5440}
DIR=$(realpath -m "${TOKENWAY_PG_DIR:-.cache/postgres}")
DATA=$DIR/data
DB=tokenway

find_bindir() {
    if command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1; then
        dirname "$(readlink -f "$(command -v pg_ctl)")"
        return
    fi
    # Debian keeps the server binaries off PATH, one directory per major version.
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

# postgres refuses to run as root: as root, run the server as the postgres user (from /, a
# directory it can always enter).
as_owner() {
    if [ "$(id -u)" -eq 0 ]; then (cd / && runuser -u postgres -- "$@"); else "$@"; fi
}

# The port of the running server (it may have been started with another $TOKENWAY_PG_PORT).
running_port() {
    [ -f "$DATA/postmaster.pid" ] && sed -n 4p "$DATA/postmaster.pid" || echo "$PORT"
}

dsn() {
    echo "postgresql://postgres@127.0.0.1:$(running_port)/$DB"
}

start() {
    BIN=$(find_bindir)
    if [ -z "$BIN" ]; then
        [ "$(id -u)" -eq 0 ] || { echo "postgresql is not installed; run as root to install it" >&2; exit 1; }
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
        BIN=$(find_bindir)
    fi
    mkdir -p "$DIR"
    if [ "$(id -u)" -eq 0 ]; then
        chown postgres: "$DIR"
        # The server must reach $DIR: give "others" traverse (x) on each parent that lacks it.
        p=$DIR
        while [ "$p" != / ]; do
            p=$(dirname "$p")
            case "$(stat -c %A "$p")" in *x|*t) ;; *) chmod o+x "$p" ;; esac
        done
    fi
    if [ ! -f "$DATA/PG_VERSION" ]; then
        as_owner "$BIN/initdb" -D "$DATA" --username=postgres --auth=trust --encoding=UTF8 --locale=C >"$DIR/initdb.log"
    fi
    if ! as_owner "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
        # No unix socket: everything, including this script, connects over 127.0.0.1.
        as_owner "$BIN/pg_ctl" -D "$DATA" -l "$DIR/server.log" -w -t 60 start \
            -o "-c listen_addresses=127.0.0.1 -c port=$PORT -c unix_socket_directories=''" >/dev/null
    fi
    local port
    port=$(running_port)
    if [ -z "$("$BIN/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = '$DB'")" ]; then
        "$BIN/createdb" -h 127.0.0.1 -p "$port" -U postgres "$DB"
    fi
    dsn
}

stop() {
    BIN=$(find_bindir)
    if [ -n "$BIN" ] && [ -f "$DATA/PG_VERSION" ] && as_owner "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
        as_owner "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    url) dsn ;;
    *) echo "usage: $0 start|stop|url" >&2; exit 2 ;;
esac
