"""A mixture-of-experts layer's expert MLPs, run by expert: the weights as the file stores them.

A layer holds E experts, each a gated MLP: down(act(gate(x), up(x))). A step's T tokens each
chose k of them (the router, models/experts.py). The kernel groups the step's (token, expert)
pairs by expert, so each active expert's weights are read once a step however many tokens chose
it, runs its gate, up and down on its tokens as one block matmul each, and adds each result into
its token's row weighted by the router's weight.

The weights stay as stored, never expanded to float at load: a GGUF's 3-D expert tensors are
mapped in place (models/weights.py), E consecutive (rows, bytes a row) matrices of blocks in any
type the kernels read; a safetensors checkpoint's float experts are the same with qtype "F32",
"F16" or "BF16". gpt-oss's safetensors keep their experts in MXFP4 too, laid out their own way
("MXFP4_HF": a block's 16 bytes hold its elements in pairs, 2j in the low nibble and 2j + 1 in
the high, and the E8M0 scales are a tensor of their own), also mapped in place; their gate and up
are every other row of one tensor, so rows may lie further apart than a row's bytes.

    x             (T, hidden) float32
    topk_ids      (T, k) int64     the experts each token chose
    topk_weights  (T, k) float32   their weights (already normalised as the family says)
    gate, up      ExpertWeights (E, intermediate, hidden)
    down          ExpertWeights (E, hidden, intermediate)
    result        (T, hidden) float32

The activations (ACTIVATIONS): "silu": silu(gate) * up (Qwen, Mixtral); "swiglu_oai": gpt-oss's
clamped variant: gate clamped above at `limit`, up to [-limit, limit], then
(up + 1) * gate * sigmoid(alpha * gate).

Two kernels: NativeExpertKernel (csrc/experts.cpp: the blocks read in place, int8 products on
the CPU, all of a step's experts in one call) where it builds and reads every type, else
TorchExpertKernel. `build` picks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenway import native
from tokenway.models import dequant

ACTIVATIONS = ("silu", "swiglu_oai")
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The block types csrc/experts.cpp reads, by GGML type id (its qtype argument).
NATIVE_QTYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
                    "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30, "MXFP4": 39, "MXFP4_HF": 1039}
# Types whose scales are a tensor of their own beside the blocks (ExpertWeights.scales), one byte a block of 32.
SPLIT_SCALES = ("MXFP4_HF",)
# Every type experts may be stored in: the GGUF types dequant reads, and the split-scale ones.
STORED_QTYPES = (*dequant.QTYPES, *SPLIT_SCALES)
_ACTIVATION_IDS = {"silu": 0, "swiglu_oai": 1}


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """E matrices of one projection, as stored: uint8 blocks (E, rows, bytes a row), each row's
    bytes consecutive (rows and experts may be further apart: a view of every other row)."""

    qtype: str  # GGUF type name; "F32", "F16", "BF16" for float experts; or one of SPLIT_SCALES
    blocks: torch.Tensor  # uint8 (E, rows, bytes a row)
    shape: tuple[int, int, int]  # (E, rows, in_features)
    scales: torch.Tensor | None = None  # SPLIT_SCALES types: uint8 (E, rows, in_features // 32)

    def __post_init__(self) -> None:
        if self.blocks.dim() != 3 or self.blocks.shape[:2] != self.shape[:2] or self.blocks.dtype != torch.uint8:
            raise ValueError(f"{self.qtype} experts {self.shape}: expected uint8 blocks (E, rows, bytes), "
                             f"got {self.blocks.dtype} {tuple(self.blocks.shape)}")
        if (self.scales is not None) != (self.qtype in SPLIT_SCALES):
            raise ValueError(f"{self.qtype} experts: scales are {'required' if self.scales is None else 'not read'} "
                             f"beside the blocks")
        if self.scales is not None:
            expected = (*self.shape[:2], self.shape[2] // 32)
            if self.scales.dtype != torch.uint8 or tuple(self.scales.shape) != expected:
                raise ValueError(f"{self.qtype} experts {self.shape}: expected uint8 scales {expected}, "
                                 f"got {self.scales.dtype} {tuple(self.scales.shape)}")

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

    def every_other_row(self, first: int) -> ExpertWeights:
        """Rows first, first + 2, ... of every expert: views, nothing copied (gpt-oss's gate and up,
        interleaved by row in one tensor)."""
        blocks = self.blocks[:, first::2]
        scales = None if self.scales is None else self.scales[:, first::2]
        return ExpertWeights(self.qtype, blocks, (blocks.shape[0], blocks.shape[1], self.shape[2]), scales)

    def to(self, device: torch.device) -> ExpertWeights:
        return ExpertWeights(self.qtype, self.blocks.to(device), self.shape,
                             None if self.scales is None else self.scales.to(device))

    def dequantize(self, expert: int) -> torch.Tensor:
        """float32 (rows, in_features) of one expert."""
        _, rows, cols = self.shape
        blocks = self.blocks[expert]
        if self.qtype in FLOAT_DTYPES:
            return blocks.contiguous().view(FLOAT_DTYPES[self.qtype]).view(rows, cols).float()
        if self.scales is not None:
            return dequant.mxfp4_pairs(blocks, self.scales[expert])
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


class NativeExpertKernel:
    """The experts in one native call a step (csrc/experts.cpp experts_forward): the step's
    (token, expert) pairs grouped by expert, each token's activations quantized to int8 once,
    each active expert's rows read once against all its tokens, work over (expert, rows) on all
    cores. The same call as TorchExpertKernel; CPU tensors only.
    isa: a build for another instruction set (native.ISA_FLAGS; tests and benchmarks)."""

    __slots__ = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias", "spec", "ops", "activation_id")

    def __init__(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, spec: ExpertSpec,
                 gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, isa: str | None = None) -> None:
        check_shapes(gate, up, down)
        for weights in (gate, up, down):
            if not supports(weights.qtype, weights.shape[2]):
                raise ValueError(f"no native expert kernel for {weights.qtype} with {weights.shape[2]} input features")
            if weights.blocks.device.type != "cpu":
                raise ValueError(f"native experts run on the CPU, got blocks on {weights.blocks.device}")
        ops = native.load("experts", isa)
        if ops is None:
            raise RuntimeError("the native experts kernel is not built on this machine")
        # Mapped tensors stay in place: the op reads rows and experts at their strides.
        self.gate, self.up, self.down = (ExpertWeights(w.qtype, _rows_consecutive(w.blocks), w.shape,
                                                       None if w.scales is None else _rows_consecutive(w.scales))
                                         for w in (gate, up, down))
        self.gate_bias, self.up_bias, self.down_bias = gate_bias, up_bias, down_bias  # (E, rows) or None
        self.spec = spec
        self.ops = ops  # the experts library this kernel calls (the decode stack calls the same op)
        self.activation_id = _ACTIVATION_IDS[spec.activation]  # the op's activation argument

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        num_experts, inter, _ = self.gate.shape
        return self.ops.experts_forward(
            x, topk_ids, topk_weights,
            self.gate.blocks, NATIVE_QTYPE_IDS[self.gate.qtype], self.up.blocks, NATIVE_QTYPE_IDS[self.up.qtype],
            self.down.blocks, NATIVE_QTYPE_IDS[self.down.qtype], num_experts, inter,
            self.gate_bias, self.up_bias, self.down_bias, self.activation_id, self.spec.alpha, self.spec.limit,
            self.gate.scales, self.up.scales, self.down.scales)


ExpertKernel = TorchExpertKernel | NativeExpertKernel


def supports(qtype: str, in_features: int | None = None) -> bool:
    """Whether the native kernel reads `qtype` blocks (with rows of in_features, when given)."""
    if qtype not in NATIVE_QTYPE_IDS:
        return False
    block = 32 if qtype in SPLIT_SCALES else dequant.block_size(qtype)
    return in_features is None or in_features % block == 0


def _rows_consecutive(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy where a row's bytes are not consecutive (what the op reads at any other stride)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert].float()


def check_shapes(gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights) -> None:
    num_experts, inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert shapes disagree: gate {gate.shape}, up {up.shape}, down {down.shape} "
                         f"(expected down {(num_experts, hidden, inter)})")


def build(gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, spec: ExpertSpec,
          gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
          down_bias: torch.Tensor | None = None, torch_device: torch.device | None = None) -> ExpertKernel:
    """The fastest kernel that runs these experts here: the native one where it builds and reads
    their types on the CPU, else torch's."""
    on_cpu = (torch_device is None or torch_device.type == "cpu") and all(
        w.blocks.device.type == "cpu" for w in (gate, up, down))
    if on_cpu and all(supports(w.qtype, w.shape[2]) for w in (gate, up, down)) and native.load("experts") is not None:
        return NativeExpertKernel(gate, up, down, spec, gate_bias, up_bias, down_bias)
    if torch_device is not None:  # the blocks as stored, on the device (a GPU): decoded there per call
        gate, up, down = (w.to(torch_device) for w in (gate, up, down))
        gate_bias, up_bias, down_bias = (None if b is None else b.to(torch_device)
                                         for b in (gate_bias, up_bias, down_bias))
    return TorchExpertKernel(gate, up, down, spec, gate_bias, up_bias, down_bias)
