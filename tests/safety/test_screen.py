"""The safety stage's screens: the input check, the streamed output check (the same result
however the reply is split, nothing of a finding ever released, prose never held), and where
policies come from: the flags, a model's config, a key."""

from __future__ import annotations

import random
import sqlite3

import pytest

from tokenway.gateway.keystore import KeyStore
from tokenway.routing.registry import Registry
from tokenway.safety.screen import OutputScreen, SafetyPolicy, screen_input

EMAIL, CARD = "ann.lee@example.com", "4111 1111 1111 1111"
IBAN, PHONE = "DE89 3704 0044 0532 0130 00", "+1 415 555 0132"
KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
REPLY = (f"Sure. Write to {EMAIL} or call {PHONE}; pay with {CARD} or to {IBAN}. The key is {KEY} and the "
         f"order 4471-2290 ships in 2024.")


def screened(mode: str, text: str, sizes: list[int], categories: frozenset[str] | None = None):
    screen = OutputScreen(SafetyPolicy(output=mode, categories=categories))
    pieces, position, blocked = [], 0, False
    for size in sizes:
        if position >= len(text):
            break
        result = screen.feed(text[position:position + size])
        position += size
        pieces.append(result.text)
        if result.blocked:
            blocked = True
            break
    if not blocked:
        result = screen.finish()
        pieces.append(result.text)
        blocked = result.blocked
    return pieces, blocked, sorted(screen.categories)


def splits(text: str) -> list[list[int]]:
    rng = random.Random(5)
    return [[1] * len(text), [len(text)]] + [[rng.randint(1, 8) for _ in range(len(text))] for _ in range(8)]


def test_redact_gives_the_same_reply_however_it_is_split_and_never_releases_a_secret():
    expected = ("Sure. Write to [REDACTED:email] or call [REDACTED:phone]; pay with [REDACTED:credit_card] or to "
                "[REDACTED:iban]. The key is [REDACTED:api_key] and the order 4471-2290 ships in 2024.")
    for sizes in splits(REPLY):
        pieces, blocked, categories = screened("redact", REPLY, sizes)
        assert "".join(pieces) == expected and not blocked
        assert categories == ["api_key", "credit_card", "email", "iban", "phone"]
        sent = ""
        for piece in pieces:  # at no point has any part of a secret gone out
            sent += piece
            for secret in (EMAIL, CARD, IBAN, KEY, "4111 1111", "ann.lee@", "sk-proj-Ab3"):
                assert secret not in sent


def test_block_ends_the_reply_before_the_first_finding():
    for sizes in splits(REPLY):
        pieces, blocked, categories = screened("block", REPLY, sizes)
        assert "".join(pieces) == "Sure. Write to " and blocked and categories == ["email"]
    pieces, blocked, _ = screened("block", REPLY, [4] * len(REPLY), frozenset({"credit_card"}))
    assert "".join(pieces) == f"Sure. Write to {EMAIL} or call {PHONE}; pay with " and blocked


def test_flag_holds_nothing_back_and_names_what_it_saw_at_the_end():
    screen = OutputScreen(SafetyPolicy(output="flag"))
    assert [screen.feed(piece).text for piece in ("Mail ", EMAIL[:5], EMAIL[5:])] == ["Mail ", EMAIL[:5], EMAIL[5:]]
    assert screen.finish().categories == ("email",)


def test_prose_is_released_at_once_and_a_number_waits_for_its_end():
    screen = OutputScreen(SafetyPolicy(output="redact"))
    assert screen.feed("The weather is fine today ").text == "The weather is fine today "
    assert screen.feed("and the card 4111 ").text == "and the card "  # digits: held, they may be a card
    assert screen.feed("1111 1111 1111 is done").text == "[REDACTED:credit_card] is "
    assert screen.finish().text == "done"


def test_the_input_check_finds_redacts_and_says_what_it_did():
    texts = [f"mail {EMAIL}", "nothing here", f"card {CARD}"]
    assert screen_input(SafetyPolicy(input="off"), texts).categories == ()
    flagged = screen_input(SafetyPolicy(input="flag"), texts)
    assert (flagged.categories, flagged.action, flagged.redacted) == (("credit_card", "email"), "flag", None)
    redacted = screen_input(SafetyPolicy(input="redact"), texts)
    assert redacted.redacted == ("mail [REDACTED:email]", "nothing here", "card [REDACTED:credit_card]")
    assert screen_input(SafetyPolicy(input="block", categories=frozenset({"iban"})), texts).action is None


