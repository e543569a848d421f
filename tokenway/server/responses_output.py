"""A reply's output items, as OpenAI's Responses API has them, made as its deltas arrive: the
items themselves (a reasoning item, a message, function calls) and, for a stream, the typed
events each delta makes (responses_render.py frames them between the lifecycle events).

    ChoiceDelta (Generation.outputs()) ─► OutputItems.feed ─► [ResponseStreamEvent ...]
                                        ─► OutputItems.close(finish_reason) ─► .items
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenway.protocol.job import ChoiceDelta
from tokenway.protocol.responses_bodies import (
    DeltaLogprob,
    FunctionCallItem,
    ItemStatus,
    Logprob,
    OutputItem,
    OutputMessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseStreamEvent,
)
from tokenway.protocol.responses_items import reasoning_envelope
from tokenway.server.openai_render import TokenText
from tokenway.server.prepare import new_id


class OutputItems:
    """A reply's output items as its deltas arrive (Generation.outputs(): its thinking split off,
    screened, its tool calls parsed into pieces): thinking opens a reasoning item, text a
    message item, a tool call's first piece (id, name) a function_call item, and the next item
    closes the open one. With `stream`, feed() and close() return the events each step makes;
    without, they build the items only. encrypted_reasoning (include
    reasoning.encrypted_content): a reasoning item carries its text in tokenway's envelope too."""

    def __init__(self, stream: bool, sequence: Iterator[int], token_text: TokenText | None, top_logprobs: int,
                 namespaces: dict[str, str] | None = None, encrypted_reasoning: bool = False) -> None:
        self.items: list[OutputItem] = []
        self.namespaces = namespaces or {}  # function name -> its namespace tool's name
        self.stream = stream
        self.sequence = sequence  # the stream's sequence_number, shared with its lifecycle events
        self.token_text = token_text  # None: no logprobs asked for
        self.top_logprobs = top_logprobs
        self.encrypted_reasoning = encrypted_reasoning
        self._reasoning: ReasoningItem | None = None  # the open reasoning item, its text in _thoughts until closed
        self._thoughts: list[str] = []
        self._message: OutputMessageItem | None = None  # the open message, its text in _texts until closed
        self._texts: list[str] = []
        self._logprobs: list[Logprob] = []
        self._call: FunctionCallItem | None = None  # the open call, its arguments in _arguments
        self._arguments: list[str] = []
        self._call_index = -1  # the open call's index among the reply's calls

    def feed(self, delta: ChoiceDelta) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        if delta.reasoning:  # a delta's thinking comes before its text
            if self._reasoning is None:
                events += self._open_reasoning()
            self._thoughts.append(delta.reasoning)
            if self.stream:
                assert self._reasoning is not None
                events.append({"type": "response.reasoning_text.delta", "sequence_number": next(self.sequence),
                               "item_id": self._reasoning["id"], "output_index": len(self.items) - 1,
                               "content_index": 0, "delta": delta.reasoning})
        # A delta of thinking alone: its tokens' logprobs are not the message's.
        logprobs = self._logprobs_of(delta) if delta.text or not delta.reasoning else []
        if delta.text or logprobs:
            if self._message is None:
                events += self._open_message()
            self._texts.append(delta.text)
            self._logprobs += logprobs
            if self.stream:
                assert self._message is not None
                events.append({"type": "response.output_text.delta", "sequence_number": next(self.sequence),
                               "item_id": self._message["id"], "output_index": len(self.items) - 1,
                               "content_index": 0, "delta": delta.text, "logprobs": streamed(logprobs)})
        for piece in delta.tool_calls:
            if self._call is None or piece.index != self._call_index:
                events += self._close("completed")
                call: FunctionCallItem = {"id": new_id("fc_"), "type": "function_call", "call_id": piece.id or "",
                                          "name": piece.name or "", "arguments": "", "status": "in_progress"}
                if call["name"] in self.namespaces:
                    call["namespace"] = self.namespaces[call["name"]]
                self._call, self._call_index = call, piece.index
                events += self._added(call)
            if piece.arguments:
                self._arguments.append(piece.arguments)
                if self.stream:
                    assert self._call is not None
                    events.append({"type": "response.function_call_arguments.delta",
                                   "sequence_number": next(self.sequence), "item_id": self._call["id"],
                                   "output_index": len(self.items) - 1, "delta": piece.arguments})
        return events

    def close(self, finish_reason: str | None) -> list[ResponseStreamEvent]:
        """End the reply: its last item is cut (incomplete) where max_output_tokens or the safety
        stage ended it; a reply of nothing is one empty message, as OpenAI sends it."""
        events = [] if self.items else self._open_message()
        return events + self._close("incomplete" if finish_reason in ("length", "content_filter") else "completed")

    def _logprobs_of(self, delta: ChoiceDelta) -> list[Logprob]:
        if self.token_text is None or not delta.logprobs:
            return []
        return self.token_text.chat_logprobs(delta.logprobs, self.top_logprobs)["content"]

    def _open_message(self) -> list[ResponseStreamEvent]:
        events = self._close("completed")
        message: OutputMessageItem = {"id": new_id("msg_"), "type": "message", "role": "assistant",
                                      "status": "in_progress", "content": []}
        self._message = message
        events += self._added(message)
        if self.stream:
            events.append({"type": "response.content_part.added", "sequence_number": next(self.sequence),
                           "item_id": message["id"], "output_index": len(self.items) - 1, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        return events

    def _open_reasoning(self) -> list[ResponseStreamEvent]:
        events = self._close("completed")
        item: ReasoningItem = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                               "encrypted_content": None, "status": "in_progress"}
        self._reasoning = item
        events += self._added(item)
        if self.stream:
            events.append({"type": "response.content_part.added", "sequence_number": next(self.sequence),
                           "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0,
                           "part": {"type": "reasoning_text", "text": ""}})
        return events

    def _added(self, item: OutputItem) -> list[ResponseStreamEvent]:
        self.items.append(item)
        if not self.stream:
            return []
        return [{"type": "response.output_item.added", "sequence_number": next(self.sequence),
                 "output_index": len(self.items) - 1, "item": item.copy()}]

    def _close(self, status: ItemStatus) -> list[ResponseStreamEvent]:
        """Finish the open item (its text or arguments joined once) with `status`."""
        events: list[ResponseStreamEvent] = []
        index = len(self.items) - 1
        if self._message is not None:
            message, self._message = self._message, None
            part: OutputText = {"type": "output_text", "text": "".join(self._texts), "annotations": [],
                                "logprobs": self._logprobs}
            self._texts, self._logprobs = [], []
            message["content"], message["status"] = [part], status
            if self.stream:
                item_id = message["id"]
                events.append({"type": "response.output_text.done", "sequence_number": next(self.sequence),
                               "item_id": item_id, "output_index": index, "content_index": 0, "text": part["text"],
                               "logprobs": streamed(part["logprobs"])})
                events.append({"type": "response.content_part.done", "sequence_number": next(self.sequence),
                               "item_id": item_id, "output_index": index, "content_index": 0, "part": part})
        elif self._call is not None:
            call, self._call = self._call, None
            call["arguments"], call["status"] = "".join(self._arguments), status
            self._arguments = []
            if self.stream:
                events.append({"type": "response.function_call_arguments.done", "sequence_number": next(self.sequence),
                               "item_id": call["id"], "output_index": index, "arguments": call["arguments"]})
        elif self._reasoning is not None:
            item, self._reasoning = self._reasoning, None
            thinking: ReasoningText = {"type": "reasoning_text", "text": "".join(self._thoughts)}
            self._thoughts = []
            item["content"], item["status"] = [thinking], status
            if self.encrypted_reasoning:
                item["encrypted_content"] = reasoning_envelope(thinking["text"])
            if self.stream:
                events.append({"type": "response.reasoning_text.done", "sequence_number": next(self.sequence),
                               "item_id": item["id"], "output_index": index, "content_index": 0,
                               "text": thinking["text"]})
                events.append({"type": "response.content_part.done", "sequence_number": next(self.sequence),
                               "item_id": item["id"], "output_index": index, "content_index": 0, "part": thinking})
        else:
            return events
        if self.stream:
            events.append({"type": "response.output_item.done", "sequence_number": next(self.sequence),
                           "output_index": index, "item": self.items[index]})
        return events


def streamed(logprobs: list[Logprob]) -> list[DeltaLogprob]:
    """Logprobs as a stream's text events carry them: without the bytes."""
    return [{"token": lp["token"], "logprob": lp["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in lp["top_logprobs"]]}
            for lp in logprobs]
