"""Request bodies parsed off the event loop once they are large.

json.loads and pydantic hold the GIL for the whole call: 7 MB of token ids take ~240 ms, so
a thread would not help (the loop waits for the GIL just the same). Bodies up to
`inline_bytes` (≤ ~2 ms of parsing) are parsed where they arrive; larger ones in a worker
process, whose result comes back as the already-checked request model (schema caps bound
what that model can hold, so unpickling it is quick). The pool starts with the server and is
replaced if a worker dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import pydantic

from tokenway.protocol.body import decode_json_body
from tokenway.protocol.errors import InvalidRequestError, ServiceUnavailableError

T = TypeVar("T", bound=pydantic.BaseModel)
logger = logging.getLogger(__name__)

INLINE_BODY_BYTES = 64 * 1024


def _parse(raw: bytes, model: type[T]) -> tuple[bool, Any]:
    """In the worker: (True, the model) or (False, the 400's message, param and code)."""
    try:
        return True, decode_json_body(raw, model)
    except InvalidRequestError as exc:
        return False, (exc.message, exc.param, exc.code)


def _warm_up() -> None:
    """Imports done, the worker is ready."""


class BodyParser:
    def __init__(self, inline_bytes: int = INLINE_BODY_BYTES, num_workers: int = 1) -> None:
        self.inline_bytes = inline_bytes
        self.num_workers = num_workers
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Spawn the worker now (it takes ~0.5 s to import), so the first large body does not wait."""
        self._pool_or_new().submit(_warm_up)

    async def parse(self, raw: bytes, model: type[T]) -> T:
        if len(raw) <= self.inline_bytes:
            return decode_json_body(raw, model)
        pool = self._pool_or_new()
        try:
            ok, value = await asyncio.wrap_future(pool.submit(_parse, raw, model))
        except BrokenProcessPool:
            # A worker died (killed, out of memory): this body is not answered, later ones are.
            logger.error("body parser: a worker process died; starting a new one")
            if self._pool is pool:
                self._pool = None
            raise ServiceUnavailableError("The server could not parse this request body; retry shortly.",
                                          retry_after=1) from None
        if not ok:
            message, param, code = value
            raise InvalidRequestError(message, param=param, code=code)
        return value

    def _pool_or_new(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the server process has threads (the engine's, torch's) that fork would copy mid-flight.
            self._pool = ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
