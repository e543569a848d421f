"""VectorStores: SqliteVecStore (a file and :memory:) and PostgresVectorStore against a real
PostgreSQL started by scripts/postgres.sh (exact mode; pgvector mode too where the server has
the extension). The same behaviour is asserted of each."""

from __future__ import annotations

import numpy as np
import pytest

from tokenway.client.vectors import Item, PostgresVectorStore, SqliteVecStore


def has_pgvector(url: str) -> bool:
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone() is not None


@pytest.fixture(params=["sqlite-file", "sqlite-memory", "postgres-exact", "postgres-pgvector"])
def make_store(request, tmp_path):
    """make_store(dimensions) -> a new, empty store of the kind under test (closed after)."""
    stores = []

    def make(dimensions: int = 4):
        if request.param == "sqlite-file":
            store = SqliteVecStore(str(tmp_path / f"vectors-{len(stores)}.db"), dimensions=dimensions)
        elif request.param == "sqlite-memory":
            store = SqliteVecStore(":memory:", dimensions=dimensions)
        else:
            url = request.getfixturevalue("postgres_database")
            mode = request.param.removeprefix("postgres-")
            if mode == "pgvector" and not has_pgvector(url):
                pytest.skip("this PostgreSQL server has no pgvector extension")
            store = PostgresVectorStore(url, dimensions=dimensions, table=f"vectors_{len(stores)}", mode=mode)
            assert store.mode == mode
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def item(item_id, vector, source="a.md", namespace="docs", **fields):
    return Item(item_id, vector, f"text of {item_id}", source, namespace, **fields)


def ids(hits):
    return [hit.record.id for hit in hits]


def test_search_returns_the_nearest_best_first_with_cosine_scores(make_store):
    store = make_store()
    vectors = {"x": [1, 0, 0, 0], "y": [0, 1, 0, 0], "xy": [1, 1, 0, 0], "minus_x": [-1, 0, 0, 0]}
    store.add([item(name, vector) for name, vector in vectors.items()])
    query = np.array([1, 0.2, 0, 0])
    hits = store.search(query, k=3)
    assert ids(hits) == ["x", "xy", "y"]
    for hit in hits:
        v = np.array(vectors[hit.record.id], dtype=float)
        assert hit.score == pytest.approx(v @ query / np.linalg.norm(v) / np.linalg.norm(query), abs=1e-5)
    assert store.search(query, k=10)[-1].score == pytest.approx(-1 / np.linalg.norm(query), abs=1e-5)


def test_vectors_are_normalised_on_the_way_in(make_store):
    store = make_store()
    store.add([item("long", [30, 40, 0, 0]), item("short", [0, 0, 0.001, 0])])
    assert store.search([0.3, 0.4, 0, 0], k=1)[0].score == pytest.approx(1.0, abs=1e-6)
    assert store.search([0, 0, 5, 0], k=1)[0].score == pytest.approx(1.0, abs=1e-6)


def test_a_filtered_search_still_finds_k_hits(make_store):
    store = make_store()
    # 60 items near the query in one namespace, 3 far from it in another, 3 from another source.
    rng = np.random.default_rng(0)
    near = [item(f"near{i}", [1, *rng.normal(0, 0.05, 3)], namespace="crowd") for i in range(60)]
    far = [item(f"far{i}", [0, 1, i, 0], namespace="few") for i in range(3)]
    other = [item(f"other{i}", [1, 0, 0, 0.1 * i], source="b.md", namespace="crowd") for i in range(3)]
    store.add(near + far + other)
    assert sorted(ids(store.search([1, 0, 0, 0], k=3, namespace="few"))) == ["far0", "far1", "far2"]
    assert sorted(ids(store.search([0, 0, 0, 1], k=5, namespace="crowd", sources=["b.md"]))) == \
        ["other0", "other1", "other2"]
    assert store.search([1, 0, 0, 0], k=3, sources=[]) == []
    assert len(store.search([1, 0, 0, 0], k=100, namespace="crowd")) == 63


def test_records_keep_what_was_added(make_store):
    store = make_store()
    store.add([item("a", [1, 0, 0, 0], section="Install", span=(10, 42), metadata={"lang": "en", "n": 3},
                    created_at=1_700_000_000.5),
               item("b", [0, 1, 0, 0])])
    [a] = store.get(["a"])
    assert (a.id, a.text, a.source, a.namespace, a.section, a.span, dict(a.metadata), a.created_at) == \
        ("a", "text of a", "a.md", "docs", "Install", (10, 42), {"lang": "en", "n": 3}, 1_700_000_000.5)
    [b] = store.get(["b"])
    assert (b.section, b.span, dict(b.metadata)) == (None, None, {}) and b.created_at > 1_700_000_000.5
    assert store.search([1, 0, 0, 0], k=1)[0].record == a


