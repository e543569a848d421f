"""A done line as its batch's results give it: OpenAI's output and error file lines, Anthropic's
results lines. finalize_ready writes a batch's files with these; nothing else makes them.

OpenAI (one JSON object a line; a line answered 2xx goes to the output file, every other to
the error file):

    {"id": "batch_req_<line_id>", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}
    {"id": ..., "custom_id": ..., "response": null, "error": {"code", "message"}}   never answered:
        code batch_cancelled, batch_expired, or the failure's (a line whose run raised)

Anthropic (one file, every line):

    {"custom_id": ..., "result": {"type": "succeeded", "message": <Message>}}
    {"custom_id": ..., "result": {"type": "errored", "error": <ErrorResponse>}}
    {"custom_id": ..., "result": {"type": "canceled"}}  /  {"type": "expired"}
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tokenway.batches.store import BatchApi, BatchLine, JSONObject, LineOutcome

CANCELLED_ERROR: JSONObject = {"code": "batch_cancelled",
                               "message": "This request was not executed because the batch was cancelled."}
EXPIRED_ERROR: JSONObject = {"code": "batch_expired",
                             "message": "This request could not be executed before the completion window expired."}


def openai_line(line: BatchLine, outcome: LineOutcome) -> dict[str, Any]:
    response = None
    if outcome.status_code is not None and outcome.response is not None:
        response = {"status_code": outcome.status_code, "request_id": outcome.request_id,
                    "body": outcome.response}
    return {"id": line.request_id, "custom_id": line.custom_id, "response": response,
            "error": None if response is not None else _error_object(outcome)}


def in_output_file(outcome: LineOutcome) -> bool:
    """OpenAI's output file has the lines answered 2xx; its error file, the rest."""
    return outcome.outcome == "succeeded"


def anthropic_line(line: BatchLine, outcome: LineOutcome) -> dict[str, Any]:
    result: dict[str, Any]
    if outcome.outcome == "succeeded":
        result = {"type": "succeeded", "message": outcome.response}
    elif outcome.outcome == "failed":
        result = {"type": "errored", "error": _anthropic_error_body(outcome)}
    else:
        result = {"type": "canceled" if outcome.outcome == "cancelled" else "expired"}
    return {"custom_id": line.custom_id, "result": result}


def _error_object(outcome: LineOutcome) -> JSONObject:
    if outcome.error is not None:
        return {"code": outcome.error.get("code"), "message": outcome.error.get("message", "")}
    return {"code": "internal_error", "message": "The request failed without an answer."}


def _anthropic_error_body(outcome: LineOutcome) -> JSONObject:
    """The body the line was answered with when it is Anthropic's error shape, else one made of
    the failure (the line raised, or its answer was not an error body)."""
    body = outcome.response
    if body is not None and body.get("type") == "error" and isinstance(body.get("error"), dict):
        return body
    error = _error_object(outcome)
    # api_error: a failure before any answer is the server's own.
    body = {"type": "error", "error": {"type": "api_error", "message": error["message"]}}
    return body if outcome.request_id is None else {**body, "request_id": outcome.request_id}


def result_files(api: BatchApi, results: Iterable[tuple[BatchLine, LineOutcome]]) -> tuple[bytes, bytes]:
    """(output, error) file contents, JSONL; either may be empty (then no file is made). An
    Anthropic batch's results are all in the first."""
    output: list[str] = []
    errors: list[str] = []
    for line, outcome in results:
        if api == "anthropic":
            output.append(_dumps(anthropic_line(line, outcome)))
        else:
            (output if in_output_file(outcome) else errors).append(_dumps(openai_line(line, outcome)))
    return "".join(output).encode(), "".join(errors).encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n"
