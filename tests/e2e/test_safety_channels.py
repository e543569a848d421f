"""The input screen on a real server (`tokenway serve --safety-input block`), against an
attacker's probe: a Luhn-valid card number or an sk-proj- key in every channel a request carries
into the prompt (completions as token ids, tool calls and results, tool definitions, schemas,
names, embeddings inputs as text and as token ids, Anthropic's blocks), split between texts and
disguised, through the openai and anthropic SDKs and raw HTTP: each refused with a 400 before
the model runs; under a key whose policy redacts, the model sees the redaction (what echo and
the embedding show), and what cannot be redacted in place is refused. A benign conversation full
of numbers goes through."""

from __future__ import annotations

import json

import anthropic
import httpx
import numpy as np
import openai
import pytest
import tokenizers

from tests.e2e.conftest import Server
from tokenway.embeddings import default_model_dir
from tokenway.gateway.keystore import KeyStore
from tokenway.safety.screen import SafetyPolicy

MODEL = "smollm2-135m-instruct"
EMBEDDINGS = "all-minilm-l6-v2"
CARD = "4111 1111 1111 1111"
KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"


@pytest.fixture(scope="module")
def screened_server(default_model_dir, tmp_path_factory):
    """--safety-input block for every key but `redacting`, whose own policy redacts."""
    db = tmp_path_factory.mktemp("safety-channels") / "keys.db"
    with KeyStore(db) as store:
        keys = {"blocking": store.create("blocking")[0],
                "redacting": store.create("redacting", safety=SafetyPolicy(input="redact"))[0]}
    server = Server("--safety-input", "block", db=db)
    server.keys = keys
    yield server
    assert server.stop() == 0


def clients(server: Server, key: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=120))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def with_call(arguments: str, result: str = "done") -> list[dict]:
    return [user("Look it up."),
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}]


def lookup_tool(description: str = "Look up an order", properties: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": "lookup", "description": description, "parameters": {
        "type": "object", "properties": properties or {"order_id": {"type": "string"}}}}}


ARABIC_CARD = "".join(chr(0x0660 + int(ch)) if ch.isdigit() else ch for ch in CARD)
FULLWIDTH_KEY = "".join(chr(ord(ch) + 0xFEE0) for ch in KEY)
# name -> (chat request fields, the field the 400 names)
CHAT_PROBES = {
    "tool_call_arguments": (dict(messages=with_call(json.dumps({"order_id": KEY}))), "messages"),
    "tool_result": (dict(messages=with_call("{}", f"Card on file: {CARD}")), "messages"),
    "tool_description": (dict(messages=[user("Hi")], tools=[lookup_tool(f"Charges card {CARD}")]), "tools"),
    "enum_value": (dict(messages=[user("Hi")], tools=[lookup_tool(properties={
        "card": {"type": "string", "enum": ["none", CARD]}})]), "tools"),
    "response_format_schema": (dict(messages=[user("Hi")], response_format={
        "type": "json_schema", "json_schema": {"name": "r", "schema": {
            "type": "object", "description": f"Use key {KEY}", "properties": {"ok": {"type": "boolean"}}}}}),
        "response_format"),
    "message_name": (dict(messages=[{"role": "user", "name": KEY, "content": "Hi"}]), "messages"),
    "split_across_parts": (dict(messages=[{"role": "user", "content": [
        {"type": "text", "text": "My card is 4111 11"}, {"type": "text", "text": "11 1111 1111, ok?"}]}]), "messages"),
    "split_across_messages": (dict(messages=[user("My card is 41111111"),
                                             {"role": "assistant", "content": "11111111 is the rest"},
                                             user("Right?")]), "messages"),
    "nbsp_separators": (dict(messages=[user(f"Card {CARD.replace(' ', chr(0xA0))}")]), "messages"),
    "arabic_indic_digits": (dict(messages=[user(f"Card {ARABIC_CARD}")]), "messages"),
    "zwj_between_digits": (dict(messages=[user("Card " + "\u200d".join("4111111111111111"))]), "messages"),
    "cyrillic_key_prefix": (dict(messages=[user("Key \u0455" + KEY[1:])]), "messages"),
    "fullwidth_key": (dict(messages=[user(f"Key {FULLWIDTH_KEY}")]), "messages"),
    "key_broken_by_blanks": (dict(messages=[user(f"Key {KEY[:14]} {KEY[14:29]}\n{KEY[29:]}")]), "messages"),
}


@pytest.mark.parametrize("probe", CHAT_PROBES)
def test_every_chat_channel_and_disguise_is_refused(screened_server, probe):
    fields, param = CHAT_PROBES[probe]
    oa, _ = clients(screened_server, screened_server.keys["blocking"])
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.chat.completions.create(model=MODEL, max_tokens=1, stream=stream, **fields)
        assert refused.value.code == "content_policy_violation" and refused.value.param == param
        assert KEY not in refused.value.message and CARD not in refused.value.message


def test_completion_token_ids_are_read_and_refused(screened_server):
    key = screened_server.keys["blocking"]
    oa, _ = clients(screened_server, key)
    ids = httpx.post(f"{screened_server.base_url}/tokenize", headers={"authorization": f"Bearer {key}"}, timeout=30,
                     json={"model": MODEL, "prompt": f"My key is {KEY} and my card {CARD}"}).json()["tokens"]
    for prompt in (ids, [ids]):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert refused.value.code == "content_policy_violation" and refused.value.param == "prompt"
        assert "api_key" in refused.value.message and "credit_card" in refused.value.message


