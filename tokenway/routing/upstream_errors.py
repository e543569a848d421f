"""An upstream's failures in tokenway's error tree (the table in routing/upstream.py), and
which of them count against the replica's health."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any

from tokenway.protocol.errors import (
    MAX_MESSAGE_CHARS,
    BadGatewayError,
    GatewayTimeoutError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
    TokenwayError,
    truncate,
)
from tokenway.routing.http_client import HTTPError


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """retry-after-ms (OpenAI's), else retry-after in seconds or as an HTTP date."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            try:
                seconds = parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError):
                continue
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


def _error_fields(body: bytes) -> tuple[str | None, str | None, str | None]:
    """(message, param, code) from an OpenAI, Anthropic, vLLM or FastAPI error body, or its text."""
    try:
        payload = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return (truncate(text, MAX_MESSAGE_CHARS) if text else None), None, None
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if not isinstance(error, dict):
        error = {"message": error}
    message = error.get("message", error.get("detail"))
    if message is not None and not isinstance(message, str):
        message = json.dumps(message)
    message, param, code = (truncate(field, MAX_MESSAGE_CHARS) if isinstance(field, str) else None
                            for field in (message, error.get("param"), error.get("code")))
    return message, param, code


def error_for_status(name: str, status: int, body: bytes, headers: Mapping[str, str]) -> TokenwayError:
    """The error a caller sees for an upstream's HTTP error answer (the table above)."""
    if status in (400, 413, 422):
        message, param, code = _error_fields(body)
        return InvalidRequestError(message or f"Upstream {name} refused the request (HTTP {status}).",
                                   param=param, code=code)
    if status == 429:
        return RateLimitError(f"Upstream {name} is rate limiting requests.", retry_after=retry_after_seconds(headers))
    if status in (503, 529):
        return ServiceUnavailableError(f"Upstream {name} is overloaded.", retry_after=retry_after_seconds(headers))
    if status in (401, 403):  # the upstream's message may quote part of the key: never shown
        return BadGatewayError(f"Upstream {name} refused tokenway's credentials (HTTP {status}).")
    if status == 404:
        return BadGatewayError(f"Upstream {name} answered 404: check its base_url and model in tokenway's config.")
    return BadGatewayError(f"Upstream {name} failed (HTTP {status}).")


def stream_error(name: str, error: Any) -> TokenwayError:
    """An error sent inside a 200 stream: OpenAI-style {"message", "code": 400, ...} (vLLM) or
    Anthropic's {"type": "overloaded_error", "message"}."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    kind, code = error.get("type"), error.get("code")
    status = code if isinstance(code, int) else {
        "invalid_request_error": 400, "BadRequestError": 400, "rate_limit_error": 429, "overloaded_error": 529,
    }.get(kind, 500)
    if status in (400, 413, 422, 429, 503, 529):
        return error_for_status(name, status, json.dumps({"error": error}).encode(), {})
    message = error.get("message")
    detail = f": {truncate(message, MAX_MESSAGE_CHARS)}" if isinstance(message, str) and message else ""
    return BadGatewayError(f"Upstream {name} failed mid-stream{detail}")


def is_replica_fault(exc: BaseException) -> bool:
    """Whether a failed call counts against the replica's health: its 5xx, 429s, timeouts,
    dropped connections and garbage do; the caller's own 400s and cancellations do not."""
    return isinstance(exc, (BadGatewayError, GatewayTimeoutError, ServiceUnavailableError, RateLimitError,
                            HTTPError, OSError, TimeoutError))
