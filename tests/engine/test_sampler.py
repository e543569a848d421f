import math
from collections import Counter

import pytest
import torch

from tokenway.engine.request import Request
from tokenway.engine.sampler import Sampler, SamplerOutput, process_logits
from tokenway.engine.sampling_metadata import SamplingMetadata
from tokenway.protocol.sampling import SamplingParams

VOCAB = 8
# Distinct values so that every rank is unambiguous: argmax is token 5, then 0, 2, 4, 7, ...
LOGITS = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0]


def make_request(
    prompt_token_ids=(0, 1),
    output_token_ids=(),
    eos_token_id=None,
    request_id="r",
    **params,
) -> Request:
    request = Request(request_id, list(prompt_token_ids), SamplingParams(**params), eos_token_id=eos_token_id)
    request.append_output_token_ids(list(output_token_ids))
    return request


def sample(logits, requests) -> SamplerOutput:
    logits = torch.as_tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits.expand(len(requests), -1).contiguous()
    return Sampler()(logits, SamplingMetadata.from_requests(requests, logits.shape[1]))


def draw(logits, request, num_draws) -> Counter:
    """num_draws one-row steps of the same request (its generator advances every step)."""
    return Counter(sample(logits, [request]).sampled_token_ids[0] for _ in range(num_draws))


def processed(logits, requests) -> torch.Tensor:
    logits = torch.as_tensor(logits, dtype=torch.float32).expand(len(requests), -1).clone()
    return process_logits(logits, SamplingMetadata.from_requests(requests, logits.shape[1]))


# --- greedy --------------------------------------------------------------------------------


