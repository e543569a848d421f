"""../shared/bench/random_gguf.py's models, written one tensor at a time: the same bytes (same
shapes, order and random stream), but memory stays at one tensor rather than the whole model,
so an 8B shape (16 GB in F16) can be made on a 24 GB machine.

    python bench/random_gguf_stream.py llama-3.1-8b out.f16.gguf
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "random_gguf.py"


def shared_module(path: Path):
    spec = importlib.util.spec_from_file_location("random_gguf", path)
    if spec is None or spec.loader is None:
        sys.exit(f"no {path}: set --shared")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shared", type=Path, default=SHARED, help="the shared random_gguf.py (shapes, fields)")
    ap.add_argument("--source", type=Path, default=None)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shared = shared_module(args.shared)
    hidden, layers, heads, kv_heads, ffn = shared.SHAPES[args.shape]
    head_dim = hidden // heads
    reader = gguf.GGUFReader(args.source or shared.default_source())
    writer = gguf.GGUFWriter(str(args.out), "llama")
    shared.copy_fields(reader, writer, {
        "llama.embedding_length": hidden, "llama.block_count": layers, "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads, "llama.feed_forward_length": ffn,
        "llama.rope.dimension_count": head_dim, "llama.context_length": args.context,
    })
    writer.add_name(f"random {args.shape}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    # The tensors in the shared script's order: (name, rows, cols), cols 0 for a norm (ones).
    tensors = [("token_embd.weight", vocab, hidden)]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", hidden, 0), (f"blk.{i}.attn_q.weight", heads * head_dim, hidden),
                    (f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden),
                    (f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden),
                    (f"blk.{i}.attn_output.weight", hidden, heads * head_dim), (f"blk.{i}.ffn_norm.weight", hidden, 0),
                    (f"blk.{i}.ffn_gate.weight", ffn, hidden), (f"blk.{i}.ffn_up.weight", ffn, hidden),
                    (f"blk.{i}.ffn_down.weight", hidden, ffn)]
    tensors.append(("output_norm.weight", hidden, 0))
    for name, rows, cols in tensors:
        if cols:
            writer.add_tensor_info(name, (rows, cols), np.dtype(np.float16), rows * cols * 2)
        else:
            writer.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for _, rows, cols in tensors:
        if cols:
            writer.write_tensor_data((rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16))
        else:
            writer.write_tensor_data(np.ones(rows, np.float32))
    writer.close()
    print(f"{args.out}: random {args.shape} (hidden {hidden}, {layers} layers, {heads}/{kv_heads} heads, ffn {ffn}, "
          f"vocab {vocab}), written a tensor at a time")


if __name__ == "__main__":
    main()
