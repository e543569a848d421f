"""What /v1/messages and /v1/messages/count_tokens send back, in front of a scripted replica:
thinking blocks before the text, streamed as Anthropic streams them and accumulated by the SDK's
own stream helper, sent back in the next turn; usage, stop details and context edits as the
SDK's (and the beta's) types declare them."""

import anthropic
import httpx2
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.beta import BetaMessage, BetaMessageTokensCount

from tokenway.protocol.job import ChoiceDelta, Usage
from tokenway.protocol.sampling import ThinkingRequest
from tokenway.routing.router import Pool, Router
from tokenway.safety.screen import SafetyPolicy
from tokenway.server.anthropic_render import thinking_signature
from tokenway.server.app import create_app
from tokenway.server.services import ModelCatalog, ServerConfig, Services

from .conftest import MODEL, ScriptedServer, sse_events, validate_strictly

THINKING = {"type": "enabled", "budget_tokens": 1024}
BODY = {"max_tokens": 2048, "thinking": THINKING, "messages": [{"role": "user", "content": "What is 2+2?"}]}
# The replica splits the reply itself (as an upstream that parses thinking does): two pieces of
# thinking, then the answer.
EVENTS = [
    ChoiceDelta(0, reasoning="2 and 2"),
    ChoiceDelta(0, reasoning=" make 4."),
    ChoiceDelta(0, text="4", finish_reason="stop"),
    Usage(prompt_tokens=20, completion_tokens=9, reasoning_tokens=6),
]


def sdk_client(scripted: ScriptedServer, received: list | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="k", base_url="http://t", max_retries=0, _strict_response_validation=True,
                               http_client=httpx2.Client(transport=scripted.sdk_transport(received)))


def test_thinking_comes_first_signed_and_counted(scripted):
    message = validate_strictly(Message, scripted.answer("/v1/messages", BODY, EVENTS).json())
    thinking, text = message.content
    assert (thinking.type, thinking.thinking, thinking.signature) == (
        "thinking", "2 and 2 make 4.", thinking_signature("2 and 2 make 4."))
    assert (text.type, text.text, message.stop_reason, message.stop_details) == ("text", "4", "end_turn", None)
    usage = message.usage
    assert (usage.output_tokens, usage.output_tokens_details.thinking_tokens, usage.service_tier) == (9, 6, "standard")
    assert (usage.cache_creation.ephemeral_5m_input_tokens, usage.cache_creation.ephemeral_1h_input_tokens) == (0, 0)
    job = scripted.replica.jobs[0]
    assert job.thinking == ThinkingRequest(enabled=True, budget_tokens=1024)  # an upstream asks in its own terms


def test_thinking_streams_as_anthropic_streams_it(scripted):
    events = sse_events(scripted.answer("/v1/messages", {**BODY, "stream": True}, EVENTS).text)
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    start, block, first, second, signature, stop, text_block, text, text_stop, delta, _ = [
        validate_strictly(RawMessageStreamEvent, data) for name, data in events if name != "ping"]
    assert (block.index, block.content_block.type, block.content_block.thinking) == (0, "thinking", "")
    assert (first.delta.thinking, second.delta.thinking) == ("2 and 2", " make 4.")
    assert (signature.delta.type, signature.delta.signature) == (
        "signature_delta", thinking_signature("2 and 2 make 4."))
    assert (stop.index, text_block.index, text.delta.text, text_stop.index) == (0, 1, "4", 1)
    assert delta.usage.output_tokens_details.thinking_tokens == 6


def test_the_sdks_stream_helper_accumulates_the_same_message_and_it_goes_back_unchanged(scripted):
    received = []
    client = sdk_client(scripted, received)
    scripted.replica.events = EVENTS
    created = client.messages.create(model=MODEL, **BODY)
    with client.messages.stream(model=MODEL, **BODY) as stream:
        thinking = "".join(event.thinking for event in stream if event.type == "thinking")
        streamed = stream.get_final_message()
    assert thinking == "2 and 2 make 4."
    assert streamed.model_dump(exclude={"id"}) == created.model_dump(exclude={"id"})
    history = [*BODY["messages"], streamed.to_param(), {"role": "user", "content": "And 3+3?"}]
    client.messages.create(model=MODEL, max_tokens=2048, thinking=THINKING, messages=history)
    assert received[-1]["messages"][1]["content"][0] == streamed.content[0].model_dump()
    assistant = scripted.replica.jobs[-1].messages[1]
    assert assistant == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."}


def test_display_omitted_sends_thinking_blocks_without_their_text(scripted):
    body = {**BODY, "thinking": {**THINKING, "display": "omitted"}}
    message = validate_strictly(Message, scripted.answer("/v1/messages", body, EVENTS).json())
    assert (message.content[0].thinking, message.content[0].signature) == ("", thinking_signature("2 and 2 make 4."))
    events = sse_events(scripted.answer("/v1/messages", {**body, "stream": True}, EVENTS).text)
    assert [data["delta"]["type"] for name, data in events if name == "content_block_delta"] == [
        "signature_delta", "text_delta"]


