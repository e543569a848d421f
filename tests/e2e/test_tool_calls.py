"""Tool calls with the default model (the generic format: its template knows no tools), through
both official SDKs: calls stream as they form, the streamed reply equals the non-streamed one,
tool_choice and parallel_tool_calls are honoured, a call cut by max_tokens is dropped, and a
tool result is answered rather than called again."""

from __future__ import annotations

import json
import random

import anthropic
import openai
import pytest

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def openai_stream(oa, **request) -> tuple[str, list[dict], str, list]:
    """(content, calls as {id, name, arguments}, finish_reason, the chunks' tool-call pieces)."""
    content, calls, finish, pieces = [], {}, None, []
    for chunk in oa.chat.completions.create(**request, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for piece in delta.tool_calls or ():
            pieces.append(piece)
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, pieces


def whole(calls: list[dict], finish: str) -> list[tuple[str, dict]]:
    """The calls a client keeps from a stream: a stream cannot take back a call it began, so the
    one max_tokens cut (finish length, arguments that do not parse) is dropped, as the
    non-streamed reply drops it."""
    kept = []
    for position, call in enumerate(calls):
        try:
            kept.append((call["name"], json.loads(call["arguments"])))
        except json.JSONDecodeError:
            assert finish == "length" and position == len(calls) - 1, "only the last call can be cut"
    return kept


def test_a_required_call_streams_as_it_forms_and_is_made_once(oa):
    request = dict(model=MODEL, messages=ask("What's the weather in Rome?"), tools=[WEATHER],
                   tool_choice="required", max_tokens=100, temperature=0)
    content, calls, finish, pieces = openai_stream(oa, **request)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather" and pieces[0].index == 0
    assert len([p for p in pieces if p.function.arguments]) >= 3, "arguments arrive in fragments, as they form"
    reply = oa.chat.completions.create(**request).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls]


def test_after_the_tool_result_the_model_answers(oa, an):
    messages = ask("What's the weather in Rome?")
    first = oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100,
                                       temperature=0).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    second = oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100,
                                        temperature=0).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert second.message.content and "{" not in second.message.content
    # The same conversation in Anthropic's shape: tool_use, then a tool_result block.
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    reply = an.messages.create(model=MODEL, max_tokens=100, tools=[tool], extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "What's the weather in Rome?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": json.loads(call.function.arguments)}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]}])
    assert reply.stop_reason == "end_turn" and [b.type for b in reply.content] == ["text"]


def test_a_call_cut_by_max_tokens_is_dropped_and_leaks_no_format_text(oa):
    for max_tokens in (6, 12):  # cut before the name, and inside the arguments
        request = dict(model=MODEL, messages=ask("What's the weather in Rome?"), tools=[WEATHER],
                       tool_choice="required", max_tokens=max_tokens, temperature=0)
        choice = oa.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "length"
        assert not choice.message.content and not choice.message.tool_calls
        content, calls, finish, _ = openai_stream(oa, **request)
        assert finish == "length" and content == "" and whole(calls, finish) == []


# ---- parity over random tools, both SDKs -----------------------------------------------------

PARAMETERS = [
    ("city", {"type": "string"}), ("count", {"type": "integer"}), ("amount", {"type": "number"}),
    ("unit", {"type": "string", "enum": ["celsius", "fahrenheit"]}), ("urgent", {"type": "boolean"}),
    ("dates", {"type": "array", "items": {"type": "string"}}),
    ("filters", {"type": "object", "properties": {"max_price": {"type": "number"}, "airline": {"type": "string"}},
                 "required": ["max_price"]}),
    ("note", {"type": "string"}),
]
NAMES = ["get_weather", "search_flights", "convert_currency", "lookup_user", "add_numbers", "set_alarm",
         "translate_text", "book_table"]
QUESTIONS = ["What's the weather in Zürich?", "Find me flights from Oslo to Tōkyō for 2 people under 900 euros.",
             "Convert 100 euros to yen.", "Who is the user alice@example.com?", "Add 2 and 40.",
             "Wake me up at 6:30 tomorrow, it's urgent.", "Translate 'où est la gare ?' to English.",
             "Book a table for 4 at Café Ünïcode on Friday."]


