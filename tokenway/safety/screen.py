"""The safety stage: a call's input screened before templating (before admission), its output
screened as it streams (before the client sees it), by the configured checks, under a policy.

    SafetyPolicy(input="block", output="redact", categories=...)       the server's (--safety-*)
    screen_input(policy, texts)  -> InputScreening(categories, action, redacted texts)
                   texts: every text the request carries into the prompt (channels.py), read
                   as one normalized view (normalize.py), so a secret split between two of
                   them or disguised in other scripts' digits, invisible characters or
                   look-alike letters is found; each finding redacts the original characters
                   it covers, in each text it covers
    OutputScreen(policy).feed(text) -> ScreenedText(text, categories, blocked)   one per choice
                        .finish()   -> the text held back, screened

Modes, for input and output alike:
    off     nothing is checked
    flag    checked; what is found is named in the trace (and the x-tokenway-safety-* headers)
    redact  flag, and each finding is replaced by "[REDACTED:<category>]": in the prompt the
            model sees, or in the reply the client gets
    block   flag, and a finding stops the call: the input with a 400 (code
            content_policy_violation), the output at the finding with finish_reason
            content_filter (a stream ends there)

Output in redact and block modes is held back only as far as a finding could still be
forming: the word being written (an email or a key has no blank in it) and, where the
last 64 characters hold digits, the digit groups among them (a card number, an IBAN or a
phone number may be written in groups). Prose flows at once; a number waits for its end.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenway.protocol.errors import FieldError
from tokenway.protocol.job import ToolCallDelta
from tokenway.safety.channels import PromptText
from tokenway.safety.detectors import CATEGORIES, Finding, detect, redact
from tokenway.safety.guard import GUARD_FORMATS
from tokenway.safety.normalize import JoinedView

MODES = ("off", "flag", "redact", "block")
_DIGIT_GROUPS_TAIL = 64
_MAX_HELD = 512  # longer than any key the detectors know
# From the first of the trailing runs that hold a digit, or are one separator ("4539 | 1488"),
# (with the blanks between them) to the end: the part of the tail a number written in groups
# may still be growing in. The first digit of a run is where the run's [^\s\d]* stops, so the
# pattern cannot backtrack far.
_TRAILING_GROUPS = re.compile(r"(?:(?:[^\s\d]*\d\S*|[^A-Za-z0-9\s])[ \t]{1,2})*\S*\Z")


@dataclass(frozen=True, slots=True)
class SafetyPolicy:
    input: str = "off"
    output: str = "off"
    categories: frozenset[str] | None = None  # None: every built-in category
    threshold: float = 0.5  # a finding counts from this score
    # A guard model (safety/guard.py): a served model's name, asked about the input after the
    # built-in checks; its categories are flagged, or block under `block`.
    guard_model: str | None = None
    guard_format: str = "prompt"  # "prompt": Llama Guard's task as a user turn; "chat_template": its own
    guard_fail_closed: bool = False  # a guard that cannot answer: refuse the call (503), not pass it

    def __post_init__(self) -> None:
        for name in ("input", "output"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"safety_{name}: expected one of {', '.join(MODES)}, got {getattr(self, name)!r}")
        if self.guard_format not in GUARD_FORMATS:
            raise FieldError("safety_guard_format", f"expected one of {', '.join(GUARD_FORMATS)}, "
                             f"got {self.guard_format!r}")
        if self.categories is not None and not self.categories <= set(CATEGORIES):
            raise FieldError("safety_categories", f"unknown {sorted(self.categories - set(CATEGORIES))}; "
                             f"known are {', '.join(CATEGORIES)}")

    def to_dict(self) -> dict:
        data = {"input": self.input, "output": self.output, "threshold": self.threshold,
                "categories": sorted(self.categories) if self.categories is not None else None}
        if self.guard_model is not None:
            data |= {"guard_model": self.guard_model, "guard_format": self.guard_format,
                     "guard_fail_closed": self.guard_fail_closed}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SafetyPolicy:
        categories = data.get("categories")
        return cls(input=data.get("input", "off"), output=data.get("output", "off"),
                   categories=frozenset(categories) if categories is not None else None,
                   threshold=data.get("threshold", 0.5), guard_model=data.get("guard_model"),
                   guard_format=data.get("guard_format", "prompt"),
                   guard_fail_closed=data.get("guard_fail_closed", False))

    def findings(self, text: str) -> tuple[Finding, ...]:
        return tuple(f for f in detect(text, self.categories) if f.score >= self.threshold)


@dataclass(frozen=True, slots=True)
class InputScreening:
    """What the input check found and did: categories found (sorted, once each), the action
    taken (flag, redact, block; None when nothing was found), the texts redacted where the
    action is redact, the request field of the first finding, and how long it took. Under a
    redact policy the action is block where a finding is in a text that cannot be redacted."""

    categories: tuple[str, ...] = ()
    action: str | None = None
    redacted: tuple[str, ...] | None = None
    ms: float = 0.0
    param: str | None = None


def screen_input(policy: SafetyPolicy, texts: Sequence[PromptText | str]) -> InputScreening:
    """Screen the texts a call carries into its prompt (a str is a PromptText of its own)."""
    if policy.input == "off":
        return InputScreening()
    started = time.perf_counter()
    texts = [text if isinstance(text, PromptText) else PromptText(text) for text in texts]
    view = JoinedView.of([text.text for text in texts], [text.flows for text in texts])
    found = policy.findings(view.text)
    if not found:
        return InputScreening(ms=(time.perf_counter() - started) * 1000)
    index_to_spans: dict[int, list[tuple[int, int, str]]] = {}
    for finding in found:
        for index, start, end in view.pieces(finding.start, finding.end):
            spans = index_to_spans.setdefault(index, [])
            if spans and start < spans[-1][1]:  # two findings in one character folded into several
                spans[-1] = (spans[-1][0], max(end, spans[-1][1]), spans[-1][2])
            else:
                spans.append((start, end, finding.category))
    categories = tuple(sorted({f.category for f in found}))
    param = texts[min(index_to_spans)].param
    action, redacted = policy.input, None
    if action == "redact":
        if all(texts[index].redactable for index in index_to_spans):
            redacted = tuple(_redact_spans(text.text, index_to_spans[i]) if i in index_to_spans else text.text
                             for i, text in enumerate(texts))
        else:
            action = "block"
    return InputScreening(categories, action, redacted, (time.perf_counter() - started) * 1000, param)


def _redact_spans(text: str, spans: list[tuple[int, int, str]]) -> str:
    pieces, position = [], 0
    for start, end, category in spans:
        pieces += (text[position:start], f"[REDACTED:{category}]")
        position = end
    pieces.append(text[position:])
    return "".join(pieces)


@dataclass(frozen=True, slots=True)
class ScreenedText:
    text: str  # what may be sent now (redacted, in redact mode)
    categories: tuple[str, ...] = ()  # found in it
    blocked: bool = False  # a finding in block mode: the choice ends here, content_filter


class OutputScreen:
    """One choice's output, screened as it streams (module docstring)."""

    def __init__(self, policy: SafetyPolicy) -> None:
        self.policy = policy
        self.mode = policy.output
        self.held = ""
        self.categories: set[str] = set()
        self.seconds = 0.0
        self.blocked = False
        self._flag_text: list[str] = []  # flag mode: the text as it went, checked at the end
        self.finished = False

    def feed(self, text: str) -> ScreenedText:
        if self.blocked or not text:
            return ScreenedText("")
        if self.mode == "flag":
            self._flag_text.append(text)  # nothing is held: checked once, at the end
            return ScreenedText(text)
        started = time.perf_counter()
        try:
            return self._screen(self.held + text, final=False)
        finally:
            self.seconds += time.perf_counter() - started

    def finish(self) -> ScreenedText:
        self.finished = True
        started = time.perf_counter()
        try:
            if self.mode == "flag":
                found = self.policy.findings("".join(self._flag_text))
                self.categories.update(f.category for f in found)
                return ScreenedText("", tuple(sorted({f.category for f in found})))
            if self.blocked:
                return ScreenedText("")
            return self._screen(self.held, final=True)
        finally:
            self.seconds += time.perf_counter() - started

    def _screen(self, buffer: str, final: bool) -> ScreenedText:
        findings = self.policy.findings(buffer) if buffer else ()
        release = len(buffer)
        if not final:
            release = _hold_from(buffer)
            for finding in findings:  # a finding is released whole or not at all
                if finding.start < release < finding.end:
                    release = finding.start
        done = [f for f in findings if f.end <= release]
        if done and self.mode == "block":  # the reply ends at the first: what follows it is never seen
            self.blocked, self.held = True, ""
            self.categories.add(done[0].category)
            return ScreenedText(buffer[:done[0].start], (done[0].category,), blocked=True)
        categories = tuple(sorted({f.category for f in done}))
        self.categories.update(categories)
        self.held = buffer[release:]
        return ScreenedText(redact(buffer[:release], done) if done else buffer[:release], categories)


