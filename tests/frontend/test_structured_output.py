"""StructuredOutputManager on the default model's tokenizer: the batch's mask has one row per
constrained batch row, in batch order, each its own grammar's."""

from __future__ import annotations

import pytest

from tokenway.frontend.structured_output import StructuredOutputManager, allowed_tokens
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.protocol.sampling import StructuredOutputSpec


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    # The EOS ids as ModelFrontend.from_dir passes them: a frozenset.
    return StructuredOutputManager(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def token_id(tokenizer: Tokenizer, text: str) -> int:
    (token_id,) = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def test_the_mask_has_a_row_per_constrained_row_in_batch_order(tokenizer, manager):
    a, b = token_id(tokenizer, "a"), token_id(tokenizer, "b")
    grammars = [None, manager.new_matcher(StructuredOutputSpec.regex("a")), None,
                manager.new_matcher(StructuredOutputSpec.regex("b"))]
    bitmask = manager.grammar_bitmask(grammars)
    assert bitmask is not None
    assert bitmask.row_ids.tolist() == [1, 3]
    allowed = allowed_tokens(bitmask.bitmask, manager.vocab_size)
    assert allowed.shape == (2, manager.vocab_size)
    assert allowed[0, a] and not allowed[0, b]
    assert allowed[1, b] and not allowed[1, a]


def test_a_batch_without_a_constrained_row_has_no_mask(manager):
    assert manager.grammar_bitmask([None, None]) is None
    assert manager.grammar_bitmask([]) is None
