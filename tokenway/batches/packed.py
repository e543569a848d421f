"""PackedLines: a batch's lines as the store writes them, each line's custom_id and its body's JSON
text packed into two UTF-8 blobs with their end offsets, beside the models the bodies name.

    worker process: LinePacker.add(custom_id, body) ... ─► PackedLines ─pickle─► the server
    the server: models checked ─► BatchStore.create_batch(batch, packed) ─► rows(start, stop), a chunk at a time

100,000 lines are a handful of objects rather than 100,000 dicts: they cross from the body
parser's worker process in one quick unpickle (a few milliseconds of the event loop, where
100,000 checked models took most of a second), take about the body's own size in memory, and
are decoded into rows only a chunk at a time, on the store's thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenway.batches.schema import dumps

JSONObject = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PackedLines:
    custom_ids: bytes  # UTF-8, one after another
    custom_id_ends: array  # 'q': the end of line i's custom_id in custom_ids
    bodies: bytes  # UTF-8 JSON texts (schema.dumps), one after another
    body_ends: array  # 'q'
    # Each distinct body "model", in the order first named, with the index of the first line
    # naming it; None for a body whose model is not a string.
    model_to_first_index: Mapping[str | None, int]

    def __post_init__(self) -> None:
        if len(self.custom_id_ends) != len(self.body_ends):
            raise ValueError("a custom_id and a body for every line")

    def __len__(self) -> int:
        return len(self.body_ends)

    @property
    def models(self) -> frozenset[str | None]:
        return frozenset(self.model_to_first_index)

    @property
    def first_model(self) -> str | None:
        """The first line's model (a batch's `model`), if it names one."""
        for model, index in self.model_to_first_index.items():
            if index == 0:
                return model
        return None

    def rows(self, start: int, stop: int) -> list[tuple[str, str]]:
        """Lines [start, stop) as (custom_id, body JSON text)."""
        stop = min(stop, len(self))
        id_start = self.custom_id_ends[start - 1] if start else 0
        body_start = self.body_ends[start - 1] if start else 0
        rows = []
        for index in range(start, stop):
            id_end, body_end = self.custom_id_ends[index], self.body_ends[index]
            rows.append((self.custom_ids[id_start:id_end].decode(), self.bodies[body_start:body_end].decode()))
            id_start, body_start = id_end, body_end
        return rows

    @classmethod
    def of(cls, lines: Iterable[tuple[str, JSONObject]]) -> PackedLines:
        """From (custom_id, body) pairs; ValueError for a custom_id used twice."""
        packer = LinePacker()
        for custom_id, body in lines:
            if packer.add(custom_id, body) is not None:
                raise ValueError("a batch's custom_ids must be unique")
        return packer.packed()


class LinePacker:
    """PackedLines built a line at a time."""

    def __init__(self) -> None:
        self._custom_ids, self._bodies = bytearray(), bytearray()
        self._custom_id_ends, self._body_ends = array("q"), array("q")
        self._custom_id_to_index: dict[str, int] = {}
        self._model_to_first_index: dict[str | None, int] = {}

    def __len__(self) -> int:
        return len(self._body_ends)

    def add(self, custom_id: str, body: JSONObject) -> int | None:
        """Add the line, unless its custom_id is an earlier line's: then that line's index, and
        nothing is added."""
        index = len(self._body_ends)
        earlier = self._custom_id_to_index.setdefault(custom_id, index)
        if earlier != index:
            return earlier
        model = body.get("model")
        self._model_to_first_index.setdefault(model if isinstance(model, str) else None, index)
        self._custom_ids += custom_id.encode()
        self._bodies += dumps(body).encode()
        self._custom_id_ends.append(len(self._custom_ids))
        self._body_ends.append(len(self._bodies))
        return None

    def packed(self) -> PackedLines:
        return PackedLines(bytes(self._custom_ids), self._custom_id_ends, bytes(self._bodies), self._body_ends,
                           dict(self._model_to_first_index))
