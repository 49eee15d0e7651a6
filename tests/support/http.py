"""Small HTTP and SSE clients on plain sockets, for the web's real processes.

``fetch`` answers any status (the tests check it); :class:`SSEClient` is a raw-socket
EventSource that parses the status line, the headers, a chunked body and the events, so
tests see exactly the bytes the web wrote.
"""
from __future__ import annotations

import http.client
import json
import socket
from typing import Any, Callable, Optional


class Resp:
    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def fetch(port: int, path: str, headers: Optional[dict[str, str]] = None,
         method: str = "GET", timeout: float = 10.0) -> Resp:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return Resp(r.status, r.headers, r.read())
    finally:
        conn.close()


def get_json(port: int, path: str, **kw: Any) -> Any:
    r = fetch(port, path, **kw)
    assert r.status == 200, (path, r.status, r.body[:300])
    return r.json()


class SSEClient:
    """A raw-socket EventSource: parses the status, headers, chunked body and events."""

    def __init__(self, port: int, path: str, headers: Optional[dict[str, str]] = None,
                 timeout: float = 15.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                          f"Accept: text/event-stream\r\n{extra}\r\n".encode())
        self._raw = b""
        self._body = b""
        head = self._read_until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip()
                        for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        self.chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        self.closed = False
        self.comments: list[str] = []
        self.retry: Optional[int] = None

    def _recv(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            self.closed = True
            return False
        self._raw += data
        return True

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._raw:
            if not self._recv():
                raise EOFError("connection closed before headers")
        head, _, self._raw = self._raw.partition(marker)
        return head

    def _dechunk(self) -> None:
        if not self.chunked:
            self._body += self._raw
            self._raw = b""
            return
        while b"\r\n" in self._raw:
            size_line, _, rest = self._raw.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if len(rest) < size + 2:
                return
            if size == 0:
                self.closed = True
            self._body += rest[:size]
            self._raw = rest[size + 2:]

    def next_block(self) -> Optional[str]:
        """The next raw event block (without its blank line), or None at end of stream."""
        while True:
            self._dechunk()
            if b"\n\n" in self._body:
                block, _, self._body = self._body.partition(b"\n\n")
                return block.decode()
            if self.closed or not self._recv():
                self._dechunk()
                if b"\n\n" in self._body:
                    continue
                return None

    def next_event(self) -> Optional[dict[str, Any]]:
        """The next dispatched event ({id, event, data}); comments and retry are recorded."""
        while True:
            block = self.next_block()
            if block is None:
                return None
            event: dict[str, Any] = {}
            data: list[str] = []
            for line in block.split("\n"):
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "":
                    self.comments.append(value)
                elif name == "retry":
                    self.retry = int(value)
                elif name == "data":
                    data.append(value)
                else:
                    event[name] = value
            if data:
                event["data"] = json.loads("\n".join(data))
                event.setdefault("event", "message")
                return event

    def events_until(self, predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        out = []
        while True:
            ev = self.next_event()
            if ev is None:
                raise AssertionError(f"stream ended after {[(e['id'], e['event']) for e in out]}")
            out.append(ev)
            if predicate(ev):
                return out

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> SSEClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
