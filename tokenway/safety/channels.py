"""What a request carries into the prompt, as the texts the input screen reads, and the request
again with the screen's redactions in place.

    ChatInput(messages, tools, response_format)  a chat call's template input (OpenAI chat, and
                                                 Anthropic Messages once to_chat_messages made it so)
        .texts()             -> PromptText ...   every text in it, in prompt order
        .redacted(new_texts) -> ChatInput        the same with each text replaced by its new one
    screen_chat(screen, chat) -> ChatInput       both, around the server's screen (server/prepare.py screen)
    screen_prompts(screen, items, decode, param) completion prompts, embeddings inputs: each alone

A chat call carries: every message's content (system, user, assistant, tool results), name and
tool_call_id; each earlier tool call's id, name and arguments; each tool's definition (name,
description, its parameters schema with every description, enum value, default and property
name in it); the response_format (its name, description and schema). JSON (arguments, tools,
schemas) is read as its values, decoded: a number written with escapes ("\\u0034") or split by
"\\n" in a string is seen as the template renders it, and a redaction lands inside a string
value, so the document stays valid JSON. Under `redact`:
  - a string value, or free text, is redacted in place;
  - a number in tool-call arguments becomes the redaction string (a JSON string);
  - an object key, or a number in a tool definition or a schema, cannot be redacted without
    changing what the document means (a renamed property, a schema whose "minimum" is a
    string): a finding there refuses the call, as `block` does.

Message contents "flow": the template writes them in sequence, and the screen joins them in
order with line breaks, which a card number, an IBAN or a key may run across (detectors.py) and
nothing else does, so a number split between two parts (joined by a line break already) or two
messages is seen whole, and digits ending one message and starting the next are a card only if
they pass its checksum and grouping. Names, ids and JSON values stand alone: nothing runs into
or out of them. A completion's prompts and embeddings inputs are each a prompt of their own.

Not carried, so not screened: image, audio and document parts (refused by the schemas: the
models are text-only); tool_choice (it names a tool already read).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# A text that stands alone (a name, an id, a JSON value or key) and is ASCII holds no finding when
# it is this short (the shortest finding, an email, has 6 characters), or shorter than the
# shortest key (Slack's, 15) with no digit and no "@": it is not screened (tool schemas are
# mostly such words: "type", "string", "description", "order_id").
_MIN_CHARS, _MIN_KEY_CHARS = 6, 15
_DIGIT_OR_AT = re.compile(r"[0-9@]")


@dataclass(frozen=True, slots=True)
class PromptText:
    """One text a request carries into the prompt."""

    text: str
    param: str = "messages"  # the request field it is in, named in a refusal
    flows: bool = False  # a message's content: joined with the other contents, in order
    redactable: bool = True  # False: a finding here refuses the call under redact too


# visit(text, param, flows, redactable) -> the text to put in its place
Visit = Callable[[str, str, bool, bool], str]


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A chat call's template input: messages as the chat template takes them (content a
    string or text parts), tools in OpenAI's shape, the response_format."""

    messages: list[dict]
    tools: list[dict] | None = None
    response_format: dict | None = None

    def texts(self) -> Iterator[PromptText]:
        """Every text the call carries into the prompt, in the order the template writes them
        (a generator: nothing is read until it is iterated)."""
        found: list[PromptText] = []

        def collect(text: str, param: str, flows: bool, redactable: bool) -> str:
            found.append(PromptText(text, param, flows, redactable))
            return text

        self._walk(collect)
        yield from found

    def redacted(self, new_texts: Sequence[str]) -> ChatInput:
        """This input with its texts (in texts() order) replaced by `new_texts`; the parts
        whose texts did not change are the same objects."""
        replacements = iter(new_texts)
        result = self._walk(lambda text, param, flows, redactable: next(replacements))
        if next(replacements, None) is not None:
            raise ValueError("new_texts: more texts than the input has")
        return result

    def _walk(self, visit: Visit) -> ChatInput:
        """The one traversal texts() and redacted() share, so they agree on the order."""
        messages = [_walk_message(message, visit) for message in self.messages]
        tools, same_tools = None, True
        if self.tools is not None:
            tools = [_walk_json(tool, visit, "tools", schema=True) for tool in self.tools]
            same_tools = all(new is old for new, old in zip(tools, self.tools))
        response_format = None if self.response_format is None else _walk_json(
            self.response_format, visit, "response_format", schema=True)
        if (all(new is old for new, old in zip(messages, self.messages)) and response_format is self.response_format
                and same_tools):
            return self
        return ChatInput(messages, tools, response_format)


# The server's input check: the texts -> every text redacted, or None (nothing to change).
Screen = Callable[[Iterable[PromptText]], Sequence[str] | None]


def screen_chat(screen: Screen, chat: ChatInput) -> ChatInput:
    """`chat` screened: as it is, or with the screen's redactions in place."""
    redacted = screen(chat.texts())
    return chat if redacted is None else chat.redacted(redacted)


