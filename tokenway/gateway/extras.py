"""The packages a shared store needs and a plain install lacks: redis for --limits-url redis://,
psycopg for a postgresql:// key store or ledger. Both come with `pip install 'tokenway[scale]'`;
without them the option is refused in one line that says so, before anything starts."""

from __future__ import annotations

import importlib.util

SCALE_EXTRA = "pip install 'tokenway[scale]'"
_SCHEME_TO_PACKAGE = {"redis://": "redis", "rediss://": "redis", "unix://": "redis",
                      "postgresql://": "psycopg", "postgres://": "psycopg"}


def missing_package(option: str, url: str | None) -> str | None:
    """The one-line error for an option whose url needs a package that is not installed; None
    when it needs none or it is there. option: as the command line spells it (--limits-url)."""
    if url is None:
        return None
    package = next((name for scheme, name in _SCHEME_TO_PACKAGE.items() if url.startswith(scheme)), None)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"{option} {url.split('://', 1)[0]}://... needs the {package} package, not installed: {SCALE_EXTRA}"
