"""Reading a model directory's weights: (HF tensor name, tensor), mapped in place where they can be.

A HuggingFace directory's *.safetensors are read through safetensors (memory-mapped), but for
experts kept in MXFP4 (gpt-oss's `*_blocks` beside `*_scales`), mapped in place as stored
(`expert_weights`). A GGUF's
directory (loader.resolve_model, gguf.py) holds no weights, only gguf.TENSOR_TABLE: each tensor is
mapped from the GGUF itself when the model loads, one mapping a tensor, so a tensor's pages are let
go once the model has what it keeps of it. Quantized weights reach the model as their blocks
(`quantized_weights`), float ones in their dtype (`iter_weights`).

The block kernels re-lay a GGUF's blocks out once (models/quant.py). That costs a few seconds a GB in
numpy, so a GGUF's directory also keeps the relaid kernels in one file (`KernelCache`), mapped on the
next start: a restart reads no GGUF block and rewrites nothing.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf as gguf_py
import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from tokenway.models import dequant
from tokenway.models.expert_kernels import ExpertWeights
from tokenway.models.gguf import TENSOR_TABLE, unpermute

FLOAT_TYPES = ("F32", "F16", "BF16")
_ALIGN = 64  # bytes: each kernel tensor in KernelCache starts on a cache line


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A weight kept as its file stores it: rows of quantized blocks (a GGUF's), or of a
    checkpoint's bfloat16 or float16 values, in HF row order."""

    qtype: str  # the GGUF type name: "Q4_K", "Q8_0", ..., "BF16", "F16"
    blocks: torch.Tensor  # uint8 (rows, bytes per row): mapped from the file unless rows were reordered
    shape: tuple[int, int]  # HF (rows, in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 (rows, in_features) weight."""
        if self.qtype in dequant.QTYPES:
            return dequant.dequantize(self.blocks, self.qtype, self.shape)
        kind = gguf_py.GGMLQuantizationType[self.qtype]
        return torch.from_numpy(gguf_py.quants.dequantize(self.blocks.numpy(), kind).reshape(self.shape))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One line of gguf.TENSOR_TABLE."""

    name: str  # HF name
    type: str  # GGUF type name
    shape: tuple[int, ...]  # HF shape
    offset: int  # of its bytes in the GGUF
    nbytes: int
    unpermute_heads: int | None  # rows to reorder (llama.cpp's RoPE permutation of q/k), as heads
    value_offset: float  # subtracted from the decoded values (Gemma's norm scales, stored as 1 + w)

    @property
    def quantized(self) -> bool:
        return self.type not in FLOAT_TYPES and len(self.shape) == 2


def gguf_table(model_dir: Path) -> tuple[Path, list[TensorEntry]] | None:
    """(the GGUF, its tensors) when model_dir describes one; None for a HuggingFace directory."""
    path = Path(model_dir) / TENSOR_TABLE
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    entries = [TensorEntry(e["name"], e["type"], tuple(e["shape"]), e["offset"], e["nbytes"], e["unpermute_heads"],
                           e["value_offset"]) for e in table["tensors"]]
    return Path(table["gguf"]), entries


def _map_bytes(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """nbytes of the file from offset, mapped copy-on-write (writable for torch, never written to the file)."""
    return np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,))


def _mapped(gguf_path: Path, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes, mapped (_map_bytes)."""
    return _map_bytes(gguf_path, entry.offset, entry.nbytes)


def _blocks(gguf_path: Path, entry: TensorEntry) -> torch.Tensor:
    rows = entry.shape[0]
    blocks = _mapped(gguf_path, entry).reshape(rows, -1)
    if entry.unpermute_heads is not None:  # whole blocks move with their rows
        blocks = np.ascontiguousarray(unpermute(blocks, entry.unpermute_heads))
    return torch.from_numpy(blocks)


