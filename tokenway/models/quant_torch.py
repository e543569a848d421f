"""Matmuls on GGUF blocks with torch operators alone: the block kernels' fallback on any device.

On a GPU the native CPU kernels (models/quant.py) do not run, but the weights need not be expanded
to float at load either: the blocks stay on the device as the GGUF stores them (4.5 bits a weight
for Q4_K against 16), and each call dequantizes the weight it needs with bit operations
(models/dequant.py) and multiplies in the model's dtype. That spends a dequantization per matmul,
cheap beside a GPU's bandwidth, and keeps memory at the file's size. On a CPU the native kernels
are far faster; there this class is for tests and for machines where they cannot build.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenway.models import dequant


class TorchQuantKernel:
    """y = x @ weight.T (+ bias), float32 out, x (T, in_features): the same call as QuantKernel."""

    __slots__ = ("blocks", "qtype", "in_features", "out_features", "bias", "dtype", "products")

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if qtype not in dequant.QTYPES:
            raise ValueError(f"no torch dequantizer for GGUF type {qtype!r}")
        self.blocks = blocks.to(device)  # uint8 (out_features, bytes per row), as stored
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.bias = bias  # the module's Parameter: loading fills it after this kernel exists
        self.dtype = dtype
        self.products = str(dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def weight(self) -> torch.Tensor:
        return self.blocks

    def dequantize(self) -> torch.Tensor:
        return dequant.dequantize(self.blocks, self.qtype, (self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        bias = None if self.bias is None or not self.bias.numel() else self.bias.to(x.device, self.dtype)
        y = F.linear(x.to(self.dtype), self.dequantize().to(self.dtype), bias).float()
        if out is None:
            return y
        out.copy_(y)
        return out

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 (len(ids), in_features), decoded from their blocks alone."""
        return dequant.dequantize_rows(self.blocks, self.qtype, (self.out_features, self.in_features),
                                       torch.as_tensor(ids, device=self.blocks.device))
