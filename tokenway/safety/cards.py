"""Which digit runs in a text's number windows (numbers.py) are card numbers (detectors.py runs
this).

    find_cards(windows) -> (start, end) ...   offsets in the text

A run is digit groups with gaps between them; a gap is one or two blanks, up to three line
breaks (with blanks), or one separator: any character but a letter, a digit, a blank or NUL
("-", ".", "/", "_", "+", ",", ":", "|", "*", ...), a blank and line breaks on either side of
it allowed. Anything else between two digits (two separators, three blanks, a letter) ends the
run. A run is cut where its separator changes ("4111 1111 1111 1111, 12/28": a blank-split
number, then a comma, then a slash), the group between two kinds in both pieces; a bare line
break (one text of a conversation ending, the next starting) belongs to no kind, and may cut a
group.

A piece is a card when its digits, all of them, are one: 13-19 digits in a card scheme's range
and length, Luhn, and (when it has separators) each group 1-6 digits, but for the groups a line
break touches. Letters may touch it ("u4539148803436467x"). Checking every piece whole, never a
window of its groups, is what keeps lists of small numbers ("41 42 43 ...", lottery draws,
token ids), amounts, dates and versions out: a window of a long run would pass Luhn one time in
ten. What is tried beyond the whole piece, in order: without the group it shares with a
neighbour ("... 1111 12/28"); several cards back to back, all of them valid; and, across line
breaks, a card in up to four of its lines (a number ending one message, a card starting the
next).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

from tokenway.safety.numbers import NumberWindows

# A digit, then (when 13 digits follow closely) its run. Possessive throughout: a run is taken
# whole, once; what it holds is judged in Python. The lookahead fails at once on most numbers,
# and is not tried on a digit right after a digit or after one gap character: a run starts its
# chain (numbers.py), and the lookahead failing at a digit fails at each after it.
_GAP_CHAR = r"[^0-9A-Za-z\0]"
_RUN = re.compile(rf"[0-9](?<![0-9].)(?<![0-9]{_GAP_CHAR}.)(?=(?:{_GAP_CHAR}{{0,7}}+[0-9]){{12}})[0-9]*+"
                  rf"(?:{_GAP_CHAR}{{1,7}}+[0-9]++)*+")
_GROUPS_AND_GAPS = re.compile(r"[0-9]+|[^0-9]+")
_BLANKS_OVER_TWO = re.compile(r"[ \t]{3}")
_MAX_GROUP = 6
_MAX_DIGITS = 19
_MAX_TILED = 4 * _MAX_DIGITS  # the most digits read as cards back to back
_MAX_LINES = 4  # the most lines a card is looked for in, within a longer run
# Hashes (git's 40 hex digits, MD5's 32, SHA-256's 64) hold long digit runs glued to letters: a
# run inside a hex token this long is part of one, not a card glued to a word.
_HASH_CHARS = 32
_HEX = frozenset("0123456789abcdefABCDEF")
_WORD_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

# (first digits range, allowed lengths) per scheme.
_IIN_RANGES = (
    ((4, 4), (13, 16, 19)),  # Visa
    ((51, 55), (16,)), ((2221, 2720), (16,)),  # Mastercard
    ((34, 34), (15,)), ((37, 37), (15,)),  # Amex
    ((6011, 6011), (16, 17, 18, 19)), ((65, 65), (16, 17, 18, 19)), ((644, 649), (16, 17, 18, 19)),  # Discover
    ((3528, 3589), (16, 17, 18, 19)),  # JCB
    ((300, 305), (14, 15, 16, 17, 18, 19)), ((36, 36), (14, 15, 16, 17, 18, 19)),  # Diners
    ((38, 38), (14, 15, 16, 17, 18, 19)),
)


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


# The same, as ranges of the first four digits, for one int() per number.
_HEAD_RANGES = tuple((low * 10 ** (4 - len(str(low))), (high + 1) * 10 ** (4 - len(str(high))) - 1, lengths)
                     for (low, high), lengths in _IIN_RANGES)


def _known_scheme(digits: str) -> bool:
    head, num_digits = int(digits[:4]), len(digits)
    return any(low <= head <= high and num_digits in lengths for low, high, lengths in _HEAD_RANGES)


@dataclass(frozen=True, slots=True)
class _Gap:
    kind: str | None  # " " (blanks), the separator, or None (bare line breaks: no kind)
    breaks: bool  # it holds a line break: the groups it touches are not held to group lengths
    ends_run: bool = False  # not a gap a number has: two runs meet there


_RUN_END = _Gap(None, False, ends_run=True)


@functools.lru_cache(maxsize=4096)  # a text has few kinds of gap, seen again and again
def _gap(text: str) -> _Gap:
    """What the gap between two groups is (module docstring)."""
    num_breaks = text.count("\n")
    separator = text.replace(" ", "").replace("\t", "").replace("\n", "")
    if num_breaks > 3 or len(separator) > 1 or _BLANKS_OVER_TWO.search(text):
        return _RUN_END
    if not separator:
        return _Gap(None if text.count("\n") == len(text) else " ", num_breaks > 0)
    return _Gap(separator, num_breaks > 0)


@dataclass(frozen=True, slots=True)
class _Run:
    groups: list[str]
    gaps: list[_Gap]  # gaps[i] is between groups[i] and groups[i + 1]
    starts: list[int]  # where each group starts in the run's text
    num_before: list[int]  # digits in groups[:i]

    def num_digits(self, lo: int, hi: int) -> int:
        return self.num_before[hi + 1] - self.num_before[lo]

    def is_card(self, lo: int, hi: int) -> bool:
        """Whether groups lo..hi (inclusive) are one card."""
        if not 13 <= self.num_digits(lo, hi) <= _MAX_DIGITS:
            return False
        if any(gap.kind is not None for gap in self.gaps[lo:hi]) and not all(
                len(self.groups[i]) <= _MAX_GROUP or (i > lo and self.gaps[i - 1].breaks)
                or (i < hi and self.gaps[i].breaks) for i in range(lo, hi + 1)):
            return False
        digits = "".join(self.groups[lo:hi + 1])
        return _known_scheme(digits) and luhn_ok(digits)

    def tiled(self, lo: int, hi: int) -> list[tuple[int, int]] | None:
        """Groups lo..hi as one card or several back to back, every one valid; else None."""
        if self.num_digits(lo, hi) > _MAX_TILED:
            return None
        ends_at: dict[int, list[tuple[int, int]]] = {lo - 1: []}  # last group -> cards up to it
        for end in range(lo, hi + 1):
            for start in range(end, lo - 1, -1):
                if self.num_digits(start, end) > _MAX_DIGITS:
                    break
                if start - 1 in ends_at and self.is_card(start, end):
                    ends_at[end] = [*ends_at[start - 1], (start, end)]
                    break
        return ends_at.get(hi)


def _cards_in(run: _Run, lo: int, hi: int, shared_lo: bool, shared_hi: bool) -> list[tuple[int, int]]:
    """The cards among groups lo..hi (one kind of separator), as group ranges; shared_lo and
    shared_hi: the first and last group are also in the neighbouring pieces."""
    if run.num_digits(lo, hi) < 13:
        return []
    for a, b in dict.fromkeys(((lo, hi), (lo + shared_lo, hi), (lo, hi - shared_hi),
                               (lo + shared_lo, hi - shared_hi))):
        if a <= b and (cards := run.tiled(a, b)):
            return cards
    # Across line breaks: one card in up to _MAX_LINES of its lines, the most from each line
    # first (a number ending one message, a card starting the next). Bounded so, the work is
    # linear in the lines, however many ("4\n5\n3\n9\n..." for a page).
    line_starts = [lo, *(i + 1 for i in range(lo, hi) if run.gaps[i].breaks)]
    line_ends = [start - 1 for start in line_starts[1:]] + [hi]
    found: list[tuple[int, int]] = []
    first = 0
    while len(line_starts) > 1 and first < len(line_starts):
        a = line_starts[first]
        for last in range(min(first + _MAX_LINES, len(line_starts)) - 1, first - 1, -1):
            if (a, line_ends[last]) != (lo, hi) and run.is_card(a, line_ends[last]):
                found.append((a, line_ends[last]))
                first = last
                break
        first += 1
    return found


def _cards_in_run(text: str) -> Iterator[tuple[int, int]]:
    """The cards in one _RUN match, as offsets in it."""
    tokens = _GROUPS_AND_GAPS.findall(text)
    groups = tokens[::2]
    run = _Run(groups, [_gap(token) for token in tokens[1::2]],
               list(accumulate(map(len, tokens), initial=0))[::2],
               list(accumulate(map(len, groups), initial=0)))
    # Pieces: cut at a gap that ends a run, and where the separator changes (the group
    # there is in both pieces).
    lo, kind, used_to, num_gaps = 0, None, -1, len(run.gaps)
    for i in range(num_gaps + 1):
        gap = run.gaps[i] if i < num_gaps else _RUN_END
        if not gap.ends_run and (gap.kind is None or kind is None or gap.kind == kind):
            kind = kind or gap.kind
            continue
        if run.num_digits(lo, i) >= 13:
            shared_lo = lo > 0 and not run.gaps[lo - 1].ends_run and used_to < lo
            for a, b in _cards_in(run, lo + (used_to == lo), i, shared_lo, not gap.ends_run):
                used_to = b
                yield run.starts[a], run.starts[b] + len(run.groups[b])
        lo, kind = (i + 1, None) if gap.ends_run else (i, gap.kind)


def find_cards(windows: NumberWindows) -> Iterator[tuple[int, int]]:
    text = windows.text
    for m in _RUN.finditer(windows.joined):
        for start, end in _cards_in_run(m.group()):
            start, end = windows.text_offset(m.start() + start), windows.text_offset(m.start() + start) + end - start
            if not _in_hash(text, start, end):
                yield start, end


def _in_hash(text: str, start: int, end: int) -> bool:
    """Whether text[start:end], glued to letters, is inside a long hex token (a hash)."""
    glued_before = start > 0 and text[start - 1] in _WORD_CHARS
    glued_after = end < len(text) and text[end] in _WORD_CHARS
    if not (glued_before or glued_after):
        return False
    token_start, token_end = start, end
    while token_start > 0 and text[token_start - 1] in _WORD_CHARS:
        token_start -= 1
    while token_end < len(text) and text[token_end] in _WORD_CHARS:
        token_end += 1
    token = text[token_start:token_end]
    return len(token) >= _HASH_CHARS and all(ch in _HEX for ch in token)
