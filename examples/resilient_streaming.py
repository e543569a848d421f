"""Resilient streaming against `tokenway serve`: retries, a deadline, a first-token timeout, a
fallback server, and a stream that breaks midway picked up where it stopped.

    tokenway serve &
    python examples/resilient_streaming.py [--url http://127.0.0.1:8000] [--fallback-url URL]
                                           [--break-after 20]

--break-after N closes the stream after N chunks, as a dropped connection would end it, then
asks the server to go on from the text that arrived (continue_final_message), so the whole
reply is printed once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import openai

from tokenway.client.resilience import Policy
from tokenway.client.resilient import ResilientChat


async def main(args: argparse.Namespace) -> int:
    clients = [openai.AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="unused")
               for url in [args.url, *args.fallback_url]]
    chat = ResilientChat(clients, Policy(max_attempts=5, deadline=120, ttft_timeout=30))
    model = (await clients[0].models.list()).data[0].id
    request = {"model": model, "messages": [{"role": "user", "content": args.prompt}], "max_tokens": 96,
               "temperature": 0, "stream_options": {"include_usage": True}}
    stream = await chat.stream(**request)
    async for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
        if args.break_after and stream.result.num_chunks >= args.break_after:
            await stream.close()  # as if the connection dropped here
    result = stream.result
    if not result.complete:
        print(f"\n[broke off after {result.num_chunks} chunks: {type(result.error).__name__}; going on]")
        rest = await chat.stream(**result.continue_request(request))
        async for chunk in rest:
            for choice in chunk.choices:
                print(choice.delta.content or "", end="", flush=True)
        result = rest.result
    print(f"\n[{result.finish_reason}; served by {result.endpoint}; first token {result.ttft:.2f} s; "
          f"{len(stream.attempts)} failed attempts before the stream opened]")
    for client in clients:
        await client.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--fallback-url", action="append", default=[])
    parser.add_argument("--prompt", default="Write a short poem about the sea.")
    parser.add_argument("--break-after", type=int, default=0)
    sys.exit(asyncio.run(main(parser.parse_args())))
