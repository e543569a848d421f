"""A replica behind an OpenAI-compatible API: vLLM, SGLang, llama.cpp's server, tokenway itself,
or a provider.

    GenerationJob ── chat_body / completion_body ──► POST {base_url}/chat/completions | /completions
        streamed (upstream.sends_stream; stream_options.include_usage, so the first token is
        forwarded the moment it exists) ── each chunk's choices ──► ChoiceDelta ... ── [DONE]
        else, no `stream` ── one chat.completion / text_completion ── its choices ──► one
        ChoiceDelta a choice (a message read as one delta)
    ──► one Usage

A reasoning model's thinking comes as each delta's reasoning_content (or reasoning) and goes out
as ChoiceDelta.reasoning; the job's ThinkingRequest goes as reasoning_effort (and, with
sampling_extensions, as chat_template_kwargs.enable_thinking, the switch vLLM, SGLang and
llama.cpp hand a template that thinks). Usage is the upstream's last `usage` object, its
reasoning_tokens included; an upstream that sends none is counted by upstream.counted_usage.
The answer is complete when every one of the n choices has a finish_reason; [DONE] ends
reading a stream (a clean end of body without it is accepted).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from tokenway.protocol.errors import BadGatewayError, InvalidRequestError
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, ToolCallDelta, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.upstream import (
    ConnectionLimits,
    CountTokens,
    HTTPReplica,
    UpstreamHTTP,
    UpstreamTimeouts,
    api_key_from_env,
    counted_usage,
    parse_json_object,
    reasoning_effort,
    sends_stream,
)
from tokenway.routing.upstream_errors import stream_error


def sampling_fields(params: SamplingParams, n: int, chat: bool, extensions: bool) -> dict[str, Any]:
    """OpenAI's names for the job's sampling. temperature and top_p always go (an upstream such
    as vLLM would otherwise apply the model's generation_config defaults); the rest only when
    set. `extensions` adds vLLM / SGLang / llama.cpp fields that OpenAI itself rejects."""
    fields: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p}
    if params.max_tokens is not None:
        fields["max_tokens"] = params.max_tokens
    if params.stop:
        fields["stop"] = list(params.stop)
    if params.seed is not None:
        fields["seed"] = params.seed
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name):
            fields[name] = getattr(params, name)
    if params.logit_bias:
        fields["logit_bias"] = {str(token_id): bias for token_id, bias in params.logit_bias.items()}
    if n > 1:
        fields["n"] = n
    if params.logprobs is not None:
        fields.update({"logprobs": True, "top_logprobs": params.logprobs} if chat else {"logprobs": params.logprobs})
    if extensions:
        defaults = {"top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (0,)}
        fields.update({name: getattr(params, name) for name, off in defaults.items()
                       if getattr(params, name) not in off})
    return fields


def chat_body(job: GenerationJob, model: str, extensions: bool = False) -> dict[str, Any]:
    if not job.messages:
        raise InvalidRequestError("An OpenAI-compatible upstream needs the chat messages, not token ids.",
                                  param="messages")
    # An assistant's earlier thinking goes back only to the servers that read it (vLLM, SGLang,
    # llama.cpp: `extensions`); OpenAI's chat API has no such message field.
    messages = list(job.messages) if extensions else [_without_reasoning(message) for message in job.messages]
    body: dict[str, Any] = {"model": model, "messages": messages}
    effort = reasoning_effort(job.thinking)
    if effort is not None:
        body["reasoning_effort"] = effort
    if extensions and job.thinking is not None and job.thinking.enabled is not None:
        # The switch of a template that thinks (Qwen3's, DeepSeek-R1's distills) on vLLM and its kin.
        body["chat_template_kwargs"] = {"enable_thinking": job.thinking.enabled}
    if job.tools:  # tool_choice without tools is a 400 at OpenAI
        body.update(tools=list(job.tools), tool_choice=job.tool_choice, parallel_tool_calls=job.parallel_tool_calls)
    if job.response_format is not None:
        body["response_format"] = job.response_format
    body.update(sampling_fields(job.params, job.n, chat=True, extensions=extensions))
    return body | upstream_tier(job) | stream_fields(job)


def stream_fields(job: GenerationJob) -> dict[str, Any]:
    """A streamed call asks for the usage chunk; a non-streamed one sends no `stream` (false at
    every OpenAI-compatible server)."""
    return {"stream": True, "stream_options": {"include_usage": True}} if sends_stream(job) else {}


def upstream_tier(job: GenerationJob) -> dict[str, str]:
    """OpenAI's service_tier for a flex or priority job; none for the others: "default" is what
    an upstream does unasked, and OpenAI has no "batch" tier (its Batch API is another road)."""
    return {"service_tier": job.service_class} if job.service_class in ("flex", "priority") else {}


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    if "reasoning_content" not in message:
        return message
    return {key: value for key, value in message.items() if key != "reasoning_content"}


def completion_body(job: GenerationJob, model: str, extensions: bool = False) -> dict[str, Any]:
    # The caller's text where there is one: the upstream's tokenizer may not be tokenway's.
    prompt = job.prompt if job.prompt is not None else list(job.prompt_token_ids or ())
    body = {"model": model, "prompt": prompt} | sampling_fields(job.params, job.n, chat=False, extensions=extensions)
    return body | upstream_tier(job) | stream_fields(job)


def _completion_logprobs(logprobs: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The legacy parallel lists as chat-style entries, one per token."""
    tops = logprobs.get("top_logprobs") or []
    return tuple(
        {"token": token, "logprob": logprob,
         "top_logprobs": [{"token": t, "logprob": lp}
                          for t, lp in (tops[i] if i < len(tops) and tops[i] else {}).items()]}
        for i, (token, logprob) in enumerate(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))
    )


