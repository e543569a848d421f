"""The tool-call parsers: replies in each format, split every way a stream can split them,
give the same content and calls as the whole reply; calls stream as they form (name first,
then argument fragments); a call cut short is no call, and no format text leaks."""

from __future__ import annotations

import json
import random

import pytest

from tokenway.frontend.tool_parsers import ReplyFormat, ToolCallParser

NESTED = {"city": "Zürich", "when": {"days": [1, 2], "tz": "Europe/Zurich"}, "note": 'say "hi" \\ ☕ 😀'}


def parse(fmt: str, text: str, chunks: list[int] | None = None, max_calls: int | None = None):
    """Feed `text` in pieces of the given sizes (default: whole); return what a stream sees
    (content, calls folded from their pieces, the order pieces came in) and the parser."""
    parser = ReplyFormat(fmt, max_calls=max_calls).parser()
    content, calls, order = [], {}, []
    position, sizes = 0, iter(chunks or [len(text)])
    deltas = []
    while position < len(text):
        size = next(sizes, len(text))
        deltas.append(parser.feed(text[position:position + size]))
        position += size
    deltas.append(parser.finish())
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.calls:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = piece.id, piece.name
            else:
                assert call["id"] is not None, "a call's first piece carries its id and name"
            call["arguments"] += piece.arguments
            order.append(piece.index)
    return "".join(content), list(calls.values()), parser


def completed(parser: ToolCallParser) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.tool_calls()]


def splits(text: str, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] * len(text), [2] * len(text), [3] * len(text)] + [
        [rng.randint(1, 9) for _ in range(len(text))] for _ in range(6)]


def call_json(name: str, arguments: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False)


REPLIES = {
    "generic": [
        ('{"tool_calls": [' + call_json("get_weather", {"city": "Rome"}) + ", " + call_json("plan", NESTED) + "]}",
         "", [("get_weather", {"city": "Rome"}), ("plan", NESTED)]),
        (json.dumps({"response": 'Bonjour, ça va ? "quoted" \\ \n ☕ 😀'}),
         'Bonjour, ça va ? "quoted" \\ \n ☕ 😀', []),
        (json.dumps({"response": "😀 ok"}, ensure_ascii=True), "😀 ok", []),  # \ud83d\ude00: a surrogate pair
    ],
    "hermes": [
        ("Let me look that up.\n\n<tool_call>\n" + call_json("get_weather", {"city": "Rome"}) + "\n</tool_call>\n"
         "<tool_call>\n" + call_json("plan", NESTED) + "\n</tool_call>",
         "Let me look that up.", [("get_weather", {"city": "Rome"}), ("plan", NESTED)]),
        ("<tool_call>\n" + call_json("plan", NESTED) + "\n</tool_call>", "", [("plan", NESTED)]),
        ("A < b and <tool> is no tag; 2 <tool_ca are not either.", "A < b and <tool> is no tag; 2 <tool_ca are not "
         "either.", []),
        # arguments before the name, and arguments as a string holding the object
        ('<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
         '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Bergen\\"}"}\n</tool_call>', "",
         [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]),
    ],
    "llama3_json": [
        (call_json("get_weather", {"city": "Rome"}, "parameters"), "", [("get_weather", {"city": "Rome"})]),
        ("<|python_tag|>" + call_json("get_weather", {"city": "Rome"}, "parameters") + "; "
         + call_json("plan", NESTED, "parameters"), "", [("get_weather", {"city": "Rome"}), ("plan", NESTED)]),
        ("It is sunny in Rome today.", "It is sunny in Rome today.", []),
        ('{"type": "object"} is a JSON object.', '{"type": "object"} is a JSON object.', []),
    ],
    "mistral": [
        ("Sure.[TOOL_CALLS][" + call_json("get_weather", {"city": "Rome"}) + ', {"name": "plan", "arguments": '
         + json.dumps(NESTED, ensure_ascii=False) + ', "id": "a1b2c3d4e"}]', "Sure.",
         [("get_weather", {"city": "Rome"}), ("plan", NESTED)]),
        ("[TOOL_CALLS]get_weather[ARGS]" + json.dumps({"city": "Rome"}) + "[TOOL_CALLS]plan[ARGS]"
         + json.dumps(NESTED, ensure_ascii=False), "", [("get_weather", {"city": "Rome"}), ("plan", NESTED)]),
        ("No tools needed [TOOL here].", "No tools needed [TOOL here].", []),
    ],
}
CASES = [(fmt, *case) for fmt, cases in REPLIES.items() for case in cases]


