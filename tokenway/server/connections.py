"""What one HTTP server lets a connection hold before it has sent a request: the read
timeouts, the head's size, and how many connections there may be, per client address and in
all (server/uvicorn_server.py's protocol applies them).

    accept ─► opening ──head complete──► active (body, then the app's answer) ──answer sent──► idle
              header timeout, head cap     body timeout: the whole body          keep-alive timeout
                                                    ▲                                   │
                                                    └────────── next head complete ─────┘

A connection waiting for a request head (opening, or idle between requests) costs whoever
holds it nothing, so refusing new connections at a cap would let the fastest opener lock
everyone else out. At a cap the table closes the connection that has waited longest instead
(ConnectionTable says in which order): a flood of half-open connections only ever displaces
itself, while a client whose request follows its connect (a health check, an SDK) is read long
before it becomes the oldest. Only when every connection is active is a new one refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# Left to the rest of the process below RLIMIT_NOFILE: the engine's pipes, the ledger and key
# databases, upstream and Redis sockets, the body parser workers, log files.
MIN_SPARE_FDS = 512
MAX_DEFAULT_CONNECTIONS = 65536  # a bound on memory too, not only on file descriptors
WARN_EVERY_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class ConnectionPolicy:
    """Seconds and counts. The header timeout runs from accept (and its TLS handshake) to the
    end of the first request's head, and from the first byte of each later request to the end
    of its head; the body timeout bounds the whole body from the end of its head, not counting
    time the server itself stops reading (its buffer is full, a pipelined request waits, or an
    `Expect: 100-continue` client waits to be asked); keep-alive is the idle time allowed
    between a response and the next request. None for a cap: derived from RLIMIT_NOFILE
    (resolved()); max_connections_per_client defaults to a quarter of max_connections.
    Under TLS a connection's header timeout is also its handshake's."""

    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 60.0
    # Above the clients' own pool expiry (httpx and the openai SDK 5 s, aiohttp 15 s): a server
    # closing first races the client reusing the connection.
    keep_alive_timeout_seconds: float = 20.0
    max_connections: int | None = None
    max_connections_per_client: int | None = None
    # Opening at once (no head yet), beyond which the oldest opening one is closed even below
    # the caps: each is 6 objects every full garbage collection walks. Flooded to 18,000 the
    # server's collections took 60-100 ms; capped at 4,096, none took over 5 ms. Legitimate
    # connections send their head as they connect and are read long before 4,096 newer ones.
    max_opening_connections: int = 4096
    # A head is parsed as it arrives and llhttp's callers (httptools, uvicorn) append its pieces
    # with bytes +=: unbounded, an endless header is quadratic time and unbounded memory.
    max_head_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_seconds", "body_timeout_seconds", "keep_alive_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("max_connections", "max_connections_per_client", "max_opening_connections",
                     "max_head_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ConnectionPolicy:
        """From `tokenway serve` / `tokenway worker` options named as the fields; None keeps the default."""
        return cls(**{field.name: options[field.name] for field in dataclasses.fields(cls)
                      if options.get(field.name) is not None})

    def resolved(self, num_fds: int) -> ConnectionPolicy:
        """The caps set, checked against the process's file-descriptor limit `num_fds`."""
        max_connections = self.max_connections or default_max_connections(num_fds)
        if max_connections > num_fds - min(MIN_SPARE_FDS, num_fds // 2):
            raise ValueError(f"max_connections: {max_connections} leaves the process too few of its {num_fds} "
                             f"file descriptors (RLIMIT_NOFILE); raise `ulimit -n` or lower max_connections")
        per_client = min(self.max_connections_per_client or max(1, max_connections // 4), max_connections)
        return dataclasses.replace(self, max_connections=max_connections, max_connections_per_client=per_client,
                                   max_opening_connections=min(self.max_opening_connections, max_connections))


def add_arguments(parser) -> None:
    """The policy's flags, for every command that runs a server (`tokenway serve`, `worker`);
    None when not given, so that the config file and ConnectionPolicy's defaults apply."""
    parser.add_argument("--header-timeout-seconds", type=float,
                        help="accept (TLS handshake included) to the end of a request's head, and a later "
                             "request's first byte to the end of its head; slower: closed (default 10)")
    parser.add_argument("--body-timeout-seconds", type=float,
                        help="the end of a request's head to the end of its whole body, not counting time the "
                             "server itself stops reading; slower: closed (default 60)")
    parser.add_argument("--keep-alive-timeout-seconds", type=float,
                        help="idle time allowed between a response and the next request (default 20)")
    parser.add_argument("--max-connections", type=int,
                        help="open at once; at the cap the connection waiting longest for a request head is "
                             "closed (default: 90%% of RLIMIT_NOFILE, raised to its hard limit at start)")
    parser.add_argument("--max-connections-per-client", type=int,
                        help="open at once from one client address, as --max-connections (default: a quarter of "
                             "it; behind a proxy every client is the proxy's address: raise it)")


def raise_fd_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard one (the soft default, often 1024, is a
    historical select() limit, not a resource bound); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 2**20


def default_max_connections(num_fds: int) -> int:
    """A tenth of the descriptors (at least MIN_SPARE_FDS, at most half) stay with the rest of
    the process: 20,000 -> 18,000; 1,024 -> 512."""
    spare = min(max(MIN_SPARE_FDS, num_fds // 10), num_fds // 2)
    return max(1, min(num_fds - spare, MAX_DEFAULT_CONNECTIONS))


class Evictable(Protocol):
    def evict(self) -> None:
        """Close at once: the table has already forgotten this connection."""


class ConnectionTable:
    """Every open connection of one server, counted by client address. Those waiting for a
    request head are kept in the order they began waiting: `opening` ones (no head completed
    yet; with the time each was accepted) and `idle` ones (between requests), globally, and
    both together per address. At a cap the oldest opening connection goes first (it has not
    shown it is a client at all), then the oldest idle one; at an address's cap, that
    address's oldest waiting one. Opening ones past the header timeout are closed by
    close_expired() from the front of their queue, so none needs a timer of its own. Owned by
    one server and used from its event loop only."""

    def __init__(self, max_connections: int, max_connections_per_client: int,
                 max_opening_connections: int | None = None) -> None:
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.max_opening_connections = max_opening_connections or max_connections
        self.num_evicted = 0  # waiting connections closed to make room
        self.num_refused = 0  # new connections turned away: every one over the cap was active
        self.num_expired = 0  # opening connections closed at the header timeout
        self._connection_to_client: dict[Evictable, str] = {}
        self._client_to_num_connections: dict[str, int] = {}
        self._opening: OrderedDict[Evictable, float] = OrderedDict()  # -> when accepted
        self._idle: OrderedDict[Evictable, None] = OrderedDict()
        self._client_to_waiting: dict[str, OrderedDict[Evictable, None]] = {}
        self._warned_at = -WARN_EVERY_SECONDS

    @property
    def num_connections(self) -> int:
        return len(self._connection_to_client)

    @property
    def num_waiting(self) -> int:
        return len(self._opening) + len(self._idle)

    def num_connections_of(self, client: str) -> int:
        return self._client_to_num_connections.get(client, 0)

    def admit(self, connection: Evictable, client: str, now: float) -> bool:
        """Counts a connection accepted from `client` at `now` as opening, first closing the
        oldest waiting connection of that client, or of all, where a cap would be passed.
        False: refused (every connection over the cap is active); the caller closes it."""
        if (self.num_connections_of(client) >= self.max_connections_per_client
                and not self._evict_oldest(self._client_to_waiting.get(client))):
            return self._refuse()
        if len(self._connection_to_client) >= self.max_connections and not self._evict_oldest(
                self._opening or self._idle):
            return self._refuse()
        if len(self._opening) >= self.max_opening_connections:
            self._evict_oldest(self._opening)
        self._connection_to_client[connection] = client
        self._client_to_num_connections[client] = self.num_connections_of(client) + 1
        self._opening[connection] = now
        self._client_to_waiting.setdefault(client, OrderedDict())[connection] = None
        return True

    def mark_active(self, connection: Evictable) -> None:
        """Its request head is complete: not evictable until it is idle again."""
        if connection in self._opening:
            del self._opening[connection]
        elif connection in self._idle:
            del self._idle[connection]
        else:
            return
        client = self._connection_to_client[connection]
        queue = self._client_to_waiting[client]
        del queue[connection]
        if not queue:
            del self._client_to_waiting[client]

    def mark_idle(self, connection: Evictable) -> None:
        """Answered, waiting for its next request; one already waiting keeps its place."""
        client = self._connection_to_client.get(connection)
        if client is None or connection in self._opening or connection in self._idle:
            return
        self._idle[connection] = None
        self._client_to_waiting.setdefault(client, OrderedDict())[connection] = None

    def remove(self, connection: Evictable) -> None:
        """The connection closed (a second call is a no-op)."""
        self.mark_active(connection)
        client = self._connection_to_client.pop(connection, None)
        if client is None:
            return
        num_left = self._client_to_num_connections.pop(client) - 1
        if num_left:
            self._client_to_num_connections[client] = num_left

    def close_expired(self, accepted_before: float) -> int:
        """Closes the opening connections accepted before `accepted_before`; how many."""
        num_closed = 0
        while self._opening:
            connection, accepted_at = next(iter(self._opening.items()))
            if accepted_at >= accepted_before:
                break
            self.remove(connection)
            connection.evict()
            num_closed += 1
        self.num_expired += num_closed
        return num_closed

    def _evict_oldest(self, queue: OrderedDict[Evictable, Any] | None) -> bool:
        if not queue:
            return False
        victim = next(iter(queue))
        self.remove(victim)
        self.num_evicted += 1
        victim.evict()
        self._warn()
        return True

    def _refuse(self) -> bool:
        self.num_refused += 1
        self._warn()
        return False

    def _warn(self) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_SECONDS:
            self._warned_at = now
            logger.warning("tokenway: connections at the cap (%d open: at most %d, %d per client address, %d "
                           "without a request head yet): %d waiting ones closed to make room and %d new ones "
                           "refused so far", self.num_connections, self.max_connections,
                           self.max_connections_per_client, self.max_opening_connections, self.num_evicted,
                           self.num_refused)


# The scope key of a request's Disconnection, where the server that read it keeps one
# (server/uvicorn_server.py's protocol); an ASGI server without one leaves it out.
DISCONNECTION = "tokenway.disconnection"


class Disconnection:
    """A request's connection, as a handler watches it without a task of its own: `watch`
    runs a callback once the connection is lost before the response is complete (soon, if it
    already was). The protocol `fire`s it from connection_lost; an ASGI app otherwise learns
    of it only by a receive() that returns http.disconnect, which takes a task waiting on it."""

    __slots__ = ("_callbacks", "lost")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.lost = False

    def watch(self, callback: Callable[[], None]) -> None:
        if self.lost:
            asyncio.get_running_loop().call_soon(callback)
        else:
            self._callbacks.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def fire(self) -> None:
        if self.lost:
            return
        self.lost = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
