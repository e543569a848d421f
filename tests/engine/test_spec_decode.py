"""N-gram speculative decoding: the proposer, the scheduler's verify steps and their KV blocks,
rejection sampling's distribution, and on the real default model: greedy output identical to
plain decoding (batched, chunked, prefix-cache hits, preemption), stops inside an accepted
run, max_tokens exactly, and the counters."""

from __future__ import annotations

import math

import pytest
import torch

from tokenway import LLM, SamplingParams
from tokenway.config import EngineConfig
from tokenway.engine.request import Request
from tokenway.engine.sampler import Sampler
from tokenway.engine.sampling_metadata import SamplingMetadata
from tokenway.engine.scheduler import Scheduler
from tokenway.engine.spec_decode import NgramProposer, SpecDecodingStats
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.observability.metrics import EngineCollector

# --- the proposer --------------------------------------------------------------------------


def test_proposer_takes_the_longest_ngram_then_the_earliest_occurrence():
    # vLLM's example: [4, 2, 3] has no earlier match, [2, 3] does; only 3 tokens follow it.
    assert NgramProposer(4, prompt_lookup_max=3, prompt_lookup_min=2).propose([1, 2, 3, 4, 2, 3]) == (4, 2, 3)
    context = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    # [1, 2, 3] occurs at 0 (then 4); [2, 3] alone also at 5 (then 5): the longer n-gram wins.
    assert NgramProposer(2, prompt_lookup_max=3).propose(context) == (4, 9)
    # Capped at bigrams, [2, 3] occurs at 1 and 5: the earliest wins.
    assert NgramProposer(2, prompt_lookup_max=2).propose(context) == (4, 9)
    assert NgramProposer(2, prompt_lookup_max=2).propose([7, 2, 3, 8, 2, 3, 6, 2, 3]) == (8, 2)


def test_proposer_needs_prompt_lookup_min_tokens_and_caps_the_drafts():
    proposer = NgramProposer(4, prompt_lookup_max=4, prompt_lookup_min=2)
    assert proposer.propose([1, 2, 3, 1]) == ()  # only a unigram recurs
    assert proposer.propose([5, 5]) == ()
    assert proposer.propose([1, 2]) == ()
    assert proposer.propose([5, 5, 5, 5]) == (5,)  # overlapping occurrences count
    assert proposer.propose(list(range(10)) * 3, max_num_tokens=2) == (0, 1)
    assert proposer.propose(list(range(10)) * 3, max_num_tokens=0) == ()
    assert NgramProposer(3, prompt_lookup_min=1).propose([1, 2, 3, 1]) == (2, 3, 1)


def test_proposer_and_config_refuse_bad_settings_by_name():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(4, prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    for options, field in [({"speculative_method": "eagle", "num_speculative_tokens": 4}, "speculative_method"),
                           ({"speculative_method": "ngram"}, "num_speculative_tokens"),
                           ({"num_speculative_tokens": 4}, "num_speculative_tokens"),
                           ({"speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
                            "prompt_lookup_min"),
                           ({"speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1,
                             "prompt_lookup_min": 2}, "prompt_lookup_max")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**options)
    EngineConfig(speculative_method="ngram", num_speculative_tokens=4)


def test_stats_rates():
    stats = SpecDecodingStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_accepted_length == 0.0
    stats.observe(4, 3)
    stats.observe(4, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 8, 3)
    assert stats.acceptance_rate == 3 / 8 and stats.mean_accepted_length == 2.5


# --- scheduling and the KV cache -----------------------------------------------------------


def test_a_verify_step_takes_its_drafts_slots_and_never_caches_a_rejected_draft():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(kv, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4,
                          proposer=NgramProposer(3, prompt_lookup_max=4))
    request = Request("r", [1, 2, 3, 4, 1, 2, 3], SamplingParams(temperature=0, max_tokens=20))
    scheduler.add_request(request)
    out = scheduler.schedule()  # the prompt
    assert out.num_scheduled_tokens == [7] and out.spec_token_ids == [()]
    scheduler.update_from_output(out, [4], [None])

    out = scheduler.schedule()  # [1, 2, 3, 4] recurs: drafts [1, 2, 3] after the new 4
    assert out.spec_token_ids == [(1, 2, 3)] and out.num_scheduled_tokens == [4]
    assert out.sampling_requests == [request] and out.sampling_spec_token_ids == [(1, 2, 3)]
    assert kv.get_block_ids("r") == [0, 1, 2]  # positions 7..10: slots for the drafts too
    # Blocks 0 and 1 hold known tokens only and are cached; block 2 would hold drafts: it is not.
    assert [kv.block_pool.block_hash(b) is not None for b in (0, 1, 2)] == [True, True, False]

    # The model accepts 1 and 2, then says 9 instead of 3.
    (output,) = scheduler.update_from_output(out, [1, 2, 9, 6], [None] * 4, num_accepted_tokens=[2])
    assert output.new_token_ids == [1, 2, 9]
    assert request.all_token_ids == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 9]
    assert request.num_computed_tokens == 10  # the 9 has no KV yet; the rejected 3's slot is rewritten
    assert (scheduler.spec_decoding_stats.num_drafts, scheduler.spec_decoding_stats.num_draft_tokens,
            scheduler.spec_decoding_stats.num_accepted_tokens) == (1, 3, 2)

    out = scheduler.schedule()  # no n-gram ends in [2, 9]
    assert out.spec_token_ids == [()] and out.num_scheduled_tokens == [1]
    scheduler.update_from_output(out, [5], [None])
    scheduler.schedule()
    # Block 2 is cached now that it is full of the tokens the model kept.
    assert kv.block_pool.get_cached_block(request.block_hashes[2]) == 2
    drafted = Request("d", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 6, 0], SamplingParams())
    assert kv.get_computed_blocks(drafted) == ([0, 1], 8)  # the drafts' block is no hit


