"""The error tree: one status per kind, both wire shapes, and validation failures turned into
one short message naming the field (from pydantic directly and from FastAPI's error list)."""

import json

import httpx2
import openai
import pydantic
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from tokenway.protocol import errors
from tokenway.protocol.errors import (
    AuthenticationError,
    ContextLengthExceededError,
    InternalServerError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    TokenwayError,
    UnsupportedMediaTypeError,
    anthropic_error_body,
    from_validation_error,
    openai_error_body,
    param_from_loc,
)
from tokenway.protocol.openai import ChatCompletionRequest

# kind, status, OpenAI type, Anthropic type, default code
TREE = [
    (InvalidRequestError("bad", param="n"), 400, "invalid_request_error", "invalid_request_error", None),
    (ContextLengthExceededError(3000, 500, 2048), 400, "invalid_request_error", "invalid_request_error",
     "context_length_exceeded"),
    (AuthenticationError("no key"), 401, "authentication_error", "authentication_error", "invalid_api_key"),
    (PermissionDeniedError("no"), 403, "permission_error", "permission_error", None),
    (NotFoundError.for_model("gpt-9"), 404, "not_found_error", "not_found_error", "model_not_found"),
    (PayloadTooLargeError("big"), 413, "invalid_request_error", "request_too_large", "payload_too_large"),
    (UnsupportedMediaTypeError("form"), 415, "invalid_request_error", "invalid_request_error",
     "unsupported_media_type"),
    (RateLimitError("slow down", retry_after=2.5), 429, "rate_limit_error", "rate_limit_error", None),
    (InternalServerError(), 500, "internal_error", "api_error", None),
    (ServiceUnavailableError("busy", retry_after=1), 503, "service_unavailable", "overloaded_error", "overloaded"),
]


@pytest.mark.parametrize("err, status, openai_type, anthropic_type, code", TREE)
def test_each_kind_has_one_status_and_both_shapes(err, status, openai_type, anthropic_type, code):
    assert isinstance(err, TokenwayError) and err.status == status
    assert openai_error_body(err) == {
        "error": {"message": err.message, "type": openai_type, "param": err.param, "code": code}
    }
    assert anthropic_error_body(err) == {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    assert anthropic_error_body(err, request_id="req_1")["request_id"] == "req_1"


def test_context_length_message_gives_both_numbers():
    err = ContextLengthExceededError(3000, 500, 2048)
    assert isinstance(err, InvalidRequestError) and err.param == "messages"
    assert "maximum context length is 2048 tokens" in err.message
    assert "3500 tokens (3000 in the messages, 500 in the completion)" in err.message
    prompt_only = ContextLengthExceededError(4096, None, 2048, param="prompt")
    assert "your prompt resulted in 4096 tokens" in prompt_only.message and prompt_only.param == "prompt"


def test_retry_after_headers():
    assert RateLimitError("x", retry_after=2.5).headers == {"retry-after": "3", "retry-after-ms": "2500"}
    assert ServiceUnavailableError("x", retry_after=0.2).headers == {"retry-after": "1", "retry-after-ms": "200"}
    assert RateLimitError("x").headers == {} and InvalidRequestError("x").headers == {}


def test_internal_error_default_message_is_generic():
    assert InternalServerError().message == "The server had an error while processing your request."


def test_openai_sdk_reads_our_bodies_and_honours_retry_after():
    """The official client maps each status to its exception and retries after retry-after-ms."""
    replies = [RateLimitError("slow down", retry_after=0.001), NotFoundError.for_model("nope")]
    calls = []

    def handler(request):
        err = replies[len(calls)]
        calls.append(request)
        return httpx2.Response(err.status, json=openai_error_body(err), headers=err.headers)

    client = openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=1,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert len(calls) == 2  # the 429 was retried
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


# ---- from_validation_error ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "loc, param",
    [
        (("body", "messages", 2, "role"), "messages[2].role"),
        (("messages", 0, "content", "list[function-before[check_kind(), tagged-union[TextPart]]]", 1, "TextPart",
          "text"), "messages[0].content[1].text"),
        (("stop", "str"), "stop"),
        (("logit_bias", "50256"), "logit_bias.50256"),
        (("body",), None),
        ((), None),
    ],
)
def test_param_from_loc(loc, param):
    assert param_from_loc(loc) == param


def test_fastapi_json_decode_error():
    err = from_validation_error(
        [{"type": "json_invalid", "loc": ("body", 28), "msg": "JSON decode error", "input": {},
          "ctx": {"error": "Expecting value"}}]
    )
    assert err.message == "Request body is not valid JSON: Expecting value at character 28" and err.param is None


def test_pydantic_json_decode_error():
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate_json('{"model": ')
    err = from_validation_error(caught.value)
    assert err.message.startswith("Request body is not valid JSON: ") and err.param is None


def test_union_failures_merge_into_one_sentence():
    err = from_validation_error(
        [{"type": "string_type", "loc": ("body", "x", "str"), "msg": "Input should be a valid string", "input": 5},
         {"type": "list_type", "loc": ("body", "x", "list[str]"), "msg": "Input should be a valid list", "input": 5}]
    )
    assert err.message == "x: Input should be a valid string, got 5 or a valid list" and err.param == "x"


def test_value_errors_and_huge_inputs_stay_short():
    huge = "x" * 1_000_000
    err = from_validation_error(
        [{"type": "value_error", "loc": ("body", "a"), "msg": "Value error, " + huge, "input": huge},
         {"type": "extra_forbidden", "loc": ("body", huge), "msg": "Extra inputs are not permitted", "input": 1}]
    )
    assert err.param == "a" and len(err.message) <= errors.MAX_MESSAGE_CHARS
    assert not err.message.startswith("a: Value error")


def make_app() -> FastAPI:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        err = from_validation_error(exc.errors())
        return JSONResponse(openai_error_body(err), status_code=err.status)

    @app.post("/v1/chat/completions")
    def chat(req: ChatCompletionRequest) -> dict:
        return {"model": req.model}

    return app


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"model": "m", "messages": [', "Request body is not valid JSON: Expecting value at character 28"),
        (b"", "Request body is required: send a JSON object."),
        (b"[1, 2]", "Request body must be a JSON object."),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
         "temperature: Input should be a finite number, got nan"),
        (b'{"model": "m", "messages": [{"role": "usr", "content": "x"}]}',
         "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool', got 'usr'"),
    ],
)
def test_through_fastapi(content, message):
    response = TestClient(make_app()).post(
        "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    body = response.json()
    assert body["error"]["message"] == message and body["error"]["type"] == "invalid_request_error"
    assert "pydantic" not in json.dumps(body)
