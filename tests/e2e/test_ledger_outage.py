"""A real `tokenway serve` on a PostgreSQL ledger that goes down under load and comes back:
the clients never notice, the gateway reports itself degraded while it lasts, and every call
served has exactly one row once the database is back, with no restart."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import psycopg
from prometheus_client.parser import text_string_to_metric_families

from ..billing.conftest import OwnPostgres
from .conftest import Server

MODEL = "smollm2-135m-instruct"
OUTAGE_S = 8.0  # long enough for many failed retries; the code does not depend on it


class Load:
    """Clients calling in a loop until stopped; the ids of the calls served, and any failure."""

    def __init__(self, server: Server, num_clients: int = 4) -> None:
        self.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        self.served_ids: list[str] = []
        self.failures: list[str] = []
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num_clients)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                completion = self.client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=2, temperature=0)
                self.served_ids.append(completion.id)  # list.append: atomic across threads
            except openai.APIError as exc:
                self.failures.append(repr(exc))

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=60)


def ledger_metrics(server: Server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("tokenway_ledger_")}


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Poll until `condition` holds or `timeout` passes (a deadline: the ledger retries at most
    5 s apart, so a healthy one is back well within it)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def row_ids(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [row[0] for row in conn.execute("SELECT request_id FROM usage_ledger")]


def test_a_ledger_outage_under_load_is_replayed_by_the_running_server(default_model_dir, tmp_path):
    postgres = OwnPostgres(tmp_path / "postgres")
    url = postgres.new_database()
    server = Server("--no-embeddings", "--ledger-url", url)
    load = None
    try:
        load = Load(server)
        assert wait_until(lambda: len(load.served_ids) >= 10, timeout=60)
        assert ledger_metrics(server)["tokenway_ledger_degraded"] == 0

        postgres.stop()
        stopped_at = time.monotonic()
        # Seen at the first commit that fails: once a call ends (seconds each on a busy CPU).
        assert wait_until(lambda: ledger_metrics(server)["tokenway_ledger_degraded"] == 1, timeout=30)
        num_served_at_down = len(load.served_ids)
        ready = httpx.get(server.base_url + "/ready", timeout=10)
        # Still in rotation (every gateway shares the database), and says why it is degraded.
        assert ready.status_code == 200 and ready.json()["ledger"] == "degraded"
        usage = httpx.get(server.base_url + "/v1/usage", timeout=10)
        assert usage.status_code == 503 and usage.json()["error"]["code"] == "ledger_unavailable"
        assert int(usage.headers["retry-after"]) >= 1
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))
        assert len(load.served_ids) > num_served_at_down  # the clients went on being served
        assert ledger_metrics(server)["tokenway_ledger_pending_rows"] > 0

        postgres.start()
        assert wait_until(lambda: ledger_metrics(server)["tokenway_ledger_degraded"] == 0)
        load.stop()
        served = set(load.served_ids)
        assert len(served) == len(load.served_ids) and not load.failures, load.failures[:3]
        assert wait_until(lambda: set(row_ids(url)) >= served)
        ids = row_ids(url)
        assert len(ids) == len(set(ids)) and set(ids) == served  # each call once, nothing else
        assert ledger_metrics(server)["tokenway_ledger_pending_rows"] == 0
        assert httpx.get(server.base_url + "/ready", timeout=10).json()["ledger"] == "ok"
        [row] = httpx.get(server.base_url + "/v1/usage", timeout=10).json()["data"]
        assert (row["requests"], row["refused_requests"]) == (len(served), 0)
        assert server.process.poll() is None  # the same process throughout
        log = server.read_log()
        assert log.count("cannot commit to the database") == 1 and log.count("the database is back") == 1, log[-3000:]
    finally:
        if load is not None:
            load.stop()
        assert server.stop() == 0, server.read_log()[-3000:]
        postgres.stop()
