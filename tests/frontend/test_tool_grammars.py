"""The native formats' grammars whatever kind of token their markers are: spelled out of the
vocabulary (the default model's tokenizer), user-defined added tokens (Qwen2.5's <tool_call>, as
llama.cpp's converter writes it) or control tokens (Mistral's [TOOL_CALLS]). Each reply is walked
as the engine walks it (the mask allows each token, the matcher takes it), then decoded as the
server decodes it for the format and parsed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers

from tokenway.frontend.chat import build_chat_prompt
from tokenway.frontend.output import RequestState
from tokenway.frontend.structured_output import StructuredOutputManager, allowed_tokens
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.frontend.tool_grammars import native_call_grammar, qwen3_coder_auto_grammar
from tokenway.frontend.tool_parsers import MARKERS, ReplyFormat
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams, StructuredOutputSpec

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
FORMAT_TEMPLATES = {
    "hermes": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama3_json": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}
KINDS = ("text", "user_defined", "control")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
FORCED_REPLIES = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
}
AUTO_REPLIES = {**FORCED_REPLIES,
                "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'}
ASK = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def base(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def models(base) -> dict[tuple[str, str], tuple[Tokenizer, StructuredOutputManager]]:
    """(format, marker kind) -> its tokenizer and grammar manager: one vocabulary per kind, the
    template per format."""
    built = {}
    for kind in KINDS:
        hf = tokenizers.Tokenizer.from_str(base.hf.to_str())
        markers = [tokenizers.AddedToken(text, special=kind == "control", normalized=False)
                   for fmt in FORMAT_TEMPLATES for text in MARKERS[fmt]]
        if kind == "user_defined":
            hf.add_tokens(markers)  # as gguf_tokenizer.py adds llama.cpp's USER_DEFINED tokens
        elif kind == "control":
            hf.add_special_tokens(markers)
        vocab = Tokenizer(hf, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
        manager = StructuredOutputManager(vocab, vocab.vocab_size, [vocab.eos_token_id])
        for fmt, name in FORMAT_TEMPLATES.items():
            tokenizer = Tokenizer(hf, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
                                  chat_template=(TEMPLATES / name).read_text(), source=name)
            built[fmt, kind] = tokenizer, manager
    return built


def walk(manager: StructuredOutputManager, grammar: str, token_ids: list[int]) -> bool:
    """Whether the grammar lets the engine sample every token in turn: each allowed by the mask
    and taken by the matcher."""
    matcher = manager.new_matcher(StructuredOutputSpec(kind="grammar", grammar=grammar))
    for token_id in token_ids:
        bitmask = manager.grammar_bitmask([matcher])
        assert bitmask is not None
        if not allowed_tokens(bitmask.bitmask, manager.vocab_size)[0, token_id] or not matcher.accept_token(token_id):
            return False
    return True


def read(tokenizer: Tokenizer, prompt, token_ids: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    """The reply decoded as the server decodes it for its format (ChatTemplating.skip_special_tokens),
    one token a step, and parsed: (content, calls)."""
    params = SamplingParams(skip_special_tokens=not prompt.reply_format.keeps_special_tokens)
    state = RequestState("r", None, [1], params, tokenizer)
    parser = prompt.reply_format.parser()
    content = []
    for position, token_id in enumerate(token_ids):
        finish_reason = "stop" if position == len(token_ids) - 1 else None
        out = state.process(EngineOutput("r", [token_id], finish_reason=finish_reason))
        content.append(parser.feed(out.outputs[0].delta_text).content)
    content.append(parser.finish().content)
    return "".join(content), [(call.name, json.loads(call.arguments)) for call in parser.tool_calls()]


def reply_ids(tokenizer: Tokenizer, fmt: str, kind: str, reply: str) -> list[int]:
    token_ids = tokenizer.encode(reply, add_special_tokens=False)
    marker_ids = [tokenizer.added_token_id(text) for text in MARKERS[fmt] if text in reply]
    if kind == "text":
        assert marker_ids == [None] * len(marker_ids)
    else:  # each marker is one token of the reply, as the model writes it
        assert all(token_id in token_ids for token_id in marker_ids)
    return token_ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", list(FORMAT_TEMPLATES))
def test_forced_and_named_calls_complete_whatever_their_markers_are(models, fmt, kind):
    tokenizer, manager = models[fmt, kind]
    token_ids = reply_ids(tokenizer, fmt, kind, FORCED_REPLIES[fmt])
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        prompt = build_chat_prompt(tokenizer, ASK, [WEATHER, TIME], choice, parallel_tool_calls=False)
        assert walk(manager, prompt.grammar, token_ids), choice
        matcher = manager.new_matcher(StructuredOutputSpec(kind="grammar", grammar=prompt.grammar))
        assert all(matcher.accept_token(token_id) for token_id in token_ids) and matcher.is_finished
        assert read(tokenizer, prompt, token_ids) == ("", [("get_weather", {"city": "Rome"})])
    named = build_chat_prompt(tokenizer, ASK, [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert not walk(manager, named.grammar, token_ids)  # a named function allows that one only


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", list(FORMAT_TEMPLATES))
def test_auto_calls_are_read_whatever_their_markers_are(models, fmt, kind):
    tokenizer, manager = models[fmt, kind]
    prompt = build_chat_prompt(tokenizer, ASK, [WEATHER, TIME], "auto")
    # Special tokens are kept in the text exactly where a marker is one.
    assert prompt.reply_format.keeps_special_tokens == (kind == "control")
    text = "Let me check." + ("\n" if fmt == "hermes" else "")
    token_ids = tokenizer.encode(text, add_special_tokens=False) + reply_ids(tokenizer, fmt, kind, AUTO_REPLIES[fmt])
    if fmt != "hermes":  # the other formats' calls are free under auto
        assert prompt.grammar is None
        assert read(tokenizer, prompt, reply_ids(tokenizer, fmt, kind, AUTO_REPLIES[fmt]))[1] == \
            [("get_weather", {"city": "Rome"})]
        return
    assert walk(manager, prompt.grammar, token_ids)
    assert read(tokenizer, prompt, token_ids) == ("Let me check.", [("get_weather", {"city": "Rome"})])
    # Text stays free; a call, however its tag is written, is held to the schemas.
    assert walk(manager, prompt.grammar, tokenizer.encode("Sunny, 21 °C <b>{not a call}</b>.",
                                                          add_special_tokens=False))
    for bad in ('{"name": "get_weather", "arguments": {"city": 21}}', '{"name": "get_stock", "arguments": {}}'):
        bad_ids = reply_ids(tokenizer, fmt, kind, f"<tool_call>\n{bad}\n</tool_call>")
        assert not walk(manager, prompt.grammar, bad_ids), bad


# Qwen3-Coder's XML calls: its markers are Hermes's (<tool_call>, </tool_call>), so the Hermes
# vocabularies serve; the grammar is asked for directly (the format the template picks is chat.py's).
TYPED = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Rome", "Paris"]}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "note": {"type": "string"}, "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                                          "required": ["lat"]}},
    "required": ["city", "days"]}}}
QWEN3_CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n<parameter=note>\nif a < b:\n    return '<p>'\n</parameter>\n<parameter=where>\n"
                    '{"lat": 41.9}\n</parameter>\n</function>\n</tool_call>')


@pytest.mark.parametrize("kind", KINDS)
def test_qwen3_coder_forced_calls_hold_each_value_to_its_type(models, kind):
    tokenizer, manager = models["hermes", kind]
    eos = [tokenizer.eos_token_id]
    token_ids = reply_ids(tokenizer, "qwen3_coder", kind, QWEN3_CODER_CALL)
    reply_format = ReplyFormat("qwen3_coder", keeps_special_tokens=kind == "control", tools=(TYPED, TIME))
    want = [("get_weather", {"city": "Rome", "days": 3, "note": "if a < b:\n    return '<p>'", "where": {"lat": 41.9}})]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        one = native_call_grammar(tokenizer, "qwen3_coder", [TYPED, TIME], choice, parallel_tool_calls=False)
        assert walk(manager, one, token_ids), choice
        matcher = manager.new_matcher(StructuredOutputSpec(kind="grammar", grammar=one))
        assert all(matcher.accept_token(token_id) for token_id in token_ids) and matcher.is_finished
        assert read(tokenizer, SimpleNamespace(reply_format=reply_format), token_ids) == ("", want)
    grammar = native_call_grammar(tokenizer, "qwen3_coder", [TYPED, TIME], "required", parallel_tool_calls=True)
    second = "\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
    assert walk(manager, grammar, token_ids + reply_ids(tokenizer, "qwen3_coder", kind, second) + eos)
    for bad in (QWEN3_CODER_CALL.replace("\n3\n", "\nthree\n"),  # an integer
                QWEN3_CODER_CALL.replace("Rome", "Oslo"),  # not in the enum
                QWEN3_CODER_CALL.replace("<parameter=city>\nRome\n</parameter>\n", ""),  # a required one left out
                QWEN3_CODER_CALL.replace('"lat": 41.9', '"lat": "N"'),  # the object's schema
                QWEN3_CODER_CALL.replace("return '<p>'", "</function>"),  # a tag that would end the value
                QWEN3_CODER_CALL.replace("get_weather", "get_stock")):
        assert not walk(manager, grammar, reply_ids(tokenizer, "qwen3_coder", kind, bad) + eos), bad
    named = native_call_grammar(tokenizer, "qwen3_coder", [TYPED, TIME], {"type": "function", "function": {
        "name": "get_time"}}, parallel_tool_calls=False)
    assert not walk(manager, named, token_ids)  # a named function allows that one only


@pytest.mark.parametrize("kind", KINDS)
def test_qwen3_coder_auto_calls_are_held_to_the_tools_text_is_free(models, kind):
    tokenizer, manager = models["hermes", kind]
    grammar = qwen3_coder_auto_grammar(tokenizer, [TYPED, TIME])
    reply_format = ReplyFormat("qwen3_coder", keeps_special_tokens=kind == "control", tools=(TYPED, TIME))
    token_ids = tokenizer.encode("Let me check.\n", add_special_tokens=False) + \
        reply_ids(tokenizer, "qwen3_coder", kind, QWEN3_CODER_CALL)
    assert walk(manager, grammar, token_ids)
    assert read(tokenizer, SimpleNamespace(reply_format=reply_format), token_ids) == ("Let me check.", [
        ("get_weather", {"city": "Rome", "days": 3, "note": "if a < b:\n    return '<p>'", "where": {"lat": 41.9}})])
    assert walk(manager, grammar, tokenizer.encode("Sunny, 21 °C <b>{not a call}</b> <function=x>.",
                                                   add_special_tokens=False))
    for bad in (QWEN3_CODER_CALL.replace("\n3\n", "\nthree\n"), QWEN3_CODER_CALL.replace("get_weather", "get_stock")):
        assert not walk(manager, grammar, reply_ids(tokenizer, "qwen3_coder", kind, bad)), bad
