"""The text the input screen matches: a normalized view of what a request carries, with the
map back to the original, so a finding in the view redacts exactly the characters it covers.

    normalize(text) -> NormalizedText(text=view)    .original_span(start, end) -> (start, end)

The view folds what a reader (and a model) sees past, per character:
  compatibility forms   NFKD: fullwidth "４１１１" -> "4111", "ｓｋ－" -> "sk-", ligatures, circled
                        and mathematical letters and digits; accents off ("é" -> "e")
  digits of any script  unicodedata.decimal: Arabic-Indic "٤", Devanagari "४", Bengali ... -> "4"
  invisible characters  format characters (Cf: ZWJ, ZWSP, soft hyphen, BOM, bidi and tag
                        characters) and control characters other than tab and newline are
                        dropped; combining marks (Mn, Me) are dropped after a Latin letter or a
                        digit, where they only decorate it
  separators            every space (Zs: NBSP, thin, ideographic ...) -> " "; line and paragraph
                        separators, VT, FF, NEL -> "\\n"; dashes (Pd: U+2010-2015 with the
                        non-breaking hyphen U+2011, minus U+2212 ...) -> "-"
  confusables           Cyrillic and Greek letters that look like Latin ones ("ѕ", "а", "ο") ->
                        those Latin letters, so a key's prefix cannot hide behind them

Folding is per character, so the map is exact: each view character comes from one original
character (a character folded into several, "ﬁ" -> "fi", maps each of them to it). Text that
is ASCII without control characters, nearly every request, is its own view: no copy, no map.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

# Cyrillic and Greek letters drawn like Latin ones (Unicode's confusables.txt, the ones that
# matter for ASCII keys and codes).
_CONFUSABLE_TO_LATIN = {
    **dict(zip("аеорсухѕіјԁһӏԛԝвкмнтАВЕКМНОРСТУХЅІЈԚԜ", "aeopcyxsijdhlqwbkmhtABEKMHOPCTYXSIJQW")),
    **dict(zip("αοριυνκχτεΑΒΕΖΗΙΚΜΝΟΡΤΥΧ", "aopiuvkxteABEZHIKMNOPTYX")),
}
# Dashes that are not category Pd.
_OTHER_DASHES = "\u2212\u2043\u02d7\ufe63\u2796"
# The code points looked at for folds: the BMP and plane 1 (mathematical letters and digits,
# other scripts' digits), tags and variation selectors, but not the blocks where none folds
# (CJK ideographs, Hangul syllables, surrogates, private use): the build takes half as long.
_SCANNED_RANGES = ((0x80, 0x33FF), (0x4DC0, 0x4DFF), (0xA000, 0xABFF), (0xD7A4, 0xD7FF), (0xF900, 0x1FFFF),
                   (0xE0000, 0xE01EF))


@dataclass(frozen=True, slots=True)
class NormalizedText:
    """A text's view (`text`) and, where it differs, the map back: the view is cut into segments
    at each original character that became more or fewer than one; segment i starts at view
    offset norm_starts[i] and original offset orig_starts[i], and is aligned (one view character
    per original character) unless folded[i] (one original character that became several)."""

    text: str
    norm_starts: tuple[int, ...] = ()  # empty: the view is the original
    orig_starts: tuple[int, ...] = ()
    folded: tuple[bool, ...] = ()

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The original characters view[start:end] comes from (start < end)."""
        if not self.norm_starts:
            return start, end
        i = bisect.bisect_right(self.norm_starts, start) - 1
        original_start = self.orig_starts[i] + (0 if self.folded[i] else start - self.norm_starts[i])
        j = bisect.bisect_right(self.norm_starts, end - 1) - 1
        original_end = self.orig_starts[j] + (1 if self.folded[j] else end - self.norm_starts[j])
        return original_start, original_end


@dataclass(frozen=True, slots=True)
class _Folding:
    """The fold of every character that changes: one-for-one ones by str.translate, the others
    (dropped, or folded into several) one at a time."""

    one_to_one: dict[int, str]
    other: dict[int, str]
    changes: re.Pattern[str]  # a character of `other`, or marks after a Latin letter or digit


def _fold_char(ch: str, category: str) -> str:
    if category in ("Cf", "Cc"):
        return ch if ch in "\t\n" else "\n" if ch in "\x0b\x0c\x85" else ""
    if category in ("Zl", "Zp"):
        return "\n"
    if category == "Zs":
        return " "
    if category == "Pd" or ch in _OTHER_DASHES:
        return "-"
    if category == "Nd":
        return str(unicodedata.decimal(ch))
    if ch in _CONFUSABLE_TO_LATIN:
        return _CONFUSABLE_TO_LATIN[ch]
    return ch


