"""A GGUF's tokenizer metadata -> a HuggingFace `tokenizers.Tokenizer` that gives llama.cpp's ids.

    tokenizer.ggml.model "gpt2"   byte-level BPE (Llama 3, Qwen, SmolLM): tokens + merges, split
                                  per tokenizer.ggml.pre
    tokenizer.ggml.model "llama"  SentencePiece BPE (Llama 2, Mistral, Phi-3, Gemma): tokens + scores;
                                  merges are derived from the scores (llama.cpp's llm_tokenizer_spm)

Token types (tokenizer.ggml.token_type) decide what matches whole before the BPE runs, as
llama.cpp's tokenizer_st_partition does: CONTROL (and UNKNOWN) tokens become special added tokens,
USER_DEFINED ones plain added tokens, which match even where special tokens are read as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2", "gpt-4o")

# llama.cpp's split regexes (llama-vocab.cpp), as HF tokenizer.json files spell them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (gpt-oss, GPT-4o; llama.cpp's "gpt-4o"): words split at case changes, numbers in threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2_SPLIT, "gpt-4o": _GPT4O_SPLIT}
# llama_token_type in llama.h
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_UNUSED = 5
# Texts llama.cpp makes control tokens (and end-of-generation) whatever type the file gives them
# (llama_vocab::impl::load, "control-looking token"): Gemma 3 lists "</s>" as user-defined.
_CONTROL_LOOKING = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
    "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})
_SPACE = "\u2581"  # SentencePiece's "▁", which stands for " " in its tokens


def tokenizer_from_gguf(fields: Mapping[str, Any], source: str, model_max_length: int) -> tuple[HFTokenizer, dict]:
    """`fields`: GGUF metadata key -> decoded contents (GGUFReader's `field.contents()`).
    Returns the tokenizer and the content of its tokenizer_config.json. `source` names the file
    in errors."""
    kind = _require(fields, "tokenizer.ggml.model", source)
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"{source}: unsupported tokenizer.ggml.model {kind!r}; expected one of {list(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens: list[str] = _require(fields, "tokenizer.ggml.tokens", source)
    token_types: list[int] = fields.get("tokenizer.ggml.token_type") or [_TOKEN_TYPE_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{source}: {len(token_types)} token types for {len(tokens)} tokens")
    # Added tokens map to their GGUF ids through the vocab, which keeps the first of duplicates.
    vocab = {token: token_id for token_id, token in reversed(list(enumerate(tokens)))}
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(fields, source, vocab)
        _add_tokens(tokenizer, tokens, token_types, special_types=(_TOKEN_TYPE_CONTROL,))
        add_bos_default = False
    else:
        token_types = [
            _TOKEN_TYPE_CONTROL if token in _CONTROL_LOOKING else token_type
            for token, token_type in zip(tokens, token_types)
        ]
        tokenizer = _sentencepiece_bpe(fields, source, vocab, token_types)
        _add_tokens(tokenizer, tokens, token_types, special_types=(_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN),
                    rstrip=_phi3_rstrip(fields, tokens, token_types))
        add_bos_default = True  # llama.cpp's default for SPM vocabs: older files have no flag

    def token(key: str) -> str | None:
        token_id = fields.get(f"tokenizer.ggml.{key}")
        return None if token_id is None or not 0 <= token_id < len(tokens) else tokens[token_id]

    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    config = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": fields.get("tokenizer.chat_template"),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    # BOS/EOS insertion lives in tokenizer.json too, so it encodes like llama.cpp on its own.
    bos = [config["bos_token"]] if add_bos and config["bos_token"] else []
    eos = [config["eos_token"]] if add_eos and config["eos_token"] else []
    if bos or eos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=bos + ["$A"] + eos,
            pair=bos + ["$A"] + eos + bos + ["$B"] + eos,
            special_tokens=[(t, vocab[t]) for t in set(bos + eos)],
        )
    return tokenizer, {k: v for k, v in config.items() if v is not None}


def _byte_level_bpe(fields: Mapping[str, Any], source: str, vocab: dict[str, int]) -> HFTokenizer:
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise ValueError(f"{source}: unsupported tokenizer.ggml.pre {pre!r}; "
                         f"expected one of {list(SUPPORTED_PRE_TOKENIZERS)}")
    merges = [tuple(m.split(" ", 1)) for m in _require(fields, "tokenizer.ggml.merges", source)]
    # Normal tokens are spelled in the byte-level alphabet; control and user-defined ones as plain
    # text. Keeping the plain spelling in the vocab makes each added token map to its GGUF id.
    tokenizer = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3")))
    if pre in ("default", "gpt2"):
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":  # as SmolLM's own tokenizer.json: every digit is its own word
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        split = _SPLITS.get(pre, _LLAMA3_SPLIT)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # Qwen2's own tokenizer.json normalizes; llama.cpp does not
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(
    fields: Mapping[str, Any], source: str, vocab: dict[str, int], token_types: list[int]
) -> HFTokenizer:
    """llama.cpp's llm_tokenizer_spm: the text between added tokens, spaces written "▁" (and one
    put in front where add_space_prefix), is one word of UTF-8 characters; the adjacent pair whose
    concatenation is the best-scored token merges first (the leftmost among equals), until none
    is a token; characters outside the vocab become their <0xXX> byte tokens.

    HF's BPE does the same given every such pair as a merge, ranked by the merged token's score.
    One difference remains: where two different pairs spell the same token (a+bc, ab+c) and
    overlap, llama.cpp merges the left one and HF the lower-ranked one."""
    tokens = _require(fields, "tokenizer.ggml.tokens", source)
    scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ValueError(f"{source}: {len(scores)} token scores for {len(tokens)} tokens")
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = models.BPE(vocab, _merges_by_score(tokens, scores, token_types, vocab), unk_token=unk,
                       byte_fallback=True, fuse_unk=False, ignore_merges=False)
    tokenizer = HFTokenizer(model)
    # llama.cpp puts the prefix space before every run of text, the first and each one after an
    # added token; Prepend does so per piece too (Metaspace would skip pieces that start with a space).
    add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if add_space_prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the prefix space is no part of the text: decode drops it, as HF and llama.cpp do
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_by_score(
    tokens: list[str], scores: list[float], token_types: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens that spells a mergeable token, best merged token first.
    Only normal and unused tokens are merge results: added tokens are cut out of the text before
    the BPE sees it, byte tokens come from byte fallback, and a control token must never be
    spelled out of plain text (llama.cpp would, where its pieces are tokens)."""
    ranked = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type not in (_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_UNUSED) or vocab[token] != token_id:
            continue
        for cut in range(1, len(token)):
            if token[:cut] in vocab and token[cut:] in vocab:
                ranked.append((-scores[token_id], token_id, cut))
    ranked.sort()
    return [(tokens[token_id][:cut], tokens[token_id][cut:]) for _, token_id, cut in ranked]


def _add_tokens(
    tokenizer: HFTokenizer, tokens: list[str], token_types: list[int], special_types: tuple[int, ...],
    rstrip: frozenset[str] = frozenset(),
) -> None:
    added = [
        AddedToken(token, special=token_type in special_types, normalized=False, rstrip=token in rstrip)
        for token, token_type in zip(tokens, token_types)
        if token and (token_type in special_types or token_type == _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])


def _phi3_rstrip(fields: Mapping[str, Any], tokens: list[str], token_types: list[int]) -> frozenset[str]:
    """The added tokens that eat the whitespace after them: llama.cpp does this for every added
    token but three when the model's name says Phi-3 (its own tokenizer.json says rstrip)."""
    name = str(fields.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    added_types = (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_USER_DEFINED)
    stripping = {token for token, token_type in zip(tokens, token_types) if token_type in added_types}
    return frozenset(stripping - {"<unk>", "<s>", "<|endoftext|>"})


def _require(fields: Mapping[str, Any], key: str, source: str) -> Any:
    value = fields.get(key)
    if value is None:
        raise ValueError(f"{source}: missing GGUF metadata key {key!r}")
    return value
