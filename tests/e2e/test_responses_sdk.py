"""OpenAI's Responses API against a real tokenway server on loopback, driven by the official
openai SDK and the OpenAI Agents SDK, unchanged: create, stream and parse; a function tool's
round trip through previous_response_id, and the same with nothing stored (the items passed
back); input_items, delete, and the cancel of a background response."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the current weather for a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_create_answers_and_the_stored_response_reads_back(client, server):
    response = client.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be brief.",
                                       max_output_tokens=20, temperature=0)
    assert "Paris" in response.output_text and response.status in ("completed", "incomplete")
    usage = response.usage
    assert usage.input_tokens > 10 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert client.responses.retrieve(response.id) == response
    row = server.ledger_row(response.id)  # billed under the response's own id, as a chat call is
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage.input_tokens, usage.output_tokens)


def test_stream_sends_the_typed_events_and_matches_create(client):
    # A reply that ends by itself: the SDK's final response needs response.completed (a cut one
    # ends with response.incomplete, as OpenAI's does).
    kwargs = dict(model=MODEL, input="What is the capital of France? One word.", max_output_tokens=40,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=1000)  # bounded: the grammar allows at most 4 digits


def test_parse_constrains_the_reply_to_the_pydantic_schema(client):
    response = client.responses.parse(model=MODEL, input="Give me Paris's name, country and population in millions.",
                                      text_format=City, max_output_tokens=80, temperature=0)
    city = response.output_parsed
    assert isinstance(city, City) and city.name and 0 <= city.population_millions <= 1000


def weather_call(client, **kwargs):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris? Use the tool.", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=60, temperature=0, **kwargs)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    return first, call


RESULT = json.dumps({"temperature": 21, "sky": "clear"})


def test_a_function_tools_round_trip_through_previous_response_id(client):
    first, call = weather_call(client)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": RESULT}], max_output_tokens=24, temperature=0)
    assert second.output_text and second.previous_response_id == first.id
    [item] = client.responses.input_items.list(second.id).data
    assert (item.type, item.call_id, item.output) == ("function_call_output", call.call_id, RESULT)
    # Not stored, the same conversation passed back as items is the same prompt: the same reply.
    unstored, unstored_call = weather_call(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    items = [{"role": "user", "content": "What is the weather in Paris? Use the tool."},
             *[item.model_dump(exclude_none=True) for item in unstored.output],
             {"type": "function_call_output", "call_id": unstored_call.call_id, "output": RESULT}]
    passed_back = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none", store=False,
                                          max_output_tokens=24, temperature=0)
    assert unstored_call.arguments == call.arguments and passed_back.output_text == second.output_text


def test_input_items_pages_and_delete_forgets(client):
    created = client.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"role": "user", "content": f"Message {i}."} for i in range(5)])
    newest = client.responses.input_items.list(created.id, limit=2)
    assert [item.content[0].text for item in newest.data] == ["Message 4.", "Message 3."] and newest.has_more
    older = client.responses.input_items.list(created.id, limit=2, after=newest.data[-1].id)
    assert [item.content[0].text for item in older.data] == ["Message 2.", "Message 1."] and older.has_more
    everything = client.responses.input_items.list(created.id, order="asc")
    assert [item.content[0].text for item in everything.data] == [f"Message {i}." for i in range(5)]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_cancelling_a_background_response_stops_its_generation(client, server):
    queued = client.responses.create(model=MODEL, input="Count from 1 to 1000, one number a line.", background=True,
                                     max_output_tokens=4000, temperature=0)
    assert queued.status == "queued" and queued.background
    deadline = time.monotonic() + 60
    while client.responses.retrieve(queued.id).status == "queued" or server.stats()["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(queued.id).status == "cancelled"
    while server.stats()["num_running"] or server.stats()["num_waiting"]:  # the engine freed the request
        assert time.monotonic() < deadline
        time.sleep(0.02)
    row = server.ledger_row(queued.id)
    assert row["status"] == 499 and row["error"] == "cancelled" and 0 < row["completion_tokens"] < 4000
    assert client.responses.cancel(queued.id).status == "cancelled"  # idempotent


def test_a_built_in_tool_listed_is_left_out_and_named(client, server):
    """As OpenAI's Codex CLI lists web_search with every request: answered, not refused."""
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0,
        tools=[{"type": "web_search", "external_web_access": False}, {"type": "image_generation"}])
    assert raw.headers["x-tokenway-omitted-tools"] == "web_search, image_generation"
    response = raw.parse()
    assert response.status == "incomplete" and response.tools == [] and response.usage.output_tokens == 4
    assert server.ledger_row(response.id)["status"] == 200


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.BadRequestError) as refused:  # forced: only a built-in tool could answer it
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}],
                                tool_choice={"type": "web_search"})
    assert refused.value.param == "tool_choice" and "web_search" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.responses.create(model=MODEL, input="hi " * 9000, max_output_tokens=10)
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "input"
    garbage = httpx.post(f"{server.base_url}/v1/responses", content=b"{", headers={"content-type": "application/json"})
    assert garbage.status_code == 400 and garbage.json()["error"]["type"] == "invalid_request_error"


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool(server):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install openai-agents)")
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI
    looked_up: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        looked_up.append(city)
        return f"It is 21 degrees and sunny in {city}."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120))
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                         tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=48, tool_choice="required"))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert looked_up and isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item"
