"""Chunker: exact slices under the token limit, cut at the strongest break, overlapping, one
section each; counted by a word counter where the cut must be predictable, and by the
embedding model's own tokenizer for its 256-token input limit."""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenway.client.chunking import Chunker, EmbeddingTokenCounter, sections

REPO = Path(__file__).resolve().parents[2]
EMBEDDING_INPUT_LIMIT = 256  # all-MiniLM-L6-v2's, [CLS] and [SEP] included


def words(text: str) -> int:
    return len(text.split())


def words_of(text: str) -> list[str]:
    return text.split()


@pytest.fixture(scope="module")
def embedding_counter():
    return EmbeddingTokenCounter()


def check_invariants(text, chunks, count, max_tokens):
    """Exact slices within the limit, in order, covering every non-space character."""
    covered = [False] * len(text)
    for chunk in chunks:
        assert chunk.text == text[chunk.start:chunk.end] and chunk.span == (chunk.start, chunk.end)
        assert chunk.text == chunk.text.strip() and chunk.text
        assert chunk.num_tokens == count(chunk.text) <= max_tokens
        covered[chunk.start:chunk.end] = [True] * (chunk.end - chunk.start)
    assert [c.start for c in chunks] == sorted({c.start for c in chunks})
    assert [c.end for c in chunks] == sorted({c.end for c in chunks})
    assert all(covered[i] for i, char in enumerate(text) if not char.isspace())


def test_the_embedding_counter_counts_cls_and_sep(embedding_counter):
    assert embedding_counter("") == 2
    assert embedding_counter("Hello world") == 4  # [CLS] hello world [SEP]
    long_text = "token " * 300
    assert embedding_counter(long_text) == 302  # tokenizer.json truncates at 128; the counter does not


def test_readme_chunks_fit_the_embedding_models_input_with_its_special_tokens(embedding_counter):
    text = (REPO / "README.md").read_text()
    chunks = Chunker(embedding_counter).split(text)
    check_invariants(text, chunks, embedding_counter, 200)
    assert max(c.num_tokens for c in chunks) <= 200 < EMBEDDING_INPUT_LIMIT
    # Mostly full: the cut moves back to a break only within the back half of what fits.
    assert sum(c.num_tokens for c in chunks) / len(chunks) > 140
    headings = {m.group(1) for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)}
    assert {c.section for c in chunks} <= headings
    for before, after in pairwise(chunks):
        if after.section == before.section and after.start < before.end:
            assert embedding_counter(text[after.start:before.end]) <= 40


def test_a_tokenizer_object_with_encode_counts_the_same(embedding_counter):
    text = (REPO / "README.md").read_text()[:6000]
    assert Chunker(embedding_counter.tokenizer).split(text) == Chunker(embedding_counter).split(text)


def test_a_short_text_is_one_chunk():
    [chunk] = Chunker(words).split("  Hello world.\n")
    assert (chunk.text, chunk.span, chunk.section, chunk.num_tokens) == ("Hello world.", (2, 14), None, 2)
    assert Chunker(words).split(" \n\n ") == []


def test_cuts_at_a_paragraph_break_when_one_is_in_the_back_half():
    paragraphs = [" ".join(" ".join(f"p{p}s{s}w{w}" for w in range(10)) + "." for s in range(3)) for p in range(7)]
    text = "\n\n".join(paragraphs)
    chunks = Chunker(words, max_tokens=100, overlap_tokens=0).split(text)
    check_invariants(text, chunks, words, 100)
    # 100 words fit, ending a sentence; the paragraph break at word 90 wins over it.
    assert [c.text for c in chunks] == ["\n\n".join(paragraphs[0:3]), "\n\n".join(paragraphs[3:6]), paragraphs[6]]


def test_cuts_at_a_sentence_end_inside_a_long_paragraph():
    sentences = [" ".join(f"s{s}w{w}" for w in range(7)) + "." for s in range(20)]
    text = " ".join(sentences)
    chunks = Chunker(words, max_tokens=30, overlap_tokens=0).split(text)
    check_invariants(text, chunks, words, 30)
    assert all(c.text.endswith(".") for c in chunks)
    assert [c.num_tokens for c in chunks[:-1]] == [28] * (len(chunks) - 1)  # 4 sentences; a 5th would make 35


