"""Anthropic's Messages API over the same engine and chat path:

    POST /v1/messages               a Message, or Anthropic's named SSE events (anthropic_render.py)
    POST /v1/messages/count_tokens  {"input_tokens": N}: the prompt a Messages call would make

The adaptor (anthropic_prepare.py) makes the same PreparedCall a chat call does. The
`anthropic-version` and `anthropic-beta` headers are read by nothing: every field the betas
add is in the schema, whichever betas a client names.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.protocol.anthropic import MessagesPrompt, MessagesRequest
from tokenway.server.anthropic_prepare import count_message_tokens, prepare_messages
from tokenway.server.anthropic_render import message_response, message_stream
from tokenway.server.generation import admitted
from tokenway.server.http import EventStreamResponse, offload, parse_body
from tokenway.server.response_cache import cache_directive
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services


def router(services: Services) -> APIRouter:
    api = APIRouter()
    inline_bytes = services.body_parser.inline_bytes

    @api.post("/v1/messages", openapi_extra=schema_extra(MessagesRequest))
    async def messages(request: Request) -> Response:
        body = await parse_body(request, MessagesRequest, services.body_parser)
        call = call_of(request)
        messages_call = await offload(request, inline_bytes, prepare_messages, services, body, call)
        generation = await admitted(services, call, messages_call.prepared, cache_directive(request))
        if body.stream:
            await generation.start_stream(request)  # a refusal is a status, not a 200 stream of one error
            return EventStreamResponse(message_stream(generation, messages_call), generation.cache_headers,
                                       on_close=generation.aclose)
        return await generation.json_response(request, message_response(generation, messages_call), "request-id")

    @api.post("/v1/messages/count_tokens", openapi_extra=schema_extra(MessagesPrompt))
    async def count_tokens(request: Request) -> Response:
        body = await parse_body(request, MessagesPrompt, services.body_parser)
        call = call_of(request)
        return JSONResponse(await offload(request, inline_bytes, count_message_tokens, services, body, call))

    return api
