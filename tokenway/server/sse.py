"""Server-Sent Events framing. OpenAI streams `data: {json}` events ending with
`data: [DONE]`; Anthropic names each event (`event: message_start`)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def _dumps(payload: Any) -> str:
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump(mode="json", exclude_none=False)
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def data_event(payload: Any) -> bytes:
    return f"data: {_dumps(payload)}\n\n".encode()


def named_event(event: str, payload: Any) -> bytes:
    return f"event: {event}\ndata: {_dumps(payload)}\n\n".encode()


def comment(text: str) -> bytes:
    """An SSE comment: clients ignore it; tokenway puts the stream's Server-Timing here."""
    return "".join(f": {line}\n" for line in text.splitlines()).encode() + b"\n"
