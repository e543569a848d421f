"""A real HTTP server on loopback (uvicorn, h11, in a thread) whose answers each test scripts,
for the upstream clients: OpenAI chat completions, Anthropic Messages, OpenAI Responses.

    with StubUpstream() as stub:
        stub.script(Reply(chunks=(openai_chunk(text="Hi"), DONE)))
        ... the client under test calls stub.base_url ...
        stub.received[0].body           # the exact JSON the client sent
        stub.wait_for(lambda: stub.num_disconnects == 1)

A Reply sends its status and headers, then its chunks one by one (a threading.Event in the
chunks holds the rest back until the test sets it), then ends the body, drops the connection
("close") or sends nothing more until the client goes away ("hang"; the stub counts that
disconnect). hang_before_headers never answers at all.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Self

import uvicorn

DONE = b"data: [DONE]\n\n"


def sse(payload: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


def openai_chunk(index: int = 0, text: str | None = None, tool_calls: list[dict] | None = None,
                 finish_reason: str | None = None, usage: dict | None = None, **choice_fields: Any) -> bytes:
    delta: dict[str, Any] = {}
    if text is not None:
        delta["content"] = text
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason, **choice_fields}
    return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "up", "choices": [choice],
                "usage": usage})


def usage_fields(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def openai_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
    usage = usage_fields(prompt_tokens, completion_tokens, cached_tokens)
    return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "up", "choices": [], "usage": usage})


def openai_answer(text: str | None = "", finish_reason: str = "stop", usage: dict[str, Any] | None = None,
                  **message: Any) -> Reply:
    """A non-streamed chat.completion of one choice (its message's fields: content `text`, and
    `message`), as the whole 200 answer; usage as usage_fields makes it."""
    return json_reply({"id": "chatcmpl-1", "object": "chat.completion", "model": "up", "usage": usage,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text, **message},
                                    "finish_reason": finish_reason}]})


def json_reply(payload: Any, status: int = 200) -> Reply:
    return Reply(status=status, chunks=(json.dumps(payload).encode(),), headers={"content-type": "application/json"})


def anthropic_answer(*content: dict[str, Any], stop_reason: str = "end_turn", **usage: int) -> Reply:
    """A non-streamed Messages answer of these content blocks; usage as Anthropic counts it."""
    return json_reply({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-up",
                       "content": list(content), "stop_reason": stop_reason, "stop_sequence": None, "usage": usage})


def anthropic_event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, event=kind)


def responses_event(kind: str, **fields: Any) -> bytes:
    """One event of OpenAI's Responses stream (named, as OpenAI sends them)."""
    return sse({"type": kind, **fields}, event=kind)


def responses_final(status: str = "completed", input_tokens: int = 10, output_tokens: int = 5, cached_tokens: int = 0,
                    reasoning_tokens: int = 0, incomplete_reason: str | None = None) -> bytes:
    """A Responses stream's last event, its response's usage in it."""
    usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
             "total_tokens": input_tokens + output_tokens}
    response = {"id": "resp_up", "object": "response", "status": status, "usage": usage,
                "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None}
    return responses_event(f"response.{status}", response=response)


def responses_object(*output: dict[str, Any], status: str = "completed", incomplete_reason: str | None = None,
                     **usage: int) -> dict[str, Any]:
    """A non-streamed response (as json_reply's payload): these output items, the usage."""
    counts = {"input_tokens": 10, "output_tokens": 5} | usage
    return {"id": "resp_up", "object": "response", "status": status, "error": None, "output": list(output),
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "usage": {"input_tokens": counts["input_tokens"], "output_tokens": counts["output_tokens"],
                      "input_tokens_details": {"cached_tokens": counts.get("cached_tokens", 0)},
                      "output_tokens_details": {"reasoning_tokens": counts.get("reasoning_tokens", 0)}}}


def output_message(*texts: str) -> dict[str, Any]:
    """A response's message item, its text in these parts."""
    return {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []} for text in texts]}


def text_item(output_index: int, *pieces: str) -> tuple[bytes, ...]:
    """A Responses stream's message item, its text in these pieces."""
    item = {"id": f"msg_{output_index}", "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}
    return (responses_event("response.output_item.added", output_index=output_index, item=item),
            responses_event("response.content_part.added", item_id=item["id"], output_index=output_index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []}),
            *(responses_event("response.output_text.delta", item_id=item["id"], output_index=output_index,
                              content_index=0, delta=piece, logprobs=[]) for piece in pieces),
            responses_event("response.output_text.done", item_id=item["id"], output_index=output_index,
                            content_index=0, text="".join(pieces)),
            responses_event("response.output_item.done", output_index=output_index,
                            item={**item, "status": "completed"}))


