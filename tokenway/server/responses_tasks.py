"""The background responses a server runs (server/responses_background.py runs each): a task per
response, by its id, held by Services (like Capacity, state a request changes, owned here)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from tokenway.protocol.errors import ServiceUnavailableError


class BackgroundResponses:
    """The background responses running in this server, by response id. Only the event loop
    touches it."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.closing = False  # the server is shutting down: a task cancelled now did not ask for it

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    def check_open(self) -> None:
        """A 503 once the server is shutting down: a response made now could not run."""
        if self.closing:
            raise ServiceUnavailableError("The server is shutting down; create the response again.", retry_after=1)

    def spawn(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        if self.closing:
            work.close()
        self.check_open()
        task = asyncio.get_running_loop().create_task(work, name=f"background {response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    def cancel(self, response_id: str) -> bool:
        """Stop the response's generation, if it runs here."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        if not task.cancelling():  # once: a second cancel would cut short how it records its end
            task.cancel()
        return True

    async def aclose(self) -> None:
        """Cancel every task and wait for each to record how it ended."""
        self.closing = True
        tasks = list(self._tasks.values())
        for task in tasks:
            if not task.cancelling():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
