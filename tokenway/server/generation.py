"""One API call's generation, the same for every API: once the call is admitted, its job goes
to its replica, the replica's events come back, and when the call ends its CallOutcome is
made, once.

    PreparedCall ─► admitted() ─► Generation ─► Router.generate ─► outputs(): ChoiceDelta ...
                                                  final_outputs(): [ChoiceResult] by index
                 ─► finish(status, error) ─► CallOutcome ─► the ledger row and the trace

A call the response cache answers (server/response_cache.py) takes the same path, its events
replayed from the entry instead of a replica's; a miss keeps its replica's events for the next.

Each delta from the replica is read in order: a reasoning model's thinking split off its text
(reasoning_parsers.py: `reasoning`, and the tokens spent thinking), the content's tool calls
(tool_parsers.py), then the safety stage's output check, of both parts. A Harmony reply
(gpt-oss) is split into all three by one parser (harmony_parser.py).

The API modules (openai_render.py, anthropic_api.py) only render: deltas into their API's
events, results into their API's body. framed_stream frames any API's events the same way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from tokenway.frontend.harmony import HARMONY
from tokenway.frontend.harmony_parser import HarmonyParser
from tokenway.frontend.reasoning_parsers import ReasoningFormat
from tokenway.frontend.tool_parsers import ReplyFormat
from tokenway.gateway.admission import admit
from tokenway.gateway.call import Call, CallOutcome
from tokenway.json_codec import dumps
from tokenway.protocol.errors import InternalServerError, TokenwayError
from tokenway.protocol.job import ChoiceDelta, ReplicaEvent, ToolCallDelta, Usage, estimate_tokens
from tokenway.protocol.openai_bodies import CompletionUsage
from tokenway.routing.router import ReplicaChoice
from tokenway.safety.screen import OutputScreen, ReplyScreen
from tokenway.server import sse
from tokenway.server.http import ClientDisconnected, unless_disconnected
from tokenway.server.prepare import PreparedCall, guard, replica_events
from tokenway.server.response_cache import CacheDirective, CacheLookup
from tokenway.server.services import Services
from tokenway.stages import StageClock

access_log = logging.getLogger("tokenway.access")
logger = logging.getLogger(__name__)

STREAM_FAILED = "The server failed while generating; the stream has ended."


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One finished choice, as the non-streaming responses render it."""

    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list | None  # engine TokenLogprob per token (an upstream's: OpenAI-shaped dicts), where given
    tool_calls: tuple[ToolCall, ...] = ()  # the calls completed, in order; text is then the content around them
    reasoning: str = ""  # a reasoning model's thinking, apart from text


@dataclass(slots=True)
class ToolCall:
    """One tool call a replica made, as its pieces arrived (ToolCallDelta)."""

    id: str
    name: str
    arguments: str = ""


async def admitted(services: Services, call: Call, prepared: PreparedCall,
                   cache: CacheDirective | None = None) -> Generation:
    """A route's steps on its prepared call: the guard model's verdict (where the call's
    policy names one), the budget and limits, the response cache (a route that passes its
    caller's directive), then its Generation."""
    await guard(services, call, prepared)
    await admit(services.gatekeeper, call)
    response_cache = services.response_cache
    lookup = await response_cache.lookup(call, prepared.job, cache) \
        if cache is not None and response_cache is not None else None
    return Generation(services, call, prepared, lookup)


