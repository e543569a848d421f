"""Work a forward may let run between two of its layers.

A step that carries batch work can take tens of milliseconds on a CPU (128 sequences, a 512-token
prompt chunk); an interactive request that arrives meanwhile would wait for its end before its
own prefill even starts. With an Interjection the forward stops at the next layer boundary once
wake_fd is readable (the engine's command pipe: a request arrived) and calls run(), which may
run a whole step of its own on other requests (engine/core.py), then goes on from that layer
with its state untouched: the layers it runs, and so its output, are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Interjection:
    wake_fd: int  # readable when run() may have something to do
    run: Callable[[], None]  # called between two layers; cheap when there is nothing to do
