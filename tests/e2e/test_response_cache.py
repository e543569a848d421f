"""The response cache end to end: a real server whose model turns it on ([models.cache]), the
official SDKs. A hit's body is the miss's, it is billed at the cached_response price and traced
as a hit; entries never cross keys; Cache-Control bypasses; a stream replays the same events."""

from __future__ import annotations

import json
import time
import uuid

import anthropic
import httpx
import openai
import pytest

from .conftest import Server
from .test_gateway_policy import MODEL, create_key

# input and output at $0.001 a token, a hit's tokens at $0.000001: a row's price tells which it was.
CONFIG = f"""
embeddings = false
[[models]]
name = "{MODEL}"
  [[models.replicas]]
  kind = "local"
  [models.prices]
  input = 1000.0
  cached_input = 1000.0
  output = 1000.0
  cached_response = 1.0
  [models.cache]
  enabled = true
  ttl_s = 600
"""


@pytest.fixture(scope="module")
def cached(default_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "tokenway.toml"
    path.write_text(CONFIG)
    server = Server("--config", str(path))
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def keys(cached) -> list[str]:
    made = [create_key(cached.db, "--name", name) for name in ("alice", "bob")]
    # The server reads the key file within 2 s; until then auth is off and every call is anonymous.
    deadline = time.monotonic() + 30
    while httpx.get(f"{cached.base_url}/v1/models", timeout=10).status_code != 401:
        assert time.monotonic() < deadline, "the server never turned auth on"
        time.sleep(0.1)
    return made


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(server: Server, key: str, content: str, headers: dict | None = None, **fields):
    """One chat call, greedy unless fields say: (the x-tokenway-cache header or None, the parsed completion)."""
    raw = client(server, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8, extra_headers=headers,
        **{"temperature": 0, **fields})
    return raw.headers.get("x-tokenway-cache"), raw.parse()


def without_ids(completion) -> dict:
    body = completion.model_dump()
    del body["id"], body["created"]
    return body


def fresh() -> str:
    return f"Name a colour. ({uuid.uuid4().hex[:6]})"


def test_a_hit_is_the_miss_replayed_billed_and_traced_as_a_hit(cached, keys):
    key = keys[0]
    content = fresh()
    status, miss = ask(cached, key, content)
    assert status == "miss"
    status, hit = ask(cached, key, content)
    assert status == "hit"
    assert without_ids(hit) == without_ids(miss) and hit.id != miss.id
    miss_row, hit_row = cached.ledger_row(miss.id), cached.ledger_row(hit.id)
    usage = miss.usage
    num_tokens = usage.prompt_tokens + usage.completion_tokens
    assert json.loads(miss_row["trace"])["response_cache"] == "miss"
    assert miss_row["cost_usd"] == pytest.approx(num_tokens * 1e-3)
    hit_trace = json.loads(hit_row["trace"])
    assert hit_trace["response_cache"] == "hit" and hit_trace["route"]["replica"] == "response_cache"
    assert (hit_row["prompt_tokens"], hit_row["cached_tokens"], hit_row["completion_tokens"]) == \
        (usage.prompt_tokens, usage.prompt_tokens, usage.completion_tokens)
    assert hit_row["cost_usd"] == pytest.approx(num_tokens * 1e-6)
    trace = httpx.get(f"{cached.base_url}/v1/traces/{hit.id}", headers={"Authorization": f"Bearer {key}"}).json()
    assert trace["response_cache"] == "hit"


def test_an_entry_never_crosses_keys(cached, keys):
    alice, bob = keys
    content = fresh()
    assert ask(cached, alice, content)[0] == "miss"
    assert ask(cached, bob, content)[0] == "miss"
    assert ask(cached, bob, content)[0] == "hit"


def test_no_cache_bypasses_the_lookup_and_still_keeps_no_store_does_neither(cached, keys):
    key = keys[0]
    content = fresh()
    assert ask(cached, key, content)[0] == "miss"
    assert ask(cached, key, content, {"Cache-Control": "no-cache"})[0] == "miss"
    other = fresh()
    assert ask(cached, key, other, {"Cache-Control": "no-cache"})[0] == "miss"
    assert ask(cached, key, other)[0] == "hit"  # kept all the same
    unkept = fresh()
    assert ask(cached, key, unkept, {"Cache-Control": "no-store"})[0] == "miss"
    assert ask(cached, key, unkept)[0] == "miss"


def test_a_sampled_call_is_not_covered_and_a_seeded_one_is(cached, keys):
    key = keys[0]
    content = fresh()
    assert ask(cached, key, content, temperature=0.9)[0] is None
    assert ask(cached, key, content, temperature=0.9, seed=7)[0] == "miss"
    status, _ = ask(cached, key, content, temperature=0.9, seed=7)
    assert status == "hit"


def test_a_stream_is_replayed_as_the_same_events_and_hits_what_a_json_call_kept(cached, keys):
    key = keys[0]
    content = fresh()

    def stream() -> tuple[str | None, list]:
        with client(cached, key).chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0,
                stream=True, stream_options={"include_usage": True}) as response:
            chunks = [(c.choices[0].delta.content, c.choices[0].finish_reason) if c.choices
                      else c.usage and c.usage.model_dump() for c in response.parse()]
            return response.headers.get("x-tokenway-cache"), chunks

    status, first = stream()
    assert status == "miss" and len(first) > 3
    status, again = stream()
    assert status == "hit" and again == first
    status, body = ask(cached, key, content)
    assert status == "hit"
    assert body.choices[0].message.content == "".join(text for text, _ in first[:-1] if text)


def test_messages_and_completions_hit_too(cached, keys):
    key = keys[0]
    content = fresh()
    messages = anthropic.Anthropic(base_url=cached.base_url, api_key=key, max_retries=0, timeout=120)
    replies = []
    for expected in ("miss", "hit"):
        turns: list = [{"role": "user", "content": content}]
        raw = messages.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=turns,
                                                         extra_body={"temperature": 0})
        assert raw.headers.get("x-tokenway-cache") == expected
        replies.append(raw.parse())
    assert replies[0].content == replies[1].content and replies[0].usage == replies[1].usage
    completions = []
    for expected in ("miss", "hit"):
        raw = client(cached, key).completions.with_raw_response.create(model=MODEL, prompt=content, max_tokens=8,
                                                                        temperature=0)
        assert raw.headers.get("x-tokenway-cache") == expected
        completions.append(raw.parse())
    assert completions[0].choices == completions[1].choices


def test_responses_hit_too(cached, keys):
    content = fresh()
    outputs = []
    for expected in ("miss", "hit"):
        raw = client(cached, keys[0]).responses.with_raw_response.create(
            model=MODEL, input=content, max_output_tokens=8, temperature=0, store=False)
        assert raw.headers.get("x-tokenway-cache") == expected
        outputs.append(raw.parse())
    assert outputs[0].output_text == outputs[1].output_text and outputs[0].usage == outputs[1].usage
