"""Shared pieces of the benchmarks: result lines, real broker/web processes, a raw SSE client.

Everything here is plain I/O plumbing for measurement; nothing is a test. The processes are
the real ones (``python -m rankboard broker|web``) on ephemeral loopback ports with a
temporary data dir, started the way ``rankboard up`` starts its broker child: the bound
endpoints and the dashboard port are learned from the processes' own log lines.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.polling import wait_for  # noqa: E402  (the one poll-with-deadline)
from web.children import terminate  # noqa: E402  (the one terminate-then-kill)

EPHEMERAL = "tcp://127.0.0.1:*"
T = TypeVar("T")


@contextmanager
def broker_gc() -> Iterator[None]:
    """The broker process's collector settings (:func:`broker.server.tune_gc`, which
    ``rankboard broker`` applies) while a benchmark hosts a ``BrokerServer`` in this
    process; restored after, so the benchmarks that follow (the agent's: a user's
    process) run with CPython's defaults."""
    import gc

    from broker.server import tune_gc

    before = tune_gc()
    try:
        yield
    finally:
        gc.set_threshold(*before)

_BOUND = re.compile(r"broker (ingest|publish|snapshot) bound at (\S+)")
_DASHBOARD = re.compile(r"dashboard: http://localhost:(\d+)")


def result(name: str, value: float, unit: str, baseline: Optional[float] = None,
           ratio: Optional[float] = None, **extra: Any) -> dict[str, Any]:
    """One benchmark figure as run_all prints it (``extra`` goes to BENCHMARKS.md only)."""
    out: dict[str, Any] = {"name": name, "value": value, "unit": unit,
                           "baseline": baseline, "ratio": ratio}
    if extra:
        out["_extra"] = extra
    return out


def push_socket(ingest: str) -> tuple[Any, Any]:
    """A context and a PUSH socket connected to ``ingest`` that queue without limit and
    linger a second at close: how the benches feed a broker as ranks would."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.sndhwm = 0
    sock.linger = 1000
    sock.connect(ingest)
    return ctx, sock


def push_all(ingest: str, frames: list[bytes]) -> None:
    """Push ``frames`` to ``ingest`` from a socket of this process and deliver them all
    before returning (the run's registers before a timed flood)."""
    ctx, sock = push_socket(ingest)
    for f in frames:
        sock.send(f)
    sock.close(linger=-1)
    ctx.term()


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0-100), nearest-rank on the sorted values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(p / 100.0 * (len(s) - 1)))))
    return s[k]


def raise_nofile(limit: int = 8192) -> None:
    """Lift the soft open-files limit (1,000 SSE clients need more than 1,024 fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, limit)) if hard != resource.RLIM_INFINITY else max(soft, limit)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class Proc:
    """A ``python -m rankboard ...`` child; its output lines are collected by a thread."""

    def __init__(self, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("RANKBOARD_TOKEN", None)
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankboard", *args], cwd=str(REPO), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=raise_nofile,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def find(self, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        return [m for line in list(self.lines) if (m := pattern.search(line))]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        """Resident set size of the child (VmRSS), KiB."""
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the child so far (from /proc)."""
        with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        terminate(self.proc, 10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._reader.join(2)

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.lines[-n:])


class Stack:
    """A real broker process and a real web process on ephemeral ports (``data_dir``: tmp)."""

    def __init__(self, data_dir: Path, *, web: bool = True, web_env: Optional[dict[str, str]] = None
                 ) -> None:
        self.broker = Proc(["broker", "--ingest", EPHEMERAL, "--publish", EPHEMERAL,
                            "--snapshot", EPHEMERAL, "--data-dir", str(data_dir),
                            "--log-level", "INFO"])
        self.endpoints: dict[str, str] = {}
        try:
            def bound() -> bool:
                if self.broker.proc.poll() is not None:
                    raise RuntimeError("broker exited:\n" + self.broker.tail())
                self.endpoints = {m.group(1): m.group(2) for m in self.broker.find(_BOUND)}
                return len(self.endpoints) == 3
            wait_for(bound, 30, "the broker to bind")
        except BaseException:
            self.broker.stop()
            raise
        self.web: Optional[Proc] = None
        self.port = 0
        if web:
            self.start_web(web_env)

    def start_web(self, env: Optional[dict[str, str]] = None) -> None:
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.web = Proc(["web", "--publish", self.endpoints["publish"],
                             "--snapshot", self.endpoints["snapshot"], "--port", "0",
                             "--log-level", "WARNING"])
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        web = self.web

        def ready() -> bool:
            if web.proc.poll() is not None:
                raise RuntimeError("web exited:\n" + web.tail())
            found = web.find(_DASHBOARD)
            if not found:
                return False
            self.port = int(found[0].group(1))
            status, _ = http_get(self.port, "/healthz")
            return status == 200
        try:
            wait_for(ready, 30, "the web to be healthy", interval=0.05)
        except BaseException:
            self.close()
            raise

    @property
    def ingest(self) -> str:
        return self.endpoints["ingest"]

    def close(self) -> None:
        if self.web is not None:
            self.web.stop()
        self.broker.stop()


