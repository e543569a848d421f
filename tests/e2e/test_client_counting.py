"""tokenway.client's counters against a real tokenway serve: for 50 varied chat requests
(system prompts, multi-turn, tools and tool_choice, earlier calls and their results,
response_format, unicode) both counters give exactly the prompt_tokens the call reports."""

from __future__ import annotations

import json
import random

import openai
import pytest

from tokenway.client import LocalCounter, Price, RemoteCounter, price_of

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
TEXTS = ["What is the capital of France?", "Écris-moi un haïku sur la mer.", "Summarise: " + "tokens " * 40,
         "数字 1234 和 5678 的和是多少？", "List three fruits, please 🍎🍌🍇.", "Why is the sky blue?"]


def varied_request(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": rng.choice(["system", "developer"]), "content": "You are terse. " * rng.randint(1, 3)})
    for _ in range(rng.randint(0, 3)):
        messages += [{"role": "user", "content": rng.choice(TEXTS)},
                     {"role": "assistant", "content": rng.choice(TEXTS)}]
    request: dict = {"model": MODEL}
    if rng.random() < 0.5:
        tools = rng.sample([WEATHER, ADD], rng.randint(1, 2))
        request["tools"] = tools
        request["tool_choice"] = rng.choice([None, "auto", "required", "none",
                                             {"type": "function", "function": {"name": tools[0]["function"]["name"]}}])
        request["parallel_tool_calls"] = rng.choice([None, True, False])
        if rng.random() < 0.5:  # an earlier call and its result
            messages += [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": -3})}]
    elif rng.random() < 0.5:
        request["response_format"] = rng.choice([
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}])
    messages.append({"role": "user", "content": [{"type": "text", "text": rng.choice(TEXTS)}]
                     if rng.random() < 0.3 else rng.choice(TEXTS)})
    request["messages"] = messages
    return {key: value for key, value in request.items() if value is not None}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(default_model_dir):
    return LocalCounter(str(default_model_dir))


def test_both_counters_give_the_servers_prompt_tokens_for_50_varied_requests(client, local):
    remote = RemoteCounter(client)
    rng = random.Random(13)
    for _ in range(50):
        request = varied_request(rng)
        reported = client.chat.completions.create(**request, max_tokens=1, temperature=0).usage.prompt_tokens
        assert remote.count(request) == reported, request
        assert local.count(request) == reported, request


@pytest.mark.anyio
async def test_the_async_sdk_counts_too(server):
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    assert await RemoteCounter(client).count_async(request) == RemoteCounter(
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")).count(request)


def test_an_sdk_message_put_back_counts_as_its_json(client, local):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=5, temperature=0).choices[0].message
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}, reply,
                                            {"role": "user", "content": "Again."}]}
    reported = client.chat.completions.create(**request, max_tokens=1).usage.prompt_tokens
    assert RemoteCounter(client).count(request) == local.count(request) == reported


def test_prices_and_cost():
    price = Price(input=0.5, cached_input=0.25, output=2.0)
    assert price.cost(1_000_000) == 0.5
    assert price.cost(1000, 500, cached_tokens=400) == pytest.approx((600 * 0.5 + 400 * 0.25 + 500 * 2.0) / 1e6)


def test_a_model_without_prices_is_free(client):
    assert price_of(client, MODEL) == Price()
