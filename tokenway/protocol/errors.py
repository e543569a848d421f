"""Every error a client can see, as one tree. Each kind maps to exactly one HTTP status.

    TokenwayError                      (status, type, code, param, message; .headers)
    ├── InvalidRequestError            400 invalid_request_error   param names the field: "messages[2].role"
    │   ├── ContentPolicyViolationError 400 invalid_request_error  code content_policy_violation (safety: block)
    │   └── ContextLengthExceededError 400 invalid_request_error   code context_length_exceeded
    ├── AuthenticationError            401 authentication_error    code invalid_api_key
    ├── PermissionDeniedError          403 permission_error
    ├── NotFoundError                  404 not_found_error         code model_not_found for models
    ├── PayloadTooLargeError           413 invalid_request_error   code payload_too_large
    ├── UnsupportedMediaTypeError      415 invalid_request_error   code unsupported_media_type
    ├── RateLimitError                 429 rate_limit_error        retry_after -> retry-after, retry-after-ms
    ├── InternalServerError            500 internal_error          the message never carries a traceback
    ├── BadGatewayError                502 upstream_error          a replica answered with an error or garbage
    ├── ServiceUnavailableError        503 service_unavailable     code overloaded; retry_after as for 429
    └── GatewayTimeoutError            504 timeout_error           the per-request deadline passed upstream

The same error renders in either wire shape: `openai_error_body` gives
{"error": {"message", "type", "param", "code"}}, `anthropic_error_body` gives
{"type": "error", "error": {"type", "message"}} with Anthropic's type names.
`from_validation_error` turns a pydantic / FastAPI validation failure into one short
InvalidRequestError naming the offending field. FieldError (a ValueError, not a TokenwayError) is
what the layers below the API raise for a bad value; it carries the field in `.param`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, NotRequired

import pydantic
from typing_extensions import TypedDict  # pydantic reads only this one before Python 3.12

MAX_ECHOED_CHARS = 100  # a value echoed back in a message is cut to this
MAX_MESSAGE_CHARS = 300


class FieldError(ValueError):
    """A value a request field may not take, raised where the value is checked (SamplingParams,
    a prompt check, a config): `param` names the field, so the API edge answers
    InvalidRequestError(str(exc), param=exc.param) without reading the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.reason = message

    def __reduce__(self):  # crosses the engine process's pipe whole, param included
        return type(self), (self.param, self.reason)


class TokenwayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"  # OpenAI's error.type
    anthropic_type: ClassVar[str] = "api_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        # Whatever a message echoes of the request, it must render as UTF-8 JSON (a lone
        # surrogate would make the error itself fail).
        message = message if message.isascii() else message.encode("utf-8", "backslashreplace").decode()
        super().__init__(message)
        self.message = message
        self.param = param if param is None or param.isascii() else param.encode("utf-8", "backslashreplace").decode()
        self.code = code if code is not None else self.default_code
        self.retry_after: float | None = None  # seconds; set by the kinds that send Retry-After

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        # The openai SDK prefers retry-after-ms; Retry-After itself must be whole seconds.
        return {
            "retry-after": str(max(1, math.ceil(self.retry_after))),
            "retry-after-ms": str(max(0, round(self.retry_after * 1000))),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, code={self.code!r})"


class InvalidRequestError(TokenwayError):
    status = 400
    type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


def invalid_value(exc: ValueError) -> InvalidRequestError:
    """The 400 for a value the layers below refused: naming the field where a FieldError knows it."""
    return InvalidRequestError(str(exc), param=exc.param if isinstance(exc, FieldError) else None)


class ContentPolicyViolationError(InvalidRequestError):
    """Input the server's safety policy blocks: which categories, never the text found."""

    default_code = "content_policy_violation"

    def __init__(self, categories: tuple[str, ...], param: str = "messages") -> None:
        super().__init__(f"The input was blocked by this server's content policy: it contains "
                         f"{', '.join(categories)}. Remove it and send the request again.", param=param)
        self.categories = categories


