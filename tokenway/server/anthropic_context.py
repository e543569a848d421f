"""Anthropic's context editing (a Messages body's context_management.edits), made on the
conversation as the chat templates take it, before the safety stage and the template see it.
The caller keeps its whole history; each call is edited anew.

    clear_tool_uses_20250919  once the prompt passes the trigger (input tokens, or tool uses),
                              every tool use but the last `keep` (and those of exclude_tools)
                              has its result replaced by PLACEHOLDER, and with
                              clear_tool_inputs its call's input by {}; an edit that would
                              clear fewer tokens than clear_at_least is not made
    clear_thinking_20251015   the thinking of all but the last `keep` assistant turns that
                              thought is left out (a template may leave out more: Qwen3's
                              renders no thinking before the last user turn)

Edits run in the order given, each on the last one's result; each one made is reported with the
tokens it cleared, counted as the prompt's tokens before it less those after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenway.protocol.anthropic_bodies import AppliedEdit
from tokenway.protocol.anthropic_edits import AllThinkingTurns, ClearThinking, ClearToolUses

PLACEHOLDER = "[This tool result was cleared to save context.]"

Messages = list[dict[str, Any]]
CountTokens = Callable[[Messages], int]  # a conversation -> its prompt's tokens


def apply_edits(edits: Sequence[ClearToolUses | ClearThinking], messages: Messages, count: CountTokens
                ) -> tuple[Messages, list[AppliedEdit], int]:
    """The edited conversation, the edits made, and the prompt's tokens before any of them."""
    num_tokens = num_original_tokens = count(messages)
    applied: list[AppliedEdit] = []
    for edit in edits:
        if isinstance(edit, ClearThinking):
            edited, num_cleared = clear_thinking(edit, messages)
        elif triggered(edit, messages, num_tokens):
            edited, num_cleared = clear_tool_uses(edit, messages)
        else:
            continue
        if not num_cleared:
            continue
        num_edited_tokens = count(edited)
        num_cleared_tokens = max(0, num_tokens - num_edited_tokens)
        if isinstance(edit, ClearThinking):
            applied.append({"type": "clear_thinking_20251015", "cleared_thinking_turns": num_cleared,
                            "cleared_input_tokens": num_cleared_tokens})
        elif edit.clear_at_least is not None and num_cleared_tokens < edit.clear_at_least.value:
            continue  # not worth the prompt cache it would cost
        else:
            applied.append({"type": "clear_tool_uses_20250919", "cleared_tool_uses": num_cleared,
                            "cleared_input_tokens": num_cleared_tokens})
        messages, num_tokens = edited, num_edited_tokens
    return messages, applied, num_original_tokens


def tool_uses(messages: Messages) -> list[tuple[int, int, str, str]]:
    """Every tool call in the conversation, in order: (message index, its position among the
    message's calls, its id, the tool's name)."""
    return [(index, position, call.get("id") or "", (call.get("function") or {}).get("name") or "")
            for index, message in enumerate(messages) if message["role"] == "assistant"
            for position, call in enumerate(message.get("tool_calls") or ())]


def triggered(edit: ClearToolUses, messages: Messages, num_tokens: int) -> bool:
    if edit.trigger.type == "input_tokens":
        return num_tokens > edit.trigger.value
    return len(tool_uses(messages)) > edit.trigger.value


def clear_tool_uses(edit: ClearToolUses, messages: Messages) -> tuple[Messages, int]:
    """The conversation with its older tool uses cleared, and how many were."""
    uses = tool_uses(messages)
    excluded = set(edit.exclude_tools or ())
    inputs = edit.clear_tool_inputs
    result_index = {message.get("tool_call_id"): index for index, message in enumerate(messages)
                    if message["role"] == "tool"}
    edited = list(messages)
    num_cleared = 0
    for index, position, call_id, name in uses[:max(0, len(uses) - edit.keep.value)]:
        if name in excluded:
            continue
        cleared = False
        result = result_index.get(call_id)
        if result is not None and edited[result]["content"] != PLACEHOLDER:
            edited[result] = {**edited[result], "content": PLACEHOLDER}
            cleared = True
        if inputs is True or isinstance(inputs, list) and name in inputs:
            calls = list(edited[index]["tool_calls"])
            if calls[position]["function"].get("arguments") != "{}":
                calls[position] = {**calls[position], "function": {**calls[position]["function"], "arguments": "{}"}}
                edited[index] = {**edited[index], "tool_calls": calls}
                cleared = True
        num_cleared += cleared
    return edited, num_cleared


def clear_thinking(edit: ClearThinking, messages: Messages) -> tuple[Messages, int]:
    """The conversation with the older turns' thinking left out, and how many turns lost it."""
    turns = [index for index, message in enumerate(messages)
             if message["role"] == "assistant" and message.get("reasoning_content")]
    keep = edit.keep
    num_kept = len(turns) if keep == "all" or isinstance(keep, AllThinkingTurns) else keep.value
    cleared = set(turns[:max(0, len(turns) - num_kept)])
    if not cleared:
        return messages, 0
    edited = [{key: value for key, value in message.items() if key != "reasoning_content"} if index in cleared
              else message for index, message in enumerate(messages)]
    return edited, len(cleared)
