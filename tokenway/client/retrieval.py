"""Retrieval: documents chunked by tokens, embedded through /v1/embeddings, stored, searched.

    index = Retriever(openai.OpenAI(base_url=".../v1"), SqliteVecStore("rag.db"))
    index.add_files(["README.md", "docs/guide.md"])      # or add(text, source), add_documents({source: text})
    passages = index.search("how do I set a budget?", k=4)  # [Passage(text, source, score, ...)], best first
    request, report = assemble(request, counter, window=..., max_tokens=..., passages=passages)  # assemble.py

    document ─► Chunker.split (chunking.py) ─► Chunks ─► client.embeddings.create, in batches
             ─► Items ─► VectorStore.replace(namespace, source, items) (vectors.py)
    query    ─► client.embeddings.create ─► VectorStore.search ─► Passages

Every chunk is scanned for injected instructions once, when it is indexed, with its vector
(injection.scan: the rules and the embedding probe); the finding is stored with it and comes
back on its Passage, so marking it for a prompt (untrusted.Spotlight) scans nothing again.

A source is the unit of update: adding it again replaces its chunks in one transaction. Each
chunk carries its document's hash (the text, the chunker's settings and the model), so a
document added unchanged is not chunked or embedded again. Embeddings go through the openai
SDK only (its base URL, key, retries, timeouts): openai.OpenAI for add/search, AsyncOpenAI for
add_async/search_async. Chunks are counted with the embedding model's own tokenizer
(EmbeddingTokenCounter) unless a Chunker says otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import openai

from tokenway.client.chunking import Chunk, Chunker, EmbeddingTokenCounter
from tokenway.client.injection import CLEAN, Finding, Match, scan
from tokenway.client.vectors import Item, Record, SqliteVecStore, VectorStore
from tokenway.config import DEFAULT_EMBEDDING_MODEL

# Under OpenAI's 2048 inputs and 300,000 tokens a call: 128 chunks of <= 256 tokens is ~33,000.
EMBEDDING_BATCH_SIZE = 128


@dataclass(frozen=True, slots=True)
class Passage:
    text: str
    source: str  # a path or URL given to add(); "memory:<id>" for a memory
    score: float  # cosine similarity with the query, in [-1, 1]
    chunk_id: str
    section: str | None = None  # the markdown heading the text lies under
    span: tuple[int, int] | None = None  # the text's characters in the source: source_text[start:end]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    finding: Finding | None = None  # the injection scan made when the text was stored (None: not scanned)

    @property
    def citation(self) -> str:
        """How a reader finds it: `README.md § Install (chars 120-560)`."""
        where = self.source + (f" § {self.section}" if self.section else "")
        return where + (f" (chars {self.span[0]}-{self.span[1]})" if self.span else "")


@dataclass(frozen=True, slots=True)
class IndexReport:
    num_documents: int  # documents given
    num_unchanged: int  # of them, found indexed with the same hash: not embedded again
    num_chunks: int  # chunks embedded and stored
    num_tokens: int  # the embedding calls' usage.prompt_tokens


@dataclass(frozen=True, slots=True)
class _Pending:
    """A document to (re)index: its chunks are embedded, then replace its old ones."""

    source: str
    document_hash: str
    chunks: list[Chunk]
    metadata: Mapping[str, Any]


def embed(client: openai.OpenAI | openai.AsyncOpenAI, model: str, texts: Sequence[str],
          batch_size: int = EMBEDDING_BATCH_SIZE) -> tuple[np.ndarray, int]:
    """(float32 (len(texts), dimensions), prompt tokens) through client.embeddings.create; a
    TypeError for an AsyncOpenAI client."""
    client = _checked_client(client, asynchronous=False)
    replies = [client.embeddings.create(model=model, input=list(texts[i:i + batch_size]))
               for i in range(0, len(texts), batch_size)]
    return _vectors(replies)


async def embed_async(client: openai.OpenAI | openai.AsyncOpenAI, model: str, texts: Sequence[str],
                      batch_size: int = EMBEDDING_BATCH_SIZE) -> tuple[np.ndarray, int]:
    """embed() on an AsyncOpenAI client (a TypeError for an OpenAI one). The batches go one
    after another: the server runs one embedding model, so sending them at once would only
    queue them there."""
    client = _checked_client(client, asynchronous=True)
    replies = [await client.embeddings.create(model=model, input=list(texts[i:i + batch_size]))
               for i in range(0, len(texts), batch_size)]
    return _vectors(replies)


def _vectors(replies: list[Any]) -> tuple[np.ndarray, int]:
    rows = [item.embedding for reply in replies for item in sorted(reply.data, key=lambda d: d.index)]
    num_tokens = sum(reply.usage.prompt_tokens for reply in replies if reply.usage is not None)
    return np.asarray(rows, dtype=np.float32), num_tokens


@overload
def _checked_client(client: Any, asynchronous: Literal[False]) -> openai.OpenAI: ...


@overload
def _checked_client(client: Any, asynchronous: Literal[True]) -> openai.AsyncOpenAI: ...


def _checked_client(client: Any, asynchronous: bool) -> openai.OpenAI | openai.AsyncOpenAI:
    """client, if its calls are of the kind asked for. Duck-typed: anything with the SDK's
    surface passes."""
    if inspect.iscoroutinefunction(client.embeddings.create) != asynchronous:
        want = "openai.AsyncOpenAI for the *_async methods" if asynchronous else "openai.OpenAI for add and search"
        raise TypeError(f"client: expected an {want}, got {type(client).__name__}")
    return client


class Retriever:
    """`store` defaults to an in-memory SqliteVecStore; `namespace` keeps this corpus apart
    from others (and from memories) in a shared store."""

    def __init__(self, client: openai.OpenAI | openai.AsyncOpenAI, store: VectorStore | None = None, *,
                 model: str = DEFAULT_EMBEDDING_MODEL, chunker: Chunker | None = None,
                 namespace: str = "documents", batch_size: int = EMBEDDING_BATCH_SIZE) -> None:
        self.client = client
        self.store = store if store is not None else SqliteVecStore()
        self.model = model
        self._chunker = chunker
        self.namespace = namespace
        self.batch_size = batch_size

    @property
    def chunker(self) -> Chunker:
        # Made on first use: loading the tokenizer costs ~2 s of imports a search never needs.
        if self._chunker is None:
            self._chunker = Chunker(EmbeddingTokenCounter())
        return self._chunker

    # ---- adding --------------------------------------------------------------------------

    def add(self, text: str, source: str, *, metadata: Mapping[str, Any] | None = None) -> IndexReport:
        return self.add_documents({source: text}, metadata=metadata)

    def add_files(self, paths: Iterable[str | Path], *, encoding: str = "utf-8") -> IndexReport:
        """Text or markdown files, each under its path as given."""
        return self.add_documents(_read_files(paths, encoding))

    def add_documents(self, documents: Mapping[str, str], *,
                      metadata: Mapping[str, Any] | None = None) -> IndexReport:
        """{source: text}; the chunks of every changed document share the embedding calls."""
        pending, num_unchanged = self._plan(documents, metadata or {})
        vectors, num_tokens = embed(self.client, self.model, _texts(pending), self.batch_size)
        self._store(pending, vectors)
        return IndexReport(len(documents), num_unchanged, len(vectors), num_tokens)

    async def add_async(self, text: str, source: str, *, metadata: Mapping[str, Any] | None = None) -> IndexReport:
        return await self.add_documents_async({source: text}, metadata=metadata)

    async def add_files_async(self, paths: Iterable[str | Path], *, encoding: str = "utf-8") -> IndexReport:
        return await self.add_documents_async(await asyncio.to_thread(_read_files, paths, encoding))

    async def add_documents_async(self, documents: Mapping[str, str], *,
                                  metadata: Mapping[str, Any] | None = None) -> IndexReport:
        # Tokenizing and the store's SQL are blocking work: off the event loop.
        pending, num_unchanged = await asyncio.to_thread(self._plan, documents, metadata or {})
        vectors, num_tokens = await embed_async(self.client, self.model, _texts(pending), self.batch_size)
        await asyncio.to_thread(self._store, pending, vectors)
        return IndexReport(len(documents), num_unchanged, len(vectors), num_tokens)

    def _plan(self, documents: Mapping[str, str], metadata: Mapping[str, Any]) -> tuple[list[_Pending], int]:
        pending, num_unchanged = [], 0
        for source, text in documents.items():
            document_hash = hashlib.sha256(f"{self.model}\0{self.chunker.settings}\0{text}".encode()).hexdigest()
            old = self.store.get(namespace=self.namespace, source=source)
            if old and all(record.metadata.get("document_hash") == document_hash for record in old):
                num_unchanged += 1
                continue
            pending.append(_Pending(source, document_hash, self.chunker.split(text), metadata))
        return pending, num_unchanged

    def _store(self, pending: list[_Pending], vectors: np.ndarray) -> None:
        row = 0
        for document in pending:
            items = [Item(self.chunk_id(document.source, index), vectors[row + index], chunk.text, document.source,
                          self.namespace, chunk.section, chunk.span,
                          {**document.metadata, "document_hash": document.document_hash,
                           **scan_metadata(chunk.text, vectors[row + index])})
                     for index, chunk in enumerate(document.chunks)]
            row += len(items)
            self.store.replace(self.namespace, document.source, items)

    def chunk_id(self, source: str, index: int) -> str:
        return f"{self.namespace}/{source}#{index}"

    def remove(self, source: str) -> int:
        """Deletes a source's chunks; returns how many there were."""
        return self.store.delete(namespace=self.namespace, source=source)

    # ---- searching -----------------------------------------------------------------------

    def search(self, query: str, k: int = 4, *, min_score: float | None = None,
               sources: Sequence[str] | None = None) -> list[Passage]:
        """The k passages nearest the query, best first; none under min_score; only from
        `sources` when given."""
        vectors, _ = embed(self.client, self.model, [query])
        return self._passages(vectors[0], k, min_score, sources)

    async def search_async(self, query: str, k: int = 4, *, min_score: float | None = None,
                           sources: Sequence[str] | None = None) -> list[Passage]:
        vectors, _ = await embed_async(self.client, self.model, [query])
        return await asyncio.to_thread(self._passages, vectors[0], k, min_score, sources)

    def _passages(self, vector: np.ndarray, k: int, min_score: float | None,
                  sources: Sequence[str] | None) -> list[Passage]:
        hits = self.store.search(vector, k, namespace=self.namespace, sources=sources)
        return [passage(hit.record, hit.score) for hit in hits if min_score is None or hit.score >= min_score]


def passage(record: Record, score: float, source: str | None = None) -> Passage:
    metadata = {key: value for key, value in record.metadata.items() if key not in _OWN_KEYS}
    return Passage(record.text, source or record.source, score, record.id, record.section, record.span, metadata,
                   _finding(record.metadata.get("injection")))


_OWN_KEYS = ("document_hash", "injection")


def scan_metadata(text: str, vector: np.ndarray) -> dict[str, Any]:
    """The injection scan of a text being stored, as metadata."""
    finding = scan(text, vector.tolist())
    return {"injection": {"score": finding.score,
                          "matches": [[m.category, m.rule, m.excerpt] for m in finding.matches]}}


def _finding(stored: Mapping[str, Any] | None) -> Finding | None:
    if stored is None:  # stored before scans were kept
        return None
    if not stored["matches"]:
        return CLEAN
    return Finding(float(stored["score"]), tuple(Match(*match) for match in stored["matches"]))


def _texts(pending: list[_Pending]) -> list[str]:
    return [chunk.text for document in pending for chunk in document.chunks]


def _read_files(paths: Iterable[str | Path], encoding: str) -> dict[str, str]:
    return {str(path): Path(path).read_text(encoding=encoding) for path in paths}
