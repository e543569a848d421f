"""tokenway keys create | list | revoke | rotate | export | import: API keys, straight in the
store the gateways read: the SQLite file (a running gateway sees a change within its key cache's
refresh interval) or, with --store-url postgresql://..., the database every gateway shares (each
sees it at once).

    tokenway keys create --name ci --models smollm2-135m-instruct --rpm 60 --expires 30d
    tokenway keys create --name app --tiers default,flex,priority
    tokenway keys list
    tokenway keys revoke k_3f9a2c1b
    tokenway keys rotate k_3f9a2c1b
    tokenway keys export > keys.jsonl                                # every key, secret hashes only
    tokenway keys --store-url postgresql://db/tokenway import keys.jsonl

create and rotate print the secret alone on stdout (so `KEY=$(tokenway keys create ...)`
works) and everything else on stderr. import adds the keys the store lacks and leaves those it
holds with the same values; one it holds with other values refuses the whole import.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

from tokenway.gateway.keystore import KeyInfo, KeyStore, KeyStoreUnavailable, StoredKey, UnknownKeyError
from tokenway.protocol.job import SERVICE_CLASSES, ServiceClass
from tokenway.safety.screen import SafetyPolicy

_DURATION_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def default_db_path() -> Path:
    """$TOKENWAY_DATA_DIR/tokenway.db, else ~/.local/share/tokenway/tokenway.db."""
    data_dir = os.environ.get("TOKENWAY_DATA_DIR")
    base = Path(data_dir) if data_dir else Path.home() / ".local" / "share" / "tokenway"
    return base / "tokenway.db"


def parse_expires(text: str, now: float) -> float | None:
    """'never' -> None; '30d', '12h', '2w', '90m' -> now + that; '2026-12-31' (00:00 UTC that day)
    or an ISO datetime (UTC unless it carries an offset) -> unix seconds."""
    text = text.strip()
    if text.lower() == "never":
        return None
    match = re.fullmatch(r"(\d+)\s*([mhdw])", text.lower())
    if match:
        if int(match.group(1)) == 0:
            raise ValueError(f"--expires: {text!r} is already over")
        return now + int(match.group(1)) * _DURATION_UNITS[match.group(2)]
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--expires: cannot read {text!r}; use e.g. 30d, 12h, 2026-12-31 or never") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def add_keys_parser(subparsers) -> None:
    keys = subparsers.add_parser("keys", help="create, list, revoke and rotate API keys",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    keys.add_argument("--db", help="the SQLite file (default $TOKENWAY_DATA_DIR/tokenway.db, "
                                   "else ~/.local/share/tokenway/tokenway.db)")
    keys.add_argument("--store-url", help="the key store the gateways share, postgresql://... (or "
                                          "sqlite:///path), in place of --db: as `serve --store-url`")
    sub = keys.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="make a key and print its secret, once")
    create.add_argument("--name", required=True)
    create.add_argument("--models", help="comma-separated served model names the key may use (default: all)")
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="tokens per minute")
    create.add_argument("--tpd", type=int, help="tokens per day")
    create.add_argument("--max-concurrent", type=int, help="requests in flight at once")
    create.add_argument("--max-tokens", type=int, help="cap on one request's max_tokens")
    create.add_argument("--budget-usd", type=float, help="spend allowed before requests get 429")
    create.add_argument("--expires", default="never", help="30d, 12h, 2026-12-31, an ISO datetime, or never")
    create.add_argument("--safety-input", choices=["off", "flag", "redact", "block"],
                        help="the key's own safety policy for its prompts (default: the model's or the server's)")
    create.add_argument("--safety-output", choices=["off", "flag", "redact", "block"], help="... for its replies")
    create.add_argument("--safety-categories", help="comma-separated (default: all)")
    create.add_argument("--tiers", help="comma-separated service tiers its calls may run at, of "
                                        f"{', '.join(SERVICE_CLASSES)} (default: the server's grant)")
    create.add_argument("--response-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="its calls may (--no-: may not) be answered from the response cache, whatever "
                             "the model's [models.cache] says (default: as the model says)")
    listing = sub.add_parser("list", help="all keys with their limits (never a secret)")
    listing.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    for command, text in (("revoke", "stop a key working"), ("rotate", "give a key a new secret")):
        sub.add_parser(command, help=text).add_argument("key_id")
    sub.add_parser("export", help="every key, revoked ones too, as JSON lines on stdout (secret hashes, never "
                                  "secrets): for import into another store")
    sub.add_parser("import", help="add the keys of an export this store lacks (idempotent)").add_argument(
        "file", help="the JSON lines of `tokenway keys export`; - for stdin")
    # `tokenway keys --db X list` and `tokenway keys list --db X` both work.
    for parser in sub.choices.values():
        parser.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        parser.add_argument("--store-url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def run_keys(args: argparse.Namespace) -> int:
    db, store_url = getattr(args, "db", None), getattr(args, "store_url", None)
    if db and store_url:
        print("tokenway: give --db or --store-url, not both", file=sys.stderr)
        return 2
    try:
        with KeyStore(store_url or db or default_db_path()) as store:
            return _COMMANDS[args.keys_command](store, args)
    # RuntimeError: psycopg missing; OSError: an import's file
    except (UnknownKeyError, KeyStoreUnavailable, RuntimeError, OSError) as exc:
        print(f"tokenway: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"tokenway: {exc}", file=sys.stderr)
        return 2


def _create(store: KeyStore, args: argparse.Namespace) -> int:
    models = tuple(name.strip() for name in args.models.split(",") if name.strip()) if args.models else None
    secret, info = store.create(
        args.name, models=models, rpm=args.rpm, tpm=args.tpm, tpd=args.tpd, max_concurrent=args.max_concurrent,
        max_tokens=args.max_tokens, budget_usd=args.budget_usd, expires_at=parse_expires(args.expires, time.time()),
        safety=_safety(args), service_tiers=_tiers(args.tiers), response_cache=args.response_cache)
    expiry = f", expires {_when(info.expires_at)}" if info.expires_at is not None else ""
    _print_secret(f"created API key {info.key_id} ({info.name!r}{expiry})", secret)
    return 0


def _rotate(store: KeyStore, args: argparse.Namespace) -> int:
    secret = store.rotate(args.key_id)
    _print_secret(f"rotated API key {args.key_id}; its old secret no longer works", secret)
    return 0


def _revoke(store: KeyStore, args: argparse.Namespace) -> int:
    if store.revoke(args.key_id):
        # An operator may fear the last revocation reopens a loopback server: it does not.
        last = (" (no live key is left: a server on this store refuses every call until you create one, "
                "unless it runs with --auth off)") if store.count_active() == 0 else ""
        print(f"tokenway: revoked API key {args.key_id}{last}", file=sys.stderr)
        return 0
    if store.get(args.key_id) is None:
        raise UnknownKeyError(f"no API key {args.key_id!r}")
    print(f"tokenway: API key {args.key_id} was already revoked", file=sys.stderr)
    return 0


def _list(store: KeyStore, args: argparse.Namespace) -> int:
    infos = store.list()
    if args.json:
        print(json.dumps([info.to_dict() for info in infos], indent=2))
    else:
        print(format_table(infos, time.time()))
    return 0


def _export(store: KeyStore, args: argparse.Namespace) -> int:
    keys = store.export()
    for key in keys:
        print(json.dumps(key.to_dict()))
    print(f"tokenway: exported {len(keys)} API key(s) from {store.where}", file=sys.stderr)
    return 0


def _import(store: KeyStore, args: argparse.Namespace) -> int:
    lines = sys.stdin.readlines() if args.file == "-" else Path(args.file).read_text().splitlines()
    keys = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            keys.append(StoredKey.from_dict(json.loads(line)))
        except ValueError as exc:  # json's errors are ValueErrors too
            raise ValueError(f"{args.file}, line {number}: {exc}; nothing was imported") from None
    result = store.import_keys(keys)
    print(f"tokenway: imported {result.num_added} API key(s) into {store.where}; {result.num_unchanged} were "
          "there already", file=sys.stderr)
    return 0


_COMMANDS = {"create": _create, "list": _list, "revoke": _revoke, "rotate": _rotate, "export": _export,
             "import": _import}


def _print_secret(what: str, secret: str) -> None:
    print(f"tokenway: {what}. The secret below is shown only this once; store it now.", file=sys.stderr)
    print(secret, flush=True)


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _safety(args: argparse.Namespace) -> SafetyPolicy | None:
    """The key's own policy, when any --safety-* flag is given (the modes not given: off)."""
    if args.safety_input is None and args.safety_output is None and args.safety_categories is None:
        return None
    categories = args.safety_categories
    return SafetyPolicy(input=args.safety_input or "off", output=args.safety_output or "off",
                        categories=frozenset(c.strip() for c in categories.split(",") if c.strip())
                        if categories else None)


def _tiers(text: str | None) -> tuple[ServiceClass, ...] | None:
    """--tiers as given (KeyStore.create refuses a name that is no tier); None: the server's grant."""
    if text is None:
        return None
    return cast("tuple[ServiceClass, ...]", tuple(tier.strip() for tier in text.split(",") if tier.strip()))


def _limit(value: float | None) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def format_table(infos: list[KeyInfo], now: float) -> str:
    header = ("ID", "NAME", "HINT", "STATUS", "MODELS", "RPM", "TPM", "TPD", "CONCURRENT", "MAX_TOKENS",
              "BUDGET_USD", "TIERS", "EXPIRES", "CREATED", "LAST_USED")
    rows = [header] + [
        (info.key_id, info.name, info.hint, info.status(now), ",".join(info.models) if info.models else "all",
         _limit(info.rpm), _limit(info.tpm), _limit(info.tpd), _limit(info.max_concurrent),
         _limit(info.max_tokens), _limit(info.budget_usd),
         ",".join(info.service_tiers) if info.service_tiers is not None else "server's", _when(info.expires_at),
         _when(info.created_at),
         _when(info.last_used_at))
        for info in infos
    ]
    if not infos:
        return "no API keys; make one with: tokenway keys create --name NAME"
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
