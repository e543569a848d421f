"""What the Responses API keeps of a response (StoredResponse), the store it keeps it in
(ResponseStore, opened by open_response_store) and the errors a client may see from it.

    POST /v1/responses, for the caller's key_id:
      previous_response_id ─► chain(id, key_id) ─► (Turn, ...) oldest first: the conversation it continues
      store: true ─► keep(StoredResponse): inserted without the reply waiting for it
      background: true ─► create(StoredResponse), then update(id, status=..., response=...) as it
                     runs, queued ─► in_progress ─► completed | failed | incomplete
    background, while it runs ─► renew({id: ResponseUsage}, lease_until): its server holds it, and
                     the tokens it has generated so far are kept with the lease; one whose lease ran
                     out (its server stopped) ─► expire(now, ...) ─► failed, by any server, which
                     bills it the usage last kept (server/responses_background.py)
    retention (a TTL) ─► purge(created_before): the finished responses made before it, deleted
    POST /v1/responses/{id}/cancel ─► get, then update(id, status="cancelled", ...)
    GET /v1/responses/{id} ─► get ─► StoredResponse.response;  DELETE /v1/responses/{id} ─► delete
    GET /v1/responses/{id}/input_items ─► input_items ─► InputItemsPage

Every read and delete is scoped to the key that made the response: another key's response is a
miss, exactly as one that never existed. A final status is never overwritten (update is
conditional), so a response cancelled while it runs stays cancelled whatever its runner writes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from tokenway.protocol.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError, truncate
from tokenway.protocol.responses_bodies import ResponseStatus

# A JSON object as decoded (a dict at run time, which json.dumps needs); read-only to the store's
# callers, and a protocol TypedDict passes as one.
JSONObject = Mapping[str, Any]
STATUSES: tuple[ResponseStatus, ...] = get_args(ResponseStatus)
FINAL_STATUSES: frozenset[ResponseStatus] = frozenset({"completed", "failed", "cancelled", "incomplete"})
RUNNING_STATUSES: tuple[ResponseStatus, ...] = ("queued", "in_progress")
# The statuses an update to a status may replace: forward only, never from a final one.
STATUS_TO_FROM_STATUSES: dict[ResponseStatus, tuple[ResponseStatus, ...]] = {
    status: ("queued",) if status == "queued" else ("queued", "in_progress") for status in STATUSES}

ORDERS = ("asc", "desc")
MAX_PAGE_ITEMS = 100  # OpenAI's bound on a list's limit
DEFAULT_CHAIN_LIMIT = 1000  # responses in one conversation: far past any context window's worth of turns
DEFAULT_MEMORY_MAX_BYTES = 256 * 2**20
DEFAULT_NUM_CONNECTIONS = 4
# How long keep() tries an insert through an outage before giving it up (and logging it).
KEEP_PATIENCE_S = 60.0


def check_status(status: str, response: JSONObject) -> None:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    if response.get("status", status) != status:
        raise ValueError(f"status {status!r} disagrees with the response's own {response['status']!r}")


@dataclass(frozen=True, slots=True)
class ResponseUsage:
    """What a background response has used so far, as its server last kept it with its lease:
    what is billed for it if that server stops before it ends. cached_tokens is part of
    prompt_tokens, as in a ledger row."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens) < 0:
            raise ValueError(f"token counts must be >= 0, got {self!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response as kept. input_items: this response's own input (not the conversation it
    continues), each item with its "id", in order. response: the Response object as last
    rendered, JSON-able; its "status", where it has one, is `status`. lease_until: for a
    response that runs detached (background), the unix time until which the server running it
    holds it; that server renews it while it runs, and once it has passed with the response
    still queued or in progress, the response is abandoned (expire). prompt_tokens,
    cached_tokens, completion_tokens: a background response's usage as of its lease's last
    renewal (ResponseUsage); 0 until then, and for one that never ran detached."""

    id: str
    key_id: str  # the owner; "" when the gateway is off
    created_at: float  # unix time
    status: ResponseStatus
    model: str
    previous_response_id: str | None
    instructions: str | None
    input_items: tuple[JSONObject, ...]
    response: JSONObject
    metadata: Mapping[str, str]
    lease_until: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.id.startswith("resp_"):
            raise ValueError(f"a response id starts with 'resp_', got {truncate(self.id)!r}")
        if self.previous_response_id == self.id:
            raise ValueError(f"response {self.id!r} cannot continue itself")
        check_status(self.status, self.response)
        if self.lease_until is not None and not isinstance(self.lease_until, (int, float)):
            raise ValueError(f"lease_until must be a unix time, got {self.lease_until!r}")
        item_ids = set()
        for i, item in enumerate(self.input_items):
            item_id = item.get("id")
            if not isinstance(item_id, str) or not item_id:
                raise ValueError(f"input_items[{i}] has no id")
            if item_id in item_ids:  # `after` in input_items() must name one item
                raise ValueError(f"input_items[{i}]: id {truncate(item_id)!r} appears twice")
            item_ids.add(item_id)
        ResponseUsage(self.prompt_tokens, self.cached_tokens, self.completion_tokens)  # raises on bad counts

    @property
    def usage(self) -> ResponseUsage:
        return ResponseUsage(self.prompt_tokens, self.cached_tokens, self.completion_tokens)


@dataclass(frozen=True, slots=True)
class Turn:
    """One response of a conversation: what it was given and what it answered."""

    response_id: str
    previous_response_id: str | None
    status: ResponseStatus
    model: str
    input_items: tuple[JSONObject, ...]
    output: tuple[JSONObject, ...]  # the response's "output" items


@dataclass(frozen=True, slots=True)
class InputItemsPage:
    data: tuple[JSONObject, ...]
    first_id: str | None
    last_id: str | None
    has_more: bool

    def to_json(self) -> dict[str, Any]:
        """OpenAI's list object."""
        return {"object": "list", "data": list(self.data), "first_id": self.first_id, "last_id": self.last_id,
                "has_more": self.has_more}


