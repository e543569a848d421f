"""tokenway batches: the Batch API from the terminal, through the official openai SDK, so it
works against any server that speaks OpenAI's Files and Batches (this one first).

    tokenway batches submit requests.jsonl [--endpoint /v1/chat/completions] [--watch]
    tokenway batches list
    tokenway batches status batch_...
    tokenway batches watch batch_...          a progress bar until the batch ends
    tokenway batches results batch_... -o out.jsonl --errors errors.jsonl
    tokenway batches cancel batch_...

Each line of the JSONL is one request, as OpenAI's Batch API takes it:
    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., ...}}
The server checks every line as the file is uploaded and names the bad ones by line number.

The server is --base-url (default $TOKENWAY_BASE_URL, else $TOKENWAY_URL, else the local one),
with or without /v1; the key is --api-key (default $TOKENWAY_API_KEY). `watch` and
`submit --watch` exit 0 when the batch completed, 1 when it ended otherwise (failed, expired,
cancelled).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import openai
    from openai.types import Batch

DEFAULT_URL = "http://127.0.0.1:8000"
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
MAX_ERRORS_SHOWN = 20


class CliError(Exception):
    """One line for the user, and the exit status: 2 bad input, 1 the server's refusal or a failure."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def add_batches_parser(subparsers) -> None:
    batches = subparsers.add_parser("batches", help="submit, watch and download Batch API jobs",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--base-url", "--url", dest="base_url",
                        default=os.environ.get("TOKENWAY_BASE_URL") or os.environ.get("TOKENWAY_URL") or DEFAULT_URL,
                        help="the server, with or without /v1 (default $TOKENWAY_BASE_URL, else $TOKENWAY_URL, "
                             f"else {DEFAULT_URL})")
    server.add_argument("--api-key", default=os.environ.get("TOKENWAY_API_KEY"),
                        help="the API key the batch runs as (default $TOKENWAY_API_KEY)")
    sub = batches.add_subparsers(dest="batches_command", required=True)
    submit = sub.add_parser("submit", parents=[server], help="upload a JSONL of requests and start its batch")
    submit.add_argument("file", type=Path, help="the requests, one JSON object a line")
    submit.add_argument("--endpoint", help="what every line calls (default: the first line's url)")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                        help="a metadata pair kept with the batch; repeatable")
    submit.add_argument("--watch", action="store_true", help="then show its progress until it ends")
    submit.add_argument("--interval", type=float, default=1.0, help="seconds between looks with --watch")
    listing = sub.add_parser("list", parents=[server], help="the key's batches, newest first")
    listing.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    listing.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    status = sub.add_parser("status", parents=[server], help="one batch: status, counts, files")
    status.add_argument("batch_id")
    status.add_argument("--json", action="store_true", help="the Batch object as the server answered it")
    watch = sub.add_parser("watch", parents=[server], help="a progress bar until the batch ends")
    watch.add_argument("batch_id")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between looks (default 1)")
    results = sub.add_parser("results", parents=[server], help="download an ended batch's output and errors")
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", type=Path, help="where the output lines go (default: stdout)")
    results.add_argument("--errors", type=Path, help="where the error lines go (default: not downloaded)")
    sub.add_parser("cancel", parents=[server], help="stop a batch: lines not started are not run").add_argument(
        "batch_id")


def run_batches(args: argparse.Namespace) -> int:
    try:
        import openai
    except ImportError:
        print("tokenway: `tokenway batches` needs the openai package: pip install 'tokenway[client]'",
              file=sys.stderr)
        return 2
    try:
        with openai_errors(openai, args.base_url):
            client = openai.OpenAI(base_url=v1(args.base_url), api_key=args.api_key or "none", max_retries=2,
                                   timeout=60)
            return COMMANDS[args.batches_command](client, args)
    except CliError as exc:
        print(f"tokenway: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print("\ntokenway: stopped watching; the batch runs on (`tokenway batches cancel ID` stops it)",
              file=sys.stderr)
        return 130


@contextmanager
def openai_errors(openai: Any, base_url: str) -> Iterator[None]:
    """The SDK's exceptions as one line each: what the server said, or that it did not answer."""
    try:
        yield
    except openai.APIStatusError as exc:
        raise CliError(f"{base_url} answered {exc.status_code}: {server_message(exc)}") from None
    except openai.APIConnectionError as exc:
        raise CliError(f"cannot reach {base_url} ({type(exc.__cause__ or exc).__name__})") from None
    except openai.APIError as exc:
        raise CliError(f"{base_url}: {exc.message}") from None


