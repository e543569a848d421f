"""What the served models are, and their tokenizers:

    GET  /v1/models            the models the caller's key may use, as OpenAI lists them
    GET  /v1/models/{model}    one model's card (404, 403 for one the key may not use)
    POST /tokenize             vLLM's: a prompt or chat messages -> token ids (also /v1/tokenize)
    POST /detokenize           token ids -> text
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.templating import context_window, prompt_fields, templated_token_ids
from tokenway.gateway.auth import Principal
from tokenway.protocol.errors import ContextLengthExceededError, InvalidRequestError
from tokenway.protocol.openai_bodies import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from tokenway.protocol.openai_requests import DetokenizeRequest, TokenizeRequest
from tokenway.server.http import offload, parse_body
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services


def router(services: Services) -> APIRouter:
    api = APIRouter()
    catalog = services.catalog

    def model_card(name: str) -> ModelCard:
        if name in catalog.embedding_model_names:
            embedder = services.embedder
            assert embedder is not None, "embedding models are listed only while their engine is loaded"
            return {"id": name, "object": "model", "created": services.created, "owned_by": "tokenway",
                    "kind": "embeddings", "dimensions": embedder.dimensions,
                    "max_model_len": embedder.model.max_input_tokens}
        aliases = sorted(alias for alias, target in catalog.aliases.items() if target == name)
        card: ModelCard = {"id": name, "object": "model", "created": services.created, "owned_by": "tokenway",
                           "kind": "chat", "max_model_len": catalog.max_model_len(name), "aliases": aliases}
        gatekeeper = services.gatekeeper
        if gatekeeper is not None and name in gatekeeper.prices:
            card["pricing"] = gatekeeper.prices.price(name).to_dict()  # USD per million tokens
        return card

    def tokenizing_frontend(name: str | None, principal: Principal) -> ModelFrontend:
        """The frontend of a model /tokenize and /detokenize are asked about (None: the first
        served model's), resolved as a call's model is (404, 403 for one the key may not use);
        400 for one tokenway has no tokenizer for."""
        name = services.resolve_model(name if name is not None else catalog.chat_model_names[0], principal)
        frontend = catalog.frontend(name)
        if frontend is None:
            raise InvalidRequestError(f"model: tokenway has no tokenizer for '{name}' "
                                      "(its replicas template and count its prompts)", param="model",
                                      code="model_not_supported")
        return frontend

    @api.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        """The models the caller's key may use, as OpenAI lists those a key has access to."""
        principal = call_of(request).start.principal
        return {"object": "list", "data": [model_card(name)
                                           for name in catalog.chat_model_names + catalog.embedding_model_names
                                           if principal.may_use(name)]}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> ModelCard:
        principal = call_of(request).start.principal
        if model_id in catalog.embedding_model_names:
            return model_card(services.resolve_model(model_id, principal, kind="embeddings"))
        return model_card(services.resolve_model(model_id, principal))

    @api.post("/tokenize", openapi_extra=schema_extra(TokenizeRequest))
    @api.post("/v1/tokenize", include_in_schema=False)  # under the SDKs' base URL: client.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        body = await parse_body(request, TokenizeRequest, services.body_parser)
        frontend = tokenizing_frontend(body.model, call_of(request).start.principal)
        tokens = await offload(request, services.body_parser.inline_bytes, tokenize_request, frontend, body,
                               services.tool_parser(frontend))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": frontend.max_model_len}

    @api.post("/detokenize", openapi_extra=schema_extra(DetokenizeRequest))
    async def detokenize(request: Request) -> DetokenizeResponse:
        body = await parse_body(request, DetokenizeRequest, services.body_parser)
        frontend = tokenizing_frontend(body.model, call_of(request).start.principal)
        vocab_size = frontend.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise InvalidRequestError(f"tokens: token ids must be in [0, {vocab_size})", param="tokens")
        return {"prompt": frontend.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return api


def tokenize_request(frontend: ModelFrontend, body: TokenizeRequest, tool_parser: str | None = None,
                     window_limit: bool = True) -> list[int]:
    """POST /tokenize (vLLM's): a prompt or chat messages -> token ids; a text certainly over
    the window is refused as a generation would be (and as vLLM does). Messages with the
    generation prompt are templated by the chat path itself (tools, response_format and all),
    so the count is the prompt_tokens a chat call with the same fields reports. window_limit
    False (a caller's own counting, tokenway.client.LocalCounter): any length is counted."""
    tokenizer = frontend.tokenizer
    if body.messages is not None and body.add_generation_prompt and body.add_special_tokens is not True:
        return templated_token_ids(frontend, [m.to_template_dict() for m in body.messages], *prompt_fields(body),
                                   tool_parser, window_limit)
    if body.messages is not None:
        messages = [m.to_template_dict() for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        add_special_tokens, param = body.add_special_tokens is True, "messages"
    else:
        text, add_special_tokens, param = body.prompt or "", body.add_special_tokens is not False, "prompt"
    with context_window(frontend, param) as window:
        token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens, max_num_tokens=window)
    if len(token_ids) > window:
        raise ContextLengthExceededError(len(token_ids), None, window, param=param)
    return token_ids
