"""ProcessEngine: the EngineCore stepped in a child process (as vLLM v1 runs it), so the HTTP
process never runs model code or waits on Python's GIL behind a step.

    HTTP process                                        engine process (spawned)
    generate() -> _Add ----- writer thread ---(pipe)--> add / abort / stop
    deliver <- reader thread <-----------------(pipe)--- one message a step: each request's delta + snapshot

The HTTP side keeps what a caller needs without the weights: the tokenizer, the window and
the prompt checks (engine/core.PromptChecker), so a bad prompt is still a 400 before anything
runs. The engine process folds each step's tokens into RequestOutputs itself (detokenizing and
stop strings, in the step's thread as the in-process engine does, so a stop string ends the
request in that step) and sends what each step added (new text, token ids, logprobs) in one
pickled message; the HTTP side rebuilds the RequestOutputs (_Remote). (Folding on the HTTP
side instead, vLLM's split, puts that work beside the step's OpenMP threads on a small
machine rather than after the step; it measured no faster.)

If the engine process dies, every request in flight ends with EngineDeadError, new ones are
refused with it (the server answers 503 + Retry-After, /ready says not ready) and the process
is started again, with a backoff while it keeps failing to start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tokenway.config import EngineConfig
from tokenway.engine.child import EngineChild
from tokenway.engine.client import EngineClient, EngineDeadError, _Abort, _Add, deliver, fold_outputs
from tokenway.engine.stats import EngineStats
from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.output import CompletionOutput, RequestMetrics, RequestOutput, RequestState
from tokenway.models.loader import resolve_model
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenway.engine.core import EngineCore

logger = logging.getLogger(__name__)

RESTART_BACKOFF_SECONDS = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # after the 1st, 2nd, ... failure in a row


class ProcessEngine(EngineClient):
    def __init__(self, config: EngineConfig | None = None, niceness: int = 0, child: EngineChild | None = None,
                 wait: bool = True) -> None:
        """niceness: added to the engine process's (os.nice), so the HTTP process wins a core back
        at once when it wakes (to answer /health, to send a token, to take a request in). It costs
        the engine nothing measurable at 16 streams (bench/engine_process_bench.py) and matters
        when the engine is never idle: beside a running batch, interactive calls' TTFT p99 went
        from 1.7x alone to within 5% of it at 10 (bench/batch_bench.py), serve's default.
        child: the engine process, started earlier (EngineChild.start), importing meanwhile.
        wait=False: return while the engine loads; wait_started() before it serves."""
        config = config or EngineConfig()
        child = child if child is not None else EngineChild.start(niceness)
        try:
            # Resolve (convert a GGUF, once) here, so the engine process only loads; it loads
            # while this one reads the tokenizer.
            model_dir = resolve_model(config.model, config.cache_dir, revision=config.revision,
                                      gguf_file=config.gguf_file)
            child.load(config)  # the first start's failure is the caller's error
            frontend = ModelFrontend.from_dir(model_dir, config.max_model_len)
        except BaseException:
            child.stop(0.5)
            raise
        self.tokenizer, self._prompts = frontend.tokenizer, frontend.prompts
        self.vocab_size, self.max_model_len = frontend.vocab_size, frontend.max_model_len
        self._config = config
        self._lock = threading.Lock()  # guards _live, _child, _alive
        self._live: dict[str, _Add[_Remote]] = {}
        self._child: EngineChild | None = None
        self._alive = False
        self._closing = False
        self.num_restarts = 0
        self._niceness = niceness
        self._loading: EngineChild | None = child
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Until the engine process has loaded the model (at once once it has); raises why it
        could not, the first start's failure being the caller's error."""
        child, self._loading = self._loading, None
        if child is None:
            return
        ready = child.wait_ready()
        if isinstance(ready, BaseException):
            child.stop(0.5)
            raise ready
        self._snapshot = ready  # the engine's latest counts: each step's message brings them
        self._attach(child)

    # -- caller side -------------------------------------------------------------------

    def _submit(self, command: _Add[Any] | _Abort) -> None:
        with self._lock:
            child = self._child if self._alive else None
            if isinstance(command, _Add):
                if child is None:
                    deliver([(command, EngineDeadError("the engine is restarting"))])
                    return
                self._live[command.state.request_id] = command
                state = command.state
                child.send(("add", state.request_id, state.prompt_token_ids, state.params, command.service_class,
                            command.final_only))
            elif child is not None and command.request_id in self._live:
                child.send(("abort", command.request_id))  # its final output arrives as the engine aborts it

    def _request_state(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> _Remote:
        return _Remote(request_id, prompt, prompt_token_ids, params)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._snapshot, engine_pid=self.pid, engine_restarts=self.num_restarts)

    @property
    def is_alive(self) -> bool:
        return self._alive

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None while none runs)."""
        child = self._child
        return child.process.pid if child is not None and self._alive else None

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closing = True
            self._alive = False
            child = self._child
        if child is not None:
            child.stop(timeout)
        self._fail_live(EngineDeadError("the engine stopped"))

    # -- engine side, on the reader thread ---------------------------------------------

    def _attach(self, child: EngineChild) -> None:
        with self._lock:
            self._child, self._alive = child, True
        threading.Thread(target=self._read, args=(child,), name="tokenway-engine-reader", daemon=True).start()

    def _read(self, child: EngineChild) -> None:
        """Fold the engine's messages into their requests until its pipe closes; then restart it."""
        try:
            while True:
                message = child.results.recv()
                kind = message[0]
                if kind == "step":
                    _, outputs, refused, snapshot = message
                    self._snapshot = snapshot
                    deliveries = []
                    with self._lock:
                        for request_id, reason in refused:  # raced past the checks here (rare): a ValueError
                            if (entry := self._live.pop(request_id, None)) is not None:
                                deliveries.append((entry, reason))
                        for delta in outputs:
                            entry = self._live.get(delta[0])
                            if entry is None:  # aborted here meanwhile
                                continue
                            output = entry.state.apply(delta)
                            if output.finished:
                                del self._live[output.request_id]
                            deliveries.append((entry, output))
                    deliver(deliveries)
                elif kind == "step_failed":  # the engine logged it and aborted everything
                    self._fail_live(RuntimeError(message[1]))
        except (EOFError, OSError):  # the engine process is gone
            pass
        except Exception:  # noqa: BLE001 - a message this side could not fold: never leave callers waiting
            logger.exception("tokenway: reading the engine's outputs failed; restarting the engine")
        self._restart(child)

    def _fail_live(self, error: BaseException) -> None:
        with self._lock:
            failed = [(entry, error) for entry in self._live.values()]
            self._live.clear()
        deliver(failed)

    def _restart(self, dead: EngineChild) -> None:
        with self._lock:
            self._alive = False
            closing = self._closing
        if closing:
            return
        code = dead.stop(0.5)
        logger.error("tokenway: the engine process exited (code %s); %d requests in flight failed; restarting",
                     code, len(self._live))
        self._fail_live(EngineDeadError("the engine process exited while generating this request"))
        failures = 0
        while not self._closing:
            time.sleep(RESTART_BACKOFF_SECONDS[min(failures, len(RESTART_BACKOFF_SECONDS) - 1)])
            child = EngineChild.start(self._niceness)
            child.load(self._config)
            ready = child.wait_ready()
            if not isinstance(ready, BaseException):
                self.num_restarts += 1
                self._snapshot = ready
                logger.warning("tokenway: the engine process is back (pid %d)", child.process.pid)
                self._attach(child)
                return
            child.stop(0.5)
            failures += 1
            logger.error("tokenway: the engine process failed to start again (%s)", ready)