def random_case(rng: random.Random, number: int) -> dict:
    tools = []
    for name in rng.sample(NAMES, rng.randint(1, 3)):
        chosen = rng.sample(PARAMETERS, rng.randint(1, 3))
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ')}",
            "parameters": {"type": "object", "properties": dict(chosen), "required": [p for p, _ in chosen]}}})
    choice = ["required", "auto", "named", "required"][number % 4]
    return {"tools": tools, "question": rng.choice(QUESTIONS),
            "tool_choice": {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
            if choice == "named" else choice,
            "parallel": [None, True, False][number % 3],
            # enough for two calls where several are allowed; a cut, every fourth
            "max_tokens": rng.randint(10, 40) if number % 4 == 1 else 96 if number % 3 == 1 else 48}


def check_arguments(tools: list[dict], name: str, arguments: dict) -> None:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    assert set(schema["required"]) <= set(arguments), (name, arguments)


def openai_parity(oa, case: dict) -> tuple[str, int]:
    request = dict(model=MODEL, messages=ask(case["question"]), tools=case["tools"], tool_choice=case["tool_choice"],
                   max_tokens=case["max_tokens"], temperature=0)
    if case["parallel"] is not None:
        request["parallel_tool_calls"] = case["parallel"]
    reply = oa.chat.completions.create(**request).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls or ()]
    content, streamed, finish, pieces = openai_stream(oa, **request)
    assert finish == reply.finish_reason
    assert content == (reply.message.content or "")
    assert whole(streamed, finish) == calls
    assert [c["arguments"] for c in streamed][:len(calls)] == [c.function.arguments for c in reply.message.tool_calls
                                                             or ()], "the fragments are the arguments exactly"
    if case["parallel"] is False or (case["parallel"] is None):
        assert len(streamed) <= 1  # the generic format makes one call unless parallel_tool_calls is true
    if case["tool_choice"] != "auto" and reply.finish_reason != "length":
        assert calls and reply.finish_reason == "tool_calls"
    if isinstance(case["tool_choice"], dict):
        assert {name for name, _ in calls} <= {case["tool_choice"]["function"]["name"]}
    for name, arguments in calls:
        check_arguments(case["tools"], name, arguments)
    return reply.finish_reason, len(calls)


def anthropic_parity(an, case: dict) -> tuple[str, int]:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in case["tools"]]
    choice = case["tool_choice"]
    tool_choice = {"type": "tool", "name": choice["function"]["name"]} if isinstance(choice, dict) else \
        {"type": {"required": "any", "auto": "auto"}[choice]}
    if case["parallel"] is False:
        tool_choice["disable_parallel_tool_use"] = True
    request = dict(model=MODEL, max_tokens=case["max_tokens"], tools=tools, tool_choice=tool_choice,
                   messages=ask(case["question"]), extra_body={"temperature": 0})
    reply = an.messages.create(**request)
    blocks = [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in reply.content
              if b.type != "text" or b.text]
    streamed, stop_reason, open_blocks = [], None, {}
    for event in an.messages.create(**request, stream=True):
        if event.type == "content_block_start":
            block = event.content_block
            open_blocks[event.index] = ["text", ""] if block.type == "text" else ["tool_use", block.name, ""]
            if block.type == "tool_use":
                assert block.id.startswith("toolu_") and block.name
        elif event.type == "content_block_delta":
            if event.delta.type == "text_delta":
                open_blocks[event.index][1] += event.delta.text
            else:
                open_blocks[event.index][2] += event.delta.partial_json
        elif event.type == "content_block_stop":
            streamed.append(open_blocks.pop(event.index))
        elif event.type == "message_delta":
            stop_reason = event.delta.stop_reason
    assert stop_reason == reply.stop_reason and not open_blocks
    kept = []
    for position, block in enumerate(streamed):
        if block[0] == "text":
            if block[1]:
                kept.append(("text", block[1]))
            continue
        try:
            kept.append(("tool_use", (block[1], json.loads(block[2] or "{}"))))
        except json.JSONDecodeError:
            assert stop_reason == "max_tokens" and position == len(streamed) - 1
    assert kept == blocks
    uses = [value for kind, value in blocks if kind == "tool_use"]
    for name, arguments in uses:
        check_arguments(case["tools"], name, arguments)
    if choice != "auto" and reply.stop_reason != "max_tokens":
        assert uses and reply.stop_reason == "tool_use"
    return reply.stop_reason, len(uses)


def test_the_stream_equals_the_reply_over_random_tools_both_sdks(oa, an):
    rng = random.Random(12)
    outcomes = []
    for number in range(32):
        case = random_case(rng, number)
        if number % 2 == 0:
            outcomes.append(("openai", *openai_parity(oa, case)))
        else:
            outcomes.append(("anthropic", *anthropic_parity(an, case)))
    finishes = {finish for _, finish, _ in outcomes}
    # The set covered calls, parallel calls and cuts, not only one kind of ending.
    assert {"tool_calls", "length"} <= finishes or {"tool_use", "max_tokens"} <= finishes, outcomes
    assert any(num_calls > 1 for _, _, num_calls in outcomes), outcomes
