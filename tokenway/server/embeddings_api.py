"""POST /v1/embeddings: OpenAI's shape, through the same stages as a generation call.

    body ─► EmbeddingRequest ─► routing (the embeddings model, its pool) ─► safety (each input's
         text screened) ─► tokenize (checked ids)
         ─► EmbeddingsJob ─► admit (the caller's token limits reserve the inputs' tokens)
         ─► EmbeddingEngine (batched with other calls' inputs) ─► one CallOutcome ─► JSON

Keys, limits, the ledger row and the trace are the generation calls' (gateway/call.py); the
forward pass is timed as the prefill stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.embeddings import EmbeddingEngine
from tokenway.gateway.admission import admit
from tokenway.gateway.call import Call, CallOutcome, RouteChoice
from tokenway.protocol.embeddings import EmbeddingRequest, embedding_response
from tokenway.protocol.errors import NotFoundError, TokenwayError
from tokenway.protocol.job import EmbeddingsJob
from tokenway.routing.router import ReplicaChoice
from tokenway.safety.channels import screen_prompts
from tokenway.safety.screen import SafetyPolicy
from tokenway.server.generation import log_request
from tokenway.server.http import ClientDisconnected, offload, parse_body, unless_disconnected
from tokenway.server.prepare import screen
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services

if TYPE_CHECKING:
    from tokenway.embeddings.model import EmbeddingModel

# Inputs above this many answer through a worker thread: 2048 inputs as float JSON is ~16 MB
# and ~0.6 s of json.dumps, which must not stall the event loop.
INLINE_RENDER_INPUTS = 64


def router(services: Services) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/embeddings", openapi_extra=schema_extra(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        return await create_embeddings(services, request, call_of(request))

    return api


async def create_embeddings(services: Services, request: Request, call: Call) -> Response:
    body = await parse_body(request, EmbeddingRequest, services.body_parser)
    embedder = services.embedder
    name = services.resolve_model(body.model, call.start.principal, kind="embeddings")
    if embedder is None:  # listed but not loaded: cannot happen with the names from the server's own config
        raise NotFoundError.for_model(name)
    call.set_route(RouteChoice(model=name, pool=name))
    call.set_replica(ReplicaChoice(name, "local", "only"))
    clock = call.clock
    clock.end("routing")
    policy = services.safety_policy(name, call.start.principal)
    value = await offload(request, services.body_parser.inline_bytes, screen_inputs, call, policy, embedder, body.input)
    token_ids = await embedder.tokenize(value, dimensions=body.dimensions)
    job = EmbeddingsJob(call.start.new_id("embd-"), name, tuple(tuple(ids) for ids in token_ids), body.encoding_format)
    call.set_job(job)
    clock.end("tokenize")
    await admit(services.gatekeeper, call)
    num_tokens = job.num_prompt_tokens
    try:
        result = await unless_disconnected(request, embedder.embed_token_ids(token_ids))
        clock.end("queue")
        clock.end("prefill")
        if len(token_ids) > INLINE_RENDER_INPUTS:
            payload = await asyncio.to_thread(embedding_response, result.vectors, num_tokens, model=name,
                                              encoding_format=body.encoding_format)
        else:
            payload = embedding_response(result.vectors, num_tokens, model=name, encoding_format=body.encoding_format)
    except ClientDisconnected:
        finish(call, CallOutcome(499, prompt_tokens=num_tokens, error="client disconnected"))
        return Response(status_code=499)
    except TokenwayError as exc:
        finish(call, CallOutcome(exc.status, prompt_tokens=num_tokens, error=exc.message))
        raise
    clock.end("postprocess")
    finish(call, CallOutcome(200, prompt_tokens=num_tokens))
    return JSONResponse(payload, headers={"Server-Timing": clock.server_timing(), "x-request-id": job.request_id})


def screen_inputs(call: Call, policy: SafetyPolicy, embedder: EmbeddingEngine, value: Any) -> Any:
    """The safety stage for embeddings: each input's text (token ids decoded with the model's
    tokenizer) screened on its own; `value` as it came, or with the redacted inputs in place
    (an input given as token ids, its redacted text's ids)."""
    items = [value] if isinstance(value, str) or type(value[0]) is int else value
    model = cast("EmbeddingModel", embedder.model)  # the served one, whose tokenizer decodes

    def decode(token_ids: Sequence[int]) -> str:
        return model.tokenizer.decode([t for t in token_ids if t < model.vocab_size])

    redacted = screen_prompts(partial(screen, call, policy, param="input"), items, decode, "input")
    if redacted is None:
        return value
    new_items = [item if text is None else text if isinstance(item, str) else model.tokenize([text])[0]
                 for item, text in zip(items, redacted)]
    return new_items if items is value else new_items[0]


def finish(call: Call, outcome: CallOutcome) -> None:
    call.end(outcome)
    log_request(call.request_id, call.model, call.clock, outcome)
