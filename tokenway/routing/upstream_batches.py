"""An upstream's own Batch API, the client side: a whole batch handed to an OpenAI-compatible
server (tokenway, vLLM, OpenAI) or to Anthropic, polled, cancelled, and its results read back as
the store's LineOutcomes. Over the replica's own UpstreamHTTP (its connections, its key).

    OpenAI     submit: POST files (multipart, purpose=batch) ─► POST batches {input_file_id,
               endpoint, completion_window 24h, metadata} ─► its id
               find:   GET batches?limit=100: the one whose metadata names ours, if any
               poll:   GET batches/{id}: validating | in_progress | finalizing | cancelling ─► running;
                       completed | expired | cancelled | failed ─► ended
               results: GET files/{output_file_id}/content and files/{error_file_id}/content
               cancel: POST batches/{id}/cancel
    Anthropic  submit: POST messages/batches {requests: [{custom_id, params}]} ─► its id
               poll:   GET messages/batches/{id}: processing_status ended ─► ended
               results: GET messages/batches/{id}/results
               cancel: POST messages/batches/{id}/cancel

Failures map as every upstream call's do (upstream_errors.py): a 4xx refusal of the batch is
InvalidRequestError, a 429 or 503 says when to try again, the rest are 502 or 504. Whole bodies
are read (a batch's input and results are files, not streams), each within MAX_BODY_BYTES.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenway.batches.store import JSONObject, LineOutcome
from tokenway.protocol.errors import BadGatewayError, truncate
from tokenway.routing.upstream import MAX_ERROR_BODY_BYTES, UpstreamHTTP
from tokenway.routing.upstream_errors import error_for_status

BatchApiShape = Literal["openai", "anthropic"]
MAX_BODY_BYTES = 512 * 2**20  # an uploaded input or a results file, read whole
REQUEST_TIMEOUT_S = 300.0  # one request of the Batch API: an upload or download of a whole file
OPENAI_ENDED = frozenset({"completed", "expired", "cancelled", "failed"})
ANTHROPIC_ERROR_STATUS = {"invalid_request_error": 400, "authentication_error": 401, "permission_error": 403,
                          "not_found_error": 404, "request_too_large": 413, "rate_limit_error": 429,
                          "overloaded_error": 529}


@dataclass(frozen=True, slots=True)
class UpstreamBatch:
    """An upstream's batch as one poll saw it. status: the upstream's own word."""

    id: str
    status: str
    ended: bool
    output_file_id: str | None = None  # OpenAI's
    error_file_id: str | None = None
    errors: tuple[str, ...] = ()  # a failed batch's (OpenAI's errors.data messages)


class UpstreamBatchAPI:
    """`http`: the replica's client; `shape`: which Batch API it speaks."""

    def __init__(self, http: UpstreamHTTP, shape: BatchApiShape, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.http, self.shape, self.timeout_s = http, shape, timeout_s

    async def submit(self, lines: Sequence[tuple[str, JSONObject]], endpoint: str,
                     metadata: Mapping[str, str] | None = None) -> str:
        """The batch's (custom_id, body) lines, each body as the upstream takes it: the upstream's id for it."""
        if self.shape == "anthropic":
            requests = [{"custom_id": custom_id, "params": body} for custom_id, body in lines]
            return _field(await self._json("POST", "messages/batches", {"requests": requests}), "id", self.http.name)
        jsonl = "".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body},
                                   ensure_ascii=False, separators=(",", ":")) + "\n" for custom_id, body in lines)
        boundary = "tokenway-" + secrets.token_hex(16)
        upload = _multipart(boundary, {"purpose": "batch"}, ("file", "batch.jsonl", jsonl.encode()))
        file = await self._json("POST", "files", upload, content_type=f"multipart/form-data; boundary={boundary}")
        created = await self._json("POST", "batches", {
            "input_file_id": _field(file, "id", self.http.name), "endpoint": endpoint, "completion_window": "24h",
            **({"metadata": dict(metadata)} if metadata else {})})
        return _field(created, "id", self.http.name)

    async def find(self, metadata_key: str, value: str) -> str | None:
        """The id of the upstream's batch, among its latest 100, whose metadata says key = value:
        one a submission cut off before its id was kept made. Anthropic's batches carry no
        metadata: None."""
        if self.shape == "anthropic":
            return None
        listed = (await self._json("GET", "batches?limit=100")).get("data")
        for batch in listed if isinstance(listed, list) else ():
            if isinstance(batch, dict) and _dict(batch.get("metadata")).get(metadata_key) == value \
                    and isinstance(batch.get("id"), str):
                return batch["id"]
        return None

    async def poll(self, batch_id: str) -> UpstreamBatch:
        if self.shape == "anthropic":
            body = await self._json("GET", f"messages/batches/{batch_id}")
            status = _field(body, "processing_status", self.http.name)
            return UpstreamBatch(batch_id, status, status == "ended")
        body = await self._json("GET", f"batches/{batch_id}")
        status = _field(body, "status", self.http.name)
        errors = tuple(str(error.get("message") or error.get("code") or "")
                       for error in (_dict(body.get("errors")).get("data") or ()) if isinstance(error, dict))
        return UpstreamBatch(batch_id, status, status in OPENAI_ENDED, body.get("output_file_id"),
                             body.get("error_file_id"), errors)

    async def cancel(self, batch_id: str) -> None:
        """Idempotent upstream: cancelling an ended batch there is its 4xx, taken as done."""
        path = f"messages/batches/{batch_id}/cancel" if self.shape == "anthropic" else f"batches/{batch_id}/cancel"
        status, body = await self._request("POST", path, b"{}", "application/json")
        if status >= 300 and status not in (400, 409):
            raise error_for_status(self.http.name, status, body[:MAX_ERROR_BODY_BYTES], {})

    async def results(self, batch: UpstreamBatch) -> dict[str, LineOutcome]:
        """custom_id -> the line's outcome, for every line the ended batch's results name."""
        if self.shape == "anthropic":
            return {line["custom_id"]: anthropic_outcome(line)
                    for line in await self._jsonl(f"messages/batches/{batch.id}/results")}
        outcomes: dict[str, LineOutcome] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                outcomes |= {line["custom_id"]: openai_outcome(line)
                             for line in await self._jsonl(f"files/{file_id}/content")}
        return outcomes

    # ---- the HTTP side ----

    async def _request(self, method: str, path: str, body: bytes | None = None,
                       content_type: str | None = None) -> tuple[int, bytes]:
        headers = {"accept": "application/json", **({"content-type": content_type} if content_type else {})}
        status, answer_headers, data = await self.http.fetch(method, path, headers, body,
                                                             time.monotonic() + self.timeout_s, MAX_BODY_BYTES + 1)
        if len(data) > MAX_BODY_BYTES:
            raise BadGatewayError(f"Upstream {self.http.name} answered {method} {path} with more than "
                                  f"{MAX_BODY_BYTES} bytes.")
        if status >= 300 and not path.endswith("/cancel"):
            raise error_for_status(self.http.name, status, data[:MAX_ERROR_BODY_BYTES], answer_headers)
        return status, data

    async def _json(self, method: str, path: str, body: Any = None, content_type: str = "application/json"
                    ) -> dict[str, Any]:
        payload = body if isinstance(body, bytes) or body is None else json.dumps(body, ensure_ascii=False).encode()
        _, data = await self._request(method, path, payload, content_type if payload is not None else None)
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise BadGatewayError(f"Upstream {self.http.name} answered {method} {path} with something other than a "
                                  f"JSON object: {truncate(data.decode('utf-8', 'replace'), 60)!r}")
        return parsed

    async def _jsonl(self, path: str) -> list[dict[str, Any]]:
        _, data = await self._request("GET", path)
        lines = []
        for number, text in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except (ValueError, RecursionError):
                line = None
            if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str):
                raise BadGatewayError(f"Upstream {self.http.name}'s results (GET {path}) line {number} is not a "
                                      "result line with a custom_id.")
            lines.append(line)
        return lines


