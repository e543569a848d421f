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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import openai

_PROMPT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format")


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
        try:
            return int(self.client.post("/tokenize", body=tokenize_body(request), cast_to=object)["count"])
        except openai.BadRequestError as exc:
            raise _over_window(exc) from None

    async def count_async(self, request: Mapping[str, Any]) -> int:
        try:
            return int((await self.client.post("/tokenize", body=tokenize_body(request), cast_to=object))["count"])
        except openai.BadRequestError as exc:
            raise _over_window(exc) from None


def _over_window(exc: openai.BadRequestError) -> Exception:
    return OverWindow(exc.message) if exc.code == "context_length_exceeded" else exc


class LocalCounter:
    """Counts with the model's own tokenizer and chat template, read from the files the engine
    loads (a GGUF, or a HuggingFace directory), through the same templating code as the
    server; no server. `tool_parser`: as the server's --tool-parser, where it sets one."""

    def __init__(self, model: str, tool_parser: str | None = None) -> None:
        from tokenway.frontend.model import ModelFrontend
        from tokenway.models.loader import resolve_model

        self.frontend = ModelFrontend.from_dir(resolve_model(model))
        # A conversation is counted again and again as it grows, and fit() counts it cut
        # several ways: its turns' ids are remembered (exact, or not enabled at all).
        self.frontend.tokenizer.enable_segment_cache()
        self.tool_parser = tool_parser

    def count(self, request: Mapping[str, Any]) -> int:
        from tokenway.protocol.openai_requests import TokenizeRequest
        from tokenway.server.openai_api import tokenize

        body = TokenizeRequest.model_validate(tokenize_body(request))
        return len(tokenize(self.frontend, body, self.tool_parser, window_limit=False))


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
