"""Where API keys, tokens and private keys are in a text (detectors.py runs this).

    find_api_keys(text) -> (start, end) ...   each known key format, a JWT, a PEM private key

A key is found by its literal prefix ("sk-proj-", "AKIA", "ghp_" ...) and the rest of its
format. It may be broken by blanks or line breaks (a key split across two messages or wrapped)
or by one separator between pieces of any size ("AKIA.Z7Q2.M9VB...", "AKIA-Z7Q2-...": any
character but a letter, a digit or NUL, blanks around it allowed; a "-" or "_" the format has
no room for is dropped): its pieces are joined while they make no key yet, and after that up to
the first that reads as a word, so prose after a key stays out of it; a key that needed pieces
reading as words, or pieces of one or two characters, must look random as a whole, so prose
after a prefix makes no key. "sk-" (OpenAI's and Anthropic's keys) may be broken inside its
prefix too ("s k-proj-..."); the other prefixes must be whole.

A key may be glued to the word before it ("keysk-proj-...", "x_AKIA..."), and a key of a fixed
length (AWS, Google, tokenway) to the one after it, when it looks random as a whole; glued
after a run of more than 24 key characters, a prefix is part of a longer token (base64url
holds "sk-" once in about 260,000 characters), not a key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_KEY_CHARS = "A-Za-z0-9_-"
# (literal prefix, rest of the pattern). The prefix starts each regex, so the regex engine jumps
# from one occurrence to the next; the boundary before it is a lookbehind placed after it for
# the same reason.
_KEY_PREFIX_TO_REST = (
    ("sk-", r"(?:ant-|proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),  # Anthropic, OpenAI
    ("AKIA", r"[A-Z0-9]{16}"), ("ASIA", r"[A-Z0-9]{16}"),  # AWS access key id
    *((prefix, r"[A-Za-z0-9]{36,255}") for prefix in ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),  # GitHub
    ("github_pat_", r"[A-Za-z0-9_]{22,255}"),
    *((f"xox{kind}-", r"[A-Za-z0-9-]{10,}") for kind in "abprs"),  # Slack
    ("AIza", r"[A-Za-z0-9_-]{35}"),  # Google API key
    *((prefix, r"[A-Za-z0-9]{16,}") for prefix in ("sk_live_", "rk_live_", "pk_live_")),  # Stripe
    ("hf_", r"[A-Za-z0-9]{34,}"),  # Hugging Face
    ("tw-k_", r"[0-9a-f]{8}-[A-Za-z0-9_-]{43}"),  # tokenway (gateway/auth.py new_secret)
)
_PREFIX_TO_PATTERN = {
    prefix: re.compile(f"{re.escape(prefix)}(?<![{_KEY_CHARS}]{re.escape(prefix)}){rest}(?![{_KEY_CHARS}])")
    for prefix, rest in _KEY_PREFIX_TO_REST}
_BLANKS = "[ \t\n]{0,8}"
# Between two pieces of a key: blanks, or one separator with blanks around it (on its line: a
# sentence's end and the next message's start are no key's).
_PIECE_GAP = "(?:[ \t\n]{1,8}|[ \t]{0,2}[^A-Za-z0-9_\\s\0-][ \t]{0,2})"
# A word this long is prose, not a piece of a random key (base62 gives one 7 letters of a case
# about one time in 400): before a key is made, it ends the search.
_MAX_WORD_IN_KEY = 6
# The fixed-length formats, and the pattern of each without its end: a key glued to the word
# after it ends where its format does.
_FIXED_LENGTH_PREFIXES = ("AKIA", "ASIA", "AIza", "tw-k_")
_PREFIX_TO_OPEN_PATTERN = {prefix: re.compile(re.escape(prefix) + rest) for prefix, rest in _KEY_PREFIX_TO_REST
                           if prefix in _FIXED_LENGTH_PREFIXES}
_MAX_GLUED_BEFORE = 24


def _run(prefix: str) -> re.Pattern[str]:
    """A prefix and what may be its key: pieces of key characters split by gaps."""
    start = f"s{_BLANKS}k{_BLANKS}-" if prefix == "sk-" else re.escape(prefix)
    return re.compile(f"{start}[{_KEY_CHARS}]*+(?:{_PIECE_GAP}[{_KEY_CHARS}]++){{0,128}}")


# Prefixes in families, each family behind one literal search (about 5 us on 16,000 characters,
# where an `in` test per prefix would take as long each): None searches the members' own runs.
_FAMILIES = tuple(
    (None if prefilter is None else re.compile(prefilter), tuple((p, _run(p), _PREFIX_TO_PATTERN[p]) for p in prefixes))
    for prefilter, prefixes in (
        (None, ("sk-",)), ("A(?:KIA|SIA|Iza)", ("AKIA", "ASIA", "AIza")),
        ("gh[pousr]_", ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")), (None, ("github_pat_",)),
        ("xox[abprs]-", ("xoxa-", "xoxb-", "xoxp-", "xoxr-", "xoxs-")),
        ("k_live_", ("sk_live_", "rk_live_", "pk_live_")), (None, ("hf_",)), (None, ("tw-k_",))))
assert {p for _, members in _FAMILIES for p, _, _ in members} == set(_PREFIX_TO_PATTERN)
_JWT = re.compile(f"eyJ(?<![{_KEY_CHARS}]eyJ)[A-Za-z0-9_-]{{4,}}\\.eyJ[A-Za-z0-9_-]{{4,}}\\.[A-Za-z0-9_-]+"
                  f"(?![{_KEY_CHARS}])")
# The whole PEM block when its END line follows; else the header alone.
_PEM = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----"
                  r"(?:[A-Za-z0-9+/=:,\s-]{0,16384}?-----END \1PRIVATE KEY-----)?")
_KEY_PIECE = re.compile(f"[{_KEY_CHARS}]+")
_WORD_PART = re.compile(r"[-_]")
_SK_KIND = re.compile(r"^sk-(?:ant-|proj-|svcacct-|admin-)?")


def find_api_keys(text: str) -> Iterator[tuple[int, int]]:
    for prefilter, members in _FAMILIES:
        if prefilter is not None and prefilter.search(text) is None:
            continue
        for prefix, run, pattern in members:
            position = 0
            while (m := run.search(text, position)) is not None:
                num_glued = _num_key_chars_before(text, m.start())
                end = None if num_glued > _MAX_GLUED_BEFORE else _key_end(m.group(), prefix, pattern, num_glued > 0)
                if end is not None:
                    yield m.start(), m.start() + end
                position = m.start() + (end or 1)
    for m in _JWT.finditer(text):
        yield m.start(), m.end()
    if "PRIVATE KEY-----" in text:
        for m in _PEM.finditer(text):
            yield m.start(), m.end()


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
    # "-" and "_" are left out: slugs ("assessment-framework-2024-Q1") change kind at each.
    kinds = [0 if ch.islower() else 1 if ch.isupper() else 2 for ch in body if ch not in "-_"]
    return sum(a != b for a, b in zip(kinds, kinds[1:])) >= 0.3 * (len(kinds) - 1)


class _LazyWords:
    """words[i]: whether pieces[i] reads as a word, computed on first use."""

    def __init__(self, pieces: list[re.Match[str]]) -> None:
        self.pieces = pieces
        self.index_to_word: dict[int, bool] = {}

    def __getitem__(self, i: int) -> bool:
        if i not in self.index_to_word:
            self.index_to_word[i] = _is_word(self.pieces[i].group())
        return self.index_to_word[i]


def _is_chunked(piece: str) -> bool:
    """Whether `piece` is chunks of one or two characters joined by "-" or "_" ("A-b-3-d")."""
    parts = _WORD_PART.split(piece)
    return len(parts) >= 4 and all(len(part) <= 2 for part in parts)


def _num_key_chars_before(text: str, start: int) -> int:
    """How many key characters run up to text[start] (the word a prefix is glued to)."""
    i = start
    while i > 0 and (text[i - 1].isascii() and text[i - 1].isalnum() or text[i - 1] in "_-"):
        i -= 1
        if start - i > _MAX_GLUED_BEFORE:
            break
    return start - i


def _compact(key: str, prefix: str, pattern: re.Pattern[str]) -> bool:
    """Whether `key` (pieces joined) is of the format, as written or with the "-" and "_" it
    has no room for dropped (separators between its pieces)."""
    body = key[len(prefix):] if not key.startswith("sk-") else key[3:]
    head = key[:len(key) - len(body)]
    return any(pattern.fullmatch(head + candidate) for candidate in dict.fromkeys(
        (body, body.replace("-", ""), body.replace("-", "").replace("_", ""))))


def _key_end(run: str, prefix: str, pattern: re.Pattern[str], glued: bool) -> int | None:
    """Where the key `run` starts with ends (an offset in `run`), or None (module docstring).
    A word of one or two characters ("d", "Ab") that a random piece follows is a key's piece.
    `glued`: the prefix is glued to the word before it."""
    pieces = list(_KEY_PIECE.finditer(run))
    # Read as words lazily: a run holds up to 128 pieces, and the loop stops at the first few.
    words = _LazyWords(pieces)
    first = pieces[0].group()
    first_body = _SK_KIND.sub("", first) if prefix == "sk-" else first[len(prefix):]
    # A piece of one or two characters (or a first piece of such chunks joined by "-" or "_"):
    # the key must look random.
    used_short = _is_chunked(first_body)
    found, used_word, used_random = None, glued, bool(first_body) and not _is_word(first_body) or used_short
    for num_pieces in range(1, len(pieces) + 1):
        if num_pieces > 1:
            last = num_pieces - 1
            size, size_before = len(pieces[last].group()), len(pieces[last - 1].group())
            # A key written in chunks (of up to 4, or 2 characters) goes on through chunks that
            # read as words.
            chunked = size <= 2 and size_before <= 2 or size <= 4 and size_before <= 4 and last > 1
            bridge = (size <= 2 or chunked) and num_pieces < len(pieces) and not words[num_pieces]
            if words[last] and not (bridge or chunked and size <= 2):
                if found is not None or max(map(len, _WORD_PART.split(pieces[last].group()))) > _MAX_WORD_IN_KEY:
                    break
                used_word = True
            used_short = used_short or size <= 2
            used_random = used_random or not words[last] or used_short
        key = "".join(piece.group() for piece in pieces[:num_pieces])
        if not _compact(key, prefix, pattern):
            # Glued to the word after it: a fixed-length format ends inside the last piece.
            open_match = _PREFIX_TO_OPEN_PATTERN[prefix].match(key) if prefix in _PREFIX_TO_OPEN_PATTERN else None
            last_start = len(key) - len(pieces[num_pieces - 1].group())
            if (open_match is not None and last_start < open_match.end() < len(key)
                    and _looks_random(open_match.group()[len(prefix):])):
                return pieces[num_pieces - 1].start() + open_match.end() - last_start
            continue
        body = _SK_KIND.sub("", key) if prefix == "sk-" else key[len(prefix):]
        if prefix == "sk-" and not _is_mixed(body):
            continue
        if used_short and not _looks_random(body):
            continue
        if used_word and not (used_random and (prefix in ("AKIA", "ASIA") and not glued or _looks_random(body))):
            continue
        found = pieces[num_pieces - 1].end()
    return found
