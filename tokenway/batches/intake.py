"""What a batch's create reads, run in the body parser's worker process (server/body_parser.py
parse_with) so that the event loop never parses, checks or copies 100,000 requests:

    POST /v1/messages/batches: the body ─► read_message_batch ─► PackedLines, or the 400
    POST /v1/files: the file ─► check_batch_file_lines ─► FileReading (its bad lines)
    POST /v1/batches: the file ─► read_batch_file_lines ─► FileReading (its lines packed too)

What needs the server (is a model served, may this key use it) is asked once per distinct model
back on the server (FileReading.problems; PackedLines.model_to_first_index), not once per line.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokenway.batches.packed import LinePacker, PackedLines
from tokenway.protocol.batches import BadLine, MessageBatchCreateRequest, read_batch_file
from tokenway.protocol.body import decode_json_body
from tokenway.protocol.errors import InvalidRequestError


def read_message_batch(raw: bytes) -> PackedLines:
    """An Anthropic message batch's requests, packed; a 400 for what would make the batch
    unrunnable (a repeated custom_id, a stream, a model that is not a string), naming the request."""
    body = decode_json_body(raw, MessageBatchCreateRequest)
    packer = LinePacker()
    for index, item in enumerate(body.requests):
        where = f"requests[{index}]"
        if packer.add(item.custom_id, item.params) is not None:
            raise InvalidRequestError(f"{where}.custom_id: {item.custom_id!r} is used by an earlier request; "
                                      "each must be unique", param=f"{where}.custom_id")
        model, stream = item.params.get("model"), item.params.get("stream")
        if stream is True:
            raise InvalidRequestError(f"{where}.params.stream: a batch's requests are answered whole; "
                                      "remove stream", param=f"{where}.params.stream")
        if not isinstance(model, str):
            raise InvalidRequestError(f"{where}.params.model: a string is required", param=f"{where}.params.model")
    return packer.packed()


@dataclass(frozen=True, slots=True)
class FileReading:
    """An OpenAI batch input file as read: its bad lines, and each (url, model) its good lines
    name with those lines' numbers (1-based); the good lines packed where asked for."""

    bad: tuple[BadLine, ...]  # in line order
    url_model_to_numbers: Mapping[tuple[str, str], array]  # 'q'
    lines: PackedLines | None

    def problems(self, model_error: Callable[[str, str], str | None], endpoint: str | None = None) -> list[BadLine]:
        """Every bad line, in order: those refused as read, those whose model the endpoint cannot
        run for this key (model_error(url, model): why, or None), and, given the batch's
        endpoint, those whose url is another."""
        bad = list(self.bad)
        for (url, model), numbers in self.url_model_to_numbers.items():
            error = model_error(url, model)
            if error is not None:
                bad += [BadLine(number, f"body.model: {error}") for number in numbers]
            elif endpoint is not None and url != endpoint:
                bad += [BadLine(number, f"url {url} is not the batch's endpoint {endpoint}") for number in numbers]
        bad.sort(key=lambda line: line.number)
        return bad


def check_batch_file_lines(raw: bytes) -> FileReading:
    """An upload's check: what read_batch_file_lines finds, without the lines."""
    return _read_file(raw, pack=False)


def read_batch_file_lines(raw: bytes) -> FileReading:
    return _read_file(raw, pack=True)


def _read_file(raw: bytes, *, pack: bool) -> FileReading:
    lines, bad = read_batch_file(raw, lambda url, model: None)  # models: asked on the server, once each
    url_model_to_numbers: dict[tuple[str, str], array] = {}
    packer = LinePacker() if pack else None
    for line in lines:
        url_model_to_numbers.setdefault((line.url, line.body["model"]), array("q")).append(line.number)
        if packer is not None:
            packer.add(line.custom_id, line.body)  # custom_ids are unique: read_batch_file refused repeats
    return FileReading(tuple(bad), url_model_to_numbers, packer.packed() if packer is not None else None)