def test_adding_an_id_again_replaces_that_item(make_store):
    store = make_store()
    store.add([item("a", [1, 0, 0, 0]), item("b", [0, 1, 0, 0])])
    store.add([Item("a", [0, 0, 1, 0], "new text", "c.md", "docs")])
    assert store.count() == 2
    hit = store.search([0, 0, 1, 0], k=1)[0]
    assert (hit.record.id, hit.record.text, hit.record.source, hit.score) == ("a", "new text", "c.md",
                                                                              pytest.approx(1.0, abs=1e-6))


def test_replace_makes_a_sources_items_exactly_the_new_ones(make_store):
    store = make_store()
    store.add([item(f"a{i}", [1, i, 0, 0]) for i in range(3)] + [item("b0", [0, 0, 1, 0], source="b.md")]
              + [item("other-namespace", [1, 0, 0, 0], namespace="memory")])
    store.replace("docs", "a.md", [item("a0", [0, 1, 0, 0]), item("a9", [0, 1, 1, 0])])
    assert [r.id for r in store.get(namespace="docs", source="a.md")] == ["a0", "a9"]
    assert store.count(namespace="docs") == 3 and store.count() == 4
    store.replace("docs", "a.md", [])
    assert store.count(source="a.md") == 1  # the other namespace's a.md item stays
    with pytest.raises(ValueError, match="replace"):
        store.replace("docs", "a.md", [item("x", [1, 0, 0, 0], source="b.md")])


def test_get_count_and_delete_by_ids_source_and_namespace(make_store):
    store = make_store()
    store.add([item("a0", [1, 0, 0, 0]), item("a1", [1, 1, 0, 0]), item("b0", [0, 1, 0, 0], source="b.md"),
               item("m0", [0, 0, 1, 0], "memory", "memory"), item("m1", [0, 0, 1, 1], "memory", "memory")])
    assert store.count() == 5 and store.count(namespace="memory") == 2 and store.count(source="a.md") == 2
    assert [r.id for r in store.get(["a1", "m0", "missing"])] == ["a1", "m0"]
    assert store.delete(["a1", "missing"]) == 1
    assert store.delete(["m0"], namespace="docs") == 0  # both filters hold, or nothing goes
    assert store.delete(source="b.md") == 1
    assert store.delete(namespace="memory") == 2
    assert ids(store.search([1, 1, 1, 1], k=10)) == ["a0"]
    with pytest.raises(ValueError, match="delete"):
        store.delete()


def test_bad_vectors_and_arguments_are_refused(make_store):
    store = make_store()
    with pytest.raises(ValueError, match="dimensions"):
        store.add([item("a", [1, 0, 0])])
    with pytest.raises(ValueError, match="zeros"):
        store.add([item("a", [0, 0, 0, 0])])
    with pytest.raises(ValueError, match="k"):
        store.search([1, 0, 0, 0], k=0)
    assert store.count() == 0


def test_search_over_real_sized_vectors_matches_exact_nearest_neighbours(make_store):
    store = make_store(384)
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(400, 384)).astype(np.float32)
    store.add([item(f"v{i}", vector) for i, vector in enumerate(vectors)])
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    for query in rng.normal(size=(5, 384)):
        expected = np.argsort(-(unit @ (query / np.linalg.norm(query))))[:5]
        hits = store.search(query, k=5)
        if getattr(store, "mode", "exact") == "pgvector":  # HNSW is approximate: the best is found
            assert hits[0].record.id == f"v{expected[0]}"
        else:
            assert ids(hits) == [f"v{i}" for i in expected]


def test_a_sqlite_file_is_read_back_by_a_new_connection(tmp_path):
    path = str(tmp_path / "store.db")
    with SqliteVecStore(path, dimensions=4) as store:
        store.add([item("a", [1, 0, 0, 0], section="S", span=(0, 5))])
    with SqliteVecStore(path, dimensions=4) as store:
        [hit] = store.search([1, 0, 0, 0], k=1)
        assert (hit.record.id, hit.record.section, hit.record.span) == ("a", "S", (0, 5))
    with pytest.raises(ValueError, match="dimensions"):
        SqliteVecStore(path, dimensions=384)


def test_postgres_reports_its_mode_and_keeps_it(postgres_database):
    available = has_pgvector(postgres_database)
    with PostgresVectorStore(postgres_database, dimensions=4) as store:
        assert store.mode == ("pgvector" if available else "exact")
        store.add([item("a", [1, 0, 0, 0])])
    with PostgresVectorStore(postgres_database, dimensions=4) as store:
        assert store.count() == 1 and store.mode == ("pgvector" if available else "exact")
    other = "exact" if available else "pgvector"
    with pytest.raises(ValueError, match="mode"):
        PostgresVectorStore(postgres_database, dimensions=4, mode=other)
    if not available:
        with pytest.raises(ValueError, match="pgvector"):
            PostgresVectorStore(postgres_database, dimensions=4, table="fresh", mode="pgvector")