class Generation:
    """One prepared call's run on its replica: what outputs() has seen of each choice, and the
    call's outcome, made once (finish). Built once the call is admitted."""

    def __init__(self, services: Services, call: Call, prepared: PreparedCall, cache: CacheLookup | None = None
                 ) -> None:
        job = prepared.job
        self.services = services
        self.call = call
        self.clock = call.clock
        self.job = job
        self.frontend = prepared.frontend  # None: an untemplated job (its upstream templates)
        self.model = job.model
        self.request_id = job.request_id
        self.num_choices = job.n
        self.num_prompt_tokens = job.num_prompt_tokens  # an estimate for an untemplated job, until usage comes
        # Each choice as it stands; only outputs() writes these.
        self.completion_tokens = [0] * job.n
        self.texts: list[list[str]] = [[] for _ in range(job.n)]
        self.logprobs: list[list | None] = [[] if job.params.logprobs is not None else None for _ in range(job.n)]
        self.finish_reasons: list[str | None] = [None] * job.n
        self.stop_reasons: list[int | str | None] = [None] * job.n
        self.tool_calls: list[list[ToolCall]] = [[] for _ in range(job.n)]
        self.reasonings: list[list[str]] = [[] for _ in range(job.n)]
        self.reasoning_tokens = [0] * job.n  # of completion_tokens, those spent thinking
        # A reasoning model's reply is split as it streams (before its tool calls are read: they
        # are in the content); a replica that splits it itself (an upstream) sends `reasoning`.
        reasoning, reply_format = prepared.reasoning, prepared.reply_format
        # A Harmony reply: one parser a choice reads its thinking, content and calls at once.
        self.harmony = _harmony_parsers(reasoning, reply_format, job.n) \
            if reasoning is not None and reasoning.name == HARMONY else None
        if self.harmony is not None:
            reasoning = None
        token_text = self.frontend.tokenizer.token_text if self.frontend is not None else None
        self.reasoning_parsers = [reasoning.parser(token_text) for _ in range(job.n)] \
            if reasoning is not None else None
        # A reply in a tool-call format is read as it streams: its deltas carry content and
        # call pieces (ToolCallDelta), as a replica that makes calls itself (an upstream) sends.
        if self.harmony is not None:  # its calls are the tool-call format's where tools are offered
            calls_offered = reply_format is not None and reply_format.max_calls != 0
            self.parsers: list | None = self.harmony if calls_offered else None
        else:
            self.parsers = [reply_format.parser() for _ in range(job.n)] if reply_format is not None else None
        # The safety stage's output check, per choice, on the content (after the tool-call parser).
        policy = self.policy = prepared.policy
        self.screens = [ReplyScreen(policy) for _ in range(job.n)] if policy.output != "off" else None
        # ... and on the thinking, by a screen of its own (it goes out as a part of its own),
        # finished when the thinking is (the content, a call or the end follows).
        self.thinking_screens = [OutputScreen(policy) for _ in range(job.n)] if policy.output != "off" else None
        self.thinking_unscreened = [False] * job.n  # thinking fed to its screen since it last finished
        self.num_cached_tokens = 0
        self.cache_reason: str | None = None
        self.reported: Usage | None = None  # the replica's own count, once it sends it
        # The router's events once start() has run (its first event kept in _first for outputs()).
        self._events: AsyncGenerator[ReplicaEvent, None] | None = None
        self._first: list[ReplicaEvent] = []
        self._closed = False
        self._num_slots = 0  # the engine slots start() took (none for a call the cache answers)
        self._batch_line = call.start.batch_line is not None  # its slots count apart (Capacity)
        # The response cache: a hit's events replace the replica's; a miss that may be kept
        # records its replica's events as they came (before any parsing: a hit is parsed again).
        self.cache = cache
        self._recorded: list[ReplicaEvent] | None = [] if cache is not None and not self.cache_hit and cache.store \
            else None

    async def start(self) -> None:
        """Take the call's engine slots and wait for the replica's first event. Whatever
        refuses a call before its first token (the engine or the pool full, no replica able to
        run it, an upstream's error) raises here: a stream started after this answers such a
        refusal with its status and Retry-After before its first byte, as a JSON response does.
        Idempotent; aclose() undoes it."""
        if self._events is not None or self._closed:
            return
        if self.cache is not None and self.cache.events is not None:  # a hit
            self.call.set_replica(ReplicaChoice(self.model, "response_cache", "response_cache"))
            self._events = _replayed(self.cache.events)
        else:
            self.services.capacity.take(self.num_choices, batch=self._batch_line)
            self._num_slots = self.num_choices
            self._events = replica_events(self.services.router, self.job, self.call.set_replica)
        try:
            first = await anext(self._events, None)
        except BaseException:
            await self.aclose()
            raise
        self._first = [first] if first is not None else []

    async def aclose(self) -> None:
        """Stop the replica where it still runs and give the engine slots back. Idempotent: the
        stream's end, its response's end and a failed start all call it."""
        events, self._events = self._events, None
        if events is None or self._closed:
            return
        self._closed = True
        try:
            await events.aclose()
        finally:
            self.services.capacity.release(self._num_slots, batch=self._batch_line)

    async def outputs(self) -> AsyncIterator[ChoiceDelta]:
        """The replica's deltas, in order, with the call's counts and stage times kept up to date."""
        await self.start()
        if self._events is None:  # closed already: nothing more comes
            return
        # A replay's tokens are no engine's: they stay out of the token rate and inter-token times.
        observer = None if self.cache_hit else self.services.observer
        last_token_times: list[float | None] = [None] * self.num_choices
        first, self._first = self._first, []
        recorded = self._recorded
        try:
            async with aclosing(_chained(first, self._events)) as events:
                async for event in events:
                    if recorded is not None:
                        recorded.append(event)
                    if isinstance(event, Usage):
                        self.reported = event
                        self.num_cached_tokens, self.cache_reason = event.cached_tokens, event.cache_reason
                        continue
                    index = event.index
                    mark_stage_times(self.clock, event)
                    num_new = len(event.token_ids)
                    if observer is not None and num_new > 0:
                        now, previous = time.monotonic(), last_token_times[index]
                        num_gaps, times = num_new, event.engine_times
                        if times is not None and times[2] is not None:
                            now = times[2]
                            if previous is None and num_new > 1 and times[1] is not None:
                                previous, num_gaps = times[1], num_new - 1  # a reply sent whole: its mean gap
                        gap = None if previous is None else (now - previous) / num_gaps
                        observer.on_tokens(self.model, num_new, gap)
                        last_token_times[index] = now
                    self.completion_tokens[index] += num_new
                    if self.harmony is not None:
                        event = self._harmony_split(event)
                    elif self.reasoning_parsers is not None:
                        event = self._split(event)
                    elif event.reasoning:  # split by the replica: its tokens where it says, else an estimate
                        self.reasoning_tokens[index] += num_new if num_new and not event.text \
                            else estimate_tokens(event.reasoning)
                    if self.parsers is not None and self.harmony is None:
                        event = self._parsed(event)
                    if self.screens is not None:
                        event = self._screened(event)
                        if event is None:  # a choice the safety stage ended: the rest of it is dropped
                            continue
                    if event.text:
                        self.texts[index].append(event.text)
                    if event.reasoning:
                        self.reasonings[index].append(event.reasoning)
                    choice_logprobs = self.logprobs[index]
                    if event.logprobs and choice_logprobs is not None:
                        choice_logprobs.extend(event.logprobs)
                    for piece in event.tool_calls:
                        add_tool_call_piece(self.tool_calls[index], piece)
                    if event.num_cached_tokens >= self.num_cached_tokens:
                        self.num_cached_tokens, self.cache_reason = event.num_cached_tokens, event.cache_reason
                    if event.finish_reason is not None:
                        self.finish_reasons[index], self.stop_reasons[index] = event.finish_reason, event.stop_reason
                    yield event
                    if self.screens is not None and "content_filter" in self.finish_reasons \
                            and all(self.finish_reasons):
                        break  # every choice has ended, one by the safety stage: the replica stops (aclose)
        finally:
            await self.aclose()

    def _split(self, event: ChoiceDelta) -> ChoiceDelta:
        """A reasoning model's delta as thinking (`reasoning`) and content (`text`); at the
        reply's end the text held back is placed. The choice's thinking tokens are counted by
        token as the parser places them."""
        assert self.reasoning_parsers is not None, "only a reasoning model's reply is split"
        parser = self.reasoning_parsers[event.index]
        parsed = parser.feed(event.text, event.token_ids)
        reasoning, content = parsed.reasoning, parsed.content
        if event.finish_reason is not None:
            rest = parser.finish()
            reasoning, content = reasoning + rest.reasoning, content + rest.content
        self.reasoning_tokens[event.index] = parser.num_reasoning_tokens
        return dataclasses.replace(event, text=content, reasoning=event.reasoning + reasoning)

    def _harmony_split(self, event: ChoiceDelta) -> ChoiceDelta:
        """A Harmony reply's delta as thinking, content and call pieces (the reply's end ends its
        last message); a reply that completed calls ends with tool_calls, as _parsed says."""
        assert self.harmony is not None, "only a Harmony reply is split so"
        parser = self.harmony[event.index]
        parsed = parser.feed(event.text, event.token_ids)
        reasoning, content, calls = parsed.reasoning, parsed.content, parsed.calls
        finish_reason = event.finish_reason
        if finish_reason is not None:
            rest = parser.finish()
            reasoning, content, calls = reasoning + rest.reasoning, content + rest.content, calls + rest.calls
            if finish_reason == "stop" and parser.tool_calls():
                finish_reason = "tool_calls"
        self.reasoning_tokens[event.index] = parser.num_reasoning_tokens
        return dataclasses.replace(event, text=content, reasoning=event.reasoning + reasoning,
                                   tool_calls=event.tool_calls + calls, finish_reason=finish_reason)

    def _parsed(self, event: ChoiceDelta) -> ChoiceDelta:
        """A delta of a tool-call format's reply as content and call pieces. At the reply's end
        the text held back is sent, and a reply that completed calls ends with tool_calls (or
        length: the calls before a cut are kept, the one it cut is not)."""
        assert self.parsers is not None, "only a reply in a tool-call format is parsed"
        parser = self.parsers[event.index]
        parsed = parser.feed(event.text) if event.text else None
        content = parsed.content if parsed is not None else ""
        calls = parsed.calls if parsed is not None else ()
        finish_reason = event.finish_reason
        if finish_reason is not None:
            rest = parser.finish()
            content, calls = content + rest.content, calls + rest.calls
            if finish_reason == "stop" and parser.tool_calls():
                finish_reason = "tool_calls"
        return dataclasses.replace(event, text=content, tool_calls=event.tool_calls + calls,
                                   finish_reason=finish_reason)

    def _screened(self, event: ChoiceDelta) -> ChoiceDelta | None:
        """A delta's content as the safety stage lets it out (safety/screen.py): redacted, held
        back while a finding may still be forming, or cut at a finding the policy blocks, where
        the choice ends with content_filter. None for a choice that has ended so."""
        assert self.screens is not None and self.thinking_screens is not None, \
            "only a reply under an output policy is screened"
        index = event.index
        screen, thinking = self.screens[index], self.thinking_screens[index]
        if screen.blocked or thinking.blocked:
            return None
        final = event.finish_reason is not None
        reasoning = event.reasoning
        if reasoning:
            reasoning = thinking.feed(reasoning).text
            self.thinking_unscreened[index] = True
        if self.thinking_unscreened[index] and not thinking.blocked and (event.text or event.tool_calls or final):
            reasoning += thinking.finish().text  # the thinking is over: what its screen held goes out
            self.thinking_unscreened[index] = False
        if thinking.blocked:
            return dataclasses.replace(event, reasoning=reasoning, text="", tool_calls=(),
                                       finish_reason="content_filter", stop_reason=None)
        text, calls = screen.screen(event.text, event.tool_calls, final=final)
        if screen.blocked:
            return dataclasses.replace(event, reasoning=reasoning, text=text, tool_calls=calls,
                                       finish_reason="content_filter", stop_reason=None)
        return dataclasses.replace(event, reasoning=reasoning, text=text, tool_calls=calls)

    def text(self, index: int) -> str:
        """Choice `index`'s text so far (in a tool-call format, its content)."""
        return "".join(self.texts[index])

    def reasoning(self, index: int) -> str:
        """Choice `index`'s thinking so far (a reasoning model's)."""
        return "".join(self.reasonings[index])

    def completed_tool_calls(self, index: int) -> tuple[ToolCall, ...]:
        """The choice's calls as they went out (screened), those completed: by the replica, or
        in a tool-call format the ones its parser completed; under a safety policy, those whose
        arguments were all released before the reply ended."""
        completed = {call.id for call in self.parsers[index].tool_calls()} if self.parsers is not None else None
        released = self.screens[index].released if self.screens is not None else None
        return tuple(call for position, call in enumerate(self.tool_calls[index])
                     if (completed is None or call.id in completed) and (released is None or position in released))

    async def final_outputs(self) -> list[ChoiceResult]:
        """Run to the end; every choice's result, by index."""
        async for _ in self.outputs():
            pass
        return [ChoiceResult(i, self.text(i), self.finish_reasons[i], self.stop_reasons[i], self.logprobs[i],
                             self.completed_tool_calls(i), self.reasoning(i)) for i in range(self.num_choices)]

    async def start_stream(self, request: Request) -> None:
        """start(), raced against the client leaving; a refusal is the call's outcome."""
        try:
            await unless_disconnected(request, self.start())
        except ClientDisconnected:
            self.finish(499, "client disconnected")
            raise
        except TokenwayError as exc:
            self.finish(exc.status, exc.message)
            raise

    async def commit(self) -> None:
        """Make the ledger row durable; a stream calls this before its final event."""
        gatekeeper = self.services.gatekeeper
        if gatekeeper is not None:
            await gatekeeper.commit(self.call)

    async def json_response(self, request: Request, work: Awaitable[Mapping[str, object]],
                            id_header: str = "x-request-id") -> Response:
        """Await the response body unless the client leaves first; log and time it either way."""
        try:
            body = await unless_disconnected(request, work)
        except ClientDisconnected:
            self.finish(499, "client disconnected")
            return Response(status_code=499)
        except TokenwayError as exc:
            self.finish(exc.status, exc.message)
            raise
        except Exception as exc:  # a bug: the tokens made before it are still billed, then a plain 500
            logger.exception("request %s failed", self.request_id)
            self.finish(500, type(exc).__name__)
            raise InternalServerError("The server had an error processing the request") from exc
        self.clock.end("postprocess")
        response = Response(dumps(body), media_type="application/json",
                            headers={"Server-Timing": self.clock.server_timing(), id_header: self.request_id,
                                     **self.cache_headers})
        self.finish()
        return response

    @property
    def cache_hit(self) -> bool:
        """The response cache answers this call: its events are a stored reply's, replayed."""
        return self.cache is not None and self.cache.events is not None

    @property
    def cache_headers(self) -> dict[str, str]:
        """x-tokenway-cache on a call the response cache covers; {} on any other."""
        return self.cache.headers if self.cache is not None else {}

    @property
    def num_completion_tokens(self) -> int:
        """The replica's count where it sent one; else the token ids its deltas carried; else
        (a replica that counts nothing until its end, cut before it) what it sent, counted by
        the model's tokenizer where the call has one, or estimated."""
        if self.reported is not None:
            return self.reported.completion_tokens
        return sum(self.completion_tokens) or sum(map(self._count_sent, range(self.job.n)))

    def _count_sent(self, index: int) -> int:
        """A choice's text as kept for its reply (thinking, content, its calls' names and
        arguments), in tokens."""
        calls = self.tool_calls[index]
        text = "".join((*self.reasonings[index], *self.texts[index], *(c.name + c.arguments for c in calls)))
        if not text:
            return 0
        if self.frontend is not None:
            return len(self.frontend.tokenizer.encode(text, add_special_tokens=False))
        return estimate_tokens(text)

    @property
    def num_reasoning_tokens(self) -> int:
        """The call's thinking tokens, all choices: the replica's count where it sends one, else
        tokenway's (by token where the replica reports tokens), never above the completion's."""
        reported = self.reported
        if reported is not None and reported.reasoning_tokens:
            return reported.reasoning_tokens
        return min(sum(self.reasoning_tokens), self.num_completion_tokens)

    def usage(self) -> CompletionUsage:
        num_prompt_tokens = self.reported.prompt_tokens if self.reported is not None else self.num_prompt_tokens
        return usage_dict(num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens,
                          self.num_reasoning_tokens)

    def json_complete(self) -> bool | None:
        """For a call that asked for JSON (a schema, json_object) or tools: whether every choice
        is whole (a JSON document; every call it began, completed). A reply cut by max_tokens is
        not, and its finish_reason is already `length`: it is never presented as valid JSON."""
        if self.parsers is not None:
            return all(parser.complete for parser in self.parsers)
        job = self.job
        kind = (job.response_format or {}).get("type")
        if job.params.structured_output is None and kind not in ("json_schema", "json_object"):
            return None
        for index in range(self.num_choices):
            try:
                json.loads(self.text(index))
            except ValueError:
                return False
        return True

    def safety_output(self) -> dict:
        """The output check's part of the outcome: what it found, did, and took."""
        if self.screens is None:
            return {}
        thinking = self.thinking_screens or []
        categories = tuple(sorted(set().union(*(screen.categories for screen in self.screens),
                                              *(screen.categories for screen in thinking))))
        seconds = sum(screen.seconds for screen in self.screens) + sum(screen.seconds for screen in thinking)
        return {"safety_output": categories, "safety_output_action": self.policy.output if categories
                else None, "safety_output_ms": seconds * 1000}

    def finish(self, status: int = 200, error: str | None = None) -> None:
        """The call's outcome, made once from the counts as they stand, and its log line."""
        reasons = [r for r in self.finish_reasons if r]
        reported = self.reported
        cache = self.cache
        num_prompt_tokens = reported.prompt_tokens if reported is not None else self.num_prompt_tokens
        outcome = CallOutcome(  # Call.end bills nothing of a call its replica never started
            status, prompt_tokens=num_prompt_tokens,
            # A hit's whole prompt was served from a cache (its body still says what the miss's did).
            cached_tokens=num_prompt_tokens if self.cache_hit else self.num_cached_tokens,
            completion_tokens=self.num_completion_tokens,
            reasoning_tokens=self.num_reasoning_tokens, max_choice_tokens=max(self.completion_tokens),
            finish_reason=reasons[0] if reasons else None, error=error, cache_reason=self.cache_reason,
            json_complete=self.json_complete() if status == 200 else None,
            response_cache=cache.status if cache is not None else None, **self.safety_output())
        self.call.end(outcome)
        log_request(self.request_id, self.model, self.clock, outcome)
        recorded, self._recorded = self._recorded, None
        # Kept only whole: every choice ended by its replica (a safety stop cuts the events short).
        if recorded is not None and cache is not None and status == 200 and all(self.finish_reasons) \
                and "content_filter" not in self.finish_reasons and self.services.response_cache is not None:
            self.services.response_cache.keep(cache, recorded)


