"""What splitting a reasoning model's reply costs per streamed delta: a long thinking-then-answer
reply, detokenized one token a step as the engine hands it over, fed to a ReasoningParser
(frontend/reasoning_parsers.py) with its token ids, as Generation does for each delta.

    python bench/reasoning_parser_bench.py            # best of 5 runs over a 2,000-token reply

Prints microseconds per delta for the parser (text and token counting), and for comparison
the tool-call parser (hermes) on the same deltas. Needs the default model's tokenizer
(downloaded once, as the tests do).
"""

from __future__ import annotations

import argparse
import time

from tokenway.frontend.reasoning_parsers import ReasoningFormat
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.frontend.tool_parsers import ReplyFormat
from tokenway.models.loader import DEFAULT_MODEL, resolve_model

THOUGHT = ("Let me work through this carefully. The user asks for the sum of 17 and 25; 17 + 25 = 42. "
           "I should double-check: 40 + 2 = 42, and a < b holds for a = 1 and b = 2.\n\n")
ANSWER = "The sum of 17 and 25 is **42**. "


def deltas(tokenizer: Tokenizer, num_tokens: int) -> list[tuple[str, list[int]]]:
    """(text, token ids) per token of a reply of about num_tokens, thinking for ~80% of them."""
    thought_ids = tokenizer.encode(THOUGHT, add_special_tokens=False)
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    reps = max(1, int(num_tokens * 0.8) // len(thought_ids))
    text = "<think>\n" + THOUGHT * reps + "</think>\n\n" + ANSWER * max(1, num_tokens // 5 // len(answer_ids))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    out, previous = [], ""
    for i in range(len(token_ids)):  # the text each token adds, as a detokenizer releases it
        current = tokenizer.decode(token_ids[: i + 1], skip_special_tokens=False)
        out.append((current[len(previous):], [token_ids[i]]))
        previous = current
    return out


def run(tokenizer: Tokenizer, stream: list[tuple[str, list[int]]], repeats: int) -> tuple[float, float, int]:
    fmt = ReasoningFormat("qwen3", "<think>", "</think>")
    best_reasoning = best_tools = float("inf")
    count = 0
    for _ in range(repeats):
        parser = fmt.parser(tokenizer.token_text)
        started = time.perf_counter()
        for text, token_ids in stream:
            parser.feed(text, token_ids)
        parser.finish()
        best_reasoning = min(best_reasoning, time.perf_counter() - started)
        count = parser.num_reasoning_tokens
        tools = ReplyFormat("hermes").parser()
        started = time.perf_counter()
        for text, _ in stream:
            tools.feed(text)
        tools.finish()
        best_tools = min(best_tools, time.perf_counter() - started)
    return best_reasoning / len(stream) * 1e6, best_tools / len(stream) * 1e6, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(resolve_model(DEFAULT_MODEL))
    stream = deltas(tokenizer, args.tokens)
    reasoning_us, tools_us, count = run(tokenizer, stream, args.repeats)
    print(f"{len(stream)} deltas, {count} thinking tokens")
    print(f"reasoning parser: {reasoning_us:.2f} us/delta")
    print(f"tool-call parser (hermes), same deltas: {tools_us:.2f} us/delta")


if __name__ == "__main__":
    main()
