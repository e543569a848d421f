"""What rendering one streamed chat chunk costs: the dict literal the renderer writes (typed by
protocol/openai_bodies.py's TypedDicts, which cost nothing at run time) against a pydantic model
of the same chunk, built and dumped, as a stream would do once per token.

    python bench/render_chunk.py            # best of 5 runs of 200,000 chunks each

Each figure is microseconds per chunk, up to the SSE event's bytes (server/sse.py) where it says
so; the last two build the chunk alone. All three renders send the same chunk. The pydantic
models mirror the ones protocol/openai_responses.py held before the TypedDicts.
"""

from __future__ import annotations

import argparse
import json
import timeit
from typing import Literal

from pydantic import BaseModel, model_serializer

from tokenway.protocol.openai_bodies import ChatCompletionChunk
from tokenway.server import sse


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None = None


class Chunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: None = None


class LeanDelta(ChoiceDelta):
    """A delta that serializes only what it carries, so model_dump_json writes OpenAI's shape."""

    @model_serializer
    def _only_set(self) -> dict[str, str]:
        return {key: value for key, value in (("role", self.role), ("content", self.content)) if value is not None}


class LeanChoice(ChunkChoice):
    delta: LeanDelta


class LeanChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[LeanChoice]
    system_fingerprint: None = None


REQUEST_ID, CREATED, MODEL, TEXT = "chatcmpl-5f1c0a3e9b7d4c21", 1767225600, "smollm2-135m-instruct", " token"


def typed_dict() -> bytes:
    payload: ChatCompletionChunk = {"id": REQUEST_ID, "object": "chat.completion.chunk", "created": CREATED,
                                    "model": MODEL, "choices": [{"index": 0, "delta": {"content": TEXT},
                                                                 "logprobs": None, "finish_reason": None}],
                                    "system_fingerprint": None}
    return sse.data_event(payload)


def pydantic_dump() -> bytes:
    chunk = Chunk(id=REQUEST_ID, created=CREATED, model=MODEL,
                  choices=[ChunkChoice(index=0, delta=ChoiceDelta(content=TEXT))])
    # The delta carries only what changed: its unset fields are left out, the chunk's sent as null.
    payload = chunk.model_dump(mode="json")
    payload["choices"][0]["delta"] = chunk.choices[0].delta.model_dump(exclude_none=True)
    return sse.data_event(payload)


def pydantic_dump_json() -> bytes:
    chunk = LeanChunk(id=REQUEST_ID, created=CREATED, model=MODEL,
                      choices=[LeanChoice(index=0, delta=LeanDelta(content=TEXT))])
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


def dict_only() -> ChatCompletionChunk:
    return {"id": REQUEST_ID, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": TEXT}, "logprobs": None, "finish_reason": None}],
            "system_fingerprint": None}


def pydantic_only() -> Chunk:
    return Chunk(id=REQUEST_ID, created=CREATED, model=MODEL,
                 choices=[ChunkChoice(index=0, delta=ChoiceDelta(content=TEXT))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sent = json.loads(typed_dict()[6:])
    assert sent == json.loads(pydantic_dump()[6:]) == json.loads(pydantic_dump_json()[6:]), "one chunk, three ways"
    results = {}
    for name, render in (("TypedDict literal + json.dumps", typed_dict),
                         ("pydantic build + model_dump + json.dumps", pydantic_dump),
                         ("pydantic build + model_dump_json", pydantic_dump_json),
                         ("TypedDict literal alone", dict_only),
                         ("pydantic build alone", pydantic_only)):
        seconds = min(timeit.repeat(render, number=args.number, repeat=args.repeat))
        results[name] = seconds / args.number * 1e6
    base = results["TypedDict literal + json.dumps"]
    for name, micros in results.items():
        print(f"{name:42s} {micros:6.2f} us/chunk  {micros / base:4.1f}x")


if __name__ == "__main__":
    main()
