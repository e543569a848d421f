"""A `tokenway worker` on another host as a replica (routing/wire.py has the protocol).

    GenerationJob (prompt_token_ids, params, n) ── POST /worker/v1/generate ──► events
        ── each choice's delta ──► ChoiceDelta (text, token_ids, engine TokenLogprobs, prefix-cache hit) ...
        ── usage, once every choice finished ──► one Usage (counted_by="replica")

Engine times are not passed on: they are the worker host's time.monotonic(), which means
nothing to the gateway's stage clock.

The HTTP side is upstream.py's (pool, timers, the error table): a worker that is killed
mid-stream closes its connections, which ends each open call with BadGatewayError at once; a
worker that goes silent ends it with GatewayTimeoutError after timeouts.between_events, or at
the job's deadline. An error event in the stream maps as an upstream's does (503: the call
never ran there, ServiceUnavailableError; else BadGatewayError).

finish_reason is OpenAI's "stop" or "length". The engine's "abort" never ends a choice here: a
worker only aborts a request whose caller still listens when it is stopping, and then sends an
error event instead; an "abort" from any worker is still taken as the replica failing the call
(BadGatewayError), because the text is cut short and OpenAI's vocabulary has no word for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from tokenway.engine.stats import EngineStats
from tokenway.protocol.errors import BadGatewayError, InternalServerError, ServiceUnavailableError
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, ReplicaStats, Usage
from tokenway.routing import wire
from tokenway.routing.upstream import (
    ConnectionLimits,
    HTTPReplica,
    UpstreamHTTP,
    UpstreamTimeouts,
    api_key_from_env,
    parse_json_object,
)
from tokenway.routing.upstream_errors import stream_error

FINISH_REASONS = ("stop", "length")
TOKENIZER_FETCH_SECONDS = 30.0  # tokenizer.json is a few MB


class _EventReader:
    """One call's events, checked: each choice's deltas until its finish, then the usage."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n
        self.finished_indexes: set[int] = set()
        self.usage: Usage | None = None

    def read(self, payload: dict[str, Any]) -> ChoiceDelta | None:
        if payload.get("error") is not None:
            raise stream_error(self.name, payload["error"])
        try:
            if "usage" in payload:
                return self._usage(payload["usage"])
            return self._delta(payload)
        except (KeyError, TypeError, ValueError) as exc:
            raise BadGatewayError(f"Worker {self.name} sent a malformed event ({type(exc).__name__}: {exc}).") from None

    def _usage(self, usage: dict[str, Any]) -> None:
        if len(self.finished_indexes) < self.n or self.usage is not None:
            raise ValueError("usage before every choice finished, or twice")
        counts = [usage["prompt_tokens"], usage["completion_tokens"], usage.get("cached_tokens", 0)]
        if any(type(count) is not int or count < 0 for count in counts):
            raise ValueError("usage counts must be integers >= 0")
        cache_reason = usage.get("cache_reason")
        if cache_reason is not None and not isinstance(cache_reason, str):
            raise TypeError("cache_reason must be a string")
        self.usage = Usage(*counts, counted_by="replica", cache_reason=cache_reason)

    def _delta(self, payload: dict[str, Any]) -> ChoiceDelta:
        index, text, finish_reason = payload["index"], payload.get("text", ""), payload.get("finish_reason")
        if type(index) is not int or not 0 <= index < self.n or index in self.finished_indexes:
            raise ValueError(f"index {index!r} is not an unfinished choice")
        if not isinstance(text, str):
            raise TypeError("text must be a string")
        if finish_reason == "abort":
            raise BadGatewayError(f"Worker {self.name} aborted the request before it finished.")
        if finish_reason is not None and finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {finish_reason!r}")
        stop_reason = payload.get("stop_reason")
        if stop_reason is not None and not isinstance(stop_reason, (int, str)):
            raise TypeError("stop_reason must be a token id or a string")
        token_ids = tuple(payload.get("token_ids") or ())
        if any(type(token_id) is not int for token_id in token_ids):
            raise TypeError("token_ids must be integers")
        num_cached_tokens, cache_reason = payload.get("num_cached_tokens", 0), payload.get("cache_reason")
        if type(num_cached_tokens) is not int or not (cache_reason is None or isinstance(cache_reason, str)):
            raise TypeError("num_cached_tokens must be an integer, cache_reason a string")
        if finish_reason is not None:
            self.finished_indexes.add(index)
        return ChoiceDelta(index, text=text, token_ids=token_ids, finish_reason=finish_reason, stop_reason=stop_reason,
                           logprobs=wire.logprobs_from_wire(payload.get("logprobs")),
                           num_cached_tokens=num_cached_tokens, cache_reason=cache_reason)


