"""The official openai SDK, unchanged, against a real tokenway server on loopback."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "all-minilm-l6-v2"]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion(client):
    response = client.chat.completions.create(model=MODEL, messages=ask("What is the capital of France?"),
                                              max_tokens=20, temperature=0)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    usage = response.usage
    assert usage.prompt_tokens > 10 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=ask("Name three colours."), max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"] or finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_n_choices(client):
    response = client.chat.completions.create(model=MODEL, messages=ask("Suggest a name for a cat."),
                                              n=2, max_tokens=12, temperature=1.0, seed=3)
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content for c in response.choices)
    assert response.choices[0].message.content != response.choices[1].message.content
    assert response.usage.completion_tokens >= 2


def test_stop_string_is_never_emitted(client):
    base = client.chat.completions.create(model=MODEL, messages=ask("Count from 1 to 10, separated by commas."),
                                          max_tokens=40, temperature=0).choices[0].message.content
    assert "5" in base
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=ask("Count from 1 to 10, separated by commas."), max_tokens=40,
                      temperature=0, stop=["5"])
        if stream:
            chunks = client.chat.completions.create(**kwargs, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            response = client.chat.completions.create(**kwargs)
            assert response.choices[0].finish_reason == "stop"
            text = response.choices[0].message.content
        assert "5" not in text and base.startswith(text) and text


def test_seed_repeats(client):
    kwargs = dict(model=MODEL, messages=ask("Write one sentence about the moon."), max_tokens=20,
                  temperature=1.0, seed=42)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first
    other = client.chat.completions.create(**{**kwargs, "seed": 43}).choices[0].message.content
    assert other != first


def test_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=ask("Say yes."), max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    # Bounded, so even a 135M model's digits must stop: the grammar allows at most 4 of them.
    population_millions: int = Field(ge=0, le=1000)


def test_structured_output_with_parse(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=ask("Give me Paris's name, country and population in millions as JSON."),
        response_format=City, max_tokens=80, temperature=0)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name and 0 <= city.population_millions <= 1000


def test_a_json_reply_cut_by_max_tokens_is_never_presented_as_valid(client, server):
    def trace_of(raw) -> dict:
        return httpx.get(f"{server.base_url}/v1/traces/{raw.headers['x-request-id']}", timeout=10).json()

    cut = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("Give me Paris's name and country as JSON."), max_tokens=4, temperature=0,
        response_format={"type": "json_object"})
    assert cut.parse().choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.parse().choices[0].message.content)
    assert trace_of(cut)["json_complete"] is False  # the trace marks it incomplete
    whole = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("Give me Paris's name as JSON."), max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}}})
    assert whole.parse().choices[0].finish_reason == "stop"
    assert json.loads(whole.parse().choices[0].message.content)["name"]
    assert trace_of(whole)["json_complete"] is True
    plain = client.chat.completions.with_raw_response.create(model=MODEL, messages=ask("Hi"), max_tokens=4)
    assert trace_of(plain)["json_complete"] is None


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


def test_tool_round_trip(client):
    messages = ask("What is the weather in Paris? Use the tool.")
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="required", max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                            tool_choice="none", max_tokens=40, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.content


def test_completions_endpoint(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, logprobs=2)
    choice = response.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == response.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == choice.text


def test_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=ask("hi " * 9000), max_tokens=10)
    assert excinfo.value.code == "context_length_exceeded"
    assert "8192" in excinfo.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=ask("hi"), max_tokens=5)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, temperature=7)
    assert excinfo.value.param == "temperature"


def test_continue_final_message_goes_on_from_the_begun_reply(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "List three colours, comma-separated."}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=16, temperature=0)
    whole = whole.choices[0].message.content
    begun = " ".join(whole.split(" ")[:2])  # at a word's end: "The th" would re-tokenize unlike the reply
    rest = client.chat.completions.create(model=MODEL, messages=[*ask, {"role": "assistant", "content": begun}],
                                          max_tokens=16, temperature=0, extra_body={"continue_final_message": True})
    assert (begun + rest.choices[0].message.content).startswith(whole[:len(begun) + 8])
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                       extra_body={"continue_final_message": True})