def screen_prompts(screen: Screen, items: Sequence[str | Sequence[int]], decode: Callable[[Sequence[int]], str],
                   param: str) -> list[str | None] | None:
    """Prompts of their own (a completion's prompts, embeddings inputs), each screened alone,
    none flowing into the next; an item of token ids is read as decode() gives its text, only
    when a policy reads at all. None when nothing changes, else each item's redacted text, None
    where that item is unchanged."""
    texts = [item if isinstance(item, str) else "" for item in items]

    def read() -> Iterator[PromptText]:
        for i, item in enumerate(items):
            if not isinstance(item, str):
                texts[i] = decode(item)
            yield PromptText(texts[i], param)

    redacted = screen(read())
    if redacted is None:
        return None
    return [None if new == text else new for new, text in zip(redacted, texts)]


def _walk_message(message: dict, visit: Visit) -> dict:
    changes: dict[str, Any] = {}
    content = message.get("content")
    if isinstance(content, str):
        changes["content"] = _visit(content, visit, "messages", True, True)
    elif isinstance(content, list):  # text parts
        parts = [_walk_part(part, visit) for part in content]
        changes["content"] = content if all(new is old for new, old in zip(parts, content)) else parts
    for field in ("reasoning_content", "reasoning"):  # a reasoning model's thinking, passed back into the prompt
        if isinstance(message.get(field), str):
            changes[field] = _visit(message[field], visit, "messages", True, True)
    for field in ("name", "tool_call_id"):
        if isinstance(message.get(field), str):
            changes[field] = _visit_field(message[field], visit, "messages")
    if message.get("tool_calls"):
        calls = [_walk_call(call, visit) for call in message["tool_calls"]]
        changes["tool_calls"] = message["tool_calls"] if all(
            new is old for new, old in zip(calls, message["tool_calls"])) else calls
    if all(new is message.get(key) for key, new in changes.items()):
        return message
    return {**message, **changes}


def _walk_part(part: Any, visit: Visit) -> Any:
    if not isinstance(part, dict) or not isinstance(part.get("text"), str):
        return part
    text = _visit(part["text"], visit, "messages", True, True)
    return part if text is part["text"] else {**part, "text": text}


def _walk_call(call: dict, visit: Visit) -> dict:
    function = call.get("function") or {}
    new_id = _visit_field(call["id"], visit, "messages") if isinstance(call.get("id"), str) else call.get("id")
    new_function = {**function}
    if isinstance(function.get("name"), str):
        new_function["name"] = _visit_field(function["name"], visit, "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if isinstance(value, (dict, list)):
            new_value = _walk_json(value, visit, "messages", schema=False)
            if new_value is not value:
                new_function["arguments"] = json.dumps(new_value, ensure_ascii=False)
        else:  # not a JSON object or array (a call cut short): the template writes it as it is
            new_function["arguments"] = _visit(arguments, visit, "messages", False, True)
    elif isinstance(arguments, (dict, list)):
        new_function["arguments"] = _walk_json(arguments, visit, "messages", schema=False)
    if new_id is call.get("id") and all(new_function[key] is function.get(key) for key in new_function):
        return call
    return {**call, "id": new_id, "function": new_function}


def _visit_field(text: str, visit: Visit, param: str, redactable: bool = True) -> str:
    if text.isascii() and (len(text) < _MIN_CHARS or len(text) < _MIN_KEY_CHARS and _DIGIT_OR_AT.search(text) is None):
        return text
    return _visit(text, visit, param, False, redactable)


def _visit(text: str, visit: Visit, param: str, flows: bool, redactable: bool) -> str:
    """The visited text, or `text` itself where it is the same (arguments are parsed anew by
    each walk: an unchanged value must be the same object for its document to stay as sent)."""
    new = visit(text, param, flows, redactable)
    return text if new == text else new


def _walk_json(value: Any, visit: Visit, param: str, schema: bool) -> Any:
    """`value` with its strings (keys too) and integers visited; the same object where none
    changed (nothing is copied unless something changes). A changed integer becomes its new
    text, a JSON string."""
    if isinstance(value, str):
        return _visit_field(value, visit, param)
    if type(value) is int:
        if -10**(_MIN_CHARS - 1) < value < 10**(_MIN_CHARS - 1):
            return value
        text = str(value)
        new = _visit(text, visit, param, False, not schema)
        return value if new is text else new
    if isinstance(value, dict):
        changed: dict | None = None
        for i, (key, item) in enumerate(value.items()):
            if isinstance(key, str):
                _visit_field(key, visit, param, redactable=False)  # a finding in one refuses the call
            new_item = _walk_json(item, visit, param, schema)
            if changed is None and new_item is not item:
                changed = dict(list(value.items())[:i])
            if changed is not None:
                changed[key] = new_item
        return value if changed is None else changed
    if isinstance(value, list):
        new_list: list | None = None
        for i, item in enumerate(value):
            new_item = _walk_json(item, visit, param, schema)
            if new_list is None and new_item is not item:
                new_list = value[:i]
            if new_list is not None:
                new_list.append(new_item)
        return value if new_list is None else new_list
    return value
