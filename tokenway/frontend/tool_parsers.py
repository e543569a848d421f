"""Tool calls read out of a reply as it streams: the model's text in, content and tool-call
pieces out, one ToolCallParser per choice.

    parser.feed(text)          -> ParsedDelta(content, calls)   as each delta arrives
    parser.finish()            -> ParsedDelta                   the text held back, at the end
    parser.tool_calls()        -> the calls completed, in order (a call cut short is not one)

A call's first piece carries its index, id and name, as soon as the name is known; its
arguments follow as fragments of their JSON text as the tokens arrive, so the fragments
joined are the arguments exactly as the model wrote them, in the stream and in the
non-stream reply alike. Text that is part of a format (tags, the generic JSON's framing) is
never content; text held back because it may open a tag is sent once it cannot.

The formats (chosen per model by its chat template, tool_formats.py):

    generic      {"tool_calls": [{"name": .., "arguments": {..}}, ..]} | {"response": ".."}
    hermes       text <tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call> ..   (Qwen2.5, Hermes)
    llama3_json  {"name": .., "parameters": {..}}; {..}  the whole reply, maybe after <|python_tag|>
    mistral      text [TOOL_CALLS][{"name": .., "arguments": {..}}, ..]  or  [TOOL_CALLS]name[ARGS]{..}
    qwen3_coder  text <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n..</function>\n</tool_call>
                 (Qwen3-Coder, Qwen3.5; tool_parser_qwen3_coder.py: the values typed by the tools' schemas)

Everything is read one character at a time by small state machines, so a reply costs
O(its length) however finely it is split.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tokenway.protocol.job import ToolCallDelta

FORMATS = ("generic", "hermes", "llama3_json", "mistral", "qwen3_coder")
# The texts that frame a format's calls. A tokenizer may have any of them as an added token, a
# control or a user-defined one, or spell it out of its vocabulary; a control token's text is in
# the decoded reply only where special tokens are kept (ReplyFormat.keeps_special_tokens).
MARKERS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),  # <function=, <parameter= are text in its vocabulary
}

_WHITESPACE = " \t\r\n"
_ALPHANUMERIC = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates accept only 9 alphanumeric characters as a call id."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


# ---- JSON, one character at a time --------------------------------------------------------

_MORE, _ENDS_WITH, _ENDED_BEFORE = 0, 1, 2


class _ValueScanner:
    """Finds where one JSON value ends. push(ch) says: _MORE (ch is in the value), _ENDS_WITH
    (ch is its last character) or _ENDED_BEFORE (a number or literal ended just before ch)."""

    __slots__ = ("kind", "depth", "in_string", "escape")

    def __init__(self) -> None:
        self.kind = ""  # "container" | "string" | "literal", set by the first character
        self.depth = 0
        self.in_string = False
        self.escape = False

    def push(self, ch: str) -> int:
        if not self.kind:
            if ch in "{[":
                self.kind, self.depth = "container", 1
            elif ch == '"':
                self.kind, self.in_string = "string", True
            else:
                self.kind = "literal"
            return _MORE
        if self.kind == "literal":
            return _ENDED_BEFORE if ch in ",}];" or ch in _WHITESPACE else _MORE
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.kind == "string":
                    return _ENDS_WITH
            return _MORE
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                return _ENDS_WITH
        return _MORE


class _StringDecoder:
    """The text of a JSON string as its characters arrive (after the opening quote): an escape
    is held until whole (a surrogate pair until both halves are)."""

    __slots__ = ("pending", "done")

    def __init__(self) -> None:
        self.pending = ""  # an escape not yet whole
        self.done = False

    def push(self, ch: str) -> str:
        if self.pending:
            self.pending += ch
            return self._escape()
        if ch == "\\":
            self.pending = ch
            return ""
        if ch == '"':
            self.done = True
            return ""
        return ch

    def _escape(self) -> str:
        pending = self.pending
        if len(pending) < 2 or (pending[1] == "u" and len(pending) < 6):
            return ""
        if pending[1] == "u" and 0xD800 <= _hex(pending[2:6]) <= 0xDBFF:  # a high surrogate: its pair?
            if len(pending) < 12 and "\\u".startswith(pending[6:8]):
                return ""
            if len(pending) > 6 and not pending.startswith("\\u", 6):
                self.pending = ""  # a lone high surrogate, then another character
                return "\ufffd" + self.push_all(pending[6:])
        self.pending = ""
        try:
            return json.loads(f'"{pending}"').encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        except (json.JSONDecodeError, ValueError):
            return ""

    def push_all(self, text: str) -> str:
        return "".join(self.push(ch) for ch in text)


def _hex(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        return -1


class _CallObject:
    """One call's JSON object, after its "{": {"name": .., "arguments": ..} with the keys in
    any order (an "id", as Mistral writes, is read and ignored). The name is sent as soon as
    it is whole; arguments that follow it stream, arguments before it wait for it. Arguments
    written as a JSON string holding the object are unwrapped."""

    __slots__ = ("emit", "argument_keys", "state", "key", "text", "scanner", "name", "arguments",
                 "streaming", "failed")

    def __init__(self, emit: _Emitter, argument_keys: tuple[str, ...]) -> None:
        self.emit = emit
        self.argument_keys = argument_keys
        self.state = "key_or_end"
        self.key = ""
        self.text: list[str] = []  # the key or value being read
        self.scanner = _ValueScanner()  # of the key or value being read; each gets a fresh one
        self.name: str | None = None
        self.arguments: str | None = None  # read before the name, or as a string: sent with the name
        self.streaming = False
        self.failed = False

    def push(self, ch: str) -> int:
        """_MORE, or _ENDS_WITH at the object's closing brace; a malformed object sets failed."""
        state = self.state
        if state == "value":
            return self._value(ch)
        if ch in _WHITESPACE:
            return _MORE
        if state == "key_or_end":
            if ch == "}":
                return self._close()
            if ch == '"':
                self.state, self.scanner, self.text = "key", _ValueScanner(), ['"']
                self.scanner.push('"')
            elif ch != ",":
                self.failed = True
            return _MORE
        if state == "key":
            self.text.append(ch)
            if self.scanner.push(ch) == _ENDS_WITH:
                self.key = json.loads("".join(self.text))
                self.state = "colon"
            return _MORE
        if state == "colon":
            if ch == ":":
                self.state = "value_start"
            else:
                self.failed = True
            return _MORE
        # value_start
        self.state, self.scanner, self.text = "value", _ValueScanner(), []
        self.streaming = self.key in self.argument_keys and self.name is not None and ch in "{["
        return self._value(ch)

    def _value(self, ch: str) -> int:
        verdict = self.scanner.push(ch)
        if verdict == _ENDED_BEFORE:
            self._value_read()
            self.state = "key_or_end"
            return self.push(ch)
        if self.streaming:
            self.emit.arguments(ch)
        else:
            self.text.append(ch)
        if verdict == _ENDS_WITH:
            self._value_read()
            self.state = "key_or_end"
        return _MORE

    def _value_read(self) -> None:
        if self.streaming:
            self.arguments, self.streaming = "", False  # sent already
            return
        raw = "".join(self.text)
        if self.key == "name":
            try:
                name = json.loads(raw)
            except json.JSONDecodeError:
                name = None
            if not isinstance(name, str) or not name:
                self.failed = True
                return
            self.name = name
            self.emit.start(name)
            if self.arguments:
                self.emit.arguments(self.arguments)
                self.arguments = ""
        elif self.key in self.argument_keys:
            if raw.startswith('"'):  # {"arguments": "{\"city\": ..}"}
                try:
                    raw = json.loads(raw)
                except json.JSONDecodeError:
                    pass
            if self.name is not None:
                self.emit.arguments(raw)
                raw = ""
            self.arguments = raw

    def _close(self) -> int:
        if self.name is None:
            self.failed = True
            return _ENDS_WITH
        if self.arguments is None:
            self.emit.arguments("{}")
        return _ENDS_WITH


