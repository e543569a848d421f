"""Random ids for what a call makes (its request id, its response, a reservation): 128 bits
from the operating system's CSPRNG as 32 hex digits, the shape `uuid.uuid4().hex` had, so
no caller can guess another's.

A gateway call makes three, and each `os.urandom` is a getrandom(2) call (about 4 µs in a
busy server, more than the rest of making the id), so the bytes are drawn 64 ids at a time
and handed out from a deque: `popleft` is atomic, so two threads never get the same id, and
a forked child (serve --workers N) starts with none of its parent's."""

from __future__ import annotations

import os
from collections import deque

_IDS_PER_DRAW = 64
_ready: deque[str] = deque()


def random_hex() -> str:
    """32 random hex digits."""
    try:
        return _ready.popleft()
    except IndexError:
        digits = os.urandom(16 * _IDS_PER_DRAW).hex()
        _ready.extend(digits[start:start + 32] for start in range(32, len(digits), 32))
        return digits[:32]


os.register_at_fork(after_in_child=_ready.clear)
