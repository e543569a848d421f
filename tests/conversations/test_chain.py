"""chain(): the conversation a previous_response_id continues, oldest first, in one statement,
on every backend; a link that is missing or another key's, and a conversation past the limit,
are clear 400s that never tell another key's response from one never made."""

import sqlite3

import pytest

from tokenway.conversations import ConversationTooLongError, PreviousResponseNotFoundError, open_response_store
from tokenway.protocol.errors import openai_error_body

from .conftest import make_response

pytestmark = pytest.mark.anyio


async def create_conversation(store, num_turns: int, key_id: str = "key-a", prefix: str = "resp_t") -> list[str]:
    ids = [f"{prefix}{i:03d}" for i in range(num_turns)]
    for i, response_id in enumerate(ids):
        await store.create(make_response(response_id, key_id=key_id, previous_response_id=ids[i - 1] if i else None,
                                         text=f"turn {i}: ünï \"q\" \\ ✓", num_items=1 + i % 3))
    return ids


async def test_a_chain_is_the_conversation_oldest_first_with_each_turns_input_and_output(store):
    ids = await create_conversation(store, 4)
    turns = await store.chain(ids[-1], "key-a")
    assert [turn.response_id for turn in turns] == ids
    assert [turn.previous_response_id for turn in turns] == [None, *ids[:-1]]
    for turn in turns:
        stored = await store.get(turn.response_id, "key-a")
        assert (turn.status, turn.model) == (stored.status, stored.model) == ("completed", "m1")
        assert turn.input_items == stored.input_items
        assert turn.output == tuple(stored.response["output"])
    assert [turn.response_id for turn in await store.chain(ids[1], "key-a")] == ids[:2]  # a branch point
    assert [turn.response_id for turn in await store.chain(ids[0], "key-a")] == ids[:1]


async def test_a_turns_output_reads_back_exactly_as_rendered(store):
    """The output is taken out of the stored Response by the database's own JSON functions."""
    await store.create(make_response("resp_1", status="in_progress"))
    output = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "0.1 + 0.2 = ✓ \"\\\n\t",
                            "logprobs": [{"token": "0", "logprob": -0.30000000000000004, "bytes": [48],
                                          "top_logprobs": []}, {"token": "x", "logprob": -1e-300, "bytes": [],
                                                                "top_logprobs": []}],
                            "annotations": []}]},
              {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"a\": 1}",
               "status": "completed"}]
    response = {"id": "resp_1", "status": "completed", "output": output, "usage": {"output_tokens": 3}}
    assert await store.update("resp_1", status="completed", response=response)
    [turn] = await store.chain("resp_1", "key-a")
    assert turn.output == tuple(output)
    assert await store.update("resp_2", status="completed", response={}) is False
    await store.create(make_response("resp_2", status="queued"))
    assert await store.update("resp_2", status="in_progress", response={"status": "in_progress"})
    assert (await store.chain("resp_2", "key-a"))[0].output == ()  # no output yet


async def test_two_branches_from_one_response_share_its_past(store):
    ids = await create_conversation(store, 2)
    await store.create(make_response("resp_left", previous_response_id=ids[1]))
    await store.create(make_response("resp_right", previous_response_id=ids[1]))
    assert [t.response_id for t in await store.chain("resp_left", "key-a")] == [*ids, "resp_left"]
    assert [t.response_id for t in await store.chain("resp_right", "key-a")] == [*ids, "resp_right"]


async def test_a_chain_of_50_turns_is_one_statement(tmp_path, monkeypatch):
    statements: list[str] = []
    real_connect = sqlite3.connect

    def traced_connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced_connect)
    # One connection: the chain's query cannot land on a thread whose connection is still to open.
    store = open_response_store(f"sqlite://{tmp_path}/responses.db", num_connections=1)
    try:
        ids = await create_conversation(store, 50)
        statements.clear()
        turns = await store.chain(ids[-1], "key-a")
        assert [turn.response_id for turn in turns] == ids
        assert len(statements) == 1 and statements[0].startswith("WITH RECURSIVE")
    finally:
        await store.close()


async def test_a_previous_response_never_made_or_another_keys_is_not_found_alike(store):
    await create_conversation(store, 1, key_id="key-b", prefix="resp_b")
    errors = []
    for response_id in ("resp_never", "resp_b000"):
        with pytest.raises(PreviousResponseNotFoundError) as caught:
            await store.chain(response_id, "key-a")
        errors.append(caught.value)
    assert [openai_error_body(e)["error"] for e in errors] == [
        {"message": f"Previous response with id '{response_id}' not found.", "type": "invalid_request_error",
         "param": "previous_response_id", "code": "previous_response_not_found"}
        for response_id in ("resp_never", "resp_b000")]
    assert errors[0].status == 400


async def test_a_link_deleted_or_another_keys_breaks_the_chain_with_a_clear_error(store):
    ids = await create_conversation(store, 4)
    assert await store.delete(ids[1], "key-a")
    with pytest.raises(PreviousResponseNotFoundError) as caught:
        await store.chain(ids[3], "key-a")
    assert caught.value.message == (f"Previous response with id '{ids[3]}' cannot be continued: the response "
                                    f"'{ids[2]}' in its conversation continues '{ids[1]}', which was not found.")
    # key-b continues key-a's response: key-b cannot read key-a's turns through it.
    await store.create(make_response("resp_b", key_id="key-b", previous_response_id=ids[0]))
    with pytest.raises(PreviousResponseNotFoundError, match=f"'resp_b' in its conversation continues '{ids[0]}'"):
        await store.chain("resp_b", "key-b")


async def test_a_conversation_longer_than_the_limit_is_refused(store):
    ids = await create_conversation(store, 4)
    assert len(await store.chain(ids[3], "key-a", limit=4)) == 4
    with pytest.raises(ConversationTooLongError) as caught:
        await store.chain(ids[3], "key-a", limit=3)
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400, "previous_response_id", "conversation_too_long")
    assert "more than 3 responses" in caught.value.message
    with pytest.raises(ValueError, match="limit must be >= 1"):
        await store.chain(ids[3], "key-a", limit=0)
