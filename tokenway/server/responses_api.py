"""OpenAI's Responses API over the chat path:

    POST   /v1/responses                      create: JSON, an SSE stream, or background (queued)
    GET    /v1/responses/{id}                 the stored response (a background one: its status now)
    DELETE /v1/responses/{id}                 deleted (a background one still running: stopped)
    POST   /v1/responses/{id}/cancel          a background response: cancelled, its generation aborted
    GET    /v1/responses/{id}/input_items     its own input items, a page at a time
    POST   /v1/responses/input_tokens         the prompt's length, as a response would have it

A create goes the chat path's way (responses_prepare.py, then guard, admit, Generation) and
renders as responses_render.py's Response or events. Stored responses (conversations/) belong
to the key that made them: another key's is a 404, as one that does not exist.
"""

from __future__ import annotations

import re
import time
from itertools import count
from typing import Literal, cast

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.conversations import (
    FINAL_STATUSES,
    PreviousResponseNotFoundError,
    ResponseStore,
    StoredResponse,
    response_not_found,
)
from tokenway.gateway.call import Call
from tokenway.protocol.errors import ContentPolicyViolationError, InvalidRequestError, TokenwayError, truncate
from tokenway.protocol.responses import InputTokensRequest, ResponsesPrompt, ResponsesRequest
from tokenway.protocol.responses_bodies import InputItem, InputTokens, OutputItem, ResponseDeleted
from tokenway.protocol.responses_bodies import Response as ResponseBody
from tokenway.server.generation import Generation, admitted
from tokenway.server.http import EventStreamResponse, offload, parse_body
from tokenway.server.openai_render import TokenText
from tokenway.server.response_cache import CacheDirective, cache_directive
from tokenway.server.responses_background import detached_call, record, run_detached
from tokenway.server.responses_output import OutputItems
from tokenway.server.responses_prepare import (
    History,
    PreparedResponse,
    count_input_tokens,
    naming_fields,
    prepare_response,
)
from tokenway.server.responses_render import OnEnd, ResponseStream, response_base, response_json
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services

# Ids as this server makes them (and OpenAI's): anything else cannot name a stored response.
RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9]{1,128}")
MAX_PAGE_ITEMS = 100


def router(services: Services) -> APIRouter:
    api = APIRouter()
    inline_bytes = services.body_parser.inline_bytes

    @api.post("/v1/responses", openapi_extra=schema_extra(ResponsesRequest))
    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest, services.body_parser)
        call = call_of(request)
        if body.background:
            return await create_background(request, body, call)
        history = await history_of(services, body, call)
        prepared = await offload(request, inline_bytes, prepare_response, services, body, call, history)
        generation = await admitted_response(services, call, prepared, cache_directive(request))
        base = response_base(body, prepared)
        items = output_items(body, generation)
        on_end = storing(services, call, body, prepared)
        if body.stream:
            await generation.start_stream(request)  # a refusal is a status, not a 200 stream of one error
            return EventStreamResponse(ResponseStream(base, generation, items, on_end).framed(),
                                       generation.cache_headers, on_close=generation.aclose)
        return await generation.json_response(request, response_json(base, generation, items, on_end))

    async def create_background(request: Request, body: ResponsesRequest, http_call: Call) -> Response:
        """Prepared and admitted now (a 400 or 429 answers the POST), run detached on a Call
        of its own, answered as queued."""
        store = stored_in(services)
        call = detached_call(http_call)
        history = await history_of(services, body, call)
        prepared = await offload(request, inline_bytes, prepare_response, services, body, call, history)
        assert call.route is not None, "prepare_response routes the call first"
        http_call.set_route(call.route)  # the POST's own row (a refusal's, before admission) names the model too
        generation = await admitted_response(services, call, prepared)
        # Admitted, the detached call writes the one ledger row and trace (record(), whatever ends
        # it): the POST answered with it writes neither.
        http_call.hand_over()
        base = response_base(body, prepared)
        queued = base.copy()
        queued["status"] = "queued"
        try:
            services.background.check_open()
            # Held by this server while it runs: one that outlives its server is failed by the
            # next to see its lease pass (responses_tasks.py).
            lease_until = time.time() + services.background.lease_s
            await store.create(stored_response(call, body, prepared, queued, lease_until))
            services.background.spawn(prepared.response_id, run_detached(
                services, services.background, store, generation, base, output_items(body, generation)))
        except BaseException as exc:
            generation.finish(exc.status if isinstance(exc, TokenwayError) else 499, str(exc))
            await generation.aclose()
            await record(services, call)
            raise
        return JSONResponse(queued, headers={"x-request-id": prepared.response_id})

    @api.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        if request.query_params.get("stream", "false").lower() == "true":
            raise InvalidRequestError("stream: resuming a response's stream is not supported by this server; "
                                      "poll GET /v1/responses/{id} for a background response", param="stream")
        stored = await stored_of(services, request, response_id)
        return JSONResponse(stored.response)

    @api.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        store = stored_in(services)
        if not RESPONSE_ID.fullmatch(response_id) or not await store.delete(response_id, key_of(request)):
            raise response_not_found(response_id)
        services.background.cancel(response_id)
        deleted: ResponseDeleted = {"id": response_id, "object": "response.deleted", "deleted": True}
        return JSONResponse(deleted)

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> Response:
        store = stored_in(services)
        stored = await stored_of(services, request, response_id)
        if not stored.response.get("background"):
            raise InvalidRequestError("Only responses created with background: true can be cancelled.",
                                      code="not_cancellable")
        if stored.status in FINAL_STATUSES:  # cancelling is idempotent: a finished response stays as it is
            return JSONResponse(stored.response)
        cancelled = {**stored.response, "status": "cancelled"}
        if not await store.update(response_id, status="cancelled", response=cancelled):
            return JSONResponse((await stored_of(services, request, response_id)).response)  # it ended meanwhile
        services.background.cancel(response_id)
        return JSONResponse(cancelled)

    @api.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Response:
        query = request.query_params
        limit, order, after = page_limit(query.get("limit")), page_order(query.get("order")), query.get("after")
        page = None
        if RESPONSE_ID.fullmatch(response_id):
            try:
                page = await stored_in(services).input_items(response_id, key_of(request), after=after, limit=limit,
                                                             order=order)
            except ValueError as exc:  # an `after` the response has no item for
                raise InvalidRequestError(str(exc), param="after") from None
        if page is None:
            raise response_not_found(response_id)
        return JSONResponse(page.to_json())

    @api.post("/v1/responses/input_tokens", openapi_extra=schema_extra(InputTokensRequest))
    async def input_tokens(request: Request) -> Response:
        body = await parse_body(request, InputTokensRequest, services.body_parser)
        call = call_of(request)
        history = await history_of(services, body, call)
        num_tokens = await offload(request, inline_bytes, count_input_tokens, services, body, call, history)
        counted: InputTokens = {"object": "response.input_tokens", "input_tokens": num_tokens}
        return JSONResponse(counted)

    return api


