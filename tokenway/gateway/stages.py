"""StageClock: where one request's time went, stage by stage.

Every stage is the interval between two marks on one clock (time.monotonic, the clock
the engine stamps its requests with), so the stages add up to the end-to-end time:

    received ─gateway─► validated ─tokenize─► submitted ─queue─► scheduled
             ─prefill─► first token ─decode─► last token ─postprocess─► done
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STAGES = ("gateway", "tokenize", "queue", "prefill", "decode", "postprocess")


@dataclass(slots=True)
class StageClock:
    received: float = field(default_factory=time.monotonic)
    validated: float | None = None
    submitted: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    done: float | None = None

    def mark(self, name: str, at: float | None = None) -> None:
        setattr(self, name, time.monotonic() if at is None else at)

    def durations_ms(self) -> dict[str, float]:
        """Stage -> milliseconds, adding up to done - received. A mark that was skipped gives
        its stage 0 ms (the time counts to the next stage reached); time after the last mark
        reached counts to the stage that was under way (e.g. gateway, for a request refused there)."""
        marks = [self.received, self.validated, self.submitted, self.scheduled, self.first_token, self.last_token]
        done = self.done if self.done is not None else time.monotonic()
        last_reached = max(i for i, value in enumerate(marks) if value is not None)
        durations = dict.fromkeys(STAGES, 0.0)
        previous = marks[0]
        for i in range(1, last_reached + 1):
            if marks[i] is not None:
                value = max(marks[i], previous)
                durations[STAGES[i - 1]] = (value - previous) * 1000
                previous = value
        durations[STAGES[last_reached]] = max(0.0, done - previous) * 1000
        return durations

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else (self.first_token - self.received) * 1000

    def server_timing(self) -> str:
        """The Server-Timing header value: `gateway;dur=0.41, tokenize;dur=0.22, ...`."""
        parts = [f"{stage};dur={ms:.2f}" for stage, ms in self.durations_ms().items()]
        total = (self.done or time.monotonic()) - self.received
        parts.append(f"total;dur={total * 1000:.2f}")
        return ", ".join(parts)
