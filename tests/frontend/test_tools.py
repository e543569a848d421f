"""The generic tool-call format's reply parser: whole replies, and replies cut by max_tokens,
which keep what they completed and never leak the format's JSON."""

from __future__ import annotations

import json

from tokenway.frontend.tools import parse_tool_reply

CALLS = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}, ' \
        '{"name": "get_time", "arguments": {"zone": "Europe/Oslo", "nested": {"a": [1, 2]}}}]}'


def test_whole_replies():
    content, calls = parse_tool_reply(CALLS)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "Europe/Oslo", "nested": {"a": [1, 2]}})]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_reply('{"response": "Bonjour, ça va ?"}') == ("Bonjour, ça va ?", [])


def test_a_cut_reply_keeps_the_calls_it_completed_and_drops_the_one_cut():
    for cut in range(len('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}'), len(CALLS) - 2):
        content, calls = parse_tool_reply(CALLS[:cut])
        assert content is None  # nothing of the JSON becomes text
        assert [c.name for c in calls] in (["get_weather"], ["get_weather", "get_time"])
        assert json.loads(calls[0].arguments) == {"city": "Rome"}


def test_every_cut_of_a_reply_parses_without_leaking_the_format():
    reply = json.dumps({"response": 'She said "hi" \\ then left: café ☕ \n done'}, ensure_ascii=True)
    text = json.loads(reply)["response"]
    for cut in range(len(reply)):
        content, calls = parse_tool_reply(reply[:cut])
        assert calls == [] and text.startswith(content)  # the answer so far, never the format's JSON
    for cut in range(len(CALLS)):
        content, calls = parse_tool_reply(CALLS[:cut])
        assert content in (None, "")
