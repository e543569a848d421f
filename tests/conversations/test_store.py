"""The response store's operations on every backend (SQLite, in memory, a real PostgreSQL): what
is stored reads back exactly, only for its owner; updates move a status forward and never
over a final one; input items page as OpenAI's lists do."""

import asyncio
import dataclasses

import pytest

from tokenway.conversations import StoredResponse, open_response_store, response_not_found
from tokenway.protocol.errors import FieldError, openai_error_body

from .conftest import make_response, render

pytestmark = pytest.mark.anyio


async def test_a_created_response_reads_back_exactly(store, store_url):
    stored = make_response("resp_1", text="ünïcode ✓ \"quoted\" \\ back", num_items=3, instructions="Be brief.",
                           metadata={"topic": "tests", "n": "1"})
    stored = dataclasses.replace(stored, response={**stored.response, "temperature": 0.7, "tools": [],
                                                   "text": {"format": {"type": "text"}}, "max_output_tokens": None})
    await store.create(stored)
    assert await store.get("resp_1", "key-a") == stored
    assert await store.get("resp_2", "key-a") is None
    await store.create(stored)  # the same id again (a retried insert): a no-op
    assert await store.get("resp_1", "key-a") == stored
    if store_url != "memory":  # another store's connections see it: it is in the database
        other = open_response_store(store_url)
        try:
            assert await other.get("resp_1", "key-a") == stored
        finally:
            await other.close()


async def test_a_kept_response_is_there_for_every_call_that_follows_keep(store, store_url):
    """keep() returns before its insert; whatever the next call is, it sees the response."""
    for n, read in enumerate([
            lambda i: store.get(i, "key-a"),
            lambda i: store.chain(i, "key-a"),
            lambda i: store.input_items(i, "key-a"),
            lambda i: store.delete(i, "key-a")]):
        store.keep(make_response(f"resp_k{n}"))
        assert await read(f"resp_k{n}") not in (None, False, ())
    store.keep(make_response("resp_k9"))
    store.keep(make_response("resp_k10", previous_response_id="resp_k9"))
    assert [turn.response_id for turn in await store.chain("resp_k10", "key-a")] == ["resp_k9", "resp_k10"]
    store.keep(make_response("resp_last"))
    await store.close()  # close waits for the inserts under way
    if store_url != "memory":
        reopened = open_response_store(store_url)
        try:
            assert await reopened.get("resp_last", "key-a") is not None
        finally:
            await reopened.close()


async def test_another_keys_response_is_a_miss_as_one_never_made(store):
    await store.create(make_response("resp_a", key_id="key-a", num_items=2))
    assert await store.get("resp_a", "key-b") is None
    assert await store.input_items("resp_a", "key-b") is None
    assert await store.delete("resp_a", "key-b") is False
    assert await store.get("resp_a", "key-a") is not None  # untouched by key-b's delete
    assert await store.get("resp_a", "") is None  # no gateway's key is no key's either


async def test_delete_removes_the_response_once(store):
    await store.create(make_response("resp_1"))
    assert await store.delete("resp_1", "key-a") is True
    assert await store.get("resp_1", "key-a") is None
    assert await store.input_items("resp_1", "key-a") is None
    assert await store.delete("resp_1", "key-a") is False
    assert await store.update("resp_1", status="completed", response=render("resp_1", "completed", "x")) is False


async def test_a_background_response_moves_forward_and_a_cancel_is_never_overwritten(store):
    await store.create(make_response("resp_bg", status="queued"))
    running = render("resp_bg", "in_progress", "Par")
    assert await store.update("resp_bg", status="in_progress", response=running) is True
    assert await store.update("resp_bg", status="queued", response=render("resp_bg", "queued", "")) is False
    running = render("resp_bg", "in_progress", "Paris")
    assert await store.update("resp_bg", status="in_progress", response=running) is True
    cancelled = render("resp_bg", "cancelled", "Paris")
    assert await store.update("resp_bg", status="cancelled", response=cancelled) is True
    # The runner's write lands after the cancel: refused, and the response stays cancelled.
    for status in ("completed", "failed", "in_progress", "cancelled"):
        assert await store.update("resp_bg", status=status, response=render("resp_bg", status, "Paris.")) is False
    stored = await store.get("resp_bg", "key-a")
    assert (stored.status, stored.response) == ("cancelled", cancelled)