def embedding_ids(text: str) -> list[int]:
    tokenizer = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    return tokenizer.encode(text).ids


def test_embeddings_inputs_are_screened_as_text_and_as_token_ids(screened_server):
    oa, _ = clients(screened_server, screened_server.keys["blocking"])
    for value in (f"card {CARD}", ["hello", f"key {KEY}"], embedding_ids(f"card {CARD}"),
                  [embedding_ids("hello"), embedding_ids(f"card {CARD}")]):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.embeddings.create(model=EMBEDDINGS, input=value)
        assert refused.value.code == "content_policy_violation" and refused.value.param == "input"
    assert len(oa.embeddings.create(model=EMBEDDINGS, input=["hello", "order 2024-03-15"]).data) == 2


def test_anthropic_blocks_are_refused(screened_server):
    _, an = clients(screened_server, screened_server.keys["blocking"])
    probes = [
        dict(messages=[user("Charge it"), {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "charge", "input": {"key": KEY}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}],
             tools=[{"name": "charge", "input_schema": {"type": "object", "properties": {}}}]),
        dict(messages=[user("Look it up"), {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "Found 4111 1111"}, {"type": "text", "text": "1111 1111."}]}]}],
             tools=[{"name": "lookup", "input_schema": {"type": "object", "properties": {}}}]),
        dict(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": f"Card: {ARABIC_CARD}"}],
             messages=[user("Hi")]),
        dict(messages=[user("Hi")], tools=[{"name": "charge", "description": f"Uses {KEY}",
                                            "input_schema": {"type": "object", "properties": {}}}]),
    ]
    for fields in probes:
        with pytest.raises(anthropic.BadRequestError) as refused:
            an.messages.create(model=MODEL, max_tokens=1, **fields)
        assert refused.value.status_code == 400 and KEY not in str(refused.value)


def test_raw_http_bodies_are_refused_before_any_stream(screened_server):
    key = screened_server.keys["blocking"]
    body = {"model": MODEL, "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "sk-proj-Ab3dEf6h"}, {"type": "text", "text": "Ij9kLm2nOp5qRs8tUv1wXy4z"}]}]}
    response = httpx.post(f"{screened_server.base_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == "content_policy_violation"
    # A NUL between digits is dropped from the view, not a wall in it.
    body = {"model": MODEL, "max_tokens": 1, "messages": [user("card " + "\u0000".join("4111111111111111"))]}
    response = httpx.post(f"{screened_server.base_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 400 and "credit_card" in response.json()["error"]["message"]


def test_a_benign_conversation_full_of_numbers_goes_through(screened_server):
    oa, _ = clients(screened_server, screened_server.keys["blocking"])
    messages = [
        {"role": "system", "content": "You are a support agent. Opening hours 09:00-17:30, refunds within 14 days."},
        user("Order ORD-2024-004471 arrived on 2024-03-15 with 2 of 3 items; I paid $129.99."),
        {"role": "assistant", "content": "Sorry! Ticket #415-555 is open; version 1.26.4 fixed the cart bug."},
        user("4000"), {"role": "assistant", "content": "5000 6000 7000 8000"},
        *with_call(json.dumps({"order_id": "ORD-2024-004471", "qty": 2}),
                   json.dumps({"shipped": "2024-03-12", "tracking": "1Z 999 AA1 0123 4567 84", "total": 129.99})),
    ]
    reply = oa.chat.completions.create(model=MODEL, max_tokens=1, messages=messages, tools=[lookup_tool(properties={
        "order_id": {"type": "string", "description": "e.g. ORD-2024-004471"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99}})])
    assert reply.choices[0].finish_reason


def test_redacting_key_the_model_sees_the_redaction(screened_server):
    key = screened_server.keys["redacting"]
    oa, _ = clients(screened_server, key)
    ids = httpx.post(f"{screened_server.base_url}/tokenize", headers={"authorization": f"Bearer {key}"}, timeout=30,
                     json={"model": MODEL, "prompt": f"My card is {CARD}."}).json()["tokens"]
    raw = oa.completions.with_raw_response.create(model=MODEL, prompt=ids, max_tokens=1, echo=True)
    assert raw.parse().choices[0].text.startswith("My card is [REDACTED:credit_card].")
    assert raw.headers["x-tokenway-safety-input"] == "redact; credit_card"
    # Arguments stay JSON (the template parses them) and the call goes through.
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=with_call(json.dumps({"order_id": KEY, "card": 4111111111111111})))
    assert raw.parse().choices[0].finish_reason
    assert raw.headers["x-tokenway-safety-input"] == "redact; api_key,credit_card"
    # A property named by the key cannot be renamed without changing the schema: refused.
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model=MODEL, max_tokens=1, messages=[user("Hi")],
                                   tools=[lookup_tool(properties={KEY: {"type": "string"}})])
    assert refused.value.code == "content_policy_violation" and refused.value.param == "tools"


def test_redacting_key_embeds_the_redacted_text(screened_server):
    oa, _ = clients(screened_server, screened_server.keys["redacting"])
    redacted, as_text, as_ids = (oa.embeddings.create(model=EMBEDDINGS, input=value).data[0].embedding for value in (
        "card [REDACTED:credit_card] ok", f"card {CARD} ok", embedding_ids(f"card {CARD} ok")))
    assert np.allclose(as_text, redacted, atol=1e-5) and np.allclose(as_ids, redacted, atol=1e-5)
