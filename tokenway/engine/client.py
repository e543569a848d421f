"""The engine for asyncio callers (the HTTP server): EngineClient, and AsyncEngine, which steps
an EngineCore in a thread of this process (`tokenway serve --engine-thread`).
engine/process.py's ProcessEngine steps it in a child process behind the same interface: what
`tokenway serve` and `tokenway worker` run by default.

Commands (add, abort) cross to the engine through a queue; each step's outputs are folded into
RequestOutputs (detokenizing, stop strings: fold_outputs) and cross back with one
call_soon_threadsafe into a per-request asyncio.Queue.

    async for output in engine.generate(prompt_token_ids, params, request_id):
        ...           # RequestOutput with delta_text / delta_token_ids
    await engine.abort(request_id)   # or just stop iterating: the request is aborted

A caller that takes the result whole and bills nothing of a reply cut short (a batch line:
routing/replicas.py) asks for final_only:
its one output, the last, carries everything as its delta, and nothing crosses to it before
(vLLM's FINAL_ONLY): at 128 running requests a step's outputs were 128 wake-ups of the HTTP
side's event loop, each for a token nobody reads yet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from tokenway.config import EngineConfig
from tokenway.engine.core import EngineCore
from tokenway.engine.stats import EngineStats
from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.output import RequestOutput, RequestState
from tokenway.frontend.prompt_check import PromptChecker
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.protocol.job import SERVICE_CLASSES, ServiceClass
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has stopped (or is restarting); no request can be served now."""


class CallerState(Protocol):
    """What folds a request's outputs on the caller's side: a RequestState (the engine thread
    detokenizes with it), or engine/process.py's _Remote (rebuilt from the engine process's deltas)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


StateT = TypeVar("StateT", bound=CallerState)


@dataclass(slots=True)
class _Add(Generic[StateT]):
    state: StateT
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    service_class: ServiceClass = "default"
    final_only: bool = False


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Folds(Protocol):
    """A live request whose engine outputs are folded here (an _Add, or the engine process's own)."""

    @property
    def state(self) -> RequestState: ...

    @property
    def final_only(self) -> bool: ...


FoldsT = TypeVar("FoldsT", bound=_Folds)


def fold_outputs(live: dict[str, FoldsT], engine_outputs: list[EngineOutput]
                 ) -> tuple[list[tuple[FoldsT, RequestOutput]], list[tuple[str, int | str | None]]]:
    """Fold one step's outputs into their requests: (what to deliver, requests a stop string
    ended that the engine must now finish: (request_id, stop_reason)). Finished requests leave
    `live`; outputs of requests no longer live are dropped."""
    deliveries: list[tuple[FoldsT, RequestOutput]] = []
    stopped: list[tuple[str, int | str | None]] = []
    for engine_output in engine_outputs:
        entry = live.get(engine_output.request_id)
        if entry is None:
            continue
        result = entry.state.process(engine_output)
        completion = result.outputs[0]
        if result.finished:
            del live[engine_output.request_id]
            if not engine_output.finished:  # a stop string matched
                stopped.append((engine_output.request_id, completion.stop_reason))
        if entry.final_only:
            if result.finished:
                deliveries.append((entry, whole(result)))
        elif completion.delta_text or completion.delta_token_ids or result.finished:
            deliveries.append((entry, result))
    return deliveries, stopped


def whole(output: RequestOutput) -> RequestOutput:
    """A final_only request's one output: everything it released, as its delta."""
    completion = output.outputs[0]
    return dataclasses.replace(output, outputs=[dataclasses.replace(
        completion, delta_text=completion.text, delta_token_ids=completion.token_ids)])


def deliver(items: Sequence[tuple[_Add[Any], object]]) -> None:
    """Hand results (RequestOutputs or exceptions) to their callers: one wake-up per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for entry, item in items:
        by_loop.setdefault(entry.loop, []).append((entry.outputs, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that event loop is closed; nobody is listening
            pass


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in batch:
        outputs.put_nowait(item)


class EngineClient:
    """The asyncio side of an engine: what callers may read of it (tokenizer, vocab_size,
    max_model_len, stats()), the checks it would refuse a prompt for, and generate/abort.
    Subclasses say where the engine runs (_submit, stats, is_alive, shutdown)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    _prompts: PromptChecker

    def _submit(self, command: _Add[Any] | _Abort) -> None:
        raise NotImplementedError

    @property
    def frontend(self) -> ModelFrontend:
        """The engine's model as the HTTP side sees it: tokenizer and prompt checks."""
        return ModelFrontend(self.tokenizer, self._prompts, is_local=True)

    def _request_state(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> CallerState:
        """What folds this request's outputs on this side (the engine thread detokenizes with it)."""
        return RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)

    def stats(self) -> EngineStats:
        """What runs, what waits, how full the KV cache is (EngineCore.snapshot; may be one step stale)."""
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field) for what the engine would refuse: ids outside the
        vocabulary, a prompt over the window, a response_format that cannot be compiled;
        EngineDeadError when no engine is running to take it."""
        self._prompts.check(prompt_token_ids, params)
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        service_class: ServiceClass = "default",
        final_only: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield a RequestOutput per step that releases something; the last has finished=True.
        Raises ValueError (before anything runs) for a bad prompt or service class,
        EngineDeadError when the engine is down or dies meanwhile. Leaving the loop early, or
        cancelling the task, aborts the request in the engine within one step. service_class:
        how urgently the engine schedules it (engine/scheduler.py). final_only: yield only the
        last output, its delta the whole text and token ids."""
        if service_class not in SERVICE_CLASSES:
            raise ValueError(f"service_class: expected one of {', '.join(SERVICE_CLASSES)}, got {service_class!r}")
        self.validate_prompt(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        outputs: asyncio.Queue = asyncio.Queue()
        state = self._request_state(request_id, prompt, list(prompt_token_ids), params)
        self._submit(_Add(state, outputs, asyncio.get_running_loop(), service_class, final_only))
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
                self._submit(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))


