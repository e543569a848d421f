"""EmbeddingEngine: concurrent embed() calls share forward passes on one model thread.

    embed(input) ── prepare_inputs (a worker thread) ──► EmbeddingJob ──► inbox (queue.Queue)
    model thread:  inbox ─► pending PendingInputs ─► take_batch ─► model.embed_token_ids
                   ─► rows into each job's vectors ─► the job's last row resolves its future
                      (on the caller's event loop, via call_soon_threadsafe)

The model thread blocks on the inbox only when idle; after each forward pass it takes every job
that arrived meanwhile, so callers that arrive during a pass share the next one. A job's items
enter the pending queue shortest first, and the queue is served in arrival order, so a big
request is cut into passes of similar lengths and a later caller waits behind it, never
starved. A caller that is cancelled marks its job; its items not yet started are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np
import torch

from tokenway.embeddings.inputs import TokenizingModel, prepare_inputs
from tokenway.protocol.errors import InternalServerError, ServiceUnavailableError

logger = logging.getLogger(__name__)


class Model(TokenizingModel, Protocol):
    def embed_token_ids(self, batch: list[list[int]]) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    vectors: np.ndarray  # float32 (num_inputs, dimensions), unit L2 norm; row i is input i
    num_tokens: tuple[int, ...]  # tokens of each input, [CLS] and [SEP] included

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclass(frozen=True, slots=True)
class EmbeddingStats:
    num_requests: int  # embed() calls that passed the input checks
    num_inputs: int  # their items
    num_batches: int  # forward passes run
    num_batch_inputs: int  # items those passes computed (a cancelled caller's unstarted items are not)
    num_tokens: int  # real tokens those passes computed
    num_padded_tokens: int  # sum over passes of rows * longest row: the attention's rectangle
    max_batch_size: int  # the most items one pass computed

    @property
    def mean_batch_size(self) -> float:
        return self.num_batch_inputs / self.num_batches if self.num_batches else 0.0


@dataclass(slots=True, eq=False)
class EmbeddingJob:
    """One embed() call's items. After submission only the model thread touches it, except
    `cancelled`, which the caller sets (a bool store: atomic under the GIL)."""

    token_ids: list[list[int]]
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future | None
    vectors: np.ndarray  # (len(token_ids), dimensions), filled row by row
    num_left: int = field(init=False)
    cancelled: bool = False  # the caller is gone, or the job failed: skip its remaining items

    def __post_init__(self) -> None:
        self.num_left = len(self.token_ids)

    def pending_inputs(self) -> list[PendingInput]:
        order = sorted(range(len(self.token_ids)), key=lambda i: len(self.token_ids[i]))
        return [PendingInput(self, i, len(self.token_ids[i])) for i in order]

    def resolve(self, outcome: EmbeddingResult | BaseException) -> None:
        """Hands the outcome to the caller's loop; called once, from the model thread."""
        if self.loop is None or self.future is None:
            return
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, outcome)
        except RuntimeError:  # the caller's loop has closed: no one is waiting
            pass


@dataclass(frozen=True, slots=True)
class PendingInput:
    job: EmbeddingJob
    index: int  # into job.token_ids
    num_tokens: int


def take_batch(pending: deque[PendingInput], max_batch_inputs: int, max_batch_tokens: int) -> list[PendingInput]:
    """The next forward pass, from the front of `pending`: at most max_batch_inputs items and
    at most max_batch_tokens padded tokens (items * the longest), but always the first item.
    Items of cancelled jobs are dropped on the way."""
    batch: list[PendingInput] = []
    longest = 0
    while pending and len(batch) < max_batch_inputs:
        item = pending[0]
        if item.job.cancelled:
            pending.popleft()
            continue
        if batch and (len(batch) + 1) * max(longest, item.num_tokens) > max_batch_tokens:
            break
        batch.append(pending.popleft())
        longest = max(longest, item.num_tokens)
    return batch


