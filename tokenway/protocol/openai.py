"""The OpenAI-compatible wire schemas, in one namespace.

    request body ──► ChatCompletionRequest | CompletionRequest    (openai_requests.py, built from
                                                                  openai_messages.py's parts)
    gateway      ──► frontend: req.template_messages(), req.template_tools(), sampling fields
    response     ◄── ChatCompletion | ChatCompletionChunk | Completion | CompletionChunk
                                                                 (openai_responses.py)

A failed parse is a pydantic.ValidationError; errors.from_validation_error makes it a 400.
"""

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
from tokenway.protocol.openai_responses import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChoiceDelta,
    ChoiceDeltaFunction,
    ChoiceDeltaToolCall,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    DetokenizeResponse,
    FunctionCallOut,
    Model,
    ModelList,
    PromptTokensDetails,
    TokenizeResponse,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    Usage,
)

__all__ = [
    "ChatCompletion", "ChatCompletionChoice", "ChatCompletionChunk", "ChatCompletionChunkChoice",
    "ChatCompletionMessage", "ChatCompletionRequest", "ChatMessage", "ChoiceDelta", "ChoiceDeltaFunction",
    "ChoiceDeltaToolCall", "ChoiceLogprobs", "Completion", "CompletionChoice", "CompletionChunk",
    "CompletionChunkChoice", "CompletionLogprobs", "CompletionRequest", "ContentPart", "DetokenizeRequest",
    "DetokenizeResponse", "FunctionCall", "FunctionCallOut", "FunctionDefinition", "JSONSchemaFormat", "Model",
    "ModelList", "NamedToolChoice", "PromptTokensDetails", "RefusalPart", "ResponseFormat",
    "ResponseFormatJSONObject", "ResponseFormatJSONSchema", "ResponseFormatText", "SamplingRequest",
    "StreamOptions", "TextPart", "TokenLogprob", "TokenizeRequest", "TokenizeResponse", "Tool", "ToolCall",
    "ToolCallOut", "TopLogprob", "Usage",
]
