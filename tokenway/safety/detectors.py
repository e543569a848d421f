"""Built-in detectors for secrets and PII in text: where they are, never what they say.

    text -> detect(text, categories) -> tuple[Finding, ...]  (sorted by start, non-overlapping)
         -> redact(text, findings)   -> text with each span replaced by "[REDACTED:<category>]"

Each category has one finder (cards in cards.py, IBANs in numbers.py, keys in keys.py, emails and phone
numbers here) that yields candidates; detect() runs the finders whose cheap prefilter passes
(no '@': no email; no digit run: no card, phone or IBAN; no key prefix: no api_key regex), then
keeps, among overlapping candidates, the most specific category (api_key > iban > credit_card >
email > phone), so a key whose digits look like a phone number is reported once, as a key. A
Finding holds only offsets, so a secret is never copied into it.

The patterns are ASCII. The input screen (screen.py) runs them on a normalized view of the
request (normalize.py: other scripts' digits, fullwidth forms, invisible characters, odd spaces
and dashes, look-alike letters folded), so what they see is what a reader sees. On that view:
  cards     digit groups of any size split by blanks, line breaks or any one separator ("_",
            "+", ",", ":", "|" ..., blanks around it allowed), one kind per number, glued to
            letters or not; each run of one kind is judged whole (cards.py); a bare line break
            may cut a group (a card split across texts: the screen joins a conversation's texts
            with line breaks), and a run across lines is tried again line by line
  IBANs     groups of any size split by a blank or a line break
  api keys  broken by blanks, line breaks or one separator, in pieces of any size, the "sk-"
            prefix too (by blanks): the pieces are joined up to the first that reads as a word
            once they make a key ("and", "Then", "2024"), so prose after a key stays out; glued
            to the word before it (or, fixed-length formats, after it) when random (keys.py)
A phone number's context (a label, "call") is read on its own line only.

Scores: 1.0 where the match is checked beyond its shape (Luhn and IIN range for cards, mod-97
and the country's length for IBANs) or is an exact key format; 0.95 for emails; 0.8 for phone
numbers, 0.9 when a word such as "phone" or "call" comes just before.

Deliberately not detected: obfuscated emails ("ann at example dot com"), lowercase IBANs,
plain digit runs as phone numbers ("4155550132"), a card led by another number split the same
way ("ref 1234 4111 1111 1111 1111" is one 20-digit run, and trying every window of a run would
multiply false positives in lists of numbers), a card with two kinds of separator or two
separators in a row ("4111-1111 1111.1111", "4111--1111"), digits inside a hex token of 32 or
more (a hash), a key whose prefix is broken other than "sk-"'s ("AK IA..."), a tokenway key
split by dashes (its random part holds dashes of its own).

Out of a pattern detector's reach, left to a guard model (guard.py): secrets encoded (HTML
entities "&#52;&#49;", URL-encoding "%34%31", base64, hex, JSON escapes in free text),
reversed, spelled out ("four one one one ..."), interleaved with other text ("4a1b1c1..."), or
split between places that stand alone (JSON values, names).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tokenway.safety.cards import find_cards, luhn_ok
from tokenway.safety.keys import find_api_keys
from tokenway.safety.numbers import (
    IBAN_COUNTRY_TO_LENGTH,
    NumberWindows,
    chain_windows,
    find_ibans,
    iban_ok,
    zero_digits,
)

__all__ = ["CATEGORIES", "IBAN_COUNTRY_TO_LENGTH", "Finding", "detect", "iban_ok", "luhn_ok", "redact"]

CATEGORIES = ("api_key", "credit_card", "iban", "email", "phone")
# Higher wins when two findings overlap. An IBAN's digits glued to its country code may read as
# a card too ("BE68 5390 0754 7034"): mod 97 and the country's length are the stronger check.
_CATEGORY_TO_RANK = {"api_key": 5, "iban": 4, "credit_card": 3, "email": 2, "phone": 1}
_NUMBER_CATEGORIES = frozenset({"credit_card", "iban", "phone"})  # each holds a digit
_CHAIN_CATEGORIES = frozenset({"credit_card", "phone"})  # found in the chain windows (numbers.py)


@dataclass(frozen=True, slots=True)
class Finding:
    """One detected item: text[start:end] is of `category`, with confidence `score` in (0, 1]."""

    category: str
    start: int
    end: int
    score: float

    def __post_init__(self) -> None:
        if self.category not in _CATEGORY_TO_RANK:
            raise ValueError(f"category: must be one of {CATEGORIES}, got {self.category!r}")
        if not 0 <= self.start < self.end:
            raise ValueError(f"start, end: need 0 <= start < end, got {self.start}, {self.end}")
        if not 0.0 < self.score <= 1.0:
            raise ValueError(f"score: must be in (0, 1], got {self.score!r}")


# ---- email ---------------------------------------------------------------------------------------

_EMAIL_LOCAL = re.compile(r"[A-Za-z0-9._%+'-]{1,64}\Z")  # ' as in o'neil@
_EMAIL_DOMAIN = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+([A-Za-z]{2,24})(?![A-Za-z0-9-])")
# "icon@2x.png" is a file name, not an address.
_FILE_SUFFIXES = frozenset(("png", "jpg", "jpeg", "gif", "svg", "webp", "ico", "pdf", "txt", "css",
                            "js", "json", "yaml", "yml", "toml", "py", "ts", "md", "html", "zip"))


def _find_emails(text: str) -> Iterator[Finding]:
    at = text.find("@")
    while at != -1:
        local = _EMAIL_LOCAL.search(text, max(0, at - 64), at)
        domain = _EMAIL_DOMAIN.match(text, at + 1)
        # "git@github.com:org/repo.git" is an SSH remote, "icon@2x.png" a file name.
        if (local and domain and domain.group(1).lower() not in _FILE_SUFFIXES
                and not (text.startswith(":", domain.end()) and text[domain.end() + 1:domain.end() + 2].strip())):
            start = local.start() + len(local.group()) - len(local.group().lstrip(".'"))
            if start < at and text[at - 1] != ".":
                yield Finding("email", start, domain.end(), 0.95)
        at = text.find("@", at + 1)


# ---- phone ---------------------------------------------------------------------------------------

_PHONE = re.compile(r"""
    [+(0-9](?<![\w+#$/.:-].)       # the first character, then what stands before it: so the
    (?:                             # regex engine skips to the next "+", "(" or digit at once
        (?<=\+)[1-9]\d{0,2}(?:[ ]?\(0\))?(?:[ .-]?\(\d{1,4}\)|[ .-]?\d{1,6}){1,6}    # international
      | (?<=\()[2-9]\d{2}\)[ ]?[2-9]\d{2}[ .-]\d{4}                          # US (415) 555-0132
      | (?<=1)[ .-]\([2-9]\d{2}\)[ ]?[2-9]\d{2}[ .-]\d{4}                    # US 1 (415) 555-0132
      | (?<=1)[ .-][2-9]\d{2}([ .-])[2-9]\d{2}\1\d{4}                         # US 1-415-555-0132
      | (?<=[2-9])\d{2}([ .-])[2-9]\d{2}\2\d{4}                              # US 415-555-0132
      | (?<=0)\d{1,4}([ .-])\d{2,8}(?:\3\d{2,4}){0,3}                        # national 020 7946 0958
    )
    (?!\w|[ .,:/-]\d)                # nor the start of one: "04 11 23 35 42 48"
""", re.VERBOSE | re.ASCII)
# A code right before ("1Z 999 AA1 0123 4567 84") makes the digits the rest of that code.
_CODE_BEFORE = re.compile(r"\w*\d\w*[ -]\Z")
_PHONE_WORDS = re.compile(r"(?i)\b(?:phone|tel|telephone|call|mobile|cell|fax|whatsapp|sms|text|dial|ring)\b")
# A label right before the number ("order #", "Invoice no.", "ticket ID:") says it is not a phone.
_NOT_PHONE_LABEL = re.compile(r"(?i)(?:\b(?:order|invoice|ticket|tracking|ref|reference|account|acct|case|serial"
                              r"|sku|part|id|isbn|po|batch|lot|build|version|item|confirmation)"
                              r"(?:\s*(?:no|nr|num|number|code))?\.?\s*[:#]?|#)\s*\Z")
_PARENS_ONLY = re.compile(r"\(\d+\)")
_CONTEXT_CHARS = 24


def _find_phones(windows: NumberWindows) -> Iterator[Finding]:
    text = windows.text
    for m in _PHONE.finditer(windows.joined):
        candidate = m.group()
        num_digits = sum(ch.isdigit() for ch in candidate)
        if candidate[0] == "+":
            # E.164: at most 15 digits; one unbroken run must be long to not be a "+12345" delta.
            unbroken = not any(ch in " .-()" for ch in candidate)
            if not (10 if unbroken else 8) <= num_digits <= 15:
                continue
            if _PARENS_ONLY.sub("", candidate).count("(") or "  " in candidate:
                continue
        elif candidate[0] == "0" and not 9 <= num_digits <= 12:
            continue
        start = windows.text_offset(m.start())
        # On the number's line only: the screen joins a request's texts with line breaks (and
        # NULs), and a word ending one message ("text.", "order #") says nothing of a number
        # starting the next.
        before = text[max(0, start - _CONTEXT_CHARS):start]
        before = before[max(before.rfind("\n"), before.rfind("\0")) + 1:]
        if _CODE_BEFORE.search(before):
            continue
        if _PHONE_WORDS.search(before):
            yield Finding("phone", start, start + len(candidate), 0.9)
        elif not _NOT_PHONE_LABEL.search(before):
            yield Finding("phone", start, start + len(candidate), 0.8)


# ---- detect and redact ---------------------------------------------------------------------------


def detect(text: str, categories: frozenset[str] | None = None) -> tuple[Finding, ...]:
    """The secrets and PII in `text` (all CATEGORIES when `categories` is None), sorted by start;
    of overlapping candidates only the most specific category is kept."""
    if categories is None:
        categories = frozenset(CATEGORIES)
    elif not categories <= _CATEGORY_TO_RANK.keys():
        raise ValueError(f"categories: unknown {sorted(categories - _CATEGORY_TO_RANK.keys())}, "
                         f"known are {CATEGORIES}")
    candidates: list[Finding] = []
    if "api_key" in categories:
        candidates += (Finding("api_key", start, end, 1.0) for start, end in find_api_keys(text))
    if categories & _NUMBER_CATEGORIES and "0" in (zeroed := zero_digits(text)):
        if categories & _CHAIN_CATEGORIES and (windows := chain_windows(text, zeroed)).joined:
            if "credit_card" in categories:
                candidates += (Finding("credit_card", start, end, 1.0) for start, end in find_cards(windows))
            if "phone" in categories:
                candidates += _find_phones(windows)
        if "iban" in categories:
            candidates += (Finding("iban", start, end, 1.0) for start, end in find_ibans(text, zeroed))
    if "email" in categories and "@" in text:
        candidates += _find_emails(text)
    if len(candidates) < 2:
        return tuple(candidates)
    # Most specific first, then the longer span; a candidate overlapping a kept one is dropped.
    # Candidates are few (one per item found), so the quadratic check is cheap.
    candidates.sort(key=lambda f: (-_CATEGORY_TO_RANK[f.category], f.start - f.end, f.start))
    kept: list[Finding] = []
    for finding in candidates:
        if all(finding.end <= k.start or k.end <= finding.start for k in kept):
            kept.append(finding)
    return tuple(sorted(kept, key=lambda f: f.start))


def redact(text: str, findings: Iterable[Finding]) -> str:
    """`text` with each finding's span replaced by "[REDACTED:<category>]". `findings` must be
    sorted by start and not overlap, as detect() returns them."""
    pieces, position = [], 0
    for finding in findings:
        if finding.start < position or finding.end > len(text):
            raise ValueError(f"findings: must be sorted, non-overlapping and inside the text, "
                             f"got {finding.category} at {finding.start}:{finding.end}")
        pieces += (text[position:finding.start], f"[REDACTED:{finding.category}]")
        position = finding.end
    pieces.append(text[position:])
    return "".join(pieces)
