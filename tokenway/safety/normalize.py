"""The text the input screen matches: a normalized view of what a request carries, with the
map back to the original, so a finding in the view redacts exactly the characters it covers.

    normalize(text) -> NormalizedText(text=view)    .original_span(start, end) -> (start, end)

The view folds what a reader (and a model) sees past, per character:
  compatibility forms   NFKD: fullwidth "４１１１" -> "4111", "ｓｋ－" -> "sk-", ligatures, circled
                        and mathematical letters and digits; accents off ("é" -> "e")
  digits of any script  unicodedata.decimal: Arabic-Indic "٤", Devanagari "४", Bengali ... -> "4"
  invisible characters  format characters (Cf: ZWJ, ZWSP, soft hyphen, BOM, bidi and tag
                        characters), combining marks (Mn, Me) and control characters other than
                        tab and newline are dropped (the patterns are ASCII: a mark on a Hindi
                        letter matters no more to them than one on a digit)
  separators            every space (Zs: NBSP, thin, ideographic ...) -> " "; line and paragraph
                        separators, VT, FF, NEL -> "\\n"; dashes (Pd: U+2010-2015 with the
                        non-breaking hyphen U+2011, minus U+2212 ...) -> "-"
  confusables           Cyrillic and Greek letters that look like Latin ones ("ѕ", "а", "ο") ->
                        those Latin letters, so a key's prefix cannot hide behind them

Folding is per character, one str.translate pass (C speed), so the map is exact: each view
character comes from one original character (a character folded into several, "ﬁ" -> "fi",
maps each of them to it). The map is made only when a finding needs it, from the characters
that fold into other than one. Text that is ASCII without control characters, nearly every
request, is its own view: no copy at all.
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
    """A text's view (`text`) and the original it folds (None: the view is the original)."""

    text: str
    original: str | None = None

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The original characters view[start:end] comes from (start < end)."""
        if self.original is None:
            return start, end
        # The view in segments: one starts after each original character that folds into other
        # than one (dropped, or several); segment i starts at view offset norm_starts[i] and
        # original offset orig_starts[i], one view character per original one unless folded[i]
        # (one original character become several).
        norm_starts, orig_starts, folded = [0], [0], [False]
        num_chars = 0  # the view's characters before the current original one
        position = 0
        for match in _FOLDING.length_changing.finditer(self.original):
            num_chars += match.start() - position
            replacement = _FOLDING.table[ord(match.group())]
            if replacement:
                norm_starts.append(num_chars)
                orig_starts.append(match.start())
                folded.append(True)
                num_chars += len(replacement)
            position = match.end()
            norm_starts.append(num_chars)
            orig_starts.append(position)
            folded.append(False)
        i = bisect.bisect_right(norm_starts, start) - 1
        original_start = orig_starts[i] + (0 if folded[i] else start - norm_starts[i])
        j = bisect.bisect_right(norm_starts, end - 1) - 1
        original_end = orig_starts[j] + (1 if folded[j] else end - norm_starts[j])
        return original_start, original_end


@dataclass(frozen=True, slots=True)
class _Folding:
    table: dict[int, str]  # code point -> its fold, for every character that changes
    length_changing: re.Pattern[str]  # a character that folds into other than one


def _fold_char(ch: str, category: str) -> str:
    if category in ("Cf", "Cc", "Mn", "Me"):
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
    table: dict[int, str] = {}
    for low, high in _SCANNED_RANGES:
        for code in range(low, high + 1):
            ch = chr(code)
            category = unicodedata.category(ch)
            if category in ("Cn", "Co", "Cs"):
                continue
            folded = _fold_char(ch, category)
            if folded == ch:
                folded = "".join(_fold_char(part, unicodedata.category(part))
                                 for part in unicodedata.normalize("NFKD", ch))
            if folded != ch:
                table[code] = folded
    for code in (*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F):  # ASCII controls but tab and newline
        table[code] = _fold_char(chr(code), "Cc")
    length_changing = [code for code, folded in table.items() if len(folded) != 1]
    return _Folding(table, re.compile(f"[{_char_class(length_changing)}]"))


def _char_class(codes: list[int]) -> str:
    """A regex character class body for the given code points, as ranges."""
    ranges: list[list[int]] = []
    for code in sorted(codes):
        if ranges and code == ranges[-1][1] + 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    return "".join(re.escape(chr(low)) if low == high else f"{re.escape(chr(low))}-{re.escape(chr(high))}"
                   for low, high in ranges)


_FOLDING = _build_folding()
_PLAIN_ASCII = bytes(range(0x20, 0x7F)) + b"\t\n"  # bytes.translate drops these: 4 us, a regex 30
_PLAIN_ASCII_AND_NUL = _PLAIN_ASCII + b"\0"


def is_plain(text: str) -> bool:
    """Whether `text` is its own view: ASCII, no control character but tab and newline."""
    return text.isascii() and not text.encode().translate(None, _PLAIN_ASCII)


def normalize(text: str) -> NormalizedText:
    """`text`'s view for matching, with the map back (module docstring)."""
    if is_plain(text):
        return NormalizedText(text)
    return NormalizedText(text.translate(_FOLDING.table), text)


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
        parts = [texts[i] for i in order]
        text = _join(parts, num_flowing)
        views = None
        # One look at the whole request: plain ASCII (the NULs are the joins') is its own view.
        num_joins = len(parts) - max(num_flowing, 1) if parts else 0
        if (not text.isascii() or text.count("\0") != num_joins
                or text.encode().translate(None, _PLAIN_ASCII_AND_NUL)):  # a control character is left
            views = tuple(map(normalize, texts))
            parts = [views[i].text for i in order]
            text = _join(parts, num_flowing)
        starts, ends, position = [], [], 0
        for part in parts:
            starts.append(position)
            position += len(part)
            ends.append(position)
            position += 1  # the "\n" or "\0" after it
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


def _join(parts: list[str], num_flowing: int) -> str:
    """The flowing parts (the first num_flowing) joined by line breaks, then the others by NULs."""
    if num_flowing == len(parts):
        return "\n".join(parts)
    if not num_flowing:
        return "\0".join(parts)
    return "\0".join(["\n".join(parts[:num_flowing]), *parts[num_flowing:]])
