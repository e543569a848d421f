"""`tokenway batches` against a real `tokenway serve`: a JSONL submitted and watched to its end,
its results downloaded equal to what the server's files hold, listed, inspected and cancelled;
bad input and a server's refusals are one clear line each, never a traceback."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenway.cli import main

from .conftest import free_port

MODEL = "smollm2-135m-instruct"
NUM_LONG = 150


def request(custom_id: str, content: str, max_tokens: int = 4, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def write_jsonl(path, lines: list[dict]):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def batches(server, capsys, *args: str) -> tuple[int, str, str]:
    status = main(["batches", *args, "--base-url", server.base_url])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def test_submit_watch_and_download_results(server, client, capsys, tmp_path):
    lines = [request(f"q{i}", f"Say the number {i}.") for i in range(3)]
    lines.append(request("bad", "x", temperature=5))  # valid JSONL, refused by the endpoint when it runs
    jsonl = write_jsonl(tmp_path / "requests.jsonl", lines)
    status, out, err = batches(server, capsys, "submit", str(jsonl), "--metadata", "team=eval", "--watch",
                               "--interval", "0.2")
    batch_id = out.strip()
    assert status == 0, err
    assert batch_id.startswith("batch_") and "uploaded" in err
    assert f"batch {batch_id} completed: 4 of 4 done, 1 failed" in err
    assert "4/4" in err  # the progress bar's last state

    batch = client.batches.retrieve(batch_id)
    assert batch.endpoint == "/v1/chat/completions" and batch.metadata == {"team": "eval"}
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    status, out, err = batches(server, capsys, "results", batch_id, "-o", str(output), "--errors", str(errors))
    assert status == 0, err
    assert output.read_bytes() == client.files.content(batch.output_file_id or "").content
    assert errors.read_bytes() == client.files.content(batch.error_file_id or "").content
    assert sorted(json.loads(line)["custom_id"] for line in output.read_text().splitlines()) == ["q0", "q1", "q2"]
    assert [json.loads(line)["custom_id"] for line in errors.read_text().splitlines()] == ["bad"]
    # Without -o the output lines go to stdout; the error file is named, not fetched.
    status, out, err = batches(server, capsys, "results", batch_id)
    assert status == 0 and out.encode() == output.read_bytes()
    assert f"in {batch.error_file_id}; --errors PATH saves them" in err

    # Each line has its trace, which says which batch line it is.
    first = json.loads(output.read_text().splitlines()[0])
    trace = httpx.get(f"{server.base_url}/v1/traces/{first['response']['request_id']}", timeout=10).json()
    index = next(i for i, line in enumerate(lines) if line["custom_id"] == first["custom_id"])
    assert trace["batch_line"] == f"{batch_id.removeprefix('batch_')}l{index}"
    assert trace["endpoint"] == "/v1/chat/completions" and trace["status"] == 200

    status, out, err = batches(server, capsys, "status", batch_id)
    assert status == 0
    assert "completed" in out and "4 of 4 done, 1 failed" in out and batch.output_file_id in out
    status, out, _ = batches(server, capsys, "status", batch_id, "--json")
    assert json.loads(out)["id"] == batch_id
    status, out, _ = batches(server, capsys, "list", "--limit", "5")
    assert status == 0 and out.startswith("ID") and batch_id in out
    status, out, _ = batches(server, capsys, "list", "--json", "--limit", "1")
    assert [entry["id"] for entry in json.loads(out)] == [client.batches.list(limit=1).data[0].id]
    # Ended: nothing left to cancel, and it says so.
    status, _, err = batches(server, capsys, "cancel", batch_id)
    assert status == 1 and "already ended (completed)" in err


def test_cancel_stops_a_running_batch(server, client, capsys, tmp_path):
    # More lines than a runner runs at once (64): some are still waiting when the cancel arrives.
    jsonl = write_jsonl(tmp_path / "long.jsonl", [request(f"l{i}", f"Count to {100 + i}.", max_tokens=2)
                                                  for i in range(NUM_LONG)])
    status, out, err = batches(server, capsys, "submit", str(jsonl))
    batch_id = out.strip()
    assert status == 0, err
    status, _, err = batches(server, capsys, "cancel", batch_id)
    assert status == 0, err
    assert f"batch {batch_id} is cancell" in err and "will not run" in err
    status, _, err = batches(server, capsys, "watch", batch_id, "--interval", "0.2")
    assert status == 1 and f"batch {batch_id} cancelled:" in err
    counts = client.batches.retrieve(batch_id).request_counts
    assert counts is not None and counts.total == NUM_LONG and counts.completed + counts.failed < NUM_LONG
    # Cancelled before it ended: its results are the lines that ran.
    status, _, err = batches(server, capsys, "results", batch_id, "-o", str(tmp_path / "partial.jsonl"))
    assert status == 0, err


def test_a_file_with_bad_lines_is_refused_naming_them(server, capsys, tmp_path):
    jsonl = tmp_path / "bad.jsonl"
    good = json.dumps(request("a", "hi"))
    jsonl.write_text(f"{good}\n{{not json\n{json.dumps({**request('c', 'x'), 'method': 'GET'})}\n")
    status, _, err = batches(server, capsys, "submit", str(jsonl))
    assert status == 1
    assert "answered 400" in err and "line 2" in err and "line 3" in err


@pytest.mark.parametrize(("args", "says"), [
    (("submit", "/no/such/file.jsonl"), "no such file"),
    (("submit", "{empty}"), "is empty"),
    (("submit", "{no_url}", "--metadata", "x=1"), 'line 1: no "url"'),
    (("submit", "{ok}", "--metadata", "novalue"), "expected KEY=VALUE"),
    (("list", "--limit", "0"), "--limit must be >= 1"),
    (("watch", "batch_x", "--interval", "0"), "--interval must be > 0"),
])
def test_bad_input_is_one_line_and_status_2(server, capsys, tmp_path, args, says):
    files = {"empty": tmp_path / "empty.jsonl", "no_url": tmp_path / "no_url.jsonl", "ok": tmp_path / "ok.jsonl"}
    files["empty"].write_text("\n")
    files["no_url"].write_text(json.dumps({"custom_id": "a", "body": {}}) + "\n")
    write_jsonl(files["ok"], [request("a", "hi")])
    status, _, err = batches(server, capsys, *(arg.format(**files) for arg in args))
    assert status == 2 and says in err and err.count("\n") == 1


def test_server_refusals_and_an_unreachable_server(server, capsys):
    status, _, err = batches(server, capsys, "status", "batch_doesnotexist")
    assert status == 1 and "answered 404: No such Batch object: batch_doesnotexist" in err
    status, _, err = batches(server, capsys, "results", "batch_doesnotexist")
    assert status == 1 and "answered 404" in err
    status = main(["batches", "list", "--base-url", f"http://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("tokenway: cannot reach http://127.0.0.1:") and "Traceback" not in err


def test_metrics_count_batch_lines_and_the_queue(server, capsys, tmp_path):
    jsonl = write_jsonl(tmp_path / "two.jsonl", [request("m0", "Hello."), request("m1", "x", temperature=5)])
    before = batch_samples(server)
    status, _, err = batches(server, capsys, "submit", str(jsonl), "--watch", "--interval", "0.2")
    assert status == 0, err
    after = batch_samples(server)
    lines = ("tokenway_batch_lines_total", (("outcome", "succeeded"),))
    failed = ("tokenway_batch_lines_total", (("outcome", "failed"),))
    assert after[lines] - before.get(lines, 0) == 1 and after[failed] - before.get(failed, 0) == 1
    assert ("tokenway_batch_lines_running", ()) in after and ("tokenway_batch_line_deferrals_total", ()) in after
    # The queue's gauges, as the runner's upkeep (every few seconds) last read them.
    deadline = time.monotonic() + 30
    while batch_samples(server).get(("tokenway_batches", (("status", "completed"),)), 0) < 1:
        assert time.monotonic() < deadline, "the queue's gauges never showed a completed batch"
        time.sleep(0.2)
    assert ("tokenway_batch_lines_pending", ()) in batch_samples(server)


def batch_samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) if family.name.startswith("tokenway_batch")
            for sample in family.samples}
