"""A replica behind an Anthropic Messages API: the reverse of protocol/anthropic.py's
to_chat_messages, so an OpenAI client reaches Claude (and an Anthropic client, whose body was
converted to OpenAI messages on the way in, gets its own shapes back unchanged).

    GenerationJob (OpenAI chat messages) ── messages_body ──► POST {base_url}/messages
    streamed (upstream.sends_stream): message_start (usage) · content_block_start text |
    thinking | tool_use (id, name) · content_block_delta text_delta | thinking_delta |
    input_json_delta · message_delta (stop_reason, usage) · message_stop
        ──► ChoiceDelta ... (thinking as its `reasoning`)
    else, no `stream`: one message (content blocks, stop_reason, usage) ──► one ChoiceDelta
    ──► one Usage

The job's ThinkingRequest goes as `thinking` (thinking_config: what Anthropic would refuse is
left to the model's default instead). A reasoning_content the conversation carries is not sent:
Anthropic takes back only its own signed thinking blocks.

n > 1 runs n concurrent upstream calls merged into one stream, choice i from call i; their
usages are summed, so the prompt counts n times, as the upstream bills it. Not translatable,
so refused with a 400: completion jobs, logprobs, logit_bias, a non-text response_format, non-text
content parts. Ignored, as Anthropic has no equivalent: seed, presence/frequency/repetition
penalties, min_p, min_tokens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from tokenway.protocol.errors import BadGatewayError, InvalidRequestError
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, ToolCallDelta, Usage
from tokenway.routing.sse_decoder import SSEEvent
from tokenway.routing.upstream import (
    ConnectionLimits,
    CountTokens,
    HTTPReplica,
    UpstreamHTTP,
    UpstreamTimeouts,
    api_key_from_env,
    counted_usage,
    joined_delta,
    one_call_a_choice,
    parse_json_object,
    sends_stream,
)
from tokenway.routing.upstream_errors import stream_error

ANTHROPIC_VERSION = "2023-06-01"
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop", "max_tokens": "length",
                  "model_context_window_exceeded": "length", "tool_use": "tool_calls", "refusal": "content_filter"}


def _text_blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """OpenAI content (a string or text parts) as Anthropic text blocks; empty text is dropped
    because Anthropic refuses empty text blocks."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequestError("Only text content can be sent to this upstream.", param=f"{param}[{j}]")
    return [{"type": "text", "text": part["text"]} for part in parts if part.get("text")]


