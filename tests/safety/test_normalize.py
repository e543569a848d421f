"""The normalized view the input screen matches and its map back to the original text: what is
folded, and that every span of the view maps to the original characters it came from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenway.safety.normalize import JoinedView, normalize


@pytest.mark.parametrize("text, view", [
    ("card ４１１１\u00a0１１１１", "card 4111 1111"),  # fullwidth digits, NBSP
    ("٤١١١-۴۱۱۱-४१११-৪১১১", "4111-4111-4111-4111"),  # Arabic-Indic, Persian, Devanagari, Bengali
    ("𝟒𝟏𝟏𝟏 ๔๑๑๑", "4111 4111"),  # mathematical bold, Thai
    ("4\u200d1\u200b1\u00ad1\ufeff1\u2060", "41111"),  # ZWJ, ZWSP, soft hyphen, BOM, word joiner
    ("4\u03011\u03361\ufe0f1", "4111"),  # combining marks after digits
    ("4111\u20111111\u20131111\u22121111", "4111-1111-1111-1111"),  # non-breaking hyphen, en dash, minus
    ("\u0455k-pr\u03bfj \uff53\uff4b\uff0d", "sk-proj sk-"),  # Cyrillic dze, Greek omicron, fullwidth
    ("a\r\nb\x0bc\u2028d\x07e", "a\nb\nc\nde"),  # CR dropped, VT and LS are line breaks, BEL dropped
    ("caf\u00e9 \ufb01le \u2026", "cafe file ..."),  # accents off, ligature, ellipsis
])
def test_folds(text, view):
    assert normalize(text).text == view


def test_plain_text_is_its_own_view_without_a_map():
    text = "Plain ASCII prose with numbers 4111 and tabs\tand lines\n."
    normalized = normalize(text)
    assert normalized.text is text and normalized.original is None
    assert normalized.original_span(5, 10) == (5, 10)


def test_marks_go_from_every_script_and_the_map_skips_them():
    # Devanagari vowel signs and viramas are combining marks too: they match no ASCII pattern.
    text = "नमस्ते ४२४२"
    normalized = normalize(text)
    assert normalized.text == "नमसत 4242"
    start = normalized.text.index("4")
    assert text[slice(*normalized.original_span(start, start + 4))] == "४२४२"
    assert text[slice(*normalized.original_span(0, 4))] == "नमस्त"


def test_a_span_of_the_view_maps_to_exactly_the_original_characters():
    text = "x \u0455k-\u200dpr\u043ej-Ab3\ufb01 ４１\u00ad１１ y"
    normalized = normalize(text)
    assert normalized.text == "x sk-proj-Ab3fi 4111 y"
    start = normalized.text.index("sk-")
    assert text[slice(*normalized.original_span(start, start + 13))] == "\u0455k-\u200dpr\u043ej-Ab3\ufb01"
    start = normalized.text.index("4111")
    assert text[slice(*normalized.original_span(start, start + 4))] == "４１\u00ad１１"
    fi = normalized.text.index("fi")  # either half of a ligature is the whole ligature
    ligature = text.index("\ufb01")
    assert normalized.original_span(fi, fi + 1) == normalized.original_span(fi + 1, fi + 2) == (ligature, ligature + 1)


TRICKY = st.sampled_from(["a", "Z", "4", " ", "\n", "\u00a0", "\u200d", "\u00ad", "\u0301", "\ufb01", "\u2026", "٤",
                          "\uff14", "\u0455", "\r", "\x07", "é", "न", "्", "\u3000"])


@settings(max_examples=300, deadline=None)
@given(st.lists(TRICKY, max_size=24).map("".join))
def test_every_view_span_comes_from_its_original_span(text):
    normalized = normalize(text)
    view = normalized.text
    for start in range(len(view)):
        for end in range(start + 1, len(view) + 1):
            original_start, original_end = normalized.original_span(start, end)
            assert 0 <= original_start < original_end <= len(text)
            assert view[start:end] in normalize(text[original_start:original_end]).text


def test_joined_view_flows_messages_and_isolates_fields():
    view = JoinedView.of(["name_field", "4111 1111", "１１１１ 1111", "id"], [False, True, True, False])
    assert view.text == "4111 1111\n1111 1111\0name_field\0id"
    start = view.text.index("1111\n1111")
    assert list(view.pieces(start, start + 9)) == [(1, 5, 9), (2, 0, 4)]
    assert list(view.pieces(view.text.index("id"), len(view.text))) == [(3, 0, 2)]
