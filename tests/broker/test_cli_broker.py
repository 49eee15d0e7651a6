"""``rankboard broker`` in real subprocesses (``python -m rankboard``), and the parser."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from rankboard import cli

ROOT = Path(__file__).resolve().parents[2]
ANY = "tcp://127.0.0.1:*"
BOUND = re.compile(r"broker (ingest|publish|snapshot) bound at (tcp://127\.0\.0\.1:\d+)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def rankboard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankboard", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


class Broker:
    """A ``rankboard broker`` child whose stderr is read line by line in a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankboard", "broker", *args], cwd=ROOT, env=_env(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_bound(self, timeout: float = 30.0) -> dict[str, str]:
        found: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while len(found) < 3:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"broker did not log its addresses; saw {self.seen}")
            if line is None:
                pytest.fail(f"broker exited: {self.seen}")
            self.seen.append(line)
            m = BOUND.search(line)
            if m:
                found[m.group(1)] = m.group(2)
        return found

    def rest(self) -> list[str]:
        self._reader.join(10)
        while True:
            line = self.lines.get_nowait() if not self.lines.empty() else None
            if line is None:
                return self.seen
            self.seen.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def spawn() -> Iterator[list[Broker]]:
    procs: list[Broker] = []
    yield procs
    for p in procs:
        p.kill()


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("argv, needle", [
    (["broker", "--bogus"], "unknown flag --bogus; see rankboard broker --help"),
    (["broker", "--max-runs", "0"], "--max-runs"),
    (["broker", "--stale-after", "soon"], "--stale-after"),
    (["broker", "--stale-after", "-1"], "--stale-after"),
    (["broker", "--ingest", "127.0.0.1:5585"], "not a ZeroMQ endpoint"),
    (["broker", "--curve-secret-key", "k"], "go together"),
    (["web", "--port", "70000"], "--port"),
    (["broker", "--shard", "2/2"], "K must be 0..1"),
    (["broker", "--shard", "1"], "expected K/N"),
    (["broker", "--shard", "0/0"], "N must be >= 1"),
    (["broker", "--shard", "0/" + "9" * 400], "N must be 1..1024"),  # (issue 38)
    (["broker", "--shard", "0/\u00b2"], "expected K/N"),
    (["nonsense"], "invalid choice"),
    ([], "required"),
])
def test_bad_flags_exit_2_with_one_line(argv: list[str], needle: str) -> None:
    result = rankboard(*argv)
    assert result.returncode == 2
    line = _one_line_error(result)
    assert line.startswith("rankboard") and needle in line


def test_address_in_use_is_one_line_and_exit_1(tmp_path: Path) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PULL)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        result = rankboard("broker", "--ingest", f"tcp://127.0.0.1:{port}", "--publish", ANY,
                           "--snapshot", ANY, "--data-dir", str(tmp_path))
    finally:
        taken.close(linger=0)
        ctx.term()
    assert result.returncode == 1
    assert _one_line_error(result).startswith(
        f"rankboard broker: cannot bind tcp://127.0.0.1:{port}: the ingest port {port} is "
        "already in use")


def test_unusable_data_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = rankboard("broker", "--ingest", ANY, "--publish", ANY, "--snapshot", ANY,
                       "--data-dir", str(blocker / "sub"))
    assert result.returncode == 2  # a usage error, found before anything binds
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("rankboard broker: ")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_good_start_logs_addresses_and_signal_exits_0(
        sig: signal.Signals, tmp_path: Path, spawn: list[Broker]) -> None:
    b = Broker("--ingest", ANY, "--publish", ANY, "--snapshot", ANY,
               "--data-dir", str(tmp_path))
    spawn.append(b)
    eps = b.wait_bound()
    assert set(eps) == {"ingest", "publish", "snapshot"}
    # it really serves: a snapshot request is answered
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(eps["snapshot"])
        dealer.send_multipart([b"SNAP"])
        assert dealer.poll(10_000), "no snapshot reply"
        assert dealer.recv_multipart()[0] == b"END"
    finally:
        dealer.close(linger=0)
        ctx.term()
    b.proc.send_signal(sig)
    assert b.proc.wait(15) == 0
    rest = b.rest()
    assert not any("Traceback" in line for line in rest), rest


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert cli.default_data_dir() == tmp_path / "rankboard"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli.default_data_dir() == tmp_path / ".local" / "state" / "rankboard"


