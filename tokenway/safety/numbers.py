"""Where numbers are in a text, and which of them are card numbers and IBANs (detectors.py runs
these; phone numbers are found there, in the same windows).

    number_windows(text) -> NumberWindows   the text around its digit runs, in one string
    find_cards(windows), find_ibans(windows) -> (start, end) ...   offsets in the text

A card, IBAN or phone number holds a digit run; scanning the text once for runs and running the
number regexes over those runs only (with a margin: an IBAN's country code before, its letter
groups after) is what keeps a long prompt cheap. The runs near each other make one window, and
the windows are joined by NULs into one string, so each regex is one pass (a NUL is in no
pattern, so no match spans two windows).

Patterns are ASCII (re.ASCII): the input screen hands detect() its normalized view, where every
script's digits are ASCII ones.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass

# A digit run, and the runs after it that are at most 16 characters away (a window's margins).
# Possessive: a gap wider than 16 ends the match at once rather than backtracking through it.
_RUNS = re.compile(r"[0-9][0-9 \t\n()+./-]*+(?:[^0-9]{1,16}+[0-9][0-9 \t\n()+./-]*+)*+")
# Context a window keeps around its runs: before, an IBAN's country code and a phone's "+" or "(";
# after, an IBAN's letter groups ("MALT", "MTLC AST0") and what the lookaheads read. A match
# starts at least one character into its window, so its lookbehind reads the text's own.
_MARGIN_BEFORE, _MARGIN_AFTER = 4, 12


@dataclass(frozen=True, slots=True)
class NumberWindows:
    """The windows of `text` around its digit runs, joined by NULs into `joined`; window i is
    text[text_starts[i]:...] at joined[joined_starts[i]:...]."""

    text: str
    joined: str
    joined_starts: tuple[int, ...]
    text_starts: tuple[int, ...]

    def text_offset(self, position: int) -> int:
        """The offset in `text` of joined[position]."""
        i = bisect.bisect_right(self.joined_starts, position) - 1
        return self.text_starts[i] + position - self.joined_starts[i]


def number_windows(text: str) -> NumberWindows:
    spans: list[list[int]] = []
    for m in _RUNS.finditer(text):
        start, end = max(0, m.start() - _MARGIN_BEFORE), min(len(text), m.end() + _MARGIN_AFTER)
        if spans and start <= spans[-1][1]:  # margins that touch (runs are merged when closer)
            spans[-1][1] = end
        else:
            spans.append([start, end])
    joined_starts, position = [], 0
    for start, end in spans:
        joined_starts.append(position)
        position += end - start + 1
    return NumberWindows(text, "\0".join(text[start:end] for start, end in spans), tuple(joined_starts),
                         tuple(start for start, _ in spans))


# ---- credit_card ---------------------------------------------------------------------------------

# 13-19 digits, optionally in groups split by a space, a dash, a dot or a slash (with blanks
# around it) or by up to three line breaks; checked further in Python. The three kinds of gap
# match disjoint strings, so a failing candidate cannot backtrack through many ways of reading it.
# Each regex here starts with what it consumes first, its boundary a lookbehind after it, so the
# engine skips to the next digit (or capital) at C speed; a card's lookahead first makes sure 13
# digits follow closely, which most numbers fail at once.
_CARD_GAP = r"(?:[ \t]{0,2}(?:\n[ \t]{0,2}){1,3}|[ \t]?(?:\n[ \t]?){0,3}[./-][ \t]?(?:\n[ \t]?){0,3}|[ \t]{1,2})"
_CARD = re.compile(rf"\d(?<![\w.,/-]\d)(?=(?:[^\d\0]{{0,7}}+\d){{12}})(?:\d|{_CARD_GAP}\d){{12,18}}"
                   rf"(?![\w]|[.,/-]\d)", re.ASCII)
_DIGITS_OR_GAP = re.compile(r"\d+|\D+", re.ASCII)
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


def _known_scheme(digits: str) -> bool:
    for (low, high), lengths in _IIN_RANGES:
        if len(digits) in lengths and low <= int(digits[:len(str(low))]) <= high:
            return True
    return False


def _card_ok(candidate: str) -> bool:
    """Whether a _CARD match is a card: one kind of separator, groups of 3-6 digits led by one
    of 4-6, 13-19 digits in all in a known scheme's range and length, Luhn. A bare line break
    may cut a group (a card split across two texts, or wrapped): the digits around it are one
    group, and the groups a line break touches are not held to the group lengths."""
    groups: list[str] = []
    loose: list[bool] = []  # per group: a line break cuts it or is next to it
    kinds: set[str] = set()
    merge = loose_next = False
    for token in _DIGITS_OR_GAP.findall(candidate):
        if token[0].isdigit():
            if merge:
                groups[-1] += token
                loose[-1] = True
            else:
                groups.append(token)
                loose.append(loose_next)
            merge = loose_next = False
            continue
        kind = token.strip(" \t\n") or (" " if token.strip("\n") else None)
        if kind is None:
            merge = True
            continue
        kinds.add(kind)
        if "\n" in token:
            loose[-1] = loose_next = True
    if len(kinds) > 1:
        return False
    if kinds and (not all(is_loose or 3 <= len(group) <= 6 for group, is_loose in zip(groups, loose))
                  or not loose[0] and len(groups[0]) < 4):
        return False
    digits = "".join(groups)
    return 13 <= len(digits) <= 19 and _known_scheme(digits) and luhn_ok(digits)


def find_cards(windows: NumberWindows) -> Iterator[tuple[int, int]]:
    joined, position = windows.joined, 0
    while (m := _CARD.search(joined, position)) is not None:
        candidate, position = m.group(), m.end()
        if _card_ok(candidate):
            start = windows.text_offset(m.start())
            yield start, start + len(candidate)
        elif "\n" in candidate:
            # A candidate across line breaks may join one text's number to the next one's (a
            # reference ending a message, a card starting the next): a card may be in its
            # first lines, else it is looked for again from its next line on.
            breaks = [i for i, ch in enumerate(candidate) if ch == "\n"]
            first_lines = (candidate[:i].rstrip(" \t\n./-") for i in reversed(breaks))
            card = next((lines for lines in first_lines if _card_ok(lines)), None)
            if card is not None:
                start = windows.text_offset(m.start())
                yield start, start + len(card)
                position = m.start() + len(card)
            else:
                position = m.start() + breaks[0] + 1


# ---- iban ----------------------------------------------------------------------------------------

# Country, check digits, then 11-30 letters and digits, in groups of any size split by a blank
# or a line break; cut to the country's length in Python.
_IBAN = re.compile(r"[A-Z](?<![A-Za-z0-9][A-Z])[A-Z]\d{2}(?:[ \n]{0,2}[A-Z0-9]){11,30}(?![A-Za-z0-9])", re.ASCII)
# The SWIFT IBAN registry's lengths; a country not here is not an IBAN.
IBAN_COUNTRY_TO_LENGTH = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BI": 27,
    "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DJ": 27, "DK": 18, "DO": 28,
    "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FK": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23,
    "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27,
    "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "LY": 25,
    "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MN": 20, "MR": 27, "MT": 31, "MU": 30, "NI": 28, "NL": 18,
    "NO": 15, "OM": 23, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "RU": 33,
    "SA": 24, "SC": 31, "SD": 18, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "SO": 23, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20, "YE": 30,
}


def iban_ok(compact: str) -> bool:
    """ISO 13616: move the first four characters to the end, letters to 10..35, mod 97 == 1."""
    if IBAN_COUNTRY_TO_LENGTH.get(compact[:2]) != len(compact) or not compact.isalnum():
        return False
    return int("".join(str(int(ch, 36)) for ch in compact[4:] + compact[:4])) % 97 == 1


def find_ibans(windows: NumberWindows) -> Iterator[tuple[int, int]]:
    joined = windows.joined
    for m in _IBAN.finditer(joined):
        length = IBAN_COUNTRY_TO_LENGTH.get(m.group()[:2])
        if length is None:
            continue
        # The regex may run on into a following word ("... 3000 AND"): cut at the country's
        # length, and only where a group ends.
        offsets = [i for i, ch in enumerate(m.group()) if ch not in " \n"]
        if len(offsets) < length:
            continue
        end = m.start() + offsets[length - 1] + 1
        if end < m.end() and joined[end] not in " \n":
            continue
        if iban_ok(joined[m.start():end].replace(" ", "").replace("\n", "")):
            start = windows.text_offset(m.start())
            yield start, start + end - m.start()