def call_item(output_index: int, call_id: str, *pieces: str) -> tuple[bytes, ...]:
    """... a function_call item (get_weather), its arguments in these pieces."""
    item = {"id": f"fc_{output_index}", "type": "function_call", "call_id": call_id, "name": "get_weather",
            "arguments": "", "status": "in_progress"}
    return (responses_event("response.output_item.added", output_index=output_index, item=item),
            *(responses_event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=output_index, delta=piece) for piece in pieces),
            responses_event("response.function_call_arguments.done", item_id=item["id"], output_index=output_index,
                            arguments="".join(pieces)),
            responses_event("response.output_item.done", output_index=output_index,
                            item={**item, "arguments": "".join(pieces), "status": "completed"}))


def reasoning_item(output_index: int, kind: str, *pieces: str) -> tuple[bytes, ...]:
    """... a reasoning item, its text in `kind` deltas: reasoning_text or reasoning_summary_text."""
    item = {"id": f"rs_{output_index}", "type": "reasoning", "summary": []}
    return (responses_event("response.output_item.added", output_index=output_index, item=item),
            *(responses_event(f"response.{kind}.delta", item_id=item["id"], output_index=output_index,
                              **({"summary_index": 0} if "summary" in kind else {"content_index": 0}), delta=piece)
              for piece in pieces),
            responses_event("response.output_item.done", output_index=output_index, item=item))


@dataclass
class Reply:
    status: int = 200
    chunks: tuple[bytes | threading.Event, ...] = ()
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream"})
    then: Literal["end", "close", "hang"] = "end"
    hang_before_headers: bool = False


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the parsed JSON, or None
    client_port: int  # which connection it came on


class StubUpstream:
    """answer_models: GET .../models answers 200 by itself (a gateway's health probes), neither
    recorded nor taking a scripted reply."""

    def __init__(self, answer_models: bool = False) -> None:
        self.answer_models = answer_models
        self.received: list[Received] = []
        self.num_disconnects = 0
        self._replies: list[Reply] = []
        self._lock = threading.Lock()
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self._app, http="h11", interface="asgi3", lifespan="off", log_level="critical",
                                access_log=False, timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def num_open_connections(self) -> int:
        return len(self._server.server_state.connections)

    def script(self, *replies: Reply) -> None:
        """Answer the next calls with these, in order; the last one answers every call after."""
        with self._lock:
            self._replies = list(replies)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Whether condition() became true: the server sees a closed socket a moment after the client closes it."""
        give_up_at = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > give_up_at:
                return False
            time.sleep(0.01)
        return True

    def __enter__(self) -> Self:
        self._thread.start()
        assert self.wait_for(lambda: self._server.started), "stub upstream did not start"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()

    def _next_reply(self) -> Reply:
        with self._lock:
            return self._replies.pop(0) if len(self._replies) > 1 else self._replies[0]

    async def _app(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {name.decode(): value.decode() for name, value in scope["headers"]}
        if self.answer_models and scope["method"] == "GET" and scope["path"].endswith("/models"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"object": "list", "data": []}'})
            return
        with self._lock:
            self.received.append(Received(scope["method"], scope["path"], headers, json.loads(body) if body else None,
                                          scope["client"][1]))
        reply = self._next_reply()
        if reply.hang_before_headers:
            return await self._until_disconnect(receive)
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(k.encode(), v.encode()) for k, v in reply.headers.items()]})
        for chunk in reply.chunks:
            if isinstance(chunk, threading.Event):
                while not chunk.is_set():
                    await asyncio.sleep(0.005)
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if reply.then == "end":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif reply.then == "hang":
            await self._until_disconnect(receive)
        # "close": returning with the body unfinished makes uvicorn drop the connection

    async def _until_disconnect(self, receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        with self._lock:
            self.num_disconnects += 1


def collect(upstream: Any, job: Any) -> list[Any]:
    """Every event upstream.generate(job) yields, on a fresh event loop (the upstream is closed after)."""

    async def main() -> list[Any]:
        async with upstream:
            return [event async for event in upstream.generate(job)]

    return asyncio.run(main())


def reassemble_tool_calls(events: list[Any], index: int = 0) -> list[dict[str, str]]:
    """One choice's ToolCallDeltas put back together, as a caller's SDK would."""
    calls: dict[int, dict[str, str]] = {}
    for event in events:
        for delta in getattr(event, "tool_calls", ()) if getattr(event, "index", None) == index else ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.name or ""
            call["arguments"] += delta.arguments
    return [calls[i] for i in sorted(calls)]
