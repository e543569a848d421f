"""Server-Sent Events framing. OpenAI streams `data: {json}` events ending with
`data: [DONE]`; Anthropic names each event (`event: message_start`)."""

from __future__ import annotations

from typing import Any

from tokenway.json_codec import dumps

DONE = b"data: [DONE]\n\n"


def _dumps(payload: Any) -> bytes:
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump(mode="json", exclude_none=False)
    return dumps(payload)


def data_event(payload: Any) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


def named_event(event: str, payload: Any) -> bytes:
    return f"event: {event}\ndata: ".encode() + _dumps(payload) + b"\n\n"


def comment(text: str) -> bytes:
    """An SSE comment: clients ignore it; tokenway puts the stream's Server-Timing here."""
    return "".join(f": {line}\n" for line in text.splitlines()).encode() + b"\n"
