"""Memory: facts kept across sessions, recalled by meaning the way documents are retrieved.

    memory = MemoryStore(openai.OpenAI(base_url=".../v1"), SqliteVecStore("memory.db"))
    memory.remember("Alice's daughter is called Maya.", namespace="user:alice")
    memory.recall("what is her child's name?", namespace="user:alice")  # [Passage(source="memory:<id>")]
    memory.forget(memory_id); memory.all(namespace="user:alice")

A fact is one item of the VectorStore (one embedding: at most the embedding model's 256
tokens), in its namespace: one per user or subject, apart from the documents of a Retriever
sharing the store. Remembering a near-duplicate of a fact in the same namespace (cosine >=
duplicate_score) rewrites that fact, keeping its id and created_at, instead of adding a
second. What is stored survives the process: another one opening the same file or database
recalls it. Which facts to remember (mem0 asks a model to extract them from a conversation)
is the caller's choice here. A fact is scanned for injected instructions when it is stored
(a poisoned memory is an injection that waits): its Passage carries the finding.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai

from tokenway.client.retrieval import Passage, embed, embed_async, passage, scan_metadata
from tokenway.client.vectors import Item, Record, VectorStore
from tokenway.config import DEFAULT_EMBEDDING_MODEL


@dataclass(frozen=True, slots=True)
class Memory:
    id: str
    fact: str
    namespace: str
    source: str  # where the fact came from ("memory" unless the caller said)
    created_at: float
    updated_at: float  # == created_at until a near-duplicate rewrote it
    metadata: Mapping[str, Any] = field(default_factory=dict)


class MemoryStore:
    def __init__(self, client: openai.OpenAI | openai.AsyncOpenAI, store: VectorStore, *,
                 model: str = DEFAULT_EMBEDDING_MODEL, namespace: str = "memory",
                 duplicate_score: float = 0.95) -> None:
        self.client = client
        self.store = store
        self.model = model
        self.namespace = namespace
        self.duplicate_score = duplicate_score

    def remember(self, fact: str, *, namespace: str | None = None, source: str = "memory",
                 metadata: Mapping[str, Any] | None = None) -> Memory:
        """Stores the fact, or rewrites its near-duplicate; returns it as stored."""
        vectors, _ = embed(self.client, self.model, [_checked(fact)])
        return self._remember(fact, vectors[0], namespace or self.namespace, source, metadata or {})

    async def remember_async(self, fact: str, *, namespace: str | None = None, source: str = "memory",
                             metadata: Mapping[str, Any] | None = None) -> Memory:
        vectors, _ = await embed_async(self.client, self.model, [_checked(fact)])
        return await asyncio.to_thread(self._remember, fact, vectors[0], namespace or self.namespace, source,
                                       metadata or {})

    def _remember(self, fact: str, vector: np.ndarray, namespace: str, source: str,
                  metadata: Mapping[str, Any]) -> Memory:
        now = time.time()
        nearest = self.store.search(vector, 1, namespace=namespace)
        if nearest and nearest[0].score >= self.duplicate_score:
            memory_id, created_at = nearest[0].record.id, nearest[0].record.created_at
        else:
            memory_id, created_at = f"mem-{uuid.uuid4().hex[:16]}", now
        stored = {**metadata, "updated_at": now, **scan_metadata(fact, vector)}
        self.store.add([Item(memory_id, vector, fact, source, namespace, metadata=stored, created_at=created_at)])
        return _memory(Record(memory_id, fact, source, namespace, None, None, stored, created_at))

    def recall(self, query: str, k: int = 4, *, namespace: str | None = None,
               min_score: float | None = None) -> list[Passage]:
        """The k facts nearest the query, best first, as passages with source "<source>:<id>"."""
        vectors, _ = embed(self.client, self.model, [query])
        return self._recall(vectors[0], k, namespace or self.namespace, min_score)

    async def recall_async(self, query: str, k: int = 4, *, namespace: str | None = None,
                           min_score: float | None = None) -> list[Passage]:
        vectors, _ = await embed_async(self.client, self.model, [query])
        return await asyncio.to_thread(self._recall, vectors[0], k, namespace or self.namespace, min_score)

    def _recall(self, vector: np.ndarray, k: int, namespace: str, min_score: float | None) -> list[Passage]:
        hits = self.store.search(vector, k, namespace=namespace)
        return [passage(hit.record, hit.score, source=f"{hit.record.source}:{hit.record.id}")
                for hit in hits if min_score is None or hit.score >= min_score]

    def forget(self, memory_id: str, *, namespace: str | None = None) -> bool:
        """Deletes a fact by id (a recalled passage's chunk_id); False if the namespace has none."""
        return self.store.delete([memory_id], namespace=namespace or self.namespace) > 0

    def all(self, *, namespace: str | None = None) -> list[Memory]:
        """Every fact in the namespace, oldest first."""
        return [_memory(record) for record in self.store.get(namespace=namespace or self.namespace)]


def _memory(record: Record) -> Memory:
    metadata = dict(record.metadata)
    updated_at = metadata.pop("updated_at", record.created_at)
    metadata.pop("injection", None)
    return Memory(record.id, record.text, record.namespace, record.source, record.created_at, updated_at, metadata)


def _checked(fact: str) -> str:
    if not fact.strip():
        raise ValueError("fact: must not be empty")
    return fact
