"""Tool calls for models whose chat template knows no tools (llama.cpp's "generic" format).

The tools are described in the system prompt and the reply is constrained to one JSON
shape: either {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} or
{"response": "..."}. Arguments are constrained by each tool's own parameter schema, so
they always parse and match it. The conversation's earlier tool calls are rendered back in
the same JSON, so the model sees its own format; their results as a user turn that says
which call they answer, the latest asking for an answer, so that a model that has its result
answers instead of calling the same tool again (tool_parsers.GenericParser reads replies).
"""

from __future__ import annotations

import json
from typing import Any

# After the latest tool results: with it, SmolLM2-135M answered 6 of 6 follow-ups, without it
# 0 of 6 (each called the same tool again); see tests/e2e/test_tool_calls.py.
ANSWER_REQUEST = "Use this result to answer my question."
RESULT_RULE = 'When a tool result answers the question, respond with {"response": <your answer>}.'


def _function(tool: dict) -> dict:
    return tool.get("function", tool)


def call_schema(tools: list[dict], tool_choice: Any, arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call: {"name": <a tool's>, <arguments_key>: <its parameters>},
    name first. tool_choice: "auto" | "required" | {"function": {"name"}} (that tool only).

    A tool whose parameters hold references ("$ref": "#/$defs/X", as pydantic writes them, or
    "#" for itself) means its own root by "#", which stops being the document's root once it
    is nested in a call: such parameters go in the root's $defs and their references are
    rebased there. A caller nesting this schema further moves "$defs" to its own root."""
    if isinstance(tool_choice, dict):
        wanted = tool_choice.get("function", tool_choice).get("name")
        tools = [t for t in tools if _function(t)["name"] == wanted]
    calls, defs = [], {}
    for position, tool in enumerate(tools):
        function = _function(tool)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if _has_ref(parameters):
            key = f"tool{position}"
            defs[key] = rebase_refs(parameters, f"#/$defs/{key}")
            parameters = {"$ref": f"#/$defs/{key}"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "$defs": defs} if defs else schema


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(value) for value in schema.values())
    if isinstance(schema, list):
        return any(_has_ref(value) for value in schema)
    return False


def rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with its document-relative references ("#", "#/...") moved under `base` (a
    JSON pointer reference to where the schema now sits). Anchors ("#name") and other
    documents' references are left alone."""
    if isinstance(schema, dict):
        return {key: base + value[1:] if key == "$ref" and isinstance(value, str) and (value == "#" or
                                                                                    value.startswith("#/"))
                else rebase_refs(value, base) for key, value in schema.items()}
    if isinstance(schema, list):
        return [rebase_refs(value, base) for value in schema]
    return schema


def nested(schema: dict) -> tuple[dict, dict]:
    """(schema without its "$defs", those $defs): to nest a call schema in another whose root
    takes the $defs."""
    schema = dict(schema)
    return schema, schema.pop("$defs", {})


def tool_call_schema(tools: list[dict], tool_choice: Any, parallel_tool_calls: bool) -> dict:
    """The JSON schema a generic reply must satisfy."""
    call, defs = nested(call_schema(tools, tool_choice))
    tool_calls = {"type": "array", "items": call, "minItems": 1}
    if not parallel_tool_calls:
        tool_calls["maxItems"] = 1
    call_branch = {"type": "object", "properties": {"tool_calls": tool_calls}, "required": ["tool_calls"],
                   "additionalProperties": False}
    if tool_choice == "required" or isinstance(tool_choice, dict):
        schema = call_branch
    else:
        response_branch = {"type": "object", "properties": {"response": {"type": "string"}},
                           "required": ["response"], "additionalProperties": False}
        schema = {"anyOf": [call_branch, response_branch]}
    return {**schema, "$defs": defs} if defs else schema


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
               'to call tools, or {"response": <your answer>} to answer directly.\n' + RESULT_RULE)
    return "You can call these tools:\n" + "\n".join(described) + "\n" + how


def render_tool_messages(messages: list[dict]) -> list[dict]:
    """Earlier assistant tool calls become their JSON reply; tool results become user turns
    naming the call they answer: "Result of get_weather({"city": "Rome"}): ..."; the results
    that end the conversation ask for an answer."""
    rendered, called = [], {}
    for position, message in enumerate(messages):
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
                called[call.get("id")] = calls[-1]
            rendered.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif role == "tool":
            call = called.get(message.get("tool_call_id"))
            if call is not None:
                what = f"{call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})"
            else:
                what = message.get("name") or "the tool"
            text = f"Result of {what}: {message.get('content') or ''}"
            if all(m["role"] == "tool" for m in messages[position:]):
                text += "\n" + ANSWER_REQUEST
            rendered.append({"role": "user", "content": text})
        else:
            rendered.append(message)
    return rendered
