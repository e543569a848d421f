"""Vector stores for retrieval and memory: sqlite-vec in a file by default, PostgreSQL at scale.

    store = SqliteVecStore("rag.db")                  # or ":memory:"
    store = PostgresVectorStore("postgresql://...")   # store.mode: "pgvector" or "exact"
    store.add([Item("a#0", vector, "text", "a.md", namespace="docs", section="Intro", span=(0, 120))])
    store.search(query_vector, k=4, namespace="docs") -> [Hit(record, score)], best first

An item belongs to a namespace (a corpus, a user's memory) and a source (the document it came
from); ids are unique across the store. Vectors are L2-normalised once, on the way in (items
by add, the query by search), so a score is the cosine similarity, in [-1, 1]. Search is
exact nearest neighbours in SqliteVecStore (a vec0 scan: ~12 ms over 20,000 384-dim vectors
on this machine) and in PostgresVectorStore's "exact" mode; approximate (HNSW) in "pgvector".
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, LiteralString, Protocol, TypeAlias, cast

import numpy as np

MAX_K = 4096  # sqlite-vec's limit on k; the same for both, so code moves between them
_MAX_PARAMETERS = 500  # bound parameters per SQLite statement (older builds allow at most 999)


Vector: TypeAlias = "Sequence[float] | np.ndarray"  # (dimensions,)


@dataclass(frozen=True, slots=True)
class Item:
    """What add() takes."""

    id: str
    vector: Vector  # any scale: stored normalised
    text: str
    source: str  # the document it came from: a path, a URL, "memory"
    namespace: str = "default"
    section: str | None = None
    span: tuple[int, int] | None = None  # the text's characters in the source
    metadata: Mapping[str, Any] = field(default_factory=dict)  # JSON
    created_at: float | None = None  # Unix time; None: now


@dataclass(frozen=True, slots=True)
class Record:
    """An item as stored, without its vector."""

    id: str
    text: str
    source: str
    namespace: str
    section: str | None
    span: tuple[int, int] | None
    metadata: Mapping[str, Any]
    created_at: float


@dataclass(frozen=True, slots=True)
class Hit:
    record: Record
    score: float  # cosine similarity with the query


class VectorStore(Protocol):
    dimensions: int

    def add(self, items: Sequence[Item]) -> None:
        """Adds the items; an item whose id is stored already replaces it."""

    def replace(self, namespace: str, source: str, items: Sequence[Item]) -> None:
        """The source's items become these, in one transaction (readers see old or new)."""

    def search(self, vector: Vector, k: int = 4, *, namespace: str | None = None,
               sources: Sequence[str] | None = None) -> list[Hit]:
        """The k nearest items, best first; within a namespace and sources when given."""
        ...

    def get(self, ids: Sequence[str] | None = None, *, namespace: str | None = None,
            source: str | None = None) -> list[Record]:
        """The items matching every filter given, oldest first."""
        ...

    def delete(self, ids: Sequence[str] | None = None, *, namespace: str | None = None,
               source: str | None = None) -> int:
        """Deletes the items matching every filter given (at least one); returns how many."""
        ...

    def count(self, *, namespace: str | None = None, source: str | None = None) -> int: ...

    def close(self) -> None: ...


def normalised(vectors: np.ndarray | Sequence[Vector], dimensions: int) -> np.ndarray:
    """float32 (n, dimensions) rows of unit length; ValueError for another width or a zero row."""
    array = np.asarray(vectors, dtype=np.float32)
    if array.ndim != 2 or array.shape[1] != dimensions:
        raise ValueError(f"vector: expected {dimensions} dimensions, got shape {array.shape[1:]}")
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    if not np.all(np.isfinite(norms)) or np.any(norms == 0):
        raise ValueError("vector: must be finite and not all zeros")
    return array / norms


def check_search(k: int, sources: Sequence[str] | None) -> None:
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k: must be in [1, {MAX_K}], got {k}")
    if sources is not None and isinstance(sources, str):
        raise ValueError("sources: a list of sources, not one string")


def check_filters(ids: Sequence[str] | None, namespace: str | None, source: str | None) -> None:
    if ids is None and namespace is None and source is None:
        raise ValueError("delete: give ids, a namespace or a source (deleting everything needs one of them)")