def engine_main(niceness: int, commands: Connection, results: Connection) -> None:
    """The engine process (engine/child.py): import the engine while the HTTP process starts,
    load what it is told to, then step while there is work, reading commands between steps."""
    from tokenway.engine.core import EngineCore

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops this process
    if niceness:
        os.nice(niceness)
    try:
        message = commands.recv()
    except (EOFError, OSError):  # the HTTP process stopped before it said what to load
        return
    if message[0] != "load":
        return
    config: EngineConfig = message[1]
    try:
        core = EngineCore(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        results.send(("failed", str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}",
                      isinstance(exc, ValueError)))
        return
    results.send(("ready", core.snapshot()))
    intake = _Intake(core, commands, results)
    while True:
        aborted = []
        # Wait for a command only when there is nothing to step; then take all that are queued,
        # after those a step took in and kept for its end. (The parent's exit closes the pipe: EOF
        # ends this process.)
        try:
            deferred, intake.deferred = intake.deferred, []
            for command in deferred:
                if (outputs := intake.handle(command)) is None:
                    return
                aborted += outputs
            if aborted and not core.has_unfinished_requests():
                # Those aborts emptied the engine, which now waits for a command: their ends and
                # the counts go out first (the HTTP side sizes the batch's room by these counts,
                # and would send nothing more while they still showed the aborted requests).
                intake.publish(aborted)
                aborted = []
            pending = not core.has_unfinished_requests() or commands.poll()
            while pending:
                if (outputs := intake.handle(commands.recv())) is None:
                    return
                aborted += outputs
                pending = commands.poll()
        except (EOFError, OSError):
            return
        engine_outputs = []
        if core.has_unfinished_requests():
            try:
                engine_outputs = core.step(intake)
            except Exception as exc:  # a bug or a device failure: fail these requests, keep serving
                logging.getLogger(__name__).exception("engine step failed; aborting %d requests", len(intake.live))
                core.abort_requests(list(intake.live))
                intake.live.clear()
                results.send(("step_failed", f"the engine failed while generating: {type(exc).__name__}"))
                continue
        intake.publish(aborted + engine_outputs)


