"""The input screen against an attacker's probe: a card number or an API key in every channel a
request carries into the prompt, and in every disguise a pattern detector can see through
(separators, other scripts' digits, invisible characters, look-alike letters, splits across
parts and messages), each blocked under `block` and redacted in place under `redact` (JSON
staying valid); generated splits and disguises, all blocked; and benign text never flagged,
alone or joined with its neighbours.

Requests are built as the adaptors build them (server/openai_api.py prepare_chat,
server/anthropic_prepare.py prepare_messages), so what is screened is what the template gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.safety.test_detectors import load_lines
from tokenway.protocol.anthropic import MessagesRequest, to_chat_messages, to_chat_tools
from tokenway.protocol.openai_requests import ChatCompletionRequest
from tokenway.safety.channels import ChatInput, PromptText
from tokenway.safety.detectors import detect
from tokenway.safety.normalize import normalize
from tokenway.safety.screen import InputScreening, SafetyPolicy, screen_input

CARD = "4111 1111 1111 1111"
CARDS = ("4111111111111111", "5555555555554444", "378282246310005", "6011111111111117", "3530111333300000",
         "4012888888881881", "2223003122003222", "30569309025904")
KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
KEYS = (KEY, "sk-proj-ErQHQwjyaxErPZDS3MoJaQNjCxkv5ndK0meGR0vRzZ1fb6d0",
        "sk-ant-api03-xT7qLmN2vB9kR4wZ8cY1pD6fH3jS5gA0eU", "ghp_x7Kq2mN9vB4wR8cZ1pD6fH3jS5gA0eUtLyMo",
        "AKIAZ7Q2M9VB4WR8CZ1P", "tw-k_bdba1909-OrhOEApliw3RIf3CVORgO9ACim9_uz7XRyrv85toz0B")
FIXTURES = Path(__file__).parents[1] / "fixtures" / "injection"


def openai_input(**body) -> ChatInput:
    """A chat body's template input, as prepare_chat makes it."""
    request = ChatCompletionRequest.model_validate({"model": "m", **body})
    response_format = request.response_format.model_dump(exclude_none=True, by_alias=True) \
        if request.response_format else None
    return ChatInput(request.template_messages(), request.template_tools(), response_format)


def anthropic_input(**body) -> ChatInput:
    """A Messages body's template input, as prepare_messages makes it."""
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body})
    return ChatInput(to_chat_messages(request), to_chat_tools(request))


def screened(chat: ChatInput | list[PromptText], mode: str = "block") -> InputScreening:
    texts = list(chat.texts()) if isinstance(chat, ChatInput) else chat
    return screen_input(SafetyPolicy(input=mode), texts)


def redacted(chat: ChatInput) -> ChatInput:
    screening = screened(chat, "redact")
    assert screening.action == "redact", screening
    return chat.redacted(screening.redacted)


def dump(chat: ChatInput) -> str:
    return json.dumps([chat.messages, chat.tools, chat.response_format], ensure_ascii=False)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def tool(description: str = "Look up an order", parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": "lookup", "description": description, "parameters": parameters or {
        "type": "object", "properties": {"order_id": {"type": "string", "description": "The order's id"}}}}}


