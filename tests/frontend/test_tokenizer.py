"""Tokenizer: the GGUF-derived tokenizer against transformers, and chat template rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors

from tokenway.frontend.tokenizer import Tokenizer

# Text where our tokenizer and transformers' must agree. A whitespace run right before a digit is
# left out on purpose: see test_digits_are_split_like_llama_cpp.
TEXTS = [
    "Hello, world!",
    "12345",
    "The year 2024 had 366 days; pi is 3.14159 and 1,000,000 is a million.",
    "x1y22z333",
    "multiple   spaces\n\nnew lines\ttabs\t\tand\r\nCRLF  ",
    "   leading and trailing   ",
    "😀🎉 emoji, 中文字符, 日本語のテキスト, 한국어, naïve café, Ωμέγα, Привет",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "I'm sure you're right, they'll see WE'VE won",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "",
    " ",
]

CONVERSATIONS = {
    "without_system": [{"role": "user", "content": "What is 2 + 2?"}],
    "with_system": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?"},
    ],
}


@pytest.fixture(scope="session")
def converted_dir(default_model_dir) -> Path:
    return default_model_dir


@pytest.fixture(scope="session")
def tokenizer(converted_dir) -> Tokenizer:
    return Tokenizer.from_dir(converted_dir)


@pytest.fixture(scope="session")
def reference(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, reference, text):
    token_ids = tokenizer.encode(text)
    assert token_ids == reference.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tokenizer.decode(token_ids, skip_special_tokens=skip) == reference.decode(
            token_ids, skip_special_tokens=skip
        )
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == text


def test_digits_are_split_like_llama_cpp(tokenizer):
    # llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 split, so "  12" is
    # "  " + "1" + "2". transformers' GGUF loader knows no "smollm" split and gives " " + " " + ...
    tokens = [tokenizer.hf.id_to_token(i) for i in tokenizer.encode("x  12\n\n3")]
    assert tokens == ["x", "ĠĠ", "1", "2", "ĊĊ", "3"]


def test_lone_surrogates_encode_as_the_replacement_character(tokenizer):
    # JSON's "\ud800" decodes to a lone surrogate, which is not a character: read as U+FFFD, not a 500.
    assert tokenizer.encode("a\ud800b") == tokenizer.encode("a\ufffdb")
    assert tokenizer.encode_special_tokens_as_text("\udfff<|im_end|>") == \
        tokenizer.encode_special_tokens_as_text("\ufffd<|im_end|>")


def test_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.eos_token_ids == frozenset({2, 0})  # <|endoftext|> ends generation too, as in llama.cpp
    assert tokenizer.encode("<|im_start|>hi<|im_end|>") == [1, tokenizer.hf.token_to_id("hi"), 2]
    assert tokenizer.is_special(2)
    assert not tokenizer.is_special(tokenizer.hf.token_to_id("hi"))
    assert tokenizer.decode([1, tokenizer.hf.token_to_id("hi"), 2]) == "hi"  # skips specials by default


def test_smollm_adds_no_bos(tokenizer, converted_dir):
    assert json.loads((converted_dir / "tokenizer_config.json").read_text())["add_bos_token"] is False
    assert tokenizer.encode("hi") == [tokenizer.hf.token_to_id("hi")]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, reference, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_smollm_template_does_not_take_tools(tokenizer):
    assert tokenizer.chat_template is not None
    assert tokenizer.template_supports_tools is False


# Small hand-built tokenizers for the template and BOS rules.
def _tiny_hf(post_processor=None) -> tokenizers.Tokenizer:
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    hf = tokenizers.Tokenizer(models.BPE(vocab, [("a", "b")]))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<s>", "</s>"])
    if post_processor is not None:
        hf.post_processor = post_processor
    return hf


def _tiny(chat_template: str | None = None, **config) -> Tokenizer:
    return Tokenizer(_tiny_hf(), {"bos_token": "<s>", "eos_token": "</s>", **config}, chat_template=chat_template)


def test_add_bos_token_prepends_bos_once():
    assert _tiny(add_bos_token=True).encode("ab") == [0, 4]
    assert _tiny(add_bos_token=True).encode("ab", add_special_tokens=False) == [4]
    assert _tiny().encode("ab") == [4]
    # A tokenizer.json whose post-processor inserts BOS already: no second one.
    template = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = Tokenizer(_tiny_hf(template), {"bos_token": "<s>", "add_bos_token": True})
    assert tokenizer.encode("ab") == [0, 4]


def test_template_environment_matches_transformers():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}{{ tools | tojson(indent=2) }}|{{ extra }}|{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}<gen>{% endif %}"
    )
    tokenizer = _tiny(template)
    messages = [{"role": "user", "content": "<b>&'é</b>"}]
    tools = [{"name": "f"}]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, extra="x")
    assert rendered == (
        '<s>{"role": "user", "content": "<b>&\'é</b>"}\n' + json.dumps(tools, indent=2) + "|x|4<gen>"
    )
    assert tokenizer.template_supports_tools
    with pytest.raises(ValueError, match="no bad roles"):
        tokenizer.apply_chat_template([{"role": "bad", "content": ""}])


def test_template_trims_blocks_like_transformers():
    template = "{% for m in messages %}\n  {% if m %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}"
    assert _tiny(template).apply_chat_template([{"content": "a"}, {"content": "b"}]) == "a\nb\n"


def test_template_errors_are_value_errors():
    tokenizer = _tiny("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ValueError, match="chat template failed"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="not valid jinja"):
        _tiny("{% for %}")


def test_a_model_without_a_chat_template_is_templated_as_chatml_as_llama_cpp_does():
    tokenizer = _tiny()
    assert tokenizer.chat_template_is_fallback
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not _tiny("{{ messages[0]['content'] }}").chat_template_is_fallback


def _write_tiny_dir(model_dir: Path, tokenizer_config: dict, generation_config: dict | None = None) -> None:
    _tiny_hf().save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (model_dir / "generation_config.json").write_text(json.dumps(generation_config))


def test_from_dir_reads_generation_config_and_template_file(tmp_path):
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "from config"}
    _write_tiny_dir(tmp_path, config, {"eos_token_id": [1, 3]})
    (tmp_path / "chat_template.jinja").write_text("from file")
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.eos_token_ids == frozenset({1, 3})
    assert tokenizer.apply_chat_template([]) == "from file"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json: not found") as exc:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(exc.value)


def test_invalid_tokenizer_config(tmp_path):
    _write_tiny_dir(tmp_path, {})
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as exc:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer_config.json") in str(exc.value)