def test_parser_defaults_per_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKBOARD_TOKEN", "s3cret")
    p = cli.build_parser()
    b = p.parse_args(["broker"])
    assert (b.ingest, b.publish, b.snapshot) == (
        "tcp://127.0.0.1:5585", "tcp://127.0.0.1:5586", "tcp://127.0.0.1:5587")
    assert (b.stale_after, b.max_runs, b.data_dir) == (30.0, 1000, None)
    w = p.parse_args(["web"])
    assert (w.host, w.port, w.token, w.insecure_no_auth) == ("127.0.0.1", 8585, "s3cret", False)
    u = p.parse_args(["up"])
    assert u.port is None and u.ingest == "tcp://127.0.0.1:5585" and u.token == "s3cret"
    d = p.parse_args(["demo"])
    assert (d.port, d.ranks, d.hosts, d.epochs, d.epoch_seconds) == (8585, 8, 2, 20, 2.0)
    k = p.parse_args(["keys", "somewhere"])
    assert k.dir == Path("somewhere")


def test_sigkill_restart_on_same_data_dir_keeps_records_and_raises_ids(
        tmp_path: Path, spawn: list[Broker]) -> None:
    from broker import feed
    from tests.support.brokers import FeedClient
    from tests.support.frames import enc, metrics, register

    n = 1500  # one batch can hold more events than half a journal seq block
    b = Broker("--ingest", ANY, "--publish", ANY, "--snapshot", ANY, "--data-dir", str(tmp_path))
    spawn.append(b)
    eps = b.wait_bound()
    ctx = zmq.Context()
    client = FeedClient(ctx, eps["publish"], eps["snapshot"])
    push = ctx.socket(zmq.PUSH)
    try:
        client.until(lambda u: True, what="subscription live")
        push.linger = 0
        push.sndhwm = 0
        push.connect(eps["ingest"])
        frames = [enc(register(run="k"))] + [enc(metrics(run="k", epoch=e)) for e in range(n)]
        for raw in frames:
            push.send(raw)
        events = client.events("k", until=lambda u: u.kind == "epoch" and u.data["epoch"] == n - 1,
                               timeout=60)
        issued = max(u.seq for u in events)
        b.proc.kill()
        b.proc.wait(10)

        again = Broker("--ingest", ANY, "--publish", ANY, "--snapshot", ANY,
                       "--data-dir", str(tmp_path))
        spawn.append(again)
        eps2 = again.wait_bound()
        client2 = FeedClient(ctx, eps2["publish"], eps2["snapshot"])
        try:
            [snap], _ = client2.snapshot("k")
            assert [rec["epoch"] for _, rec in snap["records"]] == list(range(n))
            assert snap["seq"] > issued
            hb = client2.until(lambda u: isinstance(u, feed.Heartbeat), what="heartbeat")[0]
            assert hb.runs == 1
        finally:
            client2.close()
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(15) == 0
    finally:
        push.close(linger=0)
        client.close()
        ctx.term()


def burst(pid: int, n: int = 300) -> int:
    """Send ``n`` SIGTERM and SIGINT, alternated, as fast as possible (systemd and
    Kubernetes repeat SIGTERM; Ctrl-C reaches a process group); returns how many were
    sent before the process was gone."""
    for i in range(n):
        try:
            os.kill(pid, signal.SIGTERM if i % 2 else signal.SIGINT)
        except ProcessLookupError:
            return i
    return n


def test_a_burst_of_signals_stops_the_broker_cleanly_and_promptly(
        tmp_path: Path, spawn: list[Broker]) -> None:
    """Issue 27: the handler called ``threading.Event.set``, whose lock a second signal
    could re-enter: the broker hung until SIGKILL. The handler now only sets an attribute;
    a burst must end in exit 0, within seconds, with no traceback."""
    b = Broker("--ingest", ANY, "--publish", ANY, "--snapshot", ANY, "--data-dir", str(tmp_path))
    spawn.append(b)
    b.wait_bound()
    started = time.monotonic()
    sent = burst(b.proc.pid)
    assert b.proc.wait(15) == 0
    assert time.monotonic() - started < 10
    assert sent > 1
    rest = b.rest()
    assert not any("Traceback" in line for line in rest), rest
