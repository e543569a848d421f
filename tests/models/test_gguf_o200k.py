"""gpt-oss's o200k tokenizer read from GGUF metadata (tokenizer.ggml.pre "gpt-4o", as llama.cpp's
converter writes it) gives tiktoken's ids: the vocabulary is o200k_base itself (built as in
tests/frontend/test_harmony_reference.py), written as llama.cpp writes a byte-level BPE (tokens in
the byte-level alphabet, merges by rank, Harmony's control tokens at their ids), and compared on
texts that exercise the split (case changes, contractions, numbers in threes, scripts, line
breaks) with openai-harmony's encoder, which is tiktoken's."""

from __future__ import annotations

import base64

import pytest
from tokenizers import pre_tokenizers

from tests.fixtures.o200k import o200k_dir
from tokenway.models.gguf_tokenizer import tokenizer_from_gguf

CONTROL, NORMAL = 3, 1
HARMONY_SPECIALS = {199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>", 200005: "<|channel|>",
                    200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
TEXTS = [
    "Hello world! It's a test, isn't it? They'll've DONE it.",
    "camelCaseWords and HTTPServerError, XMLHttpRequest",
    "1234567 + 89 = 1234656; 3.14159",
    "  leading spaces\n\n\ttabs\r\nand line breaks   \n",
    "Ünïcödé: naïve café, Ελληνικά, русский язык, 日本語のテキスト, 한국어, עברית, العربية",
    "emoji 🤖🎉 and combining e\u0301 marks",
    "path/to/file.py:42 // comment\n#include <stdio.h>",
    '<|start|>assistant<|channel|>analysis<|message|>We need {"city": "Rome"}.<|end|>',
]


@pytest.fixture(scope="module")
def o200k(model_cache_dir):
    harmony = pytest.importorskip("openai_harmony")
    folder = o200k_dir(model_cache_dir)
    if folder is None:
        pytest.skip("the o200k_base vocabulary is not to be had (see test_harmony_reference.py)")
    ranks = {}
    for line in (folder / "o200k_base.tiktoken").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
        encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    return ranks, encoding


def gguf_fields(ranks: dict[bytes, int]) -> dict:
    """The tokenizer metadata llama.cpp's converter writes for gpt-oss: 201088 tokens, the
    reserved ones as <|reserved_N|> controls, merges in the rank order of the tokens they make
    (every split of a token into two tokens, as transformers' tiktoken converter lists them)."""
    byte_to_char = {b: ch for b, ch in enumerate(_byte_chars())}
    tokens = [f"<|reserved_{i}|>" for i in range(201088)]
    types = [CONTROL] * len(tokens)
    for token, rank in ranks.items():
        tokens[rank] = "".join(byte_to_char[b] for b in token)
        types[rank] = NORMAL
    for token_id, text in HARMONY_SPECIALS.items():
        tokens[token_id] = text
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        pairs = sorted((ranks[token[:i]], ranks[token[i:]]) for i in range(1, len(token))
                       if token[:i] in ranks and token[i:] in ranks)
        merges += [f"{tokens[left]} {tokens[right]}" for left, right in pairs]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": 200002}


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet, indexed by byte: printable bytes as themselves, the rest
    shifted past 255 (the mapping ByteLevel's pre-tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    assert sorted(chars.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    return [chars[b] for b in range(256)]


def test_o200k_from_gguf_gives_tiktokens_ids(o200k):
    ranks, encoding = o200k
    tokenizer, config = tokenizer_from_gguf(gguf_fields(ranks), "gpt-oss.gguf", 131072)
    assert config["eos_token"] == "<|return|>"
    for text in TEXTS:
        expected = encoding.encode(text, allowed_special="all")
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, text
        assert tokenizer.decode(expected, skip_special_tokens=False) == text