def _sqlite3() -> Any:
    """A sqlite3 module that can load extensions: the standard library's where it was built
    with that, else pysqlite3 (pysqlite3-binary bundles a recent SQLite that can)."""
    import sqlite3

    if hasattr(sqlite3.Connection, "enable_load_extension"):
        return sqlite3
    try:
        from pysqlite3 import dbapi2
    except ImportError:
        raise ImportError("SqliteVecStore: this Python's sqlite3 cannot load extensions; "
                          "pip install pysqlite3-binary (or tokenway[client])") from None
    return dbapi2


_RECORD_COLUMNS: LiteralString = "id, text, source, namespace, section, span_start, span_end, metadata, created_at"


def _record(row: Sequence[Any]) -> Record:
    item_id, text, source, namespace, section, span_start, span_end, metadata, created_at = row
    span = (span_start, span_end) if span_start is not None else None
    if isinstance(metadata, str):  # sqlite's JSON is text; PostgreSQL's jsonb arrives decoded
        metadata = json.loads(metadata)
    return Record(item_id, text, source, namespace, section, span, metadata, created_at)


def _row(item: Item, now: float) -> tuple[Any, ...]:
    span_start, span_end = item.span if item.span is not None else (None, None)
    return (item.id, item.text, item.source, item.namespace, item.section, span_start, span_end,
            json.dumps(dict(item.metadata)), item.created_at if item.created_at is not None else now)


