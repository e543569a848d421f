"""Where API keys, tokens and private keys are in a text (detectors.py runs this).

    find_api_keys(text) -> (start, end) ...   each known key format, a JWT, a PEM private key

A key is found by its literal prefix ("sk-proj-", "AKIA", "ghp_" ...) and the rest of its
format. It may be broken by blanks or line breaks (a key split across two messages or wrapped):
its pieces are joined while they make no key yet, and after that up to the first that reads as
a word, so prose after a key stays out of it; a key that needed pieces reading as words must
also hold a random piece and look random as a whole, so prose after a prefix makes no key.
"sk-" (OpenAI's and Anthropic's keys) may be broken inside its prefix too ("s k-proj-..."); the
other prefixes must be whole.
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


def _run(prefix: str) -> re.Pattern[str]:
    """A prefix and what may be its key: pieces of key characters split by up to 8 blanks."""
    start = (f"s(?<![{_KEY_CHARS}]s){_BLANKS}k{_BLANKS}-" if prefix == "sk-"
             else f"{re.escape(prefix)}(?<![{_KEY_CHARS}]{re.escape(prefix)})")
    return re.compile(f"{start}[{_KEY_CHARS}]*(?:[ \t\n]{{1,8}}[{_KEY_CHARS}]+){{0,32}}")


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
                end = _key_end(m.group(), prefix, pattern)
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
    kinds = [0 if ch.islower() else 1 if ch.isupper() else 2 if ch.isdigit() else 3 for ch in body]
    return sum(a != b for a, b in zip(kinds, kinds[1:])) >= 0.3 * (len(body) - 1)


def _key_end(run: str, prefix: str, pattern: re.Pattern[str]) -> int | None:
    """Where the key `run` starts with ends (an offset in `run`), or None (module docstring).
    A word of one or two characters ("d", "Ab") that a random piece follows is a key's piece."""
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
