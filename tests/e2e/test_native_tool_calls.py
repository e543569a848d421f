"""Native tool formats end to end, on tiny GGUF models whose tool-call markers are user-defined
added tokens, as llama.cpp's converter writes Qwen2.5's <tool_call> (tests/fixtures/
tiny_tool_model.py): for each format, a forced, a named and an auto call complete through chat
completions, Responses and Messages, streamed and not, through the official SDKs. Under auto the
model itself writes its call (its weights are a script); under a grammar the grammar does."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.e2e.conftest import Server
from tests.fixtures.tiny_tool_model import FORMATS, WEATHER, build
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.models.loader import resolve_model

MODEL = "tiny-tools"
ASK = "What's the weather in Rome?"
CHOICES = ("required", "named", "auto")
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module", params=list(FORMATS))
def model(request, default_model_dir, model_cache_dir):
    return request.param, build(request.param, model_cache_dir / "tiny-tool-models", default_model_dir)


@pytest.fixture(scope="module")
def server(model):
    server = Server("--model", str(model[1]), "--served-model-name", MODEL, "--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def check(calls: list[tuple[str, str]], choice: str) -> None:
    """One whole call to get_weather, its arguments held to the schema (the enum) as sent."""
    assert len(calls) == 1, (choice, calls)
    name, arguments = calls[0]
    assert name == "get_weather", (choice, calls)
    assert json.loads(arguments) in ({"city": "Rome"}, {"city": "Paris"}), (choice, arguments)


def test_the_markers_are_user_defined_added_tokens(model):
    fmt, path = model
    tokenizer = Tokenizer.from_dir(resolve_model(str(path)))
    for marker in FORMATS[fmt].markers:
        token_id = tokenizer.added_token_id(marker)
        assert token_id is not None and not tokenizer.is_special(token_id)
        assert tokenizer.encode(marker, add_special_tokens=False) == [token_id]


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_completions(oa, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    request = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=TOOLS, tool_choice=tool_choice,
                   parallel_tool_calls=False, max_tokens=60, temperature=0)
    reply = oa.chat.completions.create(**request).choices[0]
    assert reply.finish_reason == "tool_calls" and not reply.message.content
    calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or ()]
    check(calls, choice)
    content, pieces, finish = "", {}, None
    for chunk in oa.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = pieces.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, finish) == ("", "tool_calls")
    assert [tuple(pieces[i]) for i in sorted(pieces)] == calls  # the stream is the reply


@pytest.mark.parametrize("choice", CHOICES)
def test_responses(oa, choice):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    tool_choice = {"type": "function", "name": "get_weather"} if choice == "named" else choice
    request = dict(model=MODEL, input=ASK, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False,
                   max_output_tokens=60, temperature=0)
    response = oa.responses.create(**request)
    assert response.status == "completed"
    calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
    assert [item.type for item in response.output] == ["function_call"]
    check(calls, choice)
    with oa.responses.stream(**request) as stream:
        arguments = "".join(event.delta for event in stream if event.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert [(item.name, item.arguments) for item in final.output if item.type == "function_call"] == calls
    assert arguments == calls[0][1]


@pytest.mark.parametrize("choice", CHOICES)
def test_messages(an, choice):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    tool_choice = {"type": "tool", "name": "get_weather"} if choice == "named" else \
        {"type": {"required": "any", "auto": "auto"}[choice]}
    request = dict(model=MODEL, max_tokens=60, tools=tools, messages=[{"role": "user", "content": ASK}],
                   tool_choice={**tool_choice, "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    reply = an.messages.create(**request)
    assert reply.stop_reason == "tool_use", reply
    assert [block.type for block in reply.content] == ["tool_use"]
    calls = [(block.name, json.dumps(block.input)) for block in reply.content]
    check(calls, choice)
    with an.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(block.type, block.name, block.input) for block in final.content] == \
        [(block.type, block.name, block.input) for block in reply.content]
