"""OpenAI schemas: what the official SDK sends parses; what we send back, the SDK parses in
strict mode; every invalid field is one InvalidRequestError naming it in a short sentence."""

import json

import httpx2
import openai
import pydantic
import pytest
from openai import pydantic_function_tool

from tokenway.protocol.errors import MAX_MESSAGE_CHARS, InvalidRequestError, from_validation_error
from tokenway.protocol.openai import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChoiceDelta,
    ChoiceDeltaFunction,
    ChoiceDeltaToolCall,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    FunctionCallOut,
    Model,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    Usage,
)

USAGE = Usage(prompt_tokens=12, completion_tokens=3, total_tokens=15,
              prompt_tokens_details=PromptTokensDetails(cached_tokens=8))
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def make_sdk(reply):
    """An openai client whose transport records each body and answers with reply(path, body)."""
    bodies = []

    def handler(request):
        body = json.loads(request.content) if request.content else None
        bodies.append(body)
        return reply(request.url.path, body)

    client = openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=0, _strict_response_validation=True,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    return client, bodies


def json_reply(model: pydantic.BaseModel):
    return lambda path, body: httpx2.Response(200, json=model.model_dump(mode="json"))


def sse_reply(events: list[pydantic.BaseModel]):
    text = "".join(f"data: {e.model_dump_json(exclude_none=True)}\n\n" for e in events) + "data: [DONE]\n\n"
    return lambda path, body: httpx2.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def chat_completion(message: ChatCompletionMessage, finish_reason="stop", logprobs=None) -> ChatCompletion:
    return ChatCompletion(id="chatcmpl-1", created=1, model="m", usage=USAGE, choices=[
        ChatCompletionChoice(index=0, message=message, finish_reason=finish_reason, logprobs=logprobs)])


def test_sdk_chat_request_with_every_parameter_parses_and_response_parses_back():
    top = [TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105])]
    logprobs = ChoiceLogprobs(content=[TokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=top)])
    call = ToolCallOut(id="call_1", function=FunctionCallOut(name="get_weather", arguments='{"city": "Paris"}'))
    reply = chat_completion(ChatCompletionMessage(content="Hi", tool_calls=[call]), "tool_calls", logprobs)
    client, bodies = make_sdk(json_reply(reply))
    result = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Really."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
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
    assert req.template_messages()[3] == {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
    assert req.template_messages()[4] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert req.template_tools() == [WEATHER_TOOL]
    assert result.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert result.choices[0].logprobs.content[0].top_logprobs[0].bytes == [72, 105]
    assert result.usage.prompt_tokens_details.cached_tokens == 8


def test_sdk_parse_helpers_send_bodies_we_accept():
    class City(pydantic.BaseModel):
        name: str

    client, bodies = make_sdk(json_reply(chat_completion(ChatCompletionMessage(content='{"name": "Paris"}'))))
    parsed = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "x"}],
                                           response_format=City, tools=[pydantic_function_tool(City)])
    ChatCompletionRequest.model_validate(bodies[0])
    assert parsed.choices[0].message.parsed == City(name="Paris")


def test_sdk_streaming_chat():
    def chunk(delta=None, finish_reason=None, usage=None):
        choices = [ChatCompletionChunkChoice(index=0, delta=delta, finish_reason=finish_reason)] if delta else []
        return ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=choices, usage=usage)

    fn = ChoiceDeltaFunction
    events = [
        chunk(ChoiceDelta(role="assistant", content="")),
        chunk(ChoiceDelta(content="Hel")),
        chunk(ChoiceDelta(content="lo")),
        chunk(ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(index=0, id="call_1", type="function",
                                                          function=fn(name="get_weather", arguments=""))])),
        chunk(ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(index=0, function=fn(arguments='{"city": "P"}'))])),
        chunk(ChoiceDelta(), finish_reason="tool_calls"),
        chunk(usage=USAGE),
    ]
    client, bodies = make_sdk(sse_reply(events))
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True,
                                            stream_options={"include_usage": True})
    received = list(stream)
    req = ChatCompletionRequest.model_validate(bodies[0])
    assert req.stream and req.stream_options.include_usage
    assert "".join(c.choices[0].delta.content or "" for c in received if c.choices) == "Hello"
    assert received[4].choices[0].delta.tool_calls[0].function.arguments == '{"city": "P"}'
    assert received[-1].choices == [] and received[-1].usage.total_tokens == 15


def test_sdk_legacy_completion_and_models():
    # OpenAI sends null for an echoed first token; the SDK's strict types do not allow it, so not here.
    logprobs = CompletionLogprobs(tokens=["a", "b"], token_logprobs=[-0.2, -0.5],
                                  top_logprobs=[{"a": -0.2}, {"b": -0.5}], text_offset=[0, 1])
    reply = Completion(id="cmpl-1", created=1, model="m", usage=USAGE, choices=[
        CompletionChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length")])
    client, bodies = make_sdk(json_reply(reply))
    result = client.completions.create(model="m", prompt=[[1, 2], [3]], max_tokens=5, echo=True, logprobs=5,
                                       n=2, best_of=2, seed=1, stop="x", suffix=None, extra_body={"top_k": 5})
    req = CompletionRequest.model_validate(bodies[0])
    assert req.prompts == [[1, 2], [3]] and req.max_tokens == 5 and req.logprobs == 5
    assert result.choices[0].logprobs.top_logprobs == [{"a": -0.2}, {"b": -0.5}]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts == [[1, 2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).max_tokens == 16

    models = ModelList(data=[Model(id="m", created=1, owned_by="tokenway", max_model_len=2048)])
    client, _ = make_sdk(json_reply(models))
    assert [m.id for m in client.models.list()] == ["m"]


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
