"""The dashboard as a person sees it: headless Chromium (Debian's package, installed by
scripts/chromium.sh) opens /dashboard on a real server with auth on; the waterfall of the
request just made is on the page. The screenshot is kept in artifacts/dashboard.png."""

from __future__ import annotations

import os
import re
import subprocess
import time

import httpx
import openai
import pytest

from .conftest import REPO, Server
from .test_gateway_policy import create_key

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-secret-for-dashboard-tests"
ARTIFACTS = REPO / "artifacts"


@pytest.fixture(scope="module")
def chromium() -> str:
    out = subprocess.run([str(REPO / "scripts" / "chromium.sh")], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"scripts/chromium.sh could not provide chromium: {out.stderr}")
        pytest.skip(f"no chromium: {out.stderr.strip()}")
    return out.stdout.strip()


@pytest.fixture(scope="module")
def server(default_model_dir):
    server = Server("--admin-key", ADMIN)
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


def run_chromium(chromium: str, tmp_path, url: str, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1800", "--virtual-time-budget=8000",
         *mode, url],
        capture_output=True, text=True, timeout=120)


def test_the_dashboard_draws_the_waterfall_of_a_request(chromium, server, tmp_path):
    key = create_key(server.db, "--name", "dashboard-user")  # auth on: the page needs the admin key
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    deadline = time.monotonic() + 10  # the server sees the new key within ~2 s
    while True:
        try:
            completion = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell me about cats."}], max_tokens=12,
                temperature=0)
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline
            time.sleep(0.2)

    snapshot_url = f"{server.base_url}/dashboard/api/snapshot"
    assert httpx.get(snapshot_url, timeout=10).status_code == 401
    assert httpx.get(snapshot_url, headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 401
    assert httpx.get(snapshot_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).status_code == 200
    page = httpx.get(server.base_url + "/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(server.base_url + "/dashboard/static/../app.py", timeout=10).status_code == 404

    url = f"{server.base_url}/dashboard#key={ADMIN}"
    dom = run_chromium(chromium, tmp_path, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    waterfall = re.search(r'<[^>]*id="waterfall"[^>]*>', html)
    assert waterfall is not None, html[:2000]
    assert f'data-request-id="{completion.id}"' in waterfall.group(0)
    stages = re.findall(r'class="wf-row[^"]*"[^>]*data-stage="([a-z]+)"', html)
    assert {"auth", "tokenize", "queue", "prefill", "decode", "billing"} <= set(stages)
    recent = html[html.index('id="recent"'):]
    assert f'data-request-id="{completion.id}"' in recent

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "dashboard.png"
    screenshot.unlink(missing_ok=True)
    shot = run_chromium(chromium, tmp_path, url, f"--screenshot={screenshot}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    data = screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_without_the_admin_key_the_page_asks_for_it(chromium, server, tmp_path):
    create_key(server.db, "--name", "turns-auth-on")
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/dashboard/api/snapshot", timeout=10).status_code != 401:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    dom = run_chromium(chromium, tmp_path, f"{server.base_url}/dashboard", "--dump-dom")
    assert dom.returncode == 0
    assert "admin key" in dom.stdout.lower()
    assert 'data-request-id="chatcmpl-' not in dom.stdout  # no data without the key