def quantized_weights(model_dir: Path, floats_as_stored: bool = False) -> dict[str, QuantizedTensor]:
    """A GGUF's block-quantized 2-D weights, by HF name, mapped from the file. For a HuggingFace
    directory, with floats_as_stored: its bfloat16 and float16 2-D weights (qtype "BF16", "F16",
    their bytes), mapped in place for the raw kernels (models/quant_raw.py) to compute on as they
    are (a model computing in float32 would otherwise hold them expanded: twice the memory, and
    twice the bytes a token reads); else empty."""
    table = gguf_table(model_dir)
    if table is None:
        return _stored_floats(Path(model_dir)) if floats_as_stored else {}
    gguf_path, entries = table
    return {e.name: QuantizedTensor(e.type, _blocks(gguf_path, e), (e.shape[0], e.shape[1]))
            for e in entries if e.quantized}


def expert_weights(model_dir: Path) -> dict[str, ExpertWeights]:
    """A GGUF's 3-D expert tensors (experts, rows, in_features), any type, by HF name, mapped in
    place from the file; for a HuggingFace directory its MXFP4 experts, by the name their
    `_blocks` and `_scales` share (its float experts load as floats)."""
    table = gguf_table(model_dir)
    if table is None:
        return _mxfp4_experts(Path(model_dir))
    gguf_path, entries = table
    out = {}
    for entry in entries:
        if len(entry.shape) == 3 and entry.unpermute_heads is None and not entry.value_offset:
            num_experts, rows, cols = entry.shape
            blocks = torch.from_numpy(_mapped(gguf_path, entry).reshape(num_experts, rows, -1))
            out[entry.name] = ExpertWeights(entry.type, blocks, (num_experts, rows, cols))
    return out


# gpt-oss's MXFP4 experts in safetensors (transformers' Mxfp4 layout): NAME_blocks uint8 (E, rows,
# blocks, 16) of nibble pairs and NAME_scales uint8 (E, rows, blocks) of E8M0 exponents.
MXFP4_PARTS = ("_blocks", "_scales")


@dataclass(frozen=True, slots=True)
class _Stored:
    """A safetensors tensor's place: its file and absolute byte range, dtype, shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    def mapped(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(_map_bytes(self.file, self.start, self.end - self.start).reshape(shape))


def _safetensors_table(model_dir: Path) -> dict[str, _Stored]:
    """Every tensor of the directory's *.safetensors, from their headers (8 bytes of length, JSON)."""
    out: dict[str, _Stored] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                out[name] = _Stored(file, entry["dtype"], tuple(entry["shape"]), 8 + size + start, 8 + size + end)
    return out


def _mxfp4_experts(model_dir: Path) -> dict[str, ExpertWeights]:
    """Each NAME_blocks with its NAME_scales (either shard) as MXFP4_HF experts, mapped in place.
    A pair of another shape is left to the checkpoint's reader, which names it."""
    table = _safetensors_table(model_dir)
    out = {}
    for name, blocks in table.items():
        if not name.endswith(MXFP4_PARTS[0]):
            continue
        stem = name.removesuffix(MXFP4_PARTS[0])
        scales = table.get(stem + MXFP4_PARTS[1])
        if (scales is None or blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) != 4
                or blocks.shape[3] != 16 or scales.shape != blocks.shape[:3]):
            continue
        num_experts, rows, num_blocks, _ = blocks.shape
        out[stem] = ExpertWeights("MXFP4_HF", blocks.mapped((num_experts, rows, num_blocks * 16)),
                                  (num_experts, rows, num_blocks * 32), scales.mapped(scales.shape))
    return out


def _stored_floats(model_dir: Path) -> dict[str, QuantizedTensor]:
    out = {}
    for name, stored in _safetensors_table(model_dir).items():
        if stored.dtype in ("BF16", "F16") and len(stored.shape) == 2:
            rows, cols = stored.shape
            out[name] = QuantizedTensor(stored.dtype, stored.mapped((rows, 2 * cols)), (rows, cols))
    return out


def _stem(name: str) -> str:
    """The name an MXFP4 part's pair shares (expert_weights' key), else the name itself."""
    for part in MXFP4_PARTS:
        if name.endswith(part):
            return name.removesuffix(part)
    return name


