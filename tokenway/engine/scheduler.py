"""Scheduler: which requests run this step, and how many tokens each.

Continuous batching with a token budget per step (vLLM v1's design): running requests go
first, each taking the tokens it still has to compute (1 for a decode, a chunk for a long
prompt); waiting requests then join with whatever budget is left. No prefill/decode
phase: everything is num_computed_tokens against num_tokens. When the KV cache is out of
blocks (in any of its groups: kv_cache/manager.py), the newest running request is preempted:
its blocks are freed and it restarts later by recomputing its tokens (mostly from the prefix
cache). A structured-output grammar
advances only in update_from_output, on each newly sampled token, so recomputing the tokens a
request already has never touches it.

With a proposer (engine/spec_decode.py), a decode request also takes the drafts proposed for
it this step: 1 + k tokens against the budget and the KV cache (the drafts are the first thing
given up when blocks run out). update_from_output then counts as computed only the tokens the
verification kept; the KV slots of rejected drafts are simply overwritten later.

A reasoning budget (engine/thinking.py) advances, like the grammar, only on appended tokens. Its
forced tokens need nothing here: a verify step forces each of its rows as a plain decode step
would at that position, so a draft is kept only where it is the forced token.

Service classes (protocol/job.py; vLLM's priority policy, with preemption on admission too):
each step serves the classes best first, a class's running requests and then its waiting ones,
so the token budget reaches a batch request's prefill chunk only after every better class took
what it needs this step. `running` stays ordered by (class, admission), so the newest request of
the worst class is always running[-1]: the victim when blocks run out, whoever needs them. A
waiting request that the KV cache or max_num_seqs stops preempts running requests of a worse
class (never its own or a better one) until it fits; it is admitted in the step it arrives
unless better classes use the whole budget. Once a class's head of line is stopped, or a
request of a class is preempted, no request of that class or a worse one is admitted in that
step (it would take the blocks back from the one that waits). With one class this is exactly
the FCFS scheduling above.

With a BatchAllowance (engine/step_cost.py: a bound on how much longer a step may take for the
batch work in it), the batch class's budget in a step that also runs better classes is the
tokens that bound allows beside theirs (none in a step that prefills one of them); batch
requests running and not scheduled keep their blocks and go on when the allowance comes back.
With nothing better running lately the batch takes the whole step.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import cast

from tokenway.engine.request import Request, RequestStatus
from tokenway.engine.request_queue import WaitingQueue
from tokenway.engine.spec_decode import NgramProposer, SpecDecodingStats
from tokenway.engine.step_cost import BatchAllowance
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.protocol.job import SERVICE_CLASSES, class_rank
from tokenway.protocol.outputs import EngineOutput, TokenLogprob

BATCH_RANK = class_rank("batch")


def _class_rank(request: Request) -> int:
    return request.class_rank


@dataclass(slots=True)
class SchedulerOutput:
    """What runs in one step. Built by the Scheduler; the runner only reads it."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per request, same order
    # Per request, same order: its block table in the first KV cache group (the only one, or the
    # full-attention layers' where they mix with sliding-window layers).
    block_tables: list[list[int]] = field(default_factory=list)
    # Per request, same order: the drafts scheduled after its last known token (counted in
    # num_scheduled_tokens); () for most.
    spec_token_ids: list[tuple[int, ...]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Per request, same order: its table in the sliding-window layers' group where they have one
    # (kv_cache/manager.py); empty: those layers read block_tables, if the model has any.
    sliding_block_tables: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.spec_token_ids:  # built with its requests (not by the Scheduler): no drafts
            self.spec_token_ids = [()] * len(self.requests)

    def blocks_written(self, block_size: int) -> set[int]:
        """The KV blocks this step writes (in every group): those holding its scheduled tokens."""
        written: set[int] = set()
        for tables in (self.block_tables, self.sliding_block_tables):
            for table, request, num_new in zip(tables, self.requests, self.num_scheduled_tokens):
                start = request.num_computed_tokens
                written.update(table[start // block_size: (start + num_new - 1) // block_size + 1])
        return written

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_spec_tokens(self) -> int:
        return sum(map(len, self.spec_token_ids))

    @property
    def sampling_requests(self) -> list[Request]:
        """Requests whose scheduled tokens reach their last known token (and their drafts): they
        get new tokens."""
        return [
            request
            for request, num_new, drafts in zip(self.requests, self.num_scheduled_tokens, self.spec_token_ids)
            if request.num_computed_tokens + num_new == request.num_tokens + len(drafts)
        ]

    @property
    def sampling_spec_token_ids(self) -> list[tuple[int, ...]]:
        """The drafts of each of sampling_requests, same order."""
        return [
            drafts
            for request, num_new, drafts in zip(self.requests, self.num_scheduled_tokens, self.spec_token_ids)
            if request.num_computed_tokens + num_new == request.num_tokens + len(drafts)
        ]


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        eos_token_ids: frozenset[int] = frozenset(),
        proposer: NgramProposer | None = None,
        batch_allowance: BatchAllowance | None = None,
        max_num_batch_seqs: int | None = None,
    ) -> None:
        """max_num_batch_seqs: the seats the batch class may hold of max_num_seqs (None: all), so
        that a better request arriving mid-step finds one free (schedule_interjection)."""
        self.kv_manager = kv_manager
        self.proposer = proposer
        self.batch_allowance = batch_allowance
        self.spec_decoding_stats = SpecDecodingStats()
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batch_seqs = max_num_seqs if max_num_batch_seqs is None else min(max_num_batch_seqs, max_num_seqs)
        self.eos_token_ids = eos_token_ids
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # ordered by (class_rank, admission)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Totals since start per class, indexed by class_rank (EngineCore.snapshot publishes them).
        self.num_preemptions_by_rank = [0] * len(SERVICE_CLASSES)
        self.num_prompt_tokens_by_rank = [0] * len(SERVICE_CLASSES)  # of the requests admitted
        self.num_generated_tokens_by_rank = [0] * len(SERVICE_CLASSES)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def holds_batch_requests(self) -> bool:
        """Whether a request of the batch class runs or waits (running is ordered by class)."""
        return bool(self.running and self.running[-1].class_rank == BATCH_RANK or self.waiting.by_rank[BATCH_RANK])

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        """Finish the requests now and free their blocks; unknown ids are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._dequeue(request)
                outputs.append(self._finish(request, RequestStatus.FINISHED_ABORTED, []))
        return outputs

    def _dequeue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv, running = self.kv_manager, self.running
        # Classes of this rank and worse admit nobody more this step (see the module's docstring).
        admit_below = len(SERVICE_CLASSES)
        index = 0  # running[:index] are scheduled; running[index:] are of this class or worse
        for rank, waiting in enumerate(self.waiting.by_rank):
            allowed, budget_left = None, budget
            if rank == BATCH_RANK and self.batch_allowance is not None and (waiting or index < len(running)):
                prefilling = any(request.num_computed_tokens < request.num_prompt_tokens for request in out.requests)
                allowed = self.batch_allowance.tokens(self.max_num_batched_tokens - budget, prefilling)
                budget = min(budget, allowed)
            while index < len(running) and budget > 0:
                request = running[index]
                if request.class_rank != rank:
                    break
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                assert num_new > 0, "a running request always has a token to compute"
                drafts = self._propose(request, budget - 1) if num_new == 1 and budget > 1 else ()
                num_new += len(drafts)
                while kv.allocate_slots(request, num_new) is None:
                    if drafts:  # out of blocks: give up the drafts before anyone's blocks
                        num_new -= len(drafts)
                        drafts = ()
                        continue
                    # Out of blocks: preempt the newest running request of the worst class (possibly this one).
                    victim = self._preempt_last(out)
                    admit_below = min(admit_below, victim.class_rank)
                    if victim is request:
                        break
                else:
                    self._add_to_output(out, request, num_new, drafts)
                    budget -= num_new
                    index += 1
                    continue
                break  # the request itself was preempted; everything after it already was

            # New or resumed requests of this class, while nobody of it (or better) was preempted.
            while waiting and budget > 0 and rank < admit_below:
                if len(running) >= self.max_num_seqs and not self._preempt_worse(rank, out):
                    admit_below = rank
                    break
                if rank == BATCH_RANK and len(running) - bisect.bisect_left(
                        running, BATCH_RANK, key=_class_rank) >= self.max_num_batch_seqs:
                    break
                request = waiting[0]
                computed_block_ids, num_computed = kv.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_computed, budget)
                # A preemption frees blocks and evicts none: the cache hit found above still holds.
                while kv.allocate_slots(request, num_new, computed_block_ids) is None:
                    if not self._preempt_worse(rank, out):
                        break
                else:
                    waiting.popleft()
                    self._admit(request, num_computed)
                    running.insert(index, request)  # the end of its class: running stays ordered
                    index += 1
                    self._add_to_output(out, request, num_new)
                    budget -= num_new
                    continue
                admit_below = rank
                break
            if allowed is not None:  # the better classes' budget, less what the batch used
                used = min(budget_left, allowed) - budget
                budget = budget_left - used
        return out

    def schedule_interjection(self, in_flight: SchedulerOutput) -> SchedulerOutput:
        """Waiting requests of the classes better than batch, admitted while in_flight (a step
        that carries batch work) is stopped between two layers (EngineCore.step): what runs
        in a step of their own before in_flight goes on. None of in_flight's requests is touched,
        so only free blocks are taken (no preemption), and a request whose cache hit reaches a
        block in_flight is still writing is left for the next step (the hit is registered when
        the blocks are allocated, before the step computes them). What is not admitted here is
        admitted by the next schedule() as it would have been; the classes' order holds."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv, running = self.kv_manager, self.running
        writing: set[int] | None = None
        for rank, waiting in enumerate(self.waiting.by_rank[:BATCH_RANK]):
            while waiting and budget > 0:
                if len(running) >= self.max_num_seqs:
                    return out
                request = waiting[0]
                computed_block_ids, num_computed = kv.get_computed_blocks(request)
                if computed_block_ids:
                    if writing is None:
                        writing = in_flight.blocks_written(kv.block_size)
                    if not writing.isdisjoint(computed_block_ids):
                        return out
                num_new = min(request.num_tokens - num_computed, budget)
                if kv.allocate_slots(request, num_new, computed_block_ids) is None:
                    return out
                waiting.popleft()
                self._admit(request, num_computed)
                # The end of its class: running stays ordered by (class, admission).
                running.insert(bisect.bisect_right(running, rank, key=_class_rank), request)
                self._add_to_output(out, request, num_new)
                budget -= num_new
        return out

    def _admit(self, request: Request, num_computed: int) -> None:
        """A waiting request starts (or resumes) running with its first num_computed tokens cached."""
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
            request.cache_reason = self.kv_manager.get_cache_miss_reason(request.request_id)
            request.first_scheduled_time = time.monotonic()
            self.num_prompt_tokens_by_rank[request.class_rank] += request.num_prompt_tokens
        request.status = RequestStatus.RUNNING

    def _preempt_last(self, out: SchedulerOutput) -> Request:
        """Preempt running[-1]: the newest request of the worst class running."""
        victim = self.running.pop()
        self._preempt(victim)
        out.preempted_request_ids.append(victim.request_id)
        return victim

    def _preempt_worse(self, rank: int, out: SchedulerOutput) -> bool:
        """Make room for a waiting request of class `rank`: preempt the newest running request of the
        worst class, if that class is worse than `rank` (it is not scheduled this step yet). False
        when none is."""
        if not self.running or self.running[-1].class_rank <= rank:
            return False
        self._preempt_last(out)
        return True

    def _add_to_output(self, out: SchedulerOutput, request: Request, num_new: int,
                       drafts: tuple[int, ...] = ()) -> None:
        out.requests.append(request)
        out.num_scheduled_tokens.append(num_new)
        block_tables = self.kv_manager.get_block_tables(request.request_id)
        out.block_tables.append(block_tables[0])
        if len(block_tables) > 1:
            out.sliding_block_tables.append(block_tables[1])
        out.spec_token_ids.append(drafts)

    def _propose(self, request: Request, max_num_drafts: int) -> tuple[int, ...]:
        """Drafts for a decode request: none under a grammar (it would have to check each draft
        before the model sees it), nor while one waits for the thinking part to close (the rows
        after a close inside the drafts would go unchecked), and never more than the output may
        still grow by after the step's own token (max_tokens, the context window), so a verify
        step never runs past them."""
        thinking = request.thinking
        if self.proposer is None or request.grammar is not None or (thinking is not None
                                                                     and thinking.grammar is not None):
            return ()
        params = request.sampling_params
        max_num_drafts = min(max_num_drafts, self.max_model_len - request.num_tokens - 1)
        if params.max_tokens is not None:
            max_num_drafts = min(max_num_drafts, params.max_tokens - request.num_output_tokens - 1)
        if max_num_drafts <= 0:
            return ()
        return self.proposer.propose(request.all_token_ids, max_num_drafts)

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_rank[request.class_rank] += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[TokenLogprob | None],
        num_accepted_tokens: list[int] | None = None,
    ) -> list[EngineOutput]:
        """Advance the counters, append sampled tokens, check stop conditions and free finished
        requests. sampled_token_ids and logprobs have a row per sampling request (in order) and
        one more per draft of it; num_accepted_tokens says, per sampling request, how many of
        its drafts were accepted (None when none had drafts): its new tokens are the accepted
        drafts and the token after them, cut after the first that stops it."""
        outputs: list[EngineOutput] = []
        row = 0
        sample_index = 0
        num_generated_tokens_by_rank = self.num_generated_tokens_by_rank
        for request, num_new, drafts in zip(out.requests, out.num_scheduled_tokens, out.spec_token_ids):
            request.num_computed_tokens += num_new - len(drafts)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk: nothing sampled yet
            num_accepted = 0
            if drafts:
                assert num_accepted_tokens is not None
                num_accepted = num_accepted_tokens[sample_index]
                self.spec_decoding_stats.observe(len(drafts), num_accepted)
                # This step wrote the accepted drafts' KV, exactly as decoding them would have.
                request.num_computed_tokens += num_accepted
            new_token_ids = sampled_token_ids[row : row + 1 + num_accepted]
            new_logprobs = logprobs[row : row + 1 + num_accepted]
            row += 1 + len(drafts)
            sample_index += 1
            status = None
            for position, token_id in enumerate(new_token_ids):
                request.append_output_token_ids(token_id)
                if request.grammar is not None:
                    request.grammar.accept_token(token_id)
                thinking = request.thinking
                if thinking is not None and thinking.advance(request.output_token_ids):
                    # The part closed with this token: a grammar constrains the answer from the next.
                    request.grammar, thinking.grammar = thinking.grammar, None
                status = self._check_stop(request, token_id)
                if status is not None:
                    del new_token_ids[position + 1 :], new_logprobs[position + 1 :]
                    break
            num_generated_tokens_by_rank[request.class_rank] += len(new_token_ids)
            # A request asked for logprobs or not: its rows are all TokenLogprob or all None.
            kept_logprobs = None if new_logprobs[0] is None else cast("list[TokenLogprob]", new_logprobs)
            if status is None:
                outputs.append(self._output(request, new_token_ids, kept_logprobs))
            else:
                self.running.remove(request)
                outputs.append(self._finish(request, status, new_token_ids, kept_logprobs))
        assert row == len(sampled_token_ids)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        # The output is complete (only EOS could follow) whatever min_tokens or ignore_eos say:
        # the grammar would allow nothing else.
        if request.grammar is not None and request.grammar.is_finished:
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish a request from outside the step (e.g. a stop string the frontend matched)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        self._dequeue(request)
        request.stop_reason = stop_reason
        self._finish(request, status, [])

    def _finish(
        self,
        request: Request,
        status: RequestStatus,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> EngineOutput:
        request.status = status
        request.grammar = None
        if request.thinking is not None:
            request.thinking.grammar = None
        self.kv_manager.free(request)
        del self.requests[request.request_id]
        return self._output(request, new_token_ids, new_logprobs)

    def _output(self, request: Request, new_token_ids: list[int], new_logprobs) -> EngineOutput:
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            cache_reason=request.cache_reason,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
        )
