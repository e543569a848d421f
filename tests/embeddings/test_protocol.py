"""The /v1/embeddings wire shapes: what the openai SDK sends parses, every bad field is one 400
naming it, and the response the SDK reads back holds exactly our float32 vectors, as floats or
as base64."""

from __future__ import annotations

import base64
import json

import httpx2
import numpy as np
import openai
import pydantic
import pytest

from tokenway.embeddings.inputs import prepare_inputs
from tokenway.protocol.embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest, embedding_response, split_inputs
from tokenway.protocol.errors import ContextLengthExceededError, InvalidRequestError, from_validation_error

VECTORS = np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32)


def sdk_round_trip(reply_vectors: np.ndarray, **create_kwargs):
    """(the body the openai SDK sent, what it returned) for embeddings.create(**create_kwargs)."""
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        request_body = EmbeddingRequest.model_validate_json(request.content)
        items, _ = split_inputs(request_body.input)
        answer = embedding_response(reply_vectors[: len(items)], 7, model="all-minilm-l6-v2",
                                    encoding_format=request_body.encoding_format)
        return httpx2.Response(200, content=json.dumps(answer).encode(), headers={"content-type": "application/json"})

    # Strict validation checks the raw body, before the SDK decodes base64 into floats.
    strict = create_kwargs.get("encoding_format") == "float"
    client = openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=0, _strict_response_validation=strict,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    return bodies, client.embeddings.create(model="all-minilm-l6-v2", **create_kwargs)


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_sdk_request_parses_and_its_response_reads_back_our_exact_floats(encoding_format):
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    bodies, response = sdk_round_trip(VECTORS, input=["a", "b", "c"], dimensions=384, user="u1", **kwargs)
    assert bodies[0]["encoding_format"] == (encoding_format or "base64")  # the SDK asks for base64 by default
    if encoding_format == "base64":  # asked for explicitly, the SDK hands the strings over as they came
        got = np.stack([np.frombuffer(base64.b64decode(item.embedding), dtype="<f4") for item in response.data])
    else:
        got = np.array([item.embedding for item in response.data], dtype=np.float32)
    np.testing.assert_array_equal(got, VECTORS)
    assert [item.index for item in response.data] == [0, 1, 2]
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (7, 7)
    assert response.model == "all-minilm-l6-v2" and response.object == "list"


def test_base64_is_little_endian_float32_bytes():
    body = embedding_response(VECTORS, 5, model="m", encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]])
    np.testing.assert_array_equal(decoded, VECTORS)


def test_float_response_is_plain_json_holding_the_float32_values():
    body = json.loads(json.dumps(embedding_response(VECTORS, 5, model="m")))
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [item["object"] for item in body["data"]] == ["embedding"] * 3
    np.testing.assert_array_equal(np.array([item["embedding"] for item in body["data"]], dtype=np.float32), VECTORS)


@pytest.mark.parametrize(("value", "items", "single"), [
    ("hello", ["hello"], True),
    (["a", "b"], ["a", "b"], False),
    ([101, 7592, 102], [[101, 7592, 102]], True),
    ([[101, 102], [7592]], [[101, 102], [7592]], False),
])
def test_the_four_input_shapes(value, items, single):
    request = EmbeddingRequest.model_validate_json(json.dumps({"model": "m", "input": value}))
    assert request.encoding_format == "float" and request.dimensions is None
    assert split_inputs(request.input) == (items, single)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": ""}, "input", "input: must not be an empty string"),
    ({"input": []}, "input", "input: must have at least 1 item(s)"),
    ({"input": ["a", ""]}, "input[1]", "input[1]: must not be an empty string"),
    ({"input": ["a", 3]}, "input[1]", "input[1]: Input should be a valid string, got 3"),
    ({"input": [5, -1]}, "input[1]", "input[1]: must be >= 0, got -1"),
    ({"input": [[5], []]}, "input[1]", "input[1]: must have at least 1 item(s)"),
    ({"input": [[5], [6, "x"]]}, "input[1][1]", "input[1][1]: Input should be a valid integer, got 'x'"),
    ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", "input: must have at most 2048 items, got 2049"),
    ({"input": 5}, "input", "input: must be a string, a list of strings, a list of token ids"),
    ({"input": [1.5]}, "input", "input: must be a string, a list of strings, a list of token ids"),
    ({"input": [True]}, "input", "input: must be a string, a list of strings, a list of token ids"),
    ({}, "input", "input: is required"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format",
     "encoding_format: Input should be 'float' or 'base64', got 'hex'"),
    ({"input": "a", "dimensions": 0}, "dimensions", "dimensions: must be >= 1, got 0"),
    ({"input": "a", "dimensions": "384"}, "dimensions", "dimensions: Input should be a valid integer"),
    ({"input": "a", "truncate": True}, "truncate", "Unrecognized request argument supplied: truncate"),
])
def test_bad_fields_are_one_400_naming_the_field(body, param, message):
    with pytest.raises(pydantic.ValidationError) as caught:
        EmbeddingRequest.model_validate_json(json.dumps({"model": "m", **body}))
    error = from_validation_error(caught.value)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(message)


@pytest.mark.parametrize(("value", "param"), [("", "input"), (["a", ""], "input[1]"), ({"a": 1}, "input")])
def test_split_inputs_checks_as_the_request_does(value, param):
    with pytest.raises(InvalidRequestError) as caught:
        split_inputs(value)
    assert caught.value.param == param


# ---- what needs the model: prepare_inputs ----------------------------------------------------------


def test_out_of_vocabulary_ids_name_the_item(model):
    with pytest.raises(InvalidRequestError) as caught:
        prepare_inputs(model, [[101, 102], [101, 30522, 102]])
    assert caught.value.param == "input[1]"
    assert caught.value.message == "input[1]: token id 30522 is outside the vocabulary [0, 30522)"
    assert prepare_inputs(model, [101, 30521, 102]) == [[101, 30521, 102]]


def test_over_long_item_of_a_list_is_a_context_length_error_naming_it(model):
    with pytest.raises(ContextLengthExceededError) as caught:
        prepare_inputs(model, ["short", "word " * 300])
    assert (caught.value.param, caught.value.code, caught.value.num_prompt_tokens) == (
        "input[1]", "context_length_exceeded", 302)
    assert "maximum context length is 256 tokens" in caught.value.message


def test_a_request_over_300000_tokens_in_all_is_refused(model):
    assert len(prepare_inputs(model, [[101] * 146] * 2048)) == 2048  # 299,008 tokens
    with pytest.raises(InvalidRequestError) as caught:
        prepare_inputs(model, [[101] * 147] * 2048)
    assert caught.value.param == "input" and "301056 tokens" in caught.value.message


@pytest.mark.parametrize("dimensions", [1, 128, 383, 385, 1536])
def test_dimensions_other_than_the_models_are_refused(model, dimensions):
    with pytest.raises(InvalidRequestError) as caught:
        prepare_inputs(model, "hello", dimensions)
    assert caught.value.param == "dimensions" and "384" in caught.value.message
    assert prepare_inputs(model, "hello", 384) == prepare_inputs(model, "hello")
