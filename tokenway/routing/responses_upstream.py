"""A replica behind OpenAI's Responses API only (OpenAI's newest models answer nothing else), for
any chat job, whichever API its caller spoke (chat completions, Anthropic Messages, Responses):

    GenerationJob (OpenAI chat messages) ── responses_body ──► POST {base_url}/responses,
        store=false (tokenway keeps its own conversations; the upstream keeps none)
    streamed (upstream.sends_stream): response.output_item.added function_call (call_id, name) ·
    response.output_text.delta · response.function_call_arguments.delta ·
    response.reasoning_text.delta | response.reasoning_summary_text.delta ·
    response.completed | response.incomplete (usage)
        ──► ChoiceDelta ... (thinking as its `reasoning`)
    else, no `stream`: one response (output items, status, usage) ──► one ChoiceDelta
    ──► one Usage

Message to item: system, developer and user messages stay messages (text parts input_text,
image_url parts input_image); an assistant's text is an assistant message and each of its
tool_calls a function_call item; a tool message is a function_call_output. An assistant's
reasoning_content is not sent: a Responses upstream takes back only reasoning items it made,
by id or encrypted_content, and tokenway keeps neither.

Sampling: temperature and top_p always, max_tokens as max_output_tokens, logprobs as
top_logprobs with include message.output_text.logprobs, the job's ThinkingRequest as
reasoning.effort (upstream.reasoning_effort). Refused with a 400, as the API has no such field:
completion jobs, stop, logit_bias, a response_format other than text, json_object and
json_schema. Ignored: seed, penalties, min_p, min_tokens. n > 1 runs n concurrent calls merged
into one stream (the Responses API makes one reply a call); their usages are summed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from tokenway.protocol.errors import BadGatewayError, InvalidRequestError, TokenwayError
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, ToolCallDelta, Usage
from tokenway.routing.openai_upstream import upstream_tier
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
    reasoning_effort,
    sends_stream,
)
from tokenway.routing.upstream_errors import stream_error

INCLUDE_LOGPROBS = "message.output_text.logprobs"
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})
INCOMPLETE_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}
# A failed response's error codes (Response.error.code), as the error kinds upstream_errors maps.
ERROR_CODE_TO_TYPE = {"rate_limit_exceeded": "rate_limit_error", "invalid_prompt": "invalid_request_error",
                      "server_is_overloaded": "overloaded_error", "slow_down": "overloaded_error"}
TEXT_FORMATS = ("text", "json_object", "json_schema")


def _input_parts(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A system, developer or user message's content as Responses input parts."""
    if isinstance(content, str) or content is None:
        return content or ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "input_text", "text": part["text"]})
        elif kind == "image_url":
            image = part["image_url"]
            url, detail = (image, None) if isinstance(image, str) else (image.get("url"), image.get("detail"))
            parts.append({"type": "input_image", "image_url": url, "detail": detail or "auto"})
        else:
            raise InvalidRequestError("Only text and image_url content can be sent to this upstream.",
                                      param=f"{param}[{j}]")
    return parts


