"""OpenAI's Responses API request bodies: POST /v1/responses and /v1/responses/input_tokens.

    body ──► ResponsesRequest (input: a string, or items: protocol/responses_items.py)
         ──► .input_items(new_id): the items as stored and listed (protocol/responses_bodies.py's
             InputItem dicts, each with its id) ──► server/responses_prepare.py: the chat path's
             messages and tools

Every field of OpenAI's reference is accepted: what changes the reply is honoured (input,
instructions, previous_response_id, tools, tool_choice, parallel_tool_calls, text.format,
max_output_tokens, temperature, top_p, top_logprobs, truncation, include's logprobs and
reasoning.encrypted_content, reasoning.effort, store, background, metadata, service_tier); what a
self-hosted server has no use for (prompt_cache_key, reasoning.summary, safety_identifier,
...) is accepted and echoed. A tool it cannot give the model (OpenAI's built-in tools,
web_search, file_search, ..., and the client tools with call shapes of their own: custom,
shell, apply_patch, ...) is left out of the prompt, as Ollama and LM Studio do, since agents
(OpenAI's Codex CLI) list web_search with every request: the response's
x-tokenway-omitted-tools header and the trace name it. What it cannot do is a 400 naming it:
a tool_choice that names such a tool, built-in tools' items, stored prompt templates, the
Conversations API, item references, image and file inputs.

The rules of protocol/openai_messages.py hold: unknown top-level fields are an error, nested
objects ignore unknown keys, types are strict.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator

from tokenway.protocol.errors import short_repr
from tokenway.protocol.openai_messages import (
    Name,
    PositiveInt,
    RequestModel,
    TaggedUnion,
    WireModel,
    check_json_schema,
    fail,
)
from tokenway.protocol.openai_requests import ServiceTier
from tokenway.protocol.responses_bodies import InputItem
from tokenway.protocol.responses_items import InputItemModel, NewId, string_type
from tokenway.protocol.sampling import ThinkingRequest, effort_thinking

MAX_TOP_LOGPROBS = 20
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_INPUT_ITEMS = 2**14  # far above any window's worth of turns; a bound on what one body makes us build
# Tools other than functions: OpenAI's built-in (hosted) tools, and the client tools with a shape
# of their own (free-form input, shell actions, patches). Left out of the prompt; a tool_choice
# that names one is a 400.
OmittedToolType = Literal[
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "computer", "computer_use", "computer_use_preview", "code_interpreter", "image_generation", "mcp",
    "local_shell", "shell", "apply_patch", "custom", "tool_search", "programmatic_tool_calling",
]
OMITTED_TOOLS: frozenset[str] = frozenset(get_args(OmittedToolType))
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"


# ---- tools, tool_choice, text -------------------------------------------------------------------


class FunctionTool(WireModel):
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return value if value is None else check_json_schema(finite(value), object_root=True)

    def chat_tool(self) -> dict[str, Any]:
        """The tool in the chat path's shape (OpenAI chat's {"type", "function": {...}})."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


def _tool_type(value: Any) -> Any:
    """Named here, not by the union: its list of every built-in type would hide what was sent."""
    kind = string_type(value).get("type") if isinstance(value, dict) else None
    if isinstance(value, dict) and kind not in ("function", "namespace") and kind not in OMITTED_TOOLS:
        raise fail("unknown_type", "type must be 'function', 'namespace' or one of OpenAI's built-in tools (which "
                   "this server leaves out of the prompt), got {got}", got=short_repr(kind))
    return value


class OmittedTool(WireModel):
    """A tool the model is not shown: one of OpenAI's built-in tools, which run on OpenAI's side,
    or a client tool whose calls are not functions. Its other fields are not read."""

    type: OmittedToolType
    name: str | None = None  # a custom tool's; the built-in ones have none


class NamespaceTool(WireModel):
    """Function tools grouped under one name: each is shown to the model as a function of its
    own, and a call of one names its namespace."""

    type: Literal["namespace"]
    name: Name
    description: str | None = None
    tools: list[Annotated[Annotated[FunctionTool | OmittedTool, TaggedUnion("tool")], BeforeValidator(_tool_type)]]

    @property
    def functions(self) -> list[FunctionTool]:
        return [tool for tool in self.tools if isinstance(tool, FunctionTool)]


ToolModel = Annotated[Annotated[FunctionTool | NamespaceTool | OmittedTool, TaggedUnion("tool")],
                      BeforeValidator(_tool_type)]


