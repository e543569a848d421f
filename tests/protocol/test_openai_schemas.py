"""OpenAI schemas: what the official SDK sends parses; what the server sends back (the real app
and renderers, in front of a scripted replica) is the SDK's own types, validated strictly and
with no key the SDK does not declare; every invalid field is one InvalidRequestError naming it
in a short sentence."""

import json
from types import SimpleNamespace

import httpx2
import openai
import pydantic
import pytest
from openai import pydantic_function_tool
from openai.types import Completion, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs

from tokenway.protocol.errors import MAX_MESSAGE_CHARS, BadGatewayError, InvalidRequestError, from_validation_error
from tokenway.protocol.job import ChoiceDelta, ToolCallDelta, Usage
from tokenway.protocol.openai import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenway.protocol.outputs import TokenLogprob
from tokenway.server.openai_render import TokenText

from .conftest import MODEL, sse_events, validate_strictly

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# The fields tokenway (and vLLM) add to OpenAI's Model.
MODEL_EXTENSIONS = frozenset({"kind", "max_model_len", "aliases", "pricing", "dimensions"})


def upstream_logprob(token: str, logprob: float, *alternatives: tuple[str, float]) -> dict:
    """One token's logprobs as an OpenAI-compatible upstream sends them (chat's shape)."""
    top = [(token, logprob), *alternatives]
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": value, "bytes": list(t.encode())} for t, value in top]}


# Two choices: one writes text (with logprobs), the other calls a tool in two pieces.
CHAT_BODY = {"messages": [{"role": "user", "content": "Hi, and the weather in Paris?"}], "n": 2, "max_tokens": 16,
             "logprobs": True, "top_logprobs": 1, "tools": [WEATHER_TOOL]}
CHAT_EVENTS = [
    ChoiceDelta(0, text="Hel", logprobs=(upstream_logprob("Hel", -0.1, ("Hi", -2.5)),)),
    ChoiceDelta(1, tool_calls=(ToolCallDelta(0, id="call_1", name="get_weather", arguments='{"city": '),)),
    ChoiceDelta(0, text="lo", logprobs=(upstream_logprob("lo", -0.2),), finish_reason="stop"),
    ChoiceDelta(1, tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),), finish_reason="tool_calls"),
    Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=8),
]
COMPLETION_BODY = {"prompt": "Look at", "echo": True, "logprobs": 2, "max_tokens": 2}
COMPLETION_EVENTS = [
    ChoiceDelta(0, text=" the", logprobs=(upstream_logprob(" the", -0.3),)),
    ChoiceDelta(0, text=" sky", logprobs=(upstream_logprob(" sky", -0.4, (" sea", -1.9)),), finish_reason="length"),
    Usage(prompt_tokens=2, completion_tokens=2),
]


# ---- what the server sends ----------------------------------------------------------------------


def test_a_chat_completion_is_the_sdks_chat_completion(scripted):
    body = scripted.answer("/v1/chat/completions", CHAT_BODY, CHAT_EVENTS).json()
    completion = validate_strictly(ChatCompletion, body)
    text, call = completion.choices
    assert (text.index, text.message.content, text.message.tool_calls, text.finish_reason) == (0, "Hello", None, "stop")
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in text.logprobs.content] == [
        ("Hel", list(b"Hel"), ["Hel"]), ("lo", list(b"lo"), ["lo"])]
    assert (call.index, call.message.content, call.finish_reason) == (1, None, "tool_calls")
    [tool_call] = call.message.tool_calls
    assert (tool_call.id, tool_call.function.name, tool_call.function.arguments) == (
        "call_1", "get_weather", '{"city": "Paris"}')
    assert (completion.usage.total_tokens, completion.usage.prompt_tokens_details.cached_tokens) == (17, 8)
    # OpenAI's optional fields go out as null, never left out.
    message = body["choices"][0]["message"]
    assert body["system_fingerprint"] is None and message["refusal"] is None and message["tool_calls"] is None