async def admitted_response(services: Services, call: Call, prepared: PreparedResponse,
                            cache: CacheDirective | None = None) -> Generation:
    """The chat path's admitted(), its safety refusal naming the Responses field; `cache`: the
    caller's directive to the response cache (None, as for a background response: not covered)."""
    try:
        return await admitted(services, call, prepared.call, cache)
    except ContentPolicyViolationError as exc:
        raise naming_fields(exc) from None


def output_items(body: ResponsesRequest, generation: Generation) -> OutputItems:
    token_text = TokenText(generation.frontend) if body.wants_logprobs else None
    return OutputItems(bool(body.stream), count(), token_text, body.top_logprobs or 0, body.namespaces(),
                       body.wants_encrypted_reasoning)


def key_of(request: Request) -> str:
    """The caller's key: a stored response's owner."""
    return call_of(request).start.principal.key_id


def stored_in(services: Services) -> ResponseStore:
    store = services.response_store
    if store is None:
        raise InvalidRequestError("This server keeps no responses: send store false, and the conversation's items "
                                  "instead of previous_response_id.", code="store_disabled")
    return store


async def stored_of(services: Services, request: Request, response_id: str) -> StoredResponse:
    stored = None
    if RESPONSE_ID.fullmatch(response_id):
        stored = await stored_in(services).get(response_id, key_of(request))
    if stored is None:
        raise response_not_found(response_id)
    return stored


def page_limit(text: str | None) -> int:
    if text is None:
        return 20
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_PAGE_ITEMS:
        raise InvalidRequestError(f"limit: must be an integer from 1 to {MAX_PAGE_ITEMS}, got {text[:20]!r}",
                                  param="limit")
    return int(text)


def page_order(text: str | None) -> Literal["asc", "desc"]:
    """A list's `order` query parameter: newest first ("desc") unless asked."""
    if text is None or text == "desc":
        return "desc"
    if text != "asc":
        raise InvalidRequestError(f"order: must be 'asc' or 'desc', got {text[:20]!r}", param="order")
    return "asc"


async def history_of(services: Services, body: ResponsesPrompt, call: Call) -> History:
    """The stored conversation body.previous_response_id continues (one query), for the caller's key."""
    previous_id = body.previous_response_id
    if previous_id is None:
        return History()
    store = stored_in(services)
    key_id = call.start.principal.key_id
    if not RESPONSE_ID.fullmatch(previous_id):
        raise PreviousResponseNotFoundError(f"Previous response with id '{truncate(previous_id)}' not found.")
    turns = await store.chain(previous_id, key_id)
    last = turns[-1]
    if last.status not in FINAL_STATUSES:
        raise InvalidRequestError(f"previous_response_id: response '{previous_id}' is still {last.status}; "
                                  "continue it once it has finished", param="previous_response_id")
    # The store keeps the items as this module made them (protocol/responses_bodies.py's shapes).
    items = cast("tuple[InputItem | OutputItem, ...]",
                 tuple(item for turn in turns for item in (*turn.input_items, *turn.output)))
    return History(items, last.model)


def storing(services: Services, call: Call, body: ResponsesRequest, prepared: PreparedResponse) -> OnEnd | None:
    """How a finished response is kept: in the store, its insert not awaited (store: true), or not at all."""
    store = services.response_store
    if not body.stored or store is None:
        return None

    async def keep(response: ResponseBody) -> None:
        store.keep(stored_response(call, body, prepared, response))

    return keep


def stored_response(call: Call, body: ResponsesRequest, prepared: PreparedResponse, response: ResponseBody,
                    lease_until: float | None = None) -> StoredResponse:
    return StoredResponse(
        id=response["id"], key_id=call.start.principal.key_id, created_at=prepared.created_at,
        status=response["status"], model=response["model"], previous_response_id=body.previous_response_id,
        instructions=body.instructions, input_items=tuple(dict(item) for item in prepared.input_items),
        response=dict(response), metadata=body.metadata or {}, lease_until=lease_until)
