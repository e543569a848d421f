"""Retrieval and memory against a real tokenway serve (its all-MiniLM-L6-v2 on /v1/embeddings),
through the official openai SDK: a corpus of twelve topics answers each question with the
right document first; an unchanged document costs no embedding call and a changed one
replaces its chunks; the local token counter counts what the server bills; memories written
by one process are recalled by another."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tokenway.client.chunking import Chunker, EmbeddingTokenCounter
from tokenway.client.retrieval import IndexReport, Retriever
from tokenway.client.vectors import SqliteVecStore

from .conftest import REPO

MODEL = "all-minilm-l6-v2"

CORPUS = {
    "notes/sourdough.md": "# Sourdough bread\n\nA sourdough starter is flour and water fermented by wild yeast and "
    "lactic acid bacteria. Feed it daily, let the dough rise overnight, and bake the loaf in a hot Dutch oven "
    "for a crisp crust.",
    "notes/volcanoes.md": "# Volcanoes\n\nA volcano erupts when magma rises through the crust. Basaltic lava flows "
    "are runny, while explosive eruptions throw out ash and pumice. Mount Etna in Sicily is one of the most active.",
    "notes/chess.md": "# Chess openings\n\nThe Sicilian Defence answers 1.e4 with c5. White often castles kingside, "
    "and the bishops, knights and pawns fight for the centre squares in the opening.",
    "notes/tcp.md": "# TCP handshake\n\nA TCP connection opens with a three-way handshake: SYN, SYN-ACK, ACK. "
    "Sequence numbers let the receiver reorder segments, and lost packets are retransmitted after a timeout.",
    "notes/photosynthesis.md": "# Photosynthesis\n\nPlants turn sunlight, water and carbon dioxide into glucose and "
    "oxygen. Chlorophyll in the chloroplasts of leaves absorbs mostly red and blue light.",
    "notes/marathon.md": "# Marathon training\n\nA marathon is 42.195 km. Build weekly mileage slowly, do one long "
    "run each week, and taper for two weeks before race day to let the legs recover.",
    "notes/tax.md": "# Income tax returns\n\nFile the annual income tax return before the deadline. Keep receipts "
    "for deductible expenses such as charitable donations and work equipment, and report all salary income.",
    "notes/bees.md": "# Honey bees\n\nA honey bee colony has one queen, thousands of female workers and a few male "
    "drones. Workers collect nectar and pollen and perform a waggle dance to show where flowers are.",
    "notes/git.md": "# Git branches\n\nCreate a branch with git switch -c, commit your changes, then rebase onto "
    "main or open a pull request. A merge conflict must be resolved by editing the files and committing.",
    "notes/coffee.md": "# Espresso\n\nEspresso forces hot water through finely ground coffee at about nine bars of "
    "pressure. A good shot takes 25 to 30 seconds and has a layer of golden crema on top.",
    "notes/moon.md": "# The Moon\n\nThe Moon orbits the Earth every 27.3 days and always shows the same face. Its "
    "gravity raises the ocean tides, and Apollo 11 landed the first astronauts on it in 1969.",
    "notes/vaccines.md": "# Vaccines\n\nA vaccine trains the immune system with a harmless piece of a pathogen, so "
    "antibodies and memory cells are ready when the real virus or bacterium arrives.",
}

# Paraphrased: few of the questions share a content word with their document.
QUESTIONS = [
    ("How do I keep my bread starter alive?", "notes/sourdough.md"),
    ("What comes out of an erupting mountain?", "notes/volcanoes.md"),
    ("What is a good reply to king's pawn e4?", "notes/chess.md"),
    ("How does a network connection get established?", "notes/tcp.md"),
    ("How do leaves make sugar from light?", "notes/photosynthesis.md"),
    ("How long before a long-distance race should I rest?", "notes/marathon.md"),
    ("Which receipts should I keep for my taxes?", "notes/tax.md"),
    ("Why do insects dance in the hive?", "notes/bees.md"),
    ("How do I fix a merge conflict?", "notes/git.md"),
    ("How long should a coffee shot take to pull?", "notes/coffee.md"),
    ("What causes the tides in the sea?", "notes/moon.md"),
    ("How does immunisation protect against disease?", "notes/vaccines.md"),
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def counter():
    return EmbeddingTokenCounter()


@pytest.fixture(scope="module")
def index(client, counter, tmp_path_factory):
    """The corpus indexed once for the module, in a sqlite-vec file."""
    store = SqliteVecStore(str(tmp_path_factory.mktemp("rag") / "corpus.db"))
    retriever = Retriever(client, store, chunker=Chunker(counter))
    report = retriever.add_documents(CORPUS)
    assert report == IndexReport(num_documents=12, num_unchanged=0, num_chunks=12,
                                 num_tokens=sum(counter(text) for text in CORPUS.values()))
    yield retriever
    store.close()


def embedding_calls(server) -> float:
    """The server's count of /v1/embeddings calls answered, from its Prometheus metrics."""
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(
        r'^tokenway_requests_total\{[^}]*endpoint="/v1/embeddings"[^}]*\} ([\d.e+]+)$', metrics, re.MULTILINE))