class _Emitter:
    """Collects one feed()'s output: content, and the calls' pieces merged per call."""

    def __init__(self, new_id: Callable[[], str], max_calls: int | None) -> None:
        self.new_id = new_id
        self.max_calls = max_calls
        self.calls: list[ParsedCall] = []
        self.content: list[str] = []
        self.pieces: dict[int, list] = {}  # call index -> [id, name, [argument fragments]]
        self.silent = False  # a call past max_calls: read, never sent

    def text(self, text: str) -> None:
        if text:
            self.content.append(text)

    def start(self, name: str) -> None:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.silent = True
            return
        self.silent = False
        call = ParsedCall(self.new_id(), name)
        self.calls.append(call)
        self.pieces[len(self.calls) - 1] = [call.id, name, []]

    def arguments(self, fragment: str) -> None:
        if self.silent or not self.calls:
            return
        index = len(self.calls) - 1
        self.calls[index].arguments += fragment
        self.pieces.setdefault(index, [None, None, []])[2].append(fragment)

    def complete(self) -> None:
        if not self.silent and self.calls:
            self.calls[-1].complete = True
        self.silent = False

    def take(self) -> ParsedDelta:
        content = "".join(self.content)
        calls = tuple(ToolCallDelta(index, id=id_, name=name, arguments="".join(fragments))
                      for index, (id_, name, fragments) in self.pieces.items())
        self.content, self.pieces = [], {}
        return ParsedDelta(content, calls)


