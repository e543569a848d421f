"""AsyncEngine: the engine for asyncio callers (the HTTP server).

The EngineCore steps in its own thread; the event loop never waits on the model. Commands
(add, abort) cross into the thread through a queue; each step's outputs cross back with
one call_soon_threadsafe into a per-request asyncio.Queue. Detokenizing and stop strings
run in the engine thread, so a stop string ends the request in the same step.

    async for output in engine.generate(prompt_token_ids, params, request_id):
        ...           # RequestOutput with delta_text / delta_token_ids
    await engine.abort(request_id)   # or just stop iterating: the request is aborted
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from tokenway.config import EngineConfig
from tokenway.engine.core import EngineCore
from tokenway.engine.request import SamplingParams
from tokenway.frontend.output import RequestOutput, RequestState

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass(slots=True)
class _Add:
    state: RequestState
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None) -> None:
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request_id -> (state, queue, loop); touched only by the engine thread.
        self._live: dict[str, _Add] = {}
        self._stopped = threading.Event()
        self._loaded = threading.Event()
        self._error: BaseException | None = None
        self.core = core
        self._thread = threading.Thread(target=self._run, args=(config or EngineConfig(),), name="tokenway-engine",
                                        daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self.core is None:
            raise self._error  # the model failed to load: the same ValueError the caller would get
        # What callers may read of the engine; nothing else of the core is theirs to touch.
        self.tokenizer = self.core.tokenizer
        self.vocab_size = self.core.model_config.vocab_size
        self.max_model_len = self.core.max_model_len

    def stats(self) -> dict:
        """What runs, what waits, how full the KV cache is (counts read without a lock: a
        snapshot may be one step stale, never torn within a number)."""
        core = self.core
        kv = core.kv_manager
        return {"num_running": len(core.scheduler.running), "num_waiting": len(core.scheduler.waiting),
                "kv_blocks_total": kv.num_blocks, "kv_blocks_free": kv.num_free_blocks,
                "prefix_cache_hit_rate": kv.prefix_cache_hit_rate, "prefix_cache_queried_tokens": kv.num_queried_tokens,
                "prefix_cache_hit_tokens": kv.num_hit_tokens, "num_preemptions": core.scheduler.num_preemptions}

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field) for what the engine would refuse: ids outside the
        vocabulary, a prompt over the window, a response_format that cannot be compiled."""
        self.core.validate_prompt(prompt_token_ids, params)

    # -- asyncio side ----------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per step that releases something; the last has finished=True.
        Raises ValueError (before anything runs) for a bad prompt. Leaving the loop early,
        or cancelling the task, aborts the request in the engine within one step."""
        if self._stopped.is_set():
            raise EngineDeadError("the engine has stopped") from self._error
        self.validate_prompt(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        outputs: asyncio.Queue = asyncio.Queue()
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, self.tokenizer)
        self._commands.put(_Add(state, outputs, asyncio.get_running_loop()))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    # -- engine thread ---------------------------------------------------------------

    def _run(self, config: EngineConfig) -> None:
        # The model is loaded, and every step runs, on this thread only: torch's OpenMP
        # pool then belongs to it alone. A second pool, left on the main thread by loading
        # there, competes for the same cores (measured ~15% slower steps on 2 cores).
        try:
            if self.core is None:
                self.core = EngineCore(config)
        except BaseException as exc:
            self._error = exc
            self._stopped.set()
            return
        finally:
            self._loaded.set()
        core = self.core
        try:
            while True:
                # Block only when there is nothing to step.
                if not self._drain(block=not core.has_unfinished_requests()):
                    break
                if not core.has_unfinished_requests():
                    continue
                try:
                    engine_outputs = core.step()
                except Exception as exc:  # a bug or a device failure: fail these requests, keep serving
                    logger.exception("engine step failed; aborting %d requests", len(self._live))
                    core.abort_requests(list(self._live))
                    self._deliver([(live, exc) for live in self._live.values()])
                    self._live.clear()
                    continue
                deliveries = []
                for engine_output in engine_outputs:
                    live = self._live.get(engine_output.request_id)
                    if live is None:
                        continue
                    result = live.state.process(engine_output)
                    if result.finished:
                        del self._live[engine_output.request_id]
                        if not engine_output.finished:  # a stop string matched
                            core.finish_request(engine_output.request_id, result.outputs[0].stop_reason)
                    if result.outputs[0].delta_text or result.outputs[0].delta_token_ids or result.finished:
                        deliveries.append((live, result))
                self._deliver(deliveries)
        except BaseException as exc:  # pragma: no cover - the thread must never die silently
            logger.exception("engine thread died")
            self._error = exc
        finally:
            self._stopped.set()
            dead = EngineDeadError("the engine stopped")
            self._deliver([(live, dead) for live in self._live.values()])
            self._live.clear()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is None:
                self.core.abort_requests(list(self._live))
                return False
            if isinstance(command, _Add):
                request_id = command.state.request_id
                try:
                    self.core.add_request(request_id, command.state.prompt_token_ids, command.state.params)
                except ValueError as exc:
                    self._deliver([(command, exc)])
                    continue
                self._live[request_id] = command
            elif (live := self._live.pop(command.request_id, None)) is not None:
                # The caller may still be listening (an explicit abort): tell it.
                for engine_output in self.core.abort_requests([command.request_id]):
                    self._deliver([(live, live.state.process(engine_output))])

    @staticmethod
    def _deliver(items: list[tuple[_Add, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for live, item in items:
            by_loop.setdefault(live.loop, []).append((live.outputs, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed; nobody is listening
                pass


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in batch:
        outputs.put_nowait(item)
