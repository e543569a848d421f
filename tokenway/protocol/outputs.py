"""What the engine hands back per step, as plain values: the scheduler makes an EngineOutput for
each request that advanced, the frontend (frontend/output.py) detokenizes it, and a worker
process sends it over the wire. No torch: the sides that read these never load the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one sampled token under the model, with its top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass(slots=True)
class EngineOutput:
    """New tokens for one request from one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cache_reason: str | None = None
    arrival_time: float = 0.0  # time.monotonic() clock, as on the Request
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
