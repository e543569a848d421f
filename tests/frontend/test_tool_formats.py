"""Native tool-call formats with real chat templates (tests/fixtures/chat_templates, as the
models ship them) on a real tokenizer (the default model's): the format each template is
read in, tools and earlier calls and results rendered as transformers renders them, the
grammar that tool_choice "required" compiles to, and a reply marked with special tokens
decoded and parsed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from tokenway.frontend.chat import build_chat_prompt, mistral_id, render_native_messages, tool_format
from tokenway.frontend.output import RequestState
from tokenway.frontend.structured_output import StructuredOutputManager
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.frontend.tool_parsers import ReplyFormat
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams, StructuredOutputSpec

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
FORMATS = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja": "qwen3_coder",
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
RESULT = json.dumps({"temperature_c": 21, "sky": "soleggiato ☀"}, ensure_ascii=False)


@pytest.fixture(scope="module")
def base(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def with_template(base: Tokenizer, name: str, special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    hf = tokenizers.Tokenizer.from_str(base.hf.to_str())
    if special_tokens:
        hf.add_special_tokens(list(special_tokens))
    return Tokenizer(hf, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
                     chat_template=(TEMPLATES / name).read_text(), source=name)


def conversation(call_id: str = "call_4f1c2a9b8e7d6c5b4a3f2e1d") -> list[dict]:
    return [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Rome and Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "days": 2})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_template_is_read_in_its_own_format(base, name):
    tokenizer = with_template(base, name)
    assert tokenizer.template_supports_tools
    assert tool_format(tokenizer) == FORMATS[name]
    assert tool_format(tokenizer, "generic") == "generic"  # --tool-parser wins
    with pytest.raises(ValueError, match="expected one of"):
        tool_format(tokenizer, "xml")


def test_a_template_without_tools_gets_the_generic_format(base):
    assert not base.template_supports_tools and tool_format(base) == "generic"


@pytest.mark.parametrize("name", list(FORMATS))
def test_tools_calls_and_results_render_as_the_template_writes_them(base, name):
    tokenizer = with_template(base, name)
    fmt = FORMATS[name]
    prompt = build_chat_prompt(tokenizer, conversation(), [WEATHER, TIME], "auto")
    text = tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=False)
    # Qwen3-Coder's parser types each value by its tool's schema.
    assert prompt.reply_format == ReplyFormat(fmt, tools=(WEATHER, TIME) if fmt == "qwen3_coder" else ())
    assert prompt.json_schema is None
    # auto: only Hermes's and Qwen3-Coder's calls are held to the schemas
    assert (prompt.grammar is not None) == (fmt in ("hermes", "qwen3_coder"))
    names = ("<name>get_weather</name>", "<name>get_time</name>") if fmt == "qwen3_coder" else \
        ('"get_weather"', '"get_time"')
    assert all(name in text for name in names) and "The weather in a city" in text  # the tools
    assert RESULT in text  # the result, as the tool gave it
    call = {"hermes": '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}',
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
            "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}, '
                       f'"id": "{mistral_id("call_4f1c2a9b8e7d6c5b4a3f2e1d")}"}}]',
            "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                           "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"}[fmt]
    assert call in text  # the earlier call in the model's own format, its arguments an object
    marks = {"hermes": ["<tool_response>"], "llama3_json": ["ipython"], "mistral": ["[TOOL_RESULTS]"],
             "qwen3_coder": ["<tool_response>"]}[fmt]
    assert all(mark in text for mark in marks)  # the result as a result, not as a user turn
    # As transformers renders the same messages with the same template.
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
    from tokenway.frontend.chat import normalize_messages
    messages = render_native_messages(normalize_messages(conversation()), fmt)
    expected = reference.apply_chat_template(messages, tools=[WEATHER, TIME], chat_template=tokenizer.chat_template,
                                             tokenize=False, add_generation_prompt=True,
                                             bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert tokenizer.apply_chat_template(messages, tools=[WEATHER, TIME]) == expected


def test_mistral_ids_are_nine_characters_and_match_between_call_and_result():
    assert mistral_id("a1b2c3d4e") == "a1b2c3d4e"
    mapped = mistral_id("call_4f1c2a9b8e7d6c5b4a3f2e1d")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == mistral_id("call_4f1c2a9b8e7d6c5b4a3f2e1d")
    rendered = render_native_messages(conversation(), "mistral")
    assert rendered[2]["tool_calls"][0]["id"] == rendered[3]["tool_call_id"] == mapped


def test_llama3_parallel_calls_render_as_one_call_a_turn(base):
    tokenizer = with_template(base, "meta-llama-Llama-3.1-8B-Instruct.jinja")
    messages = conversation()
    messages[2]["tool_calls"].append({"id": "call_2", "type": "function",
                                      "function": {"name": "get_time", "arguments": "{\"zone\": \"CET\"}"}})
    messages.append({"role": "tool", "tool_call_id": "call_2", "content": "12:00"})
    text = tokenizer.decode(build_chat_prompt(tokenizer, messages, [WEATHER, TIME]).prompt_token_ids,
                            skip_special_tokens=False)  # the template refuses two calls in one turn
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text


@pytest.mark.parametrize("name,reply", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]'),
])
def test_required_compiles_to_a_grammar_of_the_formats_calls(base, name, reply):
    tokenizer = with_template(base, name)
    manager = StructuredOutputManager(base, base.vocab_size, [base.eos_token_id])
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        prompt = build_chat_prompt(tokenizer, conversation()[:2], [WEATHER, TIME], choice, parallel_tool_calls=False)
        spec = StructuredOutputSpec(kind="grammar", grammar=prompt.grammar)
        matcher = manager.new_matcher(spec)
        for token_id in base.encode(reply, add_special_tokens=False):
            assert matcher.accept_token(token_id), (choice, base.decode([token_id]))
        assert matcher.accept_token(base.eos_token_id) or matcher.is_finished()
    # A named function allows that function only.
    named = build_chat_prompt(tokenizer, conversation()[:2], [WEATHER, TIME],
                              {"type": "function", "function": {"name": "get_time"}})
    matcher = manager.new_matcher(StructuredOutputSpec(kind="grammar", grammar=named.grammar))
    assert not all(matcher.accept_token(t) for t in base.encode(reply, add_special_tokens=False))


@pytest.mark.parametrize("name,special,reply,needs_special", [
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", ("[TOOL_CALLS]",),
     'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich"}}]', True),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", ("<|python_tag|>",),
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}', False),
])
def test_a_call_marked_by_a_special_token_is_read_from_the_decoded_stream(base, name, special, reply,
                                                                          needs_special):
    tokenizer = with_template(base, name, special)
    token_ids = tokenizer.encode(reply, add_special_tokens=False)
    assert tokenizer.hf.token_to_id(special[0]) in token_ids  # one token, as in the real tokenizer
    prompt = build_chat_prompt(tokenizer, conversation()[:2], [WEATHER])
    assert prompt.reply_format.keeps_special_tokens  # the server decodes them for this format
    call = [("get_weather", {"city": "Zürich"})]
    for skip_special_tokens, found in ((False, call), (True, [] if needs_special else call)):
        state = RequestState("r", None, [1], SamplingParams(skip_special_tokens=skip_special_tokens), tokenizer)
        parser = prompt.reply_format.parser()
        content = []
        for i, token_id in enumerate(token_ids):
            finish_reason = "stop" if i == len(token_ids) - 1 else None
            out = state.process(EngineOutput("r", [token_id], finish_reason=finish_reason))
            content.append(parser.feed(out.outputs[0].delta_text).content)
        content.append(parser.finish().content)
        assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls()] == found
        if not skip_special_tokens:
            assert "".join(content) == reply.split(special[0])[0]


def test_auto_in_the_hermes_format_leaves_text_free_and_holds_calls_to_the_schemas(base):
    tokenizer = with_template(base, "Qwen-Qwen2.5-7B-Instruct.jinja")
    manager = StructuredOutputManager(base, base.vocab_size, [base.eos_token_id])
    prompt = build_chat_prompt(tokenizer, conversation()[:2], [WEATHER, TIME], "auto")
    spec = StructuredOutputSpec(kind="grammar", grammar=prompt.grammar)
    for reply, allowed in [
        ("It is sunny in Rome, 21 °C {not a call} <b>bold</b>.", True),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": 21}}\n</tool_call>', False),  # not its schema
        ('<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>', False),  # no such tool
    ]:
        matcher = manager.new_matcher(spec)
        assert all(matcher.accept_token(t) for t in base.encode(reply, add_special_tokens=False)) == allowed, reply


# pydantic writes nested models as "$defs" with "#/$defs/..." references, and a recursive
# model refers to "#": both mean the parameters' own root, wherever the call nests them.
ORDER = {"type": "function", "function": {"name": "place_order", "parameters": {
    "type": "object", "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                          "qty": {"type": "integer"}},
                                         "required": ["sku", "qty"], "additionalProperties": False}},
    "properties": {"item": {"$ref": "#/$defs/Item"}, "then": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
    "required": ["item", "then"], "additionalProperties": False}}}
ORDER_ARGUMENTS = {"item": {"sku": "A1", "qty": 2}, "then": {"item": {"sku": "B2", "qty": 1}, "then": None}}


@pytest.mark.parametrize("name,reply,bad", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", '<tool_call>\n{{"name": "place_order", "arguments": {}}}\n</tool_call>',
     '<tool_call>\n{{"name": "place_order", "arguments": {}}}\n</tool_call>'),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", '{{"name": "place_order", "parameters": {}}}',
     '{{"name": "place_order", "parameters": {}}}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", '[TOOL_CALLS][{{"name": "place_order", "arguments": {}}}]',
     '[TOOL_CALLS][{{"name": "place_order", "arguments": {}}}]'),
    ("generic", '{{"tool_calls": [{{"name": "place_order", "arguments": {}}}]}}',
     '{{"tool_calls": [{{"name": "place_order", "arguments": {}}}]}}'),
])
def test_tool_parameters_with_references_constrain_calls_in_every_format(base, name, reply, bad):
    tokenizer = base if name == "generic" else with_template(base, name)
    manager = StructuredOutputManager(base, base.vocab_size, [base.eos_token_id])
    prompt = build_chat_prompt(tokenizer, conversation()[:2], [WEATHER, ORDER], "required", parallel_tool_calls=False)
    spec = (StructuredOutputSpec.json_schema(prompt.json_schema) if name == "generic"
            else StructuredOutputSpec(kind="grammar", grammar=prompt.grammar))
    good_text = reply.format(json.dumps(ORDER_ARGUMENTS))
    wrong = {"item": {"sku": "A1", "qty": "two"}, "then": None}  # qty is no integer: Item's schema holds
    for text, allowed in ((good_text, True), (bad.format(json.dumps(wrong)), False)):
        matcher = manager.new_matcher(spec)
        assert all(matcher.accept_token(t) for t in base.encode(text, add_special_tokens=False)) == allowed, text


def test_a_tool_no_arguments_can_satisfy_is_refused_naming_it(base):
    from tokenway.frontend.prompt_check import PromptChecker

    checker = PromptChecker(base.vocab_size, 8192, StructuredOutputManager(base, base.vocab_size,
                                                                           [base.eos_token_id]))
    checker.check_tools([WEATHER, ORDER])  # fine
    never = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    with pytest.raises(ValueError, match=r"^tools\[2\]\.function\.parameters: the parameters of tool 'f'"):
        checker.check_tools([WEATHER, ORDER, never])


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct.jinja", "generic"])
def test_tool_choice_none_leaves_the_tools_out_and_keeps_the_response_format(base, name):
    tokenizer = base if name == "generic" else with_template(base, name)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    messages = conversation()[:2]
    prompt = build_chat_prompt(tokenizer, messages, [WEATHER], "none", response_format=response_format)
    assert prompt.reply_format is None and prompt.grammar is None
    assert prompt.json_schema == schema
    assert prompt.prompt_token_ids == build_chat_prompt(tokenizer, messages).prompt_token_ids
    with_tools = build_chat_prompt(tokenizer, messages, [WEATHER], "auto", response_format=response_format)
    assert with_tools.reply_format is not None  # tools win over the response_format
    assert with_tools.prompt_token_ids != prompt.prompt_token_ids
