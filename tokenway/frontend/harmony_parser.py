"""A Harmony reply read as it streams: the model's text (special tokens kept) in, thinking,
content and tool-call pieces out, one HarmonyParser per choice. It stands for both of the other
formats' parsers (reasoning_parsers.py, then tool_parsers.py): its deltas carry all three parts,
so every API renders them as it renders theirs.

    parser.feed(text, token_ids) -> HarmonyDelta(reasoning, content, calls)   as each delta arrives
    parser.finish()              -> HarmonyDelta                              the text held back
    parser.tool_calls()          -> the calls completed, in order
    parser.num_reasoning_tokens  -> the tokens of the analysis channel's text

The reply goes on from the generation prompt's `<|start|>assistant`, a message at a time:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>
    └───────────────────────── header ───────────────────────────────────────────┘ └─ body ──────┘

    analysis                       -> reasoning
    final, commentary (no recipient: a preamble to the user)  -> content
    any channel to=functions.NAME  -> a call to NAME, its body the arguments, streamed as they come
    to= anything else (a built-in tool gpt-oss knows, not offered here) -> reasoning

<|end|> ends a message; <|call|> and <|return|> end the reply (the engine stops on them, so they
are usually not in the text at all: a reply's end ends its last message). A header is read whole
(it is short) at <|message|>, in either order of recipient and channel, as openai-harmony's
parser reads it. A reply that never writes a header (a model that is not writing Harmony) is
content. Text that may be a marker under way is held until it is known not to be: every split
of a reply gives the same parts.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenway.frontend.tool_parsers import ParsedCall
from tokenway.protocol.job import ToolCallDelta

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN, START)  # a <|start|> in a body (no <|end|> written) begins the next message
# A header longer than this, or one with a line break, is no header: the reply is not Harmony.
_MAX_HEADER_CHARS = 256
FUNCTIONS = "functions."


@dataclass(frozen=True, slots=True)
class HarmonyDelta:
    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class Header:
    """A message's header: where its body goes."""

    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def function(self) -> str | None:
        """The function the message calls; None: it calls none."""
        recipient = self.recipient
        return recipient[len(FUNCTIONS):] if recipient is not None and recipient.startswith(FUNCTIONS) else None

    @property
    def part(self) -> str:
        """"reasoning", "content" or "call": what the body is."""
        if self.function is not None:
            return "call"
        if self.recipient is not None and self.recipient != "all" or self.channel == "analysis":
            return "reasoning"
        return "content"


def parse_header(text: str) -> Header:
    """A header's text (between <|start|> and <|message|>, the role included or not) as
    openai-harmony's parse_header_from_string reads it: the channel wherever it stands, then the
    last word a `to=` recipient, or a content type after one."""
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        rest = text[at + len(CHANNEL):]
        size = next((i for i, ch in enumerate(rest) if ch.isspace() or ch == "<"), len(rest))
        channel, text = rest[:size] or None, text[:at] + rest[size:]
    words = text.replace(CONSTRAIN, " " + CONSTRAIN).split()
    if words and words[0] == "assistant":
        words.pop(0)
    recipient = content_type = None
    if words:
        last = words.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif not words:
            recipient = last
        else:
            content_type = last
            recipient = words.pop().removeprefix("to=")
    return Header(channel, recipient, content_type)


