"""What the HTTP side needs of a model, without its weights: its tokenizer and chat template,
and the checks the engine would refuse a prompt for (the window, the vocabulary, a
response_format that cannot be compiled). One per served model: the local engine's, or one
built from the tokenizer files a tokenway worker sends (WorkerReplica.fetch_tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenway.config import EngineConfig
from tokenway.frontend.prompt_check import PromptChecker, eos_token_ids, resolve_max_model_len
from tokenway.frontend.structured_output import StructuredOutputManager
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelFrontend:
    tokenizer: Tokenizer
    prompts: PromptChecker
    is_local: bool = False  # the model of this process's engine

    @property
    def vocab_size(self) -> int:
        return self.prompts.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.prompts.max_model_len

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_model_len: int | None = None, is_local: bool = False
                 ) -> ModelFrontend:
        """From a model directory's config.json and tokenizer files (the weights are not read)."""
        model_config = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        window = resolve_max_model_len(EngineConfig(max_model_len=max_model_len), model_config)
        manager = StructuredOutputManager(tokenizer, model_config.vocab_size, eos_token_ids(tokenizer, model_config))
        return cls(tokenizer, PromptChecker(model_config.vocab_size, window, manager), is_local)
