"""A mixture-of-experts MLP: the block every MoE family shares (models/arch/ says how each routes).

    logits  = router(x)                      (T, E) float32, with a bias where the family has one
    ids, w  = route(logits)                  (T, k) the chosen experts and their weights
    y       = experts(x, ids, w)             models/expert_kernels.py: grouped by expert, each
                                             active expert's weights read once a step
    y      += sigmoid(shared_gate(x)) * shared(x)    where the family has a shared expert (Qwen2-MoE)

The experts' weights are the file's: a GGUF's 3-D tensors mapped in place (use_stored), or a
safetensors checkpoint's float experts, loaded into (E, rows, in_features) parameters. The kernel
is built once both the experts and their biases are in (finish).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tokenway.models import expert_kernels
from tokenway.models.config import ModelConfig
from tokenway.models.expert_kernels import ExpertSpec, ExpertWeights

PROJECTIONS = ("gate", "up", "down")
# A checkpoint's per-expert tensor (Qwen-MoE, Mixtral after its renames): mlp.experts.{e}.{proj}_proj.weight
_PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


class SparseMoe(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shared: nn.Module | None) -> None:
        super().__init__()
        spec = config.arch.experts
        assert spec is not None, "a sparse layer's family routes experts"
        num_experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k = num_experts, config.num_experts_per_tok
        self.routing = spec.routing
        self.normalize = spec.renormalize or config.norm_topk_prob
        # The router is small (E x hidden) and decides which weights are read: float32, as HF computes it.
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.router_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if spec.router_bias else None
        # Float experts (a safetensors checkpoint): released when the file's blocks are used instead.
        self.gate_weight = nn.Parameter(torch.empty(num_experts, inter, hidden, dtype=dtype), requires_grad=False)
        self.up_weight = nn.Parameter(torch.empty(num_experts, inter, hidden, dtype=dtype), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)
        biased = spec.expert_bias
        self.gate_bias = nn.Parameter(torch.zeros(num_experts, inter), requires_grad=False) if biased else None
        self.up_bias = nn.Parameter(torch.zeros(num_experts, inter), requires_grad=False) if biased else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False) if biased else None
        self.shared = shared
        self.shared_gate_weight = (nn.Parameter(torch.empty(1, hidden), requires_grad=False)
                                   if shared is not None else None)
        self.spec = ExpertSpec(spec.activation, config.swiglu_alpha, config.swiglu_limit)
        self.stored: tuple[ExpertWeights, ExpertWeights, ExpertWeights] | None = None  # the file's (use_stored)
        self.kernel: expert_kernels.ExpertKernel | None = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) -> the chosen experts (T, k) int64 and their weights (T, k) float32."""
        logits = F.linear(hidden.float(), self.router_weight, self.router_bias)
        if self.routing == "topk_softmax":
            values, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, torch.softmax(values, dim=-1)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        assert self.kernel is not None, "finish() builds the experts' kernel after loading"
        ids, weights = self.route(x)
        out = self.kernel(x, ids, weights)
        if self.shared is not None and self.shared_gate_weight is not None:
            out += torch.sigmoid(F.linear(x.float(), self.shared_gate_weight)) * self.shared(x, ops)
        return out

    def use_stored(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights) -> None:
        """Run on the file's experts as stored; the float parameters are released."""
        expert_kernels.check_shapes(gate, up, down)
        expected = (self.num_experts, *self.gate_weight.shape[1:])
        if gate.shape != expected:
            raise ValueError(f"experts of shape {gate.shape} do not fit the config's {expected}")
        self.stored = (gate, up, down)
        for param in (self.gate_weight, self.up_weight, self.down_weight):
            param.data = torch.empty(0, dtype=param.dtype)

    def finish(self, torch_device: torch.device | None = None) -> None:
        """Build the experts' kernel, on the stored experts or the loaded float ones."""
        if self.stored is not None:
            gate, up, down = self.stored
        else:
            gate, up, down = (ExpertWeights.of_float(p.data) for p in (self.gate_weight, self.up_weight,
                                                                          self.down_weight))
        biases = [None if b is None else b.data for b in (self.gate_bias, self.up_bias, self.down_bias)]
        self.kernel = expert_kernels.build(gate, up, down, self.spec, *biases, torch_device=torch_device)


def weight_targets(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """A sparse layer's checkpoint names (after "model.layers.N.") -> (its parameter under the
    layer, first row, rows), as decoder.load_weights fills them; stacked experts fill all E rows."""
    num_experts, hidden = config.num_experts, config.hidden_size
    shared = config.shared_expert_intermediate_size
    targets = {"mlp.gate.weight": ("mlp.router_weight", 0, num_experts),
               "mlp.gate.bias": ("mlp.router_bias", 0, num_experts)}
    for proj in PROJECTIONS:
        targets[f"mlp.experts.{proj}_proj.weight"] = (f"mlp.{proj}_weight", 0, num_experts)
        targets[f"mlp.experts.{proj}_proj.bias"] = (f"mlp.{proj}_bias", 0, num_experts)
    if shared:
        targets.update({"mlp.shared_expert.gate_proj.weight": ("mlp.shared.gate_up_weight", 0, shared),
                        "mlp.shared_expert.up_proj.weight": ("mlp.shared.gate_up_weight", shared, shared),
                        "mlp.shared_expert.down_proj.weight": ("mlp.shared.down_weight", 0, hidden),
                        "mlp.shared_expert_gate.weight": ("mlp.shared_gate_weight", 0, 1)})
    return targets


def per_expert(suffix: str, tensor: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
    """One expert's 2-D projection (mlp.experts.{e}.gate_proj.weight) -> (its stacked
    parameter under the layer, the expert, the tensor as one row of it); None for any other name."""
    match = _PER_EXPERT.fullmatch(suffix)
    if match is None:
        return None
    return f"mlp.{match.group(2)}_weight", int(match.group(1)), tensor.unsqueeze(0)