# ---- the formats ---------------------------------------------------------------------------


class ToolCallParser:
    """The base: text passes through as content. Subclasses read their format."""

    argument_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, new_id: Callable[[], str] = openai_call_id, max_calls: int | None = None) -> None:
        self.out = _Emitter(new_id, max_calls)
        self.raw: list[str] = []
        self.call: _CallObject | None = None
        self.cut = False  # the reply ended inside a call

    def feed(self, text: str) -> ParsedDelta:
        self.raw.append(text)
        for ch in text:
            self._push(ch)
        return self.out.take()

    def finish(self) -> ParsedDelta:
        """The end of the reply: text held back is content. A call still open was cut short:
        it never completes, so it is not one of tool_calls()."""
        self._flush()
        self.cut, self.call = self.call is not None, None
        return self.out.take()

    def tool_calls(self) -> list[ParsedCall]:
        return [call for call in self.out.calls if call.complete]

    @property
    def text(self) -> str:
        """The reply as the model wrote it."""
        return "".join(self.raw)

    @property
    def complete(self) -> bool:
        """Every call the reply began, it completed."""
        return not self.cut and self.call is None and all(call.complete for call in self.out.calls)

    def _push(self, ch: str) -> None:
        self.out.text(ch)

    def _flush(self) -> None:
        pass

    def _call_char(self, ch: str) -> bool:
        """Feed the open call; True once it has ended (completed or failed)."""
        call = self.call
        assert call is not None, "a parser in mode 'call' has an open call"
        verdict = call.push(ch)
        if call.failed:  # malformed: the call, if it was begun, never completes
            self.call = None
            return True
        if verdict == _ENDS_WITH:
            self.out.complete()
            self.call = None
            return True
        return False

    def _new_call(self) -> None:
        self.call = _CallObject(self.out, self.argument_keys)
        self.mode = "call"

    def _array_char(self, ch: str, end_mode: str) -> None:
        """In a JSON array of calls: "{" opens the next call; "]", or anything but a comma or a
        blank, ends the array."""
        if ch == "{":
            self._new_call()
        elif ch == "]" or (ch not in _WHITESPACE and ch != ","):
            self.mode = end_mode


