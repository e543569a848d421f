"""bench/random_moe_gguf.py writes GGUFs that gguf-py reads back with the published files' tensor
types, valid scales and the padded tokenizer; bench/moe_bench.py counts what a token reads."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


rmg = load("random_moe_gguf")
moe_bench = load("moe_bench")
Q = gguf.GGMLQuantizationType


def type_counts(specs) -> dict[str, int]:
    return dict(collections.Counter(s.qtype.name for s in specs))


def test_full_layouts_match_the_published_files():
    # ggml-org's gpt-oss-20b-mxfp4.gguf: 289 F32, 98 Q8_0, 72 MXFP4 (llama.cpp's load log).
    oss = rmg.SHAPES["gpt-oss-20b"]
    assert type_counts(rmg.gpt_oss_tensors(oss, oss.vocab)) == {"Q8_0": 98, "F32": 289, "MXFP4": 72}
    # llama-quantize Q4_K_M of a 48-layer qwen3moe: 241 F32, 289 Q4_K, 49 Q6_K.
    qwen = rmg.SHAPES["qwen3-30b-a3b"]
    specs = rmg.qwen3_moe_tensors(qwen, qwen.vocab)
    assert type_counts(specs) == {"Q4_K": 289, "F32": 241, "Q6_K": 49}
    six = [s.name for s in specs if s.qtype == Q.Q6_K]
    assert "output.weight" in six and "blk.0.ffn_down_exps.weight" in six and "blk.6.attn_v.weight" not in six
    assert sum(s.name.endswith("ffn_down_exps.weight") for s in specs if s.qtype == Q.Q6_K) == 24


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4])
def test_random_blocks_dequantize_to_small_finite_weights(qtype):
    w = gguf.quants.dequantize(rmg.random_blocks(np.random.default_rng(0), qtype, 256 * 256), qtype)
    assert np.isfinite(w).all()
    assert 0.01 < w.std() < 0.04 and abs(w.mean()) < 0.002


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tokenizer-only GGUF in SmolLM2's form (gpt2 BPE, ChatML), small enough to read fast
    (gguf-py takes a minute over SmolLM2's 49,152 tokens on a busy machine)."""
    path = tmp_path_factory.mktemp("source") / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"abcdefgh", "ab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("shape_name", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_written_file_reads_back(tmp_path, source, shape_name):
    # A small model of the same family and layout: 256-wide rows fit every block type.
    full = rmg.SHAPES[shape_name]
    small = dataclasses.replace(full, layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8,
                                experts_used=2, expert_ffn=256, vocab=1000)
    out = tmp_path / "m.gguf"
    rmg.write(small, out, "test", pad_vocab=True, source=source, context=4096, seed=0)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == full.arch
    assert reader.fields[f"{full.arch}.expert_count"].contents() == 8
    assert reader.fields["tokenizer.chat_template"].contents().startswith("{% for m in messages %}")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 1000 and tokens[12] == "<pad_12>" and tokens[1] == "<|im_start|>"
    tensors = {t.name: t for t in reader.tensors}
    assert [int(n) for n in tensors["blk.0.ffn_gate_exps.weight"].shape] == [256, 256, 8]
    assert [int(n) for n in tensors["token_embd.weight"].shape] == [256, 1000]
    exps = tensors["blk.1.ffn_down_exps.weight"]
    w = gguf.quants.dequantize(exps.data, exps.tensor_type)
    assert np.isfinite(w).all() and 0.01 < w.std() < 0.04

    tb = moe_bench.token_bytes(out)
    expert_bytes = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    assert tb.experts == expert_bytes * 2 // 8
    assert tb.head == int(tensors["output.weight"].n_bytes)
    assert tb.embedding_row * 1000 == int(tensors["token_embd.weight"].n_bytes)
    everything = sum(int(t.n_bytes) for t in reader.tensors)
    assert tb.dense + tb.experts * 4 + tb.head + tb.embedding_row * 1000 == everything
