"""A Harmony reply read as it streams (harmony_parser.py): its channels as reasoning, content and
tool calls, the same however the reply is split, and the same channels openai-harmony's own parser
reads from the reply's o200k tokens."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.o200k import o200k_dir
from tokenway.frontend.harmony_parser import HarmonyParser, parse_header

ANALYSIS = "<|channel|>analysis<|message|>User asks the weather. Call get_weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}'


def read(chunks, **kwargs) -> tuple[str, str, list[tuple[str, str]], HarmonyParser]:
    """(reasoning, content, [(name, arguments)] as streamed, the parser) of a reply fed in chunks."""
    parser = HarmonyParser(**kwargs)
    reasoning, content, calls = [], [], {}
    for delta in [*(parser.feed(chunk) for chunk in chunks), parser.finish()]:
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        for piece in delta.calls:
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.name or ""
            call[1] += piece.arguments
    return "".join(reasoning), "".join(content), [tuple(calls[i]) for i in sorted(calls)], parser


def test_analysis_is_reasoning_and_final_is_content():
    reply = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
    reasoning, content, calls, parser = read([reply])
    assert (reasoning, content, calls) == ("User asks the weather. Call get_weather.", "It is 4.", [])
    assert parser.complete and parser.tool_calls() == []


@pytest.mark.parametrize("header", [
    "<|channel|>commentary to=functions.get_weather <|constrain|>json",  # as gpt-oss writes it
    " to=functions.get_weather<|channel|>commentary json",  # as the chat template renders it
    "<|channel|>analysis to=functions.get_weather<|constrain|>json",  # to a function from analysis
])
def test_a_call_is_a_tool_call_whichever_way_its_header_reads(header):
    reply = ANALYSIS + "<|start|>assistant" + header + '<|message|>{"city": "Rome"}'
    reasoning, content, calls, parser = read([reply])  # <|call|> is the engine's stop: not in the text
    assert calls == [("get_weather", '{"city": "Rome"}')] and content == ""
    assert [(c.name, c.arguments) for c in parser.tool_calls()] == calls and parser.complete


def test_arguments_stream_as_they_form():
    parser = HarmonyParser()
    parser.feed(ANALYSIS + CALL[:-10])
    delta = parser.feed(CALL[-10:])
    assert [p.arguments for p in delta.calls] == [CALL[-10:]] and not delta.calls[0].name


def test_a_call_cut_short_is_no_call():
    _, _, calls, parser = read([ANALYSIS + CALL[:-4]])
    assert calls == [("get_weather", '{"city":"Ro')]  # streamed as it came
    assert parser.tool_calls() == [] and not parser.complete


def test_a_preamble_is_content_and_a_builtin_tool_is_thinking():
    reply = ("<|channel|>commentary<|message|>Checking.<|end|>"
             "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|call|>")
    reasoning, content, calls, _ = read([reply])
    assert (reasoning, content, calls) == ('{"query": "x"}', "Checking.", [])


def test_messages_of_one_part_join_on_new_lines():
    reply = ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
             "<|start|>assistant<|channel|>final<|message|>three")
    assert read([reply])[:2] == ("one\ntwo", "three")


def test_a_reply_that_is_not_harmony_is_content():
    assert read(["Hello there,\nfriend"])[:3] == ("", "Hello there,\nfriend", [])
    assert read(["Hi"])[:3] == ("", "Hi", [])


def test_a_continued_final_answer_is_content():
    assert read([" more.<|return|>"], starts_in="final")[:2] == ("", " more.")


def test_max_calls_keeps_the_first():
    second = CALL.replace("get_weather", "get_time")
    _, _, calls, parser = read([CALL + "<|call|>" + second], max_calls=1)
    assert calls == [("get_weather", '{"city":"Rome"}')] and len(parser.tool_calls()) == 1


def test_reasoning_tokens_are_the_analysis_text_tokens():
    parser = HarmonyParser()
    for text in ("<|channel|>", "analysis", "<|message|>", "Think", "ing", "<|end|>", "<|start|>", "assistant",
                 "<|channel|>", "final", "<|message|>", "Done"):
        parser.feed(text, [0])
    parser.finish()
    assert parser.num_reasoning_tokens == 2


def test_headers_read_as_openai_harmony_reads_them():
    header = parse_header("assistant to=functions.f<|channel|>commentary <|constrain|>json")
    assert (header.channel, header.recipient, header.content_type) == ("commentary", "functions.f", "<|constrain|>json")
    assert parse_header("<|channel|>final").part == "content"
    assert parse_header("<|channel|>commentary to=functions.lookup").function == "lookup"


# ---- at random, against openai-harmony's parser ------------------------------------------------

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>")
TEXT = st.text(st.sampled_from("ab <|>\n{}\":é"), min_size=1, max_size=24).filter(
    lambda text: not any(marker in text for marker in MARKERS) and text.strip())


@st.composite
def replies(draw) -> list[tuple[str, str | None, str]]:
    """Messages (channel, function or None, text); a call only last, as <|call|> ends a reply."""
    messages = [(draw(st.sampled_from(("analysis", "final", "commentary"))), None, draw(TEXT))
                for _ in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()):
        arguments = json.dumps({"city": draw(TEXT)})
        messages.append(("commentary", draw(st.sampled_from(("get_weather", "get_time"))), arguments))
    return messages or [("final", None, draw(TEXT))]


def render(messages: list[tuple[str, str | None, str]]) -> str:
    parts = []
    for position, (channel, function, text) in enumerate(messages):
        start = "" if position == 0 else "<|start|>assistant"
        header = f"<|channel|>{channel}" + (f" to=functions.{function} <|constrain|>json" if function else "")
        end = "<|call|>" if function else "<|return|>" if position == len(messages) - 1 else "<|end|>"
        parts.append(f"{start}{header}<|message|>{text}{end}")
    return "".join(parts)


@pytest.fixture(scope="module")
def encoding(model_cache_dir):
    harmony = pytest.importorskip("openai_harmony")
    folder = o200k_dir(model_cache_dir)
    if folder is None:
        pytest.skip("openai-harmony needs the o200k_base vocabulary (see test_harmony_reference.py)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def library_channels(encoding, reply: str) -> tuple[str, str, list[tuple[str, str]]]:
    """What openai-harmony's parser reads from the reply's tokens, gathered as tokenway joins it."""
    import openai_harmony as harmony

    messages = encoding.parse_messages_from_completion_tokens(encoding.encode(reply, allowed_special="all"),
                                                              harmony.Role.ASSISTANT)
    reasoning, content, calls = [], [], []
    for message in messages:
        text = message.content[0].text
        if message.recipient and message.recipient.startswith("functions."):
            calls.append((message.recipient.removeprefix("functions."), text))
        elif message.channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)
    return "\n".join(reasoning), "\n".join(content), calls


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=replies(), data=st.data())
def test_any_split_gives_the_channels_openai_harmony_reads(encoding, messages, data):
    reply = render(messages)
    expected = library_channels(encoding, reply)
    token_texts = [encoding.decode([token_id]) for token_id in encoding.encode(reply, allowed_special="all")]
    assert "".join(token_texts) == reply
    assert read(token_texts)[:3] == expected  # a token a delta, as the engine streams
    # ... and at any other boundaries, the stop token taken by the engine (not in the text).
    stripped = reply.removesuffix("<|call|>").removesuffix("<|return|>")
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stripped) - 1)), max_size=12)))
    chunks = [stripped[a:b] for a, b in zip([0, *cuts], [*cuts, len(stripped)]) if a < b]
    reasoning, content, calls, parser = read(chunks)
    assert (reasoning, content, calls) == expected
    assert [(c.name, c.arguments) for c in parser.tool_calls()] == expected[2]