class FunctionChoice(WireModel):
    type: Literal["function"]
    name: str


class AllowedTool(WireModel):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(WireModel):
    """Only these tools may be called: the others stay defined, and the prompt shows only these."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


def _tool_choice_shape(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    kind = string_type(value).get("type") if isinstance(value, dict) else None
    if kind in OMITTED_TOOLS:  # listed, it is left out; forced, the call could only fail
        raise fail("unsupported_tool", "names tool {got}, which this server does not run: it runs function tools "
                   "(type 'function', alone or in a namespace), which your code executes; OpenAI's built-in tools "
                   "run on OpenAI's side", got=short_repr(kind))
    if kind in ("function", "allowed_tools"):
        return value
    raise fail("tool_choice", "must be 'none', 'auto', 'required', a function ({{\"type\": \"function\", \"name\": "
               "...}}) or allowed_tools, got {got}", got=short_repr(value))


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | Annotated[FunctionChoice | AllowedToolsChoice, TaggedUnion("tool_choice")],
    BeforeValidator(_tool_choice_shape)]


class TextFormatText(WireModel):
    type: Literal["text"]


class TextFormatJSONObject(WireModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(WireModel):
    type: Literal["json_schema"]
    name: Name
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(finite(value))


class TextConfig(WireModel):
    format: Annotated[Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema,
                                TaggedUnion("text.format")], BeforeValidator(string_type)] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(WireModel):
    # A reasoning model's thinking budget (sampling.effort_thinking); "none" turns thinking off.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # accepted; no summary is made (it would take another model's call)
    generate_summary: str | None = None


Tool = FunctionTool | NamespaceTool | OmittedTool


def function_tools(tools: list[Tool] | None) -> list[tuple[str | None, FunctionTool]]:
    """Every function tool with its namespace (None: none), in order."""
    flat: list[tuple[str | None, FunctionTool]] = []
    for tool in tools or ():
        if isinstance(tool, FunctionTool):
            flat.append((None, tool))
        elif isinstance(tool, NamespaceTool):
            flat += [(tool.name, inner) for inner in tool.functions]
    return flat


def omitted_tools(tools: list[Tool] | None) -> tuple[str, ...]:
    """The types of the tools left out of the prompt, each once, in order (a namespace's too)."""
    kinds = [inner.type for tool in tools or () for inner in (tool.tools if isinstance(tool, NamespaceTool) else
                                                               (tool,)) if isinstance(inner, OmittedTool)]
    return tuple(dict.fromkeys(kinds))


def finite(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema the response echoes back must be JSON: NaN and Infinity (which Python's JSON
    parser reads) are not, and neither the response nor its store could hold them."""
    try:
        json.dumps(schema, allow_nan=False)
    except ValueError:
        raise fail("invalid_json_schema", "must not hold NaN or Infinity") from None
    return schema


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's metadata rules (responses, batches): at most 16 pairs, keys of 64 characters, values of 512."""
    if value is None:
        return value
    if len(value) > MAX_METADATA_PAIRS:
        raise fail("metadata", "may hold at most {n} pairs, got {got}", n=MAX_METADATA_PAIRS, got=len(value))
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise fail("metadata", "keys may have at most {n} characters, got {got}", n=MAX_METADATA_KEY_CHARS,
                       got=short_repr(key))
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise fail("metadata", "values may have at most {n} characters", n=MAX_METADATA_VALUE_CHARS)
    return value


# ---- the bodies ---------------------------------------------------------------------------------


class ResponsesPrompt(RequestModel):
    """What shapes a response's prompt; POST /v1/responses/input_tokens takes exactly these."""

    model: str | None = None  # None: the previous response's
    input: str | Annotated[list[InputItemModel], Field(max_length=MAX_INPUT_ITEMS)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ToolModel] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: Reasoning | None = None
    # Refused when set: what they name lives on OpenAI's side.
    conversation: str | dict[str, Any] | None = None

    @field_validator("input")
    @classmethod
    def _unique_item_ids(cls, value: str | list[Any] | None) -> str | list[Any] | None:
        seen: set[str] = set()
        for item in value if isinstance(value, list) else ():
            if item.id in seen:
                raise fail("duplicate_item", "item ids must be unique; {id} appears twice", id=short_repr(item.id))
            if item.id is not None:
                seen.add(item.id)
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        seen: set[str] = set()
        for _, tool in function_tools(value):
            if tool.name in seen:
                raise fail("duplicate_tool", "function names must be unique (namespaces included); {name} appears "
                           "twice", name=short_repr(tool.name))
            seen.add(tool.name)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:  # tools themselves failed; that error is the one to report
            return value
        names = {tool.name for _, tool in function_tools(info.data["tools"])}
        named = [value.name] if isinstance(value, FunctionChoice) else \
            [tool.name for tool in value.tools] if isinstance(value, AllowedToolsChoice) else []
        for name in named:
            if name not in names:
                raise fail("tool_choice", "names function {name}, which is not in tools", name=short_repr(name))
        if value == "required" and not names:
            raise fail("tool_choice", "'required' needs at least one tool in tools")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, value: Any) -> Any:
        if value is not None:
            raise fail("unsupported_parameter", "the Conversations API is not served here: continue a stored "
                       "response with previous_response_id, or send the items")
        return value

    def input_items(self, new_id: NewId) -> list[InputItem]:
        """The input as items, each with its id (a string input is one user message)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"id": new_id("msg_"), "type": "message", "role": "user", "status": "completed",
                     "content": [{"type": "input_text", "text": self.input}]}]
        return [item.item(new_id) for item in self.input]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows, in the chat path's shape: allowed_tools' subset, none under 'none'."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        allowed = {tool.name for tool in choice.tools} if isinstance(choice, AllowedToolsChoice) else None
        return [tool.chat_tool() for _, tool in function_tools(self.tools)
                if allowed is None or tool.name in allowed] or None

    def omitted_tools(self) -> tuple[str, ...]:
        """The tool types left out of the prompt (OmittedTool's), for the header and the trace."""
        return omitted_tools(self.tools)

    def namespaces(self) -> dict[str, str]:
        """function name -> its namespace, for the functions in one."""
        return {tool.name: namespace for namespace, tool in function_tools(self.tools) if namespace is not None}

    def chat_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, AllowedToolsChoice):
            return choice.mode
        return choice or "auto"

    def thinking(self) -> ThinkingRequest | None:
        """What reasoning.effort asks of a reasoning model's thinking (None: its default)."""
        return effort_thinking(self.reasoning.effort) if self.reasoning is not None else None

    def response_format(self) -> dict[str, Any] | None:
        """text.format in the chat path's shape (response_format); None: free text."""
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, TextFormatJSONObject):
            return {"type": "json_object"}
        if isinstance(fmt, TextFormatJSONSchema):
            json_schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
            if fmt.strict is not None:
                json_schema["strict"] = fmt.strict
            return {"type": "json_schema", "json_schema": json_schema}
        return None


