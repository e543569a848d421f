"""The dashboard's Batches panel as a person sees it: headless Chromium opens /dashboard, served by
the real observability routes over an Observer watching a batch runner's stats the test sets
(RunnerStats over a real QueueOverview): the running batches with their progress, the queue's
depth; a server without a runner says so; and a batch line's trace names its line."""

from __future__ import annotations

import re

from tokenway.batches import Batch, BatchCounts, BatchStatus, QueueOverview
from tokenway.batches.runner import RunnerStats

from .test_dashboard_replicas import DashboardServer, chromium, dump_dom, server  # noqa: F401  (fixtures)
from .test_traces import make_trace

NOW = 1_750_000_000.0


def running_batch(batch_id: str, status: BatchStatus, counts: BatchCounts) -> Batch:
    return Batch(batch_id, "k_team", "openai", "/v1/chat/completions", "file-" + "a" * 24, status, NOW, NOW + 86400,
                 {"in_progress_at": NOW}, None, (), None, None, counts, "smollm2-135m-instruct")


def batch_rows(html: str) -> dict[str, str]:
    """batch id -> its row's text."""
    body = html[html.index('id="batches"'):]
    body = body[:body.index("</table>")]
    return {batch_id: re.sub(r"<[^>]+>", " ", cells)
            for batch_id, cells in re.findall(r'<tr data-batch="([^"]*)"[^>]*>(.*?)</tr>', body, re.DOTALL)}


def test_running_batches_show_their_progress_and_the_queue(chromium, server: DashboardServer, tmp_path):  # noqa: F811
    stats = RunnerStats(num_lines_by_outcome={"succeeded": 7, "failed": 1}, num_deferred=2, num_running=3,
                        overview_at=NOW, overview=QueueOverview(
                            {"in_progress": 1, "cancelling": 1, "completed": 4}, 150, 3, (
                                running_batch("batch_a", "in_progress", BatchCounts(200, 50, 10, pending=140)),
                                running_batch("batch_b", "cancelling", BatchCounts(4, 1, cancelled=2, pending=1)))))
    server.observer.watch_batches(stats.to_dict)
    server.observer.record(make_trace("chatcmpl-batchline", batch_line="Abcl3"))
    html = dump_dom(chromium, tmp_path, server)

    rows = batch_rows(html)
    assert list(rows) == ["batch_a", "batch_b"]
    assert rows["batch_a"].split()[:6] == ["batch_a", "k_team", "smollm2-135m-instruct", "/v1/chat/completions",
                                           "in_progress", "60"]
    assert "60 / 200 · 30.0%" in rows["batch_a"] and rows["batch_a"].split()[10:13] == ["50", "10", "140"]
    assert "cancelling" in rows["batch_b"] and "3 / 4 · 75.0%" in rows["batch_b"]
    assert "150 lines waiting · 3 held by runners · this server: 3 running, 7 succeeded, 1 failed, 2 deferred" in html
    assert re.search(r'<section id="batches-panel" class="panel span-12">', html)  # not greyed out
    # The newest request (selected) is the batch line: its details name it.
    assert re.search(r"<dt>Batch line</dt><dd><code>Abcl3</code></dd>", html)
    assert "NaN" not in html and "undefined" not in html


def test_a_server_without_a_batch_runner_says_so(chromium, server: DashboardServer, tmp_path):  # noqa: F811
    html = dump_dom(chromium, tmp_path, server)
    assert batch_rows(html) == {}
    assert "No batch runner." in html
    assert re.search(r'<section id="batches-panel" class="panel span-12 off">', html)
