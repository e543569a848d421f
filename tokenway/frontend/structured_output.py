"""Constrained decoding: the output must match a JSON schema, a regex or a Lark grammar.

The grammar engine is llguidance, chosen over xgrammar 0.2.8 by measurement on the
49,152-token SmolLM2 vocabulary: ~1 ms to compile a nested schema against ~155 ms; it
rejects unsatisfiable schemas such as allOf[string, integer] that xgrammar compiles; and it
brings no triton or tvm-ffi. Its mask costs ~20 us a token against xgrammar's ~5 us, both
negligible next to a model step.

    SamplingParams.structured_output: StructuredOutputSpec (protocol/sampling.py, a plain value)
      -> StructuredOutputManager.compile(spec) (PromptChecker: bad specs are a FieldError)
      -> Request.grammar = manager.new_matcher(spec) (EngineCore.add_request)
      -> manager.grammar_bitmask([request.grammar, ...]) -> GrammarBitmask (EngineCore.step)
      -> Sampler masks the logits of the rows that have one
      -> Scheduler.update_from_output: grammar.accept_token(sampled); finished -> "stop"

A request's matcher advances only when the scheduler appends a sampled token, so a preempted
request, which recomputes tokens it already has, leaves it untouched.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from tokenway.protocol.errors import FieldError
from tokenway.protocol.sampling import StructuredOutputSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only its stub defines it; llguidance exports no name for it

    from tokenway.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Compact JSON with fixed separators: with free whitespace a small model can emit blanks
# forever and never close the object. ", " and ": " are what models (and json.dumps) write.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance_grammar(spec: StructuredOutputSpec) -> str:
    """The spec in llguidance's grammar language."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    # StructuredOutputSpec.__post_init__ holds that the field of the spec's kind is set.
    if spec.kind == "json_schema":
        assert spec.schema is not None
        return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        assert spec.pattern is not None
        return llguidance.LLMatcher.grammar_from_regex(spec.pattern)
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class GrammarMatcher:
    """One request's position in its grammar. Advanced only by the scheduler."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """False if the grammar forbids the token; the matcher then counts as finished."""
        if self._matcher.consume_token(token_id):
            return True
        # The mask rules this out unless another stage forbade every token the grammar allows
        # (min_tokens banning a stop token id the grammar requires).
        logger.warning("structured output: sampled token %d is outside the grammar: %s",
                       token_id, self._matcher.get_error().splitlines()[0])
        return False

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow (the output is complete), or the matcher failed."""
        return self._matcher.is_stopped()


@dataclass(slots=True)
class GrammarBitmask:
    """Allowed next tokens for the rows of a batch that have a grammar."""

    row_ids: torch.Tensor  # (num_grammar_rows,) int64 rows of the batch
    bitmask: torch.Tensor  # (num_grammar_rows, ceil(vocab / 32)) int32; bit t % 32 of word t // 32: token t allowed


class StructuredOutputManager:
    """Compiles specs (LRU-cached) and fills the allowed-token masks. Owned by the EngineCore.

    compile() also runs on the caller's thread (AsyncEngine validates before queueing), so the
    cache is guarded by a lock. Cached matchers are never advanced: each request gets a copy.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int], max_cached_grammars: int = 256
    ) -> None:
        self.vocab_size = vocab_size
        # Padding or truncation in tokenizer.json would also apply to what llguidance tokenizes.
        hf = tokenizer.hf
        tokenizer_text = hf.to_str()
        if hf.padding is not None or hf.truncation is not None:
            tokenizer_json = json.loads(tokenizer_text)
            tokenizer_json["padding"] = tokenizer_json["truncation"] = None
            tokenizer_text = json.dumps(tokenizer_json)
        # The model may have more rows than the tokenizer has tokens (padded embeddings):
        # llguidance never allows those ids, so they stay masked.
        num_tokens = max(vocab_size, tokenizer.vocab_size)
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        # llguidance's view of the vocabulary takes ~0.2 s: built beside the start (the model's
        # load, the engine's), and waited for by the first constrained request if it comes first.
        self._tokenizer_built = threading.Thread(
            target=self._build_tokenizer, args=(tokenizer_text, num_tokens, sorted(eos_token_ids)),
            name="tokenway-llguidance-vocab", daemon=True)
        self._tokenizer_built.start()
        self._num_words = (num_tokens + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._max_cached_grammars = max_cached_grammars
        self._spec_to_matcher: OrderedDict[StructuredOutputSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _build_tokenizer(self, tokenizer_text: str, num_tokens: int, eos_token_ids: list[int]) -> None:
        try:
            self._llg_tokenizer = llguidance.LLTokenizer(tokenizer_text, n_vocab=num_tokens, eos_token=eos_token_ids)
        except ValueError as exc:  # only constrained requests need it: the engine still serves the rest
            self._tokenizer_error = str(exc)
            logger.warning("structured output is unavailable: llguidance cannot use this tokenizer (%s)", exc)

    def compile(self, spec: StructuredOutputSpec) -> None:
        """Raises FieldError("response_format", ...) when the spec is invalid or nothing satisfies it."""
        self._compiled(spec)

    def new_matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        return GrammarMatcher(self._compiled(spec).deep_copy())

    def grammar_bitmask(self, grammars: Sequence[GrammarMatcher | None]) -> GrammarBitmask | None:
        """grammars: one per batch row (None where unconstrained). None when no row has one."""
        row_to_matcher = {row: grammar._matcher for row, grammar in enumerate(grammars) if grammar is not None}
        if not row_to_matcher:
            return None
        row_ids = list(row_to_matcher)
        bitmask = torch.zeros((len(row_ids), self._num_words), dtype=torch.int32)
        jobs = [(matcher, index) for index, matcher in enumerate(row_to_matcher.values())]
        self._executor.unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), self._num_words * 4, len(row_ids))
        return GrammarBitmask(torch.tensor(row_ids, dtype=torch.int64), bitmask)

    def _compiled(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        with self._lock:
            matcher = self._spec_to_matcher.get(spec)
            if matcher is not None:
                self._spec_to_matcher.move_to_end(spec)
                return matcher
        matcher = self._compile_uncached(spec)
        with self._lock:
            self._spec_to_matcher[spec] = matcher
            if len(self._spec_to_matcher) > self._max_cached_grammars:
                self._spec_to_matcher.popitem(last=False)
        return matcher

    def _compile_uncached(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        self._tokenizer_built.join()
        if self._llg_tokenizer is None:
            raise FieldError("response_format", f"not supported for this model's tokenizer ({self._tokenizer_error})")
        try:
            grammar = llguidance_grammar(spec)
        except ValueError as exc:
            raise FieldError("response_format", str(exc)) from None
        # llguidance reports grammar errors, including schemas it proves unsatisfiable, as
        # an error state rather than an exception.
        matcher = llguidance.LLMatcher(self._llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise FieldError("response_format", _first_line(matcher.get_error()))
        # What the checks above miss still shows as a first step that allows no token (the
        # matcher then fails, e.g. on an empty regex class). Computed on this thread and before
        # the matcher is shared, so no other thread can be copying it.
        bitmask = torch.zeros((1, self._num_words), dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), self._num_words * 4)
        if matcher.is_error() or not allowed_tokens(bitmask, self.vocab_size).any():
            raise FieldError("response_format", f"no output can satisfy this {spec.kind.replace('_', ' ')}")
        return matcher


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask (num_rows, num_words) int32 -> (num_rows, vocab_size) bool; ids past the mask are False."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # (num_rows, num_words, 32)
    allowed = allowed.view(bitmask.shape[0], -1).bool()  # (num_rows, num_words * 32)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"