def test_greedy_takes_the_argmax_of_each_row():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [make_request(temperature=0.0) for _ in range(4)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 4


def test_bf16_logits_are_accepted():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    requests = [make_request(temperature=0.0), make_request(seed=1), make_request(temperature=0.0, logprobs=2)]
    out = sample(logits, requests)
    assert out.sampled_token_ids[0] == logits[0].float().argmax().item()
    assert out.sampled_token_ids[2] == logits[2].float().argmax().item()
    assert 0 <= out.sampled_token_ids[1] < 50


def test_greedy_rows_in_a_mixed_batch_still_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    requests = [make_request(temperature=0.0), make_request(seed=3), make_request(temperature=0.0), make_request()]
    out = sample(logits, requests)
    assert out.sampled_token_ids[0] == logits[0].argmax().item()
    assert out.sampled_token_ids[2] == logits[2].argmax().item()


def test_a_vanishing_temperature_is_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(14)) * 20
    out = sample(logits, [make_request(seed=s, temperature=1e-37) for s in range(4)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_the_callers_logits_are_not_modified():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    requests = [
        make_request(seed=0, top_p=0.5, min_p=0.1, temperature=0.7, top_k=3, logit_bias={1: 5.0}),
        make_request(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, output_token_ids=[2]),
        make_request(seed=1, logprobs=3),
    ]
    sample(logits, requests)
    assert torch.equal(logits, before)


# --- seeds ---------------------------------------------------------------------------------


def run_seeded(seed, companions, position, num_steps=20):
    """Token ids of a seeded request over num_steps steps, batched with fresh companions each step."""
    request = make_request(seed=seed, temperature=0.9)
    logits_gen = torch.Generator().manual_seed(123)  # the request's row: the same every run
    companion_gen = torch.Generator().manual_seed(len(companions))
    token_ids = []
    for _ in range(num_steps):
        batch = [make_request(**params) for params in companions]
        batch.insert(position, request)
        logits = torch.randn(len(batch), 64, generator=companion_gen)
        logits[position] = torch.randn(64, generator=logits_gen)
        token_ids.append(sample(logits, batch).sampled_token_ids[position])
    return token_ids


def test_a_seed_reproduces_its_tokens_alone_and_in_any_batch():
    alone = run_seeded(7, [], 0)
    assert run_seeded(7, [], 0) == alone
    companions = [{"temperature": 0.0}, {"seed": 1, "top_p": 0.5}, {}, {"seed": 99, "top_k": 3, "logprobs": 2}]
    assert run_seeded(7, companions, 2) == alone
    assert run_seeded(7, companions[:1], 1) == alone


def test_different_seeds_give_different_tokens():
    assert run_seeded(7, [], 0) != run_seeded(8, [], 0)


# --- top_k, top_p, min_p, temperature ------------------------------------------------------


def test_top_k_1_behaves_like_greedy():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(4))
    out = sample(logits, [make_request(seed=s, top_k=1) for s in range(16)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_most_likely():
    logits = [0.0, 0.1, 0.2, 0.3, 0.25, 0.15, 0.05, 0.35]
    assert set(draw(logits, make_request(seed=5, top_k=3), 300)) == {7, 3, 4}


def test_a_tiny_top_p_keeps_only_the_top_token():
    logits = torch.zeros(16, 100)
    logits[:, 17] = 0.01  # barely the most likely of 100 near-equal tokens
    out = sample(logits, [make_request(seed=s, top_p=1e-6) for s in range(16)])
    assert out.sampled_token_ids == [17] * 16


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is {1, 3}.
    counts = draw(probs.log(), make_request(seed=6, top_p=0.7), 400)
    assert set(counts) == {1, 3}
    # 0.5 + 0.3 < 0.9 <= 0.5 + 0.3 + 0.15: the nucleus grows to {1, 3, 2}.
    assert set(draw(probs.log(), make_request(seed=6, top_p=0.9), 400)) == {1, 2, 3}


def test_min_p_drops_tokens_below_min_p_times_the_max():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = draw(probs.log(), make_request(seed=7, min_p=0.2), 600)  # floor 0.1
    assert set(counts) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampled_frequencies_match_the_tempered_distribution(temperature):
    probs = torch.tensor([0.6, 0.3, 0.1])
    num_draws = 3000
    counts = draw(probs.log(), make_request(seed=8, temperature=temperature), num_draws)
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    for token_id in range(3):
        assert abs(counts[token_id] / num_draws - expected[token_id].item()) < 0.03


# --- logit processing ----------------------------------------------------------------------


def test_repetition_penalty_scales_prompt_and_output_tokens_towards_unlikely():
    request = make_request(prompt_token_ids=[0, 1], output_token_ids=[2, 3, 3], repetition_penalty=2.0)
    expected = list(LOGITS)
    expected[0], expected[1], expected[2], expected[3] = 2.0 / 2, -2.0 * 2, 1.0 / 2, -1.0 * 2
    assert processed(LOGITS, [request])[0].tolist() == expected


def test_presence_and_frequency_penalties_apply_to_output_tokens_only():
    request = make_request(
        prompt_token_ids=[0, 1], output_token_ids=[2, 3, 3], presence_penalty=0.5, frequency_penalty=0.25
    )
    expected = list(LOGITS)
    expected[2] -= 0.5 + 0.25 * 1
    expected[3] -= 0.5 + 0.25 * 2
    assert processed(LOGITS, [request])[0].tolist() == expected


def test_penalties_touch_only_their_own_row():
    requests = [
        make_request(output_token_ids=[5], temperature=0.0),
        make_request(output_token_ids=[5, 5], frequency_penalty=2.0, repetition_penalty=1.5, temperature=0.0),
        make_request(output_token_ids=[5], temperature=0.0, logit_bias={0: 1.0}),
    ]
    rows = processed(LOGITS, requests)
    assert rows[0].tolist() == LOGITS
    assert rows[1, 5].item() == 3.0 / 1.5 - 2.0 * 2
    assert rows[2].tolist() == [3.0] + LOGITS[1:]
    # The penalty flips the greedy choice of row 1 only: token 5 drops below token 0.
    assert sample(LOGITS, requests).sampled_token_ids == [5, 0, 0]


def test_logit_bias_forces_and_forbids_tokens():
    assert sample(LOGITS, [make_request(temperature=0.0, logit_bias={1: 100.0})]).sampled_token_ids == [1]
    assert sample(LOGITS, [make_request(temperature=0.0, logit_bias={5: -100.0})]).sampled_token_ids == [0]
    uniform = [0.0] * VOCAB
    assert set(draw(uniform, make_request(seed=9, logit_bias={6: 100.0}), 50)) == {6}
    assert 3 not in draw(uniform, make_request(seed=9, logit_bias={3: -100.0}), 400)


def test_logit_bias_outside_the_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.from_requests([make_request(logit_bias={VOCAB: 1.0})], VOCAB)


def test_min_tokens_forbids_eos_and_stop_token_ids_until_reached():
    # EOS = 5 is the argmax, stop id 0 is next, so greedy picks 2 while both are banned.
    def greedy(num_outputs, **params):
        request = make_request(output_token_ids=[4] * num_outputs, eos_token_id=5, temperature=0.0, **params)
        return sample(LOGITS, [request]).sampled_token_ids[0]

    assert greedy(0, min_tokens=2, stop_token_ids=(0,)) == 2
    assert greedy(1, min_tokens=2, stop_token_ids=(0,)) == 2
    assert greedy(2, min_tokens=2, stop_token_ids=(0,)) == 5
    # ignore_eos lifts the ban on EOS but not on stop_token_ids.
    assert greedy(0, min_tokens=2, stop_token_ids=(5, 0), ignore_eos=True) == 2
    assert greedy(0, min_tokens=2, ignore_eos=True) == 5
    request = make_request(eos_token_id=5, seed=10, min_tokens=1)
    assert 5 not in draw([0.0] * VOCAB, request, 200)


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(11))
    requests = [
        make_request(temperature=0.0, logprobs=5, logit_bias={7: 100.0}),  # forced to a low-ranked token
        make_request(seed=12),
        make_request(seed=13, logprobs=0, temperature=0.5),
    ]
    out = sample(logits, requests)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs[1] is None

    forced = out.logprobs[0]
    assert forced.token_id == out.sampled_token_ids[0] == 7
    assert forced.logprob == pytest.approx(raw[0, 7].item(), abs=1e-6)
    assert forced.rank == 1 + int((raw[0] > raw[0, 7]).sum())
    assert [token_id for token_id, _ in forced.top] == raw[0].argsort(descending=True)[:5].tolist()
    assert [lp for _, lp in forced.top] == pytest.approx(raw[0].sort(descending=True).values[:5].tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(forced.top, forced.top[1:]))

    sampled = out.logprobs[2]
    token_id = out.sampled_token_ids[2]
    assert (sampled.token_id, sampled.top) == (token_id, [])
    assert sampled.logprob == pytest.approx(raw[2, token_id].item(), abs=1e-6)
    assert sampled.rank == 1 + int((raw[2] > raw[2, token_id]).sum())


def test_the_greedy_token_has_rank_1_and_heads_the_top_list():
    out = sample(LOGITS, [make_request(temperature=0.0, logprobs=3)])
    logprob = out.logprobs[0]
    assert (logprob.token_id, logprob.rank) == (5, 1)
    assert [token_id for token_id, _ in logprob.top] == [5, 0, 2]
    assert logprob.logprob == pytest.approx(3.0 - math.log(sum(math.exp(x) for x in LOGITS)), abs=1e-6)


@pytest.mark.parametrize(
    ("forced_token_id", "num_logprobs", "rank"),
    [(0, 3, 2), (2, 5, 3), (4, 2, 4), (1, 2, 8), (6, 0, 6)],  # inside and outside the top list
)
def test_rank_counts_the_strictly_more_likely_raw_tokens(forced_token_id, num_logprobs, rank):
    request = make_request(temperature=0.0, logprobs=num_logprobs, logit_bias={forced_token_id: 100.0})
    logprob = sample(LOGITS, [request]).logprobs[0]
    assert (logprob.token_id, logprob.rank, len(logprob.top)) == (forced_token_id, rank, num_logprobs)


def test_top_p_that_underflows_float32_keeps_the_top_token():
    # Found by schemathesis: top_p=5e-324 is 0.0 in float32; the top token must still win.
    import torch

    from tokenway.engine.request import Request
    from tokenway.engine.sampler import Sampler
    from tokenway.engine.sampling_metadata import SamplingMetadata
    from tokenway.protocol.sampling import SamplingParams

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    request = Request("r", [1], SamplingParams(temperature=1.0, top_p=5e-324, seed=0))
    out = Sampler()(logits, SamplingMetadata.from_requests([request], 4))
    assert out.sampled_token_ids == [1]
