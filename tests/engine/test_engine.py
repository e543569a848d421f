"""The engine end to end on the real default model: greedy equals a transformers
reference, seeds reproduce, the prefix cache and preemption change nothing but speed,
aborts free every block, bad input is refused by name."""

from __future__ import annotations

import pytest
import torch

from tokenway import LLM, SamplingParams
from tokenway.engine.core import EngineCore

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a name for a pet turtle.",
    "What does a compiler do?",
]
STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "named Elias. Every morning he opened his shop, wound the hundred clocks that lined its walls, and "
    "listened to them tick in unison. Children from the village would press their noses against the "
    "window to watch him work, and travellers came from distant towns to buy his clocks, which were said "
    "never to lose a second. One winter night, a stranger in a grey coat knocked at his door and asked "
    "him to repair a clock that had no hands, no numbers and no sound at all. "
) * 3


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def mixed_prompts(llm: LLM) -> list[list[int]]:
    """16 prompts from 20 to ~400 tokens: chat questions and story prefixes of many lengths."""
    story = llm.tokenizer.encode(STORY, add_special_tokens=False)
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    prompts += [story[:n] for n in (20, 45, 90, 130, 200, 260, 330, 400)]
    return prompts


def reference_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_outputs(llm, hf_reference):
    return [reference_greedy(hf_reference, p, GREEDY.max_tokens) for p in mixed_prompts(llm)]


@pytest.fixture
def cold_cache(llm):
    """No prefix-cache hits from earlier tests: a hit changes the prefill's matmul shapes, and
    with them the float32 rounding, which can flip a near-tie in greedy decoding."""
    assert llm.engine.kv_manager.reset_prefix_cache()


def test_greedy_alone_matches_transformers(llm, reference_outputs, cold_cache):
    prompts = mixed_prompts(llm)
    for index in (0, 3, 10, 15):  # short and long, one at a time
        assert generate_ids(llm, [prompts[index]], GREEDY) == [reference_outputs[index]], f"prompt {index}"


def test_greedy_in_a_batch_of_16_matches_transformers(llm, reference_outputs, cold_cache):
    # max_num_batched_tokens=256: the long prompts are chunked while the short ones decode.
    got = generate_ids(llm, mixed_prompts(llm), GREEDY)
    for index, (ours, theirs) in enumerate(zip(got, reference_outputs)):
        assert ours == theirs, f"prompt {index}"


def test_seed_reproduces_alone_and_in_a_batch_and_seeds_differ(llm):
    prompt = chat_ids(llm, "Tell me a story about a dragon.")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = generate_ids(llm, [prompt], seeded)[0]
    others = [chat_ids(llm, q) for q in QUESTIONS[:5]]
    mixed_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20) for i in range(5)] + [seeded]
    outputs = llm.generate([{"prompt_token_ids": p} for p in others + [prompt]], mixed_params)
    assert outputs[-1].outputs[0].token_ids == alone
    assert generate_ids(llm, [prompt], seeded)[0] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=20, ignore_eos=True)
    assert generate_ids(llm, [prompt], other_seed)[0] != alone


def test_prefix_cache_hit_reports_cached_blocks_and_changes_nothing(llm, default_model_dir):
    story = llm.tokenizer.encode(STORY, add_special_tokens=False)
    prefix = story[:200]
    first = prefix + llm.tokenizer.encode(" The stranger smiled.", add_special_tokens=False)
    second = prefix + llm.tokenizer.encode(" Elias frowned and said", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.engine.kv_manager.reset_prefix_cache()
    cold = llm.generate([{"prompt_token_ids": first}], params)[0]
    assert cold.num_cached_tokens == 0
    warm = llm.generate([{"prompt_token_ids": second}], params)[0]
    assert warm.num_cached_tokens == 192  # the 12 full 16-token blocks of the 200-token prefix

    no_cache = LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory="64MiB",
                   max_model_len=1024, enable_prefix_caching=False, show_progress=False)
    expected = no_cache.generate([{"prompt_token_ids": second}], params)[0]
    assert expected.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == expected.outputs[0].token_ids


def test_preemption_under_a_tiny_kv_budget_gives_the_same_greedy_outputs(llm, default_model_dir):
    prompts = mixed_prompts(llm)[:8]  # the chat questions, ~30-40 tokens each
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = generate_ids(llm, prompts, params)
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # layers x block x kv heads x head dim x fp32, K and V
    tiny = LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory=20 * block_bytes,
               max_model_len=256, show_progress=False)
    assert tiny.engine.kv_manager.num_blocks == 20  # room for ~4 of the 8 requests at once
    assert generate_ids(tiny, prompts, params) == expected
    assert tiny.engine.scheduler.num_preemptions > 0
    assert tiny.engine.kv_manager.num_free_blocks == 20


def test_abort_mid_generation_frees_every_block(llm):
    core: EngineCore = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, question in enumerate(QUESTIONS[:4]):
        core.add_request(f"abort-{i}", chat_ids(llm, question), params)
    for _ in range(5):
        core.step()
    assert core.kv_manager.num_free_blocks < core.kv_manager.num_blocks
    outputs = core.abort_requests(["abort-0", "abort-2"])
    assert [o.finish_reason for o in outputs] == ["abort", "abort"]
    core.step()
    core.abort_requests(["abort-1", "abort-3", "never-existed"])
    assert not core.has_unfinished_requests()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda llm: llm.generate([""], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([{"prompt_token_ids": [5] * 9000}], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([{"prompt_token_ids": [10**6]}], SamplingParams(max_tokens=4)), "prompt_token_ids"),
        (lambda llm: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda llm: SamplingParams(max_tokens=-3), "max_tokens"),
        (lambda llm: SamplingParams(top_p=0.0), "top_p"),
        (lambda llm: SamplingParams(top_p=1.5), "top_p"),
        (lambda llm: SamplingParams(temperature=-1), "temperature"),
        (lambda llm: SamplingParams(logit_bias={1: 500}), "logit_bias"),
        (lambda llm: LLM("/no/such/model/dir"), "/no/such/model/dir"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field_and_the_engine_keeps_serving(llm, make, field):
    with pytest.raises(ValueError, match=field.replace("/", "/")):
        make(llm)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_stop_conditions_and_outputs(llm):
    prompt = chat_ids(llm, "What is the capital of France?")
    full = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert full.finish_reason == "stop" and full.text  # ends on EOS (<|im_end|>)
    assert llm.tokenizer.eos_token_id not in full.token_ids[:-1]

    word = full.text.split()[2]
    stopped = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=30, stop=[word]))
    out = stopped[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert word not in out.text and full.text.startswith(out.text)

    capped = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 3

    token = full.token_ids[1]
    by_id = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[token]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token and by_id.token_ids == full.token_ids[:2]

    with_logprobs = llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(with_logprobs.logprobs) == 5
    for token_id, lp in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert lp.token_id == token_id and lp.rank == 1 and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token_id


def test_context_window_ends_generation_with_length(default_model_dir):
    small = LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory="16MiB", max_model_len=40,
                show_progress=False)
    out = small.generate([{"prompt_token_ids": list(range(100, 130))}],
                         SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40


def test_chat_and_n(llm):
    outputs = llm.chat([{"role": "user", "content": "Say hello."}],
                       SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=8, ignore_eos=True))
    assert len(outputs) == 1 and len(outputs[0].outputs) == 3
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    # n copies share the prompt: the 2nd and 3rd reuse the 1st's full blocks.
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1