def response_not_found(response_id: str) -> NotFoundError:
    """The 404 for a response that is not there for this key: never saying whether another key has it."""
    return NotFoundError(f"Response with id '{truncate(response_id)}' not found.")


class PreviousResponseNotFoundError(InvalidRequestError):
    """previous_response_id, or a response its conversation continues, is not there for this key
    (never made, deleted, or another key's: the message does not tell them apart)."""

    default_code = "previous_response_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="previous_response_id")


class ConversationTooLongError(InvalidRequestError):
    default_code = "conversation_too_long"

    def __init__(self, response_id: str, limit: int) -> None:
        super().__init__(f"The conversation that previous_response_id '{truncate(response_id)}' continues has more "
                         f"than {limit} responses; start a new one with the context it needs.",
                         param="previous_response_id")


class ResponseStoreUnavailable(ServiceUnavailableError):
    """The database the responses are kept in cannot be reached; retry_after: when this store
    tries it next (until then it refuses at once instead of making each call wait out a timeout)."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("Stored responses cannot be read or written now: their database is unreachable.",
                         retry_after=retry_after_s, code="response_store_unavailable")


class ResponseStore(Protocol):
    """The API's side: every call runs its query off the event loop. A database down raises
    ResponseStoreUnavailable (a 503 with Retry-After); a closed store, RuntimeError."""

    async def create(self, response: StoredResponse) -> None: ...

    def keep(self, response: StoredResponse) -> None:
        """create(response) without waiting for it: returns at once, the insert runs on the
        store's threads. Every read or write of this store that follows waits for the inserts
        begun before it (their first try), so a call that continues the response at once finds
        it. Through an outage the insert is tried again until KEEP_PATIENCE_S has passed, then
        given up with an error in the log; close() waits for every insert still going."""
        ...

    async def update(self, response_id: str, *, status: ResponseStatus, response: JSONObject) -> bool:
        """Write a new status and rendering unless the stored status may not move to `status`
        (STATUS_TO_FROM_STATUSES: a final one never does): False then, and when it was deleted."""
        ...

    async def get(self, response_id: str, key_id: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, key_id: str) -> bool: ...

    async def chain(self, response_id: str, key_id: str, limit: int = DEFAULT_CHAIN_LIMIT) -> tuple[Turn, ...]:
        """The conversation that ends with `response_id`, oldest first, `response_id`'s turn last.
        PreviousResponseNotFoundError when it or a response it continues is missing or another
        key's; ConversationTooLongError past `limit` responses."""
        ...

    async def input_items(self, response_id: str, key_id: str, *, after: str | None = None, limit: int = 20,
                          order: Literal["asc", "desc"] = "desc") -> InputItemsPage | None:
        """A page of the response's own input items, in `order`, from the one after `after` (an
        item id; FieldError if the response has none such); None when the response is not there."""
        ...

    async def renew(self, response_id_to_usage: Mapping[str, ResponseUsage], lease_until: float) -> int:
        """Extend the leases of those of the responses still queued or in progress, each with
        its usage so far; how many."""
        ...

    async def expire(self, now: float, abandon: Callable[[JSONObject], JSONObject]) -> tuple[StoredResponse, ...]:
        """Every response queued or in progress whose lease has passed at `now` (or that never had
        one, and is an hour old), stored failed as abandon(its response) renders it; each as
        stored now (its usage the last its server kept), for its bill."""
        ...

    async def purge(self, created_before: float) -> int:
        """Delete the finished responses created before this unix time; how many. One still
        running is kept (expire ends it first)."""
        ...

    async def close(self) -> None:
        """Finish the queries under way, then close every connection. Idempotent."""
        ...


