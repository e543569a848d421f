"""The dashboard as a person sees it: headless Chromium (Debian's package, installed by
scripts/chromium.sh) opens /dashboard on a real server with auth on; the waterfall of the
request just made is on the page. The screenshot is kept in artifacts/dashboard.png."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import httpx
import openai
import pytest

from .conftest import REPO, Server
from .test_gateway_policy import create_key

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-secret-for-dashboard-tests"
ARTIFACTS = REPO / "artifacts"
CHROMIUM_TIMEOUT_S = 60


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
    # A fresh profile per run: a profile still held by another Chromium is locked.
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp_path)
    return subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         f"--user-data-dir={profile}", "--window-size=1280,1800", "--virtual-time-budget=8000", *mode, url],
        capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)


def test_the_dashboard_draws_the_waterfall_of_a_request(chromium, server, tmp_path):
    key = create_key(server.db, "--name", "dashboard-user")  # auth on (the admin key): the page needs it
    snapshot_url = f"{server.base_url}/dashboard/api/snapshot"
    assert httpx.get(snapshot_url, timeout=10).status_code == 401
    deadline = time.monotonic() + 10  # the server sees the new key within ~2 s
    while httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                    timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the new key was never accepted"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about cats."}], max_tokens=8, temperature=0)

    assert httpx.get(snapshot_url, headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN}"}
    # The trace is recorded after the last byte, which the client may see first.
    deadline = time.monotonic() + 10
    while True:
        snapshot = httpx.get(snapshot_url, headers=admin, timeout=10)
        assert snapshot.status_code == 200
        if any(t["request_id"] == completion.id for t in snapshot.json()["traces"]):
            break
        assert time.monotonic() < deadline, f"{completion.id} never reached the snapshot"
        time.sleep(0.1)
    newest = snapshot.json()["traces"][0]
    assert newest["request_id"] == completion.id  # newest: selected by default
    assert newest["key_id"] != "anonymous"  # made with auth on
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
    assert stages == snapshot.json()["stages"]  # one row per stage, in order
    recent = html[html.index('id="recent"'):]
    assert f'data-request-id="{completion.id}"' in recent
    assert ADMIN not in html  # the key moved from the URL to sessionStorage

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
