"""Half-open HTTP connections (slowloris) and a /health prober, for tests/e2e/test_slowloris.py
and bench/slowloris_bench.py.

    flood = Flood.start(port, num_connections=10_000, sources=("127.0.0.2",))   # a child process
    flood.wait_opened()          # every connection attempted; the child holds them open
    ... probe meanwhile ...
    stats = flood.stop()         # closes them all (RST: no TIME_WAIT left) and says what it saw

Each connection sends the start of a request head, `GET /health HTTP/1.1\r\nHost: x\r\n`, and
never finishes it. A flood runs in its own process: one process may hold no more sockets than
its RLIMIT_NOFILE, and two of them together can hold more than the server's. It binds each
socket to one of `sources` (Linux routes all of 127/8 to lo) so a test chooses whether the
attacker shares the health checker's address.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"
IP_BIND_ADDRESS_NO_PORT = 24  # Linux: pick the source port at connect, by the whole 4-tuple
CONNECT_TIMEOUT_SECONDS = 3.0  # a SYN dropped by a full accept queue is resent after 1 s, then 3 s


@dataclass(frozen=True, slots=True)
class FloodStats:
    num_connected: int  # connections established and sent their partial head
    num_failed: int  # connect refused, reset or timed out
    num_closed_by_server: int  # of the connected, closed by the server by the time the flood stopped


class Flood:
    """A child process holding half-open connections until stop()."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.stats: FloodStats | None = None

    @classmethod
    def start(cls, port: int, num_connections: int, sources: tuple[str, ...], host: str = "127.0.0.1",
              concurrency: int = 256) -> Flood:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--host", host, "--port", str(port),
             "--connections", str(num_connections), "--concurrency", str(concurrency), *sum(
                 (["--source", source] for source in sources), [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return cls(process)

    def wait_opened(self, timeout: float = 120.0) -> dict:
        """The child's first line, once every connection was attempted: {"num_connected", "num_failed", "seconds"}."""
        line = _readline(self.process, timeout)
        return json.loads(line)

    def stop(self, timeout: float = 60.0) -> FloodStats:
        """Closes every connection; the counts as the child saw them just before."""
        if self.stats is None:
            try:
                self.process.stdin.close()
                self.stats = FloodStats(**json.loads(_readline(self.process, timeout)))
            finally:
                self.process.wait(timeout)
        return self.stats


def _readline(process: subprocess.Popen, timeout: float) -> str:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or not lines[0]:
        process.kill()
        raise RuntimeError(f"the flood process gave no answer (exit {process.poll()})")
    return lines[0]


# ---- /health, probed from a thread ----------------------------------------------------------------


@dataclass
class HealthProber:
    """GET /health on a new connection every `interval` seconds (as a load balancer's check),
    from a thread, recording each answer's status (0: no answer) and latency."""

    port: int
    interval: float = 0.1
    host: str = "127.0.0.1"
    timeout: float = 10.0
    statuses: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProber:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self.statuses.append(self.probe())
            self.latencies.append(time.perf_counter() - started)
            self._stop.wait(max(0.0, self.interval - (time.perf_counter() - started)))

    def probe(self) -> int:
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                received = b""
                while chunk := sock.recv(4096):
                    received += chunk
        except OSError:
            return 0
        status_line = received.split(b"\r\n", 1)[0].split()
        return int(status_line[1]) if len(status_line) > 1 and status_line[1].isdigit() else 0

    def summary(self) -> str:
        ordered = sorted(self.latencies)
        if not ordered:
            return "no probes"
        p50, p99 = ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return (f"{len(ordered)} probes, {sum(s == 200 for s in self.statuses)} answered 200; "
                f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms")


# ---- the child process ----------------------------------------------------------------------------


async def _open(loop: asyncio.AbstractEventLoop, host: str, port: int, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
        sock.bind((source, 0))
        async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
            await loop.sock_connect(sock, (host, port))
        sock.send(PARTIAL_HEAD)
    except BaseException:
        sock.close()
        raise
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


async def _flood(host: str, port: int, num_connections: int, sources: list[str], concurrency: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    max_open = hard - 64
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(concurrency)
    sockets: list[socket.socket] = []
    num_failed = 0

    async def one(i: int) -> None:
        nonlocal num_failed
        async with slots:
            try:
                sockets.append(await _open(loop, host, port, sources[i % len(sources)]))
            except (OSError, TimeoutError) as exc:
                if getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE):
                    raise
                num_failed += 1

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(min(num_connections, max_open))))
    print(json.dumps({"num_connected": len(sockets), "num_failed": num_failed,
                      "seconds": round(time.monotonic() - started, 2)}), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # hold them until the parent closes stdin
    num_closed = sum(map(_closed_by_server, sockets))
    for sock in sockets:
        sock.close()
    print(json.dumps({"num_connected": len(sockets), "num_failed": num_failed, "num_closed_by_server": num_closed}),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--source", action="append", help="source address(es), round robin (default 127.0.0.2)")
    parser.add_argument("--concurrency", type=int, default=256, help="connects in flight at once")
    args = parser.parse_args()
    asyncio.run(_flood(args.host, args.port, args.connections, args.source or ["127.0.0.2"], args.concurrency))


if __name__ == "__main__":
    main()
