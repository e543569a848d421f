"""The Files and Batch APIs in process (OpenAI's and Anthropic's), on the session's fp32 engine
with keys, a real SQLite ledger and an in-memory batch store: every route's bad input is a 400
or 404 in its API's shape, another key's files and batches are 404s, and a line run by the
executor takes the HTTP path as the batch's key, under its line's id. The runner and the SDKs:
tests/e2e/test_batches.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tracemalloc

import httpx
import pytest

from tokenway.batches import BatchLine, line_id_of, open_batch_store
from tokenway.engine.client import AsyncEngine
from tokenway.server.app import create_app
from tokenway.server.batch_lines import LineExecutor, principal_of

from .conftest import gateway_services

MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


@pytest.fixture()
def services(llm, tmp_path):
    engine = AsyncEngine(core=llm.engine)
    services = dataclasses.replace(gateway_services(engine, tmp_path), batch_store=open_batch_store("memory"))
    yield services
    asyncio.run(services.batch_store.close())
    engine.shutdown()


def keys(services, *names: str) -> list[dict[str, str]]:
    return [{"Authorization": f"Bearer {services.gatekeeper.keys.create(name=name)[0]}"} for name in names]


def session(services, steps):
    async def main():
        app = create_app(services)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await steps(client, app)

    return asyncio.run(main())


def jsonl(*lines) -> bytes:
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


def request_line(custom_id: str, body: dict | None = None, url: str = "/v1/chat/completions", **fields) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body or CHAT, **fields}


async def upload(client, auth, content: bytes, purpose: str = "batch") -> httpx.Response:
    return await client.post("/v1/files", headers=auth, data={"purpose": purpose},
                             files={"file": ("requests.jsonl", content, "application/jsonl")})


def multipart(filename: str, content: bytes, purpose: str = "batch") -> bytes:
    """A multipart body written by hand: the filename's bytes as given (UTF-8), unescaped."""
    return (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n' + purpose.encode() +
            b'\r\n--B\r\nContent-Disposition: form-data; name="file"; filename="' + filename.encode() +
            b'"\r\nContent-Type: application/jsonl\r\n\r\n' + content + b"\r\n--B--\r\n")


def test_an_upload_names_every_bad_line_by_its_number(services):
    [auth] = keys(services, "a")
    content = jsonl(request_line("ok-1"), "not json", request_line("ok-1"), {**request_line("get"), "method": "GET"},
                    request_line("url", url="/v1/moderations"), request_line("model", {**CHAT, "model": "nope"}),
                    request_line("stream", {**CHAT, "stream": True}), ["a list"], request_line("ok-2"))

    async def steps(client, app):
        bad = await upload(client, auth, content)
        good = await upload(client, auth, jsonl(request_line("a"), "", request_line("b")))
        return bad, good

    bad, good = session(services, steps)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert (error["param"], error["code"]) == ("file", "invalid_batch_line")
    message = error["message"]
    assert message.startswith("file: 7 bad lines: line 2: is not JSON; line 3: custom_id 'ok-1' is that of line 1")
    for number, what in ((4, "method must be 'POST'"), (5, "url must be one of"), (6, "body.model: "),
                         (7, "body.stream"), (8, "is not a JSON object")):
        assert f"line {number}: {what}" in message
    assert "line 9" not in message and "line 1:" not in message
    assert good.status_code == 200, good.text
    file = good.json()
    assert (file["object"], file["purpose"], file["filename"], file["status"]) == (
        "file", "batch", "requests.jsonl", "processed")
    assert file["bytes"] == len(jsonl(request_line("a"), "", request_line("b"))) and file["id"].startswith("file-")
    assert file["expires_at"] - file["created_at"] == 30 * 24 * 3600