def called(arguments: str) -> list[dict]:
    return [user("Look it up."),
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


# ---- every channel ------------------------------------------------------------------------------

# name -> (request with the secret, where the 400 points). Every one can be redacted in place.
CHANNELS = {
    "system": lambda s: openai_input(messages=[{"role": "system", "content": f"Pay with {s}."}, user("Hi")]),
    "developer": lambda s: openai_input(messages=[{"role": "developer", "content": f"Key {s}"}, user("Hi")]),
    "assistant": lambda s: openai_input(messages=[user("Hi"), {"role": "assistant", "content": f"It is {s}."},
                                                  user("Thanks")]),
    "text_parts": lambda s: openai_input(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Here:"}, {"type": "text", "text": s}]}]),
    "refusal_part": lambda s: openai_input(messages=[user("Hi"), {"role": "assistant", "content": [
        {"type": "refusal", "refusal": f"I won't use {s}."}]}, user("ok")]),
    "reasoning_content": lambda s: openai_input(messages=[user("Hi"), {"role": "assistant", "content": "Done.",
                                                          "reasoning_content": f"They paid with {s}."}, user("ok")]),
    "reasoning": lambda s: openai_input(messages=[user("Hi"), {"role": "assistant", "content": "Done.",
                                                  "reasoning": f"They paid with {s}."}, user("ok")]),
    "name": lambda s: openai_input(messages=[{"role": "user", "name": s.replace(" ", "_"), "content": "Hi"}]),
    "tool_call_arguments": lambda s: openai_input(messages=called(json.dumps({"order_id": s}))),
    "tool_call_arguments_escaped": lambda s: openai_input(messages=called(json.dumps({"note": s}, ensure_ascii=True)
                                                                          .replace("1", "\\u0031"))),
    "tool_call_id": lambda s: openai_input(messages=[
        user("Hi"), {"role": "assistant", "tool_calls": [{"id": s.replace(" ", ""), "type": "function",
                                                          "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": s.replace(" ", ""), "content": "done"}]),
    "tool_result": lambda s: openai_input(messages=called("{}")[:2] + [
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"card": s})}]),
    "tool_description": lambda s: openai_input(messages=[user("Hi")], tools=[tool(f"Charges card {s}")]),
    "parameter_description": lambda s: openai_input(messages=[user("Hi")], tools=[tool(parameters={
        "type": "object", "properties": {"card": {"type": "string", "description": f"e.g. {s}"}}})]),
    "enum_value": lambda s: openai_input(messages=[user("Hi")], tools=[tool(parameters={
        "type": "object", "properties": {"card": {"type": "string", "enum": ["none", s]}}})]),
    "schema_description": lambda s: openai_input(messages=[user("Hi")], response_format=schema_format({
        "type": "object", "description": f"Use {s}", "properties": {"ok": {"type": "boolean"}}})),
    "schema_const": lambda s: openai_input(messages=[user("Hi")], response_format=schema_format({
        "type": "object", "properties": {"contact": {"const": s}}})),
    "anthropic_system_blocks": lambda s: anthropic_input(system=[{"type": "text", "text": "Be brief."},
                                                                  {"type": "text", "text": f"Card: {s}"}],
                                                          messages=[user("Hi")]),
    "anthropic_tool_use": lambda s: anthropic_input(messages=[
        user("Charge it"), {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "charge", "input": {"card": s}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]),
    "anthropic_tool_result": lambda s: anthropic_input(messages=[
        user("Look it up"), {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "Found:"}, {"type": "text", "text": s}]}]}]),
    "anthropic_tool_definition": lambda s: anthropic_input(
        messages=[user("Hi")], tools=[{"name": "charge", "description": f"Charges {s}",
                                       "input_schema": {"type": "object", "properties": {}}}]),
}
PARAM_OF = {"tool_description": "tools", "parameter_description": "tools", "enum_value": "tools",
            "schema_description": "response_format", "schema_const": "response_format",
            "anthropic_tool_definition": "tools"}


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("secret, category", [(CARD, "credit_card"), (KEY, "api_key")])
def test_every_channel_is_blocked_and_redacted_in_place(channel, secret, category):
    if channel in ("name", "tool_call_id") and category == "credit_card":
        secret = CARD.replace(" ", "-")
    chat = CHANNELS[channel](secret)
    screening = screened(chat)
    assert screening.categories == (category,) and screening.action == "block"
    assert screening.param == PARAM_OF.get(channel, "messages")
    clean = redacted(chat)
    assert secret not in dump(clean) and f"[REDACTED:{category}]" in dump(clean)
    assert screened(clean).action is None  # nothing of it is left to find
    for message in clean.messages:  # arguments stay JSON
        for call in message.get("tool_calls") or ():
            json.loads(call["function"]["arguments"])


def test_a_redaction_keeps_everything_else_as_it_was():
    chat = openai_input(messages=[*called('{"order_id": "ORD-2024-004471"}'), user(f"card {CARD}.")], tools=[tool()])
    clean = redacted(chat)
    assert all(new is old for new, old in zip(clean.messages[:3], chat.messages)) and clean.tools[0] is chat.tools[0]
    assert clean.messages[3]["content"] == "card [REDACTED:credit_card]."


