"""Fitting a chat request into the model's window, with its output reserved.

    fitted, report = fit(request, counter, window=8192, max_tokens=512, strategy="drop_oldest")

The messages are cut in units that are never split: the system prompt (never dropped), and
each turn, where an assistant message that called tools goes with every tool result that
answers it. The last unit (the turn being asked) is always kept. Strategies:

    drop_oldest            drop the oldest units until the request fits
    sliding_window         keep at most `keep_last` units, then drop the oldest as needed
    keep_first_and_recent  keep the first unit (the task, as first stated) and the most recent
    summarize              replace the dropped units by one message summarising them, written
                           by `summarize(messages) -> str` (e.g. a call to a cheaper model)

Counting is the counter's (tokenway.client.counting): exact for tokenway's models. The number
of units dropped is searched for from an estimate (each unit's share of the characters),
galloping then bisecting, so it usually costs two or three counts, O(log n) at worst.
`report` (a CutReport) says what was cut and what the prompt costs before and after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

STRATEGIES = ("drop_oldest", "sliding_window", "keep_first_and_recent", "summarize")
SUMMARY_PREFIX = "Summary of the earlier conversation: "


class Counter(Protocol):
    def count(self, request: Mapping[str, Any]) -> int: ...


class ContextTooSmall(ValueError):
    """Even the system prompt and the last turn do not fit the budget."""


@dataclass(frozen=True, slots=True)
class CutReport:
    strategy: str
    budget: int  # prompt tokens allowed: the window less the output reserved
    # None: over the window, where the counter counts no further; or not counted, where the
    # `previous` cut given to fit showed the conversation over the budget already.
    prompt_tokens_before: int | None
    prompt_tokens_after: int
    dropped: tuple[int, ...] = ()  # indexes, in the original messages, of the messages cut
    summarized: bool = False  # the dropped messages are in a summary message (strategy summarize)
    num_messages: int = 0  # the messages it was given (a later fit's `previous` reads how many are new)

    @property
    def cut(self) -> bool:
        return bool(self.dropped)


def units_of(messages: Sequence[Any]) -> tuple[list[int], list[list[int]]]:
    """(the leading system messages' indexes, the other messages' indexes grouped into turns:
    a tool call and its results are one unit)."""
    pinned, units = [], []
    position = 0
    while position < len(messages) and role_of(messages[position]) in ("system", "developer"):
        pinned.append(position)
        position += 1
    while position < len(messages):
        unit = [position]
        if role_of(messages[position]) == "assistant" and field_of(messages[position], "tool_calls"):
            while position + 1 < len(messages) and role_of(messages[position + 1]) == "tool":
                position += 1
                unit.append(position)
        units.append(unit)
        position += 1
    return pinned, units


def fit(request: Mapping[str, Any], counter: Counter, *, window: int, max_tokens: int,
        strategy: str = "drop_oldest", keep_last: int | None = None,
        summarize: Callable[[list[Any]], str] | None = None,
        previous: CutReport | None = None) -> tuple[dict[str, Any], CutReport]:
    """The request with its messages cut to fit `window - max_tokens` prompt tokens (and
    max_tokens set), and what was cut. Raises ContextTooSmall if nothing can make it fit.

    previous: this conversation's last report, its messages then a prefix of these. A
    conversation cut before has only grown, so it is not counted whole again, and the search
    starts at the turns dropped then: a call of a long conversation costs two counts."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "summarize" and summarize is None:
        raise ValueError("summarize: the summarize strategy needs a summarize(messages) -> str callable")
    budget = window - max_tokens
    messages = list(request["messages"])
    pinned, units = units_of(messages)
    base = {**request, "max_tokens": max_tokens}
    # The units that may go, in the order they go.
    first = 1 if strategy == "keep_first_and_recent" and len(units) > 2 else 0
    candidates = list(range(first, len(units) - 1))
    dropped_before = _dropped_before(previous, strategy, budget, messages, units, candidates)
    before = None if dropped_before else count_or_none(counter, {**base, "messages": messages})

    def build(dropped_units: Sequence[int], summary: str | None = None) -> list[Any]:
        dropped = {i for u in dropped_units for i in units[u]}
        kept = [messages[i] for i in pinned]
        if summary is not None:
            kept.append({"role": "user", "content": SUMMARY_PREFIX + summary})
        return kept + [messages[i] for i in range(len(messages)) if i not in dropped and i not in pinned]

    forced = 0
    if strategy == "sliding_window" and keep_last is not None:
        forced = max(0, len(units) - keep_last - first)
        forced = min(forced, len(candidates))
    if before is not None and before <= budget and forced == 0:
        return {**base, "messages": messages}, CutReport(strategy, budget, before, before, num_messages=len(messages))

    counted: dict[int, int | None] = {} if forced or dropped_before else {0: before}  # units dropped -> tokens

    def tokens_without(num_dropped: int) -> int | None:
        if num_dropped not in counted:
            counted[num_dropped] = count_or_none(counter, {**base, "messages": build(candidates[:num_dropped])})
        return counted[num_dropped]

    def fits(num_dropped: int) -> bool:
        tokens = tokens_without(num_dropped)
        return tokens is not None and tokens <= budget

    guess = dropped_before or _guess(messages, units, candidates, before, budget, forced)
    num_dropped = least_true(fits, guess, forced, len(candidates))
    if num_dropped is None:
        if strategy != "summarize" or not candidates:  # with nothing to drop there is nothing to summarize
            tokens = tokens_without(len(candidates))
            need = f"{tokens} tokens" if tokens is not None else "more tokens than the window"
            raise ContextTooSmall(f"the system prompt and the last turn need {need}; the budget is {budget} "
                                  f"({window} in the window, {max_tokens} reserved for the output)")
        num_dropped = len(candidates)
    dropped_units = candidates[:num_dropped]
    summary = None
    if strategy == "summarize" and dropped_units:
        assert summarize is not None  # checked on entry
        # The summary takes room too: drop one more unit into it until the whole fits.
        while True:
            dropped_units = candidates[:num_dropped]
            summary = summarize([messages[i] for u in dropped_units for i in units[u]])
            tokens = count_or_none(counter, {**base, "messages": build(dropped_units, summary)})
            if tokens is not None and tokens <= budget:
                break
            if num_dropped == len(candidates):
                raise ContextTooSmall(f"with the summary the prompt needs {tokens} tokens; the budget is {budget}")
            num_dropped += 1
    kept = build(dropped_units, summary)
    after = tokens if summary is not None else tokens_without(num_dropped)
    assert after is not None  # counted, and within the budget
    dropped = tuple(i for u in dropped_units for i in units[u])
    return {**base, "messages": kept}, CutReport(strategy, budget, before, after, dropped, summary is not None,
                                                 len(messages))


