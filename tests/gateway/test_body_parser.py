"""Large bodies are parsed in a worker process: the same model or the same 400 as inline,
and a dead worker costs one 503, not the server."""

import asyncio
import json
import os
import signal

import pytest

from tokenway.gateway.body_parser import BodyParser
from tokenway.protocol.body import decode_json_body
from tokenway.protocol.errors import InvalidRequestError, ServiceUnavailableError
from tokenway.protocol.openai import ChatCompletionRequest


@pytest.fixture(scope="module")
def parser():
    parser = BodyParser(inline_bytes=1024)
    yield parser
    parser.close()


def big_chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}], **fields}).encode()


def test_a_large_body_comes_back_as_the_same_model_it_would_be_inline(parser):
    raw = big_chat(max_tokens=7, tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}])
    remote = asyncio.run(parser.parse(raw, ChatCompletionRequest))
    assert remote == decode_json_body(raw, ChatCompletionRequest)
    assert remote.max_tokens == 7 and remote.tools[0].function.name == "f"


def test_a_large_bad_body_is_the_same_400_naming_the_field(parser):
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(parser.parse(big_chat(max_tokens="ten"), ChatCompletionRequest))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(parser.parse(big_chat(user="\ud800"), ChatCompletionRequest))
    assert info.value.code == "invalid_unicode" and info.value.param == "user"


def test_a_dead_worker_costs_one_503_and_the_next_body_parses(parser):
    asyncio.run(parser.parse(big_chat(), ChatCompletionRequest))  # the worker is up
    for pid in list(parser._pool._processes):
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(parser.parse(big_chat(), ChatCompletionRequest))
    assert asyncio.run(parser.parse(big_chat(max_tokens=2), ChatCompletionRequest)).max_tokens == 2
