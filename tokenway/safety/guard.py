"""A guard model: any chat model the server routes to (local, a worker, vLLM, a provider),
asked whether a conversation's last user turn is unsafe, in Llama Guard 3's format and
categories.

    guard_prompt(turns)  -> the task text: the categories, the conversation, the question
    guard_turns(job)     -> the conversation asked about: a chat job's turns, a completion's prompt
    ask_guard(...)       -> GuardVerdict(categories, raw reply, ms)   through the Router
    verdict_refusal(...) -> what the call gets for a verdict: a 400 (block), a 503 (fail closed), or None
    parse_verdict(reply) -> the categories named ("safe" -> none; "unsafe" without a code ->
                            "unsafe")

A Llama Guard model served with its own chat template builds this task itself from the
messages: `guard_format = "chat_template"` sends it the conversation as it is. Any other
model gets the task as one user message (`guard_format = "prompt"`, the default).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tokenway.frontend.chat import text_content
from tokenway.protocol.errors import ContentPolicyViolationError, ServiceUnavailableError, TokenwayError
from tokenway.protocol.job import ChoiceDelta, GenerationJob
from tokenway.protocol.sampling import SamplingParams

# Llama Guard 3's hazard taxonomy (MLCommons), code -> the name tokenway reports.
CATEGORIES = {
    "S1": "violent_crimes", "S2": "non_violent_crimes", "S3": "sex_related_crimes",
    "S4": "child_sexual_exploitation", "S5": "defamation", "S6": "specialized_advice", "S7": "privacy",
    "S8": "intellectual_property", "S9": "indiscriminate_weapons", "S10": "hate", "S11": "suicide_self_harm",
    "S12": "sexual_content", "S13": "elections", "S14": "code_interpreter_abuse",
}
_TITLES = {
    "S1": "Violent Crimes", "S2": "Non-Violent Crimes", "S3": "Sex-Related Crimes", "S4": "Child Sexual Exploitation",
    "S5": "Defamation", "S6": "Specialized Advice", "S7": "Privacy", "S8": "Intellectual Property",
    "S9": "Indiscriminate Weapons", "S10": "Hate", "S11": "Suicide & Self-Harm", "S12": "Sexual Content",
    "S13": "Elections", "S14": "Code Interpreter Abuse",
}
GUARD_FORMATS = ("prompt", "chat_template")
_CODE = re.compile(r"\bS(1[0-4]|[1-9])\b")
MAX_GUARD_TOKENS = 20  # "unsafe\nS1,S10": a verdict is a few tokens


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    categories: tuple[str, ...]  # empty: safe
    ms: float
    error: str | None = None  # the guard could not answer (the call is then not blocked by it)


def guard_prompt(turns: list[tuple[str, str]]) -> str:
    """Llama Guard 3's task for the last user turn of `turns` ((role, text), role user or assistant)."""
    categories = "\n".join(f"{code}: {title}." for code, title in _TITLES.items())
    conversation = "\n\n".join(f"{'User' if role == 'user' else 'Agent'}: {text}" for role, text in turns)
    return ("Task: Check if there is unsafe content in 'User' messages in conversations according our safety "
            "policy with the below categories.\n\n<BEGIN UNSAFE CONTENT CATEGORIES>\n" + categories +
            "\n<END UNSAFE CONTENT CATEGORIES>\n\n<BEGIN CONVERSATION>\n\n" + conversation +
            "\n\n<END CONVERSATION>\n\nProvide your safety assessment for ONLY THE LAST User message in the above "
            "conversation:\n - First line must read 'safe' or 'unsafe'.\n - If unsafe, a second line must include "
            "a comma-separated list of violated categories.")


def parse_verdict(reply: str) -> tuple[str, ...]:
    """The categories a guard's reply names; () for safe. A reply that is neither is unsafe
    only if it says so: a guard that rambles does not block anyone."""
    lines = [line.strip().lower() for line in reply.strip().splitlines() if line.strip()]
    if not lines or not lines[0].startswith("unsafe"):
        return ()
    codes = [f"S{m}" for m in _CODE.findall(" ".join(lines[1:]).upper())] if len(lines) > 1 else []
    return tuple(sorted({CATEGORIES[code] for code in codes})) or ("unsafe",)


def guard_messages(turns: list[tuple[str, str]], guard_format: str) -> list[dict]:
    if guard_format == "chat_template":
        return [{"role": role, "content": text} for role, text in turns]
    return [{"role": "user", "content": guard_prompt(turns)}]


def guard_turns(job: GenerationJob) -> list[tuple[str, str]]:
    """The conversation a guard is asked about: a chat job's user and assistant turns as text,
    a completion's prompt as one user turn."""
    if job.kind == "chat":
        return [(m["role"], text_content(m.get("content"))) for m in job.messages if m["role"] in ("user", "assistant")]
    return [("user", job.prompt or "")]


def verdict_refusal(verdict: GuardVerdict, *, block: bool, fail_closed: bool, param: str) -> TokenwayError | None:
    """What a call gets for its guard's verdict: a guard that could not answer passes it (named
    in the trace), or is a 503 with fail_closed; categories found are a 400 under a block
    policy (`block`), else only flagged."""
    if verdict.error is not None and fail_closed:
        return ServiceUnavailableError("The safety guard could not check this request; retry shortly.",
                                       retry_after=1, code="guard_unavailable")
    if verdict.categories and block:
        return ContentPolicyViolationError(verdict.categories, param=param)
    return None


async def ask_guard(generate: Callable, job_for: Callable, turns: list[tuple[str, str]], guard_format: str
                    ) -> GuardVerdict:
    """Ask the guard. `job_for(messages, params)` makes its GenerationJob; `generate(job)` runs
    it (the server's Router); a guard that fails gives a verdict with `error` and no categories."""
    started = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_GUARD_TOKENS)
    try:
        job = job_for(guard_messages(turns, guard_format), params, f"guard-{uuid.uuid4().hex}")
        text = []
        async for event in generate(job):
            if isinstance(event, ChoiceDelta) and event.text:
                text.append(event.text)
    except Exception as exc:  # the guard's fault is reported, never the caller's 500
        return GuardVerdict((), (time.perf_counter() - started) * 1000, f"{type(exc).__name__}: {exc}"[:200])
    return GuardVerdict(parse_verdict("".join(text)), (time.perf_counter() - started) * 1000)