class _Tagged(ToolCallParser):
    """Text with tool calls after a trigger tag. Text that may be the start of the tag, and
    whitespace that may precede it, is held until it is known not to be."""

    trigger = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = "text"
        self.held = ""  # text that may open the trigger, or whitespace that may precede it

    def _text_char(self, ch: str) -> None:
        held = self.held + ch
        if held.endswith(self.trigger):
            self._content(held[: -len(self.trigger)].rstrip(_WHITESPACE))  # blanks before a tag go
            self.held = ""
            self._triggered()
            return
        keep = 0  # the longest tail that may still become the trigger
        for size in range(min(len(self.trigger) - 1, len(held)), 0, -1):
            if self.trigger.startswith(held[-size:]):
                keep = size
                break
        head = held[: len(held) - keep]
        body = head.rstrip(_WHITESPACE)
        self._content(body)
        self.held = held[len(body):]

    def _content(self, text: str) -> None:
        if text and not (self.out.calls and not text.strip()):  # blanks between calls are no content
            self.out.text(text)

    def _flush(self) -> None:
        if self.mode == "text":
            self._content(self.held if not self.out.calls else self.held.strip())
        self.held = ""

    def _triggered(self) -> None:
        raise NotImplementedError


class HermesParser(_Tagged):
    """<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>, any number, after text."""

    trigger, closing = MARKERS["hermes"]

    def _push(self, ch: str) -> None:
        mode = self.mode
        if mode == "text":
            self._text_char(ch)
        elif mode == "open":
            if ch == "{":
                self._new_call()
            elif ch not in _WHITESPACE:
                self.mode = "skip"  # not a call object: skip to the closing tag
                self.held = ch
        elif mode == "call":
            if self._call_char(ch):
                self.mode, self.held = "skip", ""
        else:  # skip: to the closing tag
            self.held = (self.held + ch)[-len(self.closing):]
            if self.held == self.closing:
                self.mode, self.held = "text", ""

    def _triggered(self) -> None:
        self.mode = "open"


