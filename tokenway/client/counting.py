"""A chat request's prompt tokens, and its cost, before it is sent.

    RemoteCounter(openai.OpenAI(...)).count(request)    the server's /v1/tokenize, through the SDK
    LocalCounter("smollm2-135m-instruct").count(request) the model's own files, no server
    price_of(client, model) -> Price; price.cost(prompt_tokens, completion_tokens, cached_tokens)

`request` is what chat.completions.create takes (model, messages, tools, tool_choice,
parallel_tool_calls, response_format; other fields are ignored). Both counters count the
prompt the way tokenway's chat path templates it, tools and response_format included (the
server's /tokenize runs that path; LocalCounter runs the same code on the same files), so for
tokenway's models the count is the `usage.prompt_tokens` the call then reports.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import openai

_PROMPT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format")
# build_chat_prompt's (tools, tool_choice, parallel_tool_calls, response_format): frontend/templating.prompt_fields
PromptFields: TypeAlias = tuple[list[dict] | None, Any, bool | None, dict | None]


def tokenize_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The /tokenize body for a chat request: its prompt-shaping fields, as plain JSON."""
    body = {"model": request["model"]} if request.get("model") else {}
    for name in _PROMPT_FIELDS:
        value = request.get(name)
        if value is not None and value is not openai.NOT_GIVEN:
            body[name] = _plain(value)
    return body


def _plain(value: Any) -> Any:
    """SDK objects (a ChatCompletionMessage put back into messages) as the JSON they send."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is dict:
        if all(type(item) is str or item is None for item in value.values()):
            return value  # a plain message: validation reads it and copies nothing back
        return {key: _plain(item) for key, item in value.items()}
    if kind is list or kind is tuple:
        return [_plain(item) for item in value]
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return [_plain(item) for item in value] if isinstance(value, list) else value


class OverWindow(ValueError):
    """The server counts no further than the model's window: this request is over it."""


class RemoteCounter:
    """Counts through the server's POST /v1/tokenize, with the SDK's own HTTP client (its
    base URL, key, retries and timeouts). A request over the model's window raises OverWindow
    (the server refuses to count further, as vLLM's /tokenize does); LocalCounter counts any
    length."""

    def __init__(self, client: openai.OpenAI | openai.AsyncOpenAI) -> None:
        self.client = client

    def count(self, request: Mapping[str, Any]) -> int:
        if not isinstance(self.client, openai.OpenAI):
            raise TypeError("count: needs an openai.OpenAI client; with an AsyncOpenAI one, use count_async")
        try:
            # cast_to=object: the JSON body as it came.
            body: Any = self.client.post("/tokenize", body=tokenize_body(request), cast_to=object)
        except openai.BadRequestError as exc:
            raise _over_window(exc) from None
        return int(body["count"])

    async def count_async(self, request: Mapping[str, Any]) -> int:
        if not isinstance(self.client, openai.AsyncOpenAI):
            raise TypeError("count_async: needs an openai.AsyncOpenAI client; with an OpenAI one, use count")
        try:
            body: Any = await self.client.post("/tokenize", body=tokenize_body(request), cast_to=object)
        except openai.BadRequestError as exc:
            raise _over_window(exc) from None
        return int(body["count"])


def _over_window(exc: openai.BadRequestError) -> Exception:
    return OverWindow(exc.message) if exc.code == "context_length_exceeded" else exc


class LocalCounter:
    """Counts with the model's own tokenizer and chat template, read from the files the engine
    loads (a GGUF, or a HuggingFace directory), through the same templating code as the
    server; no server. `tool_parser`: as the server's --tool-parser, where it sets one.

    A conversation is counted again and again as it grows, and fit() counts it cut several
    ways, so the work per message is remembered: each message is validated and turned into
    its template dict once (kept while it stays equal to what was seen), each prompt field
    set once, and the tokenizer keeps its segments' ids (exact, or not enabled at all)."""

    def __init__(self, model: str, tool_parser: str | None = None) -> None:
        from tokenway.frontend.model import ModelFrontend
        from tokenway.models.loader import resolve_model

        self.frontend = ModelFrontend.from_dir(resolve_model(model))
        self.frontend.tokenizer.enable_segment_cache()
        self.tool_parser = tool_parser
        self._message_id_to_template: dict[int, tuple[Any, dict]] = {}  # id -> (the message as seen, its dict)
        self._fields_to_prompt_fields: dict[str, PromptFields] = {}  # the fields' JSON -> build_chat_prompt's args

    def count(self, request: Mapping[str, Any]) -> int:
        from tokenway.frontend.templating import templated_token_ids

        messages = request["messages"]
        if not messages:
            raise ValueError("messages: must have at least 1 item(s)")
        template = [self._template_dict(message) for message in messages]
        return len(templated_token_ids(self.frontend, template, *self._prompt_fields(request), self.tool_parser,
                                       window_limit=False))

    def _template_dict(self, message: Any) -> dict:
        """The message as the server templates it (validated as the server validates it)."""
        from tokenway.protocol.openai_messages import ChatMessage

        dumped = None if type(message) is dict else _plain(message)  # an SDK object: compared as it dumps now
        comparable = message if dumped is None else dumped
        seen = self._message_id_to_template.get(id(message))
        if seen is not None and seen[0] == comparable:  # equal to what was seen: a changed message is redone
            return seen[1]
        template = ChatMessage.model_validate(_plain(message) if dumped is None else dumped).to_template_dict()
        if len(self._message_id_to_template) >= _MAX_REMEMBERED:
            self._message_id_to_template.clear()
        self._message_id_to_template[id(message)] = (copy.deepcopy(comparable), template)
        return template

    def _prompt_fields(self, request: Mapping[str, Any]) -> PromptFields:
        from tokenway.frontend.templating import prompt_fields
        from tokenway.protocol.openai_requests import TokenizeRequest

        fields = tokenize_body({name: value for name, value in request.items() if name != "messages"})
        key = json.dumps(fields, sort_keys=True, default=str)
        cached = self._fields_to_prompt_fields.get(key)
        if cached is None:
            body = TokenizeRequest.model_validate({**fields, "messages": [{"role": "user", "content": ""}]})
            if len(self._fields_to_prompt_fields) >= _MAX_REMEMBERED:
                self._fields_to_prompt_fields.clear()
            cached = self._fields_to_prompt_fields[key] = prompt_fields(body)
        return cached


_MAX_REMEMBERED = 50_000


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens, as the server's /v1/models shows a model's `pricing`."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int = 0, cached_tokens: int = 0) -> float:
        """USD for a call: cached prompt tokens at cached_input, the rest at input, output at output."""
        return ((prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                + completion_tokens * self.output) / 1_000_000


def price_of(client: openai.OpenAI, model: str) -> Price:
    """The model's prices from the server (free where it sets none)."""
    card = client.models.retrieve(model)
    pricing = (card.model_extra or {}).get("pricing") or {}
    return Price(**{key: float(pricing.get(key, 0.0)) for key in ("input", "cached_input", "output")})
