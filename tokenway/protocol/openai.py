"""The OpenAI-compatible wire schemas, in one namespace.

    request body ──► ChatCompletionRequest | CompletionRequest    (openai_requests.py, built from
                                                                  openai_messages.py's parts)
    gateway      ──► frontend: req.template_messages(), req.template_tools(), sampling fields
    response     ◄── ChatCompletion | ChatCompletionChunk | Completion | CompletionChunk, ModelList ...
                                                 (openai_bodies.py: TypedDicts the renderers return)

A failed parse is a pydantic.ValidationError; errors.from_validation_error makes it a 400.
"""

from tokenway.protocol.openai_bodies import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionTokenLogprob,
    ChatFinishReason,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionFinishReason,
    CompletionLogprobs,
    CompletionUsage,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeResponse,
    ToolCallFunction,
    TopLogprob,
)
from tokenway.protocol.openai_messages import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedToolChoice,
    RefusalPart,
    ResponseFormat,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    ResponseFormatText,
    StreamOptions,
    TextPart,
    Tool,
    ToolCall,
)
from tokenway.protocol.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)

__all__ = [
    "ChatCompletion", "ChatCompletionChoice", "ChatCompletionChunk", "ChatCompletionChunkChoice",
    "ChatCompletionMessage", "ChatCompletionMessageToolCall", "ChatCompletionRequest", "ChatCompletionTokenLogprob",
    "ChatFinishReason", "ChatMessage", "ChoiceDelta", "ChoiceDeltaToolCall", "ChoiceDeltaToolCallFunction",
    "ChoiceLogprobs", "Completion", "CompletionChoice", "CompletionChunk", "CompletionChunkChoice",
    "CompletionFinishReason", "CompletionLogprobs", "CompletionRequest", "CompletionUsage", "ContentPart",
    "DetokenizeRequest", "DetokenizeResponse", "FunctionCall", "FunctionDefinition", "JSONSchemaFormat", "ModelCard",
    "ModelList", "NamedToolChoice", "PromptTokensDetails", "RefusalPart", "ResponseFormat", "ResponseFormatJSONObject",
    "ResponseFormatJSONSchema", "ResponseFormatText", "SamplingRequest", "StreamOptions", "TextPart",
    "TokenizeRequest", "TokenizeResponse", "Tool", "ToolCall", "ToolCallFunction", "TopLogprob",
]
