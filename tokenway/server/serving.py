"""What every API route shares: the served model and its replica, admission, sampling
parameters, the context-window check, and the per-request log line (server/generation.py
runs the call itself)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tokenway.embeddings import EmbeddingEngine
from tokenway.engine.client import EngineClient
from tokenway.frontend.chat import build_chat_prompt, text_content
from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.templating import context_window
from tokenway.frontend.tool_parsers import ReplyFormat
from tokenway.gateway.auth import Principal
from tokenway.gateway.call import Call, CallOutcome, RouteChoice
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.observability.observer import Observer
from tokenway.protocol.errors import (
    ContentPolicyViolationError,
    ContextLengthExceededError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    invalid_value,
)
from tokenway.protocol.job import GenerationJob, estimate_chat_tokens
from tokenway.protocol.sampling import SamplingParams, StructuredOutputSpec
from tokenway.routing.replicas import LocalReplica
from tokenway.routing.router import Pool, Router
from tokenway.safety.channels import PromptText
from tokenway.safety.guard import ask_guard
from tokenway.safety.screen import SafetyPolicy, screen_input
from tokenway.server.body_parser import BodyParser
from tokenway.stages import StageClock

access_log = logging.getLogger("tokenway.access")
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    # Requests allowed in flight (running + queued) before new ones get 503 + Retry-After.
    max_pending_requests: int = 256
    graceful_shutdown_seconds: float = 30.0
    admin_key: str | None = None  # guards /admin; None disables the admin API
    tool_parser: str | None = None  # the local model's tool-call format (--tool-parser); None: its template's
    safety: SafetyPolicy = SafetyPolicy()  # the safety stage's checks (--safety-input, --safety-output)
    model_safety: Mapping[str, SafetyPolicy] = field(default_factory=dict)  # a model's own ([models.safety])


@dataclass(frozen=True, slots=True)
class ChatTemplating:
    """What templating a chat call decided (ServerState.template_chat)."""

    prompt_token_ids: tuple[int, ...] | None  # None: the model's upstream templates the messages
    context_window: int
    max_tokens: int | None  # None only for an untemplated call that set none: the upstream's rest
    messages: tuple[dict, ...]  # as the safety stage passed them (redacted, under a redact policy)
    structured: StructuredOutputSpec | None  # what the reply is constrained to (JSON, a tool-call grammar)
    reply_format: ReplyFormat | None  # how the reply's tool calls are read; None: no tools (or the upstream's)

    @property
    def skip_special_tokens(self) -> bool:
        """Formats that mark calls with special tokens ([TOOL_CALLS], <|python_tag|>) need them in the text."""
        return self.reply_format is None or not self.reply_format.keeps_special_tokens


@dataclass(slots=True)
class ServerState:
    engine: EngineClient | None  # None: a gateway only (every model's replicas are remote)
    config: ServerConfig
    model_names: tuple[str, ...]
    gatekeeper: Gatekeeper | None = None  # None: no auth, limits or ledger (benchmarks only)
    observer: Observer | None = None  # None: no traces, metrics or dashboard (--no-observability)
    body_parser: BodyParser = field(default_factory=BodyParser)
    created: int = field(default_factory=lambda: int(time.time()))
    num_pending: int = 0
    ready: bool = True
    embedder: EmbeddingEngine | None = None  # /v1/embeddings; None: not served
    embedding_model_names: tuple[str, ...] = ()
    router: Router | None = None  # None: every served name is one pool, the local engine
    # served name -> its tokenizer and prompt checks (default: the local engine's, for every
    # name). A model tokenway has no tokenizer for (an upstream's) has none: its jobs go
    # untemplated, with the messages, and the upstream templates and counts them.
    frontends: dict[str, ModelFrontend] = field(default_factory=dict)
    # served name -> its context window, for the untemplated models (the others' is their frontend's)
    context_windows: dict[str, int] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # another name clients may use -> the served name

    def __post_init__(self) -> None:
        if self.router is not None or self.engine is None:
            return  # routes built from the registry (routing/build.py) are set before serving
        for name in self.model_names:
            self.frontends.setdefault(name, self.engine.frontend)
        if self.router is None:
            # Its probes (every 0.5 s) find a restarted engine back and close a breaker its failures opened.
            replica = LocalReplica(self.engine)
            local = Pool.of("local", [replica], name_to_max_in_flight={replica.name: self.config.max_pending_requests})
            self.router = Router({name: local for name in self.model_names})

    def frontend(self, name: str | None = None) -> ModelFrontend | None:
        """A served model's tokenizer and checks (None: the first served model's); None for a
        model tokenway has no tokenizer for."""
        return self.frontends.get(name if name is not None else self.model_names[0])

    def tokenizing_frontend(self, name: str | None, principal: Principal) -> ModelFrontend:
        """The frontend of a model /tokenize and /detokenize are asked about (None: the first
        served model's), resolved as a call's model is (404, 403 for one the key may not use);
        400 for one tokenway has no tokenizer for."""
        name = self.resolve_model(name if name is not None else self.model_names[0], principal)
        frontend = self.frontend(name)
        if frontend is None:
            raise InvalidRequestError(f"model: tokenway has no tokenizer for '{name}' "
                                      "(its replicas template and count its prompts)", param="model",
                                      code="model_not_supported")
        return frontend

    def max_model_len(self, name: str) -> int:
        frontend = self.frontends.get(name)
        return frontend.max_model_len if frontend is not None else self.context_windows[name]

    def resolve_model(self, name: str | None, principal: Principal | None = None, kind: str = "chat") -> str:
        """The served name a request's `model` refers to; 404 for anything else, 400 for a
        model of the other kind (chat / embeddings), 403 for one the caller's key may not use."""
        name = self.aliases.get(name, name) if isinstance(name, str) else name
        names, others = self.model_names, self.embedding_model_names
        if kind == "embeddings":
            names, others = others, names
        if name not in names:
            if name in others:
                other_kind = "a chat" if kind == "embeddings" else "an embeddings"
                raise InvalidRequestError(f"model: '{name}' is {other_kind} model; it cannot serve this endpoint",
                                          param="model", code="model_not_supported")
            raise NotFoundError.for_model(str(name))
        if principal is not None and self.gatekeeper is not None:
            self.gatekeeper.check_model(principal, name)
        return name

    def route(self, body, call: Call) -> str:
        """Stage 2: the served model a generation call asked for, and its pool (the router picks
        the replica once the job is made)."""
        name = self.resolve_model(body.model, call.start.principal)
        call.set_route(RouteChoice(model=name, pool=name))
        call.clock.end("routing")
        return name

    def max_tokens(self, call: Call, window: int, num_prompt_tokens: int, requested: int | None,
                   param: str, num_messages: int = 1, exact: bool = True) -> int | None:
        """max_tokens after the window check and the key's caps (the cap fills in when the
        request names none). `exact`: num_prompt_tokens is the templated prompt's length; else an
        estimate (an untemplated job), which only a max_tokens over the whole window fails, and a
        call with neither max_tokens nor a cap gets None: the upstream gives it the rest."""
        if self.gatekeeper is not None:
            principal = call.start.principal
            self.gatekeeper.check_sizes(principal, num_messages, requested, param)
            cap = self.gatekeeper.max_tokens_cap(principal)
            if requested is None and cap is not None:
                requested = min(cap, window - num_prompt_tokens) if exact else cap
        if not exact:
            if requested is not None and requested >= window:
                raise InvalidRequestError(
                    f"This model's maximum context length is {window} tokens. However, you requested {requested} "
                    f"tokens for the completion alone. Please reduce {param}.", param=param,
                    code="context_length_exceeded")
            return requested
        return resolve_max_tokens(window, num_prompt_tokens, requested, param)

    def template_chat(self, call: Call, model: str, messages: list[dict], tools: list[dict] | None, tool_choice: Any,
                      requested_max_tokens: int | None, param: str, num_messages: int,
                      parallel_tool_calls: bool | None = None, response_format: dict | None = None,
                      continue_final_message: bool = False) -> ChatTemplating:
        """A chat call's prompt for its model (stage 3), the same for every chat API: templated
        and checked against the window where tokenway has the model's tokenizer; else left to the
        upstream, with max_tokens checked against the config's window and an estimated prompt.
        The adaptor has had the safety stage screen the call's input (screen) first, so a
        redacted prompt is templated once."""
        frontend = self.frontend(model)
        if frontend is None:
            window = self.max_model_len(model)
            max_tokens = self.max_tokens(call, window, estimate_chat_tokens(messages, tools), requested_max_tokens,
                                         param, num_messages=num_messages, exact=False)
            return ChatTemplating(None, window, max_tokens, tuple(messages), None, None)
        with context_window(frontend, "messages") as window:
            prompt = build_chat_prompt(frontend.tokenizer, messages, tools, tool_choice, parallel_tool_calls,
                                       response_format, max_num_tokens=window, tool_parser=self.tool_parser(frontend),
                                       continue_final_message=continue_final_message)
        max_tokens = self.max_tokens(call, frontend.max_model_len, len(prompt.prompt_token_ids), requested_max_tokens,
                                     param, num_messages=num_messages)
        return ChatTemplating(tuple(prompt.prompt_token_ids), frontend.max_model_len, max_tokens, tuple(messages),
                              structured_output_spec(prompt.json_schema, prompt.json_object, prompt.grammar),
                              prompt.reply_format)

    def tool_parser(self, frontend: ModelFrontend) -> str | None:
        """--tool-parser, for the local model; None: the model's template decides."""
        return self.config.tool_parser if frontend.is_local else None

    def safety_policy(self, model: str, principal: Principal | None = None) -> SafetyPolicy:
        """The caller's key's own policy where it has one, else the model's where its config
        sets one, else the server's."""
        if principal is not None and principal.safety is not None:
            return principal.safety
        return self.config.model_safety.get(model, self.config.safety)

    def screen(self, call: Call, texts: Iterable[PromptText], param: str = "messages") -> tuple[str, ...] | None:
        """The safety stage's input check (safety/screen.py) of every text a call carries into
        its prompt (safety/channels.py): raises ContentPolicyViolationError (400, naming the
        field of the first finding, else `param`) under a block policy that finds something, or
        a redact policy that finds something it cannot redact in place; under a redact policy
        that finds something, the texts redacted (every one, in order); else None. The texts
        are read only when a policy is on."""
        policy = self.safety_policy(call.model, call.start.principal)
        if policy.input == "off":
            call.clock.end("safety")
            return None
        screening = screen_input(policy, list(texts))
        call.set_screening(screening)
        call.clock.end("safety")
        if screening.action == "block":
            raise ContentPolicyViolationError(screening.categories, param=screening.param or param)
        return screening.redacted

    async def admit(self, call: Call) -> None:
        """Budget and limits, reserving the worst-case cost and prompt + max_tokens for every
        choice. Raises 429 (503 while the limits store is down, under limits_on_error closed)."""
        if self.gatekeeper is not None:
            job = call.job
            num_prompt_tokens = job.num_prompt_tokens
            call.set_admission(await self.gatekeeper.admit(call.start.principal, call.model, num_prompt_tokens,
                                                           job.num_reserved_tokens - num_prompt_tokens, job.n))
        call.clock.end("limits")

    async def prepare(self, request, prepare: Callable[..., Any], *args: Any) -> Any:
        """Run a route's prepare step (chat template, tokenizing, the checks that need the
        model): where it is for a small body; for a large one in a worker thread, where the
        tokenizer runs without the GIL, so the event loop keeps serving meanwhile."""
        if request.scope["state"]["body_bytes"] <= self.body_parser.inline_bytes:
            return prepare(*args)
        return await asyncio.to_thread(prepare, *args)

    def engine_stats(self) -> dict:
        """A snapshot of the engine (what runs, what waits, how full the KV cache is), where this
        server runs one, and of every pool's replicas."""
        engine = self.engine.stats() if self.engine is not None else {}
        return {**engine, "num_pending_http": self.num_pending, "replicas": self.router.stats()}

    async def guard(self, call: Call) -> None:
        """A guard model's verdict on the input (safety/guard.py), after tokenizing and before
        admission, where the call's policy names a guard: its categories are flagged, or a 400
        under `block`; a guard that cannot answer passes the call (named in the trace), or is
        a 503 with guard_fail_closed."""
        policy = self.safety_policy(call.model, call.start.principal)
        if policy.guard_model is None or policy.input == "off":
            return
        job = call.job
        if job.kind == "chat":
            turns = [(m["role"], text_content(m.get("content"))) for m in job.messages
                     if m["role"] in ("user", "assistant")]
        else:
            turns = [("user", job.prompt or "")]
        verdict = await ask_guard(self._guard_events, partial(self._guard_job, policy.guard_model), turns,
                                  policy.guard_format)
        call.set_guard(verdict)
        call.clock.end("guard")
        if verdict.error is not None:
            logger.warning("guard model %s could not answer for %s: %s", policy.guard_model, call.request_id,
                           verdict.error)
            if policy.guard_fail_closed:
                raise ServiceUnavailableError("The safety guard could not check this request; retry shortly.",
                                              retry_after=1, code="guard_unavailable")
        if verdict.categories and policy.input == "block":
            raise ContentPolicyViolationError(verdict.categories, param="prompt" if job.kind == "completion"
                                              else "messages")

    def _guard_job(self, model: str, messages: list[dict], params: SamplingParams, request_id: str
                   ) -> GenerationJob:
        frontend = self.frontend(model)
        if frontend is None:
            return GenerationJob(request_id, model, "chat", params, messages=tuple(messages),
                                 context_window=self.max_model_len(model))
        prompt = build_chat_prompt(frontend.tokenizer, messages, max_num_tokens=frontend.max_model_len)
        return GenerationJob(request_id, model, "chat", params, messages=tuple(messages),
                             prompt_token_ids=tuple(prompt.prompt_token_ids), context_window=frontend.max_model_len)

    async def _guard_events(self, job: GenerationJob):
        self.take_engine_slots(1)
        try:
            async with aclosing(self.router.generate(job, lambda choice: None)) as events:
                async for event in events:
                    yield event
        finally:
            self.release_engine_slots(1)

    def take_engine_slots(self, count: int = 1) -> None:
        if self.num_pending + count > self.config.max_pending_requests:
            raise ServiceUnavailableError(
                f"The server is at capacity ({self.num_pending} requests in flight); retry shortly.",
                retry_after=1,
            )
        self.num_pending += count

    def release_engine_slots(self, count: int = 1) -> None:
        self.num_pending -= count


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def resolve_max_tokens(window: int, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
    """OpenAI's rule: prompt + max_tokens must fit the window; no max_tokens means 'the rest'."""
    if num_prompt_tokens >= window:
        raise ContextLengthExceededError(num_prompt_tokens, max_tokens, window, param="messages")
    if max_tokens is None:
        return window - num_prompt_tokens
    if num_prompt_tokens + max_tokens > window:
        raise ContextLengthExceededError(num_prompt_tokens, max_tokens, window, param=param)
    return max_tokens


def structured_output_spec(json_schema: dict | None, json_object: bool, grammar: str | None = None
                           ) -> StructuredOutputSpec | None:
    if grammar is not None:
        return StructuredOutputSpec(kind="grammar", grammar=grammar)
    if json_schema is not None:
        return StructuredOutputSpec.json_schema(json_schema)  # keeps the user's property order
    if json_object:
        return StructuredOutputSpec(kind="json_object")
    return None


def make_sampling_params(body: Any, max_tokens: int, structured: StructuredOutputSpec | None,
                         logprobs: int | None, stop: Any, skip_special_tokens: bool = True) -> SamplingParams:
    """Map the OpenAI fields onto SamplingParams; a ValueError there names the field."""
    logit_bias = None
    if getattr(body, "logit_bias", None):
        try:
            logit_bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias: keys must be token ids", param="logit_bias") from None
    if isinstance(stop, str):
        stop = [stop]
    try:
        return SamplingParams(
            n=1,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=getattr(body, "top_k", None) or 0,
            min_p=getattr(body, "min_p", None) or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=getattr(body, "repetition_penalty", None) or 1.0,
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            min_tokens=getattr(body, "min_tokens", None) or 0,
            stop=tuple(s for s in (stop or ()) if s),
            stop_token_ids=tuple(getattr(body, "stop_token_ids", None) or ()),
            ignore_eos=bool(getattr(body, "ignore_eos", False)),
            logprobs=logprobs,
            structured_output=structured,
            skip_special_tokens=skip_special_tokens,
        )
    except ValueError as exc:
        raise invalid_value(exc) from None


def log_request(request_id: str, model: str, clock: StageClock, outcome: CallOutcome) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return  # the line is not built for nobody (serve --log-level warning)
    access_log.info(json.dumps({
        "request_id": request_id,
        "model": model,
        "status": outcome.status,
        "prompt_tokens": outcome.prompt_tokens,
        "cached_tokens": outcome.cached_tokens,
        "completion_tokens": outcome.completion_tokens,
        "finish_reason": outcome.finish_reason,
        "error": outcome.error,
        "ttft_ms": None if clock.ttft_ms is None else round(clock.ttft_ms, 2),
        "stages_ms": {k: round(v, 2) for k, v in clock.durations_ms().items()},
    }))


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
