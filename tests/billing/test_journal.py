"""The ledger's journal: one database per journal, nothing in it can stop a start, and a row
no backend will take is quarantined without holding up the rows behind it."""

import json

import pytest

from tokenway.billing.dead_letters import DeadLetters
from tokenway.billing.journal import Journal, encode_record, header_line, read_records
from tokenway.billing.ledger import Ledger

from .conftest import make_record

pytestmark = pytest.mark.anyio


def dead_letter_entries(ledger_or_path) -> list[dict]:
    path = getattr(getattr(ledger_or_path, "dead_letters", None), "path", ledger_or_path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_journal_held_by_a_live_gateway_is_neither_shared_nor_adopted(tmp_path):
    dead = DeadLetters(tmp_path / "dead.jsonl")
    live = Journal(tmp_path, "sqlite:///a.db", "8000", dead)
    live.append(make_record("in-flight"))
    with pytest.raises(ValueError, match="held by another running gateway"):
        Journal(tmp_path, "sqlite:///a.db", "8000", dead)
    other = Journal(tmp_path, "sqlite:///a.db", "8001", dead)
    assert other.recovered == []  # the live gateway's row stays with it
    assert [r.request_id for r in read_records(live.path, "sqlite:///a.db", dead)] == ["in-flight"]
    other.close()
    live.close()  # the gateway is gone: the next start adopts its row
    unrelated = tmp_path / "audit.journal"  # not a ledger journal: never read nor removed
    unrelated.write_text("not ours\n")
    adopter = Journal(tmp_path, "sqlite:///a.db", "8002", dead)
    assert [r.request_id for r in adopter.recovered] == ["in-flight"]
    assert not live.path.exists() and unrelated.read_text() == "not ours\n"
    adopter.close()
    assert dead.num_rows == 0


def test_a_journal_names_its_database_and_another_database_never_adopts_it(tmp_path):
    dead = DeadLetters(tmp_path / "dead.jsonl")
    a = Journal(tmp_path, "sqlite:///srv/a.db", "8000", dead)
    a.append(make_record("row-of-a"))
    a.close()
    first_line = a.path.read_bytes().splitlines()[0]
    assert json.loads(first_line)["database"] == "sqlite:///srv/a.db"
    # Another database's gateway, even under the very same name (port), starts empty...
    b = Journal(tmp_path, "sqlite:///srv/b.db", "8000", dead)
    assert b.recovered == [] and b.path != a.path
    b.close()
    # ...and a file that claims a's name but names b inside is not a's either.
    forged = tmp_path / a.path.name.replace("-8000", "-9000")
    forged.write_bytes(header_line("sqlite:///srv/b.db") + encode_record(make_record("row-of-b")))
    again = Journal(tmp_path, "sqlite:///srv/a.db", "8001", dead)
    assert [r.request_id for r in again.recovered] == ["row-of-a"]
    assert forged.exists()
    again.close()


def test_a_legacy_journal_is_adopted_only_under_its_own_name(tmp_path):
    dead = DeadLetters(tmp_path / "dead.jsonl")
    (tmp_path / "ledger-8000.journal").write_bytes(encode_record(make_record("legacy-8000")))
    (tmp_path / "ledger-9000.journal").write_bytes(encode_record(make_record("legacy-9000")))
    journal = Journal(tmp_path, "sqlite:///a.db", "8000", dead)
    assert [r.request_id for r in journal.recovered] == ["legacy-8000"]
    assert not (tmp_path / "ledger-8000.journal").exists() and (tmp_path / "ledger-9000.journal").exists()
    journal.close()


def test_a_torn_last_line_is_quarantined_and_does_not_swallow_the_next_row(tmp_path):
    dead = DeadLetters(tmp_path / "dead.jsonl")
    journal = Journal(tmp_path, "sqlite:///a.db", "8000", dead)
    journal.append(make_record("whole"))
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(encode_record(make_record("torn"))[:40])  # a crash mid-write
    reopened = Journal(tmp_path, "sqlite:///a.db", "8000", dead)
    assert [r.request_id for r in reopened.recovered] == ["whole"]
    reopened.append(make_record("after"))
    reopened.close()
    assert [r.request_id for r in read_records(journal.path, "sqlite:///a.db", DeadLetters(None))] == ["whole", "after"]
    [entry] = dead_letter_entries(dead.path)
    assert entry["source"].endswith("line 3") and bytes.fromhex(entry["raw_hex"]).startswith(b'{"request_id":"torn"')


async def test_a_journal_with_unreadable_and_unencodable_rows_still_starts_and_commits_the_good_ones(url, tmp_path):
    # What a crashed gateway left: good rows, a line that is not UTF-8, one that is not a row,
    # a row whose text no UTF-8 database takes (a lone surrogate, as the reproducer
    # left), and one whose token count overflows every backend's integer.
    async with Ledger(url, journal_dir=tmp_path, journal_name="8000") as ledger:
        path, database = ledger.journal_path, ledger.url
    lines = [
        header_line(database),
        encode_record(make_record("good-1")),
        b'{"request_id": "bad-\xff\xfe"}\n',
        b'{"not": "a row"}\n',
        encode_record(make_record("surrogate", error="The model '\ud800' does not exist")),
        encode_record(make_record("huge", prompt_tokens=2**70)),
        encode_record(make_record("good-2")),
    ]
    path.write_bytes(b"".join(lines))
    async with Ledger(url, journal_dir=tmp_path, journal_name="8000") as ledger:
        assert [r.request_id for r in [await ledger.get(i) for i in ("good-1", "good-2")]] == ["good-1", "good-2"]
        assert (await ledger.get("surrogate")).error == "The model '\\ud800' does not exist"
        assert await ledger.get("huge") is None
        assert ledger.stats()["num_rows_quarantined"] == 3
        entries = dead_letter_entries(ledger)
    assert [e["source"].rsplit(" ", 1)[-1] for e in entries[:2]] == ["3", "4"]
    assert entries[2]["source"] == "commit" and entries[2]["row"]["request_id"] == "huge"
    assert len(path.read_bytes().splitlines()) == 1  # everything handled: back to the header
    async with Ledger(url, journal_dir=tmp_path, journal_name="8000") as ledger:  # and the next start is clean
        assert ledger.stats()["num_rows_quarantined"] == 0


async def test_a_row_no_backend_takes_is_quarantined_while_serving_and_the_rest_go_through(url, tmp_path):
    async with Ledger(url, journal_dir=tmp_path, journal_name="8000") as ledger:
        ledger.record_nowait(make_record("before"))
        ledger.record_nowait(make_record("huge", completion_tokens=2**70))
        ledger.record_nowait(make_record("nul\x00byte", model="m\x00", error="bad \udcff"))
        await ledger.record(make_record("after"))
        await ledger.close()
        assert ledger.num_rows_written == 3
        assert [e["row"]["request_id"] for e in dead_letter_entries(ledger)] == ["huge"]
    async with Ledger(url) as ledger:
        stored = await ledger.get("nul\\x00byte")
        assert (stored.model, stored.error) == ("m\\x00", "bad \\udcff")
        assert await ledger.get("after") is not None


async def test_without_a_journal_an_unstorable_row_is_logged_and_the_caller_is_not_failed(url, caplog):
    async with Ledger(url) as ledger:
        await ledger.record(make_record("huge", prompt_tokens=2**70))  # returns: the row is handled
        await ledger.record(make_record("fine"))
        assert ledger.stats()["num_rows_quarantined"] == 1
        assert await ledger.get("fine") is not None
    assert any('"request_id": "huge"' in r.getMessage() for r in caplog.records)



def test_rows_reads_the_file_up_to_an_end_and_quarantines_nothing_twice(tmp_path):
    dead = DeadLetters(tmp_path / "dead.jsonl")
    journal = Journal(tmp_path, "sqlite:///a.db", "8000", dead)
    journal.append(make_record("left-1"))
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(b"torn\n")  # quarantined when the journal is opened again
    journal = Journal(tmp_path, "sqlite:///a.db", "8000", dead)
    assert dead.num_rows == 1
    for i in range(5):
        journal.append(make_record(f"new-{i}"))
    end = journal.end()
    journal.append(make_record("after-end"))
    batches = list(journal.rows(end, batch_max=2))
    assert [[r.request_id for r in batch] for batch in batches] == [["left-1", "new-0"], ["new-1", "new-2"],
                                                                      ["new-3", "new-4"]]
    assert dead.num_rows == 1
    journal.close()