def test_policies_refuse_unknown_modes_and_categories():
    with pytest.raises(ValueError, match="safety_input"):
        SafetyPolicy(input="maybe")
    with pytest.raises(ValueError, match="safety_categories: unknown"):
        SafetyPolicy(categories=frozenset({"ssn"}))
    policy = SafetyPolicy(input="block", output="redact", categories=frozenset({"email", "iban"}), threshold=0.9)
    assert SafetyPolicy.from_dict(policy.to_dict()) == policy


def test_a_models_config_sets_its_own_policy():
    registry = Registry.from_config({"models": [{
        "name": "bot", "replicas": [{"kind": "local"}],
        "safety": {"input": "block", "output": "redact", "categories": ["email"]}}]}, default_model="m.gguf")
    assert registry.models[0].safety == SafetyPolicy(input="block", output="redact", categories=frozenset({"email"}))
    with pytest.raises(ValueError, match="safety"):
        Registry.from_config({"models": [{"name": "bot", "replicas": [{"kind": "local"}],
                                          "safety": {"input": "loud"}}]}, default_model="m.gguf")


def test_a_keys_policy_is_stored_with_it_and_an_older_database_gains_the_column(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:  # the table as it was before per-key policies
        conn.executescript("""
            CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, secret_sha256 BLOB NOT NULL, hint TEXT NOT NULL,
                name TEXT NOT NULL, models TEXT, rpm INTEGER, tpm INTEGER, tpd INTEGER, max_concurrent INTEGER,
                max_tokens INTEGER, budget_usd REAL, expires_at REAL, created_at REAL NOT NULL, revoked_at REAL,
                last_used_at REAL);""")
    policy = SafetyPolicy(input="redact", output="block")
    with KeyStore(path) as store:
        secret, info = store.create("k", safety=policy)
        plain_secret, plain = store.create("plain")
        assert info.safety == policy and plain.safety is None
        assert store.authenticate(secret).safety == policy and store.authenticate(plain_secret).safety is None
        assert info.to_dict()["safety"] == {"input": "redact", "output": "block", "threshold": 0.5, "categories": None}


def test_a_guards_reply_is_read_as_llama_guard_writes_it():
    from tokenway.safety.guard import guard_messages, parse_verdict

    assert parse_verdict("safe") == () and parse_verdict("  Safe\n") == ()
    assert parse_verdict("unsafe\nS1") == ("violent_crimes",)
    assert parse_verdict("unsafe\nS10, S12") == ("hate", "sexual_content")
    assert parse_verdict("unsafe") == ("unsafe",)  # no code given: still unsafe
    assert parse_verdict("I think this is fine, not unsafe at all.") == ()  # rambling blocks nobody
    turns = [("user", "hi"), ("assistant", "hello"), ("user", "and now?")]
    [task] = guard_messages(turns, "prompt")
    assert "User: hi\n\nAgent: hello\n\nUser: and now?" in task["content"] and "S14: Code Interpreter Abuse." in \
        task["content"]
    assert guard_messages(turns, "chat_template") == [{"role": r, "content": t} for r, t in turns]


def test_a_secret_in_tool_call_arguments_is_redacted_in_place_or_blocks():
    from tokenway.protocol.job import ToolCallDelta
    from tokenway.safety.screen import ReplyScreen

    arguments = '{"to": "' + EMAIL + '", "note": "card ' + CARD + ' ok"}'
    for mode, expected in (("redact", '{"to": "[REDACTED:email]", "note": "card [REDACTED:credit_card] ok"}'),
                           ("block", '{"to": "')):
        screen = ReplyScreen(SafetyPolicy(output=mode))
        pieces = [ToolCallDelta(0, id="call_1", name="send", arguments="")]
        pieces += [ToolCallDelta(0, arguments=arguments[i:i + 3]) for i in range(0, len(arguments), 3)]
        pieces.append(ToolCallDelta(1, id="call_2", name="ping", arguments="{}"))
        sent: dict[int, str] = {}
        for position, piece in enumerate(pieces):
            _, out = screen.screen("", (piece,), final=position == len(pieces) - 1)
            for p in out:
                sent[p.index] = sent.get(p.index, "") + p.arguments
            if screen.blocked:
                break
        assert sent[0] == expected
        if mode == "redact":
            assert sent[1] == "{}" and screen.released == {0, 1}  # the first call's arguments went out first
        else:
            assert screen.blocked and 1 not in sent and screen.released == set()
