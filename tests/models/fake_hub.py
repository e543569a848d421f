"""A HuggingFace Hub on loopback and a Hub cache built by hand, for tests/models/test_hub.py.

FakeHub answers what huggingface_hub 2.x asks of the Hub to list and download a model repo:

    GET  /api/models/{repo}[/revision/{rev}] model_info: {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}       list_repo_tree (one page): [{"type", "path", "size", "oid"}]
    HEAD /{repo}/resolve/{rev}/{file}        file metadata: X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}        the bytes

and fails the way the Hub does: X-Error-Code RepoNotFound / GatedRepo / RevisionNotFound /
EntryNotFound. write_cache() lays files out as huggingface_hub's cache does (blobs named by
ETag, snapshots/<commit>/ symlinking into them, refs/<branch> holding the commit).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import unquote, urlsplit


def etag_of(name: str, data: bytes) -> str:
    """The Hub's ETag: sha256 for an LFS file (weights), else the git blob sha1."""
    if name.endswith((".safetensors", ".gguf", ".bin")):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    tags: tuple[str, ...] = ()  # other names of the same commit
    gated: bool = False

    def commit_of(self, revision: str) -> str | None:
        return self.commit if revision in ("main", self.commit, *self.tags) else None


def write_cache(cache: Path, repo_id: str, repo: FakeRepo) -> Path:
    """The repo as huggingface_hub's cache holds it after a download; returns the snapshot dir."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / repo.commit
    for name, data in repo.files.items():
        blob = storage / "blobs" / etag_of(name, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in ("main", *repo.tags):
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(repo.commit)
    return snapshot


class FakeHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repos: dict[str, FakeRepo]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.requests: list[str] = []  # "GET /path", in arrival order
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
        self.server_close()

    def downloaded(self) -> set[str]:
        """The file paths fetched with GET .../resolve/..."""
        return {m[1] for r in self.requests if (m := re.fullmatch(r"GET /[^/]+/[^/]+/resolve/[^/]+/(.+)", r))}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeHub

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def log_message(self, *args) -> None:
        pass

    def _answer(self, send_body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.server.requests.append(f"{self.command} {path}")
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path):
            repo_id, kind, revision = match[1], match[2] or "revision", match[3] or "main"
            repo, commit = self._repo(repo_id, revision, send_body)
            if repo is None:
                return
            if kind == "revision":
                body = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": n} for n in repo.files]}
            else:
                body = [{"type": "file", "path": n, "size": len(d), "oid": etag_of(n, d)}
                        for n, d in repo.files.items()]
            self._send(200, json.dumps(body).encode(), send_body, {"Content-Type": "application/json"})
        elif match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo_id, revision, name = match.groups()
            repo, commit = self._repo(repo_id, revision, send_body)
            if repo is None:
                return
            if name not in repo.files:
                self._error(404, "EntryNotFound", f"{name} does not exist", send_body, {"X-Repo-Commit": commit})
                return
            data = repo.files[name]
            self._send(200, data, send_body, {"X-Repo-Commit": commit, "ETag": f'"{etag_of(name, data)}"'})
        else:
            self._send(404, b"Not Found", send_body)

    def _repo(self, repo_id: str, revision: str, send_body: bool) -> tuple[FakeRepo | None, str]:
        repo = self.server.repos.get(repo_id)
        if repo is None:  # the Hub answers 401 for a missing repo to anyone without a token
            self._error(401, "RepoNotFound", "Repository not found", send_body)
        elif repo.gated:
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.", send_body)
        elif (commit := repo.commit_of(revision)) is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", send_body)
        else:
            return repo, commit
        return None, ""

    def _error(self, status: int, code: str, message: str, send_body: bool, headers: dict | None = None) -> None:
        self._send(status, json.dumps({"error": message}).encode(), send_body,
                   {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json",
                    **(headers or {})})

    def _send(self, status: int, body: bytes, send_body: bool, headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)
