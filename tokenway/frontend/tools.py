"""Tool calls for models whose chat template knows no tools (llama.cpp's "generic" format).

The tools are described in the system prompt and the reply is constrained to one JSON
shape: either {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} or
{"response": "..."}. Arguments are constrained by each tool's own parameter schema, so
they always parse and match it. The conversation's earlier tool calls and tool results
are rendered back in the same JSON, so the model sees its own format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _function(tool: dict) -> dict:
    return tool.get("function", tool)


def tool_call_schema(tools: list[dict], tool_choice: Any, parallel_tool_calls: bool) -> dict:
    """The JSON schema a reply must satisfy. tool_choice: "auto" | "required" | {"function": {"name"}}."""
    if isinstance(tool_choice, dict):
        wanted = tool_choice.get("function", tool_choice).get("name")
        tools = [t for t in tools if _function(t)["name"] == wanted]
    calls = []
    for tool in tools:
        function = _function(tool)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    tool_calls = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel_tool_calls:
        tool_calls["maxItems"] = 1
    call_branch = {"type": "object", "properties": {"tool_calls": tool_calls}, "required": ["tool_calls"],
                   "additionalProperties": False}
    if tool_choice == "required" or isinstance(tool_choice, dict):
        return call_branch
    response_branch = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                       "additionalProperties": False}
    return {"anyOf": [call_branch, response_branch]}


def tool_system_prompt(tools: list[dict], tool_choice: Any) -> str:
    described = []
    for tool in tools:
        function = _function(tool)
        described.append(json.dumps({
            "name": function["name"],
            "description": function.get("description", ""),
            "parameters": function.get("parameters") or {"type": "object", "properties": {}},
        }, ensure_ascii=False))
    if tool_choice == "required" or isinstance(tool_choice, dict):
        how = 'Respond with a JSON object {"tool_calls": [{"name": <tool name>, "arguments": {...}}]}.'
    else:
        how = ('Respond with a JSON object: either {"tool_calls": [{"name": <tool name>, "arguments": {...}}]} '
               'to call tools, or {"response": <your answer>} to answer directly.')
    return "You can call these tools:\n" + "\n".join(described) + "\n" + how


def render_tool_messages(messages: list[dict]) -> list[dict]:
    """Earlier assistant tool calls become their JSON reply; tool results become user turns."""
    rendered = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function", {})
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                except json.JSONDecodeError:
                    arguments = function.get("arguments")
                calls.append({"name": function.get("name"), "arguments": arguments})
            rendered.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif role == "tool":
            result = {"tool_call_id": message.get("tool_call_id"), "content": message.get("content") or ""}
            if message.get("name"):
                result["name"] = message["name"]
            rendered.append({"role": "user", "content": json.dumps({"tool_result": result}, ensure_ascii=False)})
        else:
            rendered.append(message)
    return rendered


_CALLS_OPENING = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[\s*')
_RESPONSE_OPENING = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_SEPARATOR = re.compile(r"\s*,\s*")
_DECODER = json.JSONDecoder()


def parse_tool_reply(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool_calls) from a constrained reply. A reply cut short (max_tokens) keeps what
    it completed and nothing of the format leaks: the calls finished before the cut (a call cut
    half-way is dropped), or the answer's text so far."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return _parse_cut_reply(text)
    if isinstance(reply, dict) and isinstance(reply.get("tool_calls"), list):
        return None, [_tool_call(c) for c in reply["tool_calls"] if isinstance(c, dict)]
    if isinstance(reply, dict) and isinstance(reply.get("response"), str):
        return reply["response"], []
    return text, []


def _tool_call(call: dict) -> ToolCall:
    return ToolCall(new_tool_call_id(), str(call.get("name")), json.dumps(call.get("arguments", {}), ensure_ascii=False))


def _parse_cut_reply(text: str) -> tuple[str | None, list[ToolCall]]:
    opening = _CALLS_OPENING.match(text)
    if opening is not None:
        calls, position = [], opening.end()
        while True:
            try:
                call, position = _DECODER.raw_decode(text, position)
            except json.JSONDecodeError:
                break  # the call the cut went through
            if isinstance(call, dict) and "name" in call and "arguments" in call:
                calls.append(_tool_call(call))
            separator = _SEPARATOR.match(text, position)
            if separator is None:
                break
            position = separator.end()
        return None, calls
    opening = _RESPONSE_OPENING.match(text)
    if opening is not None:
        return _json_string_prefix(text[opening.end():]), []
    return "", []  # cut before the reply said which branch: nothing to show


def _json_string_prefix(body: str) -> str:
    """The text of a JSON string cut somewhere inside: decoded up to its last whole character
    (an escape cut half-way is dropped)."""
    for end in range(len(body), max(-1, len(body) - 7), -1):
        try:
            return json.loads('"' + body[:end] + '"')
        except json.JSONDecodeError:
            continue
    return ""
