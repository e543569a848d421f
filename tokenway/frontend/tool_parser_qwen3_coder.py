"""Qwen3-Coder's XML tool calls, read as vLLM's qwen3_coder parser reads them:

    text <tool_call>
    <function=get_weather>
    <parameter=city>
    Rome
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between its <parameter=K> and </parameter> (one newline after the opening
and one before the closing dropped), typed by the tool's JSON schema: a string stays that text,
an integer, number, boolean, object or array is parsed, with vLLM's fallbacks (parameter_value()).
The arguments are the JSON object vLLM's json.dumps writes, {"city": "Rome", "days": 3}, sent
as it forms: "{" with the name, each key as its parameter opens, a string value character by
character (held back only where it may still be a closing tag, the newline before one, or the
literal null), any other value whole at its closing tag, "}" at </function>.

As in vLLM, a parameter also ends where the next <parameter= or </function> begins, a function
where </tool_call> does, and a <function=...> the model writes without <tool_call> around it is a
call too (llama.cpp notes Qwen3-Coder sometimes omits it). Text inside <tool_call> outside a
function, or inside a function outside a parameter, is no content and no argument.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from tokenway.frontend.tool_parsers import _WHITESPACE, ParsedDelta, _Tagged

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, TOOL_CALL_END)
_LONGEST_TAG = max(len(tag) for tag in (TOOL_CALL, TOOL_CALL_END, FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END))

# vLLM's spellings of each kind of type (qwen3coder_tool_parser.py, _convert_param_value).
STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float")
_BOOLEAN_TYPES = frozenset({"boolean", "bool", "binary"})
_JSON_TYPES = frozenset({"object", "array", "arr"})
_JSON_PREFIXES = ("dict", "list")


def writes_qwen3_coder_calls(template: str) -> bool:
    """Whether a chat template writes its calls in this format (Qwen3-Coder's, Qwen3.5's, Nemotron
    Nano 3's): <function= and <parameter= inside <tool_call>. It holds <tool_call>, so it must be
    asked before Hermes is."""
    return all(tag in template for tag in (TOOL_CALL, FUNCTION, PARAMETER))


def schema_type(schema: Any) -> str:
    """A parameter's type as the parser reads it: its schema's "type" in lower case, the first
    non-null one of a list (["integer", "null"]; vLLM reads the list's Python text, which
    matches no type), "string" where the schema names none (anyOf, $ref, none at all)."""
    if not isinstance(schema, dict) or "type" not in schema:
        return "string"
    declared = schema["type"]
    if isinstance(declared, list):
        declared = next((kind for kind in declared if kind != "null"), "null")
    return str(declared).strip().lower()


def parameter_types(tools: tuple[dict, ...] | list[dict]) -> dict[str, dict[str, str]]:
    """function name -> parameter name -> schema_type(), for tools in OpenAI's shape
    ({"type": "function", "function": {..}}) or bare ({"name", "parameters"})."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        types.setdefault(function["name"], {}).update(
            {name: schema_type(schema) for name, schema in properties.items()} if isinstance(properties, dict) else {})
    return types


