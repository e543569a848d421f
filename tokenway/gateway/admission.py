"""The gateway's two steps on a prepared call: max_tokens within the window and the key's cap
(while the prompt is known, before the job is made), then admission (budget and limits, once
the job is made).

    cap_max_tokens(gatekeeper, principal, window, num_prompt_tokens, requested, ...) -> max_tokens
    admit(gatekeeper, call)   the call's Admission, or a 429 (503 while the limits store is down)

A gatekeeper of None (no auth, limits or ledger: benchmarks) caps nothing and admits every call.
"""

from __future__ import annotations

from tokenway.gateway.auth import Principal
from tokenway.gateway.call import Call
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.gateway.tiers import call_tier
from tokenway.protocol.errors import ContextLengthExceededError, InvalidRequestError


def cap_max_tokens(gatekeeper: Gatekeeper | None, principal: Principal, window: int, num_prompt_tokens: int,
                   requested: int | None, param: str, num_messages: int = 1, exact: bool = True,
                   prompt: str = "messages") -> int | None:
    """max_tokens after the window check and the key's caps (the cap fills in when the
    request names none). `exact`: num_prompt_tokens is the templated prompt's length; else an
    estimate (an untemplated job), which only a max_tokens over the whole window fails, and a
    call with neither max_tokens nor a cap gets None: the upstream gives it the rest."""
    if gatekeeper is not None:
        gatekeeper.check_sizes(principal, num_messages, requested, param)
        cap = gatekeeper.max_tokens_cap(principal)
        if requested is None and cap is not None and not (exact and num_prompt_tokens >= window):
            # (a prompt that fills the window alone is refused below for itself, not for a
            # completion of what it leaves, a negative count)
            requested = min(cap, window - num_prompt_tokens) if exact else cap
    if not exact:
        if requested is not None and requested >= window:
            raise InvalidRequestError(
                f"This model's maximum context length is {window} tokens. However, you requested {requested} "
                f"tokens for the completion alone. Please reduce {param}.", param=param,
                code="context_length_exceeded")
        return requested
    return resolve_max_tokens(window, num_prompt_tokens, requested, param, prompt)


def resolve_max_tokens(window: int, num_prompt_tokens: int, max_tokens: int | None, param: str,
                       prompt: str = "messages") -> int:
    """OpenAI's rule: prompt + max_tokens must fit the window; no max_tokens means 'the rest'.
    param: the max_tokens field's name; prompt: the prompt's."""
    if num_prompt_tokens >= window:
        raise ContextLengthExceededError(num_prompt_tokens, max_tokens, window, param=prompt, prompt=prompt)
    if max_tokens is None:
        return window - num_prompt_tokens
    if num_prompt_tokens + max_tokens > window:
        raise ContextLengthExceededError(num_prompt_tokens, max_tokens, window, param=param, prompt=prompt)
    return max_tokens


async def admit(gatekeeper: Gatekeeper | None, call: Call) -> None:
    """Budget and limits, reserving the worst-case cost and prompt + max_tokens for every
    choice of the call's job. Raises 429 (503 while the limits store is down, under
    limits_on_error closed)."""
    if gatekeeper is not None:
        job = call.job
        assert job is not None, "a call is admitted once its job is made"
        num_prompt_tokens = job.num_prompt_tokens
        call.set_admission(await gatekeeper.admit(call.start.principal, call.model, num_prompt_tokens,
                                                  job.num_reserved_tokens - num_prompt_tokens, job.n,
                                                  call_tier(call)))
    call.clock.end("limits")