def _harmony_parsers(reasoning: ReasoningFormat, reply_format: ReplyFormat | None, num_choices: int
                     ) -> list[HarmonyParser]:
    """A Harmony parser a choice: call ids in the API's prefix, at most the calls the call allows
    (none where it offers no tools), from the channel the prompt left open."""
    prefix = reply_format.id_prefix if reply_format is not None else "call_"
    max_calls = reply_format.max_calls if reply_format is not None else 0
    return [HarmonyParser(lambda: f"{prefix}{uuid.uuid4().hex[:24]}", max_calls, starts_in=reasoning.open_channel)
            for _ in range(num_choices)]


async def _replayed(events: tuple[ReplicaEvent, ...]) -> AsyncGenerator[ReplicaEvent, None]:
    for event in events:
        yield event


async def _chained(first: list[ReplicaEvent], rest: AsyncIterator[ReplicaEvent]
                   ) -> AsyncGenerator[ReplicaEvent, None]:
    for event in first:
        yield event
    async for event in rest:
        yield event


def add_tool_call_piece(calls: list[ToolCall], piece: ToolCallDelta) -> None:
    """Fold a piece into its choice's calls: a piece with an id or a name at a new index starts
    a call, every piece's arguments extend it."""
    if piece.index >= len(calls):
        calls.extend(ToolCall(id="", name="") for _ in range(piece.index + 1 - len(calls)))
    call = calls[piece.index]
    if piece.id:
        call.id = piece.id
    if piece.name and not call.name:  # OpenAI sends it once, with the id
        call.name = piece.name
    call.arguments += piece.arguments


