"""Scanning untrusted text (tool results, retrieved passages) for injected instructions.

    finding = scan(text)        # Finding(flagged, score, categories, matches)

A rule-based scanner, fast enough to run on every tool result and passage of every call: text
is normalised first (NFKC, case folded, zero-width characters removed, Cyrillic and Greek
look-alikes mapped to Latin, leetspeak undone in a second view), then each rule that matches
adds its weight to the score once; a score of 1.0 or more flags the text. Strong signals weigh
1.0 alone (an order to ignore earlier instructions, a chat-template token, a markdown image
whose URL carries the conversation); weak ones (an imperative to send or delete, "you are
now", an "end of document" line) flag only together. Base64 runs that decode to text are
scanned too, and an instruction found there is category `encoded`.

The categories:

    instruction_override   ignore / disregard / forget the earlier instructions, new rules
    role_change            you are now ..., developer mode, act as an unrestricted model
    fake_turn              chat-template tokens, "system:" lines, forged end-of-data markers
    prompt_leak            reveal / repeat the system prompt or the text above
    tool_coercion          call a tool, send mail, transfer money, delete, run commands
    exfiltration           send the conversation or secrets out, by URL or markdown image
    addressed_to_model     text that speaks to the AI reading it ("note to AI assistants")
    covert                 do it without telling the user
    encoded                an instruction hidden in base64, rot13 or zero-width characters
    embedding_probe        the text's all-MiniLM-L6-v2 vector looks like injected text's

The probe: with `vector` (the text's unit vector from all-MiniLM-L6-v2, the server's
/v1/embeddings model, which retrieval has for every chunk anyway), a logistic regression
trained on the labelled development sets (bench/train_injection_probe.py, weights in
injection_probe.json) adds its verdict: it catches paraphrases no rule knows, at a threshold
chosen for 0.90 precision in cross-validation.

This is a screen, not a proof: a paraphrase no rule knows passes, and text about injection
that quotes a payload is flagged. Spotlighting (untrusted.py) is the defence that does not
depend on recognising the attack; the scan is what lets a caller see and drop the attempt.
The labelled set in tests/fixtures/injection/ measures it (bench/injection_bench.py).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import json
import math
import re
import unicodedata
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenway.client.injection_rules import FOREIGN, RULES

CATEGORIES = ("instruction_override", "role_change", "fake_turn", "prompt_leak", "tool_coercion", "exfiltration",
              "addressed_to_model", "covert", "encoded", "embedding_probe")
THRESHOLD = 1.0
PROBE_PATH = Path(__file__).resolve().parent / "injection_probe.json"
PROBE_MODEL = "all-minilm-l6-v2"


@dataclass(frozen=True, slots=True)
class Match:
    category: str
    rule: str
    excerpt: str  # the matched words, normalised, at most 80 characters


@dataclass(frozen=True, slots=True)
class Finding:
    score: float
    matches: tuple[Match, ...] = ()

    @property
    def flagged(self) -> bool:
        return self.score >= THRESHOLD

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(match.category for match in self.matches))


CLEAN = Finding(0.0)


_ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e\u200e\u200f]")
# Cyrillic and Greek letters that look Latin (after case folding), in words that mix them with
# Latin letters ("іgnore"); a Russian word stays Russian for the Russian rule.
_CONFUSABLES = str.maketrans("аеорсухіјѕԁԛԝꙇνοκταειρ", "aeopcyxijsdqwlvoktaeip")
_LOOKALIKE = re.compile(r"[аеорсухіјѕԁԛԝꙇνοκταειρ]")
_LATIN = re.compile(r"[a-z]")
_WORD = re.compile(r"\w+")
_LEET = str.maketrans("013457@$|!", "oieastasii")
_LEET_INSIDE = re.compile(r"[a-z][013457$|!][a-z]|[a-z]@[a-z]+\b(?!\.)")  # not an e-mail address
_BASE64 = re.compile(r"(?<![A-Za-z0-9+/=])[A-Za-z0-9+/]{24,}={0,2}(?![A-Za-z0-9+/=])")
_PERCENT = re.compile(r"%[0-9a-fA-F]{2}")
_LONG_RUN = re.compile(r"[A-Za-z0-9+/]{24}")  # where a base64 run could be
_SPACED_HINT = re.compile(r"(?:\b\w \w \w \w )")  # where spaced-out letters could be
_CODE = re.compile(r"```.*?```|`[^`\n]+`|\{%.*?%\}|\{\{.*?\}\}", re.DOTALL)
_TAG_CHARS = re.compile("[\U000E0020-\U000E007E]+")
_SPACED = re.compile(r"(?<!\S)\w (?=\w(?: |$))")
_SPACED_GAP = re.compile(r"(?<=\S) (?=\S)")
_REVERSE_HINT = re.compile(r"\brevers(?:e|ed)\b|\bbackwards?\b|\bright\s+to\s+left\b")
_ROT13_HINT = re.compile(r"\brot-?13\b|\bcaesar\b|\brot\s*13\b")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_BLANKS = re.compile(r"[ \t\r\f\v]{2,}|[\t\r\f\v]")


def normalise(text: str) -> str:
    """NFKC, case folded, zero-width characters out, look-alike letters Latin, blanks single."""
    if _NON_ASCII.search(text):
        text = _ZERO_WIDTH.sub("", unicodedata.normalize("NFKC", text)).casefold()
        if _LOOKALIKE.search(text):
            text = _WORD.sub(_latin_if_mixed, text)
    else:
        text = text.lower()
    return _BLANKS.sub(" ", text)


def _latin_if_mixed(word: re.Match[str]) -> str:
    text = word.group(0)
    return text.translate(_CONFUSABLES) if _LATIN.search(text) and _LOOKALIKE.search(text) else text


def scan(text: str, vector: Sequence[float] | None = None) -> Finding:
    """What in `text` looks like instructions to the model reading it. `vector`: the text's
    all-MiniLM-L6-v2 unit vector, for the embedding probe (none: the rules alone)."""
    matches = _match(normalise(text))
    extra: list[Match] = []
    if _NON_ASCII.search(text) and _letters_split(text):
        extra.append(Match("encoded", "zero_width", "zero-width characters inside words"))
    for decoded, how in _decoded_views(text):
        inner = _match(normalise(decoded))
        if any(m.category != "fake_turn" for m in inner):
            extra.append(Match("encoded", how, inner[0].excerpt))
            matches = matches + inner
    if vector is not None and (probability := probe_probability(vector)) >= _probe()[2]:
        extra.append(Match("embedding_probe", "embedding_probe", f"p={probability:.2f}"))
    if not matches and not extra:
        return CLEAN
    found = matches + extra
    score = sum(_WEIGHT[m.rule] for m in dict((m.rule, m) for m in found).values())
    return Finding(round(score, 2), tuple(found))


def probe_probability(vector: Sequence[float]) -> float:
    """The probe's probability that the text of this all-MiniLM-L6-v2 vector is injected."""
    weights, bias, _ = _probe()
    if len(vector) != len(weights):
        raise ValueError(f"vector: the probe reads {len(weights)}-dimensional {PROBE_MODEL} vectors, "
                         f"got {len(vector)} dimensions")
    logit = bias + sum(w * v for w, v in zip(weights, vector))
    return 1.0 / (1.0 + math.exp(-max(min(logit, 60.0), -60.0)))


