"""Fixtures for the web's socket tests: a REAL broker (``BrokerServer`` in a thread on
ephemeral loopback endpoints, tmp data dir), REAL ``rankboard`` web/up/demo subprocesses (the
web is gevent-patched, so it runs out of this unpatched test process), a raw PUSH socket that
sends real wire frames, and small HTTP and SSE clients on plain sockets.

Nothing here sleeps to synchronise: every wait polls a condition against a deadline.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

import pytest
import zmq

from broker.server import BrokerServer
from rank_agent import protocol
from tests import polling

REPO = Path(__file__).resolve().parents[2]
EPHEMERAL = "tcp://127.0.0.1:*"
T = TypeVar("T")


#: What a poll over HTTP treats as "not yet" (the server not up, a half-written answer).
HTTP_NOT_YET = (OSError, http.client.HTTPException, ValueError, KeyError)


def wait_for(predicate: Callable[[], Optional[T]], timeout: float = 15.0, what: str = "condition",
             interval: float = 0.05) -> T:
    """:func:`tests.polling.wait_for` with HTTP errors counted as "not yet"."""
    return polling.wait_for(predicate, timeout, what, interval=interval, retry_on=HTTP_NOT_YET)


# ------------------------------------------------------------------------- broker
class Broker:
    """A BrokerServer serving in a thread; ``restart()`` keeps its endpoints and data dir."""

    def __init__(self, data_dir: Path, endpoints: Optional[dict[str, str]] = None) -> None:
        self.data_dir = data_dir
        eps = endpoints or {"ingest": EPHEMERAL, "publish": EPHEMERAL, "snapshot": EPHEMERAL}
        self.server = BrokerServer(eps["ingest"], eps["publish"], eps["snapshot"],
                                   data_dir=data_dir, stale_after=30.0)
        self.endpoints = self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, name="broker", daemon=True)
        self.thread.start()

    @property
    def ingest(self) -> str:
        return self.endpoints["ingest"]

    @property
    def publish(self) -> str:
        return self.endpoints["publish"]

    @property
    def snapshot(self) -> str:
        return self.endpoints["snapshot"]

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        self.server.close()

    def restart(self) -> Broker:
        self.stop()
        return Broker(self.data_dir, self.endpoints)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    holder = {"b": Broker(tmp_path / "data")}
    yield _BrokerRef(holder)  # type: ignore[misc]
    holder["b"].stop()


class _BrokerRef:
    """The ``broker`` fixture: delegates to the current Broker, survives ``restart()``."""

    def __init__(self, holder: dict[str, Broker]) -> None:
        self._holder = holder

    def restart(self) -> None:
        self._holder["b"] = self._holder["b"].restart()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._holder["b"], name)


# ---------------------------------------------------------------------- frames
class Pusher:
    """A raw PUSH socket sending real wire frames (rank_agent.protocol) to the broker."""

    def __init__(self, ingest: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.linger = 0
        self.sock.connect(ingest)

    def send(self, *frames: Any) -> None:
        for frame in frames:
            self.sock.send(protocol.encoder.encode(frame))

    def register(self, run: str, rank: int, world_size: int, host: str = "node-a",
                 **kw: Any) -> None:
        self.send(protocol.Register(run=run, rank=rank, world_size=world_size, host=host,
                                    local_rank=kw.pop("local_rank", rank), **kw))

    def epoch(self, run: str, epoch: int, world_size: int, loss: float = 1.0,
              scalars: Optional[dict[str, tuple[float, int]]] = None, **kw: Any) -> None:
        for rank in range(world_size):
            self.send(protocol.Metrics(run=run, rank=rank, epoch=epoch, avg_loss=loss, batches=10,
                                       samples=640, epoch_ms=100.0, scalars=scalars or {}, **kw))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def pusher(broker: Broker) -> Iterator[Pusher]:
    p = Pusher(broker.ingest)
    yield p
    p.close()


# -------------------------------------------------------------------- processes
class Proc:
    """A ``python -m rankboard ...`` subprocess whose stdout/stderr lines are collected."""

    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None) -> None:
        full_env = dict(os.environ, PYTHONUNBUFFERED="1")
        full_env.pop("RANKBOARD_TOKEN", None)
        full_env.update(env or {})
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankboard", *args], cwd=REPO, env=full_env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._cond = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for t in self._readers:
            t.start()
        self.port: Optional[int] = None

    def _read(self, name: str, stream: Any) -> None:
        for line in stream:
            with self._cond:
                self.lines[name].append(line.rstrip("\n"))
                self._cond.notify_all()

    def output(self, name: str = "stderr") -> str:
        with self._cond:
            return "\n".join(self.lines[name])

    def wait_line(self, pattern: str, stream: str = "stdout", timeout: float = 20.0,
                  start: int = 0) -> re.Match[str]:
        """The first line (from index ``start``) of ``stream`` matching ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[stream][start:]:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and all(
                        not t.is_alive() for t in self._readers)):
                    raise AssertionError(
                        f"no line matching {pattern!r} on {stream} of {self.args}; "
                        f"exit={self.proc.poll()}\nstdout:\n{self.output('stdout')}\n"
                        f"stderr:\n{self.output('stderr')[-4000:]}")
                self._cond.wait(min(left, 0.2))

    def wait_dashboard(self, timeout: float = 20.0) -> int:
        self.port = int(self.wait_line(r"^dashboard: http://[^:]+:(\d+)$", timeout=timeout).group(1))
        return self.port

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for t in self._readers:
            t.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """``spawn(*args, env=...)`` starts a rankboard subprocess, killed at teardown."""
    procs: list[Proc] = []

    def start(*args: str, env: Optional[dict[str, str]] = None) -> Proc:
        proc = Proc(list(args), env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()


def start_web(spawn: Callable[..., Proc], broker: Any, *extra: str,
              env: Optional[dict[str, str]] = None, healthy: bool = True) -> Proc:
    """``rankboard web`` on an ephemeral loopback port against ``broker``; waits for /healthz."""
    proc = spawn("web", "--publish", broker.publish, "--snapshot", broker.snapshot,
                 "--host", "127.0.0.1", "--port", "0", *extra, env=env)
    port = proc.wait_dashboard()
    if healthy:
        wait_for(lambda: fetch(port, "/healthz").status == 200, what="web /healthz 200")
    return proc


@pytest.fixture
def web(spawn: Callable[..., Proc], broker: Broker) -> Proc:
    return start_web(spawn, broker)


# ------------------------------------------------------------------------ HTTP
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
