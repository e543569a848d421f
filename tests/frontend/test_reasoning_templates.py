"""Thinking with real chat templates (Qwen3's and DeepSeek-R1's, tests/fixtures/chat_templates)
on the default model's tokenizer: the format a template is read in, its enable_thinking switch
set by a ThinkingRequest or chat_template_kwargs, the budget an effort becomes (the closing
sequence in the model's own tokens), thinking passed back rendered by the template, and a reply
detokenized as the engine does it, split with its thinking tokens counted exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from tokenway.frontend.chat import build_chat_prompt
from tokenway.frontend.output import RequestState
from tokenway.frontend.reasoning_parsers import ReasoningFormat
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.protocol.errors import FieldError
from tokenway.protocol.openai_requests import ChatCompletionRequest
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import ReasoningBudget, SamplingParams, ThinkingRequest, effort_thinking

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
QWEN3, R1 = "Qwen-Qwen3-0.6B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
HI = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def base(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def with_template(base: Tokenizer, name: str) -> Tokenizer:
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(base.hf.to_str()),
                          {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, source=name)
    tokenizer.use_chat_template((TEMPLATES / name).read_text(), name)
    return tokenizer


def text_of(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def test_qwen3s_template_thinks_and_its_switch_turns_it_off(base):
    tokenizer = with_template(base, QWEN3)
    on = build_chat_prompt(tokenizer, HI)
    assert on.reasoning == ReasoningFormat("qwen3", "<think>", "</think>", starts_open=False)  # Qwen3 opens it
    assert on.reasoning_budget is None and text_of(tokenizer, on.prompt_token_ids).endswith("<|im_start|>assistant\n")
    off = build_chat_prompt(tokenizer, HI, thinking=ThinkingRequest(enabled=False))
    assert off.reasoning is None and off.reasoning_budget is None  # the reply is content only
    assert text_of(tokenizer, off.prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # vLLM's chat_template_kwargs set the same switch, and win over the thinking asked.
    assert build_chat_prompt(tokenizer, HI, template_kwargs={"enable_thinking": False}).prompt_token_ids \
        == off.prompt_token_ids
    both = build_chat_prompt(tokenizer, HI, thinking=ThinkingRequest(enabled=False),
                             template_kwargs={"enable_thinking": True})
    assert both.prompt_token_ids == on.prompt_token_ids and both.reasoning_budget is not None \
        and both.reasoning_budget.max_tokens == 0  # the thinking asked off still ends at once


def test_an_effort_is_a_budget_closed_as_the_template_writes_it_in_the_models_tokens(base):
    tokenizer = with_template(base, QWEN3)
    prompt = build_chat_prompt(tokenizer, HI, thinking=effort_thinking("low"))
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert prompt.reasoning_budget == ReasoningBudget(1024, end_token_ids=encode("\n</think>\n\n"),
                                                      start_token_ids=encode("<think>"), starts_open=False)
    assert prompt.reasoning_budget is not None
    assert tokenizer.decode(prompt.reasoning_budget.end_token_ids) == "\n</think>\n\n"


def test_deepseek_r1s_generation_prompt_opens_the_thinking_and_has_no_switch(base):
    tokenizer = with_template(base, R1)
    prompt = build_chat_prompt(tokenizer, HI)
    assert text_of(tokenizer, prompt.prompt_token_ids).endswith("<｜Assistant｜><think>\n")
    assert prompt.reasoning == ReasoningFormat("qwen3", "<think>", "</think>", starts_open=True)
    # Thinking asked off: the template cannot, so the engine closes the part at once.
    off = build_chat_prompt(tokenizer, HI, thinking=effort_thinking("none"))
    assert off.prompt_token_ids == prompt.prompt_token_ids and off.reasoning == prompt.reasoning
    assert off.reasoning_budget is not None and (off.reasoning_budget.max_tokens, off.reasoning_budget.starts_open) \
        == (0, True)


def test_reasoning_parser_overrides_the_template(base):
    assert build_chat_prompt(base, HI).reasoning is None  # SmolLM2's own template does not think
    prompt = build_chat_prompt(base, HI, reasoning_parser="deepseek_r1")
    assert prompt.reasoning == ReasoningFormat("deepseek_r1", "<think>", "</think>", starts_open=True)
    with pytest.raises(ValueError, match="expected one of qwen3, deepseek_r1"):
        build_chat_prompt(base, HI, reasoning_parser="granite")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_thinking_passed_back_is_rendered_by_the_template(base, field):
    tokenizer = with_template(base, QWEN3)
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "tea"}'}}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Find tea."},
        {"role": "assistant", "content": None, "tool_calls": [call], field: "I should look it up."},
        {"role": "tool", "tool_call_id": "call_1", "content": "green"}]})
    text = text_of(tokenizer, build_chat_prompt(tokenizer, body.template_messages()).prompt_token_ids)
    assert "<|im_start|>assistant\n<think>\nI should look it up.\n</think>\n\n<tool_call>" in text


def test_chat_template_kwargs_may_not_set_what_the_server_does(base):
    with pytest.raises(FieldError, match="'messages' is set by the server") as caught:
        build_chat_prompt(with_template(base, QWEN3), HI, template_kwargs={"messages": []})
    assert caught.value.param == "chat_template_kwargs"


REPLY = "<think>\nThe user greets me; I greet back.\n</think>\n\nHello there! 😀 Nice to meet you."


@pytest.mark.parametrize("tokens_a_step", [1, 2, 3, 7])
def test_a_detokenized_reply_is_split_and_its_thinking_counted_by_token(base, tokens_a_step):
    token_ids = base.encode(REPLY, add_special_tokens=False)
    # Each token's place in the text, from the text of the tokens before it.
    ends = [len(base.decode(token_ids[:i + 1], skip_special_tokens=False)) for i in range(len(token_ids))]
    starts = [0, *ends[:-1]]
    first, last = REPLY.index("The user"), REPLY.index("back.") + len("back.")
    expected = sum(1 for start, end in zip(starts, ends) if start < last and end > first)
    # The engine's detokenizer, several tokens a step (speculative decoding), as Generation feeds the parser.
    state = RequestState("r", None, [1], SamplingParams(), base)
    parser = ReasoningFormat("qwen3", "<think>", "</think>").parser(base.token_text)
    reasoning, content = "", ""
    for position in range(0, len(token_ids), tokens_a_step):
        step = token_ids[position:position + tokens_a_step]
        out = state.process(EngineOutput("r", step)).outputs[0]
        delta = parser.feed(out.delta_text, out.delta_token_ids)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    rest = parser.finish()
    assert (reasoning + rest.reasoning, content + rest.content) == (
        "The user greets me; I greet back.", "Hello there! 😀 Nice to meet you.")
    assert parser.num_reasoning_tokens == expected > 0
