"""Sampler: one step's logits -> one token per row (+ logprobs where asked).

Stages, in vLLM's order (each skipped when no row uses it):
  1. logprobs from the RAW logits (log_softmax of the model output);
  2. logit_bias, min_tokens (ban EOS/stop ids), repetition, presence and frequency penalties;
     then the structured-output grammar: tokens it forbids become -inf;
  3. greedy rows: argmax;
  4. random rows: temperature, top_k, min_p, then the exponential race argmax(probs / q),
     q ~ Exp(1) drawn from the request's own generator; top_p is then enforced on the
     race's winner, sorting only the rows whose winner fell outside the nucleus (the result
     is the same as filtering before the race).
  5. rows with a forced token (a spent reasoning budget writing the end of the thinking part,
     engine/thinking.py) have it overwrite what they drew: their logits are never masked, so their
     logprobs are what the model gave the token, and no other stage (min_tokens, a logit_bias)
     can keep it from being written.

Speculative decoding (engine/spec_decode.py) gives a request with k drafts k + 1 rows (see
SamplingMetadata). Stages 1-2 run per row as usual; then each row gets the token the request
emits at that position: greedy, the argmax (a draft is accepted when it equals it, so the
output is exactly greedy decoding's); random, rejection sampling against the draft as a point
mass q: drafts[j] is kept with probability min(1, p(x) / q(x)) = p(drafts[j]), else the token
is drawn from normalize(max(0, p - q)), i.e. p without the draft; the last row draws from p.
The output is distributed as the target's (Leviathan et al. 2023). The request keeps its
drafts up to the first row whose token differs from its draft, and that row's token.

The caller's logits are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenway import native
from tokenway.engine.sampling_metadata import SamplingMetadata
from tokenway.frontend.structured_output import GrammarBitmask, allowed_tokens
from tokenway.protocol.outputs import TokenLogprob


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None where the request did not ask for logprobs
    # Per request, how many of its drafts were accepted (rows start..start + n are its new
    # tokens); None when no request had drafts (then row i is request i's one new token).
    num_accepted_tokens: list[int] | None = None


class Sampler:
    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, grammar_bitmask: GrammarBitmask | None = None
    ) -> SamplerOutput:
        """logits: (num_rows, vocab_size), float32 or bf16, in from_requests order (one row per
        request, plus one per draft). grammar_bitmask: the allowed tokens of the requests under a
        structured-output grammar (by request; such a request has no drafts, so one row)."""
        md = metadata
        assert logits.shape == (md.num_rows, md.vocab_size), f"logits {tuple(logits.shape)} do not match metadata"
        needs_processing = md.needs_processing or grammar_bitmask is not None
        if md.all_greedy and not needs_processing and md.logprob_row_ids is None:
            # The common path. No float32 cast: it is exact, so the argmax would not change.
            greedy_ids = argmax_rows(logits)
            if md.forced_tokens is not None:
                greedy_ids[md.forced_tokens[0]] = md.forced_tokens[1]
            token_ids = greedy_ids.tolist()
            return SamplerOutput(token_ids, [None] * md.num_rows, _count_accepted(token_ids, md))

        model_logits = logits
        logits = logits.to(torch.float32).contiguous()  # (num_rows, vocab); a no-op when already so
        raw_logprobs = None
        if md.logprob_row_ids is not None:
            rows = logits if len(md.logprob_row_ids) == md.num_rows else logits[md.logprob_row_ids]
            raw_logprobs = rows.log_softmax(dim=-1)  # (num_logprob_rows, vocab)
        if needs_processing:
            # Processing works in place, so it needs a copy unless the cast above made one.
            logits = logits if logits.data_ptr() != model_logits.data_ptr() else logits.clone()
        if md.needs_processing:
            logits = process_logits(logits, md)
        if grammar_bitmask is not None:
            if md.request_row_starts is not None:
                grammar_bitmask = replace(grammar_bitmask, row_ids=md.request_row_starts[grammar_bitmask.row_ids])
            apply_grammar_bitmask(logits, grammar_bitmask)

        token_ids = _sample(logits, md)  # (num_rows,) int64
        if md.forced_tokens is not None:
            token_ids[md.forced_tokens[0]] = md.forced_tokens[1]
        logprobs: list[TokenLogprob | None] = [None] * md.num_rows
        if raw_logprobs is not None:
            _fill_logprobs(logprobs, raw_logprobs, token_ids, md)
        sampled_token_ids = token_ids.tolist()
        return SamplerOutput(sampled_token_ids, logprobs, _count_accepted(sampled_token_ids, md))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(num_rows, vocab) -> (num_rows,) int64, torch.argmax's answers (the first of equal values,
    the first NaN); the native kernel for float32 on the CPU (csrc/fused.cpp: ~10x torch's)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous() and logits.shape[1]:
        ops = native.load("fused")
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Applies logit_bias, min_tokens and the penalties. Modifies logits (num_rows, vocab), contiguous."""
    flat = logits.view(-1)  # flat indices are row * vocab_size + token_id
    if md.logit_bias is not None:
        flat.index_add_(0, *md.logit_bias)
    if md.min_tokens_index is not None:
        flat.index_fill_(0, md.min_tokens_index, float("-inf"))
    if md.output_token_index is None:
        return logits

    counts = torch.zeros_like(flat)  # how often each token appears in each row's output
    counts.scatter_add_(0, md.output_token_index, torch.ones(len(md.output_token_index)))
    counts = counts.view_as(logits)  # (num_rows, vocab)
    output_seen = counts > 0
    if md.repetition_penalties is not None:
        # CTRL / HF: every token seen in the prompt or output moves towards "less likely",
        # whatever its sign: positive logits are divided by the penalty, negative multiplied.
        seen = torch.zeros_like(flat, dtype=torch.bool)
        seen[md.prompt_token_index] = True
        seen = seen.view_as(logits) | output_seen
        penalty = md.repetition_penalties  # (num_rows, 1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    # OpenAI: output tokens only.
    if md.frequency_penalties is not None:
        logits -= md.frequency_penalties * counts
    if md.presence_penalties is not None:
        logits -= md.presence_penalties * output_seen
    return logits


