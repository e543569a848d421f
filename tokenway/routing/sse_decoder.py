"""Server-Sent Events as an upstream sends them, decoded incrementally: comments, CRLF or CR
line ends, multi-line data and named events are all tolerated; a line or an event larger than
the decoder's max_event_chars is garbage, not a token (EventTooLargeError, which the reader
maps to a 502 naming it).

Each piece of text is scanned once, whatever the length of the line it continues: a line
still open is kept as its pieces and joined once it ends. (Re-scanning the open line with
every chunk made an endless line quadratic: 1.8 s of event loop per call at an 8 MiB cap.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenway.protocol.errors import truncate

MAX_EVENT_CHARS = 2**20  # one line or one event's data; a larger one is garbage, not a token


class EventTooLargeError(ValueError):
    """A line or an event over the decoder's max_event_chars."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = "message"


_NEWLINE = re.compile(r"\r\n|\r|\n")


def split_lines(text: str) -> list[str]:
    """The lines ended in `text`, then what follows the last line end (maybe "")."""
    if "\n" not in text and "\r" not in text:  # two memchr-speed scans; the regex walks each character
        return [text]
    return _NEWLINE.split(text)


class SSEDecoder:
    """Server-sent events (WHATWG HTML, "event stream interpretation") from text as it arrives:
    CRLF, CR or LF line ends (a CRLF may be split across chunks), comments, multi-line data.
    Stricter than browsers in one way: a line naming a field other than data, event, id or
    retry raises ValueError, so a 200 answered with HTML or plain JSON fails at once."""

    def __init__(self, max_event_chars: int = MAX_EVENT_CHARS) -> None:
        self.max_event_chars = max_event_chars
        self._open_line: list[str] = []  # the line not yet ended, in the pieces it came in
        self._num_open_line_chars = 0
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
        lines = split_lines(text)  # this text only: the open line's pieces are not scanned again
        rest = lines.pop()
        if lines and self._open_line:
            lines[0] = "".join(self._open_line) + lines[0]
            self._open_line, self._num_open_line_chars = [], 0
        if rest:
            self._open_line.append(rest)
            self._num_open_line_chars += len(rest)
            if self._num_open_line_chars > self.max_event_chars:
                raise EventTooLargeError(f"a line longer than {self.max_event_chars} characters")
        return [event for event in map(self._line, lines) if event is not None]

    def finish(self) -> list[SSEEvent]:
        """At the end of the body: an event whose closing blank line never came still counts."""
        lines = ["".join(self._open_line), ""] if self._open_line else [""]
        self._open_line, self._num_open_line_chars = [], 0
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
            if self._num_data_chars > self.max_event_chars:
                raise EventTooLargeError(f"an event larger than {self.max_event_chars} characters")
            self._data_lines.append(value)
        elif name == "event":
            self._event = value
        elif name not in ("id", "retry"):
            raise ValueError(f"not an event-stream line: {truncate(line, 60)!r}")
        return None
