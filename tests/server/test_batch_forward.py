"""The forwarder's rule and its steps, on a real store and a scripted upstream Batch API: which
batches go to an upstream whole; submitted once, polled, read back into each line once; a
cancel before submission sends nothing; an upstream's refusal fails the lines with its reason;
a second forwarder on the same database (a restart) carries on from the stored upstream id, and
finds there the batch a submission cut off before its id was kept made."""

import pytest

from tokenway.batches import LineOutcome, new_batch, open_batch_store
from tokenway.protocol.errors import InvalidRequestError
from tokenway.routing.upstream_batches import UpstreamBatch
from tokenway.server.batch_forward import BatchForwarder, ForwardTarget

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class ScriptedUpstream:
    def __init__(self, shape: str = "openai") -> None:
        self.shape = shape
        self.submitted: list[list[tuple[str, dict]]] = []
        self.metadata: list[dict] = []
        self.cancelled: list[str] = []
        self.status = "in_progress"
        self.refuse = False

    async def submit(self, lines, endpoint, metadata=None):
        if self.refuse:
            raise InvalidRequestError("the model is not in this account")
        self.submitted.append(list(lines))
        self.metadata.append(dict(metadata))
        return f"batch_up{len(self.submitted)}"

    async def find(self, key, value):
        return next((f"batch_up{i + 1}" for i, metadata in enumerate(self.metadata) if metadata[key] == value), None)

    async def poll(self, batch_id):
        return UpstreamBatch(batch_id, self.status, self.status in ("completed", "cancelled"))

    async def cancel(self, batch_id):
        self.cancelled.append(batch_id)
        self.status = "cancelled"

    async def results(self, batch):
        (lines,) = self.submitted
        return {custom_id: LineOutcome("succeeded", 200, {"model": body["model"], "n": i,
                                                          "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, None)
                for i, (custom_id, body) in enumerate(lines) if i < 2}  # the third left out


def forwarder(store, upstream) -> BatchForwarder:
    target = ForwardTarget("remote/b", "upstream-name", upstream)
    forwarder = BatchForwarder(store, {"remote": target, "alias": target}, None, poll_s=0.0)  # due again at once
    store.forward_with(forwarder.choose)
    return forwarder


async def create(store, models=("remote",) * 3, api="openai"):
    endpoint = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    batch = new_batch(api, "key-a", endpoint, now=1.0e9 * 2, input_file_id="file-" + "a" * 24 if api == "openai"
                      else None)
    return await store.create_batch(batch, [(f"q{i}", {"model": model, "messages": []})
                                            for i, model in enumerate(models)])


async def step(forwarder) -> None:
    await forwarder()
    await forwarder._task


@pytest.fixture
async def store(tmp_path):
    store = open_batch_store(f"sqlite://{tmp_path}/ledger.db")
    yield store
    await store.close()


async def test_the_rule_one_model_with_a_target_of_the_batchs_api(store):
    forwarder(store, ScriptedUpstream())
    assert (await create(store)).upstream == "remote/b"
    assert (await create(store, ("remote", "alias", "remote"))).upstream == "remote/b"  # an alias is the model
    assert (await create(store, ("remote", "other", "remote"))).upstream is None
    assert (await create(store, ("remote",), api="anthropic")).upstream is None  # an openai upstream's API only


async def test_a_batch_is_submitted_once_polled_and_read_back(store, tmp_path):
    upstream = ScriptedUpstream()
    first = forwarder(store, upstream)
    batch = await create(store)
    await step(first)
    assert [[body["model"] for _, body in lines] for lines in upstream.submitted] == [["upstream-name"] * 3]
    assert (await store.get_batch(batch.id, "key-a")).upstream_batch_id == "batch_up1"
    await step(first)  # still running there: nothing more
    assert len(upstream.submitted) == 1 and (await store.get_batch(batch.id, "key-a")).counts.pending == 3
    # A restart: another forwarder on the database polls the id it finds there.
    other_store = open_batch_store(f"sqlite://{tmp_path}/ledger.db")
    try:
        upstream.status = "completed"
        await step(forwarder(other_store, upstream))
        assert len(upstream.submitted) == 1
        assert await other_store.finalize_ready(2.0e9) == (batch.id,)
        results = {line.custom_id: outcome async for line, outcome in await other_store.results(batch.id, "key-a")}
    finally:
        await other_store.close()
    assert [results[f"q{i}"].outcome for i in range(3)] == ["succeeded", "succeeded", "failed"]
    assert results["q0"].response["model"] == "remote" and results["q0"].request_id.startswith("batch_req_")
    assert results["q2"].error["code"] == "upstream_batch_failed"


async def test_a_cancel_before_submission_sends_nothing_and_after_it_reaches_the_upstream(store):
    upstream = ScriptedUpstream()
    fwd = forwarder(store, upstream)
    early = await create(store)
    await store.cancel_batch(early.id, "key-a")
    await step(fwd)
    assert upstream.submitted == [] and (await store.get_batch(early.id, "key-a")).counts.cancelled == 3
    late = await create(store)
    await step(fwd)
    await store.cancel_batch(late.id, "key-a")
    await step(fwd)
    assert upstream.cancelled == ["batch_up1"]
    assert (await store.get_batch(late.id, "key-a")).counts.succeeded == 2  # what ran there is kept


async def test_an_upstreams_refusal_fails_the_lines_with_its_reason(store):
    upstream = ScriptedUpstream()
    upstream.refuse = True
    fwd = forwarder(store, upstream)
    batch = await create(store)
    await step(fwd)
    results = [outcome async for _, outcome in await store.results(batch.id, "key-a")]
    assert [outcome.error["code"] for outcome in results] == ["upstream_refused"] * 3
    assert "not in this account" in results[0].error["message"]


async def test_a_submission_cut_off_before_its_id_was_kept_is_found_not_sent_again(store):
    upstream = ScriptedUpstream()
    fwd = forwarder(store, upstream)
    batch = await create(store)
    await upstream.submit([("q0", {})], "/v1/chat/completions", {"tokenway_batch_id": batch.id})  # then killed
    await step(fwd)
    assert len(upstream.submitted) == 1
    assert (await store.get_batch(batch.id, "key-a")).upstream_batch_id == "batch_up1"