_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: float | str, field_name: str) -> float:
    """'30d', '12h', '90m', '45s', 3600 -> seconds (> 0); ValueError naming field_name else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(str(value))
        if match is None:
            raise ValueError(f"{field_name}: cannot read {value!r} as a duration; use e.g. 30d, 12h, 90m or seconds")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{field_name}: must be a duration > 0, got {value!r}")
    return seconds


def open_response_store(url: str, *, num_connections: int = DEFAULT_NUM_CONNECTIONS,
                        memory_max_bytes: int = DEFAULT_MEMORY_MAX_BYTES) -> ResponseStore:
    """url: the ledger's database (sqlite:///abs/path.db or postgresql://...), or "memory": an
    SQLite database in this process, lost when it exits, keeping the newest responses within
    memory_max_bytes (about: characters of their JSON). Opens nothing yet: each connection is
    opened, and the schema made, by the first query that needs it. num_connections: queries at
    once (the memory store has one)."""
    from functools import partial

    from tokenway.conversations.database import SqlResponseStore
    from tokenway.conversations.sqlite_backend import SqliteBackend

    if num_connections < 1:
        raise ValueError(f"num_connections must be >= 1, got {num_connections}")
    if url == "memory":
        if memory_max_bytes < 1:
            raise ValueError(f"memory_max_bytes must be >= 1, got {memory_max_bytes}")
        # One connection: an SQLite :memory: database is private to the connection that made it.
        return SqlResponseStore(partial(SqliteBackend, ":memory:", max_bytes=memory_max_bytes), 1, "memory")
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path or path == "/:memory:":
            raise ValueError(f"response store url {url!r}: use sqlite:///absolute/path.db, or 'memory'")
        return SqlResponseStore(partial(SqliteBackend, path), num_connections, url)
    if url.startswith(("postgresql://", "postgres://")):
        from tokenway.conversations.postgres_backend import PostgresBackend, connect_kwargs

        kwargs = connect_kwargs(url)  # a malformed url is a configuration error: found now, not per call
        return SqlResponseStore(partial(PostgresBackend, url, kwargs), num_connections, url.split("@", 1)[-1])
    raise ValueError(f"response store url {url!r}: expected sqlite:///path.db, postgresql://... or 'memory'")
