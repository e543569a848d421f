"""A body's bytes -> a request model or one 400 naming the problem: nothing a client sends
gets past this as an exception of another kind."""

import json

import pytest

from tokenway.protocol.body import MAX_JSON_DEPTH, decode_json_body
from tokenway.protocol.errors import InvalidRequestError
from tokenway.protocol.openai import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def body(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


def refusal(raw: bytes, model=ChatCompletionRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        decode_json_body(raw, model)
    return info.value


def test_a_valid_body_parses():
    parsed = decode_json_body(body(max_tokens=3), ChatCompletionRequest)
    assert parsed.max_tokens == 3 and parsed.messages[0].content == "hi"


@pytest.mark.parametrize("raw, code, words", [
    (b'{"model": "\xff"}', None, "not valid UTF-8"),
    (b'{"model": ', None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b"[" * 10_000 + b"]" * 10_000, "json_too_deep", "nested too deeply"),
    (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "number_too_large", "at most 4300 digits"),
])
def test_malformed_bodies_are_named(raw, code, words):
    error = refusal(raw)
    assert error.code == code and words in error.message


def test_nesting_beyond_the_limit_names_where_even_below_the_parser_limit():
    schema: dict = {"type": "string"}
    for _ in range(40):  # 80 levels: json.loads copes, the limit does not allow it
        schema = {"type": "object", "properties": {"a": schema}}
    error = refusal(body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert error.code == "json_too_deep" and f"the limit is {MAX_JSON_DEPTH}" in error.message
    assert error.param.startswith("response_format.json_schema.schema.properties.a")
    shallow = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    parsed = decode_json_body(body(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                           "schema": shallow}}),
                              ChatCompletionRequest)
    assert parsed.response_format is not None


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\uDFFFb"}]}', "messages[0].content"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"\\ud83d": "v"}}',
     "metadata.\\ud83d"),
])
def test_a_lone_surrogate_is_invalid_unicode_naming_the_field(raw, param):
    error = refusal(raw)
    assert error.code == "invalid_unicode" and error.param == param
    json.dumps({"message": error.message}, ensure_ascii=False).encode("utf-8")  # the error itself renders


def test_a_surrogate_pair_and_an_escaped_backslash_are_fine():
    raw = b'{"model": "m", "prompt": "smile \\ud83d\\ude00 and \\\\ud800 literally"}'
    parsed = decode_json_body(raw, CompletionRequest)
    assert parsed.prompt == "smile \U0001F600 and \\ud800 literally"


def test_counts_are_capped_where_they_enter():
    error = refusal(body(max_tokens=2**40))
    assert error.param == "max_tokens" and "2147483647" in error.message