def _field(body: Mapping[str, Any], name: str, upstream: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise BadGatewayError(f"Upstream {upstream} answered without a {name}.")
    return value


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _multipart(boundary: str, fields: Mapping[str, str], file: tuple[str, str, bytes]) -> bytes:
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    name, filename, content = file
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                 "Content-Type: application/jsonl\r\n\r\n".encode() + content + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def openai_outcome(line: Mapping[str, Any]) -> LineOutcome:
    """An OpenAI output or error file line as the line's outcome (the request id is the caller's to set)."""
    response, error = line.get("response"), line.get("error")
    if isinstance(response, dict) and isinstance(response.get("status_code"), int) \
            and isinstance(response.get("body"), dict):
        status = response["status_code"]
        return LineOutcome("succeeded" if status < 400 else "failed", status, response["body"], None)
    error = _dict(error)
    code = error.get("code")
    message = str(error.get("message") or "The upstream's batch gave this request no answer.")
    if code in ("batch_cancelled", "batch_expired"):
        return LineOutcome("cancelled" if code == "batch_cancelled" else "expired", None, None,
                           {"code": code, "message": message})
    return LineOutcome("failed", None, None, {"code": code or "upstream_error", "message": message})


def anthropic_outcome(line: Mapping[str, Any]) -> LineOutcome:
    result = _dict(line.get("result"))
    kind = result.get("type")
    if kind == "succeeded" and isinstance(result.get("message"), dict):
        return LineOutcome("succeeded", 200, result["message"], None)
    if kind in ("canceled", "expired"):
        code = "batch_cancelled" if kind == "canceled" else "batch_expired"
        return LineOutcome("cancelled" if kind == "canceled" else "expired", None, None,
                           {"code": code, "message": f"The upstream's batch {kind} this request."})
    error = result.get("error")
    if isinstance(error, dict):
        kind = _dict(error.get("error")).get("type")
        return LineOutcome("failed", ANTHROPIC_ERROR_STATUS.get(str(kind), 500), error, None)
    return LineOutcome("failed", None, None, {"code": "upstream_error",
                                              "message": "The upstream's batch gave this request no answer."})


def usage_of(body: Mapping[str, Any] | None) -> tuple[int, int, int, int]:
    """(prompt, cached, completion, reasoning) tokens of an answer body, OpenAI's usage or
    Anthropic's (whose input_tokens leaves out what its prompt cache read or wrote)."""
    usage = (body or {}).get("usage")
    if not isinstance(usage, dict):
        return 0, 0, 0, 0

    def count(value: Any) -> int:
        return value if type(value) is int and value > 0 else 0

    if "input_tokens" in usage:
        cached = count(usage.get("cache_read_input_tokens"))
        prompt = count(usage.get("input_tokens")) + cached + count(usage.get("cache_creation_input_tokens"))
        return prompt, cached, count(usage.get("output_tokens")), 0
    prompt_details, output_details = _dict(usage.get("prompt_tokens_details")), \
        _dict(usage.get("completion_tokens_details"))
    return (count(usage.get("prompt_tokens")), count(prompt_details.get("cached_tokens")),
            count(usage.get("completion_tokens")), count(output_details.get("reasoning_tokens")))