def test_an_upload_that_is_no_batch_file_is_refused_by_name(services):
    [auth] = keys(services, "a")

    async def steps(client, app):
        return [
            await client.post("/v1/files", headers=auth, json={"purpose": "batch"}),
            await upload(client, auth, jsonl(request_line("a")), purpose="fine-tune"),
            await client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                              files={"upload": ("r.jsonl", jsonl(request_line("a")))}),
            await upload(client, auth, b"\n\n"),
            await upload(client, auth, b"\xff\xfe"),
            await client.post("/v1/files", headers=auth, data={
                "purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
                              files={"file": ("r.jsonl", jsonl(request_line("a")))}),
            *[await upload(client, auth, jsonl(request_line("a")), purpose=spaced)
              for spaced in ("batch ", " batch", "batch\n", "Batch")],
            # httpx writes a NUL in a filename as %00; a client that sends the byte itself:
            *[await client.post("/v1/files", headers={**auth, "content-type": "multipart/form-data; boundary=B"},
                                content=multipart(filename, jsonl(request_line("a"))))
              for filename in ("r\x00.jsonl", "r\x01.jsonl", "r\x1b[31m.jsonl", "r\x7f.jsonl", "r\x85.jsonl")],
            await client.post("/v1/files", headers={**auth, "content-type": "multipart/form-data; boundary=B"},
                              content=multipart("données ✓.jsonl", jsonl(request_line("a")))),
        ]

    media, purpose, missing, empty, binary, expiry, *rest = session(services, steps)
    spaced, named, kept = rest[:4], rest[4:9], rest[9]
    for refused in spaced:
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "purpose"), refused.text
    for refused in named:
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "file"), refused.text
        assert "filename" in refused.json()["error"]["message"]
    assert kept.status_code == 200 and kept.json()["filename"] == "données ✓.jsonl"
    assert media.status_code == 415
    assert (purpose.status_code, purpose.json()["error"]["param"]) == (400, "purpose")
    assert (missing.status_code, missing.json()["error"]["param"]) == (400, "file")
    assert (empty.status_code, empty.json()["error"]["code"]) == (400, "empty_file")
    assert (binary.status_code, binary.json()["error"]["code"]) == (400, "invalid_file")
    assert (expiry.status_code, expiry.json()["error"]["param"]) == (400, "expires_after.seconds")


