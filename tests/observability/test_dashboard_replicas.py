"""The dashboard's Replicas panel as a person sees it: headless Chromium opens /dashboard, served
by the real observability routes (uvicorn on loopback) over an Observer whose stats the test
sets: a pure gateway (no engine: the engine panels are greyed out, nothing reads NaN), then
a server with a local engine."""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Self

import pytest
import uvicorn
from fastapi import FastAPI

from tokenway.observability.observer import Observer
from tokenway.server.observability_api import observability_router
from tokenway.server.stats import ServerStats

from ..e2e import test_dashboard as e2e_dashboard
from .test_replicas import ENGINE_SERVER_STATS, GATEWAY_STATS
from .test_traces import make_trace

chromium = e2e_dashboard.chromium  # the fixture: Chromium's path (scripts/chromium.sh), or a skip


class DashboardServer:
    """The observability routes alone, in a thread; `stats` is what the Observer reads."""

    def __init__(self) -> None:
        self.stats: ServerStats = GATEWAY_STATS
        self.observer = Observer(lambda: self.stats)
        app = FastAPI()
        app.include_router(observability_router(self.observer, gatekeeper=None, admin_key=None))
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="critical", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the dashboard server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


@pytest.fixture
def server():
    with DashboardServer() as server:
        yield server


def dump_dom(chromium: str, tmp_path, server: DashboardServer) -> str:
    dom = e2e_dashboard.run_chromium(chromium, tmp_path, f"{server.base_url}/dashboard", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def replica_rows(html: str) -> dict[str, tuple[str, str]]:
    """replica -> (its health attribute, its row's text)."""
    body = html[html.index('id="replicas"'):]
    body = body[:body.index("</table>")]
    rows = re.findall(r'<tr data-pool="([^"]*)" data-replica="([^"]*)" data-health="(up|down)"[^>]*>(.*?)</tr>', body)
    return {replica: (health, re.sub(r"<[^>]+>", " ", cells)) for _, replica, health, cells in rows}


def engine_panels(html: str) -> dict[str, str]:
    return dict(re.findall(r'<section id="(kv-panel|hit-rate-panel)"[^>]*data-engine="(on|off)"', html))


def test_a_gateway_shows_its_replicas_and_greys_out_the_engine_panels(chromium, server, tmp_path):
    route = {"pool": "remote", "replica": "oa", "reason": "only", "failed_attempts": 0}
    server.observer.record(make_trace("chatcmpl-routed", route=route))
    html = dump_dom(chromium, tmp_path, server)

    rows = replica_rows(html)
    assert list(rows) == ["oa", "an"]
    health, text = rows["oa"]
    assert health == "up" and text.split() == ["remote", "oa", "openai", "up", "4", "0", "20", "0", "60.0%"]
    health, text = rows["an"]
    assert health == "down" and "probe failed" in text and text.split()[-1] == "—"  # no usage: no hit rate
    assert "1 of 2 up" in html
    assert engine_panels(html) == {"kv-panel": "off", "hit-rate-panel": "off"}
    assert "No local engine" in html
    assert "NaN" not in html and "undefined" not in html
    recent = html[html.index('id="recent"'):]
    assert re.search(r'data-request-id="chatcmpl-routed".*?<td class="replica"[^>]*>oa</td>', recent, re.DOTALL)


def test_with_a_local_engine_its_panels_are_on_beside_the_replicas(chromium, server, tmp_path):
    server.stats = ENGINE_SERVER_STATS
    html = dump_dom(chromium, tmp_path, server)
    rows = replica_rows(html)
    assert list(rows) == ["local", "w1", "w2"]
    assert rows["local"][1].split()[-1] == "25.0%"
    assert rows["w1"][1].split()[-3:] == ["1", "(14.3%)", "0.0%"]  # 1 of 7 calls failed; usage but nothing cached
    assert rows["w2"][0] == "down" and "breaker open" in rows["w2"][1]
    assert engine_panels(html) == {"kv-panel": "on", "hit-rate-panel": "on"}
    assert "KV usage · 25 of 100 blocks" in html and "of 100 · 4 preempted" in html
    assert "NaN" not in html
