"""Embeddings: POST /v1/embeddings served by all-MiniLM-L6-v2, beside the chat engine.

    EmbeddingRequest (protocol/embeddings.py) ── request.input, request.dimensions
      ──► EmbeddingEngine.embed()        batcher.py: inputs from concurrent calls share
            prepare_inputs()             inputs.py: tokenize / check ids, window, dimensions
            EmbeddingModel               model.py: WordPiece ─► BertEncoder (bert.py) ─► mean ─► L2
      ──► EmbeddingResult (vectors (n, 384) float32, num_tokens per input)
      ──► embedding_response()           protocol/embeddings.py: OpenAI's JSON, float or base64

The model runs on one thread of its own, never on the event loop; its vectors match
sentence-transformers' for the same directory (tests/embeddings).
"""

from tokenway.embeddings.batcher import EmbeddingEngine, EmbeddingResult, EmbeddingStats
from tokenway.embeddings.model import DEFAULT_EMBEDDING_MODEL, EmbeddingModel, default_model_dir

__all__ = [
    "DEFAULT_EMBEDDING_MODEL", "EmbeddingEngine", "EmbeddingModel", "EmbeddingResult", "EmbeddingStats",
    "default_model_dir",
]
