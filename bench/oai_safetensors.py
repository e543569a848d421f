"""A gpt-oss GGUF (bench/random_moe_gguf.py's, or ggml-org's) rewritten as OpenAI's own
safetensors lay gpt-oss out (openai/gpt-oss-20b): the experts in MXFP4 as `*_blocks` (nibble
pairs) and `*_scales` (E8M0 bytes), gate and up interleaved by row in one `gate_up_proj`, every
other tensor bfloat16, and a config.json with quantization_config mxfp4. The same weights as
the GGUF (the MXFP4 blocks relaid bit for bit, Q8_0 decoded), so tokenway on either file reads
the same model; written one tensor at a time (memory: the largest tensor, ~2 GB for the head).

    python bench/oai_safetensors.py ~/.cache/tokenway-peers/models/gpt-oss-20b.4L.mxfp4.gguf OUT_DIR

The tokenizer is SmolLM2-135M's (tokenizer.json beside the default model): the random GGUFs'
text is noise anyway; benchmark on token ids with ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType


def pairs_of(ggml: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 blocks (..., blocks, 17) -> OpenAI's (blocks (..., blocks, 16), scales (..., blocks)):
    ggml's byte j holds elements j (low) and j + 16 (high); OpenAI's elements 2j and 2j + 1."""
    codes = np.concatenate([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(ggml[..., 0])


def bf16_bytes(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16).view(torch.uint8).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    reader = gguf.GGUFReader(args.gguf)
    tensors = {t.name: t for t in reader.tensors}

    def field(key: str):
        return reader.fields[key].contents()

    layers = int(field("gpt-oss.block_count"))
    experts = int(field("gpt-oss.expert_count"))
    hidden = int(field("gpt-oss.embedding_length"))
    inter = int(field("gpt-oss.expert_feed_forward_length"))

    def floats(name: str) -> np.ndarray:
        t = tensors[name]
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        return values.reshape([int(n) for n in reversed(t.shape)])

    def experts_mx(name: str) -> np.ndarray:  # (E, rows, blocks, 17)
        t = tensors[name]
        rows = int(t.shape[1])
        return np.asarray(t.data).reshape(experts, rows, -1, 17)

    # name -> (dtype, shape, producer of its bytes)
    plan: dict[str, tuple[str, tuple[int, ...], Callable[[], np.ndarray]]] = {}

    def bf16(hf: str, name: str) -> None:
        shape = tuple(int(n) for n in reversed(tensors[name].shape))
        plan[hf] = ("BF16", shape, lambda: bf16_bytes(floats(name)))

    bf16("model.embed_tokens.weight", "token_embd.weight")
    for i in range(layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        bf16(h + "input_layernorm.weight", b + "attn_norm.weight")
        bf16(h + "post_attention_layernorm.weight", b + "post_attention_norm.weight")
        projections = (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"))
        for ours, theirs in projections:
            bf16(h + f"self_attn.{ours}.weight", b + f"{theirs}.weight")
            bf16(h + f"self_attn.{ours}.bias", b + f"{theirs}.bias")
        bf16(h + "self_attn.sinks", b + "attn_sinks.weight")
        bf16(h + "mlp.router.weight", b + "ffn_gate_inp.weight")
        bf16(h + "mlp.router.bias", b + "ffn_gate_inp.bias")

        def gate_up(b=b) -> tuple[np.ndarray, np.ndarray]:
            fused = np.empty((experts, 2 * inter, hidden // 32, 17), dtype=np.uint8)
            fused[:, 0::2] = experts_mx(b + "ffn_gate_exps.weight")
            fused[:, 1::2] = experts_mx(b + "ffn_up_exps.weight")
            return pairs_of(fused)

        def gate_up_bias(b=b) -> np.ndarray:
            fused = np.empty((experts, 2 * inter), dtype=np.float32)
            fused[:, 0::2], fused[:, 1::2] = floats(b + "ffn_gate_exps.bias"), floats(b + "ffn_up_exps.bias")
            return bf16_bytes(fused)

        plan[h + "mlp.experts.gate_up_proj_blocks"] = ("U8", (experts, 2 * inter, hidden // 32, 16),
                                                        lambda f=gate_up: f()[0])
        plan[h + "mlp.experts.gate_up_proj_scales"] = ("U8", (experts, 2 * inter, hidden // 32),
                                                        lambda f=gate_up: f()[1])
        plan[h + "mlp.experts.gate_up_proj_bias"] = ("BF16", (experts, 2 * inter), gate_up_bias)
        plan[h + "mlp.experts.down_proj_blocks"] = ("U8", (experts, hidden, inter // 32, 16),
                                                     lambda b=b: pairs_of(experts_mx(b + "ffn_down_exps.weight"))[0])
        plan[h + "mlp.experts.down_proj_scales"] = ("U8", (experts, hidden, inter // 32),
                                                     lambda b=b: pairs_of(experts_mx(b + "ffn_down_exps.weight"))[1])
        bf16(h + "mlp.experts.down_proj_bias", b + "ffn_down_exps.bias")
    bf16("model.norm.weight", "output_norm.weight")
    bf16("lm_head.weight", "output.weight")

    args.out.mkdir(parents=True, exist_ok=True)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, _) in plan.items():
        size = int(np.prod(shape)) * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    start = time.perf_counter()
    with open(args.out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, (_, _, produce) in plan.items():
            data = produce()
            assert data.nbytes == header[name]["data_offsets"][1] - header[name]["data_offsets"][0], name
            f.write(np.ascontiguousarray(data).tobytes())
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": int(field("gpt-oss.attention.head_count")),
        "num_key_value_heads": int(field("gpt-oss.attention.head_count_kv")),
        "head_dim": int(field("gpt-oss.attention.key_length")), "num_local_experts": experts,
        "num_experts_per_tok": int(field("gpt-oss.expert_used_count")),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]), "rms_norm_eps": 1e-5,
        "rope_theta": float(field("gpt-oss.rope.freq_base")),
        "sliding_window": int(field("gpt-oss.attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": int(field("gpt-oss.context_length")), "initial_context_length": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    from tokenway.models.loader import DEFAULT_MODEL, resolve_model

    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, args.out / name)
    print(f"{args.out}: {offset / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
