"""Files on every backend: content reads back byte for byte, only for its owner; lists page as
OpenAI's do (newest first, `after` a file id, has_more)."""

import pytest

from tokenway.batches import StoredFile, new_file_id, open_batch_store
from tokenway.protocol.errors import FieldError

from .conftest import NOW

pytestmark = pytest.mark.anyio


def make_file(content: bytes, *, key_id: str = "key-a", created_at: float = NOW, purpose: str = "batch") -> StoredFile:
    return StoredFile(new_file_id(), key_id, purpose, "requests.jsonl", len(content), created_at, created_at + 3600)


async def test_a_file_reads_back_exactly_for_its_owner_only(store, store_url):
    content = b'{"custom_id": "a", "body": {"x": "\\u0000 \xc3\xa9"}}\n' + bytes(range(256))
    file = make_file(content)
    await store.create_file(file, content)
    assert await store.get_file(file.id, "key-a") == file
    assert await store.file_content(file.id, "key-a") == content
    assert await store.get_file(file.id, "key-b") is None
    assert await store.file_content(file.id, "key-b") is None
    assert not await store.delete_file(file.id, "key-b")
    if store_url != "memory":  # another store (another gateway) serves it: it is in the database
        other = open_batch_store(store_url)
        try:
            assert await other.file_content(file.id, "key-a") == content
        finally:
            await other.close()
    assert await store.delete_file(file.id, "key-a")
    assert await store.get_file(file.id, "key-a") is None
    assert not await store.delete_file(file.id, "key-a")


async def test_a_file_whose_size_disagrees_with_its_content_is_refused(store):
    with pytest.raises(ValueError, match="3 bytes"):
        await store.create_file(make_file(b"abc"), b"abcd")


async def test_files_page_newest_first_from_after(store):
    files = [make_file(b"x" * i, created_at=NOW + i) for i in range(5)]
    for file in files:
        await store.create_file(file, b"x" * file.bytes)
    await store.create_file(make_file(b"y", key_id="key-b"), b"y")
    first = await store.list_files("key-a", limit=2)
    assert [f.id for f in first.data] == [files[4].id, files[3].id]
    assert first.has_more and first.last_id == files[3].id
    second = await store.list_files("key-a", limit=2, after=first.last_id)
    third = await store.list_files("key-a", limit=2, after=second.last_id)
    assert [f.id for f in second.data + third.data] == [files[2].id, files[1].id, files[0].id]
    assert second.has_more and not third.has_more
    oldest = await store.list_files("key-a", limit=3, order="asc")
    assert [f.id for f in oldest.data] == [files[0].id, files[1].id, files[2].id]
    assert (await store.list_files("key-a", purpose="batch_output")).data == ()
    with pytest.raises(FieldError) as caught:
        await store.list_files("key-b", after=files[0].id)  # another key's file is no cursor
    assert caught.value.param == "after"
    with pytest.raises(FieldError, match="limit"):
        await store.list_files("key-a", limit=101)


async def test_files_made_in_the_same_instant_page_without_loss_or_repeat(store):
    files = [make_file(b"z") for _ in range(7)]
    for file in files:
        await store.create_file(file, b"z")
    seen, after = [], None
    while True:
        page = await store.list_files("key-a", limit=3, after=after)
        seen += [f.id for f in page.data]
        if not page.has_more:
            break
        after = page.last_id
    assert sorted(seen) == sorted(f.id for f in files) and len(seen) == 7
