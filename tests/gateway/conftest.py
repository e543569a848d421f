"""Fixtures of the gateway's tests."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_factory(request):
    """The loop a test runs its coroutine on: asyncio's, and uvloop's (the server's: its
    transports are not asyncio.Transport's subclasses)."""
    if request.param == "uvloop":
        return pytest.importorskip("uvloop").new_event_loop
    return asyncio.new_event_loop