def test_files_and_batches_are_their_keys_own(services):
    mine, theirs = keys(services, "mine", "theirs")

    async def steps(client, app):
        file_id = (await upload(client, mine, jsonl(request_line("a")))).json()["id"]
        batch = (await client.post("/v1/batches", headers=mine, json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})).json()
        seen_by_them = [
            await client.get(f"/v1/files/{file_id}", headers=theirs),
            await client.get(f"/v1/files/{file_id}/content", headers=theirs),
            await client.delete(f"/v1/files/{file_id}", headers=theirs),
            await client.post("/v1/batches", headers=theirs, json={
                "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
            await client.get(f"/v1/batches/{batch['id']}", headers=theirs),
            await client.post(f"/v1/batches/{batch['id']}/cancel", headers=theirs),
            await client.get("/v1/files/file-nosuchfile", headers=mine),
            await client.get("/v1/batches/batch_nosuchbatch", headers=mine),
        ]
        lists = [(await client.get(path, headers=auth)).json()["data"]
                 for path in ("/v1/files", "/v1/batches") for auth in (mine, theirs)]
        content = await client.get(f"/v1/files/{file_id}/content", headers=mine)
        return batch, seen_by_them, lists, content

    batch, seen_by_them, (my_files, their_files, my_batches, their_batches), content = session(services, steps)
    assert batch["status"] == "in_progress" and batch["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    assert batch["model"] == MODEL and batch["completion_window"] == "24h"
    for response in seen_by_them:
        assert response.status_code == 404, response.text
        assert response.json()["error"]["type"] == "not_found_error"
    assert [f["id"] for f in my_files] == [batch["input_file_id"]] and their_files == []
    assert [b["id"] for b in my_batches] == [batch["id"]] and their_batches == []
    assert content.content == jsonl(request_line("a"))


def test_a_batch_create_refuses_what_it_cannot_run(services):
    [auth] = keys(services, "a")

    async def steps(client, app):
        completion = request_line("cmpl", {"model": MODEL, "prompt": "x"}, url="/v1/completions")
        mixed = jsonl(request_line("chat"), completion)
        file_id = (await upload(client, auth, mixed)).json()["id"]
        create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return [
            await client.post("/v1/batches", headers=auth, json={**create, "endpoint": "/v1/moderations"}),
            await client.post("/v1/batches", headers=auth, json={**create, "completion_window": "1h"}),
            await client.post("/v1/batches", headers=auth, json={**create, "input_file_id": "file-nope"}),
            await client.post("/v1/batches", headers=auth, json={**create, "metadata": {"k": "v" * 513}}),
            await client.get("/v1/batches?limit=0", headers=auth),
            await client.get("/v1/batches?after=batch_unknown", headers=auth),
            await client.post("/v1/batches", headers=auth, json=create),
        ]

    endpoint, window, missing, metadata, limit, after, mixed = session(services, steps)
    assert (endpoint.status_code, endpoint.json()["error"]["param"]) == (400, "endpoint")
    assert window.status_code == 400 and "completion_window" in window.json()["error"]["message"]
    assert (missing.status_code, missing.json()["error"]["param"]) == (404, "input_file_id")
    assert metadata.status_code == 400 and limit.status_code == 400
    assert (after.status_code, after.json()["error"]["param"]) == (400, "after")
    # The file's completions line (its line 2) is not the batch's endpoint: the batch fails, naming it.
    batch = mixed.json()
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [(2, "invalid_request")]
    assert "/v1/completions" in batch["errors"]["data"][0]["message"]


def test_message_batches_refuse_bad_input_in_anthropics_shape(services):
    mine, theirs = keys(services, "mine", "theirs")
    params = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}

    async def steps(client, app):
        made = await client.post("/v1/messages/batches", headers=mine, json={"requests": [
            {"custom_id": "a", "params": params}]})
        batch_id = made.json()["id"]
        return made, [
            await client.post("/v1/messages/batches", headers=mine, json={"requests": []}),
            await client.post("/v1/messages/batches", headers=mine, json={"requests": [
                {"custom_id": "a", "params": params}, {"custom_id": "a", "params": params}]}),
            await client.post("/v1/messages/batches", headers=mine, json={"requests": [
                {"custom_id": "a", "params": {**params, "stream": True}}]}),
            await client.post("/v1/messages/batches", headers=mine, json={"requests": [
                {"custom_id": "bad id!", "params": params}]}),
            await client.get(f"/v1/messages/batches/{batch_id}/results", headers=mine),
            await client.delete(f"/v1/messages/batches/{batch_id}", headers=mine),  # still running
        ], [
            await client.post("/v1/messages/batches", headers=mine, json={"requests": [
                {"custom_id": "a", "params": {**params, "model": "nope"}}]}),
            await client.get(f"/v1/messages/batches/{batch_id}", headers=theirs),
            await client.post(f"/v1/messages/batches/{batch_id}/cancel", headers=theirs),
            await client.get(f"/v1/messages/batches/{batch_id}/results", headers=theirs),
            await client.delete(f"/v1/messages/batches/{batch_id}", headers=theirs),
            await client.get("/v1/messages/batches/batch_notanthropic", headers=mine),
        ], (await client.get("/v1/messages/batches", headers=theirs)).json()

    made, refused, missing, their_list = session(services, steps)
    batch = made.json()
    assert made.status_code == 200 and batch["type"] == "message_batch" and batch["id"].startswith("msgbatch_")
    assert batch["processing_status"] == "in_progress" and batch["results_url"] is None
    assert batch["request_counts"] == {"processing": 1, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    for response in refused:
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert "requests[1].custom_id" in refused[1].json()["error"]["message"]
    assert "requests[0].params.stream" in refused[2].json()["error"]["message"]
    for response in missing:
        assert response.status_code == 404, response.text
        assert response.json()["error"]["type"] == "not_found_error"
    assert "requests[0].params.model" in missing[0].json()["error"]["message"]
    assert their_list == {"data": [], "has_more": False, "first_id": None, "last_id": None}


def test_a_line_runs_through_the_http_path_as_its_batchs_key(services):
    """The executor's call is the batch key's, under the line's id: the same id every run (so
    one ledger row), the endpoint's own checks, and its error shape."""
    [auth] = keys(services, "owner")
    key_id = services.gatekeeper.keys.list()[0].key_id
    batch_id = "batch_" + "A" * 24

    def line(index: int, body: dict, endpoint: str = "/v1/chat/completions", api: str = "openai") -> BatchLine:
        return BatchLine(batch_id, index, f"c{index}", body, endpoint, key_id, api, line_id_of(batch_id, index))

    async def steps(client, app):
        execute = LineExecutor(app, principal_of(services.gatekeeper))
        ok = line(0, CHAT)
        first, again = await execute(ok), await execute(ok)
        bad = await execute(line(1, {**CHAT, "temperature": 5}))
        anthropic = await execute(line(2, {"model": MODEL, "messages": []}, "/v1/messages", "anthropic"))
        row = await services.gatekeeper.ledger.get(first.request_id)
        services.gatekeeper.keys.revoke(key_id)
        revoked = await execute(line(3, CHAT))
        return first, again, bad, anthropic, row, revoked

    first, again, bad, anthropic, row, revoked = session(services, steps)
    assert (first.outcome, first.status_code) == ("succeeded", 200)
    assert first.request_id == f"chatcmpl-{'A' * 24}l0" == first.response["id"] == again.request_id
    assert first.response["choices"][0]["message"]["content"] == again.response["choices"][0]["message"]["content"]
    assert row is not None and (row.key_id, row.status) == (key_id, 200)
    assert (bad.outcome, bad.status_code, bad.response["error"]["param"]) == ("failed", 400, "temperature")
    assert (anthropic.outcome, anthropic.status_code) == ("failed", 400)
    assert anthropic.response["type"] == "error" and anthropic.response["error"]["type"] == "invalid_request_error"
    assert (revoked.outcome, revoked.status_code, revoked.response["error"]["type"]) == (
        "failed", 401, "authentication_error")


def test_no_header_makes_a_network_call_a_batch_lines(services):
    """Only in-process code puts a CallStart in the scope: headers named like it change nothing."""
    [auth] = keys(services, "a")
    forged = {"tokenway.call_start": "k_00000000", "tokenway-call-start": "x", "x-tokenway-batch-line": "forgedl0"}

    async def steps(client, app):
        anonymous = await client.post("/v1/chat/completions", headers=forged, json=CHAT)
        keyed = await client.post("/v1/chat/completions", headers={**forged, **auth}, json=CHAT)
        return anonymous, keyed

    anonymous, keyed = session(services, steps)
    assert anonymous.status_code == 401
    assert keyed.status_code == 200 and "forged" not in keyed.json()["id"]
    assert keyed.json()["id"] == keyed.headers["x-request-id"]


def test_a_key_without_the_batch_tier_is_refused_at_create_not_line_by_line(services):
    secret = services.gatekeeper.keys.create(name="interactive-only", service_tiers=("default",))[0]
    auth = {"Authorization": f"Bearer {secret}"}

    async def steps(client, app):
        file_id = (await upload(client, auth, jsonl(request_line("chat")))).json()["id"]
        return [
            await client.post("/v1/batches", headers=auth, json={
                "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
            await client.post("/v1/messages/batches", headers={**auth, "anthropic-version": "2023-06-01"}, json={
                "requests": [{"custom_id": "a", "params": {"model": MODEL, "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "Hi."}]}}]}),
        ]

    openai_batch, message_batch = session(services, steps)
    assert openai_batch.status_code == 403 and openai_batch.json()["error"]["code"] == "service_tier_not_allowed"
    assert "batch" in openai_batch.json()["error"]["message"]
    assert message_batch.status_code == 403 and message_batch.json()["error"]["type"] == "permission_error"


def test_a_files_list_takes_only_asc_or_desc_order(services):
    [auth] = keys(services, "a")

    async def steps(client, app):
        await upload(client, auth, jsonl(request_line("one")))
        await upload(client, auth, jsonl(request_line("two")))
        return [await client.get(f"/v1/files?order={order}", headers=auth) for order in ("asc", "desc", "newest")]

    asc, desc, bad = session(services, steps)
    assert [f["id"] for f in asc.json()["data"]] == [f["id"] for f in desc.json()["data"]][::-1]
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "order")


def test_a_100000_request_message_batch_is_made_off_the_event_loop(services):
    """Read and checked in the body parser's worker process, stored on the store's thread: /health
    is answered throughout the create, and the server holds the requests packed (about the body's
    own size), never as 100,000 models. The figures (/health p99, the create's time, RSS):
    bench/batch_create_bench.py."""
    [auth] = keys(services, "a")

    def body(requests: int, model_of=lambda i: MODEL) -> bytes:
        return json.dumps({"requests": [{"custom_id": f"q{i}", "params": {
            "model": model_of(i), "max_tokens": 16,
            "messages": [{"role": "user", "content": f"Question {i:06d}: what is the capital of France?"}]}}
            for i in range(requests)]}).encode()

    big = body(100_000)
    bad_last = body(100_000, lambda i: "nope" if i == 99_999 else MODEL)

    async def steps(client, app):
        await client.get("/health")
        num_answered = 0

        async def create(content: bytes) -> httpx.Response:
            return await client.post("/v1/messages/batches", headers={**auth, "content-type": "application/json"},
                                     content=content)

        tracemalloc.start()
        creating = asyncio.create_task(create(big))
        while not creating.done():
            assert (await client.get("/health")).status_code == 200
            num_answered += not creating.done()
            await asyncio.sleep(0.005)
        _, peak_bytes = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return await creating, num_answered, peak_bytes, await create(bad_last)

    created, num_answered, peak_bytes, refused = session(services, steps)
    assert created.status_code == 200, created.text
    assert created.json()["request_counts"]["processing"] == 100_000
    assert num_answered >= 10  # answered while the batch was being made, not only before and after
    # The body (18 MB, held by the test's client too), the packed lines and one chunk of rows at a
    # time: not the 100,000 checked models and their JSON copies (9.4 times the body, measured).
    assert peak_bytes < 4 * len(big), (peak_bytes, len(big))
    assert refused.status_code == 404 and "requests[99999].params.model" in refused.json()["error"]["message"]
