"""Turn engine token ids into what a caller sees: text, stop strings, logprobs.

One RequestState per request, fed each step's EngineOutput. The detokenizer is the
tokenizers library's DecodeStream, which never yields half a UTF-8 character. Stop
strings are matched on the decoded text; text that could still be the start of a stop
string is held back, so a stop string is never emitted, even across tokens. A step may bring
several tokens (speculative decoding): they are matched one by one, and those after the one
that completes a stop string are dropped, as if never generated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from tokenizers.decoders import DecodeStream

from tokenway.frontend.tokenizer import Tokenizer
from tokenway.protocol.outputs import EngineOutput, TokenLogprob
from tokenway.protocol.sampling import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # everything released so far
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""  # released by the latest step
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """time.monotonic() stamps, taken in the engine thread as things happen."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_reason: str | None = None  # why the prefix cache stopped there (kv_cache/manager.py)
    metrics: RequestMetrics | None = None


def hold_back_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.decoded = ""  # all text decoded so far
        self.num_released = 0  # chars of `decoded` handed to the caller
        self.output = CompletionOutput(index, "", [], logprobs=[] if params.logprobs is not None else None)
        self.num_cached_tokens = 0
        self.cache_reason: str | None = None
        self.finished = False
        self.metrics = RequestMetrics()

    def process(self, engine_output: EngineOutput) -> RequestOutput:
        """Fold in one step. If a stop string matched, the result is finished with
        finish_reason "stop" and the caller must finish the request in the engine."""
        out = self.output
        self.num_cached_tokens = engine_output.num_cached_tokens
        self.cache_reason = engine_output.cache_reason
        metrics = self.metrics
        metrics.arrival_time = engine_output.arrival_time
        metrics.first_scheduled_time = engine_output.first_scheduled_time
        if engine_output.new_token_ids:
            now = time.monotonic()
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        stops = self.params.stop
        # Search only where a new match can start: the unreleased tail plus overlap.
        search_from = max(0, self.num_released - max(len(s) for s in stops) + 1) if stops else 0
        new_token_ids = engine_output.new_token_ids
        match = None
        for index, token_id in enumerate(new_token_ids):
            # A stop token is no text (kept with skip_special_tokens false, EOS would be).
            if (token_id in self.params.stop_token_ids or token_id in self.tokenizer.eos_token_ids) \
                    and not self.params.include_stop_str_in_output:
                continue
            piece = self.stream.step(self.tokenizer.hf, token_id)
            if piece:
                self.decoded += piece
                if stops:
                    match = min(((position, stop) for stop in stops
                                 if (position := self.decoded.find(stop, search_from)) >= 0), default=None)
                    if match is not None:
                        new_token_ids = new_token_ids[: index + 1]
                        break
        out.delta_token_ids = list(new_token_ids)
        out.token_ids.extend(new_token_ids)
        if out.logprobs is not None and engine_output.new_logprobs:
            out.logprobs.extend(engine_output.new_logprobs[: len(new_token_ids)])

        releasable = len(self.decoded)
        finish_reason, stop_reason = engine_output.finish_reason, engine_output.stop_reason
        if stops:
            if match is not None:
                position, stop = match
                releasable = position + (len(stop) if self.params.include_stop_str_in_output else 0)
                self.decoded = self.decoded[:releasable]
                finish_reason, stop_reason = "stop", stop
            elif finish_reason is None:
                releasable -= hold_back_length(self.decoded, stops)
        releasable = max(releasable, self.num_released)
        out.delta_text = self.decoded[self.num_released : releasable]
        self.num_released = releasable
        out.text = self.decoded[:releasable]
        if finish_reason is not None:
            out.finish_reason, out.stop_reason = finish_reason, stop_reason
            self.finished = True
        # A snapshot: the caller may read it on another thread while the next step runs.
        snapshot = replace(
            out,
            token_ids=list(out.token_ids),
            logprobs=list(out.logprobs) if out.logprobs is not None else None,
            delta_token_ids=list(out.delta_token_ids),
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [snapshot],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            cache_reason=self.cache_reason,
            metrics=replace(metrics),
        )