def test_drafts_fit_the_budget_max_tokens_and_the_window_and_go_first_when_blocks_run_out():
    def decode_request(max_tokens=None, max_model_len=64, budget=64, num_blocks=16):
        kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
        scheduler = Scheduler(kv, max_model_len, budget, max_num_seqs=4, proposer=NgramProposer(5))
        request = Request("r", list(range(8)) * 2 + [0, 1], SamplingParams(temperature=0, max_tokens=max_tokens))
        scheduler.add_request(request)
        scheduler.update_from_output(scheduler.schedule(), [2], [None])
        return scheduler, request

    assert decode_request()[0].schedule().spec_token_ids == [(3, 4, 5, 6, 7)]
    assert decode_request(max_tokens=4)[0].schedule().spec_token_ids == [(3, 4)]  # 1 out, then 1 + 2 drafts
    assert decode_request(max_tokens=2)[0].schedule().spec_token_ids == [()]
    assert decode_request(max_model_len=22)[0].schedule().spec_token_ids == [(3, 4)]  # 19 tokens: 2 more + 1
    scheduler, _ = decode_request(budget=64)
    scheduler.max_num_batched_tokens = 3
    assert scheduler.schedule().spec_token_ids == [(3, 4)]
    # 5 blocks hold the 19 tokens; the drafts would need a sixth: they are dropped, nobody is preempted.
    scheduler, request = decode_request(num_blocks=5)
    out = scheduler.schedule()
    assert out.spec_token_ids == [()] and out.num_scheduled_tokens == [1] and not out.preempted_request_ids


# --- the sampler ---------------------------------------------------------------------------

VOCAB = 8


def make_request(request_id="r", output_token_ids=(), **params) -> Request:
    request = Request(request_id, [0, 1], SamplingParams(**params))
    request.append_output_token_ids(list(output_token_ids))
    return request


def verify(logits, requests, spec_token_ids):
    logits = torch.as_tensor(logits, dtype=torch.float32)
    return Sampler()(logits, SamplingMetadata.from_requests(requests, VOCAB, spec_token_ids))


LOGITS = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0]  # argmax 5, then 0


