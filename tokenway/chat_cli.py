"""tokenway chat: an interactive terminal chat with any OpenAI-compatible server.

    tokenway chat                                    the local server (http://127.0.0.1:8000)
    tokenway chat --url https://host/v1 --model m    any server; key from --api-key-env's variable
    tokenway chat --mcp "python my_tools.py"         an MCP server's tools, run in the tool loop
    tokenway chat --fallback-url http://b:8000       a second server to fail over to

Replies stream as they come; after each turn one line gives the tokens in (cached) and out,
the cost (where the server prices the model), the time to first token and the whole time.
The conversation is fitted into the model's window before each turn (tokenway.client.context;
counting through the server's /v1/tokenize where it has one), and says what it cut.

Commands: /help, /tools, /budget, /system <text>, /model <name>, /reset, /quit (or Ctrl-D).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from contextlib import AsyncExitStack
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:8000"


def add_chat_parser(subparsers) -> None:
    chat = subparsers.add_parser("chat", help="an interactive chat with a server, in the terminal",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("--url", default=os.environ.get("TOKENWAY_URL", DEFAULT_URL),
                      help="the server (with or without /v1; default $TOKENWAY_URL or %(default)s)")
    chat.add_argument("--api-key-env", default="TOKENWAY_API_KEY",
                      help="the environment variable holding the API key (default %(default)s)")
    chat.add_argument("--model", help="default: the server's first chat model")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--max-tokens", type=int, default=512, help="output tokens a turn (reserved in the window)")
    chat.add_argument("--temperature", type=float)
    chat.add_argument("--strategy", default="drop_oldest",
                      choices=("drop_oldest", "sliding_window", "keep_first_and_recent"),
                      help="what to cut when the conversation outgrows the window")
    chat.add_argument("--mcp", action="append", default=[], metavar="COMMAND",
                      help="an MCP server to start (stdio), or its streamable-HTTP URL; repeatable")
    chat.add_argument("--fallback-url", action="append", default=[], help="servers to fail over to")
    chat.add_argument("--max-rounds", type=int, default=6, help="tool-loop rounds a turn")


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    return asyncio.run(Chat(args, stdout).run(stdin))


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class Chat:
    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.args = args
        self.out = out
        self.messages: list[dict[str, Any]] = []
        self.system = args.system
        self.model = args.model
        self.tools: list[Any] = []
        self.total_cost = 0.0
        self.last_report = None
        self.spotlight = None  # made with the first tool turn: tool results are marked as data

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    async def run(self, stdin: TextIO) -> int:
        import openai

        from tokenway.client.counting import RemoteCounter, price_of
        from tokenway.client.mcp_tools import mcp_tools
        from tokenway.client.resilience import Policy
        from tokenway.client.resilient import ResilientChat

        key = os.environ.get(self.args.api_key_env) or os.environ.get("OPENAI_API_KEY") or "none"
        clients = [openai.AsyncOpenAI(base_url=_v1(url), api_key=key)
                   for url in [self.args.url, *self.args.fallback_url]]
        sync_client = openai.OpenAI(base_url=_v1(self.args.url), api_key=key, max_retries=1)
        async with AsyncExitStack() as stack:
            for client in clients:
                stack.push_async_callback(client.close)
            try:
                cards = sync_client.models.list().data
            except openai.APIError as exc:
                self.say(f"tokenway chat: cannot reach {self.args.url}: {exc}")
                return 1
            chat_cards = [c for c in cards if (c.model_extra or {}).get("kind", "chat") == "chat"]
            self.model = self.model or (chat_cards or cards)[0].id
            card = next((c for c in cards if c.id == self.model), None)
            self.window = (card.model_extra or {}).get("max_model_len") if card else None
            self.price = price_of(sync_client, self.model) if card else None
            self.counter = RemoteCounter(sync_client)
            for source in self.args.mcp:
                where = {"url": source} if source.startswith(("http://", "https://")) else \
                    {"command": shlex.split(source)[0], "args": shlex.split(source)[1:]}
                self.tools += await stack.enter_async_context(mcp_tools(**where))
            self.chat = ResilientChat(clients, Policy(max_attempts=4, ttft_timeout=120, attempt_timeout=600))
            self.say(f"tokenway chat · {self.model} at {self.args.url}"
                     f"{f' · window {self.window}' if self.window else ''}"
                     f"{f' · {len(self.tools)} tools' if self.tools else ''} · /help for commands")
            while True:
                self.say("> ", end="")
                line = stdin.readline()
                if not line:
                    self.say()
                    return 0
                line = line.strip()
                if not line:
                    continue
                if line.startswith("/"):
                    if not self.command(line):
                        return 0
                    continue
                await self.turn(line)

    def command(self, line: str) -> bool:
        name, _, rest = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            self.say((__doc__ or "").partition("Commands:")[2].strip())  # None under python -OO
        elif name == "/tools":
            if not self.tools:
                self.say("no tools (start tokenway chat with --mcp COMMAND or --mcp URL)")
            for tool in self.tools:
                params = ", ".join(tool.parameters.get("properties", {}))
                self.say(f"  {tool.name}({params}): {tool.description}")
        elif name == "/budget":
            self.budget()
        elif name == "/system":
            self.system = rest or None
            self.say(f"system prompt {'set' if rest else 'cleared'}")
        elif name == "/model":
            self.model = rest or self.model
            self.say(f"model: {self.model}")
        elif name == "/reset":
            self.messages.clear()
            self.say("conversation cleared")
        else:
            self.say(f"unknown command {name}; /help lists them")
        return True

    def request(self) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        request: dict[str, Any] = {"model": self.model, "messages": system + self.messages,
                                   "max_tokens": self.args.max_tokens}
        if self.args.temperature is not None:
            request["temperature"] = self.args.temperature
        if self.tools:
            request["tools"] = [tool.spec() for tool in self.tools]
        return request

    def budget(self) -> None:
        from tokenway.client.counting import OverWindow

        request = self.request()
        try:
            tokens = self.counter.count(request) if request["messages"] else 0
        except OverWindow:
            tokens = None
        except Exception as exc:  # a server with no /tokenize
            self.say(f"counting is not available from this server ({type(exc).__name__})")
            return
        window = self.window or 0
        left = window - self.args.max_tokens - (tokens or 0)
        self.say(f"prompt {tokens if tokens is not None else 'over the window'} tokens · "
                 f"{self.args.max_tokens} reserved for the reply · window {window or '?'} · "
                 f"{left if window else '?'} left · {len(self.messages)} messages · "
                 f"spent ${self.total_cost:.6f} this session")
        if self.last_report is not None and self.last_report.cut:
            self.say(f"last turn cut {len(self.last_report.dropped)} earlier messages ({self.last_report.strategy})")

    async def turn(self, text: str) -> None:
        from tokenway.client.context import ContextTooSmall, fit

        self.messages.append({"role": "user", "content": text})
        request = self.request()
        if self.window:
            try:
                request, self.last_report = fit(request, self.counter, window=self.window,
                                                max_tokens=self.args.max_tokens, strategy=self.args.strategy)
            except ContextTooSmall as exc:
                self.messages.pop()
                self.say(f"[{exc}]")
                return
            except Exception:  # a server that cannot count: send as it is, the server will say if too long
                self.last_report = None
            if self.last_report is not None and self.last_report.cut:
                self.say(f"[cut {len(self.last_report.dropped)} earlier messages to fit the window]")
        started = time.monotonic()
        try:
            if self.tools:
                usage, ttft = await self.tool_turn(request), None
            else:
                usage, ttft = await self.stream_turn(request)
        except Exception as exc:
            self.messages.pop()
            self.say(f"\n[error: {type(exc).__name__}: {exc}]")
            return
        self.say(self.stats(usage, ttft, time.monotonic() - started))

    async def stream_turn(self, request: dict[str, Any]) -> tuple[Any, float | None]:
        request = {**request, "stream_options": {"include_usage": True}}
        async with await self.chat.stream(**request) as stream:
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.index == 0 and choice.delta and choice.delta.content:
                        self.say(choice.delta.content, end="")
        result = stream.result
        self.say()
        if not result.complete:
            self.say(f"[the reply broke off: {result.error}]")
        self.messages.append(result.message())
        return result.usage, result.ttft

    async def tool_turn(self, request: dict[str, Any]) -> Any:
        from tokenway.client.tool_loop import Limits, run_tool_loop
        from tokenway.client.untrusted import Spotlight, with_rule

        self.spotlight = self.spotlight or Spotlight()  # one boundary for the session
        asked = len(with_rule(request["messages"], self.spotlight))  # the loop starts from these
        without_specs = {key: value for key, value in request.items() if key != "tools"}  # the loop adds them
        result = await run_tool_loop(self.chat, without_specs, self.tools, Limits(max_rounds=self.args.max_rounds),
                                     spotlight=self.spotlight)
        for run in result.runs:
            self.say(f"  → {run.name}({run.arguments}) = {run.outcome.text[:200]}")
            if run.finding is not None and run.finding.flagged:
                self.say(f"  ! {run.name}'s result looked like instructions ({', '.join(run.finding.categories)}): "
                         f"{'withheld' if run.dropped else 'kept as marked data'}")
        self.say(result.reply or "")
        if result.stop_reason not in ("answered", "length"):
            self.say(f"[the tool loop stopped: {result.stop_reason}]")
        self.messages.extend(result.messages[asked:])
        return result.usage

    def stats(self, usage: Any, ttft: float | None, seconds: float) -> str:
        if usage is None:
            return f"[{seconds:.2f} s]"
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(usage, "cached_tokens", None) or (getattr(details, "cached_tokens", 0) if details else 0) or 0
        cost = self.price.cost(usage.prompt_tokens, usage.completion_tokens, cached) if self.price else 0.0
        self.total_cost += cost
        parts = [f"{usage.prompt_tokens} in ({cached} cached)", f"{usage.completion_tokens} out",
                 f"${cost:.6f}"]
        if ttft is not None:
            parts.append(f"first token {ttft:.2f} s")
        parts.append(f"{seconds:.2f} s")
        if usage.completion_tokens and seconds > 0:
            parts.append(f"{usage.completion_tokens / seconds:.1f} tok/s")
        return "[" + " · ".join(parts) + "]"

