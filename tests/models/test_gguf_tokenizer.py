"""tokenizer_from_gguf: GGUF tokenizer metadata -> the ids llama.cpp gives.

A tiny SentencePiece vocab whose ids are worked out by hand from llama.cpp's llm_tokenizer_spm
(and were checked once against llama-server on a GGUF holding it), one trained by sentencepiece
itself, and the real Gemma 3 GGUF against llama.cpp's recorded ids, transformers and, where one
is built, a live llama-server.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
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


@pytest.mark.parametrize("add_dummy_prefix", [True, False])
def test_spm_matches_sentencepiece_on_a_vocab_it_trained(add_dummy_prefix):
    # llama.cpp's SPM tokenizer reproduces sentencepiece's BPE encoder, so sentencepiece is a
    # second reference, on a vocab with merges we did not choose.
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
    from sentencepiece import sentencepiece_model_pb2

    corpus = [line for path in (Path(__file__), Path(tokenizer_from_gguf.__code__.co_filename))
              for line in path.read_text().splitlines()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, model_type="bpe", vocab_size=600, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix,
        character_coverage=1.0, allow_whitespace_only_pieces=True, split_by_whitespace=False, minloglevel=2,
        num_threads=1,
    )
    proto = sentencepiece_model_pb2.ModelProto.FromString(model.getvalue())
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
        "tokenizer.ggml.scores": [p.score for p in proto.pieces],
        "tokenizer.ggml.token_type": [p.type for p in proto.pieces],  # sentencepiece's numbering is llama.cpp's
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.add_space_prefix": add_dummy_prefix,
    }
    hf, _ = tokenizer_from_gguf(fields, "trained.gguf", 64)
    hf.encode_special_tokens = True  # sentencepiece reads "<s>" in text as text
    reference = spm.SentencePieceProcessor(model_proto=model.getvalue())
    rng = random.Random(0)
    texts = ["", " ", "   ", "\n", "def f(x):\n    return x  # ok", "日本語 🙂 naïve", "\x00\x7f\ufffd"]
    for _ in range(300):  # corpus slices, sometimes with spaces, newlines and unseen characters in them
        line = rng.choice(corpus)
        start = rng.randrange(len(line) + 1)
        text = line[start:start + rng.randrange(1, 60)]
        if rng.random() < 0.3:
            text = text.replace(rng.choice(text or " "), rng.choice([" ", "  ", "\n", "é", "语", "🙂", "\t"]))
        texts.append(text)
    for text in texts:
        assert hf.encode(text, add_special_tokens=False).ids == reference.encode(text), repr(text)
        assert hf.decode(reference.encode(text)) == reference.decode(reference.encode(text)), repr(text)


UNSUPPORTED_BERT = r"tiny.gguf: unsupported tokenizer.ggml.model 'bert'; expected one of \['gpt2', 'llama'\]"


def gpt2_fields(**extra) -> dict:
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<|endoftext|>", "a", "b", "c", "ab", "abc", "Ġ", "Ġa", "1", "2", "12", "<think>"],
        "tokenizer.ggml.token_type": [3] + [1] * 10 + [4],
        "tokenizer.ggml.merges": ["a b", "ab c", "Ġ a", "1 2"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    return {**fields, **extra}


def test_gpt2_byte_level_bpe():
    hf, config = tokenizer_from_gguf(gpt2_fields(), "tiny.gguf", model_max_length=128)
    tokenizer = Tokenizer(hf, config)
    # smollm isolates digits before merging, so "12" never merges; <think> is user-defined
    assert tokenizer.encode("abc a12<think><|endoftext|>") == [5, 7, 8, 9, 11, 0]
    assert tokenizer.encode_special_tokens_as_text("<think>") == [11]
    assert tokenizer.is_special(0) and not tokenizer.is_special(11)
    assert tokenizer.decode([5, 7, 0], skip_special_tokens=False) == "abc a<|endoftext|>"
    assert config == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False,
                      "add_eos_token": False, "model_max_length": 128, "clean_up_tokenization_spaces": False,
                      "tokenizer_class": "PreTrainedTokenizerFast"}
    hf, _ = tokenizer_from_gguf(gpt2_fields(**{"tokenizer.ggml.add_bos_token": True}), "tiny.gguf", 128)
    assert hf.encode("ab").ids == [0, 4]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, UNSUPPORTED_BERT),
        ({"tokenizer.ggml.model": "rwkv"}, r"unsupported tokenizer.ggml.model 'rwkv'"),
        ({"tokenizer.ggml.pre": "deepseek-llm"}, r"tiny.gguf: unsupported tokenizer.ggml.pre 'deepseek-llm'"),
        ({"tokenizer.ggml.tokens": None}, r"tiny.gguf: missing GGUF metadata key 'tokenizer.ggml.tokens'"),
        ({"tokenizer.ggml.model": None}, r"tiny.gguf: missing GGUF metadata key 'tokenizer.ggml.model'"),
        ({"tokenizer.ggml.merges": None}, r"tiny.gguf: missing GGUF metadata key 'tokenizer.ggml.merges'"),
        ({"tokenizer.ggml.token_type": [1]}, r"tiny.gguf: 1 token types for 12 tokens"),
    ],
)
def test_unsupported_or_broken_metadata_is_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        tokenizer_from_gguf(gpt2_fields(**fields), "tiny.gguf", 128)


def test_spm_scores_must_match_the_tokens():
    with pytest.raises(ValueError, match=r"tiny.gguf: 3 token scores for 287 tokens"):
        tokenizer_from_gguf(spm_fields(**{"tokenizer.ggml.scores": [0.0] * 3}), "tiny.gguf", 64)


@pytest.fixture(scope="module")
def gemma3_path(gemma3_gguf) -> Path:
    return gemma3_gguf


@pytest.fixture(scope="module")
def gemma3_fields(gemma3_path) -> dict:
    # transformers' reader: the same decoded values as GGUFReader's contents(), in 2 s rather than
    # 10 (GGUFReader parses all 262,144 tokens' headers one by one).
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    metadata, _ = reader.read_gguf_metadata(str(gemma3_path), arrays)
    return metadata


@pytest.fixture(scope="module")
def gemma3(gemma3_fields) -> Tokenizer:
    hf, config = tokenizer_from_gguf(gemma3_fields, "gemma-3-270m-q4_k_m.gguf", model_max_length=32768)
    return Tokenizer(hf, config, source="gemma-3-270m-q4_k_m.gguf")


def gemma3_cases() -> list[dict]:
    return json.loads(FIXTURE.read_text())["cases"]


def test_gemma3_encodes_as_llama_cpp_did(gemma3, gemma3_path):
    fixture = json.loads(FIXTURE.read_text())
    with open(gemma3_path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == fixture["gguf_sha256"], "not the fixture's GGUF"
    assert gemma3.vocab_size == 262144 and gemma3.bos_token_id == 2 and gemma3.eos_token_id == 1
    for case in fixture["cases"]:
        text = case["text"]
        if case["parse_special"]:
            assert gemma3.encode(text, add_special_tokens=case["add_special"]) == case["ids"], repr(text)
        else:  # llama.cpp's parse_special=False reads control tokens as text, user-defined ones not
            assert gemma3.encode_special_tokens_as_text(text) == case["ids"], repr(text)
    assert gemma3.enable_segment_cache()  # added tokens are hard boundaries here, as in llama.cpp
    for case in fixture["cases"]:
        if case["parse_special"] and case["add_special"]:
            assert gemma3.encode(case["text"], add_special_tokens=False) == case["ids"][1:], repr(case["text"])


def test_gemma3_decode_round_trips(gemma3):
    for text in {case["text"] for case in gemma3_cases()}:
        assert gemma3.decode(gemma3.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    assert gemma3.decode(gemma3.encode("<start_of_turn>user\nHi 🙂<end_of_turn>\n")) == "user\nHi 🙂\n"


def test_gemma3_matches_transformers(gemma3, gemma3_path):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(gemma3_path.parent, gguf_file=gemma3_path.name)
    for text in {case["text"] for case in gemma3_cases()}:
        token_ids = gemma3.encode(text)
        if " " * 32 in text:
            # Gemma's GGUF stores runs of 2-31 spaces as user-defined tokens, which llama.cpp matches
            # whole, longest first; transformers respells them "▁▁..." and merges them differently.
            # The fixture holds llama.cpp's ids for such a text.
            continue
        assert token_ids == reference.encode(text), repr(text)
        assert gemma3.decode(token_ids, skip_special_tokens=False) == reference.decode(token_ids), repr(text)
        if "</s>" not in text:  # llama.cpp makes Gemma's "</s>" a control token: decode drops it
            assert gemma3.decode(token_ids) == reference.decode(token_ids, skip_special_tokens=True), repr(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llama_server_ids(base_url: str, text: str) -> list[int]:
    body = json.dumps({"content": text, "add_special": True, "parse_special": True}).encode()
    request = urllib.request.Request(f"{base_url}/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["tokens"]


def test_gemma3_matches_a_live_llama_server(gemma3, gemma3_path):
    if not LLAMA_SERVER.is_file():
        pytest.skip(f"no llama-server at {LLAMA_SERVER} (TOKENWAY_LLAMA_SERVER); gemma3_tokenize.json covers it")
    port = _free_port()
    server = subprocess.Popen(
        # --no-repack: on a CPU that lists AMX its repacked path can die of SIGILL (a VM without AMX state)
        [str(LLAMA_SERVER), "-m", str(gemma3_path), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-t", "1",
         "--no-repack"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base_url}/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None, "llama-server exited"
                time.sleep(0.1)
        rng = random.Random(0)
        pieces = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "=", "--", "...", "a", "aaa", "the", " the", "ing", "x", "0",
                  "123", "日本", "語", "🙂", "é", "e\u0301", "<", ">", "</", "<b>", "</s>", "<s>", "<start_of_turn>",
                  "<end_of_turn>", "<unused7>", "_", "#", "**", "\u00a0", "Ω", "\ue000", "\x00", "A", "'s", "::", "{}"]
        words = Path(__file__).read_text().split()
        for _ in range(400):
            if rng.random() < 0.5:
                text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
            else:
                text = "".join(rng.choice(words) + rng.choice([" ", "  ", "\n", "", "\t"]) for _ in range(20))
            assert gemma3.encode(text) == _llama_server_ids(base_url, text), repr(text)
    finally:
        server.terminate()
        server.wait(timeout=30)