def http_get(port: int, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def http_json(port: int, path: str) -> Any:
    status, body = http_get(port, path)
    if status != 200:
        raise ValueError(f"GET {path}: {status}")
    return json.loads(body)


class SseReader:
    """A minimal SSE client on a raw socket: blocking reads, events split on blank lines.

    Cheap on purpose (one ``recv`` per readiness, a byte search per event) so that it is not
    what a latency figure measures. ``on_event(kind, id, data_bytes, t)`` gets each event with
    the monotonic time its last byte was read.
    """

    def __init__(self, port: int, run: str, last_event_id: Optional[int] = None,
                 timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        headers = f"GET /api/runs/{run}/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
        if last_event_id is not None:
            headers += f"Last-Event-ID: {last_event_id}\r\n"
        self.sock.sendall((headers + "\r\n").encode())
        self.buf = b""
        self.chunked = False
        self._raw = b""
        self._read_headers()

    def _read_headers(self) -> None:
        while b"\r\n\r\n" not in self._raw:
            data = self.sock.recv(65536)
            if not data:
                raise OSError("closed before headers")
            self._raw += data
        head, _, rest = self._raw.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise OSError(f"bad response: {head[:200]!r}")
        self.chunked = b"transfer-encoding: chunked" in head.lower()
        self._raw = rest
        self._feed()

    def _feed(self) -> None:
        """Move de-chunked bytes from ``_raw`` to ``buf``."""
        if not self.chunked:
            self.buf += self._raw
            self._raw = b""
            return
        raw = self._raw
        pos = 0
        parts = []
        while True:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";")[0], 16)
            if len(raw) < eol + 2 + size + 2:
                break
            parts.append(raw[eol + 2:eol + 2 + size])
            pos = eol + 2 + size + 2
        self._raw = raw[pos:]
        self.buf += b"".join(parts)

    def events(self) -> Any:
        """Yield ``(kind, id, data, t)`` forever (until the socket closes)."""
        while True:
            while True:
                end = self.buf.find(b"\n\n")
                if end < 0:
                    break
                block, self.buf = self.buf[:end], self.buf[end + 2:]
                t = time.monotonic()
                kind = b"message"
                ident = None
                data = []
                for line in block.split(b"\n"):
                    if line.startswith(b"event: "):
                        kind = line[7:]
                    elif line.startswith(b"id: "):
                        ident = int(line[4:])
                    elif line.startswith(b"data: "):
                        data.append(line[6:])
                if data or kind != b"message":
                    yield kind.decode(), ident, b"\n".join(data), t
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return
            self._raw += chunk
            self._feed()

    def close(self) -> None:
        self.sock.close()


def machine() -> dict[str, Any]:
    """What BENCHMARKS.md records about the machine."""
    import platform

    import zmq

    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu": model,
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------ sender processes


def _push(endpoint: str, frames_for: Callable[[int, int], list[bytes]], sender: int, size: int,
          ready: Any, go: Any) -> None:
    """A sender process: build its frames first (so encoding is not timed), connect, say
    ready, then push everything at ``go`` and deliver it all before exiting."""
    import zmq

    frames = frames_for(sender, size)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.sndhwm = 10_000
    sock.connect(endpoint)
    ready.release()
    go.wait()
    send = sock.send
    for f in frames:
        send(f)
    sock.close(linger=-1)  # deliver everything
    ctx.term()


class Senders:
    """``n`` spawned processes pushing ``frames_for(i, size)`` (a picklable module-level
    function, or a ``functools.partial`` of one) to ``endpoint``, all released at once by
    :meth:`start`, so a receiver's clock covers the same sender start-up in every run."""

    def __init__(self, endpoint: str, frames_for: Callable[[int, int], list[bytes]], n: int,
                 size: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()
        self.procs = [ctx.Process(target=_push, args=(endpoint, frames_for, i, size, self.ready,
                                                      self.go), daemon=True)
                      for i in range(n)]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            if not self.ready.acquire(timeout=120):
                raise RuntimeError("a sender did not start")

    def start(self) -> float:
        """Release the senders; returns the ``perf_counter`` time they were released."""
        t0 = time.perf_counter()
        self.go.set()
        return t0

    def join(self) -> None:
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def pull_rate(senders: Callable[[str], Senders], total: int, decode: bool = False,
              cpu: Optional[dict[str, float]] = None,
              handle: Optional[Callable[[bytes], object]] = None) -> float:
    """Frames/s of a bare PULL loop in this process receiving ``total`` frames from the
    senders ``senders(endpoint)`` starts; with ``decode`` it also runs ``protocol.decode``
    on each (the floor of any broker that validates what it receives). ``cpu``, if given,
    gets ``"per_frame"``: the loop thread's CPU seconds per frame (``time.thread_time``:
    what the floor costs, whatever else the machine runs). ``handle``, if given, is called
    with each frame instead (``bench/frame_instructions.py rate``: a broker's rules written
    as one function, over the floor's sockets and senders)."""
    import zmq

    from rank_agent import protocol

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    sock.rcvhwm = 100_000
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        pool = senders(f"tcp://127.0.0.1:{port}")
        recv = sock.recv
        c0 = time.thread_time()
        t0 = pool.start()
        if handle is not None:
            for _ in range(total):
                handle(recv())
        elif decode:
            dec = protocol.decode
            for _ in range(total):
                dec(recv())
        else:
            for _ in range(total):
                recv()
        dt = time.perf_counter() - t0
        if cpu is not None:
            cpu["per_frame"] = (time.thread_time() - c0) / total
        pool.join()
    finally:
        sock.close(0)
        ctx.term()
    return total / dt
