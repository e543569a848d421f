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
        """Stage -> milliseconds. A stage never reached counts as 0, and a missing mark
        takes the previous one's time, so the sum is always done - received."""
        marks = [self.received, self.validated, self.submitted, self.scheduled, self.first_token,
                 self.last_token, self.done if self.done is not None else time.monotonic()]
        filled = []
        previous = marks[0]
        for value in marks:
            previous = previous if value is None else max(value, previous)
            filled.append(previous)
        return {stage: (filled[i + 1] - filled[i]) * 1000 for i, stage in enumerate(STAGES)}

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else (self.first_token - self.received) * 1000

    def server_timing(self) -> str:
        """The Server-Timing header value: `gateway;dur=0.41, tokenize;dur=0.22, ...`."""
        parts = [f"{stage};dur={ms:.2f}" for stage, ms in self.durations_ms().items()]
        total = (self.done or time.monotonic()) - self.received
        parts.append(f"total;dur={total * 1000:.2f}")
        return ", ".join(parts)
