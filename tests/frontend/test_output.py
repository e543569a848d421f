"""RequestState: incremental detokenizing and stop strings, token by token."""

from __future__ import annotations

import pytest

from tokenway.frontend.output import RequestState, hold_back_length
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def stream(tokenizer: Tokenizer, text: str, params: SamplingParams, finish_last: bool = True):
    """Feed `text`'s tokens one step at a time; return the deltas and the last output."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    state = RequestState("r", None, [1], params, tokenizer)
    deltas, last = [], None
    for i, token_id in enumerate(token_ids):
        finish = "length" if finish_last and i == len(token_ids) - 1 else None
        last = state.process(EngineOutput("r", [token_id], finish_reason=finish))
        deltas.append(last.outputs[0].delta_text)
        if last.finished:
            break
    return deltas, last


def test_deltas_never_split_a_utf8_character(tokenizer):
    text = "Emoji 🎉🦀 and CJK 漢字かな, accents é à ü — done."
    deltas, last = stream(tokenizer, text, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == last.outputs[0].text


def test_stop_string_spanning_tokens_is_never_emitted(tokenizer):
    text = "The answer is forty-two, said the computer."
    deltas, last = stream(tokenizer, text, SamplingParams(stop=("forty-two",)), finish_last=False)
    out = last.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "forty-two"
    assert out.text == "The answer is " and "".join(deltas) == "The answer is "
    assert not any("forty" in d for d in deltas)


def test_held_back_text_is_released_when_the_stop_string_does_not_come(tokenizer):
    text = "I like fort walls and forty cats."
    deltas, last = stream(tokenizer, text, SamplingParams(stop=("forty-two",)))
    assert "".join(deltas) == text and last.outputs[0].finish_reason == "length"


def test_include_stop_str_in_output(tokenizer):
    _, last = stream(tokenizer, "one two three four", SamplingParams(stop=("three",), include_stop_str_in_output=True),
                     finish_last=False)
    assert last.outputs[0].text == "one two three"


def test_hold_back_length():
    assert hold_back_length("abc fo", ("foo",)) == 2
    assert hold_back_length("abc f", ("foo", "fx")) == 1
    assert hold_back_length("abc", ("foo",)) == 0
    assert hold_back_length("", ("foo",)) == 0