class _Intake:
    """The engine process's end of the command pipe, and the requests it folds outputs for: the
    EngineCore's Arrivals, so a step can take in a request that arrives while it runs."""

    def __init__(self, core: EngineCore, commands: Connection, results: Connection) -> None:
        self.core, self.commands, self.results = core, commands, results
        self.wake_fd = commands.fileno()
        # request_id -> its RequestState: outputs are folded (detokenized, stop strings) here, in
        # the step's own thread, as the in-process engine does; one message a step carries them.
        self.live: dict[str, _Folding] = {}
        self.refused: list[tuple[str, ValueError]] = []  # raced past the HTTP side's checks
        self.deferred: list[tuple] = []  # commands a step took in that wait for its end

    def handle(self, command: tuple) -> list[EngineOutput] | None:
        """One command between steps: the outputs it made (an abort's); None for "stop"."""
        kind = command[0]
        if kind == "add":
            self._add(command)
            return []
        if kind == "abort":
            return self.core.abort_requests([command[1]])
        return None

    def _add(self, command: tuple) -> bool:
        _, request_id, prompt_token_ids, params, service_class, final_only = command
        try:
            self.core.add_request(request_id, prompt_token_ids, params, service_class)
        except ValueError as exc:  # a FieldError pickles whole: its param survives
            self.refused.append((request_id, exc))
            return False
        self.live[request_id] = _Folding(RequestState(request_id, None, prompt_token_ids, params,
                                                      self.core.tokenizer), final_only)
        return True

    def take(self) -> bool:
        """Mid-step (EngineCore.step): new requests join the queue now; an abort or a stop waits
        for the step's end, since the step still writes the blocks an abort would free."""
        added = False
        try:
            while self.commands.poll():
                command = self.commands.recv()
                if command[0] == "add":
                    added |= self._add(command)
                else:
                    self.deferred.append(command)
        except (EOFError, OSError):  # the parent is gone: the loop sees it after the step
            pass
        return added

    def publish(self, outputs: list[EngineOutput]) -> None:
        """Fold a step's outputs and send what each request got, with the engine's counts."""
        deliveries, stopped = fold_outputs(self.live, outputs)
        for request_id, stop_reason in stopped:  # in the same step: nothing more is computed
            self.core.finish_request(request_id, stop_reason)
        refused, self.refused = self.refused, []
        self.results.send(("step", [_step_delta(output) for _, output in deliveries], refused, self.core.snapshot()))


@dataclass(slots=True)
class _Folding:
    state: RequestState
    final_only: bool = False  # send only the last output, everything as its delta


def _step_delta(output: RequestOutput) -> tuple:
    """What one step added to a request, as a plain tuple (the cheapest thing to pickle): what
    crosses the pipe grows with the step's new tokens, never with the request's length."""
    completion = output.outputs[0]
    new_logprobs = None
    if completion.logprobs is not None and completion.delta_token_ids:
        new_logprobs = completion.logprobs[len(completion.logprobs) - len(completion.delta_token_ids):]
    metrics = output.metrics
    times = None if metrics is None else (metrics.arrival_time, metrics.first_scheduled_time,
                                          metrics.first_token_time, metrics.last_token_time)
    return (output.request_id, completion.delta_text, completion.delta_token_ids, new_logprobs,
            completion.finish_reason, completion.stop_reason, output.num_cached_tokens, output.cache_reason, times)


class _Remote:
    """A request on the HTTP side: its RequestOutputs rebuilt from the engine process's step
    deltas (the same values the engine thread's RequestState hands out; the engine process
    detokenized and matched the stop strings)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "text", "token_ids", "logprobs")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.request_id, self.prompt, self.prompt_token_ids, self.params = request_id, prompt, prompt_token_ids, params
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None

    def apply(self, delta: tuple) -> RequestOutput:
        _, text, token_ids, new_logprobs, finish_reason, stop_reason, num_cached_tokens, cache_reason, times = delta
        self.text += text
        self.token_ids.extend(token_ids)
        if self.logprobs is not None and new_logprobs:
            self.logprobs.extend(new_logprobs)
        # Copies: the caller may still hold this output when the next step's arrives.
        completion = CompletionOutput(0, self.text, list(self.token_ids), finish_reason, stop_reason,
                                      None if self.logprobs is None else list(self.logprobs), text, list(token_ids))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finished=finish_reason is not None, num_cached_tokens=num_cached_tokens,
                             cache_reason=cache_reason, metrics=None if times is None else RequestMetrics(*times))
