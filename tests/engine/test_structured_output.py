"""Structured output on the real model: every constrained generation parses and validates,
greedy or sampled, batched with free requests or preempted; bad specs are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tokenway import LLM, SamplingParams
from tokenway.engine.core import EngineCore
from tokenway.engine.request import Request
from tokenway.engine.sampler import Sampler
from tokenway.engine.sampling_metadata import SamplingMetadata
from tokenway.frontend.structured_output import GrammarBitmask, StructuredOutputManager, allowed_tokens
from tokenway.protocol.sampling import StructuredOutputSpec

# Every string and array is bounded, so any output the grammar allows ends within max_tokens.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
            },
            "required": ["city", "tags"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
PERSON = StructuredOutputSpec.json_schema(PERSON_SCHEMA)
PERSON_PROMPT = "Describe a fictional person as JSON with a name, age, role and address."
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Give me a name for a pet turtle.",
    "What does a compiler do?",
    "Translate 'good morning' into Spanish.",
    "Explain photosynthesis to a child in two sentences.",
]


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def assert_valid_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


# -- the spec --------------------------------------------------------------------------


def test_spec_keeps_the_schema_as_compact_json_in_key_order():
    spaced = StructuredOutputSpec("json_schema", schema=json.dumps(PERSON_SCHEMA, indent=2))
    assert spaced == PERSON and hash(spaced) == hash(PERSON)
    assert PERSON.schema == json.dumps(PERSON_SCHEMA, separators=(",", ":"))  # properties stay in order


@pytest.mark.parametrize(
    "make",
    [
        lambda: StructuredOutputSpec("yaml"),
        lambda: StructuredOutputSpec("json_schema"),
        lambda: StructuredOutputSpec("json_schema", schema="{not json"),
        lambda: StructuredOutputSpec("json_schema", schema="[1, 2]"),
        lambda: StructuredOutputSpec("regex"),
        lambda: StructuredOutputSpec("regex", pattern="a+", schema="{}"),
        lambda: StructuredOutputSpec("json_object", pattern="a+"),
    ],
)
def test_malformed_specs_name_response_format(make):
    with pytest.raises(ValueError, match="^response_format: "):
        make()


def test_sampling_params_refuse_a_spec_that_is_not_one():
    with pytest.raises(ValueError, match="^structured_output: "):
        SamplingParams(structured_output={"type": "json_object"})


# -- the manager and the sampler, without the model ---------------------------------------


def test_model_rows_past_the_tokenizer_vocabulary_are_never_allowed(llm):
    tokenizer = llm.tokenizer
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size + 64, llm.engine.eos_token_ids)
    bitmask = manager.grammar_bitmask([manager.new_matcher(StructuredOutputSpec.regex(r"(.|\n)*"))])
    allowed = allowed_tokens(bitmask.bitmask, tokenizer.vocab_size + 64)[0]
    assert allowed[: tokenizer.vocab_size].sum() > 40_000  # any text: nearly every token
    assert not allowed[tokenizer.vocab_size :].any()


def test_sampler_masks_only_the_grammar_rows():
    vocab_size = 40
    # The last token is every row's argmax.
    logits = torch.arange(3 * vocab_size, dtype=torch.float32).view(3, vocab_size)
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # row 0 may only emit token 3
    bitmask[1, 1] = (1 << 1) | (1 << 4)  # row 2 may emit 33 or 36
    grammar = GrammarBitmask(torch.tensor([0, 2]), bitmask)
    requests = [Request(str(i), [1], SamplingParams(temperature=0)) for i in range(3)]
    greedy = Sampler()(logits, SamplingMetadata.from_requests(requests, vocab_size), grammar)
    assert greedy.sampled_token_ids == [3, vocab_size - 1, 36]
    requests = [Request(str(i), [1], SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    for _ in range(5):
        sampled = Sampler()(logits, SamplingMetadata.from_requests(requests, vocab_size), grammar)
        assert sampled.sampled_token_ids[0] == 3 and sampled.sampled_token_ids[2] in (33, 36)


# -- generation on the real model ---------------------------------------------------------


def test_greedy_and_sampled_outputs_satisfy_the_schema(llm):
    prompt = chat_ids(llm, PERSON_PROMPT)
    params = [SamplingParams(temperature=0, max_tokens=600, structured_output=PERSON)]
    params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=600, structured_output=PERSON)
               for seed in range(6)]
    outputs = generate(llm, [prompt] * len(params), params)
    for output in outputs:
        assert output.finish_reason == "stop"
        assert_valid_person(output.text)
    assert len({o.text for o in outputs}) > 3  # sampling really varied the output


def test_json_object_gives_an_object(llm):
    # Free-form JSON is unbounded: like OpenAI's json_object mode, the prompt must ask for JSON.
    spec = StructuredOutputSpec.json_object()
    params = [SamplingParams(temperature=0, max_tokens=200, structured_output=spec),
              SamplingParams(temperature=1.0, seed=3, max_tokens=200, structured_output=spec)]
    for output in generate(llm, [chat_ids(llm, PERSON_PROMPT)] * 2, params):
        assert output.finish_reason == "stop"
        assert isinstance(json.loads(output.text), dict)


def test_regex_output_matches_in_full_and_ends_the_request_even_with_ignore_eos(llm):
    spec = StructuredOutputSpec.regex(r"[0-9]{3}-[0-9]{4}")
    params = [
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, structured_output=spec),
        SamplingParams(temperature=1.0, seed=7, max_tokens=50, structured_output=spec),
    ]
    outputs = generate(llm, [chat_ids(llm, "What is your phone number?")] * 2, params)
    for output in outputs:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", output.text)
        assert output.finish_reason == "stop"


def test_logprobs_come_from_the_unconstrained_distribution(llm):
    prompt = chat_ids(llm, "Write a haiku about the sea.")
    digits = SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                            structured_output=StructuredOutputSpec.regex("[0-9]+"))
    (free,) = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    (constrained,) = generate(llm, [prompt], digits)
    chosen = constrained.logprobs[0]
    assert llm.tokenizer.decode([chosen.token_id]).isdigit()
    assert chosen.rank > 1  # the model prefers words: the grammar made it pick a digit
    free_top = free.logprobs[0].top  # the second run hits the prefix cache: equal up to rounding
    assert [t for t, _ in chosen.top] == [t for t, _ in free_top]
    assert [lp for _, lp in chosen.top] == pytest.approx([lp for _, lp in free_top], abs=1e-4)


def test_a_constrained_neighbour_does_not_change_an_unconstrained_request(llm):
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free_sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=600, structured_output=PERSON)
    prompts = [chat_ids(llm, QUESTIONS[0]), chat_ids(llm, QUESTIONS[1])]
    alone = [o.token_ids for o in generate(llm, prompts, [free, free_sampled])]
    mixed = generate(llm, [prompts[0], chat_ids(llm, PERSON_PROMPT), prompts[1]], [free, constrained, free_sampled])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert_valid_person(mixed[1].text)


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputSpec.json_schema({"type": "foo"}), "type"),
        (StructuredOutputSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}), "gone"),
        (StructuredOutputSpec.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
        (StructuredOutputSpec.json_schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "nsatisfiable"),
        (StructuredOutputSpec.regex("(ab"), "regex"),
        (StructuredOutputSpec.regex("[a&&b]"), "no output can satisfy"),  # parses, but matches nothing
        (StructuredOutputSpec("grammar", grammar="start: missing_rule"), "missing_rule"),
    ],
)
def test_invalid_and_unsatisfiable_specs_are_refused_and_the_engine_keeps_serving(llm, spec, message):
    params = SamplingParams(temperature=0, max_tokens=8, structured_output=spec)
    prompt = chat_ids(llm, QUESTIONS[0])
    with pytest.raises(ValueError, match=f"^response_format: .*{re.escape(message)}"):
        llm.generate([{"prompt_token_ids": prompt}], params)
    with pytest.raises(ValueError, match="^response_format: "):
        llm.engine.add_request("bad-spec", prompt, params)
    assert not llm.engine.has_unfinished_requests()
    (output,) = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=4))
    assert len(output.token_ids) == 4


def test_aborted_and_finished_requests_release_their_grammar(llm):
    core: EngineCore = llm.engine
    params = SamplingParams(temperature=0, max_tokens=600, structured_output=PERSON)
    core.add_request("so-abort", chat_ids(llm, PERSON_PROMPT), params)
    two_digits = SamplingParams(temperature=0, max_tokens=50, structured_output=StructuredOutputSpec.regex("[0-9]{2}"))
    core.add_request("so-finish", chat_ids(llm, PERSON_PROMPT), two_digits)
    requests = [core.scheduler.requests["so-abort"], core.scheduler.requests["so-finish"]]
    assert all(r.grammar is not None for r in requests)
    finished = []
    while not finished:
        finished = [o for o in core.step() if o.finished]
    assert [o.request_id for o in finished] == ["so-finish"] and requests[1].grammar is None
    assert requests[0].grammar is not None
    core.abort_requests(["so-abort"])
    assert requests[0].grammar is None and not core.has_unfinished_requests()


def test_a_preempted_constrained_request_resumes_its_grammar(llm, default_model_dir):
    prompts = [chat_ids(llm, f"{q} Answer with a person as JSON.") for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=200, structured_output=PERSON)
    expected = [o.token_ids for o in generate(llm, prompts, params)]
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # layers x block x kv heads x head dim x fp32, K and V
    tiny = LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory=20 * block_bytes,
               max_model_len=256, show_progress=False)
    outputs = generate(tiny, prompts, params)
    assert tiny.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected
    for output in outputs:
        assert output.finish_reason == "stop"
        assert_valid_person(output.text)
