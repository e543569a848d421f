"""The grammars (llguidance's Lark) that hold a native tool format's replies to its calls.

    tool_choice "required" or a named function   native_call_grammar: the format's framing around
                                                  one call, or several, each held to its tool's schema
    tool_choice "auto", Hermes                    hermes_auto_grammar: free text, and from <tool_call>
                                                  on the call held to the tools' schemas
    qwen3_coder, "required" or named              qwen3_coder_call_grammar: the XML call, each value
                                                  held to its parameter's type
    qwen3_coder, "auto"                           qwen3_coder_auto_grammar: free text, and from
                                                  <tool_call> on the call held so

A format's markers are written as the model's tokenizer has them. A marker that is an added token
(Qwen2.5's <tool_call>, user-defined; Mistral's [TOOL_CALLS], a control token) is that token, by id
(`<[151657]>`); one the tokenizer spells out of its vocabulary (the default model's) is its text.
By id because llguidance counts every added token written <...> as a special token, user-defined
ones included, whose bytes no string literal matches: under "<tool_call>" the engine sampled the
very token the grammar's own tokenization picked, the matcher refused it and the reply ended at
its first token; under auto the token was masked out, so the model could never open a call. A
token named by id matches however llguidance counts it.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from tokenway.frontend import tools as generic_tools
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.frontend.tool_parser_qwen3_coder import schema_type

# Compact JSON, as the json_schema kind writes it (structured_output.py).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def marker(tokenizer: Tokenizer, text: str) -> str:
    """`text` as a grammar term: its token by id where it is an added token, else the string."""
    token_id = tokenizer.added_token_id(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def native_call_grammar(tokenizer: Tokenizer, fmt: str, tools: list[dict], tool_choice: Any,
                        parallel_tool_calls: bool) -> str:
    """tool_choice "required" or a named function in a native format: one call, or several, in
    the format's own framing."""
    if fmt == "qwen3_coder":
        return qwen3_coder_call_grammar(tokenizer, tools, tool_choice, parallel_tool_calls)
    arguments_key = "parameters" if fmt == "llama3_json" else "arguments"
    call = generic_tools.call_schema(tools, tool_choice, arguments_key)
    if fmt == "mistral":
        call, defs = generic_tools.nested(call)
        array = {"type": "array", "items": call, "minItems": 1}
        if not parallel_tool_calls:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        return f"start: {marker(tokenizer, '[TOOL_CALLS]')} %json {_grammar_json(array)}"
    if fmt == "hermes":
        one = (f'{marker(tokenizer, "<tool_call>")} "\\n" %json {_grammar_json(call)} "\\n" '
               f'{marker(tokenizer, "</tool_call>")}')
        separator = '"\\n"'
    else:  # llama3_json: the call alone, as Llama writes a custom tool's (<|python_tag|> is for its built-ins)
        one, separator = f"%json {_grammar_json(call)}", '"; "'
    return f"start: call\ncall: {one}" if not parallel_tool_calls else f"start: call ({separator} call)*\ncall: {one}"


def hermes_auto_grammar(tokenizer: Tokenizer, tools: list[dict]) -> str:
    """tool_choice "auto" in the Hermes format: free text, but once the model writes
    <tool_call> the call is held to the tools' schemas, so its arguments always parse and
    match. A <tool_call> spelled in pieces is found in the text by llguidance's lazy trigger; a
    <tool_call> token, which no text trigger sees, opens the call as a token. The other native
    formats' calls stay free under auto, as in vLLM."""
    schema = _grammar_json(generic_tools.call_schema(tools, "auto"))
    if tokenizer.added_token_id("<tool_call>") is None:
        tag = llguidance.StructTag(trigger="<tool_call>", begin="<tool_call>\n", end="\n</tool_call>", grammar=schema)
        return llguidance.StructTag.to_grammar([tag], assume_special=False)
    # StructTag's own form for a special-token trigger, with both markers by id.
    return (f"%llguidance {{}}\nstart: call* TEXT\n"
            f"call: TEXT {marker(tokenizer, '<tool_call>')} \"\\n\" %json {schema} \"\\n\" "
            f"{marker(tokenizer, '</tool_call>')}\n"
            "TEXT: /(.|\\n)*/\n")


# A free value: any text up to its closing tag, that holds none of the tags that end a value
# where vLLM's parser reads one (a closing tag, the next parameter, the function's or the call's
# end). The closing tag is in the lexeme, so a lexeme that could go on past it cannot be chosen.
_VALUE_ENDS = r"(<\/parameter>|<parameter=|<\/function>|<\/tool_call>)"
_FREE_VALUE = rf"/(.|\n)*\n<\/parameter>/ & ~/(.|\n)*{_VALUE_ENDS}(.|\n)+/"
_CLOSE = '"\\n</parameter>"'
# Bounded, so that a model with nothing to say cannot write digits forever, and finite (an
# exponent of 999 would be an infinity, which the parser keeps as text).
_INTEGER = r"-?(0|[1-9][0-9]{0,18})"
_NUMBER = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?"


