"""The edge of the embeddings engine: an OpenAI `input` value -> the token ids the model sees,
or an InvalidRequestError naming the field. Runs off the event loop (tokenizing 2048 texts,
or scanning 300,000 ids, is milliseconds of CPU)."""

from __future__ import annotations

from typing import Any, Protocol, cast

from tokenway.protocol.embeddings import MAX_EMBEDDING_TOKENS, check_dimensions, input_param, split_inputs
from tokenway.protocol.errors import ContextLengthExceededError, InvalidRequestError


class TokenizingModel(Protocol):
    dimensions: int
    vocab_size: int
    max_input_tokens: int

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...


def prepare_inputs(model: TokenizingModel, value: Any, dimensions: int | None = None) -> list[list[int]]:
    """Each item's token ids, [CLS] and [SEP] included: a text tokenized, a token-id list as sent.

    Refused with a 400: a malformed input, a token id outside the vocabulary, an item over
    model.max_input_tokens (ContextLengthExceededError: refused, not truncated, as OpenAI
    does), more than MAX_EMBEDDING_TOKENS in all, or dimensions other than the model's."""
    check_dimensions(dimensions, model.dimensions)
    items, single = split_inputs(value)
    if isinstance(items[0], str):  # the items are of one kind (split_inputs)
        token_ids = model.tokenize(cast("list[str]", items))
    else:
        token_ids = cast("list[list[int]]", items)
        for index, ids in enumerate(token_ids):
            if max(ids) >= model.vocab_size:  # split_inputs has refused negative ids
                bad = next(t for t in ids if t >= model.vocab_size)
                param = input_param(index, single)
                raise InvalidRequestError(
                    f"{param}: token id {bad} is outside the vocabulary [0, {model.vocab_size})", param=param)
    for index, ids in enumerate(token_ids):
        if len(ids) > model.max_input_tokens:
            raise ContextLengthExceededError(len(ids), None, model.max_input_tokens, param=input_param(index, single))
    num_tokens = sum(len(ids) for ids in token_ids)
    if num_tokens > MAX_EMBEDDING_TOKENS:
        raise InvalidRequestError(
            f"input: the {len(token_ids)} inputs hold {num_tokens} tokens; one request may hold at most "
            f"{MAX_EMBEDDING_TOKENS}: send them in several requests", param="input")
    return token_ids
