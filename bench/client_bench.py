"""What tokenway.client costs the caller per call, before the request leaves: counting a
20-turn conversation's prompt tokens (LocalCounter: the server's own templating on the
model's files), fitting it into a window (context.fit), and the whole per-call work of a RAG
conversation (assemble.assemble): the spotlight's rule in the system prompt, a memory and four
retrieved passages (scanned when they were indexed, as retrieval does) marked and fitted into
the last turn, two tools, the history cut to the window; each call asks a new question.

    python bench/client_bench.py            # 200 timed runs each

The goal: p50 under 1 ms for a 20-turn conversation with counting cached.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway.client import LocalCounter  # noqa: E402  (after the sys.path line)
from tokenway.client.assemble import assemble  # noqa: E402
from tokenway.client.context import fit  # noqa: E402
from tokenway.client.injection import scan  # noqa: E402
from tokenway.client.retrieval import Passage  # noqa: E402
from tokenway.client.untrusted import Spotlight, with_rule  # noqa: E402

MODEL = "smollm2-135m-instruct"
TOPICS = ["ships", "rivers", "bread", "clocks", "bees", "glass", "trains", "maps", "salt", "wool"]


def conversation(turns: int = 20) -> list[dict]:
    messages = [{"role": "system", "content": "You are a patient historian."}]
    for turn in range(turns):
        topic = TOPICS[turn % len(TOPICS)]
        messages.append({"role": "user", "content": f"Turn {turn}: tell me about {topic}. " + f"{topic} " * 30})
        messages.append({"role": "assistant", "content": f"About {topic}: " + "an answer " * 30})
    messages.append({"role": "user", "content": "Which topic was first?"})
    return messages


TOOLS = [{"type": "function", "function": {"name": name, "description": f"Looks up {name}.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
         for name in ("timetables", "weather")]


def passages() -> list[Passage]:
    texts = [f"Section {i}: the {TOPICS[i]} trade grew along the coast, " + "with ports, markets and roads. " * 18
             for i in range(4)]
    return [Passage(text, "history.md", 0.8 - i / 10, f"history.md#{i}", f"Part {i}", (i * 700, i * 700 + len(text)),
                    finding=scan(text)) for i, text in enumerate(texts)]


def timed(fn, runs: int) -> tuple[float, float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    counter = LocalCounter(MODEL)
    request = {"model": MODEL, "messages": conversation()}
    tokens = counter.count(request)
    p50, p99 = timed(lambda: counter.count(request), args.runs)
    print(f"count, 20 turns ({tokens} tokens): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    p50, p99 = timed(lambda: fit(request, counter, window=tokens + 64, max_tokens=64), args.runs)
    print(f"fit, already fitting (1 count): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    _, report = fit(request, counter, window=tokens // 2, max_tokens=64)
    p50, p99 = timed(lambda: fit(request, counter, window=tokens // 2, max_tokens=64), max(20, args.runs // 10))
    print(f"fit, half the window (drop_oldest, {len(report.dropped)} messages cut): p50 {p50:.2f} ms, "
          f"p99 {p99:.2f} ms")
    p50, p99 = timed(lambda: fit(request, counter, window=tokens // 2, max_tokens=64, previous=report),
                     max(20, args.runs // 10))
    print(f"fit, half the window, given the conversation's previous cut: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    spotlight, retrieved = Spotlight(), passages()
    memories = [Passage("The user is writing a book about salt roads.", "memory:1", 0.9, "mem-1", finding=scan(
        "The user is writing a book about salt roads."))]
    history = with_rule(request["messages"][:-1], spotlight)
    calls = iter(range(10**9))

    previous: list = [None]

    def tool_turn(window: int) -> None:
        """A call of the tool loop: the next question, the model's call, the tool's new result
        scanned and marked, the whole counted and fitted (with the conversation's last cut)."""
        i = next(calls)
        result = spotlight.mark(f"Result {i}: " + "the salt road ran from the coast to the hills, " * 12,
                                "tool:timetables")
        messages = [*history, {"role": "user", "content": f"Question {i}: which route carried the most salt?"},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": f"call_{i}", "type": "function",
                        "function": {"name": "timetables", "arguments": '{"query": "salt"}'}}]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": result.text}]
        _, previous[0] = fit({**request, "tools": TOOLS, "messages": messages}, counter, window=window,
                             max_tokens=256, previous=previous[0])

    def rag_turn(window: int) -> None:
        """A RAG call: the next question with a memory and four passages assembled in."""
        asked = {**request, "tools": TOOLS, "messages": [*request["messages"][:-1], {
            "role": "user", "content": f"Question {next(calls)}: which route carried the most salt?"}]}
        _, previous[0] = assemble(asked, counter, window=window, max_tokens=256, memories=memories,
                                  passages=retrieved, spotlight=spotlight, previous=previous[0])

    cases = (("a tool-loop call: 20 turns, 2 tools, a new question and a new 600-character tool result marked",
              tool_turn), ("a RAG call: 20 turns, 2 tools, a new question, 1 memory and 4 passages assembled in",
                           rag_turn))
    for label, turn in cases:
        for window_label, window in (("fits", tokens + 2048), ("history cut to a 2,048-token window", 2048)):
            previous[0] = None
            turn(window)
            p50, p99 = timed(functools.partial(turn, window), args.runs)
            print(f"{label}, {window_label}: p50 {p50:.2f} ms, p99 {p99:.2f} ms")


if __name__ == "__main__":
    main()