def test_a_number_in_arguments_becomes_the_redaction_and_stays_json():
    chat = openai_input(messages=called('{"card": 4111111111111111, "qty": 2}'))
    assert json.loads(redacted(chat).messages[1]["tool_calls"][0]["function"]["arguments"]) == {
        "card": "[REDACTED:credit_card]", "qty": 2}


@pytest.mark.parametrize("chat", [
    openai_input(messages=[user("Hi")], tools=[tool(parameters={  # a property named by the secret
        "type": "object", "properties": {KEY: {"type": "string"}}})]),
    openai_input(messages=[user("Hi")], response_format=schema_format({  # a number in a schema
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 4111111111111111}}})),
    openai_input(messages=called(json.dumps({KEY: "x"}))),  # an object key in arguments
], ids=["schema_property_name", "schema_number", "arguments_key"])
def test_what_cannot_be_redacted_in_place_is_refused_under_redact(chat):
    screening = screened(chat, "redact")
    assert screening.action == "block" and screening.redacted is None


def test_prompts_and_inputs_are_screened_each_alone():
    texts = [PromptText(text, "input") for text in ("4111 1111", "1111 1111", f"card {CARD}")]
    screening = screened(texts, "redact")
    assert screening.redacted == ("4111 1111", "1111 1111", "card [REDACTED:credit_card]")
    assert screening.param == "input"


# ---- every disguise -----------------------------------------------------------------------------

ZERO_CODE_POINTS = (0xFF10, 0x0660, 0x06F0, 0x0966, 0x09E6, 0x0A66, 0x0BE6, 0x0E50, 0x1040, 0x1D7CE, 0x1D7EC)
INVISIBLE = ("\u200d", "\u200b", "\u200c", "\u00ad", "\ufeff", "\u2060", "\u0301", "\u0336", "\ufe0f", "\u034f", "\x00",
             "\x07")
SEPARATORS = (" ", "-", ".", "/", "\u00a0", "\n", "\u2011", "\t", " - ", "\u2009", "\u202f", "\u3000", "\u2013", "\r\n")


def in_script(text: str, zero: int) -> str:
    return "".join(chr(zero + int(ch)) if ch.isdigit() else ch for ch in text)


def grouped(digits: str, separator: str) -> str:
    sizes = (4, 6, 5) if len(digits) == 15 else (4, 6, 4) if len(digits) == 14 else (4,) * 4
    groups, position = [], 0
    for size in sizes:
        groups.append(digits[position:position + size])
        position += size
    return separator.join(groups + ([digits[position:]] if position < len(digits) else []))


CARD_TRICKS = {
    **{f"separator {sep!r}": grouped("4111111111111111", sep) for sep in SEPARATORS},
    **{f"digits from U+{zero:04X}": in_script(CARD, zero) for zero in ZERO_CODE_POINTS},
    **{f"U+{ord(ch):04X} between digits": ch.join("4111111111111111") for ch in INVISIBLE},
    "fullwidth digits, NBSP": in_script(CARD, 0xFF10).replace(" ", "\u00a0"),
}
KEY_TRICKS = {
    "ZWJ inside": KEY[:9] + "\u200d" + KEY[9:20] + "\u200d" + KEY[20:],
    "fullwidth": "".join(chr(ord(ch) + 0xFEE0) for ch in KEY),
    "blank inside": KEY[:20] + " " + KEY[20:],
    "line breaks inside": KEY[:12] + "\n" + KEY[12:30] + "\n" + KEY[30:],
    "Cyrillic s": "\u0455" + KEY[1:],
    "Cyrillic and Greek look-alikes": KEY.replace("s", "\u0455").replace("o", "\u03bf").replace("A", "\u0410"),
    "soft hyphens": "\u00ad".join(KEY),
    "combining marks": "\u0301".join(KEY),
}


@pytest.mark.parametrize("trick", CARD_TRICKS)
def test_card_tricks_are_blocked(trick):
    screening = screened(openai_input(messages=[user(f"My card: {CARD_TRICKS[trick]} thanks")]))
    assert screening.categories == ("credit_card",), CARD_TRICKS[trick]


@pytest.mark.parametrize("trick", KEY_TRICKS)
def test_key_tricks_are_blocked(trick):
    assert screened(openai_input(messages=[user(f"Use {KEY_TRICKS[trick]} now")])).categories == ("api_key",)