async def test_a_finished_response_cannot_be_cancelled_later(store):
    await store.create(make_response("resp_1", status="in_progress"))
    done = render("resp_1", "completed", "done")
    assert await store.update("resp_1", status="completed", response=done) is True
    assert await store.update("resp_1", status="cancelled", response=render("resp_1", "cancelled", "done")) is False
    assert (await store.get("resp_1", "key-a")).response == done


async def test_an_update_whose_rendering_disagrees_with_its_status_is_refused(store):
    await store.create(make_response("resp_1", status="queued"))
    with pytest.raises(ValueError, match="disagrees"):
        await store.update("resp_1", status="completed", response=render("resp_1", "in_progress", ""))
    with pytest.raises(ValueError, match="status must be one of"):
        await store.update("resp_1", status="done", response={})


async def test_input_items_page_as_openai_lists_newest_first_by_default(store):
    await store.create(make_response("resp_1", num_items=5))
    ids = [f"msg_resp_1_{i}" for i in range(5)]

    async def page(**kwargs) -> tuple[list[str], str | None, str | None, bool]:
        result = await store.input_items("resp_1", "key-a", **kwargs)
        return [item["id"] for item in result.data], result.first_id, result.last_id, result.has_more

    assert await page(limit=2) == ([ids[4], ids[3]], ids[4], ids[3], True)
    assert await page(limit=2, after=ids[3]) == ([ids[2], ids[1]], ids[2], ids[1], True)
    assert await page(limit=2, after=ids[1]) == ([ids[0]], ids[0], ids[0], False)
    assert await page(after=ids[0]) == ([], None, None, False)
    assert await page(order="asc") == (ids, ids[0], ids[4], False)
    assert await page(order="asc", limit=4, after=ids[0]) == (ids[1:], ids[1], ids[4], False)
    assert await page(order="asc", limit=3) == (ids[:3], ids[0], ids[2], True)
    full = await store.input_items("resp_1", "key-a", order="asc")
    assert full.data == (await store.get("resp_1", "key-a")).input_items
    assert full.to_json() == {"object": "list", "data": list(full.data), "first_id": ids[0], "last_id": ids[4],
                              "has_more": False}


async def test_input_items_refuse_a_bad_page_naming_the_field(store):
    await store.create(make_response("resp_1", num_items=2))
    for kwargs, param in [({"after": "msg_other"}, "after"), ({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"order": "newest"}, "order")]:
        with pytest.raises(FieldError) as caught:
            await store.input_items("resp_1", "key-a", **kwargs)
        assert caught.value.param == param


async def test_many_calls_at_once_each_see_their_own_rows(store):
    ids = [f"resp_{i:03d}" for i in range(60)]
    await asyncio.gather(*(store.create(make_response(i, key_id=f"key-{n % 3}", text=i)) for n, i in enumerate(ids)))
    got = await asyncio.gather(*(store.get(i, f"key-{n % 3}") for n, i in enumerate(ids)))
    assert [r.input_items[0]["content"][0]["text"] for r in got] == [f"{i} #0" for i in ids]


async def test_nul_characters_are_kept_in_sqlite_and_replaced_in_postgresql(store, store_url):
    stored = make_response("resp_nul", text="a\x00b \\u0000 c\\\x00", instructions="no\x00pe")
    await store.create(stored)
    got = await store.get("resp_nul", "key-a")
    if store_url.startswith("postgres"):  # neither jsonb nor text can hold U+0000
        assert got.instructions == "no\ufffdpe"
        assert got.input_items[0]["content"][0]["text"] == "a\ufffdb \\u0000 c\\\ufffd #0"
    else:
        assert got == stored


def test_a_stored_response_checks_what_the_store_relies_on():
    good = make_response("resp_1", num_items=2)
    item = good.input_items[0]
    for change, message in [({"id": "chatcmpl-1"}, "starts with 'resp_'"),
                            ({"previous_response_id": "resp_1"}, "cannot continue itself"),
                            ({"status": "done"}, "status must be one of"),
                            ({"status": "failed"}, "disagrees"),
                            ({"input_items": ({"type": "message"},)}, r"input_items\[0\] has no id"),
                            ({"input_items": (item, item)}, r"input_items\[1\]: id .* appears twice")]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(good, **change)
    assert isinstance(dataclasses.replace(good, response={}), StoredResponse)  # a rendering without a status


def test_a_missing_response_is_a_404_that_names_only_the_id():
    body = openai_error_body(response_not_found("resp_x"))
    assert response_not_found("resp_x").status == 404
    assert body == {"error": {"message": "Response with id 'resp_x' not found.", "type": "not_found_error",
                              "param": None, "code": None}}
