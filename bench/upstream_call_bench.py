"""What one call through an OpenAIUpstream costs the gateway, streamed and not: sequential calls,
in this process, to the instant upstream stub the gateway benchmarks use (its stream: a role
chunk, 8 content chunks, a finish chunk, a usage chunk, [DONE]; not streamed: one chat.completion).

    python bench/upstream_call_bench.py                 # 3,000 calls a road, twice, alternated
    python bench/upstream_call_bench.py --calls 10000

Prints, for each road, the wall time a call takes and the gateway-side CPU time it spends
(process_time: the client, parsing and translating; the stub runs in its own process). A
non-streamed caller's call takes the non-streamed road (upstream.sends_stream).

Measured 2026-11-25 on the shared 2-core machine, two runs: streamed 320-410 us a call (210-265 us
CPU), not streamed 90-140 us (60-95 us CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

from tokenway.protocol.job import GenerationJob
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.openai_upstream import OpenAIUpstream

STUB = Path(__file__).resolve().parent.parent.parent / "shared" / "bench" / "upstream_stub.py"


async def run(base_url: str, num_calls: int, num_rounds: int) -> None:
    async with OpenAIUpstream("stub", base_url, "stub-model") as upstream:
        for _ in range(num_rounds):
            for stream in (True, False):
                job = GenerationJob("bench", "stub-model", "chat", params=SamplingParams(max_tokens=8),
                                    messages=({"role": "user", "content": "hi"},), stream=stream)
                for _ in range(num_calls // 20):  # warm: connections, caches
                    [event async for event in upstream.generate(job)]
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(num_calls):
                    [event async for event in upstream.generate(job)]
                wall_us = (time.perf_counter() - wall) / num_calls * 1e6
                cpu_us = (time.process_time() - cpu) / num_calls * 1e6
                print(f"{'streamed' if stream else 'not streamed':>13}: {wall_us:6.0f} us a call, "
                      f"{cpu_us:6.0f} us gateway CPU a call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stub", type=Path, default=STUB, help="the stub server (../shared/bench/upstream_stub.py)")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stub = subprocess.Popen([sys.executable, str(args.stub), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        asyncio.run(run(f"http://127.0.0.1:{port}/v1", args.calls, args.rounds))
    finally:
        stub.kill()
        stub.wait()


if __name__ == "__main__":
    main()
