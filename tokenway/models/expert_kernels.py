"""A mixture-of-experts layer's expert MLPs, run by expert: the weights as the file stores them.

A layer holds E experts, each a gated MLP: down(act(gate(x), up(x))). A step's T tokens each
chose k of them (the router, models/experts.py). The kernel groups the step's (token, expert)
pairs by expert, so each active expert's weights are read once a step however many tokens chose
it, runs its gate, up and down on its tokens as one block matmul each, and adds each result into
its token's row weighted by the router's weight.

The weights stay as stored, never expanded to float at load: a GGUF's 3-D expert tensors are
mapped in place (models/weights.py), E consecutive (rows, bytes a row) matrices of blocks in any
type the kernels read; a safetensors checkpoint's float experts are the same with qtype "F32",
"F16" or "BF16".

    x             (T, hidden) float32
    topk_ids      (T, k) int64     the experts each token chose
    topk_weights  (T, k) float32   their weights (already normalised as the family says)
    gate, up      ExpertWeights (E, intermediate, hidden)
    down          ExpertWeights (E, hidden, intermediate)
    result        (T, hidden) float32

The activations (ACTIVATIONS): "silu": silu(gate) * up (Qwen, Mixtral); "swiglu_oai": gpt-oss's
clamped variant: gate clamped above at `limit`, up to [-limit, limit], then
(up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenway.models import dequant

ACTIVATIONS = ("silu", "swiglu_oai")
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """E matrices of one projection, as stored: uint8 blocks (E, rows, bytes a row)."""

    qtype: str  # GGUF type name; "F32", "F16", "BF16" for float experts
    blocks: torch.Tensor  # uint8 (E, rows, bytes a row)
    shape: tuple[int, int, int]  # (E, rows, in_features)

    def __post_init__(self) -> None:
        if self.blocks.dim() != 3 or self.blocks.shape[:2] != self.shape[:2] or self.blocks.dtype != torch.uint8:
            raise ValueError(f"{self.qtype} experts {self.shape}: expected uint8 blocks (E, rows, bytes), "
                             f"got {self.blocks.dtype} {tuple(self.blocks.shape)}")

    @classmethod
    def of_float(cls, weight: torch.Tensor) -> ExpertWeights:
        """Float experts (E, rows, in_features) in their dtype, viewed as bytes (no copy when contiguous)."""
        qtype = next((name for name, dtype in FLOAT_DTYPES.items() if dtype == weight.dtype), None)
        if qtype is None:
            raise ValueError(f"expert weights of dtype {weight.dtype}: expected one of float32, float16, bfloat16")
        num_experts, rows, cols = weight.shape
        blocks = weight.contiguous().view(torch.uint8).view(num_experts, rows, cols * weight.element_size())
        return cls(qtype, blocks, (num_experts, rows, cols))

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def dequantize(self, expert: int) -> torch.Tensor:
        """float32 (rows, in_features) of one expert."""
        _, rows, cols = self.shape
        blocks = self.blocks[expert]
        if self.qtype in FLOAT_DTYPES:
            return blocks.contiguous().view(FLOAT_DTYPES[self.qtype]).view(rows, cols).float()
        return dequant.dequantize(blocks, self.qtype, (rows, cols))


@dataclass(frozen=True, slots=True)
class ExpertSpec:
    """What the experts compute beyond their weights."""

    activation: str = "silu"
    alpha: float = 1.702  # swiglu_oai's sigmoid slope
    limit: float = 7.0  # swiglu_oai's clamp

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class TorchExpertKernel:
    """The experts through torch operators on any device: each active expert's weights decoded
    for the call, its tokens multiplied in one matmul. The reference the native kernel is held to,
    and the path where it does not run (a GPU, no compiler)."""

    __slots__ = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias", "spec")

    def __init__(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, spec: ExpertSpec,
                 gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None) -> None:
        check_shapes(gate, up, down)
        self.gate, self.up, self.down, self.spec = gate, up, down, spec
        self.gate_bias, self.up_bias, self.down_bias = gate_bias, up_bias, down_bias  # (E, rows) float32 or None

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, k = topk_ids.shape
        out = torch.zeros_like(x, dtype=torch.float32)
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (T * k,) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.gate.num_experts).tolist()
        token_of_pair = order // k
        weight_of_pair = topk_weights.reshape(-1)[order].float()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            tokens = token_of_pair[start:start + count]
            rows = x.index_select(0, tokens).float()  # (n, hidden)
            gate = F.linear(rows, self.gate.dequantize(expert), _row(self.gate_bias, expert))
            up = F.linear(rows, self.up.dequantize(expert), _row(self.up_bias, expert))
            h = F.linear(self.spec.apply(gate, up), self.down.dequantize(expert), _row(self.down_bias, expert))
            out.index_add_(0, tokens, h * weight_of_pair[start:start + count, None])
            start += count
        return out


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert].float()


def check_shapes(gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights) -> None:
    num_experts, inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert shapes disagree: gate {gate.shape}, up {up.shape}, down {down.shape} "
                         f"(expected down {(num_experts, hidden, inter)})")


def build(gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, spec: ExpertSpec,
          gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
          down_bias: torch.Tensor | None = None, torch_device: torch.device | None = None) -> TorchExpertKernel:
    """The fastest kernel that runs these experts here: the native one where it builds and reads
    their types on the CPU, else torch's."""
    return TorchExpertKernel(gate, up, down, spec, gate_bias, up_bias, down_bias)