class HarmonyParser:
    """One choice's Harmony reply, split as it streams (module docstring).

    States: `header` (reading a header, up to <|message|>), `body` (a message's text), `between`
    (after <|end|>, before the next <|start|>), `done` (after <|call|> or <|return|>), `text`
    (the reply is not Harmony: all of it is content)."""

    __slots__ = ("new_id", "max_calls", "state", "held", "header", "part", "raw", "calls", "num_reasoning_tokens",
                 "_used", "_fresh", "_out", "_pieces", "_silent", "_cut", "_num_reasoning_chars")

    def __init__(self, new_id: Callable[[], str] | None = None, max_calls: int | None = None,
                 starts_in: str | None = None) -> None:
        """starts_in: the channel whose body the prompt left open (a reply continued from its
        begun final answer); None: the reply starts with a header."""
        self.new_id = new_id or (lambda: f"call_{uuid.uuid4().hex[:24]}")
        self.max_calls = max_calls
        self.state = "header" if starts_in is None else "body"
        self.held = ""  # header text, or body text that may be a marker under way
        self.header = ""
        self.part = "content" if starts_in is None else Header(starts_in, None, None).part
        self.raw: list[str] = []
        self.calls: list[ParsedCall] = []
        self.num_reasoning_tokens = 0
        # A part with text already whose message is new: its text starts on a new line (several
        # analysis messages, a preamble and the final answer), as vLLM joins them.
        self._used = {"reasoning": False, "content": False}
        self._fresh = {"reasoning": False, "content": False}
        self._out = {"reasoning": [], "content": []}
        self._pieces: dict[int, list] = {}  # call index -> [id, name, [argument fragments]], this feed's
        self._silent = False  # a call past max_calls: read, never sent
        self._cut = False
        self._num_reasoning_chars = 0  # of this feed's text, those read as reasoning

    # ---- the interface Generation calls -------------------------------------------------

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> HarmonyDelta:
        self.raw.append(text)
        self._num_reasoning_chars = 0
        for ch in text:
            self._push(ch)
        if token_ids and self._num_reasoning_chars:  # a delta's tokens by its share of thinking text
            share = self._num_reasoning_chars / len(text)
            self.num_reasoning_tokens += len(token_ids) if share >= 1 else max(1, round(len(token_ids) * share))
        return self._take()

    def finish(self) -> HarmonyDelta:
        """The reply's end ends its last message: a call whose arguments are whole JSON is made
        (the engine took its <|call|>); one cut short is not. A header never ended is text."""
        held, self.held = self.held, ""
        if self.state == "header":
            header = self.header + held
            if header.strip() and MESSAGE not in header:
                self._emit("content", header)
        elif self.state == "body":
            self._body_text(held)
            self._end_message(explicit=False)
        elif self.state == "text":
            self._emit("content", held)
        self.state = "done"
        return self._take()

    def tool_calls(self) -> list[ParsedCall]:
        return [call for call in self.calls if call.complete]

    @property
    def text(self) -> str:
        """The reply as the model wrote it."""
        return "".join(self.raw)

    @property
    def complete(self) -> bool:
        """Every call the reply began, it completed."""
        return not self._cut and all(call.complete for call in self.calls)

    # ---- reading, one character at a time ----------------------------------------------

    def _push(self, ch: str) -> None:
        state = self.state
        if state == "body":
            self._body_char(ch)
        elif state == "header":
            self._header_char(ch)
        elif state == "between":
            held = self.held + ch
            if held.endswith(START):
                self.state, self.held, self.header = "header", "", ""
            else:  # stray text between messages is dropped; a marker may be under way
                self.held = _marker_tail(held, (START,))
        elif state == "text":
            self._emit("content", ch)

    def _header_char(self, ch: str) -> None:
        header = self.header + ch
        if header.endswith(MESSAGE):
            self.header = ""
            self._begin(parse_header(header[: -len(MESSAGE)]))
            return
        for marker in (START, END, CALL, RETURN):
            if header.endswith(marker):  # a header cut off: start over, or stop
                self.header = ""
                if marker in (CALL, RETURN):
                    self.state = "done"
                elif marker == END:
                    self.state = "between"
                return
        self.header = header
        if len(header) > _MAX_HEADER_CHARS or "\n" in header:
            self.state, self.header = "text", ""  # not Harmony: what was read is the reply's first text
            self._emit("content", header)

    def _begin(self, header: Header) -> None:
        self.state, self.part = "body", header.part
        if self.part != "call":
            self._fresh[self.part] = True
        name = header.function
        if name is None:
            return
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self._silent = True
            return
        self._silent = False
        call = ParsedCall(self.new_id(), name)
        self.calls.append(call)
        self._pieces[len(self.calls) - 1] = [call.id, name, []]

    def _body_char(self, ch: str) -> None:
        held = self.held + ch
        for marker in _BODY_ENDS:
            if held.endswith(marker):
                self._body_text(held[: -len(marker)])
                self.held = ""
                self._end_message(explicit=True)
                self.state = "header" if marker == START else "between" if marker == END else "done"
                self.header = ""
                return
        self.held = _marker_tail(held, _BODY_ENDS)
        self._body_text(held[: len(held) - len(self.held)])

    def _body_text(self, text: str) -> None:
        if not text:
            return
        if self.part == "call":
            if not self._silent and self.calls:
                self.calls[-1].arguments += text
                self._pieces.setdefault(len(self.calls) - 1, [None, None, []])[2].append(text)
            return
        self._emit(self.part, text)

    def _end_message(self, explicit: bool) -> None:
        if self.part == "call" and not self._silent and self.calls:
            call = self.calls[-1]
            call.complete = explicit or _is_json(call.arguments)
            self._cut = self._cut or not call.complete
        self.part = "content"

    def _emit(self, part: str, text: str) -> None:
        if not text:
            return
        out = self._out[part]
        if self._used[part] and self._fresh[part]:
            out.append("\n")
        self._fresh[part] = False
        if part == "reasoning":
            self._num_reasoning_chars += len(text)
        out.append(text)
        self._used[part] = True

    def _take(self) -> HarmonyDelta:
        reasoning, content = "".join(self._out["reasoning"]), "".join(self._out["content"])
        calls = tuple(ToolCallDelta(index, id=id_, name=name, arguments="".join(fragments))
                      for index, (id_, name, fragments) in self._pieces.items())
        self._out = {"reasoning": [], "content": []}
        self._pieces = {}
        return HarmonyDelta(reasoning, content, calls)


def _marker_tail(text: str, markers: Sequence[str]) -> str:
    """The longest tail of `text` that may still become one of `markers`."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-size:]
        if any(marker.startswith(tail) for marker in markers):
            return tail
    return ""


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
