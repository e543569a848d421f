"""OpenAI's generation API: POST /v1/chat/completions and /v1/completions, as JSON or SSE
(openai_render.py).

Each adaptor parses its body into its pydantic request and prepares one PreparedCall
(server/prepare.py's steps); the route then runs guard -> admit -> respond on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from tokenway.frontend.templating import completion_token_ids
from tokenway.gateway.admission import cap_max_tokens
from tokenway.gateway.call import Call
from tokenway.gateway.tiers import openai_ask
from tokenway.protocol.errors import InvalidRequestError
from tokenway.protocol.job import GenerationJob, ServiceClass, estimate_tokens
from tokenway.protocol.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from tokenway.protocol.sampling import ReasoningBudget, SamplingParams, StructuredOutputSpec
from tokenway.safety.channels import ChatInput, screen_chat, screen_prompts
from tokenway.safety.screen import SafetyPolicy
from tokenway.server.generation import admitted
from tokenway.server.http import EventStreamResponse, offload, parse_body
from tokenway.server.openai_render import (
    chat_response,
    chat_stream,
    completion_response,
    completion_stream,
    guarded_stream,
)
from tokenway.server.prepare import (
    PreparedCall,
    chat_prompt,
    field_errors,
    prepared,
    route,
    screen,
    service_class,
)
from tokenway.server.response_cache import cache_directive
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services


def router(services: Services) -> APIRouter:
    api = APIRouter()
    inline_bytes = services.body_parser.inline_bytes

    # The adaptors (prepare_chat, prepare_completion) are looked up at each call, where a test
    # may stand a broken one in.
    @api.post("/v1/chat/completions", openapi_extra=schema_extra(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, services.body_parser)
        call = call_of(request)
        generation = await admitted(services, call, await offload(request, inline_bytes, prepare_chat, services,
                                                                  body, call), cache_directive(request))
        if body.stream:
            await generation.start_stream(request)  # a refusal is a status, not a 200 stream of one error
            return EventStreamResponse(guarded_stream(chat_stream(body, generation), generation),
                                       generation.cache_headers, on_close=generation.aclose)
        return await generation.json_response(request, chat_response(body, generation))

    @api.post("/v1/completions", openapi_extra=schema_extra(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, services.body_parser)
        call = call_of(request)
        prepared_call = await offload(request, inline_bytes, prepare_completion, services, body, call)
        generation = await admitted(services, call, prepared_call, cache_directive(request))
        if body.stream:
            await generation.start_stream(request)
            return EventStreamResponse(guarded_stream(completion_stream(body, generation, prepared_call.echo),
                                                      generation), generation.cache_headers, on_close=generation.aclose)
        return await generation.json_response(request, completion_response(body, generation, prepared_call.echo))

    return api


def openai_sampling(body: SamplingRequest, max_tokens: int | None, structured: StructuredOutputSpec | None,
                    logprobs: int | None, skip_special_tokens: bool = True,
                    reasoning_budget: ReasoningBudget | None = None) -> SamplingParams:
    """The OpenAI fields as SamplingParams; a value they refuse is the 400 naming its field."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    with field_errors():
        return SamplingParams(
            n=1,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            logit_bias=body.logit_bias_by_token_id or None,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens or 0,
            stop=tuple(s for s in (stop or ()) if s),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            structured_output=structured,
            skip_special_tokens=skip_special_tokens,
            reasoning_budget=reasoning_budget,
        )


# ---- chat ------------------------------------------------------------------------------


def prepare_chat(services: Services, body: ChatCompletionRequest, call: Call) -> PreparedCall:
    """The adaptor for chat: the body becomes one GenerationJob."""
    model = route(services, call, body.model)
    tier = service_class(services, call, openai_ask(body.service_tier))
    policy = services.safety_policy(model, call.start.principal)
    top_logprobs = 0 if body.logprobs and body.top_logprobs is None else body.top_logprobs
    tool_choice: Any = body.tool_choice if body.tool_choice is not None else "auto"
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump(exclude_none=True)
    response_format = (body.response_format.model_dump(exclude_none=True, by_alias=True)
                       if body.response_format else None)
    chat = screen_chat(partial(screen, call, policy),
                       ChatInput(body.template_messages(), body.template_tools(), response_format))
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    logprobs = top_logprobs if body.logprobs else None
    thinking = body.thinking
    templating = chat_prompt(services, call, model, chat, tool_choice, body.max_output_tokens, param,
                             len(body.messages), body.parallel_tool_calls, body.continue_final_message,
                             thinking=thinking, template_kwargs=body.chat_template_kwargs)
    params = openai_sampling(body, templating.max_tokens, templating.structured, logprobs,
                             templating.skip_special_tokens, templating.reasoning_budget)
    tools = chat.tools
    job = GenerationJob(call.start.new_id("chatcmpl-"), model, "chat", params, n=body.n or 1,
                        messages=templating.messages,
                        tools=tuple(tools) if tools else None, tool_choice=tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls is not False,
                        response_format=chat.response_format, prompt_token_ids=templating.prompt_token_ids,
                        context_window=templating.context_window, stream=bool(body.stream), thinking=thinking,
                        service_class=tier)
    return prepared(services, call, job, services.catalog.frontend(model), policy, templating.reply_format,
                    reasoning=templating.reasoning)


