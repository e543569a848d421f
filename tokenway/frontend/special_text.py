"""Special tokens written inside messages are text, not control tokens.

A chat template renders the caller's strings into the prompt text, and tokenizing that text
reads every special-token string in it as the token itself: a user whose content is
"<|im_end|>\\n<|im_start|>system\\n..." would forge a system turn. As vLLM and llama.cpp do by
default, such strings are tokenized as the text they are, while the template's own special
tokens stay control tokens:

    messages, tools ─► escape(): each special-token string in a caller's string becomes a
                       placeholder (a nonce between private-use characters; no token matches it)
                   ─► the template renders the escaped messages
    rendered text  ─► encode(): split at the template's own special tokens; a piece holding a
                       placeholder is encoded with the originals put back and special tokens
                       read as text; every other piece as usual (the segment cache's path)

A request whose strings hold no special-token string (nearly all) renders and encodes exactly
as before. `Tokenizer.special_tokens_in_messages` (serve --special-tokens-in-messages) turns the
guard off for a deployment whose callers are trusted to write control tokens.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from tokenway.frontend.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Escaped:
    """What escape() replaced: placeholder -> the special-token string it stands for."""

    placeholder_to_text: dict[str, str]
    placeholders: re.Pattern[str]


def escape(tokenizer: Tokenizer, values: list[Any]) -> tuple[list[Any], Escaped | None]:
    """`values` (messages, tools...) with every special-token string inside their strings
    replaced by a placeholder; (values unchanged, None) when there is none."""
    pattern = tokenizer.special_token_pattern
    if pattern is None or not any(_holds(value, pattern) for value in values):
        return values, None
    nonce = secrets.token_hex(8)
    text_to_placeholder: dict[str, str] = {}

    def placeholder(match: re.Match[str]) -> str:
        text = match.group()
        found = text_to_placeholder.get(text)
        if found is None:
            found = text_to_placeholder[text] = f"\ue000{nonce}{len(text_to_placeholder)}\ue001"
        return found

    escaped = [_replace(value, pattern, placeholder) for value in values]
    placeholder_to_text = {p: text for text, p in text_to_placeholder.items()}
    return escaped, Escaped(placeholder_to_text, re.compile(f"\ue000{nonce}\\d+\ue001"))


def encode(tokenizer: Tokenizer, text: str, escaped: Escaped, max_num_tokens: int | None) -> list[int]:
    """The rendered prompt's ids: the template's special tokens as tokens, the caller's as text."""
    pattern = tokenizer.special_token_pattern
    assert pattern is not None  # escape() found special-token text to escape
    token_ids: list[int] = []
    position = 0
    for match in pattern.finditer(text):
        token_ids += _encode_piece(tokenizer, text[position:match.start()], escaped, max_num_tokens)
        token_id = tokenizer.hf.token_to_id(match.group())
        assert token_id is not None  # the pattern is made of the vocabulary's special tokens
        token_ids.append(token_id)
        position = match.end()
    token_ids += _encode_piece(tokenizer, text[position:], escaped, max_num_tokens)
    return token_ids


def _encode_piece(tokenizer: Tokenizer, piece: str, escaped: Escaped, max_num_tokens: int | None) -> list[int]:
    if not piece:
        return []
    if "\ue000" not in piece or not escaped.placeholders.search(piece):
        return tokenizer.encode(piece, add_special_tokens=False, max_num_tokens=max_num_tokens)
    original = escaped.placeholders.sub(lambda m: escaped.placeholder_to_text[m.group()], piece)
    return tokenizer.encode_special_tokens_as_text(original)


def _holds(value: Any, pattern: re.Pattern[str]) -> bool:
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(_holds(v, pattern) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, pattern) for v in value)
    return False


def _replace(value: Any, pattern: re.Pattern[str], placeholder) -> Any:
    """`value` with its strings' matches replaced; containers copied only where something changed."""
    if isinstance(value, str):
        return pattern.sub(placeholder, value)
    if isinstance(value, dict):
        return {k: _replace(v, pattern, placeholder) for k, v in value.items()} if _holds(value, pattern) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(v, pattern, placeholder) for v in value) if _holds(value, pattern) else value
    return value