def apply_grammar_bitmask(logits: torch.Tensor, grammar_bitmask: GrammarBitmask) -> None:
    """Sets the logits of the tokens each grammar row forbids to -inf. Modifies logits (num_rows, vocab)."""
    row_ids = grammar_bitmask.row_ids
    forbidden = ~allowed_tokens(grammar_bitmask.bitmask, logits.shape[1])  # (num_grammar_rows, vocab)
    if len(row_ids) == logits.shape[0]:  # every row: no gather and scatter
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits[row_ids] = logits[row_ids].masked_fill_(forbidden, float("-inf"))


def _count_accepted(token_ids: list[int], md: SamplingMetadata) -> list[int] | None:
    """Per request with rows from md.spec_token_ids: its leading drafts that equal the tokens of
    their rows (greedy: the argmax; random: rejection sampling only keeps a draft as its token)."""
    if md.spec_token_ids is None:
        return None
    assert md.request_row_starts is not None
    num_accepted = []
    for start, drafts in zip(md.request_row_starts.tolist(), md.spec_token_ids):
        n = 0
        while n < len(drafts) and token_ids[start + n] == drafts[n]:
            n += 1
        num_accepted.append(n)
    return num_accepted


def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logits: (num_rows, vocab) processed. Returns (num_rows,) int64 token ids."""
    if md.all_greedy:
        return argmax_rows(logits)
    sample_random = _sample_random if md.row_draft_token_ids is None else _verify_random
    if md.random_row_ids is None:
        return sample_random(logits, md)
    token_ids = argmax_rows(logits)
    token_ids[md.random_row_ids] = sample_random(logits[md.random_row_ids], md)
    return token_ids


def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logits: (num_random, vocab). Never modified: every step below that could is out of place."""
    probs = _probs(logits, md)

    # Exponential race: argmax(probs / q) with q ~ Exp(1) is a draw from probs (unnormalised
    # is fine). q = -log(u), u ~ U[0, 1), because uniform_ is ~7x faster than exponential_ on
    # CPU; then argmax(probs / q) = argmax(log(u) / probs). Each row draws from its own
    # generator only, so a seeded request samples the same tokens in any batch.
    # Tokens with prob 0 get log(u) / 0 = -inf and can never win.
    keys = torch.empty_like(probs)  # (num_random, vocab)
    for row, generator in enumerate(md.generators):
        keys[row].uniform_(generator=generator)
    keys = keys.log_().div_(probs)
    token_ids = argmax_rows(keys)  # (num_random,)
    if md.top_ps is not None:
        _restrict_to_nucleus(token_ids, keys, probs, md.top_ps)
    return token_ids


