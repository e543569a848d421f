"""Where numbers are in a text, and which of them are IBANs (detectors.py runs these; card
numbers are found in cards.py, phone numbers in detectors.py, in the chain windows).

    zero_digits(text) -> zeroed               every digit "0" (offsets kept)
    chain_windows(text, zeroed) -> NumberWindows   the text around its chains of 8 digits or more
    find_ibans(text, zeroed) -> (start, end) ...   offsets in the text

Scanning a long prompt once for the few places a number may be, and running the number regexes
over those only, is what keeps it cheap. A card or a phone number is a chain of at least 8
digits, each within 7 characters of the next, with no letter between (a card 13 or more, a
phone 8 to 15: cards.py and detectors.py read each chain whole); the chains are found in the
text with its digits all made "0", where the regex engine jumps from one "0" to the next as
from a literal (a digit class costs it a test per character: 0.13 ms on 15,000, ten times as
long). The chains near each other make one window, with a margin for what the patterns read
around them, and the windows are joined by NULs into one string, so each regex is one pass (a
NUL is in no pattern, so no match spans two windows). An IBAN's letter groups break chains: it
is looked for only in a text that holds a country code and its check digits, in the windows
around every digit run.

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
# A chain (in the zeroed text) of 8 digits or more: a digit, then up to 7 characters that are
# neither a letter, a digit nor NUL, before each next one. A chain is taken whole, from its first
# digit: the lookahead failing at one digit fails at each after it in its chain, so the
# lookbehinds skip a digit right after a digit or after one such character.
_CHAIN_GAP = r"[^0-9A-Za-z\0]"
_MIN_CHAIN_DIGITS = 8
_CHAINS = re.compile(rf"0(?<!0.)(?<!0{_CHAIN_GAP}.)(?=(?:{_CHAIN_GAP}{{0,7}}+0){{{_MIN_CHAIN_DIGITS - 1}}})0*+"
                     rf"(?:{_CHAIN_GAP}{{1,7}}+0++)*+")
_ZERO_DIGITS = str.maketrans("123456789", "000000000")
_NONZERO_DIGIT = re.compile("[1-9]")


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


def zero_digits(text: str) -> str:
    """`text` with every ASCII digit "0": the same offsets, digits a literal for the regexes."""
    # str.translate caches its lookups for ASCII only; elsewhere it asks the dict per character.
    return text.translate(_ZERO_DIGITS) if text.isascii() else _NONZERO_DIGIT.sub("0", text)


def number_windows(text: str) -> NumberWindows:
    """The windows around every digit run (for IBANs)."""
    return _windows(text, ((m.start(), m.end()) for m in _RUNS.finditer(text)))


def chain_windows(text: str, zeroed: str) -> NumberWindows:
    """The windows around the chains of 8 digits or more (for cards and phone numbers)."""
    return _windows(text, ((m.start(), m.end()) for m in _CHAINS.finditer(zeroed)))


def _windows(text: str, runs: Iterator[tuple[int, int]]) -> NumberWindows:
    spans: list[list[int]] = []
    for run_start, run_end in runs:
        start, end = max(0, run_start - _MARGIN_BEFORE), min(len(text), run_end + _MARGIN_AFTER)
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


# ---- iban ----------------------------------------------------------------------------------------

# Country, check digits, then 11-30 letters and digits, in groups of any size split by a blank
# or a line break; cut to the country's length in Python.
_IBAN = re.compile(r"[A-Z](?<![A-Za-z0-9][A-Z])[A-Z]\d{2}(?:[ \n]{0,2}[A-Z0-9]){11,30}(?![A-Za-z0-9])", re.ASCII)
# A country code and check digits, in the zeroed text: "00" is a literal to jump to.
_IBAN_HEAD = re.compile(r"00(?<=[A-Z][A-Z]00)")
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


def find_ibans(text: str, zeroed: str) -> Iterator[tuple[int, int]]:
    if _IBAN_HEAD.search(zeroed) is None:  # nearly every text: no windows to make
        return
    windows = number_windows(text)
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