def test_a_chat_stream_is_the_sdks_chunks_each_delta_carrying_only_what_changed(scripted):
    response = scripted.answer("/v1/chat/completions", {**CHAT_BODY, "stream": True,
                                                        "stream_options": {"include_usage": True}}, CHAT_EVENTS)
    *events, done = sse_events(response.text)
    assert done == (None, "[DONE]")
    chunks = [validate_strictly(ChatCompletionChunk, data) for _, data in events]
    assert len({(chunk.id, chunk.created) for chunk in chunks}) == 1
    # usage rides on every chunk (null) and is counted on the last, which has no choices
    assert [chunk.usage for chunk in chunks[:-1]] == [None] * (len(chunks) - 1) and "usage" in events[0][1]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 17
    choices = [data["choices"] for _, data in events[:-1]]
    assert all(len(c) == 1 for c in choices)
    assert [(c[0]["index"], c[0]["delta"], c[0]["finish_reason"]) for c in choices] == [
        (0, {"role": "assistant", "content": ""}, None),
        (1, {"role": "assistant", "content": ""}, None),
        (0, {"content": "Hel"}, None),
        (1, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": '}}]}, None),
        (0, {"content": "lo"}, None),
        (0, {}, "stop"),
        (1, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, None),
        (1, {}, "tool_calls"),
    ]
    assert choices[2][0]["logprobs"] == {"content": [{"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel"),
                                                      "top_logprobs": [{"token": "Hel", "logprob": -0.1,
                                                                        "bytes": list(b"Hel")}]}],
                                         "refusal": None}


TIER = frozenset({"service_tier"})


def test_a_completion_is_the_sdks_completion_streamed_or_not(scripted):
    body = scripted.answer("/v1/completions", COMPLETION_BODY, COMPLETION_EVENTS).json()
    # service_tier: as chat completions carry it; the SDK's legacy Completion does not declare it.
    [choice] = validate_strictly(Completion, body, TIER).choices
    assert body["service_tier"] == "default"
    assert (choice.text, choice.finish_reason) == ("Look at the sky", "length")
    assert (choice.logprobs.tokens, choice.logprobs.text_offset) == ([" the", " sky"], [7, 11])
    assert choice.logprobs.top_logprobs == [{" the": -0.3}, {" sky": -0.4, " sea": -1.9}]

    response = scripted.answer("/v1/completions", {**COMPLETION_BODY, "stream": True,
                                                   "stream_options": {"include_usage": True}}, COMPLETION_EVENTS)
    *events, done = sse_events(response.text)
    assert done == (None, "[DONE]")
    chunks = [data for _, data in events]
    # OpenAI streams Completion objects whose finish_reason is null until a choice's last; the
    # SDK's type (made for the whole response) has no null there, so the check fills one in.
    finish_reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    assert finish_reasons == [None, None, "length"]
    for chunk in chunks:
        validate_strictly(Completion, {**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                                                            for c in chunk["choices"]]}, TIER)
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == "Look at the sky"
    assert [c["logprobs"]["text_offset"] for chunk in chunks[1:3] for c in chunk["choices"]] == [[7], [11]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4


def test_a_stream_that_fails_ends_with_an_openai_error_event_then_done(scripted):
    failure = BadGatewayError("Upstream scripted broke off.")
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = scripted.answer("/v1/chat/completions", body, [ChoiceDelta(0, text="Hi"), failure])
    *_, (_, error), done = sse_events(response.text)
    assert done == (None, "[DONE]") and set(error) == {"error"}
    sent = validate_strictly(ErrorObject, error["error"])
    assert (sent.type, sent.code, sent.message) == ("upstream_error", failure.code, failure.message)


def test_models_are_the_sdks_model_with_tokenways_extensions(scripted):
    listing = scripted.request("GET", "/v1/models").json()
    assert set(listing) == {"object", "data"} and listing["object"] == "list"
    [card] = [validate_strictly(Model, data, MODEL_EXTENSIONS) for data in listing["data"]]
    assert card.id == MODEL and card.model_extra == {"kind": "chat", "max_model_len": 4096, "aliases": []}
    assert scripted.request("GET", f"/v1/models/{MODEL}").json() == listing["data"][0]


def test_engine_logprobs_render_in_both_of_openais_shapes():
    vocab = {1: "Hé", 2: "llo", 3: "Hi"}
    token_text = TokenText(SimpleNamespace(tokenizer=SimpleNamespace(token_text=vocab.__getitem__)))
    logprobs = [TokenLogprob(1, -0.1, 1, [(1, -0.1), (3, -2.3)]), TokenLogprob(2, -0.2, 1, [(2, -0.2)])]
    chat = validate_strictly(ChoiceLogprobs, token_text.chat_logprobs(logprobs, top_n=1))
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in chat.content] == [
        ("Hé", list("Hé".encode()), ["Hé"]), ("llo", list(b"llo"), ["llo"])]
    legacy = validate_strictly(Logprobs, token_text.completion_logprobs(logprobs, offset=5))
    assert legacy.text_offset == [5, 7] and legacy.top_logprobs == [{"Hé": -0.1, "Hi": -2.3}, {"llo": -0.2}]


