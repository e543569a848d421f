"""How far a gateway call in tokenway is from the floor in Python: lone calls, one at a time,
through four doors in front of the same instant upstream (../shared/bench/upstream_stub.py):

    direct     the stub itself
    bare       uvloop + httptools: parse, forward over one kept-alive connection, answer
    lean       the same, doing the essential work a gateway call does: the API key by its hash,
               a sliding-window RPM check, the body and the upstream's answer through orjson,
               the response rebuilt, a journal line written before the response, rate headers
    tokenway   `tokenway serve` on a gateway-only config (keys, limits, ledger, traces on)

    python bench/gateway_floor.py                 # 3,000 calls a door, 3 rounds, alternated
    python bench/gateway_floor.py --calls 1000 --rounds 1
    python bench/gateway_floor.py --limits-url $(scripts/redis.sh start)   # tokenway's limits in Redis
    python bench/gateway_floor.py --limits-url ... --budget-usd 100000     # ... and a budget on its key

Prints each door's round-trip p50 and what it adds over `direct`. The lean door is not a
product: it answers one key, one model and well-formed bodies, and is here to say what the
Python work of a call costs when it is written for that alone (tokenway's added p50 minus the
lean door's is what its path's generality costs a call).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STUB = REPO.parent / "shared" / "bench" / "upstream_stub.py"
LEAN_KEY = "sk-lean-floor"


def serve_door(kind: str, port: int, upstream_port: int, journal: str) -> None:
    """Run the bare or lean door on `port` until killed."""
    import httptools
    import orjson
    import uvloop

    keys = {hashlib.sha256(LEAN_KEY.encode()).hexdigest(): ("key-floor", 10**9)}
    windows: dict[str, deque[float]] = {}
    journal_fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    class Upstream(asyncio.Protocol):
        def __init__(self) -> None:
            self.answer: asyncio.Future[bytes] | None = None
            self.parser = httptools.HttpResponseParser(self)
            self.body: list[bytes] = []

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            answer, self.answer = self.answer, None
            body, self.body = b"".join(self.body), []
            assert answer is not None
            answer.set_result(body)

        async def post(self, body: bytes) -> bytes:
            self.answer = asyncio.get_running_loop().create_future()
            self.transport.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: stub\r\ncontent-type: application/json"
                                 b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            return await self.answer

    class Door(asyncio.Protocol):
        def __init__(self, upstream: Upstream) -> None:
            self.upstream = upstream
            self.parser = httptools.HttpRequestParser(self)
            self.headers: dict[bytes, bytes] = {}
            self.body: list[bytes] = []

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers[name.lower()] = value

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            headers, body = self.headers, b"".join(self.body)
            self.headers, self.body = {}, []
            handle = self.bare if kind == "bare" else self.lean
            asyncio.get_running_loop().create_task(handle(headers, body))

        def reply(self, status: int, body: bytes, extra: bytes = b"") -> None:
            self.transport.write(b"HTTP/1.1 %d \r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
                                 % (status, len(body), extra, body))

        async def bare(self, headers: dict[bytes, bytes], body: bytes) -> None:
            self.reply(200, orjson.dumps(orjson.loads(await self.upstream.post(orjson.dumps(orjson.loads(body))))))

        async def lean(self, headers: dict[bytes, bytes], body: bytes) -> None:
            authorization = headers.get(b"authorization", b"")
            key = keys.get(hashlib.sha256(authorization[7:]).hexdigest()) \
                if authorization.startswith(b"Bearer ") else None
            if key is None:
                return self.reply(401, b'{"error":{"message":"no such key"}}')
            key_id, rpm = key
            request = orjson.loads(body)
            if not isinstance(request, dict) or not isinstance(request.get("model"), str) \
                    or not isinstance(request.get("messages"), list):
                return self.reply(400, b'{"error":{"message":"not a chat request"}}')
            now = time.monotonic()
            window = windows.setdefault(key_id, deque())
            while window and window[0] <= now - 60:
                window.popleft()
            if len(window) >= rpm:
                return self.reply(429, b'{"error":{"message":"rpm"}}')
            window.append(now)
            answer = orjson.loads(await self.upstream.post(orjson.dumps(
                {"model": request["model"], "messages": request["messages"],
                 "max_tokens": request.get("max_tokens"), "stream": False})))
            choice, usage = answer["choices"][0], answer.get("usage") or {}
            request_id = os.urandom(16).hex()
            response = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
                        "model": request["model"], "usage": usage,
                        "choices": [{"index": 0, "message": {"role": "assistant",
                                                             "content": choice["message"]["content"]},
                                     "logprobs": None, "finish_reason": choice["finish_reason"]}]}
            os.write(journal_fd, orjson.dumps({
                "request_id": request_id, "key_id": key_id, "model": request["model"],
                "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                "status": 200, "total_ms": (time.monotonic() - now) * 1000}) + b"\n")
            self.reply(200, orjson.dumps(response), b"x-request-id: %s\r\nx-ratelimit-limit-requests: %d\r\n"
                       b"x-ratelimit-remaining-requests: %d\r\n" % (request_id.encode(), rpm, rpm - len(window)))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(Upstream, "127.0.0.1", upstream_port)
        await loop.create_server(lambda: Door(upstream), "127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(main())


async def round_trips(port: int, key: str, num_calls: int, gap_s: float) -> list[float]:
    """Lone calls on one keep-alive connection, gap_s apart: each one's round trip, in seconds."""
    import json

    body = json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 8}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
               f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(num_calls):
        started = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        times.append(time.perf_counter() - started)
        await asyncio.sleep(gap_s)
    writer.close()
    return times[num_calls // 10:]  # the first tenth warms up


def wait_for(port: int, path: str = "/v1/models", seconds: float = 90) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1)
            return
        except OSError as exc:
            if getattr(exc, "code", None):  # an HTTP error: it answers
                return
            time.sleep(0.2)
    raise RuntimeError(f"nothing answered on port {port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls a door a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="between one call's answer and the next call")
    parser.add_argument("--port", type=int, default=18510, help="the first of five ports")
    parser.add_argument("--limits-url", help="the tokenway door's --limits-url (redis://...: scripts/redis.sh start)")
    parser.add_argument("--budget-usd", help="the tokenway door's key has this budget")
    parser.add_argument("--door", choices=("bare", "lean"), help=argparse.SUPPRESS)  # a door's own process
    parser.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--journal", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.door:
        serve_door(args.door, args.port, args.upstream_port, args.journal)
        return 0
    if not STUB.is_file():
        print(f"no upstream stub at {STUB}", file=sys.stderr)
        return 2
    stub_port, bare_port, lean_port, tw_port = args.port, args.port + 1, args.port + 2, args.port + 3
    processes = []
    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        try:
            processes.append(subprocess.Popen([sys.executable, str(STUB), "--port", str(stub_port)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_for(stub_port)
            for door, port in (("bare", bare_port), ("lean", lean_port)):
                processes.append(subprocess.Popen([sys.executable, __file__, "--door", door, "--port", str(port),
                                                   "--upstream-port", str(stub_port),
                                                   "--journal", str(work_dir / "lean.journal")]))
            config = work_dir / "gateway.toml"
            config.write_text(f'[[models]]\nname = "bench-model"\ncontext_window = 8192\n  [[models.replicas]]\n'
                              f'  kind = "openai"\n  url = "http://127.0.0.1:{stub_port}/v1"\n'
                              f'  model = "bench-model"\n')
            tokenway = [sys.executable, "-m", "tokenway.cli"]
            key = subprocess.run([*tokenway, "keys", "--db", str(work_dir / "keys.db"), "create", "--name", "floor",
                                  "--rpm", "100000000", "--tpm", "100000000000",
                                  *(["--budget-usd", args.budget_usd] if args.budget_usd else [])],
                                 check=True, capture_output=True, text=True, cwd=REPO).stdout.strip()
            processes.append(subprocess.Popen([*tokenway, "serve", "--host", "127.0.0.1", "--port", str(tw_port),
                                               "--config", str(config), "--db", str(work_dir / "keys.db"),
                                               "--no-embeddings", "--log-level", "warning",
                                               *(["--limits-url", args.limits_url] if args.limits_url else [])],
                                              cwd=REPO))
            wait_for(tw_port, "/ready")
            doors = {"direct": (stub_port, "x"), "bare": (bare_port, "x"), "lean": (lean_port, LEAN_KEY),
                     "tokenway": (tw_port, key)}
            p50s: dict[str, list[float]] = {door: [] for door in doors}
            for _ in range(args.rounds):
                for door, (port, secret) in doors.items():
                    times = asyncio.run(round_trips(port, secret, args.calls, args.gap_ms / 1000))
                    p50s[door].append(statistics.median(times) * 1000)
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=15)
    direct = statistics.median(p50s["direct"])
    print(f"lone calls, {args.calls} a door a round, {args.rounds} rounds alternated; round trip p50 (ms):")
    for door, values in p50s.items():
        added = "" if door == "direct" else f"   adds {statistics.median(values) - direct:.3f}"
        print(f"  {door:9s} {' '.join(f'{v:.3f}' for v in values)}{added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
