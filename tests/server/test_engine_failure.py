"""A request that fails inside the engine: a plain 500 (no traceback), the server keeps
serving, and the ledger still gets its one row."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tokenway.billing.ledger import Ledger


def test_engine_failure_is_a_500_with_a_ledger_row(app_and_ledger, llm, monkeypatch):
    app, ledger = app_and_ledger
    runner = llm.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def failing_once(out, interjection=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device failure")
        return real_execute(out, interjection)

    monkeypatch.setattr(runner, "execute", failing_once)
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            failed = await client.post("/v1/chat/completions", json=body)
            healthy = await client.post("/v1/chat/completions", json=body)
        await asyncio.sleep(0.05)
        return failed, healthy, await ledger.usage(None)

    failed, healthy, usage = asyncio.run(main())
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "internal_error" and "Traceback" not in failed.text
    assert "simulated" not in failed.text
    assert healthy.status_code == 200  # the engine kept serving
    rows = asyncio.run(_rows(ledger))
    assert sorted(r.status for r in rows) == [200, 500]
    assert next(r for r in rows if r.status == 500).error
    assert usage and usage[0]["requests"] == 2


async def _rows(ledger: Ledger):
    import sqlite3

    with sqlite3.connect(ledger._url.removeprefix("sqlite:///")) as conn:
        ids = [row[0] for row in conn.execute("SELECT request_id FROM usage_ledger")]
    return [await ledger.get(request_id) for request_id in ids]


@pytest.mark.parametrize("path, body, last_events", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
     ['data: {"error":{"message":"The engine failed while generating this request.",'
      '"type":"internal_error","param":null,"code":null}}', "data: [DONE]"]),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
     ["event: error", 'data: {"type":"error","error":{"type":"api_error",'
                      '"message":"The engine failed while generating this request."}}']),
])
def test_engine_failure_mid_stream_ends_with_an_error_event(app_and_ledger, llm, monkeypatch, path, body,
                                                             last_events):
    app, ledger = app_and_ledger
    runner = llm.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def failing_after_the_first_token(out, interjection=None):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("simulated device failure")
        return real_execute(out, interjection)

    monkeypatch.setattr(runner, "execute", failing_after_the_first_token)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            response = await client.post(path, json={"model": "smollm2-135m-instruct", **body})
        await asyncio.sleep(0.05)
        return response

    response = asyncio.run(main())
    assert response.status_code == 200  # the stream had begun: its first token was out
    lines = [line for line in response.text.splitlines() if line and not line.startswith(":")]
    assert lines[-2:] == last_events
    assert [r.status for r in asyncio.run(_rows(ledger))] == [500]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_engine_failure_before_the_first_token_of_a_stream_is_a_500(app_and_ledger, llm, monkeypatch, path):
    app, ledger = app_and_ledger

    def failing(out, interjection=None):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(llm.engine.runner, "execute", failing)
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            response = await client.post(path, json=body)
        await asyncio.sleep(0.05)
        return response

    response = asyncio.run(main())
    assert response.status_code == 500 and response.headers["content-type"].startswith("application/json")
    assert "simulated" not in response.text and "Traceback" not in response.text
    assert [r.status for r in asyncio.run(_rows(ledger))] == [500]
