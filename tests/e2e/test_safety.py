"""The safety stage end to end: input and output policies (block, redact, flag), streamed and
not, through both SDKs, on a real server (its own flag policy, and keys with policies of their
own); what a redacted call leaves in the ledger, the log and the trace; POST /v1/moderations.

The default model is made to write a secret deterministically with a json_schema whose
property is a const: the reply is exactly {"contact": "<the secret>"}. The input screen reads
schemas too, so those calls use keys whose policy screens the output only."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import Server
from tokenway.gateway.keystore import KeyStore
from tokenway.safety.screen import SafetyPolicy

MODEL = "smollm2-135m-instruct"
EMAIL = "ann.lee@example.com"
CARD = "4111 1111 1111 1111"
KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"


def const_reply(value: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "contact", "schema": {
        "type": "object", "properties": {"contact": {"const": value}}, "required": ["contact"]}}}


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def stream_text(oa, **request) -> tuple[str, str]:
    text, finish = [], None
    for chunk in oa.chat.completions.create(**request, stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def trace(server: Server, request_id: str, key: str) -> dict:
    return httpx.get(f"{server.base_url}/v1/traces/{request_id}", headers={"authorization": f"Bearer {key}"},
                     timeout=5).json()


@pytest.fixture(scope="module")
def safety_server(default_model_dir, tmp_path_factory):
    """One server: its own policy flags (email and credit_card); keys with policies of their
    own, which win over it: strict (block input, redact output), lenient (redact input, block
    output), redacting and blocking (output only: redact, block); plain has none."""
    db = tmp_path_factory.mktemp("safety") / "keys.db"
    with KeyStore(db) as store:
        keys = {"plain": store.create("plain")[0],
                "strict": store.create("strict", safety=SafetyPolicy(input="block", output="redact"))[0],
                "lenient": store.create("lenient", safety=SafetyPolicy(input="redact", output="block"))[0],
                "redacting": store.create("redacting", safety=SafetyPolicy(output="redact"))[0],
                "blocking": store.create("blocking", safety=SafetyPolicy(output="block"))[0]}
    server = Server("--no-embeddings", "--safety-input", "flag", "--safety-output", "flag",
                    "--safety-categories", "email,credit_card", db=db)
    server.keys = keys
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def strict(safety_server):
    return safety_server, safety_server.keys["strict"]


@pytest.fixture(scope="module")
def lenient(safety_server):
    return safety_server, safety_server.keys["lenient"]


@pytest.fixture(scope="module")
def redacting(safety_server):
    return safety_server, safety_server.keys["redacting"]


@pytest.fixture(scope="module")
def blocking(safety_server):
    return safety_server, safety_server.keys["blocking"]


@pytest.fixture(scope="module")
def flagging(safety_server):
    return safety_server, safety_server.keys["plain"]


def clients(server: Server, key: str):
    return (openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=120))


def test_blocked_input_is_a_400_in_both_apis_streamed_or_not(strict):
    server, key = strict
    oa, an = clients(server, key)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.chat.completions.create(model=MODEL, messages=ask(f"My card is {CARD}, is it valid?"), max_tokens=5,
                                       stream=stream)
        assert refused.value.code == "content_policy_violation" and refused.value.param == "messages"
        assert "credit_card" in refused.value.message and CARD not in refused.value.message
        with pytest.raises(anthropic.BadRequestError) as refused:
            an.messages.create(model=MODEL, max_tokens=5, stream=stream,
                               messages=ask(f"Use my key {KEY} to call the API."))
        assert refused.value.status_code == 400 and "api_key" in str(refused.value) and KEY not in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        oa.completions.create(model=MODEL, prompt=f"Write to {EMAIL} today", max_tokens=5)
    assert refused.value.code == "content_policy_violation" and refused.value.param == "prompt"
    # Clean input goes through.
    assert oa.chat.completions.create(model=MODEL, messages=ask("Say hi."), max_tokens=5).choices[0].finish_reason


def test_redacted_output_streamed_and_not_and_what_it_leaves_behind(redacting):
    server, key = redacting
    oa, _ = clients(server, key)
    request = dict(model=MODEL, messages=ask("Give me the contact."), response_format=const_reply(EMAIL),
                   max_tokens=40, temperature=0)
    raw = oa.chat.completions.with_raw_response.create(**request)
    reply = raw.parse()
    content = reply.choices[0].message.content
    assert content == '{"contact": "[REDACTED:email]"}' and reply.choices[0].finish_reason == "stop"
    assert raw.headers["x-tokenway-safety-output"] == "redact; email"
    assert stream_text(oa, **request) == (content, "stop")
    entry = trace(server, reply.id, key)
    assert entry["safety"]["output"]["categories"] == ["email"] and entry["safety"]["output"]["action"] == "redact"
    assert "input" not in entry["safety"] and entry["stages_ms"]["safety"] >= 0  # this key screens output only
    # Neither the ledger row, the trace nor the server's log holds the secret.
    assert EMAIL not in json.dumps(server.ledger_row(reply.id)) and EMAIL not in json.dumps(entry)
    assert EMAIL not in server.read_log()
    with pytest.raises(openai.BadRequestError) as refused:  # token texts would show what was redacted
        oa.chat.completions.create(**request, logprobs=True)
    assert refused.value.param == "logprobs"


def test_redacted_input_is_what_the_model_sees(lenient):
    server, key = lenient
    oa, an = clients(server, key)
    raw = oa.completions.with_raw_response.create(model=MODEL, prompt=f"Mail {EMAIL} the key {KEY}:", max_tokens=3,
                                                  echo=True, temperature=0)
    seen = raw.parse().choices[0].text
    assert seen.startswith("Mail [REDACTED:email] the key [REDACTED:api_key]:") and EMAIL not in seen
    assert raw.headers["x-tokenway-safety-input"] == "redact; api_key,email"
    message = an.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=ask(f"Email {EMAIL} now."),
                                                   extra_body={"temperature": 0})
    assert message.headers["x-tokenway-safety-input"] == "redact; email"
    assert EMAIL not in server.read_log() and EMAIL not in json.dumps(server.ledger_row(message.parse().id))


def test_blocked_output_ends_with_content_filter(blocking):
    server, key = blocking
    oa, an = clients(server, key)
    request = dict(model=MODEL, messages=ask("Give me the contact."), response_format=const_reply(CARD),
                   max_tokens=40, temperature=0)
    reply = oa.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "content_filter" and choice.message.content == '{"contact": "'
    assert stream_text(oa, **request) == ('{"contact": "', "content_filter")
    assert trace(server, reply.id, key)["safety"]["output"] == {"categories": ["credit_card"], "action": "block",
                                                             "ms": pytest.approx(0, abs=50)}
    assert CARD not in server.read_log()


def test_flag_passes_everything_and_names_what_it_found(flagging):
    server, key = flagging
    oa, an = clients(server, key)
    request = dict(model=MODEL, messages=ask(f"I am {EMAIL}; my key is {KEY}."), response_format=const_reply(EMAIL),
                   max_tokens=40, temperature=0)
    raw = oa.chat.completions.with_raw_response.create(**request)
    reply = raw.parse()
    assert reply.choices[0].message.content == json.dumps({"contact": EMAIL})
    assert raw.headers["x-tokenway-safety-input"] == "flag; email"  # api_key is not among the categories
    assert raw.headers["x-tokenway-safety-output"] == "flag; email"
    assert stream_text(oa, **request) == (json.dumps({"contact": EMAIL}), "stop")
    safety = trace(server, reply.id, key)["safety"]
    assert safety["input"]["categories"] == ["email"] and safety["output"]["categories"] == ["email"]
    message = an.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=ask(f"Card {CARD}?"),
                                                   extra_body={"temperature": 0})
    assert message.headers["x-tokenway-safety-input"] == "flag; credit_card"


def test_moderations_in_openais_shape(flagging):
    server, key = flagging
    oa, _ = clients(server, key)
    result = oa.moderations.create(input=[f"write to {EMAIL}", "4111 1111 1111 1112 is no card", "hello"])
    flagged = [(r.flagged, {k for k, v in r.categories.model_dump().items() if v}) for r in result.results]
    assert flagged == [(True, {"email"}), (False, set()), (False, set())]
    assert set(result.results[0].category_scores.model_dump()) >= {"email", "credit_card"}
    with pytest.raises(openai.BadRequestError):
        oa.moderations.create(input="")


def test_a_secret_in_tool_call_arguments_is_redacted_streamed_or_not(redacting):
    server, key = redacting
    oa, an = clients(server, key)
    tool = {"type": "function", "function": {"name": "send_mail", "description": "Send a mail", "parameters": {
        "type": "object", "properties": {"to": {"const": EMAIL}}, "required": ["to"]}}}
    request = dict(model=MODEL, messages=ask("Mail Ann."), tools=[tool], tool_choice="required", max_tokens=40,
                   temperature=0)
    reply = oa.chat.completions.create(**request).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in reply.message.tool_calls] == [{"to": "[REDACTED:email]"}]
    streamed = "".join(piece.function.arguments or "" for chunk in oa.chat.completions.create(**request, stream=True)
                       if chunk.choices for piece in chunk.choices[0].delta.tool_calls or ())
    assert streamed == reply.message.tool_calls[0].function.arguments and EMAIL not in streamed
    message = an.messages.create(model=MODEL, max_tokens=40, tool_choice={"type": "any"}, messages=ask("Mail Ann."),
                                 tools=[{"name": "send_mail", "description": "Send a mail",
                                         "input_schema": tool["function"]["parameters"]}],
                                 extra_body={"temperature": 0})
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"to": "[REDACTED:email]"})]
