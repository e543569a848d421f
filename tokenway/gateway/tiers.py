"""Which service tier a call runs at: what its API's field asks, within what its key was granted.

    OpenAI    service_tier  auto | default | flex | priority | scale ─► openai_ask ────┐
    Anthropic service_tier  auto | standard_only                     ─► anthropic_ask ─┤
    the key's grant: Principal.service_tiers, else the server's (Defaults.service_tiers) ┼─► resolve ─► ServiceClass
    CallStart.batch_line: a Batch API line runs as "batch", whatever its body asks ──────┘

The class resolved is GenerationJob.service_class: the local engine schedules by it, its price
bills the ledger row (billing/pricing.py), the response echoes it in its API's words
(openai_tier, anthropic_tier), and an upstream whose API has tiers is sent it.

OpenAI's "auto" (and no field) is "default" where the key has it, else "flex": never a
dearer tier than asked. "scale" (OpenAI's reserved capacity) runs as "priority". Anthropic's
"auto" (and no field, as Anthropic defaults) is "priority" where the key has it, else
"default" (Anthropic's "standard"); "standard_only" is "default". Without a gateway there is
no key: a tier named is run as asked, and "auto" is "default".
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenway.gateway.auth import Principal
from tokenway.gateway.call import Call
from tokenway.protocol import anthropic_bodies, openai_bodies
from tokenway.protocol.errors import PermissionDeniedError
from tokenway.protocol.job import GenerationJob, ServiceClass

# What a key that names no tiers may use, unless the server's config says otherwise: priority
# takes capacity from everyone else, so it is granted key by key.
DEFAULT_GRANT: tuple[ServiceClass, ...] = ("default", "flex", "batch")


@dataclass(frozen=True, slots=True)
class TierAsk:
    """A body's service_tier in tokenway's classes: the first of `preferred` the key has (one
    class for a tier named; more for "auto")."""

    preferred: tuple[ServiceClass, ...]
    asked: str  # as the caller wrote it, for the refusal

    def __post_init__(self) -> None:
        assert self.preferred, "a tier ask names at least one class"


def openai_ask(service_tier: str | None) -> TierAsk:
    """OpenAI's service_tier (chat completions, completions, responses); the request models
    have refused any other value already."""
    if service_tier in (None, "auto"):
        return TierAsk(("default", "flex"), "auto")
    if service_tier == "scale":
        return TierAsk(("priority",), "scale")
    assert service_tier in ("default", "flex", "priority"), f"unchecked service_tier {service_tier!r}"
    return TierAsk((service_tier,), service_tier)


def anthropic_ask(service_tier: str | None) -> TierAsk:
    if service_tier == "standard_only":
        return TierAsk(("default",), "standard_only")
    return TierAsk(("priority", "default"), "auto")


def granted_tiers(principal: Principal, default_grant: tuple[ServiceClass, ...]) -> tuple[ServiceClass, ...]:
    return principal.service_tiers if principal.service_tiers is not None else default_grant


def resolve(ask: TierAsk, granted: tuple[ServiceClass, ...] | None, batch_line: str | None) -> ServiceClass:
    """The class the call runs at; PermissionDeniedError (403, service_tier_not_allowed) naming
    what was asked and what the key may use, where it has none of the classes asked.
    granted None: no gateway, no key to ask."""
    preferred: tuple[ServiceClass, ...] = ("batch",) if batch_line is not None else ask.preferred
    if granted is None:
        return preferred[0] if len(preferred) == 1 else "default"
    for service_class in preferred:
        if service_class in granted:
            return service_class
    asked = "batch (a Batch API line)" if batch_line is not None else (
        ask.asked if ask.preferred == (ask.asked,) else f"{ask.asked} ({' or '.join(ask.preferred)})")
    raise PermissionDeniedError(f"This API key may not use the service tier {asked}; its tiers: "
                                f"{', '.join(granted) or 'none'}.", param=None if batch_line else "service_tier",
                                code="service_tier_not_allowed")


def call_tier(call: Call) -> ServiceClass:
    """The tier a call ran at, for its bill: its job's class; a job without one (embeddings) runs
    as "batch" for a Batch API line, else "default"."""
    if isinstance(call.job, GenerationJob):
        return call.job.service_class
    return "batch" if call.start.batch_line is not None else "default"


def openai_tier(service_class: ServiceClass) -> openai_bodies.ServedTier:
    """The tier a response says served it, in OpenAI's words: a Batch API line's says "default",
    as OpenAI's batch output does (its price is the batch's all the same)."""
    return "default" if service_class == "batch" else service_class


def anthropic_tier(service_class: ServiceClass) -> anthropic_bodies.ServedTier:
    """usage.service_tier: Anthropic has no flex; a flex call is billed as flex, shown as standard."""
    if service_class in ("priority", "batch"):
        return service_class
    return "standard"
