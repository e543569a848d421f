"""/v1/embeddings out of the box: the official openai SDK against `tokenway serve` with no
config gets all-MiniLM-L6-v2's vectors, equal to sentence-transformers' own, with usage, a
ledger row and a trace like any generation call; wrong models and inputs are clear 4xx."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from tokenway.embeddings import default_model_dir

MODEL = "all-minilm-l6-v2"
TEXTS = ["The capital of France is Paris.", "Das ist ein Test mit Umlauten: äöü.", "x",
         "A much longer sentence about self-hosted inference servers and their gateways, " * 5]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(default_model_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_model_is_listed_beside_the_chat_model(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"smollm2-135m-instruct", MODEL}
    assert client.models.retrieve(MODEL).model_extra["dimensions"] == 384


def test_single_and_batched_inputs_equal_sentence_transformers(client, reference):
    single = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(single.data) == 1 and len(single.data[0].embedding) == 384
    assert cosines([single.data[0].embedding], reference[:1])[0] >= 0.9999
    batch = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert cosines([d.embedding for d in batch.data], reference).min() >= 0.9999
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > single.usage.prompt_tokens > 0


def test_token_id_input_and_base64(server, client):
    text = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP] in the model's WordPiece vocabulary
    by_ids = httpx.post(f"{server.base_url}/v1/embeddings", timeout=60,
                        json={"model": MODEL, "input": ids, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(by_ids["data"][0]["embedding"]), dtype="<f4")
    assert cosines([vector], [text.data[0].embedding])[0] >= 0.99999
    assert by_ids["usage"]["prompt_tokens"] == text.usage.prompt_tokens == 4


def test_concurrent_callers_are_served_together(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(aclient.embeddings.create(model=MODEL, input=f"sentence number {i}")
                                          for i in range(24)))

    results = asyncio.run(main())
    assert all(len(r.data[0].embedding) == 384 for r in results)
    vectors = np.array([r.data[0].embedding for r in results])
    assert len({v.tobytes() for v in vectors}) == 24  # each caller got its own input's vector


def test_each_call_has_a_trace_and_bad_requests_are_clear(server, client):
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=["a", "b"], encoding_format="float")
    request_id = raw.headers["x-request-id"]
    trace = httpx.get(f"{server.base_url}/v1/traces/{request_id}", timeout=10).json()
    assert trace["endpoint"] == "/v1/embeddings" and trace["model"] == MODEL and trace["status"] == 200
    assert trace["prompt_tokens"] == raw.parse().usage.prompt_tokens and trace["completion_tokens"] == 0

    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as wrong_kind:
        client.embeddings.create(model="smollm2-135m-instruct", input="hi")
    assert wrong_kind.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=MODEL, input="word " * 400)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as dims:
        client.embeddings.create(model=MODEL, input="hi", dimensions=128)
    assert dims.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
