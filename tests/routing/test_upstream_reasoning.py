"""A reasoning model behind an OpenAI-compatible or an Anthropic upstream: the job's
ThinkingRequest goes in each API's terms (reasoning_effort, vLLM's chat_template_kwargs,
Anthropic's thinking, left to the model's default where Anthropic would refuse it), and the
thinking each streams back (reasoning_content or reasoning deltas; thinking blocks) comes out as
ChoiceDelta.reasoning, with the upstream's reasoning token count in the Usage."""

from __future__ import annotations

import pytest

from tokenway.protocol.job import ChoiceDelta, GenerationJob, Usage
from tokenway.protocol.sampling import SamplingParams, ThinkingRequest, effort_thinking
from tokenway.routing.anthropic_upstream import AnthropicUpstream, thinking_config
from tokenway.routing.openai_upstream import OpenAIUpstream
from tokenway.routing.upstream import reasoning_effort

from .stub_upstream import DONE, Reply, StubUpstream, anthropic_event, collect, openai_chunk, sse

USER = ({"role": "user", "content": "hi"},)
ASSISTANT_THOUGHT = {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture()
def stub():
    with StubUpstream() as server:
        yield server


def make_job(**fields) -> GenerationJob:
    """A streamed caller's job (test_upstream_unstreamed.py: the other road)."""
    fields.setdefault("stream", True)
    fields.setdefault("messages", USER)
    fields.setdefault("params", SamplingParams(max_tokens=4000))
    return GenerationJob("req-1", "served", "chat", **fields)


# ---- the effort a ThinkingRequest names ----------------------------------------------------------


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", "xhigh"])
def test_every_effort_round_trips_through_its_thinking_request(effort):
    assert reasoning_effort(effort_thinking(effort)) == effort


# ---- OpenAI-compatible ---------------------------------------------------------------------------


def openai_usage_with_reasoning(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int) -> bytes:
    return sse({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}})


def thinking_chunk(field: str, text: str) -> bytes:
    return sse({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {field: text}, "finish_reason": None}]})


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_openai_upstreams_thinking_deltas_are_the_reasoning_and_its_count_is_kept(stub, field):
    stub.script(Reply(chunks=(openai_chunk(text=""), thinking_chunk(field, "Think"), thinking_chunk(field, "ing."),
                              openai_chunk(text="Hi!"),
                              openai_chunk(finish_reason="stop"), openai_usage_with_reasoning(9, 12, 8), DONE)))
    events = collect(OpenAIUpstream("vllm", stub.base_url, "up"), make_job())
    assert events == [ChoiceDelta(0, reasoning="Think"), ChoiceDelta(0, reasoning="ing."), ChoiceDelta(0, text="Hi!"),
                      ChoiceDelta(0, finish_reason="stop"), Usage(9, 12, reasoning_tokens=8)]


def test_an_openai_upstream_is_sent_the_effort_and_not_the_thinking_it_cannot_read(stub):
    stub.script(Reply(chunks=(openai_chunk(text="ok", finish_reason="stop"), DONE)))
    collect(OpenAIUpstream("openai", stub.base_url, "up"),
            make_job(messages=(*USER, ASSISTANT_THOUGHT, *USER), thinking=effort_thinking("low")))
    body = stub.received[0].body
    assert body["reasoning_effort"] == "low" and "chat_template_kwargs" not in body
    assert body["messages"][1] == {"role": "assistant", "content": "Hello!"}


def test_a_vllm_upstream_gets_the_templates_switch_and_the_earlier_thinking(stub):
    stub.script(Reply(chunks=(openai_chunk(text="ok", finish_reason="stop"), DONE)))
    collect(OpenAIUpstream("vllm", stub.base_url, "up", sampling_extensions=True),
            make_job(messages=(*USER, ASSISTANT_THOUGHT, *USER), thinking=effort_thinking("none")))
    body = stub.received[0].body
    assert body["reasoning_effort"] == "none" and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["messages"][1] == ASSISTANT_THOUGHT