def _hold_from(buffer: str) -> int:
    """Where the part of `buffer` a finding may still be growing in starts: the trailing digit
    groups within the last 64 characters, or the word under way (back to its first character,
    for a key longer than the tail; at most _MAX_HELD characters)."""
    start = max(0, len(buffer) - _DIGIT_GROUPS_TAIL)
    match = _TRAILING_GROUPS.search(buffer, start)
    held_from = match.start() if match is not None else len(buffer)
    if held_from == start and start > 0:
        while held_from > 0 and not buffer[held_from - 1].isspace() and len(buffer) - held_from < _MAX_HELD:
            held_from -= 1
    return held_from


class ReplyScreen:
    """One choice's reply screened: its content, and each tool call's arguments, each by its own
    OutputScreen (a secret inside arguments is redacted in place: the JSON stays valid). A
    call's held arguments go out before the next call starts; everything at the reply's end."""

    def __init__(self, policy: SafetyPolicy) -> None:
        self.policy = policy
        self.content = OutputScreen(policy)
        self.calls: dict[int, OutputScreen] = {}
        self.released: set[int] = set()  # calls whose arguments are all out
        self.blocked = False

    def screen(self, text: str, pieces: tuple[ToolCallDelta, ...], final: bool
               ) -> tuple[str, tuple[ToolCallDelta, ...]]:
        """What may go out of one delta (text, call pieces); `blocked` is set when the policy
        ends the reply here."""
        out_calls: list[ToolCallDelta] = []
        out_text = ""
        if text:
            screened = self.content.feed(text)
            out_text = screened.text
            if screened.blocked:
                return self._block(out_text, out_calls)
        for piece in pieces:
            if piece.id is not None and not self._release(out_calls, below=piece.index):
                return self._block(out_text, out_calls)
            screen = self.calls.setdefault(piece.index, OutputScreen(self.policy))
            screened = screen.feed(piece.arguments)
            if piece.id is not None or screened.text:
                out_calls.append(dataclasses.replace(piece, arguments=screened.text))
            if screened.blocked:
                return self._block(out_text, out_calls)
        if final:
            screened = self.content.finish()
            out_text += screened.text
            if screened.blocked or not self._release(out_calls, below=None):
                return self._block(out_text, out_calls)
        return out_text, tuple(out_calls)

    def _release(self, out_calls: list[ToolCallDelta], below: int | None) -> bool:
        """The held arguments of the calls before `below` (every call: None); False if blocked."""
        for index in sorted(self.calls):
            screen = self.calls[index]
            if screen.finished or (below is not None and index >= below):
                continue
            screened = screen.finish()
            if screened.text:
                out_calls.append(ToolCallDelta(index, arguments=screened.text))
            if screened.blocked:
                return False
            self.released.add(index)
        return True

    def _block(self, text: str, out_calls: list[ToolCallDelta]) -> tuple[str, tuple[ToolCallDelta, ...]]:
        self.blocked = True
        return text, tuple(out_calls)

    @property
    def categories(self) -> set[str]:
        return self.content.categories.union(*(screen.categories for screen in self.calls.values()))

    @property
    def seconds(self) -> float:
        return self.content.seconds + sum(screen.seconds for screen in self.calls.values())
