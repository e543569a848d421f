#!/usr/bin/env bash
# A throwaway Redis for tests and benchmarks: loopback only, no persistence.
#   scripts/redis.sh start   install redis-server if missing, start it (if not running), print its URL
#   scripts/redis.sh url     print the URL of the running server (exit 1 when none is running)
#   scripts/redis.sh stop    stop it (exit 0 when none is running)
# Port: TOKENWAY_REDIS_PORT if set, else 6390, else the next free one. State lives in
# $TOKENWAY_REDIS_DIR (default .cache/redis): one server a directory.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${TOKENWAY_REDIS_DIR:-.cache/redis}")
PIDFILE="$DIR/redis.pid"
PORTFILE="$DIR/port"

running_port() {  # the port of our server when it is alive and answers, else nothing
    [ -f "$PIDFILE" ] && [ -f "$PORTFILE" ] || return 1
    kill -0 "$(cat "$PIDFILE")" 2>/dev/null || return 1
    local port
    port=$(cat "$PORTFILE")
    [ "$(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null)" = "PONG" ] || return 1
    echo "$port"
}

port_is_free() {
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

install() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet: update only when the install needs it.
    $sudo apt-get install -y -qq redis-server >/dev/null 2>&1 \
        || { $sudo apt-get update -qq && $sudo apt-get install -y -qq redis-server >/dev/null; }
}

start() {
    if port=$(running_port); then
        echo "redis://127.0.0.1:$port/0"
        return 0
    fi
    install
    mkdir -p "$DIR"
    if [ -n "${TOKENWAY_REDIS_PORT:-}" ]; then
        port=$TOKENWAY_REDIS_PORT
    else
        port=6390
        while ! port_is_free "$port"; do
            port=$((port + 1))
            [ "$port" -lt 6490 ] || { echo "redis.sh: no free port in 6390..6489" >&2; exit 1; }
        done
    fi
    rm -f "$PIDFILE"
    echo "$port" >"$PORTFILE"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --daemonize yes --pidfile "$PIDFILE" --dir "$DIR" --logfile "$DIR/redis.log" >/dev/null
    for _ in $(seq 100); do
        if running_port >/dev/null; then
            echo "redis://127.0.0.1:$port/0"
            return 0
        fi
        sleep 0.1
    done
    echo "redis.sh: redis-server did not answer PING on port $port; see $DIR/redis.log" >&2
    exit 1
}

stop() {
    [ -f "$PIDFILE" ] || return 0
    local pid
    pid=$(cat "$PIDFILE")
    # Only a redis-server: a stale pidfile may name a pid the system has reused since.
    if kill -0 "$pid" 2>/dev/null && grep -q redis-server "/proc/$pid/cmdline" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
    fi
    rm -f "$PIDFILE"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    url)
        port=$(running_port) || exit 1
        echo "redis://127.0.0.1:$port/0"
        ;;
    *)
        echo "usage: $0 start|stop|url" >&2
        exit 2
        ;;
esac
