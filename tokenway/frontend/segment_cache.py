"""Encoding a chat prompt piece by piece, remembering the pieces: a conversation's earlier turns
cost a dict lookup the next time it is counted or sent.

A fast tokenizer cuts its input at added tokens (<|im_start|>, <|im_end|>, ...) before it
normalizes or pre-tokenizes anything, so a rendered chat prompt's ids are the ids of each text
piece between added tokens, joined with the added tokens' own ids. SegmentCache encodes each
piece once. That holds only where added tokens are hard boundaries: none strips the whitespace
beside it (lstrip/rstrip), matches whole words only, or is matched after a normalizer; and
the pre-tokenizer treats every piece alike (a Metaspace with prepend_scheme "first" gives the
first piece a space the others do not get). `SegmentCache.for_tokenizer` checks the
flags and then compares piecewise and whole encodings on probe texts; where anything differs it
returns None and the caller encodes whole texts as before.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from typing import Any

_PROBES = ("Hello{0}user\nWhat is 2+2?{1}\n{0}assistant\n 4, and  spaces{1}",
           "{0}{1}x{0} leading space\n\n\tand tabs{1}{1}end",
           "naïve café{0}日本語のテキスト{1}🙂 emoji {0}\n")


class SegmentCache:
    def __init__(self, encode: Callable[[str], list[int]], added: dict[str, int], max_chars: int = 4_000_000) -> None:
        self._encode = encode  # a text without added tokens -> its ids
        self._added = added  # added token text -> id
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._ids: dict[str, array] = {}  # piece -> its ids, 4 bytes each
        self.max_chars = max_chars  # of the pieces remembered; past it the cache starts again
        self._num_chars = 0
        self.num_hits = 0
        self.num_misses = 0

    @classmethod
    def for_tokenizer(cls, hf: Any, encode: Callable[[str], list[int]],
                      max_chars: int = 4_000_000) -> SegmentCache | None:
        tokens = hf.get_added_tokens_decoder().values()
        if not tokens or any(t.lstrip or t.rstrip or t.single_word or (t.normalized and hf.normalizer is not None)
                             for t in tokens):
            return None
        added = {t.content: hf.token_to_id(t.content) for t in tokens}
        cache = cls(encode, added, max_chars)
        specials = sorted(added, key=len, reverse=True)
        for probe in _PROBES:
            text = probe.format(specials[0], specials[-1])
            if cache.encode(text) != hf.encode(text, add_special_tokens=False).ids:
                return None
        cache._ids.clear()
        cache._num_chars = 0
        return cache

    def encode(self, text: str) -> list[int]:
        """The ids of `text` as hf.encode(text, add_special_tokens=False) gives them."""
        ids: list[int] = []
        for position, piece in enumerate(self._split.split(text)):
            if position % 2:  # re.split puts the separators (added tokens) at odd positions
                ids.append(self._added[piece])
            elif piece:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> array:
        cached = self._ids.get(piece)
        if cached is not None:
            self.num_hits += 1
            return cached
        self.num_misses += 1
        cached = array("I", self._encode(piece))
        if self._num_chars + len(piece) > self.max_chars:
            self._ids.clear()  # simple and bounded: a conversation's pieces come back on its next call
            self._num_chars = 0
        if len(piece) <= self.max_chars:
            self._ids[piece] = cached
            self._num_chars += len(piece)
        return cached
