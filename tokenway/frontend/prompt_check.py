"""What the engine refuses before a request runs, checked on the caller's side without the
weights (PromptChecker), and the two facts of a served model it rests on: its context window
(resolve_max_model_len) and its end-of-generation tokens (eos_token_ids)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenway.config import EngineConfig
from tokenway.frontend.structured_output import StructuredOutputManager
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.models.config import ModelConfig
from tokenway.protocol.errors import FieldError
from tokenway.protocol.sampling import SamplingParams, StructuredOutputSpec


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context window served: the config's, which may not exceed the model's."""
    if config.max_model_len and config.max_model_len > model_config.max_position_embeddings:
        raise FieldError("max_model_len", f"{config.max_model_len} exceeds the model's context window "
                         f"({model_config.max_position_embeddings})")
    return min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)


def eos_token_ids(tokenizer: Tokenizer, model_config: ModelConfig) -> frozenset[int]:
    return frozenset(tokenizer.eos_token_ids) | frozenset(model_config.eos_token_ids)


@dataclass(frozen=True, slots=True)
class PromptChecker:
    """What the engine refuses before a request runs, checkable without the weights (an engine
    in another process checks here, on the caller's side, so a refusal is a 400 before any byte
    of a stream): ids outside the vocabulary (the prompt's, logit_bias's, a reasoning budget's), a
    prompt over the window, a response_format that cannot be compiled. Raises FieldError naming the field."""

    vocab_size: int
    max_model_len: int
    structured_output: StructuredOutputManager

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise FieldError("prompt", "must not be empty")
        vocab_size = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise FieldError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise FieldError("prompt", f"{len(prompt_token_ids)} tokens do not fit the context window of "
                             f"{self.max_model_len} tokens (at least one output token is needed)")
        if params.logit_bias:
            bad = next((t for t in params.logit_bias if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise FieldError("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        budget = params.reasoning_budget
        if budget is not None:  # the engine writes these tokens itself: one with no embedding would fail the step
            bad = next((t for t in (*budget.start_token_ids, *budget.end_token_ids) if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise FieldError("reasoning_budget", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if params.structured_output is not None:
            self.structured_output.compile(params.structured_output)  # cached: add_request reuses it

    def check_tools(self, tools: Sequence[Mapping]) -> None:
        """Each tool's parameters compiled as a JSON schema of its own (cached), as a
        response_format schema is: a tool no arguments can satisfy is refused naming it,
        rather than constraining the reply to nothing."""
        for position, tool in enumerate(tools):
            function = tool.get("function", tool)
            parameters = function.get("parameters")
            if not parameters:
                continue
            try:
                self.structured_output.compile(StructuredOutputSpec.json_schema(parameters))
            except FieldError as exc:
                reason = str(exc).removeprefix(f"{exc.param}: ")
                raise FieldError(f"tools[{position}].function.parameters", f"the parameters of tool "
                                 f"{function.get('name')!r} cannot be used: {reason}") from None