def mark_stage_times(clock: StageClock, delta: ChoiceDelta) -> None:
    """Queue ends when the engine first schedules the request, prefill at its first token,
    decode at its last (over all choices: the first to start, the last to finish). A replica
    that does not report engine times (a remote one) ends queue and prefill at its first event."""
    times = delta.engine_times
    first_scheduled, first_token, last_token = times if times is not None else (None, None, None)
    if not delta.token_ids and not delta.text and not delta.reasoning and delta.finish_reason is None \
            and times is None:
        return
    now = time.monotonic()
    if times is None:
        first_scheduled = first_token = last_token = now
    if first_scheduled is not None and not clock.ended("queue"):
        clock.end("queue", first_scheduled)
    if first_token is not None and not clock.ended("prefill"):
        clock.end("prefill", first_token)
    if last_token is not None:
        clock.end("decode", max(last_token, clock.ends.get("decode", 0.0)))


async def framed_stream(events: AsyncIterator[bytes], generation: Generation,
                        render_error: Callable[[TokenwayError], list[bytes]],
                        closing: list[bytes]) -> AsyncIterator[bytes]:
    """Frame an API's stream events, the same for every API: an error after the stream began
    ends it with the API's error event(s), never a silent cut; the stage times go in an SSE
    comment (clients ignore it); the ledger row is durable before the closing event(s); a
    disconnect (cancellation) bills what was generated."""
    try:
        async for event in events:
            yield event
    except TokenwayError as exc:
        error, reason = exc, exc.message
    except Exception as exc:  # noqa: BLE001 - reported to the client, logged in full
        logger.exception("stream %s failed", generation.request_id)
        error, reason = InternalServerError(STREAM_FAILED, code="internal_error"), type(exc).__name__
    except BaseException:
        generation.finish(499, "client disconnected")
        raise
    else:
        generation.clock.end("postprocess")
        yield sse.comment("server-timing: " + generation.clock.server_timing())
        generation.finish()
        await generation.commit()
        for event in closing:
            yield event
        return
    generation.finish(error.status, reason)
    await generation.commit()
    for event in render_error(error):
        yield event


def log_request(request_id: str, model: str, clock: StageClock, outcome: CallOutcome) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return  # the line is not built for nobody (serve --log-level warning)
    access_log.info(json.dumps({
        "request_id": request_id,
        "model": model,
        "status": outcome.status,
        "prompt_tokens": outcome.prompt_tokens,
        "cached_tokens": outcome.cached_tokens,
        "completion_tokens": outcome.completion_tokens,
        "finish_reason": outcome.finish_reason,
        "error": outcome.error,
        "ttft_ms": None if clock.ttft_ms is None else round(clock.ttft_ms, 2),
        "stages_ms": {k: round(v, 2) for k, v in clock.durations_ms().items()},
    }))


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int,
               num_reasoning_tokens: int = 0) -> CompletionUsage:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
    }
