"""The parts OpenAI-style request bodies are made of: chat messages, content parts, tools,
response formats, and the request base classes (also used by protocol/anthropic.py).

Rules for every request model: unknown top-level fields are rejected as OpenAI does
("Unrecognized request argument supplied"); nested objects ignore unknown keys (clients add
cache hints and the like); types are strict ("5" is not an integer, true is not a number).
Errors raised here are PydanticCustomErrors with short messages, so that
errors.from_validation_error can show them as they are.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, LiteralString, Union, get_args

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import CoreSchema, PydanticCustomError

from tokenway.protocol.errors import short_repr, truncate


class RequestModel(BaseModel):
    """A top-level request body: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class WireModel(BaseModel):
    """An object nested in a request: unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def fail(error_type: LiteralString, message: LiteralString, **context: Any) -> PydanticCustomError:
    return PydanticCustomError(error_type, message, context or None)


def tagged_union(*members: type[BaseModel], what: str, text_only: frozenset[str] = frozenset()) -> Any:
    """A union chosen by each object's "type". Unknown types fail with our own message (naming
    the type, and saying "text only" for images and audio) instead of pydantic's union dump."""
    # A member's `type` is a Literal of one kind, or of several that the member stands for alike.
    kind_to_tag = {kind: member.__name__ for member in members
                   for kind in get_args(member.model_fields["type"].annotation)}

    def check_kind(value: Any) -> Any:
        if not isinstance(value, dict):
            raise fail("object_type", "each {what} must be a JSON object, got {got}", what=what, got=short_repr(value))
        kind = value.get("type")
        if isinstance(kind, str) and kind in kind_to_tag:  # a list or object is no tag (nor hashable)
            return value
        if isinstance(kind, str) and kind in text_only:
            raise fail("text_only", "this model accepts text only; {what} type {got} is not supported",
                       what=what, got=short_repr(kind))
        expected = ", ".join(repr(k) for k in kind_to_tag)
        raise fail("unknown_type", "type must be one of {expected}, got {got}",
                   what=what, expected=expected, got=short_repr(kind))

    def tag_of(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return kind_to_tag.get(kind) if isinstance(kind, str) else None

    choices = tuple(Annotated[member, Tag(member.__name__)] for member in members)
    return Annotated[Union[choices], Discriminator(tag_of), BeforeValidator(check_kind)]  # noqa: UP007


@dataclass(frozen=True, slots=True)
class TaggedUnion:
    """`Annotated[A | B, TaggedUnion(what=...)]`: tagged_union(A, B, what=...) for pydantic,
    the plain union A | B for a type checker."""

    what: str
    text_only: frozenset[str] = frozenset()

    def __get_pydantic_core_schema__(self, source_type: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        members = get_args(source_type) or (source_type,)
        return handler.generate_schema(tagged_union(*members, what=self.what, text_only=self.text_only))


def check_json_schema(schema: dict[str, Any], *, object_root: bool = False) -> dict[str, Any]:
    error = _schema_error(schema)
    if error is not None:
        raise fail("invalid_json_schema", "is not a valid JSON schema: {reason}{where}",
                   reason=error[0], where=error[1]) from None
    if object_root and schema.get("type", "object") != "object":
        raise fail("invalid_json_schema", "must be a JSON schema of type 'object', got type {got}",
                   got=short_repr(schema["type"]))
    return schema


def _schema_error(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, where) of the schema's first error against the meta-schema, or None."""
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        text = None
    if text is not None and len(text) <= _CACHED_SCHEMA_CHARS:
        return _cached_schema_error(text)
    return _meta_schema_error(schema)


# Checking a schema against the meta-schema costs ~3 ms for a small tool, and the same tools come
# with every call of a conversation (and every count a client makes of it): verdicts are kept
# for the 256 most recent schemas of up to 64 KiB.
_CACHED_SCHEMA_CHARS = 65_536


@functools.lru_cache(maxsize=256)
def _cached_schema_error(text: str) -> tuple[str, str] | None:
    return _meta_schema_error(json.loads(text))


def _meta_schema_error(schema: Any) -> tuple[str, str] | None:
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return truncate(exc.message), "" if exc.json_path == "$" else f" at {truncate(exc.json_path)}"
    return None


# ---- shared field types -------------------------------------------------------------------------

Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # function and json_schema names
MAX_COUNT = 2**31 - 1  # any token count or id: far above every window and vocabulary, within int32
PositiveInt = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT)]
MAX_STOP_STRINGS = 16


def check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str) and value:
        return value
    if isinstance(value, list) and len(value) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in value):
        return value
    raise fail("stop", "must be a non-empty string or a list of at most {n} non-empty strings", n=MAX_STOP_STRINGS)


class StreamOptions(WireModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM extension: usage on every chunk


# ---- chat messages ------------------------------------------------------------------------------


class TextPart(WireModel):
    type: Literal["text"]
    text: str


class RefusalPart(WireModel):  # appears in assistant history the SDK echoes back
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | RefusalPart, TaggedUnion(
    "content part", text_only=frozenset({"image_url", "input_audio", "file", "image", "input_image", "audio"}))]


class FunctionCall(WireModel):
    name: str
    arguments: str  # JSON text, as the model produced it


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    # Field order matters: the checks below read fields declared before them.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    # An assistant turn's thinking passed back (a reasoning model's reply, as the server sent it):
    # llama.cpp's and the first vLLM's name, and vLLM's now. Other roles' are ignored.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_for_tool(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise fail("tool_call_id_required", "is required for role 'tool' messages")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (str, list)):
            raise fail("content_type", "must be a string or a list of content parts, got {got}", got=short_repr(value))
        return value

    @field_validator("content")
    @classmethod
    def _content_present(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and role is not None and "tool_calls" in info.data:
            if role != "assistant":
                raise fail("content_required", "is required for role '{role}' messages", role=role)
            if not info.data["tool_calls"]:
                raise fail("content_required", "is required for assistant messages without tool_calls")
        return value

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text if isinstance(part, TextPart) else part.refusal for part in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        """The OpenAI-style dict our chat templates take: content always a string, "developer"
        (OpenAI's newer name for system) as "system", which templates know, and an assistant
        turn's thinking where it is passed back."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and self.role == "assistant":
            # Under both names: Qwen3's template reads reasoning_content, vLLM hands templates reasoning.
            message["reasoning_content"] = message["reasoning"] = thinking
        return message


# ---- tools and response formats -----------------------------------------------------------------


class FunctionDefinition(WireModel):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return value if value is None else check_json_schema(value, object_root=True)


class Tool(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormatText(WireModel):
    type: Literal["text"]


class ResponseFormatJSONObject(WireModel):
    type: Literal["json_object"]


class JSONSchemaFormat(WireModel):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return value if value is None else check_json_schema(value)


class ResponseFormatJSONSchema(WireModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           TaggedUnion("response_format")]