def _text(content: Any, param: str) -> str:
    """An assistant's or a tool's content as one text."""
    if isinstance(content, str) or content is None:
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequestError("Only text content can be sent to this upstream.", param=f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def to_input_items(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as Responses input items (the module's docstring says how)."""
    items: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content, param = message.get("role"), message.get("content"), f"messages[{i}].content"
        if role in ("system", "developer", "user"):
            items.append({"type": "message", "role": role, "content": _input_parts(content, param)})
        elif role == "assistant":
            text = _text(content, param)
            if text or not message.get("tool_calls"):
                items.append({"type": "message", "role": "assistant", "content": text})
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                items.append({"type": "function_call", "call_id": call.get("id"), "name": function.get("name"),
                              "arguments": function.get("arguments") or ""})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": message.get("tool_call_id"),
                          "output": _text(content, param)})
        else:
            raise InvalidRequestError(f"Role {role!r} cannot be sent to this upstream.", param=f"messages[{i}].role")
    return items


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    # strict defaults to true in the Responses API (false in chat's): a chat caller's schema is
    # not held to strict mode unless it asked.
    return {"type": "function", "name": function["name"],
            **({"description": function["description"]} if function.get("description") else {}),
            "parameters": function.get("parameters") or {"type": "object", "properties": {}},
            "strict": function.get("strict") is True}


def _tool_choice(tool_choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(tool_choice, dict):
        return {"type": "function", "name": tool_choice["function"]["name"]}
    return tool_choice


def _text_format(response_format: dict[str, Any]) -> dict[str, Any]:
    if response_format.get("type") != "json_schema":
        return {"type": response_format["type"]}
    json_schema = response_format.get("json_schema") or {}
    fmt = {"type": "json_schema", "name": json_schema.get("name") or "response", "schema": json_schema.get("schema")}
    fmt.update({key: json_schema[key] for key in ("description", "strict") if json_schema.get(key) is not None})
    return fmt


def responses_body(job: GenerationJob, model: str) -> dict[str, Any]:
    params = job.params
    if job.kind != "chat" or not job.messages:
        raise InvalidRequestError("An OpenAI Responses upstream takes chat messages only.", param="prompt")
    response_format = job.response_format or {"type": "text"}
    refused = next((name for name, is_set in (
        ("stop", bool(params.stop)), ("logit_bias", bool(params.logit_bias)),
        ("response_format", response_format.get("type") not in TEXT_FORMATS)) if is_set), None)
    if refused is not None:
        raise InvalidRequestError(f"{refused} is not supported by this model's upstream (OpenAI Responses).",
                                  param=refused)
    body: dict[str, Any] = {"model": model, "input": to_input_items(job.messages), "store": False,
                            "temperature": params.temperature, "top_p": params.top_p}
    if params.max_tokens is not None:
        body["max_output_tokens"] = params.max_tokens
    if params.logprobs is not None:
        body.update(top_logprobs=params.logprobs, include=[INCLUDE_LOGPROBS])
    if job.tools:  # tool_choice without tools is a 400 at OpenAI
        body.update(tools=[_tool(tool) for tool in job.tools], tool_choice=_tool_choice(job.tool_choice),
                    parallel_tool_calls=job.parallel_tool_calls)
    if response_format.get("type") != "text":
        body["text"] = {"format": _text_format(response_format)}
    effort = reasoning_effort(job.thinking)
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    return body | upstream_tier(job) | ({"stream": True} if sends_stream(job) else {})


def _logprobs(entries: Any) -> tuple[dict[str, Any], ...] | None:
    """A text delta's logprobs in chat's entry shape (the Responses stream sends no bytes)."""
    if not entries:
        return None
    return tuple({"token": lp["token"], "logprob": lp["logprob"], "bytes": list(lp["token"].encode()),
                  "top_logprobs": [{"token": top["token"], "logprob": top["logprob"],
                                    "bytes": list(top["token"].encode())} for top in lp.get("top_logprobs") or ()]}
                 for lp in entries)


def _stream_error(name: str, error: Any) -> TokenwayError:
    """An error event's or a failed response's error, typed as upstream_errors maps error types."""
    error = dict(error) if isinstance(error, dict) else {"message": str(error)}
    code = error.get("code")
    if isinstance(code, str) and code in ERROR_CODE_TO_TYPE:
        error["type"] = ERROR_CODE_TO_TYPE[code]
    return stream_error(name, error)


class _ResponseReader:
    """One upstream response, streamed or whole, as choice `index`'s deltas. The Responses API counts
    output items (messages, calls, reasoning together); chat numbers tool calls alone:
    output_to_call maps them."""

    def __init__(self, name: str, index: int) -> None:
        self.name, self.index = name, index
        self.output_to_call: dict[int, int] = {}
        self.texts: list[str] = []
        self.usage: Usage | None = None
        self.ended = False  # response.completed or response.incomplete came

    def read(self, event: SSEEvent) -> ChoiceDelta | None:
        payload = parse_json_object(self.name, event.data)
        try:
            return self._read(payload.get("type") or event.event, payload)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BadGatewayError(f"Upstream {self.name} sent a malformed event ({type(exc).__name__}).") from None

    def read_response(self, response: dict[str, Any]) -> ChoiceDelta:
        """A non-streamed answer: its output items in one delta, as the events of its stream add up."""
        if response.get("status") == "failed" or response.get("error"):
            raise _stream_error(self.name, response.get("error"))
        try:
            return joined_delta(self.index, [self._read(kind, event) for kind, event in _as_events(response)])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BadGatewayError(f"Upstream {self.name} sent a malformed response ({type(exc).__name__}).") from None

    def _read(self, kind: str, payload: dict[str, Any]) -> ChoiceDelta | None:
        if kind == "error":
            raise _stream_error(self.name, payload)
        if kind == "response.failed":
            raise _stream_error(self.name, (payload.get("response") or {}).get("error"))
        if kind == "response.output_item.added" and payload["item"]["type"] == "function_call":
            item = payload["item"]
            call_index = self.output_to_call[int(payload["output_index"])] = len(self.output_to_call)
            return self._delta(tool_call=ToolCallDelta(call_index, id=item["call_id"], name=item["name"],
                                                       arguments=item.get("arguments") or ""))
        if kind == "response.function_call_arguments.delta":
            call_index = self.output_to_call[int(payload["output_index"])]
            return self._delta(tool_call=ToolCallDelta(call_index, arguments=payload["delta"]))
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            return self._delta(text=payload["delta"], logprobs=_logprobs(payload.get("logprobs")))
        if kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            return self._delta(reasoning=payload["delta"])
        if kind in FINAL_EVENTS:
            return self._end(payload["response"])
        # created, in_progress, the *.added / *.done that repeat what the deltas said, and
        # event kinds OpenAI may add
        return None

    def _delta(self, text: str = "", reasoning: str = "", tool_call: ToolCallDelta | None = None,
               logprobs: tuple[dict[str, Any], ...] | None = None) -> ChoiceDelta | None:
        if tool_call is not None:
            self.texts.append((tool_call.name or "") + tool_call.arguments)
            return ChoiceDelta(self.index, tool_calls=(tool_call,))
        if not (text or reasoning or logprobs):
            return None
        self.texts.append(reasoning + text)
        return ChoiceDelta(self.index, text=text, reasoning=reasoning, logprobs=logprobs)

    def _end(self, response: dict[str, Any]) -> ChoiceDelta:
        self.ended = True
        usage = response.get("usage")
        if isinstance(usage, dict) and "input_tokens" in usage:
            input_details = usage.get("input_tokens_details") or {}
            output_details = usage.get("output_tokens_details") or {}
            self.usage = Usage(int(usage["input_tokens"]), int(usage.get("output_tokens") or 0),
                               cached_tokens=int(input_details.get("cached_tokens") or 0),
                               reasoning_tokens=int(output_details.get("reasoning_tokens") or 0))
        if response.get("status") == "incomplete":
            reason = (response.get("incomplete_details") or {}).get("reason")
            finish_reason = INCOMPLETE_REASONS.get(reason, "length") if isinstance(reason, str) else "length"
        else:
            finish_reason = "tool_calls" if self.output_to_call else "stop"
        return ChoiceDelta(self.index, finish_reason=finish_reason)


def _as_events(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A whole response as the events its stream would have sent, each piece whole in one
    delta (a call's arguments in its output_item.added), so one reader reads both."""
    events: list[tuple[str, dict[str, Any]]] = []
    for output_index, item in enumerate(response["output"]):
        if item["type"] == "function_call":
            events.append(("response.output_item.added", {"output_index": output_index, "item": item}))
        elif item["type"] == "message":
            events += [("response.output_text.delta", {"delta": part["text"], "logprobs": part.get("logprobs")})
                       if part["type"] == "output_text" else ("response.refusal.delta", {"delta": part["refusal"]})
                       for part in item["content"] if part["type"] in ("output_text", "refusal")]
        elif item["type"] == "reasoning":
            parts = (*(item.get("content") or ()), *(item.get("summary") or ()))
            events += [("response.reasoning_text.delta", {"delta": part["text"]})
                       for part in parts if part["type"] in ("reasoning_text", "summary_text")]
    final = "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
    return [*events, (final, {"response": response})]


class ResponsesUpstream(HTTPReplica):
    """An OpenAI Responses API upstream as a replica: `model` is the upstream's name for it, the
    key (from the variable `api_key_env` names) goes as a Bearer token, `count_tokens` counts
    usage with the model's tokenizer when the upstream reports none. Call aclose() when done
    with it: it owns a connection pool."""

    kind = "responses"

    def __init__(self, name: str, base_url: str, model: str, api_key_env: str | None = None, *,
                 timeouts: UpstreamTimeouts = UpstreamTimeouts(), limits: ConnectionLimits = ConnectionLimits(),
                 count_tokens: CountTokens | None = None, health_path: str = "models") -> None:
        api_key = api_key_from_env(api_key_env)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.name, self.model = name, model
        self.http = UpstreamHTTP(name, base_url, headers, timeouts, limits, health_path)
        self._count_tokens = count_tokens

    def __repr__(self) -> str:
        return f"ResponsesUpstream(name={self.name!r}, base_url={self.http.base_url!r}, model={self.model!r})"

    def stats(self) -> None:
        """An upstream publishes no engine counts (Replica.stats)."""
        return None

    async def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]:
        body = responses_body(job, self.model)
        readers = [_ResponseReader(self.name, index) for index in range(job.n)]
        events = one_call_a_choice(
            [self._call(body, job.deadline, reader) for reader in readers],
            lambda: [reader.usage or counted_usage(job, ["".join(reader.texts)], self._count_tokens)
                     for reader in readers])
        async with aclosing(events):
            async for event in events:
                yield event

    async def _call(self, body: dict[str, Any], deadline: float | None, reader: _ResponseReader
                    ) -> AsyncGenerator[ChoiceDelta, None]:
        if body.get("stream"):
            events = self.http.stream_events("responses", body, deadline, is_last=lambda event: reader.ended)
            async with aclosing(events):
                async for event in events:
                    if (delta := reader.read(event)) is not None:
                        yield delta
        else:
            yield reader.read_response(await self.http.post_json("responses", body, deadline))
        if not reader.ended:
            raise BadGatewayError(f"Upstream {self.name} ended the stream before the response finished.")
