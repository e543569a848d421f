"""The scheduler's waiting requests, by service class (protocol/job.py): one FIFO per class,
read best class first.

vLLM's priority policy keeps one heap ordered by (priority, arrival_time). With four classes a
deque per class gives that order at O(1) a request, and all-default traffic lives in one deque,
exactly the FCFS queue it had before classes existed. A preempted request goes back to the
front of its class's deque: it resumes before later arrivals of its class, as under FCFS.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from tokenway.engine.request import Request
from tokenway.protocol.job import SERVICE_CLASSES


class WaitingQueue:
    __slots__ = ("by_rank",)

    def __init__(self) -> None:
        # by_rank[class_rank]: that class's waiting requests, the next to admit first.
        self.by_rank: tuple[deque[Request], ...] = tuple(deque() for _ in SERVICE_CLASSES)

    def __len__(self) -> int:
        return sum(map(len, self.by_rank))

    def __bool__(self) -> bool:
        return any(self.by_rank)

    def __iter__(self) -> Iterator[Request]:
        """In admission order: the best class first, each class first come first served."""
        return itertools.chain.from_iterable(self.by_rank)

    def append(self, request: Request) -> None:
        self.by_rank[request.class_rank].append(request)

    def appendleft(self, request: Request) -> None:
        self.by_rank[request.class_rank].appendleft(request)

    def remove(self, request: Request) -> None:
        self.by_rank[request.class_rank].remove(request)

    def num_waiting_by_rank(self) -> list[int]:
        return [len(queue) for queue in self.by_rank]
