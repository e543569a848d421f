"""The context-length 400 for a max_tokens past the window, through every API that shows it (the
Messages API fits max_tokens to the window instead): the text names the prompt's field beside the
completion, and param the field at fault."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

HUGE = 1_000_000_000
CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": HUGE},
     "messages", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": HUGE},
     "messages", "max_completion_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": HUGE}, "prompt", "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": HUGE}, "prompt", "max_tokens"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": HUGE}, "input", "max_output_tokens"),
]


def post(app, path: str, body: dict) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.post(path, json={"model": "smollm2-135m-instruct", **body})

    return asyncio.run(main())


@pytest.mark.parametrize(("path", "body", "prompt", "param"), CASES)
def test_the_message_counts_the_prompt_as_the_prompt(app_and_ledger, path, body, prompt, param):
    app, _ = app_and_ledger
    response = post(app, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    found = re.search(rf"you requested (\d+) tokens \((\d+) in the (\w+), {HUGE} in the completion\)",
                      error["message"])
    assert found is not None, error["message"]
    total, num_prompt_tokens, named = int(found[1]), int(found[2]), found[3]
    assert named == prompt and 0 < num_prompt_tokens < 100 and total == num_prompt_tokens + HUGE
    assert f"reduce the length of the {prompt} or completion" in error["message"]
    assert error["param"] == param