class AsyncEngine(EngineClient):
    """The EngineCore stepped by a thread of this process: `tokenway serve`'s default, tests and
    embedding (`--engine-process` runs engine/process.py's ProcessEngine instead)."""

    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None) -> None:
        self._commands: queue.SimpleQueue[_Add[Any] | _Abort | None] = queue.SimpleQueue()  # None: stop
        # request_id -> (state, queue, loop); touched only by the engine thread.
        self._live: dict[str, _Add[RequestState]] = {}
        self._stopped = threading.Event()
        loaded: Future[EngineCore] = Future()
        self._thread = threading.Thread(target=self._run, args=(config or EngineConfig(), core, loaded),
                                        name="tokenway-engine", daemon=True)
        self._thread.start()
        # The model failed to load: result() raises the same ValueError the caller would get.
        self.core = loaded.result()
        # What callers may read of the engine; nothing else of the core is theirs to touch.
        self.tokenizer = self.core.tokenizer
        self.vocab_size = self.core.model_config.vocab_size
        self.max_model_len = self.core.max_model_len
        self._prompts = self.core.prompts

    def _submit(self, command: _Add[Any] | _Abort) -> None:
        self._commands.put(command)

    def stats(self) -> EngineStats:
        return self.core.snapshot()  # read without a lock: a count may be one step stale, never torn

    def shutdown(self, timeout: float = 5.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    # -- engine thread ---------------------------------------------------------------

    def _run(self, config: EngineConfig, core: EngineCore | None, loaded: Future[EngineCore]) -> None:
        # The model is loaded, and every step runs, on this thread only: torch's OpenMP
        # pool then belongs to it alone. A second pool, left on the main thread by loading
        # there, competes for the same cores (measured ~15% slower steps on 2 cores).
        try:
            core = core if core is not None else EngineCore(config)
        except BaseException as exc:
            self._stopped.set()
            loaded.set_exception(exc)
            return
        loaded.set_result(core)
        try:
            while True:
                # Block only when there is nothing to step.
                if not self._drain(core, block=not core.has_unfinished_requests()):
                    break
                if not core.has_unfinished_requests():
                    continue
                try:
                    engine_outputs = core.step()
                except Exception as exc:  # a bug or a device failure: fail these requests, keep serving
                    logger.exception("engine step failed; aborting %d requests", len(self._live))
                    core.abort_requests(list(self._live))
                    deliver([(live, exc) for live in self._live.values()])
                    self._live.clear()
                    continue
                deliveries, stopped = fold_outputs(self._live, engine_outputs)
                for request_id, stop_reason in stopped:  # in the same step: nothing more is computed
                    core.finish_request(request_id, stop_reason)
                deliver(deliveries)
        except BaseException:  # pragma: no cover - the thread must never die silently
            logger.exception("engine thread died")
        finally:
            self._stopped.set()
            dead = EngineDeadError("the engine stopped")
            deliver([(live, dead) for live in self._live.values()])
            self._live.clear()

    def _drain(self, core: EngineCore, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is None:
                core.abort_requests(list(self._live))
                return False
            if isinstance(command, _Add):
                request_id = command.state.request_id
                try:
                    core.add_request(request_id, command.state.prompt_token_ids, command.state.params,
                                     command.service_class)
                except ValueError as exc:
                    deliver([(command, exc)])
                    continue
                self._live[request_id] = command
            elif (live := self._live.pop(command.request_id, None)) is not None:
                # The caller may still be listening (an explicit abort): tell it.
                for engine_output in core.abort_requests([command.request_id]):
                    output = live.state.process(engine_output)
                    deliver([(live, whole(output) if live.final_only else output)])
