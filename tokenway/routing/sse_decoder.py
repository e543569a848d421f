"""Server-Sent Events as an upstream sends them, decoded incrementally: comments, CRLF or CR
line ends, multi-line data and named events are all tolerated; an event larger than
MAX_EVENT_CHARS is garbage, not a token (a ValueError, which the reader maps to a 502)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenway.protocol.errors import truncate

MAX_EVENT_CHARS = 8 * 1024 * 1024  # one event's data; a larger one is garbage, not a token


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = "message"


_NEWLINE = re.compile(r"\r\n|\r|\n")


class SSEDecoder:
    """Server-sent events (WHATWG HTML, "event stream interpretation") from text as it arrives:
    CRLF, CR or LF line ends (a CRLF may be split across chunks), comments, multi-line data.
    Stricter than browsers in one way: a line naming a field other than data, event, id or
    retry raises ValueError, so a 200 answered with HTML or plain JSON fails at once."""

    def __init__(self, max_event_chars: int = MAX_EVENT_CHARS) -> None:
        self._max_event_chars = max_event_chars
        self._partial_line = ""
        self._data_lines: list[str] = []
        self._num_data_chars = 0
        self._event = ""
        self._skip_lf = False  # the last chunk ended in CR: an LF opening the next one ends no line
        self._started = False

    def feed(self, text: str) -> list[SSEEvent]:
        if not text:
            return []
        if not self._started:
            text, self._started = text.removeprefix("\ufeff"), True
        if self._skip_lf and text.startswith("\n"):
            text = text[1:]
        self._skip_lf = text.endswith("\r")
        lines = _NEWLINE.split(self._partial_line + text)
        self._partial_line = lines.pop()
        if len(self._partial_line) > self._max_event_chars:
            raise ValueError(f"a line longer than {self._max_event_chars} characters")
        return [event for event in map(self._line, lines) if event is not None]

    def finish(self) -> list[SSEEvent]:
        """At the end of the body: an event whose closing blank line never came still counts."""
        lines = [self._partial_line, ""] if self._partial_line else [""]
        self._partial_line = ""
        return [event for event in map(self._line, lines) if event is not None]

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            event = SSEEvent("\n".join(self._data_lines), self._event or "message") if self._data_lines else None
            self._data_lines, self._num_data_chars, self._event = [], 0, ""
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._num_data_chars += len(value) + 1
            if self._num_data_chars > self._max_event_chars:
                raise ValueError(f"an event larger than {self._max_event_chars} characters")
            self._data_lines.append(value)
        elif name == "event":
            self._event = value
        elif name not in ("id", "retry"):
            raise ValueError(f"not an event-stream line: {truncate(line, 60)!r}")
        return None