def _build_folding() -> _Folding:
    one_to_one: dict[int, str] = {}
    other: dict[int, str] = {}
    marks: list[str] = []
    for low, high in _SCANNED_RANGES:
        for code in range(low, high + 1):
            ch = chr(code)
            category = unicodedata.category(ch)
            if category in ("Cn", "Co", "Cs"):
                continue
            if category in ("Mn", "Me"):
                marks.append(ch)
                continue
            folded = _fold_char(ch, category)
            if folded == ch:
                decomposed = unicodedata.normalize("NFKD", ch)
                folded = "".join(_fold_char(part, unicodedata.category(part)) for part in decomposed
                                 if unicodedata.category(part) not in ("Mn", "Me"))
            if folded != ch:
                (one_to_one if len(folded) == 1 else other)[code] = folded
    for code in (*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F):  # ASCII controls but tab and newline
        folded = _fold_char(chr(code), "Cc")
        (one_to_one if len(folded) == 1 else other)[code] = folded
    # Marks are dropped after what is (or becomes) ASCII or is dropped itself ("4", ZWJ, U+0301),
    # and at the start, where they decorate the end of the text before (a card split after "4").
    after = [code for code, folded in (*one_to_one.items(), *other.items()) if folded.isascii()]
    changes = re.compile(f"[{_char_class(other)}]|(?:^|(?<=[\\x00-\\x7f{_char_class(after)}]))"
                         f"[{_char_class(marks)}]+")
    return _Folding(one_to_one, other, changes)


def _char_class(chars) -> str:
    """A regex character class body for the given characters (or code points), as ranges."""
    codes = sorted(ord(ch) if isinstance(ch, str) else ch for ch in chars)
    ranges: list[list[int]] = []
    for code in codes:
        if ranges and code == ranges[-1][1] + 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    return "".join(re.escape(chr(low)) if low == high else f"{re.escape(chr(low))}-{re.escape(chr(high))}"
                   for low, high in ranges)


_FOLDING = _build_folding()
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def is_plain(text: str) -> bool:
    """Whether `text` is its own view: ASCII, no control character but tab and newline."""
    return text.isascii() and _ASCII_CONTROL.search(text) is None


def normalize(text: str) -> NormalizedText:
    """`text`'s view for matching, with the map back (module docstring)."""
    if is_plain(text):
        return NormalizedText(text)
    folding = _FOLDING
    pieces: list[str] = []
    norm_starts, orig_starts, folded = [0], [0], [False]
    position = num_chars = 0
    for match in folding.changes.finditer(text):
        aligned = text[position:match.start()].translate(folding.one_to_one)
        pieces.append(aligned)
        num_chars += len(aligned)
        if match.end() - match.start() == 1 and (replacement := folding.other.get(ord(match.group()))):
            pieces.append(replacement)
            if len(replacement) > 1:
                norm_starts.append(num_chars), orig_starts.append(match.start()), folded.append(True)
            num_chars += len(replacement)
        position = match.end()  # what follows starts an aligned segment
        norm_starts.append(num_chars), orig_starts.append(position), folded.append(False)
    if len(norm_starts) == 1:  # one-for-one folds only: the offsets are the original's
        return NormalizedText(text.translate(folding.one_to_one))
    pieces.append(text[position:].translate(folding.one_to_one))
    return NormalizedText("".join(pieces), tuple(norm_starts), tuple(orig_starts), tuple(folded))


@dataclass(frozen=True, slots=True)
class JoinedView:
    """Many texts' views in one string, for one detect() pass over a whole request: the texts
    that flow (a conversation's messages, in order) joined by line breaks, which a card, an IBAN
    or a key may run across (detectors.py), then the others, each after a NUL, which nothing
    runs across. NUL is dropped from every view, so it only ever stands between texts."""

    text: str
    order: tuple[int, ...]  # the texts' indices, in the order they are in `text`
    starts: tuple[int, ...]  # where each of them starts in `text`
    ends: tuple[int, ...]
    views: tuple[NormalizedText, ...] | None  # by text index; None: every text is its own view

    @classmethod
    def of(cls, texts: list[str], flows: list[bool]) -> JoinedView:
        order = tuple([i for i, flow in enumerate(flows) if flow] + [i for i, flow in enumerate(flows) if not flow])
        num_flowing = sum(flows)
        views = None
        parts = [texts[i] for i in order]
        if not all(map(is_plain, parts)):
            views = tuple(normalize(text) for text in texts)
            parts = [views[i].text for i in order]
        starts, ends, position = [], [], 0
        for k, part in enumerate(parts):
            if k:
                position += 1  # the "\n" or "\0" before it
            starts.append(position)
            position += len(part)
            ends.append(position)
        text = "\n".join(parts[:num_flowing])
        if num_flowing < len(parts):
            text = "\0".join([text, *parts[num_flowing:]]) if num_flowing else "\0".join(parts)
        return cls(text, order, tuple(starts), tuple(ends), views)

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """The pieces of text[start:end] in the texts it covers: (text index, start, end) in
        that text's original characters."""
        k = bisect.bisect_right(self.starts, start) - 1
        while k < len(self.order) and self.starts[k] < end:
            offset = self.starts[k]
            local_start, local_end = max(start, offset) - offset, min(end, self.ends[k]) - offset
            if local_start < local_end:
                index = self.order[k]
                if self.views is None:
                    yield index, local_start, local_end
                else:
                    yield index, *self.views[index].original_span(local_start, local_end)
            k += 1
