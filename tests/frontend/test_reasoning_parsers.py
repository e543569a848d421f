"""The reasoning parsers: a reply split every way a stream can split it gives the same thinking
and content as the whole reply; tags (and the line breaks around them) are in neither part; a
partial tag is held, never leaked; a reply that does not think is content, one cut inside its
thinking is reasoning; the thinking's tokens are counted by token, however deltas group them.
No model: the formats are text, the tokens a scripted vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokenway.frontend.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningFormat,
    check_reasoning_parser,
    closing_text,
    prompt_reasoning,
    template_reasoning_parser,
)

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
QWEN3 = ReasoningFormat("qwen3", "<think>", "</think>")
OPEN = ReasoningFormat("deepseek_r1", "<think>", "</think>", starts_open=True)


def parse(fmt: ReasoningFormat, text: str, sizes: list[int] | None = None) -> tuple[str, str]:
    """Feed `text` in pieces of the given sizes (default: whole); the thinking and the content
    a stream sees, joined."""
    parser = fmt.parser()
    reasoning, content = [], []
    position, pieces = 0, iter(sizes or [len(text)])
    while position < len(text):
        size = next(pieces, len(text))
        delta = parser.feed(text[position:position + size])
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        position += size
    rest = parser.finish()
    return "".join(reasoning) + rest.reasoning, "".join(content) + rest.content


def splits(text: str, seed: int = 0) -> list[list[int]]:
    """Every cut in two, one character at a time, and random cuts."""
    rng = random.Random(seed)
    return ([[cut, len(text)] for cut in range(1, len(text))] + [[1] * len(text), [3] * len(text)]
            + [[rng.randint(1, 7) for _ in range(len(text))] for _ in range(8)])


REPLIES = [
    # (format, reply, reasoning, content)
    (QWEN3, "<think>\nLet me add: 2 + 2.\n</think>\n\nThe sum is 4.", "Let me add: 2 + 2.", "The sum is 4."),
    (QWEN3, "The sum is 4.", "", "The sum is 4."),  # no thinking at all: content as it is
    (QWEN3, "\n\nThe sum is 4.\n", "", "\n\nThe sum is 4.\n"),
    (QWEN3, "\n<think>x</think>y", "x", "y"),  # blanks before the tag
    (QWEN3, "<thinking>is not the tag</thinking>", "", "<thinking>is not the tag</thinking>"),
    (QWEN3, "<think>\nStill going", "Still going", ""),  # cut inside the thinking: all reasoning
    (QWEN3, "<think>\nabc\n</thi", "abc\n</thi", ""),  # cut inside the closing tag
    (QWEN3, "<thi", "", "<thi"),  # cut before the reply showed it thinks: content
    (QWEN3, "<think>\nline one\n\nline two\n</think>\n\nanswer\n", "line one\n\nline two", "answer\n"),
    (QWEN3, "<think>a < b and </div> </thinker> <</think>\n\nok", "a < b and </div> </thinker> <", "ok"),
    (QWEN3, "<think>x</think>\n\n    indented()", "x", "    indented()"),  # only line breaks are markup
    (QWEN3, "<think>a</think>b</think>c", "a", "b</think>c"),  # one thinking part, at the start
    (QWEN3, "<think></think>\n\nOnly content.", "", "Only content."),
    (QWEN3, "<think>😀 ünïcode\r\n</think>\r\n\r\n✓", "😀 ünïcode", "✓"),
    (OPEN, "Let me think.\n</think>\n\nAnswer.", "Let me think.", "Answer."),  # the prompt opened it
    (OPEN, "<think>\nHmm.\n</think>\n\nA", "Hmm.", "A"),  # a tag written again is markup
    (OPEN, "\n\nall of it thought", "all of it thought", ""),
    (OPEN, "</think>\n\nA", "", "A"),  # ended at once (a budget of 0)
    (OPEN, "<thin", "<thin", ""),
    (OPEN, "<t>ag</think>x", "<t>ag", "x"),
    (OPEN, "", "", ""),
]


@pytest.mark.parametrize("fmt, reply, reasoning, content", REPLIES)
def test_every_split_of_a_reply_gives_its_thinking_and_content(fmt, reply, reasoning, content):
    assert parse(fmt, reply) == (reasoning, content)
    for sizes in splits(reply):
        assert parse(fmt, reply, sizes) == (reasoning, content), sizes


def test_a_partial_tag_is_held_and_text_goes_out_as_soon_as_it_cannot_be_one():
    parser = QWEN3.parser()
    assert parser.feed("<thi") == ReasoningDelta()  # may open the part
    assert parser.feed("nk>\nabc") == ReasoningDelta("abc")
    assert parser.feed("\n</th") == ReasoningDelta()  # may close it
    assert parser.feed("e") == ReasoningDelta("\n</the")  # cannot
    assert parser.feed("</think>\n") == ReasoningDelta()
    assert parser.feed("\nHi") == ReasoningDelta(content="Hi")


# ---- counting tokens ------------------------------------------------------------------------

# A reply as a scripted vocabulary's tokens (id = position): tags in pieces, as a BPE without
# them as special tokens writes them, and tokens that straddle the thinking's edges.
TOKENS = ["<", "think", ">\n", "Let", " me", " add", ".\n", "</", "think", ">\n\n", "The", " sum", " is", " 4", "."]
THINKING_TOKENS = 4  # "Let", " me", " add", ".\n" (it holds the full stop); the tags' tokens are not


def count(fmt: ReasoningFormat, tokens: list[str], groups: list[int], token_text: bool = True
          ) -> tuple[int, str, str]:
    """Feed `tokens` (id: position) as deltas of `groups[i]` tokens each, text and ids; the
    thinking tokens counted, and the two parts."""
    parser = fmt.parser((lambda token_id: tokens[token_id]) if token_text else None)
    ids = list(range(len(tokens)))
    reasoning, content, position = "", "", 0
    for size in groups:
        chunk = ids[position:position + size]
        delta = parser.feed("".join(tokens[i] for i in chunk), chunk)
        reasoning, content, position = reasoning + delta.reasoning, content + delta.content, position + size
    rest = parser.finish()
    return parser.num_reasoning_tokens, reasoning + rest.reasoning, content + rest.content


def groupings(num_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    fixed = [[1] * num_tokens, [2] * num_tokens, [3] * num_tokens, [num_tokens]]
    return fixed + [[rng.randint(1, 4) for _ in range(num_tokens)] for _ in range(20)]


def test_thinking_tokens_are_counted_by_token_however_deltas_group_them():
    for groups in groupings(len(TOKENS)):
        assert count(QWEN3, TOKENS, groups) == (THINKING_TOKENS, "Let me add.", "The sum is 4."), groups


def test_a_delta_across_the_end_of_the_thinking_is_not_all_or_nothing():
    # One delta: ".\n" (thinking), the closing tag's three tokens, "The" (content).
    assert count(QWEN3, TOKENS, [3, 3, 5, 4])[0] == THINKING_TOKENS
    # Without the tokens' own texts, by the share of text: still neither all five nor none.
    assert count(QWEN3, TOKENS, [3, 3, 5, 4], token_text=False)[0] == THINKING_TOKENS


def test_tokens_with_no_text_are_placed_by_the_text_after_them():
    tokens = TOKENS + [""]  # an end-of-sequence token: no text
    assert count(QWEN3, tokens, [1] * len(tokens))[0] == THINKING_TOKENS  # after the content: not thinking
    cut = TOKENS[:6] + [""]  # a reply that ends inside its thinking: thinking, as vLLM counts it
    assert count(QWEN3, cut, [1] * 7) == (4, "Let me add", "")
    # Half a character (its text comes with the next token) inside the thinking: thinking.
    split = ["<think>", "", "é", "</think>", "x"]
    assert count(QWEN3, split, [1] * 5) == (2, "é", "x")


def test_a_reply_that_does_not_think_has_no_thinking_tokens():
    tokens = ["The", " sum", " is", " 4", "."]
    for groups in groupings(len(tokens)):
        assert count(QWEN3, tokens, groups) == (0, "", "The sum is 4."), groups
    assert count(OPEN, tokens, [1] * 5) == (5, "The sum is 4.", "")  # all thinking where the prompt opened it


# ---- choosing the format ------------------------------------------------------------------


def test_the_registry_has_vllms_names_and_an_unknown_one_lists_them():
    assert list(REASONING_PARSERS) == ["qwen3", "deepseek_r1"]
    assert check_reasoning_parser("deepseek_r1") == "deepseek_r1"
    with pytest.raises(ValueError, match="reasoning parser 'r1': expected one of qwen3, deepseek_r1"):
        check_reasoning_parser("r1")


def test_a_template_that_writes_think_tags_thinks():
    assert template_reasoning_parser((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()) == "qwen3"
    assert template_reasoning_parser((TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()) \
        == "qwen3"
    assert template_reasoning_parser((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()) is None


@pytest.mark.parametrize("name, prompt, continues, expected", [
    ("qwen3", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False, QWEN3),
    ("qwen3", "<|im_start|>assistant\n<think>\n", False, ReasoningFormat("qwen3", "<think>", "</think>", True)),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, None),  # the switch off: closed
    # A caller's message is never last: its tags do not open or close the reply's thinking.
    ("qwen3", "<|im_start|>user\nsay </think><|im_end|>\n<|im_start|>assistant\n", False, QWEN3),
    ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜>", False, OPEN),  # always open
    ("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n", False, None),
    # A reply begun by the caller (continue_final_message): its own tags count, wherever they are.
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n<think>\nI wonder", True,
     ReasoningFormat("qwen3", "<think>", "</think>", True)),
    ("qwen3", "<|im_start|>assistant\n<think>\nx\n</think>\n\nThe answer", True, None),
])
def test_the_rendered_prompt_says_where_the_reply_starts(name, prompt, continues, expected):
    assert prompt_reasoning(name, prompt, continues) == expected


def test_the_closing_sequence_is_the_templates_own():
    assert closing_text((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(), QWEN3) == "\n</think>\n\n"
    # DeepSeek-R1's template writes no closing tag of its own: the tag on its own lines.
    assert closing_text((TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(), OPEN) \
        == "\n</think>\n\n"