def test_without_a_thinking_request_an_openai_upstream_gets_no_reasoning_field(stub):
    stub.script(Reply(chunks=(openai_chunk(text="ok", finish_reason="stop"), DONE)))
    collect(OpenAIUpstream("vllm", stub.base_url, "up", sampling_extensions=True), make_job())
    assert not {"reasoning_effort", "chat_template_kwargs"} & set(stub.received[0].body)


# ---- Anthropic -----------------------------------------------------------------------------------


def anthropic_thinking_reply() -> Reply:
    return Reply(chunks=(
        anthropic_event("message_start", message={"id": "m", "type": "message", "role": "assistant", "content": [],
                                                  "model": "claude-x", "usage": {"input_tokens": 20,
                                                                                 "output_tokens": 1}}),
        anthropic_event("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}),
        anthropic_event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Two and "}),
        anthropic_event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "two."}),
        anthropic_event("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "EqQB..."}),
        anthropic_event("content_block_stop", index=0),
        anthropic_event("content_block_start", index=1, content_block={"type": "redacted_thinking", "data": "x"}),
        anthropic_event("content_block_stop", index=1),
        anthropic_event("content_block_start", index=2, content_block={"type": "text", "text": ""}),
        anthropic_event("content_block_delta", index=2, delta={"type": "text_delta", "text": "4"}),
        anthropic_event("content_block_stop", index=2),
        anthropic_event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 30}),
        anthropic_event("message_stop")))


def test_anthropic_thinking_blocks_are_the_reasoning_and_the_budget_goes_as_thinking(stub):
    stub.script(anthropic_thinking_reply())
    job = make_job(messages=(*USER, ASSISTANT_THOUGHT, *USER), thinking=effort_thinking("medium"),
                   params=SamplingParams(temperature=0.2, top_p=0.5, top_k=5, max_tokens=4000))
    events = collect(AnthropicUpstream("claude", stub.base_url, "claude-x"), job)
    assert events == [ChoiceDelta(0, reasoning="Two and "), ChoiceDelta(0, reasoning="two."), ChoiceDelta(0, text="4"),
                      ChoiceDelta(0, finish_reason="stop"), Usage(20, 30)]
    body = stub.received[0].body
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    # With thinking Anthropic takes no temperature but 1, no top_k, and top_p from 0.95.
    assert "temperature" not in body and "top_k" not in body and body["top_p"] == 0.95
    assert body["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}


@pytest.mark.parametrize("thinking, fields, config", [
    (None, {}, None),
    (ThinkingRequest(), {}, None),
    (ThinkingRequest(enabled=False), {}, {"type": "disabled"}),
    (ThinkingRequest(enabled=True), {}, {"type": "adaptive"}),
    (ThinkingRequest(enabled=True, budget_tokens=128), {}, {"type": "enabled", "budget_tokens": 1024}),
    (ThinkingRequest(enabled=True, budget_tokens=9000), {}, {"type": "enabled", "budget_tokens": 3999}),
    (ThinkingRequest(enabled=True, budget_tokens=2000), {"params": SamplingParams(max_tokens=1000)}, None),
    (ThinkingRequest(enabled=True, budget_tokens=2000), {"tools": (TOOL,), "tool_choice": "required"}, None),
    (ThinkingRequest(enabled=True, budget_tokens=2000), {"tools": (TOOL,), "tool_choice": "auto"},
     {"type": "enabled", "budget_tokens": 2000}),
    (ThinkingRequest(enabled=True, budget_tokens=2000), {"messages": (
        *USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "done"})}, None),
])
def test_thinking_config_leaves_to_the_model_what_anthropic_would_refuse(thinking, fields, config):
    job = make_job(thinking=thinking, **fields)
    assert thinking_config(job, job.params.max_tokens or 4096) == config
