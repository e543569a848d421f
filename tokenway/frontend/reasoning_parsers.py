"""A reasoning model's thinking read out of its reply as it streams: the model's text in,
thinking and content out, one ReasoningParser per choice.

    parser.feed(text, token_ids) -> ReasoningDelta(reasoning, content)   as each delta arrives
    parser.finish()              -> ReasoningDelta                       the text held back, at the end
    parser.num_reasoning_tokens  -> the tokens spent thinking so far (the call's count once finished)

A reply has at most one thinking part, at its start, between its format's tags:

    <think>\\n I should add them. \\n</think>\\n\\n The sum is 4.
    └markup─┘ └──── reasoning ───┘└──markup──┘ └─content─┘

The tags and the line breaks around them are markup, in neither part (templates write them
back around each part: Qwen3's renders `<think>\\n{reasoning}\\n</think>\\n\\n{content}`). Text that
may be part of a tag, or line breaks that may precede one, is held until it is known not to
be: every split of a reply across deltas gives the same two parts. A reply cut inside its
thinking (max_tokens) is all reasoning.

The formats, by vLLM's --reasoning-parser names (REASONING_PARSERS):

    qwen3        <think> .. </think>: the model opens the part itself (Qwen3), or the prompt
                 left it open (Qwen3's 2507 thinking models, Qwen3.5); a reply that opens with
                 neither is all content
    deepseek_r1  .. </think>: the reply starts inside the part whatever the prompt (DeepSeek-R1
                 and its distills; their template ends the generation prompt in <think>\\n, and
                 the first R1 wrote none); a <think> the model writes again first is markup

Reasoning tokens are counted by token, as vLLM counts them: a token holding any of the
reasoning's text is one, the tags' own tokens are not (the engine's ReasoningBudget counts the
same tokens). Where one delta brings several tokens across a boundary, each token's own text
places it.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from tokenway.protocol.sampling import ReasoningBudget

_BREAKS = "\r\n"


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """How one family of models marks its thinking part."""

    start: str
    end: str
    always_open: bool  # the reply starts inside the part, whatever the prompt


REASONING_PARSERS: Mapping[str, ThinkTags] = MappingProxyType({
    "qwen3": ThinkTags("<think>", "</think>", always_open=False),
    "deepseek_r1": ThinkTags("<think>", "</think>", always_open=True),
})


def check_reasoning_parser(name: str) -> str:
    """`name` (--reasoning-parser) if it is a format; a ValueError listing them if not."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r}: expected one of {', '.join(REASONING_PARSERS)}")
    return name


