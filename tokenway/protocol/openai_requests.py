"""OpenAI-compatible request bodies: /v1/chat/completions, /v1/completions, /tokenize, /detokenize.

Checked at the edge, once: a body that parses here is well-formed (ranges, shapes, tool
schemas, cross-field rules), and one that does not raises pydantic.ValidationError, which
errors.from_validation_error turns into one 400 naming the field. What stays for later stages
is what needs the model: the context window, token ids in range, tool-template support.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tokenway.protocol.errors import short_repr
from tokenway.protocol.openai_messages import (
    MAX_COUNT,
    ChatMessage,
    NamedToolChoice,
    Penalty,
    PositiveInt,
    Probability,
    RequestModel,
    ResponseFormat,
    Seed,
    StreamOptions,
    TokenId,
    Tool,
    check_stop,
    fail,
)
from tokenway.protocol.sampling import EFFORT_BUDGETS, ThinkingRequest, effort_thinking

MAX_N = 16
MAX_TOP_LOGPROBS = 20
# Token ids in one body: above any window served here (a longer prompt could only be refused
# later), and a bound on what a body decoded off the event loop hands back to it.
MAX_TOKEN_IDS = 2**17
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]
# The tier a call asks to run at, as OpenAI names them (gateway/tiers.py: what each runs as).
ServiceTier = Literal["auto", "default", "flex", "priority", "scale"]


class SamplingRequest(RequestModel):
    """The fields /v1/chat/completions and /v1/completions share. Subclass fields come after
    these, so their validators can read n and stream from info.data."""

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT)] | None = None  # vLLM extension; -1 and 0 disable
    min_p: Probability | None = None  # vLLM extension
    seed: Seed | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None  # vLLM extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # vLLM extension
    min_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None  # vLLM extension; <= max_tokens
    stop_token_ids: TokenIds | None = None  # vLLM extension
    service_tier: ServiceTier | None = None  # None: auto
    # Accepted and ignored: they change nothing a single self-hosted server does.
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        return check_stop(value)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or ():
            if not key.isascii() or not key.isdigit():
                raise fail("logit_bias_key", "keys must be token ids (decimal integers as strings), got {got}",
                           got=short_repr(key))
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise fail("stream_options", "is only allowed when stream is true")
        return value

    @property
    def logit_bias_by_token_id(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {int(key): bias for key, bias in self.logit_bias.items()}


# Known OpenAI parameters this server cannot honour: a 400 naming them beats silently ignoring.
_UNSUPPORTED_CHAT_PARAMS = (
    "audio", "modalities", "prediction", "web_search_options", "functions", "function_call",
)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the last (assistant) message is the reply's beginning, which goes on from it.
    continue_final_message: bool = False
    # A reasoning model's thinking: OpenAI's effort (a budget, or "none": off where the template
    # can turn it off), and vLLM's variables for the chat template (enable_thinking).
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored, as above.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    # Rejected when set (see _UNSUPPORTED_CHAT_PARAMS).
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template_dict() for message in self.messages]

    @property
    def thinking(self) -> ThinkingRequest | None:
        """What the call asks of a reasoning model's thinking (None: the model's default)."""
        return effort_thinking(self.reasoning_effort)

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise fail("top_logprobs", "requires logprobs to be true")
        return value

    @model_validator(mode="after")
    def _continues_an_assistant_message(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise fail("continue_final_message",
                       "continue_final_message needs the last message to be the assistant's reply begun")
        return self

    @field_validator("reasoning_effort")
    @classmethod
    def _effort_level(cls, value: str | None) -> str | None:
        if value is not None and value not in EFFORT_BUDGETS:
            raise fail("reasoning_effort", "must be one of {levels}, got {got}",
                       levels=", ".join(EFFORT_BUDGETS), got=short_repr(value))
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or ()]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise fail("duplicate_tool", "function names must be unique; {name} appears twice",
                       name=short_repr(duplicate))
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, dict) or value in ("none", "auto", "required"):
            return value
        raise fail("tool_choice", "must be 'none', 'auto', 'required' or a named function, got {got}",
                   got=short_repr(value))

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:  # tools themselves failed; that error is the one to report
            return value
        names = [tool.function.name for tool in info.data["tools"] or ()]
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise fail("tool_choice", "names function {name}, which is not in tools",
                       name=short_repr(value.function.name))
        if value == "required" and not names:
            raise fail("tool_choice", "'required' needs at least one tool in tools")
        return value

    @field_validator(*_UNSUPPORTED_CHAT_PARAMS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or info.field_name == "modalities" and value == ["text"]:
            return value
        raise fail("unsupported_parameter", "is not supported by this server")


class CompletionRequest(SamplingRequest):
    """The legacy /v1/completions body."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: PositiveInt | None = 16  # None: up to the context window
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: PositiveInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], list):
            num_ids = sum(len(item) if isinstance(item, list) else 1 for item in value)
        else:
            num_ids = len(value) if isinstance(value, list) else 0
        if num_ids > MAX_TOKEN_IDS:
            raise fail("too_many_token_ids", "must hold at most {n} token ids, got {got}", n=MAX_TOKEN_IDS, got=num_ids)
        if isinstance(value, str):
            if not value:
                raise fail("empty_prompt", "must not be empty")
            return value
        if isinstance(value, list) and value:
            if all(isinstance(item, str) and item for item in value):
                return value
            if all(_is_token_id(item) for item in value):
                return value
            if all(isinstance(item, list) and item and all(_is_token_id(i) for i in item) for item in value):
                return value
        raise fail("prompt", "must be a non-empty string, list of strings, list of token ids (integers >= 0), "
                   "or list of token-id lists")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise fail("unsupported_parameter", "is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value < n:
            raise fail("best_of", "must be >= n ({n}), got {got}", n=n, got=value)
        if value is not None and value > n:
            raise fail("unsupported_parameter", "greater than n is not supported by this server")
        return value

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """One entry per prompt: strings, or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        # A list holds one kind (the field's union): token ids are one prompt, else one prompt each.
        if self.prompt and isinstance(self.prompt[0], int):
            return [cast("list[int]", self.prompt)]
        return cast("list[str] | list[list[int]]", self.prompt)


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: either a prompt or chat messages (rendered with the chat template).
    With messages, the chat fields that shape the prompt (tools, tool_choice,
    parallel_tool_calls, response_format) count as a chat call with them is templated."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise fail("prompt_or_messages", "send exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: TokenIds
