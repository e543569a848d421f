"""tokenway trace: where a request's time went.

    tokenway trace chatcmpl-3f2a...               the waterfall of one request (its x-request-id)
    tokenway trace --summary [--last 500]         'where the time went' over the last requests
    tokenway trace ... --json                     the raw trace / summary

Asks the running server first (--url; the admin key sees every trace, an API key its own),
then, when the server is unreachable or has forgotten the request, the ledger (--db or
--ledger-url), which keeps every request's stages as of its commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx

from tokenway.observability.traces import Trace, render_summary, render_waterfall, summarize

T = TypeVar("T")


def add_trace_parser(subparsers) -> None:
    trace = subparsers.add_parser("trace", help="a request's stage waterfall, or the summary over recent ones",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trace.add_argument("request_id", nargs="?", help="the response's id / x-request-id header")
    trace.add_argument("--summary", action="store_true", help="the per-stage table over the last requests")
    trace.add_argument("--last", type=int, default=500, help="how many requests --summary covers (default 500)")
    trace.add_argument("--url", default=os.environ.get("TOKENWAY_URL", "http://127.0.0.1:8000"),
                       help="the server (default $TOKENWAY_URL or http://127.0.0.1:8000)")
    trace.add_argument("--admin-key", default=os.environ.get("TOKENWAY_ADMIN_KEY"),
                       help="sees every key's traces (default $TOKENWAY_ADMIN_KEY)")
    trace.add_argument("--api-key", default=os.environ.get("TOKENWAY_API_KEY"),
                       help="sees this key's traces (default $TOKENWAY_API_KEY)")
    trace.add_argument("--db", help="the SQLite file whose ledger to read when the server cannot answer")
    trace.add_argument("--ledger-url", help="sqlite:///path or postgresql://... instead of --db")
    trace.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_trace(args: argparse.Namespace) -> int:
    if not args.summary and not args.request_id:
        print("tokenway: trace needs a request id, or --summary", file=sys.stderr)
        return 2
    if args.last < 1:
        print("tokenway: --last must be >= 1", file=sys.stderr)
        return 2
    data, problem = from_server(args)
    if data is None:
        data = from_ledger(args)
        if data is None:
            what = "recent requests" if args.summary else f"request {args.request_id}"
            print(f"tokenway: no trace of {what}: {problem}; not in the ledger either", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(data, indent=2))
    elif args.summary:
        print(render_summary(data))
    else:
        print(render_waterfall(data))
    return 0


def from_server(args: argparse.Namespace) -> tuple[dict | None, str]:
    """(the trace or summary, None) from the server, or (None, why not)."""
    prefix = "/admin/traces" if args.admin_key else "/v1/traces"
    key = args.admin_key or args.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path, params = (prefix, {"summary": "true", "limit": args.last}) if args.summary else \
        (f"{prefix}/{args.request_id}", None)
    try:
        response = httpx.get(args.url.rstrip("/") + path, params=params, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        return None, f"{args.url} did not answer ({type(exc).__name__})"
    if response.status_code == 200:
        return response.json(), ""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return None, f"{args.url} answered {response.status_code}: {message}"


def from_ledger(args: argparse.Namespace) -> dict | None:
    from tokenway.billing.ledger import Ledger
    from tokenway.keys_cli import default_db_path

    url = args.ledger_url
    if url is None:
        db = Path(args.db) if args.db else default_db_path()
        if not db.exists():
            return None
        url = f"sqlite:///{db.resolve()}"

    async def read(query: Callable[[Ledger], Awaitable[T]]) -> T:
        ledger = Ledger(url)
        try:
            return await query(ledger)
        finally:
            await ledger.close()

    if args.summary:
        rows = asyncio.run(read(lambda ledger: ledger.recent(args.last)))
        return summarize([Trace.from_usage_record(row) for row in rows]) if rows else None
    row = asyncio.run(read(lambda ledger: ledger.get(args.request_id)))
    return None if row is None else Trace.from_usage_record(row).to_dict()
