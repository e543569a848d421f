"""Safety detectors benchmark: quality on the labelled set, the latency of detect(), and the
latency of the input screen on a whole chat request, against the screen it replaced.

    python bench/safety_bench.py            # 1,000 timed runs per prompt
    python bench/safety_bench.py --quick    # 100
    python bench/safety_bench.py --baseline REV   # the screen to compare with (default below)
    python bench/safety_bench.py --cpu-time       # the process's CPU time (a shared machine)

Quality: precision and recall per category over findings on tests/safety/data/pii_lines.tsv
(a finding counts as true when its line expects that category; counts per line), and the share
of lines whose found categories equal the expected ones exactly.
Latency: p50/p99 of detect() on a ~16,000-character (~4,000-token) prompt of mixed prose with
digits, dates, versions and a few PII items; and on the same length of prose with no digit and
no '@' (the fast path: only the key-prefix scans run). The goal is p99 under 1 ms.
The input screen: p50/p99 of what the server's screen (server/prepare.py) runs for a ~4,000-token
chat request (a system prompt, tools with schemas, eight turns, two tool calls with their JSON
results; prose with dates, amounts and ids, no secret), the current tokenway/safety and the
baseline's (the package as it was at --baseline, loaded from git), in the same process, runs
alternated; and both on the same request written in Cyrillic with fullwidth digits (the
normalization's slow path) and with a tool result that is a table of numbers (the number
matcher's). The goal: p99 under 1 ms.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# After the sys.path line:
from tokenway.protocol.job import estimate_chat_tokens  # noqa: E402
from tokenway.safety.channels import ChatInput  # noqa: E402
from tokenway.safety.detectors import CATEGORIES, detect  # noqa: E402
from tokenway.safety.screen import SafetyPolicy, screen_input  # noqa: E402

# The screen before the broader card and key matcher (separators of every kind, groups of 1-6
# digits, glued letters).
BASELINE = "e80586b"

PII_LINES = REPO / "tests" / "safety" / "data" / "pii_lines.tsv"
PROMPT_CHARS = 16_000
WORDS = ("the model returns a list of tokens for each request and the scheduler decides which "
         "requests run in the next step while the cache keeps blocks of keys and values for "
         "prefixes that were seen before so that a long system prompt is computed only once").split()
NUMBERY = ("in 2024", "version 1.26.4", "$1,299.99", "on 2024-03-15", "at 14:30", "192.168.1.20",
           "order #4471-2290", "42%", "3.14159", "batch size 512", "uuid 550e8400-e29b-41d4-a716-446655440000")
PII = ("mail ann.lee@example.com", "call +44 20 7946 0958", "card 4111 1111 1111 1111",
       "IBAN GB82 WEST 1234 5698 7654 32", "key AKIAIOSFODNN7EXAMPLE")


def evaluate(path: Path) -> tuple[dict[str, Counter], int, int]:
    """Per category tp/fp/fn, the number of exactly matched lines, and the number of lines."""
    _, *rows = path.read_text(encoding="utf-8").splitlines()
    category_to_counts = {category: Counter() for category in CATEGORIES}
    num_exact = 0
    for row in rows:
        label, text = row.split("\t")
        expected = Counter() if label == "none" else Counter(label.split(","))
        found = Counter(f.category for f in detect(text))
        num_exact += found == expected
        for category in CATEGORIES:
            tp = min(found[category], expected[category])
            category_to_counts[category].update(tp=tp, fp=found[category] - tp, fn=expected[category] - tp)
    return category_to_counts, num_exact, len(rows)


def make_prompt(rng: random.Random, with_numbers: bool) -> str:
    pieces, num_chars = [], 0
    while num_chars < PROMPT_CHARS:
        piece = rng.choice(WORDS)
        if with_numbers and rng.random() < 0.03:
            piece = rng.choice(NUMBERY)
        pieces.append(piece)
        num_chars += len(piece) + 1
    if with_numbers:
        for item in PII:
            pieces.insert(rng.randrange(len(pieces)), item)
    return " ".join(pieces)[:PROMPT_CHARS]


def time_detect(text: str, num_runs: int, clock: Callable[[], float]) -> tuple[float, float]:
    for _ in range(50):
        detect(text)
    latencies = []
    for _ in range(num_runs):
        start = clock()
        detect(text)
        latencies.append(clock() - start)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


SENTENCES = (
    "The customer says the parcel for order {order} arrived on {date} with one item missing.",
    "We refunded ${amount} to the original payment method; it usually shows within {days} business days.",
    "Version {version} of the app fixes the crash that happened when the cart held more than {num} items.",
    "Our warehouse in Rotterdam ships Monday to Friday between 09:00 and 17:30 local time.",
    "The tracking page said the parcel left the depot at {time} and was out for delivery the next morning.",
    "Please keep the answer short, friendly and in the language the customer wrote in.",
    "If the customer asks for a manager, offer a callback within {days} working days instead.",
    "Items returned after {days} days are refunded as store credit, not to the card.",
    "The discount code took {num}% off the first order but cannot be combined with the spring sale.",
    "She mentioned ticket {ticket} from last month, which was closed after the replacement shipped.",
)


def sentence(rng: random.Random) -> str:
    return rng.choice(SENTENCES).format(
        order=f"ORD-2024-{rng.randrange(10**6):06d}",
        date=f"2024-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
        amount=f"{rng.randrange(5, 500)}.{rng.randrange(100):02d}", days=rng.randrange(2, 31),
        version=f"{rng.randrange(1, 9)}.{rng.randrange(30)}.{rng.randrange(10)}", num=rng.randrange(2, 60),
        time=f"{rng.randrange(24):02d}:{rng.randrange(60):02d}", ticket=f"#{rng.randrange(10**5, 10**6)}")


def paragraph(rng: random.Random, num_chars: int) -> str:
    sentences = []
    while sum(len(s) + 1 for s in sentences) < num_chars:
        sentences.append(sentence(rng))
    return " ".join(sentences)


def make_chat_request(rng: random.Random) -> ChatInput:
    """A support agent's conversation of ~4,000 tokens, as the chat template gets it: system
    prompt, four tools with schemas, eight turns, two tool calls and their JSON results."""
    def function(name: str, description: str, properties: dict) -> dict:
        return {"type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": properties, "required": list(properties)[:1]}}}

    tools = [
        function("get_order", "Look up an order by its id: items, status, shipping and tracking.", {
            "order_id": {"type": "string", "description": "The order id, e.g. ORD-2024-004471"},
            "include": {"type": "array", "items": {"type": "string", "enum": ["items", "shipping", "payments"]}}}),
        function("refund_order", "Refund an order or some of its items to the original payment method.", {
            "order_id": {"type": "string", "description": "The order to refund"},
            "amount": {"type": "number", "description": "Amount in EUR; leave out for a full refund", "minimum": 0},
            "reason": {"type": "string", "enum": ["missing_item", "damaged", "late", "other"]}}),
        function("search_help_center", "Search the help-center articles; returns titles and snippets.", {
            "query": {"type": "string", "description": "What to search for, in the customer's words"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5}}),
        function("schedule_callback", "Book a phone callback with a manager within the opening hours.", {
            "when": {"type": "string", "description": "ISO 8601 time, e.g. 2024-03-15T14:30:00+01:00"},
            "topic": {"type": "string", "description": "One line on what the call is about"}}),
    ]
    order = f"ORD-2024-{rng.randrange(10**6):06d}"
    order_json = json.dumps({"order_id": order, "status": "delivered", "shipped": "2024-03-12",
                             "tracking": "1Z 999 AA1 0123 4567 84", "items": [
                                 {"sku": f"SKU-{rng.randrange(10**4):04d}", "qty": rng.randrange(1, 4),
                                  "price": rng.randrange(500, 9000) / 100} for _ in range(6)]})
    messages = [{"role": "system", "content": paragraph(rng, 2000)}]
    for turn in range(8):
        messages.append({"role": "user", "content": paragraph(rng, 550)})
        if turn in (2, 5):
            call_id = f"call_{rng.randrange(16**12):012x}"
            messages.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": call_id, "type": "function", "function": {"name": "get_order", "arguments": json.dumps(
                    {"order_id": order, "include": ["items", "shipping"]})}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": order_json})
        messages.append({"role": "assistant", "content": paragraph(rng, 700)})
    messages.append({"role": "user", "content": paragraph(rng, 400)})
    return ChatInput(messages, tools)


def load_baseline(rev: str) -> types.ModuleType:
    """tokenway/safety as it was at `rev`, as the package `baseline_safety` (its own modules
    importing each other, the rest of tokenway the current one); returns its screen module."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:tokenway/safety"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    root = Path(tempfile.mkdtemp(prefix="safety-baseline-"))
    (root / "baseline_safety").mkdir()
    for name in names:
        if name.endswith(".py"):
            source = subprocess.run(["git", "show", f"{rev}:tokenway/safety/{name}"], cwd=REPO, check=True,
                                    capture_output=True, text=True).stdout
            (root / "baseline_safety" / name).write_text(source.replace("tokenway.safety.", "baseline_safety."))
    sys.path.insert(0, str(root))
    return importlib.import_module("baseline_safety.screen")