def _settle(future: asyncio.Future, outcome: EmbeddingResult | BaseException) -> None:
    if future.done():  # the caller was cancelled
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class EmbeddingEngine:
    """An embedding model served on one dedicated thread, with concurrent calls batched.

    num_threads: torch's intra-op threads for the model thread alone (None: leave torch's
    setting as it is). The default, 1, suits a 2-core machine shared with the chat engine:
    with 2 threads a pass ran up to 2x faster on idle cores, but up to 10x slower whenever
    another process or thread was busy (bench/embeddings_bench.py --num-threads 2).
    max_batch_tokens bounds a pass's padded tokens (rows * longest row): on this CPU tokens/s
    is flat from ~300 to ~2,500 tokens a pass and falls beyond ~5,000 (activations leave cache)."""

    def __init__(self, model: Model, *, max_batch_inputs: int = 64, max_batch_tokens: int = 4096,
                 num_threads: int | None = 1) -> None:
        if max_batch_inputs < 1:
            raise ValueError(f"max_batch_inputs: must be >= 1, got {max_batch_inputs}")
        if max_batch_tokens < model.max_input_tokens:
            raise ValueError(f"max_batch_tokens: must be >= the model's {model.max_input_tokens} tokens per input, "
                             f"got {max_batch_tokens}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {num_threads}")
        self.model = model
        self.max_batch_inputs = max_batch_inputs
        self.max_batch_tokens = max_batch_tokens
        self.num_threads = num_threads
        self._inbox: queue.Queue[EmbeddingJob | None] = queue.Queue()
        self._lock = threading.Lock()  # guards _closed, the inbox's sentinel and the counters
        self._closed = False
        self._counts = {f.name: 0 for f in fields(EmbeddingStats)}
        self._thread_ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenway-embeddings", daemon=True)
        previous_num_threads = torch.get_num_threads()
        self._thread.start()
        self._thread_ready.wait()
        if num_threads is not None:
            # torch.set_num_threads on the model thread also set the process default that
            # threads started later inherit (the chat engine's); put it back. The model thread
            # keeps its own count: its OpenMP and MKL settings are per thread.
            torch.set_num_threads(previous_num_threads)

    @property
    def dimensions(self) -> int:
        return self.model.dimensions

    async def embed(self, input: Any, *, dimensions: int | None = None) -> EmbeddingResult:
        """`input` as OpenAI's: a text, a list of texts, a token-id list or a list of them.

        Raises InvalidRequestError (ContextLengthExceededError for an item over the model's
        window) naming the field, ServiceUnavailableError after shutdown(), InternalServerError
        if the forward pass failed."""
        return await self.embed_token_ids(await self.tokenize(input, dimensions=dimensions))

    async def tokenize(self, input: Any, *, dimensions: int | None = None) -> list[list[int]]:
        """embed()'s first half: the inputs' token ids, checked (off the event loop). The server
        counts them for the caller's limits before embed_token_ids runs them."""
        if self._closed:  # checked again under the lock in embed_token_ids; this saves the tokenizing
            raise ServiceUnavailableError("The embeddings engine is shutting down.")
        return await asyncio.to_thread(prepare_inputs, self.model, input, dimensions)

    async def embed_token_ids(self, token_ids: list[list[int]]) -> EmbeddingResult:
        """embed()'s second half: run checked token ids (from tokenize) in the shared batches."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EmbeddingResult] = loop.create_future()
        job = EmbeddingJob(token_ids, loop, future, np.empty((len(token_ids), self.model.dimensions), dtype=np.float32))
        with self._lock:
            if self._closed:
                raise ServiceUnavailableError("The embeddings engine is shutting down.")
            self._counts["num_requests"] += 1
            self._counts["num_inputs"] += len(token_ids)
            self._inbox.put(job)
        try:
            return await future
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    def stats(self) -> EmbeddingStats:
        with self._lock:
            return EmbeddingStats(**self._counts)

    def shutdown(self, timeout: float | None = None) -> None:
        """Finishes the forward pass under way; every call still waiting fails with
        ServiceUnavailableError, and so does every later one."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(None)  # under the lock: no job can be queued behind it
        self._thread.join(timeout)

    # ---- the model thread ----------------------------------------------------------------------

    def _run(self) -> None:
        if self.num_threads is not None:
            torch.get_num_threads()  # lets torch set this thread up first, so the count below sticks
            torch.set_num_threads(self.num_threads)
        self._thread_ready.set()
        pending: deque[PendingInput] = deque()
        while self._receive(pending, block=not pending):
            batch = take_batch(pending, self.max_batch_inputs, self.max_batch_tokens)
            if batch:
                self._forward(batch)
        error = ServiceUnavailableError("The embeddings engine is shutting down.")
        for job in {item.job for item in pending if not item.job.cancelled}:
            job.resolve(error)

    def _receive(self, pending: deque[PendingInput], block: bool) -> bool:
        """Moves every job in the inbox into `pending` (waiting for one if `block`);
        False once shutdown() has been called."""
        try:
            job = self._inbox.get(block=block)
            while job is not None:
                pending.extend(job.pending_inputs())
                job = self._inbox.get_nowait()
            return False
        except queue.Empty:
            return True

    def _forward(self, batch: list[PendingInput]) -> None:
        try:
            vectors = self.model.embed_token_ids([item.job.token_ids[item.index] for item in batch])
        except Exception as exc:
            logger.exception("embeddings forward pass failed")
            error = InternalServerError("The embeddings model failed on this request.")
            error.__cause__ = exc
            for job in {item.job for item in batch}:
                job.cancelled = True  # its other items are not worth computing
                job.resolve(error)
            return
        longest = max(item.num_tokens for item in batch)
        with self._lock:
            counts = self._counts
            counts["num_batches"] += 1
            counts["num_batch_inputs"] += len(batch)
            counts["num_tokens"] += sum(item.num_tokens for item in batch)
            counts["num_padded_tokens"] += len(batch) * longest
            counts["max_batch_size"] = max(counts["max_batch_size"], len(batch))
        for item, row in zip(batch, vectors):
            job = item.job
            job.vectors[item.index] = row
            job.num_left -= 1
            if job.num_left == 0:
                job.resolve(EmbeddingResult(job.vectors, tuple(len(ids) for ids in job.token_ids)))