def template_reasoning_parser(chat_template: str) -> str | None:
    """The format a chat template shows it thinks in (it writes or reads a format's tags), read
    as qwen3: the reply thinks where the model or the generation prompt opens the part. None:
    the template knows no thinking."""
    for name, tags in REASONING_PARSERS.items():
        if not tags.always_open and (tags.start in chat_template or tags.end in chat_template):
            return name
    return None


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one call's reply is read: its format's name and tags, and whether the reply starts
    inside the thinking part (the prompt left it open, or the format always does)."""

    name: str
    start: str
    end: str
    starts_open: bool = False
    # Harmony (harmony_parser.py reads the reply, not ReasoningParser): the channel whose message
    # the prompt left open (a final answer the caller began); None: the reply starts with a header.
    open_channel: str | None = None

    def parser(self, token_text: Callable[[int], str] | None = None) -> ReasoningParser:
        """A parser for one choice; token_text (the tokenizer's) places the tokens of a delta
        that crosses a boundary."""
        return ReasoningParser(self, token_text)


def prompt_reasoning(name: str, prompt_text: str, continues: bool = False) -> ReasoningFormat | None:
    """How a reply to this rendered prompt is read in format `name`. None where the prompt has
    closed the thinking part already: a template's switch turned off writes an empty one in
    its generation prompt (Qwen3's `<think>\\n\\n</think>\\n\\n`), and the reply is content only.
    `continues`: the prompt ends in a reply begun by the caller (continue_final_message), which
    may have opened or closed the part anywhere in its text; otherwise only the generation
    prompt, at the prompt's very end, opens or closes it (a caller's message is never last)."""
    tags = REASONING_PARSERS[name]
    if continues:
        last_start, last_end = prompt_text.rfind(tags.start), prompt_text.rfind(tags.end)
        opened, closed = last_start > last_end, last_end > last_start
    else:
        tail = prompt_text.rstrip()
        opened, closed = tail.endswith(tags.start), tail.endswith(tags.end)
    if closed:
        return None
    return ReasoningFormat(name, tags.start, tags.end, starts_open=opened or tags.always_open)


_CLOSING = re.compile(r"((?:\\n)*)(</[^'\"<>{}]+>)((?:\\n)*)")


def closing_text(chat_template: str, fmt: ReasoningFormat) -> str:
    """The closing sequence as the template writes it (Qwen3's: `\\n</think>\\n\\n`), the line
    breaks around the tag included, so a part the engine ends reads as one the model ended;
    the tag on its own lines where the template writes none."""
    for match in _CLOSING.finditer(chat_template):
        if match.group(2) == fmt.end and (match.group(1) or match.group(3)):
            return match.group(1).replace("\\n", "\n") + fmt.end + match.group(3).replace("\\n", "\n")
    return f"\n{fmt.end}\n\n"


def thinking_budget(fmt: ReasoningFormat, max_tokens: int, chat_template: str,
                    encode: Callable[[str], list[int]]) -> ReasoningBudget:
    """The engine's budget for a reply in `fmt`: at most max_tokens thinking, then the closing
    sequence the model would write (as `encode` makes it, the model's tokenizer)."""
    return ReasoningBudget(max_tokens, end_token_ids=tuple(encode(closing_text(chat_template, fmt))),
                           start_token_ids=tuple(encode(fmt.start)), starts_open=fmt.starts_open)


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One choice's reply split into thinking and content as it streams (module docstring).

    States: `start` (before the reply shows whether it thinks), `open` (the reply starts inside
    the part; a tag written again is markup), `lead` (line breaks after the opening tag), `body`
    (the thinking), `trail` (line breaks after the closing tag), `content` (the rest)."""

    __slots__ = ("format", "token_text", "state", "held", "num_chars", "body_start", "body_end",
                 "num_reasoning_tokens", "_pending", "_reasoning", "_content")

    def __init__(self, fmt: ReasoningFormat, token_text: Callable[[int], str] | None = None) -> None:
        self.format = fmt
        self.token_text = token_text
        self.state = "open" if fmt.starts_open else "start"
        self.held = ""  # text that may be (or precede) a tag, not yet in either part
        self.num_chars = 0  # of the text fed
        # Where the thinking's text lies in the text fed: [body_start, body_end); None: not yet known.
        self.body_start: int | None = None
        self.body_end: int | None = None
        self.num_reasoning_tokens = 0
        # Deltas whose tokens are not counted yet, as (first char, end char, token ids): a
        # token's text held back (a tag under way) is placed once the parser has read past it.
        self._pending: deque[tuple[int, int, Sequence[int]]] = deque()
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ReasoningDelta:
        """One delta's text, and the tokens it came from where the replica reports them."""
        position = self.num_chars
        self.num_chars += len(text)
        state = self.state
        if state == "content":
            delta = ReasoningDelta(content=text)
        elif state == "body" and not self.held and "<" not in text and not text.endswith(("\r", "\n")):
            delta = ReasoningDelta(reasoning=text)  # the common case: thinking with no tag in sight
        else:
            for offset, ch in enumerate(text):
                self._push(ch, position + offset)
            delta = self._take()
        if token_ids:
            self._pending.append((position, self.num_chars, token_ids))
        if self._pending:
            self._count(final=False)
        return delta

    def finish(self) -> ReasoningDelta:
        """The text held back, at the reply's end: a reply cut inside its thinking is all
        reasoning, one cut before it showed whether it thinks, content."""
        held, self.held = self.held, ""
        if self.state == "start":
            if held:
                self._content.append(held)
            self.state = "content"
        elif self.state == "open":  # blanks, or a tag begun: the part's text, read as such
            self.state = "lead"
            first = self.num_chars - len(held)
            for offset, ch in enumerate(held):
                self._push(ch, first + offset)
            held, self.held = self.held, ""
        if self.state == "body" and held:
            self._reasoning.append(held)
        self._count(final=True)
        return self._take()

    # ---- reading, one character at a time ----------------------------------------------

    def _push(self, ch: str, position: int) -> None:
        state = self.state
        if state == "body":
            self._body_char(ch, position)
        elif state == "content":
            self._content.append(ch)
        elif state in ("lead", "trail"):
            if ch in _BREAKS:
                return  # markup
            if state == "trail":
                self.state = "content"
                self._content.append(ch)
            else:
                self.state, self.body_start = "body", position
                self._body_char(ch, position)
        else:  # start, open: before the opening tag, if there is one
            held = self.held + ch
            stripped = held.lstrip()
            if stripped == self.format.start:
                self.state, self.held = "lead", ""
            elif self.format.start.startswith(stripped):
                self.held = held  # blanks, or the tag under way
            elif state == "start":  # the reply does not think: all of it is content
                self.state, self.held = "content", ""
                self._content.append(held)
            else:  # the thinking begins without a tag: what was held is its first text
                self.state, self.held = "lead", ""
                first = position - len(held) + 1
                for offset, held_ch in enumerate(held):
                    self._push(held_ch, first + offset)

    def _body_char(self, ch: str, position: int) -> None:
        end = self.format.end
        held = self.held + ch
        held_from = position - len(held) + 1
        if held.endswith(end):  # line breaks before the tag are markup
            body = held[: -len(end)].rstrip(_BREAKS)
            if body:
                self._reasoning.append(body)
            self.state, self.held, self.body_end = "trail", "", held_from + len(body)
            if self.body_start is None:
                self.body_start = self.body_end
            return
        keep = 0  # the longest tail that may still become the tag
        for size in range(min(len(end) - 1, len(held)), 0, -1):
            if end.startswith(held[-size:]):
                keep = size
                break
        body = held[: len(held) - keep].rstrip(_BREAKS)
        if body:
            self._reasoning.append(body)
        self.held = held[len(body):]

    def _take(self) -> ReasoningDelta:
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return ReasoningDelta(reasoning, content)

    # ---- counting tokens ----------------------------------------------------------------

    def _count(self, final: bool) -> None:
        """Count the tokens of every delta whose text is read to its end (all of them, final)."""
        decided = self.num_chars - len(self.held)
        pending = self._pending
        while pending:
            first, end, token_ids = pending[0]
            # A delta with no text (half a character, a skipped special token) is placed by the
            # character after it.
            if not final and (end > decided or (first == end and first >= decided)):
                break
            pending.popleft()
            self.num_reasoning_tokens += self._reasoning_tokens(first, end, token_ids)

    def _reasoning_tokens(self, first: int, end: int, token_ids: Sequence[int]) -> int:
        """How many of one delta's tokens hold reasoning text (the thinking's place as known now:
        a part not begun lies past every character read, one not ended runs on)."""
        start = self.body_start if self.body_start is not None else math.inf
        stop = self.body_end if self.body_end is not None else math.inf
        num_tokens = len(token_ids)
        if first == end:
            return num_tokens if start <= first < stop else 0
        overlap = min(end, stop) - max(first, start)
        if overlap <= 0:
            return 0
        if overlap == end - first or num_tokens == 1:
            return num_tokens
        if self.token_text is not None:  # several tokens across a boundary: each by its own text
            lengths = [len(self.token_text(token_id)) for token_id in token_ids]
            if sum(lengths) == end - first:
                count, position = 0, first
                for length in lengths:
                    inside = start <= position < stop if length == 0 else \
                        min(position + length, stop) > max(position, start)
                    count += inside
                    position += length
                return count
        # Their texts are not the delta's (a character split across tokens): by the share of text.
        return min(num_tokens, max(1, round(num_tokens * overlap / (end - first))))
