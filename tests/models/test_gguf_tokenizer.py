"""tokenizer_from_gguf: GGUF tokenizer metadata -> the ids llama.cpp gives.

A tiny SentencePiece vocab whose ids are worked out by hand from llama.cpp's llm_tokenizer_spm
(and were checked once against llama-server on a GGUF holding it), one trained by sentencepiece
itself, and the real Gemma 3 GGUF against llama.cpp's recorded ids, transformers and, where one
is built, a live llama-server.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tokenway.frontend.tokenizer import Tokenizer
from tokenway.models.gguf_tokenizer import tokenizer_from_gguf

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gemma3_tokenize.json"
GEMMA3_GGUF = Path(os.environ.get("TOKENWAY_GEMMA3_GGUF", "/tmp/gemma3/gemma-3-270m-q4_k_m.gguf"))
LLAMA_SERVER = Path(os.environ.get("TOKENWAY_LLAMA_SERVER", Path.home() / ".cache/tokenway-peers/bin/llama-server"))

# The tiny vocab: <unk> <s> </s>, the 256 byte tokens (id 3 + byte), then normal pieces whose
# score says how early SentencePiece merged them, then added tokens (4: user-defined, 3: control;
# llama.cpp wants <|endoftext|> in a vocab it treats as Phi-3's).
BYTE = 3
PIECES = [
    ("▁h", -1), ("ll", -2), ("▁he", -3), ("llo", -4), ("▁hello", -5), ("▁w", -6), ("or", -7), ("ld", -8),
    ("▁wor", -9), ("▁world", -10), ("▁▁", -11), ("ab", -12), ("bc", -13),
    ("▁", -100), ("h", -101), ("e", -102), ("l", -103), ("o", -104), ("w", -105), ("r", -106), ("d", -107),
    ("a", -108), ("b", -109), ("c", -110), ("日", -111),
]
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in PIECES]
ADDED = [("<tool>", 4), ("\n\n", 4), ("<|endoftext|>", 3)]
SPM_TOKENS += [token for token, _ in ADDED]
ID = {token: token_id for token_id, token in enumerate(SPM_TOKENS)}
UNK, BOS, EOS, TOOL, NEWLINES = ID["<unk>"], ID["<s>"], ID["</s>"], ID["<tool>"], ID["\n\n"]


def spm_fields(**extra) -> dict:
    """GGUF metadata as GGUFReader's contents() gives it."""
    fields = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": SPM_TOKENS,
        "tokenizer.ggml.scores": [0.0] * (BYTE + 256) + [float(s) for _, s in PIECES] + [0.0] * len(ADDED),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(PIECES) + [t for _, t in ADDED],
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOS,
        "tokenizer.ggml.unknown_token_id": UNK,
    }
    return {**fields, **extra}


def spm_tokenizer(**extra) -> Tokenizer:
    hf, config = tokenizer_from_gguf(spm_fields(**extra), "tiny.gguf", model_max_length=64)
    return Tokenizer(hf, config, source="tiny.gguf")


@pytest.mark.parametrize(
    ("text", "token_ids"),
    [
        # "▁hello▁world": ▁h, ll, ▁he, llo, ▁hello, ▁w, or, ld, ▁wor, ▁world in score order
        ("hello world", [BOS, ID["▁hello"], ID["▁world"]]),
        ("", [BOS]),
        # "▁▁▁hello": ▁h goes first, which leaves the pair of ▁ before it
        ("  hello", [BOS, ID["▁▁"], ID["▁hello"]]),
        ("hello   world", [BOS, ID["▁hello"], ID["▁▁"], ID["▁world"]]),
        ("abc", [BOS, ID["▁"], ID["ab"], ID["c"]]),  # ab outscores bc
        ("é", [BOS, ID["▁"], BYTE + 0xC3, BYTE + 0xA9]),  # not in the vocab: its UTF-8 bytes
        ("🙂", [BOS, ID["▁"], BYTE + 0xF0, BYTE + 0x9F, BYTE + 0x99, BYTE + 0x82]),
        ("a\x01日", [BOS, ID["▁"], ID["a"], BYTE + 0x01, ID["日"]]),
        ("a\nb", [BOS, ID["▁"], ID["a"], BYTE + 0x0A, ID["b"]]),
        # user-defined tokens match whole, and the text after any added token gets the prefix space
        ("a\n\nb", [BOS, ID["▁"], ID["a"], NEWLINES, ID["▁"], ID["b"]]),
        ("hello<tool>world", [BOS, ID["▁hello"], TOOL, ID["▁world"]]),
        ("<s>hello</s>", [BOS, BOS, ID["▁hello"], EOS]),
        ("<unk>", [BOS, UNK]),
    ],
)
def test_spm_encodes_as_llama_cpp(text, token_ids):
    tokenizer = spm_tokenizer()
    assert tokenizer.encode(text) == token_ids
    assert tokenizer.encode(text, add_special_tokens=False) == token_ids[1:]


