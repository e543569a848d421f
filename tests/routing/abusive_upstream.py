"""An OpenAI-compatible upstream that sends too much, in its own process (so its sending
does not take the test process's GIL from the client it measures), for
tests/routing/test_upstream_abuse.py.

    with AbusiveUpstream() as upstream:      # python tests/routing/abusive_upstream.py, on a free port
        ... a replica at upstream.base_url ...
        upstream.num_bytes_sent()            # GET /stats: what its answers have carried so far

GET .../models answers a small list; a POST answers as its body's `model` says:

    endless-line   an event stream whose one `data:` line never ends
    huge-json      200 application/json, Content-Length 300 MB, one JSON object without a line end
    endless-head   a status line, then one header that never ends
    huge-error     500 with a 300 MB body

each until the client closes (a thread per connection, blocking sockets).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

PIECE = 64 * 1024
HUGE = 300 * 10**6


class AbusiveUpstream:
    """The server's process, started on enter and killed on exit."""

    def __enter__(self) -> AbusiveUpstream:
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdout=subprocess.PIPE,
                                        text=True)
        self.port = int(self.process.stdout.readline())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.kill()
        self.process.wait()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def num_bytes_sent(self) -> int:
        return httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=10).json()["num_bytes_sent"]


class _Server:
    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.num_bytes_sent = 0
        self.lock = threading.Lock()

    def serve_forever(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while self.answer(conn):
                    pass
            except OSError:
                pass  # the client closed the connection: what the tests want

    def answer(self, conn: socket.socket) -> bool:
        """One request; False when the connection is done."""
        received = b""
        while b"\r\n\r\n" not in received:
            if not (chunk := conn.recv(65536)):
                return False
            received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        if lines[0].startswith("GET"):
            answer = json.dumps({"num_bytes_sent": self.num_bytes_sent} if lines[0].startswith("GET /stats")
                                else {"object": "list", "data": []}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            return True
        mode = json.loads(body)["model"]
        if mode == "endless-line":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
            self.send_forever(conn, b"data: ", b"x" * PIECE)
        elif mode == "huge-json":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % HUGE)
            self.send_forever(conn, b'{"id":"chatcmpl-1","choices":[{"message":{"content":"', b"y" * PIECE, HUGE)
        elif mode == "endless-head":
            self.send_forever(conn, b"HTTP/1.1 200 OK\r\nx-endless: ", b"z" * PIECE)
        elif mode == "huge-error":
            conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\n"
                         b"content-length: %d\r\n\r\n" % HUGE)
            self.send_forever(conn, b"", b"e" * PIECE, HUGE)
        return False

    def send_forever(self, conn: socket.socket, start: bytes, piece: bytes, limit: float = float("inf")) -> None:
        conn.sendall(start)
        num_sent = len(start)
        while num_sent < limit:
            conn.sendall(piece)
            num_sent += len(piece)
            with self.lock:
                self.num_bytes_sent += len(piece)


if __name__ == "__main__":
    server = _Server()
    print(server.listener.getsockname()[1], flush=True)
    server.serve_forever()