def qwen3_coder_call_grammar(tokenizer: Tokenizer, tools: list[dict], tool_choice: Any,
                             parallel_tool_calls: bool) -> str:
    """Qwen3-Coder's calls as its template writes them,

        <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n..</function>\n</tool_call>

    each function's parameters in its schema's order, the required ones always, and each value
    written so the parser (tool_parser_qwen3_coder.py) reads it as its type: an enum one of its
    values, an integer, number or boolean as JSON writes it, an object or array JSON held to its
    schema, anything else free text."""
    if isinstance(tool_choice, dict):
        wanted = tool_choice.get("function", tool_choice).get("name")
        tools = [tool for tool in tools if tool.get("function", tool)["name"] == wanted]
    function, rules = _qwen3_coder_functions(tools)
    call = f'call: {marker(tokenizer, "<tool_call>")} "\\n" {function} "\\n" {marker(tokenizer, "</tool_call>")}'
    start = 'start: call ("\\n" call)*' if parallel_tool_calls else "start: call"
    return "\n".join([start, call, *rules]) + "\n"


def qwen3_coder_auto_grammar(tokenizer: Tokenizer, tools: list[dict]) -> str:
    """tool_choice "auto" in the qwen3_coder format, as hermes_auto_grammar is for Hermes: free
    text, and from <tool_call> on the call held to the tools, each value to its type."""
    function, rules = _qwen3_coder_functions(tools)
    if tokenizer.added_token_id("<tool_call>") is None:  # spelled in pieces: llguidance's lazy trigger
        body = "\n".join([f"start: {function}", *rules]) + "\n"
        tag = llguidance.StructTag(trigger="<tool_call>", begin="<tool_call>\n", end="\n</tool_call>", grammar=body)
        return llguidance.StructTag.to_grammar([tag], assume_special=False)
    return "\n".join([
        "%llguidance {}", "start: call* TEXT",
        f'call: TEXT {marker(tokenizer, "<tool_call>")} "\\n" {function} "\\n" {marker(tokenizer, "</tool_call>")}',
        "TEXT: /(.|\\n)*/", *rules]) + "\n"


def _qwen3_coder_functions(tools: list[dict]) -> tuple[str, list[str]]:
    """(the grammar term of one function call, the rules it uses): f0 | f1 .., each
    <function=NAME>\\n, its parameters, </function>."""
    rules, functions = [], []
    for position, tool in enumerate(tools):
        function = tool.get("function", tool)
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required") or ())
        items = []
        for number, (name, schema) in enumerate((parameters.get("properties") or {}).items()):
            rule = f"f{position}_p{number}"
            opening = json.dumps(f"<parameter={name}>\n", ensure_ascii=False)
            rules.append(f'{rule}: {opening} {_value(rule, schema, parameters, rules)} "\\n"')
            items.append(rule if name in required else f"{rule}?")
        opening = json.dumps(f"<function={function['name']}>\n", ensure_ascii=False)
        rules.append(f'f{position}: {opening} {" ".join(items)} "</function>"')
        functions.append(f"f{position}")
    return f"({' | '.join(functions)})", rules


def _value(rule: str, schema: Any, parameters: dict, rules: list[str]) -> str:
    """The grammar of one value and its closing tag; a lexeme it needs goes into `rules`."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None) if isinstance(schema, dict) else None
    if choices:
        written = [choice if isinstance(choice, str) else json.dumps(choice, ensure_ascii=False) for choice in choices]
        return f"({' | '.join(json.dumps(text, ensure_ascii=False) for text in written)}) {_CLOSE}"
    kind = schema_type(schema)
    if kind in ("integer", "number", "boolean", "null"):
        literal = {"integer": f"/{_INTEGER}/", "number": f"/{_NUMBER}/", "boolean": '("true" | "false")',
                   "null": '"null"'}[kind]
        return f"{literal} {_CLOSE}"
    if kind in ("object", "array"):
        schema = dict(schema)
        for key in ("$defs", "definitions"):  # the parameters' own, which its references name
            if key in parameters and key not in schema:
                schema[key] = parameters[key]
        return f"%json {_grammar_json(schema)} {_CLOSE}"
    lexeme = rule.upper()
    rules.append(f"{lexeme}: {_FREE_VALUE}")
    return lexeme


def _grammar_json(schema: dict) -> str:
    """A schema for %json, its keys in order (properties are generated in schema order: the
    name before the arguments) and JSON written compactly, as the json_schema kind is."""
    return json.dumps({"x-guidance": _JSON_OPTIONS, **schema}, ensure_ascii=False)
