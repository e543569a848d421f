"""A reasoning budget (SamplingParams.reasoning_budget): the state's rules on plain token ids, the
sampler's forced rows (with drafts, logprobs, bans), and on the real default model: the free
tokens, then the end ids exactly, then the reply; nothing forced where the part never opens or
closes itself; budget 0; n = 2; speculative decoding; preemption; a JSON schema after the
thinking; logprobs of forced tokens; the request's max_tokens inside the forced sequence."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tokenway import LLM, SamplingParams
from tokenway.engine.request import Request
from tokenway.engine.sampler import Sampler
from tokenway.engine.sampling_metadata import SamplingMetadata
from tokenway.engine.thinking import ThinkingState
from tokenway.protocol.errors import FieldError
from tokenway.protocol.sampling import ReasoningBudget, StructuredOutputSpec

# --- the state, on token ids ---------------------------------------------------------------


def advance(state: ThinkingState, output: list[int], *token_ids: int) -> list[bool]:
    closed = []
    for token_id in token_ids:
        output.append(token_id)
        closed.append(state.advance(output))
    return closed


def test_an_open_part_counts_to_its_budget_then_forces_the_end_ids_and_closes_for_good():
    state = ThinkingState.start(ReasoningBudget(3, end_token_ids=(7, 6), starts_open=True))
    output: list[int] = []
    assert advance(state, output, 1, 2) == [False, False] and state.forced_token_id is None
    assert advance(state, output, 3) == [False] and state.forced_token_id == 7  # 3 spent
    assert advance(state, output, 7) == [False] and state.forced_token_id == 6
    assert advance(state, output, 6) == [True] and state.is_closed and state.forced_token_id is None
    assert advance(state, output, 7, 6, 7) == [False] * 3 and state.forced_token_id is None
    assert state.num_thinking_tokens == 5


def test_the_part_opens_on_its_start_ids_and_a_model_that_closes_it_is_never_forced():
    state = ThinkingState.start(ReasoningBudget(4, end_token_ids=(9,), start_token_ids=(4, 5)))
    output: list[int] = []
    advance(state, output, 5, 4, 1)  # no start sequence yet: nothing counts
    assert not state.is_open and state.num_thinking_tokens == 0
    advance(state, output, 4, 5)
    assert state.is_open and state.num_thinking_tokens == 0
    assert advance(state, output, 1, 9) == [False, True]  # closed by the model within its budget
    advance(state, output, 4, 5, 1, 1, 1, 1, 1)  # a start sequence after the close opens nothing
    assert state.is_closed and state.forced_token_id is None and state.num_thinking_tokens == 2


def test_a_spent_budget_forces_only_the_rest_of_an_end_sequence_the_output_began():
    state = ThinkingState.start(ReasoningBudget(2, end_token_ids=(7, 6, 5), starts_open=True))
    output: list[int] = []
    advance(state, output, 1, 7)
    assert state.forced_token_id == 6  # "</think>" written already: "\n\n" and no second "</think>"
    assert advance(state, output, 6, 5) == [False, True]


def test_budget_zero_forces_from_the_first_token_or_from_the_opening():
    assert ThinkingState.start(ReasoningBudget(0, end_token_ids=(7,), starts_open=True)).forced_token_id == 7
    state = ThinkingState.start(ReasoningBudget(0, end_token_ids=(7,), start_token_ids=(4,)))
    output: list[int] = []
    assert state.forced_token_id is None
    advance(state, output, 4)
    assert state.forced_token_id == 7


def test_forced_tokens_per_verify_row_follow_the_drafts():
    state = ThinkingState.start(ReasoningBudget(2, end_token_ids=(7, 6), starts_open=True))
    output: list[int] = []
    advance(state, output, 1)
    # Row j is the request after drafts[:j]: row 1 has spent the budget, row 2 wrote 7, row 3 closed.
    assert state.forced_token_ids(output, (3, 7, 6)) == [None, 7, 6, None]
    # A draft that is not the forced token is rejected there: the rows after it are dropped.
    assert state.forced_token_ids(output, (3, 5, 6)) == [None, 7, None, None]
    assert state.forced_token_ids(output, ()) is None and state.forced_token_ids(output, (3,)) == [None, 7]
    assert state.num_thinking_tokens == 1  # the lookahead leaves the state alone


# --- the sampler's forced rows --------------------------------------------------------------


def forcing_request(request_id: str = "r", **params) -> Request:
    """A request whose next token is forced: an open part with budget 0 and end ids (3, 6)."""
    budget = ReasoningBudget(0, end_token_ids=(3, 6), starts_open=True)
    return Request(request_id, [0, 1], SamplingParams(reasoning_budget=budget, **params))


def test_a_forced_row_emits_its_token_with_the_models_logprob_whatever_bans_it():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[:, 3] = logits.min() - 1.0  # token 3 is the least likely of every row
    requests = [forcing_request("greedy", temperature=0.0), forcing_request("random", seed=5, logprobs=2),
                forcing_request("banned", temperature=0.0, min_tokens=4, stop_token_ids=[3], logit_bias={3: -100.0})]
    fast = Sampler()(logits[:1], SamplingMetadata.from_requests(requests[:1], 50))  # the argmax-only path
    assert fast.sampled_token_ids == [3]
    out = Sampler()(logits, SamplingMetadata.from_requests(requests, 50))
    assert out.sampled_token_ids == [3, 3, 3]
    raw = logits[1].log_softmax(dim=-1)
    forced = out.logprobs[1]
    assert forced is not None and forced.token_id == 3 and forced.rank == 50
    assert forced.logprob == pytest.approx(raw[3].item())
    assert [t for t, _ in forced.top] == raw.topk(2).indices.tolist()


def test_a_verify_step_keeps_a_draft_only_where_it_is_the_forced_token():
    budget = ReasoningBudget(2, end_token_ids=(7, 6), starts_open=True)
    logits = torch.zeros(4, 10)
    logits[:, 3] = 5.0  # every row's argmax is 3
    for drafts, accepted, tokens in [((3, 7, 6), 3, [3, 7, 6, 3]), ((3, 5, 6), 1, [3, 7])]:
        request = Request("r", [0, 1], SamplingParams(temperature=0.0, reasoning_budget=budget))
        request.append_output_token_ids(1)
        assert request.thinking is not None
        request.thinking.advance(request.output_token_ids)
        out = Sampler()(logits, SamplingMetadata.from_requests([request], 10, [drafts]))
        assert out.num_accepted_tokens == [accepted]
        assert out.sampled_token_ids[: accepted + 1] == tokens


# --- the real model -------------------------------------------------------------------------


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    return [o.outputs for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def greedy(llm: LLM, prompt: list[int], max_tokens: int, **options) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)
    return run(llm, [prompt], params)[0][0].token_ids


def opened(max_tokens: int, end_ids, **options) -> ReasoningBudget:
    return ReasoningBudget(max_tokens, end_token_ids=end_ids, starts_open=True, **options)


@pytest.fixture(scope="module")
def end_ids(llm) -> tuple[int, ...]:
    ids = tuple(llm.tokenizer.encode("</think>\n\n", add_special_tokens=False))
    assert len(ids) >= 2  # the tests below cut inside it
    return ids


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    return chat_ids(llm, "Why is the sky blue?")


@pytest.fixture(scope="module")
def free(llm, prompt) -> list[int]:
    """The greedy reply without a budget."""
    return greedy(llm, prompt, 30)


def test_the_first_n_tokens_are_free_then_the_end_ids_then_the_reply_goes_on(llm, prompt, free, end_ids):
    n, num_end = 8, len(end_ids)
    assert free[n - 1] != end_ids[0]  # else only the rest of the end ids would be written
    output = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               reasoning_budget=opened(n, end_ids)))[0][0]
    assert output.token_ids[:n] == free[:n]
    assert tuple(output.token_ids[n : n + num_end]) == end_ids
    rest = output.token_ids[n + num_end :]
    assert len(rest) == 30 - n - num_end and output.finish_reason == "length"
    # The model read the forced tokens: it goes on as it would after a prompt that ends in them.
    assert rest == greedy(llm, prompt + output.token_ids[: n + num_end], len(rest))


def test_nothing_is_forced_where_the_part_never_opens_or_the_model_closes_it(llm, prompt, free, end_ids):
    start_ids = tuple(llm.tokenizer.encode("<think>", add_special_tokens=False))
    never_opened = ReasoningBudget(2, end_token_ids=end_ids, start_token_ids=start_ids)
    assert greedy(llm, prompt, 30, reasoning_budget=never_opened) == free
    # A token the reply writes at index 3 as the end sequence: the model closes the part itself.
    assert free[3] not in free[:3] and free[10] != free[3]
    assert greedy(llm, prompt, 30, reasoning_budget=opened(10, (free[3],))) == free
    # The control: with a budget spent before index 3, the same end id is forced at index 2.
    assert greedy(llm, prompt, 30, reasoning_budget=opened(2, (free[3],)))[:3] == [*free[:2], free[3]]


def test_the_part_opens_on_start_ids_the_model_writes_and_budget_zero_forces_at_once(llm, prompt, free, end_ids):
    num_end = len(end_ids)
    output = greedy(llm, prompt, 20, reasoning_budget=opened(0, end_ids))
    assert tuple(output[:num_end]) == end_ids
    assert output[num_end:] == greedy(llm, prompt + list(end_ids), 20 - num_end)
    # Free index 2 as the start sequence: the part opens after it and its next tokens are the end ids.
    assert free[2] not in free[:2] and free[6] != end_ids[0]
    for budget, num_free in ((0, 3), (4, 7)):
        reasoning = ReasoningBudget(budget, end_token_ids=end_ids, start_token_ids=(free[2],))
        output = greedy(llm, prompt, 20, reasoning_budget=reasoning)
        assert output[:num_free] == free[:num_free] and tuple(output[num_free : num_free + num_end]) == end_ids


def test_max_tokens_can_end_the_reply_inside_the_forced_sequence(llm, prompt, free, end_ids):
    output = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=4, reasoning_budget=opened(3, end_ids)))[0][0]
    assert output.token_ids == [*free[:3], end_ids[0]] and output.finish_reason == "length"


def test_each_of_n_choices_counts_its_own_thinking(llm, prompt, end_ids):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True,
                            reasoning_budget=opened(5, end_ids))
    choices = run(llm, [prompt], params)[0]
    assert len(choices) == 2 and choices[0].token_ids[:5] != choices[1].token_ids[:5]
    for choice in choices:
        assert tuple(choice.token_ids[5 : 5 + len(end_ids)]) == end_ids and len(choice.token_ids) == 16


def test_forced_tokens_carry_the_logprobs_the_model_gave_them(llm, prompt, free, end_ids):
    n = 4
    output = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=n + 2, ignore_eos=True, logprobs=2,
                                               reasoning_budget=opened(n, end_ids)))[0][0]
    unforced = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2))[0][0]
    assert output.logprobs is not None and unforced.logprobs is not None
    for ours, theirs in zip(output.logprobs[:n], unforced.logprobs):
        assert (ours.token_id, ours.rank, [t for t, _ in ours.top]) == (theirs.token_id, 1, [t for t, _ in theirs.top])
    # The model's own view of the first forced token: a logit_bias writes it, logprobs stay raw.
    reference = run(llm, [prompt + free[:n]], SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                             logit_bias={end_ids[0]: 100.0}))[0][0].logprobs
    forced = output.logprobs[n]
    assert reference is not None and forced.token_id == reference[0].token_id == end_ids[0]
    assert forced.rank == reference[0].rank > 1
    assert forced.logprob == pytest.approx(reference[0].logprob, abs=1e-3)
    assert [t for t, _ in forced.top] == [t for t, _ in reference[0].top]


def test_a_json_schema_constrains_only_the_reply_after_the_thinking(llm, end_ids):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"], "additionalProperties": False}
    spec = StructuredOutputSpec.json_schema(schema)
    prompt = chat_ids(llm, "What is the capital of France?")
    free = greedy(llm, prompt, 6)
    assert not llm.tokenizer.decode(free).lstrip().startswith("{")  # unconstrained, the model writes prose
    n, num_end = 6, len(end_ids)
    output = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=80, structured_output=spec,
                                               reasoning_budget=opened(n, end_ids)))[0][0]
    assert output.token_ids[:n] == free and tuple(output.token_ids[n : n + num_end]) == end_ids
    assert output.finish_reason == "stop"  # the grammar completed
    jsonschema.validate(json.loads(llm.tokenizer.decode(output.token_ids[n + num_end :])), schema)


def test_speculative_decoding_forces_the_same_tokens_as_plain_decoding(llm, default_model_dir, end_ids):
    prompts = [chat_ids(llm, ask) for ask in ("Count from one to thirty in words, separated by commas.",
                                              "Write the alphabet twice, letters separated by spaces.")]
    spec_llm = LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory="64MiB",
                   max_model_len=1024, speculative_method="ngram", num_speculative_tokens=4, show_progress=False)
    for budget in (5, 13):  # the end ids forced inside the thinking's drafted runs
        params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, reasoning_budget=opened(budget, end_ids))
        want = [choices[0].token_ids for choices in run(llm, prompts, params)]
        for output in want:
            assert tuple(output[budget : budget + len(end_ids)]) == end_ids
        assert [choices[0].token_ids for choices in run(spec_llm, prompts, params)] == want, budget
    assert spec_llm.engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0


def test_preemption_keeps_each_requests_thinking(llm, default_model_dir, end_ids):
    prompts = [chat_ids(llm, q) for q in ("What is the capital of France?", "Write a haiku about the sea.",
                                          "List three prime numbers.", "Why is the sky blue?")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, reasoning_budget=opened(8, end_ids))
    want = [choices[0].token_ids for choices in run(llm, prompts, params)]
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # layers x block x kv heads x head dim x fp32, K and V
    tiny = LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory=10 * block_bytes,
               max_model_len=160, show_progress=False)  # ~4 blocks a request at the end: 2 fit at once
    assert [choices[0].token_ids for choices in run(tiny, prompts, params)] == want
    assert tiny.engine.scheduler.num_preemptions > 0
    for output in want:
        assert tuple(output[8 : 8 + len(end_ids)]) == end_ids


def test_an_end_id_outside_the_vocabulary_is_refused_by_name(llm, prompt, free):
    vocab_size = llm.engine.model_config.vocab_size
    with pytest.raises(FieldError, match=f"token id {vocab_size}") as refused:
        greedy(llm, prompt, 4, reasoning_budget=opened(1, (5, vocab_size)))
    assert refused.value.param == "reasoning_budget"
    assert greedy(llm, prompt, 4) == free[:4]  # and the engine goes on serving