def test_each_question_finds_its_document_first(index):
    for question, source in QUESTIONS:
        passages = index.search(question, k=3)
        assert passages[0].source == source, (question, [(p.source, round(p.score, 3)) for p in passages])
        assert [p.score for p in passages] == sorted((p.score for p in passages), reverse=True)
        first = passages[0]
        assert first.text == CORPUS[source] and first.span == (0, len(CORPUS[source]))
        assert first.section == CORPUS[source].splitlines()[0].removeprefix("# ")
        assert first.chunk_id == f"documents/{source}#0"
    assert index.search("bees", k=12, min_score=0.3)[0].source == "notes/bees.md"
    assert len(index.search("bees", k=12, min_score=0.3)) < 12
    only = index.search("What causes the tides?", k=3, sources=["notes/tax.md", "notes/git.md"])
    assert {p.source for p in only} == {"notes/tax.md", "notes/git.md"}


def test_an_unchanged_document_is_not_embedded_again_and_a_changed_one_replaces_its_chunks(server, index):
    calls = embedding_calls(server)
    assert index.add_documents(CORPUS).num_unchanged == 12
    assert embedding_calls(server) == calls  # no call at all

    lava = "# Volcanoes\n\nPele is the Hawaiian goddess of fire and of volcanoes, said to live in Kilauea."
    report = index.add(lava, "notes/volcanoes.md")
    assert (report.num_unchanged, report.num_chunks) == (0, 1)
    assert embedding_calls(server) == calls + 1
    [passage] = index.store.get(namespace="documents", source="notes/volcanoes.md")
    assert passage.text == lava
    assert index.search("Which goddess lives in a Hawaiian volcano?", k=1)[0].text == lava
    index.add(CORPUS["notes/volcanoes.md"], "notes/volcanoes.md")  # back as it was, for the other tests


def test_the_local_counter_counts_what_the_server_bills(client, counter):
    """Chunks of the README at the default 200 tokens: the server accepts each (its limit is
    256 with [CLS] and [SEP]) and bills exactly the counter's tokens."""
    text = (REPO / "README.md").read_text()[:20_000]
    chunks = Chunker(counter).split(text)
    reply = client.embeddings.create(model=MODEL, input=[chunk.text for chunk in chunks])
    assert reply.usage.prompt_tokens == sum(chunk.num_tokens for chunk in chunks)
    assert max(chunk.num_tokens for chunk in chunks) <= 200


@pytest.mark.anyio
async def test_the_async_client_indexes_and_finds_the_same(server, index, counter, tmp_path):
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    with SqliteVecStore(str(tmp_path / "async.db")) as store:
        retriever = Retriever(client, store, chunker=Chunker(counter))
        report = await retriever.add_documents_async(CORPUS)
        assert report.num_chunks == 12
        for question, source in QUESTIONS[:4]:
            mine = await retriever.search_async(question, k=2)
            assert [p.source for p in mine] == [p.source for p in index.search(question, k=2)]
            assert mine[0].source == source
        with pytest.raises(TypeError, match="AsyncOpenAI"):
            await Retriever(openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused"), store).search_async("x")
    await client.close()


MEMORY_SCRIPT = """
import json, sys
import openai
from tokenway.client.memory import MemoryStore
from tokenway.client.vectors import SqliteVecStore

url, path, step = sys.argv[1:]
memory = MemoryStore(openai.OpenAI(base_url=url, api_key="unused", max_retries=0), SqliteVecStore(path))
if step == "write":
    for fact in ["Alice's daughter is called Maya.", "Alice is allergic to peanuts.",
                 "Alice works as a marine biologist in Lisbon.", "Alice is allergic to peanuts",
                 "Alice is allergic to cats."]:
        memory.remember(fact, namespace="user:alice")
    memory.remember("Bob's daughter is called Zoe.", namespace="user:bob")
else:
    answers = {q: memory.recall(q, k=1, namespace="user:alice")[0].text
               for q in ["What is her child's name?", "What food must Alice avoid?", "What is her job?"]}
    job = memory.recall("What is her job?", k=1, namespace="user:alice")[0]
    memory.forget(job.chunk_id, namespace="user:alice")
    recalled = [p.source for p in memory.recall("daughter", namespace="user:alice")]
    print(json.dumps({"answers": answers, "recall": recalled}))
facts = memory.all(namespace="user:alice")
print(json.dumps([[m.id, m.fact, m.namespace, m.created_at < m.updated_at] for m in facts]))
"""


def run_memory(server, path: Path, step: str) -> list:
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, f"{server.base_url}/v1", str(path), step],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_memories_written_by_one_process_are_recalled_by_another(server, tmp_path):
    path = tmp_path / "memory.db"
    [written] = run_memory(server, path, "write")
    # The fact said twice is one memory, rewritten (updated_at after created_at) in the latest words.
    assert [(fact, updated) for _, fact, _, updated in written] == [
        ("Alice's daughter is called Maya.", False), ("Alice is allergic to peanuts", True),
        ("Alice works as a marine biologist in Lisbon.", False), ("Alice is allergic to cats.", False)]
    recalled, remaining = run_memory(server, path, "read")
    assert recalled["answers"] == {"What is her child's name?": "Alice's daughter is called Maya.",
                                   "What food must Alice avoid?": "Alice is allergic to peanuts",
                                   "What is her job?": "Alice works as a marine biologist in Lisbon."}
    assert recalled["recall"][0] == f"memory:{written[0][0]}"  # Bob's daughter is in another namespace
    assert len(recalled["recall"]) == 3  # every fact of the namespace, the forgotten one gone
    assert [m[0] for m in remaining] == [written[0][0], written[1][0], written[3][0]]