def test_the_sdk_reads_what_the_server_sends_and_the_server_reads_what_the_sdk_sends(scripted):
    received = []
    client = openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=0, _strict_response_validation=True,
                           http_client=httpx2.Client(transport=scripted.sdk_transport(received)))
    scripted.replica.events = CHAT_EVENTS
    completion = client.chat.completions.create(model=MODEL, **CHAT_BODY)
    assert completion.choices[1].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    stream = client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                            **CHAT_BODY)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == 0) \
        == "Hello"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 8
    scripted.replica.events = COMPLETION_EVENTS
    assert client.completions.create(model=MODEL, **COMPLETION_BODY).choices[0].text == "Look at the sky"
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert [ChatCompletionRequest.model_validate(body).stream for body in received[:2]] == [None, True]


# ---- what the SDK sends -------------------------------------------------------------------------

# Any valid body: these tests check the request the SDK sent, not the reply.
CHAT_REPLY = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": '{"name": "Paris"}'}, "finish_reason": "stop"}]}


def make_sdk(reply: dict):
    """An openai client whose transport records each body and answers with `reply`."""
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content) if request.content else None)
        return httpx2.Response(200, json=reply)

    client = openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    return client, bodies


def test_sdk_chat_request_with_every_parameter_parses():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    client, bodies = make_sdk(CHAT_REPLY)
    client.chat.completions.create(
        model="m",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Really."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        ],
        max_completion_tokens=64, max_tokens=32, temperature=0.7, top_p=0.9, n=2, seed=-3, stop=["\n\n", "END"],
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"50256": -100}, logprobs=True, top_logprobs=5,
        user="u", tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, metadata={"k": "v"}, store=False, service_tier="auto", prompt_cache_key="p",
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                                "strict": True}},
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": False},
    )
    req = ChatCompletionRequest.model_validate(bodies[0])
    assert req.max_output_tokens == 64 and req.top_k == 40 and req.logit_bias_by_token_id == {50256: -100.0}
    assert req.response_format.json_schema.schema_ == {"type": "object"}
    assert req.template_messages()[0] == {"role": "system", "content": "Be brief."}  # developer -> system
    assert req.template_messages()[2] == {"role": "user", "content": "Weather?", "name": "ann"}
    assert req.template_messages()[3] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert req.template_messages()[4] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert req.template_tools() == [WEATHER_TOOL]


def test_sdk_parse_helpers_send_bodies_we_accept():
    class City(pydantic.BaseModel):
        name: str

    client, bodies = make_sdk(CHAT_REPLY)
    client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "x"}], response_format=City,
                                  tools=[pydantic_function_tool(City)])
    req = ChatCompletionRequest.model_validate(bodies[0])
    assert req.response_format.json_schema.name == "City" and req.template_tools()[0]["function"]["name"] == "City"


def test_sdk_legacy_completion_request_parses():
    client, bodies = make_sdk({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                               "choices": [{"index": 0, "text": "ab", "finish_reason": "length"}]})
    client.completions.create(model="m", prompt=[[1, 2], [3]], max_tokens=5, echo=True, logprobs=5, n=2, best_of=2,
                              seed=1, stop="x", suffix=None, extra_body={"top_k": 5})
    req = CompletionRequest.model_validate(bodies[0])
    assert req.prompts == [[1, 2], [3]] and req.max_tokens == 5 and req.logprobs == 5
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts == [[1, 2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).max_tokens == 16


def test_tokenize_and_detokenize_requests():
    assert TokenizeRequest.model_validate({"prompt": "hi"}).add_special_tokens is None
    assert TokenizeRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}).messages
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]


# ---- invalid requests ---------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL_F = {"type": "function", "function": {"name": "f"}}


def chat_error(patch: dict, cls=ChatCompletionRequest, base=None) -> InvalidRequestError:
    body = {"model": "m", "messages": MESSAGES} if base is None else dict(base)
    body.update(patch)
    with pytest.raises(pydantic.ValidationError) as caught:
        cls.model_validate(body)
    return from_validation_error(caught.value)