def test_greedy_accepts_drafts_while_they_are_the_argmax_under_penalties_and_min_tokens():
    rows = [LOGITS] * 3
    out = verify(rows, [make_request(temperature=0)], [(5, 5)])
    assert out.sampled_token_ids == [5, 5, 5] and out.num_accepted_tokens == [2]
    # With a frequency penalty the second row has seen the first draft: 5 falls below 0.
    out = verify(rows, [make_request(temperature=0, frequency_penalty=2.0)], [(5, 5)])
    assert out.sampled_token_ids[:2] == [5, 0] and out.num_accepted_tokens == [1]
    # min_tokens bans EOS (5) while fewer than 2 tokens exist: only from the third row on.
    eos = Request("e", [0, 1], SamplingParams(temperature=0, min_tokens=2), eos_token_id=5)
    out = verify(rows, [eos], [(0, 0)])
    assert out.sampled_token_ids == [0, 0, 5] and out.num_accepted_tokens == [2]
    # Requests with and without drafts in one batch; logprobs come per row.
    out = verify([LOGITS] * 4, [make_request("a", temperature=0, logprobs=1), make_request("b", temperature=0)],
                 [(5, 3), ()])
    assert out.num_accepted_tokens == [1, 0] and out.sampled_token_ids == [5, 5, 5, 5]
    assert [lp.token_id for lp in out.logprobs[:3]] == [5, 5, 5] and out.logprobs[3] is None


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test at p = 0.001 (Wilson-Hilferty's quantile); a token of probability 0 must never appear."""
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * counts.sum()
    statistic = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    df = int((probs > 0).sum()) - 1
    z = 3.09
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic < critical


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution each row should be drawn from, the straightforward way: the top_k most
    likely tokens, renormalised, then the fewest of those whose mass reaches top_p."""
    probs = (logits / temperature).softmax(-1)
    for row in range(len(probs)):
        order = probs[row].argsort(descending=True).tolist()
        probs[row, order[top_k:]] = 0.0
        probs[row] /= probs[row].sum()
        mass = 0.0
        for rank, token in enumerate(order):
            if mass >= top_p:
                probs[row, order[rank:]] = 0.0
                break
            mass += float(probs[row, token])
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 6, 0.9)])
def test_rejection_sampling_draws_each_position_from_the_target_distribution(temperature, top_k, top_p):
    num_requests = 6000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.8, -1.0, 0.3, 0.1],
                           [0.2, 1.2, -0.3, 0.9, -1.0, 0.0, 0.4, -0.2],
                           [-0.5, 0.0, 1.0, 0.3, 0.6, -0.1, 0.2, 0.9]])  # (k + 1, vocab) for every request
    drafts = (4, 3)  # likely under both rows, never certain
    requests = [make_request(str(i), temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
                for i in range(num_requests)]
    out = verify(logits.repeat(num_requests, 1), requests, [drafts] * num_requests)
    tokens = torch.tensor(out.sampled_token_ids).view(num_requests, 3)
    accepted = torch.tensor(out.num_accepted_tokens)
    probs = target_probs(logits, temperature, top_k if top_k else VOCAB, top_p)
    # Position 0's token, whatever happened; position 1's given the first draft was kept; the
    # token after both drafts given both were.
    assert chi_square_ok(torch.bincount(tokens[:, 0], minlength=VOCAB).float(), probs[0])
    assert chi_square_ok(torch.bincount(tokens[accepted >= 1, 1], minlength=VOCAB).float(), probs[1])
    assert chi_square_ok(torch.bincount(tokens[accepted == 2, 2], minlength=VOCAB).float(), probs[2])
    # And the acceptance counts are what rejection sampling promises: p0(4) and p0(4) * p1(3).
    assert abs(float((accepted >= 1).float().mean()) - float(probs[0, 4])) < 0.03
    assert abs(float((accepted == 2).float().mean()) - float(probs[0, 4] * probs[1, 3])) < 0.03


def test_a_seeded_verify_repeats():
    def run():
        requests = [make_request(str(i), seed=i) for i in range(4)]
        return verify(torch.tensor([LOGITS] * 12), requests, [(5, 0)] * 4).sampled_token_ids

    assert run() == run()


# --- the engine on the default model -------------------------------------------------------

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
ASKS = [
    f"Rewrite this code with type hints:\n{CODE}",
    f"Repeat this code exactly, renaming width to w:\n{CODE}",
    "Repeat this list with the third item changed to pears: apples, bananas, cherries, dates, figs, grapes.",
    "Count from one to thirty in words, separated by commas.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a compiler does, then explain it again in other words.",
    "Write the alphabet twice, letters separated by spaces.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def chat_ids(llm: LLM, ask: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def spec_llm(default_model_dir):
    """The `llm` fixture's engine with ngram drafts, and a budget that chunks long prompts and
    cuts drafts when many requests decode at once."""
    return LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory="64MiB",
               max_model_len=1024, max_num_batched_tokens=96, speculative_method="ngram",
               num_speculative_tokens=4, show_progress=False)


@pytest.fixture(scope="module")
def prompts(llm):
    # The asks, plus story prefixes long enough to be prefilled in chunks and to hit the cache.
    story = llm.tokenizer.encode(("Once upon a time an old clockmaker named Elias wound the hundred clocks of his "
                                  "shop every morning, and listened to them tick in unison. ") * 6,
                                 add_special_tokens=False)
    return [chat_ids(llm, ask) for ask in ASKS] + [story[:n] for n in (130, 200)]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    return generate_ids(llm, prompts, GREEDY)


def test_greedy_is_plain_greedy_token_for_token_batched_chunked_and_from_the_prefix_cache(spec_llm, prompts,
                                                                                         expected):
    core = spec_llm.engine
    assert core.kv_manager.reset_prefix_cache()
    assert generate_ids(spec_llm, prompts, GREEDY) == expected
    # The counters reach the snapshot (/engine/stats) and /metrics.
    stats, spec = core.snapshot(), core.scheduler.spec_decoding_stats
    assert stats.spec_decode_num_drafts == spec.num_drafts > 0
    assert stats.spec_decode_num_draft_tokens == spec.num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_acceptance_rate == spec.acceptance_rate
    assert stats.spec_decode_mean_accepted_length == spec.mean_accepted_length > 1.0
    families = {family.name: family for family in EngineCollector(lambda: stats).collect()}
    assert families["tokenway_spec_decode_num_accepted_tokens"].samples[0].value == spec.num_accepted_tokens
    assert families["tokenway_spec_decode_acceptance_ratio"].samples[0].value == spec.acceptance_rate
    # Every prompt again, now mostly from the prefix cache (blocks cached from verified tokens only).
    assert generate_ids(spec_llm, prompts, GREEDY) == expected
    assert core.kv_manager.num_hit_tokens > 0
    # One at a time, too (no budget cuts: every draft is verified).
    for index in (0, 9):
        assert generate_ids(spec_llm, [prompts[index]], GREEDY) == [expected[index]]
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_greedy_under_preemption_is_plain_greedy(default_model_dir, llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    chats = prompts[2:6]  # short asks: ~4 blocks each at the end, so 2 fit at once
    want = generate_ids(llm, chats, params)
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # layers x block x kv heads x head dim x fp32, K and V
    tiny = LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory=10 * block_bytes,
               max_model_len=160, speculative_method="ngram", num_speculative_tokens=4, show_progress=False)
    assert generate_ids(tiny, chats, params) == want
    assert tiny.engine.scheduler.num_preemptions > 0
    assert tiny.engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    assert tiny.engine.kv_manager.num_free_blocks == tiny.engine.kv_manager.num_blocks


def multi_token_steps(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[int]]:
    """(the output, the indices of its tokens that a step emitted with more after them)."""
    core = llm.engine
    core.add_request("probe", prompt, params)
    output: list[int] = []
    inside: list[int] = []
    while core.has_unfinished_requests():
        for engine_output in core.step():
            new = engine_output.new_token_ids
            inside += range(len(output), len(output) + len(new) - 1)
            output += new
    return output, inside


def test_a_stop_token_or_string_inside_an_accepted_run_drops_the_tokens_after_it(spec_llm, llm, prompts):
    prompt = prompts[0]  # rewriting code: long accepted runs
    full, inside = multi_token_steps(spec_llm, prompt, GREEDY)
    # A token first seen inside a run, with text of its own.
    index = next(i for i in inside if full[i] not in full[:i] and spec_llm.tokenizer.decode([full[i]]).strip())
    token = full[index]
    by_id = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[token])
    got = spec_llm.generate([{"prompt_token_ids": prompt}], by_id)[0].outputs[0]
    assert got.token_ids == full[: index + 1] and (got.finish_reason, got.stop_reason) == ("stop", token)
    assert got.token_ids == generate_ids(llm, [prompt], by_id)[0]

    text = spec_llm.tokenizer.decode(full[: index + 1])
    stop = next(text[-n:] for n in range(2, len(text) + 1) if text.find(text[-n:]) == len(text) - n)
    by_string = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    got = spec_llm.generate([{"prompt_token_ids": prompt}], by_string)[0].outputs[0]
    plain = llm.generate([{"prompt_token_ids": prompt}], by_string)[0].outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.token_ids == plain.token_ids == full[: index + 1] and got.text == plain.text


def test_max_tokens_is_met_exactly(spec_llm, prompts, expected):
    cases = [(index, max_tokens) for index in (0, 1, 3) for max_tokens in (1, 2, 3, 6, 11)]
    got = spec_llm.generate([{"prompt_token_ids": prompts[index]} for index, _ in cases],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in cases])
    for output, (index, max_tokens) in zip(got, cases):
        assert output.outputs[0].token_ids == expected[index][:max_tokens]
        assert output.outputs[0].finish_reason == "length"


def test_logprobs_and_seeded_sampling(spec_llm, llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    got = spec_llm.generate([{"prompt_token_ids": prompts[1]}], params)[0].outputs[0]
    plain = llm.generate([{"prompt_token_ids": prompts[1]}], params)[0].outputs[0]
    assert got.token_ids == plain.token_ids and len(got.logprobs) == 16
    for mine, theirs, token_id in zip(got.logprobs, plain.logprobs, got.token_ids):
        assert mine.token_id == token_id and mine.rank == 1 and [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)

    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    first = generate_ids(spec_llm, [prompts[1]], seeded)
    assert generate_ids(spec_llm, [prompts[1]], seeded) == first and len(first[0]) == 16
    assert generate_ids(spec_llm, [prompts[1]], SamplingParams(**{**_fields(seeded), "seed": 8})) != first


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}