class SqliteVecStore:
    """Items in `<table>_items` (text and metadata), vectors in the sqlite-vec virtual table
    `<table>_vectors` (vec0, cosine distance) under the same rowid; namespace and source are
    also vec0 metadata columns, so a filtered search still returns k hits. One connection,
    serialised by a lock: usable from several threads (asyncio.to_thread). Several processes
    may share the file (WAL; a writer waits up to 5 s for another)."""

    def __init__(self, path: str = ":memory:", *, dimensions: int = 384, table: str = "tokenway") -> None:
        if not table.isidentifier():
            raise ValueError(f"table: must be an identifier, got {table!r}")
        import sqlite_vec

        sqlite3 = _sqlite3()
        self.path, self.dimensions, self.table = path, dimensions, table
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, timeout=5.0, isolation_level=None)
        self._db.enable_load_extension(True)
        sqlite_vec.load(self._db)
        self._db.enable_load_extension(False)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._create()

    def _create(self) -> None:
        t = self.table
        existing = self._db.execute("SELECT sql FROM sqlite_master WHERE name = ?", (f"{t}_vectors",)).fetchone()
        if existing is not None and f"float[{self.dimensions}]" not in existing[0]:
            raise ValueError(f"dimensions: the store's vectors are not {self.dimensions}-dimensional ({existing[0]})")
        with self._transaction():
            self._db.execute(f"""CREATE TABLE IF NOT EXISTS {t}_items (
                rowid INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, text TEXT NOT NULL, source TEXT NOT NULL,
                namespace TEXT NOT NULL, section TEXT, span_start INTEGER, span_end INTEGER,
                metadata TEXT NOT NULL, created_at REAL NOT NULL)""")
            self._db.execute(f"CREATE INDEX IF NOT EXISTS {t}_items_source ON {t}_items (namespace, source)")
            self._db.execute(f"""CREATE VIRTUAL TABLE IF NOT EXISTS {t}_vectors USING vec0(
                embedding float[{self.dimensions}] distance_metric=cosine, namespace text, source text)""")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")  # the write lock now: no deadlock upgrading a read lock
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def add(self, items: Sequence[Item]) -> None:
        if not items:
            return
        with self._lock, self._transaction():
            self._delete_ids([item.id for item in items])
            self._insert(items)

    def replace(self, namespace: str, source: str, items: Sequence[Item]) -> None:
        if any(item.namespace != namespace or item.source != source for item in items):
            raise ValueError(f"replace: every item must be of namespace {namespace!r} and source {source!r}")
        with self._lock, self._transaction():
            self._delete_where(*_where(namespace=namespace, source=source))
            self._delete_ids([item.id for item in items])  # ids unique across the store, as add() keeps them
            self._insert(items)

    def _insert(self, items: Sequence[Item]) -> None:
        if not items:
            return
        vectors = normalised([item.vector for item in items], self.dimensions)
        now = time.time()
        t = self.table
        for item, vector in zip(items, vectors, strict=True):
            cursor = self._db.execute(f"INSERT INTO {t}_items ({_RECORD_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                      _row(item, now))
            self._db.execute(f"INSERT INTO {t}_vectors (rowid, embedding, namespace, source) VALUES (?, ?, ?, ?)",
                             (cursor.lastrowid, vector.tobytes(), item.namespace, item.source))

    def _delete_ids(self, ids: list[str]) -> None:
        for start in range(0, len(ids), _MAX_PARAMETERS):
            self._delete_where(*_where(ids=ids[start:start + _MAX_PARAMETERS]))

    def _delete_where(self, where: str, params: list[Any]) -> int:
        t = self.table
        rowids = [row[0] for row in self._db.execute(f"SELECT rowid FROM {t}_items WHERE {where}", params)]
        for start in range(0, len(rowids), _MAX_PARAMETERS):
            batch = rowids[start:start + _MAX_PARAMETERS]
            marks = ", ".join("?" * len(batch))
            self._db.execute(f"DELETE FROM {t}_vectors WHERE rowid IN ({marks})", batch)
            self._db.execute(f"DELETE FROM {t}_items WHERE rowid IN ({marks})", batch)
        return len(rowids)

    def search(self, vector: Vector, k: int = 4, *, namespace: str | None = None,
               sources: Sequence[str] | None = None) -> list[Hit]:
        check_search(k, sources)
        if sources is not None and not sources:
            return []
        query = normalised([vector], self.dimensions)[0]
        filters, params = "", [query.tobytes(), k]
        if namespace is not None:
            filters += " AND namespace = ?"
            params.append(namespace)
        if sources is not None:
            filters += f" AND source IN ({', '.join('?' * len(sources))})"
            params.extend(sources)
        t = self.table
        columns = ", ".join(f"i.{name}" for name in _RECORD_COLUMNS.split(", "))
        # The KNN runs inside vec0 with its filters; the join only fetches the k rows' texts.
        with self._lock:
            rows = self._db.execute(f"""
                WITH knn AS (SELECT rowid, distance FROM {t}_vectors WHERE embedding MATCH ? AND k = ?{filters})
                SELECT {columns}, knn.distance FROM knn JOIN {t}_items i ON i.rowid = knn.rowid
                ORDER BY knn.distance, i.id""", params).fetchall()
        return [Hit(_record(row[:-1]), 1.0 - row[-1]) for row in rows]

    def get(self, ids: Sequence[str] | None = None, *, namespace: str | None = None,
            source: str | None = None) -> list[Record]:
        where, params = _where(ids, namespace, source)
        with self._lock:
            rows = self._db.execute(f"SELECT {_RECORD_COLUMNS} FROM {self.table}_items WHERE {where} "
                                    "ORDER BY created_at, rowid", params).fetchall()
        return [_record(row) for row in rows]

    def delete(self, ids: Sequence[str] | None = None, *, namespace: str | None = None,
               source: str | None = None) -> int:
        check_filters(ids, namespace, source)
        with self._lock, self._transaction():
            return self._delete_where(*_where(ids, namespace, source))

    def count(self, *, namespace: str | None = None, source: str | None = None) -> int:
        where, params = _where(None, namespace, source)
        with self._lock:
            return self._db.execute(f"SELECT count(*) FROM {self.table}_items WHERE {where}", params).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> SqliteVecStore:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


class PostgresVectorStore:
    """One table `<table>` (psycopg 3, one connection, serialised by a lock). `mode`:

        "pgvector"  the vector extension: a vector(dimensions) column, an HNSW index with
                    vector_cosine_ops, ordered by `<=>` (approximate nearest neighbours; with
                    pgvector >= 0.8 a filtered search scans on until it has k hits)
        "exact"     where the extension is not installed: a real[] column, every item in the
                    namespace scored by a dot product in SQL (the vectors are unit length);
                    ~0.4 s a search over 5,000 384-dim items here, where pgvector took ~3 ms

    "auto" (the default) takes pgvector when the server has it (CREATE EXTENSION needs the
    right to create it), else exact; a table made earlier keeps the mode it was made in."""

    def __init__(self, dsn: str, *, dimensions: int = 384, table: str = "tokenway_vectors",
                 mode: str = "auto") -> None:
        if not table.isidentifier():
            raise ValueError(f"table: must be an identifier, got {table!r}")
        if mode not in ("auto", "pgvector", "exact"):
            raise ValueError(f"mode: expected auto, pgvector or exact, got {mode!r}")
        try:
            import psycopg
        except ImportError:
            raise ImportError("PostgresVectorStore needs psycopg 3: pip install 'psycopg[binary]'") from None

        self.dimensions = dimensions
        # SQL text, as psycopg's typing asks of a query: an identifier, checked above.
        self.table: LiteralString = cast("LiteralString", table)
        self._lock = threading.Lock()
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._mode = self._choose_mode(mode)
        self._iterative_scan = self._mode == "pgvector" and self._pgvector_version() >= (0, 8)
        self._create()

    @property
    def mode(self) -> str:
        """"pgvector" or "exact": how this store searches."""
        return self._mode

    def _choose_mode(self, wanted: str) -> str:
        import psycopg

        column = self._conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = to_regclass(%s) AND attname = 'embedding'", (self.table,)).fetchone()
        if column is not None:
            mode = "exact" if column[0] == "real[]" else "pgvector"
            if mode == "pgvector" and column[0] != f"vector({self.dimensions})":
                raise ValueError(f"dimensions: table {self.table} holds {column[0]}, not vector({self.dimensions})")
            if wanted not in ("auto", mode):
                raise ValueError(f"mode: table {self.table} was made in {mode} mode, not {wanted}")
            return mode
        if wanted == "exact":
            return "exact"
        available = self._conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone()
        if available is not None:
            try:
                self._conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
                return "pgvector"
            except psycopg.Error as exc:
                if wanted == "pgvector":
                    raise ValueError(f"mode: cannot create the vector extension: {exc}") from exc
        elif wanted == "pgvector":
            raise ValueError("mode: this PostgreSQL server does not have the pgvector extension")
        return "exact"

    def _pgvector_version(self) -> tuple[int, ...]:
        row = self._conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
        assert row is not None  # asked in pgvector mode: the extension is there
        return tuple(int(part) for part in row[0].split(".")[:2] if part.isdigit())

    def _create(self) -> None:
        # An int's digits, in SQL text: DDL takes no parameters.
        t, n = self.table, cast("LiteralString", str(int(self.dimensions)))
        column = f"vector({n})" if self._mode == "pgvector" else f"real[] CHECK (array_length(embedding, 1) = {n})"
        with self._conn.transaction():
            self._conn.execute(f"""CREATE TABLE IF NOT EXISTS {t} (
                id text PRIMARY KEY, text text NOT NULL, source text NOT NULL, namespace text NOT NULL,
                section text, span_start integer, span_end integer, metadata jsonb NOT NULL,
                created_at double precision NOT NULL, embedding {column} NOT NULL)""")
            self._conn.execute(f"CREATE INDEX IF NOT EXISTS {t}_source ON {t} (namespace, source)")
            if self._mode == "pgvector":
                self._conn.execute(f"CREATE INDEX IF NOT EXISTS {t}_embedding ON {t} "
                                   "USING hnsw (embedding vector_cosine_ops)")

    def _vector(self, vector: np.ndarray) -> Any:
        """A parameter for the embedding column: pgvector's text form, or a list for real[]."""
        return "[" + ",".join(map(repr, vector.tolist())) + "]" if self._mode == "pgvector" else vector.tolist()

    @property
    def _cast(self) -> LiteralString:
        return "vector" if self._mode == "pgvector" else "real[]"

    def add(self, items: Sequence[Item]) -> None:
        with self._lock, self._conn.transaction():
            self._upsert(items)

    def replace(self, namespace: str, source: str, items: Sequence[Item]) -> None:
        if any(item.namespace != namespace or item.source != source for item in items):
            raise ValueError(f"replace: every item must be of namespace {namespace!r} and source {source!r}")
        with self._lock, self._conn.transaction():
            self._conn.execute(f"DELETE FROM {self.table} WHERE namespace = %s AND source = %s", (namespace, source))
            self._upsert(items)

    def _upsert(self, items: Sequence[Item]) -> None:
        if not items:
            return
        vectors = normalised([item.vector for item in items], self.dimensions)
        now = time.time()
        updated: list[LiteralString] = [*_RECORD_COLUMNS.split(", ")[1:], "embedding"]
        updates = ", ".join(f"{name} = excluded.{name}" for name in updated)
        with self._conn.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {self.table} ({_RECORD_COLUMNS}, embedding) "
                f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s::{self._cast}) "
                f"ON CONFLICT (id) DO UPDATE SET {updates}",
                [(*_row(item, now), self._vector(vector)) for item, vector in zip(items, vectors, strict=True)])

    def search(self, vector: Vector, k: int = 4, *, namespace: str | None = None,
               sources: Sequence[str] | None = None) -> list[Hit]:
        check_search(k, sources)
        if sources is not None and not sources:
            return []
        query = self._vector(normalised([vector], self.dimensions)[0])
        where, params = _where(namespace=namespace, mark="%s")
        if sources is not None:
            where += " AND source = ANY(%s)"
            params.append(list(sources))
        if self._mode == "pgvector":
            # ORDER BY the bare distance, as the HNSW index can serve it (no tie-break column).
            sql = (f"SELECT {_RECORD_COLUMNS}, 1 - (embedding <=> %s::vector) FROM {self.table} "
                   f"WHERE {where} ORDER BY embedding <=> %s::vector LIMIT %s")
            params = [query, *params, query, k]
        else:
            sql = (f"SELECT {_RECORD_COLUMNS}, (SELECT sum(a::float8 * b) FROM unnest(embedding, %s::real[]) "
                   f"AS pair(a, b)) AS score FROM {self.table} WHERE {where} ORDER BY score DESC, id LIMIT %s")
            params = [query, *params, k]
        with self._lock, self._conn.transaction():
            if self._mode == "pgvector":
                # ef_search bounds how many hits an index scan returns (40 by default).
                ef_search = cast("LiteralString", str(max(40, min(k, 1000))))  # an int: SET takes no parameters
                self._conn.execute(f"SET LOCAL hnsw.ef_search = {ef_search}")
                if self._iterative_scan:
                    self._conn.execute("SET LOCAL hnsw.iterative_scan = strict_order")
            rows = self._conn.execute(sql, params).fetchall()
        return [Hit(_record(row[:-1]), float(row[-1])) for row in rows]

    def get(self, ids: Sequence[str] | None = None, *, namespace: str | None = None,
            source: str | None = None) -> list[Record]:
        where, params = _where(ids, namespace, source, mark="%s")
        with self._lock:
            rows = self._conn.execute(f"SELECT {_RECORD_COLUMNS} FROM {self.table} WHERE {where} "
                                      "ORDER BY created_at, id", params).fetchall()
        return [_record(row) for row in rows]

    def delete(self, ids: Sequence[str] | None = None, *, namespace: str | None = None,
               source: str | None = None) -> int:
        check_filters(ids, namespace, source)
        where, params = _where(ids, namespace, source, mark="%s")
        with self._lock:
            return self._conn.execute(f"DELETE FROM {self.table} WHERE {where}", params).rowcount

    def count(self, *, namespace: str | None = None, source: str | None = None) -> int:
        where, params = _where(None, namespace, source, mark="%s")
        with self._lock:
            row = self._conn.execute(f"SELECT count(*) FROM {self.table} WHERE {where}", params).fetchone()
        assert row is not None  # count(*) is one row
        return row[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> PostgresVectorStore:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def _where(ids: Sequence[str] | None = None, namespace: str | None = None, source: str | None = None,
           mark: LiteralString = "?") -> tuple[LiteralString, list[Any]]:
    """A WHERE clause over the items' columns (TRUE when no filter), with its parameters."""
    clauses: list[LiteralString] = []
    params: list[Any] = []
    if ids is not None:
        ids = [ids] if isinstance(ids, str) else list(ids)
        clauses.append(f"id IN ({', '.join(mark for _ in ids)})" if ids else "FALSE")
        params.extend(ids)
    if namespace is not None:
        clauses.append(f"namespace = {mark}")
        params.append(namespace)
    if source is not None:
        clauses.append(f"source = {mark}")
        params.append(source)
    return " AND ".join(clauses) or "TRUE", params
