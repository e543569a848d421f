"""Chat messages -> prompt token ids, with tools and response formats folded in.

The gateway hands over plain dict messages (already schema-checked); this renders them
with the model's chat template. Tools: when the template cannot render them (it never
mentions `tools`), they go into the system prompt and the reply is constrained to the
generic tool-call JSON (see tools.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenway.frontend import tools as generic_tools
from tokenway.frontend.tokenizer import Tokenizer


@dataclass(slots=True)
class ChatPrompt:
    prompt_token_ids: list[int]
    # A JSON schema the reply must satisfy (tools or response_format); None: free text.
    json_schema: dict | None = None
    json_object: bool = False
    generic_tools: bool = False  # parse the reply as the generic tool-call JSON


def text_content(content: Any) -> str:
    """A message's content as text: a string, a list of text parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def normalize_messages(messages: list[dict]) -> list[dict]:
    normalized = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "developer":  # OpenAI's newer name for system
            message["role"] = "system"
        message["content"] = text_content(message.get("content"))
        normalized.append(message)
    return normalized


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + text).strip()
        return [first] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def build_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool = True,
    response_format: dict | None = None,
    max_num_tokens: int | None = None,
) -> ChatPrompt:
    """Raises PromptTooLong when the rendered prompt certainly exceeds max_num_tokens."""
    messages = normalize_messages(messages)
    use_tools = bool(tools) and tool_choice != "none"
    prompt = ChatPrompt(prompt_token_ids=[])
    if use_tools:
        # The generic path for every template: it gives arguments that always match the
        # tool's schema. (Model-native tool formats are a later step.)
        messages = _with_system(generic_tools.render_tool_messages(messages),
                                generic_tools.tool_system_prompt(tools, tool_choice))
        prompt.json_schema = generic_tools.tool_call_schema(tools, tool_choice, parallel_tool_calls)
        prompt.generic_tools = True
    else:
        messages = generic_tools.render_tool_messages(messages)
        kind = (response_format or {}).get("type", "text")
        if kind == "json_schema":
            prompt.json_schema = response_format["json_schema"].get("schema") or {}
        elif kind == "json_object":
            prompt.json_object = True
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt.prompt_token_ids = tokenizer.encode(text, add_special_tokens=False, max_num_tokens=max_num_tokens)
    return prompt


def schema_text(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))
