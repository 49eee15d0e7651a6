"""A real HTTP receiver for alert webhooks (PROTOCOL 3.1) on 127.0.0.1: ``http.server`` in a
thread that records each POST and answers as a test tells it (a status list, or hanging until
released), so webhook tests and benchmarks talk to a real socket, never a mock.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """An HTTP server on 127.0.0.1: records each POST, answers from ``statuses`` (then 200),
    or holds requests open while ``hang`` is set (until released)."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.statuses: list[int] = []
        self.hang = False
        self.release = threading.Event()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.posts.append({"body": json.loads(body), "type": self.headers["Content-Type"]})
                    receiver.paths.append(self.path)
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                if receiver.hang:
                    receiver.release.wait(10)
                    return
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/T000/SECRET-TOKEN"

    def count(self) -> int:
        with self.lock:
            return len(self.posts)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def bodies(self) -> list[dict[str, Any]]:
        """The JSON bodies received so far, in arrival order."""
        with self.lock:
            return [p["body"] for p in self.posts]


class Trickler:
    """A hostile webhook receiver on 127.0.0.1 (issue 32): it reads each request, then sends
    its answer's head one byte every ``interval`` seconds, forever, so every single read
    of the client finishes well within a per-read timeout. ``redirect``: answer at once
    with a 302 to ``redirect`` instead."""

    def __init__(self, interval: float = 0.5, redirect: str | None = None) -> None:
        import socket as _socket
        self.interval = interval
        self.redirect = redirect
        self.accepted = 0
        self.stop = threading.Event()
        self.sock = _socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks/TRICKLE"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: Any) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)
                if self.redirect is not None:
                    conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: " + self.redirect.encode()
                                 + b"\r\nContent-Length: 0\r\n\r\n")
                    return
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 100_000:
                    if self.stop.wait(self.interval):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(5)