def iter_weights(model_dir: Path, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, tensor) for every tensor of the model but those in `skip` (an MXFP4
    pair skipped by the name expert_weights gives it), in the file's dtype (a GGUF's blocks
    decoded to float32)."""
    table = gguf_table(model_dir)
    if table is not None:
        yield from _gguf_floats(*table, skip)
        return
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files; only safetensors weights are supported")
    num_tensors = 0
    for file in files:  # reads only the headers
        with safe_open(file, framework="pt") as f:
            num_tensors += len(f.keys())
    with tqdm(total=num_tensors, unit="tensor", desc="Loading weights", disable=None) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has keys() but is not iterable)
                    if name not in skip and _stem(name) not in skip:
                        yield name, f.get_tensor(name)
                    bar.update()


def _gguf_floats(gguf_path: Path, entries: list[TensorEntry],
                 skip: Container[str]) -> Iterator[tuple[str, torch.Tensor]]:
    wanted = [e for e in entries if e.name not in skip]
    with tqdm(total=sum(e.nbytes for e in wanted), unit="B", unit_scale=True, desc=f"Loading {gguf_path.name}",
              disable=None) as bar:
        for entry in wanted:
            if entry.type in FLOAT_TYPES:  # mapped, in the file's dtype: the model converts as it copies
                file_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[entry.type]
                raw = _mapped(gguf_path, entry).view(file_dtype)
                if entry.unpermute_heads is not None:
                    raw = np.ascontiguousarray(unpermute(raw.reshape(entry.shape), entry.unpermute_heads))
                tensor = torch.from_numpy(raw.reshape(entry.shape))
                if entry.type == "BF16":
                    tensor = tensor.view(torch.bfloat16)
            else:  # a 1-D tensor is one row, a 3-D one (experts) its experts' rows stacked
                rows = int(np.prod(entry.shape[:-1]))
                blocks = QuantizedTensor(entry.type, _blocks(gguf_path, entry) if len(entry.shape) == 2
                                         else torch.from_numpy(_mapped(gguf_path, entry).reshape(rows, -1)),
                                         (rows, entry.shape[-1]))
                tensor = blocks.dequantize().reshape(entry.shape)
            if entry.value_offset:
                tensor = tensor.float() - entry.value_offset
            yield entry.name, tensor
            bar.update(entry.nbytes)


class KernelCache:
    """The relaid block kernels of one model (weights named as the model names its matmuls), in one
    file beside gguf.TENSOR_TABLE: `relaid-<layout>.bin` and its index `relaid-<layout>.json`.
    The layout (models/quant.py LAYOUT_VERSION) is part of the name: a new layout never reads an old file."""

    def __init__(self, model_dir: Path, layout: int) -> None:
        self.bin = Path(model_dir) / f"relaid-{layout}.bin"
        self.index = Path(model_dir) / f"relaid-{layout}.json"

    def load(self) -> dict[str, torch.Tensor]:
        """name -> uint8 tensor mapped from the file; empty when there is none (or it is unreadable)."""
        try:
            index = json.loads(self.index.read_text())
            size = self.bin.stat().st_size
        except (OSError, ValueError):
            return {}
        if index.get("size") != size:
            return {}
        out = {}
        for name, (offset, shape) in index["tensors"].items():
            count = int(np.prod(shape))
            out[name] = torch.from_numpy(np.memmap(self.bin, dtype=np.uint8, mode="c", offset=offset, shape=(count,))
                                         .reshape(shape))
        return out

    def save(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write tensors (uint8) into the file, atomically; a failure (a read-only cache) only logs
        nothing and leaves the next start to relay again."""
        if not tensors:
            return
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.bin.name}.", dir=self.bin.parent)
        except OSError:
            return
        index: dict[str, tuple[int, list[int]]] = {}
        try:
            with os.fdopen(fd, "wb") as f:
                for name, tensor in tensors.items():
                    f.write(b"\0" * (-f.tell() % _ALIGN))
                    index[name] = (f.tell(), list(tensor.shape))
                    tensor.contiguous().numpy().tofile(f)
                size = f.tell()
            os.replace(tmp, self.bin)
            self.index.write_text(json.dumps({"size": size, "tensors": index}))
        except OSError:
            Path(tmp).unlink(missing_ok=True)
