"""The segment cache gives exactly the ids whole-text encoding gives, or is not enabled."""

from __future__ import annotations

import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, pre_tokenizers

from tokenway.frontend.segment_cache import SegmentCache
from tokenway.frontend.tokenizer import Tokenizer

WORDS = ["Hello", " world", "\n", "  ", "\t", "naïve", "日本", "🙂", "2+2=4", "user", "assistant", "'s", "!"]


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.hf.encode(text, add_special_tokens=False).ids


def test_the_default_models_tokenizer_takes_it(default_model_dir):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    assert tokenizer.enable_segment_cache()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(WORDS), st.sampled_from(["<|im_start|>", "<|im_end|>"]),
                          st.text(max_size=12)), max_size=30))
def test_ids_equal_whole_text_encoding(default_model_dir, pieces):
    tokenizer = _cached(default_model_dir)
    text = "".join(pieces)
    assert tokenizer.encode(text, add_special_tokens=False) == whole(tokenizer, text)
    assert tokenizer.encode(text, add_special_tokens=False) == whole(tokenizer, text)  # from the cache


_tokenizers: dict = {}


def _cached(model_dir) -> Tokenizer:
    if model_dir not in _tokenizers:
        _tokenizers[model_dir] = Tokenizer.from_dir(model_dir)
        _tokenizers[model_dir].enable_segment_cache()
    return _tokenizers[model_dir]


def test_a_conversation_counted_again_reuses_its_turns(default_model_dir):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    tokenizer.enable_segment_cache()
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 20} for i in range(10)]
    tokenizer.encode(tokenizer.apply_chat_template(turns[:9]), add_special_tokens=False)
    misses = tokenizer.segment_cache.num_misses
    text = tokenizer.apply_chat_template(turns)
    assert tokenizer.encode(text, add_special_tokens=False) == whole(tokenizer, text)
    assert tokenizer.segment_cache.num_misses - misses <= 3  # the new turn (and the generation prompt)


def _bpe(added: list[AddedToken], pre_tokenizer) -> tokenizers.Tokenizer:
    vocab = {"a": 0, "b": 1, "ab": 2, "▁": 3, "▁a": 4, " ": 5}
    hf = tokenizers.Tokenizer(models.BPE(vocab, [("a", "b"), ("▁", "a")]))
    hf.pre_tokenizer = pre_tokenizers.Split(" ", "isolated") if pre_tokenizer is None else pre_tokenizer
    hf.add_special_tokens(added)
    return hf


def test_tokens_that_strip_whitespace_are_not_boundaries_so_no_cache():
    hf = _bpe([AddedToken("<x>", lstrip=True, special=True)], None)
    assert SegmentCache.for_tokenizer(hf, lambda text: hf.encode(text, add_special_tokens=False).ids) is None


def test_a_pre_tokenizer_that_treats_the_first_piece_apart_gets_no_cache():
    hf = _bpe([AddedToken("<x>", special=True, normalized=False)],
              pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"))
    encode = lambda text: hf.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert SegmentCache(encode, {"<x>": hf.token_to_id("<x>")}).encode("ab<x>ab") != encode("ab<x>ab")
    assert SegmentCache.for_tokenizer(hf, encode) is None


def test_the_cache_is_bounded():
    hf = _bpe([AddedToken("<x>", special=True, normalized=False)], None)
    cache = SegmentCache(lambda text: hf.encode(text, add_special_tokens=False).ids, {"<x>": 6}, max_chars=10)
    for text in ("ab<x>abab", "ba<x>aabb", "abba<x>b"):
        cache.encode(text)
    assert cache._num_chars <= 10
