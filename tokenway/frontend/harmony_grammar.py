"""The grammars (llguidance's Lark) that hold a Harmony reply to what the call asks: a call
(tool_choice "required" or a named function), or a final answer in JSON (response_format).

    [<|channel|>analysis<|message|> THINKING <|end|><|start|>assistant]      its thinking, if it may think
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> {arguments, held to NAME's schema}
  | <|channel|>final<|message|> {the response_format's JSON}

The call ends the grammar: the engine then stops on an end-of-generation token (<|call|> is one of
gpt-oss's), so a forced reply is one call, as Harmony makes one call a turn. The thinking is
bounded where the call gives a budget (max_tokens on its rule) and left out where thinking is off.
Markers are written as the model's tokenizer has them (tool_grammars.marker: by id where added).
"""

from __future__ import annotations

import json
from typing import Any

from tokenway.frontend.tokenizer import Tokenizer
from tokenway.frontend.tool_grammars import marker
from tokenway.protocol.sampling import ThinkingRequest

# Compact JSON, as the other formats' grammars write it (tool_grammars.py).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict) -> str:
    return json.dumps({"x-guidance": _JSON_OPTIONS, **schema}, ensure_ascii=False)


def _thinking(tokenizer: Tokenizer, thinking: ThinkingRequest | None) -> str | None:
    """The rule for the analysis message before the held part; None: thinking is off."""
    if thinking is not None and (thinking.enabled is False or thinking.budget_tokens == 0):
        return None
    bound = f"[max_tokens={thinking.budget_tokens}]" if thinking is not None and thinking.budget_tokens else ""
    return (f'analysis: {marker(tokenizer, "<|channel|>")} "analysis" {marker(tokenizer, "<|message|>")} thought '
            f'{marker(tokenizer, "<|end|>")} {marker(tokenizer, "<|start|>")} "assistant"\n'
            f"thought{bound}: /(.|\\n)*/\n")


def _grammar(tokenizer: Tokenizer, held: str, thinking: ThinkingRequest | None) -> str:
    rule = _thinking(tokenizer, thinking)
    if rule is None:
        return f"start: held\n{held}"
    return f"start: analysis? held\n{held}{rule}"


def call_grammar(tokenizer: Tokenizer, tools: list[dict], tool_choice: Any,
                 thinking: ThinkingRequest | None = None) -> str:
    """tool_choice "required" (any of the tools) or a named function: one call to it, its
    arguments held to its parameters' schema."""
    functions = [tool.get("function", tool) for tool in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or tool_choice).get("name")
        functions = [function for function in functions if function.get("name") == name]
        if not functions:
            raise ValueError(f"tool_choice: no tool named {name!r}")
    channel, message = marker(tokenizer, "<|channel|>"), marker(tokenizer, "<|message|>")
    constrain = marker(tokenizer, "<|constrain|>")
    calls = [f'call_{position}: {channel} {json.dumps("commentary to=functions." + function["name"] + " ")} '
             f'{constrain} "json" {message} %json {_json(function.get("parameters") or {"type": "object"})}\n'
             for position, function in enumerate(functions)]
    held = "held: " + " | ".join(f"call_{position}" for position in range(len(calls))) + "\n" + "".join(calls)
    return _grammar(tokenizer, held, thinking)


def final_json_grammar(tokenizer: Tokenizer, schema: dict, thinking: ThinkingRequest | None = None) -> str:
    """response_format json_schema or json_object: the final answer is the JSON."""
    held = (f'held: {marker(tokenizer, "<|channel|>")} "final" {marker(tokenizer, "<|message|>")} '
            f"%json {_json(schema)}\n")
    return _grammar(tokenizer, held, thinking)