class InputTokensRequest(ResponsesPrompt):
    personality: str | None = None  # accepted, as OpenAI's reference has it; changes nothing here


class ResponsesRequest(ResponsesPrompt):
    # Field order matters: the checks of background and stream read the fields before them.
    store: bool | None = None  # None: true, as OpenAI's default
    background: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation is ever sent
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: list[str] | None = None  # message.output_text.logprobs and reasoning.encrypted_content change the reply
    metadata: dict[str, str] | None = None
    service_tier: ServiceTier | None = None  # None: auto; the response says the tier that served it
    # Accepted and echoed: they change nothing a single self-hosted server does.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: PositiveInt | None = None  # built-in tools' calls, and there are none here
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    image: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None  # the server's safety policy applies, whatever this asks
    prompt_cache_options: dict[str, Any] | None = None
    client_metadata: dict[str, str] | None = None  # OpenAI's Codex CLI sends it, whatever the provider
    # Refused when set (see _no_prompt_template).
    prompt: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @field_validator("prompt")
    @classmethod
    def _no_prompt_template(cls, value: Any) -> Any:
        if value is not None:
            raise fail("unsupported_parameter", "stored prompt templates are not served here: send the "
                       "instructions and input themselves")
        return value

    @field_validator("background")
    @classmethod
    def _background_needs_store(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("store") is False:
            raise fail("background", "a background response is stored (it is polled by id): it cannot be used "
                       "with store false")
        return value

    @field_validator("stream")
    @classmethod
    def _background_is_polled(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("background"):
            raise fail("unsupported_parameter", "a background response is not streamed by this server: poll it "
                       "with GET /v1/responses/<id>, or drop background to stream it")
        return value

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ())

    @property
    def wants_encrypted_reasoning(self) -> bool:
        return INCLUDE_ENCRYPTED_REASONING in (self.include or ())