@pytest.mark.parametrize("fmt,reply,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_reply_split_any_way_parses_as_the_whole(fmt, reply, content, calls):
    whole_content, whole_calls, parser = parse(fmt, reply)
    assert whole_content == content
    assert completed(parser) == calls
    assert [(c["name"], json.loads(c["arguments"])) for c in whole_calls] == calls
    assert parser.complete
    for chunks in splits(reply):
        streamed_content, streamed_calls, streamed = parse(fmt, reply, chunks)
        assert streamed_content == content
        # The fragments joined are the arguments exactly as the model wrote them.
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == \
            [(c.name, c.arguments) for c in streamed.tool_calls()]
        assert completed(streamed) == calls
    ids = [c.id for c in parser.tool_calls()]
    assert len(set(ids)) == len(ids)
    if fmt == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)  # what Mistral's templates accept back
    else:
        assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("fmt", list(REPLIES))
def test_a_call_streams_as_it_forms(fmt):
    reply = REPLIES[fmt][0][0]
    parser = ReplyFormat(fmt).parser()
    name_at = reply.index("get_weather") + len("get_weather") + 1
    first = parser.feed(reply[:name_at + 1])
    opening = [p for p in first.calls if p.id is not None]
    assert [p.name for p in opening] == ["get_weather"], "the name goes out as soon as it is whole"
    arguments_at = reply.index('"Rome"') + 3
    fragments = parser.feed(reply[name_at + 1:arguments_at])
    assert '"Ro' in "".join(p.arguments for p in fragments.calls), "arguments go out before the call ends"


@pytest.mark.parametrize("fmt,reply,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_cut_keeps_the_calls_completed_and_leaks_no_format_text(fmt, reply, content, calls):
    for cut in range(len(reply)):
        cut_content, streamed, parser = parse(fmt, reply[:cut], [3] * cut)
        kept = completed(parser)
        assert kept == calls[:len(kept)], "the calls before the cut, whole"
        for leak in ('"tool_calls"', '{"name"', "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]",
                     "<|python_tag|>", '"response"'):
            if leak not in content:
                assert leak not in cut_content, (cut, cut_content)
        if not calls:
            assert content.startswith(cut_content.rstrip()) or fmt == "llama3_json", (cut, cut_content)
        if len(kept) < len([c for c in streamed if c["name"]]):
            assert not parser.complete  # a call was begun and cut: the trace says so


def test_parallel_tool_calls_false_keeps_one_call():
    reply = REPLIES["hermes"][0][0]
    content, streamed, parser = parse("hermes", reply, [4] * len(reply), max_calls=1)
    assert completed(parser) == [("get_weather", {"city": "Rome"})]
    assert [c["name"] for c in streamed] == ["get_weather"], "the second call is not even streamed"


def test_blank_text_between_and_after_calls_is_not_content():
    reply = "<tool_call>\n" + call_json("a", {}) + "\n</tool_call>\n\n<tool_call>\n" + call_json("b", {}) + \
            "\n</tool_call>\n"
    content, _, parser = parse("hermes", reply, [1] * len(reply))
    assert content == "" and [c.name for c in parser.tool_calls()] == ["a", "b"]


def test_a_malformed_call_is_dropped_and_text_after_it_still_reads():
    reply = "<tool_call>\n{not json}\n</tool_call>Fine.<tool_call>\n" + call_json("b", {"x": 1}) + "\n</tool_call>"
    content, _, parser = parse("hermes", reply, [2] * len(reply))
    assert content == "Fine." and completed(parser) == [("b", {"x": 1})]


def test_a_call_without_arguments_gets_an_empty_object():
    content, streamed, parser = parse("hermes", '<tool_call>\n{"name": "ping"}\n</tool_call>')
    assert completed(parser) == [("ping", {})] and streamed[0]["arguments"] == "{}"
