"""What a batch's create reads in the body parser's worker process (tokenway/batches/intake.py)
and the packed lines it hands back (packed.py): the same lines, checks and 400s as the routes
made on the loop before, and a real worker process running the reader."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from tokenway.batches.intake import check_batch_file_lines, read_batch_file_lines, read_message_batch
from tokenway.batches.packed import PackedLines
from tokenway.protocol.errors import InvalidRequestError
from tokenway.server.body_parser import BodyParser


def params(i: int, **fields) -> dict:
    return {"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": f"q{i} ✓ \"é\"\n"}], **fields}


def message_batch(*requests: dict) -> bytes:
    return json.dumps({"requests": list(requests)}).encode()


def test_packed_lines_give_back_each_line_as_it_was_written():
    lines = [(f"c{i}-✓", params(i, model=f"m{i % 3}")) for i in range(1100)]
    packed = PackedLines.of(lines)
    assert len(packed) == 1100 and packed.first_model == "m0"
    assert dict(packed.model_to_first_index) == {"m0": 0, "m1": 1, "m2": 2}
    rows = packed.rows(0, 500) + packed.rows(500, 1000) + packed.rows(1000, 2000)
    assert [(custom_id, json.loads(body)) for custom_id, body in rows] == lines
    again = pickle.loads(pickle.dumps(packed))
    assert again.rows(1099, 1100) == packed.rows(1099, 1100)
    with pytest.raises(ValueError, match="unique"):
        PackedLines.of([("a", params(0)), ("a", params(1))])
    assert PackedLines.of([("x", {"model": 7})]).models == frozenset({None})


def test_a_message_batch_is_read_into_packed_lines():
    raw = message_batch(*({"custom_id": f"r-{i}", "params": params(i)} for i in range(3)))
    packed = read_message_batch(raw)
    assert [custom_id for custom_id, _ in packed.rows(0, 3)] == ["r-0", "r-1", "r-2"]
    assert [json.loads(body) for _, body in packed.rows(0, 3)] == [params(i) for i in range(3)]


@pytest.mark.parametrize(("requests", "param"), [
    ([{"custom_id": "a", "params": params(0)}, {"custom_id": "a", "params": params(1)}], "requests[1].custom_id"),
    ([{"custom_id": "a", "params": params(0, stream=True)}], "requests[0].params.stream"),
    ([{"custom_id": "a", "params": params(0)}, {"custom_id": "b", "params": params(1, model=None)}],
     "requests[1].params.model"),
    ([{"custom_id": "a b", "params": params(0)}], "requests[0].custom_id"),  # the schema's own check
    ([], "requests"),
])
def test_what_makes_a_message_batch_unrunnable_is_a_400_naming_the_request(requests, param):
    with pytest.raises(InvalidRequestError) as refused:
        read_message_batch(message_batch(*requests))
    assert refused.value.param == param


def line(custom_id: str, model: str = "m1", url: str = "/v1/chat/completions") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": model, "messages": []}}).encode() + b"\n"


def test_a_files_models_are_asked_once_each_and_every_bad_line_named_in_order():
    raw = (line("a") + b"not json\n" + line("b", "gone") + line("c", url="/v1/embeddings") + line("d", "gone")
           + line("a"))
    asked: list[tuple[str, str]] = []

    def model_error(url: str, model: str) -> str | None:
        asked.append((url, model))
        return "not served" if model == "gone" else None

    reading = read_batch_file_lines(raw)
    bad = reading.problems(model_error, "/v1/chat/completions")
    assert sorted(asked) == [("/v1/chat/completions", "gone"), ("/v1/chat/completions", "m1"),
                             ("/v1/embeddings", "m1")]
    assert [(b.number, b.problem) for b in bad] == [
        (2, "is not JSON"), (3, "body.model: not served"),
        (4, "url /v1/embeddings is not the batch's endpoint /v1/chat/completions"), (5, "body.model: not served"),
        (6, "custom_id 'a' is that of line 1; each must be unique")]
    assert reading.lines is not None and [custom_id for custom_id, _ in reading.lines.rows(0, 9)] == ["a", "b", "c",
                                                                                                   "d"]
    assert check_batch_file_lines(raw).lines is None
    assert [b.number for b in check_batch_file_lines(raw).problems(model_error)] == [2, 3, 5, 6]


def test_the_reader_runs_in_the_body_parsers_worker_process():
    raw = message_batch(*({"custom_id": f"r{i}", "params": params(i)} for i in range(2000)))
    bad = message_batch({"custom_id": "a", "params": params(0)}, {"custom_id": "a", "params": params(1)},
                        *({"custom_id": f"r{i}", "params": params(i)} for i in range(2000)))

    async def main():
        parser = BodyParser(inline_bytes=1024)
        try:
            async def chunks(body: bytes):
                for start in range(0, len(body), 7000):
                    yield body[start:start + 7000]

            packed, num_bytes = await parser.parse_with(chunks(raw), read_message_batch)
            with pytest.raises(InvalidRequestError) as refused:
                await parser.parse_with(chunks(bad), read_message_batch)
            return packed, num_bytes, refused.value, [worker.process.pid for worker in parser._workers]
        finally:
            await parser.close()

    packed, num_bytes, refused, worker_pids = asyncio.run(main())
    assert num_bytes == len(raw) and len(packed) == 2000 and packed.rows(1999, 2000)[0][0] == "r1999"
    assert refused.param == "requests[1].custom_id"
    assert len(worker_pids) == 1  # it ran there: the parser started its worker for it