def server_message(exc: Any) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
    return exc.message


def v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# ---- the commands ----


def _submit(client: openai.OpenAI, args: argparse.Namespace) -> int:
    path: Path = args.file
    if not path.is_file():
        raise CliError(f"{path}: no such file", 2)
    endpoint = args.endpoint or first_url(path)
    metadata = parse_metadata(args.metadata)
    if args.watch and not args.interval > 0:
        raise CliError("--interval must be > 0", 2)
    with path.open("rb") as content:
        file = client.files.create(file=(path.name, content), purpose="batch")
    print(f"tokenway: uploaded {path} as {file.id} ({file.bytes} bytes)", file=sys.stderr)
    # The SDK types endpoint as OpenAI's list; the server says which it runs.
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint,  # pyright: ignore[reportArgumentType]
                                  completion_window="24h", metadata=metadata or None)
    print(batch.id, flush=True)  # alone on stdout: BATCH=$(tokenway batches submit ...)
    if batch.status == "failed":
        return report_end(batch)
    print(f"tokenway: batch {batch.id}: {batch.request_counts.total if batch.request_counts else '?'} "
          f"requests to {endpoint}, {batch.status}", file=sys.stderr)
    return watch_until_ended(client, batch, args.interval) if args.watch else 0


def _list(client: openai.OpenAI, args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise CliError("--limit must be >= 1", 2)
    batches: list[Batch] = []
    for batch in client.batches.list(limit=min(args.limit, 100)):  # the SDK pages on as we iterate
        batches.append(batch)
        if len(batches) == args.limit:
            break
    if args.json:
        print(json.dumps([batch.model_dump(mode="json") for batch in batches], indent=2))
    elif not batches:
        print("no batches; make one with: tokenway batches submit FILE.jsonl", file=sys.stderr)
    else:
        print(format_table(batches))
    return 0


def _status(client: openai.OpenAI, args: argparse.Namespace) -> int:
    batch = client.batches.retrieve(args.batch_id)
    if args.json:
        print(batch.model_dump_json(indent=2))
        return 0
    done, failed, total = progress_of(batch)
    rows = [("id", batch.id), ("status", batch.status), ("endpoint", batch.endpoint), ("model", batch.model or "-"),
            ("requests", f"{done} of {total} done, {failed} failed"), ("created", when(batch.created_at)),
            ("expires", when(batch.expires_at))]
    rows += [(name.removesuffix("_at"), when(getattr(batch, name))) for name in
             ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at") if getattr(batch, name) is not None]
    rows += [("input file", batch.input_file_id), ("output file", batch.output_file_id or "-"),
             ("error file", batch.error_file_id or "-")]
    if batch.metadata:
        rows.append(("metadata", json.dumps(batch.metadata)))
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name.ljust(width)}  {value}" for name, value in rows))
    for line in error_lines(batch):
        print(line)
    return 0


def _watch(client: openai.OpenAI, args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise CliError("--interval must be > 0", 2)
    return watch_until_ended(client, client.batches.retrieve(args.batch_id), args.interval)


def _results(client: openai.OpenAI, args: argparse.Namespace) -> int:
    batch = client.batches.retrieve(args.batch_id)
    if batch.status not in FINAL_STATUSES:
        done, _, total = progress_of(batch)
        raise CliError(f"batch {batch.id} is {batch.status} ({done} of {total} done): its results come once it "
                       f"has ended (`tokenway batches watch {batch.id}`)")
    if batch.status == "failed":
        return report_end(batch)
    if batch.output_file_id is None:
        print(f"tokenway: batch {batch.id} ({batch.status}) has no output lines", file=sys.stderr)
    else:
        num_bytes = download(client, batch.output_file_id, args.output)
        if args.output is not None:
            print(f"tokenway: {num_bytes} bytes of output lines in {args.output}", file=sys.stderr)
    if batch.error_file_id is not None:
        if args.errors is None:
            _, failed, _ = progress_of(batch)
            print(f"tokenway: {failed} lines failed (or were not run): their error lines are in "
                  f"{batch.error_file_id}; --errors PATH saves them", file=sys.stderr)
        else:
            num_bytes = download(client, batch.error_file_id, args.errors)
            print(f"tokenway: {num_bytes} bytes of error lines in {args.errors}", file=sys.stderr)
    return 0


def _cancel(client: openai.OpenAI, args: argparse.Namespace) -> int:
    batch = client.batches.cancel(args.batch_id)
    done, _, total = progress_of(batch)
    if batch.status in ("cancelling", "cancelled"):
        print(f"tokenway: batch {batch.id} is {batch.status}: {done} of {total} done; the lines not started "
              "will not run", file=sys.stderr)
        return 0
    raise CliError(f"batch {batch.id} has already ended ({batch.status}): nothing to cancel")


COMMANDS: dict[str, Callable[[Any, argparse.Namespace], int]] = {
    "submit": _submit, "list": _list, "status": _status, "watch": _watch, "results": _results, "cancel": _cancel}


# ---- helpers ----


def first_url(path: Path) -> str:
    """The endpoint a file's lines call, from its first line (the server checks that every line
    calls the batch's endpoint, and names those that do not)."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                url = json.loads(line).get("url")
            except (ValueError, AttributeError):
                raise CliError(f"{path}, line {number}: not a JSON object; each line is one request", 2) from None
            if not isinstance(url, str):
                raise CliError(f"{path}, line {number}: no \"url\"; give the batch's endpoint with --endpoint", 2)
            return url
    raise CliError(f"{path} is empty: a batch needs at least one request", 2)


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--metadata: expected KEY=VALUE, got {pair!r}", 2)
        metadata[key] = value
    return metadata


def progress_of(batch: Batch) -> tuple[int, int, int]:
    """(done, failed, total) of the batch's requests; done counts the failed ones."""
    counts = batch.request_counts
    if counts is None:
        return 0, 0, 0
    return counts.completed + counts.failed, counts.failed, counts.total


def watch_until_ended(client: openai.OpenAI, batch: Batch, interval_s: float) -> int:
    """A tqdm bar over the batch's requests (done of total, rate, ETA, failed) until it ends."""
    from tqdm import tqdm

    done, failed, total = progress_of(batch)
    with tqdm(total=total, initial=done, unit="req", desc=batch.id, dynamic_ncols=True, file=sys.stderr) as bar:
        bar.set_postfix_str(f"{batch.status}, {failed} failed")
        while batch.status not in FINAL_STATUSES:
            time.sleep(interval_s)
            batch = client.batches.retrieve(batch.id)
            done, failed, total = progress_of(batch)
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{batch.status}, {failed} failed")
    return report_end(batch)


def report_end(batch: Batch) -> int:
    """The final status in one line (and a failed batch's errors); 0 for completed."""
    done, failed, total = progress_of(batch)
    files = ", ".join(f"{what} {file_id}" for what, file_id in (("output", batch.output_file_id),
                                                                 ("errors", batch.error_file_id)) if file_id)
    print(f"tokenway: batch {batch.id} {batch.status}: {done} of {total} done, {failed} failed"
          f"{'; ' + files if files else ''}", file=sys.stderr)
    for line in error_lines(batch):
        print(line, file=sys.stderr)
    if files:
        print(f"tokenway: download them with: tokenway batches results {batch.id} -o output.jsonl "
              "--errors errors.jsonl", file=sys.stderr)
    return 0 if batch.status == "completed" else 1


def error_lines(batch: Batch) -> list[str]:
    """A batch refused whole (failed): why, by input line."""
    errors = batch.errors.data if batch.errors is not None and batch.errors.data else []
    shown = [f"  line {error.line}: {error.message}" if error.line is not None else f"  {error.message}"
             for error in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        shown.append(f"  ... and {len(errors) - MAX_ERRORS_SHOWN} more (tokenway batches status {batch.id} --json)")
    return shown


def download(client: openai.OpenAI, file_id: str, path: Path | None) -> int:
    """The file's bytes, streamed to `path` (stdout when None); how many."""
    num_bytes = 0
    with client.files.with_streaming_response.content(file_id) as response, open_output(path) as out:
        for chunk in response.iter_bytes():
            out.write(chunk)
            num_bytes += len(chunk)
    return num_bytes


@contextmanager
def open_output(path: Path | None) -> Iterator[IO[bytes]]:
    if path is None:
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    try:
        out = path.open("wb")
    except OSError as exc:
        raise CliError(f"{path}: cannot write ({exc.strerror})", 2) from None
    with out:
        yield out


def when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def format_table(batches: list[Batch]) -> str:
    header = ("ID", "STATUS", "ENDPOINT", "MODEL", "DONE", "FAILED", "TOTAL", "CREATED")
    rows: list[tuple[str, ...]] = [header]
    for batch in batches:
        done, failed, total = progress_of(batch)
        rows.append((batch.id, batch.status, batch.endpoint, batch.model or "-", str(done), str(failed), str(total),
                     when(batch.created_at)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
