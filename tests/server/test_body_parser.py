"""Large bodies are parsed in a worker process: the same model or the same 400 as inline,
and a dead worker costs one 503, not the server."""

import asyncio
import json

import pytest

from tokenway.protocol.body import decode_json_body
from tokenway.protocol.errors import InvalidRequestError, ServiceUnavailableError
from tokenway.protocol.openai import ChatCompletionRequest
from tokenway.server.body_parser import BodyParser


def big_chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}], **fields}).encode()


async def chunks_of(raw: bytes, size: int = 65536):
    for start in range(0, len(raw), size):
        yield raw[start:start + size]


async def parse(parser: BodyParser, raw: bytes, model=ChatCompletionRequest):
    parsed, num_bytes = await parser.parse(chunks_of(raw, 700), model)
    assert num_bytes == len(raw)
    return parsed


def with_parser(test):
    """Run `test(parser)` in one event loop with a parser whose workers take bodies over 1 KiB."""
    async def main():
        parser = BodyParser(inline_bytes=1024)
        await parser.start()
        try:
            return await test(parser)
        finally:
            await parser.close()

    return asyncio.run(main())


def test_a_large_body_comes_back_as_the_same_model_it_would_be_inline():
    raw = big_chat(max_tokens=7, tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}])

    async def test(parser):
        return await asyncio.gather(*(parse(parser, raw) for _ in range(3)))

    for remote in with_parser(test):  # three at once share the worker, one after another
        assert remote == decode_json_body(raw, ChatCompletionRequest)
        assert remote.max_tokens == 7 and remote.tools[0].function.name == "f"


def test_a_large_bad_body_is_the_same_400_naming_the_field():
    async def test(parser):
        errors = []
        for raw in (big_chat(max_tokens="ten"), big_chat(user="\ud800"), b"[" * 5000 + b"]" * 5000):
            with pytest.raises(InvalidRequestError) as info:
                await parse(parser, raw)
            errors.append(info.value)
        return errors

    ten, surrogate, deep = with_parser(test)
    assert ten.param == "max_tokens"
    assert (surrogate.code, surrogate.param) == ("invalid_unicode", "user")
    assert deep.code == "json_too_deep"


def test_a_dead_worker_costs_one_503_and_the_next_body_parses():
    async def test(parser):
        await parse(parser, big_chat())  # the worker is up
        for worker in list(parser._workers):
            worker.process.kill()
            await worker.process.wait()
        with pytest.raises(ServiceUnavailableError):
            await parse(parser, big_chat())
        return await parse(parser, big_chat(max_tokens=2))

    assert with_parser(test).max_tokens == 2


def test_a_body_that_stops_coming_leaves_the_worker_ready_for_the_next():
    class ClientLeft(Exception):
        pass

    async def leaving():
        yield big_chat()[:3000]
        raise ClientLeft()

    async def test(parser):
        with pytest.raises(ClientLeft):
            await parser.parse(leaving(), ChatCompletionRequest)
        workers = set(parser._workers)
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        small, num_bytes = await parser.parse(chunks_of(raw), ChatCompletionRequest)
        assert num_bytes < 100 and small.messages[0].content == "hi"  # parsed inline
        return workers, await parse(parser, big_chat(max_tokens=3)), set(parser._workers)

    before, parsed, after = with_parser(test)
    assert parsed.max_tokens == 3 and before == after  # the same worker, not a new one
