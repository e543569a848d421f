"""The grammars (llguidance's Lark) that hold a native tool format's replies to its calls.

    tool_choice "required" or a named function   native_call_grammar: the format's framing around
                                                  one call, or several, each held to its tool's schema
    tool_choice "auto", Hermes                    hermes_auto_grammar: free text, and from <tool_call>
                                                  on the call held to the tools' schemas

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


def _grammar_json(schema: dict) -> str:
    """A schema for %json, its keys in order (properties are generated in schema order: the
    name before the arguments) and JSON written compactly, as the json_schema kind is."""
    return json.dumps({"x-guidance": _JSON_OPTIONS, **schema}, ensure_ascii=False)
