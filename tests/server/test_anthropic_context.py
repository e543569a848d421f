"""Anthropic's context editing on a conversation: which tool uses and which turns' thinking are
cleared, when, and what each edit reports, counted by a tokenizer stand-in (a token a character)."""

import json

from tokenway.protocol.anthropic_edits import ContextManagement
from tokenway.server.anthropic_context import PLACEHOLDER, apply_edits


def count(messages):
    return sum(len(json.dumps(message)) for message in messages)


def agent_conversation(num_uses: int) -> list[dict]:
    """A user turn, then `num_uses` tool uses, each call and its 200-character result, alternating
    between two tools; the assistant turns think."""
    messages = [{"role": "user", "content": "Fix the bug."}]
    for i in range(num_uses):
        name = "read_file" if i % 2 == 0 else "memory"
        messages.append({"role": "assistant", "content": "", "reasoning_content": f"step {i}", "tool_calls": [
            {"id": f"t{i}", "type": "function", "function": {"name": name, "arguments": json.dumps({"n": i})}}]})
        messages.append({"role": "tool", "tool_call_id": f"t{i}", "content": "x" * 200})
    return messages


def edits(*edits: dict) -> list:
    return ContextManagement.model_validate({"edits": list(edits)}).edits


def test_below_the_trigger_nothing_is_cleared():
    messages = agent_conversation(6)
    edited, applied, num_original = apply_edits(edits({"type": "clear_tool_uses_20250919"}), messages, count)
    assert edited is messages and applied == [] and num_original == count(messages)


def test_past_the_trigger_all_but_the_last_kept_results_are_cleared_oldest_first():
    messages = agent_conversation(6)
    edited, applied, num_original = apply_edits(edits({
        "type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1000},
        "keep": {"type": "tool_uses", "value": 2}}), messages, count)
    results = [message["content"] for message in edited if message["role"] == "tool"]
    assert results == [PLACEHOLDER] * 4 + ["x" * 200] * 2
    assert [call["function"]["arguments"] for m in edited for call in m.get("tool_calls", ())] == [
        json.dumps({"n": i}) for i in range(6)]  # inputs stay unless asked
    assert applied == [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 4,
                        "cleared_input_tokens": num_original - count(edited)}]
    assert messages[2]["content"] == "x" * 200  # the caller's history is not touched


def test_excluded_tools_are_kept_and_listed_inputs_cleared():
    edited, applied, _ = apply_edits(edits({
        "type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 3},
        "keep": {"type": "tool_uses", "value": 0}, "exclude_tools": ["memory"], "clear_tool_inputs": ["read_file"]}),
        agent_conversation(4), count)
    calls = {call["function"]["name"] + call["id"]: call["function"]["arguments"]
             for message in edited for call in message.get("tool_calls", ())}
    assert calls == {"read_filet0": "{}", "memoryt1": '{"n": 1}', "read_filet2": "{}", "memoryt3": '{"n": 3}'}
    results = {message["tool_call_id"]: message["content"] for message in edited if message["role"] == "tool"}
    assert results == {"t0": PLACEHOLDER, "t1": "x" * 200, "t2": PLACEHOLDER, "t3": "x" * 200}
    assert applied[0]["cleared_tool_uses"] == 2


def test_the_tool_uses_trigger_counts_uses():
    messages = agent_conversation(3)
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 3}}
    assert apply_edits(edits(edit), messages, count)[1] == []
    assert apply_edits(edits(edit), agent_conversation(4), count)[1][0]["cleared_tool_uses"] == 1


def test_an_edit_that_clears_less_than_clear_at_least_is_not_made():
    messages = agent_conversation(5)
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
            "keep": {"type": "tool_uses", "value": 4}, "clear_at_least": {"type": "input_tokens", "value": 5000}}
    edited, applied, _ = apply_edits(edits(edit), messages, count)
    assert edited is messages and applied == []


def test_thinking_is_kept_for_the_last_turns_only():
    messages = agent_conversation(4)
    edited, applied, _ = apply_edits(edits({"type": "clear_thinking_20251015"}), messages, count)
    assert [m.get("reasoning_content") for m in edited if m["role"] == "assistant"] == [None, None, None, "step 3"]
    assert applied == [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 3,
                        "cleared_input_tokens": count(messages) - count(edited)}]
    kept = edits({"type": "clear_thinking_20251015", "keep": "all"},
                 {"type": "clear_thinking_20251015", "keep": {"type": "all"}},
                 {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 9}})
    assert apply_edits(kept, messages, count)[:2] == (messages, [])


def test_edits_run_in_order_each_on_the_last_ones_result():
    messages = agent_conversation(6)
    edited, applied, num_original = apply_edits(edits(
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100}}), messages, count)
    assert [edit["type"] for edit in applied] == ["clear_thinking_20251015", "clear_tool_uses_20250919"]
    assert sum(edit["cleared_input_tokens"] for edit in applied) == num_original - count(edited)