class WorkerReplica(HTTPReplica):
    """A tokenway worker at base_url, its root ("http://host:8100"). `secret_env` names the
    environment variable holding the worker's shared secret (sent as a Bearer token). Call
    aclose() when done with it: it owns a connection pool."""

    kind = "worker"

    def __init__(self, name: str, base_url: str, secret_env: str | None = None, *,
                 timeouts: UpstreamTimeouts = UpstreamTimeouts(),
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        secret = api_key_from_env(secret_env)
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        self.name = name
        self.http = UpstreamHTTP(name, base_url.rstrip("/") + wire.PREFIX, headers, timeouts, limits,
                                 health_path="state")
        self._engine_stats: EngineStats | None = None  # of the last /state read (by probe or state)

    def __repr__(self) -> str:
        return f"WorkerReplica(name={self.name!r}, base_url={self.http.base_url!r})"

    async def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]:
        if job.prompt_token_ids is None:  # the gateway has the model's tokenizer for every worker pool
            raise InternalServerError(f"Replica {self.name} is a tokenway worker: the call needs prompt token ids.")
        body = {"request_id": job.request_id, "prompt_token_ids": list(job.prompt_token_ids),
                "params": wire.params_to_dict(job.params), "n": job.n}
        if job.service_class != "default":  # absent is "default" to every worker, an older one too
            body["service_class"] = job.service_class
        reader = _EventReader(self.name, job.n)
        events = self.http.stream_events("generate", body, job.deadline, is_last=lambda event: event.data == "[DONE]")
        async with aclosing(events):
            async for event in events:
                if event.data != "[DONE]" and (delta := reader.read(parse_json_object(self.name, event.data))):
                    yield delta
        if reader.usage is None:
            raise BadGatewayError(f"Worker {self.name} ended the stream before every choice finished.")
        yield reader.usage

    async def state(self) -> dict[str, Any]:
        """The worker's /state (routing/wire.py), within timeouts.probe; raises the mapped error."""
        state = await self.http.get_json("state", self.http.timeouts.probe)
        if not isinstance(state, dict) or not isinstance(state.get("engine"), dict):
            raise BadGatewayError(f"Worker {self.name} sent a malformed state.")
        try:
            self._engine_stats = EngineStats.from_dict(state["engine"])
        except ValueError as exc:
            raise BadGatewayError(f"Worker {self.name} sent a malformed state (engine: {exc}).") from None
        return state

    async def probe(self) -> bool:
        """health.Probe's contract: True when the worker answers with the right secret and its
        engine takes calls; else raises. Each probe refreshes what stats() reports."""
        if not (await self.state()).get("ready"):
            raise ServiceUnavailableError(f"Worker {self.name}'s engine is not running.", retry_after=1)
        return True

    def stats(self) -> EngineStats | None:
        """The worker's engine stats as of the last probe (as LocalReplica.stats gives its
        engine's); None before any. No I/O here: the health checker's probes keep it fresh."""
        return self._engine_stats

    async def fetch_tokenizer(self, cache_dir: str | Path) -> Path:
        """The worker's tokenizer files, written under cache_dir in a directory named by their
        content (a worker restarted with the same model gives the same one) that
        Tokenizer.from_dir loads. Only TOKENIZER_FILES names are written: a file name from the
        network never becomes a path of its own."""
        payload = await self.http.get_json("tokenizer", TOKENIZER_FETCH_SECONDS)
        files = payload.get("files") if isinstance(payload, dict) else None
        if (not isinstance(files, dict) or "tokenizer.json" not in files
                or any(name not in wire.TOKENIZER_FILES or not isinstance(text, str) for name, text in files.items())):
            raise BadGatewayError(f"Worker {self.name} sent a malformed tokenizer.")
        return await asyncio.to_thread(_write_tokenizer, Path(cache_dir), files)



def replica_stats(state: dict[str, Any]) -> ReplicaStats:
    """The balancer's view of a worker's /state (num_outstanding_tokens is the gateway's own count)."""
    engine = state["engine"]
    return ReplicaStats(num_running=engine.get("num_running", 0), num_waiting=engine.get("num_waiting", 0),
                        kv_cache_usage=state.get("kv_cache_usage"),
                        prefix_cache_hit_rate=engine.get("prefix_cache_hit_rate"),
                        extra={"num_in_flight": state.get("num_in_flight"), "block_size": state.get("block_size")})


def _write_tokenizer(cache_dir: Path, files: dict[str, str]) -> Path:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{len(files[name])}\0".encode() + files[name].encode())
    target = cache_dir / f"worker-tokenizer-{digest.hexdigest()[:16]}"
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed into place: a reader never sees half a tokenizer.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another fetch finished first; its files are the same.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
