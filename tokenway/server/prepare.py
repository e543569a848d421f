"""The steps a generation call takes between its typed body and its response, the same for
every API. An API's adaptor (openai_api.py, anthropic_api.py) runs the first ones, in a worker
thread for a large body (http.offload), and returns a PreparedCall; its route runs the rest:

    body ─► route (the served model), service_class (the tier: gateway/tiers.py)
         ─► screen (safety: the input check)
         ─► chat_prompt: the frontend's template (a reasoning model's switch and budget),
            max_tokens capped (gateway/admission.py)
         ─► SamplingParams ─► GenerationJob ─► prepared(): the call's job, the engine's checks
         ─► PreparedCall
    PreparedCall ─► admitted (generation.py): guard (a guard model's verdict), admit (budget
         and limits) ─► Generation ─► the API's JSON or stream

Each step records what it decided on the Call (gateway/call.py) and ends its stage's clock.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from tokenway.frontend.chat import build_chat_prompt
from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.reasoning_parsers import ReasoningFormat
from tokenway.frontend.templating import structured_output_spec, template_chat
from tokenway.frontend.tool_parsers import ReplyFormat
from tokenway.gateway.admission import cap_max_tokens
from tokenway.gateway.call import Call, RouteChoice
from tokenway.gateway.tiers import TierAsk, resolve
from tokenway.ids import random_hex
from tokenway.protocol.errors import ContentPolicyViolationError, InvalidRequestError, invalid_value
from tokenway.protocol.job import GenerationJob, ReplicaEvent, ServiceClass, estimate_chat_tokens
from tokenway.protocol.sampling import ReasoningBudget, SamplingParams, StructuredOutputSpec, ThinkingRequest
from tokenway.routing.replicas import engine_unavailable
from tokenway.routing.router import ReplicaChoice, Router
from tokenway.safety.channels import ChatInput, PromptText
from tokenway.safety.guard import ask_guard, guard_turns, verdict_refusal
from tokenway.safety.screen import SafetyPolicy, screen_input
from tokenway.server.services import ModelCatalog, Services

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """What an adaptor made of a request: the job, and what running and rendering it need."""

    job: GenerationJob
    frontend: ModelFrontend | None  # the model's tokenizer; None: untemplated (its upstream templates)
    policy: SafetyPolicy  # the call's safety policy: the guard and the output check read it
    reply_format: ReplyFormat | None = None  # how the reply's tool calls are read; None: no tools (or the upstream's)
    echo: str = ""  # a completion's prompt text, before each choice's text (echo: true)
    reasoning: ReasoningFormat | None = None  # how the reply's thinking is read; None: no thinking to read


@dataclass(frozen=True, slots=True)
class ChatTemplating:
    """What templating a chat call decided (chat_prompt)."""

    prompt_token_ids: tuple[int, ...] | None  # None: the model's upstream templates the messages
    context_window: int
    max_tokens: int | None  # None only for an untemplated call that set none: the upstream's rest
    messages: tuple[dict, ...]  # as the safety stage passed them (redacted, under a redact policy)
    structured: StructuredOutputSpec | None  # what the reply is constrained to (JSON, a tool-call grammar)
    reply_format: ReplyFormat | None  # how the reply's tool calls are read; None: no tools (or the upstream's)
    # How the reply's thinking is read (Generation splits it off the content); None: no thinking
    # to read (the model has no reasoning format, its thinking is off, or an upstream templates).
    reasoning: ReasoningFormat | None = None
    # The engine's bound on the thinking (SamplingParams.reasoning_budget); None: unbounded.
    reasoning_budget: ReasoningBudget | None = None

    @property
    def skip_special_tokens(self) -> bool:
        """Formats that mark calls with special tokens ([TOOL_CALLS], <|python_tag|>) need them in the text."""
        return self.reply_format is None or not self.reply_format.keeps_special_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}{random_hex()}"


def route(services: Services, call: Call, model: str | None) -> str:
    """Stage 2: the served model a generation call asked for, and its pool (the router picks
    the replica once the job is made)."""
    name = services.resolve_model(model, call.start.principal)
    call.set_route(RouteChoice(model=name, pool=name))
    call.clock.end("routing")
    return name


def service_class(services: Services, call: Call, ask: TierAsk) -> ServiceClass:
    """The tier the call runs at, asked in its API's words (gateway/tiers.py): 403 where its key
    may not use it; without a gateway, any. A Batch API line runs as "batch"."""
    gatekeeper = services.gatekeeper
    if gatekeeper is None:
        return resolve(ask, None, call.start.batch_line)
    return gatekeeper.service_class(call.start.principal, ask, call.start.batch_line)


def screen(call: Call, policy: SafetyPolicy, texts: Iterable[PromptText], param: str = "messages"
           ) -> tuple[str, ...] | None:
    """The safety stage's input check (safety/screen.py) of every text a call carries into
    its prompt (safety/channels.py): raises ContentPolicyViolationError (400, naming the
    field of the first finding, else `param`) under a block policy that finds something, or
    a redact policy that finds something it cannot redact in place; under a redact policy
    that finds something, the texts redacted (every one, in order); else None. The texts
    are read only when a policy is on."""
    if policy.input == "off":
        call.clock.end("safety")
        return None
    screening = screen_input(policy, list(texts))
    call.set_screening(screening)
    call.clock.end("safety")
    if screening.action == "block":
        raise ContentPolicyViolationError(screening.categories, param=screening.param or param)
    return screening.redacted


def chat_prompt(services: Services, call: Call, model: str, chat: ChatInput, tool_choice: Any,
                requested_max_tokens: int | None, param: str, num_messages: int,
                parallel_tool_calls: bool | None = None, continue_final_message: bool = False,
                thinking: ThinkingRequest | None = None, template_kwargs: Mapping[str, Any] | None = None
                ) -> ChatTemplating:
    """A chat call's prompt for its model (stage 3), the same for every chat API: templated
    and checked against the window where tokenway has the model's tokenizer; else left to the
    upstream, with max_tokens checked against the config's window and an estimated prompt.
    `chat` is the input as the safety stage passed it, so a redacted prompt is templated once.
    `thinking` sets a reasoning model's template switch and budget (the upstream's job carries
    it otherwise); template_kwargs go to the chat template as they are (vLLM's chat_template_kwargs)."""
    frontend = services.catalog.frontend(model)
    principal = call.start.principal
    if frontend is None:
        window = services.catalog.max_model_len(model)
        max_tokens = cap_max_tokens(services.gatekeeper, principal, window,
                                    estimate_chat_tokens(chat.messages, chat.tools), requested_max_tokens, param,
                                    num_messages=num_messages, exact=False)
        return ChatTemplating(None, window, max_tokens, tuple(chat.messages), None, None)
    with field_errors():  # a template that fails on these messages, a chat_template_kwargs it is refused
        prompt = template_chat(frontend, chat.messages, chat.tools, tool_choice, parallel_tool_calls,
                               chat.response_format, services.tool_parser(frontend), continue_final_message,
                               reasoning_parser=reasoning_parser(services, frontend), thinking=thinking,
                               template_kwargs=template_kwargs)
    max_tokens = cap_max_tokens(services.gatekeeper, principal, frontend.max_model_len, len(prompt.prompt_token_ids),
                                requested_max_tokens, param, num_messages=num_messages)
    return ChatTemplating(tuple(prompt.prompt_token_ids), frontend.max_model_len, max_tokens, tuple(chat.messages),
                          structured_output_spec(prompt), prompt.reply_format, prompt.reasoning,
                          prompt.reasoning_budget)


def reasoning_parser(services: Services, frontend: ModelFrontend) -> str | None:
    """--reasoning-parser, for the local model; None: the model's template decides."""
    return services.settings.reasoning_parser if frontend.is_local else None


@contextmanager
def field_errors() -> Iterator[None]:
    """A ValueError from the layers below (SamplingParams, the prompt checks) as the 400 naming its field."""
    try:
        yield
    except ValueError as exc:
        raise invalid_value(exc) from None


def prepared(services: Services, call: Call, job: GenerationJob, frontend: ModelFrontend | None,
             policy: SafetyPolicy, reply_format: ReplyFormat | None = None, echo: str = "", *,
             reasoning: ReasoningFormat | None = None) -> PreparedCall:
    """The call's job, made: from here a 400 or 429 is billed with its prompt, under its id.
    The engine's own checks (vocabulary, window, a response_format that cannot be satisfied)
    run now, so they are a 400 before any byte of a stream is sent."""
    call.set_job(job)
    if frontend is not None:
        with field_errors():
            if job.tools and job.tool_choice != "none":
                frontend.prompts.check_tools(job.tools)
            frontend.prompts.check(list(job.prompt_token_ids or ()), job.params)
        engine = services.engine
        if frontend.is_local and engine is not None and not engine.is_alive:
            raise engine_unavailable()
    if policy.output in ("redact", "block") and job.params.logprobs is not None:
        # Each token's text would show what the policy takes out of the reply.
        raise InvalidRequestError(f"logprobs: not available on this server (its safety policy "
                                  f"{policy.output}s output)", param="logprobs")
    call.clock.end("tokenize")
    return PreparedCall(job, frontend, policy, reply_format, echo, reasoning)


async def guard(services: Services, call: Call, prepared_call: PreparedCall) -> None:
    """A guard model's verdict on the input (safety/guard.py), after preparing and before
    admission, where the call's policy names a guard: its categories are flagged, or a 400
    under `block`; a guard that cannot answer passes the call (named in the trace), or is a
    503 with guard_fail_closed."""
    policy, job = prepared_call.policy, prepared_call.job
    if policy.guard_model is None or policy.input == "off":
        return
    verdict = await ask_guard(partial(_guard_events, services), partial(_guard_job, services.catalog,
                                                                        policy.guard_model),
                              guard_turns(job), policy.guard_format)
    call.set_guard(verdict)
    call.clock.end("guard")
    if verdict.error is not None:
        logger.warning("guard model %s could not answer for %s: %s", policy.guard_model, call.request_id,
                       verdict.error)
    refusal = verdict_refusal(verdict, block=policy.input == "block", fail_closed=policy.guard_fail_closed,
                              param="prompt" if job.kind == "completion" else "messages")
    if refusal is not None:
        raise refusal


def _guard_job(catalog: ModelCatalog, model: str, messages: list[dict], params: SamplingParams, request_id: str
               ) -> GenerationJob:
    frontend = catalog.frontend(model)
    if frontend is None:
        return GenerationJob(request_id, model, "chat", params, messages=tuple(messages),
                             context_window=catalog.max_model_len(model))
    prompt = build_chat_prompt(frontend.tokenizer, messages, max_num_tokens=frontend.max_model_len)
    return GenerationJob(request_id, model, "chat", params, messages=tuple(messages),
                         prompt_token_ids=tuple(prompt.prompt_token_ids), context_window=frontend.max_model_len)


def replica_events(router: Router, job: GenerationJob, on_replica: Callable[[ReplicaChoice], None]
                   ) -> AsyncGenerator[ReplicaEvent, None]:
    """The router's events for a job; closing them (aclose) stops the replica."""
    return cast("AsyncGenerator[ReplicaEvent, None]", router.generate(job, on_replica))  # an async generator


async def _guard_events(services: Services, job: GenerationJob) -> AsyncIterator[ReplicaEvent]:
    services.capacity.take(1)
    try:
        async with aclosing(replica_events(services.router, job, lambda choice: None)) as events:
            async for event in events:
                yield event
    finally:
        services.capacity.release(1)
