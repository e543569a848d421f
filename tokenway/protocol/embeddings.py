"""POST /v1/embeddings, OpenAI's shape: the request body and the response.

    request body ──► EmbeddingRequest            shapes checked here (a 400 naming the field)
    request.input ─► EmbeddingEngine.embed()     what needs the model: ids in the vocabulary,
                                                 the 256-token window, dimensions (embeddings/)
    EmbeddingResult ─► embedding_response()      {"object": "list", "data": [...], "usage": ...}

`input` is one text, a list of texts, one token-id list or a list of token-id lists; each item
is embedded on its own and answered at its index. OpenAI's own limits hold: at most 2048 items,
at most 300,000 tokens summed over them, none empty. With encoding_format "base64" each
embedding is the base64 of its little-endian float32 bytes (what the openai SDK asks for by
default, and decodes with numpy).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, TypeAdapter, ValidationError

from tokenway.protocol.errors import InvalidRequestError, from_validation_error, short_repr
from tokenway.protocol.openai_messages import PositiveInt, RequestModel, TokenId, fail

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on items in one request's input
MAX_EMBEDDING_TOKENS = 300_000  # OpenAI's limit on the tokens of one request, summed over its items


def _non_empty(text: str) -> str:
    if not text:
        raise fail("empty_input", "must not be an empty string")
    return text


Text = Annotated[str, AfterValidator(_non_empty)]
TokenIdList = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_EMBEDDING_TOKENS)]


def _shape_tag(value: Any) -> str | None:
    """Which of the four shapes `input` is, by its first item (later items must agree)."""
    if isinstance(value, str):
        return "Text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""  # an empty list is judged (and refused) as a list of texts
    if isinstance(first, str):
        return "Texts"
    if type(first) is int:
        return "TokenIds"
    return "TokenIdLists" if isinstance(first, list) else None


def _check_shape(value: Any) -> Any:
    if _shape_tag(value) is None:
        raise fail("input", "must be a string, a list of strings, a list of token ids (integers >= 0) "
                   "or a list of token-id lists, got {got}", got=short_repr(value))
    return value


# CamelCase tags: errors.param_from_loc drops them, so a bad item is named "input[3]".
EmbeddingInput = Annotated[
    Union[  # noqa: UP007
        Annotated[Text, Tag("Text")],
        Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS), Tag("Texts")],
        Annotated[TokenIdList, Tag("TokenIds")],
        Annotated[list[TokenIdList], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS), Tag("TokenIdLists")],
    ],
    Discriminator(_shape_tag),
    BeforeValidator(_check_shape),
]
_INPUT_ADAPTER: TypeAdapter[Any] = TypeAdapter(EmbeddingInput)


class EmbeddingRequest(RequestModel):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    # Only the model's own width is accepted (the engine checks it): MiniLM was not trained
    # to keep its meaning in a prefix of its vector, as text-embedding-3 models are.
    dimensions: PositiveInt | None = None
    user: str | None = None  # accepted and ignored


def split_inputs(value: Any) -> tuple[list[str] | list[list[int]], bool]:
    """An `input` value -> (its items, whether it was a single item rather than a list).

    Checks the shape as EmbeddingRequest does, for callers that did not parse a request;
    raises InvalidRequestError naming the field ("input", "input[3]")."""
    try:
        value = _INPUT_ADAPTER.validate_python(value, strict=True)
    except ValidationError as exc:
        errors = [{**error, "loc": ("input", *error["loc"])} for error in exc.errors(include_url=False)]
        raise from_validation_error(errors) from None
    if isinstance(value, str):
        return [value], True
    if type(value[0]) is int:
        return [value], True
    return value, False


def input_param(index: int, single: bool) -> str:
    """The field name of item `index`: "input" when the request sent one item, else "input[3]"."""
    return "input" if single else f"input[{index}]"


def check_dimensions(dimensions: int | None, model_dimensions: int) -> None:
    if dimensions is not None and dimensions != model_dimensions:
        raise InvalidRequestError(
            f"dimensions: this model's embeddings have {model_dimensions} dimensions and cannot be shortened; "
            f"send {model_dimensions} or leave dimensions out (got {dimensions})",
            param="dimensions",
        )


def embedding_response(
    vectors: np.ndarray, num_prompt_tokens: int, *, model: str, encoding_format: Literal["float", "base64"] = "float",
) -> dict[str, Any]:
    """OpenAI's response body. vectors: float32 (num_inputs, dimensions), row i for input i."""
    if encoding_format == "base64":
        rows = np.ascontiguousarray(vectors, dtype="<f4")
        embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        embeddings = vectors.astype(np.float32, copy=False).tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": embedding} for i, embedding in enumerate(embeddings)],
        "model": model,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
