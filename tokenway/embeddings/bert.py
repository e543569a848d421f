"""A BERT encoder (all-MiniLM-L6-v2's architecture) that runs on packed, unpadded tokens.

A batch holds sequences of different lengths. The linear layers and layer norms, nearly all of
the work, act on each token alone, so they run on the packed tokens (T, H) with no padding;
only attention needs a rectangle, so each layer scatters q, k, v into (B, L, ...) and gathers
the result back. Padding therefore costs attention only, and a short input batched beside a
long one gets the same vector as alone: a key-padding mask keeps pads out of every real
token's attention, and pooling reads real tokens only.

Weights are HuggingFace BertModel's names (embeddings.*, encoder.layer.N.*), read from
safetensors; the pooler is not used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")

    @classmethod
    def from_dir(cls, model_dir: Path) -> BertConfig:
        path = model_dir / "config.json"
        raw = json.loads(path.read_text())
        if raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: expected a BERT model with gelu activations")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute position embeddings are supported")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """B sequences, their tokens laid end to end."""

    token_ids: torch.Tensor  # (T,) int64
    position_ids: torch.Tensor  # (T,) int64, 0.. within each sequence
    row_ids: torch.Tensor  # (T,) int64, the sequence each token belongs to
    padded_index: torch.Tensor  # (T,) int64, row * max_len + position: the token's slot in (B * L)
    key_mask: torch.Tensor  # (B, 1, 1, L) bool, True on real tokens
    lengths: torch.Tensor  # (B,) int64

    @classmethod
    def from_token_ids(cls, batch: list[list[int]]) -> PackedBatch:
        assert batch and all(batch), "every sequence needs at least one token"
        lengths = torch.tensor([len(ids) for ids in batch], dtype=torch.int64)
        max_len = int(lengths.max())
        row_ids = torch.repeat_interleave(torch.arange(len(batch)), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        position_ids = torch.arange(len(row_ids)) - starts[row_ids]
        key_mask = torch.arange(max_len)[None, :] < lengths[:, None]
        return cls(
            token_ids=torch.tensor([t for ids in batch for t in ids], dtype=torch.int64),
            position_ids=position_ids,
            row_ids=row_ids,
            padded_index=row_ids * max_len + position_ids,
            key_mask=key_mask[:, None, None, :],
            lengths=lengths,
        )

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[-1]


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)  # query, key, value weights stacked on dim 0
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        num_rows, max_len = batch.lengths.shape[0], batch.max_len
        qkv = self.qkv(x)  # (T, 3H)
        padded = qkv.new_zeros(num_rows * max_len, qkv.shape[1])
        padded[batch.padded_index] = qkv
        head_size = x.shape[1] // self.num_heads
        q, k, v = padded.view(num_rows, max_len, 3, self.num_heads, head_size).permute(2, 0, 3, 1, 4)  # (B, nh, L, hs)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask)  # (B, nh, L, hs)
        attended = attended.transpose(1, 2).reshape(num_rows * max_len, -1)[batch.padded_index]  # (T, H)
        x = self.attention_norm(x + self.attention_out(attended))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    @classmethod
    def from_dir(cls, model_dir: Path) -> BertEncoder:
        config = BertConfig.from_dir(model_dir)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            weights.update(load_file(file))
        encoder = cls(config)
        encoder.load_state_dict(_renamed(weights, config.num_hidden_layers))
        return encoder.eval()

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """-> the last hidden state of every real token, packed: (T, H)."""
        # Single-sentence input: every token has token type 0.
        x = (self.word_embeddings(batch.token_ids) + self.position_embeddings(batch.position_ids)
             + self.token_type_embeddings.weight[0])
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        return x


def _renamed(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """HF BertModel names -> BertEncoder's; fails naming a missing tensor."""
    prefix = "bert." if any(name.startswith("bert.") for name in weights) else ""

    def take(name: str) -> torch.Tensor:
        if prefix + name not in weights:
            raise ValueError(f"weights have no tensor {prefix + name!r}")
        return weights[prefix + name]

    state: dict[str, torch.Tensor] = {}
    for ours, theirs in (("word_embeddings", "word_embeddings"), ("position_embeddings", "position_embeddings"),
                         ("token_type_embeddings", "token_type_embeddings"), ("embedding_norm", "LayerNorm")):
        for kind in ("weight", "bias") if ours == "embedding_norm" else ("weight",):
            state[f"{ours}.{kind}"] = take(f"embeddings.{theirs}.{kind}")
    for i in range(num_layers):
        hf = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            state[f"layers.{i}.qkv.{kind}"] = torch.cat(
                [take(f"{hf}attention.self.{part}.{kind}") for part in ("query", "key", "value")])
            state[f"layers.{i}.attention_out.{kind}"] = take(f"{hf}attention.output.dense.{kind}")
            state[f"layers.{i}.attention_norm.{kind}"] = take(f"{hf}attention.output.LayerNorm.{kind}")
            state[f"layers.{i}.intermediate.{kind}"] = take(f"{hf}intermediate.dense.{kind}")
            state[f"layers.{i}.output.{kind}"] = take(f"{hf}output.dense.{kind}")
            state[f"layers.{i}.output_norm.{kind}"] = take(f"{hf}output.LayerNorm.{kind}")
    return state