@functools.cache
def _probe() -> tuple[tuple[float, ...], float, float]:
    spec = json.loads(PROBE_PATH.read_text())
    return tuple(spec["weights"]), float(spec["bias"]), float(spec["threshold"])


def _match(text: str) -> list[Match]:
    words = set(_WORD.findall(text))
    leet = text.translate(_LEET) if _has_leet(text) else None  # the same length: positions hold in both
    if leet is not None:
        words.update(_WORD.findall(leet))
    long = len(text) > 2 * _WINDOW
    positions = _word_positions(text, leet) if long else {}
    found = []
    for rule in _ALL_RULES:
        triggered = not rule.words.isdisjoint(words) or any(sub in text for sub in rule.substrings)
        if not triggered and (rule.words or rule.substrings):
            continue
        if not long or not (rule.words or rule.substrings):
            windows = [(0, len(text))]
        else:  # a match holds one of its words: search only near them
            starts = [start for word in rule.words & words for start in positions.get(word, ())]
            starts += [start for sub in rule.substrings for start in _find_all(text, sub)]
            windows = _merge(starts, len(text))
        hit = _search_windows(rule.pattern, text, windows)
        if hit is None and leet is not None and rule.category in _LEET_CATEGORIES:
            hit = _search_windows(rule.pattern, leet, windows)
        if hit is None:
            continue
        name = rule.name
        if rule.category == "fake_turn" and _CODE.search(text) and _search(rule.pattern, _CODE.sub(" ", text)) is None:
            name += "_in_code"  # only inside code: a chat template or its docs, shown rather than spoken
        found.append(Match(rule.category, name, hit.group(0)[:80]))
    return found


_WINDOW = 400  # characters each side of a trigger word: longer than any rule's match