def _dropped_before(previous: CutReport | None, strategy: str, budget: int, messages: Sequence[Any],
                   units: list[list[int]], candidates: list[int]) -> int:
    """Where to start the search from the previous cut: the units it dropped, and as many
    more as hold the characters added since (0: no previous cut to go on). Only a cut by the
    same strategy into no larger a budget says the whole is over it now; a summary changes
    what is counted, so it is not gone on."""
    if previous is None or not previous.dropped or previous.summarized or previous.strategy != strategy \
            or previous.budget < budget or previous.num_messages > len(messages):
        return 0
    gone = set(previous.dropped)
    num_dropped = 0
    while num_dropped < len(candidates) and all(i in gone for i in units[candidates[num_dropped]]):
        num_dropped += 1
    # Tokens per character of what the previous call kept; the new messages' tokens, so
    # estimated, must come off the units next in line.
    kept_chars = sum(_message_chars(messages[i]) for i in range(previous.num_messages) if i not in gone) or 1
    tokens_per_char = previous.prompt_tokens_after / kept_chars
    excess = previous.prompt_tokens_after - budget + tokens_per_char * sum(
        _message_chars(m) for m in messages[previous.num_messages:])
    while excess > 0 and num_dropped < len(candidates):
        excess -= tokens_per_char * sum(_message_chars(messages[i]) for i in units[candidates[num_dropped]])
        num_dropped += 1
    return max(num_dropped, 1)


def least_true(fits: Callable[[int], bool], guess: int, lowest: int, highest: int) -> int | None:
    """The least n in [lowest, highest] with fits(n) (fits is monotone), None if none: a
    galloping search from `guess`, so a good guess costs two counts where bisection costs
    log2(highest - lowest)."""
    guess = min(max(guess, lowest), highest)
    if fits(guess):
        high, step = guess, 1
        while high - step >= lowest and fits(high - step):
            high -= step
            step *= 2
        low = max(lowest, high - step + 1)  # high - step does not fit, or is below lowest
    else:
        low, step = guess + 1, 1
        while True:
            probe = min(highest, guess + step)
            if fits(probe):
                high = probe
                break
            if probe == highest:
                return None
            low, step = probe + 1, step * 2
    while low < high:  # fits(high); nothing below low fits
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high


def _guess(messages: Sequence[Any], units: list[list[int]], candidates: list[int], before: int | None,
           budget: int, forced: int) -> int:
    """How many units to drop, from each unit's share of the characters: the search starts
    here and usually ends one count later."""
    sizes = [sum(_message_chars(messages[i]) for i in units[u]) for u in candidates]
    total = sum(_message_chars(m) for m in messages) or 1
    tokens_per_char = before / total if before else 0.3
    tokens = before if before else total * tokens_per_char
    num_dropped = 0
    while num_dropped < len(sizes) and (tokens > budget or num_dropped < forced):
        tokens -= sizes[num_dropped] * tokens_per_char
        num_dropped += 1
    return num_dropped


_MESSAGE_OVERHEAD_CHARS = 16  # a template's framing of one message, roughly


def _message_chars(message: Any) -> int:
    """A message's characters with its template framing, roughly: what the estimates weigh."""
    return _num_chars(message) + _MESSAGE_OVERHEAD_CHARS


def _num_chars(message: Any) -> int:
    content = field_of(message, "content")
    num_chars = len(content) if isinstance(content, str) else len(str(content or ""))
    for call in field_of(message, "tool_calls") or ():
        num_chars += len(str(call))
    return num_chars


def count_or_none(counter: Counter, request: Mapping[str, Any]) -> int | None:
    """The request's prompt tokens; None where the counter counts no further (over the window)."""
    from tokenway.client.counting import OverWindow

    try:
        return counter.count(request)
    except OverWindow:
        return None


def role_of(message: Any) -> str:
    """A message's role, whether it is a dict or an SDK object."""
    return str(field_of(message, "role") or "")


def field_of(message: Any, name: str) -> Any:
    """A message's field, whether it is a dict or an SDK object."""
    return message.get(name) if isinstance(message, Mapping) else getattr(message, name, None)
