"""What crosses a replica boundary, whatever the replica is (the local engine, a tokenway
worker, an OpenAI- or Anthropic-compatible upstream):

    API adaptor ─► GenerationJob (frozen) ─► Replica.generate(job) ─► ReplicaEvent ... ─► Usage

A job is built once, by the API adaptor, from the caller's typed body. Chat jobs carry the
conversation in OpenAI's chat format (an Anthropic body is converted first, so any client
API reaches any upstream API). Where tokenway knows the model's tokenizer it also carries
the templated prompt_token_ids: the local engine and tokenway workers run those, and the
balancer hashes them for prefix affinity; an upstream ignores them.

A replica answers with ReplicaEvents, one per choice and piece as they arrive, and ends with
exactly one Usage (its own count, or tokenway's where the upstream reports none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tokenway.protocol.errors import FieldError
from tokenway.protocol.sampling import SamplingParams, ThinkingRequest

# How urgently a job runs, best first: the scheduler admits a better class first and preempts
# the worst first. "priority", "default" and "flex" are the interactive tiers a caller asks for
# (OpenAI's service_tier; Anthropic's maps onto them); "batch" is work the Batch APIs submit.
ServiceClass = Literal["priority", "default", "flex", "batch"]
SERVICE_CLASSES: tuple[ServiceClass, ...] = get_args(ServiceClass)


def class_rank(service_class: ServiceClass) -> int:
    """0 for the best class ("priority"), 3 for "batch": sort ascending to serve the best first."""
    return SERVICE_CLASSES.index(service_class)


@dataclass(frozen=True, slots=True)
class GenerationJob:
    request_id: str
    model: str  # the served name the caller asked for (a replica may know it by another name)
    kind: Literal["chat", "completion"]
    params: SamplingParams  # one choice's; n choices share them (each with its own seed)
    n: int = 1
    # chat: OpenAI chat-format messages and tools
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    # the types of the tools the caller listed that the model is not shown (a Responses call's
    # web_search, ...): named in the response's x-tokenway-omitted-tools header and the trace
    omitted_tools: tuple[str, ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # completion: the prompt text (None when the caller sent token ids)
    prompt: str | None = None
    # the templated prompt, where tokenway has the model's tokenizer
    prompt_token_ids: tuple[int, ...] | None = None
    # the model's window: what a job without max_tokens (params.max_tokens None, an untemplated
    # job whose caller set none) may use up, and so reserves
    context_window: int | None = None
    # absolute time.monotonic() by which the call must be done (None: no deadline)
    deadline: float | None = None
    stream: bool = False  # the caller takes SSE (an upstream is then asked for a stream too: upstream.sends_stream)
    # what the caller asked of a reasoning model's thinking: an upstream sends it in its API's
    # terms; the local engine has it as params.reasoning_budget already (None: the model's default)
    thinking: ThinkingRequest | None = None
    # how urgently it runs (the tier the caller was granted, or "batch" for a Batch API line): the
    # local engine schedules by it; an upstream is sent the tier where its API has one
    service_class: ServiceClass = "default"
    # The templated prompt's length; without it (an upstream templates), an estimate: counted
    # once, here, as limits, the balancer and usage each ask for it.
    num_prompt_tokens: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def num_reserved_tokens(self) -> int:
        """What the caller's token limits reserve before it runs: the prompt and every choice's
        max_tokens (the rest of the window for a job that sets none)."""
        num_prompt_tokens = self.num_prompt_tokens
        max_tokens = self.params.max_tokens
        if max_tokens is None:
            max_tokens = max(0, (self.context_window or 0) - num_prompt_tokens)
        return num_prompt_tokens + max_tokens * self.n

    def sampling(self) -> dict[str, Any]:
        """The sampling fields a trace shows."""
        params = self.params
        return {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens,
                "seed": params.seed, "n": self.n}

    def __post_init__(self) -> None:
        if self.kind == "chat" and not self.messages and self.prompt_token_ids is None:
            raise FieldError("messages", "a chat job needs messages")
        if self.kind == "completion" and self.prompt is None and self.prompt_token_ids is None:
            raise FieldError("prompt", "a completion job needs a prompt or its token ids")
        if self.n < 1:
            raise FieldError("n", f"must be >= 1, got {self.n}")
        if self.service_class not in SERVICE_CLASSES:
            raise FieldError("service_tier", f"must be one of {', '.join(SERVICE_CLASSES)}, got {self.service_class!r}")
        if self.prompt_token_ids is not None:
            num_prompt_tokens = len(self.prompt_token_ids)
        elif self.kind == "completion":
            num_prompt_tokens = estimate_tokens(self.prompt or "")
        else:
            num_prompt_tokens = estimate_chat_tokens(self.messages, self.tools)
        object.__setattr__(self, "num_prompt_tokens", num_prompt_tokens)


def estimate_tokens(text: str) -> int:
    """ceil(characters / 4): OpenAI's rule of thumb for English under BPE vocabularies."""
    return -(-len(text) // 4)


def estimate_chat_tokens(messages: tuple[dict[str, Any], ...] | list[dict[str, Any]],
                         tools: tuple[dict[str, Any], ...] | list[dict[str, Any]] | None) -> int:
    """A chat prompt's tokens without its tokenizer: estimate_tokens of each message's content
    and tool calls, plus 4 tokens a message for the chat template's framing, and the tools."""
    num_tokens = sum(4 + estimate_tokens(json.dumps(m.get("content") or "", ensure_ascii=False))
                     + (estimate_tokens(json.dumps(m["tool_calls"], ensure_ascii=False)) if m.get("tool_calls") else 0)
                     for m in messages)
    return num_tokens + (estimate_tokens(json.dumps(tools, ensure_ascii=False)) if tools else 0)


@dataclass(frozen=True, slots=True)
class EmbeddingsJob:
    """One /v1/embeddings call's work: each input's checked token ids (the model's own tokenizer)."""

    request_id: str
    model: str
    input_token_ids: tuple[tuple[int, ...], ...]
    encoding_format: Literal["float", "base64"] = "float"
    n: int = 1
    stream: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_token_ids)

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_prompt_tokens

    def sampling(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of one tool call: the first piece of a call carries id and name, later ones
    argument fragments (OpenAI's streamed delta.tool_calls)."""

    index: int  # the call's position in the choice's list of calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one choice released since the last event. finish_reason is OpenAI's vocabulary
    (stop, length, tool_calls, content_filter) and is set on the choice's last event only."""

    index: int
    text: str = ""  # the reply's content (a reasoning model's thinking goes to `reasoning`)
    token_ids: tuple[int, ...] = ()  # where the replica reports them (tokenway engines)
    reasoning: str = ""  # a reasoning model's thinking released since the last event
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token that ended it, if known
    logprobs: tuple[Any, ...] | None = None  # engine TokenLogprob per new token, tokenway engines only
    # tokenway engines: prompt tokens served from the prefix cache and why it stopped there
    # (kv_cache/manager.py), known from a choice's first event on
    num_cached_tokens: int = 0
    cache_reason: str | None = None
    # the local engine only (this host's time.monotonic()): when the choice was first scheduled,
    # its first token, its latest token; the stage clock's queue, prefill and decode end there
    engine_times: tuple[float | None, float | None, float | None] | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """The call's token counts, sent once, after every choice has finished."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those spent thinking
    counted_by: Literal["replica", "tokenizer", "estimate"] = "replica"  # who counted them
    cache_reason: str | None = None  # tokenway engines: why the prefix cache stopped where it did


ReplicaEvent = ChoiceDelta | Usage


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """A replica's load as the balancer sees it; published by the replica, read by anyone."""

    num_running: int = 0
    num_waiting: int = 0
    num_outstanding_tokens: int = 0  # prompt + max_tokens of calls this gateway has in flight there
    kv_cache_usage: float | None = None  # 0..1, where the replica reports it
    prefix_cache_hit_rate: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
