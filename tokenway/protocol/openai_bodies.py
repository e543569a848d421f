"""What tokenway sends back on OpenAI's routes, field for field as the openai SDK's types name
them (openai/types/chat/chat_completion.py, chat_completion_chunk.py, completion.py,
completion_usage.py, model.py), plus vLLM's /tokenize and /detokenize bodies.

    Generation ─► server/openai_render.py ─► ChatCompletion | ChatCompletionChunk ...
                                             | Completion | CompletionChunk
    catalog    ─► server/models_api.py   ─► ModelList | ModelCard | TokenizeResponse | DetokenizeResponse

These are TypedDicts, not pydantic models: a stream renders one chunk per token for every
stream, and a dict literal checked by pyright costs nothing at run time. A content chunk, built
and encoded as an SSE event: 6.2 us as a dict, 13.6 us as a pydantic model (bench/render_chunk.py).
Each renderer's return type is one of these, so pyright checks every key and value it writes.

OpenAI's optional fields are sent as null, the key present. A stream's delta is the exception:
it carries only what changed (NotRequired), as OpenAI sends it. tests/protocol/ validate what
the server sends against the SDK's own types, unknown keys included.
"""

from __future__ import annotations

from typing import Literal, NotRequired

# pydantic (FastAPI's response models, the tests' TypeAdapters) reads only typing_extensions'
# TypedDict before Python 3.12.
from typing_extensions import TypedDict

ChatFinishReason = Literal["stop", "length", "tool_calls", "content_filter"]
CompletionFinishReason = Literal["stop", "length", "content_filter"]


class PromptTokensDetails(TypedDict):
    cached_tokens: int  # prompt tokens served from the prefix cache


class CompletionTokensDetails(TypedDict):
    reasoning_tokens: int  # of completion_tokens, those a reasoning model spent thinking


class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


# ---- logprobs -----------------------------------------------------------------------------------


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes (a token may be part of a character)


class ChatCompletionTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(TypedDict):
    content: list[ChatCompletionTokenLogprob]
    refusal: None  # tokenway refuses with finish_reason content_filter, never a refusal text


class CompletionLogprobs(TypedDict):
    """The legacy shape: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # token text -> logprob
    text_offset: list[int]  # each token's offset in the choice's text (after an echoed prompt)


# ---- chat ---------------------------------------------------------------------------------------


class ToolCallFunction(TypedDict):
    name: str
    arguments: str  # JSON text


class ChatCompletionMessageToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatCompletionMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None  # None only beside tool_calls
    refusal: None
    tool_calls: list[ChatCompletionMessageToolCall] | None
    # A reasoning model's thinking, where it thought: under both names clients read, llama.cpp's
    # and the first vLLM's (reasoning_content), and vLLM's and OpenRouter's now (reasoning).
    reasoning_content: NotRequired[str]
    reasoning: NotRequired[str]


# The tier that served a call (gateway/tiers.py openai_tier), on every completion and chunk.
ServedTier = Literal["default", "flex", "priority"]


class ChatCompletionChoice(TypedDict):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(TypedDict):
    id: str  # "chatcmpl-..."
    object: Literal["chat.completion"]
    created: int  # unix seconds
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    system_fingerprint: None
    service_tier: ServedTier


class ChoiceDeltaToolCallFunction(TypedDict):
    name: NotRequired[str]  # on a call's first piece only
    arguments: str


class ChoiceDeltaToolCall(TypedDict):
    index: int  # which call of this choice the piece extends
    id: NotRequired[str]  # on a call's first piece only, with type
    type: NotRequired[Literal["function"]]
    function: ChoiceDeltaToolCallFunction


class ChoiceDelta(TypedDict):
    role: NotRequired[Literal["assistant"]]  # on each choice's first chunk only
    content: NotRequired[str]
    reasoning_content: NotRequired[str]  # thinking, as the message's (both names)
    reasoning: NotRequired[str]
    tool_calls: NotRequired[list[ChoiceDeltaToolCall]]


class ChatCompletionChunkChoice(TypedDict):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: ChatFinishReason | None  # set on the choice's last chunk only


class ChatCompletionChunk(TypedDict):
    id: str  # the same for every chunk of one completion
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]  # empty on the last chunk under include_usage
    system_fingerprint: None
    service_tier: ServedTier
    # Only under stream_options.include_usage: null on every chunk but the last.
    usage: NotRequired[CompletionUsage | None]


# ---- legacy completions -------------------------------------------------------------------------


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: CompletionFinishReason


class Completion(TypedDict):
    id: str  # "cmpl-..."
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    system_fingerprint: None
    service_tier: ServedTier


class CompletionChunkChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: CompletionFinishReason | None


class CompletionChunk(TypedDict):
    """A streamed legacy completion: OpenAI names its object "text_completion" too."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    system_fingerprint: None
    service_tier: ServedTier
    usage: NotRequired[CompletionUsage | None]


# ---- models, tokenize ---------------------------------------------------------------------------


class ModelCard(TypedDict):
    """OpenAI's Model (id, object, created, owned_by) with tokenway's and vLLM's extensions."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: Literal["chat", "embeddings"]
    max_model_len: int  # vLLM's: the context window (an embeddings model's input limit)
    aliases: NotRequired[list[str]]  # chat: the other names that reach it
    pricing: NotRequired[dict[str, float]]  # chat, where the gateway prices it: USD per million tokens
    dimensions: NotRequired[int]  # embeddings: the vector's width


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(TypedDict):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(TypedDict):
    prompt: str