def _verify_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Rejection sampling of the random rows (num_random, vocab) against their drafts (see the
    module docstring); rows without a draft draw from p. Returns (num_random,) int64."""
    assert md.row_draft_token_ids is not None
    probs = _probs(logits, md)  # (num_random, vocab), unnormalised
    if md.top_ps is not None:
        _mask_outside_nucleus(probs, md.top_ps)
    probs.div_(probs.sum(dim=-1, keepdim=True))
    drafts = md.row_draft_token_ids if md.random_row_ids is None else md.row_draft_token_ids[md.random_row_ids]
    draft_rows = (drafts >= 0).nonzero().squeeze(1)  # (num_drafted,)
    draft_ids = drafts[draft_rows].unsqueeze(1)  # (num_drafted, 1)
    keys = torch.empty_like(probs)  # (num_random, vocab)
    uniforms = torch.empty(len(drafts))  # (num_random,)
    for row, generator in enumerate(md.generators):
        keys[row].uniform_(generator=generator)
        uniforms[row : row + 1].uniform_(generator=generator)
    accepted = torch.zeros(len(drafts), dtype=torch.bool)
    accepted[draft_rows] = uniforms[draft_rows] < probs[draft_rows].gather(1, draft_ids).squeeze(1)
    # On rejection, the residual max(0, p - q) is p without the draft (the race needs no normalising).
    probs[draft_rows] = probs[draft_rows].scatter_(1, draft_ids, 0.0)
    token_ids = argmax_rows(keys.log_().div_(probs))  # (num_random,)
    return torch.where(accepted, drafts, token_ids)


def _mask_outside_nucleus(probs: torch.Tensor, top_ps: torch.Tensor) -> None:
    """Zeroes, in place, the tokens outside each row's nucleus (the smallest set of most likely
    tokens with mass >= top_p, ties at its edge kept): the set _restrict_to_nucleus races over."""
    rows = (top_ps < 1.0).nonzero().squeeze(1)
    if len(rows) == 0:
        return
    sorted_probs = probs[rows].sort(dim=-1, descending=True).values  # (num_rows, vocab)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    num_kept = (mass_before < top_ps[rows].unsqueeze(1)).count_nonzero(dim=-1).clamp_(min=1)
    floor = sorted_probs.gather(1, (num_kept - 1).unsqueeze(1))  # (num_rows, 1)
    probs[rows] = probs[rows].masked_fill_(probs[rows] < floor, 0.0)


def _probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """(num_random, vocab) logits -> probabilities after temperature, top_k and min_p; unnormalised
    where min_p zeroed tokens. A new tensor: logits are never modified."""
    if md.temperatures is not None:
        logits = logits / md.temperatures
    if md.top_ks is not None:
        # The k-th largest logit is each row's floor (ties with it stay). topk(max k) is far
        # cheaper than a full sort.
        kth_largest = logits.topk(md.max_top_k, dim=-1).values  # (num_random, max_top_k)
        floor = kth_largest.gather(1, (md.top_ks.clamp(min=1) - 1).unsqueeze(1))  # (num_random, 1)
        floor.masked_fill_(md.top_ks.unsqueeze(1) == 0, float("-inf"))
        logits = logits.masked_fill(logits < floor, float("-inf"))
    probs = logits.softmax(dim=-1)  # (num_random, vocab); renormalised over the top-k
    if md.min_ps is not None:
        floor = md.min_ps * probs.amax(dim=-1, keepdim=True)  # (num_random, 1)
        probs.masked_fill_(probs < floor, 0.0)
    return probs


def _restrict_to_nucleus(
    token_ids: torch.Tensor, keys: torch.Tensor, probs: torch.Tensor, top_ps: torch.Tensor
) -> None:
    """Top-p without sorting every row: rewrites token_ids (num_random,) in place.

    The nucleus is the smallest set of most likely tokens with mass >= top_p (so the top
    token always stays). The race winner over the nucleus is the race winner over everything
    whenever that winner lies inside the nucleus, i.e. when the mass of tokens more likely
    than it is below top_p. That holds for about top_p of the rows; only the rest are sorted,
    and their race is rerun on the same keys, so the result equals masking first and racing
    after. min_p zeroed only tokens less likely than any surviving winner: masses are unchanged.
    """
    winner_probs = probs.gather(1, token_ids.unsqueeze(1))  # (num_random, 1)
    above_winner = probs > winner_probs  # (num_random, vocab)
    mass_above = torch.where(above_winner, probs, 0.0).sum(dim=-1)  # (num_random,)
    # A winner with nothing above it is the top token: always inside, whatever top_p is.
    outside = ((mass_above >= top_ps) & (mass_above > 0) & (top_ps < 1.0)).nonzero().squeeze(1)  # (num_outside,)
    if len(outside) == 0:
        return
    rows = probs[outside]  # (num_outside, vocab)
    # The tokens above an outside winner already reach top_p, so they hold the whole nucleus:
    # a partial sort of that many is enough, and much cheaper when the distribution is peaked.
    num_candidates = int(above_winner[outside].count_nonzero(dim=-1).max())
    sorted_probs = rows.topk(num_candidates, dim=-1).values  # (num_outside, num_candidates), descending
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive prefix sums
    num_kept = (mass_before < top_ps[outside].unsqueeze(1)).count_nonzero(dim=-1)  # (num_outside,)
    # The top token always stays, even when top_p underflows float32 (5e-324 becomes 0).
    num_kept.clamp_(min=1)
    floor = sorted_probs.gather(1, (num_kept - 1).unsqueeze(1))  # (num_outside, 1)
    token_ids[outside] = keys[outside].masked_fill_(rows < floor, float("-inf")).argmax(dim=-1)


def _fill_logprobs(
    logprobs: list[TokenLogprob | None], raw_logprobs: torch.Tensor, token_ids: torch.Tensor, md: SamplingMetadata
) -> None:
    """raw_logprobs: (num_logprob_rows, vocab) log_softmax of the raw logits; token_ids: (num_rows,)."""
    assert md.logprob_row_ids is not None
    chosen_ids = token_ids[md.logprob_row_ids].unsqueeze(1)  # (num_logprob_rows, 1)
    chosen = raw_logprobs.gather(1, chosen_ids)  # (num_logprob_rows, 1)
    # rank = 1 + number of strictly more likely tokens. When the chosen token is in the top list,
    # every more likely token is too, so the count needs only the list; the other rows (a
    # sampled long shot, or k = 0) count over the whole vocabulary.
    top = raw_logprobs.topk(max(md.max_num_logprobs, 1), dim=-1)  # (num_logprob_rows, k), most likely first
    ranks = (top.values > chosen).sum(dim=-1) + 1  # (num_logprob_rows,)
    far_rows = (top.indices != chosen_ids).all(dim=-1).nonzero().squeeze(1)
    if len(far_rows) > 0:
        ranks[far_rows] = (raw_logprobs[far_rows] > chosen[far_rows]).count_nonzero(dim=-1) + 1
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    rows = zip(md.logprob_row_ids.tolist(), chosen_ids.squeeze(1).tolist(), chosen.squeeze(1).tolist(), ranks.tolist())
    for i, (row, token_id, logprob, rank) in enumerate(rows):
        k = md.num_logprobs[row]
        assert k is not None
        logprobs[row] = TokenLogprob(token_id, logprob, rank, list(zip(top_ids[i][:k], top_values[i][:k])))
