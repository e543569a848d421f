"""Every field of Anthropic's current Messages reference, as the official SDK sends it, parses;
each block and tool reaches the chat template as the model can read it; what each field asks of
thinking, structure and the prompt cache is what the rest of the server is told."""

import json

import anthropic
import httpx2
import pytest

from tokenway.protocol.anthropic import (
    MessagesPrompt,
    MessagesRequest,
    chat_conversation,
    to_chat_messages,
    to_chat_tools,
)
from tokenway.protocol.anthropic_tools import CLIENT_TOOLS, chat_tool_choice
from tokenway.protocol.sampling import ThinkingRequest

WEATHER = {"name": "get_weather", "description": "Current weather", "cache_control": {"type": "ephemeral"},
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
REPLY = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
         "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
BASE = {"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}


def sent_by_sdk(call):
    """The bodies (and headers) `call(client)` makes the anthropic SDK send."""
    sent = []

    def handler(request):
        sent.append((json.loads(request.content), request.headers))
        return httpx2.Response(200, json={"input_tokens": 1} if request.url.path.endswith("count_tokens") else REPLY)

    client = anthropic.Anthropic(api_key="k", base_url="http://t", max_retries=0,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    call(client)
    return sent


# Every block a request's messages may hold that a text-only model can read, as the SDK types them.
HISTORY = [
    {"role": "user", "content": [
        {"type": "text", "text": "Read this.", "citations": None},
        {"type": "document", "title": "Notes", "context": "from the wiki", "citations": {"enabled": True},
         "source": {"type": "text", "media_type": "text/plain", "data": "Tokenway serves models."}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Part two."}]}},
        {"type": "search_result", "source": "https://example.com", "title": "Example",
         "content": [{"type": "text", "text": "A result."}], "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants a summary.", "signature": "EqoB..."},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "tokenway"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
            {"type": "web_search_result", "url": "https://example.com", "title": "Example",
             "encrypted_content": "xyz"}]},
        {"type": "text", "text": "Let me check the weather."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": [
            {"type": "text", "text": "timeout"}, {"type": "tool_reference", "tool_name": "get_weather"}]},
        {"type": "text", "text": "Go on."},
    ]},
]


def test_the_sdk_sends_every_field_of_the_reference_and_each_parses():
    sent = sent_by_sdk(lambda client: client.messages.create(
        model="m", max_tokens=4096, messages=HISTORY,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[WEATHER, {"type": "bash_20250124", "name": "bash"},
               {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 1000},
               {"type": "memory_20250818", "name": "memory"}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 2048, "display": "summarized"},
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}},
        cache_control={"type": "ephemeral", "ttl": "5m"}, container="container_1",
        diagnostics={"previous_message_id": None}, inference_geo="us", metadata={"user_id": "u1"},
        service_tier="standard_only", speed="fast", stop_sequences=["END"], user_profile_id="up_1",
        workspace_id="wrkspc_1", extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},
        extra_headers={"anthropic-beta": "context-management-2025-06-27,interleaved-thinking-2025-05-14"}))
    body, headers = sent[0]
    assert headers["anthropic-user-profile-id"] == "up_1"  # headers, read by nothing here
    request = MessagesRequest.model_validate(body)
    assert request.thinking_request() == ThinkingRequest(enabled=True, budget_tokens=2048)
    assert request.response_format() == {"type": "json_schema", "json_schema": {"name": "output",
                                                                                "schema": {"type": "object"}}}
    assert [tool["function"]["name"] for tool in to_chat_tools(request)] == [
        "get_weather", "bash", "str_replace_based_edit_tool", "memory"]
    assert chat_tool_choice(request.tool_choice) == "auto"


def test_the_betas_fields_parse():
    sent = sent_by_sdk(lambda client: client.beta.messages.create(
        model="m", max_tokens=2048, messages=[{"role": "user", "content": "hi"}],
        betas=["context-management-2025-06-27"], mcp_servers=[], container={"id": "c1", "skills": []},
        context_management={"edits": [
            {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
            {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 5},
             "keep": {"type": "tool_uses", "value": 1}, "clear_at_least": {"type": "input_tokens", "value": 100},
             "clear_tool_inputs": ["get_weather"], "exclude_tools": ["memory"]}]},
        fallbacks="default", fallback_credit_token="tok", billing_policy={"type": "billing_policy", "bill_to": "self"},
        thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "low"}))
    body, headers = sent[0]
    assert headers["anthropic-beta"] == "context-management-2025-06-27"
    request = MessagesRequest.model_validate(body)
    assert [edit.type for edit in request.context_management.edits] == [
        "clear_thinking_20251015", "clear_tool_uses_20250919"]
    assert request.thinking_request() == ThinkingRequest(enabled=True, budget_tokens=1024)
    assert not request.thinking_shown


def test_count_tokens_bodies_parse():
    sent = sent_by_sdk(lambda client: client.messages.count_tokens(
        model="m", messages=HISTORY, system="Be brief.", tools=[WEATHER], tool_choice={"type": "any"},
        thinking={"type": "enabled", "budget_tokens": 1024}, cache_control={"type": "ephemeral"}))
    prompt = MessagesPrompt.model_validate(sent[0][0])
    assert prompt.thinking_request() == ThinkingRequest(enabled=True, budget_tokens=1024)


