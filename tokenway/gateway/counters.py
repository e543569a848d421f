"""One process owns the limits and budgets of every key; the others ask it over a unix socket.

`tokenway serve --workers N` without a Redis: N independent in-process limiters would each
admit a key's whole RPM, so the supervisor (server/workers.py) holds the one InProcessLimiter
and InProcessBudgets of the host, and every HTTP worker's Gatekeeper holds a RemoteLimiter and
a RemoteBudgets that forward each call to it. Exactness is the in-process stores' own: the
owner runs them on one event loop, so each admit and reserve is still one atomic step.

    worker: Gatekeeper ─► RemoteLimiter.admit ─► [id, "admit", args] \\n ─►┐
                                                                     unix socket
    supervisor: CounterServer ─► InProcessLimiter.admit_now ─► [id, result] \\n ◄─┘

One connection per worker, requests pipelined. The owner answers each in line as it reads it
(the in-process stores' *_now calls never wait), and everything one read brought is answered
in one write; only a budget's first reserve of a key waits (for the ledger's seed), in a task
of its own, so answers come by id, not in order, and the others do not wait behind it. A
client's writes in one event-loop turn leave in one write too. Messages are JSON arrays, a
dataclass's fields in their declared order (no asdict: it deep-copies). An owner that cannot
be reached, or does not answer within timeout_s, is LimitsUnavailable, so the worker follows
--limits-on-error as it would for a Redis that is down; SeedUnavailable crosses as itself.

A settlement (reconcile, settle) only records what a call used: it decides nothing, so it
goes without an id and the owner answers none (CounterClient.send). It is written on the
same connection as the worker's admissions, so the owner runs it before any admission the
worker asks after it, as when it was awaited; closing the client waits until what it wrote
has left, so a worker that drains and exits loses none.
"""


from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

from tokenway.gateway.budgets import (
    BudgetDecision,
    BudgetLease,
    BudgetReservation,
    BudgetState,
    InProcessBudgets,
    SeedUnavailable,
)
from tokenway.gateway.limits import (
    Decision,
    InProcessLimiter,
    Lease,
    Limiter,
    LimitSpec,
    LimitsUnavailable,
    Reservation,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
_LIMIT = 2**20  # a line's bound: a decision's headers are a few hundred bytes
_LATER = object()  # an answer that must wait (a key's first budget reserve reads its seed)


# ---- The wire: each dataclass as the list of its fields, in declared order. ----

def _row(value: Any) -> list:
    return [getattr(value, name) for name in _field_names(type(value))]


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in fields(cls))


@functools.lru_cache(maxsize=4096)
def _spec_row(spec: LimitSpec) -> tuple:
    return tuple(_row(spec))  # a key's spec is the same value call after call: made once (a tuple: shared)


def _decision_row(decision: Decision) -> list:
    reservation = decision.reservation
    return [decision.allowed, _row(reservation) if reservation is not None else None, decision.limit_kind,
            decision.retry_after_s, decision.headers, decision.by_share]


def _decision(row: list) -> Decision:
    allowed, reservation, limit_kind, retry_after_s, headers, by_share = row
    return Decision(allowed, Reservation(*reservation) if reservation is not None else None, limit_kind,
                    retry_after_s, headers, by_share)


def _budget_row(decision: BudgetDecision) -> list:
    reservation = decision.reservation
    return [_row(reservation) if reservation is not None else None, decision.spent_nanos, decision.held_nanos,
            decision.by_share]


def _budget_decision(row: list) -> BudgetDecision:
    reservation, spent_nanos, held_nanos, by_share = row
    return BudgetDecision(BudgetReservation(*reservation) if reservation is not None else None, spent_nanos,
                          held_nanos, by_share)


def _encode(message: list) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _lines(buffer: bytearray, data: bytes) -> list[bytes]:
    """The whole lines in buffer + data; the rest stays in buffer."""
    buffer += data
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = bytes(buffer[:end]).split(b"\n")
    del buffer[:end + 1]
    return lines


# ---- The owner. ----

