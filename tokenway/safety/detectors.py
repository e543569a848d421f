"""Built-in detectors for secrets and PII in text: where they are, never what they say.

    text -> detect(text, categories) -> tuple[Finding, ...]  (sorted by start, non-overlapping)
         -> redact(text, findings)   -> text with each span replaced by "[REDACTED:<category>]"

Each category has one finder that yields candidate Findings; detect() runs the finders whose
cheap prefilter passes (no '@': no email; no digit: no card, phone or IBAN; no key prefix: no
api_key regex), then keeps, among overlapping candidates, the most specific category
(api_key > credit_card > iban > email > phone), so a key whose digits look like a phone number
is reported once, as a key. A Finding holds only offsets, so a secret is never copied into it.

The patterns are ASCII. The input screen (screen.py) runs them on a normalized view of the
request (normalize.py: other scripts' digits, fullwidth forms, invisible characters, odd spaces
and dashes, look-alike letters folded), so what they see is what a reader sees. On that view:
  cards     groups split by a space, dash, dot or slash (blanks around it allowed) or a line
            break, one kind per number; a bare line break may cut a group (a card split across
            two texts: the screen joins a request's texts with line breaks), and a candidate
            running from one line's number into the next is tried again line by line
  IBANs     groups of any size split by a blank or a line break
  api keys  broken by blanks or line breaks: the pieces after the first are joined up to the
            first that reads as a word ("and", "Then", "2024"), so prose after a key stays out

Scores: 1.0 where the match is checked beyond its shape (Luhn and IIN range for cards, mod-97
and the country's length for IBANs) or is an exact key format; 0.95 for emails; 0.8 for phone
numbers, 0.9 when a word such as "phone" or "call" comes just before.

Deliberately not detected: obfuscated emails ("ann at example dot com"), lowercase IBANs,
plain digit runs as phone numbers ("4155550132"), card numbers whose groups are not 4-digit
led ("41 1111 1111 1111 11"), a card led by another number on its line ("ref 1234 4111 1111
1111 1111" is one 20-digit run, and trying every group as a start would multiply false
positives in lists of numbers), a key whose prefix itself is broken ("s k-proj-...").

Out of a pattern detector's reach, left to a guard model (guard.py): secrets encoded (base64,
hex, URL or JSON escapes), reversed, spelled out ("four one one one ..."), interleaved with
other text, or spread over more than two places; numbers in a JSON array split into items.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

CATEGORIES = ("api_key", "credit_card", "iban", "email", "phone")
# Higher wins when two findings overlap.
_CATEGORY_TO_RANK = {"api_key": 5, "credit_card": 4, "iban": 3, "email": 2, "phone": 1}


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


# ---- api_key -------------------------------------------------------------------------------------

_KEY_CHARS = "A-Za-z0-9_-"
# (literal prefix, rest of the pattern). The prefix is the prefilter (a `in` test, about 10 us
# on 16,000 characters) and it starts the regex, so the regex engine jumps from one occurrence
# to the next; the boundary before it is a lookbehind placed after it for the same reason.
_KEY_PREFIX_TO_REST = (
    ("sk-", r"(?:ant-|proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),  # Anthropic, OpenAI
    ("AKIA", r"[A-Z0-9]{16}"), ("ASIA", r"[A-Z0-9]{16}"),  # AWS access key id
    *((prefix, r"[A-Za-z0-9]{36,255}") for prefix in ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),  # GitHub
    ("github_pat_", r"[A-Za-z0-9_]{22,255}"),
    *((f"xox{kind}-", r"[A-Za-z0-9-]{10,}") for kind in "abprs"),  # Slack
    ("AIza", r"[A-Za-z0-9_-]{35}"),  # Google API key
    *((prefix, r"[A-Za-z0-9]{16,}") for prefix in ("sk_live_", "rk_live_", "pk_live_")),  # Stripe
    ("eyJ", r"[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]+"),  # JWT
    ("hf_", r"[A-Za-z0-9]{34,}"),  # Hugging Face
    ("tw-k_", r"[0-9a-f]{8}-[A-Za-z0-9_-]{43}"),  # tokenway (gateway/auth.py new_secret)
)
_KEY_PATTERNS = tuple(
    (prefix, re.compile(f"{re.escape(prefix)}(?<![{_KEY_CHARS}]{re.escape(prefix)}){rest}(?![{_KEY_CHARS}])"))
    for prefix, rest in _KEY_PREFIX_TO_REST)
# A prefix and what may be its key, broken by blanks or line breaks (up to 32 times): the pieces
# are joined and checked against the key's pattern in Python (_key_end). Not for JWTs, whose dots
# a piece does not hold. "sk-" (OpenAI's, Anthropic's) may be broken itself ("s k-proj-..."):
# looked for everywhere (20 us on 16,000 characters), the others where their prefix is whole.
_BLANKS = "[ \t\n]{0,8}"
_BROKEN_KEYS = tuple(
    (prefix if prefix != "sk-" else None,
     re.compile((f"{re.escape(prefix)}(?<![{_KEY_CHARS}]{re.escape(prefix)})" if prefix != "sk-"
                 else f"s(?<![{_KEY_CHARS}]s){_BLANKS}k{_BLANKS}-")
                + f"[{_KEY_CHARS}]*(?:[ \t\n]{{1,8}}[{_KEY_CHARS}]+){{0,32}}"), prefix, pattern)
    for prefix, pattern in _KEY_PATTERNS if prefix != "eyJ")
_JWT = next(pattern for prefix, pattern in _KEY_PATTERNS if prefix == "eyJ")
_KEY_PIECE = re.compile(f"[{_KEY_CHARS}]+")
_WORD_PART = re.compile(r"[-_]")
# The whole PEM block when its END line follows; else the header alone.
_PEM = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----"
                  r"(?:[A-Za-z0-9+/=:,\s-]{0,16384}?-----END \1PRIVATE KEY-----)?")
_SK_KIND = re.compile(r"^sk-(?:ant-|proj-|svcacct-|admin-)?")


def _is_mixed(body: str) -> bool:
    """"sk-" bodies are free-form; a real key is random base62, so it has digits, upper and lower
    case. This keeps hyphenated slugs ("sk-this-is-not-a-key-at-all") out."""
    return (any(ch.isdigit() for ch in body) and any(ch.isupper() for ch in body)
            and any(ch.islower() for ch in body))


def _is_word(piece: str) -> bool:
    """Whether a piece after a blank reads as prose ("and", "Then", "API", "2024", "well-known")
    rather than the rest of a random key, which nearly always mixes cases or letters and digits."""
    return all(part.isdigit() or part.isalpha() and (part.islower() or part.isupper() or part.istitle())
               for part in _WORD_PART.split(piece))


def _looks_random(body: str) -> bool:
    """Whether a key body joined from pieces that read as words is random all the same: in random
    base62, 62% of neighbours differ in kind (lower, upper, digit); in words joined ("andthen",
    "UseTheNewKey2024"), far fewer, or none."""
    kinds = [0 if ch.islower() else 1 if ch.isupper() else 2 if ch.isdigit() else 3 for ch in body]
    return sum(a != b for a, b in zip(kinds, kinds[1:])) >= 0.3 * (len(body) - 1)


def _key_end(run: str, prefix: str, pattern: re.Pattern[str]) -> int | None:
    """Where the key `run` starts with ends (an offset in `run`), or None. Its pieces (split by
    blanks) are joined while they make no key yet, and after that up to the first that reads as
    a word (or a word of one or two characters, "d" or "Ab", that a random piece follows), so
    prose after a key stays out of it. A key that needed pieces reading as words must also
    hold a random one (its first, past the prefix, may be it) and look random as a whole, so
    prose after a prefix makes no key."""
    pieces = list(_KEY_PIECE.finditer(run))
    words = [_is_word(piece.group()) for piece in pieces]
    first = pieces[0].group()
    first_body = _SK_KIND.sub("", first) if prefix == "sk-" else first[len(prefix):]
    found, used_word, used_random = None, False, bool(first_body) and not _is_word(first_body)
    for num_pieces in range(1, len(pieces) + 1):
        if num_pieces > 1:
            last = num_pieces - 1
            bridge = len(pieces[last].group()) <= 2 and num_pieces < len(pieces) and not words[num_pieces]
            if words[last] and not bridge:
                if found is not None:
                    break
                used_word = True
            used_random = used_random or not words[last]
        key = "".join(piece.group() for piece in pieces[:num_pieces])
        if not pattern.fullmatch(key):
            continue
        body = _SK_KIND.sub("", key) if prefix == "sk-" else key[len(prefix):]
        if prefix == "sk-" and not _is_mixed(body):
            continue
        if used_word and not (used_random and (prefix in ("AKIA", "ASIA") or _looks_random(body))):
            continue
        found = pieces[num_pieces - 1].end()
    return found


def _find_api_keys(text: str, windows: list[tuple[int, int]]) -> Iterator[Finding]:
    for prefilter, broken, prefix, pattern in _BROKEN_KEYS:
        if prefilter is None or prefilter in text:
            position = 0
            while (m := broken.search(text, position)) is not None:
                end = _key_end(m.group(), prefix, pattern)
                if end is not None:
                    yield Finding("api_key", m.start(), m.start() + end, 1.0)
                position = m.start() + (end or len(prefix))
    if "eyJ" in text:
        for m in _JWT.finditer(text):
            yield Finding("api_key", m.start(), m.end(), 1.0)
    if "PRIVATE KEY-----" in text:
        for m in _PEM.finditer(text):
            yield Finding("api_key", m.start(), m.end(), 1.0)


# ---- numbers: where cards, IBANs and phone numbers can be ---------------------------------------

# A card, IBAN or phone number holds a digit run; scanning the text once for runs and then
# running the three regexes only near them is what keeps a long prompt cheap. Digits are ASCII
# (re.ASCII below): the input screen hands detect() its normalized view (normalize.py), where
# every script's digits are ASCII ones.
_NUMBER_RUN = re.compile(r"[0-9][0-9 \t\n()+./-]*")
# Context a window keeps around a run: before, an IBAN's country code and a phone's "+" or "(";
# after, an IBAN's letter groups ("MALT", "MTLC AST0") and what the lookaheads read.
_MARGIN_BEFORE, _MARGIN_AFTER = 4, 12


def _number_windows(text: str) -> list[tuple[int, int]]:
    """Merged (start, end) spans around every digit run; the only places the card, IBAN and
    phone regexes look."""
    windows: list[tuple[int, int]] = []
    for m in _NUMBER_RUN.finditer(text):
        start, end = max(0, m.start() - _MARGIN_BEFORE), min(len(text), m.end() + _MARGIN_AFTER)
        if windows and start <= windows[-1][1]:
            windows[-1] = (windows[-1][0], end)
        else:
            windows.append((start, end))
    return windows


def _finditer_in(pattern: re.Pattern[str], text: str, windows: list[tuple[int, int]]) -> Iterator[re.Match[str]]:
    # Lookbehinds see the text before `start`, so a window start never decides a match either.
    for start, end in windows:
        yield from pattern.finditer(text, start, end)


# ---- credit_card ---------------------------------------------------------------------------------

# 13-19 digits, optionally in groups split by a space, a dash, a dot or a slash (with blanks
# around it) or by up to three line breaks; checked further in Python. The three kinds of gap match
# disjoint strings, so a failing candidate cannot backtrack through many ways of reading it.
_CARD_GAP = r"(?:[ \t]{0,2}(?:\n[ \t]{0,2}){1,3}|[ \t]?(?:\n[ \t]?){0,3}[./-][ \t]?(?:\n[ \t]?){0,3}|[ \t]{1,2})"
_CARD = re.compile(rf"(?<![\w.,/-])\d(?:{_CARD_GAP}?\d){{12,18}}(?![\w]|[.,/-]\d)", re.ASCII)
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


def _find_cards(text: str, windows: list[tuple[int, int]]) -> Iterator[Finding]:
    for start, end in windows:
        position = start
        while (m := _CARD.search(text, position, end)) is not None:
            candidate, position = m.group(), m.end()
            if _card_ok(candidate):
                yield Finding("credit_card", m.start(), m.end(), 1.0)
            elif "\n" in candidate:
                # A candidate across line breaks may join one text's number to the next one's
                # (a reference ending a message, a card starting the next): a card may be in
                # its first lines, else it is looked for again from its next line on.
                breaks = [i for i, ch in enumerate(candidate) if ch == "\n"]
                first_lines = (candidate[:i].rstrip(" \t\n./-") for i in reversed(breaks))
                card = next((lines for lines in first_lines if _card_ok(lines)), None)
                if card is not None:
                    yield Finding("credit_card", m.start(), m.start() + len(card), 1.0)
                    position = m.start() + len(card)
                else:
                    position = m.start() + breaks[0] + 1


# ---- iban ----------------------------------------------------------------------------------------

# Country, check digits, then 11-30 letters and digits, in groups of any size split by a blank
# or a line break; cut to the country's length in Python.
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?:[ \n]{0,2}[A-Z0-9]){11,30}(?![A-Za-z0-9])", re.ASCII)
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


def _find_ibans(text: str, windows: list[tuple[int, int]]) -> Iterator[Finding]:
    for m in _finditer_in(_IBAN, text, windows):
        length = IBAN_COUNTRY_TO_LENGTH.get(m.group()[:2])
        if length is None:
            continue
        # The regex may run on into a following word ("... 3000 AND"): cut at the country's
        # length, and only where a group ends.
        offsets = [i for i, ch in enumerate(m.group()) if ch not in " \n"]
        if len(offsets) < length:
            continue
        end = m.start() + offsets[length - 1] + 1
        if end < m.end() and text[end] not in " \n":
            continue
        if iban_ok(text[m.start():end].replace(" ", "").replace("\n", "")):
            yield Finding("iban", m.start(), end, 1.0)


# ---- email ---------------------------------------------------------------------------------------

_EMAIL_LOCAL = re.compile(r"[A-Za-z0-9._%+'-]{1,64}\Z")  # ' as in o'neil@
_EMAIL_DOMAIN = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+([A-Za-z]{2,24})(?![A-Za-z0-9-])")
# "icon@2x.png" is a file name, not an address.
_FILE_SUFFIXES = frozenset(("png", "jpg", "jpeg", "gif", "svg", "webp", "ico", "pdf", "txt", "css",
                            "js", "json", "yaml", "yml", "toml", "py", "ts", "md", "html", "zip"))


def _find_emails(text: str, windows: list[tuple[int, int]]) -> Iterator[Finding]:
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
    (?<![\w+#$/.:-])
    (?:
        \+[1-9]\d{0,2}(?:[ ]?\(0\))?(?:[ .-]?\(\d{1,4}\)|[ .-]?\d{1,6}){1,6}   # international
      | (?:1[ .-])?\([2-9]\d{2}\)[ ]?[2-9]\d{2}[ .-]\d{4}                      # US (415) 555-0132
      | (?:1([ .-]))?[2-9]\d{2}([ .-])[2-9]\d{2}\2\d{4}                         # US 415-555-0132
      | 0\d{1,4}([ .-])\d{2,8}(?:\3\d{2,4}){0,3}                                # national 020 7946 0958
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


def _find_phones(text: str, windows: list[tuple[int, int]]) -> Iterator[Finding]:
    for m in _finditer_in(_PHONE, text, windows):
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
        # On the number's line only: the screen joins a request's texts with line breaks, and a
        # word ending one message ("text.", "order #") says nothing of a number starting the next.
        before = text[max(0, m.start() - _CONTEXT_CHARS):m.start()].rpartition("\n")[2]
        if _CODE_BEFORE.search(before):
            continue
        if _PHONE_WORDS.search(before):
            yield Finding("phone", m.start(), m.end(), 0.9)
        elif not _NOT_PHONE_LABEL.search(before):
            yield Finding("phone", m.start(), m.end(), 0.8)


# ---- detect and redact ---------------------------------------------------------------------------

# Every finder takes the number windows; only cards, IBANs and phones look at them.
_CATEGORY_TO_FINDER: dict[str, Callable[[str, list[tuple[int, int]]], Iterator[Finding]]] = {
    "api_key": _find_api_keys, "credit_card": _find_cards, "iban": _find_ibans,
    "email": _find_emails, "phone": _find_phones,
}


def detect(text: str, categories: frozenset[str] | None = None) -> tuple[Finding, ...]:
    """The secrets and PII in `text` (all CATEGORIES when `categories` is None), sorted by start;
    of overlapping candidates only the most specific category is kept."""
    if categories is None:
        categories = frozenset(CATEGORIES)
    elif not categories <= _CATEGORY_TO_RANK.keys():
        raise ValueError(f"categories: unknown {sorted(categories - _CATEGORY_TO_RANK.keys())}, "
                         f"known are {CATEGORIES}")
    # Ten memchr-speed scans: text without a digit (most prose) skips the digit-run scan.
    has_digit = any(digit in text for digit in "0123456789")
    windows = _number_windows(text) if has_digit else []
    candidates = [finding for category in CATEGORIES if category in categories
                  and (category != "email" or "@" in text)
                  for finding in _CATEGORY_TO_FINDER[category](text, windows)]
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
