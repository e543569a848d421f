"""Cards and keys written the ways a pattern screen used to miss, in a plain user message under
`--safety-input block`: any one separator between digit groups (or key pieces), groups of one
to four digits, glued to letters; generated, all blocked. What keeps benign numbers out (Luhn,
length, the whole run judged, hashes) is held by the labelled set's benign lines
(test_bypass.py, test_detectors.py) and the cases below."""

from __future__ import annotations

import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.safety.test_bypass import CARDS, KEYS, openai_input, redacted, screened, user
from tokenway.safety.detectors import detect
from tokenway.safety.screen import OutputScreen, SafetyPolicy

# Every ASCII character that is not a letter, a digit or a blank, and the blanks and the other
# scripts' spaces and dashes the view folds.
BLANKS = (" ", "\t", "\u00a0", "\u2009", "\u3000")
SEPARATORS = (*string.punctuation, *BLANKS, "\u2013", "\u2011", "\u2212")
GLUE = ("", "u", "x", "card", "Nr", "ID")


def groups_of(digits: str, sizes: list[int]) -> list[str]:
    """digits cut into groups of the given sizes, cycled; the last group takes what is left."""
    groups, position, i = [], 0, 0
    while position < len(digits):
        groups.append(digits[position:position + sizes[i % len(sizes)]])
        position += sizes[i % len(sizes)]
        i += 1
    return groups


def in_message(secret: str) -> str:
    return f"My card is {secret} ok"


@pytest.mark.parametrize("written", [
    "4 5 3 9 1 4 8 8 0 3 4 3 6 4 6 7", "4-5-3-9-1-4-8-8-0-3-4-3-6-4-6-7", "45 39 14 88 03 43 64 67",
    "4539_1488_0343_6467", "4539+1488+0343+6467", "4539,1488,0343,6467", "4539:1488:0343:6467",
    "u4539148803436467x", "4539.1488.0343.6467", "4539/1488/0343/6467", "4539 | 1488 | 0343 | 6467",
    "453 914 880 343 646 7", "4539, 1488, 0343, 6467"])
def test_the_probes_cards_are_blocked_and_redacted_whole(written):
    chat = openai_input(messages=[user(in_message(written))])
    assert screened(chat).categories == ("credit_card",)
    glued_before, glued_after = written[:len(written) - len(written.lstrip(string.ascii_letters))], \
        written[len(written.rstrip(string.ascii_letters)):]  # the letters stay: only the digits go
    assert redacted(chat).messages[0]["content"] == f"My card is {glued_before}[REDACTED:credit_card]{glued_after} ok"


@st.composite
def written_cards(draw) -> str:
    digits = draw(st.sampled_from((*CARDS, "4539148803436467")))
    grouping = draw(st.sampled_from(("uniform", "mixed", "none")))
    if grouping == "uniform":
        groups = groups_of(digits, [draw(st.integers(1, 4))])
    elif grouping == "mixed":
        groups = groups_of(digits, draw(st.lists(st.integers(1, 4), min_size=1, max_size=6)))
    else:
        groups = [digits]
    separator = draw(st.sampled_from(SEPARATORS))
    if separator not in BLANKS and draw(st.booleans()):
        separator = f" {separator} "  # a blank either side (three blanks in a row end a number)
    return draw(st.sampled_from(GLUE)) + separator.join(groups) + draw(st.sampled_from(GLUE))


@settings(max_examples=600, deadline=None)
@given(written_cards())
def test_generated_cards_with_every_separator_grouping_and_glue_are_blocked(written):
    assert screened(openai_input(messages=[user(in_message(written))])).categories == ("credit_card",), written


# The prefix stays whole (but "sk-", test_bypass.py); a key of a fixed length may be glued on
# both sides, the others before only (after, the glue would read as the key's own characters).
FIXED_LENGTH = ("AKIA", "tw-k_")


@st.composite
def written_keys(draw) -> str:
    key = draw(st.sampled_from(KEYS))
    prefix = next(p for p in ("sk-proj-", "sk-ant-", "ghp_", "AKIA", "tw-k_") if key.startswith(p))
    body = key[len(prefix):]
    # "-" and "_" (and the dashes folded to "-") are a key's own characters: in tokenway's
    # format, whose random part holds them, they cannot be told from separators.
    dashes = "-_\u2013\u2011\u2212"
    separator = draw(st.sampled_from([s for s in SEPARATORS if not (prefix == "tw-k_" and s in dashes)]))
    size = draw(st.integers(1, 4))
    written = prefix + separator.join(body[i:i + size] for i in range(0, len(body), size))
    before = draw(st.sampled_from(("", "key", "x_", "TOKEN=")))
    after = draw(st.sampled_from(("", "xyz"))) if prefix in FIXED_LENGTH and separator == " " else ""
    return before + written + after