class CounterServer:
    """Serves one InProcessLimiter and one InProcessBudgets on a unix socket."""

    def __init__(self, limiter: InProcessLimiter, budgets: InProcessBudgets, *,
                 also_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.limiter, self.budgets, self.also_close = limiter, budgets, also_close
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._connections: set[_OwnerSide] = set()  # the workers'

    async def start(self, path: str | Path) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _OwnerSide(self), str(path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()  # a worker hears at once that its owner is gone
        for task in list(self._tasks):
            task.cancel()
        await self.limiter.close()
        await self.budgets.close()
        if self.also_close is not None:
            await self.also_close()

    def answer(self, request_id: int | None, op: str, args: list, side: _OwnerSide) -> bytes | None:
        """The reply to one request, now; None for a settlement (or one answered later, by a task)."""
        try:
            result = self._run_now(op, args)
        except Exception as exc:  # noqa: BLE001 - the worker hears of it as the store being unable to answer
            logger.exception("counters: %s failed", op)
            return None if request_id is None else _encode([request_id, "unavailable", f"{type(exc).__name__}: {exc}"])
        if result is _LATER:
            task = asyncio.create_task(self._answer_later(request_id, op, args, side))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return None
        return None if request_id is None else _encode([request_id, "ok", result])

    def _run_now(self, op: str, args: list) -> Any:
        if op == "admit":
            key_id, spec, reserve_tokens, share = args
            share_spec = LimitSpec(*share) if share is not None else None
            return _decision_row(self.limiter.admit_now(key_id, LimitSpec(*spec), reserve_tokens, share_spec))
        if op == "reconcile":
            self.limiter.reconcile_now(Reservation(*args[0]), args[1])
            return None
        if op == "headers":
            return self.limiter.headers_now(args[0], LimitSpec(*args[1]))
        if op == "lease":
            key_id, spec, want_requests, want_tokens, min_tokens = args
            lease = self.limiter.lease_now(key_id, LimitSpec(*spec), want_requests, want_tokens, min_tokens)
            return _row(lease) if lease is not None else None
        if op == "settle_lease":
            self.limiter.settle_lease_now(*args)
            return None
        if op == "reserve":
            decision = self.budgets.reserve_now(*args)
            return _LATER if decision is None else _budget_row(decision)
        if op == "settle":
            self.budgets.settle_now(BudgetReservation(*args[0]), args[1])
            return None
        if op == "state":
            state = self.budgets.state_now(*args)
            return _row(state) if state is not None else None
        if op == "budget_lease":
            budget_lease = self.budgets.lease_now(*args)
            return _row(budget_lease) if budget_lease is not None else None
        if op == "settle_budget_lease":
            self.budgets.settle_lease_now(*args)
            return None
        raise ValueError(f"unknown operation {op!r}")

    async def _answer_later(self, request_id: int | None, op: str, args: list, side: _OwnerSide) -> None:
        assert op == "reserve", "only a reserve waits"
        try:
            reply = [request_id, "ok", _budget_row(await self.budgets.reserve(*args))]
        except SeedUnavailable as exc:
            reply = [request_id, "seed_unavailable", str(exc)]
        except Exception as exc:  # noqa: BLE001 - as in answer()
            logger.exception("counters: %s failed", op)
            reply = [request_id, "unavailable", f"{type(exc).__name__}: {exc}"]
        if request_id is not None:
            side.write(_encode(reply))


class _OwnerSide(asyncio.Protocol):
    """One worker's connection, at the owner: what one read brought is answered in one write."""

    def __init__(self, server: CounterServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport's subclasses
        self.server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        replies = []
        for line in _lines(self.buffer, data):
            try:
                request_id, op, args = json.loads(line)
            except (ValueError, TypeError) as exc:
                logger.warning("counters: a worker's connection ended: %r", exc)
                self.close()
                return
            if (reply := self.server.answer(request_id, op, args, self)) is not None:
                replies.append(reply)
        if len(self.buffer) > _LIMIT:
            logger.warning("counters: a worker's line is over %d bytes", _LIMIT)
            self.close()
        elif replies:
            self.write(b"".join(replies))

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)


# ---- A worker's side. ----

class CounterClient:
    """A worker's one connection to the CounterServer, opened on first use and again after it drops."""

    def __init__(self, path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path, self.timeout_s = str(path), timeout_s
        self._side: _WorkerSide | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = itertools.count()

    async def call(self, op: str, args: list) -> Any:
        request_id = next(self._ids)
        reply: asyncio.Future[list] = asyncio.get_running_loop().create_future()
        side = None
        try:
            async with asyncio.timeout(self.timeout_s):
                side = await self._connection()
                side.id_to_reply[request_id] = reply
                side.write(_encode([request_id, op, args]))
                _, status, result = await reply
        except (OSError, TimeoutError) as exc:
            raise LimitsUnavailable(f"the counters' owner at {self.path} cannot answer: {exc!r}") from None
        finally:
            if side is not None:
                side.id_to_reply.pop(request_id, None)
        if status == "ok":
            return result
        if status == "seed_unavailable":
            raise SeedUnavailable(result)
        raise LimitsUnavailable(f"the counters' owner failed: {result}")

    async def send(self, op: str, args: list) -> None:
        """Write a request whose answer nobody needs (a settlement), in order with the others;
        LimitsUnavailable if the owner cannot be reached (the caller keeps it for replay)."""
        side = self._side
        if side is None or side.is_closing():
            try:
                async with asyncio.timeout(self.timeout_s):
                    side = await self._connection()
            except (OSError, TimeoutError) as exc:
                raise LimitsUnavailable(f"the counters' owner at {self.path} cannot answer: {exc!r}") from None
        side.write(_encode([None, op, args]))

    async def _connection(self) -> _WorkerSide:
        if self._side is not None and not self._side.is_closing():
            return self._side
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            if self._side is None or self._side.is_closing():
                loop = asyncio.get_running_loop()
                _, self._side = await loop.create_unix_connection(_WorkerSide, self.path)
        assert self._side is not None
        return self._side

    async def close(self) -> None:
        if self._side is not None:
            await self._side.close()  # what send() wrote has left for the owner


class _WorkerSide(asyncio.Protocol):
    """The connection at a worker: what one event-loop turn writes leaves in one write; answers
    are matched to their calls by id."""

    def __init__(self) -> None:
        self.id_to_reply: dict[int, asyncio.Future[list]] = {}  # the calls asked on this connection
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.pending: list[bytes] = []
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport's subclasses

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(data)

    def flush(self) -> None:
        if self.pending and not self.is_closing():
            assert self.transport is not None
            self.transport.write(b"".join(self.pending))
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        for line in _lines(self.buffer, data):
            try:
                answer = json.loads(line)
            except ValueError as exc:
                self._fail(ConnectionResetError(f"the counters' owner sent {line[:80]!r}: {exc}"))
                return
            reply = self.id_to_reply.get(answer[0])
            if reply is not None and not reply.done():
                reply.set_result(answer)
        if len(self.buffer) > _LIMIT:
            self._fail(ConnectionResetError(f"the counters' owner sent a line over {_LIMIT} bytes"))

    def _fail(self, error: Exception) -> None:
        for reply in self.id_to_reply.values():  # never to be answered
            if not reply.done():
                reply.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("the counters' owner closed the connection"))
        if not self.lost.done():
            self.lost.set_result(None)

    async def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()  # the transport writes what it holds before it closes
            with contextlib.suppress(OSError):
                await self.lost


class RemoteLimiter:
    """limits.Limiter over a CounterClient."""

    def __init__(self, client: CounterClient) -> None:
        self.client = client

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                    share: LimitSpec | None = None) -> Decision:
        row = await self.client.call("admit", [key_id, _spec_row(spec), reserve_tokens,
                                               _spec_row(share) if share is not None else None])
        return _decision(row)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        await self.client.send("reconcile", [_row(reservation), used_tokens])

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        return await self.client.call("headers", [key_id, _spec_row(spec)])

    async def lease(self, key_id: str, spec: LimitSpec, want_requests: int, want_tokens: int,
                    min_tokens: int) -> Lease | None:
        """InProcessLimiter.lease_now at the owner."""
        row = await self.client.call("lease", [key_id, _spec_row(spec), want_requests, want_tokens, min_tokens])
        return Lease(*row) if row is not None else None

    async def settle_lease(self, lease: Lease, num_requests: int, num_tokens: int) -> None:
        await self.client.send("settle_lease", [lease.key_id, lease.lease_id, num_requests, num_tokens])

    async def close(self) -> None:
        await self.client.close()


class RemoteBudgets:
    """budgets.BudgetStore over the same CounterClient as the worker's RemoteLimiter."""

    def __init__(self, client: CounterClient) -> None:
        self.client = client

    async def reserve(self, key_id: str, budget_nanos: int, worst_nanos: int,
                      share_nanos: int | None = None) -> BudgetDecision:
        return _budget_decision(await self.client.call("reserve", [key_id, budget_nanos, worst_nanos, share_nanos]))

    async def settle(self, reservation: BudgetReservation, used_nanos: int) -> None:
        await self.client.send("settle", [_row(reservation), used_nanos])

    async def state(self, key_id: str, share: bool = False) -> BudgetState | None:
        row = await self.client.call("state", [key_id, share])
        return BudgetState(*row) if row is not None else None

    async def lease(self, key_id: str, budget_nanos: int, want_nanos: int, min_nanos: int) -> BudgetLease | None:
        """InProcessBudgets.lease_now at the owner."""
        row = await self.client.call("budget_lease", [key_id, budget_nanos, want_nanos, min_nanos])
        return BudgetLease(*row) if row is not None else None

    async def settle_lease(self, lease: BudgetLease, cost_nanos: int, held_nanos: int) -> None:
        await self.client.send("settle_budget_lease", [lease.key_id, lease.reservation_id, cost_nanos, held_nanos])

    def joint_with(self, limiter: Limiter) -> None:
        return None  # two calls to one owner: each atomic there, as the in-process pair is

    async def close(self) -> None:
        await self.client.close()