def test_a_reply_cut_while_thinking_is_its_thinking_alone(scripted):
    events = [ChoiceDelta(0, reasoning="Hmm", finish_reason="length"), Usage(prompt_tokens=5, completion_tokens=3)]
    message = validate_strictly(Message, scripted.answer("/v1/messages", BODY, events).json())
    assert [block.type for block in message.content] == ["thinking"] and message.stop_reason == "max_tokens"


def test_max_tokens_0_fills_the_cache_and_shows_nothing(scripted):
    events = [ChoiceDelta(0, text="x", finish_reason="length"), Usage(prompt_tokens=5, completion_tokens=1)]
    body = {"max_tokens": 0, "messages": BODY["messages"]}
    message = validate_strictly(Message, scripted.answer("/v1/messages", body, events).json())
    assert (message.content, message.stop_reason) == ([], "max_tokens")
    assert scripted.replica.jobs[0].params.max_tokens == 1
    names = [name for name, _ in sse_events(scripted.answer("/v1/messages", {**body, "stream": True}, events).text)]
    assert names == ["message_start", "message_delta", "message_stop"]


def test_output_config_format_is_the_jobs_response_format(scripted):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = {"max_tokens": 50, "messages": BODY["messages"],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    scripted.answer("/v1/messages", body, [ChoiceDelta(0, text='{"answer": 4}', finish_reason="stop"),
                                           Usage(prompt_tokens=5, completion_tokens=5)])
    assert scripted.replica.jobs[0].response_format == {"type": "json_schema",
                                                        "json_schema": {"name": "output", "schema": schema}}


def test_a_reply_the_safety_stage_ends_is_a_refusal_with_its_details(scripted):
    router = Router({MODEL: Pool.of(MODEL, [scripted.replica])})
    config = ServerConfig(served_model_names=(MODEL,), safety=SafetyPolicy(output="block"))
    scripted.app = create_app(Services.build(config, ModelCatalog((MODEL,), context_windows={MODEL: 4096}), router))
    events = [ChoiceDelta(0, text="My card is 4111 1111 1111 1111, and", finish_reason="stop"),
              Usage(prompt_tokens=5, completion_tokens=12)]
    message = validate_strictly(Message, scripted.answer("/v1/messages", {**BODY, "thinking": None}, events).json())
    assert message.stop_reason == "refusal"
    assert message.stop_details.type == "refusal" and "content policy" in message.stop_details.explanation


def test_context_edits_made_are_reported(scripted):
    tool = {"name": "read", "input_schema": {"type": "object"}}
    history = [{"role": "user", "content": "Go."}]
    for i in range(3):
        use = {"type": "tool_use", "id": f"t{i}", "name": "read", "input": {}}
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": "x" * 400}
        history += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    body = {"max_tokens": 50, "messages": history, "tools": [tool], "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10},
         "keep": {"type": "tool_uses", "value": 1}}]}}
    message = validate_strictly(BetaMessage, scripted.answer("/v1/messages", body, [
        ChoiceDelta(0, text="Done.", finish_reason="stop"), Usage(prompt_tokens=50, completion_tokens=2)]).json())
    (edit,) = message.context_management.applied_edits
    assert (edit.type, edit.cleared_tool_uses) == ("clear_tool_uses_20250919", 2) and edit.cleared_input_tokens > 150
    results = [m["content"] for m in scripted.replica.jobs[0].messages if m["role"] == "tool"]
    assert results[2] == "x" * 400 and results[0] == results[1] != "x" * 400
    counted = scripted.request("POST", "/v1/messages/count_tokens", {
        "model": MODEL, **{k: v for k, v in body.items() if k != "max_tokens"}}).json()
    counted = validate_strictly(BetaMessageTokensCount, counted)
    assert counted.context_management.original_input_tokens > counted.input_tokens


def test_count_tokens_through_the_sdk_with_betas_named(scripted):
    client = sdk_client(scripted)
    counted = client.messages.count_tokens(model=MODEL, messages=BODY["messages"], system="Be brief.",
                                           thinking=THINKING, extra_headers={"anthropic-beta": "a-1,b-2"})
    assert isinstance(counted, MessageTokensCount) and counted.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "text only" in caught.value.body["error"]["message"]


def test_every_betas_header_is_tolerated(scripted):
    scripted.replica.events = EVENTS
    client = sdk_client(scripted)
    message = client.beta.messages.create(model=MODEL, betas=["context-management-2025-06-27",
                                                              "interleaved-thinking-2025-05-14", "no-such-beta"],
                                          **BODY)
    assert message.content[1].text == "4"