class _ChunkReader:
    """Turns one call's chunks, or its whole answer (a chunk whose choices carry `message`
    where a chunk's carry `delta`), into ChoiceDeltas and keeps what the end needs: which
    choices finished, their text (to count tokens if the upstream does not) and the upstream's
    usage."""

    def __init__(self, name: str, n: int, chat: bool) -> None:
        self.name, self.n, self.chat = name, n, chat
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finished_indexes: set[int] = set()
        self.usage: Usage | None = None

    def read(self, payload: dict[str, Any]) -> list[ChoiceDelta]:
        if payload.get("error") is not None:
            raise stream_error(self.name, payload["error"])
        try:
            usage = payload.get("usage")
            if isinstance(usage, dict) and "prompt_tokens" in usage:
                details = usage.get("prompt_tokens_details") or {}
                output_details = usage.get("completion_tokens_details") or {}
                self.usage = Usage(int(usage["prompt_tokens"]), int(usage.get("completion_tokens") or 0),
                                   cached_tokens=int(details.get("cached_tokens") or 0),
                                   reasoning_tokens=int(output_details.get("reasoning_tokens") or 0))
            return [delta for choice in payload.get("choices") or () if (delta := self._choice(choice)) is not None]
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise BadGatewayError(f"Upstream {self.name} sent a malformed chunk ({type(exc).__name__}).") from None

    def _choice(self, choice: dict[str, Any]) -> ChoiceDelta | None:
        index = int(choice.get("index", 0))
        if not 0 <= index < self.n:
            raise IndexError(index)
        delta = (choice.get("delta") or choice.get("message") or {}) if self.chat else choice
        text = delta.get("content" if self.chat else "text") or ""
        # vLLM (before 0.11), SGLang, DeepSeek and llama.cpp name it reasoning_content; vLLM since, reasoning.
        reasoning = (delta.get("reasoning_content") or delta.get("reasoning") or "") if self.chat else ""
        if not isinstance(reasoning, str):
            raise TypeError("reasoning")
        tool_calls = tuple(
            ToolCallDelta(int(call.get("index", position)), id=call.get("id"),
                          name=(call.get("function") or {}).get("name"),
                          arguments=(call.get("function") or {}).get("arguments") or "")
            for position, call in enumerate(delta.get("tool_calls") or ())
        )
        logprobs = choice.get("logprobs")  # passed on as the upstream's entries: it sends no token ids
        if isinstance(logprobs, dict):
            logprobs = tuple(logprobs.get("content") or ()) if self.chat else _completion_logprobs(logprobs)
        else:
            logprobs = None
        finish_reason = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")  # vLLM: the stop string or token id
        if not (text or reasoning or tool_calls or logprobs or finish_reason):
            return None  # the role-only opening delta and keep-alives: nothing to forward
        self.texts[index].append(reasoning + text + "".join((c.name or "") + c.arguments for c in tool_calls))
        if finish_reason is not None:
            self.finished_indexes.add(index)
        return ChoiceDelta(index, text=text, reasoning=reasoning, tool_calls=tool_calls, finish_reason=finish_reason,
                           stop_reason=stop_reason if isinstance(stop_reason, (int, str)) else None,
                           logprobs=logprobs or None)


class OpenAIUpstream(HTTPReplica):
    """An OpenAI-compatible upstream as a replica. `model` is the name the upstream knows the
    model by; `api_key_env` names the environment variable holding its key (sent as a Bearer
    token); `count_tokens` counts usage with the model's tokenizer when the upstream reports
    none. Call aclose() when done with it: it owns a connection pool."""

    kind = "openai"

    def __init__(self, name: str, base_url: str, model: str, api_key_env: str | None = None, *,
                 timeouts: UpstreamTimeouts = UpstreamTimeouts(), limits: ConnectionLimits = ConnectionLimits(),
                 count_tokens: CountTokens | None = None, health_path: str = "models",
                 sampling_extensions: bool = False) -> None:
        api_key = api_key_from_env(api_key_env)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.name, self.model = name, model
        self.http = UpstreamHTTP(name, base_url, headers, timeouts, limits, health_path)
        self._count_tokens = count_tokens
        self._sampling_extensions = sampling_extensions

    def __repr__(self) -> str:
        return f"OpenAIUpstream(name={self.name!r}, base_url={self.http.base_url!r}, model={self.model!r})"

    def stats(self) -> None:
        """An upstream publishes no engine counts (Replica.stats)."""
        return None

    async def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]:
        chat = job.kind == "chat"
        body = (chat_body if chat else completion_body)(job, self.model, self._sampling_extensions)
        reader, path = _ChunkReader(self.name, job.n, chat), "chat/completions" if chat else "completions"
        if sends_stream(job):
            events = self.http.stream_events(path, body, job.deadline, is_last=lambda event: event.data == "[DONE]")
            async with aclosing(events):
                async for event in events:
                    if event.data != "[DONE]":
                        for delta in reader.read(parse_json_object(self.name, event.data)):
                            yield delta
        else:
            for delta in reader.read(await self.http.post_json(path, body, job.deadline)):
                yield delta
        if len(reader.finished_indexes) < job.n:
            raise BadGatewayError(f"Upstream {self.name} ended the answer before every choice finished.")
        yield reader.usage or counted_usage(job, ["".join(parts) for parts in reader.texts], self._count_tokens)