class ContextLengthExceededError(InvalidRequestError):
    default_code = "context_length_exceeded"

    def __init__(
        self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, param: str = "messages",
        at_least: bool = False, prompt: str = "messages",
    ) -> None:
        """param: the field at fault (the prompt's, or the max_tokens field that pushed it past
        the window); prompt: the prompt's field, which the text names beside the completion."""
        if max_tokens is None:
            prompt = param  # the prompt alone is too long: param is its field
            detail = f"your {param} resulted in {'at least ' if at_least else ''}{num_prompt_tokens} tokens"
        else:
            detail = (
                f"you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the {prompt}, {max_tokens} in the completion)"
            )
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, {detail}. "
            f"Please reduce the length of the {prompt} or completion.",
            param=param,
        )
        self.prompt = prompt
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class AuthenticationError(TokenwayError):
    status = 401
    type = "authentication_error"
    anthropic_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(TokenwayError):
    status = 403
    type = "permission_error"
    anthropic_type = "permission_error"


class NotFoundError(TokenwayError):
    status = 404
    type = "not_found_error"
    anthropic_type = "not_found_error"

    @classmethod
    def for_model(cls, model: str) -> NotFoundError:
        return cls(
            f"The model '{truncate(model)}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


class PayloadTooLargeError(TokenwayError):
    status = 413
    type = "invalid_request_error"
    anthropic_type = "request_too_large"
    default_code = "payload_too_large"


class UnsupportedMediaTypeError(TokenwayError):
    """A body that is not JSON: a form post from a web page must not run a generation."""

    status = 415
    type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class RateLimitError(TokenwayError):
    status = 429
    type = "rate_limit_error"
    anthropic_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float | None = None, code: str | None = None,
                 limit_kind: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after
        self.limit_kind = limit_kind  # which of the caller's limits refused it (rpm, tpm, budget...), if one did


class InternalServerError(TokenwayError):
    status = 500
    type = "internal_error"
    anthropic_type = "api_error"

    def __init__(self, message: str = "The server had an error while processing your request.", *,
                 code: str | None = None) -> None:
        super().__init__(message, code=code)


class ServiceUnavailableError(TokenwayError):
    status = 503
    type = "service_unavailable"
    anthropic_type = "overloaded_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, retry_after: float | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class BadGatewayError(TokenwayError):
    """A replica (an upstream engine or provider) failed the call: an error status it sent,
    a malformed stream, a connection that closed. The message says which replica, never its key."""

    status = 502
    type = "upstream_error"
    anthropic_type = "api_error"
    default_code = "upstream_error"


class GatewayTimeoutError(TokenwayError):
    status = 504
    type = "timeout_error"
    anthropic_type = "timeout_error"
    default_code = "upstream_timeout"


class ErrorObject(TypedDict):
    """OpenAI's error object (the openai SDK's ErrorObject)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    error: ErrorObject


class AnthropicErrorObject(TypedDict):
    type: str  # TokenwayError.anthropic_type
    message: str


class AnthropicErrorBody(TypedDict):
    """Anthropic's error body, and its stream's `error` event (the anthropic SDK's ErrorResponse)."""

    type: Literal["error"]
    error: AnthropicErrorObject
    request_id: NotRequired[str]


def openai_error_body(err: TokenwayError) -> ErrorBody:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def anthropic_error_body(err: TokenwayError, request_id: str | None = None) -> AnthropicErrorBody:
    body: AnthropicErrorBody = {"type": "error", "error": {"type": err.anthropic_type, "message": err.message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


# ---- validation errors -> one InvalidRequestError -------------------------------------------------

# Pydantic puts union-member labels into an error's loc ("str", "list[TextPart]",
# "function-after[...]", "constrained-str"); discriminated unions here use CamelCase tags
# ("TextPart"). Field names are snake_case, so these can be told apart and dropped.
_UNION_LABELS = frozenset({"str", "int", "float", "bool", "none", "bytes", "list", "dict"})
_CAMEL_TAG = re.compile(r"[A-Z][A-Za-z0-9]*")

_BOUND_PHRASES = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}
_ECHO_INPUT_TYPES = frozenset(
    {"literal_error", "int_type", "float_type", "string_type", "bool_type", "string_pattern_mismatch",
     "finite_number", "int_from_float", "enum"}
)


def truncate(text: str, limit: int = MAX_ECHOED_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_repr(value: Any) -> str:
    """A short repr of a client-sent value: never the whole of a 1 MB string."""
    if isinstance(value, str):
        return repr(truncate(value, MAX_ECHOED_CHARS))
    if isinstance(value, (dict, list, tuple)):
        return f"a {'JSON object' if isinstance(value, dict) else 'JSON array'}"
    return truncate(repr(value))


def _clean_loc(loc: Sequence[str | int]) -> list[str | int]:
    if loc and loc[0] == "body":
        loc = loc[1:]
    return [
        part
        for part in loc
        if isinstance(part, int)
        or not (part in _UNION_LABELS or "[" in part or "-" in part or _CAMEL_TAG.fullmatch(part))
    ]


def param_from_loc(loc: Sequence[str | int]) -> str | None:
    """("body", "messages", 2, "content", "list[TextPart]", 0, "text") -> "messages[2].content[0].text"."""
    param = ""
    for part in _clean_loc(loc):
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else part
    return truncate(param) if param else None


def _describe(error: Mapping[str, Any]) -> str:
    kind, ctx, value = error.get("type", ""), error.get("ctx") or {}, error.get("input")
    if kind in _BOUND_PHRASES:
        op, key = _BOUND_PHRASES[kind]
        return f"must be {op} {ctx.get(key)}, got {short_repr(value)}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "unrecognized argument"
    if kind == "too_short" and isinstance(value, (list, dict)):
        return f"must have at least {ctx.get('min_length')} item(s)"
    if kind == "too_long" and isinstance(value, (list, dict)):
        return f"must have at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}"
    message = str(error.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind in _ECHO_INPUT_TYPES and "input" in error:
        message += f", got {short_repr(value)}"
    return message


def from_validation_error(exc: pydantic.ValidationError | Sequence[dict[str, Any]]) -> InvalidRequestError:
    """One short, human InvalidRequestError for a failed request body (the first problem found).

    Accepts a pydantic ValidationError or FastAPI's RequestValidationError.errors() list.
    """
    errors = exc.errors(include_url=False) if isinstance(exc, pydantic.ValidationError) else list(exc)
    if not errors:
        return InvalidRequestError("Invalid request body.")
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error") or error.get("msg") or "malformed JSON"
            position = [part for part in error.get("loc", ()) if isinstance(part, int)]
            if position:  # FastAPI puts the character offset of the failure into loc
                reason = f"{reason} at character {position[0]}"
            return InvalidRequestError(truncate(f"Request body is not valid JSON: {reason}", MAX_MESSAGE_CHARS))

    # When a union fails, every member reports; the member that got deepest is the one the
    # client meant. Members failing at the same place are merged: "a valid string or a valid list".
    params = [param_from_loc(error.get("loc", ())) for error in errors]
    depths = [len(_clean_loc(error.get("loc", ()))) for error in errors]
    first = max(range(len(errors)), key=lambda i: (depths[i], -i))
    param = params[first]
    descriptions: list[str] = []
    for error, error_param in zip(errors, params):
        if error_param == param:
            text = _describe(error)
            if descriptions:
                text = text.removeprefix("Input should be ")
            if text not in descriptions:
                descriptions.append(text)
    kind = errors[first].get("type")
    if kind == "extra_forbidden" and len(_clean_loc(errors[first].get("loc", ()))) == 1:
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}", param=param)
    if param is None:
        if kind == "missing":
            return InvalidRequestError("Request body is required: send a JSON object.")
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return InvalidRequestError("Request body must be a JSON object.")
        message = " or ".join(descriptions)
    else:
        message = f"{param}: {' or '.join(descriptions)}"
    return InvalidRequestError(truncate(message, MAX_MESSAGE_CHARS), param=param)