# ---- completions -----------------------------------------------------------------------


def screen_prompt(services: Services, call: Call, policy: SafetyPolicy, body: CompletionRequest
                  ) -> str | list[str] | list[int] | list[list[int]]:
    """The safety stage for a completion: each prompt's text, token ids decoded with the
    model's tokenizer first; the body's prompt, or with the redacted texts in place (a prompt
    given as token ids becomes its redacted text). Token ids for a model tokenway has no
    tokenizer for cannot be read: refused under a block or redact policy, passed unread under flag."""
    frontend = services.catalog.frontend(call.model)

    def decode(token_ids: Sequence[int]) -> str:
        if frontend is not None:
            return frontend.tokenizer.decode(t for t in token_ids if t < frontend.vocab_size)
        if policy.input in ("block", "redact"):
            raise InvalidRequestError(
                "prompt: this server's content policy reads every prompt, and token ids for this model "
                "cannot be read (tokenway has no tokenizer for it); send the prompt as text", param="prompt",
                code="content_policy_unreadable")
        return ""

    prompts = body.prompts
    redacted = screen_prompts(partial(screen, call, policy, param="prompt"), prompts, decode, "prompt")
    if redacted is None:
        return body.prompt
    new: Any = [prompt if text is None else text for prompt, text in zip(prompts, redacted)]
    return new if prompts is body.prompt else new[0]  # prompts wraps a single prompt in a list


def prepare_completion(services: Services, body: CompletionRequest, call: Call) -> PreparedCall:
    model = route(services, call, body.model)
    tier = service_class(services, call, openai_ask(body.service_tier))
    policy = services.safety_policy(model, call.start.principal)
    prompt = screen_prompt(services, call, policy, body)
    frontend = services.catalog.frontend(model)
    if frontend is None:
        return prepare_untemplated_completion(services, body, call, model, policy, prompt, tier)
    prompts = completion_token_ids(frontend, prompt)
    if len(prompts) != 1:
        raise one_prompt_only()
    prompt_token_ids = prompts[0]
    if not prompt_token_ids:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    vocab_size = frontend.vocab_size
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab_size})", param="prompt")
    max_tokens = cap_max_tokens(services.gatekeeper, call.start.principal, frontend.max_model_len,
                                len(prompt_token_ids), body.max_tokens, "max_tokens", prompt="prompt")
    params = openai_sampling(body, max_tokens, None, body.logprobs)
    job = GenerationJob(call.start.new_id("cmpl-"), model, "completion", params, n=body.n or 1,
                        prompt=prompt if isinstance(prompt, str) else None,
                        prompt_token_ids=tuple(prompt_token_ids), context_window=frontend.max_model_len,
                        stream=bool(body.stream), service_class=tier)
    echo = frontend.tokenizer.decode(prompt_token_ids) if body.echo else ""
    return prepared(services, call, job, frontend, policy, echo=echo)


def one_prompt_only() -> InvalidRequestError:
    # Batched prompts would be n choices each; one prompt per call keeps billing exact.
    return InvalidRequestError("prompt: send one prompt per request (a list of prompts is not supported)",
                               param="prompt")


def prepare_untemplated_completion(services: Services, body: CompletionRequest, call: Call, model: str,
                                   policy: SafetyPolicy, prompt: str | list[str] | list[int] | list[list[int]],
                                   tier: ServiceClass) -> PreparedCall:
    """A completion for a model tokenway has no tokenizer for: the caller's text (or token ids,
    in the upstream's vocabulary) goes as it came."""
    # One prompt: a text or token ids, alone or as a list of one.
    prompts: list[Any] = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else prompt
    if len(prompts) != 1:
        raise one_prompt_only()
    item: str | list[int] = prompts[0]
    if not item:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    text, token_ids = (item, None) if isinstance(item, str) else (None, tuple(item))
    if body.echo and text is None:
        raise InvalidRequestError("echo: needs the prompt as text for this model (tokenway has no tokenizer to "
                                  "decode its token ids)", param="echo")
    window = services.catalog.max_model_len(model)
    num_prompt_tokens = estimate_tokens(text) if text is not None else len(item)
    max_tokens = cap_max_tokens(services.gatekeeper, call.start.principal, window, num_prompt_tokens, body.max_tokens,
                                "max_tokens", exact=False, prompt="prompt")
    params = openai_sampling(body, max_tokens, None, body.logprobs)
    job = GenerationJob(call.start.new_id("cmpl-"), model, "completion", params, n=body.n or 1, prompt=text,
                        prompt_token_ids=token_ids, context_window=window,
                        stream=bool(body.stream), service_class=tier)
    return prepared(services, call, job, None, policy, echo=(text or "") if body.echo else "")
