"""Harmony prompts equal openai-harmony's (the official renderer, PyPI), byte for byte: a
conversation with system and developer messages, tools, a tool result and passed-back reasoning,
then conversations drawn at random (hypothesis) from those parts, the library given the same
messages as Harmony messages.

openai-harmony renders to o200k token ids; its vocabulary comes from tests/fixtures/o200k.py
(npm's js-tiktoken, hash-checked). Where neither npm nor a copy is at hand, these tests are
skipped, saying so.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.o200k import JS_TIKTOKEN, o200k_dir
from tokenway.frontend.harmony import HarmonySystem, render_prompt

harmony = pytest.importorskip("openai_harmony")

TODAY = "2026-12-02"


@pytest.fixture(scope="module")
def encoding(model_cache_dir):
    folder = o200k_dir(model_cache_dir)
    if folder is None:
        pytest.skip("openai-harmony needs the o200k_base vocabulary: no TIKTOKEN_ENCODINGS_BASE, and npm could not "
                    f"fetch {JS_TIKTOKEN} to build it from")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the current weather in the provided location.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["location"]}}}
LOCATION = {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}}
KITCHEN = {"type": "function", "function": {
    "name": "kitchensink", "description": "A function with various complex schemas.\nOver two lines.",
    "parameters": {"description": "params object", "type": "object", "properties": {
        "string": {"type": "string", "title": "STRING", "description": "A string", "examples": ["hello", "world"]},
        "string_nullable": {"type": "string", "nullable": True, "description": "A nullable string",
                            "default": "the default"},
        "string_enum": {"type": "string", "enum": ["a", "b", "c"]},
        "oneof_string_or_number": {"oneOf": [{"type": "string", "default": "default_string_in_oneof"},
                                             {"type": "number", "description": "numbers can happen too"}],
                                   "description": "a oneof", "default": 20},
        "count": {"type": "integer", "default": 3},
        "tags": {"type": "array", "items": {"type": "string"}},
        "pairs": {"type": "array"},
        "either": {"type": ["number", "string"]},
        "nested": {"type": "object", "description": "Inner", "properties": {"flag": {"type": "boolean"}},
                   "required": ["flag"]},
        "empty": {"type": "object", "properties": {}}}}}}
TOOLS = (WEATHER, LOCATION, KITCHEN)


def library_prompt(encoding, messages: list[dict], tools: list[dict], effort: str) -> str:
    """The same conversation as openai-harmony messages, rendered by the library."""
    H = harmony
    system = H.SystemContent.new().with_reasoning_effort(H.ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(TODAY)
    rendered = [H.Message.from_role_and_content(H.Role.SYSTEM, system)]
    num_leading = 0
    while num_leading < len(messages) and messages[num_leading]["role"] in ("system", "developer"):
        num_leading += 1
    instructions = [m["content"] for m in messages[:num_leading] if m["content"]]
    developer = H.DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions("\n\n".join(instructions))
    if tools:
        developer = developer.with_function_tools([
            H.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                  parameters=t["function"].get("parameters")) for t in tools])
    if instructions or tools:
        rendered.append(H.Message.from_role_and_content(H.Role.DEVELOPER, developer))
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    for message in messages[num_leading:]:
        role = message["role"]
        if role == "user":
            rendered.append(H.Message.from_role_and_content(H.Role.USER, message["content"]))
        elif role in ("system", "developer"):
            rendered.append(H.Message.from_role_and_content(H.Role.DEVELOPER, message["content"]))
        elif role == "tool":
            author = H.Author.new(H.Role.TOOL, f"functions.{names[message['tool_call_id']]}")
            rendered.append(H.Message.from_author_and_content(author, message["content"])
                            .with_channel("commentary").with_recipient("assistant"))
        else:
            assistant = lambda text: H.Message.from_role_and_content(H.Role.ASSISTANT, text)  # noqa: E731
            if message.get("reasoning_content"):
                rendered.append(assistant(message["reasoning_content"]).with_channel("analysis"))
            calls = message.get("tool_calls") or ()
            if message.get("content"):
                rendered.append(assistant(message["content"]).with_channel("commentary" if calls else "final"))
            for call in calls:
                rendered.append(assistant(call["function"]["arguments"]).with_channel("commentary")
                                .with_recipient(f"functions.{call['function']['name']}").with_content_type("json"))
    token_ids = encoding.render_conversation_for_completion(H.Conversation.from_messages(rendered), H.Role.ASSISTANT)
    return encoding.decode_utf8(token_ids)


def ours(messages: list[dict], tools: list[dict], effort: str) -> str:
    return render_prompt(messages, tools, HarmonySystem(effort, TODAY))


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


CONVERSATION = [
    {"role": "system", "content": "Always respond in riddles."},
    {"role": "developer", "content": "Keep it short."},
    {"role": "user", "content": "What is the weather like in SF?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the weather: call get_weather.",
     "tool_calls": [call("call_1", "get_weather", {"location": "San Francisco, CA"})]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20, "sunny": true}'},
]


def test_a_conversation_with_tools_a_result_and_reasoning(encoding):
    expected = library_prompt(encoding, CONVERSATION, list(TOOLS), "high")
    assert ours(CONVERSATION, list(TOOLS), "high") == expected
    # The parts the library is compared on, as gpt-oss reads them:
    assert "Reasoning: high" in expected and "Current date: 2026-12-02" in expected
    assert "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles.\n\nKeep it short.\n\n" \
           "# Tools\n\n## functions\n\nnamespace functions {\n\n" in expected
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>" \
           "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" \
           '{"location": "San Francisco, CA"}<|call|>' \
           '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>' \
           '{"temperature": 20, "sunny": true}<|end|><|start|>assistant' in expected


def test_the_reasoning_before_the_first_final_answer_is_dropped(encoding):
    finished = [*CONVERSATION, {"role": "assistant", "content": "Fog hides the sun.", "reasoning_content": "20C."}]
    messages = [*finished, {"role": "user", "content": "And tomorrow?"}]
    prompt = ours(messages, [WEATHER], "low")
    assert prompt == library_prompt(encoding, messages, [WEATHER], "low")
    assert "Need the weather" not in prompt and "20C." not in prompt
    # The library's rule, to the letter: only what precedes the first final answer goes.
    messages = [*finished, {"role": "user", "content": "And tomorrow?"},
                {"role": "assistant", "content": "Rain.", "reasoning_content": "Check the forecast."},
                {"role": "user", "content": "Thanks."}]
    prompt = ours(messages, [WEATHER], "low")
    assert prompt == library_prompt(encoding, messages, [WEATHER], "low")
    assert "20C." not in prompt and "<|channel|>analysis<|message|>Check the forecast.<|end|>" in prompt


# ---- conversations at random -----------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="<|>\r"), max_size=30)


@st.composite
def conversations(draw) -> tuple[list[dict], list[dict], str]:
    tools = draw(st.lists(st.sampled_from(TOOLS), unique_by=lambda t: t["function"]["name"], max_size=3))
    messages: list[dict] = [{"role": draw(st.sampled_from(("system", "developer"))), "content": draw(TEXT)}
                            for _ in range(draw(st.integers(0, 2)))]
    num_calls = 0
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(("user", "final", "call", "developer")))
        if kind == "user" or not messages:
            messages.append({"role": "user", "content": draw(TEXT)})
        elif kind == "developer":
            messages.append({"role": "developer", "content": draw(TEXT)})
        elif kind == "final":
            messages.append({"role": "assistant", "content": draw(TEXT.filter(bool)),
                             "reasoning_content": draw(TEXT)})
        else:
            num_calls += 1
            call_id = f"call_{num_calls}"
            name = draw(st.sampled_from([t["function"]["name"] for t in TOOLS]))
            messages.append({"role": "assistant", "content": draw(TEXT), "reasoning_content": draw(TEXT),
                             "tool_calls": [call(call_id, name, {"location": draw(TEXT)})]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": draw(TEXT)})
    return messages, tools, draw(st.sampled_from(("low", "medium", "high")))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations())
def test_random_conversations_render_as_the_library_renders_them(encoding, conversation):
    messages, tools, effort = conversation
    assert ours(messages, tools, effort) == library_prompt(encoding, messages, tools, effort)