@settings(max_examples=400, deadline=None)
@given(written_keys())
def test_generated_keys_with_separators_chunks_and_glue_are_blocked(written):
    assert screened(openai_input(messages=[user(f"Use {written} now")])).categories == ("api_key",), written


@pytest.mark.parametrize("written, key", [
    ("AKIA-Z7Q2-M9VB-4WR8-CZ1P", "AKIA-Z7Q2-M9VB-4WR8-CZ1P"),
    ("x_AKIAZ7Q2M9VB4WR8CZ1P_end", "AKIAZ7Q2M9VB4WR8CZ1P"),
    ("AKIAZ7Q2M9VB4WR8CZ1Pxyz", "AKIAZ7Q2M9VB4WR8CZ1P"),
    ("keysk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"),
    *[("sk-proj-" + ".".join("Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"),) * 2],
])
def test_a_key_with_separators_or_glue_is_found_with_its_span(written, key):
    text = f"use {written}, then stop"
    assert [(f.category, text[f.start:f.end]) for f in detect(text)] == [("api_key", key)]


@pytest.mark.parametrize("text", [
    "risk-assessment-framework-2024-Q1-Final", "task-runner-for-the-big-batch-job-v2-Release",
    "https://example.com/ask-me-anything-2024-AMA-Thread-Part3", "the ASIA-Pacific-Region-2024 plan",
    "Token format: hf_ plus at least 34 letters or digits: e3b0c44298fc1c149afbf4c8996fb92427ae41e4",
    "AKIAIOSFODNN7EXAMPLEs",  # glued after, but not random
    "A" * 40 + "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",  # inside a long token (base64url)
])
def test_slugs_and_prefixes_inside_words_or_tokens_are_not_keys(text):
    assert detect(text, frozenset({"api_key"})) == ()


@pytest.mark.parametrize("text", [
    "41 42 43 44 45 46 47 48 49 4a 4b",  # a hex dump: the whole run is judged, not a window of it
    "4111 1111 1111 1111 5",  # 17 digits, one run
    "4539-1488 0343-6467",  # two kinds of separator
    "4539--1488--0343--6467",  # two separators end a run
    "45391488034364670",  # too long
    "sha1 4539148803436467abcdefeeeeeeeeeeeeeeeeee",  # inside a hash
])
def test_what_is_not_one_card_is_not_flagged(text):
    assert detect(text, frozenset({"credit_card"})) == ()


@pytest.mark.parametrize("text, cards", [
    ("4111 1111 1111 1111 5555 5555 5555 4444", ["4111 1111 1111 1111", "5555 5555 5555 4444"]),  # back to back
    ("card 4111 1111 1111 1111 12/28", ["4111 1111 1111 1111"]),  # the expiry after it
    ("ref 1234: 4539_1488_0343_6467", ["4539_1488_0343_6467"]),  # another kind of separator before it
    ("ref 1234 5678\n4539 1488 0343 6467", ["4539 1488 0343 6467"]),  # its own line
])
def test_a_card_next_to_other_numbers_is_found_with_its_span(text, cards):
    assert [text[f.start:f.end] for f in detect(text, frozenset({"credit_card"}))] == cards


def test_an_iban_whose_digits_read_as_a_card_is_an_iban():
    # Its digits glued to its country code are a Luhn-valid 13-digit Visa number; mod 97 and
    # Norway's length say IBAN.
    assert [f.category for f in detect("card 4850008063608")] == ["credit_card"]
    assert [f.category for f in detect("IBAN NO48 5000 8063 608 ok")] == ["iban"]


@settings(max_examples=200, deadline=None)
@given(written_cards(), st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_a_streamed_reply_never_shows_a_digit_of_such_a_card(written, sizes):
    # ASCII separators: the reply is screened as written (the input screen reads a folded view).
    assume(written.isascii())
    text, out, position = f"Your card is {written} and more text follows.", [], 0
    screen = OutputScreen(SafetyPolicy(output="redact"))
    while position < len(text):
        size = sizes[len(out) % len(sizes)]
        out.append(screen.feed(text[position:position + size]).text)
        position += size
    reply = "".join(out) + screen.finish().text
    assert "[REDACTED:credit_card]" in reply and not any(ch.isdigit() for ch in reply), (written, reply)


def test_a_card_written_one_digit_a_line_is_found_and_a_page_of_them_is_read_line_by_line():
    vertical = "\n".join("4539148803436467")
    assert screened(openai_input(messages=[user(f"Card:\n{vertical}\nthanks")])).categories == ("credit_card",)
    # A page of numbers a line is one run, read a few lines at a time (cards.py): its cards of
    # four lines are found.
    page = "\n".join(["45 39", "14 88", "03 43", "64 67"] * 50)
    assert len(detect(page, frozenset({"credit_card"}))) >= 40
