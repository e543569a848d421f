"""Qwen3-Coder's XML tool calls (tool_parser_qwen3_coder.py): calls as its real chat template
writes them read back as the arguments they were, typed by the tools' schemas; any reply split
at any characters gives the same content and calls, the arguments streaming as they form; values
converted with vLLM's fallbacks; a cut or malformed call is no call and leaks no format text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenway.frontend.tokenizer import Tokenizer
from tokenway.frontend.tool_parser_qwen3_coder import (
    parameter_types,
    parameter_value,
    schema_type,
    writes_qwen3_coder_calls,
)
from tokenway.frontend.tool_parsers import ReplyFormat, ToolCallParser

TEMPLATE = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates" / \
    "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja"
EDIT = {"type": "function", "function": {"name": "edit_file", "description": "Edit a file", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
        "dry_run": {"type": "boolean"}, "options": {"type": "object"}, "lines": {"type": "array"},
        "owner": {"type": ["string", "null"]}, "code": {"type": "string"}},
    "required": ["path"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = (EDIT, TIME)
CODE = 'def f(a, b):\n    if a < b and b > 0:\n        return "<p>" + a\n    return None\n'
EDIT_ARGUMENTS = {"path": "src/main.py", "line": 42, "scale": 2.5, "dry_run": True,
                  "options": {"indent": 4, "tabs": False}, "lines": [1, 2, 3], "owner": "Zoë ☕", "code": CODE}
# The tags of the format, which no content may hold unless the reply's text does.
TAGS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


def parse(text: str, cuts: list[int] | tuple[int, ...] = (), tools=TOOLS, max_calls: int | None = None):
    """Feed `text` split at the positions `cuts`; (content, the calls as a stream folds them, the
    parser)."""
    parser = ReplyFormat("qwen3_coder", tools=tuple(tools), max_calls=max_calls).parser()
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    deltas = [parser.feed(text[start:end]) for start, end in zip(bounds, bounds[1:])] + [parser.finish()]
    calls: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.calls:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = piece.id, piece.name
            else:
                assert call["id"] is not None, "a call's first piece carries its id and name"
            call["arguments"] += piece.arguments
    return "".join(d.content for d in deltas), list(calls.values()), parser


def completed(parser: ToolCallParser) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.tool_calls()]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return Tokenizer(hf, {}, chat_template=TEMPLATE.read_text(), source=TEMPLATE.name)


def rendered_calls(tokenizer: Tokenizer, calls: list[tuple[str, dict]], content: str = "") -> str:
    """The assistant turn the real template writes for these calls, between its <|im_start|>assistant
    and <|im_end|>: the reply the model was trained to write."""
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=list(TOOLS))
    return text.split("<|im_start|>assistant", 1)[1].rsplit("<|im_end|>", 1)[0]


def test_the_format_is_known_by_its_template():
    templates = TEMPLATE.parent
    assert writes_qwen3_coder_calls(TEMPLATE.read_text())
    # Hermes's <tool_call> JSON (Qwen2.5, Qwen3, Hermes 3) and the other formats are not it.
    assert not any(writes_qwen3_coder_calls(path.read_text()) for path in templates.glob("*.jinja") if path != TEMPLATE)


def test_the_template_shows_the_tools_and_the_format(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Go."}], tools=list(TOOLS))
    assert "<function>\n<name>edit_file</name>" in text and "<type>integer</type>" in text
    assert "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n" \
           "</parameter>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_calls_the_template_writes_read_back_as_their_arguments(tokenizer):
    reply = rendered_calls(tokenizer, [("edit_file", EDIT_ARGUMENTS), ("get_time", {})], "I will edit it.")
    assert reply.startswith("\nI will edit it.\n\n<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/main.py\n"
                            "</parameter>\n<parameter=line>\n42\n</parameter>\n")
    assert "<parameter=dry_run>\nTrue\n</parameter>" in reply  # a Python bool, as jinja's |string writes it
    for cuts in ([], list(range(len(reply))), list(range(0, len(reply), 7))):
        content, streamed, parser = parse(reply, cuts)
        assert content == "\nI will edit it."
        assert completed(parser) == [("edit_file", EDIT_ARGUMENTS), ("get_time", {})]
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in parser.tool_calls()]
        assert parser.complete
    # The arguments are the JSON text vLLM's json.dumps writes.
    assert parser.tool_calls()[0].arguments == json.dumps(EDIT_ARGUMENTS, ensure_ascii=False)
    assert parser.tool_calls()[1].arguments == "{}"
    assert all(c.id.startswith("call_") for c in parser.tool_calls())


# ---- any split gives the same calls (hypothesis) -------------------------------------------

# Text with the format's characters in it, that holds none of the tags that end a value.
_PIECES = [*'ab <>/=\n"\\nul☕parmetfunciol_', "null", "NULL", "</p", "<para", "</functio", "<tool_c"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=20).map("".join).filter(
    lambda text: not any(tag in text for tag in TAGS))
_VALUES = {
    "path": _TEXT, "code": _TEXT, "owner": _TEXT | st.sampled_from(["null", "NULL", "nul"]),
    "line": st.integers(-10**12, 10**12), "scale": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: x != int(x)),
    "dry_run": st.booleans(), "lines": st.lists(st.integers(0, 9), max_size=3),
    "options": st.dictionaries(st.sampled_from(["a", "é", "<b>"]), st.integers(0, 9) | st.text(max_size=3), max_size=2),
}
_EDIT_CALLS = st.fixed_dictionaries({}, optional=_VALUES).map(lambda arguments: ("edit_file", arguments))
_CALLS = st.lists(_EDIT_CALLS | st.just(("get_time", {})), min_size=1, max_size=3)


def expected(arguments: dict) -> dict:
    """The arguments as the parser types them: a string "null" (any case) is null, as in vLLM."""
    return {k: None if isinstance(v, str) and v.lower() == "null" else v for k, v in arguments.items()}


@settings(max_examples=150, deadline=None)
@given(calls=_CALLS, content=_TEXT, data=st.data())
def test_any_split_of_a_reply_gives_the_same_content_and_calls(tokenizer, calls, content, data):
    reply = rendered_calls(tokenizer, calls, content)
    whole_content, _, whole = parse(reply)
    want = [(name, expected(arguments)) for name, arguments in calls]
    assert completed(whole) == want
    cuts = data.draw(st.lists(st.integers(1, max(1, len(reply) - 1)), max_size=len(reply)))
    streamed_content, streamed, parser = parse(reply, cuts)
    assert streamed_content == whole_content
    assert not any(tag in streamed_content for tag in TAGS)
    assert [(c.name, c.arguments) for c in parser.tool_calls()] == [(c.name, c.arguments) for c in whole.tool_calls()]
    # The fragments joined are the arguments, in the stream and the reply alike.
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in parser.tool_calls()]


def test_every_character_boundary_gives_the_same_calls(tokenizer):
    reply = rendered_calls(tokenizer, [("edit_file", {**EDIT_ARGUMENTS, "owner": "null"}), ("get_time", {})], "Ok.")
    want = [("edit_file", {**EDIT_ARGUMENTS, "owner": None}), ("get_time", {})]
    for cut in range(1, len(reply)):
        content, streamed, parser = parse(reply, [cut])
        assert (content, completed(parser)) == ("\nOk.", want), cut


# ---- streaming as the call forms -----------------------------------------------------------

def test_the_name_then_each_value_streams_as_it_forms():
    parser = ReplyFormat("qwen3_coder", tools=TOOLS).parser()
    first = parser.feed("Sure.\n<tool_call>\n<function=edit_file>")
    assert first.content == "Sure."
    assert [(p.name, p.arguments) for p in first.calls] == [("edit_file", "{")], "the name as soon as it is whole"
    pieces = parser.feed("\n<parameter=code>\nif a <")
    assert "".join(p.arguments for p in pieces.calls) == '"code": "if a ', "a string streams; a '<' may open a tag"
    pieces = parser.feed(" b:\n")
    assert "".join(p.arguments for p in pieces.calls) == "< b:", "the newline may be the one before </parameter>"
    pieces = parser.feed("</parameter>\n<parameter=line>\n4")
    assert "".join(p.arguments for p in pieces.calls) == '", "line": ', "an integer waits for its end"
    pieces = parser.feed("2\n</parameter>\n<parameter=owner>\nnul")
    assert "".join(p.arguments for p in pieces.calls) == '42, "owner": ', "'nul' may still be null"
    pieces = parser.feed("ls\n</parameter>\n</function>\n</tool_call>")
    assert "".join(p.arguments for p in pieces.calls) == '"nulls"}'
    parser.finish()
    assert completed(parser) == [("edit_file", {"code": "if a < b:", "line": 42, "owner": "nulls"})]


def test_parallel_tool_calls_false_keeps_one_call():
    reply = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=edit_file>\n" \
            "<parameter=path>\na\n</parameter>\n</function>\n</tool_call>"
    content, streamed, parser = parse(reply, list(range(0, len(reply), 3)), max_calls=1)
    assert content == "" and completed(parser) == [("get_time", {})]
    assert [c["name"] for c in streamed] == ["get_time"], "the second call is not even streamed"


def test_an_anthropic_reply_format_writes_its_ids():
    parser = ReplyFormat("qwen3_coder", id_prefix="toolu_").parser()
    parser.feed("<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    parser.finish()
    assert parser.tool_calls()[0].id.startswith("toolu_")


# ---- schema-typed values -------------------------------------------------------------------

@pytest.mark.parametrize("text,kind,value", [
    ("Rome", "string", "Rome"), ("42", "string", "42"), ("null", "string", None), ("NULL", "integer", None),
    ("42", "integer", 42), ("-7", "int64", -7), ("4.5", "integer", "4.5"), ("forty", "integer", "forty"),
    ("2.5", "number", 2.5), ("3.0", "number", 3), ("1e3", "float", 1000), ("1e999", "number", "1e999"),
    ("nan", "number", "nan"), ("x", "number", "x"),
    ("true", "boolean", True), ("True", "boolean", True), ("FALSE", "bool", False), ("yes", "boolean", False),
    ('{"a": [1, 2]}', "object", {"a": [1, 2]}), ("{'a': True}", "object", {"a": True}), ("[1, 2]", "array", [1, 2]),
    ("(1, 2)", "array", [1, 2]), ("{1, 2}", "object", "{1, 2}"), ("not json", "object", "not json"),
    ("[NaN]", "array", "[NaN]"), ("[1]", "any", [1]), ("hello", "any", "hello"), ("None", "null", None),
])
def test_values_are_converted_as_vllm_converts_them(text, kind, value):
    converted = parameter_value(text, kind)
    assert converted == value and type(converted) is type(value)
    json.dumps(converted, allow_nan=False)  # always JSON


def test_the_type_comes_from_the_parameter_schema():
    assert [schema_type(s) for s in ({"type": "Integer "}, {"type": ["integer", "null"]}, {"type": ["null"]},
                                     {"anyOf": [{"type": "integer"}]}, {"$ref": "#/$defs/X"}, True)] == \
        ["integer", "integer", "null", "string", "string", "string"]
    bare = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
    assert parameter_types([EDIT, bare, {"type": "function"}])["get_time"] == {"zone": "string"}
    assert parameter_types([EDIT])["edit_file"]["owner"] == "string"


def test_values_of_unknown_tools_and_parameters_are_text():
    reply = "<tool_call>\n<function=edit_file>\n<parameter=line>\n5\n</parameter>\n<parameter=extra>\n6\n" \
            "</parameter>\n</function>\n</tool_call><tool_call>\n<function=unknown>\n<parameter=line>\n5\n" \
            "</parameter>\n</function>\n</tool_call>"
    assert completed(parse(reply)[2]) == [("edit_file", {"line": 5, "extra": "6"}), ("unknown", {"line": "5"})]
    assert completed(parse(reply, tools=())[2]) == [("edit_file", {"line": "5", "extra": "6"}),
                                                    ("unknown", {"line": "5"})]


def test_a_value_keeps_its_own_blank_lines():
    reply = "<tool_call>\n<function=edit_file>\n<parameter=code>\n\n  x = 1\n\n\n</parameter>\n</function>\n" \
            "</tool_call>"
    for cuts in ([], list(range(len(reply)))):
        assert completed(parse(reply, cuts)[2]) == [("edit_file", {"code": "\n  x = 1\n\n"})]


# ---- shapes vLLM also reads, malformed and cut calls ---------------------------------------

@pytest.mark.parametrize("reply,content,calls", [
    # no </parameter>: the next <parameter= or </function> ends a value
    ("<tool_call>\n<function=edit_file>\n<parameter=path>\na.py\n<parameter=line>\n3\n</function>\n</tool_call>",
     "", [("edit_file", {"path": "a.py", "line": 3})]),
    # no </function>: </tool_call> ends it
    ("<tool_call>\n<function=edit_file>\n<parameter=line>\n3\n</parameter>\n</tool_call>", "",
     [("edit_file", {"line": 3})]),
    # no <tool_call> around the function, and text after it
    ("Calling.\n<function=get_time>\n</function>\nDone.", "Calling.\nDone.", [("get_time", {})]),
    # two functions in one <tool_call>, and stray text between the tags dropped
    ("<tool_call>\nx <function=get_time>\n</function>\ny<function=edit_file>\njunk<parameter=line>\n1\n</parameter>"
     "\n</function>\n</tool_call>", "", [("get_time", {}), ("edit_file", {"line": 1})]),
    # a call that is no XML call (a Hermes JSON one) is dropped, and text after it still reads
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>Fine.<tool_call>\n<function=get_time>\n'
     "</function>\n</tool_call>", "Fine.", [("get_time", {})]),
    # no name
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "", []),
    # a parameter without a name is skipped, the call kept
    ("<tool_call>\n<function=edit_file>\n<parameter=>\nx\n</parameter>\n<parameter=line>\n2\n</parameter>\n"
     "</function>\n</tool_call>", "", [("edit_file", {"line": 2})]),
    # text that looks like the format but is none
    ("Use a < b, <tool> and <function f> in a <parameter list.", "Use a < b, <tool> and <function f> in a "
     "<parameter list.", []),
    ("Write <function=\nname> like so.", "Write <function=\nname> like so.", []),
])
def test_shapes_vllm_reads_and_malformed_calls(reply, content, calls):
    for cuts in ([], list(range(len(reply)))):
        got_content, _, parser = parse(reply, cuts)
        assert (got_content, completed(parser)) == (content, calls), cuts


@pytest.mark.parametrize("reply", [
    "Let me see.\n\n<tool_call>\n<function=edit_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=line>\n7\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    "<function=edit_file>\n<parameter=code>\nx < y\n</parameter>\n</function>",
])
def test_every_cut_keeps_the_calls_completed_and_leaks_no_format_text(reply):
    whole_content, _, whole = parse(reply)
    calls = completed(whole)
    for cut in range(len(reply)):
        content, streamed, parser = parse(reply[:cut], [3] * cut)
        kept = completed(parser)
        assert kept == calls[:len(kept)], "the calls before the cut, whole"
        assert not any(tag in content for tag in TAGS), (cut, content)
        # The text before the cut (with what the cut left of a tag, which is text then).
        assert content[:len(whole_content)] == whole_content[:len(content)], (cut, content)
        if len(kept) < len(streamed):
            assert not parser.complete, cut  # a call was begun and cut: the trace says so
