"""Assembling a call's context window: system prompt, memory, retrieved passages, history and
tools, with the output reserved.

    spotlight = Spotlight()                    # one per conversation: its rule and boundary stay put
    request, report = assemble({"model": m, "messages": history, "tools": tools}, counter,
                               window=8192, max_tokens=512, memories=recall(question),
                               passages=retriever.search(question), spotlight=spotlight)

What goes where, and what is cut first:

    system prompt + the spotlight's rule   never cut (pinned; the rule is stable, so the
                                           server's prefix cache still holds the conversation)
    tools                                  never cut (they are the request's, not the window's)
    the last turn                          never cut; memory and passages go in front of its
                                           text, as marked untrusted blocks with their sources
                                           (the turn's text changes each call anyway)
    memory, then passages                  best first, up to `context_share` of what the
                                           pinned parts leave; the last passages go first
    history                                cut by context.fit's strategy to what is left

Passages and memories are anything with `text` and `source` (retrieval.Passage: its block is
labelled with its `citation`); one with a `finding` (the scan made when it was indexed) is not
scanned again. `report` (AssemblyReport)
says what was kept and cut, and which blocks were flagged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenway.client.context import ContextTooSmall, Counter, CutReport, count_or_none, fit, least_true, role_of
from tokenway.client.untrusted import Report, Spotlight, with_rule

MEMORY_HEADING = "Remembered from earlier conversations:"
PASSAGES_HEADING = "Retrieved passages (cite their sources):"


@dataclass(frozen=True, slots=True)
class AssemblyReport:
    prompt_tokens: int
    budget: int  # prompt tokens allowed: the window less the output reserved
    history: CutReport
    memories_kept: tuple[str, ...] = ()  # sources
    memories_dropped: tuple[str, ...] = ()
    passages_kept: tuple[str, ...] = ()
    passages_dropped: tuple[str, ...] = ()
    flagged: tuple[Report, ...] = ()  # the kept blocks that looked like instructions (or were withheld)


def assemble(request: Mapping[str, Any], counter: Counter, *, window: int, max_tokens: int,
             memories: Sequence[Any] = (), passages: Sequence[Any] = (), spotlight: Spotlight | None = None,
             context_share: float = 0.5, strategy: str = "drop_oldest", keep_last: int | None = None,
             summarize: Callable[[list[Any]], str] | None = None,
             previous: AssemblyReport | None = None) -> tuple[dict[str, Any], AssemblyReport]:
    """The request with memory and passages in its last turn and its history cut to the window,
    and what was done. Raises ContextTooSmall when the pinned parts alone overrun the budget.
    previous: this conversation's last report (its history is cut from where that one was)."""
    if not 0.0 < context_share <= 1.0:
        raise ValueError(f"context_share: expected a share in (0, 1], got {context_share}")
    items = [*memories, *passages]
    if not items:
        fitted, cut = fit(request, counter, window=window, max_tokens=max_tokens, strategy=strategy,
                          keep_last=keep_last, summarize=summarize, previous=previous and previous.history)
        return fitted, AssemblyReport(cut.prompt_tokens_after, cut.budget, cut)
    spotlight = spotlight or Spotlight()
    messages = with_rule(request["messages"], spotlight)
    last = messages[-1] if isinstance(messages[-1], Mapping) else messages[-1].model_dump(exclude_none=True)
    if role_of(last) != "user":
        raise ValueError("assemble: memory and passages go into the user's turn; the last message is not one")
    budget = window - max_tokens
    # Every item marked once, whether it is kept or not: the report says what each one held.
    blocks = [spotlight.mark(item.text, getattr(item, "citation", item.source), getattr(item, "finding", None))
              for item in items]
    num_memories = len(memories)

    def with_context(num_kept: int) -> dict[str, Any]:
        return {**last, "content": _prepend(_context_text(blocks[:num_kept], num_memories), last["content"])}

    # The pinned parts alone (system, tools, the last turn) fix what the context may take.
    pinned = [m for m in messages[:-1] if role_of(m) in ("system", "developer")][:1]
    small = {**request, "max_tokens": max_tokens}
    base = count_or_none(counter, {**small, "messages": [*pinned, last]})
    if base is None or base > budget:
        raise ContextTooSmall(f"the system prompt, the tools and the last turn need {base or 'more'} tokens; "
                              f"the budget is {budget} ({window} in the window, {max_tokens} reserved for the output)")
    context_budget = int((budget - base) * context_share)

    def fits(num_dropped: int) -> bool:
        tokens = count_or_none(counter, {**small, "messages": [*pinned, with_context(len(blocks) - num_dropped)]})
        return tokens is not None and tokens - base <= context_budget

    guess = _guess_dropped([len(block.text) for block in blocks], context_budget)
    num_dropped = least_true(fits, guess, 0, len(blocks))
    num_kept = len(blocks) - (num_dropped if num_dropped is not None else len(blocks))
    assembled = {**request, "messages": [*messages[:-1], with_context(num_kept)]}
    fitted, cut = fit(assembled, counter, window=window, max_tokens=max_tokens, strategy=strategy,
                      keep_last=keep_last, summarize=summarize, previous=previous and previous.history)
    sources = [item.source for item in items]
    kept_memories = min(num_kept, num_memories)
    return fitted, AssemblyReport(
        cut.prompt_tokens_after, budget, cut,
        memories_kept=tuple(sources[:kept_memories]), memories_dropped=tuple(sources[kept_memories:num_memories]),
        passages_kept=tuple(sources[num_memories:max(num_kept, num_memories)]),
        passages_dropped=tuple(sources[max(num_kept, num_memories):]),
        flagged=tuple(block.report for block in blocks[:num_kept] if block.report is not None))


def _context_text(blocks: Sequence[Any], num_memories: int) -> str:
    parts = []
    if memories := [block.text for block in blocks[:num_memories]]:
        parts.append("\n".join([MEMORY_HEADING, *memories]))
    if passages := [block.text for block in blocks[num_memories:]]:
        parts.append("\n".join([PASSAGES_HEADING, *passages]))
    return "\n\n".join(parts)


def _prepend(context: str, content: Any) -> Any:
    if not context:
        return content
    if isinstance(content, list):
        return [{"type": "text", "text": context}, *content]
    return f"{context}\n\n{content}"


def _guess_dropped(sizes: list[int], context_budget: int, chars_per_token: float = 3.5) -> int:
    """How many items to drop from the end so the rest fit, by characters: the search starts here."""
    total, kept = 0.0, 0
    for size in sizes:
        total += size / chars_per_token
        if total > context_budget:
            break
        kept += 1
    return len(sizes) - kept

