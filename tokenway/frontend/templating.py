"""A call's prompt as token ids, the same for the server's routes and the client toolkit's local
counter: the window check around tokenizing (context_window), a chat call's templated prompt
and what it constrains the reply to (template_chat, structured_output_spec), a completion's
prompt ids (completion_token_ids), a request's prompt-shaping fields (prompt_fields) and the
templated ids (templated_token_ids)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import pydantic

from tokenway.frontend.chat import ChatPrompt, build_chat_prompt
from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.tokenizer import PromptTooLong
from tokenway.protocol.errors import ContextLengthExceededError
from tokenway.protocol.openai_requests import ChatCompletionRequest, TokenizeRequest
from tokenway.protocol.sampling import StructuredOutputSpec, ThinkingRequest


@contextmanager
def context_window(frontend: ModelFrontend, param: str) -> Iterator[int]:
    """Tokenize inside this: yields the window to pass as max_num_tokens, and turns a prompt
    known to exceed it (without tokenizing it all) into the context-length 400."""
    try:
        yield frontend.max_model_len
    except PromptTooLong as exc:
        raise ContextLengthExceededError(exc.num_tokens_at_least, None, frontend.max_model_len, param=param,
                                         at_least=True) from None


def template_chat(frontend: ModelFrontend, messages: list[dict], tools: list[dict] | None, tool_choice: Any,
                  parallel_tool_calls: bool | None, response_format: dict | None, tool_parser: str | None,
                  continue_final_message: bool = False, *, reasoning_parser: str | None = None,
                  thinking: ThinkingRequest | None = None, template_kwargs: Mapping[str, Any] | None = None
                  ) -> ChatPrompt:
    """A chat call's prompt for its model, the same for every chat API; a prompt known to
    exceed the window is the context-length 400 before it is all tokenized."""
    with context_window(frontend, "messages") as window:
        return build_chat_prompt(frontend.tokenizer, messages, tools, tool_choice, parallel_tool_calls,
                                 response_format, max_num_tokens=window, tool_parser=tool_parser,
                                 continue_final_message=continue_final_message, reasoning_parser=reasoning_parser,
                                 thinking=thinking, template_kwargs=template_kwargs)


def structured_output_spec(prompt: ChatPrompt) -> StructuredOutputSpec | None:
    """What the templated prompt constrains the reply to: a tool-call grammar, a JSON schema
    (tools or response_format), any JSON object; None: free text."""
    if prompt.grammar is not None:
        return StructuredOutputSpec(kind="grammar", grammar=prompt.grammar)
    if prompt.json_schema is not None:
        return StructuredOutputSpec.json_schema(prompt.json_schema)  # keeps the user's property order
    if prompt.json_object:
        return StructuredOutputSpec(kind="json_object")
    return None


def completion_token_ids(frontend: ModelFrontend, prompt: str | list[str] | list[int] | list[list[int]]
                         ) -> list[list[int]]:
    """A completion's prompt (str | list[str] | list[int] | list[list[int]]) as token id lists."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [list(cast("list[int]", prompt))]
    with context_window(frontend, "prompt") as window:
        if isinstance(prompt, str):
            return [frontend.tokenizer.encode(prompt, max_num_tokens=window)]
        return [frontend.tokenizer.encode(item, max_num_tokens=window) if isinstance(item, str) else list(item)
                for item in cast("list[str] | list[list[int]]", prompt)]


def prompt_fields(body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[dict] | None, Any, bool | None,
                                                                          dict | None]:
    """A tokenize body's prompt-shaping fields as build_chat_prompt takes them: (tools,
    tool_choice, parallel_tool_calls, response_format)."""
    tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(tool_choice, pydantic.BaseModel):
        tool_choice = tool_choice.model_dump(exclude_none=True)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    response_format = body.response_format.model_dump(exclude_none=True, by_alias=True) \
        if body.response_format else None
    return tools, tool_choice, body.parallel_tool_calls, response_format


def templated_token_ids(frontend: ModelFrontend, messages: list[dict], tools: list[dict] | None, tool_choice: Any,
                        parallel_tool_calls: bool | None, response_format: dict | None, tool_parser: str | None,
                        window_limit: bool = True, *, thinking: ThinkingRequest | None = None,
                        template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Template messages (to_template_dict's) and prompt fields -> the chat call's prompt ids,
    as the chat path templates them (thinking: the template's switch, as the call sets it);
    over the window a 400 unless window_limit is False."""
    with context_window(frontend, "messages") as window:
        token_ids = build_chat_prompt(frontend.tokenizer, messages, tools, tool_choice, parallel_tool_calls,
                                      response_format, max_num_tokens=window if window_limit else None,
                                      tool_parser=tool_parser, thinking=thinking,
                                      template_kwargs=template_kwargs).prompt_token_ids
    if len(token_ids) > window and window_limit:
        raise ContextLengthExceededError(len(token_ids), None, window, param="messages")
    return token_ids
