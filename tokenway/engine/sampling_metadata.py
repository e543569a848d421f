"""SamplingMetadata: a batch's SamplingParams as per-row tensors, built once per step.

Requests -> SamplingMetadata.from_requests -> Sampler(logits, metadata) -> SamplerOutput.

Row i is requests[i] and logits[i]. Every field that no row uses is None (or empty), so the
Sampler skips that stage entirely: an all-greedy batch with no penalties, bias or logprobs
costs one argmax. Per-token positions are flat indices `row * vocab_size + token_id` into
logits.view(-1), which avoids padding ragged token lists.

Under speculative decoding (engine/spec_decode.py) a request with k drafts has k + 1 rows, one
per verified position: row j is the request as it would be had it emitted drafts[:j] (its
penalties count them, min_tokens sees them), and verifies drafts[j] (the last row verifies
nothing: it draws the token after the drafts).

A row can have its token fixed in advance (forced_tokens): a reasoning budget that is spent
writes the end of the thinking part (engine/thinking.py). Its logits are left as they are, so
its logprobs are the model's; the Sampler overwrites the row's sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenway.engine.request import Request

# Below this, logits / temperature can overflow float32, and the result is greedy anyway.
_MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    vocab_size: int

    # Logprobs, computed from the raw logits.
    num_logprobs: list[int | None]  # per row: k alternatives, or None when the row did not ask
    logprob_row_ids: torch.Tensor | None  # (num_logprob_rows,) int64; None when no row asks
    max_num_logprobs: int  # max k over the rows that ask

    # Logit processing, over all rows, in this order.
    # (flat index (num_biases,) int64, values (num_biases,) float32); None when no row has a bias
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None
    min_tokens_index: torch.Tensor | None  # (num_banned,) int64 flat index of EOS/stop ids to forbid
    repetition_penalties: torch.Tensor | None  # (num_rows, 1) float32; 1.0 on rows without
    prompt_token_index: torch.Tensor | None  # (num_tokens,) int64 flat index; rows with a repetition penalty
    output_token_index: torch.Tensor | None  # (num_tokens,) int64 flat index; rows with any penalty
    presence_penalties: torch.Tensor | None  # (num_rows, 1) float32; 0.0 on rows without
    frequency_penalties: torch.Tensor | None  # (num_rows, 1) float32; 0.0 on rows without

    # Sampling: random rows only (temperature >= _MIN_TEMPERATURE). Greedy rows take the argmax.
    random_row_ids: torch.Tensor | None  # (num_random,) int64; None when every row is random
    generators: list[torch.Generator]  # (num_random,) one per random row: its only source of randomness
    temperatures: torch.Tensor | None  # (num_random, 1) float32; None when all are 1.0
    top_ks: torch.Tensor | None  # (num_random,) int64; 0 where disabled
    max_top_k: int  # max over top_ks; 0 when none
    top_ps: torch.Tensor | None  # (num_random,) float32; 1.0 where disabled
    min_ps: torch.Tensor | None  # (num_random, 1) float32; 0.0 where disabled

    # Speculative decoding: None when no request has drafts (then row i is request i).
    spec_token_ids: Sequence[Sequence[int]] | None = None  # per request: its drafts
    request_row_starts: torch.Tensor | None = None  # (num_requests,) int64 each request's first row
    row_draft_token_ids: torch.Tensor | None = None  # (num_rows,) int64 the draft a row verifies; -1: none

    # (row ids (num_forced,) int64, token ids (num_forced,) int64): rows that must emit that token
    # whatever they sample; None when no row must.
    forced_tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def all_greedy(self) -> bool:
        return not self.generators

    @property
    def needs_processing(self) -> bool:
        return (
            self.logit_bias is not None
            or self.min_tokens_index is not None
            or self.repetition_penalties is not None
            or self.presence_penalties is not None
            or self.frequency_penalties is not None
        )

    @classmethod
    def from_requests(
        cls, requests: Sequence[Request], vocab_size: int, spec_token_ids: Sequence[Sequence[int]] | None = None
    ) -> SamplingMetadata:
        """spec_token_ids: each request's drafts (None: no request has any), which give it one row
        per draft more. Raises ValueError if a logit_bias token id is outside [0, vocab_size)."""
        num_rows = len(requests) + (sum(map(len, spec_token_ids)) if spec_token_ids is not None else 0)
        num_logprobs: list[int | None] = [None] * num_rows
        logprob_row_ids: list[int] = []
        bias_index: list[int] = []
        bias_values: list[float] = []
        min_tokens_index: list[int] = []
        repetition: list[float] = []
        presence: list[float] = []
        frequency: list[float] = []
        prompt_rows: list[int] = []  # rows whose prompt tokens count for the repetition penalty
        prompt_lens: list[int] = []
        prompt_token_ids: list[int] = []
        output_rows: list[int] = []  # rows whose output tokens count for some penalty
        output_lens: list[int] = []
        output_token_ids: list[int] = []
        random_row_ids: list[int] = []
        generators: list[torch.Generator] = []
        temperatures: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []

        request_row_starts: list[int] = []
        row_draft_token_ids: list[int] = []
        forced_rows: list[int] = []
        forced_token_ids: list[int] = []
        request_forced: list[int | None] | None = None  # per row of the current request, its forced token
        for row, (request, drafts, num_drafted) in enumerate(_rows(requests, spec_token_ids)):
            params = request.sampling_params
            base = row * vocab_size
            if spec_token_ids is not None:
                if num_drafted == 0:
                    request_row_starts.append(row)
                row_draft_token_ids.append(drafts[num_drafted] if num_drafted < len(drafts) else -1)
            if request.thinking is not None:
                if num_drafted == 0:
                    request_forced = request.thinking.forced_token_ids(request.output_token_ids, drafts)
                if request_forced is not None and (forced := request_forced[num_drafted]) is not None:
                    forced_rows.append(row)
                    forced_token_ids.append(forced)
            num_output_tokens = request.num_output_tokens + num_drafted
            if params.logprobs is not None:
                num_logprobs[row] = params.logprobs
                logprob_row_ids.append(row)
            if params.logit_bias:
                for token_id, bias in params.logit_bias.items():
                    if not 0 <= token_id < vocab_size:
                        raise ValueError(
                            f"logit_bias: token id {token_id} of request {request.request_id!r} "
                            f"is outside the vocabulary [0, {vocab_size})"
                        )
                    bias_index.append(base + token_id)
                    bias_values.append(bias)
            if num_output_tokens < params.min_tokens:
                # ignore_eos lifts the ban on EOS only; stop_token_ids still stop the request.
                banned = params.stop_token_ids
                if request.eos_token_id is not None and not params.ignore_eos:
                    banned = (*banned, request.eos_token_id)
                # An id the model cannot emit needs no ban (and must not index another row).
                min_tokens_index.extend(base + t for t in banned if 0 <= t < vocab_size)
            repetition.append(params.repetition_penalty)
            presence.append(params.presence_penalty)
            frequency.append(params.frequency_penalty)
            if params.repetition_penalty != 1.0:
                prompt_rows.append(row)
                prompt_lens.append(request.num_prompt_tokens)
                prompt_token_ids.extend(request.prompt_token_ids)
            if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
                output_rows.append(row)
                output_lens.append(num_output_tokens)
                output_token_ids.extend(request.output_token_ids)
                output_token_ids.extend(drafts[:num_drafted])
            if params.temperature >= _MIN_TEMPERATURE:
                assert request.generator is not None, "Request makes a generator for every non-greedy request"
                random_row_ids.append(row)
                generators.append(request.generator)
                temperatures.append(params.temperature)
                top_ks.append(params.top_k if 0 < params.top_k < vocab_size else 0)
                top_ps.append(params.top_p)
                min_ps.append(params.min_p)

        has_repetition = bool(prompt_rows)
        has_penalty = bool(output_rows)
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            num_logprobs=num_logprobs,
            logprob_row_ids=_int64(logprob_row_ids) if logprob_row_ids else None,
            max_num_logprobs=max((k for k in num_logprobs if k is not None), default=0),
            logit_bias=(_int64(bias_index), torch.tensor(bias_values, dtype=torch.float32)) if bias_index else None,
            min_tokens_index=_int64(min_tokens_index) if min_tokens_index else None,
            repetition_penalties=_column(repetition) if has_repetition else None,
            prompt_token_index=(
                _flat_index(prompt_rows, prompt_lens, prompt_token_ids, vocab_size) if has_repetition else None
            ),
            output_token_index=(
                _flat_index(output_rows, output_lens, output_token_ids, vocab_size) if has_penalty else None
            ),
            presence_penalties=_column(presence) if any(presence) else None,
            frequency_penalties=_column(frequency) if any(frequency) else None,
            random_row_ids=_int64(random_row_ids) if len(random_row_ids) < num_rows else None,
            generators=generators,
            temperatures=_column(temperatures) if any(t != 1.0 for t in temperatures) else None,
            top_ks=_int64(top_ks) if any(top_ks) else None,
            max_top_k=max(top_ks, default=0),
            top_ps=torch.tensor(top_ps, dtype=torch.float32) if any(p < 1.0 for p in top_ps) else None,
            min_ps=_column(min_ps) if any(min_ps) else None,
            spec_token_ids=spec_token_ids,
            request_row_starts=_int64(request_row_starts) if spec_token_ids is not None else None,
            row_draft_token_ids=_int64(row_draft_token_ids) if spec_token_ids is not None else None,
            forced_tokens=(_int64(forced_rows), _int64(forced_token_ids)) if forced_rows else None,
        )


def _rows(requests: Sequence[Request], spec_token_ids: Sequence[Sequence[int]] | None):
    """(request, its drafts, how many of them the row's request has emitted) per row."""
    if spec_token_ids is None:
        for request in requests:
            yield request, (), 0
        return
    for request, drafts in zip(requests, spec_token_ids, strict=True):
        for num_drafted in range(len(drafts) + 1):
            yield request, drafts, num_drafted


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)  # (num_rows, 1), broadcasts over vocab


def _flat_index(rows: list[int], lengths: list[int], token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """token_ids is the concatenation of each row's tokens; returns row * vocab_size + token_id."""
    row_of_token = torch.repeat_interleave(_int64(rows), _int64(lengths))  # (num_tokens,)
    return row_of_token * vocab_size + _int64(token_ids)
