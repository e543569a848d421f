"""A request body's bytes -> a checked request model, or one InvalidRequestError (400).

Everything a client can send is refused here with a message naming the problem, never
passed on to fail deeper (a RecursionError in a template, a UnicodeEncodeError in the
ledger, a TypeError in the tokenizer):

    not UTF-8 · not JSON · not an object · nested deeper than MAX_JSON_DEPTH · an integer
    with more digits than Python converts · a lone UTF-16 surrogate (\\ud800) in a string ·
    then the model's own schema (pydantic)

Pure and picklable: the gateway runs it on the event loop for small bodies and in a worker
process for large ones (server/body_parser.py).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, TypeVar

import pydantic

from tokenway.json_codec import loads
from tokenway.protocol.errors import InvalidRequestError, from_validation_error

T = TypeVar("T", bound=pydantic.BaseModel)

# Deeper than any request needs (a JSON schema of 20 nested objects is 41 levels deep), far
# below what the recursive parts downstream (json, jinja, jsonschema) survive.
MAX_JSON_DEPTH = 64
# A JSON "\uXXXX" escape of a UTF-16 surrogate; a valid pair decodes to one character, a
# lone one stays a surrogate no encoder accepts.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def decode_json_body(raw: bytes, model: type[T]) -> T:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"Request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"Request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                                  f"column {exc.colno}") from None
    except RecursionError:
        raise InvalidRequestError(f"Request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)",
                                  code="json_too_deep") from None
    except ValueError:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise InvalidRequestError(f"Request body holds a number too large: integers may have at most "
                                  f"{sys.get_int_max_str_digits()} digits", code="number_too_large") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("Request body must be a JSON object")
    # Both walks are skipped when the text shows they cannot find anything.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        check_depth(data)
    if _SURROGATE_ESCAPE.search(text):
        check_unicode(data)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


def check_depth(data: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 naming where `data` nests containers deeper than `limit` (iteratively: no
    recursion, whatever the depth)."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > limit:
            param = _param(path)
            raise InvalidRequestError(f"{param}: nested too deeply (the limit is {limit} levels of objects and "
                                      f"arrays; a JSON schema this deep is not supported either)", param=param,
                                      code="json_too_deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        # The path is built only for containers: a long array of numbers costs one check each.
        stack.extend((child, depth + 1, (*path, key)) for key, child in items if isinstance(child, (dict, list)))


def _param(path: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content", at most 100 characters."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
    text = text.encode("utf-8", "backslashreplace").decode()
    return text if len(text) <= 100 else text[:97] + "..."


def check_unicode(data: Any) -> None:
    """Raise a 400 naming the first string (or key) that holds a lone surrogate."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, child in value.items():
                _check_text(key, (*path, key))
                stack.append((child, (*path, key)))
        elif isinstance(value, list):
            stack.extend((child, (*path, index)) for index, child in enumerate(value))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = _param(path) or None
        raise InvalidRequestError(
            f"{param or 'Request body'}: invalid unicode: a lone surrogate {text[exc.start]!a} at character "
            f"{exc.start} (UTF-16 surrogates must come in pairs)", param=param, code="invalid_unicode") from None