def test_spm_without_space_prefix():
    # Gemma's files say add_space_prefix false: no ▁ in front, so "h" "e" stay apart
    tokenizer = spm_tokenizer(**{"tokenizer.ggml.add_space_prefix": False})
    assert tokenizer.encode("hello world") == [BOS, ID["h"], ID["e"], ID["llo"], ID["▁world"]]
    assert tokenizer.encode("a<tool>b") == [BOS, ID["a"], TOOL, ID["b"]]
    assert tokenizer.decode(tokenizer.encode(" hello world")) == " hello world"


def test_spm_control_tokens_read_as_text_stay_text():
    tokenizer = spm_tokenizer()
    as_text = [ID["▁"], BYTE + ord("<"), BYTE + ord("s"), BYTE + ord(">"), ID["▁hello"]]
    assert tokenizer.encode_special_tokens_as_text("<s> hello") == as_text
    # user-defined tokens are no control tokens: llama.cpp matches them whatever parse_special says
    assert tokenizer.encode_special_tokens_as_text("<tool>") == [TOOL]
    assert tokenizer.is_special(BOS) and tokenizer.is_special(UNK) and not tokenizer.is_special(TOOL)


def test_spm_decode_drops_the_prefix_space_and_control_tokens():
    tokenizer = spm_tokenizer()
    token_ids = tokenizer.encode("  hello é🙂\n\tworld")
    assert tokenizer.decode(token_ids) == "  hello é🙂\n\tworld"
    # shown, <s> comes first and the prefix space stays, as llama.cpp's detokenize leaves it
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == "<s>   hello é🙂\n\tworld"
    # the text after an added token has a prefix space of its own, which llama.cpp keeps too
    assert tokenizer.decode(tokenizer.encode("a\n\nb")) == "a\n\n b"
    assert tokenizer.token_text(ID["▁world"]) == "world"  # alone, a token is a text's first: no prefix space
    assert tokenizer.token_text(BYTE + 0x0A) == "\n"


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581<"), max_size=40), st.booleans())
def test_spm_decode_round_trips_any_text(text, add_space_prefix):
    assume(not add_space_prefix or "\n\n" not in text)  # see the test above
    tokenizer = spm_tokenizer(**{"tokenizer.ggml.add_space_prefix": add_space_prefix})
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_spm_phi3_added_tokens_eat_the_whitespace_after_them():
    # llama.cpp sets rstrip on every added token of a model named Phi-3 but <unk>, <s>, <|endoftext|>
    tokenizer = spm_tokenizer(**{"general.name": "Phi-3 Mini 4k Instruct"})
    assert tokenizer.encode("<tool>\n  hello") == [BOS, TOOL, ID["▁hello"]]
    assert tokenizer.encode("<s> hello") == [BOS, BOS, ID["▁"], ID["▁hello"]]
    assert spm_tokenizer().encode("<tool> hello") == [BOS, TOOL, ID["▁"], ID["▁hello"]]


def test_spm_through_a_gguf_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    fields = spm_fields()
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_scores(fields["tokenizer.ggml.scores"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_tensor("token_embd.weight", np.zeros((len(SPM_TOKENS), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    hf, config = tokenizer_from_gguf({k: f.contents() for k, f in reader.fields.items()}, str(path), 64)
    assert hf.encode("hello world").ids == [ID["▁hello"], ID["▁world"]]  # add_bos_token false
    assert config == {
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False,
        "chat_template": "{{ messages[0]['content'] }}", "model_max_length": 64,
        "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast",
    }
