"""What tokenway sends back on OpenAI's Responses routes, field for field as the openai SDK's
types name them (openai/types/responses/response.py, response_output_message.py,
response_function_tool_call.py, response_usage.py, response_stream_event.py, ...), and the
items a response stores (its input items and output items, as listed by input_items).

    Generation ─► server/responses_render.py ─► Response | ResponseStreamEvent ...
    ResponseStore ─► server/responses_api.py ─► Response | InputItemList | ResponseDeleted

TypedDicts, as protocol/openai_bodies.py's: a stream renders events per token, and a dict
literal pyright checks costs nothing at run time. Optional fields are sent as null, the key
present, as OpenAI sends them; tests/protocol/test_responses_bodies.py validates what the
server sends against the SDK's own types.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired

# pydantic (the tests' TypeAdapters) reads only typing_extensions' TypedDict before Python 3.12.
from typing_extensions import TypedDict

from tokenway.protocol.openai_bodies import ChatCompletionTokenLogprob, ServedTier

ResponseStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# A token's logprob is the same object in chat's logprobs and an output_text's: one type.
Logprob = ChatCompletionTokenLogprob


class DeltaTopLogprob(TypedDict):
    token: str
    logprob: float


class DeltaLogprob(TypedDict):
    """A streamed text delta's token: OpenAI sends these without the bytes."""

    token: str
    logprob: float
    top_logprobs: list[DeltaTopLogprob]


# ---- items --------------------------------------------------------------------------------------


class InputText(TypedDict):
    type: Literal["input_text"]
    text: str


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]  # always empty: no citations without hosted tools
    logprobs: list[Logprob]  # with include message.output_text.logprobs; else empty


class InputMessageItem(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["user", "system", "developer"]
    status: ItemStatus
    content: list[InputText]


class OutputMessageItem(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(TypedDict):
    id: str  # "fc_...": the item's own id
    type: Literal["function_call"]
    call_id: str  # "call_...": what the function_call_output answering it names
    name: str
    arguments: str  # JSON text, as the model wrote it
    status: ItemStatus
    namespace: NotRequired[str]  # only for a function of a namespace tool


class FunctionCallOutputItem(TypedDict):
    id: str
    type: Literal["function_call_output"]
    call_id: str
    output: str
    status: ItemStatus


class SummaryText(TypedDict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(TypedDict):
    """A reasoning model's thinking: its raw text as content (one reasoning_text part); summary
    always empty (a summary would take another model's call); encrypted_content, with include
    reasoning.encrypted_content, the same text in tokenway's envelope (responses_items.py):
    not encrypted, only carried back by clients that keep nothing else."""

    id: str
    type: Literal["reasoning"]
    summary: list[SummaryText]
    content: list[ReasoningText]
    encrypted_content: str | None
    status: ItemStatus


InputItem = InputMessageItem | OutputMessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
# What a response's output holds: a reasoning model's thinking first, then its message or calls.
OutputItem = OutputMessageItem | FunctionCallItem | ReasoningItem


# ---- the response -------------------------------------------------------------------------------


class InputTokensDetails(TypedDict):
    cached_tokens: int  # input tokens served from the prefix cache
    cache_write_tokens: int  # always 0: a prefix cache here costs nothing to write


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int  # of output_tokens, those a reasoning model spent thinking


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(TypedDict):
    code: str  # OpenAI's: server_error, rate_limit_exceeded, invalid_prompt ...
    message: str


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens", "content_filter"]


class ReasoningConfig(TypedDict):
    effort: str | None
    summary: str | None


class TextConfig(TypedDict):
    format: dict[str, Any]  # {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", ...}
    verbosity: str


class FunctionToolBody(TypedDict):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool


class NamespaceToolBody(TypedDict):
    type: Literal["namespace"]
    name: str
    description: str | None
    tools: list[FunctionToolBody]


class Response(TypedDict):
    id: str  # "resp_..."
    object: Literal["response"]
    created_at: int  # unix seconds
    status: ResponseStatus
    background: bool
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    reasoning: ReasoningConfig
    safety_identifier: str | None
    service_tier: ServedTier  # the tier that served it (gateway/tiers.py)
    store: bool  # not in the SDK's type; OpenAI sends it
    temperature: float
    text: TextConfig
    tool_choice: str | dict[str, Any]
    tools: list[FunctionToolBody | NamespaceToolBody]
    top_logprobs: int
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None  # None until it finishes
    user: str | None


class ResponseDeleted(TypedDict):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class InputItemList(TypedDict):
    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None  # None: an empty page
    last_id: str | None
    has_more: bool


class InputTokens(TypedDict):
    object: Literal["response.input_tokens"]
    input_tokens: int


# ---- stream events ------------------------------------------------------------------------------


LifecycleType = Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                        "response.failed", "response.queued"]


class LifecycleEvent(TypedDict):
    type: LifecycleType
    sequence_number: int
    response: Response


class OutputItemEvent(TypedDict):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(TypedDict):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(TypedDict):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[DeltaLogprob]


class TextDoneEvent(TypedDict):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[DeltaLogprob]


class ReasoningDeltaEvent(TypedDict):
    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(TypedDict):
    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(TypedDict):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(TypedDict):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(TypedDict):
    type: Literal["error"]
    sequence_number: int
    code: str | None
    message: str
    param: str | None


ResponseStreamEvent = (LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
                       | ReasoningDeltaEvent | ReasoningDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent
                       | ErrorEvent)