def _tool_use_blocks(tool_calls: Sequence[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    blocks = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequestError("Tool call arguments must be a JSON object.",
                                      param=f"{param}[{j}].function.arguments")
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": arguments})
    return blocks


def to_anthropic_messages(messages: Sequence[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(system, messages): system (and developer) messages joined into `system`; an assistant's
    tool_calls become tool_use blocks; `tool` messages become tool_result blocks in a user turn;
    consecutive turns of one role merge into one, as Anthropic requires them to alternate."""
    system_texts: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content, param = message.get("role"), message.get("content"), f"messages[{i}].content"
        if role in ("system", "developer"):
            system_texts.extend(block["text"] for block in _text_blocks(content, param))
            continue
        if role == "tool":
            role, text = "user", "\n".join(block["text"] for block in _text_blocks(content, param))
            blocks = [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                       **({"content": text} if text else {})}]
        elif role == "user":
            blocks = _text_blocks(content, param)
        elif role == "assistant":
            blocks = _text_blocks(content, param) + _tool_use_blocks(message.get("tool_calls") or (),
                                                                     f"messages[{i}].tool_calls")
        else:
            raise InvalidRequestError(f"Role {role!r} cannot be sent to this upstream.", param=f"messages[{i}].role")
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        elif blocks:
            turns.append({"role": role, "content": blocks})
    return "\n".join(system_texts) or None, turns


def to_anthropic_tool_choice(tool_choice: str | dict[str, Any], parallel_tool_calls: bool) -> dict[str, Any]:
    choice: dict[str, Any]
    if isinstance(tool_choice, dict):
        choice = {"type": "tool", "name": tool_choice["function"]["name"]}
    else:
        choice = {"type": {"auto": "auto", "required": "any", "none": "none"}[tool_choice]}
    if not parallel_tool_calls and choice["type"] != "none":
        choice["disable_parallel_tool_use"] = True
    return choice


def messages_body(job: GenerationJob, model: str, default_max_tokens: int) -> dict[str, Any]:
    params = job.params
    if job.kind != "chat" or not job.messages:
        raise InvalidRequestError("An Anthropic Messages upstream takes chat messages only.", param="prompt")
    refused = next((name for name, is_set in (
        ("logprobs", params.logprobs is not None), ("logit_bias", bool(params.logit_bias)),
        ("response_format", (job.response_format or {"type": "text"}).get("type") != "text")) if is_set), None)
    if refused is not None:
        raise InvalidRequestError(f"{refused} is not supported by this model's upstream (Anthropic Messages).",
                                  param=refused)
    system, messages = to_anthropic_messages(job.messages)
    max_tokens = params.max_tokens or default_max_tokens
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": messages}
    if system:
        body["system"] = system
    thinking = thinking_config(job, max_tokens)
    if thinking is not None:
        body["thinking"] = thinking
    if thinking is not None and thinking["type"] != "disabled":
        # Anthropic refuses a temperature other than 1, top_k, and top_p below 0.95 with thinking on.
        if params.top_p < 1.0:
            body["top_p"] = max(params.top_p, 0.95)
    else:
        body["temperature"] = params.temperature
        if params.top_p != 1.0:  # newer Claude models refuse temperature and top_p together
            body["top_p"] = params.top_p
        if params.top_k > 0:
            body["top_k"] = params.top_k
    if params.stop:
        body["stop_sequences"] = list(params.stop)
    if job.tools:
        body["tools"] = [
            {"name": tool["function"]["name"],
             **({"description": tool["function"]["description"]} if tool["function"].get("description") else {}),
             "input_schema": tool["function"].get("parameters") or {"type": "object", "properties": {}}}
            for tool in job.tools
        ]
        body["tool_choice"] = to_anthropic_tool_choice(job.tool_choice, job.parallel_tool_calls)
    if job.service_class == "priority":  # "auto" takes Anthropic's Priority Tier where the account has it
        body["service_tier"] = "auto"
    return body | ({"stream": True} if sends_stream(job) else {})


def thinking_config(job: GenerationJob, max_tokens: int) -> dict[str, Any] | None:
    """The job's ThinkingRequest as Anthropic's `thinking`: disabled; enabled with budget_tokens
    (at least Anthropic's minimum, below max_tokens); adaptive for thinking on without a budget
    (the models since Claude 4.6 choose their own). None (the model's default) when it asks
    nothing, and where Anthropic would refuse thinking: a budget that cannot fit below
    max_tokens, a tool_choice that forces a call, and a tool loop under way, whose last
    assistant turn Anthropic wants back with its signed thinking block, which tokenway does not
    keep (thinking resumes at the next user turn)."""
    thinking = job.thinking
    if thinking is None or thinking.enabled is None and thinking.budget_tokens is None:
        return None
    if thinking.enabled is False or thinking.budget_tokens == 0:
        return {"type": "disabled"}
    if job.tools and job.tool_choice not in ("auto", "none") or _in_tool_loop(job.messages):
        return None
    if thinking.budget_tokens is None:
        return {"type": "adaptive"}
    if max_tokens <= MIN_THINKING_BUDGET:
        return None
    return {"type": "enabled", "budget_tokens": min(max(thinking.budget_tokens, MIN_THINKING_BUDGET), max_tokens - 1)}


def _in_tool_loop(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether the conversation continues an assistant turn that called tools (only their
    results follow it)."""
    for message in reversed(messages):
        if message.get("role") != "tool":
            return message.get("role") == "assistant" and bool(message.get("tool_calls"))
    return False


class _MessageReader:
    """One upstream message, streamed or whole, as choice `index`'s deltas. Anthropic counts
    content blocks (text and tool_use together); OpenAI numbers tool calls alone: block_to_call
    maps them."""

    def __init__(self, name: str, index: int) -> None:
        self.name, self.index = name, index
        self.block_to_call: dict[int, int] = {}
        self.usage_fields: dict[str, int] = {}
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.stopped = False  # message_stop came

    def read(self, event: SSEEvent) -> ChoiceDelta | None:
        payload = parse_json_object(self.name, event.data)
        try:
            return self._read(payload.get("type") or event.event, payload)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BadGatewayError(f"Upstream {self.name} sent a malformed event ({type(exc).__name__}).") from None

    def read_message(self, payload: dict[str, Any]) -> ChoiceDelta:
        """A non-streamed answer: its blocks in one delta, as the events of its stream add up."""
        if payload.get("type") == "error":
            raise stream_error(self.name, payload.get("error"))
        try:
            return joined_delta(self.index, [self._read(kind, event) for kind, event in _as_events(payload)])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BadGatewayError(f"Upstream {self.name} sent a malformed message ({type(exc).__name__}).") from None

    def _read(self, kind: str, payload: dict[str, Any]) -> ChoiceDelta | None:
        if kind == "error":
            raise stream_error(self.name, payload.get("error"))
        if kind in ("message_start", "message_delta"):  # usage counts are cumulative: the last wins
            usage = (payload["message"] if kind == "message_start" else payload).get("usage") or {}
            self.usage_fields.update({k: int(v) for k, v in usage.items() if isinstance(v, int)})
        if kind == "message_delta" and payload["delta"].get("stop_reason") is not None:
            self.finish_reason = FINISH_REASONS.get(payload["delta"]["stop_reason"], "stop")
            return ChoiceDelta(self.index, finish_reason=self.finish_reason,
                               stop_reason=payload["delta"].get("stop_sequence"))
        if kind == "message_stop":
            self.stopped = True
        if kind == "content_block_start" and payload["content_block"]["type"] == "tool_use":
            block = payload["content_block"]
            call_index = self.block_to_call[int(payload["index"])] = len(self.block_to_call)
            arguments = json.dumps(block["input"], ensure_ascii=False) if block.get("input") else ""
            return self._delta(tool_call=ToolCallDelta(call_index, id=block["id"], name=block["name"],
                                                       arguments=arguments))
        if kind == "content_block_start" and payload["content_block"]["type"] == "text":
            return self._delta(text=payload["content_block"].get("text") or "")
        if kind == "content_block_delta" and payload["delta"]["type"] == "text_delta":
            return self._delta(text=payload["delta"]["text"])
        if kind == "content_block_start" and payload["content_block"]["type"] == "thinking":
            return self._delta(reasoning=payload["content_block"].get("thinking") or "")
        if kind == "content_block_delta" and payload["delta"]["type"] == "thinking_delta":
            return self._delta(reasoning=payload["delta"]["thinking"])
        if kind == "content_block_delta" and payload["delta"]["type"] == "input_json_delta":
            call_index = self.block_to_call[int(payload["index"])]
            return self._delta(tool_call=ToolCallDelta(call_index, arguments=payload["delta"]["partial_json"]))
        # ping, content_block_stop, a thinking block's signature, redacted_thinking (encrypted: nothing
        # to show), and event kinds Anthropic may add
        return None

    def _delta(self, text: str = "", tool_call: ToolCallDelta | None = None, reasoning: str = "") -> ChoiceDelta | None:
        if tool_call is not None:
            self.texts.append((tool_call.name or "") + tool_call.arguments)
            return ChoiceDelta(self.index, tool_calls=(tool_call,))
        self.texts.append(text + reasoning)
        return ChoiceDelta(self.index, text=text, reasoning=reasoning) if text or reasoning else None

    def usage(self) -> Usage | None:
        """Anthropic's input_tokens leaves out the prompt read from or written to its cache;
        OpenAI's prompt_tokens includes them, with the read part as cached_tokens."""
        fields = self.usage_fields
        if "input_tokens" not in fields and "output_tokens" not in fields:
            return None
        cached = fields.get("cache_read_input_tokens", 0)
        return Usage(fields.get("input_tokens", 0) + cached + fields.get("cache_creation_input_tokens", 0),
                     fields.get("output_tokens", 0), cached_tokens=cached)


def _as_events(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A whole message as the events its stream would have sent, each block whole in its
    content_block_start, so one reader reads both."""
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"message": {"usage": message.get("usage")}})]
    events += [("content_block_start", {"index": i, "content_block": block})
               for i, block in enumerate(message["content"])]
    events.append(("message_delta", {"delta": {"stop_reason": message["stop_reason"],
                                               "stop_sequence": message.get("stop_sequence")}}))
    return events + [("message_stop", {})]


class AnthropicUpstream(HTTPReplica):
    """An Anthropic Messages upstream as a replica: `model` is the upstream's name for it, the
    key (from the variable `api_key_env` names) goes as x-api-key, and max_tokens, which
    Anthropic requires, is default_max_tokens when the job has none."""

    kind = "anthropic"

    def __init__(self, name: str, base_url: str, model: str, api_key_env: str | None = None, *,
                 timeouts: UpstreamTimeouts = UpstreamTimeouts(), limits: ConnectionLimits = ConnectionLimits(),
                 count_tokens: CountTokens | None = None, health_path: str = "models",
                 default_max_tokens: int = 4096, anthropic_version: str = ANTHROPIC_VERSION) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens: must be >= 1, got {default_max_tokens}")
        api_key = api_key_from_env(api_key_env)
        headers = {"anthropic-version": anthropic_version} | ({"x-api-key": api_key} if api_key else {})
        self.name, self.model, self.default_max_tokens = name, model, default_max_tokens
        self.http = UpstreamHTTP(name, base_url, headers, timeouts, limits, health_path)
        self._count_tokens = count_tokens

    def __repr__(self) -> str:
        return f"AnthropicUpstream(name={self.name!r}, base_url={self.http.base_url!r}, model={self.model!r})"

    def stats(self) -> None:
        """An upstream publishes no engine counts (Replica.stats)."""
        return None

    async def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]:
        body = messages_body(job, self.model, self.default_max_tokens)
        readers = [_MessageReader(self.name, index) for index in range(job.n)]
        events = one_call_a_choice(
            [self._call(body, job.deadline, reader) for reader in readers],
            lambda: [reader.usage() or counted_usage(job, ["".join(reader.texts)], self._count_tokens)
                     for reader in readers])
        async with aclosing(events):
            async for event in events:
                yield event

    async def _call(self, body: dict[str, Any], deadline: float | None, reader: _MessageReader
                    ) -> AsyncGenerator[ChoiceDelta, None]:
        if body.get("stream"):
            events = self.http.stream_events("messages", body, deadline, is_last=lambda event: reader.stopped)
            async with aclosing(events):
                async for event in events:
                    if (delta := reader.read(event)) is not None:
                        yield delta
        else:
            yield reader.read_message(await self.http.post_json("messages", body, deadline))
        if not reader.stopped or reader.finish_reason is None:
            raise BadGatewayError(f"Upstream {self.name} ended the answer before the message finished.")