def _word_positions(text: str, leet: str | None) -> dict[str, list[int]]:
    positions: dict[str, list[int]] = {}
    for view in (text, leet) if leet is not None else (text,):
        for word in _WORD.finditer(view):
            if word.group(0) in _TRIGGER_WORDS:
                positions.setdefault(word.group(0), []).append(word.start())
    return positions


def _find_all(text: str, sub: str) -> list[int]:
    starts, start = [], text.find(sub)
    while start >= 0:
        starts.append(start)
        start = text.find(sub, start + 1)
    return starts


def _merge(starts: list[int], length: int) -> list[tuple[int, int]]:
    windows: list[tuple[int, int]] = []
    for start in sorted(starts):
        low, high = max(0, start - _WINDOW), min(length, start + _WINDOW)
        if windows and low <= windows[-1][1]:
            windows[-1] = (windows[-1][0], max(windows[-1][1], high))
        else:
            windows.append((low, high))
    return windows


def _search_windows(pattern: re.Pattern[str], text: str, windows: list[tuple[int, int]]) -> re.Match[str] | None:
    for low, high in windows:
        if (hit := _search(pattern, text, low, high)) is not None:
            return hit
    return None


def _search(pattern: re.Pattern[str], text: str, low: int = 0, high: int | None = None) -> re.Match[str] | None:
    """The first match that starts a word (or starts with a sign): the `\\b` rule() took out."""
    position, high = low, len(text) if high is None else high
    while (hit := pattern.search(text, position, high)) is not None:
        start = hit.start()
        if start == 0 or not _is_word_char(text[start]) or not _is_word_char(text[start - 1]):
            return hit
        position = start + 1
    return None


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


def _decoded_views(text: str) -> list[tuple[str, str]]:
    """Base64 runs that decode to mostly printable text, the rot13 of a text that names it, and a
    text with many %XX escapes, unquoted."""
    views: list[tuple[str, str]] = []
    folded = text.casefold()
    rot13, reversed_ = _ROT13_HINT.search(folded), _REVERSE_HINT.search(folded)
    if text.isascii() and "%" not in text and not _LONG_RUN.search(text) and not _SPACED_HINT.search(text) \
            and not rot13 and not reversed_:
        return views  # nothing here could be a view: most text
    for run in _BASE64.findall(text):
        try:
            raw = base64.b64decode(run + "=" * (-len(run) % 4), validate=False)
        except (binascii.Error, ValueError):
            continue
        decoded = raw.decode("utf-8", errors="ignore")
        if len(decoded) >= 12 and sum(ch.isprintable() or ch.isspace() for ch in decoded) >= 0.9 * len(decoded) \
                and sum(ch.isalpha() or ch == " " for ch in decoded) >= 0.7 * len(decoded):
            views.append((decoded, "base64"))
    if rot13:
        views.append((codecs.decode(text, "rot13"), "rot13"))
    if len(_PERCENT.findall(text)) >= 8:
        views.append((urllib.parse.unquote(text), "url_encoded"))
    if _TAG_CHARS.search(text):  # "ASCII smuggling": Unicode tag characters spell ASCII unseen
        views.append(("".join(chr(ord(ch) - 0xE0000) for ch in "".join(_TAG_CHARS.findall(text))), "unicode_tags"))
    if len(_SPACED.findall(text)) >= 12:  # s p a c e d   o u t   letters
        views.append((_SPACED_GAP.sub("", text).replace("  ", " "), "spaced"))
    if reversed_:
        views.append(("\n".join(line[::-1] for line in text.splitlines()), "reversed"))
    return views


def _letters_split(text: str) -> bool:
    """Zero-width characters between letters: a word hidden from a word filter."""
    return re.search(r"\w[\u200b\u200c\u200d\u2060\ufeff\u00ad]+\w", text) is not None


def _has_leet(text: str) -> bool:
    return _LEET_INSIDE.search(text) is not None


_ALL_RULES = RULES + FOREIGN
_WEIGHT = {rule.name: rule.weight for rule in _ALL_RULES} | {
    f"{rule.name}_in_code": rule.weight / 2 for rule in _ALL_RULES if rule.category == "fake_turn"} | {
    "zero_width": 0.5, "base64": 1.0, "rot13": 1.0, "url_encoded": 1.0, "unicode_tags": 1.0, "spaced": 1.0,
    "reversed": 1.0, "embedding_probe": 1.0}
_LEET_CATEGORIES = frozenset({"instruction_override", "role_change", "prompt_leak"})
_TRIGGER_WORDS = frozenset(word for rule in _ALL_RULES for word in rule.words)