def test_cuts_between_words_without_punctuation_and_overlaps_by_words():
    text = " ".join(f"w{i}" for i in range(100))
    no_overlap = Chunker(words, max_tokens=30, overlap_tokens=0).split(text)
    assert [words_of(c.text) for c in no_overlap] == [[f"w{i}" for i in range(s, min(s + 30, 100))]
                                                      for s in range(0, 100, 30)]
    overlapping = Chunker(words, max_tokens=30, overlap_tokens=10).split(text)
    check_invariants(text, overlapping, words, 30)
    starts = [int(words_of(c.text)[0][1:]) for c in overlapping]
    assert starts == [0, 20, 40, 60, 80]  # each starts 10 words before the previous one's end


def test_the_overlap_starts_at_a_sentence_when_that_keeps_half_of_it():
    sentences = [" ".join(f"s{s}w{w}" for w in range(4)) + "." for s in range(30)]
    text = " ".join(sentences)
    chunks = Chunker(words, max_tokens=30, overlap_tokens=10).split(text)
    check_invariants(text, chunks, words, 30)
    for before, after in pairwise(chunks):
        assert after.start < before.end  # they overlap...
        assert words(text[after.start:before.end]) == 8  # ...by two whole sentences (10 words would cut one)
        assert after.text.split()[0].endswith("w0")


def test_a_word_longer_than_a_chunk_is_cut_between_characters():
    text = "short " + "x" * 180 + " end"
    chunks = Chunker(len, max_tokens=50, overlap_tokens=0).split(text)
    check_invariants(text, chunks, len, 50)
    assert chunks[0].text == "short"
    assert "".join(c.text for c in chunks[1:-1]) + chunks[-1].text.removesuffix(" end") == "x" * 180
    with pytest.raises(ValueError, match="too small for one character"):
        Chunker(lambda t: len(t) + 2, max_tokens=2, overlap_tokens=0).split("abc")


MARKDOWN = """Some words before any heading.

# Title

Intro paragraph.

## Install

```bash
# not a heading: a shell comment
pip install tokenway
```

## Use ##

Call it.
"""


def test_each_chunk_lies_in_one_markdown_section_and_keeps_its_heading():
    assert [heading for _, _, heading in sections(MARKDOWN)] == [None, "Title", "Install", "Use"]
    chunks = Chunker(words, max_tokens=200, overlap_tokens=40).split(MARKDOWN)
    assert [(c.section, c.text.splitlines()[0]) for c in chunks] == [
        (None, "Some words before any heading."), ("Title", "# Title"), ("Install", "## Install"),
        ("Use", "## Use ##")]
    assert "pip install tokenway" in chunks[2].text


def test_the_overlap_never_reaches_back_over_a_heading():
    body = " ".join(f"w{i}" for i in range(50))
    text = f"# One\n\n{body}\n\n# Two\n\n{body}"
    chunks = Chunker(words, max_tokens=30, overlap_tokens=10).split(text)
    check_invariants(text, chunks, words, 30)
    first_of_two = next(c for c in chunks if c.section == "Two")
    assert first_of_two.text.startswith("# Two")
    assert all(c.end <= text.index("# Two") for c in chunks if c.section == "One")


def test_settings_are_checked():
    with pytest.raises(ValueError, match="overlap_tokens"):
        Chunker(words, max_tokens=100, overlap_tokens=51)
    with pytest.raises(ValueError, match="max_tokens"):
        Chunker(words, max_tokens=0)
    with pytest.raises(TypeError, match="tokenizer"):
        Chunker(42)


_PIECES = ["alpha", "beta", "gamma", "delta", "x" * 40, "end.", "stop!", "why?", "\n", "\n\n", "\n\n# Head\n\n",
           "\n## Sub\n", "。", "日本語"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=120), st.sampled_from([" ", "  ", ""]),
       st.integers(3, 40), st.data())
def test_any_text_splits_into_exact_slices_within_the_limit(pieces, glue, max_tokens, data):
    text = glue.join(pieces)
    overlap_tokens = data.draw(st.integers(0, max_tokens // 2))

    def count(t: str) -> int:  # words, a long word costing more, and two special tokens
        return sum(1 + len(w) // 10 for w in t.split()) + 2

    chunks = Chunker(count, max_tokens=max_tokens, overlap_tokens=overlap_tokens).split(text)
    check_invariants(text, chunks, count, max_tokens)
    headings = [(m.start(), m.group(2)) for m in re.finditer(r"^(#+)[ \t]+(.+?)[ \t]*$", text, re.MULTILINE)]
    for chunk in chunks:
        above = [title for start, title in headings if start <= chunk.start]
        assert chunk.section == (above[-1] if above else None)
        assert not any(chunk.start < start < chunk.end for start, _ in headings)
