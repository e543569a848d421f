"""The tool loop: ask the model, run the tools it calls, give it the results, until it answers
or a cap stops the loop, and say which.

    result = await run_tool_loop(chat, {"model": "m", "messages": [...]}, [get_weather, *mcp_tools],
                                 Limits(max_rounds=6, max_seconds=60, max_cost=0.05), price=price)
    result.stop_reason     # "answered" | "length" | "content_filter" | "max_rounds" | "max_tokens"
                           #  | "max_cost" | "max_seconds"
    result.reply, result.messages, result.runs, result.usage, result.cost

`chat` is a ResilientChat (retries and failover per model call) or an openai.AsyncOpenAI.
One round is one model call and the tools it asked for, run concurrently (at most
max_parallel at a time, each within tool_timeout). Every call gets a result message, so the
conversation stays valid: a call the model made wrong gets its error (tools.py), and calls
left when a cap stops the loop get "not run" with the cap's name, so a caller may resume from
result.messages. Caps are checked after every round; max_seconds also bounds the calls in
flight. Tool results are untrusted text: with `spotlight` (tokenway.client.untrusted) each
result is marked and scanned before the model reads it, the spotlight's rule joins the system
prompt, and each run keeps its finding (`result.flagged` lists the runs whose result looked
like instructions); `wrap_result(text, source) -> str` is the hook for marking of your own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenway.client.counting import Price
from tokenway.client.injection import Finding
from tokenway.client.tools import Tool, ToolOutcome
from tokenway.client.untrusted import Spotlight, with_rule

STOP_REASONS = ("answered", "length", "content_filter", "max_rounds", "max_tokens", "max_cost", "max_seconds")


@dataclass(frozen=True, slots=True)
class Limits:
    max_rounds: int = 8  # model calls
    max_tokens: int | None = None  # prompt + completion tokens over all rounds
    max_cost: float | None = None  # USD over all rounds (needs a price)
    max_seconds: float | None = None  # wall time of the whole loop
    max_parallel: int = 8  # tools running at once
    tool_timeout: float | None = 60.0

    def __post_init__(self) -> None:
        if self.max_rounds < 1 or self.max_parallel < 1:
            raise ValueError("max_rounds, max_parallel: must be >= 1")


@dataclass(frozen=True, slots=True)
class ToolRun:
    round: int
    call_id: str
    name: str
    arguments: str
    outcome: ToolOutcome
    seconds: float
    finding: Finding | None = None  # the scan of the result, when a spotlight marked it
    dropped: bool = False  # withheld from the model by the spotlight's policy


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class LoopResult:
    stop_reason: str
    reply: str | None  # the last assistant text (the answer, when stop_reason is "answered")
    messages: tuple[dict[str, Any], ...]  # the conversation, the calls and their results included
    rounds: int
    runs: tuple[ToolRun, ...]
    usage: Usage
    cost: float | None  # None without a price
    seconds: float

    @property
    def flagged(self) -> tuple[ToolRun, ...]:
        """The runs whose result looked like instructions to the model."""
        return tuple(run for run in self.runs if run.finding is not None and run.finding.flagged)


@dataclass
class _Totals:
    usage: Usage = field(default_factory=Usage)

    def add(self, usage: Any) -> None:
        if usage is None:
            return
        details = getattr(usage, "prompt_tokens_details", None)
        cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
        self.usage = Usage(self.usage.prompt_tokens + usage.prompt_tokens,
                           self.usage.completion_tokens + usage.completion_tokens, self.usage.cached_tokens + cached)


async def run_tool_loop(chat: Any, request: dict[str, Any], tools: Sequence[Tool], limits: Limits = Limits(), *,
                        price: Price | None = None, spotlight: Spotlight | None = None,
                        wrap_result: Callable[[str, str], str] | None = None,
                        reset_tool_choice: bool = True) -> LoopResult:
    """reset_tool_choice: after a round that called tools, a tool_choice of "required" or a
    named tool becomes "auto" (as the OpenAI Agents SDK does), so the model can answer rather
    than call again and again."""
    by_name = {t.name: t for t in tools}
    if len(by_name) != len(tools):
        raise ValueError("tools: two tools have the same name")
    if limits.max_cost is not None and price is None:
        raise ValueError("max_cost: needs a price (tokenway.client.price_of)")
    if spotlight is not None and wrap_result is not None:
        raise ValueError("spotlight, wrap_result: give one of them")
    create = chat.create if hasattr(chat, "create") else chat.chat.completions.create
    request = {**request, "tools": [*(request.get("tools") or ()), *(t.spec() for t in tools)]}
    messages = list(request["messages"]) if spotlight is None else with_rule(request["messages"], spotlight)
    started, totals, runs = time.monotonic(), _Totals(), []
    semaphore = asyncio.Semaphore(limits.max_parallel)

    def remaining() -> float | None:
        return None if limits.max_seconds is None else limits.max_seconds - (time.monotonic() - started)

    def over_cap(rounds: int) -> str | None:
        cost = price.cost(totals.usage.prompt_tokens, totals.usage.completion_tokens,
                          totals.usage.cached_tokens) if price else None
        if limits.max_tokens is not None and totals.usage.total_tokens >= limits.max_tokens:
            return "max_tokens"
        if limits.max_cost is not None and cost is not None and cost >= limits.max_cost:
            return "max_cost"
        if (left := remaining()) is not None and left <= 0:
            return "max_seconds"
        return "max_rounds" if rounds >= limits.max_rounds else None

    def result(stop_reason: str, rounds: int, reply: str | None) -> LoopResult:
        usage = totals.usage
        cost = price.cost(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if price else None
        return LoopResult(stop_reason, reply, tuple(messages), rounds, tuple(runs), usage, cost,
                          time.monotonic() - started)

    async def run_one(round_: int, call: Any) -> tuple[Any, ToolOutcome, float]:
        begun = time.monotonic()
        chosen = by_name.get(call.function.name)
        if chosen is None:
            outcome = ToolOutcome(f"Error: there is no tool named {call.function.name!r}; the tools are: "
                                  f"{', '.join(by_name)}.", "unknown_tool")
        else:
            async with semaphore:
                left = remaining()
                timeout = limits.tool_timeout if left is None else min(limits.tool_timeout or left, left)
                outcome = await chosen.invoke(call.function.arguments, timeout=max(timeout, 0.001)
                                              if timeout is not None else None)
        return call, outcome, time.monotonic() - begun

    reply: str | None = None
    rounds = 0
    while True:
        rounds += 1
        try:
            async with asyncio.timeout(remaining()):
                response = await create(**{**request, "messages": messages})
        except TimeoutError:
            return result("max_seconds", rounds, reply)
        totals.add(response.usage)
        choice = response.choices[0]
        message = choice.message
        reply = message.content
        calls = list(message.tool_calls or ())
        messages.append(_assistant_message(message, calls))
        if not calls:
            stop = {"tool_calls": "answered", "stop": "answered"}.get(choice.finish_reason, choice.finish_reason)
            return result(stop if stop in STOP_REASONS else "answered", rounds, reply)
        cap = over_cap(rounds)
        if cap is not None:  # the calls made are answered "not run", so the conversation stays valid
            for call in calls:
                outcome = ToolOutcome(f"Not run: the tool loop stopped ({cap}).", "not_run")
                runs.append(ToolRun(rounds, call.id, call.function.name, call.function.arguments, outcome, 0.0))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": outcome.text})
            return result(cap, rounds, reply)
        try:
            async with asyncio.timeout(remaining()):
                done = await asyncio.gather(*(run_one(rounds, call) for call in calls))
        except TimeoutError:
            done = [(call, ToolOutcome("Not run: the tool loop stopped (max_seconds).", "timeout"), 0.0)
                    for call in calls]
        for call, outcome, seconds in done:
            source, text, marked = f"tool:{call.function.name}", outcome.text, None
            if outcome.error is None and spotlight is not None:  # our own error texts are not untrusted
                marked = spotlight.mark(outcome.text, source)
                text = marked.text
            elif outcome.error is None and wrap_result is not None:
                text = wrap_result(outcome.text, source)
            runs.append(ToolRun(rounds, call.id, call.function.name, call.function.arguments, outcome, seconds,
                                marked and marked.finding, bool(marked and marked.dropped)))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        if (left := remaining()) is not None and left <= 0:
            return result("max_seconds", rounds, reply)
        if reset_tool_choice and request.get("tool_choice") not in (None, "auto", "none"):
            request["tool_choice"] = "auto"


def _assistant_message(message: Any, calls: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in calls]
    return out