@pytest.mark.parametrize(
    "patch, param, message",
    [
        ({"max_tokens": -5}, "max_tokens", "max_tokens: must be >= 1, got -5"),
        ({"n": 0}, "n", "n: must be >= 1, got 0"),
        ({"n": 17}, "n", "n: must be <= 16, got 17"),
        ({"temperature": 3}, "temperature", "temperature: must be <= 2.0, got 3"),
        ({"temperature": "1"}, "temperature", "temperature: Input should be a valid number, got '1'"),
        ({"top_p": 0}, "top_p", "top_p: must be > 0.0, got 0"),
        ({"top_k": -2}, "top_k", "top_k: must be >= -1, got -2"),
        ({"max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid integer, got True"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool', got 'robot'"),
        ({"messages": []}, "messages", "messages: must have at least 1 item(s)"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
         "messages[0].content[0]",
         "messages[0].content[0]: this model accepts text only; content part type 'image_url' is not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text",
         "messages[0].content[0].text: is required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "messages[0].content: must be a string or a list of content parts, got 5"),
        ({"messages": [{"role": "assistant"}]}, "messages[0].content",
         "messages[0].content: is required for assistant messages without tool_calls"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id",
         "messages[0].tool_call_id: is required for role 'tool' messages"),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs: requires logprobs to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs: must be <= 20, got 21"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}]},
         "tools[0].function.parameters", ("tools[0].function.parameters: is not a valid JSON schema: "
                                          "12 is not valid under any of the given schemas at $.type")),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters",
         "tools[0].function.parameters: must be a JSON schema of type 'object', got type 'string'"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name",
         "tools[0].function.name: String should match pattern '^[a-zA-Z0-9_-]{1,64}$', got 'no spaces'"),
        ({"tools": [TOOL_F, TOOL_F]}, "tools", "tools: function names must be unique; 'f' appears twice"),
        ({"tools": [TOOL_F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
         "tool_choice: names function 'g', which is not in tools"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice: 'required' needs at least one tool in tools"),
        ({"tool_choice": "always"}, "tool_choice",
         "tool_choice: must be 'none', 'auto', 'required' or a named function, got 'always'"),
        ({"response_format": {"type": "xml"}}, "response_format",
         "response_format: type must be one of 'text', 'json_object', 'json_schema', got 'xml'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema", None),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
        ({"stop": ["a", 5]}, "stop", "stop: must be a non-empty string or a list of at most 16 non-empty strings"),
        ({"stop": ["s"] * 17}, "stop", None),
        ({"logit_bias": {"12": 150}}, "logit_bias.12", "logit_bias.12: must be <= 100.0, got 150"),
        ({"logit_bias": {"a": 1}}, "logit_bias", None),
        ({"stream_options": {"include_usage": True}}, "stream_options",
         "stream_options: is only allowed when stream is true"),
        ({"audio": {"voice": "alloy"}}, "audio", "audio: is not supported by this server"),
        ({"modalities": ["text", "audio"]}, "modalities", "modalities: is not supported by this server"),
    ],
)
def test_invalid_chat_field(patch, param, message):
    err = chat_error(patch)
    assert type(err) is InvalidRequestError and err.status == 400 and err.param == param
    if message is not None:
        assert err.message == message
    assert len(err.message) <= MAX_MESSAGE_CHARS and "For further information" not in err.message


@pytest.mark.parametrize(
    "patch, param, message",
    [
        ({"prompt": []}, "prompt", None),
        ({"prompt": ""}, "prompt", "prompt: must not be empty"),
        ({"prompt": [1, -2]}, "prompt", None),
        ({"prompt": ["a", 1]}, "prompt", None),
        ({"suffix": "tail"}, "suffix", "suffix: is not supported by this server"),
        ({"n": 2, "best_of": 1}, "best_of", "best_of: must be >= n (2), got 1"),
        ({"best_of": 3}, "best_of", "best_of: greater than n is not supported by this server"),
        ({"logprobs": 21}, "logprobs", "logprobs: must be <= 20, got 21"),
        ({"messages": MESSAGES}, "messages", "Unrecognized request argument supplied: messages"),
    ],
)
def test_invalid_completion_field(patch, param, message):
    err = chat_error(patch, CompletionRequest, base={"model": "m", "prompt": "hi"})
    assert err.param == param and (message is None or err.message == message)


def test_tokenize_needs_exactly_one_input():
    err = chat_error({}, TokenizeRequest, base={})
    assert err.message == "send exactly one of prompt or messages" and err.param is None


HUGE = "x" * 1_000_000


@pytest.mark.parametrize(
    "patch",
    [
        {"messages": [{"role": HUGE, "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": HUGE}]}]},
        {"temperature": HUGE},
        {"tool_choice": HUGE},
        {"response_format": {"type": HUGE}},
        {HUGE: 1},
        {"tools": [{"type": "function", "function": {"name": HUGE}}]},
        {"logit_bias": {HUGE: 1}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": HUGE}}}]},
    ],
)
def test_messages_stay_short_for_huge_values(patch):
    err = chat_error(patch)
    assert len(err.message) <= MAX_MESSAGE_CHARS and len(err.param or "") <= 100


@pytest.mark.parametrize("kind", [{}, [], 3, None])
def test_a_content_part_whose_type_is_no_string_is_a_validation_error(kind):
    # A dict or list as the tag once reached a dict lookup (unhashable: a 500).
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]}
    with pytest.raises(pydantic.ValidationError, match="type must be one of"):
        ChatCompletionRequest.model_validate(body)