def time_alternated(screens: dict[str, Callable[[], object]], num_runs: int,
                    clock: Callable[[], float]) -> dict[str, tuple[float, float]]:
    """p50 and p99 (ms) of each screen, run in turn so that they share the machine's moments."""
    for screen in screens.values():
        for _ in range(50):
            screen()
    name_to_latencies: dict[str, list[float]] = {name: [] for name in screens}
    for _ in range(num_runs):
        for name, screen in screens.items():
            start = clock()
            screen()
            name_to_latencies[name].append(clock() - start)
    return {name: (statistics.median(latencies) * 1000,
                   statistics.quantiles(latencies, n=100, method="inclusive")[98] * 1000)
            for name, latencies in name_to_latencies.items()}


def cyrillic(chat: ChatInput) -> ChatInput:
    """The request with its prose's Latin look-alikes written in Cyrillic and its digits fullwidth."""
    table = str.maketrans({**dict(zip("aeopcxyABEKMHOPCTX", "аеорсхуАВЕКМНОРСТХ")),
                           **{str(d): chr(0xFF10 + d) for d in range(10)}})
    return ChatInput([{**m, "content": m["content"].translate(table)} if m["role"] != "tool" else m
                      for m in chat.messages], chat.tools)


def with_table(chat: ChatInput, rng: random.Random) -> ChatInput:
    """The request with its first tool result replaced by a table of numbers (~2,000 characters:
    ids, dates, amounts, counts), the input the number matcher works hardest on."""
    rows = ["id,date,qty,amount,ref"] + [
        f"{rng.randrange(10**5)},2024-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d},{rng.randrange(1, 50)},"
        f"{rng.randrange(1, 999)}.{rng.randrange(100):02d},{rng.randrange(10**3)} {rng.randrange(10**4):04d}"
        for _ in range(60)]
    index = next(i for i, m in enumerate(chat.messages) if m["role"] == "tool")
    table = {**chat.messages[index], "content": "\n".join(rows)}
    return ChatInput([*chat.messages[:index], table, *chat.messages[index + 1:]], chat.tools)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the screen to compare with")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the process's CPU time, not the wall clock: on a shared machine, "
                             "leaves out the slices other processes hold the cores")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"clock: {'process CPU time' if args.cpu_time else 'wall (perf_counter)'}")

    category_to_counts, num_exact, num_lines = evaluate(PII_LINES)
    print(f"labelled set: {num_lines} lines, {num_exact / num_lines:.1%} with the exact category set")
    print(f"{'category':<12} {'tp':>4} {'fp':>4} {'fn':>4} {'precision':>10} {'recall':>8}")
    for category, counts in [*category_to_counts.items(), ("overall", sum(category_to_counts.values(), Counter()))]:
        tp, fp, fn = counts["tp"], counts["fp"], counts["fn"]
        precision = tp / (tp + fp) if tp + fp else float("nan")
        recall = tp / (tp + fn) if tp + fn else float("nan")
        print(f"{category:<12} {tp:>4} {fp:>4} {fn:>4} {precision:>10.3f} {recall:>8.3f}")

    rng, num_runs = random.Random(0), 100 if args.quick else 1000
    for name, with_numbers in (("mixed prose + 5 PII items", True), ("no digit, no '@' (fast path)", False)):
        prompt = make_prompt(rng, with_numbers)
        p50, p99 = time_detect(prompt, num_runs, clock)
        print(f"detect() on {len(prompt):,} chars, {name}: {len(detect(prompt))} findings, "
              f"p50 {p50:.3f} ms, p99 {p99:.3f} ms ({num_runs} runs)")

    chat = make_chat_request(random.Random(1))
    policy = SafetyPolicy(input="block")
    baseline = load_baseline(args.baseline)
    baseline_channels = importlib.import_module("baseline_safety.channels")
    baseline_policy = baseline.SafetyPolicy(input="block")
    slow = cyrillic(chat)
    numeric = with_table(chat, random.Random(2))
    screens = {}
    for name, request in (("", chat), (", Cyrillic + fullwidth", slow), (", numeric table", numeric)):
        texts = list(request.texts())
        # The baseline's own PromptText: its screen checks texts against its own class.
        old_texts = list(baseline_channels.ChatInput(request.messages, request.tools).texts())
        screens[f"baseline{name}"] = lambda texts=old_texts: baseline.screen_input(baseline_policy, texts)
        screens[f"current{name}"] = lambda texts=texts: screen_input(policy, texts)
    num_chars = sum(len(t.text) for t in chat.texts())
    print(f"input screen on one chat request: ~{estimate_chat_tokens(chat.messages, chat.tools):,} tokens, "
          f"{len(chat.messages)} messages, {len(chat.tools)} tools, {len(list(chat.texts()))} texts screened, "
          f"{num_chars:,} chars; findings: {screen_input(policy, list(chat.texts())).categories or 'none'}")
    for name, (p50, p99) in time_alternated(screens, num_runs, clock).items():
        print(f"  {name:<32} p50 {p50:.3f} ms, p99 {p99:.3f} ms ({num_runs} runs)")


if __name__ == "__main__":
    main()
