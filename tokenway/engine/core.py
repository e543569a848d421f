"""EngineCore: the step loop. Synchronous and single-threaded; engine/client.py runs it
in a thread for asyncio callers and tokenway.LLM drives it directly.

    scheduler_output = scheduler.schedule()
    logits = runner.execute(scheduler_output)
    outputs = scheduler.update_from_output(scheduler_output, *sampler(logits, ..., grammar_bitmask))

Under speculative decoding (engine/spec_decode.py) the same three calls verify drafts: a
request's logits, sampled tokens and logprobs come one per draft more, and the sampler says
how many drafts each request keeps.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from functools import partial
from typing import Protocol

import torch

from tokenway.config import EngineConfig
from tokenway.engine.request import Request, RequestStatus
from tokenway.engine.runner import ModelRunner, kv_bytes_per_block
from tokenway.engine.sampler import Sampler, SamplingMetadata
from tokenway.engine.scheduler import BATCH_RANK, Scheduler, SchedulerOutput
from tokenway.engine.spec_decode import NgramProposer
from tokenway.engine.stats import ClassStats, EngineStats
from tokenway.engine.step_cost import BatchAllowance
from tokenway.frontend.prompt_check import PromptChecker, eos_token_ids, resolve_max_model_len
from tokenway.frontend.structured_output import StructuredOutputManager
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.kv_cache.interface import plan_groups
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.models.config import ModelConfig
from tokenway.models.decoder import DecoderForCausalLM
from tokenway.models.interjection import Interjection
from tokenway.models.linear import select_kernels
from tokenway.models.loader import resolve_model
from tokenway.models.weights import KernelCache, expert_weights, iter_weights, quantized_weights
from tokenway.protocol.job import SERVICE_CLASSES, ServiceClass
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

# A cycle longer than twice its step and this is a loop that waited for work: not the step's cost.
CYCLE_SLACK_S = 0.005


class Arrivals(Protocol):
    """Where requests reach a running engine (engine/process.py's command pipe)."""

    @property
    def wake_fd(self) -> int:
        """A descriptor that turns readable when something arrived."""
        ...

    def take(self) -> bool:
        """Take in what arrived without waiting: new requests join the scheduler's queue, anything
        else (an abort, a stop) waits for the step's end. Whether a request was added."""
        ...

    def publish(self, outputs: list[EngineOutput]) -> None:
        """Send the outputs of a step interjected in another at once."""
        ...


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run 2-5x faster than fp32 (measured in bench/)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if config.dtype != "auto":
        return device, getattr(torch, config.dtype)
    if device.type == "cuda":
        return device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return device, torch.bfloat16 if cpu_has_bf16() else torch.float32


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        started = time.monotonic()
        model_dir = resolve_model(config.model, config.cache_dir, revision=config.revision, gguf_file=config.gguf_file)
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.device, self.dtype = resolve_device_and_dtype(config)
        if self.device.type == "cpu" and os.environ.get("OMP_NUM_THREADS") is None:
            torch.set_num_threads(max(1, os.cpu_count() or 1))

        self.max_model_len = resolve_max_model_len(config, self.model_config)
        model = DecoderForCausalLM(self.model_config, self.dtype, max_positions=self.max_model_len)
        quantized: set[str] = set()
        if config.quantization == "auto" and self.device.type != "cpu":
            # The blocks on the device, dequantized per matmul by torch operators (models/quant_torch.py).
            quantized = model.use_quantized(quantized_weights(model_dir), torch_device=self.device)
        elif config.quantization == "auto":
            from tokenway.models import quant

            if quant.available():
                activations = config.quant_activations
                if activations == "auto":
                    activations = "dtype" if config.dtype == "float32" else "int8"
                # A GGUF's blocks, relaid for the kernels once and kept beside its description.
                kernel_cache = KernelCache(model_dir, quant.LAYOUT_VERSION)
                relaid = kernel_cache.load()
                # A checkpoint's bfloat16 (float16) weights too, where the model computes in float32.
                stored = quantized_weights(model_dir, floats_as_stored=self.dtype == torch.float32)
                quantized = model.use_quantized(stored, activations, relaid)
                kernels = model.relaid_weights()
                if kernels.keys() - relaid.keys():
                    kernel_cache.save(kernels)
        # A mixture's experts computed on the file's 3-D tensors as stored, whatever else is quantized.
        quantized |= model.use_experts(expert_weights(model_dir))
        model.load_weights(iter_weights(model_dir, skip=quantized))
        self.model = model.to(self.device).eval()
        if self.device.type != "cpu":
            model.place_experts(self.device)
        fused = model.use_fused_kernels()
        backends = select_kernels(model.linear_kernels(), config.linear_kernels)
        packed = sum(backend == "onednn" for backend in backends.values())

        kv_cache_memory = config.kv_cache_memory
        assert isinstance(kv_cache_memory, int), "EngineConfig.__post_init__ parses it into bytes"
        block_bytes = kv_bytes_per_block(self.model_config, config.block_size, self.dtype)
        num_blocks = kv_cache_memory // block_bytes
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"kv_cache_memory: {kv_cache_memory} bytes hold {num_blocks} blocks "
                f"({num_blocks * config.block_size} tokens), fewer than max_model_len ({self.max_model_len}); "
                f"raise kv_cache_memory to at least {-(-self.max_model_len // config.block_size) * block_bytes} "
                f"or lower max_model_len"
            )
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config)
        # Layers that attend alike share block tables (kv_cache/interface.py): where the sliding-window
        # layers form a group (every layer, or a group of their own), blocks behind the window go back
        # to its pool as requests run.
        num_layers = self.model_config.num_hidden_layers
        layer_block_bytes = block_bytes // num_layers
        kv_groups = plan_groups(kv_cache_memory, layer_block_bytes,
                                [self.model_config.window(layer) for layer in range(num_layers)], config.block_size,
                                config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.kv_manager = KVCacheManager(block_size=config.block_size,
                                         enable_prefix_caching=config.enable_prefix_caching,
                                         namespace=str(model_dir), groups=kv_groups)
        proposer = None
        if config.speculative_method == "ngram":
            proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
        # Under a bound on what batch work may slow a step down, the steps' times teach the cost
        # model that turns the bound into tokens (engine/step_cost.py).
        allowance = None if config.batch_slowdown is None else BatchAllowance(config.batch_slowdown)
        self._allowance = allowance
        # The step before: (perf_counter at its start, its seconds, the seconds and the tokens
        # of the steps interjected in it, its tokens, those of the batch class)
        self._last_step: tuple[float, float, float, int, int, int] | None = None
        # Under a bound, the batch class leaves a seat in 16 (one at least) to the better classes:
        # one arriving while a batch step runs can then start in the middle of it (step()).
        max_num_batch_seqs = None
        if allowance is not None and config.max_num_seqs > 1:
            max_num_batch_seqs = config.max_num_seqs - max(1, config.max_num_seqs // 16)
        self.scheduler = Scheduler(
            self.kv_manager, self.max_model_len, config.max_num_batched_tokens, config.max_num_seqs, self.eos_token_ids,
            proposer, allowance, max_num_batch_seqs,
        )
        self.runner = ModelRunner(self.model, kv_groups[0].num_blocks, config.block_size, self.device,
                                  num_sliding_blocks=kv_groups[-1].num_blocks)
        self.sampler = Sampler()
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         self.eos_token_ids)
        self.prompts = PromptChecker(self.model_config.vocab_size, self.max_model_len, self.structured_output)
        self.num_steps = 0  # steps that ran a batch, since start
        self.num_interjected_steps = 0  # of those, steps run between two layers of another (step())
        self._interjected_s = 0.0  # the time the step running spent on steps interjected in it
        self._interjected_tokens = 0  # and their tokens
        if config.show_progress:
            print(
                f"tokenway: loaded {config.model} ({self.model_config.architecture}, {self.dtype}, {self.device}) "
                f"in {time.monotonic() - started:.1f}s; KV cache "
                f"{' + '.join(f'{group.num_blocks} blocks' for group in kv_groups)} x {config.block_size} tokens "
                f"({sum(g.num_blocks * g.num_layers for g in kv_groups) * layer_block_bytes / 2**30:.2f} GiB), "
                f"max_model_len {self.max_model_len}; "
                f"{model.num_quantized_matmuls} matmuls on GGUF blocks; "
                f"fused layer kernels {'on' if fused else 'off'}; "
                f"oneDNN-packed matmuls for {packed} of {len(backends)} float weight shapes"
                + ("; no chat template in the model: chats are templated as ChatML"
                   if self.tokenizer.chat_template_is_fallback else ""),
                file=sys.stderr,
            )

    # -- requests -----------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.prompts.check(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    service_class: ServiceClass = "default") -> None:
        self.validate_prompt(prompt_token_ids, params)
        eos = self.tokenizer.eos_token_id
        spec = params.structured_output
        grammar = None if spec is None else self.structured_output.new_matcher(spec)
        self.scheduler.add_request(Request(request_id, list(prompt_token_ids), params, eos_token_id=eos,
                                           grammar=grammar, service_class=service_class))

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        return self.scheduler.abort_requests(request_ids)

    def finish_request(self, request_id: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_reason)

    def snapshot(self) -> EngineStats:
        """What runs, what waits, how full the KV cache is: the engine's published counts."""
        kv, scheduler = self.kv_manager, self.scheduler
        spec = scheduler.spec_decoding_stats
        num_running_by_rank = [0] * len(SERVICE_CLASSES)
        for request in scheduler.running:
            num_running_by_rank[request.class_rank] += 1
        num_waiting_by_rank = scheduler.waiting.num_waiting_by_rank()
        classes = tuple(
            ClassStats(service_class, num_running_by_rank[rank], num_waiting_by_rank[rank],
                       scheduler.num_preemptions_by_rank[rank], scheduler.num_prompt_tokens_by_rank[rank],
                       scheduler.num_generated_tokens_by_rank[rank])
            for rank, service_class in enumerate(SERVICE_CLASSES))
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate, prefix_cache_queried_tokens=kv.num_queried_tokens,
            prefix_cache_hit_tokens=kv.num_hit_tokens, num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps, spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_acceptance_rate=spec.acceptance_rate,
            spec_decode_mean_accepted_length=spec.mean_accepted_length, classes=classes,
            num_interjected_steps=self.num_interjected_steps,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished_requests > 0

    # -- the loop -----------------------------------------------------------------

    def step(self, arrivals: Arrivals | None = None) -> list[EngineOutput]:
        """One step. arrivals: where requests arrive while it runs; a step that carries batch work
        then lets a request of a better class run a step of its own between two of its layers
        (_interject), so that request's first token never waits for the batch's step to end."""
        started = time.perf_counter()
        if self._allowance is not None and self._last_step is not None:
            self._observe_cycle(started)
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.requests:
            self._last_step = None
            return []
        interjection = None
        self._interjected_s, self._interjected_tokens = 0.0, 0
        num_batch_tokens = batch_tokens(scheduler_output)
        if arrivals is not None and num_batch_tokens:
            interjection = Interjection(arrivals.wake_fd, partial(self._interject, scheduler_output, arrivals))
        outputs = self._run(scheduler_output, interjection)
        if self._allowance is not None:
            # What a step costs is the whole cycle to the next (its outputs folded, detokenized and
            # sent too, work that grows with its requests); measured when the next step starts.
            self._last_step = (started, time.perf_counter() - started, self._interjected_s,
                               self._interjected_tokens, scheduler_output.total_num_scheduled_tokens,
                               num_batch_tokens)
        return outputs

    def _run(self, scheduler_output: SchedulerOutput, interjection: Interjection | None = None) -> list[EngineOutput]:
        """Execute, sample and fold one scheduled step."""
        sampling_requests = scheduler_output.sampling_requests
        spec_token_ids = scheduler_output.sampling_spec_token_ids if scheduler_output.num_spec_tokens else None
        logits = self.runner.execute(scheduler_output, interjection)
        metadata = SamplingMetadata.from_requests(sampling_requests, self.model_config.vocab_size, spec_token_ids)
        grammar_bitmask = self.structured_output.grammar_bitmask([request.grammar for request in sampling_requests])
        sampled = self.sampler(logits, metadata, grammar_bitmask)
        outputs = self.scheduler.update_from_output(
            scheduler_output, sampled.sampled_token_ids, sampled.logprobs, sampled.num_accepted_tokens
        )
        self.num_steps += 1
        return outputs

    def _interject(self, in_flight: SchedulerOutput, arrivals: Arrivals) -> None:
        """Between two layers of in_flight: take in what arrived and, if a request better than
        the batch class can start, run its step now and publish its outputs."""
        if not arrivals.take():
            return
        started = time.perf_counter()
        interjected = self.scheduler.schedule_interjection(in_flight)
        if interjected.requests:
            arrivals.publish(self._run(interjected))
            self.num_interjected_steps += 1
            self._interjected_tokens += interjected.total_num_scheduled_tokens
        self._interjected_s += time.perf_counter() - started

    def _observe_cycle(self, now: float) -> None:
        """The last step's cost: the time from its start to this one's, unless the loop waited
        for work between them (then only the step itself), the steps interjected in it included."""
        assert self._allowance is not None and self._last_step is not None
        started, step_s, interjected_s, num_interjected_tokens, num_tokens, num_batch_tokens = self._last_step
        cycle_s = now - started
        seconds = cycle_s if cycle_s < 2 * step_s + CYCLE_SLACK_S else step_s
        self._allowance.observe(num_tokens, num_batch_tokens, seconds, interjected_s, num_interjected_tokens,
                                self.scheduler.holds_batch_requests())
        self._last_step = None


def batch_tokens(scheduler_output: SchedulerOutput) -> int:
    return sum(num_new for request, num_new in zip(scheduler_output.requests, scheduler_output.num_scheduled_tokens)
               if request.class_rank == BATCH_RANK)