class MistralParser(_Tagged):
    """[TOOL_CALLS] then a JSON array of calls, or (newer tokenizers) name[ARGS]{..}; more than
    one [TOOL_CALLS] may follow."""

    trigger = MARKERS["mistral"][0]

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("new_id", mistral_call_id)
        super().__init__(*args, **kwargs)
        self.name: list[str] = []
        self.scanner: _ValueScanner | None = None

    def _push(self, ch: str) -> None:
        mode = self.mode
        if mode == "text":
            self._text_char(ch)
        elif mode == "open":
            if ch in _WHITESPACE:
                return
            if ch == "[":
                self.mode = "array"
            else:
                self.mode, self.name = "name", [ch]
        elif mode == "array":
            self._array_char(ch, "text")
        elif mode == "call":
            if self._call_char(ch):
                self.mode = "array"
        elif mode == "name":
            self.name.append(ch)
            name = "".join(self.name)
            if name.endswith("[ARGS]"):
                name = name[: -len("[ARGS]")].split("[CALL_ID]")[0].strip()
                if name:
                    self.out.start(name)
                    self.mode, self.scanner = "args", None
                else:
                    self.mode = "text"
        elif mode == "args":
            if self.scanner is None:
                if ch in _WHITESPACE:
                    return
                self.scanner = _ValueScanner()
            verdict = self.scanner.push(ch)
            if verdict == _ENDED_BEFORE:  # arguments that are no object: the call never completes
                self.mode = "text"
                self._push(ch)
                return
            self.out.arguments(ch)
            if verdict == _ENDS_WITH:
                self.out.complete()
                self.mode = "text"

    def _triggered(self) -> None:
        self.mode = "open"


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the whole reply is one call or several joined by ';', maybe after
    <|python_tag|>; a reply that is not one is text."""

    argument_keys = ("parameters", "arguments")
    python_tag = MARKERS["llama3_json"][0]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = "start"
        self.held = ""

    def _push(self, ch: str) -> None:
        mode = self.mode
        if mode == "text":
            self.out.text(ch)
        elif mode == "start":
            self.held += ch
            stripped = self.held.lstrip()
            if not stripped:
                return
            if stripped.startswith(self.python_tag):
                self.held = ""
                self.mode = "between"
            elif stripped == "{":
                self._new_call()
            elif not self.python_tag.startswith(stripped):
                self.mode = "text"
                self.out.text(self.held)
                self.held = ""
        elif mode == "call":
            self.held += ch
            if self._call_char(ch):
                if not self.out.calls and not self.tool_calls():  # not a call after all: it was text
                    self.mode = "text"
                    self.out.text(self.held)
                else:
                    self.mode = "between"
                self.held = ""
        else:  # between calls
            if ch == "{":
                self._new_call()
            elif ch not in _WHITESPACE and ch != ";":
                self.held += ch
                # Stray characters between calls are dropped, and so is a whole <|python_tag|>.
                if not self.python_tag.startswith(self.held) or self.held == self.python_tag:
                    self.held = ""

    def _flush(self) -> None:
        # A reply cut inside its first object was begun as a call: it is no text either.
        if self.mode == "start" and not self.held.strip():
            self.out.text(self.held)
        self.held = ""


class GenericParser(ToolCallParser):
    """The generic constrained JSON: {"tool_calls": [call, ..]} or {"response": "text"}."""

    _OPENING = re.compile(r'\s*\{\s*"(tool_calls|response)"\s*:\s*([\["])')
    _MAYBE = re.compile(r'\s*(\{\s*("[a-z_]*"?\s*:?\s*)?)?$')

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = "opening"
        self.held = ""
        self.string = _StringDecoder()  # the "response" text, once the opening says it is one

    def _push(self, ch: str) -> None:
        mode = self.mode
        if mode == "response":
            self.out.text(self.string.push(ch))
            if self.string.done:
                self.mode = "tail"
        elif mode == "array":
            self._array_char(ch, "tail")
        elif mode == "call":
            if self._call_char(ch):
                self.mode = "array"
        elif mode == "opening":
            self.held += ch
            opening = self._OPENING.match(self.held)
            if opening is not None:
                self.held = ""
                if opening.group(1) == "response":
                    self.mode = "response"
                else:
                    self.mode = "array"
            elif self._MAYBE.match(self.held) is None:
                self.mode = "text"  # not the format (an unconstrained replica): the text as it is
                self.out.text(self.held)
                self.held = ""
        elif mode == "text":
            self.out.text(ch)

    @property
    def complete(self) -> bool:
        """The reply is one whole JSON document."""
        try:
            json.loads(self.text)
        except ValueError:
            return False
        return True


_PARSERS: dict[str, type[ToolCallParser]] = {
    "generic": GenericParser, "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
}


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    """How a choice's reply is read: its tool-call format, at most how many calls are kept,
    and how the ids of the calls read are written. Made by the chat templating step (the
    Anthropic adaptor sets its id prefix); Generation opens a parser per choice."""

    tool_format: str
    max_calls: int | None = None  # 1: parallel_tool_calls false
    id_prefix: str = "call_"  # the API's: OpenAI's call_, Anthropic's toolu_ (Mistral's ids are its own)
    # A marker of the format is a special token of the model's tokenizer (chat.py): the reply is
    # decoded with special tokens kept, or the parser would never see the call begin.
    keeps_special_tokens: bool = False
    # The request's tools, as sent: qwen3_coder reads each value's type from its parameter's
    # schema (its calls write every value as bare text).
    tools: tuple[dict, ...] = ()

    def parser(self) -> ToolCallParser:
        if self.tool_format == "mistral":
            return MistralParser(max_calls=self.max_calls)
        prefix = self.id_prefix

        def new_id() -> str:
            return f"{prefix}{uuid.uuid4().hex[:24]}"

        if self.tool_format == "qwen3_coder":
            # Imported here: the format's module builds on this one's parsers.
            from tokenway.frontend.tool_parser_qwen3_coder import Qwen3CoderParser
            return Qwen3CoderParser(self.tools, new_id=new_id, max_calls=self.max_calls)
        return _PARSERS[self.tool_format](new_id=new_id, max_calls=self.max_calls)
