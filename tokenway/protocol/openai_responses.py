"""OpenAI-compatible response bodies, field for field as the openai SDK's types name them
(openai/types/chat/chat_completion.py, chat_completion_chunk.py, completion.py,
completion_usage.py, model.py), plus vLLM's /tokenize and /detokenize responses.

Optional fields default to None and are sent as null, as OpenAI does; a streamed chunk's
delta is the exception (send it with exclude_none so a delta carries only what changed).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

ChatFinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]
CompletionFinishReason = Literal["stop", "length", "content_filter"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# ---- logprobs -----------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # UTF-8 bytes of the token (a token may be part of a character)


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy shape: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None for the first echoed token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# ---- chat ---------------------------------------------------------------------------------------


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason


class ChatCompletion(BaseModel):
    id: str  # "chatcmpl-..."
    object: Literal["chat.completion"] = "chat.completion"
    created: int  # unix seconds
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


class ChoiceDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ChoiceDeltaToolCall(BaseModel):
    index: int  # which tool call of this choice the fragment extends
    id: str | None = None  # only on a call's first fragment
    type: Literal["function"] | None = None
    function: ChoiceDeltaFunction | None = None


class ChoiceDelta(BaseModel):
    role: Literal["developer", "system", "user", "assistant", "tool"] | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str  # the same for every chunk of one completion
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]  # empty on the final usage-only chunk
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


# ---- legacy completions -------------------------------------------------------------------------


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason


class Completion(BaseModel):
    id: str  # "cmpl-..."
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason | None = None


class CompletionChunk(BaseModel):
    """A streamed legacy completion: OpenAI sends object "text_completion" here too."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---- models, tokenize ---------------------------------------------------------------------------


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None  # vLLM extension: the context window


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