@pytest.mark.parametrize("trick", [*CARD_TRICKS, *KEY_TRICKS])
def test_a_disguised_secret_is_redacted_whole_and_nothing_else(trick):
    secret = CARD_TRICKS.get(trick) or KEY_TRICKS[trick]
    clean = redacted(openai_input(messages=[user(f"Mine: {secret} ok")]))
    assert clean.messages[0]["content"] in ("Mine: [REDACTED:credit_card] ok", "Mine: [REDACTED:api_key] ok")


SPLITS = {
    "two text parts": lambda a, b: [{"role": "user", "content": [{"type": "text", "text": a},
                                                                 {"type": "text", "text": b}]}],
    "two messages": lambda a, b: [user(a), user(b)],
    "user then assistant": lambda a, b: [user(a), {"role": "assistant", "content": b}, user("ok?")],
    "assistant then tool result": lambda a, b: [user("Go"), {"role": "assistant", "content": a, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": b}],
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("secret, cut", [(CARD, 7), (CARD, 10), ("4111111111111111", 8), (KEY, 20),
                                         ("4111-1111-1111-1111", 5)])
def test_a_secret_split_between_two_texts_is_seen_whole(split, secret, cut):
    chat = openai_input(messages=SPLITS[split](f"Mine is {secret[:cut]}", f"{secret[cut:]} ok"))
    category = "api_key" if secret == KEY else "credit_card"
    assert screened(chat).categories == (category,)
    clean = redacted(chat)  # each text loses its piece, and only it
    texts = [t.text for t in clean.texts()]
    assert "Mine is [REDACTED:" in "".join(texts) and f"[REDACTED:{category}] ok" in "".join(texts)
    assert secret[:cut] not in dump(clean) and secret[cut:] not in dump(clean)


# ---- generated: every split and disguise blocked ------------------------------------------------


@st.composite
def disguised_cards(draw) -> str:
    digits = draw(st.sampled_from(CARDS))
    text = grouped(digits, draw(st.sampled_from(SEPARATORS))) if draw(st.booleans()) else digits
    zero = draw(st.sampled_from((None, *ZERO_CODE_POINTS)))
    if zero is not None:
        text = in_script(text, zero)
    for _ in range(draw(st.integers(0, 3))):
        position = draw(st.integers(1, len(text) - 1))
        text = text[:position] + draw(st.sampled_from(INVISIBLE)) + text[position:]
    return text


@st.composite
def disguised_keys(draw) -> str:
    key = draw(st.sampled_from(KEYS))
    prefix_length = next((len(p) for p in ("tw-k_", "AKIA", "ghp_") if key.startswith(p)), 1)
    cuts = sorted(draw(st.sets(st.integers(prefix_length, len(key) - 1), max_size=3)))
    pieces = [key[a:b] for a, b in zip([0, *cuts], [*cuts, len(key)])]
    text = "".join(piece + draw(st.sampled_from(("", " ", "\n", "\t", "  ", " \n", "\u200b", "\u00a0")))
                   for piece in pieces[:-1]) + pieces[-1]
    trick = draw(st.sampled_from(("none", "fullwidth", "cyrillic_s", "zwj")))
    if trick == "fullwidth":
        text = "".join(chr(ord(ch) + 0xFEE0) if "!" <= ch <= "~" else ch for ch in text)
    elif trick == "cyrillic_s" and text.startswith("s"):
        text = "\u0455" + text[1:]
    elif trick == "zwj":
        text = text[:2] + "\u200d" + text[2:]
    return text


@st.composite
def split_requests(draw, secrets) -> ChatInput:
    """A secret cut in up to three places, its pieces in parts of one message or in messages
    (a key's prefix whole, but for "sk-": detectors.py)."""
    secret = draw(secrets)
    prefix = next((p for p in ("tw-k_", "AKIA", "ghp_") if normalize(secret).text.startswith(p)), "")
    first = next(i for i in range(1, len(secret)) if normalize(secret[:i]).text.startswith(prefix))
    cuts = sorted(draw(st.sets(st.integers(first, len(secret) - 1), max_size=2)))
    pieces = [secret[a:b] for a, b in zip([0, *cuts], [*cuts, len(secret)])]
    pieces[0] = "It is " + pieces[0]
    pieces[-1] += ", thanks."
    if draw(st.booleans()):
        return openai_input(messages=[{"role": "user", "content": [{"type": "text", "text": p} for p in pieces]}])
    roles = draw(st.lists(st.sampled_from(("user", "assistant", "system")), min_size=len(pieces),
                          max_size=len(pieces)))
    return openai_input(messages=[{"role": role, "content": piece} for role, piece in zip(roles, pieces)])


@settings(max_examples=400, deadline=None)
@given(split_requests(disguised_cards()))
def test_generated_card_splits_and_disguises_are_all_blocked(chat):
    assert screened(chat).categories == ("credit_card",), [t.text for t in chat.texts()]


@settings(max_examples=400, deadline=None)
@given(split_requests(disguised_keys()))
def test_generated_key_splits_and_disguises_are_all_blocked(chat):
    assert screened(chat).categories == ("api_key",), [t.text for t in chat.texts()]


# ---- benign text stays unflagged ----------------------------------------------------------------


def benign_lines() -> list[str]:
    return [text for expected, text in load_lines() if not expected]


def passages() -> list[str]:
    """The injection set's passages: reviews, mails, docs, code, web pages."""
    return [json.loads(line)["text"] for name in ("dev", "holdout", "test")
            for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()]


def test_benign_lines_are_not_flagged_alone_or_next_to_each_other():
    lines = benign_lines()
    assert len(lines) >= 100
    for line in lines:
        assert screened(openai_input(messages=[user(line)])).action is None, line
    numbery = [line for line in lines if any(ch.isdigit() for ch in line)]
    for first in numbery:  # every ordered pair, as two messages and as two parts of one
        for second in numbery:
            for messages in (SPLITS["two messages"](first, second), SPLITS["two text parts"](first, second)):
                assert screened(openai_input(messages=messages)).action is None, (first, second)


def test_the_view_flags_no_passage_the_detectors_pass_but_a_disguised_address():
    newly = [text for text in passages() if not detect(text) and screened(openai_input(messages=[user(text)])).action]
    assert len(newly) == 1 and "\u200bn\u200bo\u200bt\u200be\u200bs\u200b@" in newly[0]  # "notes@" with ZWSPs


def test_benign_passages_are_not_flagged_as_one_long_conversation():
    benign = [text for text in passages() if not detect(normalize(text).text)]
    assert len(benign) >= 500
    roles = ("system", "user", "assistant")
    messages = [{"role": roles[i % 3], "content": text} for i, text in enumerate(benign)]
    assert screened(openai_input(messages=messages)).action is None
    arguments = [json.dumps({"text": text}) for text in benign[:100]]  # and as tool calls' arguments
    assert screened(openai_input(messages=[m for a in arguments for m in called(a)])).action is None


def test_benign_numbers_in_tools_and_tables_are_not_flagged():
    chat = openai_input(
        messages=[user("Totals:\n2019 4100\n2020 4350\n2021 4720\n2022 5100"), {"role": "assistant", "content": "4000"},
                  user("5000 6000 7000 8000, and 4000\n5000\n6000\n7000?")],
        tools=[tool(parameters={"type": "object", "properties": {"year": {"type": "integer", "enum": [
            2019, 2020, 2021, 2022, 2023, 4000, 5000, 6000, 7000], "default": 4111111111111111 - 1}}})])
    assert screened(chat).action is None


def test_labelled_positives_are_found_as_detect_finds_them():
    # The view changes nothing for plain text: the screen finds what detect() finds, line by line.
    for expected, text in load_lines():
        if expected:
            screening = screened(openai_input(messages=[user(text)]), "flag")
            assert screening.categories == tuple(sorted({f.category for f in detect(text)})), text


def test_moderations_read_the_view_the_input_screen_reads():
    from tokenway.safety.moderations import moderation_response

    results = moderation_response(SafetyPolicy(), [f"card {CARD_TRICKS['digits from U+0660']}", KEY_TRICKS["fullwidth"],
                                                   "order ٤٤٧١-٢٢٩٠"])["results"]
    assert [[c for c, flagged in r["categories"].items() if flagged] for r in results] == [
        ["credit_card"], ["api_key"], []]
