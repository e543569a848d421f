"""Built-in secret and PII detectors: spans, checksums, overlap resolution, redaction, and
precision and recall over the labelled set in data/pii_lines.tsv."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from tokenway.safety.detectors import CATEGORIES, Finding, detect, iban_ok, luhn_ok, redact

PII_LINES = Path(__file__).parent / "data" / "pii_lines.tsv"


def load_lines(path: Path = PII_LINES) -> list[tuple[Counter, str]]:
    """(expected category counts, text) per line; the label `none` is an empty Counter."""
    header, *rows = path.read_text(encoding="utf-8").splitlines()
    assert header == "label\ttext"
    lines = []
    for row in rows:
        label, text = row.split("\t")
        lines.append((Counter() if label == "none" else Counter(label.split(",")), text))
    return lines


def count_outcomes(lines: list[tuple[Counter, str]]) -> tuple[dict[str, Counter], int]:
    """Per category tp/fp/fn over findings (matched by category within a line), and the number
    of lines whose found categories equal the expected ones exactly."""
    category_to_counts = {category: Counter() for category in CATEGORIES}
    num_exact = 0
    for expected, text in lines:
        found = Counter(f.category for f in detect(text))
        num_exact += found == expected
        for category in CATEGORIES:
            tp = min(found[category], expected[category])
            category_to_counts[category].update(tp=tp, fp=found[category] - tp, fn=expected[category] - tp)
    return category_to_counts, num_exact


def spans(text: str) -> list[tuple[str, str]]:
    return [(f.category, text[f.start:f.end]) for f in detect(text)]


@pytest.mark.parametrize("text, expected", [
    ("mail ann.lee@example.com, ok", [("email", "ann.lee@example.com")]),
    ("(o'neil@example.org)", [("email", "o'neil@example.org")]),
    ("call +44 20 7946 0958.", [("phone", "+44 20 7946 0958")]),
    ("office (415) 555-0132, desk 415.555.0199", [("phone", "(415) 555-0132"), ("phone", "415.555.0199")]),
    ("UK 020 7946 0958 / FR 01 23 45 67 89", [("phone", "020 7946 0958"), ("phone", "01 23 45 67 89")]),
    ("card 4111 1111 1111 1111, exp 12/28", [("credit_card", "4111 1111 1111 1111")]),
    ("amex 3782 822463 10005.", [("credit_card", "3782 822463 10005")]),
    ("IBAN GB82 WEST 1234 5698 7654 32 AND MORE", [("iban", "GB82 WEST 1234 5698 7654 32")]),
    ("to DE89370400440532013000.", [("iban", "DE89370400440532013000")]),
    ("Malta MT84 MALT 0110 0001 2345 MTLC AST0 01S ok", [("iban", "MT84 MALT 0110 0001 2345 MTLC AST0 01S")]),
    ("KEY=AKIAIOSFODNN7EXAMPLE;", [("api_key", "AKIAIOSFODNN7EXAMPLE")]),
    ('"sk-proj-ErQHQwjyaxErPZDS3MoJaQNjCxkv5ndK0meGR0vRzZ1fb6d0"',
     [("api_key", "sk-proj-ErQHQwjyaxErPZDS3MoJaQNjCxkv5ndK0meGR0vRzZ1fb6d0")]),
    ("Bearer tw-k_bdba1909-OrhOEApliw3RIf3CVORgO9ACim9_uz7XRyrv85toz0B",
     [("api_key", "tw-k_bdba1909-OrhOEApliw3RIf3CVORgO9ACim9_uz7XRyrv85toz0B")]),
    ("x -----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIFAKE\n-----END EC PRIVATE KEY----- y",
     [("api_key", "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIFAKE\n-----END EC PRIVATE KEY-----")]),
])
def test_each_category_is_found_with_its_span(text, expected):
    assert spans(text) == expected


@pytest.mark.parametrize("text", [
    "released 2024-03-15, v1.26.4, at 192.168.100.254:8080, for $1,299.99",
    "Order #415-555-0132 and Ticket ID: 646-555-0123",
    "scikit-learn, not sk-learn; sk-this-is-not-a-real-key-just-a-slug",
    "write to ann at example dot com",  # obfuscated addresses are deliberately not emails
    "git clone git@github.com:example/tokenway.git; see icon@2x.png",
    "uuid 550e8400-e29b-41d4-a716-446655440000, sha e3b0c44298fc1c149afbf4c8996fb924",
])
def test_lookalikes_are_not_flagged(text):
    assert detect(text) == ()


def test_no_card_without_luhn_and_a_known_scheme():
    rng = random.Random(0)
    num_flagged = 0
    for _ in range(5000):
        digits = rng.choice("3456") + "".join(rng.choice("0123456789") for _ in range(15))
        text = f"pay {' '.join(digits[i:i + 4] for i in range(0, 16, 4))} now"
        cards = detect(text, frozenset({"credit_card"}))
        assert all(luhn_ok(digits) for _ in cards), digits
        num_flagged += len(cards)
    # About one in ten random numbers passes Luhn; most of those are in a scheme's range.
    assert 100 < num_flagged < 500


@pytest.mark.parametrize("card", ["4111111111111111", "5555555555554444", "378282246310005", "6011111111111117",
                                  "3530111333300000", "30569309025904", "2223003122003222"])
def test_one_changed_digit_is_never_a_card(card):
    assert detect(f"card {card}") == (Finding("credit_card", 5, 5 + len(card), 1.0),)
    for i in range(len(card)):
        for d in "0123456789":
            if d != card[i]:
                changed = card[:i] + d + card[i + 1:]
                assert detect(f"card {changed}", frozenset({"credit_card"})) == (), changed


def test_luhn_valid_numbers_outside_every_scheme_are_not_cards():
    assert luhn_ok("1234567812345670") and luhn_ok("9400111111111110")
    assert detect("ids 1234567812345670 9400111111111110") == ()


@pytest.mark.parametrize("iban", ["GB82WEST12345698765432", "DE89370400440532013000", "FR1420041010050500013M02606",
                                  "NO9386011117947", "CH9300762011623852957"])
def test_iban_mod97_rejects_every_single_substitution(iban):
    assert iban_ok(iban)
    for i in range(2, len(iban)):
        for ch in "0123456789" if iban[i].isdigit() else "ABCDEFGHIJ":
            if ch != iban[i]:
                changed = iban[:i] + ch + iban[i + 1:]
                assert not iban_ok(changed), changed
                assert detect(changed, frozenset({"iban"})) == (), changed


def test_iban_needs_the_countrys_length_and_a_known_country():
    assert not iban_ok("GB82WEST1234569876543")  # one short
    assert detect("XX82 WEST 1234 5698 7654 32") == ()


def test_redact_replaces_each_span():
    text = "Mail tom@example.com or call 415-555-0132; card 4111 1111 1111 1111."
    assert redact(text, detect(text)) == ("Mail [REDACTED:email] or call [REDACTED:phone]; "
                                          "card [REDACTED:credit_card].")
    assert redact(text, ()) == text


def test_redact_rejects_overlapping_or_unsorted_findings():
    with pytest.raises(ValueError):
        redact("abcdef", (Finding("email", 2, 4, 1.0), Finding("phone", 0, 3, 0.8)))
    with pytest.raises(ValueError):
        redact("abc", (Finding("email", 1, 9, 1.0),))


def test_overlap_keeps_the_more_specific_category():
    text = "415-555-0132@example.com"
    # The phone candidate exists on its own ...
    assert spans_of(text, {"phone"}) == [("phone", "415-555-0132")]
    # ... but the email that contains it wins.
    assert spans(text) == [("email", text)]
    jwt = ("eyJhbGciOiJIUzI1NiJ9.eyJwaG9uZSI6IjQxNSJ9.x-415-555-0132")
    assert spans(f"token {jwt} end") == [("api_key", jwt)]


def spans_of(text: str, categories: set[str]) -> list[tuple[str, str]]:
    return [(f.category, text[f.start:f.end]) for f in detect(text, frozenset(categories))]


def test_categories_filter_and_validation():
    text = "tom@example.com 415-555-0132"
    assert spans_of(text, {"email"}) == [("email", "tom@example.com")]
    with pytest.raises(ValueError, match="unknown"):
        detect(text, frozenset({"ssn"}))
    with pytest.raises(ValueError):
        Finding("ssn", 0, 1, 1.0)
    with pytest.raises(ValueError):
        Finding("email", 3, 3, 1.0)
    with pytest.raises(ValueError):
        Finding("email", 0, 3, 1.5)


def test_scores_rank_checked_matches_above_heuristic_ones():
    text = "call 415-555-0132, or if nobody answers try 212-555-0199, card 4111111111111111, a@example.com"
    category_to_scores = {}
    for f in detect(text):
        category_to_scores.setdefault(f.category, []).append(f.score)
    assert category_to_scores == {"phone": [0.9, 0.8], "credit_card": [1.0], "email": [0.95]}


def test_labelled_set_precision_and_recall():
    lines = load_lines()
    num_positive = sum(bool(expected) for expected, _ in lines)
    assert len(lines) >= 200 and num_positive >= 100 and len(lines) - num_positive >= 100
    category_to_counts, num_exact = count_outcomes(lines)
    total = sum(category_to_counts.values(), Counter())
    precision = total["tp"] / (total["tp"] + total["fp"])
    recall = total["tp"] / (total["tp"] + total["fn"])
    assert precision >= 0.95 and recall >= 0.95, category_to_counts
    assert num_exact / len(lines) >= 0.95, num_exact
    for category, counts in category_to_counts.items():
        assert counts["tp"] >= 10, (category, counts)  # every category is exercised
