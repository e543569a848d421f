"""Tool calls for models whose chat template knows no tools (llama.cpp's "generic" format).

The tools are described in the system prompt and the reply is constrained to one JSON
shape: either {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} or
{"response": "..."}. Arguments are constrained by each tool's own parameter schema, so
they always parse and match it. The conversation's earlier tool calls and tool results
are rendered back in the same JSON, so the model sees its own format.
"""

from __future__ import annotations

import json
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


def parse_tool_reply(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool_calls) from a constrained reply. A reply cut short (max_tokens) may not
    parse: then it is returned as content, as llama.cpp does."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    if isinstance(reply, dict) and isinstance(reply.get("tool_calls"), list):
        calls = [
            ToolCall(new_tool_call_id(), str(c.get("name")), json.dumps(c.get("arguments", {}), ensure_ascii=False))
            for c in reply["tool_calls"]
            if isinstance(c, dict)
        ]
        return None, calls
    if isinstance(reply, dict) and isinstance(reply.get("response"), str):
        return reply["response"], []
    return text, []