def parameter_value(text: str, kind: str) -> Any:
    """The value of a parameter of type `kind` written as `text`, as vLLM converts it: "null"
    (any case) is null whatever the type; a string is the text; an integer or number that does
    not parse stays text, and an integral number is an integer (3.0 -> 3); a boolean is whether
    the text is "true"; an object or array is its JSON, else a Python literal, else the text; any
    other type a Python literal, else the text. Unlike vLLM, a value that would not be JSON (a
    Python set, NaN, an infinity) stays text rather than failing the call."""
    if text.lower() == "null":
        return None
    if kind in STRING_TYPES:
        return text
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(_NUMBER_PREFIXES):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in _BOOLEAN_TYPES:
        return text.lower() == "true"
    if kind in _JSON_TYPES or kind.startswith(_JSON_PREFIXES):
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError:
            pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    try:  # as JSON has it: a tuple is a list
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that may still grow into one of `tags`."""
    for size in range(min(_LONGEST_TAG - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(tag.startswith(tail) for tag in tags):
            return size
    return 0


def _json_text(text: str) -> str:
    """`text` escaped as inside a JSON string (escaping is per character, so pieces escaped
    one by one join to the whole escaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderParser(_Tagged):
    """The modes, after the text: tool_call (inside <tool_call>, to a <function=), function_name,
    parameters (inside a function, to a <parameter= or its end), parameter_name, value_start
    (the newline after <parameter=K>), value."""

    triggers = (TOOL_CALL, FUNCTION)

    def __init__(self, tools: tuple[dict, ...] = (), *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.function_to_types = parameter_types(tools)
        self.wrapped = False  # the call is inside <tool_call> .. </tool_call>
        self.window = ""  # the last characters read where a tag is looked for
        self.name: list[str] = []  # the function's or parameter's name being read
        self.types: dict[str, str] = {}  # the open function's parameter name -> type
        self.num_parameters = 0  # of the open function
        self.kind = "string"  # the open value's type
        self.value: list[str] = []  # the open value's text, closing tag and all
        self.num_sent = 0  # characters of a string value sent
        self.opened = False  # a string value's opening quote is sent
        self.blanks = ""  # the blanks before a bare <function=, sent if it opens no call

    # ---- text -------------------------------------------------------------------------------

    def _text_char(self, ch: str) -> None:
        held = self.held + ch
        for trigger in self.triggers:
            if held.endswith(trigger):
                before = held[: -len(trigger)]
                self._content(before.rstrip(_WHITESPACE))  # blanks before a tag go
                self.blanks = before[len(before.rstrip(_WHITESPACE)):]  # unless it opens no call
                self.held, self.window = "", ""
                self.wrapped = trigger == TOOL_CALL
                self.mode = "tool_call" if self.wrapped else "function_name"
                self.name = []
                return
        keep = _partial_tag(held, self.triggers)
        body = held[: len(held) - keep].rstrip(_WHITESPACE)
        self._content(body)
        self.held = held[len(body):]

    def _push(self, ch: str) -> None:
        mode = self.mode
        if mode == "value":
            self._value_char(ch)
        elif mode == "text":
            self._text_char(ch)
        elif mode == "value_start":
            self.mode, self.window, self.value, self.num_sent, self.opened = "value", "", [], 0, False
            if ch != "\n":  # the newline after <parameter=K> is the format's
                self._value_char(ch)
        elif mode in ("function_name", "parameter_name"):
            self._name_char(ch)
        else:
            self.window = (self.window + ch)[-_LONGEST_TAG:]
            tag = next((tag for tag in (FUNCTION, PARAMETER, FUNCTION_END, TOOL_CALL_END)
                        if self.window.endswith(tag)), None)
            if tag is not None:
                self._tag(tag)

    def _tag(self, tag: str) -> None:
        """A tag read in mode tool_call or parameters; any other text there is dropped."""
        self.window, self.name = "", []
        if tag == TOOL_CALL_END:
            self._close_call()
            self.mode = "text"
        elif self.mode == "tool_call" and tag == FUNCTION:
            self.mode = "function_name"
        elif self.mode == "parameters" and tag == PARAMETER:
            self.mode = "parameter_name"
        elif self.mode == "parameters" and tag == FUNCTION_END:
            self._close_call()
            self.mode = "tool_call" if self.wrapped else "text"

    def _name_char(self, ch: str) -> None:
        if ch != ">" and ch not in "<\n":
            self.name.append(ch)
            return
        written = "".join(self.name)
        name = written.strip()
        self.name = []
        function = self.mode == "function_name"
        if ch == ">" and name:
            if function:
                self.out.start(name)
                self.out.arguments("{")
                self.types, self.num_parameters = self.function_to_types.get(name, {}), 0
                self.mode = "parameters"
            else:
                self.out.arguments(f'{", " if self.num_parameters else ""}{json.dumps(name, ensure_ascii=False)}: ')
                self.num_parameters += 1
                self.kind = self.types.get(name, "string")
                self.mode = "value_start"
            return
        # Malformed: no name, or a line break or tag before its ">".
        if function and not self.wrapped:  # a <function= in the text that opens no call: text
            self.mode = "text"
            self._content(self.blanks + FUNCTION + written)
            self._push(ch)
            return
        self.mode = "tool_call" if function else "parameters"
        self.window = ""
        self._push(ch)

    # ---- values -----------------------------------------------------------------------------

    def _value_char(self, ch: str) -> None:
        self.value.append(ch)
        self.window = (self.window + ch)[-_LONGEST_TAG:]
        for tag in _VALUE_ENDS:
            if self.window.endswith(tag):
                text = "".join(self.value)[: -len(tag)]
                self._end_value(text[:-1] if text.endswith("\n") else text)
                self.window, self.name = "", []
                if tag == PARAMETER_END:
                    self.mode = "parameters"
                elif tag == PARAMETER:
                    self.mode = "parameter_name"
                else:
                    self._close_call()
                    self.mode = "tool_call" if self.wrapped and tag == FUNCTION_END else "text"
                return
        if self.kind in STRING_TYPES:
            self._send_string()

    def _send_string(self) -> None:
        """Send what of a string value can no longer be a closing tag, the newline before one, or
        part of a null."""
        end = len(self.value) - _partial_tag(self.window, _VALUE_ENDS)
        if end > 0 and self.value[end - 1] == "\n":
            end -= 1
        if end <= self.num_sent:
            return
        if not self.opened:
            if "null".startswith("".join(self.value[:end]).lower()):
                return
            self.out.arguments('"')
            self.opened = True
        self.out.arguments(_json_text("".join(self.value[self.num_sent:end])))
        self.num_sent = end

    def _end_value(self, text: str) -> None:
        if self.opened:  # a string begun: no null, the rest and its closing quote
            self.out.arguments(_json_text(text[self.num_sent:]) + '"')
        else:
            self.out.arguments(json.dumps(parameter_value(text, self.kind), ensure_ascii=False))
        self.value, self.opened = [], False

    def _close_call(self) -> None:
        if self.mode in ("tool_call", "text"):
            return  # no function open
        self.out.arguments("}")
        self.out.complete()

    # ---- the end ----------------------------------------------------------------------------

    def finish(self) -> ParsedDelta:
        delta = super().finish()
        self.cut = self.mode not in ("text", "tool_call")  # a function begun and not closed
        return delta

    def _flush(self) -> None:
        if self.mode == "function_name" and not self.wrapped:  # a call cut before its name: no text
            self.mode, self.name = "text", []
        super()._flush()
