"""Request bodies parsed off the event loop once they are large.

json.loads and pydantic hold the GIL for the whole call: 7 MB of token ids take ~240 ms, so
a thread would not help (the loop waits for the GIL just the same). Bodies up to
`inline_bytes` (≤ ~2 ms of parsing) are parsed where they arrive; larger ones are streamed,
chunk by chunk as they arrive, into a worker process (so the loop never copies a whole large
body), whose answer comes back as the already-checked request model (schema caps bound what
that model can hold, so unpickling it is quick).

A worker is `python -m tokenway.server.body_parser`, talking over its stdin and stdout:

    server -> worker   frame(pickle(request model class, or a reader)), frame(chunk)..., frame(b"")
                       (or, where the body stops coming: the client left, it grew too large,
                       an ABORT header instead of the last frame: the worker drops the body)
    worker -> server   frame(pickle((True, model) | (False, (message, param, code))))
    frame(data) = length of data (8 bytes, big-endian) + data

A reader (parse_with) is a module-level function, pickled by name: bytes -> the value the route
needs (a large batch's lines packed, rather than 100,000 checked models to unpickle on the loop),
raising InvalidRequestError for a bad body.

One body at a time per worker. Plain subprocesses rather than multiprocessing: spawn and
forkserver both import the program's __main__ again in the child, which in a script that
starts a server without a `__main__` guard starts a second server. A worker that dies costs
the body it was parsing a 503 and is replaced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, TypeVar

import pydantic

from tokenway.protocol.body import decode_json_body
from tokenway.protocol.errors import InvalidRequestError, ServiceUnavailableError

T = TypeVar("T", bound=pydantic.BaseModel)
R = TypeVar("R")
logger = logging.getLogger(__name__)

INLINE_BODY_BYTES = 64 * 1024
_LENGTH = struct.Struct(">Q")
_ABORT = 2**64 - 1  # in place of a frame's length: the rest of this body is not coming


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None and process.stdout is not None, "started with both pipes"
        self.process = process
        self.stdin, self.stdout = process.stdin, process.stdout

    @classmethod
    async def start(cls) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        return cls(process)

    async def parse(self, chunks: AsyncIterable[bytes], model: type) -> tuple[bool, Any]:
        stdin = self.stdin
        self._frame(pickle.dumps(model))
        try:
            async for chunk in chunks:
                if chunk:
                    self._frame(chunk)
                    await stdin.drain()  # the worker reads as the client sends: no body piles up here
        except BaseException:
            stdin.write(_LENGTH.pack(_ABORT))
            raise
        self._frame(b"")
        await stdin.drain()
        (length,) = _LENGTH.unpack(await self.stdout.readexactly(_LENGTH.size))
        return pickle.loads(await self.stdout.readexactly(length))

    def _frame(self, data: bytes) -> None:
        self.stdin.write(_LENGTH.pack(len(data)))
        self.stdin.write(data)

    def kill(self) -> None:
        try:
            self.process.kill()
        except ProcessLookupError:
            pass  # already gone
        self.stdin.close()


class BodyParser:
    def __init__(self, inline_bytes: int = INLINE_BODY_BYTES, num_workers: int = 1) -> None:
        self.inline_bytes = inline_bytes
        self.num_workers = num_workers
        self._idle: asyncio.Queue[_Worker | None] | None = None  # None: a slot whose worker must be started
        self._workers: set[_Worker] = set()

    async def parse(self, chunks: AsyncIterator[bytes], model: type[T]) -> tuple[T, int]:
        """(the request model, the body's size in bytes) from the body's chunks as they arrive."""
        return await self._parse(chunks, model)

    async def parse_with(self, chunks: AsyncIterator[bytes], reader: Callable[[bytes], R]) -> tuple[R, int]:
        """(reader(body), the body's size in bytes): reader a module-level function (the worker
        imports it by name), raising InvalidRequestError for a bad body."""
        return await self._parse(chunks, reader)

    async def _parse(self, chunks: AsyncIterator[bytes], model: Any) -> tuple[Any, int]:
        head: list[bytes] = []
        size = 0
        async for chunk in chunks:
            head.append(chunk)
            size += len(chunk)
            if size > self.inline_bytes:
                break
        else:
            return _decode(b"".join(head), model), size
        counted = _Counted(head, chunks)
        ok, value = await self._in_worker(counted, model)
        if not ok:
            message, param, code = value
            raise InvalidRequestError(message, param=param, code=code)
        return value, counted.size

    async def start(self) -> None:
        """Start the workers now (each takes ~0.5 s to import), so the first large body does not wait."""
        idle = self._slots()
        for _ in range(self.num_workers):
            worker = await idle.get()
            idle.put_nowait(worker or await self._new_worker())

    async def _in_worker(self, chunks: AsyncIterable[bytes], model: type) -> tuple[bool, Any]:
        idle = self._slots()
        worker = await idle.get()
        try:
            worker = worker or await self._new_worker()
            result = await worker.parse(chunks, model)
        except (OSError, EOFError, asyncio.IncompleteReadError, pickle.UnpicklingError):
            # The worker died (killed, out of memory): this body is not answered, later ones are.
            logger.error("body parser: a worker process died; starting a new one")
            self._forget(worker)
            idle.put_nowait(None)
            raise ServiceUnavailableError("The server could not parse this request body; retry shortly.",
                                          retry_after=1) from None
        except asyncio.CancelledError:  # mid-exchange: the pipe may be out of step
            self._forget(worker)
            idle.put_nowait(None)
            raise
        except BaseException:  # the body stopped coming (client gone, too large): the worker dropped it
            idle.put_nowait(worker)
            raise
        idle.put_nowait(worker)
        return result

    def _slots(self) -> asyncio.Queue:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.num_workers):
                self._idle.put_nowait(None)
        return self._idle

    async def _new_worker(self) -> _Worker:
        worker = await _Worker.start()
        self._workers.add(worker)
        return worker

    def _forget(self, worker: _Worker | None) -> None:
        if worker is not None:
            worker.kill()
            self._workers.discard(worker)

    async def close(self) -> None:
        """End the workers (their stdin closes: each exits) and wait for them."""
        workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.stdin.close()
        for worker in workers:
            try:
                await asyncio.wait_for(worker.process.wait(), 5)
            except TimeoutError:
                worker.kill()
                await worker.process.wait()


class _Counted:
    """The chunks already read, then the rest of the stream, counting the bytes."""

    def __init__(self, head: list[bytes], rest: AsyncIterator[bytes]) -> None:
        self.head, self.rest = head, rest
        self.size = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.head:
            self.size += len(chunk)
            yield chunk
        async for chunk in self.rest:
            self.size += len(chunk)
            yield chunk


def _decode(raw: bytes, model: Any) -> Any:
    """A request model class's checked body, or a reader's value."""
    if isinstance(model, type) and issubclass(model, pydantic.BaseModel):
        return decode_json_body(raw, model)
    return model(raw)


def _serve(stdin, stdout) -> None:
    """The worker's loop: one body in, one answer out, until the server closes the pipe."""
    while header := stdin.read(_LENGTH.size):
        model = pickle.loads(stdin.read(_LENGTH.unpack(header)[0]))
        chunks = []
        while (length := _LENGTH.unpack(stdin.read(_LENGTH.size))[0]) not in (0, _ABORT):
            chunks.append(stdin.read(length))
        if length == _ABORT:
            continue
        try:
            answer: tuple[bool, Any] = (True, _decode(b"".join(chunks), model))
        except InvalidRequestError as exc:
            answer = (False, (exc.message, exc.param, exc.code))
        reply = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(_LENGTH.pack(len(reply)) + reply)
        stdout.flush()


if __name__ == "__main__":
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, answers)