@pytest.mark.parametrize("thinking, output_config, expected", [
    (None, None, None),
    ({"type": "disabled"}, {"effort": "high"}, ThinkingRequest(enabled=False)),
    ({"type": "enabled", "budget_tokens": 1500}, {"effort": "low"}, ThinkingRequest(enabled=True, budget_tokens=1500)),
    ({"type": "adaptive"}, None, ThinkingRequest(enabled=True)),
    ({"type": "adaptive"}, {"effort": "medium"}, ThinkingRequest(enabled=True, budget_tokens=2048)),
    ({"type": "adaptive"}, {"effort": "max"}, ThinkingRequest(enabled=True)),
    ({"type": "between_tools"}, None, ThinkingRequest(enabled=True)),
    (None, {"effort": "xhigh"}, ThinkingRequest(budget_tokens=8192)),  # bounds a model that thinks by default
])
def test_what_a_call_asks_of_thinking(thinking, output_config, expected):
    body = {**BASE, **({"thinking": thinking} if thinking else {}),
            **({"output_config": output_config} if output_config else {})}
    assert MessagesRequest.model_validate(body).thinking_request() == expected


def test_each_block_reaches_the_template_as_the_model_reads_it():
    conversation = chat_conversation(MessagesRequest.model_validate({**BASE, "messages": HISTORY}))
    user, assistant, result, follow_up = conversation.messages
    assert user == {"role": "user", "content": (
        "Read this.\n<document>\n<title>Notes</title>\n<context>from the wiki</context>\nTokenway serves models.\n"
        "</document>\n<document>\nPart two.\n</document>\n<search_result>\n<title>Example</title>\n"
        "<source>https://example.com</source>\nA result.\n</search_result>")}
    # Thinking goes on as the turn's reasoning, Anthropic's encrypted thinking nowhere; the
    # server tool's call and result are read as text, their encrypted fields left out.
    assert assistant == {"role": "assistant", "reasoning_content": "The user wants a summary.", "content": (
        '[web_search: {"query": "tokenway"}]\n[web_search_tool_result: [{"type": "web_search_result", '
        '"url": "https://example.com", "title": "Example"}]]\nLet me check the weather.'),
        "tool_calls": [{"id": "toolu_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert result == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timeout"}
    assert follow_up == {"role": "user", "content": "Go on."}
    # The search result's breakpoint is in the first message: the prompt up to its end is cached.
    assert (conversation.num_cached_messages, conversation.cache_ttl) == (1, "1h")


@pytest.mark.parametrize("patch, num_cached", [
    ({}, 0),
    ({"system": "S"}, 0),
    ({"system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}]}, 1),
    ({"system": "S", "tools": [WEATHER]}, 1),  # tools come before the system prompt
    ({"tools": [WEATHER]}, 0),  # no system message to end the cached part at
    ({"system": "S", "cache_control": {"type": "ephemeral"}}, 4),  # the last block: the whole conversation
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                       {"type": "text", "text": "r", "cache_control": {"type": "ephemeral"}}]}]},
                   {"role": "user", "content": "c"}]}, 3),
])
def test_the_cache_breakpoint_is_the_end_of_the_message_holding_the_last(patch, num_cached):
    body = {**BASE, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                 {"role": "user", "content": "c"}], **patch}
    assert chat_conversation(MessagesRequest.model_validate(body)).num_cached_messages == num_cached


def test_client_tools_get_their_documented_schemas_and_custom_tools_their_examples():
    tools = to_chat_tools(MessagesRequest.model_validate({**BASE, "tools": [
        {"type": "text_editor_20250124", "name": "str_replace_editor"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        {**WEATHER, "input_examples": [{"city": "Oslo"}], "strict": True, "defer_loading": False}]}))
    old_editor, editor, weather = (tool["function"] for tool in tools)
    assert "undo_edit" in old_editor["parameters"]["properties"]["command"]["enum"]
    assert "undo_edit" not in editor["parameters"]["properties"]["command"]["enum"]  # Claude 4's editor has none
    assert weather["description"] == 'Current weather\n\nExample inputs:\n{"city": "Oslo"}'
    assert {name for name, _ in CLIENT_TOOLS.values()} == {"bash", "str_replace_editor",
                                                           "str_replace_based_edit_tool", "memory"}


def test_tool_choice_none_offers_no_tools_and_a_named_client_tool_may_be_forced():
    request = MessagesRequest.model_validate({**BASE, "tools": [{"type": "bash_20250124", "name": "bash"}],
                                              "tool_choice": {"type": "tool", "name": "bash"}})
    assert chat_tool_choice(request.tool_choice) == {"type": "function", "function": {"name": "bash"}}
    request = MessagesRequest.model_validate({**BASE, "tools": [WEATHER], "tool_choice": {"type": "none"}})
    assert to_chat_tools(request) is None


def test_a_compaction_block_is_read_as_the_summary_it_is():
    request = MessagesRequest.model_validate({**BASE, "messages": [
        {"role": "assistant", "content": [{"type": "compaction", "content": "Earlier: the user asked for X."}]},
        {"role": "user", "content": "Continue."}]})
    assert to_chat_messages(request)[0] == {"role": "assistant", "content": "Earlier: the user asked for X."}
