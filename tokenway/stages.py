"""StageClock: where one request's time went, stage by stage.

Every stage ends at a mark on one clock (time.monotonic, the clock the engine stamps its
requests with), so the stages add up to the end-to-end time exactly:

    received ─auth─► key checked ─validation─► body parsed ─routing─► model resolved
      ─safety─► input screened ─tokenize─► prompt ready ─guard─► a guard model's verdict
      ─limits─► admitted ─queue─► first scheduled
      ─prefill─► first token ─decode─► last token ─postprocess─► response built
      ─billing─► done (ledger row committed, the last byte handed to the server)

`received` is when the ASGI app first sees the request (uvicorn has parsed its headers;
the socket accept itself is not visible to an ASGI app).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STAGES = ("auth", "validation", "routing", "safety", "tokenize", "guard", "limits", "queue", "prefill", "decode",
          "postprocess", "billing")
_STAGE_INDEX = {stage: i for i, stage in enumerate(STAGES)}
# Stages a call may pass without running: each is marked when it ran (before any refusal it
# makes), so time after the last mark is never theirs.
_OPTIONAL_STAGES = frozenset({"safety", "guard"})


def _stage_under_way(after: int) -> str:
    """The stage under way once stage index `after - 1` was the last marked: the next one that
    is not optional (the last stage, billing, at the end)."""
    index = after
    while index < len(STAGES) - 1 and STAGES[index] in _OPTIONAL_STAGES:
        index += 1
    return STAGES[min(index, len(STAGES) - 1)]


# last marked stage's index + 1 (0: none marked) -> the stage the time after it counts to
_UNDER_WAY = tuple(_stage_under_way(after) for after in range(len(STAGES) + 1))
# The Server-Timing value, every stage in STAGES order and the total: one format, not one a stage.
_SERVER_TIMING = ", ".join(f"{stage};dur=%.2f" for stage in (*STAGES, "total"))


@dataclass(slots=True)
class StageClock:
    received: float = field(default_factory=time.monotonic)
    ends: dict[str, float] = field(default_factory=dict)  # stage -> when it ended
    billing_started: float | None = None
    done: float | None = None

    def end(self, stage: str, at: float | None = None) -> None:
        """Mark the end of `stage` (now, or at a monotonic time taken elsewhere)."""
        assert stage in _STAGE_INDEX, stage
        self.ends[stage] = time.monotonic() if at is None else at

    def ended(self, stage: str) -> bool:
        return stage in self.ends

    def start_billing(self) -> None:
        if self.billing_started is None:
            self.billing_started = time.monotonic()

    def finish(self) -> None:
        if self.done is None:
            self.done = time.monotonic()

    def durations_ms(self) -> dict[str, float]:
        """Stage -> milliseconds, adding up to done - received (now, if not done yet).

        A stage never marked gets 0 ms (its time counts to the next stage that was). The
        time after the last mark counts to the stage under way: the one after the last
        stage marked, optional stages (safety, guard) passed over (limits, for a request
        refused with a 429); billing, once started, takes the time from its start to done."""
        done = self.done if self.done is not None else time.monotonic()
        cut = self.billing_started if self.billing_started is not None else done
        ends = self.ends
        durations: dict[str, float] = {}
        previous = self.received
        last_index = -1
        for index, stage in enumerate(STAGES):  # in stage order, whatever order they were marked in
            at = ends.get(stage)
            if at is None:
                durations[stage] = 0.0
                continue
            if at < previous:
                at = previous
            if at > cut:
                at = cut
            durations[stage] = (at - previous) * 1000
            previous, last_index = at, index
        durations[_UNDER_WAY[last_index + 1]] += (cut - previous) * 1000
        if self.billing_started is not None and done > cut:
            durations["billing"] += (done - cut) * 1000
        return durations

    @property
    def total_ms(self) -> float:
        return ((self.done if self.done is not None else time.monotonic()) - self.received) * 1000

    @property
    def ttft_ms(self) -> float | None:
        first_token = self.ends.get("prefill")
        return None if first_token is None else (first_token - self.received) * 1000

    def server_timing(self) -> str:
        """The Server-Timing header value: `auth;dur=0.04, validation;dur=0.22, ...`, as of now."""
        durations = self.durations_ms()  # every stage, in STAGES order
        return _SERVER_TIMING % (*durations.values(), sum(durations.values()))
