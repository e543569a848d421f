"""One process owns the limits and budgets of every key; the others ask it over a unix socket.

`tokenway serve --workers N` without a Redis: N independent in-process limiters would each
admit a key's whole RPM, so the supervisor (server/workers.py) holds the one InProcessLimiter
and InProcessBudgets of the host, and every HTTP worker's Gatekeeper holds a RemoteLimiter and
a RemoteBudgets that forward each call to it. Exactness is the in-process stores' own: the
owner runs them on one event loop, so each admit and reserve is still one atomic step.

    worker: Gatekeeper ─► RemoteLimiter.admit ─► {"id", "op": "admit", "args"} \\n ─►┐
                                                                             unix socket
    supervisor: CounterServer ─► InProcessLimiter.admit ─► {"id", "result"} \\n ◄─┘

One connection per worker, requests pipelined and answered out of order by id (a budget's
first reserve of a key waits for the ledger's seed; the others do not wait behind it). An
owner that cannot be reached, or does not answer within timeout_s, is LimitsUnavailable, so
the worker follows --limits-on-error as it would for a Redis that is down; SeedUnavailable
crosses as itself.

A settlement (reconcile, settle) only records what a call used: it decides nothing, so it
goes without an id and the owner answers none (CounterClient.send). It is written on the
same connection as the worker's admissions, so the owner runs it before any admission the
worker asks after it, as when it was awaited; closing the client waits until what it wrote
has left, so a worker that drains and exits loses none.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenway.gateway.budgets import (
    BudgetDecision,
    BudgetReservation,
    BudgetState,
    BudgetStore,
    SeedUnavailable,
)
from tokenway.gateway.limits import Decision, Limiter, LimitSpec, LimitsUnavailable, Reservation

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
_LIMIT = 2**20  # a line's bound: a decision's headers are a few hundred bytes


def _spec(fields: dict | None) -> LimitSpec | None:
    return LimitSpec(**fields) if fields is not None else None


class CounterServer:
    """Serves one Limiter and one BudgetStore (the in-process ones) on a unix socket."""

    def __init__(self, limiter: Limiter, budgets: BudgetStore, *,
                 also_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.limiter, self.budgets, self.also_close = limiter, budgets, also_close
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # the workers' connections

    async def start(self, path: str | Path) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path, limit=_LIMIT)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()  # a worker hears at once that its owner is gone
        for task in list(self._tasks):
            task.cancel()
        await self.limiter.close()
        await self.budgets.close()
        if self.also_close is not None:
            await self.also_close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while line := await reader.readline():
                task = asyncio.create_task(self._answer(json.loads(line), writer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            logger.warning("counters: a worker's connection ended: %r", exc)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, request: dict, writer: asyncio.StreamWriter) -> None:
        if "id" not in request:  # a settlement: nobody waits for its answer
            try:
                await self._run(request["op"], request["args"])
            except Exception:
                logger.exception("counters: %s failed", request.get("op"))
            return
        try:
            reply: dict[str, Any] = {"id": request["id"], "result": await self._run(request["op"], request["args"])}
        except SeedUnavailable as exc:
            reply = {"id": request["id"], "error": "seed_unavailable", "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the worker hears of it as the store being unable to answer
            logger.exception("counters: %s failed", request.get("op"))
            reply = {"id": request["id"], "error": "unavailable", "message": f"{type(exc).__name__}: {exc}"}
        if not writer.is_closing():
            writer.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")

    async def _run(self, op: str, args: list) -> Any:
        if op == "admit":
            key_id, spec, reserve_tokens, share = args
            decision = await self.limiter.admit(key_id, LimitSpec(**spec), reserve_tokens, _spec(share))
            return asdict(decision)
        if op == "reconcile":
            await self.limiter.reconcile(Reservation(**args[0]), args[1])
            return None
        if op == "headers":
            return await self.limiter.headers(args[0], LimitSpec(**args[1]))
        if op == "reserve":
            return asdict(await self.budgets.reserve(*args))
        if op == "settle":
            await self.budgets.settle(BudgetReservation(**args[0]), args[1])
            return None
        if op == "state":
            state = await self.budgets.state(*args)
            return asdict(state) if state is not None else None
        raise ValueError(f"unknown operation {op!r}")


class CounterClient:
    """A worker's one connection to the CounterServer, opened on first use and again after it drops."""

    def __init__(self, path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path, self.timeout_s = str(path), timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None
        self._id_to_reply: dict[int, asyncio.Future[dict]] = {}
        self._ids = itertools.count()

    async def call(self, op: str, args: list) -> Any:
        request_id = next(self._ids)
        reply: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._id_to_reply[request_id] = reply
        try:
            async with asyncio.timeout(self.timeout_s):
                writer = await self._connection()
                writer.write(json.dumps({"id": request_id, "op": op, "args": args}, separators=(",", ":")).encode()
                             + b"\n")
                answer = await reply
        except (OSError, TimeoutError) as exc:
            raise LimitsUnavailable(f"the counters' owner at {self.path} cannot answer: {exc!r}") from None
        finally:
            self._id_to_reply.pop(request_id, None)
        if "error" in answer:
            if answer["error"] == "seed_unavailable":
                raise SeedUnavailable(answer["message"])
            raise LimitsUnavailable(f"the counters' owner failed: {answer['message']}")
        return answer["result"]

    async def send(self, op: str, args: list) -> None:
        """Write a request whose answer nobody needs (a settlement), in order with the others;
        LimitsUnavailable if the owner cannot be reached (the caller keeps it for replay)."""
        writer = self._writer
        if writer is None or writer.is_closing():
            try:
                async with asyncio.timeout(self.timeout_s):
                    writer = await self._connection()
            except (OSError, TimeoutError) as exc:
                raise LimitsUnavailable(f"the counters' owner at {self.path} cannot answer: {exc!r}") from None
        writer.write(json.dumps({"op": op, "args": args}, separators=(",", ":")).encode() + b"\n")

    async def _connection(self) -> asyncio.StreamWriter:
        if self._writer is not None and not self._writer.is_closing():
            return self._writer
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                reader, self._writer = await asyncio.open_unix_connection(self.path, limit=_LIMIT)
                self._reading = asyncio.create_task(self._read(reader))
        assert self._writer is not None
        return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: Exception = ConnectionResetError("the counters' owner closed the connection")
        try:
            while line := await reader.readline():
                answer = json.loads(line)
                reply = self._id_to_reply.get(answer["id"])
                if reply is not None and not reply.done():
                    reply.set_result(answer)
        except (OSError, ValueError) as exc:
            error = exc if isinstance(exc, OSError) else ConnectionResetError(str(exc))
        if self._writer is not None:
            self._writer.close()
        for reply in self._id_to_reply.values():  # asked on this connection, never answered
            if not reply.done():
                reply.set_exception(error)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()  # what send() wrote has left for the owner
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading


class RemoteLimiter:
    """limits.Limiter over a CounterClient."""

    def __init__(self, client: CounterClient) -> None:
        self.client = client

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                    share: LimitSpec | None = None) -> Decision:
        fields = await self.client.call("admit", [key_id, asdict(spec), reserve_tokens,
                                                  asdict(share) if share is not None else None])
        reservation = fields.pop("reservation")
        return Decision(reservation=Reservation(**reservation) if reservation is not None else None, **fields)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        await self.client.send("reconcile", [asdict(reservation), used_tokens])

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        return await self.client.call("headers", [key_id, asdict(spec)])

    async def close(self) -> None:
        await self.client.close()


class RemoteBudgets:
    """budgets.BudgetStore over the same CounterClient as the worker's RemoteLimiter."""

    def __init__(self, client: CounterClient) -> None:
        self.client = client

    async def reserve(self, key_id: str, budget_nanos: int, worst_nanos: int,
                      share_nanos: int | None = None) -> BudgetDecision:
        fields = await self.client.call("reserve", [key_id, budget_nanos, worst_nanos, share_nanos])
        reservation = fields.pop("reservation")
        return BudgetDecision(reservation=BudgetReservation(**reservation) if reservation is not None else None,
                              **fields)

    async def settle(self, reservation: BudgetReservation, used_nanos: int) -> None:
        await self.client.send("settle", [asdict(reservation), used_nanos])

    async def state(self, key_id: str, share: bool = False) -> BudgetState | None:
        fields = await self.client.call("state", [key_id, share])
        return BudgetState(**fields) if fields is not None else None

    def joint_with(self, limiter: Limiter) -> None:
        return None  # two calls to one owner: each atomic there, as the in-process pair is

    async def close(self) -> None:
        await self.client.close()
