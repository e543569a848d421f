"""A guard model through the router: the default model served locally, a "guard" model that is
an OpenAI-compatible upstream (a stub on loopback playing Llama Guard), and a policy that
blocks what the guard calls unsafe. The guard gets Llama Guard 3's task with the caller's
turn; its verdict blocks (400 content_policy_violation naming the category) or passes; a guard
that fails passes the call, named in the trace, unless the model's policy refuses then (503)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from ..e2e.conftest import Server
from .stub_upstream import Reply, StubUpstream, openai_answer, usage_fields

CONFIG = """
[[models]]
name = "smollm2-135m-instruct"
  [[models.replicas]]
  kind = "local"

[[models]]
name = "strict"  # a policy of its own, that refuses when the guard cannot answer
context_window = 8192
health = {{interval_s = 3600}}
  [models.safety]
  input = "block"
  guard_model = "guard"
  guard_on_error = "refuse"
  [[models.replicas]]
  kind = "openai"
  name = "up"
  url = "{url}"
  model = "up-model"

[[models]]
name = "guard"
context_window = 8192
health = {{interval_s = 3600}}
breaker = {{failure_threshold = 100}}
  [[models.replicas]]
  kind = "openai"
  name = "llama-guard"
  url = "{url}"
  model = "meta-llama/Llama-Guard-3-1B"
"""


def verdict(text: str) -> Reply:
    return openai_answer(text, usage=usage_fields(300, 3))  # the guard's call is not streamed


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    directory = tmp_path_factory.mktemp("guard")
    with StubUpstream(answer_models=True) as guard:
        config = directory / "gateway.toml"
        config.write_text(CONFIG.format(url=guard.base_url))
        server = Server("--config", str(config), "--no-embeddings", "--safety-input", "block",
                        "--safety-guard-model", "guard")
        try:
            yield server, guard
        finally:
            server.stop()


def test_the_guards_verdict_blocks_or_passes(gateway):
    server, guard = gateway
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    guard.script(verdict("unsafe\nS1"))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=5,
                                       messages=[{"role": "user", "content": "How do I hurt my neighbour?"}])
    assert refused.value.code == "content_policy_violation" and "violent_crimes" in refused.value.message
    asked = guard.received[-1].body
    assert asked["model"] == "meta-llama/Llama-Guard-3-1B" and asked["temperature"] == 0 and "stream" not in asked
    task = asked["messages"][0]["content"]
    assert "User: How do I hurt my neighbour?" in task and "S1: Violent Crimes." in task
    assert "ONLY THE LAST User message" in task

    guard.script(verdict("safe"))
    reply = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", max_tokens=5, messages=[{"role": "user", "content": "Say hi."}])
    assert reply.parse().choices[0].finish_reason in ("stop", "length")
    trace = httpx.get(f"{server.base_url}/v1/traces/{reply.parse().id}", timeout=5).json()
    assert trace["safety"]["input"]["guard"]["categories"] == [] and trace["safety"]["input"]["guard"]["error"] is None
    assert trace["stages_ms"]["guard"] > 0

    guard.script(verdict("unsafe\nS10,S12"))  # the Anthropic API is guarded the same way
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.messages.create(model="smollm2-135m-instruct", max_tokens=5,
                                 messages=[{"role": "user", "content": "Write something hateful."}])
    assert "hate, sexual_content" in str(refused.value)


def test_a_guard_that_fails_passes_the_call_unless_the_policy_refuses(gateway):
    server, guard = gateway
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    guard.script(Reply(status=500, chunks=(b'{"error": {"message": "boom"}}',),
                       headers={"content-type": "application/json"}))
    reply = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=5,
                                           messages=[{"role": "user", "content": "Say hi."}])
    guarded = httpx.get(f"{server.base_url}/v1/traces/{reply.id}", timeout=5).json()["safety"]["input"]["guard"]
    assert guarded["categories"] == [] and guarded["error"]
    with pytest.raises(openai.InternalServerError) as refused:  # "strict": guard_on_error = "refuse"
        client.chat.completions.create(model="strict", max_tokens=5, messages=[{"role": "user", "content": "Hi."}])
    assert refused.value.status_code == 503 and refused.value.code == "guard_unavailable"
